"""Bootstrap robustness: several initial peers, workers that wait for a bootstrap node that is down, and a restarted
bootstrap node that never splits the network in two. Real processes and daemons on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

from gpunet.testing import free_port
from tests.swarm import Swarm, run_cli, wait_for


def _online_via(swarm: Swarm, peer: str) -> set[str]:
    """Ids of the online workers ``gpunet status`` finds when it joins through ``peer`` only."""
    result = run_cli("status", "--network", swarm.network, "--initial-peers", peer, "--json")
    if result.returncode != 0:
        return set()
    return {w["id"] for w in json.loads(result.stdout)["workers"] if w["state"] == "online"}


@pytest.mark.swarm
def test_restarted_bootstrap_never_splits_the_network(tmp_path):
    """Two bootstrap nodes. While the first is down, a worker given both joins through the second, and one given only
    the first keeps trying, says so, and joins once the first is back (same identity and port). Afterwards everyone is
    seen from either entry point: the restart did not split the network."""
    with Swarm(tmp_path, network="boot-test", heartbeat=1.0) as swarm:
        port = free_port()
        first = swarm.start_bootstrap(host_maddrs=f"/ip4/127.0.0.1/tcp/{port}")
        first_proc = swarm.bootstrap
        second = swarm.start_bootstrap("--initial-peers", first)
        both = [first, second]
        early = swarm.start_worker(initial_peers=both)

        assert first_proc.terminate(timeout=30) == 0
        through_second = swarm.start_worker(initial_peers=both)  # one initial peer down is no problem
        waiting = swarm.start_worker(initial_peers=[first], wait_online=False)
        waiting.wait_for_line(r"None of the initial peers answered .* trying again in \d+ s \(try 2\)", timeout=60)
        assert waiting.read_ready() is None and waiting.popen.poll() is None  # still trying, not gone

        restarted = swarm.start_bootstrap(host_maddrs=f"/ip4/127.0.0.1/tcp/{port}", data_dir=first_proc.data_dir)
        assert restarted == first  # same identity, same port: the address everyone was given still works
        swarm.wait_online(waiting)  # within its backoff (at most 30 s) of the restart
        ids = {swarm.worker_id(p) for p in (early, through_second, waiting)}
        for peer in both:
            wait_for(lambda: _online_via(swarm, peer) == ids, 60, f"all three workers seen through {peer}")


@pytest.mark.swarm
def test_worker_stops_cleanly_while_waiting_for_initial_peers(tmp_path):
    """SIGTERM while no initial peer answers: the worker leaves at once, exit code 0, its daemon gone with it."""
    with Swarm(tmp_path, network="boot-test", heartbeat=1.0) as swarm:
        boot = swarm.start_bootstrap()
        assert swarm.bootstrap.terminate(timeout=30) == 0
        worker = swarm.start_worker(initial_peers=[boot], wait_online=False)
        worker.wait_for_line(r"None of the initial peers answered", timeout=60)
        assert worker.terminate(timeout=15) == 0
        wait_for(lambda: not worker.group_alive(), 10, "the worker's daemon to be gone too")


@pytest.mark.swarm
def test_a_worker_whose_only_bootstrap_restarts_joins_again(tmp_path):
    """hivemind forgets a peer that stops answering and meets peers only by talking to them: a running worker whose
    one initial peer went down and came back used to stay alone for good, online by its own account and seen by
    nobody. It now notices it has no peer left and joins again through its initial peer."""
    with Swarm(tmp_path, network="boot-test", heartbeat=1.0) as swarm:
        port = free_port()
        boot = swarm.start_bootstrap(host_maddrs=f"/ip4/127.0.0.1/tcp/{port}")
        first_proc = swarm.bootstrap
        alone = swarm.start_worker()
        assert first_proc.terminate(timeout=30) == 0
        alone.wait_for_line(r"no DHT peer left", timeout=60)  # its heartbeats found nobody to store with

        assert swarm.start_bootstrap(host_maddrs=f"/ip4/127.0.0.1/tcp/{port}", data_dir=first_proc.data_dir) == boot
        later = swarm.start_worker()
        alone.wait_for_line(r"Joined the network again", timeout=60)
        ids = {swarm.worker_id(alone), swarm.worker_id(later)}
        wait_for(lambda: _online_via(swarm, boot) == ids, 60, "both workers seen through the restarted bootstrap")
