"""Can others dial this node? Asked of a peer, not guessed: the peer opens fresh TCP connections back to us.

Most volunteers sit behind a home router. A node learns its reachability by asking a peer it is connected to (its
initial peers first) to dial it back: the peer opens a new TCP connection to each of our listen ports at the address
it sees us coming from, and says which got through (:class:`~gpunet.protocol.CheckReach` on the ``reach`` door, which
every node serves). From the answer:

* ``direct``: some port got through, so peers can dial us;
* ``relayed``: none did; the worker then runs its p2p daemon in relay-client mode (libp2p circuit relay v2: it keeps
  reservations on its initial peers, which relay for it, and announces the relayed addresses), see
  :func:`gpunet.dht.network.join`;
* ``unknown``: no peer could be asked (the first node of a network) or none answered;
* ``unreachable``: behind NAT with no relay holding a reservation for it right now: routing sends it nothing.

A dial-back goes only to the address the request came from, so the door cannot be used to make a node connect to
anyone else; checks are rationed per caller and in all (a caller turned away hears "busy", never "unreachable").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Iterable, Sequence

from gpunet import protocol
from gpunet.errors import GpunetError, WorkerBusy
from gpunet.protocol import CheckReach, Door, Error, ReachResult
from gpunet.utils import LRU, host_of

logger = logging.getLogger(__name__)

DIRECT, RELAYED, UNKNOWN, UNREACHABLE = "direct", "relayed", "unknown", "unreachable"
DIAL_TIMEOUT = 3.0
#: A caller (identity at an address) gets one check per this many seconds, and a node runs this many at once: a
#: dial-back costs it a few connections. A caller turned away hears "busy" and asks again; it never reads that as
#: "unreachable" (several nodes behind one address start together often: a home, a test on 127.0.0.1).
CHECK_INTERVAL = 5.0
#: Seconds a node behind NAT (a worker, or `gpunet doctor` trying as one) waits for its first relay reservation
#: before it says it has none: go-libp2p's auto-relay books one on the static relays within seconds, a loaded
#: machine in tens of them.
RELAY_WAIT = 30.0
#: Fresh p2p daemons it asks with, RELAY_WAIT each: after one reservation attempt that failed (timed out on a loaded
#: machine: CI saw it), go-libp2p's auto-relay leaves that relay alone for a long while (its backoff), where a new
#: daemon asks again at once.
RELAY_TRIES = 2
MAX_CHECKS_AT_ONCE = 8
BUSY_RETRIES = 3
#: Further tries of a peer that could not be asked at all (not serving the door yet, no answer in time).
FAILED_RETRIES = 2


def tcp_ports(maddrs: Iterable[str]) -> list[int]:
    """The TCP ports of our own listen addresses (loopback and relayed ones aside), at most a few."""
    ports = []
    for m in maddrs:
        parts = str(m).split("/")
        if "p2p-circuit" in parts or len(parts) < 5 or parts[3] != "tcp" or not parts[4].isdigit():
            continue
        if int(parts[4]) not in ports:
            ports.append(int(parts[4]))
    return ports[:protocol.MAX_REACH_PORTS]


def is_relayed(maddr: str) -> bool:
    return "/p2p-circuit" in str(maddr)


class ReachService:
    """The ``reach`` door: dial the caller back on the ports it names, at the address it came from."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: LRU[tuple[str, str], float] = LRU(10_000)
        self._running = 0

    async def start(self, rpc) -> None:
        await rpc.serve_stream(Door.REACH, self.handle, exact_address=True)

    async def handle(self, peer_id: str, reader, writer, address: str = "") -> None:
        """``address``: the caller's whole multiaddr as our daemon sees it (``/ip4/1.2.3.4/tcp/5``)."""
        try:
            request = await protocol.read(reader, CheckReach, timeout=protocol.FRAME_TIMEOUT)
            ip = _ip_of(address)
            host = host_of(address)  # rationed per address (an IPv6 caller per /64), like every other door
            now = self.clock()
            last = self._last.get((host, peer_id))
            if ip is not None and (self._running >= MAX_CHECKS_AT_ONCE
                                   or last is not None and now - last < CHECK_INTERVAL):
                await protocol.write(writer, Error.of(WorkerBusy("too many reachability checks now; ask again")))
                return
            open_ports: tuple[int, ...] = ()  # a relayed caller cannot be dialled back at all
            if ip is not None:
                self._last.put((host, peer_id), now)
                self._running += 1
                try:
                    results = await asyncio.gather(*(_dials(ip, port) for port in request.ports))
                finally:
                    self._running -= 1
                open_ports = tuple(p for p, ok in zip(request.ports, results) if ok)
            observed = f"/{address.split('/')[1]}/{ip}" if ip is not None else "/p2p-circuit"
            await protocol.write(writer, ReachResult(observed, open_ports))
        except GpunetError as e:
            logger.debug("reachability check from %s failed: %s", peer_id[-8:], e)
        finally:
            writer.close()


async def ask(rpc, peer_id: str, ports: Sequence[int], maddrs: Sequence[str] = ()) -> ReachResult:
    """Ask ``peer_id`` to dial us back on ``ports``; raises GpunetError if it cannot be asked."""
    reader, writer = await rpc.open(peer_id, Door.REACH, maddrs)
    try:
        await protocol.write(writer, CheckReach(tuple(ports)))
        reply = await protocol.read(reader, ReachResult, Error,
                                    timeout=DIAL_TIMEOUT * len(ports) + protocol.FRAME_TIMEOUT)
        if isinstance(reply, Error):
            raise reply.exception()
        return reply
    finally:
        writer.close()


async def check(rpc, peers: Sequence[str], own_maddrs: Sequence[str]) -> tuple[str, ReachResult | None]:
    """Our reachability, asking each of ``peers`` (multiaddrs ending in /p2p/ID) in turn until one answers."""
    ports = tcp_ports(own_maddrs)
    if not ports:
        return UNKNOWN, None
    for maddr in peers:
        peer_id = str(maddr).rsplit("/p2p/", 1)[-1]
        failures = 0
        for attempt in range(BUSY_RETRIES + FAILED_RETRIES + 1):
            try:
                result = await asyncio.wait_for(ask(rpc, peer_id, ports, [maddr]), DIAL_TIMEOUT * len(ports) + 15)
            except WorkerBusy:
                await asyncio.sleep(1.0 + attempt * CHECK_INTERVAL / 2)
                continue
            except (GpunetError, asyncio.TimeoutError) as e:
                # A peer just started may not serve the door yet, or be too loaded to answer in time: ask again.
                failures += 1
                logger.debug("Could not ask %s to dial us back (try %d): %r", peer_id[-8:], failures, e)
                if failures > FAILED_RETRIES:
                    break
                await asyncio.sleep(failures * 2.0)
                continue
            return (DIRECT if result.open else RELAYED), result
    return UNKNOWN, None


#: Bytes a relay self-test sends through the relay: past the 128 KiB a limited relay allows per circuit.
PROBE_BYTES = 512 * 1024


async def relay_works(relay: str, network: str, timeout: float = 20.0) -> bool:
    """Whether the node at ``relay`` relays real traffic: two throw-away daemons on this machine, one reachable only
    through the relay, send :data:`PROBE_BYTES` across it.

    Why a bootstrap node asks this of itself: its p2p daemon (hivemind's p2pd) starts two relay services, one with
    the limits it was given and one with libp2p's defaults for a *limited* relay (128 KiB and 2 minutes per circuit,
    meant only for hole punching), and whichever registers last serves. Which one that is varies from start to start;
    with the limited one, every job through the relay beyond a few small ones would be cut off."""
    from hivemind.p2p import P2P

    from gpunet.dht import network as net
    from gpunet.rpc import RPC

    hidden = await P2P.create(initial_peers=[relay], no_listen=True, **net._reachability_options("private", [relay]))
    caller = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    got = asyncio.get_running_loop().create_future()

    async def count(peer_id: str, reader, writer, host: str = "") -> None:
        total = 0
        while total < PROBE_BYTES:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            total += len(chunk)
        writer.write(total.to_bytes(8, "big"))
        await writer.drain()
        writer.close()

    try:
        async with asyncio.timeout(timeout):
            hidden_rpc, caller_rpc = RPC(hidden, network), RPC(caller, network)
            await hidden_rpc.serve_stream(Door.RELAY_PROBE, count)
            while not any(is_relayed(m) for m in map(str, await hidden.get_visible_maddrs(latest=True))):
                await asyncio.sleep(0.2)
            reader, writer = await caller_rpc.open(hidden.peer_id.to_base58(), Door.RELAY_PROBE)
            block = bytes(1 << 16)
            for _ in range(PROBE_BYTES // len(block)):
                writer.write(block)
                await writer.drain()
            got.set_result(int.from_bytes(await reader.readexactly(8), "big"))
            writer.close()
            return got.result() == PROBE_BYTES
    except (Exception, TimeoutError) as e:  # a reset circuit, or no reservation at all
        logger.debug("relay self-test through %s failed: %s", relay, e)
        return False
    finally:
        for p2p in (hidden, caller):
            await p2p.shutdown()


def _ip_of(address: str) -> str | None:
    """The IP address to dial back (None for a relayed caller: it cannot be dialled back at all)."""
    parts = address.split("/")
    if len(parts) >= 3 and parts[1] in ("ip4", "ip6") and "p2p-circuit" not in address:
        return parts[2]
    return None


async def _dials(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
