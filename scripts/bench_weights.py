#!/usr/bin/env python
"""Cold starts of a big program: from the client vs from peers, on a real local network, in one run.

A program of about ``--gb`` GiB of fp32 weights (Linear layers, one input row: the run itself is short, so the time
is the program's getting there and loading). In order:

1. worker A, cold, gets it **from the client** (nobody holds it yet): the baseline;
2. worker B joins; a job with redundancy 2 runs on A (warm) and B (cold): B fetches it **from one peer** (A);
3. worker C joins; redundancy 3: C fetches it **from two peers** (A and B) in parallel.
4. (a second network) the same weights **by reference** (docs/weights.md): the program names each weight by its
   hash; a worker that keeps the checkpoint in its ``--models-dir`` loads them from its disk (the client sends no
   weight byte), and a worker without it is sent them by the client.
6. (a fourth network, ``--parts spans``) a **span-only fetch**: a Llama checkpoint folder (about 300 MB of
   decoder layers) served by ``causal_lm`` over three spans on three workers that do not keep it; each worker
   receives only its span's weights (about a third), and the client sends the layers once in all.
7. (no network, ``--parts client``) **the client's memory**: a Llama checkpoint folder (about 600 MB of decoder
   layers) opened by ``causal_lm``'s engine in a fresh process, loaded whole and traced (the old way), opened thin
   (the layers traced from stand-ins, never read), and from a slim folder (``gpunet checkpoint slim``); each
   process's peak RSS beside one that only imports the same libraries, and the slim folder's size on disk. Also
   the time to open it thin after another checkpoint of the same architecture in the same process (the spans'
   graphs reused: gpunet.job.trace.trace_alike) against the fresh process's.
5. (a third network) a **cold start of many workers at once** (``--cold-workers``, default 10): four jobs per worker
   sent together; the client's copies (target <= 1.2), the time until every worker has run one against one copy's
   transfer over raw loopback TCP (target <= 1.5x where links, not CPUs, are the limit), and each worker's bytes.

Each figure is the client's wall time for that job (a redundant job ends with its slowest replica, the cold one).
Also printed: loopback TCP throughput for the same bytes in this process (the link's own ceiling), and the program
bytes the client uploaded in all (target: exactly one copy). Targets: from a peer no slower than from the client;
from two peers faster than from one. On one machine every link is loopback, so the second peer adds no bandwidth
the first lacked: expect "two peers" to be about "one peer" here, and to win only where peers' uplinks are the limit.

    python scripts/bench_weights.py [--gb 1.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.localnet import executor_pids  # noqa: E402

WIDTH = 4096


def loopback_mb_per_s(nbytes: int) -> float:
    """Raw TCP over 127.0.0.1 in this process: the ceiling for any transfer here."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sink():
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    block = bytes(1 << 20)
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        for _ in range(nbytes // len(block)):
            c.sendall(block)
    thread.join()
    server.close()
    return nbytes / (time.perf_counter() - t0) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="program size in GiB (default 1)")
    parser.add_argument("--cold-workers", type=int, default=10, help="workers of the cold start (default 10)")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="part 5 in a lab of hosts on links of this many Mbit/s up and down (needs root, ip and "
                             "tc; default: loopback)")
    parser.add_argument("--parts", default="peers,reference,cold,spans,client",
                        help="which parts to run, of peers (1-3), reference (4), cold (5), spans (6), client (7); "
                             "default all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    layers = max(1, round(args.gb * 2**30 / (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))).eval()
    x = torch.randn(1, WIDTH)
    job = gpunet.Job.from_module(model, example_inputs=(x,))
    size = len(job.program_bytes())
    model_state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del model
    figures: dict = {"program_bytes": size, "loopback_tcp_mb_s": round(loopback_mb_per_s(size), 1)}
    if "peers" in parts:
        figures.update(from_peers(job, x))
    if "reference" in parts:
        figures.update(by_reference(model_state, x, job))
    if "cold" in parts:
        figures.update(cold_start(job, x, args.cold_workers, figures["loopback_tcp_mb_s"], args.link_mbit))
    if "spans" in parts:
        figures.update(span_only())
    if "client" in parts:
        figures.update(client_memory())
    if args.json:
        print(json.dumps(figures))
        return
    mb = size / 1e6
    print(f"program: {mb:.0f} MB; loopback TCP in this process: {figures['loopback_tcp_mb_s']:.0f} MB/s")
    if "peers" in parts:
        print(f"cold start from the client:  {figures['from_client_s']:.2f} s  ({mb / figures['from_client_s']:.0f} MB/s)")
        print(f"cold start from one peer:    {figures['from_one_peer_s']:.2f} s  "
              f"({figures['one_peer_vs_client']:.2f}x the client's; target <= 1)")
        print(f"cold start from two peers:   {figures['from_two_peers_s']:.2f} s  "
              f"({figures['two_peers_vs_one']:.2f}x one peer's; target < 1 where peers' uplinks are the limit)")
        for name in ("one_peer", "two_peers"):
            if figures[f"fetch_{name}_s"] is not None:
                print(f"  the fetch itself ({name.replace('_', ' ')}): {figures[f'fetch_{name}_s']:.2f} s from "
                      f"{figures[f'fetch_{name}_sources']} peer(s) ({mb / figures[f'fetch_{name}_s']:.0f} MB/s)")
        print(f"client uploaded the program {figures['client_uploads']:g} time(s) (target: 1)")
    if "reference" in parts:
        print(f"by reference, a worker with the checkpoint in --models-dir: {figures['ref_from_disk_s']:.2f} s, "
              f"{figures['ref_from_disk_weight_bytes']} weight bytes from the client (target 0)")
        print(f"by reference, a worker without it: {figures['ref_from_client_s']:.2f} s, "
              f"{figures['ref_from_client_weight_bytes'] / 1e6:.0f} MB of weights from the client")
    if "cold" in parts:
        print(f"cold start of {figures['cold_workers']} workers at once ({figures['cold_jobs']} jobs): the client sent "
              f"{figures['cold_client_copies']:.2f} copies (target <= 1.2); all had run one in {figures['cold_all_s']:.1f} s, "
              f"{figures['cold_vs_one_copy']:.1f}x one copy over raw "
              + (f"TCP on one {args.link_mbit:g} Mbit/s link" if args.link_mbit else "loopback TCP")
              + f" ({figures['cold_one_copy_s']:.2f} s)")
        if "cold_longest_fetch_s" in figures:
            print(f"  the longest fetch from peers took {figures['cold_longest_fetch_s']:.1f} s "
                  f"({figures['cold_longest_fetch_s'] / figures['cold_one_copy_s']:.2f}x one copy); the worker that "
                  f"served most served {figures['cold_most_served_copies']:.2f} copies"
                  + (f"; the cores were {figures['cold_cpu_busy']:.0%} busy" if "cold_cpu_busy" in figures else ""))
        for worker, b in figures["cold_per_worker"].items():
            print(f"  {worker}: fetched {b['fetched'] / 1e6:.0f} MB from peers"
                  + (f" in {b['fetch_s']:.1f} s" if "fetch_s" in b else "") + f", served {b['served'] / 1e6:.0f} MB"
                  + f"; peak RSS {b['peak_rss_mb']} MB, its biggest executor's {b.get('executor_peak_rss_mb')} MB, "
                  f"anonymous memory now {b.get('anon_now_mb')} MB")
    if "spans" in parts:
        layers = figures["spans_layer_bytes"]
        print(f"span-only fetch: {layers / 1e6:.0f} MB of decoder layers over 3 spans; the client sent "
              f"{figures['spans_client_weight_bytes'] / layers:.2f} copies of them; each worker received "
              + ", ".join(f"{b / layers:.2f}" for b in figures["spans_per_worker"]) + " of them")
    if "client" in parts:
        base = figures["client_import_only_rss_mb"]
        print(f"the client's memory for {figures['client_layer_bytes'] / 1e6:.0f} MB of decoder layers (peak RSS "
              f"over a process that only imports, {base:.0f} MB):")
        for how in ("whole", "thin", "slim"):
            print(f"  {how}: +{figures[f'client_{how}_rss_mb'] - base:.0f} MB, opened and traced in "
                  f"{figures[f'client_{how}_s']:.1f} s")
        print(f"  thin, after another checkpoint of the same architecture in the same process (its spans' graphs "
              f"reused): opened in {figures['client_again_s']:.1f} s")
        print(f"  the slim folder: {figures['client_slim_folder_bytes'] / 1e6:.1f} MB on disk")


#: Part 7's child: opens a folder as causal_lm's engine does and prints its peak RSS (MB) and the time it took.
_OPEN = """
import json, sys, time
import torch, transformers
from gpunet.client.llm.engine import CausalLMCore
class NoWorkers:
    data_dir = None
    def workers(self):
        return []
if sys.argv[1] == "again":  # another checkpoint of the same architecture opened before: its spans' graphs reused
    CausalLMCore.open(NoWorkers(), sys.argv[3], max_length=64, spans=3)
t0 = time.perf_counter()
if sys.argv[1] != "import":
    CausalLMCore.open(NoWorkers(), sys.argv[2], max_length=64, spans=3, by_reference=sys.argv[1] != "whole")
# (VmHWM, not ru_maxrss: Linux keeps the latter across exec, so it would count the parent's memory at the fork.)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rss_mb": peak / 1024, "s": time.perf_counter() - t0}))
"""


def client_memory() -> dict:
    """Part 7: the client's peak memory opening one checkpoint whole, thin and slim (fresh processes)."""
    import subprocess

    from gpunet.client.llm.skeleton import slim
    from gpunet.job.checkpoints import read_header
    from gpunet.testing.llm import save_checkpoint

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_checkpoint(Path(tmp) / "ckpt", "llama", seed=0, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16)
        slim(folder, Path(tmp) / "slim")
        out["client_layer_bytes"] = sum(length for name, _, _, _, length in read_header(folder / "model.safetensors")
                                        if ".layers." in name)
        out["client_slim_folder_bytes"] = sum(p.stat().st_size for p in (Path(tmp) / "slim").iterdir())
        other = save_checkpoint(Path(tmp) / "other", "llama", seed=1, hidden_size=1024, intermediate_size=2816,
                                num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16)
        for how, path in (("import", folder), ("whole", folder), ("thin", folder), ("slim", Path(tmp) / "slim"),
                          ("again", folder)):
            done = subprocess.run([sys.executable, "-c", _OPEN, how, str(path), str(other)], capture_output=True,
                                  text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            key = "client_import_only" if how == "import" else f"client_{how}"
            out[f"{key}_rss_mb"], out[f"{key}_s"] = round(got["rss_mb"], 1), round(got["s"], 2)
    return out


def span_only() -> dict:
    """Part 6: a checkpoint folder over three spans on three bare workers: what each worker receives."""
    from gpunet.job.checkpoints import read_header
    from gpunet.testing.llm import save_checkpoint

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, LocalNetwork(Path(tmp), network="bench-weights-spans",
                                                            heartbeat=2.0) as net:
        folder = save_checkpoint(Path(tmp) / "ckpt", "llama", seed=0, hidden_size=1024, intermediate_size=2816,
                                 num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16)
        net.start_bootstrap()
        procs = net.start_workers(3)
        with gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network, data_dir=Path(tmp) / "client") \
                as client:
            wait_for(lambda: len(client.workers(refresh=True)) == 3, 60, "3 workers known")
            lm = client.causal_lm(folder, max_length=32, spans=3)
            ids = lm.tokenizer(["weights by reference"], return_tensors="pt").input_ids
            lm.generate(ids, max_new_tokens=2, do_sample=False)
            out["spans_client_weight_bytes"] = client.weight_bytes_sent
        out["spans_layer_bytes"] = sum(length for name, _, _, _, length in read_header(folder / "model.safetensors")
                                       if ".layers." in name)
        out["spans_per_worker"] = sorted(
            sum(int(n) for n in re.findall(r"Received \d+ weight\(s\) \((\d+) bytes\) from the client", p.output))
            for p in procs)
    return out


def from_peers(job: gpunet.Job, x: torch.Tensor) -> dict:
    """Parts 1-3: one cold worker after another, from the client, one peer, two peers."""
    figures: dict = {}
    size = len(job.program_bytes())
    with tempfile.TemporaryDirectory() as tmp, LocalNetwork(Path(tmp), network="bench-weights", heartbeat=2.0) as net:
        net.start_bootstrap()
        net.start_worker()
        with gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network, data_dir=Path(tmp) / "client") \
                as client:
            def timed(replicas: int) -> float:
                wait_for(lambda: len(client.workers(refresh=True)) == replicas, 60, f"{replicas} workers known")
                t0 = time.perf_counter()
                client.submit(job, x, requirements=gpunet.Requirements(redundancy=replicas, timeout=1800)).result(
                    timeout=1800)
                return round(time.perf_counter() - t0, 2)

            figures["from_client_s"] = timed(1)
            net.start_worker()
            figures["from_one_peer_s"] = timed(2)
            net.start_worker()
            figures["from_two_peers_s"] = timed(3)
            figures["client_program_bytes_sent"] = client.program_bytes_sent
        # The fetch alone, as each cold worker logged it (the rest of a cold start is the same either way: the job's
        # own set-up, then checking and loading the program).
        for name, proc in zip(("one_peer", "two_peers"), net.workers[1:]):
            found = re.search(r"Fetched program \S+ \(\d+ bytes\) from (\d) peer\(s\) in ([\d.]+) s", proc.output)
            figures[f"fetch_{name}_s"] = float(found.group(2)) if found else None
            figures[f"fetch_{name}_sources"] = int(found.group(1)) if found else 0
    figures["client_uploads"] = round(figures["client_program_bytes_sent"] / size, 2)
    figures["one_peer_vs_client"] = round(figures["from_one_peer_s"] / figures["from_client_s"], 2)
    figures["two_peers_vs_one"] = round(figures["from_two_peers_s"] / figures["from_one_peer_s"], 2)
    return figures


#: Part 5's client when it runs in a lab host: the saved job, four per worker sent at once; prints what it saw.
_COLD_CLIENT = """
import json, logging, sys, time
from pathlib import Path
import torch, gpunet
from gpunet.testing import wait_for
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
path, boot, network, workers, data_dir = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
job = gpunet.Job.load(path)
x = torch.ones(job.manifest.inputs[0].shape)
with gpunet.Client(initial_peers=[boot], network=network, data_dir=Path(data_dir)) as client:
    wait_for(lambda: len(client.workers(refresh=True)) == workers, 300, f"{workers} workers known")
    t0, cpu0 = time.perf_counter(), time.process_time()
    futures = [client.submit(job, x, requirements=gpunet.Requirements(timeout=1800)) for _ in range(4 * workers)]
    for f in futures:
        f.result(timeout=1800)
    print(json.dumps({"all_s": time.perf_counter() - t0, "ran_on": len({f.worker_id for f in futures}),
                      "sent": client.program_bytes_sent, "cpu_s": time.process_time() - cpu0}))
"""


def cold_start(job: gpunet.Job, x: torch.Tensor, workers: int, loopback_mb_s: float,
               link_mbit: float | None = None) -> dict:
    """Part 5: ``workers`` fresh workers and four jobs each, sent at once. ``link_mbit``: every worker and the
    client on a host of its own in a LinkLab, each behind a link of that speed up and down (gpunet.testing.netns),
    where bandwidth and not the CPUs is the limit; the baseline is then one copy over one such link, raw TCP."""
    import contextlib
    import subprocess

    from gpunet.testing.netns import LinkLab

    size = len(job.program_bytes())
    out: dict = {"cold_workers": workers, "cold_jobs": 4 * workers, "cold_link_mbit": link_mbit}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        net = stack.enter_context(LocalNetwork(tmp, network="bench-weights-cold", heartbeat=2.0))
        lab = stack.enter_context(LinkLab(workers + 1, up_mbit=link_mbit, down_mbit=link_mbit)) if link_mbit \
            else None
        if lab is None:
            net.start_bootstrap()
            procs = net.start_workers(workers)
            with gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network, data_dir=tmp / "client") \
                    as client:
                wait_for(lambda: len(client.workers(refresh=True)) == workers, 120, f"{workers} workers known")
                t0 = time.perf_counter()
                futures = [client.submit(job, x, requirements=gpunet.Requirements(timeout=1800))
                           for _ in range(4 * workers)]
                for f in futures:
                    f.result(timeout=1800)
                out["cold_all_s"] = round(time.perf_counter() - t0, 2)
                out["cold_ran_on"] = len({f.worker_id for f in futures})
                out["cold_client_copies"] = round(client.program_bytes_sent / size, 2)
        else:
            out["cold_one_copy_s"] = round(lab.tcp_seconds(lab.hosts[0], lab.hosts[1], lab.addrs[1], size), 2)
            net.start_bootstrap(ns=lab.public, host_maddrs=f"/ip4/{lab.public_addr}/tcp/0")
            procs = [net.start_worker(ns=lab.hosts[i], host_maddrs=f"/ip4/{lab.addrs[i]}/tcp/0", wait_online=False)
                     for i in range(1, workers + 1)]
            for proc in procs:
                net.wait_online(proc)
            job.save(tmp / "job.gpunet")
            cpu = _cpu_times()
            done = subprocess.run(lab.exec_argv(lab.hosts[0], [
                sys.executable, "-c", _COLD_CLIENT, str(tmp / "job.gpunet"), net.bootstrap_addr, net.network,
                str(workers), str(tmp / "client")]), capture_output=True, text=True, timeout=3600,
                cwd=Path(__file__).resolve().parent.parent)
            if done.returncode != 0:
                said = "\n".join(f"{net.worker_id(p)[-8:]}: {line}" for p in procs for line in p.output.splitlines()
                                 if re.search(r"WARNING|ERROR|Fetch|asked of|Received", line))
                raise RuntimeError(f"the lab's client failed (exit {done.returncode}): {done.stdout[-1000:]}"
                                   f"{done.stderr[-2000:]}\nwhat the workers said:\n{said[-6000:]}")
            busy, total = (after - before for before, after in zip(cpu, _cpu_times()))
            out["cold_cpu_busy"] = round(busy / max(total, 1), 2)  # the machine's cores, while the cold start ran
            got = json.loads(done.stdout.strip().splitlines()[-1])
            out["cold_all_s"], out["cold_ran_on"] = round(got["all_s"], 2), got["ran_on"]
            out["cold_client_copies"] = round(got["sent"] / size, 2)
            out["cold_client_cpu_s"] = round(got["cpu_s"], 1)  # the client's process, while it sent the jobs
        per, stops = {}, Counter()
        for proc in procs:
            fetched = re.search(r"Fetched program \S+ \((\d+) bytes\) from (\d+) peer\S* in ([\d.]+) s", proc.output)
            served = net.worker_id(proc)[-8:]
            per[served] = {"fetched": int(fetched.group(1)) if fetched else 0,
                           "sources": int(fetched.group(2)) if fetched else 0}
            if fetched:  # the fetch alone (then the worker checks, stores and loads it: CPU, on a shared machine)
                per[served]["fetch_s"] = float(fetched.group(3))
            per[served]["peak_rss_mb"] = _peak_rss_mb(proc.pid)  # the worker's main process (not its executors)
            per[served]["cpu_s"] = _cpu_s(proc.pid)
            # Its executors (the one that loaded the program is the biggest), and what the worker and they hold now in
            # memory of their own (anonymous: a spooled program's pages are the page cache's, and count in VmHWM)
            server, executors = executor_pids(proc.pid)  # (the fork server's memory they share counts in PSS once)
            per[served]["executor_peak_rss_mb"] = max((_peak_rss_mb(p) or 0 for p in executors), default=None)
            per[served]["anon_now_mb"] = sum(_pss_anon_mb(p) or 0 for p in [proc.pid, server, *executors] if p)
            partial = re.search(r"Fetched (\d+) of (\d+) pieces of program", proc.output)
            if partial:  # the rest came from the client
                per[served]["from_peers_before_client"] = f"{partial.group(1)} of {partial.group(2)} pieces"
            # Why streams to holders ended (a figure to read beside the copies: what made the client send more).
            stops.update(re.sub(r"[0-9a-f]{12}|\b\w{8}\b(?= stopped)|\d+", "#", m) for m in
                         re.findall(r"(?:Fetching pieces of \S+ from \S+ stopped: .*|nothing came and no holder's "
                                    r"copy grew.*)", proc.output))
        status = {w["id"][-8:]: w["peer_bytes"] for w in _status(net, lab)}
        for name, b in per.items():
            b["served"] = status.get(name, {}).get("served", 0)
        out["cold_per_worker"] = per
        out["cold_fetch_stops"] = dict(stops.most_common(8))
        fetches = [b["fetch_s"] for b in per.values() if "fetch_s" in b]
        if fetches:  # the longest fetch from peers (each begins as its job asks, within a second of the others)
            out["cold_longest_fetch_s"] = max(fetches)
        out["cold_most_served_copies"] = round(max(b["served"] for b in per.values()) / size, 2)
    if link_mbit is None:
        out["cold_one_copy_s"] = round(size / 1e6 / loopback_mb_s, 3)
    out["cold_vs_one_copy"] = round(out["cold_all_s"] / out["cold_one_copy_s"], 1)
    return out


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat): the share busy tells whether CPUs or links bound
    a run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _peak_rss_mb(pid: int) -> int | None:
    return _status_mb(pid, "VmHWM")


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a live process has used: a worker whose one Python thread neared the run's length
    was the limit, whatever the links could carry."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 1)


def _pss_anon_mb(pid: int) -> int | None:
    """Anonymous memory of a process's own, its share of what forked processes share counted once (PSS)."""
    try:
        found = re.search(r"Pss_Anon:\s+(\d+) kB", Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return None
    return int(found.group(1)) // 1024 if found else None


def _status_mb(pid: int, field: str) -> int | None:
    try:
        found = re.search(rf"{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return int(found.group(1)) // 1024 if found else None


def _status(net, lab=None) -> list[dict]:
    import subprocess

    from gpunet.testing.localnet import gpunet_cmd

    argv = gpunet_cmd("status", "--network", net.network, "--initial-peers", net.bootstrap_addr, "--json")
    done = subprocess.run(lab.exec_argv(lab.public, argv) if lab is not None else argv, capture_output=True,
                          text=True, timeout=120)
    return json.loads(done.stdout)["workers"] if done.returncode == 0 else []


def by_reference(state: dict, x: torch.Tensor, job: gpunet.Job) -> dict:
    """Cold starts of the same weights named by reference: from a worker's models dir, then from the client."""
    from safetensors.torch import save_file

    from gpunet.job.checkpoints import CheckpointIndex

    out = {}
    with tempfile.TemporaryDirectory() as tmp, LocalNetwork(Path(tmp), network="bench-weights-ref",
                                                            heartbeat=2.0) as net:
        folder = Path(tmp) / "models" / "bench"
        folder.mkdir(parents=True)
        save_file(state, str(folder / "model.safetensors"))
        ref = job.by_reference(CheckpointIndex([folder]).scan())
        out["ref_program_bytes"] = len(ref.program_bytes())
        net.start_bootstrap()
        holder = net.start_worker("--models-dir", str(Path(tmp) / "models"))
        with gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network, data_dir=Path(tmp) / "client") \
                as client:
            def timed(worker) -> float:
                wait_for(lambda: {w.id for w in client.workers(refresh=True)} == {net.worker_id(worker)}, 60,
                         "the worker")
                t0 = time.perf_counter()
                client.submit(ref, x, requirements=gpunet.Requirements(timeout=1800)).result(timeout=1800)
                return round(time.perf_counter() - t0, 2)

            out["ref_from_disk_s"] = timed(holder)
            out["ref_from_disk_weight_bytes"] = client.weight_bytes_sent
            bare = net.start_worker()
            holder.terminate()
            out["ref_from_client_s"] = timed(bare)
            out["ref_from_client_weight_bytes"] = client.weight_bytes_sent - out["ref_from_disk_weight_bytes"]
    return out


if __name__ == "__main__":
    main()
