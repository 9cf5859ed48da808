"""Balances: what each identity earned as a worker and spent as a client, a pure function of a set of receipts.

Amounts are integer nano-credits, so the sum a client spent equals, to the nano-credit, the sum its workers earned.

A receipt proves that two identities agreed a job ran and what it cost; identities are free, so two of them can sign
receipts to each other for work that never ran ("minted" credit). A reader can therefore name the clients whose
payments it counts (``trusted``: e.g. clients with a funding record, or its own trust list): a worker's earnings from
anyone else are reported apart, as ``earned_untrusted``, and not in ``earned`` or ``net``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpunet.ledger.receipts import Receipt


@dataclass(frozen=True)
class Balance:
    """One identity's totals over some receipts (money in nano-credits)."""

    identity: str
    earned: int = 0
    spent: int = 0
    jobs_worked: int = 0
    jobs_bought: int = 0
    earned_untrusted: int = 0  # from clients outside the reader's trust list (0 without one)

    @property
    def net(self) -> int:
        return self.earned - self.spent

    def to_dict(self) -> dict:
        return {
            "identity": self.identity,
            "earned": self.earned,
            "spent": self.spent,
            "net": self.net,
            "jobs_worked": self.jobs_worked,
            "jobs_bought": self.jobs_bought,
            "earned_untrusted": self.earned_untrusted,
        }


class BalanceSheet:
    """Running totals, fed receipts as they arrive (each job id counts once), so a growing ledger is summed once."""

    def __init__(self, trusted: frozenset[str] | None = None) -> None:
        self._trusted = trusted
        self._totals: dict[str, list[int]] = {}  # identity -> [earned, spent, jobs_worked, jobs_bought, untrusted]
        self._seen: set[tuple[str, str]] = set()  # (client id, job id): job ids are each client's own

    def add(self, receipt: Receipt) -> None:
        key = (receipt.client_id, receipt.job_id)
        if key in self._seen:
            return
        self._seen.add(key)
        worker = self._totals.setdefault(receipt.worker_id, [0, 0, 0, 0, 0])
        worker[0 if self._trusted is None or receipt.client_id in self._trusted else 4] += receipt.amount
        worker[2] += 1
        client = self._totals.setdefault(receipt.client_id, [0, 0, 0, 0, 0])
        client[1] += receipt.amount
        client[3] += 1

    def snapshot(self) -> dict[str, Balance]:
        return {identity: Balance(identity, *values) for identity, values in self._totals.items()}


def balances(receipts: Iterable[Receipt], trusted: Iterable[str] | None = None) -> dict[str, Balance]:
    """Per-identity earned / spent / net. Each receipt counts once however often it is passed (keyed by client and job
    id). ``trusted``: the only clients whose payments count as earned (others' go to ``earned_untrusted``)."""
    sheet = BalanceSheet(frozenset(trusted) if trusted is not None else None)
    for receipt in receipts:
        sheet.add(receipt)
    return sheet.snapshot()
