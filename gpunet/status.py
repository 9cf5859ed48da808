"""What ``gpunet status`` shows: the network as any client reads it from the DHT, for people and for programs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rich.table import Table
from rich.text import Text

from gpunet.dht import network as net
from gpunet.dht import registry
from gpunet.dht.records import WorkerState
from gpunet.dht.registry import WorkerEntry
from gpunet.utils import plural
from gpunet.identity import short_id
from gpunet.ledger.receipts import NANO, format_credits

if TYPE_CHECKING:
    from gpunet.client.trust import Reputation


@dataclass(frozen=True)
class NetworkStatus:
    network: str
    workers: list[WorkerEntry]
    read_at: float = field(default_factory=time.time)
    reputation: Reputation | None = None  # how the reading client rates each worker, if it has history

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
                    "maddrs": list(r.maddrs),
                    "reachability": r.reachability,
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
                 ratings: Callable[[], "Reputation | None"] | None = None):
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


def _trust_cell(rating: dict | None) -> str:
    if rating is None:
        return "-"
    style = "green" if rating["score"] >= 0.9 else "yellow" if rating["score"] >= 0.5 else "red"
    return f"[{style}]{rating['score']:.2f}[/]"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


_STATE_STYLE = {"online": "green", "joining": "yellow", "paused": "yellow", "draining": "magenta", "offline": "dim"}


_COLUMNS = ("worker", "state", "device", "GiB free", "TFLOPS", "price", "queue", "jobs", "earned", "trust", "reach",
            "up")
#: On a narrow terminal, columns are left out in this order (whole, never cut) until the table fits.
_DROP_ORDER = ("up", "reach", "trust", "queue", "GiB free", "jobs", "state")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_table(status: NetworkStatus, width: int | None = None) -> Table:
    """The status table; ``width``: the console's, so columns that do not fit are left out whole, never cut."""
    totals = status.totals
    table = Table(
        title=f"gpunet network {status.network!r}",
        caption=(
            f"{plural(totals['workers'], 'worker')} ({totals['online']} online), {plural(totals['gpus'], 'GPU')}, "
            f"{totals['tflops']:.3g} TFLOPS, {totals['jobs_done']} jobs done, {totals['queued']} queued; "
            "price: credits per TFLOP, interactive/batch floor"
        ),
    )
    rows = []
    for w in status.workers:
        r = w.record
        count = "" if r.device.count == 1 else f"{r.device.count}x "
        best = max(r.tflops.items(), key=lambda kv: kv[1], default=None)
        # A peer's words go in as Text, never as markup (escaping them still showed a trailing backslash doubled).
        state = Text(r.state.value, style=_STATE_STYLE.get(r.state.value, ""))
        if r.state.value == "paused" and r.pause_reason:
            state.append("\n" + _cut(r.pause_reason, 24), style="dim")
        rows.append((
            Text(short_id(w.id) + (f"\n{r.name}" if r.name else "")),
            state,
            Text(f"{count}{r.device.name}") if r.device.kind == "cuda" else f"CPU {r.device.cores}c",
            f"{_gib(r.device.memory_free)}/{_gib(r.device.memory_total)}",
            Text(f"{best[1]:.3g} {best[0]}") if best else "-",
            f"{r.price:g}" + (f"/{r.batch_floor:g}" if r.batch_floor is not None else ""),
            f"{r.queue}/{r.max_concurrent}",
            str(r.jobs_done),
            format_credits(round(r.credits_earned * NANO)),  # as the ledger prints credits
            _trust_cell(status._rating(w.id)),
            Text(r.reachability),
            _duration(r.uptime(status.read_at)),
        ))
    columns = list(_COLUMNS)
    widths = {c: max([len(c), *(len(line) for row in rows for line in _plain(row[i]).split("\n"))])
              for i, c in enumerate(columns)}
    widths["worker"], widths["device"] = 12, 10  # text columns give way down to this, with an ellipsis
    hidden = []
    while width is not None and sum(widths[c] + 3 for c in columns) + 1 > width and len(hidden) < len(_DROP_ORDER):
        drop = _DROP_ORDER[len(hidden)]
        columns.remove(drop)
        hidden.append(drop)
    room = None
    if width is not None:  # what the figures leave, shared by the two text columns
        room = max(12, width - 1 - sum(widths[c] + 3 for c in columns if c not in ("worker", "device")) - 6)
    for column in columns:
        if column in ("worker", "device"):  # text that may be shortened (with an ellipsis) on a narrow terminal
            table.add_column(column, justify="left", no_wrap=True, overflow="ellipsis", min_width=6,
                             max_width=None if room is None else max(6, room // 2))
        else:  # figures are never cut: they keep their full width and the text columns give way
            table.add_column(column, justify="left" if column == "state" else "right", no_wrap=True,
                             min_width=widths[column])
    keep = [i for i, c in enumerate(_COLUMNS) if c in columns]
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    if hidden:
        table.caption += f"; too narrow for {', '.join(hidden)} (widen the terminal, or --json)"
    versions = sorted({w.record.version for w in status.workers})
    if versions:  # peers' words: as Text
        table.caption = Text(table.caption) + Text(f"; gpunet {', '.join(versions)}")
    return table


def _plain(cell: str | Text) -> str:
    return cell.plain if isinstance(cell, Text) else Text.from_markup(cell).plain
