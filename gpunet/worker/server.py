"""A gpunet worker: joins the network, advertises its device, and leaves cleanly.

Lifecycle (what others see in the DHT): ``joining`` while it starts, ``online`` while it takes jobs, ``draining`` after
SIGTERM/Ctrl-C while running jobs finish, then an ``offline`` tombstone that makes readers drop it at once. A worker
that dies without a word simply stops refreshing its record, which expires after three heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from hivemind.utils import get_dht_time

from gpunet._version import __version__
from gpunet.config import WorkerConfig
from gpunet.dht import network, registry
from gpunet.dht.records import MAX_CACHED_PROGRAMS, WorkerRecord, WorkerState
from gpunet.ledger.identity import Identity, resolve_data_dir
from gpunet.worker import hardware as hw
from gpunet.worker import throughput

logger = logging.getLogger("gpunet.worker")


class Worker:
    """One worker process. ``run()`` blocks until the worker has left the network."""

    def __init__(self, config: WorkerConfig, nvml=None):
        self.config = config
        self.data_dir: Path = resolve_data_dir(config.data_dir)
        self.identity = Identity.load_or_create(self.data_dir)
        self._nvml = nvml
        self.hardware = hw.detect(config.device, nvml)
        self.state = WorkerState.JOINING
        self.started_at = time.time()
        self.jobs_done = 0
        self.queue_length = 0
        self.running_jobs = 0
        self.cached_programs: list[str] = []
        self.tflops: dict[str, float] = {}
        self.dht = None
        self.maddrs: list[str] = []
        self._last_expiration = 0.0
        self._stop = asyncio.Event()

    @property
    def id(self) -> str:
        return self.identity.peer_id

    # --- the record ------------------------------------------------------------------------------------------------

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            version=__version__,
            state=self.state,
            device=self.hardware.info,
            tflops=self.tflops,
            price=float(self.config.price),
            max_concurrent=self.config.max_concurrent,
            queue=self.queue_length,
            jobs_done=self.jobs_done,
            started_at=self.started_at,
            updated_at=time.time(),
            programs=self.cached_programs[-MAX_CACHED_PROGRAMS:],
            name=self.config.public_name,
            maddrs=self.maddrs[:8],
        )

    async def announce(self, state: WorkerState | None = None) -> bool:
        """Publish the current record; an explicit ``state`` change is published at once, not at the next beat."""
        if state is not None:
            self.state = state
        if self.state is not WorkerState.OFFLINE:
            self.hardware = await asyncio.to_thread(hw.refresh, self.hardware, self._nvml)
        # A newer expiration is what makes the DHT replace our previous record (the tombstone included).
        expiration = max(get_dht_time() + registry.default_ttl(self.config.heartbeat), self._last_expiration + 1e-3)
        ok = await registry.announce_async(self.dht, self.config.network, self.id, self.record(), expiration)
        if ok:
            self._last_expiration = expiration
        else:
            logger.warning("Could not publish this worker's record (no peer accepted it); retrying next heartbeat")
        return ok

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def run(self) -> int:
        return asyncio.run(self.serve())

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, sig)
        cfg = self.config
        info = self.hardware.info
        logger.info("Device: %s (%s x%d, %.1f GiB)", info.name, info.kind, info.count, info.memory_total / 2**30)
        self.tflops = await asyncio.to_thread(throughput.benchmark, self.hardware, self.data_dir, cfg.rebenchmark)
        logger.info("Measured speed: %s", ", ".join(f"{v:.3g} TFLOPS {k}" for k, v in self.tflops.items()))

        starting_network = not network.resolve_initial_peers(cfg.initial_peers)
        self.dht = await asyncio.to_thread(
            network.join,
            cfg.network,
            cfg.initial_peers,
            identity=self.identity,
            host_maddrs=cfg.host_maddrs,
            start_new=True,
        )
        try:
            network.tie_to_this_process(self.dht)
            self.maddrs = network.visible_maddrs(self.dht)
            self._print_welcome(starting_network)
            await self.announce(WorkerState.JOINING)
            await self.start_services()
            await self.announce(WorkerState.ONLINE)
            logger.info("Online: taking jobs at %.3g credits/PFLOP (worker id %s)", cfg.price, self.id)
            await self._heartbeat_until_stopped()
            await self._drain()
            return 0
        finally:
            await self.stop_services()
            await asyncio.to_thread(self.dht.shutdown)

    def _print_welcome(self, starting_network: bool) -> None:
        joinable = self.maddrs[0] if self.maddrs else "(no address)"
        if starting_network:
            print(f"Started a new gpunet network {self.config.network!r}. Others join it with:", flush=True)
        else:
            print(f"Joined gpunet network {self.config.network!r}. Others can also join through this worker:", flush=True)
        print(f"  gpunet worker --network {self.config.network} --initial-peers {joinable}", flush=True)
        print(f"Worker id: {self.id}", flush=True)

    def _request_stop(self, sig: int) -> None:
        if self._stop.is_set():
            logger.warning("Second %s: leaving without waiting for running jobs", signal.Signals(sig).name)
            sys.exit(1)
        logger.info("%s received: finishing running jobs, then leaving the network", signal.Signals(sig).name)
        self._stop.set()

    async def _heartbeat_until_stopped(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=self.config.heartbeat)
            except asyncio.TimeoutError:
                await self.announce()

    async def _drain(self) -> None:
        await self.announce(WorkerState.DRAINING)
        deadline = time.monotonic() + self.config.drain_timeout
        while self.running_jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.running_jobs:
            logger.warning("%d job(s) still running after %.0f s; abandoning them", self.running_jobs, self.config.drain_timeout)
        await self.announce(WorkerState.OFFLINE)
        logger.info("Left the network (served %d jobs). Goodbye.", self.jobs_done)

    # --- job services: the RPC handler and executors plug in here ---------------------------------------------------

    async def start_services(self) -> None:
        """Start what serves jobs; the worker is announced ``online`` only after this returns."""

    async def stop_services(self) -> None:
        """Stop what serves jobs (after draining)."""
