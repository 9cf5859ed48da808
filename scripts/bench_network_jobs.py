#!/usr/bin/env python
"""Jobs through a real local network, each figure beside its baseline from the same run.

* tiny job round trip (warm program, ~1 KB in and out): p50/p99 through ``Client.submit`` vs hivemind's raw unary
  RPC between the same two processes (the worker's ping handler echoing 1 KB), and vs a Ray task if Ray is installed;
* jobs/s with 32 jobs in flight to one worker; 64 in flight to a worker with default settings, beside Client.map;
* bulk input (64 and 256 MiB) MB/s vs raw loopback TCP between two processes;
* a compute-bound job (seconds of matmuls): network wall time vs the same computation run locally.

    python scripts/bench_network_jobs.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import json
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet.testing import LocalNetwork  # noqa: E402
from gpunet.utils import UVLOOP_ENV  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tiny_job() -> gpunet.Job:
    return gpunet.Job.from_function(lambda x: x * 2 + 1, (torch.randn(256),))  # 1 KB in, 1 KB out


def bench_tiny(client: gpunet.Client, worker_id: str, network: str, n: int, block: int = 50) -> dict:
    """Back-to-back jobs and back-to-back raw RPCs, in alternating blocks of ``block``: each is measured in its steady
    state, and slow swings in machine noise (large here) hit both figures alike."""
    job = tiny_job()
    x = torch.randn(256)
    payload = b"x" * 1024
    rpc = client._core.transport.rpc  # the client's own hivemind p2p connection

    async def raw_rpcs(count: int) -> list[float]:  # timed on the client's loop: no thread hop in the baseline
        out = []
        for _ in range(count):
            t0 = time.perf_counter()
            await rpc.ping(worker_id, payload)  # one unary hivemind RPC carrying 1 KB each way
            out.append(time.perf_counter() - t0)
        return out

    for _ in range(20):
        client.submit(job, x).result()
    asyncio.run_coroutine_threadsafe(raw_rpcs(20), client._loop).result()
    times, raw = [], []
    for start in range(0, n, block):
        for _ in range(min(block, n - start)):
            t0 = time.perf_counter()
            client.submit(job, x).result()
            times.append(time.perf_counter() - t0)
        raw += asyncio.run_coroutine_threadsafe(raw_rpcs(min(block, n - start)), client._loop).result()
    return {
        "gpunet_p50_ms": statistics.median(times) * 1e3,
        "gpunet_p99_ms": percentile(times, 0.99) * 1e3,
        "raw_rpc_p50_ms": statistics.median(raw) * 1e3,
        "raw_rpc_p99_ms": percentile(raw, 0.99) * 1e3,
    }


def bench_ray(n: int) -> dict | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def f(x):
            return x * 2 + 1

        x = torch.randn(256)
        for _ in range(20):
            ray.get(f.remote(x))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            ray.get(f.remote(x))
            times.append(time.perf_counter() - t0)
        return {"ray_p50_ms": statistics.median(times) * 1e3, "ray_p99_ms": percentile(times, 0.99) * 1e3}
    finally:
        ray.shutdown()


def bench_throughput(client: gpunet.Client, n: int, in_flight: int = 32) -> dict:
    job = tiny_job()
    x = torch.randn(256)
    client.submit(job, x).result()
    t0 = time.perf_counter()
    pending = []
    done = 0
    for _ in range(n):
        pending.append(client.submit(job, x))
        if len(pending) >= in_flight:
            pending.pop(0).result()
            done += 1
    for f in pending:
        f.result()
    return {"jobs_per_s": n / (time.perf_counter() - t0), "in_flight": in_flight}


def bench_default_worker(n: int, in_flight: int = 64) -> dict:
    """Tiny jobs against a worker with default settings (one job running, 8 queued): ``in_flight`` submits at once,
    beside ``Client.map`` over the same jobs on the same worker (which keeps its own window). A client's burst must
    wait on the client for room, not be answered "busy" and back off (it ran at a sixth of map's rate)."""
    with LocalNetwork(network="bench-jobs-default", heartbeat=5.0) as net:
        bootstrap = net.start_bootstrap()
        net.start_worker()
        with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
            burst = bench_throughput(client, n, in_flight)
            job, x = tiny_job(), torch.randn(256)
            t0 = time.perf_counter()
            for _ in client.map(job, [x] * n, progress=False):
                pass
            return {"submit_jobs_per_s": burst["jobs_per_s"], "in_flight": in_flight,
                    "map_jobs_per_s": n / (time.perf_counter() - t0)}


def _tcp_sink(port_queue, nbytes: int) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    got = 0
    buf = bytearray(1 << 20)
    while got < nbytes:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()


def raw_tcp_mb_s(nbytes: int) -> float:
    """Loopback TCP between two processes, the same bytes as the job's input: the transport's physical limit here."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_sink, args=(q, nbytes))
    p.start()
    try:
        port = q.get(timeout=30)
        data = memoryview(bytearray(nbytes))
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0 = time.perf_counter()
            s.sendall(data)
            s.recv(1)
            return nbytes / (time.perf_counter() - t0) / 1e6
    finally:
        p.join(30)


def bench_bulk(client: gpunet.Client, mib: int) -> dict:
    n = mib * 2**20 // 4
    job = gpunet.Job.from_function(lambda x: x[:4] * 1.0, (torch.randn(n),))
    x = torch.randn(n)
    client.submit(job, torch.randn(n)).result()  # program cached, executors warm
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        f = client.submit(job, x, requirements=gpunet.Requirements(timeout=600))
        f.result()
        best = max(best, f.bytes_sent / (time.perf_counter() - t0) / 1e6)
    return {"mib": mib, "gpunet_mb_s": best, "raw_tcp_mb_s": raw_tcp_mb_s(mib * 2**20)}


def bench_program_once(client: gpunet.Client, jobs: int = 30, n: int = 3700) -> dict:
    """``jobs`` jobs of one cold 55 MB program submitted at once: how many copies of the program cross to the worker
    (each job would carry one without single-flight uploads), and when the first answer comes back."""
    torch.manual_seed(0)
    job = gpunet.Job.from_module(torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.ReLU()), (torch.randn(2, n),))
    program = len(job.program_bytes())
    xs = [torch.randn(2, n) for _ in range(jobs)]
    t0 = time.perf_counter()
    futures = [client.submit(job, x, requirements=gpunet.Requirements(timeout=600)) for x in xs]
    first = None
    for f in concurrent.futures.as_completed(futures):
        f.result()
        first = first or time.perf_counter() - t0
    everything = time.perf_counter() - t0
    sent = sum(f.bytes_sent for f in futures) - jobs * len(job.encode_inputs(xs[0]))
    return {"jobs": jobs, "program_mb": program / 1e6, "copies_sent": sent / program, "first_answer_s": first,
            "all_answers_s": everything, "raw_tcp_one_copy_s": program / (raw_tcp_mb_s(program) * 1e6)}


class Heavy(torch.nn.Module):
    """A few seconds of matmuls on one CPU thread: 8 weight matrices applied 15 times (120 matmuls, ~260 GFLOP)."""

    def __init__(self, n=1024, steps=8, reps=15):
        super().__init__()
        self.reps = reps
        self.w = torch.nn.Parameter(torch.randn(steps, n, n) / n**0.5)

    def forward(self, x):
        for _ in range(self.reps):
            for w in self.w:
                x = torch.tanh(x @ w)
        return x


def bench_compute(client: gpunet.Client, threads: int) -> dict:
    model = Heavy()
    x = torch.randn(1024, 1024)
    job = gpunet.Job.from_module(model, (x,))
    client.submit(job, x).result()  # program cached on a worker, executor warm
    t0 = time.perf_counter()
    client.submit(job, x, requirements=gpunet.Requirements(timeout=600)).result()
    network = time.perf_counter() - t0
    torch.set_num_threads(threads)  # the worker's executor uses this many threads too
    with torch.no_grad():
        model(x)
        t0 = time.perf_counter()
        model(x)
        local = time.perf_counter() - t0
    return {"network_s": network, "local_s": local, "efficiency": local / network,
            "gflop": job.estimate(x).flops / 1e9}


def bench_small_jobs_on_asyncio(n: int) -> dict:
    """The tiny-job figures with gpunet's own event loops (worker, client) on asyncio's loop instead of uvloop, on a
    network of its own started just for it: the baseline that tells whether uvloop earns its place."""
    os.environ[UVLOOP_ENV] = "0"  # read by the worker processes started below and by the client's loop
    try:
        with LocalNetwork(network="bench-jobs-asyncio", heartbeat=5.0) as net:
            bootstrap = net.start_bootstrap()
            worker = net.start_worker("--max-concurrent", "2", "--max-queue", "64")
            with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
                assert not type(client._loop).__module__.startswith("uvloop")
                return {"tiny": bench_tiny(client, net.worker_id(worker), net.network, n),
                        "throughput": bench_throughput(client, 5 * n)}
    finally:
        del os.environ[UVLOOP_ENV]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, 64 MiB only")
    args = parser.parse_args()
    n = 100 if args.quick else 300
    results: dict = {"benchmark": "network_jobs"}
    results["asyncio_loop"] = plain = bench_small_jobs_on_asyncio(n)
    print(f"standard asyncio event loops (GPUNET_UVLOOP=0): tiny job p50 {plain['tiny']['gpunet_p50_ms']:.2f} ms "
          f"(raw RPC {plain['tiny']['raw_rpc_p50_ms']:.2f} ms); 32 in flight {plain['throughput']['jobs_per_s']:.0f} "
          "jobs/s", flush=True)
    with LocalNetwork(network="bench-jobs", heartbeat=5.0) as net:
        bootstrap = net.start_bootstrap()
        worker = net.start_worker("--max-concurrent", "2", "--max-queue", "64")
        worker_id = net.worker_id(worker)
        with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
            results["tiny"] = tiny = bench_tiny(client, worker_id, net.network, n)
            print(f"tiny job round trip: p50 {tiny['gpunet_p50_ms']:.2f} ms, p99 {tiny['gpunet_p99_ms']:.2f} ms | "
                  f"raw hivemind unary RPC: p50 {tiny['raw_rpc_p50_ms']:.2f} ms, p99 {tiny['raw_rpc_p99_ms']:.2f} ms "
                  f"({tiny['gpunet_p50_ms'] / tiny['raw_rpc_p50_ms']:.1f}x)", flush=True)
            results["throughput"] = tp = bench_throughput(client, 5 * n)
            print(f"32 tiny jobs in flight, one worker: {tp['jobs_per_s']:.0f} jobs/s", flush=True)
            results["bulk"] = []
            for mib in ([64] if args.quick else [64, 256]):
                bulk = bench_bulk(client, mib)
                results["bulk"].append(bulk)
                print(f"bulk input {mib} MiB: {bulk['gpunet_mb_s']:.0f} MB/s | raw loopback TCP "
                      f"{bulk['raw_tcp_mb_s']:.0f} MB/s", flush=True)
            results["program_once"] = once = bench_program_once(client)
            print(f"{once['jobs']} jobs of a cold {once['program_mb']:.0f} MB program at once: {once['copies_sent']:.2f} "
                  f"copies sent, first answer {once['first_answer_s']:.2f} s, all {once['all_answers_s']:.2f} s | "
                  f"raw loopback TCP, one copy: {once['raw_tcp_one_copy_s']:.2f} s", flush=True)
            results["compute"] = c = bench_compute(client, threads=1)
            print(f"compute-bound job ({c['gflop']:.0f} GFLOP): network {c['network_s']:.2f} s | local "
                  f"{c['local_s']:.2f} s (efficiency {c['efficiency'] * 100:.0f}%)", flush=True)
    results["default_worker"] = dw = bench_default_worker(3 * n)
    print(f"a default worker (--max-queue 8), {dw['in_flight']} submits in flight: {dw['submit_jobs_per_s']:.0f} "
          f"jobs/s | Client.map on the same worker: {dw['map_jobs_per_s']:.0f} jobs/s", flush=True)
    ray = bench_ray(n)
    results["ray"] = ray
    print("ray: not installed (pip install ray to compare)" if ray is None else
          f"ray task round trip: p50 {ray['ray_p50_ms']:.2f} ms, p99 {ray['ray_p99_ms']:.2f} ms", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
