"""Pieces of programs between workers, without a network: the piece list, what a holder serves (and refuses), and a
fetch that meets a lying peer. The serving door and the fetcher talk over in-memory streams."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gpunet import protocol
from gpunet.errors import NetworkError, ProtocolError
from gpunet.job.format import ProgramParts
from gpunet.protocol.peers import MAX_PIECES, MIN_PIECE_BYTES, PieceList, piece_size_for
from gpunet.protocol import Door, Error, GetPiece, PieceData, holding_key
from gpunet.worker.executor.cache import DiskCache
from gpunet.worker import peers
from gpunet.worker.peers import Fetcher, PieceServer

H = ProgramParts(b'{"m":1}', b"{}", hashlib.sha256(b"seed").digest() * ((2 * MIN_PIECE_BYTES + 12345) // 32)
                 + b"tail").hash


def test_piece_sizes_keep_a_program_within_max_pieces():
    assert piece_size_for(0) == piece_size_for(MIN_PIECE_BYTES * MAX_PIECES) == MIN_PIECE_BYTES
    assert piece_size_for(MIN_PIECE_BYTES * MAX_PIECES + 1) == 2 * MIN_PIECE_BYTES
    data = bytes(range(256)) * ((MIN_PIECE_BYTES * 2 + 1000) // 256)
    pieces = PieceList.of(data)
    assert len(pieces) == 3 and pieces.span(2) == (2 * MIN_PIECE_BYTES, len(data) - 2 * MIN_PIECE_BYTES)
    assert pieces.matches(1, data[MIN_PIECE_BYTES:2 * MIN_PIECE_BYTES])
    assert not pieces.matches(1, bytes([data[MIN_PIECE_BYTES] ^ 1]) + data[MIN_PIECE_BYTES + 1:2 * MIN_PIECE_BYTES])
    with pytest.raises(ValueError):
        PieceList(len(data), MIN_PIECE_BYTES, pieces.hashes[:-1])


class _Pipe:
    """A stream pair in memory: what one side writes, the other reads."""

    def __init__(self):
        self.reader = asyncio.StreamReader()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()

    def is_closing(self) -> bool:
        return self.closed


class _Network:
    """``rpc.open`` for a fetcher: each peer id names a PieceServer, served over in-memory pipes."""

    def __init__(self, servers: dict[str, PieceServer]):
        self.servers = servers
        self.tasks: list[asyncio.Task] = []

    async def open(self, peer: str, door: Door, maddrs=()):
        if peer not in self.servers:
            raise NetworkError(f"cannot reach {peer}")
        to_server, to_client = _Pipe(), _Pipe()
        self.tasks.append(asyncio.ensure_future(self.servers[peer].handle("fetcher", to_server.reader, to_client)))
        return to_client.reader, to_server


def _holder(tmp_path, name: str, data: bytes | None, **kwargs) -> PieceServer:
    disk = DiskCache(tmp_path / name, 1 << 30)
    if data is not None:
        disk.put(H, data)
    return PieceServer(disk, **kwargs)


def _program(n: int = 2 * MIN_PIECE_BYTES + 12345) -> bytes:
    """A real container (its hash is H's): a fetch checks the whole against the program hash."""
    data = ProgramParts(b'{"m":1}', b"{}", hashlib.sha256(b"seed").digest() * (n // 32) + b"tail").to_bytes()
    assert ProgramParts.from_bytes(data).hash == H
    return data


async def _ask(server: PieceServer, *requests: GetPiece) -> list:
    to_server, to_client = _Pipe(), _Pipe()
    for request in requests:
        to_server.write(protocol.encode_frame(request))
    to_server.close()
    await server.handle("peer", to_server.reader, to_client)
    replies = []
    for _ in requests:
        try:
            reply = await protocol.read(to_client.reader, PieceData, Error, timeout=5)
        except ProtocolError:  # the holder ended the stream
            break
        if isinstance(reply, PieceData):
            reply = await protocol.read_payload(to_client.reader, reply.size, reply.size, "piece", timeout=5)
        replies.append(reply)
    return replies


def test_a_holder_serves_whole_pieces_of_what_it_holds_and_nothing_else(tmp_path):
    data = _program()
    server = _holder(tmp_path, "a", data)
    pieces = PieceList.of(data)
    got = asyncio.run(_ask(server, GetPiece(H, 2, pieces.piece_size), GetPiece(H, 3, pieces.piece_size),
                           GetPiece(H, 0, MIN_PIECE_BYTES // 2), GetPiece("cd" * 32, 0, pieces.piece_size)))
    assert bytes(got[0]) == data[2 * pieces.piece_size:]
    assert "no such piece" in got[1].message  # and the stream ends: a slot is for fetching
    assert got[2:] == []
    assert server.served == len(data) - 2 * pieces.piece_size
    (wrong_size,) = asyncio.run(_ask(server, GetPiece(H, 0, MIN_PIECE_BYTES // 2)))
    assert "no such piece" in wrong_size.message
    (other,) = asyncio.run(_ask(server, GetPiece("cd" * 32, 0, pieces.piece_size)))
    assert other.code == "not_cached"


def test_a_holder_still_receiving_the_program_says_busy_not_missing(tmp_path):
    server = _holder(tmp_path, "a", None, coming=lambda h: h == H)
    (reply,) = asyncio.run(_ask(server, GetPiece(H, 0, MIN_PIECE_BYTES)))
    assert reply.code == "busy"


def test_a_fetch_catches_the_liar_at_its_piece_bans_it_and_completes_from_the_honest_peer(tmp_path):
    data = _program()
    pieces = PieceList.of(data)
    servers = {"liar": _holder(tmp_path, "l", data, corrupt=True), "honest": _holder(tmp_path, "h", data)}

    async def main():
        net = _Network(servers)
        fetcher = Fetcher(net, own_id="me")
        got = await fetcher.fetch(H, pieces, ["liar", "honest", "gone"], timeout=30)
        await asyncio.gather(*net.tasks)
        return fetcher, got

    fetcher, got = asyncio.run(main())
    assert bytes(got[0]) == data and got[1] == holding_key(data) and fetcher.fetched == len(data)
    assert fetcher.bans.banned("liar") and not fetcher.bans.banned("honest")


def test_a_fetch_bans_nobody_when_every_peer_disagrees_with_the_clients_list(tmp_path):
    """A wrong piece list (the client's) must not get honest holders banned: no piece ever matches, so the fetch
    gives up (the worker then asks the client) and nobody is blamed."""
    data = _program()
    wrong = PieceList(len(data), piece_size_for(len(data)), bytes(32) * len(PieceList.of(data)))
    servers = {"a": _holder(tmp_path, "a", data), "b": _holder(tmp_path, "b", data)}

    async def main():
        fetcher = Fetcher(_Network(servers), own_id="me")
        return fetcher, await fetcher.fetch(H, wrong, ["a", "b"], timeout=30)

    fetcher, got = asyncio.run(main())
    assert got is None
    assert not fetcher.bans.banned("a") and not fetcher.bans.banned("b")


def test_an_accomplice_of_a_lying_client_cannot_get_honest_holders_banned(tmp_path):
    """The client's list matches its accomplice's fake bytes, so the honest holders' pieces look wrong; but the
    assembled program does not hash to the program's hash, so nobody is banned and the fetch gives up."""
    data = _program()
    fake = bytes(len(data))
    servers = {"honest": _holder(tmp_path, "h", data), "accomplice": _holder(tmp_path, "a", fake)}

    async def main():
        fetcher = Fetcher(_Network(servers), own_id="me")
        return fetcher, await fetcher.fetch(H, PieceList.of(fake), ["honest", "accomplice"], timeout=30)

    fetcher, got = asyncio.run(main())
    assert got is None
    assert not fetcher.bans.banned("honest") and not fetcher.bans.banned("accomplice")


def test_a_program_has_one_byte_form_so_holders_of_it_serve_the_same_pieces():
    import msgpack

    from gpunet.errors import JobRejected

    parts = ProgramParts(b'{"m":1}', b"{}", b"w" * 300)
    assert ProgramParts.from_bytes(parts.to_bytes()).hash == parts.hash
    reordered = msgpack.packb({"weights": parts.weights, "gpunet_program": 1, "manifest": parts.manifest,
                               "graph": parts.graph}, use_bin_type=True)
    longer = parts.to_bytes().replace(b"\xa7weights\xc5\x01\x2c", b"\xa7weights\xc6\x00\x00\x01\x2c")
    for other in (reordered, longer):
        with pytest.raises(JobRejected, match="not in the form gpunet writes"):
            ProgramParts.from_bytes(other)


def test_when_peers_fail_the_worker_asks_its_client_for_the_program_on_the_same_stream():
    """The fallback after a failed fetch: the worker's watch for a hung-up client (a pending read) must be settled
    before it reads the client's answer, or the read is refused (a CI run once cut the upload off with a reset)."""
    from gpunet.protocol import Payload, Pieces, Send, Submit
    from gpunet.worker.state.admission import ServiceLimits
    from gpunet.worker.payloads import StreamPayloads

    data = _program()
    pieces = PieceList.of(data)

    class NoPeers:
        async def fetch(self, *args, **kwargs):
            return None

    async def main():
        to_worker = _Pipe()

        class Client(_Pipe):  # answers the worker's second Send with the program, as a client does
            def write(self, frame: bytes) -> None:
                super().write(frame)
                asked = protocol.decode(bytes(frame[4:]), Send)
                assert asked == Send(True, False)
                asyncio.get_running_loop().call_soon(lambda: (
                    to_worker.write(protocol.encode_frame(Payload(len(data), None))), to_worker.write(data)))

        payloads = StreamPayloads(to_worker.reader, Client(), ServiceLimits(), fetcher=NoPeers())
        submit = Submit("job-1", H, 0, b"", 30.0)
        return await payloads._from_peers(submit, Pieces(pieces.size, pieces.piece_size, pieces.hashes, ()),
                                          charged.append)

    charged = []
    program, key = asyncio.run(main())
    assert bytes(program) == data and key is None  # the client's own bytes: no proof to check against
    assert charged == [pieces.size]  # charged once, before the client sent it


def test_a_coming_holder_that_never_delivers_holds_no_budget_and_one_without_room_ends_the_fetch(tmp_path):
    """From an attacker's review: a client named as "coming" a peer of its own that answers busy for ever, and the
    program's whole size stayed charged to the worker's buffer budget while the worker waited (up to half the job's
    time). The charge is now taken with the first right piece; if there is no room then, the fetch ends."""
    from gpunet.errors import WorkerBusy

    data = _program()
    pieces = PieceList.of(data)
    asked = []

    async def main(holder: PieceServer, on_first, timeout: float):
        net = _Network({"holder": holder})
        got = await Fetcher(net, own_id="me").fetch(H, pieces, ["holder"], timeout=timeout,
                                                   coming=frozenset({"holder"}), on_first=on_first)
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got

    never = PieceServer(DiskCache(tmp_path / "never", 1 << 30), coming=lambda program: True)  # busy for ever
    assert asyncio.run(main(never, lambda: asked.append("charge"), timeout=1.0)) is None
    assert asked == []  # a whole second of waiting, nothing charged

    def no_room():
        asked.append("charge")
        raise WorkerBusy("the worker's buffer is full")

    assert asyncio.run(main(_holder(tmp_path, "has", data), no_room, timeout=30)) is None
    assert asked == ["charge"]  # asked once, and nothing was taken after the refusal
    assert bytes(asyncio.run(main(_holder(tmp_path, "has2", data), lambda: asked.append("ok"), timeout=30))[0]) == data
    assert asked == ["charge", "ok"]


def test_a_holder_whose_first_streams_cannot_be_opened_is_tried_again(tmp_path):
    """A holder busy loading what it just received can miss a stream or two on a loaded machine; giving up on it at
    once would send the client's link a second copy. A holder that never answers is still given up on."""
    data = _program()
    pieces = PieceList.of(data)

    class Flaky(_Network):
        def __init__(self, servers, failures: int):
            super().__init__(servers)
            self.failures = failures

        async def open(self, peer, door, maddrs=()):
            if self.failures > 0:
                self.failures -= 1
                raise NetworkError("stream reset")
            return await super().open(peer, door, maddrs)

    async def main(failures: int):
        net = Flaky({"holder": _holder(tmp_path, f"h{failures}", data)}, failures)
        got = await Fetcher(net, own_id="me").fetch(H, pieces, ["holder"], timeout=30)
        await asyncio.gather(*net.tasks)
        return got

    assert bytes(asyncio.run(main(failures=2))[0]) == data  # one per stream: each is tried again once
    assert asyncio.run(main(failures=100)) is None


def test_a_busy_holder_is_not_given_up_on_for_stream_failures_spread_over_a_long_wait(tmp_path, monkeypatch):
    """Only failures in a row end a holder's turn: waiting for one still receiving the program reopens a stream each
    time it says busy, and a few of those opens failing here and there is not a dead peer."""
    monkeypatch.setattr(peers, "NOT_YET_RETRY", 0.01)
    monkeypatch.setattr(peers, "SERVE_PER_PEER", 1)  # one stream: its failures are all this test's
    data = _program()
    disk = DiskCache(tmp_path / "holder", 1 << 30)
    busy = 0

    def coming(program: str) -> bool:
        nonlocal busy
        busy += 1
        if busy == 6:  # arrived: the next ask is served
            disk.put(H, data)
        return True

    class EveryOtherOpenFails(_Network):
        opens = 0

        async def open(self, peer, door, maddrs=()):
            self.opens += 1
            if self.opens % 2 == 0:
                raise NetworkError("stream reset")
            return await super().open(peer, door, maddrs)

    async def main():
        net = EveryOtherOpenFails({"holder": PieceServer(disk, coming=coming)})
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["holder"], timeout=30)
        await asyncio.gather(*net.tasks)
        return got, net.opens

    got, opens = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert opens > 2 * (peers.OPEN_RETRIES + 1)  # more failed opens in all than OPEN_RETRIES in a row
