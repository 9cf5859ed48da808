"""Balances: what each identity earned as a worker and spent as a client, a pure function of a set of receipts and of
which of them the reader vouches for.

Amounts are integer nano-credits, so the sum a client spent equals, to the nano-credit, the sum its workers earned.

A receipt proves that two identities agreed a job ran and what it cost; identities are free, so two of them can sign
receipts to each other for work that never ran ("minted" credit). So only receipts the reader vouches for
(gpunet.ledger.vouching: filed by its own job path, or with a party it trusts) count in ``earned``, ``spent`` and
``net``; the rest is reported apart, as ``earned_unvouched`` / ``spent_unvouched``, and never added in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpunet.ledger.receipts import Receipt


@dataclass(frozen=True)
class Balance:
    """One identity's totals over some receipts (money in nano-credits): vouched ones, and apart the merged ones the
    reader does not vouch for."""

    identity: str
    earned: int = 0
    spent: int = 0
    jobs_worked: int = 0
    jobs_bought: int = 0
    earned_unvouched: int = 0  # merged, not vouched for: never in earned, spent or net
    spent_unvouched: int = 0
    jobs_unvouched: int = 0  # as worker or client

    @property
    def net(self) -> int:
        return self.earned - self.spent

    @property
    def vouched(self) -> bool:
        """Whether any receipt the reader vouches for names this identity."""
        return bool(self.jobs_worked or self.jobs_bought)

    def to_dict(self) -> dict:
        return {
            "identity": self.identity,
            "earned": self.earned,
            "spent": self.spent,
            "net": self.net,
            "jobs_worked": self.jobs_worked,
            "jobs_bought": self.jobs_bought,
            "earned_unvouched": self.earned_unvouched,
            "spent_unvouched": self.spent_unvouched,
            "jobs_unvouched": self.jobs_unvouched,
            "earned_untrusted": self.earned_unvouched,  # its name before merged credit was kept apart by default
        }


class BalanceSheet:
    """Running totals, fed receipts as they arrive (each job id counts once), so a growing ledger is summed once."""

    def __init__(self) -> None:
        # identity -> [earned, spent, jobs_worked, jobs_bought, earned_unvouched, spent_unvouched, jobs_unvouched]
        self._totals: dict[str, list[int]] = {}
        self._seen: set[tuple[str, str]] = set()  # (client id, job id): job ids are each client's own

    def add(self, receipt: Receipt, vouched: bool = True) -> None:
        key = (receipt.client_id, receipt.job_id)
        if key in self._seen:
            return
        self._seen.add(key)
        worker = self._totals.setdefault(receipt.worker_id, [0] * 7)
        client = self._totals.setdefault(receipt.client_id, [0] * 7)
        if vouched:
            worker[0] += receipt.amount
            worker[2] += 1
            client[1] += receipt.amount
            client[3] += 1
        else:
            worker[4] += receipt.amount
            client[5] += receipt.amount
            worker[6] += 1
            client[6] += receipt.worker_id != receipt.client_id

    def snapshot(self) -> dict[str, Balance]:
        return {identity: Balance(identity, *values) for identity, values in self._totals.items()}


def balances(receipts: Iterable[Receipt], trusted: Iterable[str] | None = None) -> dict[str, Balance]:
    """Per-identity earned / spent / net. Each receipt counts once however often it is passed (keyed by client and job
    id). ``trusted``: count only receipts with a party among these peers (the others go to the ``*_unvouched``
    figures); None: count them all. A ledger's own view (what it filed itself counts too) is ``Ledger.balances``."""
    sheet = BalanceSheet()
    chosen = frozenset(trusted) if trusted is not None else None
    for receipt in receipts:
        sheet.add(receipt, chosen is None or receipt.worker_id in chosen or receipt.client_id in chosen)
    return sheet.snapshot()
