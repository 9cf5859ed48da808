"""What a ledger vouches for (gpunet.ledger.vouching): its own job path's receipts, merged ones with a trusted party,
a merged one that settles a result its worker was owed for; everything else merged is apart, in every reader."""

import sqlite3

import pytest

from gpunet.errors import LedgerError
from gpunet.ledger import Identity, Ledger
from gpunet.ledger.earnings import EarningsBook, earnings
from gpunet.ledger.vouching import Origin, TrustWatch, load_trusted, save_trusted, vouched
from tests._ledger_util import full_receipt, worker_signed

ME, CLIENT, MALLORY_W, MALLORY_C = (Identity.generate() for _ in range(4))


def test_the_rule():
    r = full_receipt(MALLORY_W, MALLORY_C, "x")
    none = frozenset()
    assert vouched(r, Origin.HERE, none) and not vouched(r, Origin.MERGED, none)
    assert vouched(r, Origin.MERGED, frozenset({MALLORY_C.peer_id})) and vouched(r, Origin.MERGED,
                                                                                 frozenset({MALLORY_W.peer_id}))
    assert not vouched(r, Origin.UNKNOWN, none, ME.peer_id) and vouched(r, Origin.UNKNOWN, none, MALLORY_W.peer_id)


def test_merged_receipts_count_nowhere_not_even_with_this_nodes_own_key_on_them(tmp_path):
    """A key signs whatever its owner's script asks: what this node's worker filed as jobs ran is its credit, a file
    of receipts in its name is not (unless it trusts the other party)."""
    with Ledger(tmp_path / "mint.sqlite") as mint:
        mint.append(full_receipt(ME, MALLORY_C, "minted", flops=10**15, price=10**9, max_price=None))
        mint.append(full_receipt(MALLORY_W, MALLORY_C, "theirs", flops=10**15, price=10**9, max_price=None))
    with Ledger(tmp_path / "me.sqlite") as ledger:
        ledger.append(full_receipt(ME, CLIENT, "real", flops=10**12, price=10**9, max_price=None))
        assert ledger.merge(mint.path).added == 2
        mine = ledger.balances(me=ME.peer_id)[ME.peer_id]
        assert (mine.earned, mine.jobs_worked, mine.earned_unvouched, mine.jobs_unvouched) == (10**9, 1, 10**12, 1)
        assert ledger.earned(ME.peer_id) == 10**9
        report = earnings(ledger, ME.peer_id)
        assert (report.total.nano, report.unvouched.nano, report.to_json()["unvouched"]["jobs"]) == (10**9, 10**12, 1)
        book = EarningsBook(ME.peer_id)
        assert book.report(ledger, 2)["total"]["nano"] == 10**9
        assert book.report(ledger, 2, trusted=frozenset({MALLORY_C.peer_id}))["total"]["nano"] == 10**9 + 10**12
        assert ledger.earned(ME.peer_id, [MALLORY_C.peer_id]) == 10**9 + 10**12
        assert ledger.balances([MALLORY_C.peer_id])[MALLORY_W.peer_id].earned == 10**12
        # The same receipt filed by this node's own job path afterwards (its countersignature came on the wire): own.
        ledger.append(full_receipt(ME, MALLORY_C, "minted", flops=10**15, price=10**9, max_price=None))
        assert ledger.earned(ME.peer_id) == 10**9 + 10**12


def test_a_merge_that_restores_a_result_this_worker_was_owed_for_counts(tmp_path):
    """The worker lost the countersignature (killed before filing it); the client's file brings it back."""
    half = worker_signed(ME, CLIENT, "owed")
    with Ledger(tmp_path / "client.sqlite") as client:
        client.append(full_receipt(ME, CLIENT, "owed"))
        client.append(full_receipt(ME, CLIENT, "not-delivered-here"))  # same key, but no trace of it here
    with Ledger(tmp_path / "me.sqlite") as ledger:
        ledger.record_unpaid(half)
        assert ledger.merge(client.path).added == 2 and ledger.unpaid() == []
        mine = ledger.balances(me=ME.peer_id)[ME.peer_id]
        assert (mine.earned, mine.earned_unvouched) == (half.amount, half.amount)


def test_entries_filed_before_origins_were_kept_count_when_this_node_is_a_party(tmp_path):
    path = tmp_path / "old.sqlite"
    with Ledger(path) as ledger:
        ledger.append(full_receipt(ME, CLIENT, "mine"))
        ledger.append(full_receipt(MALLORY_W, MALLORY_C, "merged-long-ago"))
    db = sqlite3.connect(path)  # as a schema-3 release left it
    db.executescript("DROP TABLE merged; DROP TABLE provenance; PRAGMA user_version = 3;")
    db.close()
    with Ledger(path, create=False, readonly=True) as old:  # read as it is
        b = old.balances(me=ME.peer_id)
        assert b[ME.peer_id].earned > 0 and b[MALLORY_W.peer_id].earned_unvouched > 0
    with Ledger(path) as ledger:  # migrated: the old entries keep unknown origin, new ones are known
        ledger.append(full_receipt(MALLORY_W, MALLORY_C, "filed-here-now"))
        b = ledger.balances(me=ME.peer_id)
        assert b[ME.peer_id].earned > 0 and b[MALLORY_W.peer_id].jobs_unvouched == 1
        assert b[MALLORY_W.peer_id].jobs_worked == 1


def test_the_trust_list_file(tmp_path):
    watch = TrustWatch(tmp_path)
    assert watch.current() == frozenset() == load_trusted(tmp_path)
    save_trusted(tmp_path, add=[MALLORY_C.peer_id, MALLORY_C.peer_id, CLIENT.peer_id])
    assert watch.current() == {MALLORY_C.peer_id, CLIENT.peer_id}
    save_trusted(tmp_path, remove=[CLIENT.peer_id])
    assert watch.current() == {MALLORY_C.peer_id} and "#" in (tmp_path / "trusted-peers").read_text()
    with pytest.raises(LedgerError, match="is not a peer id"):
        save_trusted(tmp_path, add=["12D3KooWxyz"])
    (tmp_path / "trusted-peers").write_text("oops\n")
    assert watch.current() == {MALLORY_C.peer_id}  # a broken list keeps the last good one


def test_merging_reads_nothing_of_the_other_file_but_its_entries(tmp_path):
    """Another node's file is hostile: a `provenance` or `merged` that never ends must not stall a merge."""
    with Ledger(tmp_path / "theirs.sqlite") as theirs:
        theirs.append(full_receipt(MALLORY_W, MALLORY_C, "x"))
    db = sqlite3.connect(tmp_path / "theirs.sqlite")
    endless = "WITH RECURSIVE n(since_seq) AS (SELECT 1 UNION ALL SELECT since_seq + 1 FROM n) SELECT since_seq FROM n"
    db.executescript(f"DROP TABLE provenance; CREATE VIEW provenance AS {endless}; DROP TABLE merged; "
                     f"CREATE VIEW merged AS SELECT since_seq AS seq, '' AS source, 0 AS merged_at_us FROM ({endless});")
    db.close()
    with Ledger(tmp_path / "me.sqlite") as ledger:
        assert ledger.merge(tmp_path / "theirs.sqlite").added == 1
        assert ledger.balances(me=ME.peer_id)[MALLORY_W.peer_id].jobs_unvouched == 1
