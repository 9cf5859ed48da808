"""Exports for settlement outside gpunet: CSV for spreadsheets, JSON for programs.

Each row carries the readable fields (money both as integer nano-credits and as exact decimal credits) and the
receipt's exact bytes (base64), so an export stays checkable: ``gpunet ledger merge`` accepts a JSON export, and any
row can be re-verified by decoding its ``receipt`` column.
"""

from __future__ import annotations

import base64
import binascii
import csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from gpunet.errors import LedgerError
from gpunet.ledger.entries import Entry, LedgerHead
from gpunet.ledger.receipts import Receipt, format_credits

EXPORT_FORMAT = "gpunet-ledger-export"
EXPORT_VERSION = 2  # 2: prices per TFLOP, amounts in nano-credits (receipt format 2); version 1 exports still merge
READABLE_EXPORT_VERSIONS = (1, 2)
CSV_COLUMNS = (
    "seq", "job_id", "client_id", "worker_id", "program_hash", "input_hash", "output_hash", "flops", "wall_time_us",
    "price", "max_price", "amount", "price_credits_per_tflop", "amount_credits", "started_at_us", "ended_at_us",
    "lane", "worker_signature", "client_signature", "receipt",
)  # fmt: skip


def export_row(seq: int, receipt: Receipt) -> dict[str, Any]:
    """One receipt as export fields, in ``CSV_COLUMNS`` order (plus ``format_version``)."""
    row: dict[str, Any] = {"seq": seq, **receipt.to_dict()}
    row["price_credits_per_tflop"] = format_credits(receipt.price)
    row["amount_credits"] = format_credits(receipt.amount)
    row["receipt"] = base64.b64encode(receipt.to_bytes()).decode()
    return row


def write_csv(entries: Iterable[Entry], out: TextIO) -> int:
    """Write one CSV row per entry; returns how many."""
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    count = 0
    for entry in entries:
        writer.writerow(export_row(entry.seq, entry.receipt))
        count += 1
    return count


def write_json(entries: Iterable[Entry], head: LedgerHead, out: TextIO) -> int:
    """Write a JSON document ``{format, version, head, receipts: [...]}``, streamed row by row; returns how many."""
    out.write(json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "head": head._asdict()})[:-1])
    out.write(', "receipts": [')
    count = 0
    for entry in entries:
        out.write(",\n  " if count else "\n  ")
        out.write(json.dumps(export_row(entry.seq, entry.receipt)))
        count += 1
    out.write("\n]}\n")
    return count


#: An export is read a row at a time in the layout :func:`write_json` writes (one row per line), whatever its size.
#: One in another layout (reformatted by some tool) is read whole, and only up to this size: a JSON document takes
#: tens of times its size in memory once parsed.
MAX_WHOLE_JSON_BYTES = 64 * 2**20
#: A row's line at most (a receipt is under 4 KiB; its fields twice over, base64, are well under this).
MAX_ROW_LINE = 64 * 1024
_HEADER_END = b'"receipts": ['


def read_json_export(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """``(where, receipt bytes)`` for each row of a JSON export, streamed; raises LedgerError (at once for the
    header, as met for the rows) if it is not one. A row that is not one is yielded as empty bytes: the merge
    refuses it, with where it was."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    try:
        first = f.readline(MAX_ROW_LINE).rstrip()
        if first.endswith(_HEADER_END):  # write_json's layout
            doc = _json(first + b"]}", path)
            streamed = True
        elif Path(path).stat().st_size <= MAX_WHOLE_JSON_BYTES:
            f.seek(0)
            doc = _json(f.read(), path)
            streamed = False
        else:
            raise LedgerError(f"{path} is over {MAX_WHOLE_JSON_BYTES >> 20} MiB and not laid out as `gpunet ledger "
                              "export --format json` writes it (one receipt per line); merge that export as written, "
                              "or the ledger.sqlite itself")
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or not isinstance(doc.get("receipts"), list):
            raise LedgerError(f"{path} is not a gpunet JSON export")
        if doc.get("version") not in READABLE_EXPORT_VERSIONS:
            raise LedgerError(f"{path} is export version {doc.get('version')!r:.20}; this gpunet reads "
                              f"{', '.join(map(str, READABLE_EXPORT_VERSIONS))}")
    except BaseException:
        f.close()
        raise
    return _streamed_rows(f) if streamed else _rows(f, doc["receipts"])


def _json(data: bytes, path) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise LedgerError(f"{path} is neither a gpunet ledger nor a gpunet JSON export") from None


def _rows(f, rows: list) -> Iterator[tuple[str, bytes]]:
    with f:
        for position, row in enumerate(rows, 1):
            yield _row(position, row)


def _streamed_rows(f) -> Iterator[tuple[str, bytes]]:
    try:
        with f:
            yield from _lines_as_rows(f)
    except OSError as e:
        raise LedgerError(f"cannot read {f.name}: {e.strerror}") from e


def _lines_as_rows(f) -> Iterator[tuple[str, bytes]]:
    position = 0
    while line := f.readline(MAX_ROW_LINE + 1):
        text = line.strip().rstrip(b",")
        if text in (b"]}", b"]", b""):
            continue
        position += 1
        if len(line) > MAX_ROW_LINE:
            while line and not line.endswith(b"\n"):  # the rest of an overlong line
                line = f.readline(MAX_ROW_LINE)
            yield f"row {position} (over {MAX_ROW_LINE} bytes)", b""
            continue
        try:
            row = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError):
            row = None
        yield _row(position, row)


def _row(position: int, row: Any) -> tuple[str, bytes]:
    try:
        return f"row {position}", base64.b64decode(row["receipt"], validate=True)
    except (TypeError, KeyError, binascii.Error):
        return f"row {position} (no base64 'receipt' field)", b""  # the merge refuses it
