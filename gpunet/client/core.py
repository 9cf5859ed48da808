"""The client's engine, shared by :class:`~gpunet.Client` and :class:`~gpunet.AsyncClient`: only their I/O differs.

It joins the network as a DHT client under its own identity and wires the client's rooms together: the worker view
(:mod:`~gpunet.client.view`), delivery (:mod:`~gpunet.client.delivery`, whose retries :mod:`~gpunet.client.attempts`
decides), verification (:mod:`~gpunet.client.verify`) and payment (:mod:`~gpunet.client.payment`). A job is
``run``: delivered, verified as asked, paid; a job id is never paid twice.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from gpunet import protocol
from gpunet.client.attempts import Replicas
from gpunet.client.delivery import Deliverer
from gpunet.client.jobs import Estimates, JobResult, check_call, prepare_job, shape_of
from gpunet.client.local import LocalRuns
from gpunet.client.payment import Payment
from gpunet.client.proofs import ProofConfig, SpeedProofs
from gpunet.client.routing import Requirements, Router, RoutingConfig
from gpunet.client.settlement import Settlement
from gpunet.client.transport import BaseTransport, P2PTransport
from gpunet.client.reputation import Reputation
from gpunet.client.verify import Verifier
from gpunet.client.view import WorkerView
from gpunet.config import (
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    DEFAULT_NETWORK,
    resolve_data_dir,
)
from gpunet.dht import network as net
from gpunet.dht.records import WorkerEntry
from gpunet.errors import GpunetError
from gpunet.identity import Identity
from gpunet.ledger.receipts import Receipt
from gpunet.ledger.store import Ledger, open_ledger
from gpunet.ledger.tabs import Tab
from gpunet.ledger.writer import LedgerWriter

__all__ = ["ClientConfig", "ClientCore", "JobResult", "check_call", "client_data_dir"]


@dataclass
class ClientConfig:
    """Client tuning, with defaults."""

    refresh_period: float = 2.0  # seconds between worker-list refreshes (at least; see refresh_pause)
    discovery_wait: float = 10.0  # how long a job waits for a first worker to appear in an empty view
    max_rejections: int = 3  # worker-specific refusals tolerated before the refusal is final
    max_resends: int = 2  # times a worker may lose a program between admission and run before it counts as failing
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    proofs: ProofConfig = field(default_factory=ProofConfig)  # challenging workers' claimed speeds


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
        transport: BaseTransport | None = None,
    ):
        """``transport``: how jobs reach workers; by default this client's own node on the p2p network."""
        self.network = net.check_network_name(network)
        self.initial_peers = net.resolve_initial_peers(initial_peers)
        self.data_dir = client_data_dir(data_dir)
        self.config = config or ClientConfig()
        self.identity = Identity.load_or_create(self.data_dir)
        self.reputation = Reputation.load(self.data_dir)
        self.router = Router(self.config.routing, reputation=self.reputation)
        self.transport = transport
        self.estimates = Estimates()
        self.local = LocalRuns()  # this machine's own runs of jobs, to check what workers say
        # Set by start():
        self.proofs: SpeedProofs | None = None  # None: routing takes claimed speeds as they are
        self.settlement: Settlement | None = None
        self.ledger: Ledger | None = None
        self.books: LedgerWriter | None = None  # receipts are filed in batches, after the result is handed back
        self.payment: Payment | None = None
        self.view: WorkerView | None = None
        self.deliverer: Deliverer | None = None
        self.verifier: Verifier | None = None
        self.closed = False

    @property
    def program_bytes_sent(self) -> int:
        """Program bytes this client has uploaded to workers, in all: what workers fetching programs from each other
        spare its link (gpunet.worker.peers)."""
        return self.transport.program_bytes_sent if self.transport is not None else 0

    @property
    def weight_bytes_sent(self) -> int:
        """Of those, the weights programs name by reference that workers held nowhere (docs/weights.md)."""
        return getattr(self.transport, "weight_bytes_sent", 0) if self.transport is not None else 0

    @property
    def id(self) -> str:
        return self.identity.peer_id

    async def start(self) -> None:
        if self.transport is None:
            self.transport = await P2PTransport.connect(self.network, self.initial_peers, self.identity)
        self.settlement = Settlement(self.transport)
        if self.config.proofs.enabled and self.transport.proves:
            self.proofs = SpeedProofs(self.transport, self.router, self.reputation, self.config.proofs)
        self.ledger = open_ledger(self.data_dir)
        self.payment = Payment(self.identity, self.router, self.reputation, self.settlement, books=None)
        self.books = self.payment.books = LedgerWriter(self.ledger, on_refused=self.payment.refused)
        config = self.config
        self.view = WorkerView(self.router, self.reputation, self.transport, self.network,
                               refresh_period=config.refresh_period, discovery_wait=config.discovery_wait,
                               proofs=self.proofs)
        self.deliverer = Deliverer(self.transport, self.view, self.settlement, self.payment, self.local,
                                   self.estimates, max_rejections=config.max_rejections,
                                   max_resends=config.max_resends, refresh_period=config.refresh_period)
        self.verifier = Verifier(self.deliverer, self.payment, self.view, self.local, self.reputation)
        await self.view.start()

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
        if self.view is not None:
            await self.view.close()
        if self.proofs is not None:
            await self.proofs.close()
        if self.transport is not None:
            await self.transport.close()
        if self.ledger is not None:
            self.ledger.close()
        self.local.close()
        self.reputation.save()

    async def refresh(self) -> list[WorkerEntry]:
        return await self.view.refresh()

    def workers(self) -> list[WorkerEntry]:
        return list(self.router.workers.values())

    async def flush_ledger(self) -> None:
        """Write receipts still queued, so a reader of the ledger file sees every job that has returned."""
        if self.books is not None:
            self.books.flush()

    async def estimate(self, job, inputs: Sequence[torch.Tensor]):
        """FLOPs, memory and output shapes by the dry run a worker bills from (cached per program and shapes)."""
        return await self.estimates.of(job, inputs)

    # --- jobs ------------------------------------------------------------------------------------------------------

    async def run(self, job, inputs: Sequence[torch.Tensor], requirements: Requirements | None = None,
                  job_id: str | None = None) -> JobResult:
        """Deliver, verify as asked, pay: the checked, countersigned result."""
        self.check_open()
        inputs = check_call(job, inputs)
        p = await prepare_job(job, inputs, requirements or Requirements(), job_id or uuid.uuid4().hex,
                              self.estimates)
        await self.view.some_workers(p.req)
        if p.req.redundancy == 1 and p.req.verify == "none":
            answer = await self.deliverer.deliver(p, p.job_id, Replicas())
            return await self.payment.pay(p, answer, [])
        return await self.verifier.run(p)

    # --- inference sessions (gpunet.client.sessions drives them) ---------------------------------------------------

    async def place(self, job, inputs: Sequence[torch.Tensor], requirements: Requirements | None = None,
                    exclude: set[str] = frozenset(), avoid: set[str] = frozenset(), drawn: bool = False,
                    prefer: Sequence[str] = ()) -> WorkerEntry:
        """The worker routing would send ``job`` to now (``inputs`` may be meta tensors: only shapes matter),
        passing over ``avoid`` where it can; ``drawn``: one drawn at random, as a checker is (a second opinion);
        ``prefer``: workers taken first where eligible (Router.choose)."""
        self.check_open()
        req = requirements or Requirements()
        estimate = await self.estimates.of(job, inputs)
        return await self.view.place(req, shape_of(job, estimate, 0, req), exclude, avoid, drawn, prefer)

    def held_against(self, worker_id: str, outcome: str) -> None:
        """A worker's misdeed seen outside a job's own retries (a session's span): a ban, and its record."""
        self.view.strike(worker_id, outcome)

    async def run_step(self, job, inputs: Sequence[torch.Tensor], worker_id: str, session: protocol.SessionStep,
                       state: Sequence[torch.Tensor], tab: Tab, requirements: Requirements | None = None,
                       check=None, pushed=None) -> JobResult:
        """One session step on the worker that holds its state (:meth:`Deliverer.step`)."""
        self.check_open()
        return await self.deliverer.step(job, inputs, worker_id, session, state, tab,
                                         requirements or Requirements(), check=check, pushed=pushed)

    async def close_session(self, worker_id: str, session_id: str, tab: Tab | None = None,
                            max_price: int | None = None) -> Receipt | None:
        """Free a session's state on its worker and pay its steps not billed yet (:meth:`Deliverer.close_session`)."""
        return await self.deliverer.close_session(worker_id, session_id, tab, max_price)
