"""Which public peers a node behind NAT keeps as observers, and how it tells each connection's path
(gpunet.dht.observers). The hole punch itself is proven in a real NAT lab: tests/test_nat.py."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from gpunet.dht.observers import _relay_ok, candidates, paths
from gpunet.rpc import connections

A = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
B = "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"
C = "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC"


def test_observers_are_one_per_address_and_never_a_relay_loopback_or_a_bad_address():
    found = candidates([
        f"/ip4/25.0.0.1/tcp/31337/p2p/{A}",
        f"/ip4/25.0.0.1/tcp/31338/p2p/{B}",  # a second node at the same address observes nothing new
        f"/ip4/25.0.0.9/tcp/1/p2p/{A}/p2p-circuit/p2p/{C}",  # a relay's observation would be the relay's
        f"/ip4/127.0.0.1/tcp/5/p2p/{C}",
        f"/ip4/0.0.0.0/tcp/5/p2p/{C}",
        "/ip4/25.0.0.3/tcp/5",  # no peer id: nothing to dial safely
        f"/ip4/not-an-ip/tcp/5/p2p/{C}",
        f"/ip4/25.0.0.2/udp/5/quic/p2p/{C}",
        f"/ip6/2001:db8::1/tcp/5/p2p/{C}",
    ])
    assert [(c.peer_id, c.maddr, c.ip) for c in found] == [
        (A, "/ip4/25.0.0.1/tcp/31337", "25.0.0.1"), (C, "/ip6/2001:db8::1/tcp/5", "2001:db8::1")]


def test_addresses_from_records_are_dialled_only_when_public():
    published = [f"/ip4/192.168.1.10/tcp/22/p2p/{A}", f"/ip4/10.0.0.1/tcp/80/p2p/{B}", f"/ip4/25.0.0.4/tcp/9/p2p/{C}"]
    assert [c.ip for c in candidates(published, public_only=True)] == ["25.0.0.4"]
    assert len(candidates(published)) == 3  # the node's own initial peers may be on its LAN


def test_a_peer_is_direct_if_any_of_its_connections_is():
    conns = [(A, f"/ip4/25.0.0.1/tcp/1/p2p/{C}/p2p-circuit"), (A, "/ip4/25.0.0.12/tcp/4000"),
             (B, f"/ip4/25.0.0.1/tcp/1/p2p/{C}/p2p-circuit"), (C, "/ip4/25.0.0.1/tcp/1")]
    assert paths(conns) == {A: "direct", B: "relayed", C: "direct"}
    assert paths(reversed(conns)) == {A: "direct", B: "relayed", C: "direct"}


def test_a_relayed_address_is_dialled_again_only_through_a_known_or_public_relay():
    assert _relay_ok(f"/ip4/10.0.0.1/tcp/1/p2p/{A}/p2p-circuit/p2p/{B}", relays={A})  # one of our initial peers
    assert _relay_ok(f"/ip4/25.0.0.1/tcp/1/p2p/{C}/p2p-circuit/p2p/{B}", relays={A})
    assert not _relay_ok(f"/ip4/10.0.0.1/tcp/1/p2p/{C}/p2p-circuit/p2p/{B}", relays={A})  # someone's LAN
    assert not _relay_ok(f"/ip4/127.0.0.1/tcp/22/p2p/{C}/p2p-circuit/p2p/{B}", relays={A})
    assert not _relay_ok("/ip4/25.0.0.1/tcp/1", relays={A})  # not relayed at all


def test_the_daemon_lists_a_direct_connection_with_the_address_it_uses():
    async def main():
        one = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        two = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await one.get_visible_maddrs())
        try:
            conns = await connections(two)
            port = str((await one.get_visible_maddrs())[0]).split("/")[4]
            assert (one.peer_id.to_base58(), f"/ip4/127.0.0.1/tcp/{port}") in conns
            assert paths(conns)[one.peer_id.to_base58()] == "direct"
        finally:
            await two.shutdown()
            await one.shutdown()

    asyncio.run(main())
