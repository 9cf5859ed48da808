"""Jobs through a real swarm, through the public API, as a user would submit them."""

import asyncio
import time

import msgpack
import pytest
import torch

import gpunet
from gpunet import Requirements
from gpunet.testing.localnet import cpu_seconds, executor_pids, open_files, process_alive
from gpunet.testing.workloads import Spin
from tests.swarm import wait_for

pytestmark = pytest.mark.swarm


class SlowChain(torch.nn.Module):
    """Enough matmuls to keep a CPU worker busy for a noticeable while (a few GFLOP)."""

    def __init__(self, n=384, steps=48):
        super().__init__()
        torch.manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(steps, n, n) / n**0.5)

    def forward(self, x):
        for w in self.w:
            x = torch.tanh(x @ w)
        return x


def mlp_job():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    batch = torch.export.Dim("batch", min=1, max=512)
    return model, gpunet.Job.from_module(model, (torch.randn(8, 16),), dynamic_shapes=({0: batch},))


def test_submit_and_map_return_correct_results_in_order(swarm, client_for):
    workers = swarm.start_workers(3)
    ids = {swarm.worker_id(w) for w in workers}
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    model, job = mlp_job()

    x = torch.randn(5, 16)
    future = client.submit(job, x)
    assert torch.equal(future.result(timeout=60), model(x).detach())
    assert future.worker_id in ids
    assert future.receipt.job_id and future.receipt.worker_id == future.worker_id
    assert future.receipt.client_id == client.id and future.receipt.is_countersigned

    xs = [torch.randn(1 + i % 7, 16) for i in range(100)]
    ys = list(client.map(job, xs, progress=False))
    assert len(ys) == 100
    with torch.no_grad():
        for x, y in zip(xs, ys):
            assert torch.equal(y, model(x))
    receipts = list(client.ledger.receipts())
    assert len(receipts) == 101 and len({r.job_id for r in receipts}) == 101
    assert len({r.worker_id for r in receipts}) > 1, "map should spread jobs over several workers"
    assert client.ledger.verify().count == 101


def test_killed_worker_jobs_complete_elsewhere_exactly_once(swarm, client_for):
    doomed = swarm.start_worker("--price", "0.5")  # cheapest: routing sends it work first
    others = swarm.start_workers(2, "--price", "5")
    doomed_id = swarm.worker_id(doomed)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    model = SlowChain()
    job = gpunet.Job.from_module(model, (torch.randn(64, 384),))
    xs = [torch.randn(64, 384) for _ in range(10)]
    futures = [client.submit(job, x, requirements=Requirements(prefer="cheapest", timeout=300)) for x in xs]

    # The cheapest worker takes this client's share of its places (client_places: its slot and half its queue),
    # the rest go to the others at once; once one is back, the cheapest is killed.
    wait_for(lambda: any(f.done() for f in futures), 120, "the first job back")
    doomed.kill()
    with torch.no_grad():
        for x, f in zip(xs, futures):
            assert torch.allclose(f.result(timeout=300), model(x), atol=1e-5)
    moved = [f for f in futures if doomed_id in f.attempts and f.worker_id != doomed_id]
    assert moved, "some jobs were in the killed worker's hands and had to move"
    assert all(f.attempts[0] == doomed_id for f in moved)
    receipts = list(client.ledger.receipts())
    assert sorted(r.job_id for r in receipts) == sorted(f.receipt.job_id for f in futures)  # each paid once
    assert all(r.worker_id == f.worker_id for f in futures for r in receipts if r.job_id == f.receipt.job_id)
    # The workers' own ledgers agree: every job is paid once, to the worker that delivered it.
    for proc in others:
        assert proc.terminate() == 0
    client_paid = {r.job_id: r.worker_id for r in receipts}
    for proc in others:  # left cleanly: exactly the receipts the client paid it for
        worker_id = swarm.worker_id(proc)
        assert {r.job_id for r in _worker_receipts(proc)} == {j for j, w in client_paid.items() if w == worker_id}
    # SIGKILLed moments after a job: its file may miss the last receipt or two (killed inside the group-commit
    # window, docs/ledger.md) but holds nothing the client did not pay it for; the client's copy restores the rest.
    mine = {j for j, w in client_paid.items() if w == doomed_id}
    assert {r.job_id for r in _worker_receipts(doomed)} <= mine
    from gpunet.ledger import open_ledger

    with open_ledger(doomed.data_dir) as ledger:
        report = ledger.merge(client.ledger.path)
        assert not report.refused and not report.conflicts
        assert {r.job_id for r in ledger.receipts() if r.worker_id == doomed_id} == mine


def _worker_receipts(proc):
    from gpunet.ledger import open_ledger

    if not (proc.data_dir / "ledger.sqlite").exists():
        return []
    with open_ledger(proc.data_dir) as ledger:
        ledger.verify()
        return list(ledger.receipts())


def test_both_sides_hold_the_same_receipts_and_the_books_balance(swarm, client_for):
    workers = [swarm.start_worker("--price", "1"), swarm.start_worker("--price", "2")]
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    job = gpunet.Job.from_function(lambda a, b: a @ b, (torch.randn(128, 128), torch.randn(128, 128)))
    futures = [client.submit(job, torch.randn(128, 128), torch.randn(128, 128), requirements=Requirements(
        max_price=5)) for _ in range(24)]
    for f in futures:
        f.result(timeout=120)
    assert all(f.receipt.amount > 0 for f in futures)
    mine = {r.job_id: r for r in client.ledger.receipts()}
    assert client.ledger.verify().count == 24
    # A countersignature travels after its result: one still on its way when its worker is stopped leaves that job
    # unpaid there (`gpunet ledger unpaid`), which is not what this test is about. Each is at its worker first.
    wait_for(lambda: sum(len(_worker_receipts(proc)) for proc in workers) == 24, 60,
             "every countersignature at its worker")
    for proc in workers:
        assert proc.terminate() == 0  # a worker's last countersigned receipts are in before it leaves
    theirs = {r.job_id: r for proc in workers for r in _worker_receipts(proc)}
    assert theirs == mine  # the very same double-signed receipts on both sides
    balances = client.ledger.balances()
    spent = balances[client.id].spent
    earned = sum(balances[w].earned for w in {r.worker_id for r in mine.values()})
    assert spent == earned == sum(r.amount for r in mine.values()) > 0


def test_requirements_nobody_meets_fail_fast(swarm, client_for):
    swarm.start_workers(2, "--price", "3")
    client = client_for(swarm)
    _, job = mlp_job()
    x = torch.randn(2, 16)
    for req, why in [
        (Requirements(device="gpu"), "has no GPU"),
        (Requirements(max_price=1.0), "charges 3 credits/TFLOP"),
        (Requirements(min_memory_gb=100_000), "GiB free"),
        (Requirements(dtype="fp16"), "does not run fp16"),
    ]:
        with pytest.raises(gpunet.NoWorkersAvailable, match=why):
            client.submit(job, x, requirements=req).result(timeout=20)


def test_busy_worker_is_skipped_and_cached_program_is_not_resent(swarm, client_for):
    cheap = swarm.start_worker("--price", "1", "--max-concurrent", "1", "--max-queue", "0", "-v")
    other = swarm.start_worker("--price", "2")
    cheap_id, other_id = swarm.worker_id(cheap), swarm.worker_id(other)
    client, other_client = client_for(swarm), client_for(swarm, "stranger")
    wait_for(lambda: len(client.workers(refresh=True)) == 2 and len(other_client.workers(refresh=True)) == 2, 30,
             "both workers")
    # About a second of work (100 GFLOP; 96 matmuls took 0.5 s on CI's AVX-512 cores): still running when the other
    # client's job comes (SlowChain's few tens of ms could end first, and that job then found the cheap worker free).
    job = gpunet.Job.from_module(Spin(k=192), (torch.randn(256, 1024),))
    cheapest = Requirements(prefer="cheapest", timeout=120)
    program_size = len(job.program_bytes())

    first = client.submit(job, torch.randn(256, 1024), requirements=cheapest)
    cheap.wait_for_line(r"Running job", timeout=60)
    second = client.submit(job, torch.randn(256, 1024), requirements=cheapest)
    # Another client does not know the cheap worker is taken: it hears "busy" there, and goes elsewhere.
    stranger = other_client.submit(job, torch.randn(256, 1024), requirements=cheapest)
    first.result(timeout=120), second.result(timeout=120), stranger.result(timeout=120)
    assert first.worker_id == cheap_id
    # This client's own job fills its share of the cheap worker (client_places, 1 here): not even asked
    assert second.worker_id == other_id and second.attempts == [other_id]
    assert stranger.worker_id == other_id and stranger.attempts[0] == cheap_id  # busy -> elsewhere

    third = client.submit(job, torch.randn(256, 1024), requirements=cheapest)
    third.result(timeout=120)
    assert third.worker_id == cheap_id
    assert first.bytes_sent > program_size  # the program went with the first job
    assert third.bytes_sent < program_size  # ...and never again: the worker had it cached
    assert third.bytes_sent == len(job.encode_inputs(torch.randn(256, 1024)))


def test_malformed_and_oversized_messages_get_an_error_and_the_worker_keeps_serving(swarm, client_for):
    worker = swarm.start_worker()
    worker_id = swarm.worker_id(worker)
    client = client_for(swarm)
    from gpunet import protocol
    from gpunet.protocol import Door, Error

    rpc = client._core.transport.rpc
    maddrs = client.workers()[0].record.maddrs

    def encode_frame(fields: dict) -> bytes:  # raw frames, as a hostile peer would write them
        body = msgpack.packb(fields, use_bin_type=True)
        return len(body).to_bytes(4, "big") + body

    async def exchange(raw: bytes) -> Error:
        reader, writer = await rpc.open(worker_id, Door.JOB, maddrs)
        try:
            writer.write(raw)
            await writer.drain()
            return await protocol.read(reader, Error, timeout=30)
        finally:
            writer.close()

    def ask(raw: bytes) -> dict:
        return asyncio.run_coroutine_threadsafe(exchange(raw), client._loop).result(60)

    h = "ab" * 32
    cases = {
        "garbage": (b"\x00\x00\x00\x05hello", "protocol"),
        "huge frame": ((2**31).to_bytes(4, "big") + b"x" * 16, "protocol"),
        "not a map": (b"\x00\x00\x00\x03\x92\x01\x02", "protocol"),
        "wrong type": (encode_frame({"t": "submit", "job": 7, "program": h, "inputs_size": 1}), "protocol"),
        "bad job id": (encode_frame({"t": "submit", "job": "../../etc", "program": h, "inputs_size": 1}), "protocol"),
        "oversized inputs": (encode_frame({"t": "submit", "job": "j1", "program": h, "inputs_size": 10**15}), "rejected"),
        "bad inline size": (encode_frame({"t": "submit", "job": "j2", "program": h, "inputs_size": 99,
                                          "inputs": b"abc"}), "protocol"),
    }
    for name, (raw, code) in cases.items():
        reply = ask(raw)
        assert reply.code == code, (name, reply)

    model, job = mlp_job()
    x = torch.randn(3, 16)
    assert torch.equal(client.submit(job, x).result(timeout=60), model(x).detach())
    assert worker.popen.poll() is None


def test_a_job_id_sent_twice_runs_once_and_bills_once(swarm, client_for):
    worker = swarm.start_worker()
    worker_id = swarm.worker_id(worker)
    client = client_for(swarm)
    _, job = mlp_job()
    from gpunet.client.transport import JobRequest

    transport = client._core.transport
    maddrs = client.workers()[0].record.maddrs
    inputs = job.encode_inputs(torch.randn(2, 16))
    request = JobRequest("same-job-id", job.program_hash, job.program_bytes(), inputs, timeout=30, max_price=None)

    async def twice():
        answers = []
        for _ in range(2):
            delivery = await transport.run_stream(worker_id, maddrs, request)
            delivery.close()
            answers.append(delivery)
        info = await transport.rpc.info(worker_id, maddrs)
        return answers, info

    (a, b), info = asyncio.run_coroutine_threadsafe(twice(), client._loop).result(90)
    assert a.receipt == b.receipt and a.outputs == b.outputs
    assert info.record["jobs_done"] == 1
    assert abs(info.time - time.time()) < 5


class Expanding(torch.nn.Module):
    """A small input (16 KiB, so the unary door can carry it) that grows into seconds of 2048x2048 matmuls."""

    def forward(self, x):
        y = x.repeat(32, 32)
        for _ in range(40):
            y = torch.tanh(y @ y) * 0.5
        return y[:4, :4]


def _executor_cpu_seconds(worker) -> dict[int, float]:
    """CPU time of each executor process of ``worker``."""
    seconds = {pid: cpu_seconds(pid) for pid in executor_pids(worker.pid)[1]}
    return {pid: s for pid, s in seconds.items() if s is not None}


def _cancel_while_running(client, job, x, worker) -> int:
    """Submit, wait until an executor is really computing it, cancel; returns that executor's pid."""
    before = _executor_cpu_seconds(worker)
    future = client.submit(job, x, requirements=Requirements(timeout=120))
    busy = wait_for(lambda: [p for p, s in _executor_cpu_seconds(worker).items() if s - before.get(p, 0.0) > 0.5],
                    60, "an executor to start computing the job")
    assert future.cancel()
    return busy[0]


def _stops_computing(worker, pid: int) -> None:
    """Wait until executor ``pid`` is alive and no longer computing (under 0.1 s of CPU in half a second)."""
    def idle() -> bool:
        before = _executor_cpu_seconds(worker).get(pid)
        time.sleep(0.5)
        after = _executor_cpu_seconds(worker).get(pid)
        return before is not None and after is not None and after - before < 0.1 and process_alive(pid)

    wait_for(idle, 30, "the cancelled job to stop, its executor serving on")


def test_cancelling_a_running_job_stops_it_on_the_worker(swarm, client_for):
    """Through both doors: the stream (program sent) and the unary call (program cached, small input)."""
    worker = swarm.start_worker("--max-concurrent", "1")
    client = client_for(swarm)
    job = gpunet.Job.from_module(Expanding(), (torch.randn(64, 64),))
    x = torch.randn(64, 64)

    _, small = mlp_job()
    y = torch.randn(3, 16)
    victim = _cancel_while_running(client, job, x, worker)  # first time: the stream door, program sent
    _stops_computing(worker, victim)  # at its program's next node: no executor restart for the next job
    worker.wait_for_line(r"stopped while running", timeout=30)
    # The worker keeps serving: a small job succeeds.
    assert torch.allclose(client.submit(small, y).result(timeout=120), small.run_locally(y), atol=1e-6)

    # The worker cached the program before running it: once its record says so, the next job takes the unary door.
    wait_for(lambda: any(job.program_hash in w.record.programs for w in client.workers(refresh=True)), 30,
             "the worker to advertise the cached program")
    victim = _cancel_while_running(client, job, x, worker)
    _stops_computing(worker, victim)
    wait_for(lambda: len([line for line in worker.lines if "stopped while running" in line]) >= 2, 30,
             "the worker to report the second cancellation")
    assert torch.allclose(client.submit(small, y).result(timeout=120), small.run_locally(y), atol=1e-6)

    # The cancel call itself, as the client sends it for a unary job it abandons (here sent by hand).
    from gpunet.client.transport import JobRequest

    async def cancel_by_call():
        transport, worker_id = client._core.transport, swarm.worker_id(worker)
        before = _executor_cpu_seconds(worker)
        request = JobRequest("cancel-me", job.program_hash, b"", job.encode_inputs(x), timeout=60, max_price=None)
        call = asyncio.ensure_future(transport.run_unary(worker_id, request))
        await asyncio.to_thread(wait_for, lambda: [p for p, s in _executor_cpu_seconds(worker).items()
                                                   if s - before.get(p, 0.0) > 0.5], 60, "the job to run")
        assert await transport.cancel(worker_id, "cancel-me")
        with pytest.raises(gpunet.JobFailed, match="stopped before it finished"):
            await call
        assert not await transport.cancel(worker_id, "cancel-me")  # nothing left to stop

    asyncio.run_coroutine_threadsafe(cancel_by_call(), client._loop).result(timeout=120)
    wait_for(lambda: len([line for line in worker.lines if "stopped while running" in line]) >= 3, 30,
             "the worker to report the third cancellation")


def test_a_script_that_never_closes_its_client_still_files_and_settles(swarm, tmp_path):
    """Receipts are filed in batches; a client left open at interpreter exit writes them and pays what it owes."""
    import subprocess
    import sys

    worker = swarm.start_worker()
    script = f"""
import torch, gpunet
client = gpunet.Client(initial_peers=[{swarm.bootstrap_addr!r}], network={swarm.network!r},
                       data_dir={str(tmp_path / "script-client")!r})
job = gpunet.Job.from_function(lambda x: x + 1, (torch.randn(4),))
for _ in range(3):
    client.submit(job, torch.randn(4)).result()
"""  # and no client.close()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    from gpunet.ledger import open_ledger

    with open_ledger(tmp_path / "script-client") as ledger:
        assert ledger.verify().count == 3
    assert worker.terminate() == 0
    with open_ledger(worker.data_dir) as ledger:
        assert ledger.verify().count == 3 and not ledger.unpaid()


def test_a_big_program_crosses_each_link_once_however_many_jobs_want_it(swarm, client_for):
    """30 jobs of a 55 MB program at once on 3 cold workers: each worker gets one copy, not one per job."""
    workers = swarm.start_workers(3, "--max-queue", "32")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3700, 3700), torch.nn.ReLU()).eval()
    job = gpunet.Job.from_module(model, (torch.randn(2, 3700),))
    program = len(job.program_bytes())
    assert program > 50e6
    xs = [torch.randn(2, 3700) for _ in range(30)]
    futures = [client.submit(job, x, requirements=Requirements(timeout=300)) for x in xs]
    for f, x in zip(futures, xs):
        assert torch.allclose(f.result(timeout=300), model(x).detach(), atol=1e-5)
    inputs = len(job.encode_inputs(xs[0]))
    program_bytes_sent = sum(f.bytes_sent - inputs for f in futures)
    ran_it = {f.worker_id for f in futures}
    assert program_bytes_sent <= len(ran_it) * program, (
        f"{program_bytes_sent / program:.1f} copies of the program sent for {len(ran_it)} workers")
    assert all(w.popen.poll() is None for w in workers)


def test_a_closed_client_says_so_at_once_and_its_unfinished_jobs_end(swarm, client_for):
    """After close(), every call fails at once with "client is closed" (remote models, sessions and a refreshed
    worker list used to wait for ever on the stopped loop), and a job still running when the client closed ends
    with an error instead of leaving its future pending."""
    swarm.start_worker()
    client = client_for(swarm)
    remote = client.sequential([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], example_inputs=(torch.randn(1, 4),),
                               spans=1)
    assert remote(torch.randn(1, 4)).shape == (1, 4)
    session = remote.session()
    slow = gpunet.Job.from_module(SlowChain(steps=200), (torch.randn(64, 384),))
    running = client.submit(slow, torch.randn(64, 384))
    t0 = time.monotonic()
    client.close()
    with pytest.raises(gpunet.GpunetError, match="closed"):
        running.result(timeout=30)
    for call in (lambda: remote(torch.randn(1, 4)), lambda: session.step(torch.randn(1, 4)),
                 lambda: client.workers(refresh=True), lambda: client.submit(slow, torch.randn(64, 384))):
        with pytest.raises(gpunet.GpunetError, match="client is closed"):
            call()
    assert time.monotonic() - t0 < 30

    async def async_client_after_close():
        async with gpunet.AsyncClient(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                                      data_dir=client._core.data_dir.parent / "async") as other:
            pass
        with pytest.raises(gpunet.GpunetError, match="client is closed"):
            other.submit(slow, torch.randn(64, 384))

    asyncio.run(async_client_after_close())


def test_jobs_sent_while_their_workers_are_still_joining_wait_for_them(swarm, tmp_path):
    """A script started right after its workers: they are listed `joining` (dialling back, proving their speed,
    starting executors) when the jobs come. The jobs wait for them within their timeout instead of raising
    NoWorkersAvailable ("1 is joining") at once."""
    from gpunet.client.core import ClientConfig

    model, job = mlp_job()
    x = torch.randn(8, 16)
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network, data_dir=tmp_path / "client",
                       config=ClientConfig(discovery_wait=120)) as client:
        first = client.submit(job, x)  # nobody there yet
        swarm.start_worker(wait_online=False)
        assert torch.allclose(first.result(timeout=180), model(x), atol=1e-6)
        second = swarm.start_worker(wait_online=False)
        # once listed, joining or not, it counts toward redundancy (and the copy for it waits for it)
        wait_for(lambda: any(w.id == second.id for w in client.workers(refresh=True)), 90, "the second worker listed")
        outputs = list(client.map(job, [x] * 4, requirements=Requirements(redundancy=2)))
        assert all(torch.allclose(y, model(x), atol=1e-6) for y in outputs)


def test_redundancy_above_the_workers_there_are_is_refused_before_any_copy_runs(swarm, client_for):
    worker = swarm.start_worker()
    client = client_for(swarm)
    _, job = mlp_job()
    with pytest.raises(gpunet.NoWorkersAvailable, match=r"redundancy=3 needs 3 distinct workers, but only 1 of the 1"):
        client.submit(job, torch.randn(8, 16), requirements=Requirements(redundancy=3)).result(timeout=60)
    assert _worker_receipts(worker) == []  # nothing ran, so nothing is left unpaid


def test_a_burst_of_submits_waits_on_the_client_for_room_instead_of_bouncing_off_a_default_worker(swarm, tmp_path):
    """64 submits at once against a worker with default settings (1 running, 8 queued): those beyond what it holds
    wait on the client for one of its own jobs to end, instead of being answered "busy" and backing off (the burst
    ran at a sixth of map's rate)."""
    import re
    import urllib.request

    from gpunet.testing.localnet import free_port

    port = free_port()
    swarm.start_worker("--metrics-port", str(port))
    model, job = mlp_job()
    x = torch.randn(8, 16)
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=tmp_path / "client") as client:
        wait_for(lambda: client.workers(refresh=True), 30, "the worker")
        futures = [client.submit(job, x) for _ in range(64)]
        assert all(torch.allclose(f.result(timeout=120), model(x), atol=1e-6) for f in futures)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    outcomes = dict(re.findall(r'^gpunet_jobs_total{outcome="(\w+)"} (\S+)$', text, re.M))
    assert outcomes.get("done") == "64.0" and "busy" not in outcomes, outcomes


def test_a_workers_fork_server_is_a_fork_of_it_that_holds_none_of_its_files_and_names_its_executors(swarm, client_for):
    """``gpunet worker`` forks its executors' fork server from itself (torch imported once per worker, not twice)
    before it opens its data dir or reads its key: the server holds none of its files, only its socket, pipes and
    standard streams; ``ps`` tells the worker's processes apart by name."""
    worker = swarm.start_worker()
    client = client_for(swarm)
    _, small = mlp_job()
    y = torch.randn(3, 16)
    assert torch.allclose(client.submit(small, y).result(timeout=120), small.run_locally(y), atol=1e-6)
    server, executors = executor_pids(worker.pid)
    assert server is not None and executors

    def comm(pid: int) -> str:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()

    def cmdline(pid: int) -> bytes:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()

    assert comm(server) == "gpunet-forksrv" and cmdline(server) == cmdline(worker.pid)  # a fork, not an interpreter
    assert {comm(pid) for pid in executors} == {"gpunet-executor"}
    files = open_files(server)
    data_dir = str(worker.data_dir.resolve())
    assert not [f for f in files if f.startswith(data_dir) or f.endswith((".db", ".key", ".pem"))], files
    assert {f.split(":")[0] for f in files if not f.startswith("/")} <= {"socket", "pipe", "anon_inode"}, files
