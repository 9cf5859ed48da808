"""``gpunet earnings``: a worker's own ledger summed by day or client, with every unpaid or unbilled job and why;
the figures match ``gpunet ledger export`` to the nano-credit."""

import csv
import io
import json
from datetime import datetime

import pytest

from gpunet.errors import ConfigError
from gpunet.ledger import Identity, open_ledger
from gpunet.ledger.earnings import earnings, parse_since
from gpunet.ledger.entries import Unbilled
from tests._ledger_util import T0_US, full_receipt, worker_signed
from tests.swarm import run_cli

DAY_US = 86_400 * 10**6
ME, OTHER, ALICE, BOB = (Identity.generate() for _ in range(4))


@pytest.fixture
def worker_dir(tmp_path):
    """A worker's data dir: its key, and a ledger of two days' work for two clients, some of it unpaid or unbilled."""
    ME.save(tmp_path / "identity.key")
    with open_ledger(tmp_path) as ledger:
        for i in range(3):
            ledger.append(full_receipt(ME, ALICE, f"a{i}", ended_at_us=T0_US + i))
        ledger.append(full_receipt(ME, BOB, "b0", ended_at_us=T0_US + DAY_US, lane="batch", price=1_000_000))
        ledger.append(full_receipt(OTHER, ALICE, "elsewhere", ended_at_us=T0_US))  # merged in: not this worker's
        ledger.append(full_receipt(ME, ALICE, "background-1", price=0, max_price=None, lane="background"))
        ledger.record_unpaid(worker_signed(ME, BOB, "b1", ended_at_us=T0_US + DAY_US))
        ledger.record_unbilled(Unbilled(ALICE.peer_id, "a9", "refused", "outvoted by 2 workers", 10**12))
        ledger.record_unbilled(Unbilled(BOB.peer_id, "b8", "refused", "[/x] [link=https://evil]paid[/link]"))
        ledger.record_unbilled(Unbilled(BOB.peer_id, "b2", "preempted", lane="batch"))
    return tmp_path


def test_earnings_group_paid_work_and_list_what_was_not_paid(worker_dir):
    with open_ledger(worker_dir) as ledger:
        by_day = earnings(ledger, ME.peer_id, now=T0_US / 1e6 + 2 * 86_400)
        by_client = earnings(ledger, ME.peer_id, by="client")
        recent = earnings(ledger, ME.peer_id, since=(T0_US + DAY_US) / 1e6 - 1)
    day1, day2 = (datetime.fromtimestamp(t / 1e6).strftime("%Y-%m-%d") for t in (T0_US, T0_US + DAY_US))
    assert {k: t.jobs for k, t in by_day.rows.items()} == {day1: 3, day2: 1}
    assert {k: t.jobs for k, t in by_client.rows.items()} == {ALICE.peer_id: 3, BOB.peer_id: 1}
    assert by_day.total.jobs == 4 and by_day.background_runs == 1 and set(by_day.lanes) == {"interactive", "batch"}
    assert by_day.total.nano == sum(t.nano for t in by_day.rows.values()) == by_client.total.nano
    assert [(o.job_id, o.reason) for o in by_day.unpaid] == [("b1", "never countersigned")]
    assert [(n.job_id, n.reason) for n in by_day.unbilled] == [("a9", "refused"), ("b8", "refused"),
                                                                ("b2", "preempted")]
    assert recent.total.jobs == 1 and recent.rows.keys() == {day2}
    doc = by_day.to_json()
    assert doc["total"]["jobs"] == 4 and doc["unbilled"][0]["detail"] == "outvoted by 2 workers"
    with pytest.raises(ConfigError):
        earnings(open_ledger(worker_dir), ME.peer_id, by="week")


def test_the_cli_matches_the_ledger_export(worker_dir):
    shown = run_cli("earnings", "--data-dir", str(worker_dir), "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    exported = run_cli("ledger", "export", "--format", "csv", "--data-dir", str(worker_dir))
    mine = [row for row in csv.DictReader(io.StringIO(exported.stdout))
            if row["worker_id"] == ME.peer_id and row["lane"] != "background"]
    assert doc["total"]["nano"] == sum(int(row["amount"]) for row in mine) and doc["total"]["jobs"] == len(mine)
    table = run_cli("earnings", "--data-dir", str(worker_dir), "--by", "client")
    assert table.returncode == 0 and "never countersigned" in table.stdout and "outvoted by 2 workers" in table.stdout
    assert "[/x] [link=https://evil]paid[/link]" in table.stdout  # a client's words as text, never as markup
    assert run_cli("earnings", "--data-dir", str(worker_dir), "--since", "yesterday-ish").returncode == 2
    assert run_cli("earnings", "--data-dir", str(worker_dir / "nowhere")).returncode == 2


def test_since_takes_dates_times_and_spans():
    now = 1_800_000_000.0
    assert parse_since("36h", now) == now - 36 * 3600 and parse_since("2w", now) == now - 14 * 86_400
    assert parse_since("2026-12-01") == datetime(2026, 12, 1).timestamp()
    assert parse_since(None) is None
    with pytest.raises(ConfigError, match="span back"):
        parse_since("last tuesday")
