"""Speed proofs: a worker proves how fast it multiplies matrices, and routing credits a claim only as far as it is
proven. The exchange and its checks, the worker's rationing, the client's policy over a fake transport, routing on
credited speed, and a real swarm where a worker claims a thousand times its speed."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpunet import protocol, speedproof
from gpunet.client.proofs import ProofConfig, SpeedProofs
from gpunet.client.routing import Requirements, Router
from gpunet.client.reputation import Reputation
from gpunet.identity import Identity
from gpunet.errors import JobRejected, NoWorkersAvailable, ProtocolError, SpeedProofFailed, WorkerBusy
from gpunet.protocol import OpenProof, ProofOpening, ProveSpeed, SpeedCommitment
from gpunet.worker.state.admission import Admission, ServiceLimits
from tests.test_routing import HEAVY, worker
from tests.swarm import wait_for

N = speedproof.SIZES[0]


class _Keys(dict):
    """A fresh identity per worker name, made on first use (bound challenges need a real key behind each id)."""

    def __missing__(self, name: str) -> Identity:
        self[name] = Identity.generate()
        return self[name]


_NAMED = _Keys()
ID = {n: _NAMED[n].peer_id for n in ("slow", "fast", "mid", "liar", "w", "dodger", "refuser")}
KEYS = {identity.peer_id: identity for identity in _NAMED.values()}


def _challenge(seconds: float = 0.05) -> speedproof.Challenge:
    return speedproof.Challenge(os.urandom(speedproof.SEED_BYTES), N, seconds)


# --- the exchange ----------------------------------------------------------------------------------------------------


def test_an_honest_worker_passes_and_its_fast_path_computes_the_reference_numbers():
    ch = _challenge()
    digests = speedproof.prove(ch, max_products=5)
    commitments = speedproof.commit(digests)
    weights = speedproof._weights(ch.seed, N, "cpu")
    for j, c in enumerate(commitments):  # the in-place fast path gives exactly matrix() @ matrix() and row_digests()
        a, b = speedproof.pair(j)
        product = speedproof.matrix(ch.seed, a, N) @ speedproof.matrix(ch.seed, b, N)
        assert c == speedproof.commitment(speedproof.row_digests(product, weights))
    picks = speedproof.pick(len(commitments), N)
    speedproof.verify(ch, commitments, picks, speedproof.open_products(ch, picks, digests))


def test_products_reuse_a_small_pool_of_matrices():
    pairs = [speedproof.pair(j) for j in range(100)]
    assert len(set(pairs)) == 100  # every product distinct
    assert max(max(p) for p in pairs) == 9  # 100 products from 10 matrices


def test_a_worker_that_skipped_products_is_caught():
    ch = _challenge()
    honest = speedproof.prove(ch, max_products=4)
    padded = speedproof.commit(honest) + [os.urandom(speedproof.COMMIT_BYTES) for _ in range(12)]  # claims 4x
    caught = 0
    for _ in range(5):
        picks = speedproof.pick(len(padded), N)
        # A skipped product cannot be opened to match its commitment: the cheat can only open the real digests.
        computed = honest + [bytes(8 * N)] * 12
        try:
            speedproof.verify(ch, padded, picks, speedproof.open_products(ch, picks, computed))
        except SpeedProofFailed as e:
            assert "not the ones committed to" in str(e)
            caught += 1
    assert caught == 5  # passing needs all 6 picks among the 4 real products of 16: impossible


def test_wrong_rows_and_incomplete_openings_are_caught():
    ch = _challenge()
    digests = speedproof.prove(ch, max_products=3)
    commitments = speedproof.commit(digests)
    picks = speedproof.pick(len(commitments), N, rng=random.Random(1))
    opened = speedproof.open_products(ch, picks, digests)
    first = opened[0]
    row, raw = next(iter(first.rows.items()))
    bad_row = bytearray(raw)
    bad_row[0] ^= 1
    forged = [speedproof.Opening(first.product, first.digests, {**first.rows, row: bytes(bad_row)}), *opened[1:]]
    with pytest.raises(SpeedProofFailed, match="is wrong"):
        speedproof.verify(ch, commitments, picks, forged)
    with pytest.raises(SpeedProofFailed, match="exactly the products"):
        speedproof.verify(ch, commitments, picks, opened[1:])
    missing = [speedproof.Opening(first.product, first.digests, {}), *opened[1:]]
    with pytest.raises(SpeedProofFailed, match="missing"):
        speedproof.verify(ch, commitments, picks, missing)


def test_challenges_a_worker_should_not_take_are_refused_on_the_wire():
    good = ProveSpeed(os.urandom(16), N, 1.0)
    assert protocol.decode(protocol.encode(good), ProveSpeed) == good
    for bad in (ProveSpeed(b"short", N, 1.0), ProveSpeed(os.urandom(16), 8192, 1.0),
                ProveSpeed(os.urandom(16), N, speedproof.MAX_SECONDS * 10), ProveSpeed(os.urandom(16), N, 0.0)):
        with pytest.raises(ProtocolError, match="speed challenge"):
            protocol.decode(protocol.encode(bad), ProveSpeed)
    with pytest.raises(ProtocolError):  # more commitments than any challenge allows
        protocol.decode(protocol.encode(SpeedCommitment((b"x" * 16,) * (speedproof.MAX_PRODUCTS + 1))))
    with pytest.raises(ProtocolError):  # rows beyond the matrix, or too many of them
        protocol.decode(protocol.encode(OpenProof(os.urandom(16), N, {0: [N]})))
    with pytest.raises(ProtocolError):
        protocol.decode(protocol.encode(OpenProof(os.urandom(16), N, {0: list(range(speedproof.PICK_ROWS + 1))})))
    opening = speedproof.Opening(0, b"\0" * 8, {1: b"\0" * 4})
    with pytest.raises(ProtocolError, match="at most"):
        protocol.decode(protocol.encode(ProofOpening((opening,) * (speedproof.PICK_PRODUCTS + 1))))


def test_a_worker_takes_only_the_challenge_its_own_claim_calls_for(tmp_path):
    """From an attacker's review: a 4096x4096 fp16 challenge to a CPU worker (any client may send one) kept it busy
    for minutes on one product, refusing every honest client's challenge meanwhile."""
    from gpunet.dht.records import DeviceInfo, WorkerRecord
    from gpunet.identity import Identity
    from gpunet.ledger import Ledger
    from gpunet.worker.doors import Doors
    from gpunet.worker.jobs import Jobs

    record = WorkerRecord(version="t", state="online", device=DeviceInfo(kind="cpu", name="cpu", cores=2),
                          tflops={"fp32": 0.2, "bf16": 0.9})
    assert speedproof.terms(record.tflops) == ("bf16", N)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = Doors(Jobs(identity=Identity.generate(), executor=None, ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=1), record=lambda: record))

        async def ask(n: int, dtype: str):
            reply = await service.prove(protocol.encode(ProveSpeed(os.urandom(16), n, 0.01, dtype)), "c")
            return protocol.decode(reply, SpeedCommitment, protocol.Error)

        for n, dtype in ((4096, "fp16"), (N, "fp16"), (2048 * 2, "fp32")):  # a dtype it does not claim; too big
            refused = asyncio.run(ask(n, dtype))
            assert isinstance(refused, protocol.Error) and f"{N}x{N} bf16" in refused.message, refused
        refused = asyncio.run(ask(4096, "bf16"))  # two sizes above its claim
        assert isinstance(refused, protocol.Error) and f"{N}x{N} bf16" in refused.message, refused
        assert isinstance(asyncio.run(ask(N, "bf16")), SpeedCommitment)
        service.admission._proofs.pop("c")  # (one challenge per client per interval)
        assert isinstance(asyncio.run(ask(N, "fp32")), SpeedCommitment)  # its other claim: a claim read earlier


def test_an_answer_computed_for_another_identity_checks_out_for_nobody_else():
    """Issue 38: a bound challenge's matrices come from the seed and the prover's id. What an honest worker computed
    for its own id fails for a relay that passes it on, whether the relay sends the honest signature or its own."""
    honest, relay = Identity.generate(), Identity.generate()
    seed = os.urandom(speedproof.SEED_BYTES)
    asked = speedproof.Challenge(seed, N, 0.05, "fp32", relay.peer_id)  # what the client checks against
    computed = speedproof.Challenge(seed, N, 0.05, "fp32", honest.peer_id)  # what the honest worker computes
    assert asked.key != computed.key != seed
    digests = speedproof.prove(computed, max_products=3)
    commitments = speedproof.commit(digests)
    with pytest.raises(SpeedProofFailed, match="not signed"):  # the honest worker's own signature
        speedproof.check_signature(asked, commitments, honest.sign(computed.statement(commitments)))
    speedproof.check_signature(asked, commitments, relay.sign(asked.statement(commitments)))  # re-signed: passes...
    picks = speedproof.pick(len(commitments), N)
    with pytest.raises(SpeedProofFailed, match="wrong"):  # ...but the rows are another id's matrices
        speedproof.verify(asked, commitments, picks, speedproof.open_products(computed, picks, digests))
    unbound = speedproof.Challenge(seed, N, 0.05, "fp32")  # the unbound form of the same seed: no better
    digests = speedproof.prove(unbound, max_products=3)
    commitments = speedproof.commit(digests)
    with pytest.raises(SpeedProofFailed, match="wrong"):
        speedproof.verify(asked, commitments, picks := speedproof.pick(len(commitments), N),
                          speedproof.open_products(unbound, picks, digests))
    # and the honest worker's own proof checks out for it
    digests = speedproof.prove(computed, max_products=3)
    commitments = speedproof.commit(digests)
    speedproof.check_signature(computed, commitments, honest.sign(computed.statement(commitments)))
    picks = speedproof.pick(len(commitments), N)
    speedproof.verify(computed, commitments, picks, speedproof.open_products(computed, picks, digests))


def test_a_worker_binds_a_challenge_to_its_own_id_and_signs_it(tmp_path):
    """The id a bound challenge is computed for is the worker's own, never one named by whoever asks (a relay cannot
    have an honest worker compute for the relay's id); an old client's unbound challenge is answered as before."""
    from gpunet.dht.records import DeviceInfo, WorkerRecord
    from gpunet.ledger import Ledger
    from gpunet.worker.doors import Doors
    from gpunet.worker.jobs import Jobs

    me, relay = Identity.generate(), Identity.generate()
    record = WorkerRecord(version="t", state="online", device=DeviceInfo(kind="cpu", name="cpu", cores=2),
                          tflops={"fp32": 0.2})
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = Doors(Jobs(identity=me, executor=None, ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=1), record=lambda: record))

        async def exchange(client: str, wire: dict):
            reply = protocol.decode(await service.prove(_encode(wire), client),
                                    SpeedCommitment, protocol.Error)
            assert isinstance(reply, SpeedCommitment), reply
            picks = speedproof.pick(len(reply.commitments), N)
            opened = protocol.decode(await service.prove(protocol.encode(OpenProof(wire["seed"], N, picks)), client),
                                     ProofOpening)
            return reply, picks, opened.openings

        seed = os.urandom(16)
        # a request naming another id (a field no version defines) changes nothing: the worker's own id is used
        bound = {"t": "prove_speed", "seed": seed, "n": N, "seconds": 0.05, "dtype": "fp32", "bind": True,
                 "prover": relay.peer_id}
        reply, picks, openings = asyncio.run(exchange("c1", bound))
        mine = speedproof.Challenge(seed, N, 0.05, "fp32", me.peer_id)
        speedproof.check_signature(mine, reply.commitments, reply.signature)
        speedproof.verify(mine, reply.commitments, picks, openings)
        theirs = speedproof.Challenge(seed, N, 0.05, "fp32", relay.peer_id)
        with pytest.raises(SpeedProofFailed):
            speedproof.check_signature(theirs, reply.commitments, reply.signature)
        old = {"t": "prove_speed", "seed": seed, "n": N, "seconds": 0.05, "dtype": "fp32"}
        reply, picks, openings = asyncio.run(exchange("c2", old))
        assert reply.signature == b""
        speedproof.verify(speedproof.Challenge(seed, N, 0.05), reply.commitments, picks, openings)


def _encode(wire: dict) -> bytes:
    import msgpack

    return msgpack.packb(wire, use_bin_type=True)


def test_bound_challenges_and_signed_commitments_on_the_wire():
    bound = ProveSpeed(os.urandom(16), N, 0.5, "fp32", bind=True)
    assert protocol.decode(protocol.encode(bound), ProveSpeed) == bound
    old = ProveSpeed(os.urandom(16), N, 0.5)
    assert "bind" not in old.to_wire() and protocol.decode(protocol.encode(old), ProveSpeed).bind is False
    signed = SpeedCommitment((b"c" * 16,), b"s" * 64)
    assert protocol.decode(protocol.encode(signed), SpeedCommitment) == signed
    assert protocol.decode(protocol.encode(SpeedCommitment((b"c" * 16,))), SpeedCommitment).signature == b""
    with pytest.raises(ProtocolError, match="signature"):
        protocol.decode(protocol.encode(SpeedCommitment((b"c" * 16,), b"s" * 65)), SpeedCommitment)
    with pytest.raises(ValueError, match="peer id"):
        speedproof.Challenge(os.urandom(16), N, 0.5, "fp32", "x" * 1000).check()


# --- the worker's rationing ------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_challenges_are_rationed_per_client_and_in_all_and_opened_once_by_their_sender():
    clock = _Clock()
    a = Admission(price_nano=1, max_concurrent=1, max_queue=4, clock=clock, limits=ServiceLimits(max_proofs_per_minute=3))
    seed = os.urandom(16)
    a.screen_proof("alice")
    a.proof_started("alice", seed, N)
    with pytest.raises(WorkerBusy):  # one at a time
        a.screen_proof("bob")
    a.proof_ended("alice", products=10)
    with pytest.raises(JobRejected, match="one speed challenge per client"):
        a.screen_proof("alice")
    with pytest.raises(JobRejected, match="no speed challenge of this client"):
        a.screen_opening("bob", seed, N, [0])  # only its sender opens it
    with pytest.raises(JobRejected, match="has 10 products"):
        a.screen_opening("alice", seed, N, [10])
    a.screen_opening("alice", seed, N, [0, 9])
    a.opening_started("alice")
    a.proof_ended("alice")
    with pytest.raises(JobRejected, match="opened once"):
        a.screen_opening("alice", seed, N, [0])
    for name in ("bob", "carol"):
        a.screen_proof(name)
        a.proof_started(name, os.urandom(16), N)
        a.proof_ended(name, products=1)
    with pytest.raises(WorkerBusy, match="other speed challenges"):  # 3 a minute in all, whoever asks
        a.screen_proof("dave")
    clock.now += 61
    a.screen_proof("dave")
    clock.now += ServiceLimits().proof_interval
    a.screen_proof("alice")
    a.drain()
    with pytest.raises(WorkerBusy, match="leaving"):
        a.screen_proof("erin")


# --- routing on credited speed ---------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(claimed=st.floats(1e-6, 1e4), proven=st.floats(1e-9, 1e4))
@example(claimed=1000.0, proven=0.062151274541366194)  # a fresh clone's CI: the scaled claim was one bit over the cap
def test_routing_never_credits_more_than_the_cap_of_a_proof_to_the_bit(claimed, proven):
    r = Router()
    w = worker("w", tflops=claimed)
    r.update([w])
    r.on_proof("w", proven)
    assert r.credited_tflops(w, "fp32") <= speedproof.credit_cap(proven)
    assert r.credited_tflops(w) == min(claimed, speedproof.credit_cap(proven))


def test_a_bf16_challenge_stays_at_a_size_where_every_honest_product_is_exact():
    """From a review: at n = 4096 one bf16 proof in about 20,000 holds a product entry beyond 256, which bf16 rounds:
    an honest GPU worker would have failed its proof and been recorded as lying."""
    gpu = {"fp32": 60.0, "fp16": 890.0, "bf16": 900.0}
    assert speedproof.terms(gpu) == ("fp16", 4096)  # the same units, exact at that size
    assert speedproof.terms({"bf16": 900.0, "fp32": 60.0}) == ("bf16", 2048)  # no fp16 claimed: a smaller size
    assert speedproof.terms({"bf16": 1.0, "fp32": 0.2}) == ("bf16", 1024)
    assert speedproof.fits(gpu, "fp16", 4096) and speedproof.fits(gpu, "bf16", 4096)  # an older client's ask too


def test_a_claim_counts_only_as_far_as_it_is_proven():
    liar, honest = worker("liar", tflops=1000.0), worker("honest", tflops=0.2)
    r = Router()
    r.update([liar, honest])
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "liar"  # no proof yet: claims stand
    r.on_proof("honest", 0.15)
    assert r.credited_tflops(honest) == pytest.approx(0.2)  # within SLACK of its proof: its claim stands
    assert r.credited_tflops(liar) == pytest.approx(0.2)  # unproven: no more than the median proven worker
    r.on_proof("liar", 0.05)
    assert r.credited_tflops(liar) == speedproof.credit_cap(0.05)  # exactly the cap, as the next test needs
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "honest"
    with pytest.raises(NoWorkersAvailable, match="proved only 0.1 TFLOPS"):
        r.choose(Requirements(min_tflops=1.0), HEAVY)
    r.on_proof("liar", 0.0)  # failed its proof
    assert r.credited_tflops(liar) == 0.0
    r.update([honest])
    r.update([honest, liar])  # leaving and coming back does not wipe a poor proof
    assert r.credited_tflops(liar) == 0.0


def test_an_unproven_worker_never_outranks_the_typical_proven_one():
    r = Router()
    proven = [worker(f"p{i}", tflops=t) for i, t in enumerate((0.1, 1.0, 10.0))]
    refuser = worker("refuser", tflops=1000.0)
    r.update([*proven, refuser])
    for e, t in zip(proven, (0.1, 1.0, 10.0)):
        r.on_proof(e.id, t)
    assert r.credited_tflops(refuser) == pytest.approx(1.0)  # the median, not the fastest
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "p2"


def test_speed_delivered_on_checked_paid_jobs_outweighs_a_proof():
    """Issue 38: a worker that proved a fast device (once, or by borrowing another's) and then runs jobs slowly is
    credited what it delivered; one that proved little at a busy moment and delivers more is credited that; jobs too
    short for their FLOPs to dominate teach nothing."""
    r = Router()
    boaster, modest = worker("boaster", tflops=100.0), worker("modest", tflops=100.0)
    r.update([boaster, modest])
    r.on_proof("boaster", 40.0)
    r.on_proof("modest", 5.0)
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "boaster"  # proofs alone: 80 vs 10 TFLOPS
    r.on_delivered("boaster", 2e12, 0.01)  # a short job: its fixed costs would say nothing of the device
    r._overhead["boaster"] = 0.5  # a far worker: each job costs it half a second of round trips
    r.on_delivered("boaster", 2e12, 1.5)  # under 4 overheads: the round trips could be most of it
    assert r.credited_tflops(boaster) == speedproof.credit_cap(40.0)
    r.on_delivered("boaster", 2e12, 2.0)  # 1 TFLOPS delivered on a checked, paid job
    assert r.credited_tflops(boaster) == speedproof.credit_cap(1.0)
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "modest"  # scored by what it delivered
    with pytest.raises(NoWorkersAvailable, match="proved only 2 TFLOPS"):
        r.eligible(Requirements(min_tflops=5.0, dtype="fp32"), exclude={"modest"})
    r.on_delivered("modest", 60e12, 1.0)  # proved 5 at a busy moment, delivers 60
    assert r.credited_tflops(modest) == 100.0  # up to its claim, never beyond
    r.on_proof("modest", 0.0)  # even a later failed proof does not erase speed it delivered
    assert r.credited_tflops(modest) == 100.0
    newcomer = worker("newcomer", tflops=1000.0)
    r.update([boaster, modest, newcomer])
    assert r.credited_tflops(newcomer) <= 100.0  # unproven: at most the median measured worker
    # Unchecked paid jobs (a wrong answer can come fast) only ever lower a credit.
    r.on_proof("unchecked", 10.0)
    unchecked = worker("unchecked", tflops=100.0)
    r.update([boaster, modest, newcomer, unchecked])
    r.on_delivered("unchecked", 500e12, 1.0, checked=False)
    assert r.credited_tflops(unchecked) == speedproof.credit_cap(10.0)
    r.on_delivered("unchecked", 1e12, 1.0, checked=False)
    assert r.credited_tflops(unchecked) < speedproof.credit_cap(10.0)
    r.on_delivered("newcomer", 1e12, 1.0, checked=False)
    assert r.credited_tflops(newcomer) < 100.0


# --- the client's policy, over a fake transport ----------------------------------------------------------------------


class _FakeProver:
    """A worker's side of the prove door in-process; ``skip``: claim this many times the products actually done."""

    def __init__(self, skip: int = 1, busy: int = 0, seconds=(0.5,)):
        self.skip, self.busy, self.challenges, self.digests = skip, busy, [], {}
        self.seconds = list(seconds)  # what the client's clock reads for each proof in turn (the last one repeats)
        self.tflops = []  # what each proof shows
        self.bound = {}  # worker -> its last challenge, as computed

    async def prove(self, worker_id, message: ProveSpeed):
        if self.busy:
            self.busy -= 1
            raise WorkerBusy("busy")
        # As an honest worker does: bound to its own id when asked, and signed with its own key.
        ch = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype,
                                  worker_id if message.bind else "")
        self.challenges.append(worker_id)
        self.bound[worker_id] = ch
        done = speedproof.prove(ch, max_products=4)
        fake = [os.urandom(8 * ch.n) for _ in range(len(done) * (self.skip - 1))]  # digests of nothing computed
        self.digests[worker_id] = done + fake
        seconds = self.seconds.pop(0) if len(self.seconds) > 1 else self.seconds[0]
        self.tflops.append(speedproof.proven_tflops(ch, len(done + fake), seconds))
        commitments = tuple(speedproof.commit(done + fake))
        signature = KEYS[worker_id].sign(ch.statement(commitments)) if ch.prover else b""
        return SpeedCommitment(commitments, signature), seconds

    async def open_proof(self, worker_id, request: OpenProof):
        ch = self.bound[worker_id]
        return ProofOpening(tuple(speedproof.open_products(ch, request.picks, self.digests[worker_id])))


def _proofs(transport, *entries, **config) -> SpeedProofs:
    r = Router()
    r.update(entries)
    config.setdefault("timeout", 300.0)  # a claim of 1000 TFLOPS is proven at n = 4096: slow on a loaded CPU
    return SpeedProofs(transport, r, Reputation(), ProofConfig(seconds=0.05, **config))


async def _settle(p: SpeedProofs) -> None:
    while p._tasks:
        await asyncio.gather(*p._tasks)


def test_honest_workers_are_proven_and_the_fastest_claims_go_first():
    async def main():
        prover = _FakeProver()
        p = _proofs(prover, worker(ID["slow"], tflops=0.1), worker(ID["fast"], tflops=5.0), worker(ID["mid"], tflops=1.0),
                    concurrent=1)
        assert [e.id for e in p.due(p.router.workers.values())] == [ID["fast"]]
        for _ in range(3):
            p.schedule(p.router.workers.values())
            await _settle(p)
        assert prover.challenges[0] == ID["fast"] and sorted(prover.challenges[1:]) == sorted([ID["mid"], ID["slow"]])
        assert all(t > 0 for t in p.router.proven.values()) and len(p.router.proven) == 3
        p.schedule(p.router.workers.values())
        assert not p._tasks  # each worker once

    asyncio.run(main())


def test_a_flood_of_records_claiming_the_top_speeds_does_not_keep_the_others_unchallenged():
    """From an attacker's review: 256 records claiming 1e6 TFLOPS that never answer used up the challenges (fastest
    claims first, 256 per run), so neither a liar claiming 5,000 nor the honest workers were ever challenged. Every
    other challenge now goes to a worker drawn at random, and the budget of new ones refills each hour."""
    from gpunet.client.proofs import _Attempts

    sybils = [worker(f"sybil-{i}", tflops=1e6) for i in range(256)]
    liar, honest = worker("liar", tflops=5000.0), [worker(f"honest-{i}", tflops=50.0) for i in range(5)]
    p = SpeedProofs(None, None, None, rng=random.Random(7))
    now, challenged = 0.0, {}
    while now < 6 * 3600 and not ("liar" in challenged and all(h.id in challenged for h in honest)):
        due = p.due(sybils + [liar] + honest, now)
        p._picks += len(due)
        for e in due:  # what schedule() does, every challenge timing out
            a = p._attempts.setdefault(e.id, _Attempts())
            a.tries += 1
            if a.tries == 1:
                p._first_tries.append(now)
            challenged.setdefault(e.id, now)
            a.next_at = now + 30.5 + (30, 120, 600)[min(a.tries - 1, 2)]
        now += 30.5 / 2  # two in flight, each timing out after its seconds + 30 s
    assert "liar" in challenged and all(h.id in challenged for h in honest), f"after {now / 3600:.1f} h"
    assert max(challenged[w.id] for w in [liar, *honest]) < 3 * 3600


def test_a_worker_that_fakes_its_proof_is_credited_nothing_and_recorded_as_lying():
    async def main():
        p = _proofs(_FakeProver(skip=10), worker(ID["liar"], tflops=1000.0))
        p.schedule(p.router.workers.values())
        await _settle(p)
        assert p.router.proven.get(ID["liar"]) == 0.0
        assert p.reputation.honesty(ID["liar"]) < 1.0

    asyncio.run(main())


def test_a_busy_worker_is_asked_again_later_and_capped_meanwhile():
    async def main():
        clock = _Clock()
        p = _proofs(_FakeProver(busy=1), worker(ID["w"], tflops=1.0), retry_after=(30.0,))
        p.clock = clock
        p.schedule(p.router.workers.values())
        await _settle(p)
        assert ID["w"] not in p.router.proven
        p.schedule(p.router.workers.values())
        assert not p._tasks  # not before its retry time
        clock.now += 31
        p.schedule(p.router.workers.values())
        await _settle(p)
        assert p.router.proven.get(ID["w"]) > 0

    asyncio.run(main())


def test_a_proof_far_below_its_claim_is_asked_again_and_the_best_proof_counts(caplog):
    """A proof timed at a busy moment (the client tracing a model, the worker's CPU shared) shows a fraction of the
    device; it is asked again twice, the best valid proof counts, and the log says what was proven in which unit."""
    async def main():
        clock = _Clock()
        # a few products of 1024 x 1024 (8.6 GFLOP, under 0.05 TFLOPS in 0.5 s), then in 0.1 s, then in 1 s
        prover = _FakeProver(seconds=(0.5, 0.1, 1.0))
        p = _proofs(prover, worker(ID["w"], tflops=0.5), reprove_after=(330.0, 1800.0))
        p.clock = clock
        for step, wait in enumerate((0, 330, 1800)):
            clock.now += wait
            p.schedule(p.router.workers.values())
            assert p._tasks, f"proof {step + 1} asked"
            await _settle(p)
            assert p.router.proven.get(ID["w"]) == max(prover.tflops)
            p.schedule(p.router.workers.values())
            assert not p._tasks  # not again before its time
        assert prover.tflops[1] > prover.tflops[2]  # the best counted, not the last
        clock.now += 1e6
        p.schedule(p.router.workers.values())
        assert not p._tasks  # three proofs, and that is all

    with caplog.at_level("INFO", logger="gpunet.client"):
        asyncio.run(main())
    said = [r.getMessage() for r in caplog.records if "proved" in r.getMessage()]
    assert len(said) == 3 and "products of 1024x1024 in 0.50 s" in said[0], said
    assert "claims 0.5 TFLOPS fp32" in said[0] and "asked again in 330 s" in said[0], said
    assert "asked again" not in said[2], said


def test_a_proof_asked_again_that_does_not_complete_keeps_the_one_before():
    """The worker rations challenges (one per client per 300 s, a few a minute in all): a second ask it turns away
    must not cost it the proof it already gave."""
    async def main():
        clock = _Clock()
        prover = _FakeProver()
        p = _proofs(prover, worker(ID["w"], tflops=0.5), reprove_after=(330.0,), retry_after=(1.0, 1.0))
        p.clock = clock
        p.schedule(p.router.workers.values())
        await _settle(p)
        first = p.router.proven.get(ID["w"])
        assert 0 < first < 0.25  # below the claim: asked again later
        prover.busy = 100
        for _ in range(6):
            clock.now += 331
            p.schedule(p.router.workers.values())
            await _settle(p)
        assert p.router.proven.get(ID["w"]) == first

    asyncio.run(main())


class _Dodger(_FakeProver):
    """Commits, then will not open (its picks landed on products it skipped)."""

    async def open_proof(self, worker_id, request: OpenProof):
        raise WorkerBusy("busy")


def test_a_worker_that_commits_and_then_will_not_open_is_credited_nothing():
    async def main():
        p = _proofs(_Dodger(skip=2), worker(ID["dodger"], tflops=100.0))
        p.schedule(p.router.workers.values())
        await _settle(p)
        assert p.router.proven.get(ID["dodger"]) == 0.0

    asyncio.run(main())


def test_a_worker_that_never_takes_a_challenge_ends_up_credited_nothing():
    async def main():
        clock = _Clock()
        p = _proofs(_FakeProver(busy=100), worker(ID["refuser"], tflops=100.0), retry_after=(1.0, 1.0))
        p.clock = clock
        for _ in range(5):
            p.schedule(p.router.workers.values())
            await _settle(p)
            clock.now += 2
        assert p.router.proven.get(ID["refuser"]) == 0.0
        assert len(p.router.proven) == 1 and p._attempts[ID["refuser"]].tries == 3

    asyncio.run(main())


class _OldProver(_FakeProver):
    """A worker that predates bound challenges: it ignores ``bind`` and answers unsigned, for the bare seed."""

    async def prove(self, worker_id, message: ProveSpeed):
        return await super().prove(worker_id, ProveSpeed(message.seed, message.n, message.seconds, message.dtype))


class _Relay(_FakeProver):
    """Passes each challenge to another identity's honest worker and answers with what it answered."""

    def __init__(self, honest_id: str, resign: bool = False):
        super().__init__()
        self.honest_id, self.resign = honest_id, resign

    async def prove(self, worker_id, message: ProveSpeed):
        committed, seconds = await super().prove(self.honest_id, message)
        if self.resign:  # signed again, as its own
            ch = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype, worker_id)
            committed = SpeedCommitment(committed.commitments, KEYS[worker_id].sign(ch.statement(committed.commitments)))
        return committed, seconds

    async def open_proof(self, worker_id, request: OpenProof):
        return await super().open_proof(self.honest_id, request)


def test_a_relayed_proof_is_credited_nothing_and_recorded_as_a_false_answer():
    async def main():
        for resign in (False, True):
            p = _proofs(_Relay(ID["mid"], resign), worker(ID["liar"], tflops=1.0))
            p.schedule(p.router.workers.values())
            await _settle(p)
            assert p.router.proven.get(ID["liar"]) == 0.0, resign
            assert p.reputation.honesty(ID["liar"]) < 1.0

    asyncio.run(main())


def test_a_bound_challenges_key_can_never_be_asked_as_an_unbound_seed():
    """A relay used to ask an honest worker for the unbound form with the relay's own bound key as the seed: the
    honest worker then computed exactly the relay's matrices (a bound key was a seed's length), and the relay signed
    the answer as its own. A bound key is longer than any seed, so no challenge, nor the wire, takes it as one."""
    bound = speedproof.Challenge(os.urandom(speedproof.SEED_BYTES), N, 0.5, prover=ID["liar"])
    assert len(bound.key) != speedproof.SEED_BYTES
    with pytest.raises(ValueError):
        speedproof.Challenge(bound.key, N, 0.5).check()
    with pytest.raises(ProtocolError):
        protocol.decode(protocol.encode(ProveSpeed(bound.key, N, 0.5)), ProveSpeed)


def test_a_worker_older_than_bound_challenges_is_simply_unproven():
    """Its unsigned answer proves nothing, and is held against nobody: it is asked again on the retry schedule and,
    like a worker that never takes a challenge, credited nothing once the tries are spent."""
    async def main():
        clock = _Clock()
        p = _proofs(_OldProver(), worker(ID["w"], tflops=1.0), retry_after=(1.0, 1.0))
        p.clock = clock
        p.schedule(p.router.workers.values())
        await _settle(p)
        assert ID["w"] not in p.router.proven and p.reputation.honesty(ID["w"]) == 1.0
        for _ in range(4):
            clock.now += 2
            p.schedule(p.router.workers.values())
            await _settle(p)
        assert p.router.proven.get(ID["w"]) == 0.0 and p.reputation.honesty(ID["w"]) == 1.0

    asyncio.run(main())


def test_a_slow_pong_cannot_make_a_proof_look_fast():
    from gpunet.client.transport import P2PTransport

    class _SlowPongRPC:
        async def ping(self, worker_id):
            await asyncio.sleep(0.5)  # the worker controls how fast it answers pings

        async def call(self, worker_id, door, message, *expect):
            await asyncio.sleep(0.5)
            return SpeedCommitment((b"c" * 16,))

    async def main():
        _, seconds = await P2PTransport(None, _SlowPongRPC()).prove("w", ProveSpeed(os.urandom(16), N, 0.5))
        assert seconds >= 0.45  # at most a tenth taken off for the network, whatever the ping said

    asyncio.run(main())


def test_the_proof_runs_in_the_dtype_of_the_best_claim_and_checks_exactly():
    ch = speedproof.Challenge.for_claim({"fp32": 0.2, "bf16": 1.1}, seconds=0.05)
    assert ch.dtype == "bf16" and ch.n == N
    assert speedproof.Challenge.for_claim({"fp32": 3.0, "fp16": 20.0}).n == 2048
    assert speedproof.Challenge.for_claim({"fp32": 60.0, "fp16": 800.0}).n == 4096
    digests = speedproof.prove(ch, max_products=3)
    commitments = speedproof.commit(digests)
    picks = speedproof.pick(len(commitments), N)
    speedproof.verify(ch, commitments, picks, speedproof.open_products(ch, picks, digests))
    with pytest.raises(ProtocolError, match="dtype"):
        protocol.decode(protocol.encode(ProveSpeed(os.urandom(16), N, 0.5, "int8")), ProveSpeed)


# --- a real swarm ----------------------------------------------------------------------------------------------------


@pytest.mark.swarm
def test_a_worker_claiming_a_thousand_times_its_speed_is_routed_on_what_it_proves(swarm, client_for, tmp_path):
    """The worker's cached benchmark says 1000 TFLOPS (its record publishes it); the client challenges it over the
    prove door, checks the answer, and credits it no more than SLACK times what it really multiplied."""
    from gpunet.worker import hardware, throughput

    data_dir = tmp_path / "boaster"
    data_dir.mkdir()
    key = throughput._cache_key(hardware.cpu_hardware())
    # fp32 only: its best claim sets the challenge's dtype, and a CPU without native bf16 (an AMD EPYC in CI) takes
    # minutes for one n = 4096 bf16 product, so a bf16 claim would time out instead of proving a low speed.
    (data_dir / throughput.CACHE_FILENAME).write_text(json.dumps({key: {"fp32": 1000.0}}))
    swarm.start_worker("--remeasure-every", "0", data_dir=data_dir)
    client = client_for(swarm)
    entry = client.workers()[0]
    assert entry.record.tflops["fp32"] == 1000.0
    router = client._core.router
    proven = wait_for(lambda: router.proven.get(entry.id), 60, "the client to check the worker's speed")
    assert 0 < proven < 10  # a CPU, whatever it claims
    assert router.credited_tflops(entry, "fp32") <= speedproof.credit_cap(proven)  # one expression, no ulp apart
    assert client.submit(*_tiny_job()).result(timeout=60) is not None  # and it still gets work


def _settled(router, worker_id: str, what: str) -> float:
    """What the client's challenge of ``worker_id`` came to (0.0 included), once there is an outcome."""
    wait_for(lambda: worker_id in router.proven, 240, what)
    return router.proven.get(worker_id)


def _tiny_job():
    import torch

    import gpunet

    job = gpunet.Job.from_module(torch.nn.Linear(4, 4).eval(), example_inputs=(torch.randn(2, 4),))
    return job, torch.randn(2, 4)


@pytest.mark.swarm
def test_a_relayed_speed_proof_credits_the_relay_nothing(swarm, client_for, tmp_path):
    """Issue 38: identities with no device advertise an H200 and pass every speed challenge on to an honest worker,
    answering with its answers (as they came, re-signed with their own key, or asked of it in the unbound form). On
    main the client credited the relay the honest worker's speed; now a challenge's matrices come from the seed and
    the prover's own id, so what the honest worker computed checks out for it alone."""
    from gpunet.testing.attacks import MODES, ProofRelay

    honest = swarm.start_worker("--remeasure-every", "0")
    honest_id = swarm.worker_id(honest)
    client = client_for(swarm)
    router = client._core.router
    target = next(e for e in client.workers() if e.id == honest_id)
    honest_proof = wait_for(lambda: router.proven.get(honest_id), 120, "the client to check the honest worker")
    with ProofRelay(tmp_path / "relays", swarm.network, [swarm.bootstrap_addr], honest_id, dict(target.record.tflops),
                    heartbeat=swarm.heartbeat) as relay:
        wait_for(lambda: set(relay.ids.values()) <= {e.id for e in client.workers(refresh=True)}, 60,
                 "the client to see the relays")
        for mode in MODES:  # as each relay's challenge is settled
            relay_id = relay.ids[mode]
            credited = _settled(router, relay_id, f"the client to challenge the {mode} relay")
            assert credited == 0.0, (f"the {mode} relay is credited a proof of {credited:.3g} TFLOPS (the honest "
                                     f"worker it relays to proved {honest_proof:.3g})")
            assert relay.relayed[mode] >= 1  # it did pass its challenge on
            entry = next(e for e in client.workers() if e.id == relay_id)
            assert router.credited_tflops(entry) == 0.0, mode
            assert client._core.reputation.honesty(relay_id) < 1.0  # an answer that did not check out
    assert router.proven.get(honest_id) >= honest_proof > 0  # the honest worker keeps its proof (or a better one)
