"""The network foundation, end to end: real processes, real libp2p daemons, driven through the CLI."""


import json
import os
import subprocess
from pathlib import Path

import pytest

from gpunet.testing.localnet import child_pids, gpunet_cmd, open_files
from tests.swarm import run_cli, wait_for

pytestmark = pytest.mark.swarm


def _online_ids(status: dict) -> set[str]:
    return {w["id"] for w in status["workers"] if w["state"] == "online"}


def test_status_lists_every_online_worker_with_its_device(swarm):
    workers = [swarm.start_worker("--public-name", f"w{i}", "--price", str(1.5 + i)) for i in range(3)]
    ids = {swarm.worker_id(w) for w in workers}
    status = swarm.wait_for_status(lambda s: _online_ids(s) == ids, "3 online workers")
    assert status["network"] == swarm.network
    assert len(status["workers"]) == 3
    by_name = {w["name"]: w for w in status["workers"]}
    assert set(by_name) == {"w0", "w1", "w2"}
    for i in range(3):
        w = by_name[f"w{i}"]
        assert w["price"] == 1.5 + i
        assert w["device"]["kind"] == "cpu" and w["device"]["memory_total"] > 0 and w["device"]["cores"] >= 1
        assert w["tflops"]["fp32"] > 0
        assert w["version"]
    assert status["totals"]["workers"] == 3 and status["totals"]["online"] == 3
    assert status["totals"]["tflops"] > 0

    table = run_cli("status", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr)
    assert table.returncode == 0, table.stderr
    assert "3 workers (3 online)" in table.stdout


def test_a_cli_calls_output_ends_when_it_exits_and_nodes_start_no_shared_memory_manager(swarm):
    """Nothing a node starts outlives it holding its standard streams: torch's shared-memory manager (started by
    hivemind's default strategy) kept ``gpunet status``'s stderr open for ~2 s after it exited, so ``gpunet status |
    jq``, and every script reading the output to its end, waited for it; a worker ran one beside it too."""
    worker = swarm.start_worker()
    assert not [pid for pid in child_pids(worker.pid) if Path(f"/proc/{pid}/comm").read_text().startswith("torch_shm")]
    command = gpunet_cmd("status", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr, "--json")
    status = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    pipes = {f"pipe:[{os.fstat(stream.fileno()).st_ino}]" for stream in (status.stdout, status.stderr)}
    status.wait(timeout=90)  # (its output is a few KiB: the pipes do not fill)

    holders = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
               if pid != os.getpid() and open_files(pid) & pipes]
    assert holders == []
    out, _ = status.communicate(timeout=5)
    assert status.returncode == 0 and json.loads(out)["totals"]["workers"] == 1


def test_sigkilled_worker_expires_and_sigterm_leaves_at_once(swarm):
    doomed, leaving, staying = swarm.start_workers(3)
    ids = {p: swarm.worker_id(p) for p in (doomed, leaving, staying)}
    swarm.wait_for_status(lambda s: _online_ids(s) == set(ids.values()), "all three online")

    # A clean stop: draining, then a tombstone; gone from the very next listing.
    assert leaving.terminate() == 0
    assert "Left the network" in leaving.output
    assert ids[leaving] not in {w["id"] for w in swarm.status()["workers"]}

    # A crash: the record stays until it expires (3 heartbeats of 1 s), then vanishes on its own.
    doomed.kill()
    listed = swarm.wait_for_status(lambda s: ids[doomed] not in {w["id"] for w in s["workers"]},
                                   "killed worker to expire", timeout=15)
    assert _online_ids(listed) == {ids[staying]}
    # The killed worker's DHT process and p2p daemon noticed and stopped on their own.
    wait_for(lambda: not doomed.group_alive(), 15, "orphaned DHT process of the killed worker to exit")


def test_networks_with_different_names_never_mix(swarm):
    """Two networks on one DHT (each entry point joined to the test network's): their records never mix. A worker
    joins through a node of its own network (one given only other networks' peers stops: test_first_contact)."""
    entries = {name: swarm.start_bootstrap("--initial-peers", swarm.bootstrap_addr, network=name)
               for name in ("alpha", "beta")}
    a = swarm.start_worker(network="alpha", initial_peers=[entries["alpha"]])
    b = swarm.start_worker(network="beta", initial_peers=[entries["beta"]])
    id_a, id_b = swarm.worker_id(a), swarm.worker_id(b)
    alpha = swarm.wait_for_status(lambda s: s["workers"], "alpha's worker", network="alpha")
    beta = swarm.wait_for_status(lambda s: s["workers"], "beta's worker", network="beta")
    assert [w["id"] for w in alpha["workers"]] == [id_a]
    assert [w["id"] for w in beta["workers"]] == [id_b]
    assert swarm.status()["workers"] == []  # the default test network has nobody


def test_restarted_worker_keeps_its_id(swarm, tmp_path):
    data_dir = tmp_path / "volunteer"
    first = swarm.start_worker(data_dir=data_dir)
    worker_id = swarm.worker_id(first)
    assert first.terminate() == 0
    second = swarm.start_worker(data_dir=data_dir)
    assert swarm.worker_id(second) == worker_id
    assert "Measuring this device's speed" not in second.output  # the benchmark was cached
    swarm.wait_for_status(lambda s: _online_ids(s) == {worker_id}, "restarted worker online under the same id")

    # `gpunet doctor` against the live network: it joins, and measures the clock offset by pinging the worker.
    doctor = run_cli("doctor", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr, "--json",
                     "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["network"]["outcome"] == "pass" and "1 worker(s) visible" in checks["network"]["detail"]
    assert checks["clock"]["outcome"] == "pass" and "clock offset to 1 worker(s)" in checks["clock"]["detail"]
    # ...and its reachability for real: the bootstrap node connected back to the port it listened on.
    assert checks["reachability"]["outcome"] == "pass", checks["reachability"]
    assert "directly reachable: a peer connected back to /ip4/127.0.0.1" in checks["reachability"]["detail"]


def test_status_fails_clearly_when_it_cannot_join(tmp_path):
    result = run_cli(
        "status", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWHHKkHSs5uRdrtHQN4Tv49RXqFtjreW5sExtt3bSfh3Zz",
        "--json", env={"GPUNET_DATA_DIR": str(tmp_path)},
    )
    assert result.returncode == 1  # a runtime failure (gpunet.cli.exits)
    assert "error: could not join" in result.stderr
    bad = run_cli("status", "--initial-peers", "not-an-address", env={"GPUNET_DATA_DIR": str(tmp_path)})
    assert bad.returncode == 2 and "not a multiaddr" in bad.stderr  # unusable input


@pytest.mark.parametrize("command", [[], ["worker"], ["bootstrap"], ["status"], ["doctor"], ["demo"], ["ledger"],
                                     ["ledger", "verify"], ["version"]])
def test_every_command_has_working_help(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout
