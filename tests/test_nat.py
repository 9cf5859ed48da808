"""A real NAT built from network namespaces (gpunet.testing.netns): what a home worker behind a router meets.

These tests need root, iproute2 and nftables (``.ci/run`` installs them; CI runs as root). Where namespaces cannot
be made they skip, saying why. Every namespace and process made here is removed at the end, also on failure.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpunet.testing import LocalNetwork, wait_for
from gpunet.testing.netns import LabUnavailable, NatLab
from tests.swarm import gpunet_cmd


@pytest.fixture
def lab():
    why = NatLab.available()
    if why:
        pytest.skip(f"NAT tests need network namespaces: {why}")
    try:
        with NatLab() as made:
            yield made
    except LabUnavailable as e:
        pytest.skip(f"NAT tests need network namespaces, and this kernel refused: {e}")


def _listen(lab: NatLab, ns: str, port: int) -> subprocess.Popen:
    code = ("import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('0.0.0.0',{port}));s.listen();print('up',flush=True);time.sleep(60)")
    proc = subprocess.Popen(lab.exec_argv(ns, [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_the_lab_is_a_real_nat_nothing_gets_into_a_home_from_outside(lab):
    home, other = lab.homes
    listeners = [_listen(lab, lab.public, 9000), _listen(lab, home.ns, 9001)]
    try:
        assert lab.can_connect(home.ns, lab.public_addr, 9000)  # out through the router: fine
        assert not lab.can_connect(lab.public, home.addr, 9001)  # in, to the private address: no route
        assert not lab.can_connect(lab.public, home.router_public, 9001)  # in, to the router: dropped
        assert not lab.can_connect(other.ns, home.addr, 9001)  # from the neighbour's home: no
    finally:
        for proc in listeners:
            proc.kill()
            proc.wait()


@pytest.mark.swarm
def test_a_home_worker_joins_and_is_listed_from_the_public_side(lab, tmp_path):
    """Its outgoing connection to the bootstrap carries its record into the DHT, so it is listed online; the addresses
    it announces are its private ones, which nobody outside can dial (what issue 13's relays are for)."""
    with LocalNetwork(tmp_path, network="nat-test", heartbeat=1.0) as net:
        boot = net.start_bootstrap(ns=lab.public, host_maddrs=f"/ip4/{lab.public_addr}/tcp/0")
        worker = net.start_worker(ns=lab.homes[0].ns, host_maddrs="/ip4/0.0.0.0/tcp/0")

        def listed():
            result = subprocess.run(lab.exec_argv(lab.public, gpunet_cmd(
                "status", "--network", "nat-test", "--initial-peers", boot, "--json")),
                capture_output=True, text=True, timeout=90)
            workers = json.loads(result.stdout)["workers"] if result.returncode == 0 else []
            return next((w for w in workers if w["id"] == worker.id and w["state"] == "online"), None)

        record = wait_for(listed, 60, "the home worker to be listed from the public namespace")
        assert all(lab.homes[0].addr in m or "/127.0.0.1/" in m for m in record["maddrs"])
