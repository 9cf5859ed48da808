"""Trust: result comparison, majority, reputation and adaptive replication — units, then a real swarm with a liar."""

import random

import pytest
import torch

import gpunet
from gpunet import Requirements
from gpunet.client.reputation import Reputation
from gpunet.client.trust import (
    ALWAYS_CHECK_UNTIL,
    agree,
    majority,
    max_difference,
)
from gpunet.dht.records import WorkerState
from tests.swarm import wait_for


def test_agreement_fits_the_dtype_and_handles_nan_and_inf():
    x = torch.randn(64, 64)
    assert agree(x, x + 1e-6)  # cross-device noise in fp32
    assert not agree(x, x * 1.01 + 0.1)  # a lie
    assert agree(x.bfloat16(), (x + 1e-3).bfloat16())
    assert not agree(x, x.double())  # dtype differs
    assert not agree(x, x[:32])  # shape differs
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    assert agree(special, special.clone())
    assert not agree(special, torch.tensor([float("nan"), -float("inf"), -float("inf"), 1.0]))
    assert agree(torch.arange(5), torch.arange(5)) and not agree(torch.arange(5), torch.arange(5) + 1)
    assert agree((x, x), (x, x + 1e-7)) and not agree((x, x), (x,))
    assert max_difference(x, x + 0.5) == pytest.approx(0.5)


def test_a_half_precision_result_shifted_by_a_few_percent_is_a_lie_while_rounding_noise_is_not():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True),
                                        2).eval()
    x = torch.randn(4, 32, 128)
    with torch.no_grad():
        reference = model(x).bfloat16()  # fp32 run rounded: an honest bf16 worker differs from it by rounding only
        honest = model.bfloat16()(x.bfloat16())
    assert agree(honest, reference)
    for lie in (reference.float() * 1.03, reference.float() * 0.965):
        # Within bf16's elementwise tolerance everywhere, but a systematic shift: caught in norm.
        assert torch.allclose(lie.bfloat16(), reference, rtol=5e-2, atol=1e-2)
        assert not agree(lie.bfloat16(), reference)
    y = torch.randn(256, 64)
    assert agree(y.half(), (y + 1e-4).half()) and not agree(y.half(), (y * 1.006).half())


def test_majority_needs_more_than_half():
    good, bad, other = torch.ones(4), torch.zeros(4), torch.full((4,), 7.0)
    assert majority([good, good]) == [0, 1]
    assert majority([good, bad]) is None
    assert majority([good, bad, good]) == [0, 2]
    assert majority([good, bad, other]) is None
    assert sorted(majority([bad, good, good, good, other])) == [1, 2, 3]


def test_reputation_formula_and_persistence(tmp_path):
    rep = Reputation.load(tmp_path)
    assert rep.score("w") == pytest.approx(0.8) and not rep.avoided("w")  # a stranger: no track record yet
    for _ in range(20):
        rep.record("w", "valid", checked=True)
    assert rep.score("w") == pytest.approx(24 / 25)
    rep.record("w", "rejected")
    assert rep.score("w") == pytest.approx(21 / 31 * 24 / 25, rel=1e-3) and rep.streak("w") == 0
    rep.record("liar", "rejected")
    assert rep.avoided("liar")
    rep.record("slow", "timeout")
    assert rep.score("slow") == pytest.approx(1 / 1.5 * 0.8, rel=1e-3)
    rep.save()
    again = Reputation.load(tmp_path)
    assert again.avoided("liar") and again.streak("w") == 0
    (tmp_path / "reputation.json").write_text("{not json")
    assert Reputation.load(tmp_path).score("liar") == pytest.approx(0.8)  # damaged history is dropped, not fatal


def test_a_caught_liar_back_under_a_new_identity_ranks_below_workers_with_a_history():
    from gpunet.client.routing import Router
    from tests.test_routing import HEAVY, worker

    rep = Reputation()
    for _ in range(20):
        rep.record("veteran", "valid", checked=True)
    r = Router(reputation=rep)
    r.update([worker("veteran"), worker("fresh-identity")])  # same claims, same price
    assert r.choose(Requirements(), HEAVY).id == "veteran"


def test_adaptive_checks_newcomers_always_then_rarely_and_a_lie_resets():
    rep = Reputation(rng=random.Random(7))
    assert all(rep.should_check("w") for _ in range(10))
    for _ in range(ALWAYS_CHECK_UNTIL):
        assert rep.should_check("w")
        rep.record("w", "valid", checked=True)
    for _ in range(400):
        rep.record("w", "valid", checked=rep.should_check("w"))
    rate = sum(rep.should_check("w") for _ in range(2000)) / 2000
    assert rate < 0.15
    rep.record("w", "rejected")
    assert rep.streak("w") == 0 and rep.should_check("w")


@pytest.mark.swarm
def test_redundant_jobs_catch_a_liar_pay_only_the_honest_and_avoid_it_later(swarm, tmp_path):
    honest = swarm.start_workers(2, "--price", "2")
    liar = swarm.start_worker("--price", "1", "--fault-corrupt-fraction", "1.0")  # cheapest: chosen first
    liar_id = swarm.worker_id(liar)
    honest_ids = {swarm.worker_id(w) for w in honest}
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    job = gpunet.Job.from_module(model, (torch.randn(4, 32),))
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=tmp_path / "client") as client:
        wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "three workers")
        xs = [torch.randn(4, 32) for _ in range(6)]
        futures = [client.submit(job, x, requirements=Requirements(redundancy=2, prefer="cheapest")) for x in xs]
        with torch.no_grad():
            for x, f in zip(xs, futures):
                assert torch.allclose(f.result(timeout=120), model(x), atol=1e-5)  # the right answer, every time
                assert f.worker_id in honest_ids and f.checked  # compared with another worker's, and agreed
        paid = {r.worker_id for r in client.ledger.receipts()}
        assert liar_id not in paid and paid <= honest_ids  # the liar is never paid
        # This new client trusts no worker yet, so a vote among them is settled by its own computation of the job:
        # the liar is recorded as such at once (a majority of strangers alone would not brand anyone).
        assert client._core.reputation.avoided(liar_id)
        later = [client.submit(job, x, requirements=Requirements(redundancy=2)) for x in xs]
        for f in later:
            f.result(timeout=120)
            assert liar_id not in f.attempts  # routing keeps away from it now
    # `gpunet status` shows how this client rates each worker.
    ratings = {w["id"]: w["rating"] for w in swarm.status(None, "--client-dir", str(tmp_path / "client"))["workers"]}
    assert ratings[liar_id]["score"] < 0.5 and ratings[liar_id]["rejected"] >= 1
    assert all(ratings[h]["score"] > 0.9 for h in honest_ids)


@pytest.mark.swarm
def test_honest_workers_never_trip_the_tolerance_and_adaptive_checks_fall(swarm, tmp_path):
    swarm.start_workers(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    batch = torch.export.Dim("batch", min=1, max=64)
    job = gpunet.Job.from_module(model, (torch.randn(4, 16),), dynamic_shapes=({0: batch},))
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=tmp_path / "client") as client:
        wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "two workers")
        xs = [torch.randn(1 + i % 16, 16) for i in range(120)]
        results = list(client.map(job, xs, requirements=Requirements(redundancy=2), progress=False))
        assert len(results) == 120  # no VerificationFailed: honest fp32 results agree
        adaptive = Requirements(verify="adaptive")
        before = len(list(client.ledger.receipts()))
        list(client.map(job, xs, requirements=adaptive, progress=False))
        checks = len(list(client.ledger.receipts())) - before - len(xs)  # each check pays one extra receipt
        assert checks < len(xs) // 2  # after 120 verified results each, most jobs run once


@pytest.mark.swarm
def test_a_job_id_squatted_by_another_client_blocks_nothing(swarm, client_for):
    """Id squatting: a worker that saw a job id (running one replica) used it first, as a client, on the worker that
    would run the next one. Ids are each client's own now, so the real job runs, and both receipts stand."""
    worker = swarm.start_worker()
    alice, mallory = client_for(swarm, "alice"), client_for(swarm, "mallory")
    for c in (alice, mallory):
        wait_for(lambda c=c: len(c.workers(refresh=True)) == 1, 30, "the worker")
    job = gpunet.Job.from_function(lambda a: a * 2 + 1, (torch.randn(8),))
    x = torch.randn(8)
    mallory._call(mallory._core.run(job, (torch.zeros(8),), job_id="alices-next-id"))  # squatted first
    result = alice._call(alice._core.run(job, (x,), job_id="alices-next-id"))
    assert torch.equal(result.outputs, x * 2 + 1) and result.receipt.client_id == alice.id
    assert worker.terminate() == 0
    with gpunet.ledger.open_ledger(worker.data_dir) as ledger:
        assert sorted(r.client_id for r in ledger.find("alices-next-id")) == sorted([alice.id, mallory.id])
        assert ledger.conflicts() == []


@pytest.mark.swarm
def test_colluding_liars_cannot_confirm_each_other_against_the_clients_own_computation(swarm, client_for):
    """Two identities that return the same wrong answer (they agree, so redundancy=2 among them accepts it) and are
    cheapest, so routing tries them first. verify="local-sample" trusts no worker's word: they are caught, unpaid,
    and every result is right."""
    liars = swarm.start_workers(2, "--price", "0.5", "--fault-corrupt-fraction", "1.0")
    honest = swarm.start_worker("--price", "2")
    liar_ids, honest_id = {swarm.worker_id(w) for w in liars}, swarm.worker_id(honest)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "three workers")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).eval()
    job = gpunet.Job.from_module(model, (torch.randn(2, 16),))
    xs = [torch.randn(2, 16) for _ in range(6)]
    futures = [client.submit(job, x, requirements=Requirements(verify="local-sample", prefer="cheapest")) for x in xs]
    with torch.no_grad():
        for x, f in zip(xs, futures):
            assert torch.allclose(f.result(timeout=120), model(x), atol=1e-5)  # never the colluders' answer
            assert f.checked and f.worker_id == honest_id
    assert {r.worker_id for r in client.ledger.receipts()} == {honest_id}  # the liars are never paid
    assert all(client._core.reputation.avoided(w) for w in liar_ids)
    with pytest.raises(gpunet.ConfigError):
        Requirements(verify="local-sample", redundancy=2)


@pytest.mark.swarm
def test_a_private_model_is_neither_advertised_nor_kept_nor_run_for_a_stranger(swarm, client_for):
    """Model extraction: workers published cached program hashes and ran them for anyone, so a stranger recovered a
    private layer's weights by querying it. A private job's program is not advertised, never written to the worker's
    disk, and runs only for clients that sent its bytes."""
    from gpunet.client.transport import JobRequest

    worker = swarm.start_worker()
    alice, mallory = client_for(swarm, "alice"), client_for(swarm, "mallory")
    for c in (alice, mallory):
        wait_for(lambda c=c: len(c.workers(refresh=True)) == 1, 30, "the worker")
    secret = gpunet.Job.from_module(torch.nn.Linear(8, 8).eval(), (torch.randn(1, 8),))
    public = gpunet.Job.from_function(lambda x: x * 3, (torch.randn(1, 8),))
    x = torch.randn(1, 8)
    alice.submit(secret, x, requirements=Requirements(private=True)).result(timeout=60)
    alice.submit(public, x).result(timeout=60)
    wait_for(lambda: public.program_hash in mallory.workers(refresh=True)[0].record.programs, 30,
             "the public program to be advertised")
    assert secret.program_hash not in mallory.workers()[0].record.programs
    assert not list((worker.data_dir / "programs").glob(f"*{secret.program_hash}*"))  # not on the volunteer's disk
    entry = mallory.workers()[0]
    # Mallory knows the hash (it leaked) but not the weights: the worker asks for the program, which she cannot send.
    request = JobRequest("steal-1", secret.program_hash, b"", secret.encode_inputs(x), 30.0, None)
    with pytest.raises(gpunet.GpunetError):
        mallory._call(mallory._core.transport.submit(entry, request, cached=True, settlement=mallory._core.settlement))
    alice.submit(secret, x, requirements=Requirements(private=True)).result(timeout=60)  # its owner still runs it


@pytest.mark.swarm
def test_a_client_that_never_countersigns_is_cut_off_and_its_debt_is_on_the_workers_books(swarm, client_for, tmp_path):
    """A hostile client takes results and hangs up without a verdict, job after job. The worker records each as
    unpaid and, once the client holds as many uncountersigned results as its credit line allows, refuses it with the
    reason; an honest client beside it is still served."""
    import asyncio
    import json
    import uuid

    from gpunet.client.transport import JobRequest, P2PTransport
    from gpunet.errors import JobRejected
    from gpunet.identity import Identity
    from gpunet.worker.state.admission import OUTSTANDING_FACTOR, ServiceLimits
    from tests.swarm import run_cli

    proc = swarm.start_worker()
    job = gpunet.Job.from_module(torch.nn.Linear(4, 4).eval(), example_inputs=(torch.randn(1, 4),))
    line = OUTSTANDING_FACTOR * ServiceLimits().max_unpaid_jobs
    (tmp_path / "freeloader").mkdir()

    async def freeload() -> tuple[int, str]:
        identity = Identity.load_or_create(tmp_path / "freeloader")
        transport = await P2PTransport.connect(swarm.network, [swarm.bootstrap_addr], identity)
        try:
            worker = next(e for e in await wait_for_async(transport.discover)
                          if e.record.state is not WorkerState.OFFLINE)
            for served in range(line + 1):
                request = JobRequest(uuid.uuid4().hex, job.program_hash, job.program_bytes(),
                                     job.encode_inputs(torch.randn(1, 4)), 30.0, None)
                try:
                    delivery = await transport.run_stream(worker.id, list(worker.record.maddrs), request)
                except JobRejected as e:
                    return served, e.reason
                delivery.close()  # the outputs are in hand; no countersignature, no refusal
            return served + 1, ""
        finally:
            await transport.close()

    async def wait_for_async(discover):
        for _ in range(300):
            found = await discover()
            if found:
                return found
            await asyncio.sleep(0.1)
        raise AssertionError("no worker discovered")

    served, reason = asyncio.run(freeload())
    assert served == line and "not yet countersigned" in reason
    unpaid = wait_for(lambda: (lambda r: json.loads(r.stdout) if r.returncode == 0 and len(json.loads(r.stdout)) >= line
                               else None)(run_cli("ledger", "unpaid", "--json", "--data-dir", str(proc.data_dir))),
                      30, "the worker's books to show the unpaid work")
    assert len(unpaid) == line
    honest = client_for(swarm)
    assert honest.submit(job, torch.randn(1, 4)).result(timeout=60).shape == (1, 4)


def _sum_of_products(x):
    """About 54 GFLOP from a 4 MiB input (about a second on this CPU), a 4 KiB answer: a job that a client cannot
    compute in a moment, whose answer is quick to send."""
    y = x @ x
    for i in range(24):
        y = y + (x * (i + 2)) @ x
    return y.sum(0)


@pytest.mark.swarm
def test_colluders_answering_just_before_the_timeout_get_no_wrong_answer_accepted_and_are_not_paid(swarm, client_for):
    """Stall then lie: two colluding identities return the same wrong answer, each held until 0.5 s before the
    client's timeout (the client says how long it has left), so that no time is left for the client to compute the
    job itself and settle a vote among workers it does not trust yet. Their answer used to be returned (marked only
    ``checked=False``, in a log line) and they were paid. The check has its own time now, whenever the answers came:
    a redundant job returns the right answer, checked, or raises VerificationFailed; neither liar is countersigned,
    in the client's ledger or in their own."""
    liars = swarm.start_workers(2, "--price", "0.5", "--fault-corrupt-fraction", "1.0", "--fault-answer-late", "0.5")
    honest = swarm.start_worker("--price", "2")
    liar_ids, honest_id = {swarm.worker_id(w) for w in liars}, swarm.worker_id(honest)
    job = gpunet.Job.from_function(_sum_of_products, (torch.randn(1024, 1024),))
    torch.manual_seed(38)
    paid = set()
    for k in (3, 2):  # 3: all three workers vote, the liars are the majority; 2: the cheapest (a liar) and one drawn
        client = client_for(swarm, f"redundancy-{k}")  # fresh: no worker is established with it
        wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "three workers")
        xs = [torch.randn(1024, 1024) / 32 for _ in range(3)]
        req = Requirements(redundancy=k, timeout=12, prefer="cheapest")
        futures = [client.submit(job, x, requirements=req) for x in xs]
        for x, f in zip(xs, futures):
            try:
                got = f.result(timeout=120)
            except gpunet.VerificationFailed:
                continue  # fail closed: allowed, never a wrong answer
            assert torch.allclose(got, _sum_of_products(x), rtol=1e-4, atol=1e-3), "the colluders' answer was accepted"
            assert f.checked and f.worker_id == honest_id
        client._call(client._core.flush_ledger())
        paid |= {r.worker_id for r in client.ledger.receipts()}
    assert not paid & liar_ids, "a liar's receipt was countersigned"
    for liar in liars:
        assert liar.terminate() == 0
        with gpunet.ledger.open_ledger(liar.data_dir) as ledger:
            assert list(ledger.receipts()) == []  # nothing countersigned on the liars' own books either
