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
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gpunet.errors import LedgerError
from gpunet.ledger.receipts import Receipt, format_credits

if TYPE_CHECKING:
    from gpunet.ledger.store import Entry, LedgerHead

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


def write_csv(entries: Iterable["Entry"], out: TextIO) -> int:
    """Write one CSV row per entry; returns how many."""
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    count = 0
    for entry in entries:
        writer.writerow(export_row(entry.seq, entry.receipt))
        count += 1
    return count


def write_json(entries: Iterable["Entry"], head: "LedgerHead", out: TextIO) -> int:
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


def read_json_export(path: str | Path) -> list[tuple[str, bytes]]:
    """``(where, receipt bytes)`` for each row of a JSON export; raises LedgerError if it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise LedgerError(f"cannot read {path}: {e.strerror}") from e
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LedgerError(f"{path} is neither a gpunet ledger nor a gpunet JSON export") from None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT or not isinstance(doc.get("receipts"), list):
        raise LedgerError(f"{path} is not a gpunet JSON export")
    if doc.get("version") not in READABLE_EXPORT_VERSIONS:
        raise LedgerError(f"{path} is export version {doc.get('version')!r:.20}; this gpunet reads "
                          f"{', '.join(map(str, READABLE_EXPORT_VERSIONS))}")
    out = []
    for position, row in enumerate(doc["receipts"], 1):
        try:
            out.append((f"row {position}", base64.b64decode(row["receipt"], validate=True)))
        except (TypeError, KeyError, binascii.Error):
            out.append((f"row {position} (no base64 'receipt' field)", b""))  # the merge refuses it
    return out
