"""The op fuzzer (gpunet/testing/opfuzz.py, scripts/fuzz_ops.py) finds kernels that crash instead of raising, and
the worker's argument guards (gpunet/job/guards.py) keep jobs from reaching them. CI runs a bounded sweep; run
``python scripts/fuzz_ops.py --cases 150 --baselines 10`` for a long one."""

from __future__ import annotations

import asyncio

import torch

from gpunet import Job, JobFailed
from gpunet.job.validator import ALLOWED_OPS
from gpunet.testing import opfuzz
from gpunet.worker.executor import Executor

EMBEDDING_BAG = "aten._embedding_bag.default"


def test_the_fuzzer_finds_the_embedding_bag_crash_and_the_guard_stops_it():
    op = {EMBEDDING_BAG: ALLOWED_OPS[EMBEDDING_BAG]}
    raw = opfuzz.fuzz(op, cases_per_op=200, baselines_per_op=10, guarded=False)
    assert raw.crashes, "the fuzzer no longer finds max-mode embedding_bag with empty offsets"
    assert all(c.how.startswith("crashed") for c in raw.crashes)
    assert opfuzz.replay(raw.crashes, guarded=True) == ["raised"] * len(raw.crashes)  # refused, not crashed


def test_no_allowlisted_op_crashes_a_guarded_executor():
    """A bounded sweep of every allowlisted op (a few seconds of cases per op)."""
    report = opfuzz.fuzz(cases_per_op=12, baselines_per_op=2, seed=7, guarded=True)
    assert report.ops == len(ALLOWED_OPS) and report.executed > 1000
    assert not report.crashes, [(c.op, c.args, c.how) for c in report.crashes]


class MaxBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 3, mode="max")

    def forward(self, indices, offsets):
        return self.bag(indices, offsets)


def test_a_job_that_would_segfault_its_executor_fails_cleanly(tmp_path):
    model = MaxBag().eval()
    job = Job.from_module(model, (torch.tensor([1, 2, 3]), torch.tensor([0, 2])),
                          dynamic_shapes=({0: torch.export.Dim("n", min=1, max=64)},
                                          {0: torch.export.Dim("bags", min=0, max=64)}))
    with Executor(processes=1, memory_budget_bytes=1024**3, cache_dir=tmp_path) as ex:
        async def run(indices, offsets):
            return await ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(indices, offsets), 60)

        ok = asyncio.run(run(torch.tensor([1, 2, 3]), torch.tensor([0, 2])))
        assert ok.outputs
        pid = ex.pids()[0]
        try:
            asyncio.run(run(torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.int64)))
            raise AssertionError("the job ran")
        except JobFailed as e:
            assert "refused before the kernel ran" in str(e), e
        assert ex.pids() == [pid]  # the executor lived


def test_batch_norm_with_parameters_of_another_size_than_its_channels_is_refused_before_the_kernel():
    """From an attacker's review: the meta dry run broadcasts a one-element bias (or weight, mean, var) and passes;
    the CPU kernel then reads one value per channel, out of the executor's heap (another client's session input came
    back in the output), or segfaults. A traced BatchNorm runs as before."""
    import json

    from gpunet.job.format import ProgramParts, canonical_json
    from gpunet.job.interpreter import run_program
    from gpunet.job.validator import load_program

    bn = torch.nn.BatchNorm1d(64).eval()
    x = torch.randn(2, 64, 5)
    job = Job.from_module(bn, (x,))
    with torch.no_grad():
        assert torch.allclose(job.run_locally(x), bn(x), atol=1e-6)
    g, m = json.loads(job.parts.graph), json.loads(job.parts.manifest)
    (node,) = [n for n in g["nodes"] if n["op"] == "aten._native_batch_norm_legit_no_training.default"]
    g["nodes"].insert(0, {"name": "one", "op": "aten.full.default", "args": [[1], 0.0],
                          "kwargs": {"dtype": {"dtype": "F32"}, "layout": None, "device": {"device": "cpu"},
                                     "pin_memory": None}})
    m["ops"]["aten.full.default"] = str(torch.ops.aten.full.default._schema)
    node["args"][2] = {"ref": "one"}  # the bias: one value for 64 channels
    tampered = load_program(ProgramParts(canonical_json(m), canonical_json(g), job.parts.weights).to_bytes())
    try:
        run_program(tampered, [x])
        raise AssertionError("the kernel ran")
    except JobFailed as e:
        assert "bias must be 1-D with one value per channel (64)" in str(e) and "refused before the kernel ran" in str(e)
