"""Balances: what each identity earned as a worker and spent as a client, a pure function of a set of receipts.

Amounts are integer nano-credits, so the sum a client spent equals, to the nano-credit, the sum its workers earned.
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
        }


class BalanceSheet:
    """Running totals, fed receipts as they arrive (each job id counts once), so a growing ledger is summed once."""

    def __init__(self) -> None:
        self._totals: dict[str, list[int]] = {}  # identity -> [earned, spent, jobs_worked, jobs_bought]
        self._seen: set[tuple[str, str]] = set()  # (client id, job id): job ids are each client's own

    def add(self, receipt: Receipt) -> None:
        key = (receipt.client_id, receipt.job_id)
        if key in self._seen:
            return
        self._seen.add(key)
        worker = self._totals.setdefault(receipt.worker_id, [0, 0, 0, 0])
        worker[0] += receipt.amount
        worker[2] += 1
        client = self._totals.setdefault(receipt.client_id, [0, 0, 0, 0])
        client[1] += receipt.amount
        client[3] += 1

    def snapshot(self) -> dict[str, Balance]:
        return {identity: Balance(identity, *values) for identity, values in self._totals.items()}


def balances(receipts: Iterable[Receipt]) -> dict[str, Balance]:
    """Per-identity earned / spent / net. Each receipt counts once however often it is passed (keyed by client and job id)."""
    sheet = BalanceSheet()
    for receipt in receipts:
        sheet.add(receipt)
    return sheet.snapshot()
