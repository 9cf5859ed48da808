"""A bootstrap node: a DHT-only peer with a stable identity, the entry point others pass as ``--initial-peers``."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from gpunet import readyfile
from gpunet.config import DEFAULT_NETWORK, resolve_data_dir
from gpunet.dht import network
from gpunet.identity import Identity

logger = logging.getLogger("gpunet.bootstrap")


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
    (circuit relay v2 within ``network.RELAY_LIMITS``) and serves the ``reach`` door (dial-back checks)."""
    network.check_network_name(network_name)
    network.resolve_initial_peers(initial_peers)
    data_dir = resolve_data_dir(data_dir, writable=True)
    readyfile.remove_ready(data_dir)  # one left by an earlier run that died must never be read as ours
    identity = Identity.load_or_create(data_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dht = network.join(network_name, initial_peers, identity=identity, host_maddrs=host_maddrs, start_new=True,
                       reachability="public", announce_maddrs=announce_maddrs)
    serving = threading.Thread(target=_serve_doors, args=(dht, network_name, stop), name="gpunet-doors", daemon=True)
    try:
        serving.start()
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
        serving.join(timeout=5)
        dht.shutdown()


def _serve_doors(dht, network_name: str, stop: threading.Event) -> None:
    """The doors a bootstrap node answers (its own event loop, in a thread: the main thread waits for signals)."""
    from gpunet.dht.reachability import PROBE_BYTES, ReachService, relay_works
    from gpunet.rpc import RPC, quiet_lost_daemon
    from gpunet.utils import new_event_loop

    async def serve() -> None:
        rpc = RPC(await dht.replicate_p2p(), network_name)
        try:
            await ReachService().start(rpc)
            public = [m for m in network.visible_maddrs(dht) if not m.startswith(("/ip4/127.", "/ip6/::1"))]
            works = bool(public) and await relay_works(public[0], network_name)
            if works:
                logger.info("This node's relay passed its self-test (%d KiB through one relayed connection)",
                            PROBE_BYTES // 1024)
            elif public:
                logger.warning("This node relays in libp2p's limited mode (128 KiB and 2 minutes per relayed "
                               "connection): hivemind's p2p daemon starts two relay services and the limited one "
                               "often registers last. Workers behind NAT that use this relay will have larger jobs "
                               "cut off; see docs/reachability.md")
            while not stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            if await rpc.daemon_alive():
                await rpc.close()

    def make_loop():
        loop = new_event_loop()
        loop.set_exception_handler(quiet_lost_daemon)
        return loop

    try:
        with asyncio.Runner(loop_factory=make_loop) as runner:  # cancels what hivemind left running, at the end
            runner.run(serve())
    except Exception as e:  # the daemon gone at shutdown: nothing left to serve
        logger.debug("bootstrap doors stopped: %s", e)
