import base64
import dataclasses
import json
import sqlite3

import pytest

from gpunet.errors import InvalidReceipt, LedgerCorrupted, LedgerError, ReceiptConflict
from gpunet.ledger import Identity, Ledger, Receipt, balances, open_ledger
from gpunet.ledger import store as store_module
from gpunet.ledger.export import write_json
from gpunet.ledger.store import SCHEMA_VERSION, entry_hash
from tests._ledger_util import full_receipt, worker_signed

W1, W2, C1, C2, MALLORY = (Identity.generate() for _ in range(5))


@pytest.fixture
def ledger(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield ledger


def filled(ledger: Ledger, n: int = 5) -> list[Receipt]:
    receipts = [full_receipt(W1, C1, f"job-{i}", flops=(i + 1) * 10**12) for i in range(1, n + 1)]
    for r in receipts:
        ledger.append(r)
    return receipts


def tamper(ledger: Ledger, sql: str, params=()) -> None:
    """What an attacker with the file can do: bypass the append-only triggers and rewrite rows."""
    db = sqlite3.connect(ledger.path)
    db.executescript("DROP TRIGGER IF EXISTS entries_no_update; DROP TRIGGER IF EXISTS entries_no_delete;")
    db.execute(sql, params)
    db.commit()
    db.close()


def rechain(ledger: Ledger) -> None:
    """Recompute every link, as an attacker hiding an edit from the chain check would."""
    db = sqlite3.connect(ledger.path)
    db.executescript("DROP TRIGGER IF EXISTS entries_no_update;")
    prev = bytes(32)
    for seq, data in db.execute("SELECT seq, receipt FROM entries ORDER BY seq").fetchall():
        digest = entry_hash(seq, prev, data)
        db.execute("UPDATE entries SET prev_hash = ?, entry_hash = ? WHERE seq = ?", (prev, digest, seq))
        prev = digest
    db.commit()
    db.close()


def stored(ledger: Ledger, seq: int) -> bytes:
    return ledger._db.execute("SELECT receipt FROM entries WHERE seq = ?", (seq,)).fetchone()[0]


def first_bad(ledger: Ledger) -> int | None:
    with pytest.raises(LedgerCorrupted) as info:
        ledger.verify()
    assert str(info.value).startswith(f"entry {info.value.entry}")
    return info.value.entry


# --- appending --------------------------------------------------------------------------------------------------------


def test_append_chains_entries_and_reads_back(ledger):
    receipts = filled(ledger, 3)
    assert [e.seq for e in ledger.entries()] == [1, 2, 3]
    assert list(ledger.receipts()) == receipts
    assert ledger.get("job-2") == receipts[1] and ledger.get("nope") is None
    head = ledger.verify()
    assert head == ledger.head() and head.count == 3
    assert head.head_hash == ledger.entries()[-1].entry_hash.hex()
    assert [e.seq for e in ledger.entries(2, newest_first=True)] == [3, 2]


def test_same_receipt_twice_is_stored_once(ledger):
    r = full_receipt(W1, C1, "job-retry")
    assert ledger.append(r).seq == ledger.append(r).seq == 1
    assert ledger.head().count == 1


def test_incomplete_receipt_is_refused_and_nothing_changes(ledger):
    filled(ledger, 2)
    before = ledger.head()
    with pytest.raises(InvalidReceipt, match="not countersigned"):
        ledger.append(worker_signed(W1, C1, "job-half"))
    with pytest.raises(InvalidReceipt):
        ledger.append(dataclasses.replace(full_receipt(W1, C1, "job-x"), amount=1))
    assert ledger.head() == before and ledger.verify() == before


def test_second_receipt_for_a_job_is_a_recorded_conflict_never_chosen(ledger):
    original = full_receipt(W1, C1, "job-c")
    ledger.append(original)
    rival = full_receipt(W2, C1, "job-c")
    with pytest.raises(ReceiptConflict, match="job-c"):
        ledger.append(rival)
    assert ledger.get("job-c") == original and ledger.head().count == 1
    [conflict] = ledger.conflicts()
    assert (conflict.job_id, conflict.existing, conflict.other) == ("job-c", original, rival)
    ledger.verify()


def test_entries_cannot_be_changed_through_sqlite_by_accident(ledger):
    filled(ledger, 2)
    for sql in ("UPDATE entries SET job_id = 'x' WHERE seq = 1", "DELETE FROM entries WHERE seq = 2"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            ledger._db.execute(sql)
    ledger.verify()


def test_unpaid_work_stays_visible_until_countersigned(ledger):
    half = worker_signed(W1, C1, "job-u")
    ledger.record_unpaid(half)
    ledger.record_unpaid(worker_signed(W1, C2, "job-never"))
    assert [r.job_id for r in ledger.unpaid()] == ["job-u", "job-never"]
    assert balances(ledger.unpaid())[C2.peer_id].spent == half.amount  # what C2 owes
    complete = full_receipt(W1, C1, "job-u")
    ledger.append(complete)
    assert [r.job_id for r in ledger.unpaid()] == ["job-never"]
    ledger.record_unpaid(half)  # late duplicate of a paid job: ignored
    assert [r.job_id for r in ledger.unpaid()] == ["job-never"]
    with pytest.raises(InvalidReceipt, match="worker signature"):
        ledger.record_unpaid(dataclasses.replace(half, job_id="job-forged"))


def test_a_job_paid_to_another_worker_leaves_this_work_unpaid(tmp_path):
    with Ledger(tmp_path / "w1.sqlite") as w1, Ledger(tmp_path / "client.sqlite") as client:
        w1.record_unpaid(worker_signed(W1, C1, "job-retried"))  # W1 finished, but the client had moved on
        client.append(full_receipt(W2, C1, "job-retried"))  # the retry on W2 is what the client countersigned
        assert w1.merge(client.path).added == 1
        assert [r.worker_id for r in w1.unpaid()] == [W1.peer_id]
        w1.record_unpaid(worker_signed(W1, C1, "job-retried"))
        amount = w1.get("job-retried").amount
        assert len(w1.unpaid()) == 1 and w1.balances()[W2.peer_id].earned_unvouched == amount  # merged: apart
        assert w1.balances([C1.peer_id])[W2.peer_id].earned == amount  # ... unless W1 trusts a party of it


def test_open_ledger_lives_in_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUNET_DATA_DIR", str(tmp_path / "node"))
    with open_ledger() as ledger:
        ledger.append(full_receipt(W1, C1, "job-d"))
    with open_ledger(tmp_path / "node") as again:
        assert again.head().count == 1
    assert (tmp_path / "node" / "ledger.sqlite").exists()


def test_a_file_that_is_not_a_ledger_is_a_clear_error(tmp_path):
    (tmp_path / "junk").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(LedgerError, match="not a usable gpunet ledger"):
        Ledger(tmp_path / "junk")
    other = sqlite3.connect(tmp_path / "other.sqlite")
    other.execute("CREATE TABLE t (x)")
    other.close()
    with pytest.raises(LedgerError, match="not a gpunet ledger"):
        Ledger(tmp_path / "other.sqlite")


# --- balances ---------------------------------------------------------------------------------------------------------


def test_balances_are_exact_and_what_clients_spend_workers_earn(ledger):
    receipts = [
        full_receipt(W1, C1, "a", flops=10**15, price=2_000_000),  # 2 credits
        full_receipt(W2, C1, "b", flops=5 * 10**14, price=3_000_000, max_price=None),  # 1.5 credits
        full_receipt(W1, C2, "c", flops=333, price=1_000_000),  # rounds up to one nano-credit
    ]
    for r in receipts:
        ledger.append(r)
    b = ledger.balances()
    assert (b[W1.peer_id].earned, b[W1.peer_id].jobs_worked) == (2_000_000_001, 2)
    assert (b[C1.peer_id].spent, b[C1.peer_id].net) == (3_500_000_000, -3_500_000_000)
    assert b[W2.peer_id].net == 1_500_000_000 and (b[C2.peer_id].jobs_bought, b[C2.peer_id].spent) == (1, 1)
    assert sum(x.earned for x in b.values()) == sum(x.spent for x in b.values())
    assert balances(receipts + receipts) == b  # a pure function of the receipt set
    assert ledger.earned(W1.peer_id) == 2_000_000_001 and ledger.earned(MALLORY.peer_id) == 0
    ledger.append(full_receipt(W1, C2, "d", flops=10**15, price=1_000_000))  # totals follow new entries
    assert ledger.earned(W1.peer_id) == 3_000_000_001
    assert ledger.balances() == balances(ledger.receipts())


# --- verify: tampering is found and the first bad entry named ---------------------------------------------------------


def test_flipping_any_byte_of_a_stored_receipt_is_found_at_that_entry(ledger):
    filled(ledger, 5)
    original = stored(ledger, 3)
    for i in range(len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 0x01
        tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 3", (bytes(flipped),))
        assert first_bad(ledger) == 3, f"byte {i}"
    tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 3", (original,))
    ledger.verify()


def test_a_rewritten_receipt_is_found_even_when_the_chain_is_recomputed(ledger):
    filled(ledger, 5)
    original = stored(ledger, 3)
    for i in range(0, len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 0x80
        tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 3", (bytes(flipped),))
        rechain(ledger)
        assert first_bad(ledger) == 3, f"byte {i}"


@pytest.mark.parametrize("column", ["prev_hash", "entry_hash"])
def test_flipping_a_stored_link_is_found(ledger, column):
    filled(ledger, 4)
    value = bytearray(ledger._db.execute(f"SELECT {column} FROM entries WHERE seq = 2").fetchone()[0])
    value[7] ^= 0x10
    tamper(ledger, f"UPDATE entries SET {column} = ? WHERE seq = 2", (bytes(value),))
    assert first_bad(ledger) == 2


def test_deleting_an_entry_from_the_middle_names_it(ledger):
    filled(ledger, 5)
    tamper(ledger, "DELETE FROM entries WHERE seq = 3")
    with pytest.raises(LedgerCorrupted, match="entry 3: missing") as info:
        ledger.verify()
    assert info.value.entry == 3


def test_reordering_entries_is_found(ledger):
    filled(ledger, 5)
    tamper(ledger, "UPDATE entries SET seq = -seq WHERE seq IN (3, 4)")
    tamper(ledger, "UPDATE entries SET seq = CASE seq WHEN -3 THEN 4 ELSE 3 END WHERE seq < 0")
    assert first_bad(ledger) == 3


def test_replacing_a_signature_is_found(ledger):
    receipts = filled(ledger, 4)
    target = receipts[1]
    for swapped in (
        dataclasses.replace(target, client_signature=MALLORY.sign(target.signing_bytes())),
        dataclasses.replace(target, worker_signature=MALLORY.sign(target.signing_bytes())),
        dataclasses.replace(target, worker_signature=receipts[2].worker_signature),
    ):
        tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 2", (swapped.to_bytes(),))
        assert first_bad(ledger) == 2
        rechain(ledger)
        with pytest.raises(LedgerCorrupted, match="entry 2: .*signature does not verify"):
            ledger.verify()


def test_an_entry_indexed_under_another_job_id_is_found(ledger):
    filled(ledger, 3)
    tamper(ledger, "UPDATE entries SET job_id = 'job-99' WHERE seq = 2")
    with pytest.raises(LedgerCorrupted, match="entry 2: indexed under job job-99"):
        ledger.verify()


def test_first_bad_entry_is_named_across_verification_batches(ledger, monkeypatch):
    monkeypatch.setattr(store_module, "_VERIFY_BATCH", 4)
    receipts = filled(ledger, 11)
    tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 10", (receipts[0].to_bytes(),))  # chain break at 10
    forged = dataclasses.replace(receipts[6], client_signature=MALLORY.sign(receipts[6].signing_bytes()))
    tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 7", (forged.to_bytes(),))
    rechain(ledger)  # now only signatures can tell: 7 (forged) comes before 10 (a copy of entry 1, valid signatures)
    assert first_bad(ledger) == 7
    tamper(ledger, "UPDATE entries SET receipt = ? WHERE seq = 7", (receipts[6].to_bytes(),))
    rechain(ledger)
    with pytest.raises(LedgerCorrupted, match="entry 10: indexed under job job-10 but holds a receipt for job job-1"):
        ledger.verify()


# --- merge ------------------------------------------------------------------------------------------------------------


def test_merge_is_a_union_by_job_id(tmp_path):
    shared = [full_receipt(W1, C1, f"shared-{i}") for i in range(3)]
    with Ledger(tmp_path / "worker.sqlite") as worker, Ledger(tmp_path / "client.sqlite") as client:
        for r in shared:
            worker.append(r)
            client.append(r)
        client.append(full_receipt(W2, C1, "client-only"))
        worker.append(full_receipt(W1, C2, "worker-only"))
        report = worker.merge(client.path)
        assert (report.added, report.duplicates, report.clean) == (1, 3, True)
        report = client.merge(worker.path)
        assert (report.added, report.duplicates, report.clean) == (1, 4, True)
        assert {r.job_id: r for r in worker.receipts()} == {r.job_id: r for r in client.receipts()}
        worker.verify(), client.verify()
        assert worker.merge(client.path).added == 0  # idempotent


def _smuggle(ledger: Ledger, receipt: Receipt) -> None:
    """Put a receipt in a ledger file past append's checks, as a hostile peer's file would hold it."""
    seq, prev = ledger.head()
    data = receipt.to_bytes()
    prev_hash = bytes.fromhex(prev)
    tamper(ledger, "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?)",
           (seq + 1, receipt.client_id, receipt.job_id, data, prev_hash, entry_hash(seq + 1, prev_hash, data)))  # fmt: skip


def test_merge_refuses_forged_and_wrong_key_receipts(tmp_path):
    honest = full_receipt(W1, C1, "honest")
    body_only = dataclasses.replace(full_receipt(W1, C1, "wrong-key"), worker_signature=b"", client_signature=b"")
    by_other_key = dataclasses.replace(  # worker id says W1, but Mallory signed (and the client countersigned that)
        body_only,
        worker_signature=MALLORY.sign(body_only.signing_bytes()),
        client_signature=C1.sign(body_only.signing_bytes()),
    )
    forged = dataclasses.replace(full_receipt(W1, C1, "forged"), worker_signature=bytes(64))
    with Ledger(tmp_path / "hostile.sqlite") as hostile:
        hostile.append(honest)
        _smuggle(hostile, by_other_key)
        _smuggle(hostile, forged)
    with Ledger(tmp_path / "mine.sqlite") as mine:
        report = mine.merge(tmp_path / "hostile.sqlite")
        assert report.added == 1 and report.conflicts == []
        assert [(where, "worker signature does not verify" in why) for where, why in report.refused] == [
            ("job wrong-key", True),
            ("job forged", True),
        ]
        assert [r.job_id for r in mine.receipts()] == ["honest"]
        mine.verify()


def test_merge_reports_conflicts_and_keeps_what_it_held(tmp_path):
    mine_first = full_receipt(W1, C1, "job-x")
    theirs = full_receipt(W2, C1, "job-x")
    with Ledger(tmp_path / "mine.sqlite") as mine, Ledger(tmp_path / "theirs.sqlite") as other:
        mine.append(mine_first)
        other.append(theirs)
        other.append(full_receipt(W2, C2, "job-y"))
        report = mine.merge(other.path)
        assert (report.added, report.conflicts, report.clean) == (1, ["job-x"], False)
        assert mine.get("job-x") == mine_first
        assert mine.merge(other.path).conflicts == ["job-x"]
        assert len(mine.conflicts()) == 1  # recorded once, however often it is seen
        mine.verify()


def test_merge_from_a_json_export_and_refusal_of_bad_rows(tmp_path):
    with Ledger(tmp_path / "a.sqlite") as a:
        receipts = filled(a, 4)
        with open(tmp_path / "a.json", "w") as f:
            write_json(a.entries(), a.head(), f)
    doc = json.loads((tmp_path / "a.json").read_text())
    bad = dataclasses.replace(receipts[0], job_id="tampered")
    doc["receipts"][1]["receipt"] = base64.b64encode(bad.to_bytes()).decode()
    doc["receipts"][2]["receipt"] = "%%%"
    (tmp_path / "a.json").write_text(json.dumps(doc))
    with Ledger(tmp_path / "b.sqlite") as b:
        report = b.merge(tmp_path / "a.json")
        assert report.added == 2
        assert [where for where, _ in report.refused] == ["row 3 (no base64 'receipt' field)", "job tampered"]
        assert [r.job_id for r in b.receipts()] == ["job-1", "job-4"]


def test_a_json_export_is_merged_a_row_at_a_time_and_a_hostile_one_is_refused_without_a_traceback(tmp_path,
                                                                                                   monkeypatch):
    """From an attacker's review: the whole document was parsed at once (a 4 MB file took 374 MiB; deep nesting
    raised RecursionError). The writer's layout is read a row at a time; another layout only up to a size."""
    from gpunet.ledger import export

    with Ledger(tmp_path / "a.sqlite") as a:
        filled(a, 3)
        with open(tmp_path / "a.json", "w") as f:
            write_json(a.entries(), a.head(), f)
    lines = (tmp_path / "a.json").read_text().splitlines()
    lines.insert(2, "  " + "x" * (export.MAX_ROW_LINE + 10) + ",")  # an overlong line: refused as a row, no more
    (tmp_path / "a.json").write_text("\n".join(lines) + "\n")
    rows = export.read_json_export(tmp_path / "a.json")
    assert not isinstance(rows, list)  # a generator: nothing read past the header yet
    with Ledger(tmp_path / "b.sqlite") as b:
        report = b.merge(tmp_path / "a.json")
        refused = [where for where, _ in report.refused]
        assert report.added == 3 and refused == [f"row 2 (over {export.MAX_ROW_LINE} bytes)"]
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "big.json").write_text(json.dumps({"format": export.EXPORT_FORMAT, "version": 2,
                                                   "receipts": [0] * 1000}))
    with Ledger(tmp_path / "c.sqlite") as c:
        with pytest.raises(LedgerError, match="neither a gpunet ledger"):
            c.merge(tmp_path / "deep.json")
        monkeypatch.setattr(export, "MAX_WHOLE_JSON_BYTES", 1000)
        with pytest.raises(LedgerError, match="not laid out as"):
            c.merge(tmp_path / "big.json")


def test_merge_clears_unpaid_when_the_clients_copy_arrives(tmp_path):
    with Ledger(tmp_path / "worker.sqlite") as worker, Ledger(tmp_path / "client.sqlite") as client:
        worker.record_unpaid(worker_signed(W1, C1, "job-late"))
        client.append(full_receipt(W1, C1, "job-late"))
        worker.merge(client.path)
        assert worker.unpaid() == [] and worker.get("job-late") is not None


@pytest.mark.parametrize("content", [None, b"garbage", b'{"format": "something-else", "receipts": []}'])
def test_merge_of_something_that_is_not_a_ledger_is_a_clear_error(ledger, tmp_path, content):
    source = tmp_path / "source"
    if content is not None:
        source.write_bytes(content)
    with pytest.raises(LedgerError, match="source"):
        ledger.merge(source)
    assert ledger.head().count == 0


def test_merging_a_running_nodes_file_copied_without_its_wal_says_what_to_copy(tmp_path):
    import shutil

    receipts = [full_receipt(W1, C1, f"live-{i}") for i in range(3)]
    with Ledger(tmp_path / "node.sqlite") as node, Ledger(tmp_path / "mine.sqlite") as mine:
        for r in receipts:
            node.append(r)  # the node is running: its newest pages sit in node.sqlite-wal
        assert (tmp_path / "node.sqlite-wal").exists()
        shutil.copy(tmp_path / "node.sqlite", tmp_path / "copied.sqlite")  # the file alone, as a user might copy it
        with pytest.raises(LedgerError, match=r"copied.sqlite-wal beside the ledger file: copy both files"):
            mine.merge(tmp_path / "copied.sqlite")
        shutil.copy(tmp_path / "node.sqlite-wal", tmp_path / "copied.sqlite-wal")  # ...as told: both files
        assert mine.merge(tmp_path / "copied.sqlite").added == 3
        assert mine.merge(tmp_path / "node.sqlite").duplicates == 3  # and straight from the running node's file


def _crafted(tmp_path, name: str, entries_sql: str, rows_sql: str = "") -> str:
    """A ledger file whose ``entries`` is redefined by a hostile peer: same schema version, different table."""
    path = tmp_path / name
    Ledger(path).close()
    db = sqlite3.connect(path)
    db.executescript(f"DROP TRIGGER IF EXISTS entries_no_update; DROP TRIGGER IF EXISTS entries_no_delete; "
                     f"DROP TABLE entries; {entries_sql}; {rows_sql}")
    db.close()
    return path


@pytest.mark.parametrize("entries_sql, rows_sql", [
    # a few KiB of file that would read as gigabytes, or as rows without end
    ("CREATE TABLE entries (seq INTEGER PRIMARY KEY, job_id TEXT, receipt BLOB GENERATED ALWAYS AS "
     "(zeroblob(1000000000)) VIRTUAL, prev_hash BLOB, entry_hash BLOB)",
     "INSERT INTO entries (seq, job_id) VALUES (1, 'a'), (2, 'b')"),
    ("CREATE VIEW entries AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
     "SELECT i AS seq, 'x' || i AS job_id, zeroblob(100) AS receipt FROM n", ""),
])
def test_merge_refuses_a_crafted_file_before_reading_it(tmp_path, entries_sql, rows_sql):
    crafted = _crafted(tmp_path, "crafted.sqlite", entries_sql, rows_sql)
    with Ledger(tmp_path / "mine.sqlite") as mine:
        with pytest.raises(LedgerError, match="not a (plain table|gpunet ledger)"):
            mine.merge(crafted)
        assert mine.head().count == 0


def test_merge_refuses_values_longer_than_any_receipt_without_reading_them(tmp_path):
    crafted = _crafted(tmp_path, "big.sqlite",
                       "CREATE TABLE entries (seq INTEGER PRIMARY KEY, job_id TEXT, receipt BLOB, prev_hash BLOB, "
                       "entry_hash BLOB)", "INSERT INTO entries VALUES (1, 'a', zeroblob(10000000), x'', x'')")
    with Ledger(tmp_path / "mine.sqlite") as mine:
        with pytest.raises(LedgerError, match="larger than any receipt"):
            mine.merge(crafted)


def test_a_file_of_many_bad_rows_is_counted_not_kept_row_by_row(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module.MergeReport, "MAX_LISTED", 5)
    crafted = _crafted(tmp_path, "junk.sqlite",
                       "CREATE TABLE entries (seq INTEGER PRIMARY KEY, job_id TEXT, receipt BLOB, prev_hash BLOB, "
                       "entry_hash BLOB)",
                       "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 50) "
                       "INSERT INTO entries SELECT i, 'j' || i, x'00', x'', x'' FROM n")
    with Ledger(tmp_path / "mine.sqlite") as mine:
        report = mine.merge(crafted)
    assert report.refused_count == 50 and len(report.refused) == 5 and not report.clean


_SCHEMA_1 = """
CREATE TABLE entries (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL UNIQUE, receipt BLOB NOT NULL,
                      prev_hash BLOB NOT NULL, entry_hash BLOB NOT NULL);
CREATE TRIGGER entries_no_update BEFORE UPDATE ON entries
    BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
CREATE TRIGGER entries_no_delete BEFORE DELETE ON entries
    BEGIN SELECT RAISE(ABORT, 'ledger entries are append-only'); END;
CREATE TABLE unpaid (job_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, receipt BLOB NOT NULL,
                     recorded_at_us INTEGER NOT NULL);
CREATE TABLE conflicts (id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, receipt BLOB NOT NULL, source TEXT NOT NULL,
                        detected_at_us INTEGER NOT NULL, UNIQUE (job_id, receipt));
PRAGMA user_version = 1;
"""


def _schema_1_file(path, receipts, unpaid, conflicts=()):
    """A ledger as gpunet wrote it before job ids were namespaced by client (schema 1)."""
    db = sqlite3.connect(path)
    db.executescript(_SCHEMA_1)
    prev = store_module.GENESIS_HASH
    for seq, r in enumerate(receipts, 1):
        data = r.to_bytes()
        digest = entry_hash(seq, prev, data)
        db.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?)", (seq, r.job_id, data, prev, digest))
        prev = digest
    for r in unpaid:
        db.execute("INSERT INTO unpaid VALUES (?, ?, ?, ?)", (r.job_id, r.worker_id, r.to_bytes(), 1))
    for r in conflicts:
        db.execute("INSERT INTO conflicts (job_id, receipt, source, detected_at_us) VALUES (?, ?, 'merge', 1)",
                   (r.job_id, r.to_bytes()))
    db.commit()
    db.close()


def test_a_schema_1_ledger_is_read_as_it_is_and_migrated_when_opened_for_writing(tmp_path):
    receipts = [full_receipt(W1, C1, f"job-{i}") for i in range(5)]
    owed = worker_signed(W1, C2, "job-owed")
    another_clients = full_receipt(W2, C2, "job-3")  # same id, another client: a "conflict" in schema 1
    _schema_1_file(tmp_path / "old.sqlite", receipts, [owed], [another_clients])
    with Ledger(tmp_path / "old.sqlite", create=False, readonly=True) as old:  # e.g. `gpunet ledger balance`
        head, sheet = old.verify(), old.balances()
        assert old.get("job-3") == receipts[3] and old.get_unpaid("job-owed") == owed
    assert sqlite3.connect(tmp_path / "old.sqlite").execute("PRAGMA user_version").fetchone()[0] == 1  # untouched
    with Ledger(tmp_path / "old.sqlite") as ledger:  # a node starting on it
        assert ledger.head().count == 6 and ledger.entries(5)[-1].entry_hash.hex() == head.head_hash  # same chain
        assert ledger.balances()[C1.peer_id] == sheet[C1.peer_id]  # the same money
        assert ledger.get("job-3", C1.peer_id) == receipts[3] and ledger.unpaid() == [owed]
        # Schema 1's false "conflict" is a job of its own now: appended to the chain, no longer listed as a conflict.
        assert ledger.get("job-3", C2.peer_id) == another_clients
        assert ledger.conflicts() == [] and ledger.verify().count == 6
    assert sqlite3.connect(tmp_path / "old.sqlite").execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_unbilled_work_is_noted_with_its_reason_bounded_and_a_schema_2_file_gains_the_table(tmp_path, monkeypatch):
    import gpunet.ledger.store as store
    from gpunet.ledger.entries import Unbilled

    with Ledger(tmp_path / "a.sqlite") as ledger:
        ledger.record_unbilled(Unbilled(C1.peer_id, "job-1", "refused", "outvoted by 2 other workers", 10**9))
        ledger.record_unbilled(Unbilled(C1.peer_id, "job-2", "preempted", lane="batch"))
        notes = ledger.unbilled()
        assert [(n.job_id, n.reason, n.lane) for n in notes] == [("job-1", "refused", "interactive"),
                                                                   ("job-2", "preempted", "batch")]
        assert notes[0].detail == "outvoted by 2 other workers" and notes[0].recorded_at_us > 0
        assert ledger.unbilled(since_us=notes[1].recorded_at_us + 1) == []
        monkeypatch.setattr(store, "MAX_UNBILLED", 3)
        for i in range(5):
            ledger.record_unbilled(Unbilled(C2.peer_id, f"spam-{i}", "cancelled"))
        assert [n.job_id for n in ledger.unbilled()] == ["spam-2", "spam-3", "spam-4"]
    # A ledger written before schema 3: read as it is (no notes), given the table when opened for writing.
    db = sqlite3.connect(tmp_path / "b.sqlite")
    db.executescript(store._TABLES + store._TRIGGERS + "PRAGMA user_version = 2;")
    db.close()
    with Ledger(tmp_path / "b.sqlite", readonly=True) as ledger:
        assert ledger.unbilled() == []
    with Ledger(tmp_path / "b.sqlite") as ledger:
        ledger.record_unbilled(Unbilled(C1.peer_id, "job-9", "timed_out"))
        assert [n.reason for n in ledger.unbilled()] == ["timed_out"]
    assert sqlite3.connect(tmp_path / "b.sqlite").execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
