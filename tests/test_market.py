"""The market on a real swarm, through the public API: lanes, preemption, the batch floor, fair share, deadlines,
and receipts that say which lane and what price (docs/market.md)."""

import re
import time
import urllib.request

import pytest
import torch

import gpunet
from gpunet import Requirements
from gpunet.testing.workloads import Churn, Spin
from tests.swarm import free_port, run_cli, wait_for

pytestmark = pytest.mark.swarm
NANO = 10**9


def spin_job(rows: int, k: int = 96):
    model = Spin(k=k).eval()
    x = torch.randn(rows, 1024)
    return model, gpunet.Job.from_module(model, (x,)), x


def lane_jobs(port: int, lane: str, state: str) -> float:
    """What the worker's Prometheus endpoint says of one lane (as a volunteer's monitoring would read it)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'^gpunet_lane_jobs{{lane="{lane}",state="{state}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_an_interactive_job_preempts_batch_work_which_completes_elsewhere_paid_once(swarm, client_for):
    port = free_port()
    cheap = swarm.start_worker("--price", "2", "--batch-price", "1", "--metrics-port", str(port))
    dear = swarm.start_worker("--price", "3", "--batch-price", "1.5")
    cheap_id, dear_id = swarm.worker_id(cheap), swarm.worker_id(dear)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    model, job, x = spin_job(4096, k=192)
    # The urgent job is exported before the batch job starts: under CI's load an export took seconds, and the batch
    # job (8 s of work on an AVX-512 core) had ended by the time the urgent one arrived.
    small_model, small, y = spin_job(8, k=2)
    batch = client.submit(job, x, requirements=Requirements(priority="batch", max_price=2, prefer="cheapest",
                                                             timeout=300))
    wait_for(lambda: lane_jobs(port, "batch", "running") == 1, 120, "the batch job to run on the cheapest worker")

    urgent = client.submit(small, y, requirements=Requirements(max_price=2.5, timeout=120))  # only `cheap` qualifies
    with torch.no_grad():
        assert torch.equal(urgent.result(timeout=120), small_model(y))
    assert urgent.worker_id == cheap_id
    assert urgent.receipt.lane == "interactive" and urgent.receipt.price == 2 * NANO

    # The batch job was stopped on `cheap`, not billed there, and ran again on `dear`: paid once, as batch work,
    # at dear's floor (idle: its batch price), within the bid.
    with torch.no_grad():
        assert torch.allclose(batch.result(timeout=300), model(x), atol=1e-4)
    assert batch.attempts[0] == cheap_id and batch.worker_id == dear_id
    assert batch.receipt.lane == "batch" and batch.receipt.price == int(1.5 * NANO)
    paid = [r for r in client.ledger.receipts() if r.job_id == batch.receipt.job_id]
    assert len(paid) == 1 and paid[0].worker_id == dear_id
    export = run_cli("ledger", "export", "--format", "csv", "--data-dir", str(client.ledger.path.parent))
    assert export.returncode == 0 and ",batch," in export.stdout and ",interactive," in export.stdout
    assert cheap.terminate() == 0
    from gpunet.ledger import open_ledger

    with open_ledger(cheap.data_dir) as ledger:  # it neither billed nor holds anything unpaid for the stopped job
        assert batch.receipt.job_id not in {r.job_id for r in ledger.receipts()}
        assert batch.receipt.job_id not in {r.job_id for r in ledger.unpaid()}
    assert "stopped for an interactive job" in cheap.output


def test_a_long_batch_job_after_tiny_ones_is_still_preempted(swarm, client_for):
    """Attack: five tiny batch jobs made the client's typical time tiny, and its long batch job, running past that,
    counted as nearly done for ever: it held the worker against interactive work for its whole run at the batch
    price. Nearly done now comes from the job's own counted work."""
    port = free_port()
    worker = swarm.start_worker("--max-concurrent", "1", "--price", "2", "--batch-price", "1",
                                "--metrics-port", str(port))
    attacker, victim = client_for(swarm), client_for(swarm, "victim")
    wait_for(lambda: len(attacker.workers(refresh=True)) == 1, 30, "the worker")
    batch = Requirements(priority="batch", max_price=2, timeout=300)
    _, tiny, y = spin_job(8, k=2)
    for _ in range(5):
        attacker.submit(tiny, y, requirements=batch).result(timeout=120)
    _, long_job, x = spin_job(4096, k=192)
    small_model, small, z = spin_job(8, k=2)  # exported before the long job starts (see the test above)
    hold = attacker.submit(long_job, x, requirements=batch)
    wait_for(lambda: lane_jobs(port, "batch", "running") == 1, 120, "the long batch job to run")
    urgent = victim.submit(small, z, requirements=Requirements(max_price=2, timeout=120))
    with torch.no_grad():
        assert torch.equal(urgent.result(timeout=120), small_model(z))
    wait_for(lambda: "stopped for an interactive job" in worker.output, 30, "the worker's log of the stop")
    hold.result(timeout=300)  # run again once the slot was free, and paid once: for the run that ended
    assert hold.receipt.started_at_us >= urgent.receipt.ended_at_us
    assert hold.receipt.lane == "batch"


def test_batch_work_below_the_floor_waits_until_the_floor_drops_and_pays_the_floor(swarm, client_for):
    port = free_port()
    worker = swarm.start_worker("--max-concurrent", "2", "--price", "3", "--batch-price", "1",
                                "--metrics-port", str(port))
    interactive, bidder = client_for(swarm), client_for(swarm, "bidder")
    _, long_job, x = spin_job(2048, k=192)
    _, small, y = spin_job(8, k=2)  # exported before the long job starts: under load an export takes seconds
    busy = interactive.submit(long_job, x, requirements=Requirements(timeout=300))
    wait_for(lambda: lane_jobs(port, "interactive", "running") == 1, 120, "the interactive job to run")
    # One of two slots is wanted by interactive work: the floor is halfway, 2 credits/TFLOP.
    low = bidder.submit(small, y, requirements=Requirements(priority="batch", max_price=1.5, timeout=300))
    high = bidder.submit(small, y.clone(), requirements=Requirements(priority="batch", max_price=2.5, timeout=300))
    high.result(timeout=120)
    assert high.receipt.price == 2 * NANO and high.receipt.lane == "batch"  # ran at once, charged the floor
    assert not busy.done() and not low.done()  # a slot is free, but the floor is above its bid: it waits
    busy.result(timeout=300)
    low.result(timeout=120)
    assert low.receipt.price == 1 * NANO  # the floor fell back to the batch price when the interactive job ended
    assert low.receipt.started_at_us >= busy.receipt.ended_at_us
    assert busy.receipt.price == 3 * NANO and busy.worker_id == low.worker_id == swarm.worker_id(worker)


def test_a_client_flooding_a_worker_does_not_starve_another(swarm, client_for):
    swarm.start_worker("--max-concurrent", "1", "--max-queue", "64")
    flood, modest = client_for(swarm), client_for(swarm, "modest")
    job = gpunet.Job.from_module(Churn().eval(), (torch.randn(4),))
    flood.submit(job, torch.randn(4)).result(timeout=120)  # the program is on the worker: the rest ride inline
    modest.submit(job, torch.randn(4)).result(timeout=120)
    flooding = [flood.submit(job, torch.randn(4), requirements=Requirements(timeout=300)) for _ in range(30)]
    wait_for(lambda: any(f.done() for f in flooding), 120, "the flood's first job back")
    mine = [modest.submit(job, torch.randn(4), requirements=Requirements(timeout=300)) for _ in range(6)]
    for f in flooding + mine:
        f.result(timeout=300)
    began = min(m.receipt.started_at_us for m in mine)  # the worker's clock: when the modest client got a turn
    modest_done = max(m.receipt.ended_at_us for m in mine)
    later = [f.receipt.ended_at_us for f in flooding if f.receipt.ended_at_us > began]
    # First come, first served would have run the whole flood before any modest job: nothing of it left by then.
    assert len(later) >= 12, f"only {len(later)} of the flood's jobs were left when the modest client's first ran"
    # Equal shares: the two alternate, so the modest client's six are done by the time the flood has had about six
    # more. Tolerance: two.
    assert sum(1 for t in later if t < modest_done) <= 6 + 2


def test_a_job_that_cannot_meet_its_deadline_is_refused_at_once_with_the_reason(swarm, client_for):
    port = free_port()
    swarm.start_worker("--metrics-port", str(port))
    client = client_for(swarm)
    model, job, x = spin_job(8, k=2)
    ok = client.submit(job, x, requirements=Requirements(deadline=time.time() + 120))
    with torch.no_grad():
        assert torch.equal(ok.result(timeout=120), model(x))
    _, heavy, big = spin_job(16384, k=150)  # ~5 TFLOP: tens of seconds on this worker
    with pytest.raises(gpunet.DeadlineUnreachable, match="expected to finish"):
        client.submit(heavy, big, requirements=Requirements(deadline=time.time() + 5, priority="batch")).result()
    with pytest.raises(gpunet.DeadlineUnreachable, match="passed"):
        client.submit(job, x, requirements=Requirements(deadline=time.time() - 1)).result(timeout=10)
    # Neither reached the worker: it ran the one job, and was asked nothing else.
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    outcomes = dict(re.findall(r'^gpunet_jobs_total{outcome="(\w+)"} (\S+)$', text, re.M))
    assert outcomes == {"done": "1.0"}


def test_the_volunteers_own_job_fills_idle_time_and_yields_to_paying_work(swarm, client_for, tmp_path):
    from gpunet.identity import Identity
    from gpunet.job import tensors
    from gpunet.ledger import open_ledger

    model, mine, x = spin_job(1024, k=96)  # about a second a run here
    mine.save(tmp_path / "mine.gpunet")
    (tmp_path / "mine-inputs.safetensors").write_bytes(mine.encode_inputs(x))
    port = free_port()
    worker = swarm.start_worker("--background-job", str(tmp_path / "mine.gpunet"), "--background-inputs",
                                str(tmp_path / "mine-inputs.safetensors"), "--metrics-port", str(port))
    outputs = worker.data_dir / "background"
    wait_for(lambda: len(list(outputs.glob("*.safetensors"))) >= 2, 120, "two runs of the volunteer's own job")
    newest = sorted(outputs.glob("*.safetensors"))[-1]
    with torch.no_grad():
        assert torch.allclose(tensors.decode(newest.read_bytes())["output_0"], model(x), atol=1e-4)

    def runs(outcome):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        found = re.search(rf'^gpunet_background_runs_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    client = client_for(swarm)
    small_model, small, y = spin_job(8, k=2)
    for _ in range(3):  # the machine is never idle: each paying job stops the run in progress
        with torch.no_grad():
            assert torch.equal(client.submit(small, y).result(timeout=120), small_model(y))
    assert runs("stopped") >= 1
    assert all(r.lane == "interactive" for r in client.ledger.receipts())
    # The volunteer's own job yielding is no preemption: routing does not steer batch work away from this worker for
    # it (it published 4 an hour, idle), and the dashboard's "batch stopped" stays at nothing.
    listed = swarm.wait_for_status(lambda s: s["workers"] and s["workers"][0]["jobs_done"] >= 3, "the jobs listed")
    assert listed["workers"][0]["preemptions_per_hour"] == 0
    assert worker.terminate() == 0
    owner = Identity.load_or_create(worker.data_dir / "client").peer_id
    with open_ledger(worker.data_dir) as ledger:  # the owner's work is on the books, at no price
        own = [r for r in ledger.receipts() if r.lane == "background"]
        assert len(own) >= 2 and all(r.price == 0 and r.amount == 0 and r.client_id == owner for r in own)
        ledger.verify()
