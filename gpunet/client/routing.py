"""Routing: which worker gets a job. Decides *who*; :mod:`gpunet.client.transport` decides *how*.

Pure: no I/O. The client reports each outcome (``on_success``, ``on_failure``, ``on_busy``, ``on_program_lost``)
and asks again.

Workers are filtered by the job's :class:`Requirements` and their state, then ranked by expected completion time::

    wait     = (record queue + this client's jobs in flight there) / max_concurrent * typical job time there
    transfer = bytes to send (inputs, plus weights unless the worker advertises the program) / bandwidth
    compute  = FLOPs from the dry run / the worker's credited throughput in the job's dtype (observed times refine it)

and by price (``prefer``: ``balanced`` sums both normalised, ``fastest`` time alone, ``cheapest`` price then time).
A batch job (``priority="batch"``, docs/market.md) is priced at each worker's batch floor now, and its time is
stretched by the worker's recent interactive load (the chance it is preempted there) and doubled where the floor is
above its bid (it waits there for the floor to fall): it goes where it is cheapest and least likely to be stopped.
With a ``deadline``, workers not expected to finish in time are left out, and if none is, the job is refused at once.
A worker's per-job overhead is learned from its answers; until then it is assumed a little better than the best
measured one, so a newcomer gets a job and a fair measurement instead of being starved by an incumbent. An estimate
that nothing has refreshed for a few seconds is treated the same way once, so a worker measured at a bad moment is
measured again.
Failing workers are banned with exponential backoff; a busy one is only skipped for a moment.

A worker's claimed throughput is credited only as far as it has proven it (:mod:`gpunet.speedproof`, challenged by
:mod:`gpunet.client.proofs`): at most ``SLACK`` times the proven speed, and, until its own proof is in, at most the
median proven worker's credited speed. A free identity claiming a huge speed therefore never outranks the typical
checked worker, and one that refuses challenges is in the end credited nothing. Speed *delivered* counts above speed
proven once: once a worker has run paid jobs whose results were checked, big enough for their FLOPs to dominate
(``on_delivered``), its credit is ``SLACK`` times what it delivered (counted FLOPs over the compute time this client
measured), whatever it proved: a worker that proves a fast device and then runs jobs slowly is scored by what it
delivered, and one that proved little at a busy moment but delivers more is credited that. Paid jobs nobody checked
only ever lower the credit.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Iterable, Literal, Sequence

from gpunet.client.reputation import Reputation
from gpunet.config import MAX_PRICE
from gpunet.dht.records import WorkerState
from gpunet.dht.records import WorkerEntry
from gpunet.errors import ConfigError, DeadlineUnreachable, NoWorkersAvailable
from gpunet.protocol import BATCH, CLIENT_LANES, INTERACTIVE, MAX_HOLDERS
from gpunet.speedproof import credit_cap
from gpunet.utils import LRU, host_of, human_seconds

GiB = 2**30
#: An unmeasured worker is assumed this much faster than the best measured one, so routing tries it once.
EXPLORE_DISCOUNT = 0.9
MAX_PROVEN = 4096  # workers whose proven speed a client remembers
#: How long a session keeps using a worker whose record lapsed (a loaded worker's heartbeat can come late).
LAPSE_GRACE = 60.0
#: A paid job teaches a worker's delivered speed only when it counted this much work and took this long (compute, as
#: this client measured it), and at least DELIVERED_OVERHEADS times the worker's learned per-job overhead: shorter, its
#: fixed costs (a round trip, loading inputs) would understate the device (an honest worker then shows at least 3/4
#: of its speed, well within SLACK).
DELIVERED_MIN_SECONDS = 1.0
DELIVERED_OVERHEADS = 4
DELIVERED_MIN_FLOPS = 1e9
#: Seconds after which a job that found only joining workers that fit looks again (the view refreshes meanwhile), and
#: how long a worker listed as joining is waited for at all (from when this client first saw it so).
JOINING_LOOK_AGAIN = 0.5
JOINING_PATIENCE = 60.0
#: ...and one that found the workers full of this client's own jobs, at the latest (it wakes when one of them ends).
FULL_LOOK_AGAIN = 1.0


def _check_number(name: str, value, positive: bool = False, why: str = "") -> float:
    """A Requirements figure as a float: a finite number in range (inf or nan would only fail later, elsewhere)."""
    try:
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int too big for a float
        number = math.inf
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ConfigError(f"Requirements.{name} must be a finite number {'above 0' if positive else '>= 0'}{why}, "
                          f"not {value!r}")
    return number


@dataclass(frozen=True)
class Requirements:
    """What a job needs from a worker. The user states needs; the network picks the machine."""

    device: Literal["any", "gpu", "cpu"] = "any"
    min_memory_gb: float = 0.0
    dtype: str | None = None  # "fp32" | "fp16" | "bf16": the worker must have measured throughput in it
    min_tflops: float = 0.0
    max_price: float | None = None  # credits per TFLOP
    timeout: float = 120.0  # seconds for the whole job, retries included
    prefer: Literal["balanced", "fastest", "cheapest"] = "balanced"
    redundancy: int = 1  # run on this many distinct workers and accept the majority (see gpunet.client.trust)
    #: "adaptive": spot-check workers against another worker, less often as they prove honest; "local-sample": the
    #: same schedule, but the check is the client's own computation of the job (no other worker is trusted).
    verify: Literal["none", "adaptive", "local-sample"] = "none"
    #: The program (its weights) is this client's: workers do not advertise it, do not keep it on disk, and run it
    #: only for clients that sent them its bytes (holding the weights is the capability to use them).
    private: bool = False
    #: Publish the program for anyone who names its hash (public checkpoints, a shared model's spans): workers run
    #: their copy for any client, and serve its pieces to any peer. By default (False) a worker runs a program it
    #: holds only for clients that sent it the bytes or prove they hold them (this client does, by itself): program
    #: hashes are published, and a hash alone is no capability.
    shared: bool = False
    #: The market lane (docs/market.md): "interactive", or "batch": cheaper, run only while no interactive job waits,
    #: stopped when one needs the slot and then run again (elsewhere or later) and paid once. For batch, ``max_price``
    #: is the bid: the job runs where the worker's batch floor is at or below it, and pays that floor.
    priority: Literal["interactive", "batch"] = INTERACTIVE
    #: When the result is due: a unix time, or a datetime (naive ones are local time). A job no worker is expected to
    #: finish by then is refused at once with the reason (DeadlineUnreachable), and none runs past it.
    deadline: float | datetime | None = None

    def __post_init__(self):
        if self.device not in ("any", "gpu", "cpu"):
            raise ConfigError(f"Requirements.device must be 'any', 'gpu' or 'cpu', not {self.device!r}")
        if self.prefer not in ("balanced", "fastest", "cheapest"):
            raise ConfigError(f"Requirements.prefer must be 'balanced', 'fastest' or 'cheapest', not {self.prefer!r}")
        for name in ("min_memory_gb", "min_tflops", "timeout"):  # plain floats from here (numpy's too)
            object.__setattr__(self, name, _check_number(name, getattr(self, name), positive=name == "timeout"))
        if self.max_price is not None:
            # No worker charges more than MAX_PRICE: a higher bid is that one (and fits in a receipt).
            object.__setattr__(self, "max_price", min(MAX_PRICE, _check_number(
                "max_price", self.max_price, why=" (credits per TFLOP; None for no limit)")))
        if isinstance(self.redundancy, bool) or not isinstance(self.redundancy, int) or not 1 <= self.redundancy <= 16:
            raise ConfigError("Requirements.redundancy must be between 1 and 16")
        if self.verify not in ("none", "adaptive", "local-sample"):
            raise ConfigError(f"Requirements.verify must be 'none', 'adaptive' or 'local-sample', not {self.verify!r}")
        if self.verify == "local-sample" and self.redundancy > 1:
            raise ConfigError("Requirements.verify='local-sample' checks one worker against this machine's own result; "
                              "it does not combine with redundancy > 1")
        if self.private and self.shared:
            raise ConfigError("Requirements.private and Requirements.shared exclude each other: a private program is "
                              "never published, a shared one is published for anyone")
        if self.priority not in CLIENT_LANES:
            raise ConfigError(f"Requirements.priority must be 'interactive' or 'batch', not {self.priority!r}")
        if isinstance(self.deadline, datetime):
            object.__setattr__(self, "deadline", self.deadline.timestamp())
        if self.deadline is not None and (isinstance(self.deadline, bool) or not isinstance(self.deadline, (int, float))
                                          or not math.isfinite(self.deadline) or self.deadline <= 0):
            raise ConfigError("Requirements.deadline must be a unix time (time.time() + seconds) or a datetime")

    @property
    def batch(self) -> bool:
        return self.priority == BATCH

    def refusal(self, entry: WorkerEntry) -> str | None:
        """Why ``entry`` cannot take this job, or None when it can."""
        if entry.record.state is not WorkerState.ONLINE:
            return f"is {entry.record.state.value}"
        return self.unfit(entry)

    def unfit(self, entry: WorkerEntry) -> str | None:
        """Why ``entry`` could not take this job even once online (a joining worker that fits is worth waiting for)."""
        r = entry.record
        if r.reachability == "unreachable":
            return "cannot be reached now (behind NAT, and no relay holds a reservation for it)"
        if self.device == "gpu" and r.device.kind != "cuda":
            return "has no GPU"
        if self.device == "cpu" and r.device.kind != "cpu":
            return "is not a CPU worker"
        if r.device.memory_free < self.min_memory_gb * GiB:
            return f"has {r.device.memory_free / GiB:.1f} GiB free (< {self.min_memory_gb:g})"
        if self.dtype is not None and self.dtype not in r.tflops:
            return f"does not run {self.dtype}"
        tflops = r.tflops.get(self.dtype, 0.0) if self.dtype else r.best_tflops
        if tflops < self.min_tflops:
            return f"measures {tflops:.3g} TFLOPS (< {self.min_tflops:g})"
        if self.max_price is not None and self.batch:
            least = r.batch_price if r.batch_price is not None else r.price  # no lanes: batch sells as interactive
            if least > self.max_price:
                return f"sells batch work from {least:g} credits/TFLOP (> the bid, {self.max_price:g})"
        elif self.max_price is not None and r.price > self.max_price:
            return f"charges {r.price:g} credits/TFLOP (> {self.max_price:g})"
        return None

    def price_at(self, entry: WorkerEntry) -> float:
        """What ``entry`` would charge this job now, credits per TFLOP (batch: its floor, as last published)."""
        r = entry.record
        if self.batch and r.batch_floor is not None:
            return r.batch_floor
        return r.price


@dataclass
class RoutingConfig:
    """Tuning knobs, with the defaults the client uses."""

    ban_base: float = 2.0  # seconds; doubles per consecutive failure
    ban_max: float = 300.0
    busy_cooldown: float = 0.5  # seconds a worker that answered "busy" is skipped
    default_bandwidth: float = 100e6  # bytes/s until measured
    peer_bandwidth: float = 100e6  # bytes/s a worker is assumed to fetch a program from another worker at
    default_overhead: float = 0.005  # seconds of round trip and scheduling per job, until measured
    ema: float = 0.3
    #: A worker's speed estimate that no job has refreshed for this many seconds is tried again: while none of this
    #: client's jobs is there, it ranks as unmeasured (optimistic), so one bad moment does not starve it for good.
    remeasure_after: float = 3.0


@dataclass
class _Ban:
    until: float = 0.0
    strikes: int = 0
    busy: bool = False  # a short skip after a "busy" answer, not a penalty


@dataclass(frozen=True)
class JobShape:
    """What routing needs to know about one job."""

    flops: int
    program_hash: str
    input_bytes: int
    program_bytes: int
    dtype: str | None = None
    private: bool = False  # Requirements.private: never fetched from peers
    #: Weights the program names by reference (docs/weights.md): their bytes, and the checkpoint they come from. A
    #: worker that advertises the checkpoint loads them from its disk; any other is sent them.
    weights_bytes: int = 0
    checkpoint: str | None = None


@dataclass
class Router:
    config: RoutingConfig = field(default_factory=RoutingConfig)
    workers: dict[str, WorkerEntry] = field(default_factory=dict)
    inflight: Counter = field(default_factory=Counter)
    bans: dict[str, _Ban] = field(default_factory=dict)
    known_programs: dict[str, set[str]] = field(default_factory=dict)  # worker id -> programs we sent it
    reputation: Reputation | None = None  # this client's record of real outcomes per worker
    bandwidth: float = 0.0
    _seconds_per_flop: dict[str, float] = field(default_factory=dict)  # observed, per worker
    _overhead: dict[str, float] = field(default_factory=dict)  # observed seconds a job costs beyond its FLOPs
    _bandwidth: dict[str, float] = field(default_factory=dict)  # observed bytes/s to each worker (the global one: prior)
    _measured_at: dict[str, float] = field(default_factory=dict)  # monotonic time of a worker's last sample
    #: Why each worker was left out the last time it was considered (not for per-job reasons such as "already failed
    #: this job", nor a moment's "busy"): the client says so once, so a skipped worker is never skipped silently.
    skipped: dict[str, str] = field(default_factory=dict)
    #: TFLOPS each worker proved to this client (gpunet.client.proofs); 0.0: it failed, or would not take a proof.
    #: Kept when a worker leaves (bounded), so leaving and coming back does not wipe a poor proof.
    proven: LRU[str, float] = field(default_factory=lambda: LRU(MAX_PROVEN))
    #: TFLOPS each worker delivered on this client's paid, checked jobs (an average of the recent ones; see
    #: on_delivered); where known it sets the worker's credit instead of its proof. Kept when a worker leaves.
    delivered: LRU[str, float] = field(default_factory=lambda: LRU(MAX_PROVEN))
    _unchecked: LRU[str, float] = field(default_factory=lambda: LRU(MAX_PROVEN))  # the same, of unchecked paid jobs
    _unproven_ceiling: float | None = None
    _joining_since: dict[str, float] = field(default_factory=dict)  # when this client first saw each one joining
    #: The interactive price (credits/TFLOP) each worker last advertised: the most it may bill in any lane (a batch
    #: floor never rises above it). Kept when its record lapses (bounded), so a session's last tab, billed by a
    #: worker that has just left, is still checked against what it asked.
    advertised: LRU[str, float] = field(default_factory=lambda: LRU(MAX_PROVEN))
    #: Workers whose record lapsed from the last refresh, and when (monotonic): see ``holding``.
    _lapsed: dict[str, tuple[WorkerEntry, float]] = field(default_factory=dict)

    def update(self, entries: Iterable[WorkerEntry], left: Iterable[str] = ()) -> None:
        """The workers as a look at the records found them. ``left``: ones whose tombstone it found (they said they
        left): not held for LAPSE_GRACE, as a record that lapsed is (see ``holding``)."""
        now, left = time.monotonic(), set(left)
        fresh = {e.id: e for e in entries}
        for gone in self.workers.keys() - fresh.keys():
            self._lapsed[gone] = (self.workers[gone], now)
        self._lapsed = {w: seen for w, seen in self._lapsed.items()
                        if w not in fresh and w not in left and now - seen[1] < LAPSE_GRACE}
        self.workers = fresh
        for worker_id in [w for w in self._joining_since if w not in self.workers
                          or self.workers[w].record.state is not WorkerState.JOINING]:
            del self._joining_since[worker_id]
        for entry in self.workers.values():
            self.advertised.put(entry.id, entry.record.price)
        for table in (self._overhead, self._seconds_per_flop, self._measured_at, self.skipped):
            for gone in table.keys() - self.workers.keys():  # what was known of workers that left
                del table[gone]
        self._set_ceiling()

    def holding(self, worker_id: str) -> WorkerEntry | None:
        """The entry of a worker this client holds state on (a session's span): its record, or, for LAPSE_GRACE after
        the record lapsed from a refresh, the last one seen. On a loaded machine a live worker's record can lapse for
        a moment; its state is still there, and a worker really gone fails the step itself (and the span moves)."""
        entry = self.workers.get(worker_id)
        if entry is None and worker_id in self._lapsed:
            entry, since = self._lapsed[worker_id]
            if time.monotonic() - since >= LAPSE_GRACE:
                return None
        return entry

    def lapsed_fallback(self, req: Requirements, exclude: set[str] = frozenset(),
                        avoid: set[str] = frozenset()) -> WorkerEntry | None:
        """The worker last seen of those whose record lapsed within half of LAPSE_GRACE (what is left covers a
        replay) that would otherwise be eligible: meets ``req`` (proven speed included), is not excluded, banned for
        failures or caught lying; one outside ``avoid`` first. A session span's last resort when no listed worker can
        take it: under load a live worker's heartbeat can come late (CI saw a session's two honest workers lapse
        together for over 10 s after it caught the third lying); one really gone fails the step, as a held span's
        does (see ``holding``)."""
        now = time.monotonic()
        fit = []
        for entry, since in sorted(self._lapsed.values(), key=lambda seen: -seen[1]):
            ban = self.bans.get(entry.id)
            if (now - since >= LAPSE_GRACE / 2 or entry.id in exclude or self._unmet(entry, req) is not None
                    or (self.reputation is not None and self.reputation.avoided(entry.id))
                    or (ban is not None and ban.until > now and not ban.busy)):
                continue
            fit.append(entry)
        return next((e for e in fit if e.id not in avoid), fit[0] if fit else None)

    def on_proof(self, worker_id: str, tflops: float) -> None:
        """A worker's speed proof came out at ``tflops`` (0.0: it failed, and its earlier proofs count for nothing);
        a valid proof asked again keeps the best one (a proof timed at a busy moment shows less than the device)."""
        earlier = self.proven.get(worker_id) or 0.0
        self.proven.put(worker_id, max(tflops, earlier) if tflops > 0 else 0.0)
        self._set_ceiling()

    def on_delivered(self, worker_id: str, flops: float, seconds: float, checked: bool = True) -> None:
        """A paid job counted ``flops`` and took ``seconds`` of compute at ``worker_id`` (this client's clock, less the
        transfer and its place in our queue there): speed the worker delivered, which no relayed or borrowed proof can
        fake. ``checked``: its result was checked (against another worker's or this client's own), so the speed is
        real work and sets the worker's credit; an unchecked one only ever lowers it (a wrong answer can come fast,
        a slow one is slow whatever it holds). Short jobs teach nothing (see DELIVERED_MIN_SECONDS)."""
        if flops < DELIVERED_MIN_FLOPS or seconds < max(DELIVERED_MIN_SECONDS,
                                                        DELIVERED_OVERHEADS * self._overhead.get(worker_id, 0.0)):
            return
        table = self.delivered if checked else self._unchecked
        old = table.get(worker_id)
        tflops, a = flops / seconds / 1e12, self.config.ema
        if not checked and (proven := self.proven.get(worker_id)) is not None:
            tflops = min(tflops, proven)  # fast unchecked answers must not average a slow one away
        table.put(worker_id, tflops if old is None else (1 - a) * old + a * tflops)
        self._set_ceiling()

    def _known_limit(self, worker_id: str) -> float | None:
        """What this client knows of a worker's speed, as the most it credits: ``credit_cap`` of what it delivered on
        paid, checked jobs where there is such a figure (it outweighs a one-time proof), else of its proof (lowered to
        what its unchecked paid jobs delivered); None: no figure of its own."""
        delivered = self.delivered.get(worker_id)
        if delivered is not None:
            return credit_cap(delivered)
        proven = self.proven.get(worker_id)
        return None if proven is None else self._lowered(worker_id, credit_cap(proven))

    def _lowered(self, worker_id: str, limit: float | None) -> float | None:
        """``limit``, or less where this worker's unchecked paid jobs delivered less (see on_delivered)."""
        unchecked = self.delivered.get(worker_id) is None and self._unchecked.get(worker_id)
        if not unchecked:
            return limit
        return credit_cap(unchecked) if limit is None else min(limit, credit_cap(unchecked))

    def _set_ceiling(self) -> None:
        """What a worker not proven yet is credited at most: the median credited speed of the proven (or measured)
        workers in view, so a claim alone never outranks the typical checked worker (and refusing challenges gains
        nothing)."""
        credited = sorted(min(e.record.best_tflops, limit) for e in self.workers.values()
                          if (limit := self._known_limit(e.id)) is not None and limit > 0)
        self._unproven_ceiling = credited[(len(credited) - 1) // 2] if credited else None

    def _stale(self, worker_id: str, now: float | None = None) -> bool:
        """Its estimate is old and none of our jobs is there: rank it as unmeasured, so it gets one probe job."""
        at = self._measured_at.get(worker_id)
        now = time.monotonic() if now is None else now
        return at is not None and now - at > self.config.remeasure_after and not self.inflight[worker_id]

    def credit_limit(self, entry: WorkerEntry) -> float | None:
        """The most TFLOPS routing credits this worker's best dtype: ``credit_cap`` of what it delivered, else of its
        proof; neither yet, the median proven worker's credit; None: no limit (nobody proven yet)."""
        known = self._known_limit(entry.id)
        return known if known is not None else self._lowered(entry.id, self._unproven_ceiling)

    def speed_factor(self, entry: WorkerEntry) -> float:
        """The share of its claimed throughput routing credits a worker: min(1, limit / claimed best)."""
        claimed, limit = entry.record.best_tflops, self.credit_limit(entry)
        return 1.0 if claimed <= 0 or limit is None else min(1.0, limit / claimed)

    def credited_tflops(self, entry: WorkerEntry, dtype: str | None = None) -> float:
        """The worker's claimed TFLOPS in ``dtype`` (its best without one), as far as it has proven them: its best
        claim up to :meth:`credit_limit` exactly, another dtype's claim scaled by :meth:`speed_factor` (and never over
        the limit: a scaled figure can round one bit over)."""
        r = entry.record
        claimed = (r.tflops.get(dtype) if dtype else None) or r.best_tflops
        limit = self.credit_limit(entry)
        if limit is None:
            return claimed
        if claimed >= r.best_tflops:
            return min(claimed, limit)
        return min(claimed * self.speed_factor(entry), limit)

    # --- filtering -------------------------------------------------------------------------------------------------

    def could_take(self, req: Requirements, now: float | None = None) -> int:
        """How many known workers could take a job of ``req`` now or in a moment (busy or briefly banned counts, and
        joining, for a while): what redundancy can count on."""
        now = time.monotonic() if now is None else now
        return sum(self._could_take(e, req, now) for e in self.workers.values())

    def _could_take(self, entry: WorkerEntry, req: Requirements, now: float) -> bool:
        """``entry`` meets ``req`` once online, and is online or joining since less than JOINING_PATIENCE (a record
        that says joining costs nothing: one that never comes online must not hold jobs back for long)."""
        state = entry.record.state
        if state is WorkerState.JOINING:
            if now - self._joining_since.setdefault(entry.id, now) > JOINING_PATIENCE:
                return False
        elif state is not WorkerState.ONLINE:
            return False
        if req.unfit(entry) is not None or (self.reputation is not None and self.reputation.avoided(entry.id)):
            return False
        return not req.min_tflops or self.credited_tflops(entry, req.dtype) >= req.min_tflops

    def _unmet(self, entry: WorkerEntry, req: Requirements) -> str | None:
        """Why ``entry`` does not meet ``req`` as its record says and as it proved its speed, or None."""
        why = req.refusal(entry)
        if why is None and req.min_tflops and (credited := self.credited_tflops(entry, req.dtype)) < req.min_tflops:
            why = f"proved only {credited:.3g} TFLOPS (< {req.min_tflops:g})"
        return why

    def eligible(self, req: Requirements, exclude: set[str] = frozenset(), now: float | None = None,
                 replicas: set[str] = frozenset()) -> list[WorkerEntry]:
        """Workers that meet ``req``, are not banned, did not fail this job (``exclude``) and do not run another copy
        of it (``replicas``); raises NoWorkersAvailable saying why not."""
        now = time.monotonic() if now is None else now
        ok, reasons = [], Counter()
        retry_at = None  # when the first temporarily excluded worker becomes eligible again
        for entry in self.workers.values():
            why = self._unmet(entry, req)
            if why is None and entry.id in exclude:
                why = "already failed this job"
            if why is None and entry.id in replicas:
                why = "already runs another copy of this job (redundancy needs distinct workers)"
            if why is None and self.reputation is not None and self.reputation.avoided(entry.id):
                why = "was caught returning wrong results (outvoted, or answers that failed checks)"
            if why is None and self.full(entry):  # our own jobs fill it: wait here for one to end, not be refused
                why = "is full (this client's jobs fill its queue)"
                retry_at = min(retry_at or math.inf, now + FULL_LOOK_AGAIN)
            ban = self.bans.get(entry.id)
            if why is None and ban is not None and ban.until > now:
                why = "is busy" if ban.busy else "is banned for recent failures"
                retry_at = ban.until if retry_at is None else min(retry_at, ban.until)
            if (entry.record.state is WorkerState.JOINING and entry.id not in exclude and entry.id not in replicas
                    and self._could_take(entry, req, now)):  # online in a moment (its speed proven, executors up)
                retry_at = min(retry_at or math.inf, now + JOINING_LOOK_AGAIN)
            if why is None:
                ok.append(entry)
                self.skipped.pop(entry.id, None)
            else:
                reasons[why] += 1
                if not (entry.id in exclude or entry.id in replicas or why == "is busy" or why.startswith("is full")):
                    self.skipped[entry.id] = why
        if not ok:
            if not self.workers:
                raise NoWorkersAvailable("no workers are online in this network")
            detail = "; ".join(f"{n} {why}" for why, n in reasons.most_common(6))
            error = NoWorkersAvailable(f"none of the {len(self.workers)} known workers meets the requirements: {detail}"
                                       if len(self.workers) > 1 else
                                       f"the one known worker does not meet the requirements: it {detail[2:]}")
            error.retry_at = retry_at
            raise error
        return ok

    # --- ranking ---------------------------------------------------------------------------------------------------

    def holds_program(self, entry: WorkerEntry, program_hash: str) -> bool:
        """Whether ``entry`` should have the program: it advertises it, or we sent it there since our last failure."""
        return program_hash in entry.record.programs or program_hash in self.known_programs.get(entry.id, ())

    def holders(self, program_hash: str, exclude: str = "") -> list[WorkerEntry]:
        """Workers that should hold the program, others than ``exclude``: where a worker lacking it may fetch it
        from; none banned for a recent failure (it may be gone). Directly reachable ones first (a relay's budget is
        the relayed worker's own jobs')."""
        now = time.monotonic()
        found = [e for e in self.workers.values() if e.id != exclude and e.record.reachability != "unreachable"
                 and self.holds_program(e, program_hash) and not self._failing(e.id, now)]
        return sorted(found, key=lambda e: e.record.reachability != "direct")

    def checkpoint_holders(self, job, exclude: str = "") -> tuple[str, ...]:
        """Workers whose records say they keep the checkpoint a job's weights by reference come from (directly
        reachable first; none failing lately), others than ``exclude``: where a worker lacking them fetches them."""
        checkpoint = getattr(job, "checkpoint", None)
        if checkpoint is None or not job.manifest.refs:
            return ()
        now = time.monotonic()
        found = [e for e in self.workers.values() if e.id != exclude and checkpoint in e.record.checkpoints
                 and e.record.reachability != "unreachable" and not self._failing(e.id, now)]
        return tuple(e.id for e in sorted(found, key=lambda e: e.record.reachability != "direct"))[:MAX_HOLDERS]

    def expected_seconds(self, entry: WorkerEntry, job: JobShape, unmeasured_overhead: float | None = None,
                         req: Requirements | None = None) -> float:
        r = entry.record
        tflops = self.credited_tflops(entry, job.dtype) or 1e-3
        stale = self._stale(entry.id)
        claimed = 1.0 / (tflops * 1e12)
        compute = (claimed if stale else self._seconds_per_flop.get(entry.id, claimed)) * job.flops
        # The program: already there, fetched from a peer that holds it (at peer_bandwidth: it does not use our
        # link), or sent by us.
        cached = self.holds_program(entry, job.program_hash)
        from_peer = not cached and not job.private and bool(self.holders(job.program_hash, exclude=entry.id))
        sent = job.input_bytes + (0 if cached or from_peer else job.program_bytes)
        if job.weights_bytes and not cached and not (job.checkpoint is not None and job.checkpoint in r.checkpoints):
            sent += job.weights_bytes  # no copy of the checkpoint there: this client sends the weights

        transfer = sent / (self._bandwidth.get(entry.id) or self.bandwidth or self.config.default_bandwidth)
        if from_peer:
            transfer += job.program_bytes / self.config.peer_bandwidth
        overhead = None if stale else self._overhead.get(entry.id)
        if overhead is None:
            overhead = self.unmeasured_overhead() if unmeasured_overhead is None else unmeasured_overhead
        batch = req is not None and req.batch
        # An interactive job waits only behind interactive work (batch work there is stopped for it).
        ahead = (r.queue if batch else max(0, r.queue - r.batch_queue)) + self.inflight[entry.id]
        wait = ahead / max(1, r.max_concurrent) * (compute + overhead)
        score = self.reputation.score(entry.id) if self.reputation is not None else 1.0
        seconds = (wait + transfer + compute + overhead) / max(score, 0.01)
        if batch:
            # Interactive work stops batch jobs: the busier it kept this worker lately, and the more batch jobs it
            # stopped lately (per hour: how many would fall within this job's time), the likelier a rerun. Above the
            # bid, the floor must fall before the job starts.
            seconds *= (1 + r.interactive_load) * (1 + r.preemptions_per_hour * seconds / 3600)
            if req.max_price is not None and req.price_at(entry) > req.max_price:
                seconds *= 2
        return seconds

    def unmeasured_overhead(self) -> float:
        """Optimistic until measured, so every new worker gets tried (exploration)."""
        return EXPLORE_DISCOUNT * min(self._overhead.values()) if self._overhead else self.config.default_overhead

    def rank(self, candidates: list[WorkerEntry], job: JobShape, req: Requirements,
             times: dict[str, float] | None = None) -> list[WorkerEntry]:
        if times is None:
            times = self.times(candidates, job, req)
        price = {e.id: req.price_at(e) for e in candidates}
        if req.prefer == "fastest":
            key = lambda e: (times[e.id], price[e.id])  # noqa: E731
        elif req.prefer == "cheapest":
            key = lambda e: (price[e.id], times[e.id])  # noqa: E731
        else:
            t_min = min(times.values())
            p_min = min(price.values())
            key = lambda e: times[e.id] / t_min + (price[e.id] / p_min if p_min > 0 else (1.0 if price[e.id] == 0 else 2.0))  # noqa: E731
        return sorted(candidates, key=key)

    def times(self, candidates: list[WorkerEntry], job: JobShape, req: Requirements) -> dict[str, float]:
        """Each candidate's expected seconds for the job (see the module docstring)."""
        guess = self.unmeasured_overhead()
        return {e.id: self.expected_seconds(e, job, guess, req) for e in candidates}

    def choose_checker(self, req: Requirements, exclude: set[str] = frozenset(), replicas: set[str] = frozenset(),
                       rng: random.Random | None = None) -> WorkerEntry:
        """A worker to check others' results with: drawn at random among the eligible ones, not ranked by price or
        claimed speed (two identities advertising the lowest price and the highest speed would otherwise get both
        replicas and confirm each other's lies); established ones first (see Reputation.established), and from a
        network address none of the job's other replicas comes from, where there is such a worker."""
        candidates = self.eligible(req, exclude, replicas=replicas)
        if self.reputation is not None:
            candidates = [e for e in candidates if self.reputation.established(e.id)] or candidates
        taken = {_origin(self.workers[w]) for w in replicas if w in self.workers}
        candidates = [e for e in candidates if _origin(e) not in taken] or candidates
        return (rng or _rng).choice(candidates)

    def choose(self, req: Requirements, job: JobShape, exclude: set[str] = frozenset(),
               replicas: set[str] = frozenset(), avoid: set[str] = frozenset(),
               within: float | None = None, prefer: Sequence[str] = ()) -> WorkerEntry:
        """The best eligible worker; ``avoid``: workers to pass over while any other is eligible (those holding a
        model's other spans: spreading them is what lets a model bigger than one worker run at all); ``within``:
        seconds left before the job's deadline (DeadlineUnreachable when no worker is expected to finish by then);
        ``prefer``: workers taken first, in order, when eligible and not avoided (those holding the same span for
        other sessions, which batch their steps)."""
        candidates = self.eligible(req, exclude, replicas=replicas)
        times = self.times(candidates, job, req)
        if within is not None:  # the deadline first: a worker passed over may still be the only one in time
            soonest = min(candidates, key=lambda e: times[e.id])
            candidates = [e for e in candidates if times[e.id] <= within]
            if not candidates:
                raise DeadlineUnreachable(
                    f"no worker is expected to finish the job before its deadline, {human_seconds(within)} away: the "
                    f"soonest ({soonest.id[-8:]}) would take about {human_seconds(times[soonest.id])}")
        candidates = [e for e in candidates if e.id not in avoid] or candidates
        preferred = {e.id: e for e in candidates if e.id not in avoid}
        found = next((preferred[w] for w in prefer if w in preferred), None)
        return found or self.rank(candidates, job, req, times)[0]

    # --- outcomes --------------------------------------------------------------------------------------------------

    def full(self, entry: WorkerEntry) -> bool:
        """Whether this client's jobs in flight there fill its share of the worker (running and queued): one more
        would be answered "busy" and wait out a cooldown, where waiting here for one of ours to end loses nothing."""
        places = entry.record.client_places
        return places is not None and self.inflight[entry.id] >= places

    def started(self, worker_id: str) -> int:
        """Count a job sent to ``worker_id``; returns how many of this client's jobs were already there ahead of it
        (pass it back to :meth:`on_success`)."""
        ahead = self.inflight[worker_id]
        self.inflight[worker_id] += 1
        return ahead

    def finished(self, worker_id: str) -> None:
        self.inflight[worker_id] -= 1
        if self.inflight[worker_id] <= 0:
            del self.inflight[worker_id]

    def on_success(self, worker_id: str, job: JobShape, seconds: float, bytes_sent: int, transfer_seconds: float,
                  cold: bool = False, ahead: int = 0) -> float | None:
        """Learn from a finished job. ``cold``: the worker had to receive and load the program first; that one-time
        cost says nothing about its next jobs, so only bandwidth is learned from it (else one cold start would rank
        a worker last for dozens of jobs, and load would pile onto whichever worker happened to warm up first).

        ``ahead``: this client's jobs that were at the worker before this one (from :meth:`started`). The time
        measured includes waiting behind them, which :meth:`expected_seconds` already counts as ``wait``; learning
        it as the job's own cost too would count the queue twice, so a worker that had been kept busy looked slow
        and got starved (one demo run split 200 jobs 150/43/7). The sample is the time per place in that queue.

        Returns that sample (the job's compute seconds; None for a cold job): what :meth:`on_delivered` learns from
        once the result is checked and paid."""
        self.bans.pop(worker_id, None)  # a success wipes the strikes
        self.known_programs.setdefault(worker_id, set()).add(job.program_hash)
        a = self.config.ema
        if bytes_sent > 1 << 20 and transfer_seconds > 0:
            measured = bytes_sent / transfer_seconds
            self.bandwidth = measured if not self.bandwidth else (1 - a) * self.bandwidth + a * measured
            _ema(self._bandwidth, worker_id, measured, a)  # a relayed or far worker's own, slower, link
        if cold:
            return None
        entry = self.workers.get(worker_id)
        places = 1 + ahead / max(1, entry.record.max_concurrent if entry is not None else 1)
        compute = (seconds - transfer_seconds) / places
        now = time.monotonic()
        at = self._measured_at.get(worker_id)
        if at is not None and now - at > self.config.remeasure_after:  # a re-measurement replaces the old estimate
            self._overhead.pop(worker_id, None)
            self._seconds_per_flop.pop(worker_id, None)
        self._measured_at[worker_id] = now
        if job.flops >= 1e9 and compute > 0:  # only jobs big enough for their FLOPs to dominate teach throughput
            _ema(self._seconds_per_flop, worker_id, compute / job.flops, a)
        else:
            _ema(self._overhead, worker_id, max(0.0, compute), a)
        return compute

    def _failing(self, worker_id: str, now: float) -> bool:
        """Banned for a failure (not for being busy): not named to other workers as a holder meanwhile."""
        ban = self.bans.get(worker_id)
        return ban is not None and not ban.busy and ban.until > now

    def on_failure(self, worker_id: str, now: float | None = None) -> float:
        """Ban ``worker_id`` for ban_base * 2^(strikes-1) seconds (capped); returns the ban's length."""
        now = time.monotonic() if now is None else now
        ban = self.bans.setdefault(worker_id, _Ban())
        ban.strikes += 1
        ban.busy = False
        length = min(self.config.ban_max, self.config.ban_base * 2 ** (ban.strikes - 1))
        ban.until = now + length
        self.known_programs.pop(worker_id, None)
        return length

    def on_program_lost(self, worker_id: str, program_hash: str) -> None:
        """The worker no longer holds a program we sent it (evicted): the next job there carries it again."""
        self.known_programs.get(worker_id, set()).discard(program_hash)

    def on_busy(self, worker_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        ban = self.bans.setdefault(worker_id, _Ban())
        if ban.until <= now + self.config.busy_cooldown:
            ban.until = now + self.config.busy_cooldown
            ban.busy = True

    def capacity(self, req: Requirements) -> int:
        """Jobs the eligible workers can run at once (sizes ``map``'s window); 0 when none is eligible."""
        try:
            return sum(e.record.max_concurrent for e in self.eligible(req))
        except NoWorkersAvailable:
            return 0


_rng = random.SystemRandom()  # checker draws must not be predictable by the workers being checked


def _origin(entry: WorkerEntry) -> str:
    """The network address a worker advertises (its first), for telling apart workers on different machines."""
    return host_of(entry.record.maddrs[0]) if entry.record.maddrs else entry.id


def _ema(table: dict[str, float], key: str, value: float, alpha: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - alpha) * old + alpha * value
