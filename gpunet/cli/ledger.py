"""``gpunet ledger …``: read, check, export and merge this node's ledger. A thin shell over :mod:`gpunet.ledger`.

Exit codes, as for every ``gpunet`` command (gpunet.cli.exits): 0 success; 1 the ledger failed verification, a merge
refused receipts or found conflicts, or a job was not found; 2 unusable input (no such file, not a ledger, bad option).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpunet.cli.exits import handle_errors
from gpunet.config import DATA_DIR_ENV, DEFAULT_DATA_DIR
from gpunet.errors import ConfigError, GpunetError, LedgerCorrupted, LedgerError
from gpunet.identity import KEY_FILENAME, Identity, short_id
from gpunet.ledger.balances import Balance, balances
from gpunet.ledger.export import write_csv, write_json
from gpunet.ledger.receipts import Receipt, format_credits
from gpunet.ledger.store import LEDGER_FILENAME, Ledger, open_ledger
from gpunet.ledger.vouching import load_trusted, read_trust_file, save_trusted, trust_path
from gpunet.utils import wide_console

app = typer.Typer(
    name="ledger",
    help="This node's ledger: receipts for jobs it ran or paid for, signed by both sides.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: flags shown as flags (rich's renders "--json <bool>"), arguments as FILE
    context_settings={"help_option_names": ["-h", "--help"]},
)

DataDir = Annotated[
    Optional[Path],
    typer.Option("--data-dir", metavar="DIR", help="Node data dir (default: $GPUNET_DATA_DIR or ~/.gpunet).", show_default=False),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for programs instead of a table.")]

_out = wide_console()  # piped to a file or a pager: whole columns, not cut at rich's 80
_err = Console(stderr=True)


def _command(func: Callable) -> Callable:
    """Register a subcommand that ends on an error as every gpunet command does (gpunet.cli.exits)."""
    return app.command()(handle_errors(func))


def _print_json(value: object) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def _own_id(data_dir: Path) -> str | None:
    """This node's peer id if it has a key already (reading the ledger never creates one)."""
    path = data_dir / KEY_FILENAME
    return Identity.load(path).peer_id if path.exists() else None


def _read_ledger(data_dir: Path | None) -> Ledger:
    """The ledger a reading command looks at; LedgerError (exit 2) if there is none: reading never creates a data
    dir or an empty ledger, so a mistyped --data-dir is said as such instead of showing "no receipts"."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    path = Path(raw).expanduser() / LEDGER_FILENAME
    if not path.is_file():
        client = path.parent / "client" / LEDGER_FILENAME
        if data_dir is None and client.is_file():
            raise LedgerError(f"no ledger at {path}; jobs you submitted from Python are in the client's ledger: "
                              f"add --data-dir {client.parent}")
        raise LedgerError(f"no ledger at {path}: is --data-dir right? (a worker keeps its ledger in its data dir, a "
                          "Python client in <data dir>/client)")
    return open_ledger(path.parent)


def _time(us: int) -> str:
    """A receipt's time as people read it; one no calendar holds (a merged receipt may say anything) as it is."""
    try:
        return datetime.fromtimestamp(us / 1e6, timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (ValueError, OverflowError, OSError):
        return f"{us} µs"


def _trusted(directory: Path, extra: Optional[Path]) -> frozenset[str]:
    """The node's trust list (``gpunet ledger trust``) and, for this command only, the peer ids listed in ``extra``."""
    return load_trusted(directory) | (read_trust_file(extra) if extra is not None else frozenset())


TrustFile = Annotated[Optional[Path], typer.Option(
    "--trust", metavar="FILE", help="Also count receipts with a party among the peer ids in FILE (one per line), for "
    "this command only; `gpunet ledger trust add` keeps a peer for good.")]


def _balance(data_dir: DataDir = None, trust: TrustFile = None, as_json: AsJson = False) -> None:
    """Earned, spent and net credits per identity in this ledger (receipts this node vouches for: its own, or with a
    party it trusts), merged credit it does not vouch for apart, and work still awaiting a countersignature."""
    with _read_ledger(data_dir) as ledger:
        directory = ledger.path.parent
        me = _own_id(directory)
        trusted = _trusted(directory, trust)
        totals = sorted(ledger.balances(trusted, me=me).values(), key=lambda b: (-b.net, b.identity))
        owed = balances(ledger.unpaid())
    apart = sorted((b for b in totals if b.jobs_unvouched), key=lambda b: (-b.earned_unvouched, b.identity))
    if as_json:
        _print_json(
            {
                "identity": me,
                "trusted": sorted(trusted),
                "balances": [b.to_dict() for b in totals],
                "earned_unvouched": sum(b.earned_unvouched for b in totals),  # all identities': counted nowhere
                "unpaid": [{"client_id": b.identity, "amount": b.spent, "jobs": b.jobs_bought}
                           for b in owed.values() if b.jobs_bought],
            }
        )  # fmt: skip
        return
    shown = [b for b in totals if b.vouched]
    title = "Balances (credits)" + (f", receipts with the {len(trusted)} trusted peers counted too" if trusted else "")
    if apart and not shown:
        _out.print("No receipts this node vouches for (its own jobs', or with a peer it trusts).")
    elif shown:
        _out.print(_balance_table(title, me, shown, ("jobs worked", "earned", "jobs bought", "spent", "net"),
                                  lambda b: (str(b.jobs_worked), format_credits(b.earned), str(b.jobs_bought),
                                             format_credits(b.spent), format_credits(b.net))))
    if apart:
        _out.print(_balance_table(
            "Merged, not vouched for (counted in no figure above: signed by peers this node never dealt with; "
            "`gpunet ledger trust add PEER` counts a peer's receipts)", me, apart, ("jobs", "earned", "spent"),
            lambda b: (str(b.jobs_unvouched), format_credits(b.earned_unvouched), format_credits(b.spent_unvouched))))
    if not shown and not apart:
        if data_dir is None and (directory / "client" / LEDGER_FILENAME).exists():
            _out.print(f"No receipts yet in {directory}. Jobs you submitted from Python are in the client's ledger: "
                       f"gpunet ledger balance --data-dir {directory / 'client'}")
        else:
            _out.print("No receipts yet.")
    unpaid = [b for b in owed.values() if b.jobs_bought]
    if unpaid:
        total = sum(b.spent for b in unpaid)
        jobs = sum(b.jobs_bought for b in unpaid)
        _out.print(f"Not countersigned: {jobs} job(s), {format_credits(total)} credits (see `gpunet ledger unpaid`).")


app.command("balance")(handle_errors(_balance))
app.command("balances", hidden=True)(handle_errors(_balance))  # the plural people type too


def _balance_table(title: str, me: str | None, rows: list[Balance], columns: tuple[str, ...],
                   cells: Callable[[Balance], tuple[str, ...]]) -> Table:
    """One row per identity; on a narrow terminal an identity folds onto more lines, figures stay whole."""
    table = Table(title=Text(title), title_justify="left")
    lines = [(b.identity + (" (this node)" if b.identity == me else ""), *cells(b)) for b in rows]
    table.add_column("identity", overflow="fold", min_width=12)
    for i, column in enumerate(columns, 1):
        header = column.replace(" ", "\n", 1) if column.startswith("jobs ") else column  # narrower: two lines
        table.add_column(header, justify="right", no_wrap=True,
                         min_width=max([*map(len, header.split("\n")), *(len(line[i]) for line in lines)]))
    for line in lines:
        table.add_row(*line)
    return table


def _flops(n: int) -> str:
    for scale, unit in ((10**18, "E"), (10**15, "P"), (10**12, "T"), (10**9, "G"), (10**6, "M")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


_SIGNATURES = ("worker_signature", "client_signature")


def _receipt_table(title: str | Text, rows: list[tuple[int | None, Receipt]]) -> Table:
    """Newest-first rows of receipts; the job id is never cut (it is what ``show --job`` takes)."""
    table = Table(title=title, title_justify="left")
    with_seq = any(seq is not None for seq, _ in rows)
    if with_seq:
        table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("job", overflow="fold", min_width=8)
    for column in ("worker", "client", "FLOPs", "credits", "ended (UTC)"):
        table.add_column(column, justify="left" if column in ("worker", "client") else "right", no_wrap=True)
    for seq, r in rows:
        cells = [Text(r.job_id), short_id(r.worker_id), short_id(r.client_id), _flops(r.flops), format_credits(r.amount),
                 _time(r.ended_at_us)]  # fmt: skip
        table.add_row(*([str(seq)] if with_seq else []), *cells)
    return table


@_command
def show(
    data_dir: DataDir = None,
    limit: Annotated[int, typer.Option("--limit", "-n", metavar="N", min=1, help="How many of the newest entries.")] = 20,
    job: Annotated[Optional[str], typer.Option("--job", metavar="ID", help="Show the full receipt of one job.")] = None,
    as_json: AsJson = False,
) -> None:
    """The newest receipts, or one job's full receipt."""
    with _read_ledger(data_dir) as ledger:
        if job is not None:
            found = ledger.find(job)  # job ids are each client's own: two clients may have used the same one
            if not found:
                raise GpunetError(f"no receipt for job {job!r} in this ledger")  # exit 1, "error: ..."
            if as_json:  # one object; a list only when several clients' jobs share the id
                _print_json(found[0].to_dict() if len(found) == 1 else [r.to_dict() for r in found])
                return
            for receipt in found:
                table = Table(title=Text(f"Receipt for job {job} of client {short_id(receipt.client_id)}"),
                              title_justify="left", show_header=False)
                for key, value in receipt.to_dict().items():
                    table.add_row(key, Text(str(value)))  # a merged receipt's text is anyone's: never markup
                _out.print(table)
            return
        entries = ledger.entries(limit, newest_first=True)
        head = ledger.head()
    if as_json:
        _print_json({"head": head._asdict(), "entries": [{"seq": e.seq, **e.receipt.to_dict()} for e in entries]})
        return
    _out.print(_receipt_table(f"Newest {len(entries)} of {head.count} receipts", [(e.seq, e.receipt) for e in entries]))


@_command
def verify(data_dir: DataDir = None, as_json: AsJson = False) -> None:
    """Check every signature and the whole hash chain; exit 1 naming the first bad entry on any tampering."""
    with _read_ledger(data_dir) as ledger:
        path = ledger.path
        try:
            head = ledger.verify()
        except LedgerCorrupted as e:
            if as_json:
                _print_json({"ok": False, "ledger": str(path), "entry": e.entry, "error": str(e)})
            else:
                _err.print(Text.assemble(("FAILED", "red"), f" {path}: {e}"), highlight=False)
            raise typer.Exit(1) from None
    if as_json:
        _print_json({"ok": True, "ledger": str(path), **head._asdict()})
    else:
        _out.print(f"OK {path}: {head.count} entries, every signature and link valid; head {head.head_hash}",
                   highlight=False)  # fmt: skip


class ExportFormat(str, Enum):
    csv = "csv"
    json = "json"


@_command
def export(
    data_dir: DataDir = None,
    format: Annotated[ExportFormat, typer.Option("--format", "-f", metavar="FORMAT", help="Output format.")] = ExportFormat.csv,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", metavar="FILE", help="Write here instead of stdout (- is stdout).")] = None,
) -> None:
    """Every receipt, for settlement outside gpunet (each row keeps the exact signed receipt, base64)."""
    if output is not None and str(output) == "-":
        output = None
    with _read_ledger(data_dir) as ledger:
        entries = ledger.entries()
        head = ledger.head()
    try:
        out = open(output, "w", newline="") if output else sys.stdout
    except OSError as e:
        raise ConfigError(f"cannot write {output}: {e.strerror}") from None
    try:
        count = write_csv(entries, out) if format is ExportFormat.csv else write_json(entries, head, out)
    finally:
        if output:
            out.close()
    if output:
        _err.print(f"wrote {count} receipts to {output}", highlight=False)


@_command
def merge(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Another node's ledger.sqlite, or a `gpunet ledger export -f json`.")],
    data_dir: DataDir = None,
    as_json: AsJson = False,
) -> None:
    """Import another node's receipts: union by job id; invalid receipts refused; conflicts reported, never chosen."""
    with open_ledger(data_dir) as ledger:
        report = ledger.merge(file)
    if as_json:
        _print_json(report.to_dict())
    else:
        _out.print(Text(f"merged {file}: {report.added} added, {report.duplicates} already held, "
                   f"{report.refused_count} refused, {report.conflicts_count} conflicts"), highlight=False)  # fmt: skip
        for where, reason in report.refused:
            _err.print(Text(f"refused {where}: {reason}"), highlight=False)  # a hostile file's words: never markup
        for job_id in report.conflicts:
            _err.print(Text.assemble(("CONFLICT", "red"), f" job {job_id}: a different valid receipt is already held; "
                                     "both kept (see `gpunet ledger conflicts`)"), highlight=False)
        unlisted = report.refused_count - len(report.refused) + report.conflicts_count - len(report.conflicts)
        if unlisted:
            _err.print(f"... and {unlisted} more (only the first {report.MAX_LISTED} of each are listed)",
                       highlight=False)
    if not report.clean:
        raise typer.Exit(1)


@_command
def unpaid(data_dir: DataDir = None, as_json: AsJson = False) -> None:
    """Jobs this node ran whose client never countersigned the receipt."""
    with _read_ledger(data_dir) as ledger:
        receipts = ledger.unpaid()
    if as_json:
        _print_json([r.to_dict() for r in receipts])
    else:
        _out.print(_receipt_table("Not countersigned", [(None, r) for r in receipts]) if receipts else "None.")


@_command
def conflicts(data_dir: DataDir = None, as_json: AsJson = False) -> None:
    """Jobs for which two different valid receipts were seen: evidence of fraud, kept side by side."""
    with _read_ledger(data_dir) as ledger:
        found = ledger.conflicts()
    if as_json:
        _print_json([{"job_id": c.job_id, "source": c.source, "held": c.existing.to_dict(), "other": c.other.to_dict()}
                     for c in found])  # fmt: skip
        return
    if not found:
        _out.print("None.")
    for c in found:
        _out.print(_receipt_table(Text(f"Job {c.job_id}: held vs. from {c.source}"), [(None, c.existing), (None, c.other)]))
        held, other = c.existing.to_dict(), c.other.to_dict()
        for key in (k for k in held if k not in _SIGNATURES and held[k] != other.get(k)):  # what the table may not show
            _out.print(Text(f"  {key}: held {held[key]} / other {other.get(key)}"))



@handle_errors
def earnings_command(
    data_dir: DataDir = None,
    since: Annotated[Optional[str], typer.Option(
        "--since", metavar="WHEN", help="From a date (2026-12-01), a date and time, or a span back (36h, 7d, 2w).")] = None,
    by: Annotated[str, typer.Option("--by", metavar="day|client", help="Group paid work by local day or by client.")]
    = "day",
    trust: TrustFile = None,
    as_json: AsJson = False,
) -> None:
    """What this worker earned (from its own ledger): jobs, counted work and credits, and every job not paid, with the
    reason."""
    from gpunet.ledger.earnings import check_grouping, earnings, parse_since

    start = parse_since(since)
    check_grouping(by)  # a mistake in the command is said first, wherever the data dir points
    with _read_ledger(data_dir) as ledger:
        me = _own_id(ledger.path.parent)
        if me is None:
            raise LedgerError(f"no worker identity in {ledger.path.parent}: earnings are a worker's (its data dir)")
        report = earnings(ledger, me, start, by, trusted=_trusted(ledger.path.parent, trust))
    if as_json:
        _print_json(report.to_json())
        return
    out = wide_console()  # a volunteer pipes it to a file or a pager too: whole columns, not cut at 80
    title = f"Earnings of worker {short_id(me)}" + (f" since {_time(int(start * 1e6))} UTC" if start else "")
    table = Table(title=title, title_justify="left")
    for column in (by, "jobs", "TFLOP", "credits"):
        table.add_column(column, justify="left" if column == by else "right")
    for key, tally in report.rows.items():
        table.add_row(short_id(key) if by == "client" else Text(key), str(tally.jobs), f"{tally.flops / 1e12:.4g}",
                      format_credits(tally.nano))
    table.add_row("total", str(report.total.jobs), f"{report.total.flops / 1e12:.4g}", format_credits(report.total.nano),
                  style="bold")
    out.print(table)
    if report.unvouched.jobs:
        out.print(f"Merged, not vouched for: {report.unvouched.jobs} receipt(s) naming this worker, "
                  f"{format_credits(report.unvouched.nano)} credits, counted in no figure above (they came by `gpunet "
                  "ledger merge`, not from this worker's own jobs; `gpunet ledger trust add PEER` counts a peer's)",
                  highlight=False)
    if len(report.lanes) > 1 or report.background_runs:
        lanes = ", ".join(f"{lane} {t.jobs} jobs / {format_credits(t.nano)} credits" for lane, t in report.lanes.items())
        own = f"; your own background job ran {report.background_runs} times (free)" if report.background_runs else ""
        out.print(f"By lane: {lanes or 'none'}{own}", highlight=False)
    if report.unpaid:
        owed = Table(title="Delivered, not paid (no countersignature)", title_justify="left")
        for column in ("job", "client", "credits", "delivered (UTC)", "why"):
            owed.add_column(column, overflow="fold" if column == "job" else "ellipsis")
        for o in report.unpaid:
            owed.add_row(Text(o.job_id), short_id(o.client_id), format_credits(o.nano),
                         _time(int(o.delivered_at * 1e6)), o.reason)
        out.print(owed)
    if report.unbilled:
        lost = Table(title="Work not billed", title_justify="left")
        for column in ("when (UTC)", "job", "client", "lane", "why", "detail"):
            lost.add_column(column, overflow="fold")
        for n in report.unbilled:  # a client's words, and other strangers' text: shown as text, never as markup
            lost.add_row(_time(n.recorded_at_us), Text(n.job_id), short_id(n.client_id), Text(n.lane),
                         Text(n.reason.replace("_", " ")), Text(n.detail))
        out.print(lost)
    if not report.total.jobs and not report.unpaid and not report.unbilled and not report.unvouched.jobs:
        out.print("No jobs yet" + (" in that time." if start else "."))


trust_app = typer.Typer(
    help="Peers whose receipts this node counts as credit even when they came by `merge` (docs/ledger.md).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(trust_app, name="trust")
Peers = Annotated[list[str], typer.Argument(metavar="PEER...", help="Peer ids (12D3KooW…).")]


def _node_dir(data_dir: Path | None) -> Path:
    """The node's data dir, as given or by default (not created: a trust list is written into an existing node)."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise ConfigError(f"no node data dir at {path}: is --data-dir right?")
    return path


@trust_app.command("add")
@handle_errors
def trust_add(peers: Peers, data_dir: DataDir = None) -> None:
    """Count receipts with this peer as a party (worker or client) as credit, merged ones too: trust that its
    signature means real work."""
    directory = _node_dir(data_dir)
    trusted = save_trusted(directory, add=peers)
    _out.print(Text(f"{trust_path(directory)}: {len(trusted)} trusted peer(s)"), highlight=False)


@trust_app.command("remove")
@handle_errors
def trust_remove(peers: Peers, data_dir: DataDir = None) -> None:
    """Stop counting merged receipts of these peers (receipts this node filed itself always count)."""
    directory = _node_dir(data_dir)
    unknown = sorted(set(p.strip() for p in peers) - load_trusted(directory))
    trusted = save_trusted(directory, remove=peers)
    if unknown:
        _err.print(Text(f"not in the trust list: {', '.join(unknown)}"), highlight=False)
    _out.print(Text(f"{trust_path(directory)}: {len(trusted)} trusted peer(s)"), highlight=False)


@trust_app.command("list")
@handle_errors
def trust_list(data_dir: DataDir = None, as_json: AsJson = False) -> None:
    """The peers whose receipts this node counts as credit besides its own."""
    trusted = sorted(load_trusted(_node_dir(data_dir)))
    if as_json:
        _print_json(trusted)
    else:
        _out.print("\n".join(trusted) if trusted else "None: only receipts this node filed itself count.",
                   highlight=False)
