"""One copy of a job's tries, as a pure state machine: which worker to try next, and what each outcome means.

No I/O and no clock of its own (``now`` is handed in, monotonic seconds), so every rule below is tested without a
network (tests/test_attempts.py). :class:`gpunet.client.delivery.Deliverer` runs the loop, Petals'
``sequential_forward``-style: ask :meth:`Attempts.next` (:class:`Try` a worker, :class:`Wait` for room,
:class:`Look` again at an emptied network, or :class:`GiveUp`), try it, tell :meth:`Attempts.on` the outcome and carry
out the actions it returns (:class:`Strike`, :class:`Busy`, :class:`ProgramLost`, :class:`PayUp`, :class:`Say`, then
:class:`Retry`, :class:`Raise` or :class:`Accept`).

What each outcome means:

* answered with what it was asked: accepted; workers that said the job raised lied (struck).
* a wrong answer (hashes, the dry run's shapes, the receipt's terms): struck as *invalid*, another worker.
* preempted: a batch job runs again, elsewhere first; an interactive one is never stopped by an honest worker
  (struck).
* busy (or draining): skipped a moment, not banned.
* the program was lost between admission and run: resent, not held against it, up to ``max_resends`` times.
* "the job raised": believed only when this client's own run raises too, or (too big to run here, and no result in
  hand) when a second worker drawn at random names the same node and exception; a worker whose claim this client's
  run contradicts, or who said it with no time left to check, is struck.
* at its credit line ("pay first": this client, or its address, holds results it has not countersigned yet): this
  client pays as it goes, so its countersignatures are on their way. Owed ones are sent at once (:class:`PayUp`) and
  the same worker asked again, up to ``max_pay_waits`` times (backing off), before it counts as a refusal.
* refused (its limits, its price): another worker, until ``max_rejections`` refusals make it final.
* a stream broken on the way (a relay resetting, the daemon closing one under a burst): the same worker once more.
* timed out or failed otherwise: struck (*timeout* or *failure*), another worker.
* our own daemon went (LocalNetworkDown): no worker's doing, raised at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from gpunet.errors import (
    DeadlineUnreachable,
    GpunetError,
    JobPreempted,
    JobRaised,
    JobRejected,
    JobTimeout,
    LocalNetworkDown,
    NetworkError,
    NoWorkersAvailable,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    StreamBroken,
    WorkerBusy,
)

if TYPE_CHECKING:
    from gpunet.client.routing import JobShape, Requirements, Router
    from gpunet.dht.records import WorkerEntry

#: Seconds a busy worker's job waits before routing is asked again (routing skips that worker meanwhile).
BUSY_PAUSE = 0.01
#: A claim that the job raised, made with this little time left, cannot be checked here: held as a timeout.
LATE_SECONDS = 0.1
#: Seconds before a job refused at a worker's credit line is asked there again (doubling each time), and how often.
PAY_PAUSE = 0.02
MAX_PAY_WAITS = 6
#: Times a job is sent again to a worker whose stream broke on the way (not held against it), and the pause before
#: the second of those (doubling after): the p2p daemon under a burst of streams can break several in a row.
REDIALS = 3
REDIAL_PAUSE = 0.1


# --- outcomes: what one try came to -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answered:
    """The worker answered, and its answer passed the client's checks."""


@dataclass(frozen=True)
class WrongAnswer:
    """It answered, but not with what it was asked: honesty, not availability."""

    error: GpunetError


@dataclass(frozen=True)
class Raised:
    """It said the job raised; ``here``: whether the job raises on this machine too (None: not run here)."""

    error: JobRaised
    here: bool | None


#: Anything else a try comes to is the error it raised: a GpunetError, or TimeoutError past the job's time.
Outcome = Union[Answered, WrongAnswer, Raised, GpunetError, TimeoutError]


# --- steps: what to do next -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Try:
    worker: "WorkerEntry"
    seconds: float  # left of the job's time


@dataclass(frozen=True)
class Wait:
    """Workers that fit are busy, full of this client's jobs, or joining: wait until ``until`` (monotonic), or
    until one of this client's jobs ends somewhere."""

    until: float


@dataclass(frozen=True)
class Look:
    """The network emptied under this job (records lapse together while workers restart): look again after
    ``pause`` seconds."""

    pause: float


@dataclass(frozen=True)
class GiveUp:
    error: GpunetError


# --- actions: what an outcome means -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strike:
    """Ban the worker for a while (and name it to no other as a program's holder); record ``outcome`` against it.
    ``say``: what it did, logged with the ban's length."""

    worker_id: str
    outcome: str  # "failure" | "timeout" | "invalid" (gpunet.client.trust)
    say: str | None = None
    level: int = logging.INFO


@dataclass(frozen=True)
class Busy:
    """Skip the worker a moment (``Router.on_busy``): not a penalty."""

    worker_id: str


@dataclass(frozen=True)
class ProgramLost:
    """The worker no longer holds the program: the next job there carries it (``Router.on_program_lost``)."""

    worker_id: str


@dataclass(frozen=True)
class PayUp:
    """The worker holds this client at its credit line: send it what is owed now, and let it land (bounded)."""

    worker_id: str


@dataclass(frozen=True)
class Say:
    message: str
    level: int = logging.INFO


@dataclass(frozen=True)
class Retry:
    """Ask :meth:`Attempts.next` again, after ``pause`` seconds."""

    pause: float = 0.0


@dataclass(frozen=True)
class Raise:
    error: GpunetError


@dataclass(frozen=True)
class Accept:
    """The answer is this copy's result."""


Action = Union[Strike, Busy, ProgramLost, PayUp, Say, Retry, Raise, Accept]


@dataclass
class Replicas:
    """What the copies of one job share (several for a verified job): the workers running one now, and the results
    in hand (a worker saying the job raised contradicts them)."""

    taken: set[str] = field(default_factory=set)
    delivered: int = 0


class Attempts:
    """One copy of one job, from its first try to its result or its last error. Mutated only by :meth:`next` and
    :meth:`on`."""

    def __init__(self, job_id: str, req: "Requirements", shape: "JobShape", deadline: float, *,
                 replicas: Replicas | None = None, checker: bool = False, runs_here: bool = False,
                 max_rejections: int = 3, max_resends: int = 2, max_pay_waits: int = MAX_PAY_WAITS,
                 empty_wait: float = 20.0, look_pause: float = 0.5):
        """``deadline``: monotonic; ``checker``: a second opinion, drawn at random rather than ranked; ``runs_here``:
        the job is small enough for this client to run it to check a worker that says it raised; ``empty_wait``:
        how long a job that tried workers looks for them again once the network looks empty."""
        self.job_id, self.req, self.shape, self.deadline = job_id, req, shape, deadline
        self.replicas = replicas if replicas is not None else Replicas()
        self.checker, self.runs_here = checker, runs_here
        self.max_rejections, self.max_resends, self.max_pay_waits = max_rejections, max_resends, max_pay_waits
        self.empty_wait, self.look_pause = empty_wait, look_pause
        self.tried: list[str] = []  # in order, a worker again each time it is tried again
        self.failed: set[str] = set()  # not tried again by this copy
        self.rejections: list[JobRejected] = []
        self.resends = 0  # times a worker lost the program between admission and run (not its fault)
        self.redialled: Counter[str] = Counter()  # times each worker was tried again after a broken stream
        self.preempted: Counter[str] = Counter()  # workers that stopped this batch job for interactive work
        self.raised: list[tuple[str, str]] = []  # (worker, where) for workers that said the job itself raised
        self.raised_error: JobRaised | None = None
        self.last_error: GpunetError | None = None
        self.emptied_until: float | None = None  # the network emptied under this job: looked for again until then
        self.pay_waits: Counter[str] = Counter()  # times each worker said "pay first" to this copy
        self.again: "WorkerEntry | None" = None  # the worker to ask again next, whatever routing would choose

    # --- which worker next ---------------------------------------------------------------------------------------

    def next(self, router: "Router", now: float) -> Try | Wait | Look | GiveUp:
        left = self.deadline - now
        if left <= 0:
            return GiveUp(JobTimeout(f"job {self.job_id[:12]} did not finish within {self.req.timeout:g} s; tried "
                                     f"{_names(self.tried)}"
                                     + (f" (last error: {self.last_error})" if self.last_error else "")))
        if self.again is not None:  # "pay first": asked again there, not elsewhere
            worker, self.again = self.again, None
            self.replicas.taken.add(worker.id)
            self.tried.append(worker.id)
            return Try(worker, left)
        try:
            if self.checker or self.raised:
                # A second opinion on "the job raised" comes from a worker drawn at random, like a checker: the next
                # cheapest could be the same owner's second identity.
                worker = router.choose_checker(self.req, exclude=self.failed, replicas=(
                    self.replicas.taken - self.failed) | {w for w, _ in self.raised})
            else:
                worker = router.choose(self.req, self.shape, exclude=self.failed,
                                       replicas=self.replicas.taken - self.failed, avoid=set(self.preempted),
                                       within=left if self.req.deadline is not None else None)
        except DeadlineUnreachable as e:
            return GiveUp(e)
        except NoWorkersAvailable as e:
            return self._nobody(e, bool(router.workers), now)
        self.replicas.taken.add(worker.id)
        self.tried.append(worker.id)
        return Try(worker, left)

    def _nobody(self, e: NoWorkersAvailable, any_known: bool, now: float) -> Wait | Look | GiveUp:
        if e.retry_at is not None and e.retry_at < self.deadline:  # busy, full, joining: wait for them
            return Wait(e.retry_at)
        others_hold = bool(self.replicas.taken - self.failed - set(self.tried))
        if not any_known or (others_hold and not self.tried):
            # Workers were here a moment ago (this job saw or tried some): their records can all lapse at once
            # while they restart, and under load one can lapse for a heartbeat, leaving a copy of a redundant job
            # no worker its other copies do not hold (CI saw it). Look again for a while before giving up.
            self.emptied_until = self.emptied_until or min(self.deadline, now + self.empty_wait)
            if now < self.emptied_until:
                return Look(self.look_pause)
        if not self.tried:
            return GiveUp(e)
        if self.rejections and all(isinstance(r, DeadlineUnreachable) for r in self.rejections):
            return GiveUp(DeadlineUnreachable(f"every worker that could take job {self.job_id[:12]} refused it: "
                                              f"{self.rejections[-1].reason}"))
        if self.raised:  # no other worker to ask: the one that ran it is all there is to go on
            return GiveUp(JobRaised(f"{self.raised_error} (said by worker {self.raised[0][0][-8:]}; no other worker "
                                    "could run it to confirm, nor this client)"))
        return GiveUp(NoWorkersAvailable(f"{e}; tried {_names(self.tried)}; last error: {self.last_error}"))

    # --- what an outcome means -----------------------------------------------------------------------------------

    def on(self, worker: "WorkerEntry", outcome: Outcome, now: float) -> list[Action]:
        w, job = worker.id, self.job_id[:12]
        if isinstance(outcome, Answered):
            self.replicas.delivered += 1
            actions: list[Action] = []
            for liar, _ in self.raised:  # it ran here: their "the job raised" was not the job's doing
                actions += [Strike(liar, "failure"),
                            Say(f"Worker {liar[-8:]} said job {job} raised, and worker {w[-8:]} ran it")]
            return actions + [Accept()]
        if isinstance(outcome, LocalNetworkDown):  # our own daemon went (a Ctrl-C to the process group)
            return [Raise(outcome)]
        self.replicas.taken.discard(w)
        if isinstance(outcome, WrongAnswer):
            self.failed.add(w)
            self.last_error = outcome.error
            return [Strike(w, "invalid", f"answered job {job} wrongly ({outcome.error})", logging.WARNING), Retry()]
        if isinstance(outcome, Raised):
            return self._raised(w, outcome, now)
        if isinstance(outcome, JobPreempted):  # not billed: run again elsewhere if any other worker can, else here
            self.last_error = outcome
            self.preempted[w] += 1
            if not self.req.batch:
                # An honest worker never stops an interactive job for another: one that says so only wastes the
                # job's time (and collects its inputs).
                self.failed.add(w)
                return [Strike(w, "failure", f"stopped interactive job {job}"), Retry()]
            return [Say(f"Batch job {job} was stopped on worker {w[-8:]} for interactive work; running it again"),
                    Retry()]
        if isinstance(outcome, WorkerBusy):  # draining too: it takes nothing new
            self.last_error = outcome
            return [Busy(w), Retry(BUSY_PAUSE)]
        if isinstance(outcome, ProgramNotCached):
            self.resends += 1
            self.last_error = outcome
            if self.resends > self.max_resends:  # a worker that keeps losing it is failing after all
                self.failed.add(w)
            return [ProgramLost(w), Retry()]
        if isinstance(outcome, PayFirst) and self.pay_waits[w] < self.max_pay_waits:
            # Paying as this client goes, its countersignatures are on their way (or what its address owes is):
            # pay up, then the same worker again. Only a line that does not clear is a refusal.
            self.pay_waits[w] += 1
            self.last_error = outcome
            self.again = worker
            self.replicas.taken.add(w)  # still this copy's: another copy of a vote must not pick it meanwhile
            return [PayUp(w), Retry(PAY_PAUSE * 2 ** (self.pay_waits[w] - 1))]
        if isinstance(outcome, JobRejected):  # worker-specific (its limits, its price): another may take it
            self.rejections.append(outcome)
            self.failed.add(w)
            self.last_error = outcome
            if len(self.rejections) >= self.max_rejections:
                kind = DeadlineUnreachable if all(isinstance(r, DeadlineUnreachable) for r in self.rejections) \
                    else JobRejected
                n = len(self.rejections)
                return [Raise(kind(f"{n} worker{'s' if n != 1 else ''} refused job {job}; last: {outcome.reason}"))]
            return [Retry()]
        relayed = worker.record.reachability == "relayed"
        broken = isinstance(outcome, StreamBroken)  # the path's doing as often as the worker's: a few more tries
        if (isinstance(outcome, ProtocolError) or isinstance(outcome, NetworkError) and relayed) \
                and self.redialled[w] < (REDIALS if broken else 1):
            # A stream can break on the way without the worker being at fault: a relay resets its circuits now and
            # then (libp2p's limited relays after 128 KiB or 2 minutes), and under a burst of streams the p2p daemon
            # now and then closes one before the worker's answer is through (seen here about once in 700 jobs, 30 at
            # a time to one worker; a burst broke six jobs' streams twice each, with one worker to go to). Up to
            # REDIALS times per job and worker for a stream that broke (once for another protocol error: a malformed
            # or stalled answer is the worker's own), pausing more each time, try it again on a fresh stream before
            # holding it against it (the job id makes a retry safe: the worker answers it once, and bills it once).
            # A worker that could not be reached at all is not tried again.
            self.redialled[w] += 1
            self.last_error = outcome
            pause = 0.0 if self.redialled[w] == 1 else REDIAL_PAUSE * 2 ** (self.redialled[w] - 2)
            return [Say(f"The connection to worker {w[-8:]} broke ({outcome}); trying it again"), Retry(pause)]
        error = JobTimeout(f"worker {w[-8:]} took too long") if isinstance(outcome, TimeoutError) else outcome
        self.failed.add(w)
        self.last_error = error
        return [Strike(w, "timeout" if isinstance(error, JobTimeout) else "failure", f"failed job {job} ({error})"),
                Retry()]

    def _raised(self, w: str, outcome: Raised, now: float) -> list[Action]:
        """The job's own error, this worker says: the same inputs raise the same way anywhere. Not believed on its
        word (saying so gets rid of a job): this client's own run decides when the job is small enough, else a second
        worker drawn at random must name the same node and exception. Where another worker has already given a
        result, a claim this client has not confirmed is a disagreement, not the job's."""
        e, job = outcome.error, self.job_id[:12]
        self.failed.add(w)
        self.raised_error = self.last_error = e
        here, late = outcome.here, False
        if here is None and self.deadline - now <= LATE_SECONDS and self.runs_here:
            late = True  # said with no time left to check it: a job held to its end, as a timeout
        where = raised_where(e)
        agreed = [x for x, said in self.raised if said == where]
        if here is True or (here is None and not late and agreed and not self.replicas.delivered):
            # One place is where it raised: whoever named another lied.
            actions: list[Action] = [Strike(other, "failure") for other, said in self.raised if said != where]
            who = "this client's own run" if here is True else f"worker {agreed[0][-8:]}"
            error = JobRaised(f"{e} ({who} raised the same: the job's own error, held against no worker)")
            error.confirmed_here = here is True
            return actions + [Raise(error)]
        if here is False or late:
            why = "which this client ran" if here is False else "too late to check"
            return [Strike(w, "failure" if here is False else "timeout", f"said job {job} raised ({e}), {why}"),
                    Retry()]
        if not self.replicas.delivered:
            self.raised.append((w, where))
        return [Say(f"Worker {w[-8:]} says job {job} raised ({e}); asking another worker"), Retry()]


def raised_where(error: JobRaised) -> str:
    """Where a job raised, as a worker says (the node and the exception's type), to compare two workers' words."""
    text = str(error)
    return text[:text.index(":")] if ":" in text else text


def _names(ids: list[str]) -> str:
    return ", ".join(i[-8:] for i in ids) or "no worker"
