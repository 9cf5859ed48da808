"""The client's stream transport against scripted workers on local sockets (no p2p daemon): which copy of a program
goes where. A worker that ran a program for this client holds it, so a replica asking for that program later, even
after the first job ended and before any record says so, is told to fetch it from that worker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import pytest

from gpunet import protocol
from gpunet.client.transport import JobRequest, P2PTransport
from gpunet.ledger import Identity
from gpunet.protocol import Payload, Pieces, Result, Send, Submit
from gpunet.utils import sha256_hex
from tests._ledger_util import worker_signed

CLIENT = Identity.generate()
PROGRAM = os.urandom(300_000)


class ScriptedWorker:
    """Asks for the program (saying it can fetch it from peers), records what the client answered, returns a result."""

    def __init__(self):
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.got_program = 0  # bytes of the program the client sent it
        self.told_holders: list[str] = []
        self.told_coming: frozenset[str] = frozenset()

    falls_back = False  # told of holders, it cannot fetch from them and asks the client for the program after all

    async def handle(self, reader, writer) -> None:
        submit = await protocol.read(reader, Submit)
        await protocol.write(writer, Send(True, False, pieces=True))
        reply = await protocol.read(reader, Payload, Pieces)
        if isinstance(reply, Pieces):
            self.told_holders = [peer for peer, _ in reply.holders]
            self.told_coming = reply.coming
            await protocol.read(reader, Payload)
            if self.falls_back:
                await protocol.write(writer, Send(True, False))
                reply = await protocol.read(reader, Payload)
        if not isinstance(reply, Pieces):
            self.got_program = len(await protocol.read_payload(reader, reply.program_size, len(PROGRAM), "program"))
        receipt = worker_signed(self.identity, CLIENT, submit.job_id)
        await protocol.write(writer, Result(2, receipt.to_bytes(), b"ok"))
        writer.close()


class LocalRPC:
    """``open`` dials the scripted worker's socket instead of going through a p2p daemon."""

    def __init__(self):
        self.ports: dict[str, int] = {}

    async def open(self, peer_id, door, maddrs=()):
        return await asyncio.open_connection("127.0.0.1", self.ports[peer_id])


def _request(job_id: str) -> JobRequest:
    return JobRequest(job_id, sha256_hex(PROGRAM), PROGRAM, b"", timeout=30, max_price=None)


@contextlib.asynccontextmanager
async def _network(*workers: ScriptedWorker):
    """A client transport whose streams reach ``workers``, each served on a local socket."""
    rpc, servers = LocalRPC(), []
    try:
        for worker in workers:
            servers.append(await asyncio.start_server(worker.handle, "127.0.0.1", 0))
            rpc.ports[worker.id] = servers[-1].sockets[0].getsockname()[1]
        yield P2PTransport(dht=None, rpc=rpc)
    finally:
        for server in servers:
            server.close()


def test_a_worker_that_ran_a_program_is_named_as_its_holder_after_its_job_ended():
    async def main():
        first, second = ScriptedWorker(), ScriptedWorker()
        async with _network(first, second) as transport:
            delivery = await transport.run_stream(first.id, ["/ip4/127.0.0.1/tcp/1"], _request("a" * 32))
            delivery.close()
            assert first.got_program == len(PROGRAM)
            # The first job is over: nobody is receiving the program now, and the request names no holder.
            delivery = await transport.run_stream(second.id, ["/ip4/127.0.0.1/tcp/2"], _request("b" * 32))
            delivery.close()
            assert second.got_program == 0, "a second copy crossed the client's link"
            assert second.told_holders == [first.id]
            assert second.told_coming == {first.id}  # vouched for: worth waiting for while it serves others
            assert transport.program_bytes_sent == len(PROGRAM)

    asyncio.run(main())


def test_a_worker_that_failed_its_job_is_not_named_as_a_holder():
    class Failing(ScriptedWorker):
        async def handle(self, reader, writer) -> None:
            await protocol.read(reader, Submit)
            await protocol.write(writer, Send(True, False, pieces=True))
            reply = await protocol.read(reader, Payload, Pieces)
            self.got_program = len(await protocol.read_payload(reader, reply.program_size, len(PROGRAM), "program"))
            writer.close()  # gone before any result

    async def main():
        first, second = Failing(), ScriptedWorker()
        async with _network(first, second) as transport:
            try:
                await transport.run_stream(first.id, [], _request("a" * 32))
            except protocol.ProtocolError:
                pass
            delivery = await transport.run_stream(second.id, [], _request("b" * 32))
            delivery.close()
            assert second.got_program == len(PROGRAM) and second.told_holders == []

    asyncio.run(main())


def test_a_worker_that_ran_a_program_and_then_died_is_not_named_as_its_holder():
    """A worker that ran the program is vouched for as a holder; once the client saw it fail (a span's worker killed),
    a worker taking its place is not sent to fetch the program from it (it spent seconds dialling a dead peer)."""
    async def main():
        first, second = ScriptedWorker(), ScriptedWorker()
        async with _network(first, second) as transport:
            (await transport.run_stream(first.id, [], _request("a" * 32))).close()
            transport.forget(first.id)  # what the client does when the worker stops answering
            (await transport.run_stream(second.id, [], _request("b" * 32))).close()
            assert second.got_program == len(PROGRAM) and second.told_holders == []

    asyncio.run(main())


def test_a_worker_still_receiving_a_program_is_not_named_once_forgotten():
    """A worker the client is sending the program to is named as a holder-to-be; forgotten (it failed elsewhere, or
    its record lapsed), it is not, even while that upload is still going."""
    class Slow(ScriptedWorker):
        def __init__(self):
            super().__init__()
            self.asked, self.go_on = asyncio.Event(), asyncio.Event()

        async def handle(self, reader, writer) -> None:
            await protocol.read(reader, Submit)
            await protocol.write(writer, Send(True, False, pieces=True))
            self.asked.set()
            await self.go_on.wait()  # the program is on its way: the client lists this worker as receiving it
            reply = await protocol.read(reader, Payload, Pieces)
            self.got_program = len(await protocol.read_payload(reader, reply.program_size, len(PROGRAM), "program"))
            await protocol.write(writer, Result(2, worker_signed(self.identity, CLIENT, "a" * 32).to_bytes(), b"ok"))
            writer.close()

    async def main():
        first, second, third = Slow(), ScriptedWorker(), ScriptedWorker()
        async with _network(first, second, third) as transport:
            upload = asyncio.ensure_future(transport.run_stream(first.id, [], _request("a" * 32)))
            await first.asked.wait()
            async with asyncio.timeout(10):  # its Send answered: the client lists it as receiving the program
                while first.id not in transport._receiving.get(sha256_hex(PROGRAM), {}):
                    await asyncio.sleep(0.01)
            (await transport.run_stream(second.id, [], _request("b" * 32))).close()
            assert second.told_holders == [first.id]  # named while it receives the program
            transport.forget(first.id)
            (await transport.run_stream(third.id, [], _request("c" * 32))).close()
            assert third.told_holders == [second.id]  # second, which ran it from the pieces; not first
            first.go_on.set()
            (await upload).close()

    asyncio.run(main())


class FallbackWorker(ScriptedWorker):
    """Told of holders, it cannot fetch from them (they answered "busy"): it asks the client for the program."""

    falls_back = True


def test_holders_only_records_name_come_after_vouched_ones_and_are_dropped_once_they_did_not_deliver():
    """From an attacker's review: eight records claiming a popular program (answering "busy") took every holder
    place a worker is told of, so each fetch of it waited out its patience before asking the client."""
    sybils = [(Identity.generate().peer_id, ("/ip4/10.9.9.9/tcp/1",)) for _ in range(8)]

    async def main():
        first, second, third = FallbackWorker(), FallbackWorker(), ScriptedWorker()
        async with _network(first, second, third) as transport:
            request = dataclasses.replace(_request("a" * 32), holders=tuple(sybils))
            (await transport.run_stream(first.id, ["/ip4/127.0.0.1/tcp/1"], request)).close()
            assert first.told_holders == [peer for peer, _ in sybils] and first.got_program == len(PROGRAM)
            # first ran it: named first now; the sybils that did not deliver are not named again for a while
            request = dataclasses.replace(_request("b" * 32), holders=tuple(sybils))
            (await transport.run_stream(second.id, ["/ip4/127.0.0.1/tcp/2"], request)).close()
            assert second.told_holders == [first.id]
            request = dataclasses.replace(_request("c" * 32), holders=tuple(sybils))
            (await transport.run_stream(third.id, ["/ip4/127.0.0.1/tcp/3"], request)).close()
            assert third.told_holders[:2] == [first.id, second.id] and not set(third.told_holders) & {
                peer for peer, _ in sybils}

    asyncio.run(main())


def test_a_job_whose_answer_may_not_fit_the_unary_door_goes_by_stream_at_once():
    """The unary door carries at most 1 MiB back; a bigger answer used to come back as "use the stream", its result
    kept by the worker for the retry, and a worker keeps none over its client's share of kept results."""
    from types import SimpleNamespace

    calls = []

    class Doors(P2PTransport):
        def __init__(self):  # no network: only the choice of door is under test
            self.peer_id = None  # (proves nothing)

        async def run_unary(self, worker_id, request, settle=(), holds=None):
            calls.append(("unary", request.job_id))
            return "answer"

        async def run_stream(self, worker_id, maddrs, request, holds=None):
            calls.append(("stream", request.job_id))
            return "answer"

    from gpunet.client.settlement import Settlement

    settlement = Settlement(transport=None)  # nothing owed: nothing rides along
    worker = SimpleNamespace(id="w", record=SimpleNamespace(maddrs=()))
    small = dataclasses.replace(_request("small"), max_output_bytes=protocol.UNARY_OUTPUT_BYTES)
    big = dataclasses.replace(_request("big"), max_output_bytes=protocol.UNARY_OUTPUT_BYTES + 1)

    async def scenario():
        for request in (small, big):
            assert await Doors().submit(worker, request, cached=True, settlement=settlement) == "answer"

    asyncio.run(scenario())
    assert calls == [("unary", "small"), ("stream", "big")]


def test_a_worker_the_peers_delivered_part_of_a_program_to_is_sent_only_the_rest():
    big = os.urandom(2 * protocol.MIN_PIECE_BYTES + 1000)  # three pieces
    piece = protocol.piece_size_for(len(big))

    class Partial(ScriptedWorker):
        missing: tuple[int, ...] = (1, 2)
        got = b""

        async def handle(self, reader, writer) -> None:
            submit = await protocol.read(reader, Submit)
            await protocol.write(writer, Send(True, False, pieces=True))
            reply = await protocol.read(reader, Payload, Pieces)
            if isinstance(reply, Pieces):
                await protocol.read(reader, Payload)
                await protocol.write(writer, Send(True, False, missing=self.missing))
                reply = await protocol.read(reader, Payload)
            self.got = bytes(await protocol.read_payload(reader, reply.program_size, len(big), "program"))
            receipt = worker_signed(self.identity, CLIENT, submit.job_id)
            await protocol.write(writer, Result(2, receipt.to_bytes(), b"ok"))
            writer.close()

    async def main():
        first, second, third = Partial(), Partial(), Partial()
        third.missing = (7,)  # a piece the program does not have
        async with _network(first, second, third, greedy) as transport:
            request = lambda job_id: JobRequest(job_id, sha256_hex(big), big, b"", timeout=30, max_price=None)
            (await transport.run_stream(first.id, [], request("a" * 32))).close()
            assert first.got == big  # nobody held it: all of it
            (await transport.run_stream(second.id, [], request("b" * 32))).close()
            assert second.got == big[piece:]  # pieces 1 and 2, nothing else
            assert transport.program_bytes_sent == len(big) + len(big) - piece
            with pytest.raises(protocol.ProtocolError, match="asked for piece 7 of a program of 3 pieces"):
                await transport.run_stream(third.id, [], request("c" * 32))
            # The rest, and then all of it again: never more than one copy over one stream.
            sent = transport.program_bytes_sent
            with pytest.raises(protocol.ProtocolError, match="more of the program than one copy"):
                await transport.run_stream(greedy.id, [], request("d" * 32))
            assert transport.program_bytes_sent == sent + len(big) - piece

    class Greedy(Partial):
        async def handle(self, reader, writer) -> None:
            await protocol.read(reader, Submit)
            await protocol.write(writer, Send(True, False, pieces=True))
            await protocol.read(reader, Pieces)
            await protocol.read(reader, Payload)
            await protocol.write(writer, Send(True, False, missing=(1, 2)))
            reply = await protocol.read(reader, Payload)
            await protocol.read_payload(reader, reply.program_size, len(big), "program")
            await protocol.write(writer, Send(True, False))
            await protocol.read(reader, Payload)  # (the client hangs up instead)

    greedy = Greedy()
    asyncio.run(main())
