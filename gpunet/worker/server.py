"""A gpunet worker: joins the network, advertises its device, and leaves cleanly.

Lifecycle (what others see in the DHT): ``joining`` while it starts, ``online`` while it takes jobs, ``draining`` after
SIGTERM/Ctrl-C while running jobs finish, then an ``offline`` tombstone that makes readers drop it at once. A worker
that dies without a word simply stops refreshing its record, which expires after three heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from gpunet import readyfile
from gpunet._version import __version__
from gpunet.config import WorkerConfig, resolve_data_dir
from gpunet.dht import hello, network, reachability, registry
from gpunet.dht.records import (
    MAX_ADVERTISED_MADDRS,
    MAX_CACHED_PROGRAMS,
    MAX_MADDR_CHARS,
    MAX_PAUSE_REASON,
    WorkerRecord,
    WorkerState,
    printable,
)
from gpunet.errors import ConfigError, ExecutorStartFailed, NetworkError
from gpunet.identity import Identity
from gpunet.ledger.receipts import NANO, format_credits, price_to_nano
from gpunet.ledger.store import open_ledger
from gpunet.protocol import BATCH, INTERACTIVE
from gpunet.rpc import quiet_lost_daemon
from gpunet.utils import first_line, new_event_loop
from gpunet.worker import hardware as hw
from gpunet.worker import control, metrics, throughput
from gpunet.worker.availability import Availability, OwnerRules, Reading, parse_active_hours
from gpunet.worker.probe import FakeGpuProbe, SystemProbe

logger = logging.getLogger("gpunet.worker")

#: Seconds between looks at what the owner is doing (gpunet.worker.availability).
OWNER_EVERY = 1.0
#: Seconds between the worker's short earnings lines in its log.
EARNINGS_EVERY = 600.0
#: Seconds a draining worker waits for countersignatures of results it already delivered.
UNSETTLED_GRACE = 5.0
#: Seconds each step of leaving may take. A terminal's Ctrl-C or ``systemctl stop`` signals the whole process group, so
#: the p2p daemon (and, on SIGTERM, the DHT process) may be dead already: nothing may wait on them without a bound.
LEAVE_STEP_TIMEOUT = 3.0
#: Seconds a group Ctrl-C takes to settle: a part that failed while the worker starts waits this long for the signal
#: sent with its failure, and the same signal arriving again this soon is not a second Ctrl-C.
SIGNAL_SETTLE = 0.5
#: Seconds between repeats of the "could not publish" warning while it lasts.
UNPUBLISHED_REPEAT = 300.0


class Worker:
    """One worker process. ``run()`` blocks until the worker has left the network."""

    def __init__(self, config: WorkerConfig, nvml=None):
        self.config = config
        # Arguments first: a typo must not wait for the first-run speed test to be reported.
        network.check_network_name(config.network)
        peers = network.resolve_initial_peers(config.initial_peers)
        self.data_dir: Path = resolve_data_dir(config.data_dir, writable=True)
        self._hold = readyfile.hold(self.data_dir, "worker")  # before the identity: one node per data dir
        self.identity = Identity.load_or_create(self.data_dir)
        network.not_this_node(peers, self.identity.peer_id, say=logger.warning)
        self._nvml = nvml
        self.hardware = hw.detect(config.device, nvml)
        self.state = WorkerState.JOINING
        self.started_at = time.time()
        self.service = None
        # The owner comes first (gpunet.worker.availability): their rules, what the machine looks like, their hand.
        self.availability = Availability(OwnerRules(
            pause_when_busy=config.pause_when_busy, resume_after=config.resume_after,
            active_hours=parse_active_hours(config.active_hours) if config.active_hours else (),
            max_temperature=config.max_temperature))
        self._probe = None
        if config.fake_gpu_probe is not None:
            self._probe = FakeGpuProbe(config.fake_gpu_probe)
        elif config.pause_when_busy or config.max_temperature is not None:
            self._probe = SystemProbe(os.getpid(), self.hardware.indices if self.hardware.is_gpu else (), nvml)
        self._owner_poke = asyncio.Event()
        self._owner_seen = asyncio.Event()
        self._owner_watch: asyncio.Task | None = None
        self._dashboard = None
        self._standing = None  # the volunteer's background job, loaded and checked at start
        self._background: asyncio.Task | None = None
        self.executor = None
        self.ledger = None
        self.tflops: dict[str, float] = {}
        self.dht = None
        self.rpc = None
        self.maddrs: list[str] = []
        self.reachability = reachability.UNKNOWN
        self._via_relays = False  # joined in relay-client mode (behind NAT): addresses refreshed every heartbeat
        self._last_expiration = 0.0
        self._unpublished = 0  # heartbeats in a row whose record no peer accepted
        self._unpublished_said = -UNPUBLISHED_REPEAT
        self._stop = asyncio.Event()
        self._stop_asked_at, self._stop_signal = 0.0, 0  # when the first stop signal came, and which
        self._stopping = threading.Event()  # the same, for waits in threads (joining while no initial peer answers)

    @property
    def id(self) -> str:
        return self.identity.peer_id

    # --- the record ------------------------------------------------------------------------------------------------

    def record(self) -> WorkerRecord:
        admission, ledger = self.service.admission if self.service else None, self.ledger
        lanes = self.service.lanes if self.service else None
        head = ledger.head() if ledger is not None else None
        return WorkerRecord(
            version=__version__,
            state=self.state,
            device=self.hardware.info,
            tflops=self.tflops,
            price=float(self.config.price),
            max_concurrent=self.config.max_concurrent,
            client_places=admission.max_jobs_per_client if admission else None,
            queue=admission.queue_length if admission else 0,
            jobs_done=admission.jobs_done if admission else 0,
            started_at=self.started_at,
            updated_at=time.time(),
            programs=self.executor.cached_programs()[-MAX_CACHED_PROGRAMS:] if self.executor else [],
            name=self.config.public_name,
            maddrs=[m for m in self.maddrs if len(m) <= MAX_MADDR_CHARS][:MAX_ADVERTISED_MADDRS],
            reachability=self.reachability,
            ledger_count=head.count if head else 0,
            ledger_head=head.head_hash if head else None,
            credits_earned=ledger.earned(self.id) / NANO if ledger is not None else 0.0,
            peer_bytes_served=self.service.piece_server.served if self.service and self.service.piece_server else 0,
            peer_bytes_fetched=self.service.fetcher.fetched if self.service and self.service.fetcher else 0,
            batch_price=float(self.config.batch_price),
            batch_floor=lanes.floor / NANO if lanes else float(self.config.batch_price),
            interactive_load=round(lanes.load(INTERACTIVE), 3) if lanes else 0.0,
            preemptions_per_hour=round(lanes.preemption_rate(), 2) if lanes else 0.0,
            batch_queue=lanes.count(BATCH, running=False) if lanes else 0,
            pause_reason=printable(self.availability.reason, MAX_PAUSE_REASON) if self.state is WorkerState.PAUSED
            else None,
        )

    async def announce(self, state: WorkerState | None = None) -> bool:
        """Publish the current record; an explicit ``state`` change is published at once, not at the next beat."""
        if state is not None:
            self.state = state
        if self.service is not None:
            metrics.QUEUE.set(self.service.admission.queue_length)
            metrics.RUNNING.set(self.service.admission.running)
            metrics.show_lanes(self.service.lanes)
        if self.state is not WorkerState.OFFLINE:
            self.hardware = await asyncio.to_thread(hw.refresh, self.hardware, self._nvml)
        if self._via_relays and self.dht.is_alive() and not self._stop.is_set():
            await self._refresh_relayed_addresses()
        # A newer expiration is what makes the DHT replace our previous record (the tombstone included).
        expiration = max(get_dht_time() + registry.default_ttl(self.config.heartbeat), self._last_expiration + 1e-3)
        leaving = self.state in (WorkerState.DRAINING, WorkerState.OFFLINE)
        timeout = LEAVE_STEP_TIMEOUT if leaving else max(10.0, self.config.heartbeat)
        ok = self.dht.is_alive() and bool(await _bounded(
            registry.announce_async(self.dht, self.config.network, self.id, self.record(), expiration), timeout))
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
        if state is not None:  # what deployment tools wait on, instead of reading our output
            readyfile.write_ready(self.data_dir, role="worker", id=self.id, addresses=self.maddrs,
                                  network=self.config.network, state=self.state.value)
        return ok

    async def _refresh_relayed_addresses(self) -> None:
        """Relay reservations come and go (a relay restarts, another takes over): announce the ones held now. With
        none, the record says ``unreachable`` and routing sends it nothing, rather than jobs into a black hole."""
        try:
            maddrs = await asyncio.wait_for(asyncio.to_thread(network.visible_maddrs, self.dht, True), 5.0)
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

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                return runner.run(self.serve())
        finally:
            self._hold.release()

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, sig)
        loop.add_signal_handler(signal.SIGUSR1, self.poke_owner)  # `gpunet worker pause|resume`: look now
        loop.set_exception_handler(quiet_lost_daemon)
        readyfile.remove_ready(self.data_dir)  # one left by an earlier run that died must never be read as ours
        cfg = self.config
        info = self.hardware.info
        logger.info("Device: %s (%s x%d, %.1f GiB)", info.name, info.kind, info.count, info.memory_total / 2**30)
        if cfg.max_temperature is not None and not self.hardware.is_gpu and cfg.fake_gpu_probe is None:
            logger.warning("--max-temperature reads the GPU's temperature through NVML: this CPU worker ignores it")
        import torch

        # Before any torch work (a thread keeps the count it first ran an op with): this process measures and proves
        # the speed jobs get.
        torch.set_num_threads(self._threads())
        if cfg.background_job is not None:  # a mistake in it shows now, not at the first idle moment
            from gpunet.worker.background import load_standing_job

            self._standing = await asyncio.to_thread(load_standing_job, cfg.background_job, cfg.background_inputs,
                                                     self._memory_budget(), self.hardware.torch_device)
        self.tflops = await asyncio.to_thread(throughput.benchmark, self.hardware, self.data_dir, cfg.rebenchmark,
                                              self._threads())
        logger.info("Speed: %s", ", ".join(f"{v:.3g} TFLOPS {k}" for k, v in self.tflops.items()))
        if self._stop.is_set():  # Ctrl-C while measuring: nothing joined yet, nothing to leave
            return 0

        starting_network = not network.resolve_initial_peers(cfg.initial_peers)
        network.check_local_ports_free(dashboard_port=cfg.dashboard_port, metrics_port=cfg.metrics_port)
        self.dht = await self._join(None)
        if self.dht is None:  # stopped while waiting for an initial peer
            return 0
        try:
            self.maddrs = network.visible_maddrs(self.dht)
            # Stopped while starting (Ctrl-C, `systemctl stop` right after start): leave from where it got, not after
            # starting the parts still to come (a dial-back check, executors, the dashboard).
            if not self._stop.is_set():
                await self._check_initial_peers()
            if not self._stop.is_set():
                await self._find_reachability()
            if self.dht is None or self._stop.is_set():  # stopped while joining, or rejoining through relays
                return 0
            self._print_welcome(starting_network)
            await self.announce(WorkerState.JOINING)
            if self._stop.is_set():  # as it was listed: unlisted again before any executor starts
                await self._unlist()
                return 0
            try:
                await self.start_services()
            except Exception as e:
                if not await self._stopped_meanwhile():
                    raise
                # Ctrl-C reaches the whole group: a part starting under it (the p2p daemon the job doors register
                # with) may have stopped first. We were leaving anyway.
                logger.info("Stopped while starting (%s)", first_line(e))
                await self._unlist()
                return 0
            self._owner_watch = asyncio.create_task(self._watch_owner())
            await self._owner_seen.wait()  # a worker its owner paused comes up paused
            if self._stop.is_set():
                pass  # stopped while starting: straight to leaving
            elif self.availability.paused:
                await self._set_paused()
            else:
                await self.announce(WorkerState.ONLINE)
                logger.info("Online: taking jobs at %.3g credits/TFLOP (worker id %s)", cfg.price, self.id)
            await self._heartbeat_until_stopped()
            self._owner_watch.cancel()
            await self._drain()
            return 0
        except Exception:
            await self._unlist()  # listed, and failing
            raise
        finally:
            readyfile.remove_ready(self.data_dir)
            await self.stop_services()
            await self._stop_dht()

    async def _unlist(self) -> None:
        """Leave a tombstone over our record, if one was published (best effort, within LEAVE_STEP_TIMEOUT: a Ctrl-C
        to the process group has stopped the p2p daemon too, and then the record expires by itself)."""
        if self._last_expiration and self.state is not WorkerState.OFFLINE:
            try:
                await self.announce(WorkerState.OFFLINE)
            except Exception as e:
                logger.debug("Could not leave a tombstone: %s", e)

    async def _join(self, reachability: str | None):
        """Join the DHT. Behind NAT (``"private"``) as a DHT client: peers would reach its DHT node only through a
        relay, whose per-connection budget the jobs need; it still stores and refreshes its own record."""
        cfg = self.config
        if reachability is None and not cfg.relay_service:
            reachability = "no-relay"
        try:
            return await asyncio.to_thread(
                network.join_retrying, cfg.network, cfg.initial_peers, stop=self._stopping.wait, say=logger.warning,
                identity=self.identity, host_maddrs=cfg.host_maddrs, start_new=True, reachability=reachability,
                announce_maddrs=cfg.announce_maddrs or None, client_mode=reachability == "private")
        except Exception as e:
            if not await self._stopped_meanwhile():
                raise
            # Ctrl-C reaches the whole process group: the join's own helpers (its p2p daemon, torch's shared-memory
            # manager) stopped under it. We were leaving anyway.
            logger.info("Stopped while joining the network (%s)", first_line(e))
            return None

    def _initial_peers(self) -> list[str]:
        return network.not_this_node(network.resolve_initial_peers(self.config.initial_peers), self.id)

    async def _check_initial_peers(self) -> None:
        """Stop here, before being listed, if the initial peers that answer all run another network (gpunet.dht.hello:
        such a worker went "online" and never got a job)."""
        from gpunet.rpc import RPC

        peers = self._initial_peers()
        if peers:
            # Not closed after: hivemind keeps one replica per DHT, which the next steps use too.
            await hello.check_initial_peers(RPC(await self.dht.replicate_p2p(), self.config.network),
                                            self.config.network, peers)

    async def _find_reachability(self) -> None:
        """Ask an initial peer to dial us back (gpunet.dht.reachability). Not dialable: rejoin through relays."""
        from gpunet.rpc import RPC

        cfg = self.config
        peers = self._initial_peers()
        if not peers:
            logger.info("Reachability unknown: this worker starts the network, so no peer can dial it back yet")
            return
        # Not closed after: hivemind keeps one replica per DHT, which the job doors use next.
        rpc = RPC(await self.dht.replicate_p2p(), cfg.network)
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
        await self._stop_dht()
        self.dht = await self._join("private")
        if self.dht is None:
            return
        self._via_relays = True
        deadline = time.monotonic() + reachability.RELAY_WAIT
        while time.monotonic() < deadline:
            self.maddrs = await asyncio.to_thread(network.visible_maddrs, self.dht, True)
            if any(reachability.is_relayed(m) for m in self.maddrs):
                self.reachability = reachability.RELAYED
                logger.info("Reachable through relays: %s", ", ".join(m for m in self.maddrs
                                                                       if reachability.is_relayed(m)))
                return
            await asyncio.sleep(0.5)
        self.reachability = reachability.UNREACHABLE
        logger.warning("No relay took a reservation for this worker within %.0f s; listed as unreachable (no jobs are "
                       "routed to it) while it keeps trying", reachability.RELAY_WAIT)

    async def network_alive(self) -> bool:
        """Whether our DHT process and p2p daemon are still there to talk through."""
        return self.dht.is_alive() and (self.rpc is None or await self.rpc.daemon_alive())

    async def _stop_dht(self) -> None:
        if self.dht is None:
            return
        if self.dht.is_alive() and self.rpc is not None and not await self.rpc.daemon_alive():
            # Its daemon is gone: a polite shutdown would wait its whole grace period on it.
            self.dht.terminate()
            await asyncio.to_thread(self.dht.join, LEAVE_STEP_TIMEOUT)
        else:
            await asyncio.to_thread(self.dht.shutdown)  # bounded: a grace period, then SIGTERM

    def _print_welcome(self, starting_network: bool) -> None:
        joinable = self.maddrs[0] if self.maddrs else "(no address)"
        if starting_network:
            print(f"Started a new gpunet network {self.config.network!r}. Others join it with:", flush=True)
        else:
            print(f"Joined gpunet network {self.config.network!r}. Others can also join through this worker:", flush=True)
        print(f"  gpunet worker --network {self.config.network} --initial-peers {joinable}", flush=True)
        print(f"Worker id: {self.id}", flush=True)

    async def _stopped_meanwhile(self) -> bool:
        """Whether a stop was asked, for a part that failed while starting. A Ctrl-C to the process group stops that
        part's helpers (the p2p daemon, torch's shared-memory manager) at the moment our own handler is called, and
        the failure can reach this loop first: the signal is given a moment to be handled."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), SIGNAL_SETTLE)
        return self._stop.is_set()

    def _request_stop(self, sig: int) -> None:
        if self._stop.is_set():
            if sig == self._stop_signal and time.monotonic() - self._stop_asked_at < SIGNAL_SETTLE:
                # Most likely the same Ctrl-C, once more: a child forked by C code (torch's shared-memory manager
                # starting) that has not exec'd yet still holds this loop's signal socket, and its share of the
                # group's signal arrives here too.
                logger.info("%s again at once: still leaving (again to leave without waiting)",
                            signal.Signals(sig).name)
                return
            logger.warning("Second %s: leaving without waiting for running jobs", signal.Signals(sig).name)
            sys.exit(1)
        logger.info("%s received: finishing running jobs, then leaving the network", signal.Signals(sig).name)
        self._stop_asked_at, self._stop_signal = time.monotonic(), sig
        self._stop.set()
        self._stopping.set()

    async def _heartbeat_until_stopped(self) -> None:
        reported = 0
        every = self.config.remeasure_every
        speed_due = time.monotonic() + every
        earnings_due, earned = time.monotonic() + EARNINGS_EVERY, self.ledger.earned(self.id)
        while not self._stop.is_set():
            if not self.dht.is_alive():
                await asyncio.sleep(0.1)  # a signal to the whole group kills it too: let our own handler run first
                if self._stop.is_set():
                    break
                raise NetworkError("this worker's DHT process died; leaving (a supervisor may restart the worker)")
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.config.heartbeat)
            except asyncio.TimeoutError:
                await self.announce()
                admission = self.service.admission
                done = admission.jobs_done
                if done != reported:
                    logger.info("Served %d job(s) since the last heartbeat (%d in all); %d queued, %d running",
                                done - reported, done, admission.queue_length, admission.running)
                    reported = done
                if time.monotonic() >= earnings_due:
                    earnings_due = time.monotonic() + EARNINGS_EVERY
                    earned = self._say_earnings(earned)
                if every and time.monotonic() >= speed_due and not admission.active and not self.availability.paused:
                    await self._remeasure_speed()
                    speed_due = time.monotonic() + every

    # --- the owner comes first ---------------------------------------------------------------------------------------

    async def _watch_owner(self) -> None:
        """Look at the machine and the owner's hand every OWNER_EVERY seconds (at once on SIGUSR1), and pause or
        resume the worker as gpunet.worker.availability decides."""
        try:
            await self._watch_owner_until_stopped()
        finally:  # stopped before its first look, or failed: the start must not wait for a look that never comes
            self._owner_seen.set()

    async def _watch_owner_until_stopped(self) -> None:
        failing = False
        while not self._stop.is_set():
            reading = Reading(time.time())
            if self._probe is not None:
                try:
                    reading = await asyncio.to_thread(self._probe.read)
                    failing = False
                except Exception as e:  # a probe that cannot read the machine pauses nothing (and says so once)
                    if not failing:
                        logger.warning("Could not read what else runs on this machine (%s); not pausing for it", e)
                    failing = True
            changed = self.availability.update(reading, control.read_pause(self.data_dir))
            first = not self._owner_seen.is_set()
            self._owner_seen.set()
            if changed and not first and not self._stop.is_set():
                if self.availability.paused:
                    await self._set_paused()
                else:
                    self.service.resume()
                    await self.announce(WorkerState.ONLINE)
                    logger.info("Resumed: taking jobs again")
            try:
                await asyncio.wait_for(self._owner_poke.wait(), OWNER_EVERY)
            except asyncio.TimeoutError:
                pass
            self._owner_poke.clear()

    def poke_owner(self) -> None:
        """Look at the owner's hand now (the dashboard's buttons, SIGUSR1)."""
        self._owner_poke.set()

    async def _set_paused(self) -> None:
        self.service.pause(self.availability.reason, self.config.pause_grace)
        await self.announce(WorkerState.PAUSED)
        logger.info("Paused: %s. Running jobs get %.0f s to finish; no new ones until it resumes",
                    self.availability.reason, self.config.pause_grace)

    def _say_earnings(self, before: int) -> int:
        """A short earnings line now and then (``gpunet earnings`` has the detail); returns the total it said."""
        now = self.ledger.earned(self.id)
        owed = len(self.service.settlement.unsettled)
        if now != before or owed:
            logger.info("Earnings: %s credits in all (+%s in the last %.0f min)%s; `gpunet earnings` for details",
                        format_credits(now), format_credits(now - before), EARNINGS_EVERY / 60,
                        f", {owed} result(s) awaiting a countersignature" if owed else "")
        return now

    async def _remeasure_speed(self) -> None:
        """Measure the device again while no job runs (see worker.throughput); the next heartbeat publishes it."""
        before = self.tflops
        self.tflops = await asyncio.to_thread(throughput.remeasure, self.hardware, self.data_dir, self._threads())
        if self.executor is not None:
            self.executor.speed_tflops = max(self.tflops.values(), default=None)
        changed = any(abs(v - before.get(k, 0.0)) > 0.1 * max(v, before.get(k, 0.0)) for k, v in self.tflops.items())
        (logger.info if changed else logger.debug)(
            "Speed measured again while idle: %s", ", ".join(f"{v:.3g} TFLOPS {k}" for k, v in self.tflops.items()))

    async def _drain(self) -> None:
        admission, settlement = self.service.admission, self.service.settlement
        admission.drain()
        await self._stop_background()
        if not await self.network_alive():
            # The whole process group was signalled (a terminal's Ctrl-C, systemctl stop): our p2p daemon is gone, so
            # nobody can reach us or read a goodbye; running jobs cannot deliver either. Leave at once.
            logger.info("The p2p daemon has already stopped; leaving without announcing it (the record expires)")
            return
        await self.announce(WorkerState.DRAINING)
        deadline = time.monotonic() + self.config.drain_timeout
        if not await _within(admission.drained(), deadline - time.monotonic()):
            from gpunet.worker.executor import STOP_GRACE

            stopped = self.service.stop_running()
            logger.warning("%d job(s) still running after %.0f s; stopping them (not billed: their clients run them "
                           "elsewhere)", stopped, self.config.drain_timeout)
            # Each stops at its program's next node, or is killed once one op outlasts STOP_GRACE.
            await _within(admission.drained(), STOP_GRACE + 1.0)
        # Sessions' last steps are billed when their clients close them (a client told that we drain moves its span
        # and closes here): give them a moment, then sign what is left ourselves.
        grace = min(UNSETTLED_GRACE, max(0.0, deadline - time.monotonic()))
        if not await _within(self.service.sessions_closed(), grace):
            signed = self.service.end_sessions()
            if signed:
                logger.warning("%d session(s) were not closed by their clients; their last steps stay in `gpunet "
                               "ledger unpaid`", signed)
        # Results already delivered may still have their countersignature on the way: give it a moment.
        grace = min(UNSETTLED_GRACE, max(0.0, deadline - time.monotonic()))
        if not await _within(settlement.all_settled(), grace):
            logger.warning("%d delivered job(s) were never countersigned; they stay in `gpunet ledger unpaid`",
                           len(settlement.unsettled))
        await self.announce(WorkerState.OFFLINE)
        logger.info("Left the network (served %d jobs). Goodbye.", admission.jobs_done)

    # --- job services: the RPC handler and executors plug in here ---------------------------------------------------

    def _threads(self) -> int:
        """CPU threads per job: --threads, or the CPUs shared among the executors."""
        return hw.job_threads(self.config.threads, self.config.max_concurrent)

    def _memory_budget(self) -> int:
        """Bytes one executor may use: a share of free device memory, leaving headroom for the system."""
        if self.config.memory_budget_gb:
            return int(self.config.memory_budget_gb * 2**30)
        share = 0.8 if self.hardware.is_gpu else 0.5
        return max(256 * 2**20, int(self.hardware.info.memory_free * share / self.config.max_concurrent))

    def _spool_dir(self) -> Path:
        """Where big job inputs are written as they arrive (unlinked files: nothing is left after a crash)."""
        spool = self.data_dir / "spool"
        spool.mkdir(exist_ok=True)
        return spool

    def _buffer_budget(self) -> int:
        """Bytes of job payloads this process may hold at once (declared sizes, charged before reading)."""
        if self.config.buffer_gb:
            return int(self.config.buffer_gb * 2**30)
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
            total = 4 * 2**30
        return max(2**30, total // 4)

    async def start_services(self) -> None:
        """Start the executor pool, open the ledger and register the RPC handlers, then announce ``online``."""
        from gpunet.rpc import RPC
        from gpunet.worker.admission import Admission, ServiceLimits
        from gpunet.worker.sessions import SessionLimits
        from gpunet.worker.executor import Executor
        from gpunet.worker.service import JobService

        cfg = self.config
        self.executor = Executor(
            device=self.hardware.torch_device,
            processes=cfg.max_concurrent,
            threads_per_process=self._threads(),
            memory_budget_bytes=self._memory_budget(),
            default_timeout=60.0,
            cache_dir=self.data_dir / "programs",
            protected=[str(self.data_dir), str(Path.home())],
            sandbox=cfg.sandbox,
            speed_tflops=max(self.tflops.values(), default=None),
        )
        try:
            report = await self.executor.sandbox_report()  # before any job: the executors lock themselves down
        except ExecutorStartFailed as e:
            hint = (" If your kernel or GPU driver refuses the executor sandbox, `--no-sandbox` starts without it "
                    "(please report it)." if cfg.sandbox else "")
            raise ConfigError(f"{e}; run `gpunet doctor`.{hint}") from None
        for line in report:
            (logger.warning if line.startswith(("WARNING", "no ", "sandbox incomplete")) else logger.info)(
                "Executor sandbox: %s", line.removeprefix("WARNING: "))
        self.ledger = open_ledger(self.data_dir)
        self.service = JobService(
            identity=self.identity,
            executor=self.executor,
            ledger=self.ledger,
            admission=Admission(price_nano=price_to_nano(cfg.price), max_concurrent=cfg.max_concurrent,
                                max_queue=cfg.max_queue, batch_price_nano=price_to_nano(cfg.batch_price),
                                limits=ServiceLimits(max_buffered_bytes=self._buffer_budget())),
            record=self.record,
            corrupt_outputs=_fault_injector(cfg.fault_corrupt_fraction) if cfg.fault_corrupt_fraction else None,
            spool_dir=str(self._spool_dir()),
            device=self.hardware.torch_device,
            peer_rate=cfg.peer_upload_mbps * 1e6 or None,
            corrupt_pieces=cfg.fault_corrupt_pieces,
            corrupt_pushes=cfg.fault_corrupt_pushes,
            drop_pushes=cfg.fault_drop_pushes,
            session_limits=SessionLimits(
                max_bytes=int(cfg.session_memory_gb * 2**30) if cfg.session_memory_gb is not None
                else self._memory_budget() // 4,
                max_per_client=cfg.max_sessions_per_client, max_per_host=2 * cfg.max_sessions_per_client,
                max_ttl=cfg.session_ttl),
        )
        self.rpc = RPC(await self.dht.replicate_p2p(), cfg.network)
        await self.service.start(self.rpc)
        await reachability.ReachService().start(self.rpc)  # other nodes may ask this one to dial them back
        await hello.serve(self.rpc, cfg.network, "worker")  # and which network it runs, when they join through it
        if cfg.metrics_port:
            metrics.serve(cfg.metrics_port)
            logger.info("Prometheus metrics on http://127.0.0.1:%d/metrics", cfg.metrics_port)
        if cfg.dashboard_port:
            from gpunet.worker.dashboard import Dashboard

            self._dashboard = Dashboard(self)
            try:
                url = await self._dashboard.start(cfg.dashboard_port)
            except OSError as e:
                raise ConfigError(f"--dashboard-port {cfg.dashboard_port}: cannot listen on it ({e.strerror})") from None
            logger.info("Dashboard: %s", url)
        if self._standing is not None:
            from gpunet.worker.background import StandingJob

            job, inputs = self._standing
            owner = Identity.load_or_create(self.data_dir / "client")  # the identity gpunet.Client uses here
            self._background = asyncio.create_task(StandingJob(self.service, job, inputs, self.identity, owner,
                                                               self.data_dir / "background").run_forever())

    async def _stop_background(self) -> None:
        """The volunteer's own job stops first: leaving never waits for it (a run in progress is dropped)."""
        if self._background is not None:
            self._background.cancel()
            await asyncio.wait([self._background])

    async def stop_services(self) -> None:
        """Stop serving jobs (after draining), stop every executor process, close the ledger."""
        if self._owner_watch is not None:
            self._owner_watch.cancel()
        if self._dashboard is not None:
            await _bounded(self._dashboard.stop(), LEAVE_STEP_TIMEOUT)
        await self._stop_background()
        if self.service is not None:
            if not await _bounded(self.service.stop(), LEAVE_STEP_TIMEOUT, default=False, result=True):
                logger.warning("The p2p daemon did not answer while closing the job doors; leaving anyway")
        if self.executor is not None:
            await asyncio.to_thread(self.executor.close)
        if self.ledger is not None:
            self.ledger.close()


async def _bounded(awaitable, seconds: float, default=None, result=None):
    """``await awaitable`` for at most ``seconds``: its value (or ``result`` when given), else ``default``."""
    try:
        value = await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        return default
    return value if result is None else result


async def _within(future: asyncio.Future, seconds: float) -> bool:
    """Whether ``future`` resolved within ``seconds`` (it is cancelled otherwise)."""
    try:
        await asyncio.wait_for(future, max(0.0, seconds))
        return True
    except asyncio.TimeoutError:
        return False


def _fault_injector(fraction: float):
    """FAULT INJECTION, for testing trust: returns wrong outputs (validly encoded, plausibly shaped) for ``fraction``
    of jobs, signing them as if they were right — what a volunteer cheating for credits would do."""
    import random

    from gpunet.job import tensors

    rng = random.Random()
    logger.warning("FAULT INJECTION: this worker corrupts %.0f%% of its outputs", 100 * fraction)

    def corrupt(outputs: bytes) -> bytes:
        if rng.random() >= fraction:
            return outputs
        decoded = tensors.decode(outputs)
        return tensors.encode({k: (v * 1.5 + 1) if v.is_floating_point() else v + 1 for k, v in decoded.items()})

    return corrupt
