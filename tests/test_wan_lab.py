"""The WAN lab (gpunet.testing.wan): a profile's latency and loss really lie on the lab's paths, and its delayers
go with the lab. Needs root, iproute2, nftables and iptables (``.ci/run`` installs them); skips where namespaces
cannot be made, saying why. Bounds are lower bounds only: a loaded machine adds time, never removes it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpunet.testing.netns import LabUnavailable, LinkLab, NatLab
from gpunet.testing.wan import PROFILES, Profile


def _made(lab_type, **kwargs):
    why = lab_type.available(latency=True)
    if why:
        pytest.skip(f"the WAN lab needs network namespaces: {why}")
    try:
        return lab_type(**kwargs).__enter__()
    except LabUnavailable as e:
        pytest.skip(f"the WAN lab needs network namespaces, and this machine refused: {e}")


def test_a_profile_delays_each_home_to_home_transit_by_its_latency():
    lab = _made(LinkLab, hosts_count=2, profile=Profile("test", 25.0))
    try:
        assert lab.round_trip_ms(lab.hosts[0], lab.hosts[1], lab.addrs[1]) >= 2 * 25.0  # one transit each way
        delayers = list(lab._delayers)
        assert len(delayers) == 2 and all(p.poll() is None for p in delayers)
    finally:
        lab.close()
    assert all(p.poll() is not None for p in delayers)  # gone with the lab


def test_a_home_behind_nat_meets_the_profile_on_its_way_to_the_public_side_and_loss_is_real():
    lab = _made(NatLab, homes_count=1, profile=PROFILES["city"])
    try:
        home = lab.homes[0]
        # Home and public side: a round trip crosses the home's latency once (the public side stands for a server),
        # give or take its jitter (a median of 21 round trips).
        city = PROFILES["city"]
        assert lab.round_trip_ms(home.ns, lab.public, lab.public_addr) >= city.one_way_ms - 2 * city.jitter_ms
    finally:
        lab.close()
    for loss, gets_through in ((0.0, True), (100.0, False)):
        lab = _made(LinkLab, hosts_count=2, profile=Profile("lossy", 0.0, loss_pct=loss))
        listener = subprocess.Popen(lab.exec_argv(lab.hosts[1], [sys.executable, "-c", _LISTEN, lab.addrs[1]]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            port = int(listener.stdout.readline())
            assert lab.can_connect(lab.hosts[0], lab.addrs[1], port) is gets_through  # 100%: every packet lost
        finally:
            listener.kill()
            listener.wait()
            lab.close()


_LISTEN = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
time.sleep(120)
"""
