"""A worker behind NAT joining through relays: the policy around the p2p daemon (a stand-in worker here; the real
daemons, routers and relays are in tests/test_nat.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gpunet.dht import reachability
from gpunet.worker.announcer import Announcer

RELAYED = "/ip4/25.0.0.1/tcp/4000/p2p/12D3KooWRelay/p2p-circuit/p2p/12D3KooWMe"


class _Worker:
    """What join_through_relays asks of a worker: its daemon stopped and started again (a new one each time)."""

    def __init__(self, reserves_on: int | None):
        self.reserves_on = reserves_on  # the daemon (1, 2, ...) whose auto-relay gets a reservation; None: none does
        self.started, self.stopped = 0, 0
        self.dht = None
        self._stop = asyncio.Event()

    async def _stop_dht(self):
        self.stopped += 1
        self.dht = None

    async def _join(self, mode):
        assert mode == "private"
        self.started += 1
        return SimpleNamespace(n=self.started)


def _join(monkeypatch, worker: _Worker, on_look=lambda: None) -> Announcer:
    from gpunet.dht import network

    def visible_maddrs(dht, latest=False):
        on_look()
        return [RELAYED] if dht.n == worker.reserves_on else ["/ip4/192.168.1.5/tcp/4000"]

    monkeypatch.setattr(reachability, "RELAY_WAIT", 0.3)
    monkeypatch.setattr(network, "visible_maddrs", visible_maddrs)
    announcer = Announcer(worker)

    async def no_observers():
        pass

    announcer.keep_observers = no_observers
    asyncio.run(announcer.join_through_relays())
    return announcer


def test_a_worker_whose_first_daemon_gets_no_relay_reservation_asks_again_from_a_fresh_one(monkeypatch):
    """libp2p's auto-relay leaves a relay alone for a long while after one failed attempt (a timeout on a loaded
    machine): a second daemon asks at once, and the worker is listed relayed."""
    worker = _Worker(reserves_on=2)
    announcer = _join(monkeypatch, worker)
    assert worker.started == 2 and announcer.reachability == reachability.RELAYED and announcer.maddrs == [RELAYED]


def test_a_worker_no_relay_takes_after_every_try_is_listed_unreachable(monkeypatch):
    worker = _Worker(reserves_on=None)
    announcer = _join(monkeypatch, worker)
    assert worker.started == reachability.RELAY_TRIES and announcer.reachability == reachability.UNREACHABLE


def test_a_worker_stopped_while_waiting_for_a_relay_starts_no_other_daemon(monkeypatch):
    worker = _Worker(reserves_on=None)
    _join(monkeypatch, worker, on_look=worker._stop.set)  # Ctrl-C while the first daemon waits
    assert worker.started == 1
