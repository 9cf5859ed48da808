"""The owner comes first, on a real swarm: pause and resume by hand, while the owner uses the GPU (a fake GPU probe:
this machine has none) or runs hot, and while real load from others keeps a CPU worker's machine busy."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from gpunet import Requirements
from gpunet.ledger import open_ledger
from tests.swarm import free_port, run_cli, wait_for
from tests.test_market import lane_jobs, spin_job

pytestmark = pytest.mark.swarm


def wait_state(swarm, proc, state: str, timeout: float = 45) -> str | None:
    """Wait until ``gpunet status`` shows the worker in ``state``; returns its pause reason."""
    status = swarm.wait_for_status(lambda s: any(w["id"] == proc.id and w["state"] == state for w in s["workers"]),
                                   f"the worker to be {state}", timeout=timeout)
    return next(w for w in status["workers"] if w["id"] == proc.id).get("pause_reason")


def test_pause_and_resume_by_hand_send_jobs_elsewhere_meanwhile(swarm, client_for):
    mine, other = swarm.start_workers(2)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    paused = run_cli("worker", "pause", "--data-dir", str(mine.data_dir), "--reason", "gaming tonight")
    assert paused.returncode == 0 and f"Paused the worker of {mine.data_dir} (pid {mine.pid})" in paused.stdout
    assert wait_state(swarm, mine, "paused") == "its owner paused it: gaming tonight"
    model, job, x = spin_job(8, k=2)
    wait_for(lambda: all(w.record.state.value != "online" for w in client.workers(refresh=True) if w.id == mine.id),
             30, "the client to see it paused")
    futures = [client.submit(job, x) for _ in range(6)]
    assert {f.result(timeout=120) is not None and f.worker_id for f in futures} == {other.id}
    assert run_cli("worker", "resume", "--data-dir", str(mine.data_dir)).returncode == 0
    wait_state(swarm, mine, "online")
    assert "Paused: its owner paused it: gaming tonight" in mine.output and "Resumed" in mine.output


def test_a_gpu_the_owner_uses_or_that_runs_hot_pauses_the_worker_and_its_job_completes_elsewhere(swarm, client_for,
                                                                                                   tmp_path):
    gpu = tmp_path / "gpu.json"  # FAKE HARDWARE: what NVML would say of the GPU
    port = free_port()
    mine = swarm.start_worker("--fake-gpu-probe", str(gpu), "--pause-when-busy", "--resume-after", "2",
                              "--max-temperature", "85", "--pause-grace", "1", "--price", "0.5",
                              "--metrics-port", str(port))
    other = swarm.start_worker("--price", "2")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    model, job, x = spin_job(4096, k=192)  # 16 s on an AVX-512 core: running when the owner comes back
    running = client.submit(job, x, requirements=Requirements(prefer="cheapest", timeout=300))
    wait_for(lambda: lane_jobs(port, "interactive", "running") == 1, 120, "the job to run on `mine`")
    gpu.write_text(json.dumps({"other_gpu_processes": 1}))  # a game starts
    assert "using the GPU" in wait_state(swarm, mine, "paused")
    with torch.no_grad():
        assert torch.allclose(running.result(timeout=300), model(x), atol=1e-4)
    assert running.attempts[0] == mine.id and running.worker_id == other.id  # stopped after the grace, run elsewhere
    gpu.write_text(json.dumps({"other_gpu_processes": 0}))  # the game quits: back after --resume-after
    wait_state(swarm, mine, "online")
    gpu.write_text(json.dumps({"temperature": 95}))
    assert "too hot" in wait_state(swarm, mine, "paused")
    gpu.write_text(json.dumps({"temperature": 70}))
    wait_state(swarm, mine, "online")
    assert mine.terminate() == 0
    with open_ledger(mine.data_dir) as ledger:  # the stopped job is on the books as unbilled, and why
        notes = [n for n in ledger.unbilled() if n.job_id == running.receipt.job_id]
        assert [n.reason for n in notes] == ["paused"] and "using the GPU" in notes[0].detail


def ready_state(proc) -> str | None:
    """The state a worker last announced, from its ready file: reading it costs the machine nothing (`gpunet status`
    would be load of its own on a CPU worker that watches the load)."""
    info = proc.read_ready()
    return info["state"] if info else None


@pytest.mark.exclusive  # another test's processes would keep the machine busy too
def test_a_cpu_worker_pauses_while_other_processes_keep_the_machine_busy(swarm):
    mine = swarm.start_worker("--pause-when-busy", "--resume-after", "2")
    wait_for(lambda: ready_state(mine) == "online", 60, "the worker to settle online")
    burners = []
    try:
        for _ in range(os.cpu_count() or 1):  # real load, from processes that are not the worker's
            out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                                 capture_output=True, text=True, check=True)
            burners.append(int(out.stdout))
        wait_for(lambda: ready_state(mine) == "paused", 60, "the worker to pause")
    finally:
        for pid in burners:
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ready_state(mine) == "online", 60, "the worker to resume")
    assert "Paused: the owner is using the machine" in mine.output
