"""Self-dealt credit (issue 38, item 3), attacked as a user would: two free identities sign each other receipts for
work that never ran (valid signatures, 40.5 M credits), export them and `gpunet ledger merge` them into a real
worker's ledger and into the fake worker's own. Nothing counts them as earned or spendable -- `gpunet ledger
balance`, `gpunet earnings`, the worker's dashboard, its record and the explorer -- and the ledger's readers show
them apart; once a peer is trusted (`gpunet ledger trust add`) its receipts count."""

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import torch

import gpunet
from gpunet.ledger import Identity, open_ledger
from tests._ledger_util import full_receipt
from tests.swarm import free_port, gpunet_cmd, run_cli, wait_for

pytestmark = pytest.mark.swarm

MINTED_JOBS = 3
MINTED_NANO = MINTED_JOBS * 13_500_000 * 10**9  # 40.5 M credits, as the attacker's review minted
FAKE_TFLOP = 13_500_000  # each receipt: 13.5 M TFLOP at 1 credit/TFLOP, work that never ran


def mint(tmp_path, fake_worker: Identity, fake_client: Identity):
    """The attacker's tooling: receipts signed by both fake parties, in a scratch ledger, exported as JSON."""
    now_us = int(time.time() * 1e6)
    with open_ledger(tmp_path / "mint") as scratch:
        for i in range(MINTED_JOBS):
            scratch.append(full_receipt(fake_worker, fake_client, f"minted-{i}", flops=FAKE_TFLOP * 10**12,
                                        price=10**9, max_price=None, ended_at_us=now_us - 1000 * i))
    out = tmp_path / "minted.json"
    exported = run_cli("ledger", "export", "--format", "json", "-o", str(out), "--data-dir", str(tmp_path / "mint"))
    assert exported.returncode == 0, exported.stderr
    return out


def ledger_cli(*args: str) -> dict | list:
    done = run_cli(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def dashboard_earnings(proc) -> dict:
    path = proc.data_dir / "dashboard.url"
    wait_for(path.exists, 60, "the worker to write its dashboard's address")
    base, token = path.read_text().strip().split("/#token=")
    request = urllib.request.Request(f"{base}/api/earnings?days=3", headers={"X-Gpunet-Token": token})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def explorer_worker(port: int, worker_id: str, ready) -> dict:
    """The explorer's entry for a worker, once ``ready(entry)`` holds (it reads the DHT every second)."""
    def read():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/network", timeout=30) as response:
            doc = json.loads(response.read())
        entry = next((w for w in doc["workers"] if w["id"] == worker_id), None)
        return entry if entry is not None and ready(entry) else None
    return wait_for(read, 90, f"the explorer to show worker {worker_id}")


def test_credit_two_free_identities_minted_is_never_earned_or_spendable_anywhere(swarm, tmp_path):
    fake_worker = Identity.load_or_create(tmp_path / "fake-worker")  # the attacker runs a worker with this key
    fake_client = Identity.generate()
    minted = mint(tmp_path, fake_worker, fake_client)

    real = swarm.start_worker("--dashboard-port", str(free_port()))
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=tmp_path / "client") as client:
        wait_for(lambda: client.workers(refresh=True), 60, "the client to see the worker")
        x = torch.randn(4, 8)
        job = gpunet.Job.from_module(torch.nn.Linear(8, 2), (x,))
        client.submit(job, x).result(timeout=120)  # one real, paid job on the real worker
        client.ledger  # reading it files the receipt and sends the countersignature
    real_dir = real.data_dir
    wait_for(lambda: ledger_cli("earnings", "--data-dir", str(real_dir))["total"]["jobs"] == 1, 60,
             "the real worker to file its countersigned receipt")

    # The attack: the minted export merged, as a user types it, into the real worker and into the fake worker.
    for where in (real_dir, tmp_path / "fake-worker"):
        merged = run_cli("ledger", "merge", str(minted), "--data-dir", str(where))
        assert merged.returncode == 0 and f"{MINTED_JOBS} added" in merged.stdout, merged.stdout + merged.stderr
    fake = swarm.start_worker("--dashboard-port", str(free_port()), data_dir=tmp_path / "fake-worker")

    # `gpunet ledger balance` on the real worker: the fake pair is shown apart, with nothing earned or spent.
    sheet = ledger_cli("ledger", "balance", "--data-dir", str(real_dir))
    rows = {b["identity"]: b for b in sheet["balances"]}
    assert (rows[fake_worker.peer_id]["earned"], rows[fake_worker.peer_id]["net"]) == (0, 0)
    assert rows[fake_worker.peer_id]["earned_unvouched"] == MINTED_NANO
    assert (rows[fake_client.peer_id]["spent"], rows[fake_client.peer_id]["spent_unvouched"]) == (0, MINTED_NANO)
    assert rows[real.id]["earned"] > 0 and sheet["earned_unvouched"] == MINTED_NANO  # its own job still counts
    table = run_cli("ledger", "balance", "--data-dir", str(real_dir)).stdout
    counted, apart = table.split("Merged, not vouched for")
    assert fake_worker.peer_id not in counted and fake_worker.peer_id in apart and "40500000.00" in apart

    # The fake worker's own `gpunet earnings` and dashboard: 0 earned, 40.5 M apart; its record and the explorer: 0.
    mine = ledger_cli("earnings", "--data-dir", str(fake.data_dir))
    assert (mine["total"]["nano"], mine["rows"], mine["unvouched"]["nano"]) == (0, [], MINTED_NANO)
    board = dashboard_earnings(fake)
    assert board["total"]["nano"] == 0 and sum(d["nano"] for d in board["days"]) == 0
    assert board["unvouched"]["nano"] == MINTED_NANO
    assert dashboard_earnings(real)["total"]["nano"] > 0
    port = free_port()
    explorer = subprocess.Popen(
        gpunet_cmd("status", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr, "--serve", str(port),
                   "--interval", "1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        assert "Network explorer: http://127.0.0.1:" in explorer.stdout.readline()  # it answers from now on
        shown = explorer_worker(port, fake.id, lambda w: w["ledger"]["count"] == MINTED_JOBS)  # its ledger, merged
        assert shown["ledger"]["credits_earned"] == 0
        assert explorer_worker(port, real.id, lambda w: True)["ledger"]["credits_earned"] > 0

        # A trust decision counts them: the fake worker's owner (or the real one) trusts the other party.
        added = run_cli("ledger", "trust", "add", fake_client.peer_id, "--data-dir", str(fake.data_dir))
        assert added.returncode == 0, added.stderr
        trusted = explorer_worker(port, fake.id, lambda w: w["ledger"]["credits_earned"] > 0)  # its next heartbeat
        assert trusted["ledger"]["credits_earned"] == MINTED_NANO / 1e9
        assert dashboard_earnings(fake)["total"]["nano"] == MINTED_NANO
        assert ledger_cli("earnings", "--data-dir", str(fake.data_dir))["total"]["nano"] == MINTED_NANO
    finally:
        with contextlib.suppress(ProcessLookupError):  # its DHT process and p2p daemon too
            os.killpg(explorer.pid, signal.SIGTERM)
        try:
            explorer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(explorer.pid, signal.SIGKILL)
            explorer.wait(timeout=30)
    assert run_cli("ledger", "trust", "add", fake_worker.peer_id, "--data-dir", str(real_dir)).returncode == 0
    rows = {b["identity"]: b for b in ledger_cli("ledger", "balances", "--data-dir", str(real_dir))["balances"]}
    assert (rows[fake_worker.peer_id]["earned"], rows[fake_worker.peer_id]["earned_unvouched"]) == (MINTED_NANO, 0)
