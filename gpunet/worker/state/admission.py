"""Which jobs a worker takes, and how many it holds: a pure state machine, apart from the I/O that serves jobs.

Like dask/distributed's ``worker_state_machine``, nothing here reads a socket, sleeps or logs; the job path
(:mod:`gpunet.worker.jobs`) reports what happened (admitted, started, ended, stopped, stream opened and closed) and
asks what to do. The clock is injected, so the stopped-jobs window is tested without waiting.

Rules, in the order a submit meets them:

1. (job ids are each client's own: the job path keys jobs and receipts by client and id;)
2. the worker's price in the job's lane (interactive: ``--price``; batch: the lowest its floor goes,
   ``--batch-price``; see :mod:`gpunet.worker.state.lanes`) must be within the job's bound; its timeout and inputs within
   this worker's limits;
3. the worker's credit line, since outputs go out before their payment (the client must be able to compare them
   first): a client holding ``OUTSTANDING_FACTOR * max_unpaid_jobs`` results not yet countersigned, whatever their
   age, hears :class:`~gpunet.errors.PayFirst` (a paying client waits for its countersignatures to land and asks
   again), and so do all clients of an address once they hold ``host_credit_factor`` times that together (identities
   are free: a fresh one from the same address adds nothing; see :func:`credit_address`). A client that holds
   ``max_unpaid_jobs`` results it has not countersigned for longer than ``countersign_grace`` (refused, or never
   answered) is refused outright until it pays or they age out of ``unpaid_window``; an address holds
   ``host_stops_factor`` times as many;
3b. a client that stopped ``max_stopped_jobs`` running jobs within ``stopped_jobs_window`` seconds is refused until
   the oldest stop ages out (each stop costs the worker a fresh executor; a job that crashes its executor or runs
   past its timeout counts as a stop too, a crash several times over, and so does a dry run's time, once per
   ``dry_run_seconds_per_stop``: it is paid by no receipt, see :meth:`Admission.dry_ran`);
3c. so is one that closed ``max_unpaid_jobs`` inference sessions within ``unpaid_window`` saying it did not receive
   steps that ran (not billed, see :meth:`Admission.disclaimed`); an address, ``host_stops_factor`` times as many;
4. (the job path then answers a retry of a known job id from its result, without admitting it again;)
5. a draining worker takes nothing new; a full one (``max_concurrent`` running + ``max_queue`` queued) answers busy,
   and so does one where this client already holds ``max_jobs_per_client`` places. Each lane has places of its own,
   so batch work queued to the brim never makes an interactive job hear busy;
6. a job whose bytes must still arrive is an *upload*, not a queued job: it takes no queue place until its bytes are
   in (so idle streams cannot make a worker busy for everyone); at most ``max_uploads_per_client`` (per peer id) and
   ``max_uploads_per_host`` (per network address: identities are free, addresses less so) run at once, and each
   payload's declared size is charged to the worker's ``max_buffered_bytes`` before a byte of it is read. The charge
   is given back when the job ends (its bytes are held until then); a result is held against the same share while it
   is written to its client (:meth:`Admission.hold`).

Speed challenges (:mod:`gpunet.speedproof`) are free work for whoever asks, so they are rationed apart from jobs: one
at a time, ``max_proofs_per_minute`` in all, one per client per ``proof_interval``, and each may be opened once, by the
client that sent it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from gpunet.errors import JobRejected, PayFirst, ProtocolError, WorkerBusy, WorkerDraining
from gpunet.ledger.receipts import format_credits
from gpunet.protocol import BATCH, INTERACTIVE, Submit
from gpunet.utils import LRU, When, host_of, human_bytes
from gpunet.worker.state.limits import ServiceLimits

MAX_TRACKED_CLIENTS = 10_000
#: Results a client may hold uncountersigned at once, whatever their age, in units of max_unpaid_jobs: an honest
#: client's countersignatures trail its jobs by a job or a batch delay, never by dozens.
OUTSTANDING_FACTOR = 4


def credit_address(host: str) -> str:
    """The address whose credit line a client's results count against (``host``: as :func:`host_of` gives it). A
    client behind a relay (``.../p2p/<relay>/p2p-circuit``) counts against its relay's network address: the relay
    vouches for no client address, and relays are free identities too, so one per relay would be one line per
    identity again; an attacker's own relays sit on its own address. Where the relay's address is not known, the
    relay itself (its peer id) is the key, or else the whole circuit address (never none: that would be no line)."""
    if "/p2p-circuit" not in host:
        return host
    relay = host[:host.index("/p2p-circuit")]
    return host_of(relay) if relay.startswith(("/ip4/", "/ip6/")) else relay or host


@dataclass
class _Proof:
    """A client's last speed challenge: when, which, how many products the worker committed to, whether opened."""

    at: float
    seed: bytes
    n: int
    products: int | None = None
    opened: bool = False


class Admission:
    """The worker's job counts and admission decisions. Use from one event loop's thread."""

    def __init__(self, *, price_nano: int, max_concurrent: int, max_queue: int,
                 limits: ServiceLimits = ServiceLimits(), clock: Callable[[], float] = time.monotonic,
                 batch_price_nano: int | None = None):
        self.price_nano = price_nano  # per TFLOP, interactive
        self.batch_price_nano = price_nano if batch_price_nano is None else batch_price_nano  # the batch floor's least
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.limits = limits
        self.clock = clock
        self.accepting = True
        self.paused: str | None = None  # why the owner has the machine now (gpunet.worker.state.availability)
        self.admitted = 0  # jobs holding a place: queued or running
        self.running = 0
        # Job streams open, from their submit until the countersignature is read: a result on its way out, or its
        # payment on its way in, keeps the worker from leaving (counted from the start, so no hand-off gap exists
        # between a job's release and its delivery).
        self.streams = 0
        self.jobs_done = 0
        self.buffered_bytes = 0  # declared payload bytes charged (uploads in progress and jobs holding their bytes)
        self._uploads_by_client: dict[str, int] = {}
        self._uploads_by_host: dict[str, int] = {}
        self._bytes_by_client: dict[str, int] = {}
        self._bytes_by_host: dict[str, int] = {}
        self._places_by_client: dict[tuple[str, str], int] = {}  # (client, lane) -> places held
        self._places_by_lane: dict[str, int] = {}
        self._stops: LRU[str, deque[float]] = LRU(MAX_TRACKED_CLIENTS)  # per client: when it stopped running jobs
        self._host_stops: LRU[str, deque[float]] = LRU(MAX_TRACKED_CLIENTS)  # the same, per address
        self._dry_carry: LRU[str, float] = LRU(MAX_TRACKED_CLIENTS)  # dry runs' time short of a whole stop
        self._host_dry_carry: LRU[str, float] = LRU(MAX_TRACKED_CLIENTS)
        # Per client and per address: when it closed a session disclaiming steps that ran (see disclaimed()).
        self._disclaims: LRU[str, deque[float]] = LRU(MAX_TRACKED_CLIENTS)
        self._host_disclaims: LRU[str, deque[float]] = LRU(MAX_TRACKED_CLIENTS)
        # Delivered, not yet paid, as (delivered at, address): per client by job id, per address by (client, job id).
        self._owed: LRU[str, dict[str, tuple[float, str]]] = LRU(MAX_TRACKED_CLIENTS)
        self._owed_by_host: LRU[str, dict[tuple[str, str], tuple[float, str]]] = LRU(MAX_TRACKED_CLIENTS)
        # Jobs past the credit lines and not yet delivered (client, job id) -> address: counted against both lines,
        # so that jobs screened at once cannot together take more than the line allows.
        self._coming: dict[tuple[str, str], str] = {}
        self._coming_by_client: dict[str, int] = {}
        self._coming_by_host: dict[str, int] = {}
        self._paid_clients: LRU[str, bool] = LRU(MAX_TRACKED_CLIENTS)  # clients that have countersigned here
        self._hosts: LRU[str, str] = LRU(MAX_TRACKED_CLIENTS)  # the address each client's last stream came from
        self._proofs: LRU[str, _Proof] = LRU(MAX_TRACKED_CLIENTS)  # each client's last speed challenge
        self._recent_proofs: deque[float] = deque()
        self.proving = False
        self._drained = When(lambda: not self.accepting and self.active == 0)

    @property
    def queue_length(self) -> int:
        return self.admitted - self.running

    @property
    def active(self) -> int:
        """Jobs not finished with: admitted (queued or running), or on a stream still open (a result going out, a
        countersignature coming in). Draining waits for 0."""
        return self.admitted + self.streams

    # --- decisions -------------------------------------------------------------------------------------------------

    def screen(self, client_id: str, submit: Submit, host: str = "") -> None:
        """Raise JobRejected (or ProtocolError) if this worker must refuse the job outright, whatever its load."""
        if submit.max_price is not None and submit.lane == BATCH and submit.max_price < self.batch_price_nano:
            raise JobRejected(f"this worker sells batch work at {format_credits(self.batch_price_nano)} credits/TFLOP "
                              f"or more, above the job's bid {format_credits(submit.max_price)}")
        if submit.max_price is not None and submit.lane != BATCH and submit.max_price < self.price_nano:
            raise JobRejected(f"this worker's price {format_credits(self.price_nano)} credits/TFLOP is above the job's "
                              f"bound {format_credits(submit.max_price)}")
        if submit.timeout > self.limits.max_timeout:
            raise ProtocolError(f"timeout must be in (0, {self.limits.max_timeout:g}] seconds")
        if submit.inputs_size > self.limits.max_input_bytes:
            raise JobRejected(f"inputs of {human_bytes(submit.inputs_size)} exceed this worker's limit of "
                              f"{human_bytes(self.limits.max_input_bytes)}")
        self._screen_credit(client_id, credit_address(host))
        stopped = self.recent_stops(client_id)
        if stopped >= self.limits.max_stopped_jobs:
            raise JobRejected(f"this client stopped, timed out or crashed running jobs here {stopped} times in the last "
                              f"{self.limits.stopped_jobs_window / 60:.0f} min (each costs this worker a fresh "
                              "executor; a slow dry run counts too); it takes no more of its jobs for now")
        if host and self._recent(self._host_stops, host) >= self.limits.max_stopped_jobs * self.limits.host_stops_factor:
            raise JobRejected("clients at this address stopped, timed out or crashed too many running jobs here "
                              f"in the last {self.limits.stopped_jobs_window / 60:.0f} min (a slow dry run counts "
                              "too); no more of their jobs for now")
        window = self.limits.unpaid_window
        disclaims = self._recent(self._disclaims, client_id, window)
        if disclaims >= self.limits.max_unpaid_jobs:
            raise JobRejected(f"this client closed {disclaims} sessions here in the last {window / 60:.0f} min saying "
                              "it did not receive steps that ran (not billed); it takes no more of its jobs for now")
        if host and self._recent(self._host_disclaims, host, window) >= self.limits.max_unpaid_jobs * \
                self.limits.host_stops_factor:
            raise JobRejected("clients at this address disclaimed too many session steps that ran here; no more of "
                              "their jobs for now")

    def _screen_credit(self, client_id: str, address: str) -> None:
        """The credit lines: results owed long past the grace are refused outright; results owed at once, by the
        client or by every client of its address together, are :class:`PayFirst` (a paying client's countersignatures
        are on their way)."""
        overdue = self.overdue(client_id)
        if overdue >= self.limits.max_unpaid_jobs:
            raise JobRejected(f"this client has not paid for {overdue} results this worker delivered (no "
                              f"countersignature within {self.limits.countersign_grace:.0f} s, or refused); it takes "
                              "no more of its jobs until they are countersigned or an hour has passed")
        by_host = self._owed_by_host.get(address) if address else None
        if by_host and self._overdue(by_host) >= self.limits.max_unpaid_jobs * self.limits.host_stops_factor:
            raise JobRejected("clients at this address have not paid for too many results from this worker; no more "
                              "of their jobs for now")
        line = self.credit_line
        outstanding = len(self._owed.get(client_id) or ()) + self._coming_by_client.get(client_id, 0)
        if outstanding >= line:
            raise PayFirst(f"this client holds {outstanding} results from this worker not yet countersigned; it "
                           "takes no more of its jobs until they are")
        held = len(by_host or ()) + self._coming_by_host.get(address, 0)  # (aged-out entries dropped above)
        if address and held >= int(line * self.limits.host_credit_factor):
            raise PayFirst(f"clients at this address hold {held} results from this worker not yet countersigned; it "
                           "takes no more of their jobs until they are")

    @property
    def credit_line(self) -> int:
        """Results one client may hold uncountersigned at once (``protocol.CREDIT_LINE`` with the default limits)."""
        return OUTSTANDING_FACTOR * self.limits.max_unpaid_jobs

    def owed_by_address(self, host: str) -> int:
        """Results delivered to the clients of ``host``'s address and not yet countersigned (within the window)."""
        owed = self._owed_by_host.get(credit_address(host))
        self._overdue(owed)
        return len(owed or ())

    @property
    def max_jobs_per_client(self) -> int:
        """Places one client may hold: all running slots, but never the whole queue (others can always get in line)."""
        return self.max_concurrent + self.max_queue // 2

    def check_share(self, client_id: str, host: str = "") -> None:
        """WorkerBusy while the client (or its address) holds its whole share of the payload buffer: payloads on
        their way in, or results being written to it that it has not read (a new job would add to them)."""
        share = int(self.limits.max_buffered_bytes * self.limits.buffer_share)
        if self._bytes_by_client.get(client_id, 0) >= share or (host and self._bytes_by_host.get(host, 0) >= share):
            raise WorkerBusy("this client (or its address) holds its share of this worker's buffer: payloads on their "
                             "way in, or results it has not read yet", self.queue_length)

    def has_room(self, client_id: str, lane: str = INTERACTIVE) -> bool:
        """Whether ``admit(client_id, lane)`` would succeed now; WorkerBusy while draining. Asked before a job's bytes
        are read, so nobody uploads to a worker that would answer busy anyway."""
        if not self.accepting:
            raise WorkerDraining("worker is draining: it finishes running jobs and takes no new ones", self.queue_length)
        if self.paused is not None:
            raise self.pause_error()
        return (self._places_by_lane.get(lane, 0) < self.max_concurrent + self.max_queue
                and self._places_by_client.get((client_id, lane), 0) < self.max_jobs_per_client)

    def pause_error(self) -> WorkerDraining:
        """What a client hears from a paused worker: busy, as from one leaving (a session's span moves on)."""
        return WorkerDraining(f"worker is paused ({self.paused}); it takes no jobs for now", self.queue_length)

    def admit(self, client_id: str, lane: str = INTERACTIVE) -> bool:
        """Take a place for a job whose bytes are all here: True if taken, False when full (answer busy)."""
        if not self.has_room(client_id, lane):
            return False
        self.admitted += 1
        _count(self._places_by_client, (client_id, lane), +1)
        _count(self._places_by_lane, lane, +1)
        return True

    def begin_upload(self, client_id: str, host: str) -> bool:
        """Count an upload in progress from this client and address; False when either is at its limit (busy)."""
        if (self._uploads_by_client.get(client_id, 0) >= self.limits.max_uploads_per_client
                or self._uploads_by_host.get(host, 0) >= self.limits.max_uploads_per_host):
            return False
        _count(self._uploads_by_client, client_id, +1)
        _count(self._uploads_by_host, host, +1)
        return True

    def upload_done(self, client_id: str, host: str) -> None:
        """The upload's bytes are all in (or it failed): it no longer counts as an upload in progress."""
        _count(self._uploads_by_client, client_id, -1)
        _count(self._uploads_by_host, host, -1)

    def charge(self, nbytes: int, client_id: str = "", host: str = "", dry: bool = False) -> None:
        """Charge a payload's declared size before any of it is read; WorkerBusy when the buffer (or this client's or
        address's share of it) is full for now, JobRejected when the payload could never fit. ``dry``: only check,
        charging nothing (a program peers will send is charged when it starts to come)."""
        total, share = self.limits.max_buffered_bytes, int(self.limits.max_buffered_bytes * self.limits.buffer_share)
        if nbytes > share:
            raise JobRejected(f"payload of {human_bytes(nbytes)} is over what one client may send this worker at "
                              f"once ({human_bytes(share)})")
        if self.buffered_bytes + nbytes > total:
            raise WorkerBusy(f"worker is receiving {human_bytes(self.buffered_bytes)} of payloads already",
                             self.queue_length)
        if (self._bytes_by_client.get(client_id, 0) + nbytes > share
                or self._bytes_by_host.get(host, 0) + nbytes > share):
            raise WorkerBusy("this client (or its address) already has its share of this worker's payload buffer "
                             "in flight", self.queue_length)
        if not dry:
            self.hold(nbytes, client_id, host)

    def hold(self, nbytes: int, client_id: str = "", host: str = "") -> None:
        """Count bytes held here for a client, never refused: a result being written to it (the work is done). They
        take from its (and its address's) share like a payload's charge, so a client that does not read its results
        has its next payloads refused; given back with :meth:`release_bytes`."""
        self.buffered_bytes += nbytes
        _count(self._bytes_by_client, client_id, nbytes)
        _count(self._bytes_by_host, host, nbytes)

    def release_bytes(self, nbytes: int, client_id: str = "", host: str = "") -> None:
        """The job that held these bytes is over."""
        self.buffered_bytes -= nbytes
        _count(self._bytes_by_client, client_id, -nbytes)
        _count(self._bytes_by_host, host, -nbytes)

    def uploads(self, client_id: str | None = None) -> int:
        if client_id is None:
            return sum(self._uploads_by_client.values())
        return self._uploads_by_client.get(client_id, 0)

    def came_from(self, client_id: str, host: str) -> None:
        """A stream of this client's came in from ``host`` (the unary door does not see the caller's address)."""
        if host:
            self._hosts.put(client_id, host)

    def unary_host(self, client_id: str) -> str | None:
        """The address to count a job that came through the unary door against: the one its client's last stream
        came from. None (take the stream door) for a client that has not paid here yet, owes something overdue, or
        whose address is not known: otherwise free identities, each paid up once, would be outside every per-address
        limit (stops, crashes, unpaid results, sessions)."""
        if client_id not in self._paid_clients or self.overdue(client_id):
            return None
        return self._hosts.get(client_id)

    def overdue(self, client_id: str) -> int:
        """Results this client was delivered and has not countersigned within the grace (within the window)."""
        return self._overdue(self._owed.get(client_id))

    def _overdue(self, owed: dict | None) -> int:
        """Overdue entries of one client's or one address's table, dropping those past the window from it."""
        if not owed:
            return 0
        now = self.clock()
        for key in [k for k, (at, _) in owed.items() if now - at > self.limits.unpaid_window]:
            del owed[key]  # aged out: forgiven
        return sum(1 for at, _ in owed.values() if now - at > self.limits.countersign_grace)

    def recent_stops(self, client_id: str) -> int:
        return self._recent(self._stops, client_id)

    def _recent(self, table: LRU, key: str, window: float | None = None) -> int:
        """Events of ``key`` in ``table`` within the window (the stopped-jobs one unless given), older ones dropped."""
        stops = table.get(key)
        if not stops:
            return 0
        horizon = self.clock() - (self.limits.stopped_jobs_window if window is None else window)
        while stops and stops[0] < horizon:
            stops.popleft()
        return len(stops)

    def screen_proof(self, client_id: str) -> None:
        """Raise WorkerBusy or JobRejected unless a speed challenge from this client may run now."""
        now = self.clock()
        while self._recent_proofs and now - self._recent_proofs[0] > 60.0:
            self._recent_proofs.popleft()
        if not self.accepting:
            raise WorkerBusy("this worker is leaving the network")
        if self.proving or len(self._recent_proofs) >= self.limits.max_proofs_per_minute:
            raise WorkerBusy("this worker is answering other speed challenges; try again in a minute")
        last = self._proofs.get(client_id)
        if last is not None and now - last.at < self.limits.proof_interval:
            raise JobRejected(f"this worker answers one speed challenge per client every "
                              f"{self.limits.proof_interval:.0f} s")

    def screen_opening(self, client_id: str, seed: bytes, n: int, products: Iterable[int]) -> None:
        """Raise JobRejected unless this opens this client's last challenge (same seed and size), once, for products it
        committed to; WorkerBusy while another challenge runs."""
        last = self._proofs.get(client_id)
        if last is None or last.seed != seed or last.n != n or last.opened or last.products is None:
            raise JobRejected("no speed challenge of this client to open (each is opened once, by its sender)")
        if any(j >= last.products for j in products):
            raise JobRejected(f"that challenge has {last.products} products")
        if self.proving:
            raise WorkerBusy("this worker is answering another speed challenge")

    def proof_started(self, client_id: str, seed: bytes, n: int) -> None:
        now = self.clock()
        self.proving = True
        self._proofs.put(client_id, _Proof(now, seed, n))
        self._recent_proofs.append(now)

    def opening_started(self, client_id: str) -> None:
        self.proving = True
        self._proofs.get(client_id).opened = True

    def proof_ended(self, client_id: str, products: int | None = None) -> None:
        """A challenge (with the number of products committed to) or an opening is over."""
        self.proving = False
        last = self._proofs.get(client_id)
        if products is not None and last is not None:
            last.products = products

    # --- what happened ---------------------------------------------------------------------------------------------

    def released(self, client_id: str, lane: str = INTERACTIVE) -> None:
        """An admitted job left (finished, failed or cancelled)."""
        self.admitted -= 1
        _count(self._places_by_client, (client_id, lane), -1)
        _count(self._places_by_lane, lane, -1)
        self._drained.check()

    def joined(self) -> None:
        """A job sharing the place another holds (a group's step for the same program, gpunet.worker.batching
        .Together): counted as admitted (the queue shows it, a drain waits for it), not against the places."""
        self.admitted += 1

    def left(self) -> None:
        """A job that :meth:`joined` left."""
        self.admitted -= 1
        self._drained.check()

    def started(self) -> None:
        self.running += 1

    def ended(self, done: bool) -> None:
        """A running job stopped running; ``done``: it produced a result."""
        self.running -= 1
        self.jobs_done += done

    def stopped_running(self, client_id: str, weight: int = 1, host: str = "") -> None:
        """One of the client's jobs cost the worker its executor: stopped while it ran (cancelled, the client went
        away, over its timeout), or it crashed the process (counted ``weight`` times)."""
        self._note(((self._stops, client_id), (self._host_stops, host)), weight)

    def dry_ran(self, client_id: str, seconds: float, billed: bool, host: str = "") -> int:
        """A dry run for the client took ``seconds`` of CPU: counted as stops, fractions carried over, a billed job's
        first ``dry_run_free_seconds`` free (see ServiceLimits). Returns the stops counted for the client now."""
        charged = max(0.0, seconds - self.limits.dry_run_free_seconds) if billed else seconds
        units = charged / self.limits.dry_run_seconds_per_stop
        counted = 0
        for table, carry, key in ((self._stops, self._dry_carry, client_id),
                                  (self._host_stops, self._host_dry_carry, host)):
            if not key or not units:
                continue
            owed = units + carry.get(key, 0.0)
            whole = int(owed)
            carry.put(key, owed - whole)
            if whole:
                self._note(((table, key),), whole)
            if table is self._stops:
                counted = whole
        return counted

    def disclaimed(self, client_id: str, host: str = "") -> None:
        """The client closed a session saying it did not receive steps that ran here. They are not billed (an answer
        can be lost on the way), but an honest client seldom loses one: past ``max_unpaid_jobs`` such closes within
        ``unpaid_window`` (``host_stops_factor`` times that per address), its jobs are refused, so "received nothing"
        cannot get open tabs' work free again and again."""
        self._note(((self._disclaims, client_id), (self._host_disclaims, host)))

    def _note(self, tables, weight: int = 1) -> None:
        for table, key in tables:
            if not key:
                continue
            events = table.get(key)
            if events is None:
                events = deque()
            events.extend([self.clock()] * weight)
            table.put(key, events)  # the least recently seen is forgotten beyond the bound

    def coming(self, client_id: str, job_id: str, host: str = "") -> None:
        """A job passed :meth:`screen` and goes on: its result counts against the credit lines from now (until
        :meth:`delivered` makes it owed, or :meth:`not_coming`)."""
        address = credit_address(host)
        if (client_id, job_id) not in self._coming:
            self._coming[(client_id, job_id)] = address
            _count(self._coming_by_client, client_id, +1)
            _count(self._coming_by_host, address, +1)

    def not_coming(self, client_id: str, job_id: str) -> None:
        """The job ended without a result going out (or it went already)."""
        address = self._coming.pop((client_id, job_id), None)
        if address is not None:
            _count(self._coming_by_client, client_id, -1)
            _count(self._coming_by_host, address, -1)

    def delivered(self, client_id: str, job_id: str, host: str = "") -> None:
        """A result (with its receipt) is going out to ``client_id``: owed until :meth:`paid`, by the client and by
        its address (:func:`credit_address`)."""
        self.not_coming(client_id, job_id)
        host = credit_address(host)
        entry = (self.clock(), host)
        for table, key, item in ((self._owed, client_id, job_id), (self._owed_by_host, host, (client_id, job_id))):
            if not key:
                continue
            owed = table.get(key)
            if owed is None:
                owed = {}
            owed.setdefault(item, entry)
            table.put(key, owed)

    def paid(self, client_id: str, job_id: str) -> None:
        """Its countersignature arrived."""
        self._paid_clients.put(client_id, True)
        owed = self._owed.get(client_id)
        entry = owed.pop(job_id, None) if owed else None
        if entry is not None and entry[1]:
            by_host = self._owed_by_host.get(entry[1])
            if by_host:
                by_host.pop((client_id, job_id), None)

    def stream_opened(self) -> None:
        """A job stream came in: whatever it brings, the worker answers it (and reads its payment) before leaving."""
        self.streams += 1

    def stream_closed(self) -> None:
        self.streams -= 1
        self._drained.check()

    # --- draining --------------------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Take nothing new from now on."""
        self.accepting = False
        self._drained.check()

    def drained(self) -> asyncio.Future:
        """Resolves once the worker is draining and holds no job (queued, running, or on a stream still open)."""
        return self._drained.wait()


def _count(counts: dict, key, delta: int) -> None:
    """Per-key counters that forget a key at zero (so they hold only clients with something in progress)."""
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)
