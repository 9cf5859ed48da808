"""The executor's sandbox (gpunet/worker/executor/sandbox.py): code running in an executor process — what a memory-corruption
bug in a kernel could give a crafted job — cannot read the identity key or the home directory, open a socket, run a
program or start a process, while the executor itself still runs jobs."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from gpunet import Job
from gpunet.worker.executor import sandbox
from gpunet.worker.executor import Executor
from tests import _sandbox_probe

pytestmark = pytest.mark.skipif(not sandbox.landlock_abi(), reason="this kernel has no Landlock")


def test_an_executor_process_cannot_reach_the_key_the_home_dir_or_the_network(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "programs").mkdir(parents=True)
    key = data / "identity.key"
    key.write_bytes(b"secret")
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("private")
    config = {"cache_dir": str(data / "programs"), "disk_cache_bytes": 2**30, "protected": [str(data)]}
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sandbox_probe.probe, args=(config, str(key), str(home / "notes.txt"), os.getpid(), theirs))
    proc.start()
    try:
        assert ours.poll(120), "the probe did not report"
        report, results = ours.recv()
    finally:
        proc.join(30)
    assert any(line.startswith("landlock") for line in report) and any("seccomp" in line for line in report), report
    # CUDA cannot start unless it may name its own threads (Error 304 under Landlock, seen on an H200)
    assert results[-2:] == ["name its own thread: allowed", "write cache: allowed"], results
    assert all("refused" in r for r in results[:-2]), results


def test_a_sandboxed_executor_still_runs_jobs_and_uses_its_disk_cache(tmp_path):
    w = torch.randn(8, 16)
    job = Job.from_function(lambda x: torch.tanh(x @ w.T), (torch.randn(2, 16),))
    (tmp_path / "identity.key").write_bytes(b"secret")
    x = torch.randn(2, 16)
    with Executor(processes=1, cache_dir=tmp_path / "programs", protected=[str(tmp_path)]) as ex:
        report = asyncio.run(ex.sandbox_report())
        assert any(line.startswith("landlock") for line in report), report
        asyncio.run(ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(x), 60))
    assert list(Path(tmp_path / "programs").glob("*.gpunet"))  # written by the sandboxed executor
    with Executor(processes=1, cache_dir=tmp_path / "programs", protected=[str(tmp_path)]) as ex:  # a fresh one
        result = asyncio.run(ex.run(job.program_hash, None, job.encode_inputs(x), 60))  # read from its disk cache
    from gpunet.job import tensors

    assert torch.equal(tensors.decode(result.outputs)["output_0"], torch.tanh(x @ w.T))


def test_every_model_family_runs_the_same_inside_the_sandbox(tmp_path):
    """The sandbox must not change what a job computes: each family of the model zoo, run by a sandboxed executor,
    equals its local run (a path torch needs and the sandbox denies would show up here as a failed job)."""
    from gpunet.job import tensors
    from tests._job_models import families

    with Executor(processes=1, cache_dir=tmp_path / "programs", protected=[str(tmp_path)]) as ex:
        assert any(line.startswith("landlock") for line in asyncio.run(ex.sandbox_report()))
        for name, module, example, dynamic, others in families():
            job = Job.from_module(module, example, dynamic_shapes=dynamic)
            for x in [*example, *others][:2]:
                result = asyncio.run(ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(x), 120))
                got = list(tensors.decode(result.outputs).values())
                want = job.run_locally(x)
                want = list(want) if isinstance(want, tuple) else [want]
                assert len(got) == len(want), name
                for a, b in zip(got, want):
                    assert torch.equal(a, b), name
