"""A worker's side of getting paid: receipts of delivered results wait here for their client's countersignature.

A result delivered on a stream is countersigned on that stream; one delivered through the unary door is
countersigned later — riding on that client's next job, or in a batch call shortly after. Ride-along
countersignatures are checked in a thread (Ed25519 releases the GIL) and filed by group commit a moment after the
reply has gone, so paying never slows the next job. A receipt never countersigned stays in the ledger's unpaid list.

Bounded: a client that never countersigns cannot grow the table past ``max_unsettled`` (the oldest entry goes; its
work stays visible as unpaid either way).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from gpunet.errors import GpunetError, JobRejected
from gpunet.ledger.receipts import Receipt, attach_countersignature
from gpunet.ledger.entries import Unbilled
from gpunet.ledger.writer import FLUSH_DELAY, LedgerWriter, prewarm_signatures
from gpunet.protocol import Countersign, Refuse
from gpunet.utils import LRU, Debounce, When

logger = logging.getLogger("gpunet.worker")

MAX_UNSETTLED = 4096
UNSETTLED_SHARE = 0.25
Key = tuple[str, str]  # (client id, job id)


class Settlement:
    def __init__(self, books: LedgerWriter, find_receipt: Callable[[Key], Receipt | None] = lambda key: None,
                 max_unsettled: int = MAX_UNSETTLED, on_paid: Callable[[str, str], None] = lambda client, job: None):
        """``find_receipt``: where else a delivered receipt may still be known (the service's recent results);
        ``on_paid(client_id, job_id)``: hears of every valid countersignature (the credit line)."""
        self.books = books
        self._on_paid = on_paid
        # Delivered receipts awaiting their countersignature; one client's up to a quarter (its own oldest go first:
        # one client that never pays must not push out everyone's; names are free, so four can, but each is cut off
        # by its credit line after a few unpaid results).
        self.unsettled: LRU[Key, Receipt] = LRU(max_unsettled, owner=lambda key: key[0], share=UNSETTLED_SHARE)
        self._find_receipt = find_receipt
        self._queued: list[tuple[str, tuple[tuple[str, bytes], ...]]] = []  # ride-along, not yet checked
        self._timer = Debounce(FLUSH_DELAY, self._check_soon)
        self._checking: set[asyncio.Task] = set()
        self._all_settled = When(lambda: not len(self.unsettled))

    def expect(self, client_id: str, receipt: Receipt) -> None:
        """A result went out through the unary door: its countersignature comes in a later call."""
        if self.books.get(client_id, receipt.job_id) is None:
            self.unsettled.put((client_id, receipt.job_id), receipt)

    def ride_along(self, client_id: str, items: tuple[tuple[str, bytes], ...]) -> None:
        """Countersignatures that came with a job: checked and filed shortly, after that job's reply."""
        if items:
            self._queued.append((client_id, items))
            self._timer.poke()

    async def batch(self, client_id: str, items: Iterable[tuple[str, bytes]]) -> None:
        """Countersignatures sent in a call of their own: checked in a thread, then filed now."""
        await self._check_then_file([(client_id, tuple(items))])

    def settle(self, client_id: str, message: Countersign | Refuse, receipt: Receipt | None = None) -> None:
        """A client's countersignature (or refusal) for a job it received from us; JobRejected or InvalidReceipt if
        there is nothing to settle or the signature is forged. ``receipt``: the one delivered (stream door)."""
        key = (client_id, message.job_id)
        receipt = receipt or self.unsettled.get(key) or self._find_receipt(key)
        if receipt is None:
            raise JobRejected(f"no result of job {message.job_id[:16]} for this client awaits settlement")
        if isinstance(message, Refuse):
            if self.unsettled.get(key) is not None:  # noted once, however often a client says it
                self.books.record_unbilled(Unbilled(client_id, message.job_id, "refused", message.reason, receipt.flops,
                                                    receipt.program_hash, receipt.lane))
            self._forget(key)
            logger.warning("Client %s refused the receipt for job %s: %s", client_id[-8:], message.job_id[:12],
                           message.reason)
            return
        complete = attach_countersignature(receipt, message.signature)  # InvalidReceipt if forged
        if self.books.get(client_id, message.job_id) is None:
            self.books.append(complete)
        self._on_paid(client_id, message.job_id)
        self._forget(key)

    def flush(self) -> None:
        """Check and file every countersignature received so far, and write all queued receipts."""
        self._timer.cancel()
        queued, self._queued = self._queued, []
        self._file(queued)

    async def close(self) -> None:
        if self._checking:  # countersignatures being checked in a thread: let them land
            await asyncio.wait(set(self._checking), timeout=10)
        self.flush()

    def all_settled(self) -> asyncio.Future:
        """Resolves once no delivered result awaits its countersignature."""
        return self._all_settled.wait()

    # --- internals -------------------------------------------------------------------------------------------------

    def _forget(self, key: Key) -> None:
        self.unsettled.pop(key)
        self._all_settled.check()

    def _check_soon(self) -> None:
        queued, self._queued = self._queued, []
        task = asyncio.get_running_loop().create_task(self._check_then_file(queued))
        self._checking.add(task)
        task.add_done_callback(self._checking.discard)

    async def _check_then_file(self, batches: list[tuple[str, tuple[tuple[str, bytes], ...]]]) -> None:
        """Check countersignatures in a thread first (off the loop that serves jobs), then file them durably."""
        complete = []
        for client_id, items in batches:
            for job_id, signature in items:
                receipt = self.unsettled.get((client_id, job_id))
                if receipt is not None:
                    try:
                        complete.append(receipt._with_signature("client_signature", signature))
                    except GpunetError:
                        pass  # malformed: refused with its reason when filed
        await prewarm_signatures(complete)
        self._file(batches)

    def _file(self, batches: list[tuple[str, tuple[tuple[str, bytes], ...]]]) -> None:
        for client_id, items in batches:
            bad, first = 0, None
            for job_id, signature in items:
                if (client_id, job_id) not in self.unsettled and self._find_receipt((client_id, job_id)) is None:
                    bad, first = bad + 1, first or f"no result of job {job_id[:16]} for this client awaits settlement"
                    continue  # nothing to check: a batch of made-up ids costs a lookup each, not a log line each
                try:
                    self.settle(client_id, Countersign(job_id, signature))
                except GpunetError as e:  # a bad one is skipped, never fatal
                    bad, first = bad + 1, first or str(e)
            if bad:  # one line per batch, however many it held
                logger.warning("Skipped %d bad countersignature(s) from %s: %s", bad, client_id[-8:], first)
        self.books.flush()
