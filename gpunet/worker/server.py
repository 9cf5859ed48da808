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

from gpunet import readyfile
from gpunet.config import WorkerConfig, resolve_data_dir
from gpunet.dht import hello, network, reachability
from gpunet.dht.records import WorkerState
from gpunet.errors import ConfigError, ExecutorStartFailed, NetworkError
from gpunet.identity import Identity
from gpunet.ledger.receipts import format_credits, price_to_nano
from gpunet.ledger.balances import Balance
from gpunet.ledger.store import open_ledger
from gpunet.ledger.vouching import TrustWatch
from gpunet.rpc import RPC, quiet_lost_daemon
from gpunet.utils import bounded, first_line, new_event_loop
from gpunet.worker import hardware as hw
from gpunet.worker import control, metrics, throughput
from gpunet.worker.announcer import LEAVE_STEP_TIMEOUT, Announcer
from gpunet.worker.state.availability import Availability, OwnerRules, Reading, parse_active_hours
from gpunet.worker.probe import FakeGpuProbe, SystemProbe

logger = logging.getLogger("gpunet.worker")

#: Seconds between looks at what the owner is doing (gpunet.worker.state.availability).
OWNER_EVERY = 1.0
#: Seconds between the worker's short earnings lines in its log.
EARNINGS_EVERY = 600.0
#: Seconds a draining worker waits for countersignatures of results it already delivered.
UNSETTLED_GRACE = 5.0
#: Seconds a group Ctrl-C takes to settle: a part that failed while the worker starts waits this long for the signal
#: sent with its failure, and the same signal arriving again this soon is not a second Ctrl-C.
SIGNAL_SETTLE = 0.5


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
        self.jobs = None  # gpunet.worker.jobs, once the services run
        self.doors = None
        # The owner comes first (gpunet.worker.state.availability): their rules, what the machine looks like, their hand.
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
        self.trust = TrustWatch(self.data_dir)  # whose merged receipts count as credit (gpunet ledger trust)
        self.tflops: dict[str, float] = {}
        self.dht = None
        self.rpc = None
        self._refuse_relay = False  # this node relays for nobody (no --relay-service): RPC.refuse_relaying
        self.announcer = Announcer(self)  # its record, published, and where it can be reached
        self._stop = asyncio.Event()
        self._stop_asked_at, self._stop_signal = 0.0, 0  # when the first stop signal came, and which
        self._stopping = threading.Event()  # the same, for waits in threads (joining while no initial peer answers)

    @property
    def id(self) -> str:
        return self.identity.peer_id

    def credit(self) -> Balance:
        """This worker's totals in its own ledger as it vouches for them (gpunet.ledger.vouching): what it announces,
        logs and shows. Merged receipts naming it that it does not vouch for are in the ``*_unvouched`` figures."""
        return self.ledger.balances(self.trust.current(), me=self.id).get(self.id) or Balance(self.id)

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        from gpunet.worker.executor import forkserver

        forkserver.start_forkserver()  # it imports torch for the executors while this process measures and joins
        try:
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                return runner.run(self.serve())
        finally:
            forkserver.stop_forkserver()
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
            self.announcer.maddrs = network.visible_maddrs(self.dht)
            # Stopped while starting (Ctrl-C, `systemctl stop` right after start): leave from where it got, not after
            # starting the parts still to come (a dial-back check, executors, the dashboard).
            if not self._stop.is_set():
                await self._check_initial_peers()
            if not self._stop.is_set():
                await self.announcer.find_reachability()
            if self.dht is None or self._stop.is_set():  # stopped while joining, or rejoining through relays
                return 0
            self._print_welcome(starting_network)
            await self.announcer.announce(WorkerState.JOINING)
            if self._stop.is_set():  # as it was listed: unlisted again before any executor starts
                await self.announcer.unlist()
                return 0
            try:
                await self.start_services()
            except Exception as e:
                if not await self._stopped_meanwhile():
                    raise
                # Ctrl-C reaches the whole group: a part starting under it (the p2p daemon the job doors register
                # with) may have stopped first. We were leaving anyway.
                logger.info("Stopped while starting (%s)", first_line(e))
                await self.announcer.unlist()
                return 0
            self._owner_watch = asyncio.create_task(self._watch_owner())
            await self._owner_seen.wait()  # a worker its owner paused comes up paused
            if self._stop.is_set():
                pass  # stopped while starting: straight to leaving
            elif self.availability.paused:
                await self._set_paused()
            else:
                await self.announcer.announce(WorkerState.ONLINE)
                logger.info("Online: taking jobs at %.3g credits/TFLOP (worker id %s)", cfg.price, self.id)
            await self._heartbeat_until_stopped()
            self._owner_watch.cancel()
            await self._drain()
            return 0
        except Exception:
            await self.announcer.unlist()  # listed, and failing
            raise
        finally:
            readyfile.remove_ready(self.data_dir)
            await self.stop_services()
            await self._stop_dht()

    async def _join(self, reachability: str | None):
        """Join the DHT. Behind NAT (``"private"``) as a DHT client: peers would reach its DHT node only through a
        relay, whose per-connection budget the jobs need; it still stores and refreshes its own record."""
        cfg = self.config
        limits = None
        if reachability is None and not cfg.relay_service:
            reachability = "no-relay"
        elif reachability is None:
            limits = network.relay_limits(cfg.relay_circuit_mb, cfg.relay_circuit_minutes, cfg.relay_circuits,
                                          cfg.relay_reservations)
        try:
            dht = await asyncio.to_thread(
                network.join_retrying, cfg.network, cfg.initial_peers, stop=self._stopping.wait, say=logger.warning,
                identity=self.identity, host_maddrs=cfg.host_maddrs, start_new=True, reachability=reachability,
                announce_maddrs=cfg.announce_maddrs or None, client_mode=reachability == "private",
                relay_limits=limits)
            if dht is not None and reachability == "no-relay":
                await RPC(await dht.replicate_p2p(), cfg.network).refuse_relaying()
                self._refuse_relay = True  # again at every heartbeat (see _heartbeat_until_stopped)
            return dht
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
        peers = self._initial_peers()
        if peers:
            # Not closed after: hivemind keeps one replica per DHT, which the next steps use too.
            await hello.check_initial_peers(RPC(await self.dht.replicate_p2p(), self.config.network),
                                            self.config.network, peers)

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
        joinable = self.announcer.maddrs[0] if self.announcer.maddrs else "(no address)"
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
        earnings_due, earned = time.monotonic() + EARNINGS_EVERY, self.credit().earned
        while not self._stop.is_set():
            if not self.dht.is_alive():
                await asyncio.sleep(0.1)  # a signal to the whole group kills it too: let our own handler run first
                if self._stop.is_set():
                    break
                raise NetworkError("this worker's DHT process died; leaving (a supervisor may restart the worker)")
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.config.heartbeat)
            except asyncio.TimeoutError:
                await self.announcer.announce()
                if self._refuse_relay and self.rpc is not None:
                    # libp2p's own relay starts (taking the relay protocol back) when AutoNAT first finds this node
                    # public, which can come after the join: the refusal is put back in its place.
                    try:
                        await self.rpc.refuse_relaying()
                    except Exception as e:  # the daemon going: the next look at it says so
                        logger.debug("Could not refuse relaying again: %s", e)
                admission = self.jobs.admission
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
        resume the worker as gpunet.worker.state.availability decides."""
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
                    self.jobs.turns.resume()
                    await self.announcer.announce(WorkerState.ONLINE)
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
        self.jobs.turns.pause(self.availability.reason, self.config.pause_grace)
        await self.announcer.announce(WorkerState.PAUSED)
        logger.info("Paused: %s. Running jobs get %.0f s to finish; no new ones until it resumes",
                    self.availability.reason, self.config.pause_grace)

    def _say_earnings(self, before: int) -> int:
        """A short earnings line now and then (``gpunet earnings`` has the detail); returns the total it said."""
        now = self.credit().earned
        owed = len(self.jobs.billing.awaiting.unsettled)
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
        admission, settlement = self.jobs.admission, self.jobs.billing.awaiting
        admission.drain()
        await self._stop_background()
        if not await self.network_alive():
            # The whole process group was signalled (a terminal's Ctrl-C, systemctl stop): our p2p daemon is gone, so
            # nobody can reach us or read a goodbye; running jobs cannot deliver either. Leave at once.
            logger.info("The p2p daemon has already stopped; leaving without announcing it (the record expires)")
            return
        await self.announcer.announce(WorkerState.DRAINING)
        deadline = time.monotonic() + self.config.drain_timeout
        if not await _within(admission.drained(), deadline - time.monotonic()):
            from gpunet.worker.executor import STOP_GRACE

            stopped = self.jobs.turns.stop_running()
            logger.warning("%d job(s) still running after %.0f s; stopping them (not billed: their clients run them "
                           "elsewhere)", stopped, self.config.drain_timeout)
            # Each stops at its program's next node, or is killed once one op outlasts STOP_GRACE.
            await _within(admission.drained(), STOP_GRACE + 1.0)
        # Sessions' last steps are billed when their clients close them (a client told that we drain moves its span
        # and closes here): give them a moment, then sign what is left ourselves.
        grace = min(UNSETTLED_GRACE, max(0.0, deadline - time.monotonic()))
        if not await _within(self.jobs.sessions.all_billed(), grace):
            signed = self.jobs.sessions.end_all()
            if signed:
                logger.warning("%d session(s) were not closed by their clients; their last steps stay in `gpunet "
                               "ledger unpaid`", signed)
        # Results already delivered may still have their countersignature on the way: give it a moment.
        grace = min(UNSETTLED_GRACE, max(0.0, deadline - time.monotonic()))
        if not await _within(settlement.all_settled(), grace):
            logger.warning("%d delivered job(s) were never countersigned; they stay in `gpunet ledger unpaid`",
                           len(settlement.unsettled))
        await self.announcer.announce(WorkerState.OFFLINE)
        logger.info("Left the network (served %d jobs). Goodbye.", admission.jobs_done)

    # --- job services: the RPC handler and executors plug in here ---------------------------------------------------

    def _threads(self) -> int:
        """CPU threads per job: --threads, or the CPUs shared among the executors."""
        return hw.job_threads(self.config.threads, self.config.max_concurrent)

    def _session_processes(self) -> int:
        """Executor processes kept for inference sessions' state alone (docs/sessions.md): one, unless sessions are
        turned off (``--session-memory-gb 0``)."""
        return 0 if self.config.session_memory_gb == 0 else 1

    def _memory_budget(self) -> int:
        """Bytes one executor may use: a share of free device memory, leaving headroom for the system, split evenly
        among the plain executors and the sessions' own process."""
        if self.config.memory_budget_gb:
            return int(self.config.memory_budget_gb * 2**30)
        share = 0.8 if self.hardware.is_gpu else 0.5
        processes = self.config.max_concurrent + self._session_processes()
        return max(256 * 2**20, int(self.hardware.info.memory_free * share / processes))

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
        from gpunet.worker.state.admission import Admission
        from gpunet.worker.state.limits import ServiceLimits, SessionLimits
        from gpunet.worker.executor import Executor
        from gpunet.worker.doors import Doors
        from gpunet.worker.faults import Faults
        from gpunet.worker.jobs import Jobs
        from gpunet.worker.weights import Weights

        cfg = self.config
        if cfg.fake_cuda_graphs:
            logger.warning("FAKE HARDWARE: CUDA graphs are played by a CPU stand-in "
                           "(gpunet.worker.executor.graphs.FakeCudaGraphs), for tests")
        # (in a thread: its first process is forked once the fork server has imported torch, seconds on a busy machine)
        self.executor = await asyncio.to_thread(
            Executor,
            device=self.hardware.torch_device,
            processes=cfg.max_concurrent,
            threads_per_process=self._threads(),
            memory_budget_bytes=self._memory_budget(),
            default_timeout=60.0,
            cache_dir=self.data_dir / "programs",
            protected=[str(self.data_dir), str(Path.home())],
            sandbox=cfg.sandbox,
            speed_tflops=max(self.tflops.values(), default=None),
            session_processes=self._session_processes(),
            graphs="fake" if cfg.fake_cuda_graphs else "cuda" if cfg.cuda_graphs else None,
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
        self.jobs = Jobs(
            identity=self.identity,
            executor=self.executor,
            ledger=self.ledger,
            admission=Admission(price_nano=price_to_nano(cfg.price), max_concurrent=cfg.max_concurrent,
                                max_queue=cfg.max_queue, batch_price_nano=price_to_nano(cfg.batch_price),
                                limits=ServiceLimits(max_buffered_bytes=self._buffer_budget())),
            record=self.announcer.record,
            spool_dir=str(self._spool_dir()),
            device=self.hardware.torch_device,
            peer_rate=cfg.peer_upload_mbps * 1e6 or None,
            faults=Faults.from_config(cfg),
            weights=Weights(tuple(str(d) for d in cfg.models_dirs), index_cache=self.data_dir / "models-index.json",
                            disk=self.executor.disk),
            session_limits=SessionLimits(
                max_bytes=int(cfg.session_memory_gb * 2**30) if cfg.session_memory_gb is not None
                else self._memory_budget() // 4,
                max_per_client=cfg.max_sessions_per_client, max_per_host=2 * cfg.max_sessions_per_client,
                max_ttl=cfg.session_ttl),
            batch_sessions=cfg.batch_sessions,
        )
        await self.jobs.weights.start()  # the models dirs indexed (hashing only what changed) before jobs come
        self.rpc = RPC(await self.dht.replicate_p2p(), cfg.network)
        self.doors = Doors(self.jobs)
        await self.doors.start(self.rpc)
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
            self._background = asyncio.create_task(StandingJob(self.jobs, job, inputs, self.identity, owner,
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
        self.announcer.stop()  # its look for hole-punching observers, if one runs
        if self._dashboard is not None:
            await bounded(self._dashboard.stop(), LEAVE_STEP_TIMEOUT)
        await self._stop_background()
        if self.doors is not None:
            if not await bounded(self.doors.stop(), LEAVE_STEP_TIMEOUT, default=False, result=True):
                logger.warning("The p2p daemon did not answer while closing the job doors; leaving anyway")
        elif self.jobs is not None:  # its start failed before the doors opened: what the job path holds still goes
            await self.jobs.stop()
            await self.jobs.billing.close()
        if self.executor is not None:
            await asyncio.to_thread(self.executor.close)
        if self.ledger is not None:
            self.ledger.close()


async def _within(future: asyncio.Future, seconds: float) -> bool:
    """Whether ``future`` resolved within ``seconds`` (it is cancelled otherwise)."""
    try:
        await asyncio.wait_for(future, max(0.0, seconds))
        return True
    except asyncio.TimeoutError:
        return False
