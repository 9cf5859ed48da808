"""Group commit for a node on an event loop: receipts are filed off the job's critical path, many per transaction.

A tiny job is done in about a millisecond; an SQLite transaction per receipt would be a tenth of that on each side,
spent while the other side waits. So the worker and the client queue their ledger writes here and a flush, scheduled
``delay`` seconds after the first queued write (and forced when ``max_pending`` pile up, when someone reads, and at
close), writes them all in one :meth:`~gpunet.ledger.store.Ledger.write_batch`.

The Ed25519 checks of a batch (the expensive part: ~65 µs a signature here) run in a thread first, where they do not
hold the GIL, so the event loop keeps serving jobs meanwhile; the SQLite writes then find every verdict memoised.

What this trades: a receipt reaches the file up to ``delay`` (20 ms) after the job's result has been handed over, so
a process killed in that window loses the receipts of its last few jobs from *its own* file. They are not lost: the
counterparty holds the same signed receipt (the ledger's durability argument in :mod:`gpunet.ledger.store` already
rests on that), and a worker's unsettled results stay in memory until they are countersigned or it drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from gpunet.errors import InvalidReceipt
from gpunet.ledger.receipts import Receipt
from gpunet.ledger.entries import Unbilled
from gpunet.ledger.store import Ledger
from gpunet.utils import Debounce

logger = logging.getLogger("gpunet.ledger")

#: Seconds a queued receipt may wait for company before it is written.
FLUSH_DELAY = 0.02
MAX_PENDING = 1024


class LedgerWriter:
    """Queues ``append`` / ``record_unpaid`` and writes them in batches; use from one event loop's thread."""

    def __init__(
        self,
        ledger: Ledger,
        delay: float = FLUSH_DELAY,
        max_pending: int = MAX_PENDING,
        on_refused: Callable[[Receipt, Exception], None] | None = None,
    ):
        """``on_refused(receipt, error)`` hears of every queued receipt the ledger refused (bad signature, conflict)."""
        self.ledger = ledger
        self.on_refused = on_refused
        self.delay = delay
        self.max_pending = max_pending
        self._complete: list[Receipt] = []  # in queue order; a second receipt for a job id is kept (conflict evidence)
        self._by_job: dict[tuple[str, str], Receipt] = {}  # the first queued receipt per (client, job id), for ``get``
        self._unpaid: list[Receipt] = []
        self._unbilled: list[Unbilled] = []
        self._timer = Debounce(delay, self._flush_soon)
        self._failing = False  # the last write failed: retry on a timer, never on the caller's path

    def append(self, receipt: Receipt) -> None:
        """Queue a complete receipt. Checked when written: a refused one is logged (and a conflict recorded)."""
        self._complete.append(receipt)
        self._by_job.setdefault((receipt.client_id, receipt.job_id), receipt)
        self._schedule()

    def record_unpaid(self, receipt: Receipt) -> None:
        """Queue a receipt this node signed as worker and whose countersignature has not come yet."""
        self._unpaid.append(receipt)
        self._schedule()

    def record_unbilled(self, note: Unbilled) -> None:
        """Queue a note of work this node did as a worker and was not paid for (``gpunet earnings``)."""
        self._unbilled.append(note)
        self._schedule()

    def get(self, client_id: str, job_id: str) -> Receipt | None:
        """The complete receipt for ``client_id``'s job ``job_id``, queued or stored."""
        return self._by_job.get((client_id, job_id)) or self.ledger.get(job_id, client_id)

    def signed(self, client_id: str, job_id: str) -> Receipt | None:
        """Any receipt for ``client_id``'s job ``job_id`` this node holds, paid or still unpaid, queued or stored."""
        queued = next((r for r in reversed(self._unpaid) if r.job_id == job_id and r.client_id == client_id),
                      None) if self._unpaid else None
        return self.get(client_id, job_id) or queued or self.ledger.get_unpaid(job_id, client_id)

    @property
    def pending(self) -> int:
        return len(self._complete) + len(self._unpaid) + len(self._unbilled)

    def flush(self) -> None:
        """Write everything queued now, in one transaction (one by one if the batch as a whole fails)."""
        self._timer.cancel()
        if not self.pending:
            return
        complete, unpaid, unbilled = self._complete, self._unpaid, self._unbilled
        try:
            problems = self.ledger.write_batch(complete, unpaid, unbilled)
        except Exception as batch_error:
            problems, kept_complete, kept_unpaid = self._write_one_by_one(complete, unpaid)
            if (complete or unpaid) and len(kept_complete) + len(kept_unpaid) == len(complete) + len(unpaid):
                # No receipt went in: the file is the trouble.
                logger.error("Could not write %d receipt(s) to the ledger %s (kept in memory, retrying): %s",
                             self.pending, self.ledger.path, batch_error)
                self._failing = True
                self._retry()
                return
            if unbilled:  # notes, not money: written alone, or dropped with a word
                try:
                    self.ledger.write_batch(unbilled=unbilled)
                except Exception as e:
                    logger.warning("Could not note %d unbilled job(s) in the ledger: %s", len(unbilled), e)
        self._complete, self._unpaid, self._unbilled, self._by_job, self._failing = [], [], [], {}, False
        for receipt, error in problems:
            logger.warning("Receipt for job %s not recorded: %s", receipt.job_id[:16], error)
            if self.on_refused is not None:
                self.on_refused(receipt, error)

    def _write_one_by_one(self, complete: list[Receipt], unpaid: list[Receipt]):
        """After a failed batch: write each receipt alone, so one that breaks the batch (say a corrupt stored row for
        its job id) is refused with its reason instead of holding the others back. Returns the problems and what could
        not be written at all."""
        problems, kept_complete, kept_unpaid = [], [], []
        for receipt in complete:
            try:
                problems += self.ledger.write_batch([receipt])
            except Exception as e:
                kept_complete.append(receipt)
                problems.append((receipt, e))
        for receipt in unpaid:
            try:
                problems += self.ledger.write_batch(unpaid=[receipt])
            except Exception as e:
                kept_unpaid.append(receipt)
                problems.append((receipt, e))
        return problems, kept_complete, kept_unpaid

    def close(self) -> None:
        self.flush()

    def _retry(self) -> None:
        try:
            self._timer.poke(max(1.0, self.delay))
        except RuntimeError:  # no loop (closing): the caller hears of it through the log
            pass

    def _schedule(self) -> None:
        if self.pending >= self.max_pending and not self._failing:
            self.flush()
        else:
            self._timer.poke()

    def _flush_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._check_then_flush(list(self._complete), list(self._unpaid)))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _check_then_flush(self, complete: list[Receipt], unpaid: list[Receipt]) -> None:
        await prewarm_signatures(complete, unpaid)
        self.flush()


_background: set[asyncio.Task] = set()  # flushes in progress (a task nobody references can be collected)


async def prewarm_signatures(complete: list[Receipt] = (), unpaid: list[Receipt] = ()) -> None:
    """Check these receipts' signatures in a thread (Ed25519 releases the GIL), so that the checks the ledger makes
    on the event loop afterwards are memo hits. Verdicts only: a bad receipt is refused later, where it is filed."""
    if complete or unpaid:
        await asyncio.get_running_loop().run_in_executor(None, _check_signatures, complete, unpaid)


def _check_signatures(complete: list[Receipt], unpaid: list[Receipt]) -> None:
    for receipt in complete:
        try:
            receipt.verify()
        except InvalidReceipt:
            pass
    for receipt in unpaid:
        try:
            receipt.verify_worker_signature()
        except InvalidReceipt:
            pass
