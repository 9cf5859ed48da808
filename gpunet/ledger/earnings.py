"""What a volunteer earned, from their worker's own ledger: ``gpunet earnings`` and the dashboard read it here.

Everything is a pure function of the ledger (receipts this worker signed and its clients countersigned; receipts
still unpaid; notes of work never billed, with the reason), so the figures match ``gpunet ledger export`` to the
nano-credit: the same receipts, summed. Days are local days (the volunteer's calendar). Only receipts the worker
vouches for (gpunet.ledger.vouching: filed by its own job path, or with a party in its trust list) are earnings;
receipts naming it that came in by ``merge`` otherwise are summed apart, as ``unvouched``, and in no day or total.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Iterable, Literal

from gpunet.errors import ConfigError
from gpunet.ledger.receipts import Receipt, format_credits
from gpunet.ledger.entries import Unbilled
from gpunet.ledger.store import Ledger
from gpunet.ledger.vouching import vouched

#: A delivered result whose countersignature has not come within this long is "never countersigned" (the worker's
#: credit line uses the same grace, gpunet.worker.state.admission).
COUNTERSIGN_GRACE_S = 120.0


@dataclass
class Tally:
    """Jobs, counted work and credits (nano-credits) of some receipts."""

    jobs: int = 0
    flops: int = 0
    nano: int = 0

    def add(self, receipt: Receipt) -> None:
        self.jobs += 1
        self.flops += receipt.flops
        self.nano += receipt.amount

    def to_dict(self) -> dict:
        return {"jobs": self.jobs, "flops": self.flops, "tflop": round(self.flops / 1e12, 6), "nano": self.nano,
                "credits": format_credits(self.nano)}


@dataclass
class Owed:
    """A result this worker delivered whose client has not countersigned (so far)."""

    job_id: str
    client_id: str
    flops: int
    nano: int
    lane: str
    delivered_at: float  # unix time
    reason: str  # "never countersigned" past the grace, else "awaiting countersignature"


@dataclass
class Earnings:
    worker_id: str
    by: str
    since: float | None  # unix time
    rows: dict[str, Tally] = field(default_factory=dict)  # day (YYYY-MM-DD) or client id -> what it brought
    total: Tally = field(default_factory=Tally)
    lanes: dict[str, Tally] = field(default_factory=dict)
    background_runs: int = 0  # the volunteer's own job (free; gpunet.worker.background)
    unpaid: list[Owed] = field(default_factory=list)
    unbilled: list[Unbilled] = field(default_factory=list)
    unvouched: Tally = field(default_factory=Tally)  # merged, not vouched for: in no row and not in total

    def to_json(self) -> dict:
        """The ``gpunet earnings --json`` contract (and the dashboard's ``/api/earnings``)."""
        return {
            "worker_id": self.worker_id,
            "since": self.since,
            "by": self.by,
            "rows": [{"key": key, **t.to_dict()} for key, t in self.rows.items()],
            "total": self.total.to_dict(),
            "lanes": {lane: t.to_dict() for lane, t in self.lanes.items()},
            "background_runs": self.background_runs,
            "unpaid": [{**asdict(o), "credits": format_credits(o.nano)} for o in self.unpaid],
            "unbilled": [{**asdict(n), "at": n.recorded_at_us / 1e6} for n in self.unbilled],
            "unvouched": self.unvouched.to_dict(),
        }


def check_grouping(by: str) -> None:
    if by not in ("day", "client"):
        raise ConfigError(f"earnings are grouped by 'day' or 'client', not {by!r}")


def earnings(ledger: Ledger, worker_id: str, since: float | None = None, by: Literal["day", "client"] = "day",
             now: float | None = None, trusted: frozenset[str] = frozenset()) -> Earnings:
    """This worker's earnings in ``ledger`` since ``since`` (unix time; None: all), grouped ``by`` day or client;
    ``trusted``: its trust list (merged receipts with a party in it count)."""
    check_grouping(by)
    now = time.time() if now is None else now
    since_us = int(since * 1e6) if since is not None else 0
    out = Earnings(worker_id, by, since)
    for _, receipt, origin in ledger.filed_after(0):
        if receipt.worker_id != worker_id or receipt.ended_at_us < since_us:
            continue
        if not vouched(receipt, origin, trusted, worker_id):
            out.unvouched.add(receipt)
            continue
        if receipt.lane == "background":
            out.background_runs += 1
            continue
        key = _day(receipt.ended_at_us) if by == "day" else receipt.client_id
        out.rows.setdefault(key, Tally()).add(receipt)
        out.lanes.setdefault(receipt.lane, Tally()).add(receipt)
        out.total.add(receipt)
    out.unpaid = earnings_unpaid(ledger, worker_id, since_us, now)
    out.unbilled = ledger.unbilled(since_us)
    return out


class EarningsBook:
    """A worker's earnings per local day and lane, kept up to date: each look reads only the receipts added since the
    last (a running worker's ledger grows by the thousand; its dashboard asks every few seconds)."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._reset(frozenset())

    def _reset(self, trusted: frozenset[str]) -> None:
        self.trusted = trusted
        self.days: dict[str, Tally] = {}
        self.lanes: dict[str, Tally] = {}
        self.total = Tally()
        self.unvouched = Tally()
        self.background_runs = 0
        self._seq = 0

    def update(self, ledger: Ledger, trusted: frozenset[str] = frozenset()) -> None:
        """Read the receipts added since the last look (all of them again when the trust list changed)."""
        if trusted != self.trusted:
            self._reset(trusted)
        for seq, receipt, origin in ledger.filed_after(self._seq):
            self._seq = seq
            if receipt.worker_id != self.worker_id:
                continue
            if not vouched(receipt, origin, trusted, self.worker_id):
                self.unvouched.add(receipt)
                continue
            if receipt.lane == "background":
                self.background_runs += 1
                continue
            self.days.setdefault(_day(receipt.ended_at_us), Tally()).add(receipt)
            self.lanes.setdefault(receipt.lane, Tally()).add(receipt)
            self.total.add(receipt)

    def report(self, ledger: Ledger, days: int, now: float | None = None, newest: int = 50,
               trusted: frozenset[str] = frozenset()) -> dict:
        """The dashboard's ``/api/earnings``: totals of all time, each of the last ``days`` days (those without jobs
        too), and the newest ``newest`` unpaid and unbilled jobs with how many there are in all; ``unvouched``: what
        merged receipts name this worker for, apart (in no total and no day)."""
        self.update(ledger, trusted)
        now = time.time() if now is None else now
        unpaid = [o for o in earnings_unpaid(ledger, self.worker_id, 0, now)]
        return {
            "worker_id": self.worker_id,
            "total": self.total.to_dict(),
            "lanes": {lane: t.to_dict() for lane, t in self.lanes.items()},
            "background_runs": self.background_runs,
            "days": [{"day": day, **self.days.get(day, Tally()).to_dict()} for day in days_back(days, now)],
            "unpaid": [{**asdict(o), "credits": format_credits(o.nano)} for o in unpaid[-newest:][::-1]],
            "unpaid_count": len(unpaid),
            "unbilled": [{**asdict(n), "at": n.recorded_at_us / 1e6} for n in ledger.unbilled(newest=newest)[::-1]],
            "unbilled_count": ledger.count_unbilled(),
            "unvouched": self.unvouched.to_dict(),
        }


def earnings_unpaid(ledger: Ledger, worker_id: str, since_us: int = 0, now: float | None = None) -> list[Owed]:
    """Results this worker delivered that are not countersigned, oldest first, and whether that is late."""
    now = time.time() if now is None else now
    owed = []
    for receipt in _mine(ledger.unpaid(), worker_id, since_us):
        delivered = receipt.ended_at_us / 1e6
        late = now - delivered > COUNTERSIGN_GRACE_S
        owed.append(Owed(receipt.job_id, receipt.client_id, receipt.flops, receipt.amount, receipt.lane,
                         delivered, "never countersigned" if late else "awaiting countersignature"))
    return owed


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """``--since``: a date (2026-12-01, local midnight), a date and time (ISO 8601), or a span back from now
    (``36h``, ``7d``, ``2w``)."""
    if not text:
        return None
    now = time.time() if now is None else now
    span = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([hdw])", text.strip())
    if span:
        hours = float(span.group(1)) * {"h": 1, "d": 24, "w": 168}[span.group(2)]
        return now - hours * 3600
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ConfigError(f"--since {text!r}: give a date (2026-12-01), a date and time (2026-12-01T18:00), or a "
                          "span back from now (36h, 7d, 2w)") from None


def _mine(receipts: Iterable[Receipt], worker_id: str, since_us: int) -> Iterable[Receipt]:
    return (r for r in receipts if r.worker_id == worker_id and r.ended_at_us >= since_us)


def _day(at_us: int) -> str:
    return datetime.fromtimestamp(at_us / 1e6).strftime("%Y-%m-%d")


def days_back(days: int, now: float | None = None) -> list[str]:
    """The last ``days`` local days, oldest first (a chart's axis: days without jobs are days too)."""
    today = datetime.fromtimestamp(time.time() if now is None else now).date()
    return [(today - timedelta(days=n)).isoformat() for n in range(days - 1, -1, -1)]
