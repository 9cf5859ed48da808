"""Checking a session's steps: each checked step's output is compared with a replay of the span before the client
takes it (docs/sessions.md, "Checked steps").

A span's worker keeps state the client never sees, so a step cannot be recomputed alone: a check replays the span's
inputs (which the client keeps anyway, to move a span) from the session's first step. The replay runs beside the
worker and is kept going, so checking every step costs one more run of the span, not one per step:

* ``verify="local-sample"``: the client replays the span itself (:class:`LocalReplay`, the worker's own interpreter,
  in a thread, alongside the network step). Nothing another worker says is trusted.
* ``verify="adaptive"``: a checker worker drawn at random (``Router.choose_checker``: not by price or claimed speed)
  holds a shadow session of the span (:class:`CheckerReplay`) and takes each checked step alongside the worker. When
  the two disagree, the client's own replay decides; if this machine cannot run the span, an established checker's
  word stands, a newcomer's does not (the step then fails unresolved, and nobody is branded).

Which steps are checked is the adaptive schedule of plain jobs (``Reputation.should_check``): every step of a worker
without a history of checked results, then fewer. A caught step is never returned: the client returns the replay's
output instead, refuses the worker's receipt, records it as rejected and moves the span. If the worker's earlier
steps on that span went unchecked, their outputs (already returned) may be wrong too: the step raises
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
from gpunet.ledger.tabs import Tab

if TYPE_CHECKING:
    from gpunet.client.routing import Requirements
    from gpunet.client.sequential import Span

logger = logging.getLogger("gpunet.client")


class LocalReplay:
    """The span run here, step after step, from its first state: the truth a worker's outputs are checked against.
    Call :meth:`output_at` off the event loop (it computes); a lock keeps two calls from sharing the state."""

    def __init__(self, span: "Span"):
        self.span = span
        self.state: tuple[torch.Tensor, ...] = span.state
        self.next = 0  # the step the state is ready for
        self._lock = threading.Lock()

    def output_at(self, step: int, history: Sequence[torch.Tensor]) -> torch.Tensor:
        """The span's output at ``step`` (``history[k]``: its input at step k), replaying from the first step if
        the state is past it."""
        with self._lock:
            if step < self.next:
                self.state, self.next = self.span.state, 0
            out = None
            while self.next <= step:
                y, *state = self.span.job.run_locally(history[self.next], *self.state)
                self.state, self.next, out = tuple(state), self.next + 1, y
            return out


@dataclass
class CheckerReplay:
    """A shadow session of one span on a checker worker: the same inputs, step after step; dropped (and replayed from
    the first step on another checker) when it fails, or when the client finds it lying."""

    core: Any  # gpunet.client.core.ClientCore
    span: "Span"
    requirements: "Requirements"
    ttl: float
    on_receipt: Callable[[Any], None]
    worker_id: str | None = None
    session_id: str = ""
    next: int = 0
    tab: Tab = field(default_factory=Tab)
    _closing: set[asyncio.Future] = field(default_factory=set)

    async def output_at(self, step: int, history: Sequence[torch.Tensor], exclude: set[str]) -> torch.Tensor:
        if self.worker_id is not None and (step < self.next or self.worker_id in exclude):
            self.drop(pay=True)
        if self.worker_id is None:
            checker = self.core.router.choose_checker(self.requirements, exclude=exclude)
            self.worker_id, self.session_id, self.next, self.tab = checker.id, secrets.token_urlsafe(12)[:16], 0, Tab()
        try:
            out = None
            while self.next <= step:
                message = protocol.SessionStep(self.session_id, self.next, fresh=self.span.fresh, ttl=self.ttl)
                result = await self.core.run_step(self.span.job, (history[self.next],), self.worker_id, message,
                                                  self.span.state, self.tab, self.requirements)
                self.next, out = self.next + 1, result.outputs[0]
                if result.receipt is not None:
                    self.on_receipt(result.receipt)
            return out
        except BaseException:  # failed or cancelled part of the way: its state is unknown, so it is not used again
            self.drop(pay=True)
            raise

    def drop(self, pay: bool) -> None:
        """Leave this checker: its session is closed in the background, its steps paid if ``pay`` (not when it lied)."""
        if self.worker_id is None:
            return
        worker_id, session_id, tab = self.worker_id, self.session_id, self.tab if pay else None
        self.worker_id, self.tab = None, Tab()

        async def close() -> None:
            try:
                async with asyncio.timeout(15.0):
                    receipt = await self.core.close_session(worker_id, session_id, tab)
            except (TimeoutError, GpunetError):
                return
            if receipt is not None:
                self.on_receipt(receipt)

        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self.drop(pay=True)
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class Caught(Exception):
    """A checked step's output was wrong: ``truth`` is the right one; ``suspect`` counts the worker's earlier outputs
    on this span that went out unchecked (and may be wrong too)."""

    def __init__(self, error: VerificationFailed, truth: torch.Tensor, suspect: int):
        super().__init__(str(error))
        self.error, self.truth, self.suspect = error, truth, suspect


@dataclass
class SpanChecks:
    """The checks of one span of a session: the replays, and how many of the worker's outputs went out unchecked."""

    mode: str  # "adaptive" | "local-sample"
    local: LocalReplay
    checker: CheckerReplay | None
    unchecked: int = 0  # live outputs of the span's current worker returned since its last checked step


@dataclass
class Tally:
    """What the checks of a session found (``Session.checks``)."""

    checked: int = 0  # span steps compared with a replay, and found right
    unchecked: int = 0  # span steps returned without a check (the schedule skipped them, or no replay could run)
    caught: list[str] = field(default_factory=list)  # workers whose output was wrong (each time one was caught)


class SessionChecks:
    """Decides for each live step of each span whether it is checked, replays, compares and rules (module doc)."""

    def __init__(self, core: Any, spans: Sequence["Span"], mode: str, requirements_for, ttl: float,
                 on_receipt: Callable[[Any], None]):
        self.core, self.mode = core, mode
        self.reputation = core.reputation
        self.tally = Tally()
        self.spans = [
            SpanChecks(mode, LocalReplay(span),
                       CheckerReplay(core, span, requirements_for(span), ttl, on_receipt) if mode == "adaptive"
                       else None) if span.stateful else None
            for span in spans]

    def due(self, i: int, worker_id: str) -> bool:
        return self.spans[i] is not None and self.reputation.should_check(worker_id)

    def replay(self, i: int, step: int, history: Sequence[torch.Tensor], exclude: set[str]) -> asyncio.Future:
        """Start computing span ``i``'s output at ``step`` (beside the worker's step)."""
        checks = self.spans[i]
        history = list(history[:step + 1])
        if checks.checker is not None:
            return asyncio.ensure_future(checks.checker.output_at(step, history, exclude))
        return asyncio.ensure_future(asyncio.to_thread(checks.local.output_at, step, history))

    def skipped(self, i: int) -> None:
        if self.spans[i] is not None:
            self.spans[i].unchecked += 1
            self.tally.unchecked += 1

    async def judge(self, i: int, span_name: str, worker_id: str, step: int, output: torch.Tensor,
                    replay: asyncio.Future, history: Sequence[torch.Tensor]) -> None:
        """Compare the worker's ``output`` with the replay's; returns if it is right (or cannot be checked), raises
        :class:`Caught` if it is wrong, VerificationFailed if the client cannot tell who is."""
        checks = self.spans[i]
        checker = checks.checker.worker_id if checks.checker is not None else None
        try:
            truth = await replay
        except (GpunetError, TimeoutError, MemoryError) as e:
            if checks.checker is None:
                return self._unchecked(i, step, worker_id, f"this machine could not replay the span: {e or 'timed out'}")
            logger.info("The checker of span %s failed (%s); this client replays the step itself", span_name, e)
            truth, checker = await self._own(checks, step, history), None
            if truth is None:
                return self._unchecked(i, step, worker_id, "neither a checker nor this machine could replay the span")
        if agree(output, truth):
            self.reputation.record(worker_id, "valid", checked=True)
            self.tally.checked += 1
            checks.unchecked = 0
            return
        if checker is not None:  # a worker's word against a worker's: this client's own replay decides
            own = await self._own(checks, step, history)
            if own is not None and agree(output, own):
                logger.warning("Checker %s of span %s returned a wrong output at step %d; it is not used again",
                               checker[-8:], span_name, step)
                self.reputation.record(checker, "rejected")
                self.tally.caught.append(checker)
                checks.checker.drop(pay=False)
                self.tally.checked += 1
                return
            if own is not None:
                truth = own
            elif not self.reputation.established(checker):
                checks.checker.drop(pay=True)
                raise VerificationFailed(
                    f"span {span_name}: worker {worker_id[-8:]} and checker {checker[-8:]} disagree at step {step}, "
                    "this machine could not replay the span to tell which is right, and the checker has no record "
                    "with this client yet; open a new session")
        self.reputation.record(worker_id, "rejected")
        self.reputation.save()
        self.tally.caught.append(worker_id)
        suspect, checks.unchecked = checks.unchecked, 0
        raise Caught(VerificationFailed(
            f"span {span_name}: worker {worker_id[-8:]} returned a wrong output at step {step} (a replay of the span "
            f"disagrees); it is not paid, and the span moves" + (
                f"; its {suspect} earlier output(s) on this span went out unchecked and may be wrong too: this session "
                "ends (open a new one)" if suspect else "")), truth, suspect)

    async def _own(self, checks: SpanChecks, step: int, history: Sequence[torch.Tensor]) -> torch.Tensor | None:
        try:
            return await asyncio.to_thread(checks.local.output_at, step, list(history[:step + 1]))
        except (GpunetError, MemoryError) as e:
            logger.warning("This machine could not replay the span to settle a check (%s)", e)
            return None

    def _unchecked(self, i: int, step: int, worker_id: str, why: str) -> None:
        logger.warning("Step %d of worker %s is returned unchecked: %s", step, worker_id[-8:], why)
        self.skipped(i)

    async def close(self) -> None:
        for checks in self.spans:
            if checks is not None and checks.checker is not None:
                await checks.checker.close()
