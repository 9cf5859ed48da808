#!/usr/bin/env python
"""The market's lanes on one worker, beside their baselines from the same run (docs/market.md).

* interactive latency (submit to result, p50/p99) on a worker kept full of batch work, each interactive job
  preempting one, vs the same jobs on the same worker idle; the target is at most 1.5x idle plus one executor start
  (measured here too: a fresh executor process importing torch);
* batch throughput lost to preemption: batch work finished per second while interactive jobs keep arriving vs the
  same batch stream alone;
* fair share under a flood: the executor time two clients of one lane got while both had work waiting, one sending
  five times as many jobs as the other (equal shares: 50%).

    python scripts/bench_lanes.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet import Requirements  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.workloads import Churn  # noqa: E402


def job_of(k: int) -> gpunet.Job:
    return gpunet.Job.from_module(Churn(k, seed=0).eval(), (torch.randn(4),))


def product_seconds() -> float:
    """One of Churn's 1024x1024 products on this machine with the threads the worker gives a job: the unit the job
    sizes are counted in, so that a "0.8 s batch job" is one on any machine (on a machine 2.5x slower, fixed sizes
    made every batch job outlast the gap between interactive ones: none finished)."""
    from gpunet.worker.hardware import job_threads

    before = torch.get_num_threads()
    torch.set_num_threads(job_threads(None, 1))
    try:
        churn, x = Churn(20, seed=0).eval(), torch.randn(4)
        with torch.no_grad():
            churn(x)  # warm
            t0 = time.perf_counter()
            churn(x)
            return (time.perf_counter() - t0) / churn.k
    finally:
        torch.set_num_threads(before)


def executor_start_seconds() -> tuple[float, float]:
    """A fresh executor, ready for jobs (sandbox applied): what preempting costs at most. Two figures: the first
    executor, whose fork server imports torch (a worker pays that once, as it starts), and one forked by that server
    once warm (a replacement, a spare, a session's own process)."""
    from gpunet.worker.executor import Executor

    async def start() -> float:
        t0 = time.perf_counter()
        with Executor(processes=1) as pool:
            await pool.sandbox_report()  # waits for the process to be ready
            return time.perf_counter() - t0

    return asyncio.run(start()), asyncio.run(start())


def latencies(client, job, n: int, gap: float) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.submit(job, torch.randn(4), requirements=Requirements(timeout=300)).result(timeout=300)
        out.append(time.perf_counter() - t0)
        time.sleep(gap)
    return out


class BatchStream:
    """Keeps ``depth`` batch jobs outstanding on the network until stopped; counts the work that came back."""

    def __init__(self, client, job, depth: int = 2):
        self.client, self.job, self.depth = client, job, depth
        self.done = 0
        self.flops = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "BatchStream":
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        req = Requirements(priority="batch", timeout=600)
        pending = [self.client.submit(self.job, torch.randn(4), requirements=req) for _ in range(self.depth)]
        while not self._stop.is_set():
            for i, f in enumerate(pending):
                if f.done():
                    f.result()  # a batch job that fails is a failed benchmark
                    self.done += 1
                    self.flops += f.receipt.flops
                    pending[i] = self.client.submit(self.job, torch.randn(4), requirements=req)
            time.sleep(0.01)
        for f in pending:
            f.cancel()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.started


def fair_split(net, flood_client, modest_client, job, n_flood: int, n_modest: int) -> dict:
    """Both clients send at once; the executor time each got while both had jobs waiting (from the receipts)."""
    flood = [flood_client.submit(job, torch.randn(4), requirements=Requirements(timeout=600)) for _ in range(n_flood)]
    modest = [modest_client.submit(job, torch.randn(4), requirements=Requirements(timeout=600))
              for _ in range(n_modest)]
    for f in flood + modest:
        f.result(timeout=600)
    both_until = min(max(f.receipt.ended_at_us for f in modest), max(f.receipt.ended_at_us for f in flood))
    both_from = max(min(f.receipt.started_at_us for f in modest), min(f.receipt.started_at_us for f in flood))

    def seconds(futures) -> float:
        return sum(max(0, min(f.receipt.ended_at_us, both_until) - max(f.receipt.started_at_us, both_from))
                   for f in futures) / 1e6

    a, b = seconds(flood), seconds(modest)
    return {"flood_share": a / (a + b), "modest_share": b / (a + b), "overlap_s": (both_until - both_from) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer jobs")
    args = parser.parse_args()
    n = 8 if args.quick else 20
    results: dict = {"benchmark": "lanes", "interactive_jobs": n}
    results["executor_cold_start_s"], results["executor_start_s"] = executor_start_seconds()
    unit = results["product_s"] = product_seconds()
    sizes = {name: max(1, round(seconds / unit)) for name, seconds in (("small", 0.015), ("heavy", 0.8),
                                                                      ("medium", 0.15))}
    results["products_per_job"] = sizes
    with LocalNetwork(network="bench-lanes", heartbeat=2.0) as net:
        bootstrap = net.start_bootstrap()
        net.start_worker("--max-concurrent", "1", "--max-queue", "64", "--price", "2", "--batch-price", "1")
        peers = dict(initial_peers=[bootstrap], network=net.network)
        with gpunet.Client(**peers, data_dir=net.root / "interactive") as people, \
                gpunet.Client(**peers, data_dir=net.root / "batch") as batch, \
                gpunet.Client(**peers, data_dir=net.root / "flood") as flood, \
                gpunet.Client(**peers, data_dir=net.root / "modest") as modest:
            for c in (people, batch, flood, modest):
                wait_for(lambda: c.workers(refresh=True), 60, "the worker")
            # 0.8 s and 0.15 s of work; the small one 15 ms, or one product where that takes longer (23 ms here)
            small, heavy, medium = (job_of(sizes[k]) for k in ("small", "heavy", "medium"))
            for c, j in ((people, small), (batch, heavy), (flood, medium), (modest, medium)):
                c.submit(j, torch.randn(4)).result(timeout=300)  # programs loaded, routing measured
            idle = latencies(people, small, n, gap=0.3)
            with BatchStream(batch, heavy) as alone:
                time.sleep(10 if args.quick else 30)
            with BatchStream(batch, heavy) as shared:
                time.sleep(2)
                busy = latencies(people, small, n, gap=1.0)
            split = fair_split(net, flood, modest, medium, 50 if args.quick else 100, 10 if args.quick else 20)
            preempted = sum(1 for line in net.workers[0].lines if "stopped for an interactive job" in line)
    q = statistics.quantiles
    results.update({
        "idle_p50_ms": statistics.median(idle) * 1e3, "idle_p99_ms": q(idle, n=100)[98] * 1e3,
        "busy_p50_ms": statistics.median(busy) * 1e3, "busy_p99_ms": q(busy, n=100)[98] * 1e3,
        "batch_alone_flops_per_s": alone.flops / alone.seconds,
        "batch_shared_flops_per_s": shared.flops / shared.seconds,
        "preemptions": preempted,
        **split,
    })
    r = results
    r["target_ms"] = 1.5 * r["idle_p50_ms"] + r["executor_start_s"] * 1e3
    r["batch_lost"] = 1 - r["batch_shared_flops_per_s"] / r["batch_alone_flops_per_s"]
    print(f"interactive job on a worker full of batch work: {r['busy_p50_ms']:.0f} ms p50, {r['busy_p99_ms']:.0f} ms "
          f"p99 | idle worker {r['idle_p50_ms']:.0f} ms p50, {r['idle_p99_ms']:.0f} ms p99; one executor start "
          f"{r['executor_start_s'] * 1e3:.0f} ms from the warm fork server ({r['executor_cold_start_s'] * 1e3:.0f} ms "
          f"the first, importing torch) (target p50 <= {r['target_ms']:.0f} ms)")
    print(f"batch throughput with interactive jobs arriving: {r['batch_shared_flops_per_s'] / 1e9:.1f} GFLOP/s | "
          f"alone {r['batch_alone_flops_per_s'] / 1e9:.1f} GFLOP/s ({r['batch_lost'] * 100:.0f}% lost; "
          f"{r['preemptions']} preemptions)")
    print(f"fair share under a flood (5x the jobs): flooding client {r['flood_share'] * 100:.0f}%, modest client "
          f"{r['modest_share'] * 100:.0f}% of the executor time over {r['overlap_s']:.1f} s both had work waiting "
          f"| equal shares: 50%")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
