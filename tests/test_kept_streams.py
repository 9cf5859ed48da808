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


def test_a_kept_stream_may_wait_for_a_frame_but_the_frame_must_then_come_whole_in_time():
    async def scenario():
        quiet = asyncio.StreamReader()
        with pytest.raises(ProtocolError, match="nothing for 0 s"):  # nothing begun within ``idle``
            await protocol.read(quiet, Ping, timeout=5, idle=0.05)
        dribbled = asyncio.StreamReader()
        frame = protocol.encode_frame(Ping(b"x"))
        dribbled.feed_data(frame[:6])  # begun at once, then the rest never comes
        with pytest.raises(ProtocolError, match="nothing for 0 s"):
            await protocol.read(dribbled, Ping, timeout=0.05, idle=5)
        whole = asyncio.StreamReader()
        whole.feed_data(frame)
        assert (await protocol.read(whole, Ping, timeout=0.05, idle=5)).echo == b"x"

    asyncio.run(scenario())


def test_a_push_too_big_for_a_frame_goes_by_the_push_door_and_a_small_one_by_a_kept_stream():
    from gpunet.protocol import MAX_FRAME_BYTES, Push
    from gpunet.worker.handoff import Handoff

    class Calls:
        def __init__(self):
            self.doors = []

        async def call(self, peer_id, door, message, *expect):
            self.doors.append(door)
            return Ok()

        async def open(self, peer_id, door, maddrs=()):
            self.doors.append(door)
            raise AssertionError("not reached in this test: the exchange is stubbed")

    async def scenario():
        rpc = Calls()
        handoff = Handoff("me", sessions=None, pushes=None, limits=None)
        handoff.start(rpc)
        exchanged = []

        async def exchange(peer_id, maddrs, frame, answer):
            exchanged.append(len(frame))
            return Ok()

        handoff.streams.exchange = exchange
        big = Push("12D3KooWclient", "s", 1, b"x" * (MAX_FRAME_BYTES + 1))
        assert isinstance(await handoff._sent("12D3KooWnext", big), Ok)
        assert rpc.doors == [Door.PUSH] and exchanged == []
        assert isinstance(await handoff._sent("12D3KooWnext", Push("12D3KooWclient", "s", 2, b"x" * 100)), Ok)
        assert rpc.doors == [Door.PUSH] and len(exchanged) == 1

    asyncio.run(scenario())
