"""Inference sessions a worker holds: whose they are, how far they got, what memory they take, when they expire.

A pure state machine (no I/O, time passed in), like :mod:`gpunet.worker.state.admission`: the job path asks it before a
session step runs and tells it how the step went; the executor pool holds the state itself (docs/sessions.md).
A session is keyed by its client *and* its id, so no client can reach another's state, whatever id it guesses.
Its steps are billed by tabs (:mod:`gpunet.ledger.tabs`): the table keeps the open one and hands it out to be signed
when it is full, or when the session ends (closed, expired).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from gpunet.errors import JobRejected, SessionLost, WorkerBusy
from gpunet.ledger.tabs import Tab
from gpunet.protocol import PushTo, SessionStep
from gpunet.worker.state.limits import SessionLimits


@dataclass
class _Session:
    client_id: str
    program: str
    next_step: int
    expires: float
    ttl: float
    state_bytes: int
    running: bool = False
    lost: bool = False  # its state is gone (its executor restarted): no more steps, but its tab is still owed
    max_price: int | None = None
    host: str = ""
    tab: Tab = field(default_factory=Tab)
    #: The client asked to close it while a step ran: it ends when that step does. ``received``: the steps the client
    #: said it got answers to (None: an older client, every step done is billed).
    closing: bool = False
    received: int | None = None


@dataclass(frozen=True)
class Ended:
    """A session that ended, and the tab of its last steps (None when all were billed already). ``disclaimed``: the
    steps after those its client said it received, which ran here and are not billed (the close counts against the
    client, Admission.disclaimed: otherwise closing with ``received=0`` would get any open tab's work free)."""

    key: str
    client_id: str
    session_id: str
    program: str
    tab: Tab | None
    max_price: int | None
    host: str = ""
    disclaimed: Tab | None = None


# --- what a step that did not end well leaves to do (Sessions.step_failed; the job path carries them out) -----------


@dataclass(frozen=True)
class Reoffer:
    """Hold the input the step took from its push again: the step was refused as busy, and its client retries it."""

    data: bytes


@dataclass(frozen=True)
class PushOn:
    """Tell the next span's worker that no output comes from here: its step asks the client for its input."""

    to: PushTo


@dataclass(frozen=True)
class Bill:
    """Sign the tab of a session that ended (its client closed it while the step ran: what it received is owed)."""

    ended: Ended


@dataclass(frozen=True)
class Drop:
    """Free a session's state in the executor holding it."""

    key: str


Action = Reoffer | PushOn | Bill | Drop


class Sessions:
    """The sessions open on one worker."""

    def __init__(self, limits: SessionLimits = SessionLimits()):
        self.limits = limits
        self._open: dict[tuple[str, str], _Session] = {}
        self._bytes = 0

    @staticmethod
    def key(client_id: str, session_id: str) -> str:
        """The executor's name for a session's state (client ids are peer ids: no '/' in them)."""
        return f"{client_id}/{session_id}"

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._open)

    @property
    def owing(self) -> int:
        """Sessions with steps not billed yet (a leaving worker waits for their clients to close them)."""
        return sum(1 for s in self._open.values() if s.tab.steps)

    def begin(self, client_id: str, session_id: str, program: str, step: int, ttl: float, now: float,
              host: str = "", declared: int | None = None) -> int:
        """Check that this step may run now; returns the bytes a new session's state may take (its ``room``).
        Raises JobRejected (limits, wrong program, out-of-order step) or SessionLost (not held here).

        An opening reserves its room at once (``declared``, the size its client said its state takes, else all the
        room it may take), so openings need not wait for each other; the step's end puts the true size in its place."""
        s = self._open.get((client_id, session_id))
        if step == 0:
            if s is not None:
                raise JobRejected(f"session {session_id[:16]} is already open here; open a new one with a fresh id")
            mine = sum(1 for (c, _) in self._open if c == client_id)
            if mine >= self.limits.max_per_client:
                raise JobRejected(f"this client has {mine} sessions open here, the most this worker allows "
                                  f"(--max-sessions-per-client {self.limits.max_per_client}); close one first")
            # A relayed client is seen at its relay's circuit address, shared by every client of that relay: no
            # per-address session limit for those (a home worker's clients all come that way).
            by_host = bool(host) and "/p2p-circuit" not in host
            at_host = sum(1 for o in self._open.values() if o.host == host) if by_host else 0
            if at_host >= self.limits.max_per_host:
                raise JobRejected(f"clients at this address have {at_host} sessions open here, the most this worker "
                                  "allows one address; close one first")
            if len(self._open) >= self.limits.max_sessions:
                raise JobRejected(f"this worker holds {len(self._open)} sessions, as many as it takes; try another")
            cap = int(self.limits.max_bytes * self.limits.max_client_share)
            scopes = [lambda c, o: True, lambda c, o: c == client_id]
            if by_host:
                scopes.append(lambda c, o: o.host == host)
            # What each scope (the worker, this client, this address) holds, and of that what openings still
            # running have reserved: they may turn out smaller, or fail.
            held = [sum(o.state_bytes for (c, _), o in self._open.items() if mine(c, o)) for mine in scopes]
            pending = [sum(o.state_bytes for (c, _), o in self._open.items() if mine(c, o) and o.running
                           and o.next_step == 0) for mine in scopes]
            limits = [self.limits.max_bytes] + [cap] * (len(scopes) - 1)
            room = max(0, min(limit - h for limit, h in zip(limits, held)))
            if declared is not None and declared > room:
                later = declared <= min(limit - h + p for limit, h, p in zip(limits, held, pending))
                raise (WorkerBusy if later else JobRejected)(
                    f"the session's state takes {declared} bytes; this worker has {room} left for this client's "
                    "sessions now" + (" (others are opening)" if later else ""))
            reserved = room if declared is None else declared
            self._open[(client_id, session_id)] = _Session(client_id, program, 0, now + self._ttl(ttl),
                                                           self._ttl(ttl), reserved, running=True, host=host,
                                                           tab=Tab(secrets.token_hex(4)))
            self._bytes += reserved
            return reserved
        if s is None:
            raise SessionLost(f"session {session_id[:16]} is not held here (it expired, was closed, or this worker "
                              "restarted)")
        if s.lost:
            raise SessionLost(f"session {session_id[:16]} lost its state here (its executor restarted)")
        if s.closing:
            raise SessionLost(f"session {session_id[:16]} is being closed (its client asked to)")
        if s.program != program:
            raise JobRejected("a session's steps all run the program that opened it")
        if s.running:
            raise JobRejected("a session runs one step at a time: the previous step has not finished")
        if step != s.next_step:
            raise JobRejected(f"session {session_id[:16]} is at step {s.next_step}, not {step}")
        s.running = True
        s.ttl = self._ttl(ttl)
        return 0

    def done(self, client_id: str, session_id: str, state_bytes: int, now: float, *, input_hash: str,
             output_hash: str, flops: int, wall_time_us: int, started_at_us: int, ended_at_us: int,
             max_price: int | None, close: bool = False) -> Tab | Ended | None:
        """A step ran: it goes on the session's tab, and the session moves on (or, ``close``, ends). Returns the tab
        to sign when this step filled it, the session (its tab to sign) when this step ended it, else None."""
        s = self._open.get((client_id, session_id))
        if s is None:
            return None
        s.running = False
        if s.next_step == 0:  # the true size, in place of what its opening reserved
            self._bytes += state_bytes - s.state_bytes
            s.state_bytes = state_bytes
        s.tab.add(s.next_step, input_hash, output_hash, flops, wall_time_us, started_at_us, ended_at_us)
        s.max_price = max_price
        s.next_step += 1
        s.expires = now + s.ttl
        if close or s.closing:
            return self._end(client_id, session_id)
        if s.tab.full:
            tab, s.tab = s.tab, s.tab.next()
            return tab
        return None

    def failed(self, client_id: str, session_id: str, lost: bool) -> Ended | None:
        """A step did not run. A session that never opened ends; one whose state is gone (``lost``) takes no more
        steps and frees its memory, but stays until closed or expired: its tab is still owed. One its client asked to
        close meanwhile ends now: returned, to be billed."""
        s = self._open.get((client_id, session_id))
        if s is None:
            return None
        s.running = False
        if s.next_step == 0:
            self._end(client_id, session_id)
        elif s.closing:
            return self._end(client_id, session_id)
        elif lost and not s.lost:
            s.lost = True
            self._bytes -= s.state_bytes
            s.state_bytes = 0

    def step_failed(self, client_id: str, step: SessionStep, *, begun: bool, busy: bool, lost: bool,
                    pushed: bytes | None) -> list[Action]:
        """A step that did not end well (``begun``: it had passed :meth:`begin`; ``busy``: refused for a moment, its
        client retries it; ``lost``: the session's state is gone; ``pushed``: the input it took from its push), and
        what that leaves to do, in order."""
        actions: list[Action] = []
        if busy and pushed is not None:
            actions.append(Reoffer(pushed))
        if not busy and step.push_to is not None and self.is_open(client_id, step.id):
            actions.append(PushOn(step.push_to))
        if begun:
            ended = self.failed(client_id, step.id, lost=lost)
            if ended is not None:
                actions += [Bill(ended), Drop(ended.key)]
        return actions

    def running(self, client_id: str, session_id: str) -> bool:
        s = self._open.get((client_id, session_id))
        return s is not None and s.running

    def close(self, client_id: str, session_id: str, received: int | None = None) -> Ended | None:
        """The client is done with it (None if no such session is open, or a step of it is running: it then ends
        when that step does, billed as the client said here).
        ``received``: the steps the client says it got answers to, in all; the tab bills no step after those (a step
        whose answer was lost on the way is this worker's loss, not a debt the client would refuse whole)."""
        s = self._open.get((client_id, session_id))
        if s is None:
            return None
        s.closing, s.received = True, received
        if s.running:
            return None
        return self._end(client_id, session_id)

    def is_open(self, client_id: str, session_id: str) -> bool:
        return (client_id, session_id) in self._open

    def expired(self, now: float) -> list[Ended]:
        """End every session idle past its time; the executors free their state, the worker signs their tabs."""
        gone = [k for k, s in self._open.items() if not s.running and s.expires <= now]
        return [self._end(client_id, session_id) for client_id, session_id in gone]

    def end_all(self) -> list[Ended]:
        """The worker leaves: every session not running a step ends now."""
        return self.expired(float("inf"))

    def _end(self, client_id: str, session_id: str) -> Ended:
        s = self._open.pop((client_id, session_id))
        self._bytes -= s.state_bytes
        tab, disclaimed = s.tab, None
        if s.closing and s.received is not None:  # however it ends, no step past what its client said it received
            tab, disclaimed = tab.split(s.received - tab.first)
        return Ended(self.key(client_id, session_id), client_id, session_id, s.program, tab if tab.steps else None,
                     s.max_price, s.host, disclaimed if disclaimed is not None and disclaimed.steps else None)

    def _ttl(self, ttl: float) -> float:
        return max(1.0, min(ttl, self.limits.max_ttl))
