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
    mine = [f"/ip4/10.0.0.1/tcp/1/p2p/{A}"]  # an initial peer on this node's LAN
    assert _relay_ok(f"/ip4/10.0.0.1/tcp/1/p2p/{A}/p2p-circuit/p2p/{B}", mine)
    assert _relay_ok(f"/ip4/25.0.0.1/tcp/1/p2p/{C}/p2p-circuit/p2p/{B}", mine)
    assert not _relay_ok(f"/ip4/10.0.0.7/tcp/22/p2p/{A}/p2p-circuit/p2p/{B}", mine)  # our relay's id, another address
    assert not _relay_ok(f"/ip4/10.0.0.1/tcp/1/p2p/{C}/p2p-circuit/p2p/{B}", mine)  # someone's LAN
    assert not _relay_ok(f"/ip4/127.0.0.1/tcp/22/p2p/{C}/p2p-circuit/p2p/{B}", mine)
    assert not _relay_ok("/ip4/25.0.0.1/tcp/1", mine)  # not relayed at all


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


class _Daemon:
    """What the keeper asks of the p2p daemon (gpunet.rpc's connections, dial, disconnect), recorded: the policy is
    tested here; the real daemon's part in tests/test_nat.py."""

    def __init__(self, conns, reachable):
        self.conns, self.reachable, self.dialled, self.closed = list(conns), set(reachable), [], []

    def install(self, monkeypatch):
        from gpunet.dht import observers

        async def connections(p2p):
            return list(self.conns)

        async def dial(p2p, peer_id, maddrs):
            self.dialled.append(str(maddrs[0]))
            if str(maddrs[0]) not in self.reachable:
                raise ConnectionError("no answer")
            self.conns.append((peer_id.to_base58(), str(maddrs[0])))

        async def disconnect(p2p, peer_id):
            self.closed.append(peer_id.to_base58())
            self.conns = [(p, a) for p, a in self.conns if p != peer_id.to_base58()]

        for name, fn in (("connections", connections), ("dial", dial), ("disconnect", disconnect)):
            monkeypatch.setattr(observers, name, fn)


def _ids(n):
    import os

    from gpunet.identity import peer_id_from_public_bytes

    return [peer_id_from_public_bytes(os.urandom(32)) for _ in range(n)]


def test_the_keeper_dials_public_peers_leaves_failed_ones_alone_and_punches_one_worker_a_few_times(monkeypatch):
    from gpunet.dht import observers
    from gpunet.dht.observers import ObserverKeeper

    me, w1, w2, *pub = _ids(10)
    trusted = [f"/ip4/25.0.0.{i + 1}/tcp/4000/p2p/{pub[i]}" for i in range(2)]
    published = [f"/ip4/25.0.1.{i}/tcp/4000/p2p/{pub[i]}" for i in range(2, 6)] + [
        f"/ip4/192.168.1.1/tcp/22/p2p/{pub[6]}"]  # a record naming someone's LAN: never dialled
    relay = trusted[0]
    daemon = _Daemon([(w1, f"{relay}/p2p-circuit"), (w2, f"{relay}/p2p-circuit")],
                     reachable=[t.rpartition("/p2p/")[0] for t in trusted]
                     + [p.rpartition("/p2p/")[0] for p in published[:3]] + [f"{relay}/p2p-circuit"])
    daemon.install(monkeypatch)
    now = [0.0]
    keeper = ObserverKeeper(p2p=None, own_id=me, clock=lambda: now[0])
    keeper.natted = {w1: [f"{relay}/p2p-circuit/p2p/{w1}"],
                     w2: [f"/ip4/10.9.9.9/tcp/1/p2p/{pub[0]}/p2p-circuit/p2p/{w2}"]}

    async def look():
        return await keeper.keep(trusted, published)

    assert asyncio.run(look()) == 5  # 2 trusted + 3 of the 4 public published ones answered
    assert not any("192.168." in d for d in daemon.dialled)
    # Enough observers: the relayed connection to w1 is closed and dialled again through its (trusted) relay; w2's
    # record names a relay at a LAN address under a trusted id: not dialled.
    assert daemon.closed == [w1] and daemon.dialled[-1] == f"{relay}/p2p-circuit"
    dialled = len(daemon.dialled)
    asyncio.run(look())  # the one that failed is left alone; w1 not again so soon
    assert len(daemon.dialled) == dialled and daemon.closed == [w1]
    now[0] = observers.DIAL_BACKOFF + observers.PUNCH_AGAIN
    daemon.conns.append((w1, f"{relay}/p2p-circuit"))  # still relayed (say its NAT is symmetric)
    asyncio.run(look())
    assert daemon.closed == [w1, w1]
    now[0] += 2 * observers.PUNCH_AGAIN
    asyncio.run(look())
    assert daemon.closed == [w1, w1]  # PUNCH_TRIES reached: it stays relayed


def test_an_initial_peer_that_timed_out_once_is_dialled_again_soon_then_less_often(monkeypatch):
    """One dial that times out on a loaded machine must not keep an initial peer away for minutes (a worker then
    never reached the 4 observers hole punching needs): it is tried again after DIAL_RETRY, then twice as long after
    each further failure, up to DIAL_BACKOFF; once it answers, its count starts over."""
    from gpunet.dht import observers
    from gpunet.dht.observers import ObserverKeeper

    me, boot = _ids(2)
    trusted = [f"/ip4/25.0.0.1/tcp/4000/p2p/{boot}"]
    daemon = _Daemon([], reachable=[])
    daemon.install(monkeypatch)
    now = [0.0]
    keeper = ObserverKeeper(p2p=None, own_id=me, clock=lambda: now[0])
    tried_at = []

    async def looks():  # one a second
        for t in range(2000):
            now[0] = float(t)
            dialled = len(daemon.dialled)
            await keeper.keep(trusted)
            if len(daemon.dialled) > dialled:
                tried_at.append(t)

    asyncio.run(looks())
    gaps = [b - a for a, b in zip(tried_at, tried_at[1:])]
    assert gaps[:7] == [min(observers.DIAL_BACKOFF, observers.DIAL_RETRY * 2 ** i) for i in range(7)]
    assert gaps[:6] == [10, 20, 40, 80, 160, 300]
    daemon.reachable.add(trusted[0].rpartition("/p2p/")[0])
    now[0] = tried_at[-1] + observers.DIAL_BACKOFF
    assert asyncio.run(keeper.keep(trusted)) == 1
    daemon.conns.clear()  # it left; it answers again: tried at the next look
    now[0] += 1
    assert asyncio.run(keeper.keep(trusted)) == 1
    daemon.conns.clear()
    daemon.reachable.clear()
    keeper._failed.put(boot, (0.0, 5000))  # days of failures in a row: the wait stays bounded (no overflow)
    asyncio.run(keeper.keep(trusted))
    assert keeper._failed.get(boot)[0] == now[0] + observers.DIAL_BACKOFF
