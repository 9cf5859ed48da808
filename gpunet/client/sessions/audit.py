"""Checking a session's steps: each checked step's output is compared with a replay of the span before the client
takes it (docs/sessions.md, "Checked steps").

A span's worker keeps state the client never sees, so a step cannot be recomputed alone: a check replays the span's
inputs (which the client keeps anyway, to move a span) from the session's first step. The replay runs beside the
worker and is kept going, so checking every step costs one more run of the span, not one per step:

* ``verify="local-sample"``: the client replays the span itself (:class:`LocalReplay`, the worker's own interpreter,
  in a thread, alongside the network step). Nothing another worker says is trusted.
* ``verify="adaptive"``: a checker worker drawn at random (``Router.choose_checker``: not by price or claimed speed,
  and from another network origin where there is one) holds a shadow session of the span (:class:`CheckerReplay`)
  and takes each checked step alongside the worker. When the two disagree, the client's own replay decides; if this
  machine cannot run the span, one worker's word against another's decides nothing: the step fails unresolved
  (VerificationFailed), nobody is branded and neither is paid for it.

Which steps are checked is the adaptive schedule of plain jobs (``Reputation.should_check``): every step of a worker
without a history of checked results, then fewer; and always a step that carries a receipt, so no tab is paid for
outputs nobody compared. The outputs returned unchecked wait (at most a tab's worth); the next check's replay passes
through their steps anyway and compares them too. A wrong output caught at the step that gave it is never returned:
the replay's output is, the worker's receipt is refused, it is recorded as rejected, the session uses it no more and
the span moves. A wrong output found among those already returned cannot be taken back: the step raises
VerificationFailed and the session ends.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from gpunet import protocol
from gpunet.client.trust import agree
from gpunet.errors import GpunetError, VerificationFailed
from gpunet.ledger.receipts import price_to_nano
from gpunet.ledger.tabs import Tab

if TYPE_CHECKING:
    from gpunet.client.routing import Requirements
    from gpunet.client.sessions.spans import Span

logger = logging.getLogger("gpunet.client")


def _can_answer(kept: dict[int, torch.Tensor], first: int, last: int, ready_for: int) -> bool:
    """Whether a replay whose state is ready for step ``ready_for`` can give steps ``first``..``last`` without starting
    over: every one of them it has passed is among its ``kept`` outputs."""
    return all(k in kept for k in range(first, min(last + 1, ready_for)))


def _answer(kept: dict[int, torch.Tensor], first: int, last: int) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """The outputs at ``first``..``last``, and what stays kept: those from ``first`` on (a retried step may ask again)."""
    return [kept[k] for k in range(first, last + 1)], {k: v for k, v in kept.items() if k >= first}


class LocalReplay:
    """The span run here, step after step, from its first state: the truth a worker's outputs are checked against.
    Call :meth:`outputs` off the event loop (it computes); a lock keeps two calls from sharing the state."""

    def __init__(self, span: "Span"):
        self.span = span
        self.state: tuple[torch.Tensor, ...] = span.state
        self.next = 0  # the step the state is ready for
        self.kept: dict[int, torch.Tensor] = {}  # outputs computed and not yet asked for
        self._lock = threading.Lock()

    def outputs(self, first: int, last: int, history: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The span's outputs at steps ``first``..``last`` (``history[k]``: its input at step k), replaying from the
        first step only if the state has passed ``first`` and the outputs are not kept."""
        with self._lock:
            if not _can_answer(self.kept, first, last, self.next):
                self.state, self.next, self.kept = self.span.state, 0, {}
            while self.next <= last:
                y, *state = self.span.job.run_locally(history[self.next], *self.state)
                if self.next >= first:
                    self.kept[self.next] = y
                self.state, self.next = tuple(state), self.next + 1
            out, self.kept = _answer(self.kept, first, last)
            return out


@dataclass
class CheckerReplay:
    """A shadow session of one span on a checker worker: the same inputs, step after step; dropped (and replayed from
    the first step on another checker) when it fails, or when the client finds it lying. One call at a time."""

    core: Any  # gpunet.client.core.ClientCore (above this package: not imported)
    span: "Span"
    requirements: "Requirements"
    ttl: float
    on_receipt: Callable[[Any], None]
    worker_id: str | None = None
    session_id: str = ""
    next: int = 0
    tab: Tab = field(default_factory=Tab)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _closing: set[asyncio.Future] = field(default_factory=set)

    async def outputs(self, first: int, last: int, history: Sequence[torch.Tensor], exclude: set[str],
                      beside: set[str]) -> list[torch.Tensor]:
        """Like :meth:`LocalReplay.outputs`, on the checker; ``exclude``: workers that may not check (the one checked,
        those caught), ``beside``: workers it should not share a network origin with."""
        async with self._lock:
            if self.worker_id is not None and (self.worker_id in exclude
                                               or not _can_answer(self.kept, first, last, self.next)):
                self.drop(pay=True)
            if self.worker_id is None:
                checker = self.core.router.choose_checker(self.requirements, exclude=exclude, replicas=beside)
                self.worker_id, self.session_id = checker.id, secrets.token_urlsafe(12)[:16]
                self.next, self.tab, self.kept = 0, Tab(), {}
            try:
                while self.next <= last:
                    message = protocol.SessionStep(self.session_id, self.next, fresh=self.span.fresh, ttl=self.ttl)
                    result = await self.core.run_step(self.span.job, (history[self.next],), self.worker_id, message,
                                                      self.span.state, self.tab, self.requirements)
                    if self.next >= first:
                        self.kept[self.next] = result.outputs[0]
                    self.next += 1
                    if result.receipt is not None:
                        self.on_receipt(result.receipt)
            except BaseException:  # failed or cancelled part of the way: its state is unknown, so it is not used again
                self.drop(pay=True)
                raise
            out, self.kept = _answer(self.kept, first, last)
            return out

    def drop(self, pay: bool) -> None:
        """Leave this checker: its session is closed in the background, its steps paid if ``pay`` (not when it lied
        or a dispute with it stayed unresolved)."""
        if self.worker_id is None:
            return
        worker_id, session_id, tab = self.worker_id, self.session_id, self.tab if pay else None
        bound = self.requirements.max_price  # the bound its steps were sent with: the tab is signed under it
        max_price = price_to_nano(bound) if bound is not None else None
        self.worker_id, self.tab, self.kept = None, Tab(), {}

        async def close() -> None:
            try:
                async with asyncio.timeout(15.0):
                    receipt = await self.core.close_session(worker_id, session_id, tab, max_price)
            except (TimeoutError, GpunetError):
                return
            if receipt is not None:
                self.on_receipt(receipt)

        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        async with self._lock:
            self.drop(pay=True)
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class Caught(Exception):
    """The output of the step just taken was wrong (and none returned before it): ``truth`` is the right one."""

    def __init__(self, error: VerificationFailed, truth: torch.Tensor):
        super().__init__(str(error))
        self.error, self.truth = error, truth


@dataclass
class SpanChecks:
    """The checks of one span of a session: the replays, and the outputs returned but not compared yet."""

    local: LocalReplay
    checker: CheckerReplay | None
    pending: list[tuple[int, torch.Tensor, str]] = field(default_factory=list)  # (step, output, worker), in order


@dataclass
class CheckReport:
    """What the checks of a session found (``Session.checks``)."""

    checked: int = 0  # span steps whose output was compared with a replay, and found right
    unchecked: int = 0  # span steps returned and never compared (no replay could run, or the session ended first)
    caught: list[str] = field(default_factory=list)  # workers found returning a wrong output (once each time)


#: What a replay on this machine may raise besides being cancelled: the span does not run here (memory, an op this
#: torch lacks), which is not the worker's fault.
_CANNOT_REPLAY = (Exception,)


class SessionChecks:
    """Decides which live steps of each span are checked, replays, compares and rules (module doc)."""

    def __init__(self, core: Any, spans: Sequence["Span"], mode: str, requirements_for, ttl: float,
                 on_receipt: Callable[[Any], None]):
        self.reputation = core.reputation
        self.report = CheckReport()
        self.banned: set[str] = set()  # caught in this session: never used again by it, for any span or check
        self.spans = [
            SpanChecks(LocalReplay(span),
                       CheckerReplay(core, span, requirements_for(span), ttl, on_receipt) if mode == "adaptive"
                       else None) if span.stateful else None
            for span in spans]

    def due(self, i: int, worker_id: str) -> bool:
        return self.spans[i] is not None and self.reputation.should_check(worker_id)

    def replay(self, i: int, step: int, history: Sequence[torch.Tensor], worker_id: str) -> asyncio.Future:
        """Start computing span ``i``'s outputs from its first uncompared step to ``step`` (beside the worker's)."""
        checks = self.spans[i]
        first = checks.pending[0][0] if checks.pending else step
        history = list(history[:step + 1])
        if checks.checker is not None:
            future = asyncio.ensure_future(checks.checker.outputs(
                first, step, history, exclude={worker_id, *self.banned}, beside={worker_id}))
        else:
            future = asyncio.ensure_future(asyncio.to_thread(checks.local.outputs, first, step, history))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # an unused one's failure is not news
        return future

    async def settle(self, i: int, span_name: str, worker_id: str, step: int, output: torch.Tensor,
                     replay: asyncio.Future | None, history: Sequence[torch.Tensor], billed: bool) -> None:
        """The step's ``output`` joins the span's uncompared ones; if a replay was started (the step was due), or the
        step carries a receipt (``billed``: nothing is paid uncompared), they are all compared now. Returns if all
        are right; raises :class:`Caught` if only this one is wrong, VerificationFailed if one already returned is
        (or the client cannot tell who is right)."""
        checks = self.spans[i]
        checks.pending.append((step, output, worker_id))
        if replay is None and not billed:
            return
        if replay is None:
            replay = self.replay(i, step, history, worker_id)
        first = checks.pending[0][0]
        checker = checks.checker.worker_id if checks.checker is not None else None
        try:
            truth = await replay
        except asyncio.CancelledError:
            raise
        except _CANNOT_REPLAY as e:
            if checks.checker is None:
                return self._unchecked(checks, f"this machine could not replay the span: {e or type(e).__name__}")
            logger.info("The checker of span %s failed (%s); this client replays the steps itself", span_name,
                        e or type(e).__name__)
            truth, checker = await self._own(checks, first, step, history), None
            if truth is None:
                return self._unchecked(checks, "neither a checker nor this machine could replay the span")
        if checker is not None and not all(agree(out, t) for (_, out, _), t in zip(checks.pending, truth)):
            # One worker's word against another's: this client's own replay decides, or nothing does.
            own = await self._own(checks, first, step, history)
            if own is None:
                checks.checker.drop(pay=False)
                checks.pending.clear()
                raise VerificationFailed(
                    f"span {span_name}: worker {worker_id[-8:]} and checker {checker[-8:]} disagree between steps "
                    f"{first} and {step}, and this machine could not replay the span to tell which is right; neither "
                    "is paid for it and nobody is branded. Open a new session")
            if not all(agree(t, o) for t, o in zip(truth, own)):
                self._convict(checker, f"checker of span {span_name}")
                checks.checker.drop(pay=False)
            truth = own
        wrong = [(k, w) for (k, out, w), t in zip(checks.pending, truth) if not agree(out, t)]
        for k, out, w in checks.pending:
            if (k, w) not in wrong:
                self.reputation.record(w, "valid", checked=True)
                self.report.checked += 1
        checks.pending.clear()
        if not wrong:
            return
        for w in dict.fromkeys(w for _, w in wrong):
            self._convict(w, f"worker of span {span_name}")
        self.reputation.save()
        steps = ", ".join(str(k) for k, _ in wrong)
        if wrong == [(step, worker_id)]:  # only the output not returned yet: the replay's stands in for it
            raise Caught(VerificationFailed(
                f"span {span_name}: worker {worker_id[-8:]} returned a wrong output at step {step} (a replay of the "
                "span disagrees); the replay's output is used, the worker is not paid and the span moves"),
                truth[-1])
        raise VerificationFailed(
            f"span {span_name}: wrong output(s) at step(s) {steps} from worker(s) "
            f"{', '.join(w[-8:] for w in dict.fromkeys(w for _, w in wrong))} (a replay of the span disagrees); "
            "outputs already returned were wrong, so this session ends: open a new one (those workers are not used "
            "by it again, and are not paid for the steps not billed yet)")

    def _convict(self, worker_id: str, role: str) -> None:
        logger.warning("The %s, %s, returned a wrong output; it is recorded as rejected and not used again by this "
                       "session", role, worker_id[-8:])
        self.reputation.record(worker_id, "rejected")
        self.report.caught.append(worker_id)
        self.banned.add(worker_id)

    async def _own(self, checks: SpanChecks, first: int, last: int,
                   history: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        try:
            return await asyncio.to_thread(checks.local.outputs, first, last, list(history[:last + 1]))
        except asyncio.CancelledError:
            raise
        except _CANNOT_REPLAY as e:
            logger.warning("This machine could not replay the span to settle a check (%s)", e or type(e).__name__)
            return None

    def _unchecked(self, checks: SpanChecks, why: str) -> None:
        """No replay could run: the outputs waiting are let go uncompared (and a receipt for them is paid)."""
        logger.warning("%d session output(s) returned unchecked: %s", len(checks.pending), why)
        self.report.unchecked += len(checks.pending)
        checks.pending.clear()

    async def flush(self, i: int, span_name: str, history: Sequence[torch.Tensor]) -> None:
        """Compare the outputs still waiting (the session is closing, and the tab they are on is paid at close):
        returns if they are right, raises VerificationFailed otherwise (their workers are then banned)."""
        checks = self.spans[i]
        if checks is None or not checks.pending:
            return
        step, output, worker_id = checks.pending.pop()
        try:
            await self.settle(i, span_name, worker_id, step, output, None, history, billed=True)
        except Caught as caught:
            raise caught.error from None

    async def close(self) -> None:
        for checks in self.spans:
            if checks is not None:
                self.report.unchecked += len(checks.pending)
                checks.pending.clear()
                if checks.checker is not None:
                    await checks.checker.close()
