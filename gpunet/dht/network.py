"""Joining a gpunet network: one hivemind DHT per node, its libp2p identity being the node's gpunet identity."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
from functools import partial
from typing import Callable, Iterable, Sequence

from hivemind.dht import DHT
from hivemind.utils.multiaddr import Multiaddr

from gpunet.config import (
    DEFAULT_HOST_MADDRS,
    DEFAULT_NETWORK,
    INITIAL_PEERS_ENV,
    LOOPBACK_MADDR,
    NETWORK_NAME,
)
from gpunet.dht import hardening
from gpunet.dht.validation import network_validators
from gpunet.errors import ConfigError, NetworkError, PeersUnreachable
from gpunet.identity import Identity

logger = logging.getLogger(__name__)


def _not_the_parents_signals() -> None:
    """In a process just forked from a node (hivemind's DHT process): stop signalling the parent's event loop.

    A fork keeps the parent's signal wakeup socket, so a Ctrl-C or ``systemctl stop`` (sent to the whole process
    group) reaching the child before hivemind ignores it there woke the parent's loop a second time, which read it as
    a second Ctrl-C: "leaving without waiting for running jobs", exit status 1."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread's: nothing to undo
        pass


os.register_at_fork(after_in_child=_not_the_parents_signals)


class _ShutdownNoise(logging.Filter):
    """The p2p daemon logs its control socket closing under it, when a node stops, as an ERROR ("error accepting
    connection: accept unix ...: use of closed network connection"): every Ctrl-C printed it. Expected then; dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


# hivemind logs the daemon's output here, in the DHT process (forked from this one after import: it inherits this).
logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_ShutdownNoise())

def check_network_name(network: str) -> str:
    if not NETWORK_NAME.match(network):
        raise ConfigError(f"network name {network!r} must be 1-64 letters, digits, '-' or '_' (no dots)")
    return network


def resolve_initial_peers(initial_peers: Sequence[str] | None = None) -> list[str]:
    """Initial peers from the argument, else ``GPUNET_INITIAL_PEERS`` (comma- or space-separated); each checked."""
    if not initial_peers:
        initial_peers = re.split(r"[,\s]+", os.environ.get(INITIAL_PEERS_ENV, "").strip())
    peers = [p for p in (s.strip() for s in initial_peers) if p]
    for peer in peers:
        try:
            maddr = Multiaddr(peer)
        except Exception:
            raise ConfigError(f"initial peer {peer!r} is not a multiaddr (like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW…)")
        if "p2p" not in {proto.name for proto in maddr.protocols()}:
            raise ConfigError(f"initial peer {peer!r} lacks its /p2p/<peer id> part")
    return peers


#: How the p2p daemon and hivemind say that no initial peer could be reached.
_NO_PEER_ANSWERED = ("failed to connect to bootstrap peers", "none of the initial_peers responded")
#: Waits between tries when no initial peer answers: doubling from the first to the last.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0


def not_this_node(peers: Sequence[str], own_id: str, say: Callable[..., None] | None = None) -> list[str]:
    """``peers`` less those that are this very node (its own address, passed back to it: a node cannot join through
    itself, and waited for ever for "an initial peer" to answer); ConfigError if that leaves none. ``say``: how to
    tell of those skipped (once, at start)."""
    others = [p for p in peers if not p.endswith(f"/p2p/{own_id}")]
    if peers and not others:
        raise ConfigError(f"the initial peer{'s' if len(peers) > 1 else ''} {', '.join(peers)} "
                          f"{'are' if len(peers) > 1 else 'is'} this node itself (peer id {own_id}, the identity in "
                          "its data dir): give the address of another node of the network, or leave --initial-peers "
                          "out to start a new network")
    for p in peers:
        if p not in others and say is not None:
            say("Initial peer %s is this node itself: skipped", p)
    return others


def join_retrying(network: str, initial_peers: Sequence[str] | None, *, stop: Callable[[float], bool],
                  say: Callable[[str], None], **kwargs) -> DHT | None:
    """:func:`join`, trying again with backoff while none of the initial peers answers (all down, or restarting),
    saying so each time; returns None if ``stop(seconds)`` (a wait that returns True when asked to stop) says so."""
    wait, tries = RETRY_FIRST, 0
    while True:
        try:
            return join(network, initial_peers, **kwargs)
        except PeersUnreachable:
            tries += 1
            say(f"None of the initial peers answered ({', '.join(resolve_initial_peers(initial_peers))}); trying "
                f"again in {wait:.0f} s (try {tries}). It joins as soon as one is back.")
            if stop(wait):
                return None
            wait = min(wait * 2, RETRY_MAX)


def join(
    network: str = DEFAULT_NETWORK,
    initial_peers: Sequence[str] | None = None,
    *,
    identity: Identity | None = None,
    host_maddrs: Sequence[str] | None = None,
    client_mode: bool = False,
    signing_identities: Iterable[Identity] = (),
    start_new: bool = False,
    reachability: str | None = None,
    announce_maddrs: Sequence[str] | None = None,
    relay_limits: dict | None = None,
) -> DHT:
    """Start this node's DHT and join ``network``; raises NetworkError if the initial peers cannot be reached.

    ``identity`` makes the libp2p peer id that of the node key (a restarted node keeps its id). Without initial peers,
    ``start_new=True`` starts a new network; otherwise it is an error (a client alone on a network sees nothing).

    ``reachability`` configures the p2p daemon for what :mod:`gpunet.dht.reachability` found: ``"public"`` (a node
    others dial directly: it also relays for nodes that cannot be dialled, within :data:`RELAY_LIMITS`), ``"private"``
    (behind NAT: it keeps circuit-relay reservations on its initial peers and announces the relayed addresses), or
    None (the daemon's own AutoNAT decides, which needs several peers to answer before it says anything), or
    ``"no-relay"`` (as None, but relaying for nobody: see :meth:`gpunet.rpc.RPC.refuse_relaying`). ``relay_limits``: the relay flags
    of a node that relays (:func:`relay_limits`; default :data:`RELAY_LIMITS` for a public node).
    """
    check_network_name(network)
    peers = resolve_initial_peers(initial_peers)
    if identity is not None:
        peers = not_this_node(peers, identity.peer_id)
    if not peers and not start_new:
        raise ConfigError(f"no initial peers: pass --initial-peers or set {INITIAL_PEERS_ENV}")
    _check_ports_free(host_maddrs or DEFAULT_HOST_MADDRS)
    hardening.install()  # before the DHT process forks: it inherits the entry-by-entry validation and bucket caps
    identities = [*([identity] if identity else []), *signing_identities]
    kwargs = _reachability_options(reachability, peers, relay_limits)
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity is not None:
        if identity.path is None:
            raise ConfigError("the node identity must be saved to a file before the libp2p daemon can use it")
        # hivemind's identity-collision check assumes RSA keys; our Ed25519 id is our own key, so skip it.
        kwargs.update(identity_path=str(identity.path), check_if_identity_free=False)
    try:
        dht = DHT(
            initial_peers=peers or None,
            start=True,
            client_mode=client_mode,
            host_maddrs=list(host_maddrs or DEFAULT_HOST_MADDRS),
            record_validators=network_validators(network, identities),
            cache_locally=False,  # listings read the latest records; a cached answer is only a way to serve stale ones
            cache_nearest=0,
            **kwargs,
        )
    except Exception as e:
        where = f"the initial peers {', '.join(peers)}" if peers else "a new network"
        unreachable = peers and any(s in str(e) for s in _NO_PEER_ANSWERED)
        raise (PeersUnreachable if unreachable else NetworkError)(f"could not join {where}: {_daemon_words(e)}") from e
    _tie_to_this_process(dht)
    if peers:
        dht.run_coroutine(partial(_rejoin_when_alone, initial_peers=peers, period=REJOIN_PERIOD), return_future=True)
    return dht


#: What the p2p daemon puts before its words: a timestamp ("2026/12/04 21:12:10", "Dec 04 21:10:19.471") and a level
#: and source ("[ERROR] [go-libp2p-daemon/daemon.go:198]").
_DAEMON_PREFIX = re.compile(r"(?:(?<=^)|(?<=: )|(?<=\n))(?:\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(?:\.\d+)? |"
                            r"[A-Z][a-z]{2} \d\d \d\d:\d\d:\d\d(?:\.\d+)? )?"
                            r"(?:\[(?:DEBUG|INFO|WARN|ERROR|FATAL)\] (?:\[[^\]]*\] )?)?")


def _daemon_words(error: BaseException) -> str:
    """An error from starting the p2p daemon, without the daemon's log prefixes (where a line or a quoted daemon
    message starts: text in brackets elsewhere stays)."""
    return _DAEMON_PREFIX.sub("", str(error))


#: What a public node relays for others (libp2p circuit relay v2, per relayed peer): reservations it holds, circuits
#: open at once, bytes each way and minutes per circuit before it is reset (a job's payload is bounded like any other;
#: a client whose circuit is reset reconnects). A bootstrap node's; a worker's come from its --relay-* flags.
RELAY_LIMITS = {"relayMaxReservations": 128, "relayMaxCircuits": 16, "relayDataLimit": 4 * 2**30,
                "relayTimeLimit": "30m0s"}

def relay_limits(circuit_mb: float, circuit_minutes: float, circuits: int, reservations: int) -> dict:
    """The p2p daemon's relay flags for a node that relays (see :data:`RELAY_LIMITS`): bytes each way and minutes per
    circuit, circuits open at once per peer, reservations (the daemon applies that one in all, per peer and per IP)."""
    return {"relayMaxReservations": int(reservations), "relayMaxCircuits": int(circuits),
            "relayDataLimit": int(circuit_mb * 2**20), "relayTimeLimit": f"{max(1, round(circuit_minutes * 60))}s"}


def _reachability_options(reachability: str | None, peers: Sequence[str], limits: dict | None = None) -> dict:
    """hivemind's ``P2P.create`` passes ``force_reachability`` on as daemon flags from a class table; gpunet's entries
    there carry the relay flags hivemind has no parameter for (static relays, relay limits). ``limits``: the relay
    flags of a node that relays (default :data:`RELAY_LIMITS`)."""
    from hivemind.p2p import P2P

    if reachability is None:
        if not limits:
            return {}
        P2P.FORCE_REACHABILITY_MAPPING["gpunet-relaying"] = dict(limits)  # AutoNAT decides; if public, these limits
        return {"force_reachability": "gpunet-relaying"}
    if reachability == "public":
        P2P.FORCE_REACHABILITY_MAPPING["gpunet-public"] = {"forceReachabilityPublic": 1, **(limits or RELAY_LIMITS)}
        return {"force_reachability": "gpunet-public"}
    if reachability == "no-relay":
        # A node that does not relay for others (a worker without --relay-service) but still dials peers behind NAT
        # through their relays (sessions push to the next span's worker, programs come from holders): the relay
        # transport stays, the configured relay service is off, and the daemon's own always-on relay (libp2p's
        # defaults) is shut out by RPC.refuse_relaying once the node is up.
        P2P.FORCE_REACHABILITY_MAPPING["gpunet-no-relay"] = {"relayService": 0}
        return {"force_reachability": "gpunet-no-relay"}
    if reachability == "private":
        if not peers:
            raise ConfigError("a node behind NAT needs initial peers to relay for it")
        # Static relays (the initial peers), no discovery: discovery waits for four candidates or three minutes.
        P2P.FORCE_REACHABILITY_MAPPING["gpunet-private"] = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
        return {"force_reachability": "gpunet-private", "use_auto_relay": True, "trusted_relays": list(peers)}
    raise ConfigError(f"unknown reachability mode {reachability!r}")


def _check_ports_free(maddrs: Iterable[str]) -> None:
    """Refuse a fixed listen port that something already holds. The p2p daemon listens with SO_REUSEPORT, so a second
    node on the same port would start "fine" and then share the port's connections with the first at random."""
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] in ("", "0"):
            continue
        family = socket.AF_INET if parts[1] == "ip4" else socket.AF_INET6
        if not parts[4].isdigit() or not 0 < int(parts[4]) < 65536:
            raise ConfigError(f"listen address {maddr}: {parts[4]!r} is not a TCP port")
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT is no conflict
            try:
                probe.bind((parts[2], int(parts[4])))
            except OSError as e:
                raise ConfigError(f"cannot listen on {maddr}: {e.strerror} (is another gpunet node already using "
                                  "that port? pick another, or /tcp/0 for any free one)") from None


def check_local_ports_free(**ports: int) -> None:
    """Refuse, before joining, a local service port (``dashboard_port=8470``) something already holds: found after
    the join, the worker would leave again having been listed for nothing."""
    for name, port in ports.items():
        if port:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError as e:
                    raise ConfigError(f"--{name.replace('_', '-')} {port}: cannot listen on it ({e.strerror})") from None


def join_as_client(network: str, initial_peers: Sequence[str] | None, identity: Identity | None = None
                   ) -> DHT:
    """Join ``network`` to use it, not to serve it: a DHT client that stores no records for others and listens on
    loopback alone (others never dial a client; it dials them)."""
    return join(network, initial_peers, identity=identity, client_mode=True, host_maddrs=[LOOPBACK_MADDR])


def visible_maddrs(dht: DHT, latest: bool = False) -> list[str]:
    """Addresses others can dial: relayed ones first (a node behind NAT has no other), loopback last (only useful
    on this machine). ``latest``: ask the daemon (relay reservations come and go) instead of its first answer."""
    addrs = [str(m) for m in dht.get_visible_maddrs(latest=latest)]
    return sorted(addrs, key=lambda a: (a.startswith("/ip4/127.") or a.startswith("/ip6/::1"), "/p2p-circuit" not in a))


async def _exit_with_parent(_dht: DHT, node, parent_pid: int, period: float = 1.0) -> None:
    """Runs inside the DHT process: if the node's owner dies (even by SIGKILL), stop the DHT and its p2p daemon too,
    so a killed worker leaves no orphan serving a stale identity.

    First it restores SIGTERM's default here: the DHT process is forked from its owner and inherits the owner's
    Python-level handlers, which in this process would only set a flag nobody reads, so hivemind's own
    ``terminate()`` at shutdown (and ``systemctl stop``) could not stop it. (hivemind ignores SIGINT here on purpose:
    the owner decides when its DHT stops.)"""
    import asyncio

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while os.getppid() == parent_pid:
        await asyncio.sleep(period)
    try:
        await asyncio.wait_for(node.shutdown(), timeout=5)
    finally:
        # A shutdown that timed out (a loaded machine) would leave the p2p daemon running after us, forever, with
        # the node's identity: it is our child, so we stop it ourselves.
        daemon = getattr(getattr(node, "p2p", None), "_child", None)
        if daemon is not None and daemon.returncode is None:
            try:
                daemon.kill()
            except ProcessLookupError:
                pass
        os._exit(0)


def _tie_to_this_process(dht: DHT) -> None:
    """Make the DHT child process (and its daemon) exit when this process dies, however it dies."""
    dht.run_coroutine(partial(_exit_with_parent, parent_pid=os.getpid()), return_future=True)


#: How often a node left with no DHT peer at all looks for its initial peers again.
REJOIN_PERIOD = 10.0


async def _rejoin_when_alone(_dht: DHT, node, initial_peers: Sequence[str], period: float) -> None:
    """Runs inside the DHT process. hivemind drops a peer from its routing table when it fails to answer, and meets
    peers only by talking to them: a node whose every peer went away for a while (its only bootstrap restarted) would
    stay alone for good, publishing its records to nobody. When the table is empty, dial and ping the initial peers
    again (a ping adds the peer on both sides) and look up the node's own neighbourhood, as joining did."""
    import asyncio

    from hivemind.p2p import PeerID

    peers = []
    for addr in initial_peers:  # the peer is the last /p2p/ (before it, a relay's circuit is how to reach it)
        where, _, peer = str(addr).rpartition("/p2p/")
        try:
            peers.append((PeerID.from_base58(peer), Multiaddr(where)))
        except Exception as e:  # one the daemon took but this cannot dial again: the others still can
            logger.debug("Initial peer %s cannot be dialled again: %s", addr, e)
    alone_since = None
    while node.is_alive:
        await asyncio.sleep(period)
        try:
            if node.protocol.routing_table.uid_to_peer_id:
                alone_since = None
                continue
            if alone_since is None:
                alone_since = asyncio.get_running_loop().time()
                logger.warning("This node has no DHT peer left; asking its initial peers again every %.0f s", period)
            answered = await asyncio.gather(*(_dial_and_ping(node, peer_id, maddr) for peer_id, maddr in peers))
            if any(answered):
                await asyncio.sleep(0)  # the ping's routing-table update is a task of its own
                await node.find_nearest_nodes([node.node_id])
                logger.warning("Joined the network again through an initial peer (after %.0f s alone)",
                               asyncio.get_running_loop().time() - alone_since)
                alone_since = None
        except Exception as e:  # the next look may work: this watch must not end for good
            logger.debug("Looking for initial peers again failed: %s", e)


async def _dial_and_ping(node, peer_id, maddr) -> bool:
    from gpunet.rpc import dial

    try:  # the daemon may have forgotten the address of a peer it lost
        await dial(node.p2p, peer_id, [maddr])
    except Exception:
        return False  # not back yet
    return await node.protocol.call_ping(peer_id) is not None
