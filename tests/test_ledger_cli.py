"""``gpunet ledger …`` as a user runs it: exit codes, the first bad entry named, exports that re-import."""

import base64
import csv
import io
import json
import sqlite3

import pytest
from typer.testing import CliRunner

from gpunet.ledger import Identity, Receipt, open_ledger
from gpunet.cli.ledger import app
from tests._ledger_util import full_receipt, worker_signed

runner = CliRunner()
CLIENT, OTHER = Identity.generate(), Identity.generate()


@pytest.fixture
def node(tmp_path):
    """A worker's data dir holding three paid jobs and one unpaid one."""
    me = Identity.load_or_create(tmp_path / "node")
    with open_ledger(tmp_path / "node") as ledger:
        for i in range(1, 4):
            ledger.append(full_receipt(me, CLIENT, f"job-{i}", flops=i * 10**15, price=1_000_000))
        ledger.record_unpaid(worker_signed(me, OTHER, "job-unpaid"))
    return tmp_path / "node", me


def run(*args: str, data_dir=None):
    extra = ["--data-dir", str(data_dir)] if data_dir is not None else []
    return runner.invoke(app, [*args, *extra])


def test_balance(node):
    data_dir, me = node
    result = run("balance", "--json", data_dir=data_dir)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    mine = next(b for b in doc["balances"] if b["identity"] == me.peer_id)
    assert (doc["identity"], mine["earned"], mine["jobs_worked"]) == (me.peer_id, 6_000_000_000, 3)
    assert doc["unpaid"] == [{"client_id": OTHER.peer_id, "amount": 7_500_000, "jobs": 1}]
    table = run("balance", data_dir=data_dir)
    assert table.exit_code == 0 and "6.00" in table.stdout and "Not countersigned: 1 job(s)" in table.stdout


def test_show(node):
    data_dir, _ = node
    newest = json.loads(run("show", "--limit", "2", "--json", data_dir=data_dir).stdout)
    assert [e["job_id"] for e in newest["entries"]] == ["job-3", "job-2"] and newest["head"]["count"] == 3
    one = run("show", "--job", "job-2", "--json", data_dir=data_dir)
    assert json.loads(one.stdout)["amount"] == 2_000_000_000
    missing = run("show", "--job", "nope", data_dir=data_dir)
    assert missing.exit_code == 1 and "error: no receipt for job 'nope'" in missing.output
    assert "job-unpaid" in run("unpaid", data_dir=data_dir).stdout


def test_verify_passes_then_names_the_tampered_entry(node):
    data_dir, _ = node
    ok = run("verify", data_dir=data_dir)
    assert ok.exit_code == 0 and "OK" in ok.stdout and "3 entries" in ok.stdout
    db = sqlite3.connect(data_dir / "ledger.sqlite")
    db.execute("DROP TRIGGER entries_no_update")
    receipt = bytearray(db.execute("SELECT receipt FROM entries WHERE seq = 2").fetchone()[0])
    receipt[-1] ^= 0xFF
    db.execute("UPDATE entries SET receipt = ? WHERE seq = 2", (bytes(receipt),))
    db.commit()
    db.close()
    bad = run("verify", data_dir=data_dir)
    assert bad.exit_code == 1 and "entry 2:" in bad.output
    report = json.loads(run("verify", "--json", data_dir=data_dir).stdout)
    assert (report["ok"], report["entry"]) == (False, 2)


def test_export_csv_and_json_round_trip_through_merge(node, tmp_path):
    data_dir, me = node
    rows = list(csv.DictReader(io.StringIO(run("export", "--format", "csv", data_dir=data_dir).stdout)))
    assert [r["job_id"] for r in rows] == ["job-1", "job-2", "job-3"]
    assert [r["amount_credits"] for r in rows] == ["1.00", "2.00", "3.00"]
    Receipt.from_bytes(base64.b64decode(rows[0]["receipt"])).verify()  # every row carries its signed receipt
    out = tmp_path / "export.json"
    result = run("export", "-f", "json", "-o", str(out), data_dir=data_dir)
    assert result.exit_code == 0 and "wrote 3 receipts" in result.output
    merged = run("merge", str(out), "--json", data_dir=tmp_path / "client")
    assert merged.exit_code == 0 and json.loads(merged.stdout)["added"] == 3
    assert run("verify", data_dir=tmp_path / "client").exit_code == 0
    assert run("export", "-f", "xml", data_dir=data_dir).exit_code == 2
    to_stdout = run("export", "-f", "json", "-o", "-", data_dir=data_dir)  # "-" is stdout, not a file named "-"
    assert to_stdout.exit_code == 0 and json.loads(to_stdout.stdout)["head"]["count"] == 3
    nowhere = run("export", "-o", str(tmp_path / "no-such-dir" / "x.csv"), data_dir=data_dir)
    assert nowhere.exit_code == 2 and "cannot write" in nowhere.output and "Traceback" not in nowhere.output
    (tmp_path / "empty.json").write_bytes(b"")
    empty = run("merge", str(tmp_path / "empty.json"), data_dir=tmp_path / "client")
    assert empty.exit_code == 2 and "export it again" in empty.output and "-wal" not in empty.output


def test_merge_exit_codes(node, tmp_path):
    data_dir, me = node
    assert run("merge", str(data_dir / "ledger.sqlite"), data_dir=tmp_path / "a").exit_code == 0
    with open_ledger(tmp_path / "rival") as rival:
        rival.append(full_receipt(OTHER, CLIENT, "job-2"))  # a different receipt for a job we hold
    conflict = run("merge", str(tmp_path / "rival" / "ledger.sqlite"), data_dir=data_dir)
    assert conflict.exit_code == 1 and "CONFLICT job job-2" in conflict.output
    shown = json.loads(run("conflicts", "--json", data_dir=data_dir).stdout)
    assert [(c["job_id"], c["held"]["worker_id"], c["other"]["worker_id"]) for c in shown] == [
        ("job-2", me.peer_id, OTHER.peer_id)
    ]
    assert f"worker_id: held {me.peer_id} / other {OTHER.peer_id}" in run("conflicts", data_dir=data_dir).output
    missing = run("merge", str(tmp_path / "nothing-here"), data_dir=data_dir)
    assert missing.exit_code == 2 and "cannot read" in missing.output


def test_credit_two_free_identities_minted_for_each_other_is_shown_apart_unless_a_party_is_trusted(tmp_path):
    """Self-dealing: Mallory's worker and Mallory's client sign receipts for work that never ran; they merge cleanly
    (both signatures are real). This node never dealt with either: their credit is shown apart and counted nowhere,
    until the node trusts one of them (for good with `ledger trust add`, or for one command with --trust FILE)."""
    worker, honest_client, mallory_w, mallory_c = (Identity.generate() for _ in range(4))
    with open_ledger(tmp_path / "mallory") as theirs:
        for i in range(3):
            theirs.append(full_receipt(mallory_w, mallory_c, f"fake-{i}", flops=10**15, price=10**9, max_price=None))  # 1,000 credits
    with open_ledger(tmp_path / "node") as mine:
        mine.append(full_receipt(worker, honest_client, "real", flops=10**12, price=10**9, max_price=None))  # 1 credit
    merged = run("merge", str(tmp_path / "mallory" / "ledger.sqlite"), data_dir=tmp_path / "node")
    assert merged.exit_code == 0 and "3 added" in merged.stdout
    plain = json.loads(run("balance", "--json", data_dir=tmp_path / "node").stdout)
    rows = {b["identity"]: b for b in plain["balances"]}
    assert (rows[mallory_w.peer_id]["earned"], rows[mallory_w.peer_id]["earned_unvouched"]) == (0, 3000 * 10**9)
    assert (rows[mallory_c.peer_id]["spent"], rows[mallory_c.peer_id]["spent_unvouched"]) == (0, 3000 * 10**9)
    assert rows[mallory_w.peer_id]["earned_untrusted"] == 3000 * 10**9  # the figure's name before, kept
    assert (rows[worker.peer_id]["earned"], plain["earned_unvouched"]) == (10**9, 3000 * 10**9)
    table = run("balances", data_dir=tmp_path / "node").stdout  # the plural works too
    counted, apart = table.split("Merged, not vouched for")
    assert mallory_w.peer_id not in counted and mallory_w.peer_id in apart and "3000.00" in apart

    (tmp_path / "trusted.txt").write_text(f"# for this command only\n{mallory_c.peer_id}\n")
    once = json.loads(run("balance", "--trust", str(tmp_path / "trusted.txt"), "--json", data_dir=tmp_path / "node").stdout)
    rows = {b["identity"]: b for b in once["balances"]}
    assert (rows[mallory_w.peer_id]["earned"], rows[mallory_w.peer_id]["earned_unvouched"]) == (3000 * 10**9, 0)
    assert rows[worker.peer_id]["earned"] == 10**9  # what this node filed itself counts whoever it trusts
    again = json.loads(run("balance", "--json", data_dir=tmp_path / "node").stdout)
    assert again["trusted"] == [] and again["earned_unvouched"] == 3000 * 10**9  # --trust was for that command

    added = run("trust", "add", mallory_w.peer_id, data_dir=tmp_path / "node")
    assert added.exit_code == 0 and "1 trusted peer(s)" in added.stdout
    assert json.loads(run("trust", "list", "--json", data_dir=tmp_path / "node").stdout) == [mallory_w.peer_id]
    kept = json.loads(run("balance", "--json", data_dir=tmp_path / "node").stdout)
    assert kept["trusted"] == [mallory_w.peer_id] and kept["earned_unvouched"] == 0
    assert run("trust", "remove", mallory_w.peer_id, data_dir=tmp_path / "node").exit_code == 0
    assert json.loads(run("balance", "--json", data_dir=tmp_path / "node").stdout)["earned_unvouched"] == 3000 * 10**9


def test_a_trust_list_is_checked_and_a_bad_one_loses_nothing(tmp_path):
    node = tmp_path / "node"
    Identity.load_or_create(node)
    peer = Identity.generate().peer_id
    assert run("trust", "add", peer, data_dir=node).exit_code == 0
    bad = run("trust", "add", "12D3KooWnot-a-key", data_dir=node)
    assert bad.exit_code == 2 and "is not a peer id" in bad.output and "Traceback" not in bad.output
    assert json.loads(run("trust", "list", "--json", data_dir=node).stdout) == [peer]  # the list as it was
    (tmp_path / "bad.txt").write_text(f"{peer}\nnot-a-peer-id\n")
    with open_ledger(node):
        pass
    refused = run("balance", "--trust", str(tmp_path / "bad.txt"), data_dir=node)
    assert refused.exit_code == 2 and "bad.txt, line 2" in refused.output
    (node / "trusted-peers").write_text("garbage\n")  # edited by hand, wrongly: said, never taken as empty
    broken = run("balance", data_dir=node)
    assert broken.exit_code == 2 and "trusted-peers, line 1" in broken.output
    assert run("trust", "list", data_dir=tmp_path / "nowhere").exit_code == 2


def test_a_merged_receipt_with_markup_for_a_job_id_and_a_time_no_calendar_holds_is_shown_as_it_is(tmp_path):
    """From an attacker's review: two free identities sign such a receipt; once merged (entries are append-only) it
    made `gpunet ledger show` fail for good (a MarkupError, 'year 586524 is out of range')."""
    worker = Identity.generate()
    with open_ledger(tmp_path / "node") as ledger:
        ledger.append(full_receipt(worker, CLIENT, "[/]", ended_at_us=2**63 - 1))
        ledger.append(full_receipt(worker, CLIENT, "[link=http://evil.example]pay[/link]"))
    for args in (["show"], ["show", "--job", "[/]"], ["balance"]):
        result = run(*args, data_dir=tmp_path / "node")
        assert result.exit_code == 0, (args, result.output)
    shown = run("show", data_dir=tmp_path / "node").output
    assert "[/]" in shown and "9223372036854775807 µs" in shown and "[link=http://evil.example]pay[/link]" in shown
