"""Group commit: ``Ledger.write_batch`` and the ``LedgerWriter`` that nodes put in front of their ledger."""

import asyncio

import pytest

from gpunet.errors import InvalidReceipt, ReceiptConflict
from gpunet.ledger import Identity, Ledger, countersign
from gpunet.ledger.writer import LedgerWriter
from tests._ledger_util import full_receipt, worker_signed

W1, W2, C1 = (Identity.generate() for _ in range(3))


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield ledger


def forged(job_id: str):
    """A complete-looking receipt whose worker signature is not the worker's."""
    good = full_receipt(W1, C1, job_id)
    other = worker_signed(W2, C1, job_id)
    return good._with_signature("worker_signature", other.worker_signature)


def test_write_batch_writes_everything_good_in_one_go_and_names_what_it_refused(ledger):
    good = [full_receipt(W1, C1, f"job-{i}") for i in range(5)]
    unpaid = [worker_signed(W1, C1, "job-unpaid"), worker_signed(W1, C1, "job-2")]  # job-2 is settled in the batch
    ledger.append(full_receipt(W1, C1, "job-old"))
    conflicting = full_receipt(W1, C1, "job-old", flops=7 * 10**12)
    bad = forged("job-forged")

    problems = ledger.write_batch(good + [bad, conflicting], unpaid)

    assert {(r.job_id, type(e)) for r, e in problems} == {("job-forged", InvalidReceipt), ("job-old", ReceiptConflict)}
    assert [r.job_id for r in ledger.receipts()] == ["job-old"] + [f"job-{i}" for i in range(5)]
    assert [r.job_id for r in ledger.unpaid()] == ["job-unpaid"]
    assert [c.job_id for c in ledger.conflicts()] == ["job-old"]
    assert ledger.verify().count == 6  # the chain is intact across the batch


def test_write_batch_of_duplicates_is_idempotent(ledger):
    receipts = [full_receipt(W1, C1, f"job-{i}") for i in range(3)]
    assert ledger.write_batch(receipts) == []
    assert ledger.write_batch(receipts + receipts) == []
    assert ledger.verify().count == 3


def test_countersign_can_leave_the_worker_signature_to_the_store(ledger):
    """The client checks the terms at once and the worker's signature when the receipt is filed."""
    bad = forged("job-x")
    terms = dict(output_hash=bad.output_hash, max_price=bad.max_price)
    with pytest.raises(InvalidReceipt, match="worker signature"):
        countersign(bad, C1, **terms)
    lenient = countersign(bad, C1, **terms, check_worker_signature=False)
    with pytest.raises(InvalidReceipt, match="worker signature"):
        ledger.append(lenient)
    with pytest.raises(InvalidReceipt, match="output hash"):  # the terms are still checked
        countersign(bad, C1, output_hash="0" * 64, max_price=bad.max_price, check_worker_signature=False)


def test_writer_queues_batches_and_flushes_on_its_own(ledger):
    refused = []

    async def scenario():
        books = LedgerWriter(ledger, delay=0.01, on_refused=lambda r, e: refused.append((r.job_id, e)))
        receipts = [full_receipt(W1, C1, f"job-{i}") for i in range(10)]
        for r in receipts:
            books.append(r)
        books.append(forged("job-forged"))
        books.record_unpaid(worker_signed(W1, C1, "job-unpaid"))
        assert books.get(C1.peer_id, "job-3") == receipts[3]  # visible at once, before it is written
        assert ledger.get("job-3") is None
        deadline = asyncio.get_running_loop().time() + 10
        while books.pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        assert not books.pending
        books.close()

    asyncio.run(scenario())
    assert ledger.verify().count == 10
    assert [r.job_id for r in ledger.unpaid()] == ["job-unpaid"]
    assert [job for job, _ in refused] == ["job-forged"]


def test_writer_flushes_when_many_are_pending_and_on_close(ledger):
    async def scenario():
        books = LedgerWriter(ledger, delay=3600, max_pending=4)
        for i in range(6):
            books.append(full_receipt(W1, C1, f"job-{i}"))
        assert ledger.verify().count == 4  # the fourth forced a write; no timer was needed
        books.close()

    asyncio.run(scenario())
    assert ledger.verify().count == 6


def test_writer_keeps_receipts_it_could_not_write(tmp_path, caplog):
    path = tmp_path / "ledger.sqlite"
    Ledger(path).close()
    readonly = Ledger(path, readonly=True)
    books = LedgerWriter(readonly, delay=3600)

    async def scenario():
        books.append(full_receipt(W1, C1, "job-0"))
        books.flush()
        assert books.pending == 1  # not lost: kept for the next attempt
        books.ledger = Ledger(path)  # the file is writable again
        books.close()

    asyncio.run(scenario())
    readonly.close()
    assert "Could not write 1 receipt" in caplog.text
    with Ledger(path) as ledger:
        assert ledger.verify().count == 1


def test_one_receipt_that_breaks_a_batch_does_not_hold_back_the_others(ledger):
    import sqlite3

    ledger.append(full_receipt(W1, C1, "job-corrupt"))
    db = sqlite3.connect(ledger.path)  # an attacker (or a disk) garbles the stored row for that job id
    db.executescript("DROP TRIGGER entries_no_update;")
    db.execute("UPDATE entries SET receipt = x'00' WHERE job_id = 'job-corrupt'")
    db.commit()
    db.close()
    refused = []

    async def scenario():
        books = LedgerWriter(ledger, delay=3600, on_refused=lambda r, e: refused.append((r.job_id, type(e).__name__)))
        books.append(full_receipt(W1, C1, "job-corrupt", flops=9 * 10**12))  # its job id hits the garbled row
        books.append(full_receipt(W1, C1, "job-fine"))
        books.flush()
        assert not books.pending

    asyncio.run(scenario())
    assert refused == [("job-corrupt", "LedgerCorrupted")]
    assert ledger.get("job-fine") is not None


def test_a_second_different_receipt_for_a_job_is_kept_as_evidence(ledger):
    async def scenario():
        books = LedgerWriter(ledger, delay=3600)
        first = full_receipt(W1, C1, "job-1")
        books.append(first)
        books.append(full_receipt(W1, C1, "job-1", flops=5 * 10**12))
        assert books.get(C1.peer_id, "job-1") == first
        books.close()

    asyncio.run(scenario())
    assert [c.job_id for c in ledger.conflicts()] == ["job-1"]
