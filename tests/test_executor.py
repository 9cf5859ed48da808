"""The executor pool: jobs run in separate processes, repeat jobs hit the cache, and a job that hangs or whose
executor dies fails cleanly while the pool replaces the process and keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
import torch
from torch.export import Dim

from gpunet import Job, JobFailed, JobRejected, JobTimeout, ProgramNotCached, WorkerDraining
from gpunet.job import cost, tensors
from gpunet.testing.localnet import cpu_seconds, open_files, parent_pid, process_alive, wait_for
from gpunet.worker.executor import Executor
from gpunet.worker.state.limits import SessionRun

W = torch.randn(8, 16)
SMALL = Job.from_function(lambda x: torch.tanh(x @ W.T), (torch.randn(2, 16),), dynamic_shapes=({0: Dim("b", min=1, max=32)},))


def _slow(x):
    for _ in range(300):
        x = torch.tanh(x @ x)
    return x


SLOW = Job.from_function(_slow, (torch.randn(768, 768),))  # ~270 GFLOP: about a second on this machine's fp32


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    with Executor(processes=2, memory_budget_bytes=1024**3, default_timeout=60, cache_dir=tmp_path_factory.mktemp("cache")) as ex:
        yield ex


def _run(ex, job, *xs, timeout=60, send_program=True):
    return asyncio.run(ex.run(job.program_hash, job.program_bytes() if send_program else None, job.encode_inputs(*xs), timeout))


def test_runs_a_job_and_bills_the_dry_run_flops(ex):
    x = torch.randn(5, 16)
    res = _run(ex, SMALL, x)
    assert torch.equal(SMALL.decode_outputs(res.outputs), SMALL.run_locally(x))
    assert res.flops == SMALL.estimate(x).flops == 2 * 5 * 16 * 8 + cost.TRANSCENDENTAL * 5 * 8  # matmul, tanh
    assert res.peak_memory_bytes == SMALL.estimate(x).peak_memory_bytes and res.wall_time > 0


def test_repeat_jobs_use_the_cache(ex):
    _run(ex, SMALL, torch.randn(2, 16))
    assert ex.has_program(SMALL.program_hash) and SMALL.program_hash in ex.cached_programs()
    x = torch.randn(3, 16)
    res = _run(ex, SMALL, x, send_program=False)
    assert torch.equal(SMALL.decode_outputs(res.outputs), SMALL.run_locally(x))


def test_unknown_program_without_bytes(ex):
    with pytest.raises(ProgramNotCached):
        asyncio.run(ex.run("ab" * 32, None, SMALL.encode_inputs(torch.randn(1, 16)), 10))


def test_rejections_come_back_as_job_rejected(ex):
    bad = tensors.encode({"input_0": torch.randn(33, 16)})  # batch dim outside [1, 32]
    with pytest.raises(JobRejected, match="outside its range"):
        asyncio.run(ex.run(SMALL.program_hash, SMALL.program_bytes(), bad, 10))
    with pytest.raises(JobRejected, match="hash"):
        asyncio.run(ex.run("cd" * 32, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(1, 16)), 10))
    with pytest.raises(JobRejected, match="malformed program hash"):
        asyncio.run(ex.run("../../etc/passwd", SMALL.program_bytes(), b"", 10))


def test_a_job_over_the_memory_budget_is_rejected_before_it_runs(ex):
    big = Job.from_function(lambda x: x.expand(4096, 4096, 32).clone(), (torch.randn(32),))
    with pytest.raises(JobRejected, match="peak memory"):
        _run(ex, big, torch.randn(32))


def test_a_hanging_job_times_out_and_the_executor_is_replaced(ex):
    before = set(ex.pids())
    with pytest.raises(JobTimeout):
        _run(ex, SLOW, torch.randn(768, 768), timeout=0.5)
    assert _run(ex, SMALL, torch.randn(1, 16)).flops > 0
    assert set(ex.pids()) != before  # the timed-out process was killed and replaced


def test_an_executor_killed_mid_job_is_replaced_and_the_next_job_succeeds(ex):
    async def scenario():
        task = asyncio.create_task(ex.run(SLOW.program_hash, SLOW.program_bytes(), SLOW.encode_inputs(torch.randn(768, 768)), 60))
        await asyncio.to_thread(wait_for, lambda: ex.busy_pids(), 30, "the job to reach an executor")
        victim = ex.busy_pids()[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(JobFailed, match="died.*SIGKILL.*replaced"):
            await task
        result = await ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(4, 16)), 60)
        assert victim not in ex.pids()
        return result

    assert asyncio.run(scenario()).flops == SMALL.estimate(torch.randn(4, 16)).flops


def test_after_a_death_a_warm_spare_takes_the_next_dead_executors_place(tmp_path):
    """A crash loop from one client must not make every other job wait for a torch import."""
    with Executor(processes=1, memory_budget_bytes=1024**3, default_timeout=60, cache_dir=tmp_path) as ex:

        async def kill_one_running_job():
            task = asyncio.create_task(ex.run(SLOW.program_hash, SLOW.program_bytes(),
                                              SLOW.encode_inputs(torch.randn(768, 768)), 60))
            await asyncio.to_thread(wait_for, lambda: ex.busy_pids(), 60, "the job to reach an executor")
            os.kill(ex.busy_pids()[0], signal.SIGKILL)
            with pytest.raises(JobFailed, match="died"):
                await task

        async def scenario():
            await kill_one_running_job()
            await ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(2, 16)), 60)
            await asyncio.to_thread(wait_for, lambda: ex._spare is not None, 60, "a spare to be started")
            spare_pid = ex._spare.proc.pid
            await kill_one_running_job()
            await ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(2, 16)), 60)
            assert ex.pids() == [spare_pid]  # the spare took the dead one's place
            await asyncio.to_thread(wait_for, lambda: ex._spare is not None, 60, "the next spare")

        asyncio.run(scenario())
        spare = ex._spare.proc.pid
    assert not process_alive(spare)  # close() stops the spare too


def _expand(x):  # a 4 KiB input (it rides in the pipe header) that becomes seconds of matmuls (270 GFLOP)
    y = x.repeat(24, 24)
    for _ in range(300):
        y = torch.tanh(y @ y)
    return y[:2, :2]


EXPANDING = Job.from_function(_expand, (torch.randn(32, 32),))


@pytest.mark.parametrize("job", [EXPANDING, SLOW], ids=["waiting for the reply", "big input, sent from a thread"])
def test_a_cancelled_job_stops_at_its_next_node_and_its_executor_serves_on(ex, job):
    """No restart: a fresh executor would cost the next job the torch import (seconds; the lanes benchmark's p99)."""
    async def scenario():
        x = torch.randn(*job.manifest.inputs[0].shape)
        task = asyncio.create_task(ex.run(job.program_hash, job.program_bytes(), job.encode_inputs(x), 60))
        await asyncio.to_thread(wait_for, lambda: ex.busy_pids(), 30, "the job to reach an executor")
        victim = ex.busy_pids()[0]
        if job is EXPANDING:  # cancel while it computes: the reply is what the pool is waiting for
            start = cpu_seconds(victim)
            await asyncio.to_thread(wait_for, lambda: cpu_seconds(victim) - start > 0.3, 60, "the job to compute")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ex.busy_pids()  # stopped, not left running
        result = await ex.run(SMALL.program_hash, None, SMALL.encode_inputs(torch.randn(4, 16)), 60)
        assert victim in ex.pids() and process_alive(victim)  # (a killed one is a zombie or replaced by now)
        return result

    assert asyncio.run(scenario()).flops == SMALL.estimate(torch.randn(4, 16)).flops


def _one_long_op(x):  # a 4 KiB input, then one matmul of about 740 GFLOP: no node boundary to stop at for seconds
    y = x.repeat(224, 224)
    return (y @ y)[:2, :2]


ONE_LONG_OP = Job.from_function(_one_long_op, (torch.randn(32, 32),))


def test_a_cancelled_job_inside_one_long_op_has_its_executor_killed(ex, monkeypatch):
    from gpunet.worker.executor import slot

    monkeypatch.setattr(slot, "STOP_GRACE", 0.1)  # well inside the op, on any machine

    async def scenario():
        x = torch.randn(32, 32)
        task = asyncio.create_task(ex.run(ONE_LONG_OP.program_hash, ONE_LONG_OP.program_bytes(),
                                          ONE_LONG_OP.encode_inputs(x), 120))
        await asyncio.to_thread(wait_for, lambda: ex.busy_pids(), 30, "the job to reach an executor")
        victim = ex.busy_pids()[0]
        start = cpu_seconds(victim)
        # Well into the matmul (740 GFLOP: seconds of CPU anywhere), past the repeat before it (205 MB written, page
        # faults counted as CPU: under CI's load 0.3 s of it came before the op, which a stop then ended cleanly).
        await asyncio.to_thread(wait_for, lambda: cpu_seconds(victim) - start > 1.0, 60, "the job to compute")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # after STOP_GRACE, not after the op
        await asyncio.to_thread(wait_for, lambda: not process_alive(victim), 10, "the cancelled job's executor to stop")
        result = await ex.run(SMALL.program_hash, None, SMALL.encode_inputs(torch.randn(4, 16)), 60)
        assert victim not in ex.pids()
        return result

    assert asyncio.run(scenario()).flops == SMALL.estimate(torch.randn(4, 16)).flops


def test_a_job_stopped_for_a_higher_lane_ends_at_its_next_node_and_its_executor_serves_on(ex):
    from gpunet.errors import JobPreempted

    async def scenario():
        x = torch.randn(768, 768)
        tag = object()
        assert not ex.stop(tag)  # nothing running under that name: the caller would cancel instead
        task = asyncio.create_task(ex.run(SLOW.program_hash, SLOW.program_bytes(), SLOW.encode_inputs(x), 60,
                                          tag=tag))
        await asyncio.to_thread(wait_for, lambda: ex.busy_pids(), 30, "the job to reach an executor")
        runner = ex.busy_pids()[0]
        start = cpu_seconds(runner)
        await asyncio.to_thread(wait_for, lambda: cpu_seconds(runner) - start > 0.2, 60, "the job to compute")
        assert ex.stop(tag)
        with pytest.raises(JobPreempted, match="higher lane"):
            await task
        assert runner in ex.pids() and process_alive(runner)  # no restart: the process is the same
        result = await ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(4, 16)), 60)
        other = await ex.run(SLOW.program_hash, None, SLOW.encode_inputs(x), 60, tag=object())
        return result, other  # a stop meant for one run never stops the next

    result, other = asyncio.run(scenario())
    assert result.flops and other.flops == SLOW.estimate(torch.randn(768, 768)).flops


def test_a_waiter_cancelled_after_being_handed_an_executor_passes_it_on():
    """FIFO hand-over: an executor released to a waiter that is cancelled before it resumes goes to the next one."""
    from collections import deque
    from types import SimpleNamespace

    pool = Executor.__new__(Executor)  # the queueing logic alone, over stand-in slots
    pool._slots, pool._waiters, pool._closed = [SimpleNamespace(busy=False, hashes=set())], deque(), False
    pool._pinned_waiters = {}

    async def scenario():
        held = await pool._acquire("h")
        second = asyncio.ensure_future(pool._acquire("h"))
        third = asyncio.ensure_future(pool._acquire("h"))
        await asyncio.sleep(0)
        pool._release(held)  # handed to `second`...
        second.cancel()  # ...which is cancelled before it runs again
        assert await asyncio.wait_for(third, 5) is held
        assert second.cancelled() and held.busy
        pool._release(held)
        assert not held.busy and not pool._waiters

    asyncio.run(scenario())


def test_big_inputs_and_outputs_cross_intact(ex):
    """Inputs over 1 MiB go through shared memory (mapped zero-copy by the executor), big outputs through the pipe."""
    big = Job.from_function(lambda x: x * 2 + 1, (torch.randn(1024, 1024),))
    x = torch.randn(1024, 1024)
    res = _run(ex, big, x)
    assert len(res.outputs) > 4 * 1024**2
    assert torch.equal(big.decode_outputs(res.outputs), x * 2 + 1)


def test_concurrent_jobs_share_the_pool(ex):
    async def many():
        xs = [torch.randn(i + 1, 16) for i in range(6)]
        res = await asyncio.gather(*(ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(x), 60) for x in xs))
        return xs, res

    xs, res = asyncio.run(many())
    for x, r in zip(xs, res):
        assert torch.equal(SMALL.decode_outputs(r.outputs), SMALL.run_locally(x))


def test_close_stops_every_process(tmp_path):
    ex = Executor(processes=1, cache_dir=tmp_path)
    pids = ex.pids()
    _run(ex, SMALL, torch.randn(1, 16))
    ex.close()
    assert not any(process_alive(pid) for pid in pids)
    with pytest.raises(WorkerDraining, match="stopped before the job ran"):  # its client runs it elsewhere
        _run(ex, SMALL, torch.randn(1, 16))


def _modules(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


async def _all_ready(ex) -> None:
    await asyncio.gather(*(slot.ensure_ready() for slot in ex._slots))


def test_executors_are_forked_by_one_fork_server_that_imported_torch_and_enter_the_sandbox_after(tmp_path):
    """Every executor (plain, its replacement, a spare) is a child of one fork server that imported torch before it
    forked them (not a fresh interpreter importing it each time, nor a fork of this multi-threaded process); each then
    locks itself down, single-threaded, as a spawned one did."""
    with Executor(processes=2, cache_dir=tmp_path) as ex:
        assert _run(ex, SMALL, torch.randn(1, 16)).outputs
        report = asyncio.run(ex.sandbox_report())
        assert any(line.startswith("landlock") for line in report) and any("seccomp" in line for line in report)
        first = ex.pids()
        servers = {parent_pid(pid) for pid in first}
        assert len(servers) == 1 and os.getpid() not in servers
        server = servers.pop()
        assert parent_pid(server) == os.getpid() and "libtorch_cpu" in _modules(server)
        with open(f"/proc/{server}/cmdline") as f:
            assert "multiprocessing.forkserver" in f.read()
        # No executor holds the pipe that keeps the server alive (one byte written there would stop it), once it runs
        # gpunet's code: each lets go of it first thing (one still starting has it until then).
        from multiprocessing import forkserver

        asyncio.run(_all_ready(ex))
        alive_pipe = f"pipe:[{os.fstat(forkserver._forkserver._forkserver_alive_fd).st_ino}]"
        for pid in first:
            assert alive_pipe not in open_files(pid)
        os.kill(first[0], signal.SIGKILL)  # its replacement comes from the same server
        for _ in range(3):  # (a job sent to the dead one fails, and the pool replaces it)
            with contextlib.suppress(JobFailed):
                _run(ex, SMALL, torch.randn(1, 16))
        assert first[0] not in ex.pids() and {parent_pid(pid) for pid in ex.pids()} == {server}


class SlowCounter(torch.nn.Module):
    """A stateful block whose step takes about half a second: a long chain over x, and the state counts steps."""

    def forward(self, x, n):
        for _ in range(150):
            x = torch.tanh(x @ x)
        return x[:1, :1] * 0 + n, n + 1


def test_a_run_on_an_executor_holding_sessions_is_stopped_never_killed(tmp_path):
    """Cancelled, or past its time: a kill would lose every session that process holds (any client's), so the run
    is stopped at its next node instead; the sessions go on from the state they had."""
    stepper = Job.from_module(SlowCounter(), (torch.randn(768, 768), torch.zeros(1, 1)), state=1)
    x = stepper.encode_step_inputs(torch.randn(768, 768))

    def session(key, step):
        return SessionRun(key, step, fresh=True, room=1 << 20)

    def count(result):  # the state's count, as the step saw it
        return tensors.decode(result.outputs)["output_0"].item()

    async def start_and_cancel(run, pid):
        task = asyncio.ensure_future(run)
        start = cpu_seconds(pid)
        await asyncio.to_thread(wait_for, lambda: cpu_seconds(pid) - start > 0.2, 60, "the run to compute")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def scenario(ex):
        (pid,) = ex.pids()  # one process: everything below shares it
        assert count(await ex.run(stepper.program_hash, stepper.to_bytes(), x, 60, session=session("A/s", 0))) == 0
        # Another job there, cancelled mid-run.
        await start_and_cancel(ex.run(SLOW.program_hash, SLOW.program_bytes(),
                                      SLOW.encode_inputs(torch.randn(768, 768)), 60), pid)
        # The session's own step, cancelled mid-run: the state stays as it was before it, so the step can be run again.
        await start_and_cancel(ex.run(stepper.program_hash, None, x, 60, session=session("A/s", 1)), pid)
        # A step past its time limit: stopped, the executor serving on.
        with pytest.raises(JobTimeout, match="stopped"):
            await ex.run(stepper.program_hash, None, x, 0.3, session=session("A/s", 1))
        assert ex.pids() == [pid] and process_alive(pid) and ex.holds_session("A/s")
        assert count(await ex.run(stepper.program_hash, None, x, 60, session=session("A/s", 1))) == 1
        assert count(await ex.run(stepper.program_hash, None, x, 60, session=session("A/s", 2))) == 2

        # With no session's state there, a cancel stops the run the same way (a kill waits for one op outlasting
        # STOP_GRACE: test_a_cancelled_job_inside_one_long_op_has_its_executor_killed).
        await ex.drop_sessions(["A/s"])
        await start_and_cancel(ex.run(SLOW.program_hash, None, SLOW.encode_inputs(torch.randn(768, 768)), 60), pid)
        assert count(await ex.run(stepper.program_hash, None, x, 60, session=session("B/s", 0))) == 0
        assert ex.pids() == [pid] and process_alive(pid)

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False) as ex:
        asyncio.run(scenario(ex))


class LastOpSlow(torch.nn.Module):
    """A stateful block whose step ends in one long op: a stop asked during it comes too late to stop anything."""

    def forward(self, x, n):
        seen = n * 1
        counted = n + 1
        return seen, torch.mm(x, x), counted


def test_a_cancelled_session_step_that_ends_anyway_is_taken_as_done(tmp_path):
    """Its session's state moved on in the process: dropping its answer would leave the worker a step behind the state
    (on a GPU this is the usual case: the stop is seen before the queued kernels end)."""
    stepper = Job.from_module(LastOpSlow(), (torch.randn(4096, 4096), torch.zeros(1, 1)), state=1)
    x = stepper.encode_step_inputs(torch.randn(4096, 4096))

    def session(step):
        return SessionRun("A/s", step, fresh=True, room=1 << 20)

    def seen(result):
        return tensors.decode(result.outputs)["output_0"].item()

    async def scenario(ex):
        (pid,) = ex.pids()
        assert seen(await ex.run(stepper.program_hash, stepper.to_bytes(), x, 60, session=session(0))) == 0
        task = asyncio.ensure_future(ex.run(stepper.program_hash, None, x, 60, session=session(1)))
        start = cpu_seconds(pid)
        await asyncio.to_thread(wait_for, lambda: cpu_seconds(pid) - start > 0.2, 60, "the long op to run")
        task.cancel()
        assert seen(await task) == 1  # answered, not cancelled: the step happened
        assert seen(await ex.run(stepper.program_hash, None, x, 60, session=session(2))) == 2

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False) as ex:
        asyncio.run(scenario(ex))


def test_a_device_that_cannot_start_is_said_with_its_error(tmp_path):
    """A GPU that the driver (or the sandbox, as CUDA was on an H200 before /proc/self/task was writable) refuses:
    the executor says why instead of dying with a traceback, and the worker can say it at start."""
    from gpunet.errors import ExecutorStartFailed

    with Executor(processes=1, device="cuda:99", cache_dir=tmp_path / "programs") as bad:
        with pytest.raises(ExecutorStartFailed, match=r"could not start \(cuda:99: \w+"):
            asyncio.run(bad.sandbox_report())


class OneLongOp(torch.nn.Module):
    """A plain job that is one long op (seconds on a CPU): it can be stopped only before the op, or killed in it."""

    def forward(self, x):
        x = x.repeat(2, 2)  # 6000 x 6000 from a 36 MB input: 0.4 TFLOP, seconds on any CPU
        return torch.mm(x, x)[:1, :1]


def test_plain_jobs_never_reach_the_sessions_process_so_killing_them_loses_no_session(tmp_path, monkeypatch):
    """Issue 38, item 5: sessions' state lives in a process of its own. A stranger's plain job that runs past its time
    inside one op (killed after STOP_GRACE), or that crashes its executor, takes only a plain executor with it."""
    from gpunet.errors import ExecutorDied
    from gpunet.worker.executor import slot

    monkeypatch.setattr(slot, "STOP_GRACE", 0.1)
    stepper = Job.from_module(SlowCounter(), (torch.randn(64, 64), torch.zeros(1, 1)), state=1)
    x = stepper.encode_step_inputs(torch.randn(64, 64))
    long_op = Job.from_module(OneLongOp(), (torch.randn(3000, 3000),))
    big = long_op.encode_inputs(torch.randn(3000, 3000))

    def count(result):
        return tensors.decode(result.outputs)["output_0"].item()

    def session(step):
        return SessionRun("A/s", step, fresh=True, room=1 << 20)

    async def scenario(ex):
        assert ex.session_pids() == []  # started with the first session, not before
        assert count(await ex.run(stepper.program_hash, stepper.to_bytes(), x, 60, session=session(0))) == 0
        (holder,) = ex.session_pids()
        assert holder not in ex.pids()
        # One long op past its time: its executor is killed (no session there), the sessions' process is not.
        with pytest.raises(JobTimeout, match="killed"):
            await ex.run(long_op.program_hash, long_op.to_bytes(), big, 0.3)
        # A job whose executor crashes under it (the OOM killer, a kernel fault): the same.
        task = asyncio.ensure_future(ex.run(long_op.program_hash, long_op.to_bytes(), big, 60))
        await asyncio.to_thread(wait_for, lambda: ex.busy_pids() and ex.busy_pids() == ex.pids(), 60, "the run")
        (plain,) = ex.pids()  # a fresh one: the first was killed
        start = cpu_seconds(plain)
        await asyncio.to_thread(wait_for, lambda: cpu_seconds(plain) - start > 0.2, 60, "the op to compute")
        os.kill(plain, signal.SIGKILL)
        with pytest.raises(ExecutorDied):
            await task
        assert ex.session_pids() == [holder] and process_alive(holder) and ex.holds_session("A/s")
        assert count(await ex.run(stepper.program_hash, None, x, 60, session=session(1))) == 1

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False,
                  session_processes=1) as ex:
        asyncio.run(scenario(ex))


def test_a_kill_of_a_process_holding_sessions_is_a_crash_of_the_client_that_caused_it(tmp_path, monkeypatch):
    """A session step whose one op outlasts its time and STOP_GRACE (with no measured speed to bound it) has the
    sessions' process killed: every session there is lost, so the run fails as a crash (ExecutorDied, counted five
    stops against its client by the job path), not as a mere timeout."""
    from gpunet.errors import ExecutorDied
    from gpunet.worker.executor import slot

    monkeypatch.setattr(slot, "STOP_GRACE", 0.1)
    n = Dim("n", min=8, max=8000)
    stepper = Job.from_module(LastOpSlow(), (torch.randn(8, 8), torch.zeros(1, 1)),
                              dynamic_shapes=({0: n, 1: n}, None), state=1)
    # 1e12 FLOPs: seconds even on two AVX-512 cores (6000, 4.3e11 FLOPs, ended within the 1.5 s + STOP_GRACE there)
    small, big = (stepper.encode_step_inputs(torch.randn(n, n)) for n in (8, 8000))

    async def scenario(ex):
        await ex.run(stepper.program_hash, stepper.to_bytes(), small, 60, session=SessionRun("B/s", 0, fresh=True,
                                                                                              room=1 << 20))
        # Its dry run first (a run with time enough), so the step below reaches its long op at once.
        await ex.run(stepper.program_hash, None, big, 600, session=SessionRun("M/s", 0, fresh=True, room=1 << 20))
        with pytest.raises(ExecutorDied, match="held inference sessions' state"):
            await ex.run(stepper.program_hash, None, big, 1.5, session=SessionRun("M/s", 1, room=1 << 20))
        assert not ex.holds_session("B/s")

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False,
                  session_processes=1) as ex:
        asyncio.run(scenario(ex))


def test_an_op_whose_counted_work_cannot_end_in_time_is_not_started(tmp_path):
    """Each node's time is bounded by its counted work: on a device measured at 0.001 TFLOPS a 3000² matmul (5.4e10
    FLOPs) needs at least 27 s, more than the job's 5 s, so the run stops before it, the process serving on."""
    long_op = Job.from_module(OneLongOp(), (torch.randn(3000, 3000),))
    big = long_op.encode_inputs(torch.randn(3000, 3000))

    async def scenario(ex):
        (pid,) = ex.pids()
        with pytest.raises(JobTimeout, match=r"node 'mm' .* needs at least .* stopped before it ran"):
            await ex.run(long_op.program_hash, long_op.to_bytes(), big, 5)
        assert ex.pids() == [pid] and process_alive(pid)
        ex.speed_tflops = 1.0  # a faster device: the same job runs
        await ex.run(long_op.program_hash, None, big, 60)

    with Executor(processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False,
                  speed_tflops=1e-3) as ex:
        asyncio.run(scenario(ex))


def test_the_pacer_stops_a_run_before_a_node_that_cannot_end_in_time_and_after_one_that_overran(monkeypatch):
    """The pure part of the bound, on a clock the test turns: a node is not started when even at twice the measured
    peak it would end past the job's deadline; a node that took longer than its counted work allows (at
    MIN_EFFICIENCY, plus a floor) stops the run at the next node."""
    from types import SimpleNamespace

    from gpunet.worker.executor import child

    now = [100.0]
    monkeypatch.setattr(child, "time", SimpleNamespace(monotonic=lambda: now[0]))
    steps = [SimpleNamespace(name=n, op="aten.mm.default") for n in ("a", "b", "c")]
    tflops = 1.0  # 2e12 FLOPs/s at best, 5e8 at MIN_EFFICIENCY
    pacer = child.Pacer(steps, [10**9, 10**9, 10**13], tflops, deadline=102.0 + cost.NODE_FLOOR_SECONDS)
    pacer(0)  # 0.5 ms at best: started
    now[0] += 0.5 + cost.NODE_FLOOR_SECONDS  # within the floor + 1e9 / 5e8 s
    pacer(1)
    now[0] += 0.1
    with pytest.raises(JobTimeout, match=r"node 'c' .* needs at least 5 s .* stopped before it ran"):
        pacer(2)  # 1e13 FLOPs need 5 s at best; 1.4 s are left
    pacer = child.Pacer(steps, [10**9, 10**9, 10], tflops, deadline=1000.0)
    pacer(0)
    now[0] += cost.NODE_FLOOR_SECONDS + 2.1  # past the floor + 1e9 / 5e8 s
    with pytest.raises(JobTimeout, match=r"node 'a' .* ran [0-9.]+ s; its counted work .* allows [0-9.]+ s"):
        pacer(1)
    pacer = child.Pacer(steps, [10**9, 10**9, 10], tflops, deadline=1000.0, overrun=False)  # a GPU: queued kernels
    pacer(0)
    now[0] += 100
    pacer(1)


def test_a_session_steps_executor_marks_come_back_in_order_within_the_call(ex):
    """What a step's trace is built from (gpunet.worker.steptrace): the executor's marks, on the caller's clock
    (CLOCK_MONOTONIC), in order, within the call, and the compute between them is the wall time billed."""
    stepper = Job.from_module(SlowCounter(), (torch.randn(64, 64), torch.zeros(1, 1)), state=1)
    x = stepper.encode_step_inputs(torch.randn(64, 64))

    async def steps():
        marks = []
        for step in range(2):
            before = time.monotonic_ns()
            result = await ex.run(stepper.program_hash, stepper.to_bytes() if step == 0 else None, x, 60,
                                  session=SessionRun("T/s", step, fresh=True, room=1 << 20))
            marks.append((before, result, time.monotonic_ns()))
        plain = await ex.run(SMALL.program_hash, SMALL.program_bytes(), SMALL.encode_inputs(torch.randn(2, 16)), 60)
        return marks, plain

    marks, plain = asyncio.run(steps())
    for before, result, after in marks:
        received, began, ended, replied = result.marks
        assert before < received <= began < ended <= replied < after
        assert (ended - began) / 1e9 == pytest.approx(result.wall_time, abs=1e-6)
    assert plain.marks == ()  # only session steps carry them


def test_the_fork_server_stops_when_the_worker_leaves_and_a_later_pool_starts_a_fresh_one(tmp_path):
    """A leaving worker stops its executors' fork server at once (not once every process that inherited its way in has
    gone), and one started after that in the same process works."""
    from gpunet.worker.executor import forkserver

    forkserver.start_forkserver()
    with Executor(processes=1, cache_dir=tmp_path / "a") as ex:
        _run(ex, SMALL, torch.randn(1, 16))
        server = parent_pid(ex.pids()[0])
    forkserver.stop_forkserver()
    assert not os.path.exists(f"/proc/{server}")  # gone and reaped
    with Executor(processes=1, cache_dir=tmp_path / "b") as ex:
        _run(ex, SMALL, torch.randn(1, 16))
        assert parent_pid(ex.pids()[0]) not in (server, os.getpid())


def test_executors_outlive_a_dead_fork_server_and_are_still_tracked_and_killed(tmp_path):
    """The server's death (an OOM kill, a stray signal) ends the pipes it reports its children's ends on ("exit code
    255" for each, alive or not); the pool follows each executor itself, so one still running serves on, and a kill
    (a timeout's, a cancel's) still reaches it."""
    from gpunet.worker.executor import forkserver

    with Executor(processes=1, cache_dir=tmp_path) as ex:
        _run(ex, SMALL, torch.randn(1, 16))
        pid = ex.pids()[0]
        server = parent_pid(pid)
        os.kill(server, signal.SIGKILL)
        wait_for(lambda: parent_pid(pid) != server, 10, "the executor to outlive its fork server")
        x = torch.randn(3, 16)
        assert torch.equal(SMALL.decode_outputs(_run(ex, SMALL, x).outputs), SMALL.run_locally(x))
        assert ex.pids() == [pid]  # the same process served it
        ex._slots[0].kill()
        wait_for(lambda: not process_alive(pid), 10, "the kill to reach the executor")
    forkserver.stop_forkserver()  # (reaps the dead one; the next pool starts a fresh server)


def test_a_spare_handed_to_a_slot_the_closing_pool_stopped_is_given_back_to_be_reaped(tmp_path):
    """The pool closes in another thread (the worker leaving) while a job's coroutine swaps the warm spare into a dead
    executor's slot: a slot already stopped keeps no process, so the spare is handed back and reaped, not leaked."""
    from gpunet.worker.executor.slot import Slot, reap

    with Executor(processes=1, cache_dir=tmp_path) as ex:
        slot = ex._slots[0]
        spare = Slot(ex._ctx, ex._config)
        slot.stop()
        proc, conn = slot.take_over(spare)
        assert proc is spare.proc and slot.proc is not spare.proc
        reap(proc, conn)
        assert not process_alive(spare.proc.pid) and spare.proc.sentinel is None
