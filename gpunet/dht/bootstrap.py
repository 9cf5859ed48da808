"""A bootstrap node: a DHT-only peer with a stable identity, the entry point others pass as ``--initial-peers``."""

from __future__ import annotations

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
) -> int:
    """Serve the DHT until SIGTERM/Ctrl-C; prints the address to join with and keeps a ready file (gpunet.readyfile).
    Returns the exit code."""
    network.check_network_name(network_name)
    network.resolve_initial_peers(initial_peers)
    data_dir = resolve_data_dir(data_dir, writable=True)
    readyfile.remove_ready(data_dir)  # one left by an earlier run that died must never be read as ours
    identity = Identity.load_or_create(data_dir)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dht = network.join(
        network_name, initial_peers, identity=identity, host_maddrs=host_maddrs, start_new=True
    )
    try:
        maddrs = network.visible_maddrs(dht)
        print(f"gpunet bootstrap node for network {network_name!r} is up. Join it with:", flush=True)
        for maddr in maddrs:
            print(f"  gpunet worker --network {network_name} --initial-peers {maddr}", flush=True)
        readyfile.write_ready(data_dir, role="bootstrap", id=identity.peer_id, addresses=maddrs, network=network_name,
                              state="online")
        stop.wait()
        logger.info("Stopping the bootstrap node")
        return 0
    finally:
        readyfile.remove_ready(data_dir)
        dht.shutdown()
