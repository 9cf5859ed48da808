"""A bootstrap node: a DHT-only peer with a stable identity, the entry point others pass as ``--initial-peers``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from pathlib import Path

from gpunet import readyfile
from gpunet.config import DEFAULT_NETWORK, resolve_data_dir
from gpunet.dht import hello, network
from gpunet.identity import KEY_FILENAME, Identity

logger = logging.getLogger("gpunet.bootstrap")

#: Starts of the p2p daemon a bootstrap node tries until its relay passes the self-test (see Doors).
RELAY_STARTS = 5
#: How long the doors may take to come up (serve the reach door, run the relay self-test).
DOORS_TIMEOUT = 60.0


def run_bootstrap(
    network_name: str = DEFAULT_NETWORK,
    initial_peers: list[str] | None = None,
    host_maddrs: list[str] | None = None,
    data_dir=None,
    announce_maddrs: list[str] | None = None,
) -> int:
    """Serve the DHT until SIGTERM/Ctrl-C; prints the address to join with and keeps a ready file (gpunet.readyfile).
    Returns the exit code.

    A bootstrap node is a public entry point: its daemon runs as publicly reachable, relays for nodes behind NAT
    (circuit relay v2 within ``network.RELAY_LIMITS``) and serves the ``reach`` door (dial-back checks). It says it is
    up only once those doors answer, so the first worker's dial-back check never finds them missing."""
    network.check_network_name(network_name)
    network.resolve_initial_peers(initial_peers)
    data_dir = bootstrap_data_dir(data_dir)
    hold = readyfile.hold(data_dir, "bootstrap")  # before the identity and the ready file: one node per data dir
    readyfile.remove_ready(data_dir)  # one left by an earlier run that died must never be read as ours
    identity = Identity.load_or_create(data_dir)
    network.not_this_node(network.resolve_initial_peers(initial_peers), identity.peer_id, say=logger.warning)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # The p2p daemon (a child of the DHT process) inherits this. On one OS thread the daemon's own relay (libp2p's
    # limited defaults) registers before the relay manager's configured one, which then serves: 12 of 12 starts
    # here, against about half with the default (see Doors). A relay on one core still moves far more than a
    # volunteer's uplink. Set GOMAXPROCS yourself to choose otherwise; the self-test and restarts below still hold.
    os.environ.setdefault("GOMAXPROCS", "1")
    dht = doors = None
    try:
        for start in range(1, RELAY_STARTS + 1):
            dht = network.join_retrying(network_name, initial_peers, stop=stop.wait, say=logger.warning,
                                        identity=identity, host_maddrs=host_maddrs, start_new=True,
                                        reachability="public", announce_maddrs=announce_maddrs)
            if dht is None:  # stopped while no initial peer answered
                return 0
            doors = Doors(dht, network_name)
            relay = doors.start(stop)
            if stop.is_set():
                return 0
            if relay is not False:
                break
            if start == RELAY_STARTS:
                logger.warning("This node relays in libp2p's limited mode (128 KiB and 2 minutes per relayed "
                               "connection) after %d starts of its p2p daemon: workers behind NAT that use this relay "
                               "will have larger jobs cut off; see docs/reachability.md", RELAY_STARTS)
                break
            logger.warning("Its relay came up in libp2p's limited mode; restarting the p2p daemon (start %d of %d)",
                           start + 1, RELAY_STARTS)
            doors.stop()
            dht.shutdown()
        maddrs = network.visible_maddrs(dht)
        print(f"gpunet bootstrap node for network {network_name!r} is up. Join it with:", flush=True)
        for maddr in maddrs:
            print(f"  gpunet worker --network {network_name} --initial-peers {maddr}", flush=True)
        readyfile.write_ready(data_dir, role="bootstrap", id=identity.peer_id, addresses=maddrs, network=network_name,
                              state="online")
        while not stop.wait(0.5):
            if not dht.is_alive():
                logger.error("The DHT process died; stopping")
                return 1
        logger.info("Stopping the bootstrap node")
        return 0
    finally:
        stop.set()
        readyfile.remove_ready(data_dir)
        if doors is not None:
            doors.stop()
        if dht is not None and doors is not None and not doors.daemon_alive:
            # Ctrl-C in a terminal stopped the daemon with us: a polite shutdown would wait its grace period on it.
            dht.terminate()
            dht.join(5)
        elif dht is not None:
            dht.shutdown()
        hold.release()


def bootstrap_data_dir(data_dir=None) -> Path:
    """A bootstrap node's data dir: the one given, else ``<GPUNET_DATA_DIR or ~/.gpunet>/bootstrap`` (like a client's
    ``.../client``): apart from the worker's, so both run on one machine as they are (one node per data dir).

    Earlier versions kept a bootstrap's key in the dir itself. A bootstrap's address is what others pass as
    ``--initial-peers``, so that key must not change on upgrade: where the dir holds a key and nothing of a worker's
    (no speed cache, no ledger), the key is moved into ``bootstrap/`` (same peer id), once."""
    if data_dir is not None:
        return resolve_data_dir(data_dir, writable=True)
    base = resolve_data_dir(writable=True)
    target = base / "bootstrap"
    old_key, new_key = base / KEY_FILENAME, target / KEY_FILENAME
    if old_key.exists() and not new_key.exists() and not any(
            (base / worker_file).exists() for worker_file in ("throughput.json", "ledger.sqlite")):
        target.mkdir(mode=0o700, exist_ok=True)
        os.replace(old_key, new_key)
        logger.info("Moved this bootstrap node's key from %s into %s (the same peer id; a worker on this machine now "
                    "gets a key of its own in %s)", base, target, base)
    return resolve_data_dir(target, writable=True)


class Doors:
    """The doors a bootstrap node answers, on their own event loop in a thread (the main thread waits for signals).

    Before it reports ready it tests its own relay. Why: hivemind 1.1.12's p2p daemon starts two relay services, one
    with the limits it was given and one with libp2p's defaults for a *limited* relay (128 KiB and 2 minutes per
    circuit, meant only for hole punching), and whichever registers last serves; which one varies from start to
    start. With the limited one every job through the relay beyond a few small ones is cut off, so the node restarts
    its daemon instead (see docs/reachability.md)."""

    def __init__(self, dht, network_name: str):
        self.dht, self.network_name = dht, network_name
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._relay: bool | None = None  # None: no public address to test it on
        self.daemon_alive = True  # False once stopped: the p2p daemon was gone (the whole process group signalled)
        self._thread = threading.Thread(target=self._run, name="gpunet-doors", daemon=True)

    def start(self, stop: threading.Event) -> bool | None:
        """Serve; returns once the doors answer: whether the relay passed its self-test (None: not tested)."""
        self._thread.start()
        deadline = DOORS_TIMEOUT
        while not self._ready.wait(0.2) and not stop.is_set() and self._thread.is_alive() and deadline > 0:
            deadline -= 0.2
        return self._relay

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    async def _serve(self) -> None:
        from gpunet.dht.reachability import PROBE_BYTES, ReachService, relay_works
        from gpunet.rpc import RPC

        rpc = RPC(await self.dht.replicate_p2p(), self.network_name)
        try:
            await ReachService().start(rpc)
            await hello.serve(rpc, self.network_name, "bootstrap")
            public = [m for m in network.visible_maddrs(self.dht) if not m.startswith(("/ip4/127.", "/ip6/::1"))]
            if public:
                self._relay = await relay_works(public[0], self.network_name)
                if self._relay:
                    logger.info("This node's relay passed its self-test (%d KiB through one relayed connection)",
                                PROBE_BYTES // 1024)
            self._ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            self._ready.set()
            self.daemon_alive = await rpc.daemon_alive()
            if self.daemon_alive:
                await rpc.close()

    def _run(self) -> None:
        from gpunet.rpc import quiet_lost_daemon
        from gpunet.utils import new_event_loop

        def make_loop():
            loop = new_event_loop()
            loop.set_exception_handler(quiet_lost_daemon)
            return loop

        try:
            with asyncio.Runner(loop_factory=make_loop) as runner:  # cancels what hivemind left running, at the end
                runner.run(self._serve())
        except Exception as e:  # the daemon gone at shutdown: nothing left to serve
            logger.debug("bootstrap doors stopped: %s", e)
