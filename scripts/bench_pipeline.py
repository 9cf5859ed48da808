#!/usr/bin/env python
"""A model spread over three workers, generating through an inference session, beside its baselines from this run.

* tokens/s of greedy generation through a session (each span's KV cache on its worker) vs the same blocks generating
  locally in this process (eager torch, same threads), in alternating rounds (--rounds) so both see the same machine;
* per-step overhead (a step's wall time less the compute its workers did, as their receipts state it) vs the raw
  hivemind unary round trips a step needs (one per span, to the same workers, with a payload of the step's size);
* time to recover from a killed span: the step after SIGKILLing one span's worker (it moves and replays) vs a step;
* the worker <-> executor hop alone: a session step of a one-matmul program through the worker's executor pool (its
  sandboxed process, the state kept there), in this process, less the compute the executor reports;
* where a step's time goes: the CPU each kind of process spent per pushed step (this client, its p2p daemon, the
  placed workers' network processes, their executors, their daemons; from /proc), beside the step's wall time. On a
  machine with fewer cores than busy processes, a step's wall time is mostly the sum of these.

    python scripts/bench_pipeline.py [--json] [--quick] [--d-model N] [--layers N] [--rounds N] [--device cuda:0]

``--device cuda:N``: the workers serve that GPU (all four share it) and the local baseline runs on it too; GPU and
exported-graph kernels may round differently from eager ones, so there the tokens are compared, not required equal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.export import Dim  # noqa: E402

import gpunet  # noqa: E402
from gpunet.ledger.tabs import TAB_STEPS, steps_of  # noqa: E402
from gpunet.models import TinyConfig, initial_state, tiny_gpt  # noqa: E402
from gpunet.protocol import MAX_PING_BYTES  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402


@torch.no_grad()
def local_steps(blocks, spans, prompt, tokens: int, device: str = "cpu"):
    """Greedy generation here; returns (tokens, per-step wall times, per-span compute time of each step)."""
    with torch.device(device):  # the blocks make positions and caches with torch.arange/zeros: on this device
        return _local_steps(blocks, spans, prompt.to(device), tokens, device)


def _local_steps(blocks, spans, prompt, tokens: int, device: str):
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    states = [initial_state(b) for b in blocks]
    x, out, step_times, span_times = prompt, [], [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        h, per_span = x, []
        for start, stop in spans:
            s0 = time.perf_counter()
            for i in range(start, stop):
                if states[i]:
                    h, *new = blocks[i](h, *states[i])
                    states[i] = tuple(new)
                else:
                    h = blocks[i](h)
            sync()
            per_span.append(time.perf_counter() - s0)
        token = int(h[0, -1].argmax())
        step_times.append(time.perf_counter() - t0)
        span_times.append(per_span)
        out.append(token)
        x = torch.tensor([[token]], device=device)
    return out, step_times, span_times


def remote_steps(session, prompt, tokens: int, windows: list | None = None):
    """Greedy tokens through ``session`` and each step's seconds; ``windows`` gets each step's (start, end) in
    CLOCK_MONOTONIC ns, the clock of the workers' step traces."""
    x, out, times = prompt, [], []
    for _ in range(tokens):
        t0 = time.monotonic_ns()
        token = int(session.step(x)[0, -1].argmax())
        t1 = time.monotonic_ns()
        times.append((t1 - t0) / 1e9)
        if windows is not None:
            windows.append((t0, t1))
        out.append(token)
        x = torch.tensor([[token]])
    return out, times


#: A step's stages in order along its critical path, from the client's and the workers' marks (gpunet.worker.steptrace):
#: (name, the mark it starts at, the mark it ends at, whether it ends on the next span's worker); per span, summed,
#: except where a mark is the client's (None).
STAGES = (("client to the first span", None, "input", False),
          ("worker: admitted, queued, sent to its executor", "input", "sent", False),
          ("pipe to the executor", "sent", "received", False),
          ("executor: inputs, state, dry run (cached), pacer", "received", "began", False),
          ("compute", "began", "ended", False),
          ("executor: outputs encoded, replied", "ended", "replied", False),
          ("pipe back to the worker", "replied", "back", False),
          ("worker: step on its tab, output handed to the push", "back", "answered", False),
          ("push: daemon to daemon, the next span's step woken", "answered", "input", True),
          ("last span to the client", "answered", None, False))


def step_stages(trace_dir: Path, placements: list[tuple[list[str], list[tuple[int, int]]]]) -> dict[str, float]:
    """Median ms of each stage of a pushed step (STAGES; per-span stages summed over the spans), from the steps'
    client windows and the traces of the workers placed for them."""
    lines: dict[str, list[dict]] = {}
    for path in trace_dir.glob("*.jsonl"):
        lines[path.stem] = [json.loads(line) for line in path.read_text().splitlines()]
    per_stage: dict[str, list[float]] = {name: [] for name, *_ in STAGES}
    for workers, windows in placements:
        for t0, t1 in windows:
            spans = []
            for w in workers:  # each span's step is the one of its worker that arrived within the client's window
                found = [m for m in lines.get(w, ()) if t0 <= m["arrived"] <= t1 and "back" in m and "began" in m]
                spans.append(found[0] if len(found) == 1 else None)
            if None in spans:
                continue
            for name, start, end, across in STAGES:
                if start is None:
                    total = spans[0][end] - t0
                elif end is None:
                    total = t1 - spans[-1][start]
                elif across:
                    total = sum(b[end] - a[start] for a, b in zip(spans, spans[1:]))
                else:
                    total = sum(m[end] - m[start] for m in spans)
                per_stage[name].append(total / 1e6)
    return {name: statistics.median(ms) for name, ms in per_stage.items() if ms}


def raw_round_trips(client, worker_ids: list[str], payload: int, n: int, gaps: list[float] | None = None) -> list[float]:
    """One unary hivemind RPC to each worker in turn (a step's round trips), ``n`` times: seconds per step, the
    gaps left out. ``gaps``: wait that long after each worker's answer, as a session step does while that worker
    computes (an idle peer answers its next call more slowly than a busy one: a fair baseline waits the same)."""
    rpc = client._core.transport.rpc

    async def run() -> list[float]:
        out = []
        for _ in range(n):
            total = 0.0
            for i, w in enumerate(worker_ids):
                t0 = time.perf_counter()
                await rpc.ping(w, b"x" * payload)
                total += time.perf_counter() - t0
                if gaps:
                    await asyncio.sleep(gaps[i])
            out.append(total)
        return out

    return asyncio.run_coroutine_threadsafe(run(), client._loop).result()


class _OneMatmul(torch.nn.Module):
    """A session step with almost no compute: what remains of a call through the executor pool is the hop."""

    def __init__(self, d: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x, state):
        return torch.tanh(x @ self.w) + state, state + 1


def executor_hop(d: int, device: str, steps: int = 300) -> tuple[float, float]:
    """Median seconds of a session step through the worker's executor pool (sandboxed, as a worker runs it), and of
    the compute its executor reports for it."""
    from gpunet.worker.executor import Executor
    from gpunet.worker.state.limits import SessionRun

    job = gpunet.Job.from_module(_OneMatmul(d), (torch.randn(1, 1, d), torch.zeros(1, 1, d)), state=1)
    x = job.encode_step_inputs(torch.randn(1, 1, d))

    async def run() -> tuple[float, float]:
        with Executor(device=device, processes=1, memory_budget_bytes=1 << 30, threads_per_process=1,
                      speed_tflops=0.1) as pool:
            await pool.run(job.program_hash, job.to_bytes(), x, 120, session=SessionRun("hop", 0, fresh=True,
                                                                                          room=1 << 24))
            calls, computes = [], []
            for step in range(1, steps + 1):
                t0 = time.perf_counter()
                result = await pool.run(job.program_hash, None, x, 60, session=SessionRun("hop", step, room=1 << 24))
                calls.append(time.perf_counter() - t0)
                computes.append(result.wall_time)
            return statistics.median(calls), statistics.median(computes)

    return asyncio.run(run())


_TICK = os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, int]:
    """Every process's parent, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return parents


def _tree(root: int, parents: dict[int, int]) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_by_role(placed: list[int], idle: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process's tree, by role. For the worker processes in ``placed``:
    ``worker`` (the network process), ``executor`` (its pool's processes), ``worker dht`` (hivemind's DHT process)
    and ``worker p2pd``; for this process: ``client``, ``client dht`` and ``client p2pd``; the trees in ``idle`` (the
    bootstrap, a spare worker): ``other``."""
    parents = _parents()
    side = {}
    for pid in placed:
        side.update(dict.fromkeys(_tree(pid, parents), "worker"))
    for pid in idle:
        side.update(dict.fromkeys(_tree(pid, parents), "other"))
    spent: dict[str, float] = {}
    for pid in _tree(os.getpid(), parents):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        role = side.get(pid, "client")
        # An executor or the fork server (forked from the worker: its command line is the worker's, its name not;
        # gpunet.worker.executor.forkserver), or a resource tracker
        helper = name in ("gpunet-executor", "gpunet-forksrv") or any("multiprocessing" in arg for arg in command)
        if command[0].endswith("p2pd") and role != "other":
            role += " p2pd"
        elif role == "worker" and pid not in placed:
            role = "executor" if helper else "worker dht"
        elif role == "client" and pid != os.getpid() and parents[pid] == os.getpid() and not helper:
            role = "client dht"
        spent[role] = spent.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    parser.add_argument("--d-model", type=int, default=768, help="width: sets the compute per step")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="local and networked generations, alternating")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for the workers and the local baseline")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the model's weights and activations (positions stay float32)")
    parser.add_argument("--trace", action="store_true",
                        help="where a pushed step's time goes, stage by stage (the workers' GPUNET_STEP_TRACE)")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="passed on to each `gpunet worker` (repeatable), e.g. --worker-arg=--no-sandbox")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds takes 1 or more")
    tokens = 24 if args.quick else TAB_STEPS  # one tab per span: its receipt gives the workers' compute
    args.rounds = 1 if args.quick else args.rounds
    if 4 * args.d_model + 256 > MAX_PING_BYTES:  # the raw baseline echoes a step's bytes through the ping door
        parser.error(f"--d-model {args.d_model}: the raw round trip it is measured against carries at most "
                     f"{MAX_PING_BYTES} bytes (d-model up to {(MAX_PING_BYTES - 256) // 4})")
    cfg = TinyConfig(d_model=args.d_model, n_heads=8, n_layers=args.layers, max_len=tokens + 16, vocab=512)
    dtype = getattr(torch, args.dtype)
    blocks = [b.to(dtype) for b in tiny_gpt(cfg, seed=0)]
    prompt = torch.randint(0, cfg.vocab, (1, 1))  # every step one token: each step costs the same
    gpu = args.device.startswith("cuda")
    results: dict = {"benchmark": "pipeline", "d_model": cfg.d_model, "layers": cfg.n_layers, "tokens": tokens,
                     "rounds": args.rounds, "threads_per_job": 1, "device": args.device, "dtype": args.dtype}
    local_blocks = [b.to(args.device, dtype) for b in tiny_gpt(cfg, seed=0)] if gpu else blocks
    mismatched = 0
    trace_dir = None
    if args.trace:  # the workers started below inherit it
        trace_dir = Path(tempfile.mkdtemp(prefix="gpunet-step-trace-"))
        os.environ["GPUNET_STEP_TRACE"] = str(trace_dir)
    traced: list[tuple[list[str], list[tuple[int, int]]]] = []  # each pushed session's workers and step windows
    hop_call, hop_compute = executor_hop(cfg.d_model, args.device)
    results.update({"executor_hop_call_ms": hop_call * 1e3, "executor_hop_compute_ms": hop_compute * 1e3,
                    "executor_hop_ms": (hop_call - hop_compute) * 1e3})
    with LocalNetwork(network="bench-pipeline", heartbeat=2.0) as net, _logs_on_failure(net):
        bootstrap = net.start_bootstrap()
        # Four workers on one machine: each job gets one thread (gpunet worker --threads), as the local baseline does.
        # Each with all the cores, their threads took the cores from each other and from the workers' own I/O: a
        # test of oversubscription, not of the network.
        procs = net.start_workers(4, "--threads", "1", "--device", args.device, *args.worker_arg)
        by_id = {net.worker_id(p): p for p in procs}
        with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
            wait_for(lambda: len(client.workers(refresh=True)) == 4, 60, "four workers")
            example = torch.randint(0, cfg.vocab, (1, 4))  # not 1: torch.export would take the length as fixed
            remote = client.sequential(blocks, example_inputs=(example,), spans=3,
                                       dynamic_shapes=({1: Dim("T", min=1, max=cfg.max_len)},))
            spans = [(s.start, s.stop) for s in remote.spans]
            if not all(s.stateful for s in remote.spans):  # a span of the embedding or head alone runs as a plain job
                raise SystemExit(f"--layers {args.layers}: the {len(blocks)} blocks split into spans {spans}, and a "
                                 "span without a decoder layer keeps no state, so no step could be pushed to it; "
                                 "give more --layers")
            torch.set_num_threads(1)  # as each worker's jobs run here (--threads 1)
            with remote.session() as warm:  # programs loaded, dry runs cached, routing measured
                remote_steps(warm, prompt, 4)
            # Local and networked generations alternate, so both see the same machine: on a shared 2-vCPU VM the
            # same run is 20% faster or slower from one minute to the next.
            # Each round also generates with pushes off (every activation by way of the client), the way steps went
            # before workers passed them on to each other: the gain from pushing, in the same run.
            local_times, span_times, times, receipts = [], [], [], []
            via_client, via_client_receipts, pushed = [], [], 0
            cpu, cpu_steps, cpu_wall = {}, 0, 0.0  # CPU seconds by role over pushed sessions' steps but the first
            for _ in range(args.rounds):
                want, steps, spent = local_steps(local_blocks, spans, prompt, tokens, args.device)
                local_times += steps
                span_times += spent
                for push in (True, False):
                    with remote.session(push=push) as session:
                        if push:  # the sessions are opened on the first step: counted from the second
                            got, first = remote_steps(session, prompt, 1)
                            placed = [by_id[w].pid for _, _, w in session.placement]
                            idle = [net.bootstrap.pid, *(p.pid for p in procs if p.pid not in placed)]
                            before = cpu_by_role(placed, idle)
                            windows: list[tuple[int, int]] = []
                            more, steps = remote_steps(session, torch.tensor([got[-1:]]), tokens - 1, windows)
                            traced.append(([w for _, _, w in session.placement], windows))
                            after = cpu_by_role(placed, idle)
                            for role, seconds in after.items():
                                cpu[role] = cpu.get(role, 0.0) + seconds - before.get(role, 0.0)
                            cpu_steps, cpu_wall = cpu_steps + len(steps), cpu_wall + sum(steps)
                            got, steps = got + more, first + steps
                        else:
                            got, steps = remote_steps(session, prompt, tokens)
                        placement = [w for _, _, w in session.placement]
                    if gpu:  # the count of tokens that differ is the figure (see the docstring)
                        mismatched += sum(a != b for a, b in zip(got, want))
                    else:
                        assert got == want, "networked generation differs from local generation"
                    (times if push else via_client).extend(steps)
                    # tabs, paid by now: each span's steps, one receipt each
                    (receipts if push else via_client_receipts).extend(session.receipts)
                    pushed += session.pushed
            # What the workers computed per step: each tab's compute time over the steps it covers.
            worker_compute = sum(r.wall_time_us for r in receipts) / (tokens * args.rounds) / 1e6
            via_client_compute = sum(r.wall_time_us for r in via_client_receipts) / (tokens * args.rounds) / 1e6
            # Each span's compute in the last round (its placement): how long the paced round trips wait after each.
            per_span = [r.wall_time_us / steps_of(r.job_id) / 1e6
                        for r in sorted(session.receipts, key=lambda r: placement.index(r.worker_id))]
            raw = raw_round_trips(client, placement, dtype.itemsize * cfg.d_model + 256, 50)
            paced = raw_round_trips(client, placement, dtype.itemsize * cfg.d_model + 256, 50, gaps=per_span)
            with remote.session() as session:
                # Recovery: kill the middle span's worker, then the next step moves it and replays its past steps.
                _, before = remote_steps(session, prompt, tokens)
                by_id[session.placement[1][2]].kill()
                x = torch.tensor([[got[-1]]])
                t0 = time.perf_counter()
                session.step(x)
                recover_s = time.perf_counter() - t0
                moves = session.moves
        steady, local_steady = times, local_times
        compute = [sum(s) for s in span_times]
        results.update({
            "network_tokens_per_s": len(steady) / sum(steady),
            "local_tokens_per_s": len(local_steady) / sum(local_steady),
            "step_p50_ms": statistics.median(steady) * 1e3,
            "local_step_p50_ms": statistics.median(local_steady) * 1e3,
            "compute_per_step_ms": statistics.median(compute) * 1e3,
            "worker_compute_per_step_ms": worker_compute * 1e3,
            # a step's mean wall time less the workers' mean compute per step (tabs give the mean, not each step's)
            "overhead_ms": (statistics.mean(steady) - worker_compute) * 1e3,
            "pushed_share": pushed / (len(steady) * (len(spans) - 1)),
            "via_client_tokens_per_s": len(via_client) / sum(via_client),
            "via_client_overhead_ms": (statistics.mean(via_client) - via_client_compute) * 1e3,
            "raw_round_trips_p50_ms": statistics.median(raw) * 1e3,
            "paced_round_trips_p50_ms": statistics.median(paced) * 1e3,
            "spans": len(spans),
            "recover_step_s": recover_s,
            "moves": moves,
            # where a pushed step's time goes: CPU ms per step by kind of process, beside the step's mean wall time
            "cpu_ms_per_step": {role: seconds / cpu_steps * 1e3 for role, seconds in sorted(cpu.items()) if seconds},
            "cpu_wall_ms_per_step": cpu_wall / cpu_steps * 1e3,
            "cores": os.cpu_count(),
        })
        if gpu:
            results["tokens_differing"] = mismatched
        if trace_dir is not None:
            results["stages_ms"] = step_stages(trace_dir, traced)
            shutil.rmtree(trace_dir, ignore_errors=True)
    r = results
    r["efficiency"] = r["network_tokens_per_s"] / r["local_tokens_per_s"]
    r["overhead_vs_raw"] = r["overhead_ms"] / r["raw_round_trips_p50_ms"]
    r["overhead_vs_paced"] = r["overhead_ms"] / r["paced_round_trips_p50_ms"]
    print(f"generation, {r['layers']}-layer d={r['d_model']} decoder over {r['spans']} workers: "
          f"{r['network_tokens_per_s']:.1f} tokens/s | locally {r['local_tokens_per_s']:.1f} tokens/s "
          f"({r['efficiency'] * 100:.0f}%); compute per step {r['compute_per_step_ms']:.1f} ms here, "
          f"{r['worker_compute_per_step_ms']:.1f} ms on the workers")
    print(f"with pushes off (every activation by way of the client): {r['via_client_tokens_per_s']:.1f} tokens/s, "
          f"overhead {r['via_client_overhead_ms']:.2f} ms per step; {r['pushed_share'] * 100:.0f}% of span inputs "
          "went worker to worker with pushes on")
    print(f"per-step overhead {r['overhead_ms']:.2f} ms | {r['spans']} raw hivemind round trips "
          f"{r['raw_round_trips_p50_ms']:.2f} ms back to back ({r['overhead_vs_raw']:.2f}x), "
          f"{r['paced_round_trips_p50_ms']:.2f} ms paced like a step ({r['overhead_vs_paced']:.2f}x)")
    print(f"recovering a killed span (move + replay of {tokens} steps): {r['recover_step_s']:.2f} s | a step "
          f"{r['step_p50_ms']:.1f} ms")
    print(f"the worker <-> executor hop of a session step (pipe, sandboxed process, state kept there): "
          f"{r['executor_hop_ms']:.3f} ms ({r['executor_hop_call_ms']:.3f} ms a call, "
          f"{r['executor_hop_compute_ms']:.3f} ms of it compute)")
    spent = r["cpu_ms_per_step"]
    print(f"where a pushed step's {r['cpu_wall_ms_per_step']:.1f} ms went, CPU ms per step on {r['cores']} cores: "
          + ", ".join(f"{role} {ms:.1f}" for role, ms in spent.items()) + f" (sum {sum(spent.values()):.1f})")
    if "stages_ms" in r:
        print(f"a pushed step stage by stage (median ms; per-span stages summed over the {r['spans']} spans):")
        for name, ms in r["stages_ms"].items():
            print(f"  {ms:7.2f}  {name}")
        total = sum(r["stages_ms"].values())
        print(f"  {total:7.2f}  in all (medians: the sum is near, not equal to, the median step)")
    if gpu:
        print(f"on {args.device}: {r['tokens_differing']} of {r['tokens'] * r['rounds'] * 2} networked tokens "
              "differ from local eager generation")
    if args.json:
        print(json.dumps(results))


@contextlib.contextmanager
def _logs_on_failure(net: LocalNetwork):
    """A failed run prints each node's log tail: the nodes' own error is what a reader needs."""
    try:
        yield
    except SystemExit:  # the benchmark's own verdict on its arguments: no node failed
        raise
    except BaseException:
        for proc in net.procs:
            print(f"--- {proc.name} ({proc.role}), last lines:\n" + "\n".join(proc.output.splitlines()[-40:]),
                  file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
