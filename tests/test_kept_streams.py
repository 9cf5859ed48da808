"""Streams kept open between exchanges (gpunet.rpc.KeptStreams), over real sockets: reused while fresh, replaced
once when the peer closed one, bounded per peer and in all."""

import asyncio

import pytest

from gpunet import protocol
from gpunet.protocol import Door, Ok, Ping, ProtocolError
from gpunet.rpc import KeptStreams


class LoopbackRPC:
    """Opens a TCP connection to a local server for each stream (the p2p daemon's part, without the daemon)."""

    def __init__(self, port: int):
        self.port, self.opened = port, 0

    async def open(self, peer_id, door, maddrs=()):
        self.opened += 1
        return await asyncio.open_connection("127.0.0.1", self.port)


async def _server(close_after: int | None = None):
    """Answers each Ping frame with Ok; closes a connection after ``close_after`` answers."""
    async def serve(reader, writer):
        answered = 0
        try:
            while close_after is None or answered < close_after:
                await protocol.read(reader, Ping, timeout=5)
                await protocol.write(writer, Ok())
                answered += 1
        except ProtocolError:
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _ask(kept, peer="peer"):
    return kept.exchange(peer, (), protocol.encode_frame(Ping(b"x")), lambda r: protocol.read(r, Ok, timeout=5))


def test_exchanges_share_one_stream_while_it_is_fresh():
    async def scenario():
        server, port = await _server()
        rpc = LoopbackRPC(port)
        kept = KeptStreams(rpc, Door.STEPS, reuse=30.0)
        for _ in range(5):
            assert isinstance(await _ask(kept), Ok)
        assert rpc.opened == 1 and kept.idle("peer") == 1
        kept.reuse = 0.0  # past its reuse: a new one
        assert isinstance(await _ask(kept), Ok)
        assert rpc.opened == 2
        kept.close()
        server.close()

    asyncio.run(scenario())


def test_a_stream_the_peer_closed_costs_one_more_try_on_a_new_one():
    async def scenario():
        server, port = await _server(close_after=1)  # the peer closes every stream after one answer
        rpc = LoopbackRPC(port)
        kept = KeptStreams(rpc, Door.STEPS, reuse=30.0)
        await _ask(kept)
        await asyncio.sleep(0)  # (the close may or may not have reached us: either way the next exchange works)
        for _ in range(3):
            assert isinstance(await _ask(kept), Ok)
        assert rpc.opened == 4
        kept.close()
        server.close()

    asyncio.run(scenario())


def test_a_fresh_stream_that_fails_raises_and_nothing_is_kept():
    async def scenario():
        server, port = await _server(close_after=0)  # closes at once, unanswered
        kept = KeptStreams(LoopbackRPC(port), Door.STEPS, reuse=30.0)
        with pytest.raises(ProtocolError):
            await _ask(kept)
        assert kept.idle("peer") == 0
        server.close()

    asyncio.run(scenario())


def test_idle_streams_are_bounded_per_peer_and_in_all():
    async def scenario():
        server, port = await _server()
        kept = KeptStreams(LoopbackRPC(port), Door.STEPS, reuse=30.0, per_peer=2, most=3)
        for peer in ("a", "b"):
            await asyncio.gather(*(_ask(kept, peer) for _ in range(4)))  # four at once: four streams
        assert kept.idle("a") + kept.idle("b") == 3  # two each at most, three in all: a's oldest went
        assert kept.idle("b") == 2
        kept.close()
        assert kept.idle("a") == kept.idle("b") == 0
        server.close()

    asyncio.run(scenario())
