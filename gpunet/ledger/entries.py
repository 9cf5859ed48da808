"""The ledger's plain records: what a ledger hands out and takes in, apart from the store that files them, so that
the store, its exports, the writer and earnings share them without importing each other.

* :class:`Entry` -- one link of the chain: its position, its receipt and its hash;
* :class:`LedgerHead` -- the chain's length and last hash, as a worker publishes it;
* :class:`Unbilled` -- work a worker started and was never paid for, and why;
* :class:`Conflict` -- a second, different receipt for a job already in the ledger (evidence, kept);
* :class:`MergeReport` -- what a merge did with each receipt of its source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from gpunet.ledger.receipts import Receipt


class LedgerHead(NamedTuple):
    """What a worker publishes in its DHT record: how many entries, and the hash of the last (hex)."""

    count: int
    head_hash: str


@dataclass(frozen=True)
class Entry:
    """One link of the chain: its position (from 1), its receipt and its hash
    (:func:`gpunet.ledger.store.entry_hash`)."""

    seq: int
    receipt: Receipt
    entry_hash: bytes


@dataclass(frozen=True)
class Unbilled:
    """Work a worker started and was not paid for, and why (``reason``: refused, cancelled, timed_out, preempted,
    failed, paused, drained (stopped when the worker's drain ran out of time), disclaimed (session steps a closing
    client said it did not receive); ``detail``: the words of whoever decided)."""

    client_id: str
    job_id: str
    reason: str
    detail: str = ""
    flops: int = 0  # counted work, where it was known
    program_hash: str = ""
    lane: str = "interactive"
    recorded_at_us: int = 0


@dataclass(frozen=True)
class Conflict:
    """A receipt that disagrees with the one already stored for its job id; both are kept as evidence."""

    job_id: str
    existing: Receipt
    other: Receipt
    source: str
    detected_at_us: int


@dataclass
class MergeReport:
    """What ``merge`` did with each receipt of the source."""

    source: str
    added: int = 0
    duplicates: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)  # (which receipt, why): the first MAX_LISTED
    conflicts: list[str] = field(default_factory=list)  # job ids: the first MAX_LISTED
    refused_count: int = 0  # all of them (a hostile file of millions of bad rows must not fill memory with reasons)
    conflicts_count: int = 0

    #: Refusals and conflicts listed one by one; beyond this they are only counted.
    MAX_LISTED: ClassVar[int] = 1000

    def refuse(self, where: str, why: str) -> None:
        self.refused_count += 1
        if len(self.refused) < self.MAX_LISTED:
            self.refused.append((where, why))

    def conflict(self, job_id: str) -> None:
        self.conflicts_count += 1
        if len(self.conflicts) < self.MAX_LISTED:
            self.conflicts.append(job_id)

    @property
    def clean(self) -> bool:
        return not self.refused_count and not self.conflicts_count

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "added": self.added,
            "duplicates": self.duplicates,
            "refused": [{"receipt": where, "reason": reason} for where, reason in self.refused],
            "conflicts": self.conflicts,
            "refused_count": self.refused_count,
            "conflicts_count": self.conflicts_count,
        }
