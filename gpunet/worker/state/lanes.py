"""Lanes: which admitted job runs next, what it is charged, and which batch job an interactive one stops.

A pure state machine, like :mod:`gpunet.worker.state.admission` (dask/distributed's worker state machine is the
model): the job path (:mod:`gpunet.worker.turns`) reports what happened (a job was admitted, ended, gave up waiting)
and carries out what it is told (:class:`Start` this job, :class:`Preempt` that one). Nothing here reads a socket,
sleeps or logs; the clock is injected. docs/market.md is the user's view of the same rules.

Three lanes, highest first:

``interactive``
    at the worker's ``--price``; never preempted.
``batch``
    at most the client's bid (``max_price``) and at least the *batch floor*; runs only while no interactive job
    waits; when every slot is taken and an interactive job arrives, the batch job that started last is stopped
    (preempted: not billed, its client runs it again elsewhere or later), unless its own counted work says it ends
    within PREEMPT_GRACE: then the interactive job waits for it, once, and no longer than that (see
    :meth:`Lanes._spared`).
``background``
    the volunteer's own standing job (``--background-job``): free, runs only when nothing else waits, stopped by any
    paying job.

The batch floor rises with interactive demand::

    floor = batch_price + (price - batch_price) * min(1, interactive / slots)

where ``interactive`` counts interactive jobs running or waiting and ``slots`` is ``--max-concurrent``. An idle
worker sells batch work at its ``--batch-price``; one whose every slot is wanted by interactive work asks the
interactive price. A batch job starts only while the floor is at or below its bid, and is charged the floor at that
moment (so a high bid buys a place, never a higher price: nobody gains by bidding above what they would pay).

Fair share: within a lane, each network address and, within it, each client has its own queue (first come, first
served), and the next job comes from the address, then the client, that has had the least executor time, counted in
seconds (weighted fair queueing; everyone in a lane pays the same price per TFLOP at a given moment, so equal time is
a share weighted by what each pays; identities are free, addresses less so, hence the address first). One that was
idle starts level with the least-served one waiting, so idle time is never banked against others. A job is charged
an estimate of its time when it starts (so several slots do not all go to one client before any job ends) and
corrected to its real time when it ends; a preempted job is not charged.

A preemption is attributed to the waiting job it was made for. If that job then leaves before it runs, the stop was
for nothing: its client is blamed (:class:`Blame`, which the worker counts as a stopped job against the client and its
address, as it counts cancelled ones), so a client cannot stop other people's batch work for free by sending and
withdrawing interactive jobs.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Callable

from gpunet.protocol import BACKGROUND, BATCH, INTERACTIVE, LANES  # highest priority first
#: Seconds over which lane load and client shares are averaged (exponential decay).
LOAD_HALF_LIFE = 30.0
#: The same for the rate of preemptions a worker publishes (stops are rare: a longer memory).
RATE_HALF_LIFE = 600.0
#: Seconds a waiting job of a higher lane waits for a batch job whose counted work says it ends by then, rather than
#: stopping it (given once per job).
PREEMPT_GRACE = 0.2
#: A job's time is estimated from the client's recent jobs, this weight on the newest.
EMA = 0.3
#: The most jobs one start runs as one forward (a leader and its riders).
MAX_ROWS = 64


@dataclass(eq=False)
class Ticket:
    """One admitted job as the lanes see it."""

    client: str
    lane: str = INTERACTIVE
    bid: int | None = None  # nano-credits per TFLOP the client pays at most (None: no bound)
    host: str = ""  # the client's network address ("": unknown, the client counts as an address of its own)
    job: str = ""  # the job's id, for people (the dashboard)
    seq: int = 0  # arrival order, set by enqueue
    started_at: float | None = None
    price: int = 0  # nano-credits per TFLOP it is charged, fixed when it starts
    estimate: float = 0.0  # seconds charged to its client's share when it started
    preempted: bool = False
    victim: "Ticket | None" = None  # a running job stopped so that this one could start
    spared_until: float | None = None  # left running for a waiting job until then (the grace, given once)
    #: Jobs with the same key may run as one forward (sessions' steps of one batched program in one executor: the
    #: worker's gpunet.worker.batching): when one starts, those of its lane waiting with the same key start with it
    #: as its riders, taking no slot of their own. None: it runs alone.
    rows: str | None = None
    leader: "Ticket | None" = None  # a rider's: the job holding the slot it rides on
    riders: list = field(default_factory=list)  # a leader's, while they run
    group: tuple = ()  # the jobs started together (the leader first), for the worker to meet them

    @property
    def running(self) -> bool:
        return self.started_at is not None

    @property
    def address(self) -> str:
        return self.host or self.client


@dataclass(frozen=True)
class Start:
    """Run this job now (it holds a slot until :meth:`Lanes.ended`)."""

    ticket: Ticket


@dataclass(frozen=True)
class Preempt:
    """Stop this running job (a job of a higher lane needs its slot); report it through :meth:`Lanes.ended`."""

    ticket: Ticket


@dataclass(frozen=True)
class Blame:
    """This job had another stopped for it, then left before it ran: count it against its client and address."""

    ticket: Ticket


@dataclass(frozen=True)
class Wake:
    """Call :meth:`Lanes.recheck` at ``at`` (the lanes' clock): a job left running for its grace may then be stopped."""

    at: float


Action = Start | Preempt | Blame | Wake


@dataclass
class _Decayed:
    """A quantity accumulated over time that forgets with a half-life (lane load, a client's recent share)."""

    value: float = 0.0
    at: float = 0.0
    half_life: float = LOAD_HALF_LIFE

    def read(self, now: float) -> float:
        return self.value * 0.5 ** (max(0.0, now - self.at) / self.half_life)

    def add(self, amount: float, now: float) -> None:
        self.value, self.at = self.read(now) + amount, now


@dataclass
class _Lane:
    """One lane's queues and fairness accounting: address -> client -> FIFO of tickets; executor seconds served per
    address and per client."""

    waiting: dict[str, dict[str, deque[Ticket]]] = field(default_factory=dict)
    served_address: dict[str, float] = field(default_factory=dict)
    served_client: dict[str, float] = field(default_factory=dict)
    recent: dict[str, _Decayed] = field(default_factory=dict)  # client -> executor seconds lately (its share)

    def tickets(self):
        return (t for clients in self.waiting.values() for queue in clients.values() for t in queue)


@dataclass
class Lanes:
    """The lanes of one worker: ``slots`` jobs run at once."""

    slots: int
    price: int  # interactive, nano-credits per TFLOP
    batch_price: int  # the batch floor when no interactive work is wanted; <= price
    clock: Callable[[], float] = time.monotonic
    #: Whether a running job may be stopped at all (a test can say no; the worker stops any).
    can_preempt: Callable[[Ticket], bool] = lambda ticket: True
    #: When a running job's own counted work says it ends (the lanes' clock), None while unknown: its dry run has not
    #: counted it yet (the worker asks its executor, which knows the count and the device's measured speed).
    expected_end: Callable[[Ticket], float | None] = lambda ticket: None
    running: set[Ticket] = field(default_factory=set)
    preemptions: int = 0  # clients' jobs stopped for a higher lane, in all (not the volunteer's background job)
    _lanes: dict[str, _Lane] = field(default_factory=lambda: {lane: _Lane() for lane in LANES})
    _typical: dict[str, float] = field(default_factory=dict)  # client -> its jobs' seconds (EMA)
    _stopping: set[Ticket] = field(default_factory=set)  # told to Preempt, not ended yet
    _busy: dict[str, _Decayed] = field(default_factory=lambda: {lane: _Decayed() for lane in LANES})
    _busy_at: float | None = None
    _stops: _Decayed = field(default_factory=lambda: _Decayed(half_life=RATE_HALF_LIFE))
    _seq: count = field(default_factory=count)

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError("a worker runs at least one job at a time")
        if not 0 <= self.batch_price <= self.price:
            raise ValueError("the batch price is between 0 and the interactive price")

    # --- what the market shows ---------------------------------------------------------------------------------------

    @property
    def floor(self) -> int:
        """The batch floor now, in nano-credits per TFLOP (see the module docstring)."""
        demand = min(self.slots, self.count(INTERACTIVE, running=False) +
                     sum(1 for t in self.running if t.lane == INTERACTIVE and t.leader is None))  # (riders: no slot)
        return self.batch_price + -(-(self.price - self.batch_price) * demand // self.slots)

    def charge(self, lane: str) -> int:
        """What a job of ``lane`` starting now is charged per TFLOP."""
        return {INTERACTIVE: self.price, BATCH: self.floor, BACKGROUND: 0}[lane]

    def count(self, lane: str, running: bool = True, waiting: bool = True) -> int:
        n = sum(1 for _ in self._lanes[lane].tickets()) if waiting else 0
        return n + (sum(1 for t in self.running if t.lane == lane) if running else 0)

    def load(self, lane: str = INTERACTIVE) -> float:
        """The share of this worker's slots ``lane`` has kept busy lately (0..1, decaying over about a minute)."""
        now = self.clock()
        self._account(now)
        total = LOAD_HALF_LIFE / math.log(2)  # what a lane busy on every slot all along would read
        return min(1.0, self._busy[lane].read(now) / total)

    def preemption_rate(self) -> float:
        """Jobs stopped for a higher lane per hour, lately (decaying over about a quarter of an hour): with
        :meth:`load`, what a batch client reads as its chance of being stopped here."""
        return self._stops.read(self.clock()) * math.log(2) / RATE_HALF_LIFE * 3600

    def shares(self, lane: str) -> dict[str, float]:
        """Each client's share of the executor time ``lane`` got lately (decaying; the shares sum to 1)."""
        now = self.clock()
        recent = {client: d.read(now) for client, d in self._lanes[lane].recent.items()}
        total = sum(recent.values())
        return {client: v / total for client, v in recent.items() if v > 1e-6 * total} if total > 0 else {}

    def wait_estimate(self, lane: str) -> float:
        """Seconds a job of ``lane`` admitted now would wait to start, roughly: what is left of the jobs running in its
        lane and the lanes above (those below are stopped for it) and the jobs waiting there, over the slots."""
        rank = LANES.index(lane)
        now, typical = self.clock(), self._typical_seconds()
        left = sum(max(0.0, self._typical.get(t.client, typical) - (now - t.started_at))
                   for t in self.running if LANES.index(t.lane) <= rank and t.leader is None)
        queued = sum(self._typical.get(t.client, typical) for above in LANES[:rank + 1]
                     for t in self._lanes[above].tickets())
        return (left + queued) / self.slots

    # --- stimuli -----------------------------------------------------------------------------------------------------

    def enqueue(self, ticket: Ticket) -> list[Action]:
        """A job was admitted: it waits in its lane (its address's, its client's queue there) until it may start."""
        self._add(ticket)
        return self._dispatch()

    def enqueue_all(self, tickets: list[Ticket]) -> list[Action]:
        """Jobs admitted together (the steps of one group message): all wait in their lanes before any may start, so
        that those of one ``rows`` key start as one forward."""
        for ticket in tickets:
            self._add(ticket)
        return self._dispatch()

    def _add(self, ticket: Ticket) -> None:
        if ticket.lane not in LANES:
            raise ValueError(f"unknown lane {ticket.lane!r}")
        ticket.seq = next(self._seq)
        lane = self._lanes[ticket.lane]
        clients = lane.waiting.get(ticket.address)
        if clients is None:
            # Active again: level with the least-served address waiting (or running, if none waits): no banked time.
            others = [lane.served_address.get(a, 0.0) for a in lane.waiting] or [
                lane.served_address.get(t.address, 0.0) for t in self.running if t.lane == ticket.lane]
            lane.served_address[ticket.address] = max(lane.served_address.get(ticket.address, 0.0),
                                                      min(others, default=0.0))
            clients = lane.waiting[ticket.address] = {}
        if ticket.client not in clients:  # the same within the address, between its clients
            others = [lane.served_client.get(c, 0.0) for c in clients] or [
                lane.served_client.get(t.client, 0.0) for t in self.running
                if t.lane == ticket.lane and t.address == ticket.address]
            lane.served_client[ticket.client] = max(lane.served_client.get(ticket.client, 0.0),
                                                    min(others, default=0.0))
            clients[ticket.client] = deque()
        clients[ticket.client].append(ticket)

    def withdraw(self, ticket: Ticket) -> list[Action]:
        """A waiting job left before it started (its client went away, its deadline passed, the worker paused)."""
        lane = self._lanes[ticket.lane]
        clients = lane.waiting.get(ticket.address, {})
        queue = clients.get(ticket.client)
        blame = []
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            self._drop_empty(ticket.lane, ticket.address, ticket.client)
            if ticket.victim is not None:  # another job was stopped for this one, for nothing
                blame.append(Blame(ticket))
                ticket.victim = None
        return blame + self._dispatch()

    def ended(self, ticket: Ticket, seconds: float | None = None) -> list[Action]:
        """A running job stopped (finished, failed, cancelled, preempted), after ``seconds`` in its executor."""
        if ticket not in self.running:
            return self._dispatch()
        now = self.clock()
        self._account(now)
        self.running.discard(ticket)
        if ticket.leader is not None:
            ticket.leader.riders.remove(ticket)
        elif ticket.riders:  # it left before its riders' forward ended: the slot is theirs until then
            heir, *rest = ticket.riders
            heir.leader, heir.riders, ticket.riders = None, rest, []
            for rider in rest:
                rider.leader = heir
        self._stopping.discard(ticket)
        seconds = max(0.0, seconds if seconds is not None else now - ticket.started_at)
        lane = self._lanes[ticket.lane]
        # A preempted job is not charged (the worker chose to stop it); any other is charged what it really took.
        correction = (0.0 if ticket.preempted else seconds) - ticket.estimate
        for served, key in ((lane.served_address, ticket.address), (lane.served_client, ticket.client)):
            if key in served:
                served[key] += correction
        if not ticket.preempted:
            old = self._typical.get(ticket.client)
            self._typical[ticket.client] = seconds if old is None else (1 - EMA) * old + EMA * seconds
            lane.recent.setdefault(ticket.client, _Decayed()).add(seconds, now)
        self._forget_idle(ticket.lane, ticket.address, ticket.client)
        return self._dispatch()

    def recheck(self) -> list[Action]:
        """Time passed (a :class:`Wake` is due): a job left running for its grace that has not ended is stopped now."""
        return self._dispatch()

    # --- internals ---------------------------------------------------------------------------------------------------

    def _dispatch(self) -> list[Action]:
        actions: list[Action] = []
        while sum(1 for t in self.running if t.leader is None) < self.slots:  # (riders take no slot)
            ticket = self._next()
            if ticket is None:
                break
            self._start(ticket)
            actions.append(Start(ticket))
            for rider in self._riders(ticket):
                self._start(rider)
                rider.leader = ticket
                ticket.riders.append(rider)
                actions.append(Start(rider))
            ticket.group = (ticket, *ticket.riders)
            for rider in ticket.riders:
                rider.group = ticket.group
        actions.extend(Preempt(t) for t in self._victims())
        now = self.clock()
        graces = [t.spared_until for t in self.running if t.spared_until is not None and t.spared_until > now]
        if graces and any(self._lanes[lane].waiting for lane in (INTERACTIVE, BATCH)):
            actions.append(Wake(min(graces)))
        return actions

    def _startable(self, lane: str, floor: int):
        """The first ticket of each client queue of ``lane`` that may start now (a batch bid reaching the floor)."""
        for address, clients in self._lanes[lane].waiting.items():
            for client, queue in clients.items():
                ticket = next((t for t in queue if lane != BATCH or t.bid is None or t.bid >= floor), None)
                if ticket is not None:
                    yield address, client, ticket

    def _next(self) -> Ticket | None:
        """The job to start next: the highest lane with one that may start; there its least-served address, that
        address's least-served client, oldest first."""
        floor = self.floor
        for name in LANES:
            lane = self._lanes[name]
            best = min(((lane.served_address.get(a, 0.0), lane.served_client.get(c, 0.0), t.seq, t)
                        for a, c, t in self._startable(name, floor)), default=None, key=lambda k: k[:3])
            if best is not None:
                return best[3]
        return None

    def _riders(self, leader: Ticket) -> list[Ticket]:
        """Jobs of the leader's lane waiting with its ``rows`` key, oldest first: one forward runs them all, so they
        delay nobody's turn (each is still charged its time in its client's share)."""
        if leader.rows is None:
            return []
        floor = self.floor
        return sorted((t for t in self._lanes[leader.lane].tickets() if t.rows == leader.rows and (
            leader.lane != BATCH or t.bid is None or t.bid >= floor)), key=lambda t: t.seq)[:MAX_ROWS - 1]

    def _start(self, ticket: Ticket) -> None:
        now = self.clock()
        self._account(now)
        lane = self._lanes[ticket.lane]
        lane.waiting[ticket.address][ticket.client].remove(ticket)
        self._drop_empty(ticket.lane, ticket.address, ticket.client, forget=False)
        ticket.price = self.charge(ticket.lane)
        ticket.started_at = now
        ticket.estimate = self._typical.get(ticket.client, self._typical_seconds())
        lane.served_address[ticket.address] = lane.served_address.get(ticket.address, 0.0) + ticket.estimate
        lane.served_client[ticket.client] = lane.served_client.get(ticket.client, 0.0) + ticket.estimate
        self.running.add(ticket)

    def _victims(self) -> list[Ticket]:
        """Running jobs to stop so that waiting jobs of a higher lane get slots: one for each waiting job that has
        none being stopped for it (a stop already under way whose job left serves the next one); background first,
        then batch, the last started first (the least work lost). Each is attributed to the job it is stopped for."""
        floor, now = self.floor, self.clock()
        waiters = {INTERACTIVE: sorted(self._lanes[INTERACTIVE].tickets(), key=lambda t: t.seq),
                   BATCH: sorted((t for _, _, t in self._startable(BATCH, floor)), key=lambda t: t.seq)}
        claimed = {t.victim for ts in waiters.values() for t in ts if t.victim in self._stopping}
        spare = [t for t in self._stopping if t not in claimed]
        victims: list[Ticket] = []
        for lane, below in ((INTERACTIVE, (BACKGROUND, BATCH)), (BATCH, (BACKGROUND,))):
            for waiter in waiters[lane]:
                if waiter.victim in self._stopping:
                    continue
                reusable = next((t for t in spare if t.lane in below), None)
                if reusable is not None:
                    spare.remove(reusable)
                    waiter.victim = reusable
                    continue
                candidates = sorted((t for t in self.running if t.lane in below and t not in self._stopping
                                     and t.leader is None
                                     and t not in victims and self.can_preempt(t) and not self._spared(t, now)),
                                    key=lambda t: (LANES.index(t.lane) != 2, -t.started_at, -t.seq))
                if not candidates:
                    break
                waiter.victim = candidates[0]
                victims.append(candidates[0])
        for ticket in victims:
            ticket.preempted = True
            self._stopping.add(ticket)
            if ticket.lane != BACKGROUND:  # the volunteer's own work yielding is not a client's job stopped
                self.preemptions += 1
                self._stops.add(1.0, now)
        return victims

    def _spared(self, ticket: Ticket, now: float) -> bool:
        """Whether a running job is left to end rather than stopped: its own counted work (not its client's history,
        which a client shapes with a few tiny jobs) says it ends within PREEMPT_GRACE, and within the time it has
        already run. The grace is given once, up to that expected end: a job past it (overrun: the count was
        optimistic, or the job is slower than it claimed) is stopped at the next look. Background work is always
        stopped."""
        if ticket.lane == BACKGROUND:
            return False
        if ticket.spared_until is not None:
            return now < ticket.spared_until
        end = self.expected_end(ticket)
        if end is None or end < now or end - now > min(PREEMPT_GRACE, now - ticket.started_at):
            return False
        ticket.spared_until = end
        return True

    def _account(self, now: float) -> None:
        """Integrate each lane's busy slots over the time since the last event (for :meth:`load`)."""
        if self._busy_at is not None and now > self._busy_at:
            elapsed = now - self._busy_at
            for lane in LANES:
                busy = sum(1 for t in self.running if t.lane == lane and t.leader is None)
                self._busy[lane].add(elapsed * busy / self.slots, now)
        self._busy_at = now

    def _typical_seconds(self) -> float:
        return sum(self._typical.values()) / len(self._typical) if self._typical else 1.0

    def _drop_empty(self, lane: str, address: str, client: str, forget: bool = True) -> None:
        """Remove a client's empty queue (and an address's empty map); ``forget``: their history too, unless a job of
        theirs still runs."""
        clients = self._lanes[lane].waiting.get(address)
        if clients is not None and client in clients and not clients[client]:
            del clients[client]
            if not clients:
                del self._lanes[lane].waiting[address]
        if forget:
            self._forget_idle(lane, address, client)

    def _forget_idle(self, lane: str, address: str, client: str) -> None:
        """An address or client with nothing waiting or running in a lane loses its history there (bounded memory;
        it comes back level with the others anyway). Recent shares decay on their own and go once negligible."""
        state = self._lanes[lane]
        clients = state.waiting.get(address, {})
        if client not in clients and not any(t.lane == lane and t.client == client for t in self.running):
            state.served_client.pop(client, None)
        if not clients and not any(t.lane == lane and t.address == address for t in self.running):
            state.served_address.pop(address, None)
        now = self.clock()
        for c in [c for c, d in state.recent.items() if d.read(now) < 1e-3]:
            del state.recent[c]
        if len(self._typical) > 10_000:
            self._typical.pop(next(iter(self._typical)))
