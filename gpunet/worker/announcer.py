"""How a worker is seen: its record, published in the DHT every heartbeat (and at once on a change of state), the
tombstone it leaves, and where it can be reached (the dial-back check at start, relays behind NAT, relayed addresses
refreshed every beat). A worker that dies without a word simply stops refreshing its record, which expires after
three heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.utils import get_dht_time

from gpunet import readyfile
from gpunet._version import __version__
from gpunet.dht import network, observers, reachability, registry
from gpunet.dht.records import (
    MAX_ADVERTISED_MADDRS,
    MAX_CACHED_PROGRAMS,
    MAX_CHECKPOINTS,
    MAX_MADDR_CHARS,
    MAX_PAUSE_REASON,
    WorkerRecord,
    WorkerState,
    printable,
)
from gpunet.ledger.receipts import NANO
from gpunet.protocol import BATCH, INTERACTIVE
from gpunet.utils import bounded
from gpunet.worker import hardware as hw
from gpunet.worker import metrics

logger = logging.getLogger("gpunet.worker")

#: Seconds between repeats of the "could not publish" warning while it lasts.
UNPUBLISHED_REPEAT = 300.0
#: How often a worker behind NAT reads the records for direct workers (observers: gpunet.dht.observers) and NATed
#: ones (to punch to): every heartbeat at first, twice as long each time, up to this.
OBSERVER_LOOK = 60.0
#: Seconds each step of leaving may take. A terminal's Ctrl-C or ``systemctl stop`` signals the whole process group, so
#: the p2p daemon (and, on SIGTERM, the DHT process) may be dead already: nothing may wait on them without a bound.
LEAVE_STEP_TIMEOUT = 3.0


class Announcer:
    """The record of one worker (``worker``: the :class:`~gpunet.worker.server.Worker` it describes) and its
    publication."""

    def __init__(self, worker):
        self.worker = worker
        self.maddrs: list[str] = []
        self.reachability = reachability.UNKNOWN
        self.via_relays = False  # joined in relay-client mode (behind NAT): addresses refreshed every heartbeat
        self._last_expiration = 0.0
        self._unpublished = 0  # heartbeats in a row whose record no peer accepted
        self._unpublished_said = -UNPUBLISHED_REPEAT
        self._observers: observers.ObserverKeeper | None = None  # behind NAT: public peers kept for hole punching
        self._direct_workers: list[str] = []  # their addresses, from the records (read every OBSERVER_LOOK at most)
        self._keeping: asyncio.Future | None = None  # keep_observers, running in the background
        self._workers_read, self._look_every = -OBSERVER_LOOK, 0.0

    def record(self) -> WorkerRecord:
        w = self.worker
        admission, ledger = w.jobs.admission if w.jobs else None, w.ledger
        lanes = w.jobs.lanes if w.jobs else None
        head = ledger.head() if ledger is not None else None
        return WorkerRecord(
            version=__version__,
            state=w.state,
            device=w.hardware.info,
            tflops=w.tflops,
            price=float(w.config.price),
            max_concurrent=w.config.max_concurrent,
            client_places=admission.max_jobs_per_client if admission else None,
            queue=admission.queue_length if admission else 0,
            jobs_done=admission.jobs_done if admission else 0,
            started_at=w.started_at,
            updated_at=time.time(),
            programs=w.executor.cached_programs()[-MAX_CACHED_PROGRAMS:] if w.executor else [],
            checkpoints=w.jobs.weights.checkpoint_ids()[:MAX_CHECKPOINTS] if w.jobs else [],
            name=w.config.public_name,
            maddrs=[m for m in self.maddrs if len(m) <= MAX_MADDR_CHARS][:MAX_ADVERTISED_MADDRS],
            reachability=self.reachability,
            punched=len(self._observers.punched()) if self._observers is not None else 0,
            ledger_count=head.count if head else 0,
            ledger_head=head.head_hash if head else None,
            credits_earned=w.credit().earned / NANO if ledger is not None else 0.0,  # vouched (docs/ledger.md)
            peer_bytes_served=w.jobs.piece_server.served if w.jobs and w.jobs.piece_server else 0,
            peer_bytes_fetched=w.jobs.fetcher.fetched if w.jobs and w.jobs.fetcher else 0,
            batch_price=float(w.config.batch_price),
            batch_floor=lanes.floor / NANO if lanes else float(w.config.batch_price),
            interactive_load=round(lanes.load(INTERACTIVE), 3) if lanes else 0.0,
            preemptions_per_hour=round(lanes.preemption_rate(), 2) if lanes else 0.0,
            batch_queue=lanes.count(BATCH, running=False) if lanes else 0,
            pause_reason=printable(w.availability.reason, MAX_PAUSE_REASON) if w.state is WorkerState.PAUSED
            else None,
        )

    async def announce(self, state: WorkerState | None = None) -> bool:
        """Publish the current record; an explicit ``state`` change is published at once, not at the next beat."""
        w = self.worker
        if state is not None:
            w.state = state
        if w.jobs is not None:
            metrics.QUEUE.set(w.jobs.admission.queue_length)
            metrics.RUNNING.set(w.jobs.admission.running)
            metrics.show_lanes(w.jobs.lanes)
        if w.state is not WorkerState.OFFLINE:
            w.hardware = await asyncio.to_thread(hw.refresh, w.hardware, w._nvml)
        if self.via_relays and w.dht.is_alive() and not w._stop.is_set():
            await self._refresh_relayed_addresses()
        # A newer expiration is what makes the DHT replace our previous record (the tombstone included).
        expiration = max(get_dht_time() + registry.default_ttl(w.config.heartbeat), self._last_expiration + 1e-3)
        leaving = w.state in (WorkerState.DRAINING, WorkerState.OFFLINE)
        timeout = LEAVE_STEP_TIMEOUT if leaving else max(10.0, w.config.heartbeat)
        ok = w.dht.is_alive() and bool(await bounded(
            registry.announce_async(w.dht, w.config.network, w.id, self.record(), expiration), timeout))
        if ok:
            self._last_expiration = expiration
            if self._unpublished >= 2:  # (a warning was said)
                logger.info("This worker's record is published again (after %d failed heartbeat(s))", self._unpublished)
            self._unpublished = 0
        elif not leaving:
            # Said from the second miss in a row, then at most every few minutes: one missed store is common (a peer
            # busy or gone, the first store of a start before the DHT has met its peers) and the record lives three
            # heartbeats; a worker that stays unpublished is what the owner needs to hear about.
            self._unpublished += 1
            now = time.monotonic()
            if self._unpublished < 2:
                logger.debug("This worker's record was not stored this time; trying again at the next heartbeat")
            elif now - self._unpublished_said >= UNPUBLISHED_REPEAT:
                self._unpublished_said = now
                logger.warning("Could not publish this worker's record (no peer accepted it; %d heartbeat(s) in a row); "
                               "retrying every heartbeat", self._unpublished)
        if self.via_relays and not leaving and w.dht.is_alive() and not w._stop.is_set():
            self.observe()
        if state is not None:  # what deployment tools wait on, instead of reading our output
            readyfile.write_ready(w.data_dir, role="worker", id=w.id, addresses=self.maddrs,
                                  network=w.config.network, state=w.state.value)
        return ok

    async def _refresh_relayed_addresses(self) -> None:
        """Relay reservations come and go (a relay restarts, another takes over): announce the ones held now. With
        none, the record says ``unreachable`` and routing sends it nothing, rather than jobs into a black hole."""
        w = self.worker
        try:
            maddrs = await asyncio.wait_for(asyncio.to_thread(network.visible_maddrs, w.dht, True), 5.0)
        except Exception as e:  # the daemon busy or gone: keep the last known addresses for this beat
            logger.debug("Could not refresh this worker's addresses: %s", e)
            return
        found = reachability.RELAYED if any(reachability.is_relayed(m) for m in maddrs) else reachability.UNREACHABLE
        if found != self.reachability:
            (logger.info if found == reachability.RELAYED else logger.warning)(
                "Reachable through relays again: %s" if found == reachability.RELAYED else
                "No relay holds a reservation for this worker now (%s); listed as unreachable until one does",
                ", ".join(maddrs))
        self.reachability, self.maddrs = found, maddrs

    @property
    def observers(self) -> observers.ObserverKeeper | None:
        """Behind NAT: the public peers kept for hole punching, and which peers are reached which way."""
        return self._observers

    def observe(self) -> None:
        """Keep observers (see :meth:`keep_observers`) in the background, one look at a time: dials and a read of
        the records can take seconds, which the heartbeat (and the record's life) must not wait for."""
        if self._keeping is None or self._keeping.done():
            self._keeping = asyncio.ensure_future(self.keep_observers())

    def stop(self) -> None:
        if self._keeping is not None:
            self._keeping.cancel()

    async def keep_observers(self) -> None:
        """Behind NAT: stay connected to public peers of distinct addresses, so the p2p daemon learns this worker's
        public address and hole-punches to other NATed workers (gpunet.dht.observers): the initial peers first, then
        directly reachable workers from the records (read every heartbeat at first, then less often, up to every
        OBSERVER_LOOK; a read that fails keeps what the last one found)."""
        w = self.worker
        try:
            if self._observers is None:
                self._observers = observers.ObserverKeeper(await w.dht.replicate_p2p(), w.id)
            now = time.monotonic()
            if now - self._workers_read >= self._look_every:
                self._workers_read = now
                self._look_every = min(OBSERVER_LOOK, max(2 * self._look_every, w.config.heartbeat))
                entries = await bounded(registry.discover_async(w.dht, w.config.network), 10.0)
                if entries is not None:
                    others = [e for e in entries if e.id != w.id]
                    self._direct_workers = [f"{m}/p2p/{e.id}" if "/p2p/" not in m else m for e in others
                                            if e.record.reachability == reachability.DIRECT for m in e.record.maddrs]
                    self._observers.natted = {e.id: [m for m in e.record.maddrs if reachability.is_relayed(m)]
                                              for e in others if e.record.reachability == reachability.RELAYED}
            await bounded(self._observers.keep(w._initial_peers(), self._direct_workers), 30.0)
        except Exception as e:  # the daemon busy or going: the next beat tries again
            logger.debug("Could not keep observers: %s", e)

    async def unlist(self) -> None:
        """Leave a tombstone over our record, if one was published (best effort, within LEAVE_STEP_TIMEOUT: a Ctrl-C
        to the process group has stopped the p2p daemon too, and then the record expires by itself)."""
        w = self.worker
        if self._last_expiration and w.state is not WorkerState.OFFLINE:
            try:
                await self.announce(WorkerState.OFFLINE)
            except Exception as e:
                logger.debug("Could not leave a tombstone: %s", e)

    async def find_reachability(self) -> None:
        """Ask an initial peer to dial us back (gpunet.dht.reachability). Not dialable: rejoin through relays."""
        w = self.worker
        from gpunet.rpc import RPC

        cfg = w.config
        peers = w._initial_peers()
        if not peers:
            logger.info("Reachability unknown: this worker starts the network, so no peer can dial it back yet")
            return
        # Not closed after: hivemind keeps one replica per DHT, which the job doors use next.
        rpc = RPC(await w.dht.replicate_p2p(), cfg.network)
        found, result = await reachability.check(rpc, peers, cfg.announce_maddrs or self.maddrs)
        if found == reachability.DIRECT:
            self.reachability = found
            logger.info("Reachability: direct (a peer dialled this worker back at %s, port %s)",
                        result.observed or "its address", ", ".join(map(str, result.open)))
            return
        if found == reachability.UNKNOWN:
            logger.warning("Reachability unknown: no initial peer answered a dial-back check; announcing %s as it is",
                           ", ".join(self.maddrs) or "no address")
            return
        logger.info("Not directly reachable: a peer could not dial this worker back at %s (ports %s); joining through "
                    "relays instead", result.observed or "its address", ", ".join(map(str, reachability.tcp_ports(
                        cfg.announce_maddrs or self.maddrs))))
        if cfg.announce_maddrs:
            logger.warning("The announced address(es) %s cannot be dialled from outside: is the port forwarded to this "
                           "machine?", ", ".join(cfg.announce_maddrs))
        await self.join_through_relays()

    async def join_through_relays(self) -> None:
        """Restart the p2p daemon as a relay client and wait for a reservation, from a fresh daemon again if none
        comes (see RELAY_TRIES); none at all: listed unreachable, and each heartbeat looks again."""
        w = self.worker
        for attempt in range(1, reachability.RELAY_TRIES + 1):  # a fresh daemon each (see RELAY_TRIES)
            await w._stop_dht()
            w.dht = await w._join("private")
            if w.dht is None or w._stop.is_set():
                return
            self.via_relays = True
            deadline = time.monotonic() + reachability.RELAY_WAIT
            while time.monotonic() < deadline and not w._stop.is_set():
                try:
                    self.maddrs = await asyncio.to_thread(network.visible_maddrs, w.dht, True)
                except Exception:
                    if await w._stopped_meanwhile():  # Ctrl-C to the group: the daemon may have gone first
                        return
                    raise
                if any(reachability.is_relayed(m) for m in self.maddrs):
                    self.reachability = reachability.RELAYED
                    logger.info("Reachable through relays: %s", ", ".join(m for m in self.maddrs
                                                                           if reachability.is_relayed(m)))
                    await self.keep_observers()  # before others meet this worker: their first connection can punch
                    return
                await asyncio.sleep(0.5)
            if w._stop.is_set():
                return
            if attempt < reachability.RELAY_TRIES:
                logger.info("No relay reservation within %.0f s; asking again from a fresh p2p daemon",
                            reachability.RELAY_WAIT)
        self.reachability = reachability.UNREACHABLE
        logger.warning("No relay took a reservation for this worker (%d tries of %.0f s); listed as unreachable (no "
                       "jobs are routed to it) while it keeps trying. Its relays are its initial peers: give it a "
                       "bootstrap node (workers relay only with --relay-service)", reachability.RELAY_TRIES,
                       reachability.RELAY_WAIT)
