"""Counted work (gpunet/job/cost.py): every allowlisted op has a cost, so nothing runs for free or past its limits."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import gpunet
from gpunet import Job, JobRejected, JobTimeout
from gpunet.job import cost
from gpunet.job.validator import ALLOWED_OPS
from gpunet.worker.executor import Executor


def test_every_allowlisted_op_has_a_cost_formula_and_no_formula_is_stale():
    assert [op for op in ALLOWED_OPS if cost.formula_for(op) is None] == []
    assert set(cost.FORMULAS) == {cost.packet_name(op) for op in ALLOWED_OPS}


def _ops(job: Job) -> set[str]:
    return set(job.manifest.ops)


def test_a_matrix_product_spelled_cdist_is_billed():
    """torch's FLOP counter bills _cdist_forward 0: a matmul in disguise ran for free."""
    a, b = torch.randn(64, 32), torch.randn(128, 32)
    job = Job.from_function(lambda x, y: torch.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist"), (a, b))
    assert _ops(job) == {"aten._cdist_forward.default"}
    assert job.estimate(a, b).flops == 3 * 64 * 128 * 32


def test_elementwise_chains_and_sorts_count_against_the_limit():
    """40 s of elementwise chains and sorts used to count 0 FLOPs and pass any max_flops."""
    x = torch.randn(1000, 1000)

    def chain(t):
        for _ in range(50):
            t = torch.tanh(t) * 1.0001
        return torch.sort(t, dim=1).values

    job = Job.from_function(chain, (x,))
    flops = job.estimate(x).flops
    assert flops >= 50 * (cost.TRANSCENDENTAL + cost.ELEMENTWISE) * x.numel() + cost.ELEMENTWISE * x.numel() * 10
    limited = Job.from_function(chain, (x,), limits=gpunet.JobLimits(max_flops=10**8))
    with pytest.raises(JobRejected, match="over the limit"):
        limited.run_locally(x)


def test_a_pooling_window_given_as_one_number_counts_in_every_spatial_dimension():
    """From an attacker's review: max_pool3d with kernel_size=[25] is a 25x25x25 window, billed as 25 (625x less)."""
    x = torch.randn(1, 1, 30, 30, 30)
    one = Job.from_function(lambda t: torch.nn.functional.max_pool3d(t, kernel_size=[25], stride=1), (x,))
    full = Job.from_function(lambda t: torch.nn.functional.max_pool3d(t, kernel_size=[25, 25, 25], stride=1), (x,))
    assert one.estimate(x).flops == full.estimate(x).flops >= 25**3 * 6**3
    pooled = torch.randn(1, 3, 40, 40)
    assert Job.from_function(lambda t: torch.nn.functional.avg_pool2d(t, 5), (pooled,)).estimate(pooled).flops == \
        cost.ELEMENTWISE * 3 * 8 * 8 * 25


def test_views_cost_nothing_and_matmuls_cost_their_flops():
    w = torch.randn(64, 64)
    job = Job.from_function(lambda x: (x @ w).view(-1)[:10].unsqueeze(0).permute(1, 0), (torch.randn(8, 64),))
    assert job.estimate(torch.randn(8, 64)).flops == 2 * 8 * 64 * 64  # a view of a counted node: nothing more


def test_a_worker_stops_a_job_that_runs_longer_than_its_counted_work_pays_for(tmp_path, monkeypatch):
    """The cap is the counted work at a small share of the worker's measured speed, plus a grace; a worker claiming
    to be enormously fast with no grace allows this job almost no time, so the cap shows without a long test. (The
    worker looks for the cap every GRACE_SECONDS, at least every 50 ms: the job runs longer than that.)"""
    monkeypatch.setattr(cost, "GRACE_SECONDS", 0.0)
    x = torch.randn(512, 512)

    def slow(t):
        for _ in range(40):
            t = torch.tanh(t @ t)
        return t

    job = Job.from_function(slow, (x,))
    ex = Executor(processes=1, cache_dir=tmp_path / "cache", speed_tflops=1e6, sandbox=False)
    try:
        with pytest.raises(JobTimeout, match="counted work"):
            asyncio.run(ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(x), 60))
        ex.speed_tflops = None  # no measured speed: only the job's own timeout applies
        asyncio.run(ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(x), 60))
    finally:
        ex.close()


def test_an_output_that_is_a_weight_or_an_expand_counts_its_copy_into_the_answer():
    """An expand of one number into a big answer, or a weight returned by every call, was free work (and free bytes
    to send): its copy is counted, decided from the graph (strides could differ between torch versions)."""
    x = torch.randn(1, 1)
    broadcast = Job.from_function(lambda t: (t + 1).expand(1000, 1000), (x,))
    assert broadcast.estimate(x).flops == cost.ELEMENTWISE * (1 + 1000 * 1000)
    dense = Job.from_function(lambda t: (t + 1).expand(1000, 1000).contiguous() + 1, (x,))
    assert dense.estimate(x).flops == cost.ELEMENTWISE * (1 + 2 * 1000 * 1000)  # clone, add; a computed output
    table = torch.nn.Linear(1000, 1000)
    weight_out = Job.from_function(lambda t: (table.weight.t(), t * 2), (x,))  # a view of a weight
    assert weight_out.estimate(x).flops == cost.ELEMENTWISE * (1000 * 1000 + 1)
    y = torch.randn(2, 3)
    echo = Job.from_function(lambda t: (t, t.view(3, 2), torch.split(t * 2, 1)), (y,))  # the client's own bytes,
    assert echo.estimate(y).flops == cost.ELEMENTWISE * 6  # views of a counted node: only the multiply counts
    stats = Job.from_function(lambda t: tuple(torch.max(t, 1)), (y,))  # items of a computed tuple
    assert stats.estimate(y).flops == cost.REDUCTION * 6  # max.dim's own count only


def _grid_sampling(nodes: int) -> Job:
    """Little counted work (a few thousand FLOPs), but grid_sampler_2d's meta decomposition takes ms a node to count."""
    import torch.nn.functional as F

    def resample(x, grid):
        for _ in range(nodes):
            x = F.grid_sample(x, grid, align_corners=False)
        return x

    return Job.from_function(resample, (torch.randn(1, 1, 4, 4), torch.rand(1, 4, 4, 2) * 2 - 1))


def test_the_dry_run_is_bounded_in_time_and_stoppable_and_a_refusal_is_kept():
    """Counting work from shapes costs the worker time no receipt pays for: it stops past the worker's limit, at a
    stop word as a real run does, and the same shapes are refused at once the next time."""
    from dataclasses import replace

    from gpunet.errors import DryRunTooLong, JobPreempted
    from gpunet.job.validator import WorkerLimits, load_program

    job = _grid_sampling(30)
    x, grid = torch.randn(1, 1, 4, 4), torch.rand(1, 4, 4, 2) * 2 - 1
    prog = load_program(job.to_bytes(), limits=replace(WorkerLimits(), max_dry_run_seconds=0.0))
    for _ in range(2):  # over time is no fact about the shapes: tried again, not kept
        with pytest.raises(DryRunTooLong, match="over 0 s of CPU .* 30 nodes") as e:
            prog.dry_run([x, grid])
        assert e.value.dry_seconds > 0
    prog = load_program(job.to_bytes())
    with pytest.raises(JobPreempted):
        prog.dry_run([x, grid], stop=lambda: True)
    est, seconds = prog.dry_run([x, grid])
    assert seconds > 0 and prog.dry_run([x, grid]) == (est, 0.0)  # counted once per shapes

    tight = load_program(job.to_bytes(), limits=replace(WorkerLimits(), max_flops=est.flops - 1))  # fails at the end
    with pytest.raises(JobRejected, match="FLOPs, over the limit") as first:
        tight.dry_run([x, grid])
    assert first.value.dry_seconds > 0
    with pytest.raises(JobRejected, match="FLOPs, over the limit") as again:
        tight.dry_run([x, grid])
    assert getattr(again.value, "dry_seconds", 0) == 0  # kept: refused without a second dry run


def test_a_cpu_convolutions_own_buffers_are_in_the_dry_runs_peak_memory():
    """Outside oneDNN (float64, float16) torch's CPU convolution unfolds its input first: a 31x31 float64 kernel
    over 256x256 took 1.9 GiB beside a 2 MiB output, and the dry run counted 6 MiB."""
    import torch.nn.functional as F

    x, w = torch.randn(1, 4, 256, 256, dtype=torch.float64), torch.randn(4, 4, 31, 31, dtype=torch.float64)
    job = Job.from_function(lambda t, k: F.conv2d(t, k, padding=15), (x, w))
    columns = 4 * 31 * 31 * 256 * 256 * 8
    assert job.estimate(x, w).peak_memory_bytes >= columns
    x32, w32 = x.float(), w.float()  # oneDNN's: no columns
    assert Job.from_function(lambda t, k: F.conv2d(t, k, padding=15), (x32, w32)).estimate(x32, w32) \
        .peak_memory_bytes < 8 * 2**20
    grouped = Job.from_function(lambda t, k: F.conv2d(t, k, padding=15, groups=4), (x, w[:, :1]))
    assert columns // 4 <= grouped.estimate(x, w[:, :1]).peak_memory_bytes < columns // 2  # per group


def test_an_executor_reports_what_each_dry_run_took_and_stops_one_past_its_limit(tmp_path):
    from gpunet.errors import DryRunTooLong
    from gpunet.worker.executor import DryRun

    job = _grid_sampling(30)
    x, grid = torch.randn(1, 1, 4, 4), torch.rand(1, 4, 4, 2) * 2 - 1
    inputs = job.encode_inputs(x, grid)
    with Executor(processes=1, cache_dir=tmp_path / "cache", sandbox=False) as ex:
        first, again = DryRun(), DryRun()
        one = asyncio.run(ex.run(job.program_hash, job.program_bytes(), inputs, 60, dry=first))
        two = asyncio.run(ex.run(job.program_hash, None, inputs, 60, dry=again))
        assert first.seconds > 0 and again.seconds == 0 and one.flops == two.flops  # counted once per shapes
        assert first.cap == 5.0  # the executor's limit, as it said when ready
        longer = _grid_sampling(200)  # a new program to count: about 1.6 s of CPU, cancelled as its dry run begins
        cancelled = DryRun()  # stopped at its next node: what it took until then, measured
        slot = ex._slots[0]

        async def cancel_during_the_dry_run():
            this_run = slot.run_id + 1
            run = asyncio.ensure_future(ex.run(longer.program_hash, longer.program_bytes(), inputs, 60, dry=cancelled))
            end = time.monotonic() + 60
            while slot.dry_word[0] != this_run:  # the executor writes it as the dry run begins
                assert time.monotonic() < end, "the dry run never began"
                await asyncio.sleep(0.005)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

        asyncio.run(cancel_during_the_dry_run())
        assert cancelled.seconds is not None and cancelled.cost(cancelled.began + 60) == cancelled.seconds < 5.0
        quick = DryRun()  # a job that never reached its dry run (its program not held, no bytes sent) costs nothing
        with pytest.raises(gpunet.ProgramNotCached):
            asyncio.run(ex.run(_grid_sampling(2).program_hash, None, inputs, 60, dry=quick))
        assert quick.began is None and quick.cost(1e9) == 0.0
    with Executor(processes=1, cache_dir=tmp_path / "cache2", sandbox=False, max_dry_run_seconds=0.01) as ex:
        stopped = DryRun()
        with pytest.raises(DryRunTooLong, match="split the program"):
            asyncio.run(ex.run(job.program_hash, job.program_bytes(), inputs, 60, dry=stopped))
        assert stopped.seconds >= 0.01


@pytest.mark.swarm
def test_work_that_used_to_be_free_is_billed_by_a_real_worker(swarm, client_for):
    """Sorts, distances and elementwise chains were billed 0 FLOPs: free compute for any client."""
    from tests.swarm import wait_for

    swarm.start_worker()
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 1, 30, "the worker")
    x, y = torch.randn(200, 16), torch.randn(300, 16)

    def no_matmul(a, b):
        d = torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")
        return torch.sort(torch.exp(-d), dim=1).values

    job = Job.from_function(no_matmul, (x, y))
    future = client.submit(job, x, y)
    assert torch.allclose(future.result(timeout=120), no_matmul(x, y))
    assert future.receipt.flops == job.estimate(x, y).flops >= 3 * 200 * 300 * 16
    assert future.receipt.amount > 0


def test_ops_are_billed_at_least_the_elements_they_touch_however_the_arguments_are_passed():
    """From a review: a scatter through a huge expanded index was billed for its small output, cdist's broadcast batch
    was missed, and an op given its arguments by keyword was refused by its formula."""
    from gpunet.job.validator import ALLOWED_OPS

    index = torch.zeros(1, dtype=torch.long).expand(10**6)
    scatter = cost.formula_for("aten.scatter_add.default", ALLOWED_OPS["aten.scatter_add.default"])
    out = torch.zeros(4)
    assert scatter([out, 0, index, torch.ones(10**6)], {}, out) >= 2 * 10**6
    cdist = cost.formula_for("aten._cdist_forward.default", ALLOWED_OPS["aten._cdist_forward.default"])
    x1, x2 = torch.empty(1, 10, 8, device="meta"), torch.empty(50, 20, 8, device="meta")
    assert cdist([x1, x2, 2.0, None], {}, torch.empty(50, 10, 20, device="meta")) == 3 * 50 * 10 * 20 * 8
    mm = cost.formula_for("aten.mm.default", ALLOWED_OPS["aten.mm.default"])
    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    assert mm([], {"self": a, "mat2": b}, torch.empty(8, 4, device="meta")) == mm([a, b], {}, None) == 2 * 8 * 16 * 4
