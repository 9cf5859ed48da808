"""Sessions' steps batched on a span (docs/sessions.md, batching): the steps the lanes start together (a leader and
its riders: jobs with one ``rows`` key, see gpunet.worker.state.lanes) meet here and go to the executor as one
:meth:`~gpunet.worker.executor.Executor.run_rows`.

Continuous batching: a step that arrives while its span's forward runs waits in its lane; when that forward ends,
the next start takes every step waiting with the same key, so sessions join and leave the batch between steps. The
lanes say at the start who rides along, so a batch waits for exactly those (or their leaving), never on a timer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from gpunet.errors import ExecutorDied, JobFailed, JobTimeout, ProgramNotCached
from gpunet.utils import LRU, wait_out
from gpunet.worker import metrics
from gpunet.worker.executor import RunResult
from gpunet.worker.state.lanes import MAX_ROWS, Ticket
from gpunet.worker.state.limits import SessionRun

#: How long the steps of one group message wait at the lanes for those of the group still on their way (a pushed
#: input not come yet) before they go in without them.
TOGETHER_WAIT = 0.5
#: A step's inputs at most this big may ride in a batch (a decode step's are a few KiB; a long prompt runs alone).
MAX_ROW_INPUT_BYTES = 64 * 1024
#: How long a session whose step failed in a batch runs its steps alone.
ALONE_SECONDS = 60.0


@dataclass(eq=False)
class _Forming:
    expected: set  # the tickets started together, less those that left before they came
    first: Ticket  # the first of them (the key this is found by)
    steps: dict = field(default_factory=dict)  # ticket -> (session, inputs, timeout, future)
    program_hash: str = ""


class Together:
    """The steps of one group message (gpunet.protocol.StepGroup: one client's sessions' steps to this worker, sent
    as one): those of one program (one span) go into the lanes at once (:meth:`Lanes.enqueue_all`), so that they
    start as one forward however their inputs came (pushed ones arrive one by one where the span before did not
    batch them). A step waits for the others of its program in its group at most TOGETHER_WAIT; one that ends
    before it gets there (refused, answered from the recent results, its push lost) is not waited for. Steps of
    other programs in the group (the client's other sessions may hold another span here) do not wait for these, nor
    does anyone else's job.

    The steps of a group for one program that batch (later steps of a batched span, inputs small: Rows.key) also
    share one place in the lanes (gpunet.worker.state.admission), up to a forward's rows: they run as one forward,
    so a client's many sessions on one span do not hear "busy" for rows that cost the worker little more. Other
    steps of a group (prompts, a span that does not batch) take a place each, as if sent alone."""

    def __init__(self, submits, enqueue_all):
        self._program = {s.job_id: s.program for s in submits}
        self._enqueue_all = enqueue_all
        self._gatherings: dict[str, _Gathering] = {}
        for s in submits:
            self._gatherings.setdefault(s.program, _Gathering()).pending.add(s.job_id)
        self._places: dict[tuple[str, str], int] = {}  # (program, lane) -> steps holding the group's place

    def share_place(self, program: str, lane: str) -> bool:
        """True: a step of this group holds a place for ``program`` already, and this one shares it (up to a
        forward's rows)."""
        if 0 < self._places.get((program, lane), 0) < MAX_ROWS:
            self._places[(program, lane)] += 1
            return True
        return False

    def took_place(self, program: str, lane: str) -> None:
        self._places[(program, lane)] = 1

    def drop_place(self, program: str, lane: str) -> bool:
        """A step let go of the place it shares; True when it was the last (the place is given back)."""
        self._places[(program, lane)] -= 1
        return self._places[(program, lane)] == 0

    def arrive(self, ticket: Ticket) -> bool:
        """``ticket`` waits at the lanes; True: its group lets it in (now, or with the others), False: it goes in on
        its own (the others of its program went in already)."""
        gathering = self._gatherings.get(self._program.get(ticket.job, ""))
        if gathering is None or gathering.let_in or ticket.job not in gathering.pending:
            return False
        gathering.pending.discard(ticket.job)
        gathering.here.append(ticket)
        if not gathering.pending:
            self._go(gathering)
        elif gathering.timer is None:
            gathering.timer = asyncio.get_running_loop().call_later(TOGETHER_WAIT, self._go, gathering)
        return True

    def leave(self, job_id: str) -> None:
        """A step of the group that will not (or no longer) wait at the lanes."""
        gathering = self._gatherings.get(self._program.get(job_id, ""))
        if gathering is None:
            return
        gathering.pending.discard(job_id)
        gathering.here = [t for t in gathering.here if t.job != job_id]
        if not gathering.pending:
            self._go(gathering)

    def _go(self, gathering: "_Gathering") -> None:
        if gathering.let_in:
            return
        gathering.let_in = True
        if gathering.timer is not None:
            gathering.timer.cancel()
        here, gathering.here = gathering.here, []
        if here:
            self._enqueue_all(here)


@dataclass(eq=False)
class _Gathering:
    pending: set = field(default_factory=set)  # job ids not at the lanes yet
    here: list = field(default_factory=list)  # tickets waiting for them
    timer: asyncio.TimerHandle | None = None
    let_in: bool = False


class Rows:
    """Where the steps started together meet (see the module docstring)."""

    def __init__(self, executor):
        self.executor = executor
        self._forming: dict[Ticket, _Forming] = {}  # by the first ticket of those started together
        self._runs: set[asyncio.Task] = set()
        #: Sessions whose step failed in a batch: they run alone for a while (a bad row makes its batch run again
        #: row by row: it must not do that to others step after step). Session key -> until (time.monotonic).
        self._alone: LRU[str, float] = LRU(4096)

    def key(self, session: SessionRun | None, program_hash: str, program, inputs) -> str | None:
        """The key a step may be batched under (None: it runs alone): a later step of a session of a batched
        program, its program loaded (no bytes with it), its inputs small; steps of one executor, program and input
        size share it (inputs of one size but other shapes are told apart by the executor)."""
        if session is None or session.step == 0 or program is not None or hasattr(inputs, "fileno") or \
                len(inputs) > MAX_ROW_INPUT_BYTES or self._alone.get(session.key, 0.0) > time.monotonic():
            return None
        key = self.executor.rows_key(session.key, program_hash)
        return None if key is None else f"{key}/{len(inputs)}"

    async def run(self, ticket: Ticket, program_hash: str, session: SessionRun, inputs, timeout: float
                  ) -> RunResult | None:
        """This step's result, computed with those started with it; None when it is to run alone, the usual way
        (none came with it; or its program must be loaded again). Like any session step it runs to its end once
        sent: a cancel waits for it (one that comes before is honoured)."""
        if len(ticket.group) < 2:
            return None
        forming = self._of(ticket)
        future = asyncio.get_running_loop().create_future()
        forming.steps[ticket] = (session, inputs, timeout, future)
        forming.program_hash = program_hash
        self._check(forming)
        await wait_out(future)
        task = asyncio.current_task()
        cancelled = task is not None and task.cancelling() > 0
        if future.exception() is None and future.result() is None and cancelled:
            raise asyncio.CancelledError()  # not sent: the cancel stands
        while task is not None and task.cancelling():  # its state moved on: the step is done, and taken as done
            task.uncancel()
        return future.result()

    def gone(self, ticket: Ticket) -> None:
        """A step started with others that will not come (its turn came as it was cancelled, or its deadline
        passed): the others do not wait for it."""
        if ticket.running and len(ticket.group) > 1:
            forming = self._of(ticket)
            forming.expected.discard(ticket)
            self._check(forming)

    def _of(self, ticket: Ticket) -> _Forming:
        forming = self._forming.get(ticket.group[0])
        if forming is None:
            forming = self._forming[ticket.group[0]] = _Forming(set(ticket.group), first=ticket.group[0])
        return forming

    def _check(self, forming: _Forming) -> None:
        if not forming.expected <= set(forming.steps):
            return
        del self._forming[forming.first]
        steps = list(forming.steps.values())
        if len(steps) == 1:  # the others left: this one runs alone, the usual way
            steps[0][3].set_result(None)
        elif steps:
            task = asyncio.ensure_future(self._forward(forming.program_hash, steps))
            self._runs.add(task)
            task.add_done_callback(self._runs.discard)

    async def _forward(self, program_hash: str, steps: list) -> None:
        try:
            # As long as the longest time any of them has: one step's short time must not stop the others'.
            results = await self.executor.run_rows(program_hash, [(s, inputs) for s, inputs, _, _ in steps],
                                                   timeout=max(t for _, _, t, _ in steps))
        except BaseException as e:  # what fails them all (the executor died, the worker is leaving)
            error = e
            if isinstance(e, (ExecutorDied, JobTimeout)):  # whose doing is not known: counted against none
                error = JobFailed(f"{e} (a forward of {len(steps)} sessions' steps: counted against none of them)")
            for *_, future in steps:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(e, Exception):
                raise
            return
        metrics.BATCHED_FORWARDS.inc()
        metrics.BATCHED_STEPS.inc(len(steps))
        for (session, _, _, future), result in zip(steps, results):
            if isinstance(result, ProgramNotCached):  # evicted from the executor's memory: loaded the usual way
                future.set_result(None)
            elif isinstance(result, BaseException):
                self._alone.put(session.key, time.monotonic() + ALONE_SECONDS)
                future.set_exception(result)
            else:
                future.set_result(result)
