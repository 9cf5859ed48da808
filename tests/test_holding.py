"""Who may run (and fetch) a program a worker holds: the proof of holding both ends compute, the pure table of holders,
and a holder's piece door, without a network (tests/test_owners.py attacks a real one)."""

from __future__ import annotations

import asyncio
import os

import pytest

from gpunet import protocol
from gpunet.errors import ProtocolError
from gpunet.identity import Identity
from gpunet.ledger import Ledger
from gpunet.protocol import PIECE, RUN, GetPiece, Pieces, PieceList, Submit, holding_key, proof, verifies
from gpunet.worker.executor.cache import DiskCache
from gpunet.worker.holdings import HoldingKeys
from gpunet.worker.jobs import Jobs
from gpunet.worker.state.admission import Admission
from gpunet.worker.state.owners import Owners
from tests.test_pieces import H, _ask, _program

W1, W2, ALICE, BOB = "worker-1", "worker-2", "alice", "bob"


def test_a_proof_of_holding_names_its_verifier_its_prover_and_its_purpose():
    key = holding_key(b"the program's bytes")
    alices = proof(key, RUN, W1, ALICE)
    assert verifies(key, alices, RUN, W1, ALICE)
    assert not verifies(key, alices, RUN, W1, BOB)  # replayed by another identity
    assert not verifies(key, alices, RUN, W2, ALICE)  # replayed to another worker
    assert not verifies(key, alices, PIECE, W1, ALICE)  # used for another purpose
    assert not verifies(holding_key(b"the program's bytes, nearly"), alices, RUN, W1, ALICE)
    assert not verifies(key, None, RUN, W1, ALICE)


def test_the_holding_key_is_not_the_published_program_hash_and_needs_every_byte():
    data = _program()
    assert holding_key(data).hex() != H
    assert holding_key(data) != holding_key(data[:-1] + bytes([data[-1] ^ 1]))


def test_only_holders_run_a_program_unless_it_is_shared_and_shared_stays_shared():
    owners = Owners()
    assert not owners.may_run(H, ALICE)
    owners.add(H, ALICE)
    assert owners.may_run(H, ALICE) and not owners.may_run(H, BOB)
    owners.add(H, BOB, shared=False)
    assert owners.may_run(H, BOB)
    owners.add(H, ALICE, shared=True)
    assert owners.may_run(H, "anyone") and owners.is_shared(H)
    owners.add(H, BOB)  # a holder saying nothing of sharing does not take it back
    assert owners.is_shared(H)


def test_a_private_program_is_never_shared_and_public_stays_public():
    owners = Owners()
    owners.add("p" * 64, ALICE, private=True)
    owners.add("p" * 64, BOB, shared=True)
    assert owners.is_private("p" * 64) and not owners.is_shared("p" * 64) and not owners.may_run("p" * 64, "anyone")
    owners.add("q" * 64, ALICE)
    owners.add("q" * 64, BOB, private=True)  # another's private upload of a public program: it stays public
    assert not owners.is_private("q" * 64)


def test_a_full_table_forgets_the_least_recently_used_and_forgetting_fails_closed():
    owners = Owners(max_programs=2, max_holders=2)
    owners.add("a" * 64, ALICE, shared=True)
    owners.add("b" * 64, ALICE)
    owners.add("a" * 64, BOB)  # used again: "b" is the oldest now
    owners.add("c" * 64, ALICE)
    assert len(owners) == 2 and not owners.may_run("b" * 64, ALICE) and owners.may_run("a" * 64, "anyone")
    for client in ("x", "y", "z"):
        owners.add("c" * 64, client)
    assert not owners.may_run("c" * 64, ALICE) and owners.may_run("c" * 64, "z")  # its oldest holder proves again


def test_the_new_fields_cross_the_wire_and_malformed_proofs_are_refused():
    p = os.urandom(32)
    submit = Submit("j", H, 0, b"", shared=True, holds=p)
    assert protocol.decode(protocol.encode(submit), Submit) == submit
    assert "holds" not in Submit("j", H, 0, b"").to_wire()  # the bytes older workers always read
    pieces = PieceList.of(b"x" * 100)
    message = Pieces(pieces.size, pieces.piece_size, pieces.hashes, (("a" * 46, ("/ip4/1.2.3.4/tcp/1",)),),
                     frozenset(), (("a" * 46, p),), p)
    assert protocol.decode(protocol.encode(message), Pieces) == message and message.holder_ids == ("a" * 46,)
    assert protocol.decode(protocol.encode(GetPiece(H, 0, 4 << 20, p)), GetPiece).grant == p
    for bad in ({**submit.to_wire(), "holds": b"short"}, {**message.to_wire(), "grants": [["someone else", p]]},
                {**message.to_wire(), "holds": b"x" * 33}, {**GetPiece(H, 0, 4 << 20).to_wire(), "grant": b"x"}):
        with pytest.raises(ProtocolError):
            protocol.decode(protocol.encode(_Raw(bad)))


class _Raw:
    def __init__(self, d):
        self.d = d

    def to_wire(self):
        return self.d


class _DiskOnly:
    """An executor as the piece door sees it: a disk cache, nothing running."""

    def __init__(self, disk):
        self.disk = disk

    def has_program(self, program_hash):
        return program_hash in self.disk

    def expected_end(self, tag):
        return None  # nothing runs


def test_a_holder_serves_a_program_that_is_not_shared_only_to_the_fetcher_its_client_granted(tmp_path):
    """Holders used to serve any cached program to anyone who knew its hash: a hash is published, so that handed the
    weights of every program to anyone."""
    data = _program()
    disk = DiskCache(tmp_path / "programs", 1 << 30)
    disk.put(H, data)
    holder = Identity.generate()
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        jobs = Jobs(identity=holder, executor=_DiskOnly(disk), ledger=ledger,
                    admission=Admission(price_nano=1, max_concurrent=1, max_queue=1), record=lambda: None)
        key = holding_key(data)
        piece = dict(program=H, index=0, piece_size=PieceList.of(data).piece_size)

        def ask(grant):
            return asyncio.run(_ask(jobs.piece_server, GetPiece(**piece, grant=grant)))[0]

        assert ask(None).code == "rejected" and "not shared" in ask(None).message
        assert ask(os.urandom(32)).code == "rejected"
        assert ask(proof(key, PIECE, holder.peer_id, "another fetcher")).code == "rejected"  # the grant names "peer"
        assert ask(proof(key, PIECE, "another holder", "peer")).code == "rejected"
        assert bytes(ask(proof(key, PIECE, holder.peer_id, "peer"))) == data[:piece["piece_size"]]
        jobs.owners.add(H, ALICE, shared=True)
        assert bytes(ask(None)) == data[:piece["piece_size"]]  # shared: anyone's


def test_holding_keys_come_from_the_disk_cache_once_and_only_for_what_it_holds(tmp_path):
    data = _program()
    disk = DiskCache(tmp_path / "programs", 1 << 30)
    keys = HoldingKeys(disk)

    async def main():
        assert await keys.of(H) is None  # not cached: no key, and none kept
        disk.put(H, data)
        assert await keys.of(H) == holding_key(data)
        disk._path(H).unlink()
        assert await keys.of(H) == holding_key(data)  # kept: one pass per program
        assert await keys.verifies(H, proof(holding_key(data), RUN, W1, ALICE), RUN, W1, ALICE)
        assert not await HoldingKeys(None).verifies(H, proof(holding_key(data), RUN, W1, ALICE), RUN, W1, ALICE)

    asyncio.run(main())


def test_an_upload_token_fetches_only_bytes_its_client_sent_or_proved(tmp_path):
    """Upload tokens (gpunet.protocol.holding): a worker serves a program that is still coming against grants made
    with that copy's token, and what has not arrived yet is "busy". Attack (an attacker's review, on the first
    version): a client names a victim's cached program, sends junk bytes with a token of its own, and its accomplice
    fetches the cached copy with a grant made from that token. A token opens the disk's copy only once the bytes it
    came with hash to the program."""
    data = _program()
    piece_size = PieceList.of(data).piece_size
    holder = Identity.generate()

    async def scenario(jobs) -> None:
        def ask(grant):
            return _ask(jobs.piece_server, GetPiece(H, 0, piece_size, grant=grant))

        junk, mine = jobs.uploads.begin(H, BOB), os.urandom(32)
        junk.receiving(len(data), None, mine)
        junk.arrived(b"x" * len(data))
        reply = (await ask(proof(mine, PIECE, holder.peer_id, "peer")))[0]
        assert reply.code == "rejected" and "not shared" in reply.message  # the cached copy is not the junk's
        jobs.uploads.end(junk)

        honest, theirs = jobs.uploads.begin(H, ALICE), os.urandom(32)
        honest.receiving(len(data), None, theirs)
        honest.arrived(data)
        assert bytes((await ask(proof(theirs, PIECE, holder.peer_id, "peer")))[0]) == data[:piece_size]
        assert (await ask(proof(mine, PIECE, holder.peer_id, "peer")))[0].code == "rejected"

    async def coming(jobs) -> None:
        from gpunet.worker.payloads import Receiving

        upload, token = jobs.uploads.begin(H, ALICE), os.urandom(32)
        arriving = Receiving(len(data))
        upload.receiving(len(data), arriving, token)
        grant = proof(token, PIECE, holder.peer_id, "peer")
        assert (await _ask(jobs.piece_server, GetPiece(H, 0, piece_size, grant=grant)))[0].code == "busy"
        arriving.write(data[:piece_size])
        assert bytes((await _ask(jobs.piece_server, GetPiece(H, 0, piece_size, grant=grant)))[0]) == data[:piece_size]
        other = proof(os.urandom(32), PIECE, holder.peer_id, "peer")
        assert (await _ask(jobs.piece_server, GetPiece(H, 0, piece_size, grant=other)))[0].code == "rejected"

    for on_disk, run in ((True, scenario), (False, coming)):
        disk = DiskCache(tmp_path / f"programs-{on_disk}", 1 << 30)
        if on_disk:
            disk.put(H, data)
        with Ledger(tmp_path / f"ledger-{on_disk}.sqlite") as ledger:
            jobs = Jobs(identity=holder, executor=_DiskOnly(disk), ledger=ledger,
                        admission=Admission(price_nano=1, max_concurrent=1, max_queue=1), record=lambda: None)
            asyncio.run(run(jobs))
