"""What ``gpunet status`` shows: the network read from the DHT (gpunet.dht.status, which also gives its ``--json``
form), as a table for people."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from gpunet.dht.status import NetworkStatus
from gpunet.identity import short_id
from gpunet.ledger.receipts import NANO, format_credits
from gpunet.utils import plural


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
            "models", "up")
#: On a narrow terminal, columns are left out in this order (whole, never cut) until the table fits.
_DROP_ORDER = ("up", "models", "reach", "trust", "queue", "GiB free", "jobs", "state")


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
            Text(r.reachability + (f"\n{r.punched} punched" if r.punched else "")),
            " ".join(c[:6] for c in r.checkpoints[:2]) + ("…" if len(r.checkpoints) > 2 else "") or "-",
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
