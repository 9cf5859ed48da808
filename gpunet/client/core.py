"""The client's engine, shared by :class:`~gpunet.Client` and :class:`~gpunet.AsyncClient`: only their I/O differs.

It joins the network as a DHT client under its own identity, keeps the worker view fresh, and runs each job through
routing (who), the transport (how), result checks and the ledger (countersign, append). A failed, timed-out or busy
worker is skipped and the job retried elsewhere; a job id is never paid twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import random
import secrets
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from hivemind.utils import get_dht_time

from gpunet import protocol
from gpunet.client.proofs import ProofConfig, SpeedProofs
from gpunet.client.routing import JobShape, Requirements, Router, RoutingConfig
from gpunet.client.settlement import Settlement
from gpunet.client.transport import JobRequest, P2PTransport, Transport
from gpunet.client.trust import Reputation, agree, describe, majority, quorum
from gpunet.config import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    DEFAULT_NETWORK,
    resolve_data_dir,
)
from gpunet.dht import network as net
from gpunet.dht.registry import WorkerEntry
from gpunet.errors import (
    DeadlineUnreachable,
    GpunetError,
    InvalidReceipt,
    JobFailed,
    JobPreempted,
    JobRaised,
    JobRejected,
    JobTimeout,
    LocalNetworkDown,
    NetworkError,
    NoWorkersAvailable,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    UsageError,
    VerificationFailed,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.identity import Identity
from gpunet.ledger.receipts import Receipt, countersign, format_credits, price_to_nano
from gpunet.ledger.store import Ledger, open_ledger
from gpunet.ledger import tabs
from gpunet.ledger.tabs import Tab
from gpunet.ledger.writer import LedgerWriter
from gpunet.utils import LRU, plural, sha256_hex

logger = logging.getLogger("gpunet.client")


#: A client spends at most about 1/REFRESH_DUTY of its time refreshing the worker list (listing 10,000 workers takes
#: seconds of signature checks, which every 2 s would keep a core busy for a client that only waits), and waits at
#: most MAX_REFRESH_PAUSE seconds between two (a refresh slowed by a peer that does not answer is no measure of size);
#: a failed refresh, or one that found nobody, is followed by the next at the configured period.
REFRESH_DUTY = 10
MAX_REFRESH_PAUSE = 30.0


def refresh_pause(period: float, took: float) -> float:
    """Seconds until the next refresh of the worker list, after one that took ``took`` seconds."""
    return max(period, min(REFRESH_DUTY * took, MAX_REFRESH_PAUSE))


@dataclass
class ClientConfig:
    """Client tuning, with defaults."""

    refresh_period: float = 2.0  # seconds between worker-list refreshes (at least; see refresh_pause)
    discovery_wait: float = 10.0  # how long a job waits for a first worker to appear in an empty view
    max_rejections: int = 3  # worker-specific refusals tolerated before the refusal is final
    max_resends: int = 2  # times a worker may lose a program between admission and run before it counts as failing
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    proofs: ProofConfig = field(default_factory=ProofConfig)  # challenging workers' claimed speeds


class PushedInputDiffers(JobFailed):
    """A pushed session step ran on an input other than the one the client holds for it (the span before pushed one
    thing and answered another, or this worker says so): its state there went on from the wrong input."""


@dataclass
class _Prepared:
    """One job, encoded and estimated once, however many workers it goes to."""

    job: object
    req: Requirements
    job_id: str
    encoded: bytes
    input_hash: str | None  # None while ``hashing`` computes it (big inputs: alongside their transfer)
    flops: int
    program: bytes
    deadline: float
    shape: JobShape
    max_price: int | None
    outputs: tuple  # (dtype, shape) of each output, from the dry run: a worker's answer must match exactly
    max_output_bytes: int  # their data plus room for the header: a bigger answer is refused before it is read
    hashing: asyncio.Future | None = None
    inputs: tuple | None = None  # the tensors themselves, kept for verified jobs: the client may compute the job here
    peak_memory: int = 0  # the dry run's peak, in bytes
    delivered: int = 0  # results in hand (a verified job's replicas): a worker saying it raised contradicts them
    raises_here: asyncio.Future | None = None  # this client's own run of the job, once a worker said it raised


@dataclass
class _Candidate:
    """A worker's checked but not yet paid result."""

    worker_id: str
    delivery: object
    outputs: object
    attempts: list[str]


@dataclass(frozen=True)
class JobResult:
    """A finished job: decoded outputs, the worker that ran it, and the receipt both sides signed."""

    outputs: torch.Tensor | tuple[torch.Tensor, ...]
    worker_id: str
    receipt: Receipt
    attempts: list[str]  # worker ids tried, in order, the last one delivered
    bytes_sent: int  # to the worker that delivered: inputs, plus the program unless it had it cached
    checked: bool = False  # compared with another worker's result, and agreed


def client_data_dir(data_dir: str | Path | None, *, create: bool = True) -> Path:
    """A client's node dir: the given one, else ``<GPUNET_DATA_DIR or ~/.gpunet>/client``; created (and checked to be
    writable) unless ``create`` is false (a reader such as ``gpunet status`` only looks).

    Apart from a worker's on purpose: two daemons with one libp2p identity on one network would be one peer to others.
    """
    if not create:
        base = data_dir if data_dir is not None else Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR) / "client"
        return Path(base).expanduser()
    if data_dir is not None:
        return resolve_data_dir(data_dir, writable=True)
    return resolve_data_dir(resolve_data_dir() / "client", writable=True)


class ClientCore:
    def __init__(
        self,
        initial_peers: Sequence[str] | None = None,
        network: str = DEFAULT_NETWORK,
        data_dir: str | Path | None = None,
        config: ClientConfig | None = None,
        transport: Transport | None = None,
    ):
        """``transport``: how jobs reach workers; by default this client's own node on the p2p network."""
        self.network = net.check_network_name(network)
        self.initial_peers = net.resolve_initial_peers(initial_peers)
        self.data_dir = client_data_dir(data_dir)
        self.config = config or ClientConfig()
        self.identity = Identity.load_or_create(self.data_dir)
        self.reputation = Reputation.load(self.data_dir)
        self.router = Router(self.config.routing, reputation=self.reputation)
        self._said_skips: dict[str, str] = {}  # worker id -> the reason last logged for leaving it out
        self.transport = transport
        self.proofs: SpeedProofs | None = None  # None: routing takes claimed speeds as they are
        self.settlement: Settlement | None = None
        self.ledger: Ledger | None = None
        self.books: LedgerWriter | None = None  # receipts are filed in batches, after the result is handed back
        self._refresher: asyncio.Task | None = None
        self._fresh = asyncio.Event()
        self._estimates: LRU[tuple, object] = LRU(MAX_ESTIMATES)
        self._checks_here: concurrent.futures.ThreadPoolExecutor | None = None  # see _raises_here
        self.closed = False
        self._waiting: deque[asyncio.Future] = deque()  # jobs waiting for room, oldest first (see _finished)

    @property
    def program_bytes_sent(self) -> int:
        """Program bytes this client has uploaded to workers, in all: what workers fetching programs from each other
        spare its link (gpunet.worker.peers)."""
        return getattr(self.transport, "program_bytes_sent", 0)

    @property
    def id(self) -> str:
        return self.identity.peer_id

    async def start(self) -> None:
        if self.transport is None:
            self.transport = await P2PTransport.connect(self.network, self.initial_peers, self.identity)
        self.settlement = Settlement(self.transport)
        if self.config.proofs.enabled and hasattr(self.transport, "prove"):
            self.proofs = SpeedProofs(self.transport, self.router, self.reputation, self.config.proofs)
        self.ledger = open_ledger(self.data_dir)
        self.books = LedgerWriter(self.ledger, on_refused=self._receipt_refused)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    def check_open(self) -> None:
        if self.closed:
            raise GpunetError("client is closed")

    async def close(self) -> None:
        self.closed = True
        try:
            if self.settlement is not None:  # workers are owed these countersignatures: deliver them before leaving
                await self.settlement.close()
        finally:
            if self.books is not None:  # our receipts first: nothing below may lose them
                self.books.close()
        if self._refresher is not None:
            self._refresher.cancel()
            try:
                await self._refresher
            except (asyncio.CancelledError, Exception):
                pass
        if self.proofs is not None:
            await self.proofs.close()
        if self.transport is not None:
            await self.transport.close()
        if self.ledger is not None:
            self.ledger.close()
        if self._checks_here is not None:
            self._checks_here.shutdown(wait=False, cancel_futures=True)
        self.reputation.save()

    # --- the worker view -------------------------------------------------------------------------------------------

    async def refresh(self) -> list[WorkerEntry]:
        entries = await self.transport.discover()
        if entries:  # those whose records lapsed are gone, or going: not named as holders (an empty look says little)
            for gone in self.router.workers.keys() - {e.id for e in entries}:
                self._forget(gone)
            self.router.update(entries)
            self._fresh.set()
        else:  # a look that finds nobody (a DHT search lost under load) keeps the workers whose records still hold
            now = get_dht_time()
            self.router.update([e for e in self.router.workers.values() if e.expiration_time > now])
        if self.proofs is not None:
            self.proofs.schedule(entries)
        return entries

    async def _refresh_forever(self) -> None:
        took = 0.0
        while True:
            # An empty view is looked at again soon whatever a look costs: jobs wait for its first workers.
            await asyncio.sleep(refresh_pause(self.config.refresh_period, took if self.router.workers else 0.0))
            t0 = time.monotonic()
            try:
                await self.refresh()
                took = time.monotonic() - t0
            except Exception as e:  # a slow or broken refresh must not kill the client; the next one may work
                logger.warning("Refreshing the worker list failed: %s", e)
                took = 0.0  # no measure of the network's size

    def workers(self) -> list[WorkerEntry]:
        return list(self.router.workers.values())

    def _strike(self, worker_id: str) -> float:
        """A worker failed (or lied): routing bans it for a while, and no other worker is sent to it for a program.
        Returns the ban's length. Forgotten on any failure, not only an unreachable one: a worker that failed may be
        dying, and one that lied only wastes a fetcher's time (pieces are checked), while a dead holder costs a cold
        worker seconds of dialling; forgetting a live one costs at most one upload from here."""
        self._forget(worker_id)
        return self.router.on_failure(worker_id)

    def _forget(self, worker_id: str) -> None:
        forget = getattr(self.transport, "forget", None)  # optional, as a transport's speed challenges are
        if forget is not None:
            forget(worker_id)

    def _receipt_refused(self, receipt: Receipt, error: Exception) -> None:
        """A receipt we countersigned did not enter our ledger (its worker signature is void): that worker is broken or
        cheating; it is not paid (no valid receipt exists) and routing learns to avoid it."""
        logger.warning("Worker %s sent a receipt for job %s that is not valid (%s); it is not paid",
                       receipt.worker_id[-8:], receipt.job_id[:12], error)
        self.reputation.record(receipt.worker_id, "invalid")

    async def flush_ledger(self) -> None:
        """Write receipts still queued, so a reader of the ledger file sees every job that has returned."""
        if self.books is not None:
            self.books.flush()

    # --- jobs ------------------------------------------------------------------------------------------------------

    async def _estimate(self, job, inputs: Sequence[torch.Tensor]):
        """FLOPs and memory by the same dry run the worker bills from; cached per program and input shapes."""
        key = (job.program_hash, *((tuple(t.shape), t.dtype) for t in inputs))
        estimate = self._estimates.get(key)
        if estimate is None:
            # The first dry run of a program also validates it exactly as a worker would; keep it off the loop.
            estimate = await asyncio.to_thread(job.estimate, *inputs)
            self._estimates.put(key, estimate)
        return estimate

    async def run(self, job, inputs: Sequence[torch.Tensor], requirements: Requirements | None = None,
                  job_id: str | None = None) -> JobResult:
        """Route, send, retry, verify as asked; returns the checked, countersigned result."""
        self.check_open()
        inputs = check_call(job, inputs)
        req = requirements or Requirements()
        job_id = job_id or uuid.uuid4().hex
        encoded = await _off_loop_if_large(job.encode_inputs, inputs)  # JobRejected: inputs misfit
        hashing = None
        if len(encoded) >= _LARGE_BYTES:  # only needed to check the receipt: hash big inputs while they travel
            input_hash, hashing = None, asyncio.ensure_future(asyncio.to_thread(sha256_hex, encoded))
        else:
            input_hash = sha256_hex(encoded)
        estimate = await self._estimate(job, inputs)
        program = job.program_bytes()
        p = _Prepared(
            job=job, req=req, job_id=job_id, encoded=encoded, input_hash=input_hash, flops=estimate.flops,
            program=program, deadline=time.monotonic() + _seconds_left(req),
            shape=JobShape(estimate.flops, job.program_hash, len(encoded), len(program), req.dtype or _dtype_of(job),
                           req.private),
            max_price=price_to_nano(req.max_price) if req.max_price is not None else None,
            outputs=estimate.outputs,
            max_output_bytes=estimate.output_bytes + OUTPUT_HEADER_ALLOWANCE, hashing=hashing,
            inputs=tuple(inputs) if req.verify != "none" or req.redundancy > 1 else None,
            peak_memory=estimate.peak_memory_bytes,
        )
        await self._some_workers(req)
        if req.redundancy == 1 and req.verify == "none":
            candidate = await self._deliver(p, job_id, set())
            return await self._pay(p, candidate, [])
        return await self._run_verified(p)

    async def _some_workers(self, req: Requirements) -> None:
        """Wait (a while) for discovery to find the first workers; NoWorkersAvailable, saying where it looked."""
        if self.router.workers:
            return
        wait = min(self.config.discovery_wait, req.timeout)
        try:
            await asyncio.wait_for(self._fresh.wait(), wait)
        except asyncio.TimeoutError:
            raise NoWorkersAvailable(
                f"no workers appeared in network {self.network!r} within {wait:.0f} s: is that the network the "
                "workers joined (`gpunet demo` uses 'gpunet-demo'), and are the initial peers right? "
                f"`gpunet status --network {self.network}` lists what can be seen") from None

    # --- inference sessions (gpunet.client.sequential drives them) -------------------------------------------------

    def shape_of(self, job, estimate, input_bytes: int, req: Requirements) -> JobShape:
        return JobShape(estimate.flops, job.program_hash, input_bytes, len(job.program_bytes()),
                        req.dtype or _dtype_of(job), req.private)

    async def place(self, job, inputs: Sequence[torch.Tensor], requirements: Requirements | None = None,
                    exclude: set[str] = frozenset(), avoid: set[str] = frozenset(), drawn: bool = False) -> WorkerEntry:
        """The worker routing would send ``job`` to now (``inputs`` may be meta tensors: only shapes matter),
        passing over ``avoid`` where it can; ``drawn``: one drawn at random, as a checker is (a second opinion)."""
        self.check_open()
        req = requirements or Requirements()
        estimate = await self._estimate(job, inputs)
        await self._some_workers(req)
        shape = self.shape_of(job, estimate, 0, req)
        deadline = time.monotonic() + req.timeout
        while True:
            try:
                worker = (self.router.choose_checker(req, exclude=set(exclude), replicas=set(avoid)) if drawn else
                          self.router.choose(req, shape, exclude=set(exclude), avoid=set(avoid)))
                break
            except NoWorkersAvailable as e:  # busy, or still joining: wait for them within the timeout
                if e.retry_at is None or e.retry_at >= deadline:
                    raise
                await self._slot_or(e.retry_at)
        self._say_skips()
        return worker

    def _finished(self, worker_id: str) -> None:
        """One of our jobs left ``worker_id``: the job that has waited longest for room (Router.full) may go (one
        at a time, in order: waking every waiter on every end costs each a pass over the workers)."""
        self.router.finished(worker_id)
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _slot_or(self, until: float) -> None:
        """Wait until monotonic time ``until``, or until one of our jobs ends somewhere (making room there)."""
        if len(self._waiting) > 1024:  # waiters that timed out, left for an end to skip: drop them
            self._waiting = deque(w for w in self._waiting if not w.done())
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=max(0.0, until - time.monotonic()))
        finally:
            waiter.cancel()  # (a timed-out waiter stays in the queue until an end skips it)

    def held_against(self, worker_id: str, outcome: str) -> None:
        """A worker's misdeed seen outside a job's own retries (a session's span): a ban, and its record."""
        self._strike(worker_id)
        self.reputation.record(worker_id, outcome)

    async def run_step(self, job, inputs: Sequence[torch.Tensor], worker_id: str, session: protocol.SessionStep,
                       state: Sequence[torch.Tensor], tab: Tab, requirements: Requirements | None = None,
                       check=None, pushed: asyncio.Future | None = None) -> JobResult:
        """One session step on the worker that holds (or, step 0, will hold) its state; never retried elsewhere:
        a lost worker raises, and the caller rebuilds the session on another (gpunet.client.sequential).
        ``state``: the first state (sent when the step opens a session that is not ``fresh``; its shapes are what
        the dry run needs either way). ``tab``: this session's open tab on that worker, which the step joins; when
        the step fills it (or closes the session) the worker's receipt for it comes back, checked against the tab and
        countersigned (``JobResult.receipt``; None for the other steps), and the tab starts again. ``check``: awaited
        with the step's outputs (and whether a receipt came) before anything is paid (gpunet.client.audit); what it
        raises refuses the receipt.

        ``session.input_from``: the input is pushed to the worker by that worker (``inputs``: meta tensors of its
        shapes) and ``pushed`` resolves to the hash of the input this client holds for the step (the previous span's
        output); the worker says which it ran on, and PushedInputDiffers is raised when the two differ. Such a step
        has a job id of its own, so the same step sent afterwards with its input never gets this answer."""
        self.check_open()
        req = requirements or Requirements()
        if session.step == 0 and session.state_bytes is None:  # reserved by the worker before the step runs
            session = replace(session, state_bytes=job.manifest.state_bytes)
        sends_state = session.step == 0 and not session.fresh
        full = (*inputs, *state)
        if session.input_from is not None:
            encoded = b""
        else:
            encoded = job.encode_inputs(*full) if sends_state else job.encode_step_inputs(*inputs)
        estimate = await self._estimate(job, full)
        program = job.program_bytes()
        n_out = len(job.manifest.outputs) - job.manifest.state
        p = _Prepared(
            job=job, req=req, job_id=f"{session.id}.{session.step}{'p' if session.input_from else ''}", encoded=encoded,
            input_hash=sha256_hex(encoded),
            flops=estimate.flops, program=program, deadline=time.monotonic() + req.timeout,
            shape=self.shape_of(job, estimate, len(encoded), req),
            max_price=price_to_nano(req.max_price) if req.max_price is not None else None,
            outputs=estimate.outputs[:n_out],
            max_output_bytes=replace(estimate, outputs=estimate.outputs[:n_out]).output_bytes + OUTPUT_HEADER_ALLOWANCE)
        resends = busy = 0
        redialled = False
        while True:
            worker = self.router.workers.get(worker_id)
            if worker is None:
                self._forget(worker_id)
                raise SessionLost(f"worker {worker_id[-8:]} holding the session has left the network")
            remaining = p.deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(f"session step {p.job_id[:24]} did not finish within {req.timeout:g} s")
            cold = not self.router.holds_program(worker, job.program_hash)
            request = JobRequest(p.job_id, job.program_hash, program, encoded, max(0.1, remaining), p.max_price,
                                 p.max_output_bytes, private=req.private, session=session)
            ahead = self.router.started(worker_id)
            t0 = time.perf_counter()
            delivery = None
            try:
                async with asyncio.timeout(remaining):
                    delivery = await self.transport.submit(worker, request, cached=not cold,
                                                           settlement=self.settlement)
                    if pushed is not None:
                        p.input_hash = await self._pushed_input(delivery, pushed)
                outputs = self._check_step(p, delivery, session, tab)
            except (WorkerDraining, LocalNetworkDown):
                raise
            except NetworkError as e:
                relayed = worker.record.reachability == "relayed"
                if delivery is None and not redialled and (isinstance(e, ProtocolError) or relayed):
                    # The stream broke on the way (see run(): the p2p daemon now and then closes one before the
                    # answer is through; a relay resets its circuits): ask the same worker again, once, before
                    # moving the span and replaying its steps elsewhere. The step's job id makes this safe: the
                    # worker answers a step it ran from its results, and one still running it joins.
                    redialled = True
                    logger.info("The connection to worker %s broke during session step %s (%s); asking again",
                                worker_id[-8:], p.job_id[:24], e)
                    continue
                self._strike(worker_id)
                self.reputation.record(worker_id, "failure")
                raise
            except WorkerBusy:  # its queue is full for a moment: the state is there, wait for it (backing off)
                busy += 1
                await asyncio.sleep(min(0.5, 0.01 * 2 ** min(busy, 6)) * (0.5 + random.random()))
                continue
            except ProgramNotCached:
                self.router.on_program_lost(worker_id, job.program_hash)
                resends += 1
                if resends > self.config.max_resends:
                    raise
                continue
            except asyncio.TimeoutError:
                self._strike(worker_id)
                self.reputation.record(worker_id, "failure")
                raise JobTimeout(f"worker {worker_id[-8:]} took too long with session step {p.job_id[:24]}") from None
            finally:
                self._finished(worker_id)
            self.router.on_success(worker_id, p.shape, time.perf_counter() - t0, delivery.bytes_sent,
                                   delivery.transfer_seconds, cold=cold, ahead=ahead)
            if check is not None:
                try:
                    await check(outputs, delivery.receipt is not None)
                except BaseException as e:
                    if delivery.receipt is not None:
                        self.settlement.refuse(delivery, str(e) or "the step's check did not complete")
                    raise
            receipt = None
            if delivery.receipt is not None:
                receipt = self._pay_tab(delivery, session.id, tab, p.max_price)
            return JobResult(outputs, worker_id, receipt, [worker_id], delivery.bytes_sent)

    async def _pushed_input(self, delivery, pushed: asyncio.Future) -> str:
        """The hash of a pushed step's input, once this client holds that input too, if the worker ran on the same."""
        try:
            expected = await asyncio.shield(pushed)
            if delivery.input_hash != expected:
                raise PushedInputDiffers(
                    f"worker {delivery.worker_id[-8:]} ran the step on an input other than the previous span's output"
                    if delivery.input_hash is not None else
                    f"worker {delivery.worker_id[-8:]} did not say which input it ran a pushed step on")
        except BaseException:
            if delivery.receipt is not None:
                self.settlement.refuse(delivery, "the step's input is not the one this client holds")
            raise
        return expected

    def _check_step(self, p: "_Prepared", delivery, session: protocol.SessionStep, tab: Tab):
        """A step's answer decodes against the manifest and joins the tab; a receipt comes exactly when the tab
        is due (full, or the session closing), never for a tab this client does not hold. Raises otherwise."""
        try:
            outputs = p.job.decode_step_outputs(delivery.outputs, expected=p.outputs)
        except GpunetError as e:
            raise ProtocolError(f"outputs do not match the program's output specs: {e}") from None
        tab.add(session.step, p.input_hash, sha256_hex(delivery.outputs), p.flops)
        due = tab.full or session.close
        if due != (delivery.receipt is not None):
            problem = (f"no receipt came with step {session.step}, which ends a tab of {tab.steps} steps" if due
                       else f"a receipt came with step {session.step}, in the middle of a tab")
            raise InvalidReceipt(problem)
        return outputs

    def _overpriced(self, receipt: Receipt) -> str | None:
        """Why a receipt's price is not one to pay: above what its worker advertised (its interactive price is the
        most it may charge in any lane), or from a worker whose price this client never saw. None if it is fine."""
        advertised = self.router.advertised.get(receipt.worker_id)
        if advertised is None:
            return f"receipt is from worker {receipt.worker_id[-8:]}, whose advertised price this client never saw"
        if receipt.price > price_to_nano(advertised):
            return (f"receipt charges {format_credits(receipt.price)} credits/TFLOP, above the {advertised:g} this "
                    "worker advertises")
        return None

    def _pay_tab(self, delivery, session_id: str, tab: Tab, max_price: int | None) -> Receipt:
        """Check a tab's receipt against this client's own tab (every step's input and output hash, chained, and the
        work it counted), countersign and file it; InvalidReceipt (refused, not paid) otherwise."""
        receipt = delivery.receipt
        problem = None
        named = tabs.parse(receipt.job_id)
        if receipt.worker_id != delivery.worker_id:
            problem = f"receipt names worker {receipt.worker_id[-8:]}, the answer came from {delivery.worker_id[-8:]}"
        elif (named is None or named[0] != session_id or named[2:] != (tab.first, tab.last)
              or tab.nonce not in (None, named[1])):
            problem = f"receipt is for {receipt.job_id[:64]}, the steps were {tab.first}-{tab.last} of {session_id}"
        elif receipt.input_hash != tab.input_chain:
            problem = "receipt's input hash is not the chain of the inputs sent in the tab's steps"
        else:
            problem = self._overpriced(receipt)
        try:
            if problem is not None:
                raise InvalidReceipt(problem)
            signed = countersign(receipt, self.identity, output_hash=tab.output_chain, max_price=max_price,
                                 flops=tab.flops, check_worker_signature=False)
        except GpunetError as e:
            self.settlement.refuse(delivery, str(e))
            self.reputation.record(delivery.worker_id, "invalid")
            raise
        self.books.append(signed)
        self.reputation.record(delivery.worker_id, "valid")
        self.settlement.countersign(delivery, signed.client_signature)
        tab.__init__(named[1])  # the next step starts the session's next tab
        return signed

    async def close_session(self, worker_id: str, session_id: str, tab: Tab | None = None,
                            max_price: int | None = None) -> Receipt | None:
        """Free a session's state on its worker, and pay the receipt of the steps on ``tab`` (the ones not billed
        yet). None when there was nothing to pay, or the worker is gone (those steps then stay unpaid)."""
        # The tab as it stands now: a step still running when the session is closed (a Ctrl-C under it) may add
        # itself to it meanwhile, and the worker bills only what we say here we received.
        tab = tab.prefix(tab.steps) if tab is not None else None
        received = tab.first + tab.steps if tab is not None and tab.steps else None
        try:
            delivery = await self.transport.close_session(worker_id, session_id, received)
        except GpunetError:
            return None
        if delivery is None:
            return None
        if tab is None or not tab.steps:
            self.settlement.refuse(delivery, "this client holds no unbilled steps of that session")
            return None
        try:
            return self._pay_tab(delivery, session_id, tab, max_price)
        except GpunetError as e:
            logger.warning("Worker %s closed session %s with a receipt this client refuses: %s", worker_id[-8:],
                           session_id[:12], e)
            return None

    async def _run_verified(self, p: "_Prepared") -> JobResult:
        """Redundant or adaptive: collect results from distinct workers until a quorum agrees, pay only that."""
        taken: set[str] = set()
        candidates: list[_Candidate] = []
        paid: set[int] = set()
        try:
            return await self._verify(p, taken, candidates, paid)
        except BaseException as e:
            # Whatever went wrong (a replica failed, the caller cancelled), no result we did not pay for stays open.
            raises = getattr(e, "confirmed_here", False)  # the job raises on this machine: those results were made up
            for i, c in enumerate(candidates):
                if i not in paid:
                    if raises:
                        self.reputation.record(c.worker_id, "invalid")
                    self.settlement.refuse(c.delivery, "a result for a job that raises" if raises else
                                           "job abandoned before its results were compared")
            raise

    async def _verify(self, p: "_Prepared", taken: set[str], candidates: list, paid: set[int]) -> JobResult:
        async def one_more(checker: bool = True) -> None:
            # Unguessable: a worker that ran one replica must not be able to tell which ids the others will have.
            # Checkers are drawn at random (Router.choose_checker), never by price or claimed speed.
            candidates.append(await self._deliver(p, f"{p.job_id}.{secrets.token_hex(8)}", taken, checker=checker))

        if p.req.verify == "local-sample" and p.req.redundancy == 1:
            return await self._check_locally(p, taken, candidates, paid)
        k = p.req.redundancy
        if k > 1:
            await self._enough_for(p.req, k)
        replicas = [asyncio.ensure_future(one_more(checker=i > 0)) for i in range(k)]
        try:
            await asyncio.gather(*replicas)
        except BaseException:
            for task in replicas:
                task.cancel()
            raise
        checked = k > 1
        if p.req.verify == "adaptive" and k == 1 and self.reputation.should_check(candidates[0].worker_id):
            k, checked = 2, True
            try:
                await one_more()
            except NoWorkersAvailable:  # nobody to compare with: this client checks it itself, or says it did not
                return await self._check_alone(p, candidates, paid, one_more)
        group = majority([c.outputs for c in candidates])
        while (group is None or len(group) < quorum(k)) and len(candidates) < 2 * k - 1:
            await one_more()
            group = majority([c.outputs for c in candidates])
        quorate = group is not None and len(group) >= quorum(k)
        # An answer counts as vouched for when an established worker is among those giving it. Otherwise identities
        # this client does not know yet agree with each other, which free identities can always arrange: the
        # client's own computation decides instead (see docs/trust.md, "Against free identities").
        trusted = quorate and any(self.reputation.established(candidates[i].worker_id) for i in group)
        if not trusted and p.inputs is not None:
            own = await self._own_verdict(p, candidates, one_more)
            if own is not None:
                group, trusted, quorate = own, True, True
        if not quorate:
            raise VerificationFailed(
                f"job {p.job_id[:12]}: {len(candidates)} results, no {quorum(k)} agree: "
                + describe([c.outputs for c in candidates], [c.worker_id for c in candidates]))
        for i, c in enumerate(candidates):
            if i not in group:
                # Only a trusted verdict brands the dissenter a liar: two fresh sybils outvoting an honest worker
                # must not turn it into the one recorded as lying.
                if trusted:
                    self.reputation.record(c.worker_id, "rejected")
                paid.add(i)  # settled: refused on purpose
                self.settlement.refuse(c.delivery, "result outvoted by the majority of redundant results")
                logger.warning("Worker %s returned a result the majority rejected (job %s); it is not paid%s",
                               c.worker_id[-8:], p.job_id[:12],
                               "" if trusted else " (no established worker in that majority: not held against it)")
        if not trusted:  # agreement among workers this client does not trust yet, and it could not check itself
            logger.warning("Job %s: the agreeing results come from workers this client has not come to trust, and it "
                           "could not compute the job itself; returned marked unchecked", p.job_id[:12])
        attempts = [c.worker_id for c in candidates]
        result = None
        for i in group:
            paid.add(i)
            outcome = await self._pay(p, candidates[i], attempts, checked=checked and trusted, trusted=trusted)
            result = result or outcome
        self.reputation.save()
        return result

    async def _enough_for(self, req: Requirements, k: int) -> None:
        """Redundancy ``k`` needs k distinct workers: NoWorkersAvailable, with the count, before any copy is sent (the
        copies that ran would be wasted work, refused unpaid). Workers still appearing are waited for a while, as
        the first ones are (``discovery_wait``), on the view the background refresh keeps."""
        deadline = time.monotonic() + min(self.config.discovery_wait, req.timeout)
        while (n := self.router.could_take(req)) < k and time.monotonic() < deadline:
            self._fresh.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._fresh.wait(), max(0.0, deadline - time.monotonic()))
        if n < k:
            raise NoWorkersAvailable(
                f"redundancy={k} needs {k} distinct workers, but only {n} of the "
                f"{plural(len(self.router.workers), 'known worker')} in network {self.network!r} could take this "
                f"job: lower redundancy, or ease the requirements")

    async def _check_alone(self, p: "_Prepared", candidates: list, paid: set[int], one_more) -> JobResult:
        """An adaptive spot check with no second worker to ask: the client's own computation is the check. If this
        machine cannot run the job, the result is returned marked unchecked (never silently taken as checked)."""
        own = await self._own_verdict(p, candidates, one_more) if p.inputs is not None else None
        if own is None:
            logger.warning("No second worker to spot-check job %s; its result is returned marked unchecked "
                           "(future.checked is False)", p.job_id[:12])
            paid.add(0)
            return await self._pay(p, candidates[0], [], checked=False)
        for i, c in enumerate(candidates):
            if i not in own:
                self.reputation.record(c.worker_id, "rejected")
                paid.add(i)
                self.settlement.refuse(c.delivery, "result differs from the client's own computation of the job")
        paid.add(own[0])
        result = await self._pay(p, candidates[own[0]], [c.worker_id for c in candidates], checked=True, trusted=True)
        self.reputation.save()
        return result

    async def _raises_here(self, p: "_Prepared") -> bool | None:
        """Whether the job raises on this machine too (True), runs (False), or was not tried here (None: too big to
        run on a client, or this machine cannot). Decides a worker's "the job raised" without trusting anyone. Run
        once per job, and one job at a time on a thread of its own: lying workers cannot make the client run a job
        again and again, nor fill its threads (a run past its time finishes there, holding up only later checks)."""
        if p.flops > LOCAL_CONFIRM_FLOPS or p.peak_memory > LOCAL_CONFIRM_BYTES:
            return None
        if p.raises_here is None:
            if self._checks_here is None:
                self._checks_here = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpunet-check")
            p.raises_here = asyncio.get_running_loop().run_in_executor(self._checks_here, _raises, p)
        try:
            async with asyncio.timeout(max(0.1, min(LOCAL_CONFIRM_SECONDS, p.deadline - time.monotonic()))):
                return await asyncio.shield(p.raises_here)
        except TimeoutError:
            logger.info("Could not run job %s here in time to check that it raises", p.job_id[:12])
            return None

    async def _compute_here(self, p: "_Prepared"):
        """The job computed on this machine, within what is left of its timeout (TimeoutError past it)."""
        async with asyncio.timeout(max(0.1, p.deadline - time.monotonic())):
            return await asyncio.to_thread(p.job.run_locally, *p.inputs)

    async def _own_verdict(self, p: "_Prepared", candidates: list, one_more) -> list[int] | None:
        """The candidates whose result agrees with this client's own computation of the job, asking further (randomly
        drawn) workers until one does; None when this machine cannot run the job (then the vote stands as it is)."""
        try:
            mine = await self._compute_here(p)
        except JobRaised as e:  # it raises here: the results in hand were made up, not checked ones
            e.confirmed_here = True
            raise
        except (GpunetError, TimeoutError) as e:
            logger.warning("Could not compute job %s here to settle whom to trust (%s)", p.job_id[:12],
                           e or "not within the job's timeout")
            return None
        good = [i for i, c in enumerate(candidates) if agree(c.outputs, mine)]
        while not good:
            logger.warning("No result of job %s agrees with this client's own computation; asking another worker",
                           p.job_id[:12])
            await one_more()
            if agree(candidates[-1].outputs, mine):
                good = [len(candidates) - 1]
        return good

    async def _check_locally(self, p: "_Prepared", taken: set[str], candidates: list, paid: set[int]) -> JobResult:
        """verify="local-sample": on adaptive's schedule, the client computes the job itself and pays only a result
        that agrees. A worker that disagrees is recorded as rejected, not paid, and the job goes to another worker
        (checked against the same local answer) until one agrees. Nothing another worker says is trusted, so
        identities that check each other gain nothing."""
        candidates.append(await self._deliver(p, p.job_id, taken))
        if not self.reputation.should_check(candidates[0].worker_id):
            paid.add(0)
            return await self._pay(p, candidates[0], [], checked=False)
        try:
            mine = await self._compute_here(p)
        except JobRaised as e:  # it raises here: the results in hand were made up, not checked ones
            e.confirmed_here = True
            raise
        except (GpunetError, TimeoutError) as e:  # this machine cannot run it (memory, time): not the worker's fault
            logger.warning("Could not compute job %s here to check it (%s); its result is returned marked unchecked",
                           p.job_id[:12], e)
            paid.add(0)
            return await self._pay(p, candidates[0], [], checked=False)
        while True:
            c = candidates[-1]
            paid.add(len(candidates) - 1)
            if agree(c.outputs, mine):
                result = await self._pay(p, c, [x.worker_id for x in candidates], checked=True, trusted=True)
                self.reputation.save()
                return result
            self.reputation.record(c.worker_id, "rejected")
            self.settlement.refuse(c.delivery, "result differs from the client's own computation of the job")
            logger.warning("Worker %s returned a result that differs from this client's own computation (job %s); "
                           "it is not paid, and the job goes to another worker", c.worker_id[-8:], p.job_id[:12])
            candidates.append(await self._deliver(p, f"{p.job_id}.{secrets.token_hex(8)}", taken))

    async def _deliver(self, p: "_Prepared", job_id: str, taken: set[str], checker: bool = False) -> "_Candidate":
        """One result from one worker not in ``taken`` (which it joins), retrying elsewhere on failure; an error
        says in ``attempts`` which workers it went to (``JobFuture.attempts``)."""
        tried: list[str] = []
        try:
            return await self._try_workers(p, job_id, taken, tried, checker)
        except GpunetError as e:
            e.attempts = list(tried)
            raise

    async def _try_workers(self, p: "_Prepared", job_id: str, taken: set[str], tried: list[str],
                           checker: bool) -> "_Candidate":
        req = p.req
        failed: set[str] = set()
        rejections: list[JobRejected] = []
        resends = 0  # times a worker lost the program between admission and run (not its fault)
        redialled: set[str] = set()  # workers already tried again after a broken stream
        preempted: Counter[str] = Counter()  # workers that stopped this batch job for interactive work: others first
        last_error: GpunetError | None = None
        emptied_until: float | None = None  # the network emptied under this job: looked for again until then
        raised: list[tuple[str, str]] = []  # (worker, where) for workers that said the job itself raised (JobRaised)
        raised_error: JobRaised | None = None
        while True:
            remaining = p.deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(f"job {job_id[:12]} did not finish within {req.timeout:g} s; tried {_names(tried)}"
                                 + (f" (last error: {last_error})" if last_error else ""))
            try:
                # A second opinion on "the job raised" comes from a worker drawn at random, like a checker: the next
                # cheapest could be the same owner's second identity.
                worker = (self.router.choose_checker(req, exclude=failed,
                                                     replicas=(taken - failed) | {w for w, _ in raised})
                          if checker or raised else
                          self.router.choose(req, p.shape, exclude=failed, replicas=taken - failed, avoid=set(preempted),
                                             within=remaining if req.deadline is not None else None))
                self._say_skips()
            except NoWorkersAvailable as e:
                if e.retry_at is not None and e.retry_at < p.deadline:  # busy, full, joining: wait for them
                    await self._slot_or(e.retry_at)
                    continue
                if not self.router.workers:
                    # Workers were here a moment ago (this job saw or tried some): their records can all lapse at
                    # once while they restart. Look again for a while before giving up on the network.
                    emptied_until = emptied_until or min(p.deadline, time.monotonic() + EMPTY_NETWORK_WAIT)
                    if time.monotonic() < emptied_until:
                        await asyncio.sleep(self.config.refresh_period / 4)
                        try:
                            await self.refresh()
                        except Exception as refresh_error:  # the next look may work; the deadline bounds it
                            logger.debug("Looking for workers again failed: %s", refresh_error)
                        continue
                if not tried:
                    raise
                if rejections and all(isinstance(r, DeadlineUnreachable) for r in rejections):
                    raise DeadlineUnreachable(f"every worker that could take job {job_id[:12]} refused it: "
                                              f"{rejections[-1].reason}") from None
                if raised:  # no other worker to ask: the one that ran it is all there is to go on
                    raise JobRaised(f"{raised_error} (said by worker {raised[0][0][-8:]}; no other worker could run "
                                    "it to confirm, nor this client)") from None
                raise NoWorkersAvailable(f"{e}; tried {_names(tried)}; last error: {last_error}") from None
            taken.add(worker.id)
            tried.append(worker.id)
            ahead = self.router.started(worker.id)
            # Cold: sent before this worker was known to hold the program, so it waited for the program to arrive
            # and load (whether this job carried it or another one did).
            cold = not self.router.holds_program(worker, p.job.program_hash)
            t0 = time.perf_counter()
            holders = () if req.private else tuple(
                (h.id, tuple(h.record.maddrs[:protocol.MAX_HOLDER_MADDRS]))
                for h in self.router.holders(p.job.program_hash, exclude=worker.id)[:protocol.MAX_HOLDERS])
            request = JobRequest(job_id, p.job.program_hash, p.program, p.encoded, max(0.1, remaining), p.max_price,
                                 p.max_output_bytes, private=req.private, holders=holders, lane=req.priority,
                                 deadline=req.deadline)
            try:
                async with asyncio.timeout(remaining):  # no extra task per job, unlike wait_for
                    delivery = await self.transport.submit(
                        worker, request, cached=not cold,
                        settlement=self.settlement)
                    if p.input_hash is None:
                        p.input_hash = await p.hashing
                try:
                    outputs = self._check(p, delivery)
                except GpunetError as e:
                    raise _WrongAnswer(e) from None
            except _WrongAnswer as wrong:  # it answered, but not with what it was asked: honesty, not availability
                taken.discard(worker.id)
                ban = self._strike(worker.id)
                self.reputation.record(worker.id, "invalid")
                failed.add(worker.id)
                last_error = wrong.error
                logger.warning("Worker %s answered job %s wrongly (%s); banned %.0f s, retrying elsewhere",
                               worker.id[-8:], job_id[:12], wrong.error, ban)
                continue
            except JobPreempted as e:  # not billed; run again elsewhere if any other worker can take it, else here
                taken.discard(worker.id)
                last_error = e
                preempted[worker.id] += 1
                if not req.batch:
                    # An honest worker never stops an interactive job for another: one that says so only wastes the
                    # job's time (and collects its inputs).
                    ban = self._strike(worker.id)
                    self.reputation.record(worker.id, "failure")
                    failed.add(worker.id)
                    logger.info("Worker %s stopped interactive job %s; banned %.0f s, retrying elsewhere",
                                worker.id[-8:], job_id[:12], ban)
                    continue
                logger.info("Batch job %s was stopped on worker %s for interactive work; running it again",
                            job_id[:12], worker.id[-8:])
                continue
            except WorkerBusy as e:
                taken.discard(worker.id)
                self.router.on_busy(worker.id)
                last_error = e
                await asyncio.sleep(0.01)
                continue
            except ProgramNotCached as e:
                taken.discard(worker.id)
                self.router.on_program_lost(worker.id, p.job.program_hash)
                resends += 1
                last_error = e
                if resends > self.config.max_resends:  # a worker that keeps losing it is failing after all
                    failed.add(worker.id)
                continue
            except JobRaised as e:
                # The job's own error, this worker says: the same inputs raise the same way anywhere. Not believed on
                # its word (saying so gets rid of a job): this client runs the job itself when it is small enough,
                # else a second worker drawn at random must name the same node and exception. Where another worker
                # has already given a result, a claim that is not confirmed here is a disagreement, not the job's.
                taken.discard(worker.id)
                failed.add(worker.id)
                raised_error = last_error = e
                verdict = await self._raises_here(p)
                if verdict is None and p.deadline - time.monotonic() <= 0.1 and p.flops <= LOCAL_CONFIRM_FLOPS:
                    verdict = "late"  # said with no time left to check it: a job held to its end, as a timeout
                where = _raised_where(e)
                agreed = [w for w, said in raised if said == where]
                if verdict is True or (verdict is None and agreed and not p.delivered):
                    for other, said in raised:  # one place is where it raised: whoever named another lied
                        if said != where:
                            self._strike(other)
                            self.reputation.record(other, "failure")
                    who = "this client's own run" if verdict is True else f"worker {agreed[0][-8:]}"
                    error = JobRaised(f"{e} ({who} raised the same: the job's own error, held against no worker)")
                    error.confirmed_here = verdict is True
                    raise error from None
                if verdict is False or verdict == "late":
                    self._strike(worker.id)
                    self.reputation.record(worker.id, "failure" if verdict is False else "timeout")
                    logger.info("Worker %s said job %s raised (%s), %s; banned for a while", worker.id[-8:],
                                job_id[:12], e, "which this client ran" if verdict is False else "too late to check")
                    continue
                if not p.delivered:
                    raised.append((worker.id, where))
                logger.info("Worker %s says job %s raised (%s); asking another worker", worker.id[-8:], job_id[:12], e)
                continue
            except LocalNetworkDown:  # our own daemon went (a Ctrl-C to the process group): no worker's doing
                raise
            except JobRejected as e:  # worker-specific (its limits, its price): another may take it
                taken.discard(worker.id)
                rejections.append(e)
                failed.add(worker.id)
                last_error = e
                if len(rejections) >= self.config.max_rejections:
                    kind = DeadlineUnreachable if all(isinstance(r, DeadlineUnreachable) for r in rejections) \
                        else JobRejected
                    raise kind(f"{plural(len(rejections), 'worker')} refused job {job_id[:12]}; last: {e.reason}") from None
                continue
            except (asyncio.TimeoutError, GpunetError) as e:  # the transport raises only gpunet errors
                taken.discard(worker.id)
                relayed = worker.record.reachability == "relayed"
                if (isinstance(e, ProtocolError) or isinstance(e, NetworkError) and relayed) \
                        and worker.id not in redialled:
                    # A stream can break on the way without the worker being at fault: a relay resets its circuits
                    # now and then (libp2p's limited relays after 128 KiB or 2 minutes), and under a burst of streams
                    # the p2p daemon now and then closes one before the worker's answer is through (seen here about
                    # once in 700 jobs, 30 at a time to one worker). Once per job and worker, try it again on a fresh
                    # stream before holding it against it (the job id makes a retry safe: the worker answers it once,
                    # and bills it once). A worker that could not be reached at all is not tried again.
                    redialled.add(worker.id)
                    last_error = e
                    logger.info("The connection to worker %s broke (%s); trying it again", worker.id[-8:], e)
                    continue
                error = JobTimeout(f"worker {worker.id[-8:]} took too long") if isinstance(e, asyncio.TimeoutError) else e
                ban = self._strike(worker.id)
                self.reputation.record(worker.id, "timeout" if isinstance(error, JobTimeout) else "failure")
                failed.add(worker.id)
                last_error = error
                logger.info("Worker %s failed job %s (%s); banned %.0f s, retrying elsewhere",
                            worker.id[-8:], job_id[:12], error, ban)
                continue
            finally:
                self._finished(worker.id)
            self.router.on_success(worker.id, p.shape, time.perf_counter() - t0, delivery.bytes_sent,
                                  delivery.transfer_seconds, cold=cold, ahead=ahead)
            p.delivered += 1
            for liar, _ in raised:  # it ran here: their "the job raised" was not the job's doing
                self._strike(liar)
                self.reputation.record(liar, "failure")
                logger.info("Worker %s said job %s raised, and worker %s ran it", liar[-8:], job_id[:12],
                            worker.id[-8:])
            return _Candidate(worker.id, delivery, outputs, tried)

    def _say_skips(self) -> None:
        """Log, once per worker and reason, why routing leaves a known worker out while others get the work."""
        skipped = self.router.skipped
        if skipped == self._said_skips:
            return
        for worker_id, why in skipped.items():
            if self._said_skips.get(worker_id) != why:
                entry = self.router.workers.get(worker_id)
                name = f" ({entry.record.name})" if entry is not None and entry.record.name else ""
                logger.info("Routing skips worker %s%s: it %s", worker_id[-8:], name, why)
        self._said_skips = dict(skipped)

    def _check(self, p: "_Prepared", delivery):
        """What came back must decode against the manifest and match its receipt; raises otherwise."""
        receipt = delivery.receipt
        problem = None
        if receipt.worker_id != delivery.worker_id:  # the libp2p channel authenticated who answered
            problem = InvalidReceipt(f"receipt names worker {receipt.worker_id[-8:]}, the answer came from "
                                     f"{delivery.worker_id[-8:]}")
        elif receipt.input_hash != p.input_hash:
            problem = InvalidReceipt("receipt's input hash is not the hash of the inputs sent")
        elif receipt.output_hash != sha256_hex(delivery.outputs):
            problem = InvalidReceipt("receipt's output hash is not the hash of the outputs received")
        elif (overpriced := self._overpriced(receipt)) is not None:
            problem = InvalidReceipt(overpriced)
        else:
            try:
                return p.job.decode_outputs(delivery.outputs, expected=p.outputs)
            except GpunetError as e:
                problem = ProtocolError(f"outputs do not match the program's output specs: {e}")
        self.settlement.refuse(delivery, str(problem))
        raise problem

    async def _pay(self, p: "_Prepared", c: "_Candidate", attempts: list[str], checked: bool = False,
                   trusted: bool = False) -> JobResult:
        """Countersign and record the receipt of an accepted result; refuse it if its terms are wrong."""
        try:
            # The worker's signature is checked when the receipt is filed (a moment later, off the caller's path):
            # the answer came over a channel authenticated as that worker, and the terms are checked here.
            signed = countersign(c.delivery.receipt, self.identity, output_hash=c.delivery.receipt.output_hash,
                                 max_price=p.max_price, flops=p.flops, lane=p.req.priority,
                                 check_worker_signature=False)
        except GpunetError as e:
            self.settlement.refuse(c.delivery, str(e))
            self.reputation.record(c.worker_id, "invalid")  # a receipt with terms we never agreed to
            raise
        self.books.append(signed)  # a job id is this client's own fresh uuid: never held already
        # Only a check this client can trust (its own computation, or agreement with an established worker) builds the
        # streak that makes a worker established: agreement among newcomers is what colluding identities can farm.
        self.reputation.record(c.worker_id, "valid", checked=trusted)
        # The result is ours and paid for; the worker gets its countersignature off the caller's critical path:
        # on its stream, or (unary door) riding on our next job to that worker, or in a batch shortly after.
        self.settlement.countersign(c.delivery, signed.client_signature)
        # attempts: every worker this job went to, in order (for a verified job: the replicas, then any retries).
        return JobResult(c.outputs, c.worker_id, signed, attempts + [a for a in c.attempts if a not in attempts],
                         c.delivery.bytes_sent, checked)


class _WrongAnswer(Exception):
    """A worker's answer failed the client's checks (internal: told apart from failing to answer at all)."""

    def __init__(self, error: GpunetError):
        super().__init__(str(error))
        self.error = error


def _raises(p: "_Prepared") -> bool | None:
    """The job run here (in a thread): True if it raises as a job's own error, False if it runs, None if it cannot
    run here (memory, a dtype this machine lacks)."""
    inputs = p.inputs
    if inputs is None:
        from gpunet.job import tensors

        given = tensors.decode(p.encoded)
        inputs = tuple(given[f"input_{i}"] for i in range(len(given)))
    try:
        p.job.run_locally(*inputs)
    except JobRaised:
        return True
    except (GpunetError, MemoryError):
        return None
    return False


def _raised_where(error: JobRaised) -> str:
    """Where a job raised, as a worker says (the node and the exception's type), to compare two workers' words."""
    text = str(error)
    return text[:text.index(":")] if ":" in text else text


def check_call(job, inputs: Sequence, named: dict | None = None) -> tuple[torch.Tensor, ...]:
    """What a submit was handed, as a Job and tensors in its input order (numpy arrays are taken as they are; named
    inputs go where their names say); UsageError otherwise, saying what to pass. Called where the user calls, so the
    mistake surfaces there and not in a future."""
    from gpunet.job import Job

    if not isinstance(job, Job):
        hint = (" (trace it first: gpunet.Job.from_module(model, example_inputs=(x,)))"
                if isinstance(job, torch.nn.Module) or callable(job) else "")
        raise UsageError(f"submit takes a gpunet.Job, not a {type(job).__name__}{hint}")
    return job.bind(inputs, named)


_LARGE_BYTES = 1 << 20
#: Seconds a job that already tried workers waits for them to reappear when the network looks empty (their records
#: lapse together while they restart) before it fails with NoWorkersAvailable.
EMPTY_NETWORK_WAIT = 20.0
#: A job a worker says raised (JobRaised) is run here to see, when it is this small (a few seconds on a CPU at most);
#: a bigger one needs a second worker, drawn at random, to say the same.
LOCAL_CONFIRM_FLOPS = 10**11
LOCAL_CONFIRM_BYTES = 2**30
LOCAL_CONFIRM_SECONDS = 30.0
#: Room for the safetensors header of a job's outputs (names, dtypes, shapes as JSON) on top of their data.
OUTPUT_HEADER_ALLOWANCE = 64 * 1024
MAX_ESTIMATES = 1024


def _seconds_left(req: Requirements) -> float:
    """How long a job may take in all: its timeout, cut to its deadline (DeadlineUnreachable if that has passed)."""
    if req.deadline is None:
        return req.timeout
    left = req.deadline - time.time()
    if left <= 0:
        raise DeadlineUnreachable(f"the job's deadline passed {-left:.1f} s ago")
    return min(req.timeout, left)


async def _off_loop_if_large(encode, inputs):
    """Copying big inputs takes a while; do it in a thread so other jobs' I/O keeps moving."""
    if sum(t.numel() * t.element_size() for t in inputs) >= _LARGE_BYTES:
        return await asyncio.to_thread(encode, *inputs)
    return encode(*inputs)


_THROUGHPUT_DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def _dtype_of(job) -> str | None:
    """The throughput figure that fits a job: that of its first floating-point input (fp32 for most models)."""
    for spec in job.manifest.inputs:
        if spec.dtype in _THROUGHPUT_DTYPES:
            return _THROUGHPUT_DTYPES[spec.dtype]
    return None


def _names(ids: list[str]) -> str:
    return ", ".join(i[-8:] for i in ids) or "no worker"
