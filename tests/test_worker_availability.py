"""A worker stays available to everyone while a hostile client (hand-written protocol frames, over a real swarm)
holds streams open, drips bytes or hangs up mid-upload: uploads take no queue place, are capped per client and per
address, are charged to a byte budget before reading, and an abandoned one gives its memory back at once."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import torch

import gpunet
from gpunet import protocol
from gpunet.protocol import Door, Error, Payload, Send, Submit
from gpunet.testing.localnet import executor_pids
from tests.swarm import wait_for
from tests.test_jobs_swarm import mlp_job

pytestmark = pytest.mark.swarm

def on_loop(client, coro, timeout=120):
    return asyncio.run_coroutine_threadsafe(coro, client._loop).result(timeout)


async def open_upload(client, worker_id: str, maddrs, job_id: str, program: str, inputs_size: int):
    """Submit a job with streamed inputs, announce them, send none: returns (reader, writer, what the worker said)."""
    reader, writer = await client._core.transport.rpc.open(worker_id, Door.JOB, maddrs)
    await protocol.write(writer, Submit(job_id, program, inputs_size))
    reply = await protocol.read(reader, Send, Error, timeout=30)
    if isinstance(reply, Send):
        await protocol.write(writer, Payload(1 << 10 if reply.program else None, inputs_size))
    return reader, writer, reply


def test_idle_uploads_make_nobody_else_wait(swarm, client_for):
    worker = swarm.start_worker("--max-queue", "8")
    worker_id = swarm.worker_id(worker)
    mallory, alice = client_for(swarm, "mallory"), client_for(swarm, "alice")
    maddrs = mallory.workers()[0].record.maddrs
    model, job = mlp_job()
    x = torch.randn(3, 16)
    assert torch.equal(mallory.submit(job, x).result(timeout=60), model(x).detach())  # the program is cached now

    async def hold_nine():
        return await asyncio.gather(*(open_upload(mallory, worker_id, maddrs, f"idle-{i}", job.program_hash, 1 << 20)
                                      for i in range(9)))

    held = on_loop(mallory, hold_nine())
    try:
        answers = [reply for _, _, reply in held]
        # Four uploads from one identity at a time; the rest are told "busy" at once (before sending anything).
        assert sum(isinstance(a, Send) for a in answers) == 4, answers
        assert all(a.code == "busy" for a in answers if isinstance(a, Error))
        # Nine idle streams used to fill every place (1 running + 8 queued): the worker was "busy" for everyone.
        assert torch.equal(alice.submit(job, x).result(timeout=60), model(x).detach())
    finally:
        for _, writer, _ in held:
            writer.close()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_uploads_abandoned_midway_give_their_memory_back(swarm, client_for):
    worker = swarm.start_worker()
    worker_id = swarm.worker_id(worker)
    mallory = client_for(swarm, "mallory")
    maddrs = mallory.workers()[0].record.maddrs
    model, job = mlp_job()
    x = torch.randn(3, 16)
    assert torch.equal(mallory.submit(job, x).result(timeout=60), model(x).detach())  # the program is cached now
    size, sent = 96 << 20, 64 << 20
    chunk = hashlib.sha256(b"x").digest() * (1 << 15)  # 1 MiB

    async def send_and_hang_up(i: int) -> None:
        reader, writer, reply = await open_upload(mallory, worker_id, maddrs, f"abandoned-{i}", job.program_hash, size)
        assert isinstance(reply, Send) and not reply.program, reply
        for _ in range(sent >> 20):
            writer.write(chunk)
            await writer.drain()
        writer.transport.abort()  # gone mid-upload

    baseline = _rss(worker.pid)
    for i in range(20):
        on_loop(mallory, send_and_hang_up(i))
    # 20 x 64 MiB were received and abandoned: 1.25 GiB if any were kept. Wait for the worker to see the last hang-up.
    wait_for(lambda: _rss(worker.pid) < baseline + (256 << 20), 60,
             "the worker's memory to come back after abandoned uploads", interval=0.5)
    assert torch.equal(mallory.submit(job, x).result(timeout=60), model(x).detach())  # and it still serves


def test_big_inputs_are_spooled_to_disk_and_reach_the_executor_intact(swarm, client_for):
    """Inputs of 32 MiB and more are written to an unlinked file in <data dir>/spool as they arrive and mapped by the
    executor: the worker's heap never holds them."""
    worker = swarm.start_worker()
    alice = client_for(swarm, "alice")
    job = gpunet.Job.from_function(lambda x: x.sum(dim=0), (torch.randn(4, 1024),),
                                   dynamic_shapes=({0: torch.export.Dim("rows", min=1, max=1 << 16)},))
    x = torch.randn(12 << 10, 1024)  # 48 MiB
    pid = worker.pid
    spooled = []

    def watch():  # the spooled file shows among the worker's descriptors while the job is in
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                target = os.readlink(os.path.join(fds, fd))
            except OSError:
                continue
            if "/spool/" in target:
                spooled.append(target)
        return bool(spooled)

    future = alice.submit(job, x)
    wait_for(watch, 60, "the inputs to be spooled")
    assert torch.allclose(future.result(timeout=120), x.sum(dim=0), rtol=1e-4, atol=1e-3)
    assert all("(deleted)" in t for t in spooled)  # unlinked from the start: nothing is left behind
    assert not os.listdir(worker.data_dir / "spool")


def _spool_maps(pid: int) -> set[str]:
    """The spool files ``pid`` has mapped (unlinked ones say so)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if "/spool/" in line}
    except (OSError, IndexError):
        return set()


def test_a_big_program_is_spooled_to_disk_and_its_executor_maps_the_same_file(swarm, client_for):
    """A program of 32 MiB and more is assembled in an unlinked file of <data dir>/spool as it comes, mapped (served
    to other workers and hashed from there), and handed to the executor as that file, which the executor maps in its
    turn: one copy, in the page cache, not one in the worker's heap and another in the executor's (issue 40)."""
    worker = swarm.start_worker()
    alice = client_for(swarm, "alice")
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048),
                                torch.nn.Linear(2048, 16)).eval()  # 32.1 MiB of weights
    x = torch.randn(2, 2048)
    job = gpunet.Job.from_module(model, (x,))
    seen: dict[int, set[str]] = {}

    def watch():  # the worker maps the spooled program while the job comes in, and an executor maps the same file
        for pid in [worker.pid, *executor_pids(worker.pid)[1]]:
            seen.setdefault(pid, set()).update(_spool_maps(pid))
        others = set().union(*(files for pid, files in seen.items() if pid != worker.pid))
        return seen[worker.pid] & others

    future = alice.submit(job, x)
    both = wait_for(watch, 60, "the worker and its executor to map the spooled program")
    with torch.no_grad():
        assert torch.allclose(future.result(timeout=120), model(x), rtol=1e-5, atol=1e-5)
    assert all("(deleted)" in name for name in both)  # unlinked from the start: nothing is left behind
    assert not os.listdir(worker.data_dir / "spool")
