"""A model spread over several workers, Petals-style, with inference sessions whose state stays on the workers.

``client.sequential(blocks, example_inputs=...)`` cuts a list of blocks (a transformer's layers) into contiguous
spans, traces each span into one safe job, and runs a forward pass span after span, each on a worker chosen by
routing (a span's weights stay resident there and serve every client running the same program hash). A session
pins each span to one worker, which keeps the span's state (KV caches) between steps; if that worker dies, drains or
loses the state, the span moves to another worker, which replays the span's past inputs (kept here) to rebuild the
state exactly, and the session goes on. See docs/sessions.md.

This is the engine (:class:`SequentialCore`, :class:`SessionCore`), async and shared: the handles
(:mod:`gpunet.client.sessions.handles`) run it on a :class:`~gpunet.Client`'s loop, or the caller's. Spans are cut
and traced in :mod:`~gpunet.client.sessions.spans`; checked steps are :mod:`~gpunet.client.sessions.audit`'s.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import weakref
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from gpunet import protocol
from gpunet.client.delivery import PushedInputDiffers
from gpunet.client.routing import Requirements
from gpunet.config import WorkerConfig
from gpunet.client.sessions.audit import Caught, SessionChecks
from gpunet.client.sessions.spans import MEMORY_HEADROOM, Span, block_bytes, block_state, plan_spans, spans_needed, \
    trace_spans, x_meta
from gpunet.errors import (
    GpunetError,
    InvalidReceipt,
    JobFailed,
    JobRaised,
    JobRejected,
    JobTimeout,
    LocalNetworkDown,
    NetworkError,
    NoWorkersAvailable,
    SessionLost,
    UsageError,
    VerificationFailed,
    WorkerDraining,
)
from gpunet.ledger.receipts import Receipt, price_to_nano
from gpunet.ledger.tabs import Tab
from gpunet.utils import sha256_hex

logger = logging.getLogger("gpunet.client")

#: Workers a span may move to within one step before the step fails (each one replays the span's past steps).
MAX_MOVES = 3
#: When every worker seen has failed a span once, how long to look for another before trying those again: on a loaded
#: machine the live workers' records can lapse for a moment while a dead one's has not expired yet (CI saw a span
#: moved three times to a killed worker that way).
OTHERS_WAIT = 10.0
OTHERS_POLL = 0.5
#: How long closing a session on a worker may take (a dead one's steps then stay unpaid: it cannot sign anyway).
CLOSE_TIMEOUT = 15.0
#: A pushed step's answer is awaited this long, plus this many times the mean span's time so far in the step, once the
#: client holds its input; past that its push is taken as lost and the step goes by way of the client.
PUSH_GRACE = 2.0
PUSH_GRACE_SPANS = 4
#: After a pushed step falls back (a push lost, a worker gone), steps go by way of the client for this many steps,
#: doubled at each further fallback: a path where pushes never get through costs a grace wait ever more rarely.
PUSH_RETRY_STEPS = 16


def build(core, blocks: Sequence[torch.nn.Module], example_inputs, dynamic_shapes=None, spans: int | None = None,
          initial_state: Sequence[Any] | None = None, requirements: Requirements | None = None,
          stand_ins=None, rows=None, trace_key=None) -> "SequentialCore":
    """Cut ``blocks`` into spans (``spans`` of them, or as few as the known workers' memory needs) and trace them
    (``stand_ins``: their weights stand for a checkpoint's tensors, see gpunet.job.checkpoints.StandIns; ``rows``:
    the blocks' batch dim; ``trace_key``: see trace_spans)."""
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
        raise UsageError("sequential takes a non-empty list of torch.nn.Module blocks")
    if requirements is not None and requirements.batch:
        raise UsageError("a model over several workers runs in the interactive lane: a batch step could be stopped "
                         "for other work, and its state with it (docs/market.md)")
    if requirements is not None and requirements.redundancy > 1:
        raise UsageError("a model over several workers checks its spans with verify='adaptive' or 'local-sample' "
                         "(each checked step against a replay of the span), not with redundancy: give redundancy=1 "
                         "(docs/sessions.md, checked steps)")
    sizes = [block_bytes(b) + sum(t.numel() * t.element_size()
                                  for t in block_state(b, initial_state[i] if initial_state else None))
             for i, b in enumerate(blocks)]
    if spans is None:
        spans = spans_needed(sizes, [w.record.device.memory_free for w in core.workers()])
    ranges = plan_spans(sizes, spans)
    return SequentialCore(core, trace_spans(blocks, example_inputs, dynamic_shapes, ranges, initial_state,
                                            stand_ins, rows, trace_key), requirements)


class SequentialCore:
    """The async engine behind :class:`RemoteSequential`: spans, where each was placed, and forward passes."""

    def __init__(self, core, spans: list[Span], requirements: Requirements | None = None):
        self.core, self.spans = core, spans
        self.requirements = requirements or Requirements()
        self._needs: dict[int, Requirements] = {}  # by span start: asked at every step
        self._open: weakref.WeakSet[SessionCore] = weakref.WeakSet()  # this model's sessions
        #: Sessions opening at once (a generation's rows, a gateway's requests) wait for the first to pick each
        #: span's worker, and follow it (hosts): see SessionCore._place.
        self.placing = [asyncio.Lock() for _ in spans]

    def hosts(self, i: int, but: "SessionCore") -> list[str]:
        """Where span ``i`` runs for this model's other open sessions, the most first: a worker runs the waiting
        steps of sessions of a batched span as one forward (docs/sessions.md, batching), so a new session's span
        goes there where it can (a gateway's concurrent requests batch with no one doing anything)."""
        manifest = self.spans[i].job.manifest
        if manifest.batch is None:
            return []
        held = Counter(s.placed[i].worker_id for s in list(self._open) if s is not but and not s._closed)
        held.pop(None, None)
        # Up to what a worker holds for one client by default (beyond, a session's first step there is refused
        # and it moves: a cost) and what one forward takes.
        most = min(WorkerConfig.max_sessions_per_client, manifest.dims[manifest.batch].max or 2**31)
        return [w for w, n in held.most_common() if n < most]

    def requirements_for(self, span: Span) -> Requirements:
        """A span needs a worker with room for its weights and state (and some headroom)."""
        need = self._needs.get(span.start)
        if need is None:
            memory = (span.weight_bytes + span.state_bytes) * MEMORY_HEADROOM / 2**30
            need = self._needs[span.start] = replace(self.requirements,
                                                     min_memory_gb=max(self.requirements.min_memory_gb, memory))
        return need

    async def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One stateless pass: each span as a plain job (a stateful span as a one-step session from its first
        state, closed at once)."""
        for i, span in enumerate(self.spans):
            if span.stateful:
                session = SessionCore(self, ttl=60.0)
                try:
                    x = await session.step_span(i, x, close=True)
                finally:
                    await session.close()
            else:
                x = (await self.core.run(span.job, (x,), self.requirements_for(span))).outputs
        return x

    def session(self, ttl: float = 300.0, push: bool = True) -> "SessionCore":
        return SessionCore(self, ttl, push)


@dataclass
class _Placed:
    """One span of a session: where its state lives now, and the inputs it has seen (replayed after a move)."""

    worker_id: str | None = None
    session_id: str = ""
    step: int = 0
    history: list[torch.Tensor] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)  # of ``failed``: answered, and would not take the span (limits)
    workers: list[str] = field(default_factory=list)  # every worker this span has been on, in order
    closed: bool = False
    tab: Tab = field(default_factory=Tab)  # its steps on that worker not billed yet (gpunet.ledger.tabs)


class SessionCore:
    """An inference session: each span's state on one worker between steps; moved, replaying, when that worker is
    lost. Steps run one at a time (each needs the one before)."""

    def __init__(self, seq: SequentialCore, ttl: float = 300.0, push: bool = True):
        if not 0 < ttl <= protocol.MAX_SESSION_TTL:
            raise UsageError(f"a session's ttl is between 0 and {protocol.MAX_SESSION_TTL:.0f} s")
        self.seq, self.ttl = seq, ttl
        seq._open.add(self)
        self.placed = [_Placed() for _ in seq.spans]
        self.receipts: list[Receipt] = []
        self.steps = 0
        self.moves = 0  # spans moved to another worker (their state rebuilt by replay)
        self.pushed = 0  # span steps whose input came straight from the worker before (not by way of this client)
        self._lock = asyncio.Lock()
        self._closed = False
        self._broken: GpunetError | None = None  # a step failed part of the way: the spans disagree on the step
        self._push = push  # steps may go span to span (off once a worker ran a pushed step on another input)
        self._push_from, self._push_backoff = 0, PUSH_RETRY_STEPS  # after a fallback: from which step to try again
        self._handoffs: set[asyncio.Future] = set()  # sessions being closed on workers a span left
        req = seq.requirements
        self.max_price = price_to_nano(req.max_price) if req.max_price is not None else None
        #: verify="adaptive" | "local-sample": live steps checked against a replay of the span (sessions.audit)
        self.checks = (SessionChecks(seq.core, seq.spans, req.verify, seq.requirements_for, ttl, self.receipts.append)
                       if req.verify != "none" else None)

    @property
    def placement(self) -> list[tuple[int, int, str | None]]:
        """(first block, last block + 1, worker id) of each span, where it runs now."""
        return [(s.start, s.stop, p.worker_id) for s, p in zip(self.seq.spans, self.placed)]

    async def step(self, x: torch.Tensor) -> torch.Tensor:
        """Run ``x`` through every span, each on the worker that holds its state; returns the last span's output."""
        if self._closed:
            raise UsageError("this session is closed")
        if self._broken is not None:
            raise UsageError(f"this session failed at step {self.steps} ({self._broken}); open a new one (its spans "
                             "did not all take that step, so it cannot go on)")
        async with self._lock:
            taken = [len(p.history) for p in self.placed]
            try:
                x = await (self._step_pushed(x) if self._pushable() else self._step_from(0, x))
            except BaseException as e:
                # A wrong input (refused here) or the step's own error (JobRaised: its worker's state is as before
                # the step) before any span took the step leaves every span where it was: the session goes on.
                # Anything else may have left spans on different steps.
                untouched = taken == [len(p.history) for p in self.placed] and all(
                    p.worker_id is None or p.step == len(p.history) for p in self.placed)
                # (A checked session's replays took the step beside its worker: the state they hold has moved on.)
                usable = isinstance(e, (UsageError, JobRejected)) or isinstance(e, JobRaised) and self.checks is None
                if not (untouched and usable):
                    self._broken = e if isinstance(e, GpunetError) else GpunetError(type(e).__name__)
                raise
            self.steps += 1
            return x

    async def step_span(self, i: int, x: torch.Tensor, close: bool = False) -> torch.Tensor:
        span, placed = self.seq.spans[i], self.placed[i]
        if not span.stateful:  # nothing to keep: a plain job, routed as any
            return (await self.seq.core.run(span.job, (x,), self.seq.requirements_for(span))).outputs
        from gpunet.job.format import check_inputs

        check_inputs(span.job.manifest, (x,), without_state=True)  # a wrong input is the caller's, not a worker's
        last: GpunetError | None = None
        raised_by: str | None = None  # a worker said the step itself raised: one more worker, drawn at random, is asked
        for _ in range(MAX_MOVES + 1):
            try:
                if placed.worker_id is None or self._draining(placed.worker_id):
                    await self._place(i, placed, drawn=raised_by is not None)
                y = await self._run(i, span, placed, x, close=close, record=True)
                if raised_by is not None:  # another worker took the step: the first one's "it raised" was false
                    self.seq.core.held_against(raised_by, "failure")
                return y
            except Caught as caught:  # the step's output was wrong: the replay's stands in for it, the span moves
                logger.warning("%s", caught)
                self._drop_liars()
                return caught.truth
            except VerificationFailed:  # outputs already returned were wrong (or a dispute is unresolved): ends here
                self._drop_liars()
                if placed.worker_id is not None:  # unresolved: its open tab, the disputed step on it, is not paid
                    self._leave(placed)
                raise
            except (WorkerDraining, NetworkError, JobTimeout, JobFailed, JobRejected, InvalidReceipt) as e:
                if isinstance(e, LocalNetworkDown):  # our own daemon went with a Ctrl-C: no worker was lost
                    raise
                if self._closed or self.seq.core.closed:  # closed under the step: no worker was lost either
                    raise UsageError(f"the {'session' if self._closed else 'client'} was closed while step "
                                     f"{self.steps} ran on span {span.start}-{span.stop - 1}") from None
                # The state is gone (SessionLost, a dead executor or worker), the worker leaves, or it will not take
                # the span (its session limits): another worker replays the span's steps. An error of the job's own
                # fails the same way everywhere (JobRaised: raised once another worker agrees), so moves are bounded.
                if isinstance(e, JobRaised) and placed.worker_id is not None:
                    if raised_by is not None:
                        raise JobRaised(f"{e} (the same on two workers: the step's own error)") from None
                    raised_by = placed.worker_id
                last = e
                gone = placed.worker_id
                if gone is not None:
                    placed.failed.add(gone)
                    if isinstance(e, JobRejected):
                        placed.refused.add(gone)
                logger.warning("Span %d-%d lost its worker %s (%s); moving it and replaying %d step(s)",
                               span.start, span.stop - 1, (gone or "?")[-8:], e, len(placed.history))
                placed.worker_id = None
                self.moves += 1
        raise SessionLost(f"span {span.start}-{span.stop - 1} could not be kept on any worker "
                          f"(moved {MAX_MOVES} times; last: {last})")

    def _pushable(self) -> bool:
        """Whether this step can go span to span (Petals' server-to-server hops): every span open on a worker that
        stays, and no checks (a checked step's output is compared before the next span may use it)."""
        return (self._push and self.steps >= self._push_from and self.checks is None and len(self.seq.spans) > 1
                and self.seq.core.transport.pushes
                and all(span.stateful for span in self.seq.spans)
                and all(p.worker_id is not None and p.step > 0 and not p.closed and not self._draining(p.worker_id)
                        for p in self.placed))

    async def _step_pushed(self, x: torch.Tensor) -> torch.Tensor:
        """One step with each span's output pushed by its worker straight to the next span's worker (and returned
        here too): the client sends every span its step at once and reads the answers, so the activation crosses
        the network once per span instead of twice. The client still holds every span's input (to move it), and each
        worker says which input it ran on: one that differs from the output this client got from the span before
        (a worker pushed one thing and answered another) has its state rebuilt elsewhere. A span whose push did not
        come, or whose worker failed, takes the step the usual way, and so do the spans after it."""
        from gpunet.job.format import check_inputs

        spans, placed = self.seq.spans, self.placed
        check_inputs(spans[0].job.manifest, (x,), without_state=True)
        inputs = await self._input_shapes(x)
        loop = asyncio.get_running_loop()
        held = [loop.create_future() for _ in spans[1:]]  # the hash of span i's input, once this client holds it
        tasks = []
        for i, (span, p) in enumerate(zip(spans, placed)):
            nxt = placed[i + 1] if i + 1 < len(spans) else None
            step = protocol.SessionStep(
                p.session_id, p.step, ttl=self.ttl, input_from=placed[i - 1].worker_id if i else None,
                push_to=protocol.PushTo(nxt.worker_id, nxt.session_id, nxt.step) if nxt is not None else None)
            tasks.append(asyncio.ensure_future(self.seq.core.run_step(
                span.job, (x if i == 0 else inputs[i],), p.worker_id, step, span.state, p.tab,
                self.seq.requirements_for(span), pushed=held[i - 1] if i else None)))
        try:
            start = last = loop.time()
            for i, (span, p) in enumerate(zip(spans, placed)):
                try:
                    # Once this client holds the span's input, its answer is due about a span's time later: a push
                    # refused or lost on the way is not waited for until the step's timeout.
                    grace = None if i == 0 else PUSH_GRACE + PUSH_GRACE_SPANS * (last - start) / i
                    result = await asyncio.wait_for(asyncio.shield(tasks[i]), grace)
                except (GpunetError, asyncio.TimeoutError) as e:
                    for later in tasks[i:]:  # their pushes will not come: their workers stop waiting
                        later.cancel()
                    self._push_from, self._push_backoff = self.steps + self._push_backoff, 2 * self._push_backoff
                    if isinstance(e, PushedInputDiffers):
                        logger.warning("Span %d-%d: %s; its state is rebuilt elsewhere, and this session's steps go "
                                       "by way of the client from now on", span.start, span.stop - 1, e)
                        self._push = False
                        p.failed.add(p.worker_id)  # its tab (without the disputed step) is paid as it is closed
                        p.worker_id = None
                        self.moves += 1
                    else:
                        logger.info("Span %d-%d did not take its pushed step (%s); it and the spans after it take "
                                    "this step by way of the client, as the session's next %d steps will",
                                    span.start, span.stop - 1, e if str(e) else "no answer in time",
                                    self._push_from - self.steps - 1)
                    return await self._step_from(i, x)
                last = loop.time()
                p.step += 1
                p.history.append(x.detach().clone())
                self.pushed += i > 0
                if result.receipt is not None:
                    self.receipts.append(result.receipt)
                x = result.outputs[0]
                if i + 1 < len(spans):
                    held[i].set_result(sha256_hex(spans[i + 1].job.encode_step_inputs(x)))
            return x
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _step_from(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Span ``i`` and the spans after it take the step by way of this client, one after the other."""
        for j in range(i, len(self.seq.spans)):
            x = await self.step_span(j, x)
        return x

    async def _input_shapes(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each span's input for this step as a meta tensor (a pushed step's shapes, for the dry run), span after
        span from the dry run's output shapes (cached: the same every generation step)."""
        from gpunet.job import tensors

        shapes = [torch.empty(x.shape, dtype=x.dtype, device="meta")]
        for span in self.seq.spans[:-1]:
            estimate = await self.seq.core.estimate(span.job, (shapes[-1], *span.meta_state()))
            dtype, shape = estimate.outputs[0]
            shapes.append(torch.empty(shape, dtype=tensors.DTYPES[dtype], device="meta"))
        return shapes

    def _drop_liars(self) -> None:
        """Spans whose worker was caught lying leave it: their steps not billed yet are not paid, their state there
        is freed, and they move at their next step."""
        for placed in self.placed:
            if placed.worker_id is not None and placed.worker_id in self.checks.banned:
                self._leave(placed)
                self.moves += 1

    def _leave(self, placed: _Placed) -> None:
        placed.failed.add(placed.worker_id)
        placed.tab = Tab()
        self._close_on(placed.worker_id, placed.session_id, placed.tab)  # a close that pays nothing
        placed.worker_id = None

    def _draining(self, worker_id: str) -> bool:
        """Its record says it is leaving (one missing from a refresh is not: the step finds out if it is gone)."""
        entry = self.seq.core.router.workers.get(worker_id)
        return entry is not None and entry.record.state.value == "draining"

    async def _place(self, i: int, placed: _Placed, drawn: bool = False) -> None:
        """Put span ``i`` on a worker (passing over those holding the session's other spans, and those that failed
        it) and rebuild its state there by replaying its past inputs."""
        span = self.seq.spans[i]
        if placed.worker_id is not None:  # draining: hand off; its state there is closed (and its tab paid)
            placed.failed.add(placed.worker_id)
            self._close_on(placed.worker_id, placed.session_id, placed.tab)
        elif placed.workers and placed.tab.steps:  # lost: if the worker still answers, its tab is paid
            self._close_on(placed.workers[-1], placed.session_id, placed.tab)
        placed.tab = Tab()
        others = {p.worker_id for j, p in enumerate(self.placed) if j != i and p.worker_id}
        banned = self.checks.banned if self.checks is not None else set()
        def place(exclude: set[str]):
            return self.seq.core.place(span.job, (x_meta(span), *span.meta_state()), self.seq.requirements_for(span),
                                       exclude=exclude, avoid=others, drawn=drawn, prefer=self.seq.hosts(i, self))

        worker = None
        if span.job.manifest.batch is not None and not self.seq.hosts(i, self):
            # The first of this model's open sessions to place span i: sessions opening with it (a generation's
            # rows, a gateway's requests) wait for its choice and follow it (hosts), so that span's worker gets all
            # their rows (batched). Only a first try waits so: one with nowhere to go looks on its own.
            async with self.seq.placing[i]:
                if not self.seq.hosts(i, self):
                    try:
                        worker = await place(placed.failed | banned)
                    except NoWorkersAvailable:
                        pass
                    else:
                        placed.worker_id = worker.id
        if worker is None:
            worker = await self._choose(place, placed, banned, self.seq.requirements_for(span), others)
        placed.worker_id, placed.session_id, placed.step = worker.id, secrets.token_urlsafe(12)[:16], 0
        placed.workers.append(worker.id)
        for past in placed.history:
            try:
                await self._run(i, span, placed, past, close=False, record=False)
            except JobRaised as e:  # a step that ran before cannot raise now: this worker's failure, not the job's
                raise JobFailed(f"replaying step {placed.step}: {e}") from None

    async def _choose(self, place, placed: _Placed, banned: set[str], req: Requirements, others: set[str]):
        try:
            return await place(placed.failed | banned)
        except NoWorkersAvailable as e:
            # Others are waited for when those passed over may be gone, or are liars (under load a live worker's
            # record lapses for a moment: CI saw a session fail when the liar it caught was the one worker in view);
            # not when they all answered with a refusal. A span that lost its worker to a liar caught then tries one
            # whose record lapsed a moment ago (never a first placement: those fail with the reasons).
            again = placed.failed - banned
            worker = (await self._another(place, placed.failed | banned)
                      if not again or again - placed.refused else None)
            if worker is None and not again:
                worker = (self.seq.core.router.lapsed_fallback(req, exclude=placed.failed | banned, avoid=others)
                          if placed.failed else None)
                if worker is None:
                    raise e from None
                logger.info("No listed worker can take a span: trying %s, whose record lapsed a moment ago (a "
                            "loaded worker's heartbeat can come late)", worker.id[-8:])
            elif worker is None:
                # every worker failed it once: try them again rather than give up (not liars)
                placed.failed.clear()
                placed.refused.clear()
                worker = await place(set(banned))
            return worker

    @staticmethod
    async def _another(place, exclude: set[str]):
        """A worker outside ``exclude`` that shows up within OTHERS_WAIT (records refreshed meanwhile), or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OTHERS_WAIT
        while loop.time() < deadline:
            await asyncio.sleep(OTHERS_POLL)
            try:
                return await place(exclude)
            except NoWorkersAvailable:
                continue
        return None

    def _close_on(self, worker_id: str, session_id: str, tab: Tab) -> None:
        """Close a session a span left (in the background) and pay its tab, if that worker still answers."""
        async def close() -> None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):  # a worker that died may keep the dial hanging
                    receipt = await self.seq.core.close_session(worker_id, session_id, tab, self.max_price)
            except TimeoutError:
                return
            if receipt is not None:
                self.receipts.append(receipt)

        task = asyncio.ensure_future(close())
        self._handoffs.add(task)
        task.add_done_callback(self._handoffs.discard)

    async def _run(self, i: int, span: Span, placed: _Placed, x: torch.Tensor, close: bool, record: bool):
        step = protocol.SessionStep(placed.session_id, placed.step, fresh=span.fresh, close=close, ttl=self.ttl)
        check = replay = None
        if record:
            x = x.detach().clone()  # kept to be replayed: a caller reusing its buffer must not change the past
        if record and self.checks is not None and self.checks.spans[i] is not None:
            history, worker_id = [*placed.history, x], placed.worker_id
            if self.checks.due(i, worker_id):  # replayed beside the worker's step
                replay = self.checks.replay(i, step.step, history, worker_id)

            async def check(outputs, billed: bool) -> None:  # before the step is returned or anything paid
                await self.checks.settle(i, f"{span.start}-{span.stop - 1}", worker_id, step.step, outputs[0],
                                         replay, history, billed)
        try:
            result = await self.seq.core.run_step(span.job, (x,), placed.worker_id, step, span.state, placed.tab,
                                                  self.seq.requirements_for(span), check=check)
        except (Caught, VerificationFailed):
            placed.step += 1
            placed.history.append(x)  # the step was taken (wrongly): the span's next worker replays it too
            raise
        # A step that failed otherwise leaves its replay running: what it computes is kept for the step's retry.
        placed.step += 1
        if result.receipt is not None:
            self.receipts.append(result.receipt)
        if record:
            placed.history.append(x)
        if close:
            placed.closed = True
        return result.outputs[0]

    async def close(self) -> None:
        """Free every span's state on its worker and pay the steps not billed yet (workers free the state after
        the session's ttl too, but then those steps wait for a payment that may never come)."""
        self._closed = True
        failed: VerificationFailed | None = None
        if self.checks is not None and self._broken is None:
            for i, span in enumerate(self.seq.spans):  # outputs not compared yet: before their tab is paid
                try:
                    await self.checks.flush(i, f"{span.start}-{span.stop - 1}", self.placed[i].history)
                except VerificationFailed as e:
                    failed = failed or e
                    self._drop_liars()
        for p in self.placed:
            if p.worker_id is not None and not p.closed:
                self._close_on(p.worker_id, p.session_id, p.tab)
            p.closed = True
        while self._handoffs:
            await asyncio.gather(*self._handoffs)
        if self.checks is not None:
            await self.checks.close()
        if failed is not None:
            raise failed
