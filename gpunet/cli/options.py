"""The options several ``gpunet`` commands share (one definition each, so their names, metavars and help agree), and
the logging every long-running command sets up."""

from __future__ import annotations

import logging
import os
import sys

import typer

from gpunet.config import DEFAULT_HOST_MADDRS, DEFAULT_NETWORK, WorkerConfig

InitialPeers = typer.Option(
    None, "--initial-peers", metavar="MADDR", help="Multiaddr of a peer already in the network (repeatable). Env: GPUNET_INITIAL_PEERS."
)
Network = typer.Option(DEFAULT_NETWORK, "--network", metavar="NAME", help="Network name; networks with different names never mix.")
DataDir = typer.Option(None, "--data-dir", metavar="DIR", envvar="GPUNET_DATA_DIR", help="Where the node key, caches and ledger live (default: ~/.gpunet).")
HostMaddrs = typer.Option(
    None, "--host-maddrs", metavar="MADDR",
    help=f"Multiaddr to listen on, repeatable (default: {', '.join(DEFAULT_HOST_MADDRS)}, all interfaces, a random "
    "port).",
)
AnnounceMaddrs = typer.Option(
    None, "--announce-maddrs", metavar="MADDR",
    help="Multiaddr others should dial, repeatable: your public address and a port you forwarded to this machine "
    "(checked at start by a peer dialling it back).",
)
Device = typer.Option(WorkerConfig.device, "--device", metavar="DEVICE", help="auto, cpu or cuda:N.")
Verbose = typer.Option(0, "--verbose", "-v", count=True, help="-v: log every job; -vv: network internals too.")


def setup_logging(verbose: int) -> None:
    """Log to stderr: gpunet's own at INFO (-v: DEBUG), hivemind's at WARNING (-vv: DEBUG)."""
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose >= 2 else "WARNING")
    logging.getLogger("gpunet").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.basicConfig(
        level=logging.DEBUG if verbose >= 2 else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )

