"""A churn soak: workers SIGKILLed and restarted at random while a client maps jobs over them.

What must hold whatever dies when: every job returns exactly once and correctly, nothing is paid twice, every ledger
verifies, and a worker that is never killed does not grow in memory. ``tests/test_soak.py`` runs a bounded version
(5 workers, 1,000 jobs); ``scripts/soak.py`` runs longer ones and prints the figures.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpunet.ledger.store import LEDGER_FILENAME, Ledger
from gpunet.testing.localnet import LocalNetwork, Proc, wait_for


#: Seconds the workers get to exit after SIGTERM at the end: a drain (at most --drain-timeout, 30 s) and then leaving.
STOP_LIMIT = 60.0


@dataclass
class SoakReport:
    workers: int
    jobs: int
    seconds: float = 0.0
    kills: int = 0
    slow_exits: int = 0  # killed workers whose other processes took over 30 s to follow (then SIGKILLed)
    wrong: int = 0  # results that differ from running the model locally
    missing: int = 0  # jobs that did not come back
    paid_twice: int = 0  # job ids countersigned by more than one worker
    client_receipts: int = 0
    ledgers_verified: int = 0
    ledger_errors: list[str] = field(default_factory=list)
    steady_rss_mb: tuple[float, float] = (0.0, 0.0)  # the never-killed worker: after warm-up, at the end
    slowest_stop: float = 0.0  # seconds the slowest worker took to exit after SIGTERM at the end
    stuck: list[str] = field(default_factory=list)  # workers still running STOP_LIMIT s after SIGTERM: their log tails

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.missing or self.paid_twice or self.ledger_errors or self.stuck)

    def as_dict(self) -> dict:
        return {**self.__dict__, "ok": self.ok}


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    return model


def soak(root: Path, workers: int = 5, jobs: int = 1000, kill_every: tuple[float, float] = (0.3, 1.5),
         seed: int = 0, log=print, min_kills: int = 0) -> SoakReport:
    """Run one soak under ``root`` (everything it starts is stopped before it returns). ``min_kills``: map the jobs
    again (up to 10 rounds) until at least this many workers were killed during the maps (on a fast machine 1,000
    tiny jobs take a few seconds: the churn must really happen); ``report.jobs`` counts every job mapped."""
    import gpunet

    rng = random.Random(seed)
    report = SoakReport(workers, jobs)
    model = _model()
    job = gpunet.Job.from_module(model, (torch.randn(4, 16),),
                                 dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=64)},))
    inputs = [torch.randn(1 + i % 8, 16) for i in range(jobs)]
    with LocalNetwork(root, network="gpunet-soak", heartbeat=1.0) as net:
        net.start_bootstrap()
        steady, *others = net.start_workers(workers)
        live: dict[Path, Proc] = {p.data_dir: p for p in others}
        stop = threading.Event()

        restarting: set[Path] = set()
        lock = threading.Lock()

        def restart(victim: Proc) -> None:
            try:  # its DHT process and daemon follow it within a second or two; then the same identity comes back
                try:
                    wait_for(lambda: not victim.group_alive(), 30, f"{victim.name}'s processes to exit")
                except TimeoutError:  # an executor still importing torch on a loaded machine: ours to stop
                    report.slow_exits += 1
                    os.killpg(victim.pid, signal.SIGKILL)
                    wait_for(lambda: not victim.group_alive(), 10, f"{victim.name}'s processes to exit")
                fresh = net.start_worker(data_dir=victim.data_dir, wait_online=False)
                with lock:
                    live[victim.data_dir] = fresh
            except Exception as e:  # a restart that fails is a finding, not a reason to stop the soak
                log(f"restart of {victim.name} failed: {e}")
            finally:
                with lock:
                    restarting.discard(victim.data_dir)

        def churn() -> None:
            """Kill a random running worker (never the steady one) and start it again from its data dir."""
            while not stop.wait(rng.uniform(*kill_every)):
                with lock:
                    candidates = sorted(set(live) - restarting)
                    if not candidates:
                        continue
                    victim = live[rng.choice(candidates)]
                    restarting.add(victim.data_dir)
                victim.popen.send_signal(signal.SIGKILL)
                victim.popen.wait(10)
                report.kills += 1
                threading.Thread(target=restart, args=(victim,), daemon=True).start()

        client = gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network, data_dir=root / "client")
        killer = threading.Thread(target=churn, daemon=True)
        try:
            wait_for(lambda: len(client.workers(refresh=True)) == workers, 60, "the client to see every worker")
            warm = list(client.map(job, inputs[:50], progress=False))  # warm-up: the program reaches the workers
            report.steady_rss_mb = (_rss_mb(steady.pid), 0.0)
            started = time.perf_counter()
            killer.start()
            results, sent = [], []
            for _ in range(10):
                sent += inputs
                for i, result in enumerate(client.map(job, inputs, progress=False)):
                    results.append(result)
                    if i % 200 == 199:
                        log(f"{len(results)}/{len(sent)} jobs back, {report.kills} kills so far")
                if report.kills >= min_kills:
                    break
            report.jobs = len(sent)
            report.seconds = time.perf_counter() - started
        finally:
            stop.set()
            killer.join(60)
            wait_for(lambda: not restarting, 60, "restarts in progress to finish")
        report.steady_rss_mb = (report.steady_rss_mb[0], _rss_mb(steady.pid))
        report.missing = report.jobs - len(results)
        with torch.inference_mode():
            report.wrong = sum(not torch.allclose(r, model(x), rtol=1e-5, atol=1e-6) for r, x in zip(results, sent))
        report.wrong += sum(not torch.allclose(r, model(x), rtol=1e-5, atol=1e-6) for r, x in zip(warm, inputs))
        report.client_receipts = sum(1 for _ in client.ledger.receipts())
        try:
            client.ledger.verify()
            report.ledgers_verified += 1
        except Exception as e:
            report.ledger_errors.append(f"client: {e}")
        client.close()
        stopping = time.monotonic()
        for proc in [*live.values(), steady]:
            proc.popen.send_signal(signal.SIGTERM)
        for proc in [*live.values(), steady]:
            try:
                proc.popen.wait(max(0.1, stopping + STOP_LIMIT - time.monotonic()))
            except subprocess.TimeoutExpired:
                report.stuck.append(f"{proc.name} (pid {proc.pid}) still running {STOP_LIMIT:.0f} s after SIGTERM; "
                                    "its last lines:\n" + "\n".join(proc.lines[-40:]))
                proc.popen.kill()
                proc.popen.wait(10)
            report.slowest_stop = max(report.slowest_stop, time.monotonic() - stopping)
        paid_by = Counter()
        for data_dir in sorted({p.data_dir for p in net.workers}):
            try:
                with Ledger(data_dir / LEDGER_FILENAME, create=False, readonly=True) as ledger:
                    ledger.verify()
                    report.ledgers_verified += 1
                    paid_by.update({(r.client_id, r.job_id) for r in ledger.receipts() if r.client_signature})
            except Exception as e:
                report.ledger_errors.append(f"{data_dir.name}: {e}")
        report.paid_twice = sum(1 for n in paid_by.values() if n > 1)
    return report
