"""Pieces of programs between workers, without a network: the piece list, what a holder serves (and refuses), and a
fetch that meets a lying peer. The serving door and the fetcher talk over in-memory streams."""

from __future__ import annotations

import asyncio
import hashlib
import time

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

    def __init__(self, servers: dict[str, PieceServer], me: str = "fetcher"):
        self.servers, self.me = servers, me
        self.tasks: list[asyncio.Task] = []

    async def open(self, peer: str, door: Door, maddrs=()):
        if peer not in self.servers:
            raise NetworkError(f"cannot reach {peer}")
        to_server, to_client = _Pipe(), _Pipe()
        self.tasks.append(asyncio.ensure_future(self.servers[peer].handle(self.me, to_server.reader, to_client)))
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
    """Only failures in a row end a holder's turn: waiting for one busy serving others reopens a stream each time it
    says busy, and a few of those opens failing here and there is not a dead peer."""
    monkeypatch.setattr(peers, "NOT_YET_RETRY", 0.01)
    monkeypatch.setattr(peers, "BUSY_BACKOFF", 0.02)
    monkeypatch.setattr(peers, "SERVE_PER_PEER", 1)  # one stream: its failures are all this test's
    data = _program()
    disk = DiskCache(tmp_path / "holder", 1 << 30)
    disk.put(H, data)

    class BusyAWhile(PieceServer):
        refused = 0

        async def handle(self, peer_id, reader, writer, host=""):
            if self.refused < 6:  # serving as many as it takes: this fetcher is turned away, five times
                self.refused += 1
                self._running += peers.SERVE_STREAMS
                try:
                    return await super().handle(peer_id, reader, writer, host)
                finally:
                    self._running -= peers.SERVE_STREAMS
            return await super().handle(peer_id, reader, writer, host)

    class EveryOtherOpenFails(_Network):
        opens = 0

        async def open(self, peer, door, maddrs=()):
            self.opens += 1
            if self.opens % 2 == 0:
                raise NetworkError("stream reset")
            return await super().open(peer, door, maddrs)

    async def main():
        net = EveryOtherOpenFails({"holder": BusyAWhile(disk)})
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["holder"], timeout=30,
                                                   coming=frozenset({"holder"}))
        await asyncio.gather(*net.tasks)
        return got, net.opens

    got, opens = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert opens > 2 * (peers.OPEN_RETRIES + 1)  # more failed opens in all than OPEN_RETRIES in a row


def _quick(monkeypatch, **values) -> None:
    """The fetch's waits at test speed (``values``: others, by name)."""
    for name, value in {"HAVE_WAIT": 0.05, "HAVE_POLL": 0.01, "STALL_CHECK": 0.05, **values}.items():
        monkeypatch.setattr(peers, name, value)


def _seeding(data: bytes, here: int, sent=()):
    """A copy coming from its client into the first holder (it sends each piece once): ``here`` bytes of it so far,
    pieces ``sent`` gone to other fetchers already. (upload, coming: ``coming.write`` adds bytes)."""
    from gpunet.worker.payloads import Receiving
    from gpunet.worker.uploads import Upload

    upload, coming = Upload(H), Receiving(len(data))
    upload.receiving(len(data), coming, None, seeding=True)
    coming.write(data[:here])
    upload.sent.update({i: time.monotonic() for i in sent})
    return upload, coming


def _growing(data: bytes):
    """A copy of the program on its way into a holder (as a client's upload arrives): grown by ``grow(n)``."""
    from gpunet.worker.payloads import Receiving
    from gpunet.worker.uploads import Upload

    upload, coming = Upload(H), Receiving(len(data))
    upload.receiving(len(data), coming, None)

    def grow(n: int) -> None:
        coming.write(data[coming.received:coming.received + n])

    return upload, grow


def test_a_holder_still_getting_the_program_says_what_it_has_and_keeps_the_stream(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "HAVE_WAIT", 0.05)
    data = _program()
    size = piece_size_for(len(data))

    async def main():
        upload, grow = _growing(data)
        grow(size + 10)  # piece 0 and a bit of piece 1
        server = _holder(tmp_path, "a", None, coming=lambda h: upload if h == H else None)
        to_server, to_client = _Pipe(), _Pipe()
        handled = asyncio.ensure_future(server.handle("peer", to_server.reader, to_client))
        to_server.write(protocol.encode_frame(GetPiece(H, 1, size, have=True)))
        have = await protocol.read(to_client.reader, protocol.Have, timeout=5)
        to_server.write(protocol.encode_frame(GetPiece(H, 0, size, have=True)))  # the same stream: still open
        piece = await protocol.read(to_client.reader, PieceData, timeout=5)
        got = await protocol.read_payload(to_client.reader, piece.size, piece.size, "piece", timeout=5)
        to_server.close()
        await handled
        older = await _ask(server, GetPiece(H, 1, size))  # a fetcher that does not take Have hears busy
        return have, piece, bytes(got), older

    have, piece, got, (older,) = asyncio.run(main())
    assert have.indices() == {0} and got == data[:size]
    assert protocol.Have(piece.have).indices() == {0}  # a piece from a copy still coming says what else is there
    assert older.code == "busy"


def test_a_fetch_follows_a_holder_whose_copy_grows_slowly_and_ends_when_it_stops(tmp_path, monkeypatch):
    """On slow links a holder still getting the program has nothing new for a long time (longer than BUSY_PATIENCE)
    and is still the fastest way: the fetch waits while its copy grows, and ends once nothing moves for
    HOLDER_STALL (then the client sends what is missing)."""
    _quick(monkeypatch, BUSY_PATIENCE=0.05, HOLDER_STALL=1.0)
    data = _program()
    size = piece_size_for(len(data))

    async def main(stop_at: int, vouched: bool = True):
        upload, grow = _growing(data)
        server = _holder(tmp_path, f"g{stop_at}{vouched}", None, coming=lambda h: upload if h == H else None)
        net = _Network({"holder": server})

        async def arrive():
            while upload.source.received < min(stop_at, len(data)):
                await asyncio.sleep(0.3)  # 6x BUSY_PATIENCE between arrivals
                grow(size // 2)

        arriving = asyncio.ensure_future(arrive())
        start = asyncio.get_running_loop().time()
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["holder"], timeout=30,
                                                   coming=frozenset({"holder"} if vouched else ()))
        seconds = asyncio.get_running_loop().time() - start
        arriving.cancel()
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(arriving, *net.tasks, return_exceptions=True)
        return got, seconds

    got, _ = asyncio.run(main(stop_at=len(data)))
    assert got is not None and bytes(got[0]) == data
    got, seconds = asyncio.run(main(stop_at=size))  # only its first piece ever comes
    assert got is None and seconds < 10  # HOLDER_STALL after the last growth, not the fetch's 30 s
    # One only records name (the client does not vouch for it) gets BUSY_PATIENCE, growing or not: a sybil
    # claiming to be still getting a popular program cannot hold a fetch.
    got, seconds = asyncio.run(main(stop_at=len(data), vouched=False))
    assert got is None and seconds < 1.0


def test_a_holder_whose_account_of_its_pieces_contradicts_itself_cannot_keep_a_fetch_going(monkeypatch):
    """A vouched holder that says its copy grows, and then that pieces it listed are not there, never delivering:
    its growth stops counting as the swarm moving, and the fetch ends HOLDER_STALL later, not at its deadline."""
    _quick(monkeypatch, HAVE_WAIT=0.01, HOLDER_STALL=1.0)

    async def liar(peer_id, reader, writer, host=""):
        k = 0
        while True:
            await protocol.read(reader, GetPiece, timeout=5)
            k += 1
            await protocol.write(writer, protocol.Have.of({k % 3} if k % 2 else set(), 3))  # grows, then shrinks

    class Liar:
        handle = staticmethod(liar)

    async def main():
        net = _Network({"liar": Liar()})
        start = asyncio.get_running_loop().time()
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(_program()), ["liar"], timeout=30,
                                                   coming=frozenset({"liar"}))
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, asyncio.get_running_loop().time() - start

    got, seconds = asyncio.run(main())
    assert got is None and seconds < 10  # not the fetch's 30 s


def test_a_vouched_holder_saying_its_growing_copy_went_to_others_cannot_keep_a_fetch_going(monkeypatch):
    """A liar whose every answer names its pieces as sent on already (Have.sent), one more every half second, is
    never asked for them, so never caught contradicting itself: pieces it does not send are not the swarm moving,
    and the fetch ends HOLDER_STALL later (a reviewer's run had it hold the fetch to its deadline)."""
    _quick(monkeypatch, HOLDER_STALL=1.0)
    listed = PieceList.of(bytes(40 * MIN_PIECE_BYTES))

    async def liar(peer_id, reader, writer, host=""):
        began = asyncio.get_running_loop().time()
        while True:
            await protocol.read(reader, GetPiece, timeout=5)
            grown = range(min(40, int((asyncio.get_running_loop().time() - began) / 0.5) + 1))
            await protocol.write(writer, protocol.Have.of(grown, 40, sent=grown))

    class Liar:
        handle = staticmethod(liar)

    async def main():
        net = _Network({"liar": Liar()})
        start = asyncio.get_running_loop().time()
        got = await Fetcher(net, own_id="me").fetch(H, listed, ["liar"], timeout=30, coming=frozenset({"liar"}))
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, asyncio.get_running_loop().time() - start

    got, seconds = asyncio.run(main())
    assert got is None and seconds < 5  # not 20 s of "growth", nor the fetch's 30 s


def test_a_peer_still_getting_nothing_does_not_keep_a_piece_from_one_that_holds_it_all(tmp_path):
    """CI saw a fetch stall for 30 s on its last piece: each time a peer still getting the program said it lacked the
    piece and gave it back, the same stream took it again before the stream to a holder of the whole could, and an
    idle stream held that holder's place meanwhile."""
    data = _program()

    async def main():
        upload, _ = _growing(data)  # never grows
        net = _Network({"empty": _holder(tmp_path, "e", None, coming=lambda h: upload if h == H else None),
                        "full": _holder(tmp_path, "f", data)})
        start = asyncio.get_running_loop().time()
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["empty", "full"], timeout=60,
                                                   coming=frozenset({"empty", "full"}))
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, asyncio.get_running_loop().time() - start

    got, seconds = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert seconds < peers.HOLDER_STALL / 2  # not a stall


def test_after_a_partial_fetch_the_client_sends_only_the_pieces_the_peers_did_not(tmp_path, monkeypatch):
    """The fetch stalls with part of the program here: the worker asks its client for the other pieces only (each
    checked against the client's own list, the whole against the program's hash and the client's proof of holding);
    an older client, which sends the whole program, is taken too."""
    from gpunet.protocol import Payload, Pieces, Send, Submit
    from gpunet.worker.payloads import StreamPayloads
    from gpunet.worker.state.admission import ServiceLimits

    _quick(monkeypatch, HOLDER_STALL=0.5)
    data = _program()
    listed = PieceList.of(data)

    async def main(older: bool, tamper: bool = False):
        upload, grow = _growing(data)
        grow(listed.piece_size)  # the holder only ever gets piece 0
        net = _Network({"holder": _holder(tmp_path, f"p{older}{tamper}", None,
                                          coming=lambda h: upload if h == H else None)})
        to_worker, asked = _Pipe(), []

        class Client(_Pipe):  # answers the worker's Send with what it asks for, as a client does
            def write(self, frame: bytes) -> None:
                ask = protocol.decode(bytes(frame[4:]), Send)
                asked.append(ask)
                parts = [data] if older else [bytearray(data[listed.span(i)[0]:sum(listed.span(i))])
                                              for i in ask.missing]
                if tamper:
                    parts[-1][-1] ^= 1
                to_worker.write(protocol.encode_frame(Payload(sum(map(len, parts)), None)))
                for part in parts:
                    to_worker.write(bytes(part))

        payloads = StreamPayloads(to_worker.reader, Client(), ServiceLimits(), fetcher=Fetcher(net, own_id="me"),
                                  proves=lambda key, proof: key == holding_key(data))
        try:
            got = await payloads._from_peers(
                Submit("job-1", H, 0, b"", 30.0),
                Pieces(listed.size, listed.piece_size, listed.hashes, (("holder", ()),), frozenset({"holder"})),
                lambda n: None)
        finally:
            for task in net.tasks:
                task.cancel()
            await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, asked

    (program, key), asked = asyncio.run(main(older=False))
    assert bytes(program) == data and key == holding_key(data)
    assert asked == [Send(True, False, missing=tuple(range(1, len(listed))))]
    (program, key), asked = asyncio.run(main(older=True))
    assert bytes(program) == data and key is None and len(asked) == 1
    with pytest.raises(ProtocolError, match="unlike its own piece list"):
        asyncio.run(main(older=False, tamper=True))


def test_a_request_waits_for_a_sending_place_briefly_and_holds_no_piece_meanwhile(tmp_path, monkeypatch):
    """Pieces are read only once a sending place is taken; a request that finds none within SEND_WAIT hears busy
    (well within the fetcher's frame timeout), so streams queued at a holder hold no piece in memory."""
    monkeypatch.setattr(peers, "SERVE_AT_ONCE", 1)
    monkeypatch.setattr(peers, "SEND_WAIT", 0.05)
    data = _program()
    server = _holder(tmp_path, "a", data)
    reads = []
    read_range = server.disk.read_range
    server.disk.read_range = lambda *a: reads.append(a) or read_range(*a)

    async def main():
        assert await server._take_place()  # every place taken (a slow fetcher elsewhere)
        (busy,) = await _ask(server, GetPiece(H, 0, piece_size_for(len(data))))
        server._sending[1].release()
        (piece,) = await _ask(server, GetPiece(H, 0, piece_size_for(len(data))))
        return busy, piece

    busy, piece = asyncio.run(main())
    assert busy.code == "busy" and bytes(piece) == data[:piece_size_for(len(data))]
    assert len(reads) == 1  # read once, for the request that got a place


def test_a_fetcher_asks_the_peers_that_fetch_the_same_copy_from_it(tmp_path, monkeypatch):
    """A worker named early (told only of the first holder) learns of the workers named after it when they ask it for
    pieces with its client's grant, and asks them too: the bench's cold start had every early worker fetch only from
    the first holder, whose uplink then carried most of the swarm's copies. Here the first holder's copy stops at its
    first piece; "b" was told only of it, and gets the rest from "c", which asked "b" for pieces (and was told of a
    holder of the whole). Without meeting "c", "b"'s fetch stalls."""
    from gpunet.protocol import holding
    from gpunet.protocol.holding import PIECE
    from gpunet.worker.uploads import Upload

    _quick(monkeypatch, HOLDER_STALL=3.0)
    data = _program()
    size = piece_size_for(len(data))
    token = b"t" * 32

    def copy_of(name: str):
        """A worker's copy coming in through its fetch, served to fetchers presenting its client's grant."""
        upload = Upload(H)

        async def may_serve(program, peer, grant, copy, from_disk):
            ok = copy is not None and holding.verifies(copy.token, grant, PIECE, name, peer)
            if ok:
                copy.met(peer)  # as gpunet.worker.jobs does
            return ok

        server = _holder(tmp_path, name, None, coming=lambda h: upload if h == H else None, may_serve=may_serve)
        return upload, server, lambda run: upload.receiving(len(data), run, token)

    async def main():
        first, grow = _growing(data)
        grow(size)  # the first holder's copy: its first piece, no more
        first.token = token
        b_copy, b_server, b_serve = copy_of("b")
        c_copy, c_server, c_serve = copy_of("c")
        servers = {"a": _holder(tmp_path, "a", None, coming=lambda h: first if h == H else None),
                   "b": b_server, "c": c_server, "whole": _holder(tmp_path, "whole", data)}
        grants = {p: holding.proof(token, PIECE, p, f) for p in servers for f in "bc"}
        b_net, c_net = _Network(servers, me="b"), _Network(servers, me="c")
        b = asyncio.ensure_future(Fetcher(b_net, own_id="b").fetch(
            H, PieceList.of(data), ["a"], timeout=30, coming=frozenset({"a"}), serve=b_serve, token=token,
            grants={"a": grants["a"]}))
        while not b_copy.have(size):  # "b" has its first piece from "a"
            await asyncio.sleep(0.01)
        c = await Fetcher(c_net, own_id="c").fetch(
            H, PieceList.of(data), ["b", "whole"], timeout=30, coming=frozenset({"b", "whole"}), serve=c_serve,
            token=token, grants={"b": holding.proof(token, PIECE, "b", "c")})
        c_copy.arrived(bytes(c[0]))  # "c" has it whole, and serves it from that copy
        got = await b
        for task in b_net.tasks + c_net.tasks:
            task.cancel()
        await asyncio.gather(*b_net.tasks, *c_net.tasks, return_exceptions=True)
        return got, servers

    got, servers = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert servers["c"].served > 0  # "b" asked "c", which its client never named to it


def test_a_copy_coming_from_its_client_sends_each_piece_once_and_the_fetchers_hand_it_on(tmp_path, monkeypatch):
    """The first holder's uplink carries what its client sends once: the bench's cold start had it send each piece to
    several fetchers waiting for it (3.8 copies of a 268 MB program from it, 4.5x one copy's time). While its copy
    comes from the client, a piece goes to the first fetcher that asks; the next hears it went (Have.sent) and gets it
    from that fetcher. A send that fails gives the piece back."""
    _quick(monkeypatch)
    data = _program()
    size = piece_size_for(len(data))

    class Broken(_Pipe):
        def write(self, data: bytes) -> None:
            if len(data) > 1000:  # the piece's bytes, after its header
                raise ConnectionResetError("the fetcher went")
            super().write(data)

    async def main():
        upload, coming = _seeding(data, 2 * size)  # pieces 0 and 1 here, the last still coming
        server = _holder(tmp_path, "s", None, coming=lambda h: upload if h == H else None)
        to_server = _Pipe()
        to_server.write(protocol.encode_frame(GetPiece(H, 1, size, have=True, sent=True)))
        to_server.close()
        await server.handle("broken", to_server.reader, Broken())
        after_failure = set(upload.sent)
        first = await _ask(server, GetPiece(H, 0, size, have=True, sent=True))
        to_server, to_client = _Pipe(), _Pipe()
        to_server.write(protocol.encode_frame(GetPiece(H, 0, size, have=True, sent=True)))
        to_server.write(protocol.encode_frame(GetPiece(H, 1, size, have=True, sent=True)))
        to_server.close()
        await server.handle("other", to_server.reader, to_client)
        went = await protocol.read(to_client.reader, protocol.Have, timeout=5)
        piece = await protocol.read(to_client.reader, PieceData, timeout=5)  # the same stream goes on
        got = await protocol.read_payload(to_client.reader, piece.size, piece.size, "piece", timeout=5)
        older = await _ask(server, GetPiece(H, 0, size, have=True))  # (it would ask again at once): sent again
        monkeypatch.setattr(peers, "RESEND_AFTER", 0.0)  # sent long ago: its fetcher may have dropped it
        lapsed = await _ask(server, GetPiece(H, 0, size, have=True, sent=True))
        coming.write(data[2 * size:])  # whole now: nothing is held back any more
        again = await _ask(server, GetPiece(H, 0, size, have=True, sent=True))
        return after_failure, first, went, piece, bytes(got), older + lapsed + again

    after_failure, (first,), went, piece, got, later = asyncio.run(main())
    assert after_failure == set()  # the failed send gave piece 1 back
    assert bytes(first) == data[:size] and got == data[size:2 * size]
    assert [bytes(b) for b in later] == [data[:size]] * 3
    assert went.indices() == {0, 1} and went.sent_indices() == {0}
    assert protocol.Have(piece.have, piece.sent).sent_indices() == {0, 1}


def test_a_fetcher_takes_what_the_first_holder_sent_on_from_those_that_have_it(tmp_path, monkeypatch):
    """The first holder sent pieces 0 and 1 to others already; the fetcher gets them from a peer that has them and
    asks the first holder only for the piece nobody has yet (waiting for it there): one piece from its uplink, and its
    "sent" is no contradiction of what it said it has."""

    _quick(monkeypatch)
    data = _program()
    size = piece_size_for(len(data))

    async def main():
        upload, coming = _seeding(data, 2 * size, sent=(0, 1))  # to other fetchers
        peer, grow = _growing(data)
        grow(2 * size)  # a fetcher that has pieces 0 and 1
        net = _Network({"first": _holder(tmp_path, "f", None, coming=lambda h: upload if h == H else None),
                        "peer": _holder(tmp_path, "p", None, coming=lambda h: peer if h == H else None)})

        async def arrive():
            await asyncio.sleep(0.5)
            coming.write(data[2 * size:])

        arriving = asyncio.ensure_future(arrive())
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["first", "peer"], timeout=30,
                                                   coming=frozenset({"first", "peer"}))
        await arriving
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, net.servers["first"].served, net.servers["peer"].served

    got, from_first, from_peer = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert from_first == len(data) - 2 * size and from_peer == 2 * size


def test_once_the_first_holders_copy_is_whole_the_pieces_it_sent_on_are_asked_of_it_again(tmp_path):
    """Pieces the first holder sent to a fetcher that then went: once its copy is whole it says no more (a piece
    without a bitmap), and the fetcher asks it for them at once, not one per HAVE_WAIT (a reviewer's run: 12 such
    pieces took 12 s)."""

    data = _program()
    size = piece_size_for(len(data))

    async def main():
        upload, coming = _seeding(data, 2 * size, sent=(0, 1))  # to a fetcher that is gone
        net = _Network({"first": _holder(tmp_path, "f", None, coming=lambda h: upload if h == H else None)})

        async def arrive():
            await asyncio.sleep(0.3)
            coming.write(data[2 * size:])

        arriving = asyncio.ensure_future(arrive())
        start = asyncio.get_running_loop().time()
        got = await Fetcher(net, own_id="me").fetch(H, PieceList.of(data), ["first"], timeout=30,
                                                   coming=frozenset({"first"}))
        seconds = asyncio.get_running_loop().time() - start
        await arriving
        for task in net.tasks:
            task.cancel()
        await asyncio.gather(*net.tasks, return_exceptions=True)
        return got, seconds

    got, seconds = asyncio.run(main())
    assert got is not None and bytes(got[0]) == data
    assert seconds < peers.HAVE_WAIT  # (a few tenths of a second: its last piece's wait)


def test_a_tensor_a_holder_turns_out_to_lack_goes_back_to_the_holders_that_finished_theirs(monkeypatch):
    """Weights by reference from two holders: one serves every tensor, the other takes one and then says it is not
    there (it was still fetching it from a peer that sorts before this worker). The first holder's streams, idle by
    then, take it up; the tensor is not left to the client (CI saw one weight cross the client link twice)."""
    from gpunet.errors import ProgramNotCached
    from gpunet.job.format import WeightRef

    refs = [WeightRef(f"w{i}", f"{i:064x}", "F32", (4,)) for i in range(3)]
    store: set[str] = set()

    async def tensor_from(peer, ref, store_, grant=None, token=None):
        if peer == "lacks":
            await asyncio.sleep(0.3)  # (the other holder's streams are done with theirs by then)
            raise ProgramNotCached(ref.sha256)
        await asyncio.sleep(0.02)
        store_.add(ref.sha256)

    async def main():
        fetcher = Fetcher(_Network({}), own_id="me")
        monkeypatch.setattr(fetcher, "_tensor_from", tensor_from)
        return await asyncio.wait_for(fetcher.fetch_tensors(refs, ["serves", "lacks"], store, timeout=30), 10)

    assert asyncio.run(main()) == []
    assert store == {r.sha256 for r in refs}
