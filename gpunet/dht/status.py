"""The network as any node reads it from the DHT (``gpunet status``, ``gpunet doctor``, the explorer): the workers'
records, the totals, and the reading client's ratings of them if it has any. How it is shown is the shell's
(gpunet.cli.status renders the table, gpunet.cli.explorer the page)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from gpunet.dht import network as net
from gpunet.dht import registry
from gpunet.dht.records import WorkerState
from gpunet.dht.records import WorkerEntry


class Ratings(Protocol):
    """How a client rates workers (gpunet.client.trust.Reputation has this shape; the DHT layer knows no client)."""

    workers: dict

    def score(self, worker_id: str) -> float: ...


@dataclass(frozen=True)
class NetworkStatus:
    network: str
    workers: list[WorkerEntry]
    read_at: float = field(default_factory=time.time)
    reputation: Ratings | None = None  # how the reading client rates each worker, if it has history

    @property
    def totals(self) -> dict[str, Any]:
        live = [w for w in self.workers if w.state is not WorkerState.OFFLINE]
        gpus = sum(w.record.device.count for w in live if w.record.device.kind == "cuda")
        return {
            "workers": len(live),
            "online": sum(w.state is WorkerState.ONLINE for w in live),
            "gpus": gpus,
            "tflops": round(sum(w.record.best_tflops for w in live), 4),
            "memory_total": sum(w.record.device.memory_total * w.record.device.count for w in live),
            "jobs_done": sum(w.record.jobs_done for w in live),
            "queued": sum(w.record.queue for w in live),
        }

    def _rating(self, worker_id: str) -> dict[str, Any] | None:
        """This client's view of the worker (see gpunet.client.trust), or None without history."""
        if self.reputation is None or worker_id not in self.reputation.workers:
            return None
        t = self.reputation.workers[worker_id]
        return {"score": round(self.reputation.score(worker_id), 4), "honesty": round(t.honesty, 4),
                "availability": round(t.availability, 4), "streak": t.streak, "valid": round(t.valid, 2),
                "invalid": round(t.invalid, 2),
                "rejected": round(t.rejected, 2), "failures": round(t.failures, 2), "timeouts": round(t.timeouts, 2)}

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` contract: ``{"network", "workers": [{"id", "state", "device", "tflops", "price", ...}], "totals"}``."""
        workers = []
        for w in self.workers:
            r = w.record
            workers.append(
                {
                    "id": w.id,
                    "name": r.name,
                    "state": r.state.value,
                    "pause_reason": r.pause_reason,
                    "device": r.device.model_dump(mode="json", exclude_none=True),
                    "tflops": dict(r.tflops),
                    "price": r.price,
                    "batch_price": r.batch_price,  # the batch floor's least; None: a worker without lanes
                    "batch_floor": r.batch_floor,
                    "batch_queue": r.batch_queue,
                    "interactive_load": r.interactive_load,
                    "preemptions_per_hour": r.preemptions_per_hour,
                    "max_concurrent": r.max_concurrent,
                    "queue": r.queue,
                    "jobs_done": r.jobs_done,
                    "uptime": round(r.uptime(self.read_at), 1),
                    "version": r.version,
                    "programs": list(r.programs),
                    "checkpoints": list(r.checkpoints),  # held in full in its models dirs (docs/weights.md)
                    "maddrs": list(r.maddrs),
                    "reachability": r.reachability,
                    "punched": r.punched,  # NATed workers it reaches by a hole-punched connection now
                    "peer_bytes": {"served": r.peer_bytes_served, "fetched": r.peer_bytes_fetched},
                    "ledger": {"count": r.ledger_count, "head": r.ledger_head, "credits_earned": r.credits_earned},
                    "expires_in": round(w.expiration_time - self.read_at, 1),
                    "rating": self._rating(w.id),
                }
            )
        return {"network": self.network, "workers": workers, "totals": self.totals}


class StatusReader:
    """The one reader of a network's status (``gpunet status``, ``gpunet doctor``): joins once, reads as often as asked.

    With ``ratings`` (say, loading a client's reputation file) each read also carries how that client rates each
    worker; it is called on every read, since a client running meanwhile keeps rating workers.
    """

    def __init__(self, network: str, initial_peers: Sequence[str] | None,
                 ratings: Callable[[], Ratings | None] | None = None):
        self.network = network
        self.ratings = ratings
        self.dht = net.join_as_client(network, initial_peers)

    def read(self, timeout: float = 30.0) -> NetworkStatus:
        reputation = self.ratings() if self.ratings is not None else None
        workers = registry.discover(self.dht, self.network, timeout=timeout)
        return NetworkStatus(self.network, workers, reputation=reputation)

    def close(self) -> None:
        self.dht.shutdown()

    def __enter__(self) -> "StatusReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
