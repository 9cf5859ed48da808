"""The one adapter between gpunet and hivemind's p2p layer: serve doors, call them, open streams.

hivemind's public ``P2P`` offers binary stream handlers; its unary handlers (one request, one reply over the daemon's
persistent connection, no stream set-up) live on the private ``P2P._client``. This module is the only code that
touches those internals, so a hivemind upgrade changes one file. Transport failures (the daemon's generic errors,
``ConnectionError``, ``OSError``) become :class:`~gpunet.errors.NetworkError` here, at the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Awaitable, Callable, Iterable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings import control as _daemon_control
from hivemind.p2p.p2p_daemon_bindings.utils import DEFAULT_MAX_BITS
from hivemind.p2p.p2p_daemon_bindings.utils import write_pbmsg as _hivemind_write_pbmsg
from hivemind.utils.multiaddr import Multiaddr

from gpunet import protocol
from gpunet.errors import LocalNetworkDown, NetworkError, ProtocolError
from gpunet.protocol import Door, Message
from gpunet.utils import LRU, host_of

UnaryHandler = Callable[[bytes, str], Awaitable[bytes]]  # (request body, caller's peer id) -> reply body
# (caller's peer id, reader, writer, caller's network address: "/ip4/1.2.3.4", or a relay's circuit address)
StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]


#: The circuit relay v2 protocol peers reserve slots and open circuits on (go-libp2p's relay service serves it).
HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"

#: Seconds a request waits for the first request to the same peer to connect before it dials anyway.
FIRST_CONTACT_WAIT = 10.0


def quiet_lost_daemon(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """An event loop exception handler. hivemind's daemon client leaves a background write task failing with
    ConnectionError when the daemon dies (at a group-wide Ctrl-C, every time): expected then, so logged at debug, not
    as a traceback."""
    if isinstance(context.get("exception"), ConnectionError):
        logging.getLogger("gpunet").debug("p2p daemon connection lost: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


async def _write_pbmsg_whole(stream: asyncio.StreamWriter, pbmsg) -> None:
    """hivemind's ``write_pbmsg``, in one write: its own writes each byte of the length prefix separately, each
    followed by a drain, so every message to or from the p2p daemon (each unary call, each reply) took a write per
    prefix byte plus one (three for most), each of which could wake the daemon."""
    size = pbmsg.ByteSize()
    if size >= 1 << DEFAULT_MAX_BITS:
        raise ValueError(f"integer too large: {size}")
    prefix = bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        prefix.append(byte | (0x80 if size else 0))
        if not size:
            break
    stream.write(bytes(prefix) + pbmsg.SerializeToString())
    await stream.drain()


if _daemon_control.write_pbmsg is _hivemind_write_pbmsg:  # the daemon client's every write goes through this name
    _daemon_control.write_pbmsg = _write_pbmsg_whole  # (a hivemind that changed it is left as it is)


@functools.lru_cache(maxsize=4096)
def peer(peer_id: str) -> PeerID:
    return PeerID.from_base58(peer_id)



async def dial(p2p: P2P, peer_id: PeerID, maddrs: Iterable[Multiaddr]) -> None:
    """Have the daemon connect to ``peer_id`` at ``maddrs`` (it forgets the addresses of a peer it lost a while ago)."""
    await p2p._client.connect(peer_id, list(maddrs))


async def connections(p2p: P2P) -> list[tuple[str, str]]:
    """(peer id, remote address) of each connection the daemon holds now (a peer may have more than one; a relayed
    one's address ends in ``/p2p-circuit``)."""
    return [(info.peer_id.to_base58(), str(addr)) for info in await p2p._client.list_peers() for addr in info.addrs]


async def disconnect(p2p: P2P, peer_id: PeerID) -> None:
    """Have the daemon close every connection to ``peer_id`` (streams on them end)."""
    await p2p._client.disconnect(peer_id)


class RPC:
    """gpunet's doors on one node's p2p replica (``await dht.replicate_p2p()``), for one network name."""

    def __init__(self, p2p: P2P, network: str):
        self.p2p = p2p
        self.network = network
        self._served: list[Door] = []
        self._met: LRU[str, bool] = LRU(4096)  # peers we have reached at least once
        self._meeting: LRU[str, asyncio.Lock] = LRU(4096)

    @contextlib.asynccontextmanager
    async def _first_contact(self, peer_id: str):
        """The first request to a peer goes alone; the rest wait for it (up to :data:`FIRST_CONTACT_WAIT`, so a first
        request that hangs holds nobody up for long). Many at once would each dial, and through a relay each dial is a
        circuit of its own: the relay's per-peer circuit limit, and the daemon closing the duplicate connections,
        then reset streams already running on them."""
        if peer_id in self._met:
            yield
            return
        lock = self._meeting.get(peer_id)
        if lock is None:
            lock = asyncio.Lock()
            self._meeting.put(peer_id, lock)
        try:
            await asyncio.wait_for(lock.acquire(), FIRST_CONTACT_WAIT)
        except asyncio.TimeoutError:
            yield
            return
        try:
            yield
            self._met.put(peer_id, True)
        finally:
            lock.release()

    # --- serving ---------------------------------------------------------------------------------------------------

    async def serve_unary(self, door: Door, handler: UnaryHandler) -> None:
        async def adapted(request: bytes, remote: PeerID) -> bytes:
            if len(request) > door.max_request:  # refused before any of it is parsed
                error = ProtocolError(f"{door.slug} request of {len(request)} bytes; the limit is {door.max_request}")
                return protocol.encode(protocol.Error.of(error))
            return await handler(request, remote.to_base58())

        await self.p2p._client.add_unary_handler(door.protocol(self.network), adapted)
        self._served.append(door)

    async def serve_stream(self, door: Door, handler: StreamHandler, exact_address: bool = False) -> None:
        """``handler(peer_id, reader, writer, host)``: ``host`` is what limits count per (:func:`host_of`), or with
        ``exact_address`` the caller's whole address (a dial-back needs the IPv6 address, not its /64)."""
        async def adapted(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handler(info.peer_id.to_base58(), reader, writer,
                          str(info.addr) if exact_address else host_of(info.addr))

        await self.p2p.add_binary_stream_handler(door.protocol(self.network), adapted)
        self._served.append(door)

    async def refuse_relaying(self) -> None:
        """Stop this node's p2p daemon relaying for anyone: every reservation and circuit asked of it is refused.

        hivemind's p2pd always starts libp2p's relay service (128 KiB and 2 minutes per circuit, but nothing bounds
        how often a circuit is opened again: one stranger pushed 1.9 MB/s per stream through a worker that way) and
        has no flag to leave it out. A handler registered through the daemon replaces the relay's own on its protocol,
        so every ask reaches this one, which closes it unanswered. Dialling others through their relays is
        untouched (that is the relay's other protocol, on the relaying node)."""

        async def refuse(_info, _reader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        await self.p2p.add_binary_stream_handler(HOP_PROTOCOL, refuse)

    async def daemon_alive(self, timeout: float = 1.0) -> bool:
        """Whether the p2p daemon still accepts control connections. A signal to the whole process group (Ctrl-C in a
        terminal, ``systemctl stop``) kills it at the same moment as us; a request to a dead daemon would never end."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.p2p.daemon_listen_maddr["unix"]),
                                               timeout)
        except (OSError, asyncio.TimeoutError, TypeError, ValueError):
            return False
        writer.close()
        return True

    async def close(self) -> None:
        """Stop serving every door, then close this replica's connections to the daemon (not the daemon itself)."""
        if not await self.daemon_alive():
            self._served.clear()  # nothing to unregister from, and asking would wait forever
        for door in self._served:
            try:
                if door.stream:
                    await self.p2p.remove_binary_stream_handler(door.protocol(self.network))
                else:
                    await self.p2p._client.remove_unary_handler(door.protocol(self.network))
            except Exception:  # the daemon may already be gone at shutdown
                pass
        self._served.clear()
        await self.p2p.shutdown()

    # --- calling ---------------------------------------------------------------------------------------------------

    async def call(self, peer_id: str, door: Door, message: Message, *expect: type[protocol.M]) -> protocol.M:
        """One unary round trip; the reply parsed as one of ``expect`` (ProtocolError otherwise)."""
        return protocol.decode(await self.call_raw(peer_id, door, protocol.encode(message)), *expect)

    async def call_raw(self, peer_id: str, door: Door, body: bytes) -> bytes:
        try:
            async with self._first_contact(peer_id):
                return await self.p2p._client.call_unary_handler(peer(peer_id), door.protocol(self.network), body)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the daemon reports an unreachable peer or a dead handler as a generic error
            raise await self.failure(f"worker {peer_id[-8:]} did not answer ({door.slug}): {e}") from None

    async def open(self, peer_id: str, door: Door, maddrs: Iterable[str] = ()
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to ``peer_id``; dials its advertised addresses if the daemon does not know the peer yet."""
        maddrs = list(maddrs)
        name = door.protocol(self.network)
        try:
            async with self._first_contact(peer_id):
                _, reader, writer = await self.p2p.call_binary_stream_handler(peer(peer_id), name)
            return reader, writer
        except asyncio.CancelledError:
            raise
        except Exception as e:
            first = e
            if not maddrs:
                raise await self.failure(f"cannot reach worker {peer_id[-8:]}: {first}") from None
        # A relayed address (.../p2p/RELAY/p2p-circuit/p2p/ID) is left to the daemon, which finds the peer's relays
        # through its own routing (the first try above); cut at "/p2p/" it would name the relay, not the peer.
        direct = [Multiaddr(m.split("/p2p/")[0]) for m in maddrs if "/p2p-circuit" not in m]
        if not direct:
            raise NetworkError(f"cannot reach worker {peer_id[-8:]} (through its relays): {first}") from None
        try:
            await self.p2p._client.connect(peer(peer_id), direct)
            _, reader, writer = await self.p2p.call_binary_stream_handler(peer(peer_id), name)
            return reader, writer
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise await self.failure(f"cannot reach worker {peer_id[-8:]}: {e}") from None

    async def failure(self, message: str) -> NetworkError:
        """The error for a failed call: the peer's (NetworkError), unless our own daemon is gone (LocalNetworkDown:
        a Ctrl-C to the process group stops it with us, and no peer may be blamed for that). Gone means its socket
        is, or refuses us: a slow answer (this loop stalled, the daemon busy) is no proof of that."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.p2p.daemon_listen_maddr["unix"]), 2.0)
        except (FileNotFoundError, ConnectionRefusedError):
            gone = True
        except (OSError, asyncio.TimeoutError, TypeError, ValueError):
            gone = False
        else:
            writer.close()
            gone = False
        if gone:
            return LocalNetworkDown("this node's own p2p daemon is gone (stopped with it by a Ctrl-C to the process "
                                    "group?): nothing can be sent")
        return NetworkError(message)

    # --- small requests both sides use -------------------------------------------------------------------------------

    async def ping(self, peer_id: str, echo: bytes = b"") -> protocol.Pong:
        """One unary round trip to a worker: its clock and our bytes echoed back."""
        return await self.call(peer_id, Door.PING, protocol.Ping(echo), protocol.Pong)

    async def info(self, peer_id: str, maddrs: Iterable[str] = ()) -> protocol.Info:
        """A worker's live record and clock, straight from the worker."""
        reader, writer = await self.open(peer_id, Door.INFO, maddrs)
        try:
            await protocol.write(writer, protocol.GetInfo())
            return await protocol.read(reader, protocol.Info, timeout=protocol.FRAME_TIMEOUT)
        finally:
            writer.close()


#: How long a peer whose kept-stream door could not be opened, but whose unary twin answered (an older version), is
#: sent that door's exchanges by the unary door.
NO_DOOR_SECONDS = 300.0


class KeptStreams:
    """Streams to peers on one door, kept open between exchanges (a request frame, its answer; repeated): a stream
    costs the p2p daemons a set-up each time (a unary call does too), a frame on one already open about a fifth of the
    CPU (0.15 against 0.8 ms a round trip, two daemons on one machine). At most ``per_peer`` idle streams are kept
    per peer, each reused for ``reuse`` seconds: less than the serving side's idle timeout, so nothing is written to
    a stream it is closing; one it closed all the same (it restarted, it was full) costs the exchange a second try
    on a new stream."""

    def __init__(self, rpc: RPC, door: Door, reuse: float, per_peer: int = 4, most: int = 64):
        """``most``: idle streams kept in all (each holds a socket of the daemon's); past it the oldest is closed."""
        self.rpc, self.door, self.reuse, self.per_peer, self.most = rpc, door, reuse, per_peer, most
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self._no_door: LRU[str, float] = LRU(4096)  # peers without this door, until when
        self._closed = False

    async def exchange_or(self, peer_id: str, maddrs: Iterable[str], message: Message,
                          answer: Callable[[asyncio.StreamReader], Awaitable], unary: Callable[[], Awaitable]):
        """``message`` over a kept stream (what ``answer`` reads back), or by ``unary()``, the same exchange on the
        door's unary twin: when it is too big for a frame, or the peer has no such door. A peer whose stream cannot
        be opened is taken for one without it for NO_DOOR_SECONDS, unless the unary call fails too (then it is gone,
        and may come back with one)."""
        try:
            frame = protocol.encode_frame(message)
        except ProtocolError:  # too big for a frame
            return await unary()
        if time.monotonic() < self._no_door.get(peer_id, 0.0):
            return await unary()
        try:
            return await self.exchange(peer_id, maddrs, frame, answer)
        except NetworkError as e:
            if isinstance(e, (ProtocolError, LocalNetworkDown)):  # a stream that broke, or our own daemon gone
                raise
        self._no_door.put(peer_id, time.monotonic() + NO_DOOR_SECONDS)
        try:
            return await unary()
        except NetworkError:
            self._no_door.pop(peer_id, None)
            raise

    async def exchange(self, peer_id: str, maddrs: Iterable[str], frame: bytes,
                       answer: Callable[[asyncio.StreamReader], Awaitable]):
        """Write ``frame`` on a stream to ``peer_id`` and return what ``answer`` reads from it. A stream that fails
        is closed (half read or written, it is no use to the next exchange); NetworkError when none can be opened."""
        for fresh in (False, True):
            stream = None if fresh else self._take(peer_id)
            if stream is None:
                stream, fresh = await self.rpc.open(peer_id, self.door, maddrs), True
            reader, writer = stream
            try:
                writer.write(frame)
                await writer.drain()
                result = await answer(reader)
            except BaseException as e:
                writer.close()
                broke = isinstance(e, (ProtocolError, ConnectionError, OSError))
                if broke and not fresh:
                    continue  # an idle stream the peer had closed: once more, on a new one
                if broke and not isinstance(e, ProtocolError):
                    raise ProtocolError(f"stream to {peer_id[-8:]} broke: {e}") from None
                raise
            self._keep(peer_id, reader, writer)
            return result
        raise AssertionError("unreachable")

    def idle(self, peer_id: str) -> int:
        """Streams to ``peer_id`` open and idle now."""
        return len(self._idle.get(peer_id, ()))

    def close(self) -> None:
        """Close the idle streams; those in an exchange now are closed when it ends."""
        self._closed = True
        for streams in self._idle.values():
            for _, writer, _ in streams:
                writer.close()
        self._idle.clear()

    def _take(self, peer_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        streams = self._idle.get(peer_id)
        while streams:
            reader, writer, used = streams.pop()
            if time.monotonic() - used < self.reuse and not reader.at_eof():
                return reader, writer
            writer.close()
        self._idle.pop(peer_id, None)
        return None

    def _keep(self, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        now = time.monotonic()
        if self._closed:
            writer.close()
            return
        streams = self._idle.setdefault(peer_id, [])
        if len(streams) >= self.per_peer or reader.at_eof():
            writer.close()
            return
        streams.append((reader, writer, now))
        self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close the idle streams past their reuse, and the oldest past ``most`` in all."""
        kept = sorted(((entry[2], peer, entry) for peer, idle in self._idle.items() for entry in idle),
                      key=lambda k: k[0])
        excess = len(kept) - self.most
        for i, (used, peer, entry) in enumerate(kept):
            if i < excess or now - used >= self.reuse:
                self._idle[peer].remove(entry)
                entry[1].close()
        for peer in [p for p, idle in self._idle.items() if not idle]:
            del self._idle[peer]
