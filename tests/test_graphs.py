"""Runs that repeat their shapes, captured and replayed (gpunet.worker.executor.graphs), tested behind the device
seam with the CPU stand-in for CUDA graphs (FAKE HARDWARE: gpunet.worker.executor.graphs.FakeCudaGraphs): what is captured and when, that
replays read new inputs and never hand out memory the next replay overwrites, eviction within the budget, and every
fallback. That replays on a GPU equal plain runs bit for bit is checked on the GPU machine (scripts/gpu_check.sh)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch
from torch.export import Dim

from gpunet import Job
from gpunet.errors import JobFailed, JobPreempted, JobRaised, JobTimeout
from gpunet.job import tensors
from gpunet.job.interpreter import run_program
from gpunet.job.validator import load_program
from gpunet.worker import metrics
from gpunet.worker.executor import Executor
from gpunet.worker.executor.child import Pacer
from gpunet.worker.executor.graphs import FAILED, GUARDED, SYNC, TOO_BIG, FakeCudaGraphs, GraphCache
from gpunet.worker.state.limits import SessionRun


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))).softmax(-1)


class Accumulate(torch.nn.Module):
    """A session's step: its state adds up what it was given (so a state another step overwrote shows)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, total):
        total = total + x @ self.w
        return total.sum(-1, keepdim=True), total


def _mlp():
    torch.manual_seed(0)
    job = Job.from_module(Mlp().eval(), (torch.randn(2, 16),), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    return load_program(job.program_bytes())


def _cache(backend=None, max_bytes=1 << 30, **kw):
    backend = backend or FakeCudaGraphs(**kw)
    return GraphCache(backend, max_bytes, run_program), backend


def test_a_shape_run_three_times_is_captured_then_replayed_with_the_plain_runs_bits():
    prog = _mlp()
    graphs, fake = _cache()
    outcomes = []
    for i in range(6):
        x = torch.randn(4, 16)  # new values each time: a replay that read the old ones would differ
        got = graphs(prog, [x])
        outcomes += graphs.take_counts().runs.keys()
        assert torch.equal(got[0], run_program(prog, [x])[0])
    assert outcomes == ["warming", "warming", "captured", "replayed", "replayed", "replayed"]
    # The third run was the capture's warm-up (its outputs are that run's), then recorded; the rest were replays.
    assert (fake.checks, fake.captures, fake.replays) == (1, 1, 3)
    # Another shape is another graph, warmed up on its own.
    for _ in range(3):
        graphs(prog, [torch.randn(7, 16)])
    assert fake.captures == 2 and graphs.nbytes > 0


def test_an_output_handed_out_is_never_the_graphs_own_memory():
    """Two sessions' steps interleaved on one graph: each keeps its own state, though every replay writes the graph's
    outputs (a state kept as the graph's output would be the other session's after its step)."""
    graphs, fake = _cache()
    _two_sessions_interleaved(graphs, "cpu")
    assert fake.replays == 7  # 10 steps: 2 warming, a capture, 7 replays


def _two_sessions_interleaved(graphs, device: str):
    torch.manual_seed(1)
    job = Job.from_module(Accumulate(), (torch.randn(1, 4), torch.zeros(1, 4)), state=1)
    prog = load_program(job.program_bytes(), device=device)
    states = {"a": torch.zeros(1, 4, device=device), "b": torch.ones(1, 4, device=device)}
    plain = dict(states)
    for _ in range(5):
        for name in ("a", "b"):
            x = torch.randn(1, 4)
            out, states[name] = graphs(prog, [x, states[name]])
            want, plain[name] = run_program(prog, [x, plain[name]])
            assert torch.equal(out, want)
    assert all(torch.equal(states[n], plain[n]) for n in states)


def test_graphs_past_their_budget_are_evicted_least_recently_used_first():
    x = torch.randn(8, 16)
    progs = [_mlp(), _mlp(), _mlp()]  # three programs at one shape: three graphs of the same size
    probe, _ = _cache()
    for _ in range(3):
        probe(progs[0], [x])
    one = probe.nbytes  # what one graph holds: buffers in and out
    # Room for two graphs, and for what a third needs while it is captured (its dry run's peak): the third evicts one.
    graphs, fake = _cache(max_bytes=one + GraphCache.need(progs[0], [x]))
    for p in progs:
        for _ in range(3):
            graphs(p, [torch.randn(8, 16)])
    assert fake.captures == 3 and graphs.nbytes == 2 * one  # the first went to make room for the third
    graphs.take_counts()
    graphs(progs[1], [torch.randn(8, 16)])
    assert graphs.take_counts().runs == {"replayed": 1}
    graphs(progs[0], [torch.randn(8, 16)])  # evicted: warmed up again from the start
    assert graphs.take_counts().runs == {"warming": 1}


def test_a_graph_bigger_than_the_budget_is_refused_once_and_the_runs_go_on_plain():
    prog = _mlp()
    graphs, fake = _cache(max_bytes=16)
    for _ in range(5):
        x = torch.randn(8, 16)
        assert torch.equal(graphs(prog, [x])[0], run_program(prog, [x])[0])
    counts = graphs.take_counts()
    assert counts.runs == {"warming": 2, "refused": 3} and [r for r, _ in counts.refused] == [TOO_BIG]
    assert "share of this executor's budget" in counts.refused[0][1] and graphs.nbytes == 0


def test_a_run_that_syncs_with_the_host_runs_plain_and_says_why():
    prog = _mlp()
    graphs, fake = _cache(sync_ops=frozenset({"aten.addmm.default"}))
    for _ in range(5):
        x = torch.randn(3, 16)
        assert torch.equal(graphs(prog, [x])[0], run_program(prog, [x])[0])
    counts = graphs.take_counts()
    assert counts.runs == {"warming": 2, "refused": 3} and len(counts.refused) == 1  # tried once per shape
    assert counts.refused[0][0] == SYNC and "aten.addmm" in counts.refused[0][1] and fake.captures == 0
    for _ in range(3):  # another shape is tried on its own
        graphs(prog, [torch.randn(4, 16)])
    assert fake.checks == 2 and graphs.broken is None


def test_a_capture_that_fails_half_way_ends_capturing_in_that_process_which_asks_to_be_replaced():
    """A failed capture may leave torch's allocator mid-capture: the run's own result (its warm-up) stands, nothing
    more is captured there, and the executor asks to be replaced once no session's state would go with it."""
    prog = _mlp()
    graphs, fake = _cache(fail_capture=True)
    for _ in range(5):
        x = torch.randn(3, 16)
        assert torch.equal(graphs(prog, [x])[0], run_program(prog, [x])[0])
    for _ in range(3):
        graphs(prog, [torch.randn(4, 16)])
    assert graphs.broken and fake.checks == 1  # (the second shape never got that far)
    reply: dict = {}
    graphs.tell(reply, holding_sessions=True)
    assert reply["graphs"]["runs"] == {"warming": 2, "refused": 6} and reply["graphs"]["refused"][0][0] == FAILED
    assert reply["graphs_broken"] and "recycle" not in reply  # (new sessions go elsewhere; these stay)
    graphs.tell(reply, holding_sessions=False)
    assert reply["recycle"] is True


def test_the_jobs_own_error_in_a_warm_up_ends_the_run_once_and_refuses_nothing():
    """An index out of range in the run that would have been captured is the job's error, as in a plain run: raised
    (not run again plain), and its shapes are not refused for good (the next values may be fine)."""
    class Raising(FakeCudaGraphs):
        def check(self, run):
            raise JobRaised("node 'embedding' (aten.embedding.default) raised IndexError: index out of range")

    prog = _mlp()
    graphs, fake = _cache(Raising())
    calls = []
    graphs._run_program = lambda *a, **k: calls.append(1) or run_program(*a, **k)
    for _ in range(2):
        graphs(prog, [torch.randn(3, 16)])
    with pytest.raises(JobRaised):
        graphs(prog, [torch.randn(3, 16)])
    assert len(calls) == 2 and not graphs.take_counts().refused
    graphs(prog, [torch.randn(3, 16)])
    assert graphs.take_counts().runs == {"warming": 1}


def test_a_plain_run_out_of_memory_runs_again_without_the_graphs():
    """Graphs share the runs' allocator, and a job may be admitted up to the whole budget: a plain run that ran out
    of memory while graphs held some runs once more after they are dropped."""
    prog, failures = _mlp(), []

    def plain(prog, inputs, stop=None, pace=None):
        if failures:
            raise JobFailed(failures.pop())
        return run_program(prog, inputs, stop=stop, pace=pace)

    fake = FakeCudaGraphs()
    graphs = GraphCache(fake, 1 << 30, plain)
    for _ in range(3):
        graphs(prog, [torch.randn(2, 16)])
    assert graphs.nbytes > 0
    x = torch.randn(5, 16)
    failures.append("node 'addmm' (aten.addmm.default) raised OutOfMemoryError: CUDA out of memory")
    assert torch.equal(graphs(prog, [x])[0], run_program(prog, [x])[0])
    assert graphs.nbytes == 0 and fake.releases == 1
    failures.append("node 'addmm' (aten.addmm.default) raised OutOfMemoryError: CUDA out of memory")
    with pytest.raises(JobFailed, match="OutOfMemoryError"):  # no graphs to drop: the run's own failure
        graphs(prog, [x])


def test_a_program_whose_guard_reads_values_is_never_captured():
    class Bags(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(10, 4, mode="sum")

        def forward(self, idx, offsets):
            return self.bag(idx, offsets)

    job = Job.from_module(Bags(), (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])))
    prog = load_program(job.program_bytes())
    graphs, fake = _cache()
    for _ in range(4):
        graphs(prog, [torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])])
    counts = graphs.take_counts()
    assert counts.runs == {"refused": 4} and counts.refused[0][0] == GUARDED and fake.checks == 0


def test_a_programs_graphs_go_with_it():
    """Its weights' addresses are in its graphs: a program evicted (or loaded for one job) takes them along."""
    prog = _mlp()
    graphs, _ = _cache()
    for _ in range(3):
        graphs(prog, [torch.randn(2, 16)])
    assert graphs.nbytes > 0
    del prog
    gc.collect()
    assert graphs.nbytes == 0 and not graphs._graphs and not graphs._seen.keys() and not graphs._programs


def test_a_replay_honours_the_stop_word_and_the_jobs_time():
    prog = _mlp()
    graphs, fake = _cache()
    x = torch.randn(2, 16)
    for _ in range(3):
        graphs(prog, [x])
    with pytest.raises(JobPreempted):
        graphs(prog, [x], stop=lambda: True)
    est = prog.estimate([x])
    pace = Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() - 0.1)  # the job's time is up
    with pytest.raises(JobTimeout, match="not billed"):
        graphs(prog, [x], pace=pace)
    pace = Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() + 60)
    assert torch.equal(graphs(prog, [x], pace=pace)[0], run_program(prog, [x])[0]) and fake.replays == 1
    # The run that is captured is the job's own run: stopped as any.
    y = torch.randn(6, 16)
    for _ in range(2):
        graphs(prog, [y])
    with pytest.raises(JobPreempted):
        graphs(prog, [y], stop=lambda: True)
    assert fake.captures == 1


def test_an_executor_replays_a_sessions_steps_and_the_worker_counts_them(tmp_path):
    """Through the executor's process and pipe, sandboxed: a session's steps equal its plain steps, and what the
    graphs did reaches the worker's metrics."""
    torch.manual_seed(2)
    job = Job.from_module(Accumulate(), (torch.randn(1, 4), torch.zeros(1, 4)), state=1)
    before = {k: metrics.GRAPH_RUNS.labels(k)._value.get() for k in ("warming", "captured", "replayed")}

    async def steps(ex):
        total, outs = torch.zeros(1, 4), []  # (step 0 starts from zeros: fresh)
        for step in range(6):
            x = torch.randn(1, 4)
            res = await ex.run(job.program_hash, job.to_bytes() if step == 0 else None, job.encode_step_inputs(x),
                               60, session=SessionRun("A/s", step, fresh=step == 0, room=1 << 20))
            outs.append(tensors.decode(res.outputs)["output_0"])
            plain, total = job.run_locally(x, total)
            assert torch.equal(outs[-1], plain)

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, graphs="fake") as ex:
        asyncio.run(steps(ex))
    after = {k: metrics.GRAPH_RUNS.labels(k)._value.get() - before[k] for k in before}
    assert after == {"warming": 2, "captured": 1, "replayed": 3}
    assert metrics.GRAPH_BYTES._value.get() > 0


# --- On a GPU (scripts/gpu_check.sh runs these on the lent machine; CI has no GPU) -------------------------------------

on_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: scripts/gpu_check.sh")


@on_a_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_a_gpu_every_family_replayed_equals_its_plain_runs_bit_for_bit(dtype):
    from gpunet.worker.executor.graphs import CudaGraphs
    from tests._job_models import families

    for name, module, example, dynamic, others in families():
        module = module.to(dtype) if dtype is not torch.float32 else module
        example = tuple(t.to(dtype) if t.is_floating_point() else t for t in example)
        prog = load_program(Job.from_module(module, example, dynamic_shapes=dynamic).program_bytes(), device="cuda")
        graphs = GraphCache(CudaGraphs("cuda"), 1 << 32, run_program)
        for x in [*example, *(t.to(dtype) if t.is_floating_point() else t for t in others)]:
            for _ in range(5):
                x = torch.rand_like(x) if x.is_floating_point() else torch.randint_like(x, 0, 50)
                got, want = graphs(prog, [x]), run_program(prog, [x])
                assert all(torch.equal(g, w) for g, w in zip(got, want)), name
        counts = graphs.take_counts()
        assert counts.runs.get("replayed", 0) >= 2 * (1 + len(others)), (name, counts)


@on_a_gpu
def test_on_a_gpu_sessions_interleaved_on_one_graph_keep_their_own_state():
    from gpunet.worker.executor.graphs import CudaGraphs

    graphs = GraphCache(CudaGraphs("cuda"), 1 << 30, run_program)
    _two_sessions_interleaved(graphs, "cuda")
    assert graphs.take_counts().runs["replayed"] == 7


@on_a_gpu
def test_on_a_gpu_a_run_that_syncs_with_the_host_is_refused_and_runs_plain():
    from gpunet.worker.executor.graphs import CudaGraphs

    def clip(x):
        x = x.clone()
        x[x > 0.5] = 0.0  # a boolean mask: on CUDA its indices are counted on the host
        return x

    prog = load_program(Job.from_function(clip, (torch.rand(8, 8),)).program_bytes(), device="cuda")
    graphs = GraphCache(CudaGraphs("cuda"), 1 << 30, run_program)
    for _ in range(4):
        x = torch.rand(8, 8)
        assert torch.equal(graphs(prog, [x])[0], run_program(prog, [x])[0])
    counts = graphs.take_counts()
    assert counts.runs == {"warming": 2, "refused": 2} and counts.refused[0][0] == SYNC, counts
