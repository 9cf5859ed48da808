"""Benchmark the job path on this machine: convert, validate+load, per-forward interpreter vs eager, tensor codec.

Run: PYTHONPATH=. python scripts/bench_jobs_local.py [--json] [--layers 6 --dim 320 --batch 4 --seq 128]
(decode shapes: --batch 1 --seq 2; the program is traced at 4 x 16 with dynamic batch and sequence either way)
Targets: interpreter within 10% of eager per forward; validate+load under 100 ms; decode >= 50% of memcpy speed.
On a CUDA device the worker's way is also timed replayed as a CUDA graph (gpunet.worker.executor.graphs: inputs
copied in, outputs copied out, as an executor does), beside eager PyTorch captured in a CUDA graph by hand
(``--graphs fake`` runs that path on the CPU stand-in, FAKE HARDWARE: its times mean nothing, it checks the script).
``--sweep``: decode and prefill shapes at float32 and bfloat16 in one run and one JSON (issue 41's GPU table:
``--device cuda:0 --sweep --dim 4096 --layers 4``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

from gpunet import Job
from gpunet.job import tensors
from gpunet.job.interpreter import execute, run_program
from gpunet.job.validator import load_program
from gpunet.worker.executor.child import Pacer
from gpunet.worker.executor.graphs import WARM_RUNS, CudaGraphs, FakeCudaGraphs, GraphCache


class Block(nn.Module):
    def __init__(self, d: int, heads: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:  # eager runs PyTorch's fused attention kernel; the job runs its core-ATen decomposition
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the same ops in eager and in the job: isolates the interpreter's own overhead
            att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_seq: int, sdpa: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, sdpa) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def _timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_initialized():  # a GPU's kernels are queued: the time is when they are done
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(runs: dict, repeat: int) -> dict[str, list[float]]:
    """Each of ``runs`` (name -> callable) timed ``repeat`` times, interleaved and rotating who goes first, so all see
    the same machine state (also scripts/bench_decoders.py)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(repeat):
        for name in order[i % len(order):] + order[:i % len(order)]:
            times[name] += _timed(runs[name], 1)
    return times


#: --sweep's shapes (batch, tokens): decode at one row and at eight, and a prefill; each at float32 and bfloat16.
SWEEP_SHAPES = ((1, 2), (8, 2), (1, 512))
SWEEP_DTYPES = ("float32", "bfloat16")


def build(args, dtype: str) -> dict:
    """The model at ``dtype`` on the device, traced once (dynamic batch and tokens) and loaded as a worker loads it."""
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, heads=8, max_seq=512, sdpa=args.sdpa).eval()
    model = model.to(getattr(torch, dtype))
    dyn = ({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=512)},)
    t0 = time.perf_counter()
    # Traced at a shape that specialises nothing (torch.export takes a batch of 1 for a constant), run at the one asked.
    job = Job.from_module(model, (torch.randint(0, args.vocab, (4, 16)),), dynamic_shapes=dyn)
    program = job.program_bytes()
    convert_s = time.perf_counter() - t0
    load_s = min(_timed(lambda: load_program(program), 5))
    return {"model": model.to(args.device), "prog": load_program(program, device=args.device), "dtype": dtype,
            "params": sum(p.numel() for p in model.parameters()), "program_mib": round(len(program) / 2**20, 2),
            "convert_s": round(convert_s, 3), "validate_load_ms": round(load_s * 1e3, 1)}


def forwards(args, built: dict, batch: int, seq: int) -> dict:
    """One shape's forwards, interleaved: eager, the compiled plan, the generic loop, the plan as a worker runs it,
    and (on a GPU, or --graphs fake) the worker's CUDA-graph replay beside eager captured by hand."""
    model, prog = built["model"], built["prog"]
    x = torch.randint(0, args.vocab, (batch, seq), device=args.device)
    t0 = time.perf_counter()
    est = prog.estimate([x])
    dry_run_s = time.perf_counter() - t0

    def loop():  # the generic loop the compiled plan replaced (the dry run still uses it)
        execute(prog.steps, prog.new_env([x]), prog.output_slots)

    def as_a_worker():  # with the stop word and each node's time bound, as the executor runs a job
        run_program(prog, [x], stop=lambda: False, pace=Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() + 60))

    cuda = args.device.startswith("cuda")
    graphs = None
    if args.graphs == "fake" or (args.graphs == "auto" and cuda):
        backend = CudaGraphs(args.device) if args.graphs == "auto" else FakeCudaGraphs()
        graphs = GraphCache(backend, 1 << 40, run_program)

    def graphed():  # as a worker runs a step whose shapes it captured: inputs in, replay, outputs out
        graphs(prog, [x], stop=lambda: False, pace=Pacer(prog.steps, est.node_flops, 1.0, time.monotonic() + 60))

    with torch.inference_mode():
        ref = model(x)
        got = run_program(prog, [x])[0]
        same_as_loop = torch.equal(got, execute(prog.steps, prog.new_env([x]), prog.output_slots)[0])
        runs = {"eager": lambda: model(x), "interp": lambda: run_program(prog, [x]), "generic": loop,
                "worker": as_a_worker}
        graph_fig = {}
        if graphs is not None:
            for _ in range(WARM_RUNS + 1):
                graphs(prog, [x])
            counts = graphs.take_counts()
            graph_fig["graph_refused"] = [f"{reason}: {detail}" for reason, detail in counts.refused]
            if counts.runs.get("captured"):
                graph_fig["graph_equals_plan"] = torch.equal(graphs(prog, [x])[0], got)
                runs["graph"] = graphed
            if cuda:  # the baseline: eager PyTorch captured by hand, with its input copied in and output out
                eager_graphed = _eager_in_a_graph(model, x)
                graph_fig["eager_graph_equals_eager"] = torch.equal(eager_graphed(), ref)
                runs["eager_graph"] = eager_graphed
        times = interleaved(runs, args.repeat)
        for name in ("graph", "eager_graph"):
            if times.get(name):
                graph_fig[f"{name}_forward_ms"] = round(statistics.median(times[name]) * 1e3, 3)
                eager_ms = statistics.median(times["eager"])
                graph_fig[f"{name}_vs_eager"] = round(statistics.median(times[name]) / eager_ms, 3)
    eager, interp, generic, worker = times["eager"], times["interp"], times["generic"], times["worker"]
    return {
        "dtype": built["dtype"], "batch": batch, "seq": seq,
        "graph_nodes": len(prog.steps),
        "dry_run_ms": round(dry_run_s * 1e3, 1),
        "flops_per_forward": est.flops,
        "peak_memory_mib": round(est.peak_memory_bytes / 2**20, 1),
        "eager_forward_ms": round(statistics.median(eager) * 1e3, 2),
        "interpreter_forward_ms": round(statistics.median(interp) * 1e3, 2),
        "eager_forward_min_ms": round(min(eager) * 1e3, 2),
        "interpreter_forward_min_ms": round(min(interp) * 1e3, 2),
        "interpreter_vs_eager": round(statistics.median(interp) / statistics.median(eager), 3),
        "interpreter_vs_eager_min": round(min(interp) / min(eager), 3),
        "interpreter_target_ratio": 1.10,
        "generic_loop_forward_ms": round(statistics.median(generic) * 1e3, 2),
        "generic_loop_vs_eager": round(statistics.median(generic) / statistics.median(eager), 3),
        "as_a_worker_forward_ms": round(statistics.median(worker) * 1e3, 2),
        "as_a_worker_vs_eager": round(statistics.median(worker) / statistics.median(eager), 3),
        "plan_equals_generic_loop": same_as_loop,
        "max_abs_diff_vs_eager": (ref - got).abs().max().item(),
        **graph_fig,
    }


def _eager_in_a_graph(model, x):
    """Eager PyTorch captured in a CUDA graph by hand: a callable copying ``x`` in, replaying, cloning the output."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)

    def replay():
        static_x.copy_(x)
        graph.replay()
        return static_out.clone()

    return replay


def codec(args) -> dict:
    """The tensor codec against a plain copy of the same bytes (the physical limit of any decoder that copies)."""
    n = args.codec_mib * 1024 * 1024 // 4
    blob = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    enc_s = min(_timed(lambda: tensors.encode(blob), 3))
    data = tensors.encode(blob)
    dec_s = min(_timed(lambda: tensors.decode(data), 5))
    copy_s = min(_timed(lambda: bytearray(data), 5))
    mib = len(data) / 2**20
    return {"codec_mib": round(mib, 1), "encode_gib_s": round(mib / 1024 / enc_s, 2),
            "decode_gib_s": round(mib / 1024 / dec_s, 1), "memcpy_gib_s": round(mib / 1024 / copy_s, 2),
            "decode_vs_memcpy": round(copy_s / dec_s, 1), "encode_vs_memcpy": round(copy_s / enc_s, 2),
            "decode_target_vs_memcpy": 0.5}


def sweep(args) -> None:
    """--sweep: every shape of SWEEP_SHAPES at every dtype of SWEEP_DTYPES, in one JSON (issue 41, item 4)."""
    runs = []
    for dtype in SWEEP_DTYPES:
        built = build(args, dtype)
        for batch, seq in SWEEP_SHAPES:
            run = {"convert_s": built["convert_s"], "validate_load_ms": built["validate_load_ms"],
                   **forwards(args, built, batch, seq)}
            runs.append(run)
            if not args.json:
                line = (f"{dtype:8s} batch {batch} x {seq:3d} tokens: eager {run['eager_forward_ms']:.2f} ms, "
                        f"plan {run['interpreter_vs_eager']:.2f}x, as a worker {run['as_a_worker_vs_eager']:.2f}x")
                if "graph_forward_ms" in run:
                    fake = " FAKE HARDWARE: CPU stand-in, times mean nothing;" if args.graphs == "fake" else ""
                    line += (f", replayed {run['graph_forward_ms']:.2f} ms ({run['graph_vs_eager']:.2f}x;{fake} same "
                             f"bits {run.get('graph_equals_plan')})")
                if "eager_graph_forward_ms" in run:
                    line += f", eager in a graph {run['eager_graph_forward_ms']:.2f} ms"
                print(line, flush=True)
    out = {"benchmark": "jobs_local_sweep", "device": args.device, "dim": args.dim, "layers": args.layers,
           "params": built["params"], "graphs": args.graphs, "sdpa": args.sdpa, "repeat": args.repeat, "runs": runs}
    if args.json:
        print(json.dumps(out, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=320)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--codec-mib", type=int, default=256)
    ap.add_argument("--sdpa", action="store_true", help="attention via F.scaled_dot_product_attention (fused in eager)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="where the forwards run (e.g. cuda:0); the codec stays on the CPU")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="the weights' dtype")
    ap.add_argument("--graphs", choices=("auto", "fake", "off"), default="auto",
                    help="time CUDA-graph replays (auto: on a CUDA device; fake: the CPU stand-in, FAKE HARDWARE)")
    ap.add_argument("--sweep", action="store_true",
                    help="decode (1 and 8 rows x 2 tokens) and prefill (1 x 512) shapes at float32 and bfloat16, in "
                         "one JSON; --batch, --seq, --dtype and the codec are not used")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(args)
        return
    built = build(args, args.dtype)
    fig = {"model_params": built["params"], "device": args.device, "program_mib": built["program_mib"],
           "convert_s": built["convert_s"], "validate_load_ms": built["validate_load_ms"],
           "validate_load_target_ms": 100, **forwards(args, built, args.batch, args.seq), **codec(args)}
    if args.json:
        print(json.dumps(fig, indent=2))
        return
    _print(args, fig)


def _print(args, fig: dict) -> None:
    cuda = args.device.startswith("cuda")
    print(f"model: {fig['model_params'] / 1e6:.1f} M params, {fig['graph_nodes']} graph nodes, program "
          f"{fig['program_mib']} MiB, batch {args.batch} x seq {args.seq}")
    print(f"convert (torch.export + decompose + encode): {fig['convert_s']:.2f} s")
    print(f"validate + load:  {fig['validate_load_ms']:8.1f} ms   (target < 100 ms)")
    print(f"dry run (meta):   {fig['dry_run_ms']:8.1f} ms   -> {fig['flops_per_forward'] / 1e9:.2f} GFLOP, peak "
          f"{fig['peak_memory_mib']} MiB")
    print(f"forward, eager:        median {fig['eager_forward_ms']:8.2f} ms, best {fig['eager_forward_min_ms']:8.2f} ms ({args.repeat} interleaved runs)")
    print(f"forward, interpreter:  median {fig['interpreter_forward_ms']:8.2f} ms, best {fig['interpreter_forward_min_ms']:8.2f} ms")
    print(f"interpreter / eager:   median {fig['interpreter_vs_eager']:.3f}, best {fig['interpreter_vs_eager_min']:.3f} "
          f"(target <= 1.10; best is robust to a busy machine); max |diff| {fig['max_abs_diff_vs_eager']:.2e}")
    print(f"  with the stop word and each node's time bound (as a worker runs it): {fig['as_a_worker_forward_ms']:.2f} ms, "
          f"{fig['as_a_worker_vs_eager']:.3f}x eager; the generic loop (before the compiled plan): "
          f"{fig['generic_loop_forward_ms']:.2f} ms, {fig['generic_loop_vs_eager']:.3f}x; same bits: "
          f"{fig['plan_equals_generic_loop']}")
    if "graph_refused" in fig:
        print(f"replayed as a CUDA graph{' (FAKE HARDWARE: CPU stand-in, times mean nothing)' if not cuda else ''}: "
              f"{fig.get('graph_forward_ms', '-')} ms, {fig.get('graph_vs_eager', '-')}x eager; same bits as the "
              f"plain run: {fig.get('graph_equals_plan', '-')}; eager in a CUDA graph: "
              f"{fig.get('eager_graph_forward_ms', '-')} ms, {fig.get('eager_graph_vs_eager', '-')}x eager"
              + (f"; not captured: {'; '.join(fig['graph_refused'])}" if fig.get("graph_refused") else ""))
    print(f"codec on {fig['codec_mib']:.0f} MiB: memcpy {fig['memcpy_gib_s']} GiB/s | decode {fig['decode_gib_s']} GiB/s "
          f"({fig['decode_vs_memcpy']}x memcpy, zero-copy; target >= 0.5x) | encode {fig['encode_gib_s']} GiB/s "
          f"({fig['encode_vs_memcpy']}x memcpy)")


if __name__ == "__main__":
    main()
