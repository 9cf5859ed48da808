"""A worker's books: what it signs for work that ran here, and getting paid for it.

* A job's receipt is signed as its result goes out; a session's steps are billed in tabs (gpunet.ledger.tabs), one
  receipt a tab, signed as the tab fills or the session ends (closed, expired, or the worker leaving).
* Work that ran and will not be paid (failed, stopped, preempted, disclaimed) is noted as unbilled, with why
  (``gpunet earnings`` lists it); the dashboard's recent jobs are kept here too.
* Receipts wait for their countersignature in :class:`Countersignatures`. A result delivered on a stream is
  countersigned on that stream; one delivered through the unary door is countersigned later — riding on that
  client's next job, or in a batch call shortly after. Ride-along countersignatures are checked in a thread (Ed25519
  releases the GIL) and filed by group commit a moment after the reply has gone, so paying never slows the next job.
  A receipt never countersigned stays in the ledger's unpaid list. Bounded: a client that never countersigns cannot
  grow the table past ``max_unsettled`` (the oldest entry goes; its work stays visible as unpaid either way).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Iterable

from gpunet.errors import GpunetError, JobRejected
from gpunet.identity import Identity
from gpunet.ledger.receipts import Receipt, attach_countersignature, sign_as_worker
from gpunet.ledger.entries import Unbilled
from gpunet.ledger.store import Ledger
from gpunet.ledger.writer import FLUSH_DELAY, LedgerWriter, prewarm_signatures
from gpunet.protocol import INTERACTIVE, Countersign, Refuse, Submit
from gpunet.utils import LRU, Debounce, When, sha256_hex
from gpunet.worker.state.admission import Admission
from gpunet.worker.state.lanes import Ticket
from gpunet.worker.state.sessions import Ended

logger = logging.getLogger("gpunet.worker")

MAX_UNSETTLED = 4096
UNSETTLED_SHARE = 0.25
RECENT_JOBS = 100
Key = tuple[str, str]  # (client id, job id)


class Billing:
    """Signs what ran here and keeps the books (receipts, tabs, unbilled work, the recent jobs)."""

    def __init__(self, identity: Identity, ledger: Ledger, admission: Admission,
                 find_receipt: Callable[[Key], Receipt | None] = lambda key: None):
        """``find_receipt``: where else a delivered receipt may still be known (the recent results kept for
        retries)."""
        self.identity, self.admission = identity, admission
        self.books = LedgerWriter(ledger)  # receipts are filed in batches, after the reply has gone
        self.awaiting = Countersignatures(self.books, find_receipt=find_receipt, on_paid=admission.paid)
        #: The latest jobs that ran here and how each ended, newest last (the dashboard shows them).
        self.recent: deque[dict] = deque(maxlen=RECENT_JOBS)

    def job(self, key: Key, submit: Submit, ticket: Ticket, input_hash: str, outputs: bytes, flops: int,
            wall_time: float, started: float, ended: float) -> Receipt:
        """A job's receipt, signed as its result goes out; owed until its client countersigns it."""
        client_id, job_id = key
        receipt = sign_as_worker(
            self.identity, job_id=job_id, client_id=client_id, program_hash=submit.program, input_hash=input_hash,
            output_hash=sha256_hex(outputs), flops=int(flops), wall_time_us=int(wall_time * 1e6), price=ticket.price,
            max_price=submit.max_price, started_at_us=int(started * 1e6), ended_at_us=int(ended * 1e6),
            lane=ticket.lane)
        self.books.record_unpaid(receipt)  # until the countersignature arrives, this is work the client owes
        self.admission.delivered(client_id, job_id, ticket.host)
        self.ran(key, ticket.lane, "done", receipt)
        return receipt

    def tab(self, client_id: str, session_id: str, program: str, tab, max_price: int | None,
            host: str = "") -> Receipt | None:
        """One receipt for a tab of session steps (gpunet.ledger.tabs), owed until countersigned like any (None, and
        logged, if one of that id exists: the worker's nonce makes that a bug, and one job id has one receipt)."""
        if self.books.signed(client_id, tab.job_id(session_id)) is not None:
            logger.error("A receipt for %s exists already; these steps are not billed again", tab.job_id(session_id))
            return None
        receipt = sign_as_worker(
            self.identity, job_id=tab.job_id(session_id), client_id=client_id, program_hash=program,
            input_hash=tab.input_chain, output_hash=tab.output_chain, flops=tab.flops,
            wall_time_us=tab.wall_time_us, price=self.admission.price_nano, max_price=max_price,
            started_at_us=tab.started_at_us, ended_at_us=tab.ended_at_us)
        self.books.record_unpaid(receipt)
        self.admission.delivered(client_id, receipt.job_id, host)
        return receipt

    def ended(self, ended: Ended, await_payment: bool = True) -> Receipt | None:
        """The tab of a session that ended (closed, expired): signed, and awaited from its client by a later call
        (unless ``await_payment`` is False: the worker is leaving)."""
        if ended.disclaimed is not None:
            self._disclaimed(ended)
        if ended.tab is None:
            return None
        try:
            receipt = self.tab(ended.client_id, ended.session_id, ended.program, ended.tab, ended.max_price,
                               ended.host)
        except GpunetError as e:  # never the end of the sweeper, or of the close that asked
            logger.error("Could not bill the last steps of session %s: %s", ended.session_id[:12], e)
            return None
        if receipt is not None and await_payment:
            self.awaiting.expect(ended.client_id, receipt)
        return receipt

    def _disclaimed(self, ended: Ended) -> None:
        """Steps that ran here after those the closing client said it received: not billed (an answer lost on the
        way is this worker's loss), but noted as unpaid work, and counted against the client (Admission.disclaimed),
        so that saying "received nothing" cannot get an open tab's work free again and again. Not as an unpaid
        receipt: an honest client that lost one answer would then lose the unary door here for the hour."""
        rest = ended.disclaimed
        job_id = rest.job_id(ended.session_id)
        logger.warning("Client %s closed session %s saying it did not receive %d step(s) that ran here; not billed",
                       ended.client_id[-8:], ended.session_id[:12], rest.steps)
        self.books.record_unbilled(Unbilled(
            ended.client_id, job_id, "disclaimed", f"its client said it did not receive steps {rest.first}-{rest.last}",
            rest.flops, ended.program, INTERACTIVE))
        self.admission.disclaimed(ended.client_id, ended.host)

    def unbilled(self, key: Key, submit: Submit, reason: str, detail: str) -> None:
        """Note work started here that will not be paid, and why (``gpunet earnings`` lists it)."""
        self.books.record_unbilled(Unbilled(key[0], key[1], reason, detail, 0, submit.program, submit.lane))
        self.ran(key, submit.lane, reason)

    def ran(self, key: Key, lane: str, outcome: str, receipt: Receipt | None = None) -> None:
        """One line of the dashboard's recent jobs; one not billed has no start or price, and earned nothing."""
        self.recent.append({"job_id": key[1], "client_id": key[0], "lane": lane, "outcome": outcome,
                            "ended_at": time.time(),
                            "started_at": receipt.started_at_us / 1e6 if receipt is not None else None,
                            "price": receipt.price if receipt is not None else None,
                            "amount": receipt.amount if receipt is not None else 0,
                            "flops": receipt.flops if receipt is not None else 0})

    async def close(self) -> None:
        await self.awaiting.close()


class Countersignatures:
    """Receipts of delivered results awaiting their client's countersignature, and the countersignatures coming in
    (on the stream, riding on a later job, or in a batch)."""

    def __init__(self, books: LedgerWriter, find_receipt: Callable[[Key], Receipt | None] = lambda key: None,
                 max_unsettled: int = MAX_UNSETTLED, on_paid: Callable[[str, str], None] = lambda client, job: None):
        """``find_receipt``: where else a delivered receipt may still be known (the recent results kept for retries);
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
        self._checking: dict[asyncio.Task, set[str]] = {}  # checks running in a thread -> the clients in them
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

    def arriving_from(self, client_id: str) -> bool:
        """Whether countersignatures of this client came riding on a job and are not filed yet (queued for the next
        batch, or being checked)."""
        return (any(queued == client_id for queued, _ in self._queued)
                or any(client_id in clients for clients in self._checking.values()))

    async def file_arriving(self, client_id: str) -> None:
        """File this client's countersignatures that came riding along now, instead of a moment later: those queued
        (filed here, with every other queued one) and those being checked (awaited)."""
        if any(queued == client_id for queued, _ in self._queued):
            self.flush()
        checking = [task for task, clients in self._checking.items() if client_id in clients]
        if checking:
            await asyncio.wait(checking, timeout=10)

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
        self._checking[task] = {client_id for client_id, _ in queued}
        task.add_done_callback(lambda done: self._checking.pop(done, None))

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
                    if self.books.get(client_id, job_id) is not None:
                        continue  # filed already: sent again because the word that it was filed was lost
                    bad, first = bad + 1, first or f"no result of job {job_id[:16]} for this client awaits settlement"
                    continue  # nothing to check: a batch of made-up ids costs a lookup each, not a log line each
                try:
                    self.settle(client_id, Countersign(job_id, signature))
                except GpunetError as e:  # a bad one is skipped, never fatal
                    bad, first = bad + 1, first or str(e)
            if bad:  # one line per batch, however many it held
                logger.warning("Skipped %d bad countersignature(s) from %s: %s", bad, client_id[-8:], first)
        self.books.flush()
