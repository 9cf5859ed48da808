"""Checking what a worker's answer claims, and paying for it: the receipt must name the worker that answered, the
inputs sent and the outputs received, at a price the worker advertised; the outputs must decode exactly as the dry
run predicts. An answer that passes is countersigned, filed in this client's ledger and the countersignature sent
(:mod:`gpunet.client.settlement`); one that does not is refused, and the worker is not paid.
"""

from __future__ import annotations

import logging

from gpunet import protocol
from gpunet.client.jobs import CheckedDelivery, Delivery, JobResult, Prepared
from gpunet.client.routing import Router
from gpunet.client.settlement import Settlement
from gpunet.client.reputation import Reputation
from gpunet.errors import GpunetError, InvalidReceipt, ProtocolError
from gpunet.identity import Identity
from gpunet.ledger import tabs
from gpunet.ledger.receipts import Receipt, countersign, format_credits, price_to_nano
from gpunet.ledger.tabs import Tab
from gpunet.ledger.writer import LedgerWriter
from gpunet.utils import sha256_hex

logger = logging.getLogger("gpunet.client")


class Payment:
    def __init__(self, identity: Identity, router: Router, reputation: Reputation, settlement: Settlement,
                 books: LedgerWriter | None):
        """``router``: what each worker advertised (the most it may charge); ``books``: where receipts are filed."""
        self.identity, self.router, self.reputation = identity, router, reputation
        self.settlement, self.books = settlement, books

    def check(self, p: Prepared, delivery: Delivery):
        """What came back must decode against the manifest and match its receipt: the decoded outputs; raises (and
        refuses the answer) otherwise."""
        receipt = delivery.receipt
        problem = None
        if receipt.worker_id != delivery.worker_id:  # the libp2p channel authenticated who answered
            problem = InvalidReceipt(f"receipt names worker {receipt.worker_id[-8:]}, the answer came from "
                                     f"{delivery.worker_id[-8:]}")
        elif receipt.input_hash != p.input_hash:
            problem = InvalidReceipt("receipt's input hash is not the hash of the inputs sent")
        elif receipt.output_hash != sha256_hex(delivery.outputs):
            problem = InvalidReceipt("receipt's output hash is not the hash of the outputs received")
        elif (overpriced := self.overpriced(receipt)) is not None:
            problem = InvalidReceipt(overpriced)
        else:
            try:
                return p.job.decode_outputs(delivery.outputs, expected=p.outputs)
            except GpunetError as e:
                problem = ProtocolError(f"outputs do not match the program's output specs: {e}")
        self.settlement.refuse(delivery, str(problem))
        raise problem

    def check_step(self, p: Prepared, delivery: Delivery, session: protocol.SessionStep, tab: Tab):
        """A step's answer decodes against the manifest and joins the tab; a receipt comes exactly when the tab
        is due (full, or the session closing), never for a tab this client does not hold. Raises otherwise."""
        try:
            outputs = p.job.decode_step_outputs(delivery.outputs, expected=p.outputs)
        except GpunetError as e:
            raise ProtocolError(f"outputs do not match the program's output specs: {e}") from None
        tab.add(session.step, p.input_hash, sha256_hex(delivery.outputs), p.flops)
        due = tab.full or session.close
        if due != (delivery.receipt is not None):
            problem = (f"no receipt came with step {session.step}, which ends a tab of {tab.steps} steps" if due
                       else f"a receipt came with step {session.step}, in the middle of a tab")
            raise InvalidReceipt(problem)
        return outputs

    def overpriced(self, receipt: Receipt) -> str | None:
        """Why a receipt's price is not one to pay: above what its worker advertised (its interactive price is the
        most it may charge in any lane), or from a worker whose price this client never saw. None if it is fine."""
        advertised = self.router.advertised.get(receipt.worker_id)
        if advertised is None:
            return f"receipt is from worker {receipt.worker_id[-8:]}, whose advertised price this client never saw"
        if receipt.price > price_to_nano(advertised):
            return (f"receipt charges {format_credits(receipt.price)} credits/TFLOP, above the {advertised:g} this "
                    "worker advertises")
        return None

    async def pay(self, p: Prepared, c: CheckedDelivery, attempts: list[str], checked: bool = False,
                  trusted: bool = False) -> JobResult:
        """Countersign and record the receipt of an accepted result; refuse it if its terms are wrong."""
        try:
            # The worker's signature is checked when the receipt is filed (a moment later, off the caller's path):
            # the answer came over a channel authenticated as that worker, and the terms are checked here.
            signed = countersign(c.delivery.receipt, self.identity, output_hash=c.delivery.receipt.output_hash,
                                 max_price=p.max_price, flops=p.flops, lane=p.req.priority,
                                 check_worker_signature=False)
        except GpunetError as e:
            self.settlement.refuse(c.delivery, str(e))
            self.reputation.record(c.worker_id, "invalid")  # a receipt with terms we never agreed to
            raise
        self.books.append(signed)  # a job id is this client's own fresh uuid: never held already
        # Only a check this client can trust (its own computation, or agreement with an established worker) builds the
        # streak that makes a worker established: agreement among newcomers is what colluding identities can farm.
        self.reputation.record(c.worker_id, "valid", checked=trusted)
        if c.compute_seconds is not None:  # speed delivered on a paid job (Router.on_delivered)
            self.router.on_delivered(c.worker_id, p.flops, c.compute_seconds, checked=checked)
        # The result is ours and paid for; the worker gets its countersignature off the caller's critical path:
        # on its stream, or (unary door) riding on our next job to that worker, or in a batch shortly after.
        self.settlement.countersign(c.delivery, signed.client_signature)
        # attempts: every worker this job went to, in order (for a verified job: the replicas, then any retries).
        return JobResult(c.outputs, c.worker_id, signed, attempts + [a for a in c.attempts if a not in attempts],
                         c.delivery.bytes_sent, checked)

    def pay_tab(self, delivery: Delivery, session_id: str, tab: Tab, max_price: int | None) -> Receipt:
        """Check a tab's receipt against this client's own tab (every step's input and output hash, chained, and the
        work it counted), countersign and file it; InvalidReceipt (refused, not paid) otherwise."""
        receipt = delivery.receipt
        problem = None
        named = tabs.parse(receipt.job_id)
        if receipt.worker_id != delivery.worker_id:
            problem = f"receipt names worker {receipt.worker_id[-8:]}, the answer came from {delivery.worker_id[-8:]}"
        elif (named is None or named[0] != session_id or named[2:] != (tab.first, tab.last)
              or tab.nonce not in (None, named[1])):
            problem = f"receipt is for {receipt.job_id[:64]}, the steps were {tab.first}-{tab.last} of {session_id}"
        elif receipt.input_hash != tab.input_chain:
            problem = "receipt's input hash is not the chain of the inputs sent in the tab's steps"
        else:
            problem = self.overpriced(receipt)
        try:
            if problem is not None:
                raise InvalidReceipt(problem)
            signed = countersign(receipt, self.identity, output_hash=tab.output_chain, max_price=max_price,
                                 flops=tab.flops, check_worker_signature=False)
        except GpunetError as e:
            self.settlement.refuse(delivery, str(e))
            self.reputation.record(delivery.worker_id, "invalid")
            raise
        self.books.append(signed)
        self.reputation.record(delivery.worker_id, "valid")
        self.settlement.countersign(delivery, signed.client_signature)
        tab.__init__(named[1])  # the next step starts the session's next tab
        return signed

    def refused(self, receipt: Receipt, error: Exception) -> None:
        """A receipt we countersigned did not enter our ledger (its worker signature is void): that worker is broken or
        cheating; it is not paid (no valid receipt exists) and routing learns to avoid it."""
        logger.warning("Worker %s sent a receipt for job %s that is not valid (%s); it is not paid",
                       receipt.worker_id[-8:], receipt.job_id[:12], error)
        self.reputation.record(receipt.worker_id, "invalid")
