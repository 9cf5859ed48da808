"""Whose turn it is: admitted jobs wait here until the lanes (:mod:`gpunet.worker.state.lanes`, pure) start them,
and this room carries out what the lanes decide (wake a job, stop one preempted, blame a client) as well as the
owner's pause and the worker's leaving, which stop runs the same way."""

from __future__ import annotations

import asyncio
import logging
import time

from gpunet.errors import DeadlineUnreachable, JobPreempted, ProgramNotCached, WorkerDraining
from gpunet.protocol import BACKGROUND, Submit
from gpunet.utils import Debounce, human_seconds
from gpunet.worker import metrics
from gpunet.worker.executor import STOP_GRACE
from gpunet.worker.state.admission import Admission
from gpunet.worker.state.lanes import Action, Blame, Lanes, Start, Ticket, Wake

logger = logging.getLogger("gpunet.worker")

LANE_GAUGES_DELAY = 0.1  # seconds from a change in the lanes to their gauges (metrics.count_lanes)


class Turns:
    def __init__(self, admission: Admission, executor):
        self.admission, self.executor = admission, executor
        # Which admitted job runs next, at what price, and which batch job an interactive one stops (pure; see
        # gpunet.worker.state.lanes): a job waits for its turn here, and a Preempt stops the run of the job named.
        self.lanes = Lanes(admission.max_concurrent, admission.price_nano, admission.batch_price_nano)
        if executor is not None:  # (a service that only proves its speed has none)
            self.lanes.expected_end = executor.expected_end
        # The lanes' gauges, published a moment after a change rather than at every job's start and end (a dozen
        # gauge writes a job; a scrape comes every few seconds at most).
        self._count_lanes = Debounce(LANE_GAUGES_DELAY, lambda: metrics.count_lanes(self.lanes))
        self._turns: dict[Ticket, asyncio.Future] = {}  # waiting for a Start
        self._runs: dict[Ticket, asyncio.Task] = {}  # runs that may be stopped (preempted, paused, leaving)
        self._pause_timer: asyncio.TimerHandle | None = None
        self._wake: tuple[float, asyncio.TimerHandle] | None = None  # the lanes' next recheck (Wake), if one is due
        self.leaving = False  # the drain ran out of time: running jobs are being stopped (stop_running)

    async def wait(self, ticket: Ticket, deadline: float | None, together=None) -> None:
        """Wait until the lanes start this job (at most until its deadline). ``together``: the steps of its group
        message (gpunet.worker.batching.Together), let into the lanes all at once."""
        if self.leaving:
            raise self.leaving_error()
        if self.admission.paused is not None:
            raise self.admission.pause_error()
        turn = self._turns[ticket] = asyncio.get_running_loop().create_future()
        try:
            if together is None or not together.arrive(ticket):
                self.apply(self.lanes.enqueue(ticket))
            if deadline is None:
                await turn
            else:
                try:
                    async with asyncio.timeout(deadline - time.time()):
                        await turn
                except TimeoutError:
                    raise DeadlineUnreachable("the job's deadline passed before a slot here was free") from None
        except BaseException:
            # Withdrawn while waiting (its client went away, its deadline passed), or started at the very moment it
            # was cancelled: either way its place goes to the next job.
            if together is not None:
                together.leave(ticket.job)
            self.apply(self.lanes.ended(ticket, 0.0) if ticket.running else self.lanes.withdraw(ticket))
            raise
        finally:
            self._turns.pop(ticket, None)

    def enqueue_all(self, tickets: list[Ticket]) -> None:
        """Jobs let into the lanes at once (a group's steps, see :meth:`wait`)."""
        self.apply(self.lanes.enqueue_all([t for t in tickets if t in self._turns]))

    def ended(self, ticket: Ticket, seconds: float) -> None:
        self.apply(self.lanes.ended(ticket, seconds))

    def apply(self, actions: list[Action]) -> None:
        """Carry out what the lanes decided: wake a job whose turn it is, stop one preempted."""
        for action in actions:
            if isinstance(action, Start):
                turn = self._turns.get(action.ticket)
                if turn is not None and not turn.done():
                    turn.set_result(None)
            elif isinstance(action, Blame):  # it had another job stopped, then left: as costly as a cancel
                self.admission.stopped_running(action.ticket.client, host=action.ticket.host)
            elif isinstance(action, Wake):
                self._wake_at(action.at)
            else:
                self.stop_run(action.ticket)
        if actions:
            self._count_lanes.poke()

    def _wake_at(self, at: float) -> None:
        """Recheck the lanes at ``at`` (time.monotonic, the lanes' clock): one timer, the earliest asked for."""
        if self._wake is not None:
            if self._wake[0] <= at:
                return
            self._wake[1].cancel()

        def due() -> None:
            self._wake = None
            self.apply(self.lanes.recheck())

        self._wake = (at, asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), due))

    def track(self, ticket: Ticket, run: asyncio.Task) -> None:
        """``run`` may be stopped by ticket from now on (until :meth:`untrack`)."""
        self._runs[ticket] = run

    def untrack(self, ticket: Ticket) -> None:
        self._runs.pop(ticket, None)

    def stop_run(self, ticket: Ticket) -> None:
        """Stop a running job the worker no longer wants to run (preempted, or the owner paused the worker): at its
        program's next node, the executor serving on; one op that runs long is given STOP_GRACE, then the run is
        cancelled, which kills the process (a warm spare takes its place), unless it holds sessions' state: there the
        stop word alone must do (Executor.run)."""
        run = self._runs.get(ticket)
        if run is None or run.done():
            return
        ticket.preempted = True
        if self.executor.stop(ticket):
            if not self.executor.holds_sessions_of(ticket):  # there a cancel could only wait longer (Executor.run)
                asyncio.get_running_loop().call_later(STOP_GRACE, lambda: run.done() or run.cancel())
        else:
            run.cancel()

    def check_deadline(self, submit: Submit) -> None:
        """Refuse at once a job that could not start here before its deadline (not left to time out in the queue)."""
        left = submit.deadline - time.time()
        wait = self.lanes.wait_estimate(submit.lane)
        if left <= 0 or wait >= left:
            raise DeadlineUnreachable(f"this worker cannot start the job before its deadline: about "
                                      f"{human_seconds(wait)} of work is ahead of it here, and the deadline is "
                                      f"{human_seconds(left)} away")

    # --- the volunteer's own work (gpunet.worker.background) --------------------------------------------------------

    async def run_own(self, owner_id: str, program_hash: str, program: bytes, inputs: bytes):
        """The volunteer's own work, in the background lane: it waits for a slot nothing paying wants, and any paying
        job stops it (JobPreempted). Returns the executor's RunResult."""
        ticket = Ticket(owner_id, BACKGROUND, job="background")
        run = asyncio.ensure_future(self._run_own(ticket, program_hash, program, inputs))
        self.track(ticket, run)
        try:
            await asyncio.wait([run])
        finally:
            if not run.done():  # our caller stops (the worker leaves): so does the run
                run.cancel()
                await asyncio.wait([run])
            self.untrack(ticket)
        if run.cancelled():
            raise JobPreempted("a paying job needed the slot")
        return run.result()

    async def _run_own(self, ticket: Ticket, program_hash: str, program: bytes, inputs: bytes):
        await self.wait(ticket, None)
        clock = time.monotonic()
        try:
            if self.executor.has_program(program_hash):
                try:
                    return await self.executor.run(program_hash, None, inputs, private=True, tag=ticket)
                except ProgramNotCached:  # another executor holds it; this one needs the bytes
                    pass
            return await self.executor.run(program_hash, program, inputs, private=True, tag=ticket)
        finally:
            self.ended(ticket, time.monotonic() - clock)

    # --- the owner comes first (gpunet.worker.state.availability decides; the worker's server calls these) ----------

    def pause(self, reason: str, grace: float) -> None:
        """The owner wants the machine: take nothing new, send back the jobs waiting, stop those still running after
        ``grace`` seconds (their clients run them elsewhere; nothing is billed for them)."""
        starting = self.admission.paused is None
        self.admission.paused = reason
        for turn in self._turns.values():
            if not turn.done():
                turn.set_exception(self.admission.pause_error())
        if starting:
            self._pause_timer = asyncio.get_running_loop().call_later(grace, self._stop_all_for_pause)

    def resume(self) -> None:
        self.admission.paused = None
        if self._pause_timer is not None:
            self._pause_timer.cancel()
            self._pause_timer = None

    def stop_running(self) -> int:
        """The worker is leaving and its drain ran out of time: stop the jobs still running, as a pause does, before
        the executors go (killed under them, a job would read as its own crash). Their clients hear that the worker
        left and run them elsewhere; nothing is billed for them. Returns how many were running."""
        self.leaving = True
        for turn in list(self._turns.values()):  # first the waiting ones: a stopped job's slot must start nothing
            if not turn.done():
                turn.set_exception(self.leaving_error())
        running = list(self.lanes.running)
        for ticket in running:
            self.stop_run(ticket)
        return len(running)

    def leaving_error(self) -> WorkerDraining:
        return WorkerDraining("this worker left the network before the job finished; run it elsewhere",
                              self.admission.queue_length)

    def _stop_all_for_pause(self) -> None:
        self._pause_timer = None
        running = list(self.lanes.running)
        if running:
            logger.info("Stopping %d job(s) still running after the pause's grace; their clients run them elsewhere",
                        len(running))
        for ticket in running:
            self.stop_run(ticket)
