#!/usr/bin/env python
"""The zoo's decoders at decode shapes: a span's step the way a worker runs it, beside eager PyTorch (issue 41, item 2).

For each HF decoder family gpunet serves (gpunet.testing.llm.FAMILIES: random init, no download), its decoder layers
are made into one span exactly as ``client.causal_lm`` makes them (adapter.blocks_of, then trace_spans with the
token and row dims dynamic), and a decode step (``--batch`` rows of one token each, a static KV cache of
``--length`` slots) is timed three ways, interleaved so that all see the same machine: eager PyTorch calling the
blocks, the job's compiled plan (``run_program``), and that plan with the stop word and each node's time bound as an
executor runs it. The outputs must equal eager's within the dtype's rounding. Targets: the worker's way at most 1.1x
eager on the CPU, 1.2x on a GPU without CUDA graphs. No network, no sandbox: the interpreter's own cost.

    python scripts/bench_decoders.py [--families llama,gpt2] [--width 8] [--batch 1] [--repeat 200] [--device cuda:0]
                                     [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.export import Dim

from gpunet.client.llm import adapter
from gpunet.client.llm.engine import MAX_BATCH_ROWS
from gpunet.client.sessions.spans import _SpanModule, trace_spans
from gpunet.job.interpreter import run_program
from gpunet.job.validator import load_program
from gpunet.testing.llm import FAMILIES, tiny_causal_lm
from gpunet.worker.executor.child import Pacer

from bench_jobs_local import interleaved  # (this folder: the same timing as the single-model benchmark)

#: The widths of FAMILIES' configs that scale with ``--width`` (heads stay: each head grows).
_WIDTHS = ("hidden_size", "n_embd", "intermediate_size", "ffn_dim", "moe_intermediate_size",
           "shared_expert_intermediate_size", "word_embed_proj_dim", "head_dim")


def one_family(family: str, width: int, batch: int, length: int, repeat: int, dtype: torch.dtype,
               device: str = "cpu") -> dict:
    kwargs = FAMILIES[family][2]
    model = tiny_causal_lm(family, **{k: v * width for k, v in kwargs.items() if k in _WIDTHS}).to(dtype)
    model = adapter.prepare(model)
    blocks = adapter.blocks_of(model, length)
    hidden = adapter.text_config(model.config).hidden_size
    example = torch.zeros(1, 2, hidden + 1, dtype=dtype)  # as engine.CausalLMCore traces its spans
    span, = trace_spans(blocks, (example,), ({1: Dim("T", min=1, max=length)},), [(0, len(blocks))],
                        rows=Dim("B", min=1, max=MAX_BATCH_ROWS))
    module = _SpanModule(blocks, [len(b.initial_state()) for b in blocks]).eval().to(device)
    prog = load_program(span.job.program_bytes(), device=device)
    # A decode step part way into a generation: the cache half full, each row one new token.
    state = [torch.cat([t] * batch).to(device) for t in span.state]
    state = [t.normal_() if t.is_floating_point() else t.fill_(length // 2) for t in state]
    x = adapter.with_control(torch.randn(batch, 1, hidden, dtype=dtype)).to(device)
    inputs = [x, *state]
    est = prog.estimate(inputs)

    def as_a_worker():
        run_program(prog, inputs, stop=lambda: False, pace=Pacer(prog.steps, est.node_flops, 1.0,
                                                                  time.monotonic() + 60))

    with torch.inference_mode():
        want = module(*(t.clone() for t in inputs))
        got = run_program(prog, [t.clone() for t in inputs])
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        close = len(got) == len(want) and all(
            torch.allclose(g.float(), w.float(), atol=tolerance, rtol=tolerance) for g, w in zip(got, want))
        runs = {"eager": lambda: module(*inputs), "plan": lambda: run_program(prog, inputs), "worker": as_a_worker}
        for fn in runs.values():  # (first runs: lazy initialisation, caches)
            fn()
        times = interleaved(runs, repeat)
    eager, plan, worker = (statistics.median(times[n]) for n in ("eager", "plan", "worker"))
    return {"family": family, "layers": len(blocks), "hidden": hidden, "nodes": len(prog.steps),
            "eager_ms": round(eager * 1e3, 3), "plan_ms": round(plan * 1e3, 3), "worker_ms": round(worker * 1e3, 3),
            "plan_vs_eager": round(plan / eager, 3), "worker_vs_eager": round(worker / eager, 3),
            "outputs_match": close}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of " + ", ".join(FAMILIES))
    ap.add_argument("--width", type=int, default=8, help="the tiny configs' widths times this (8: hidden 256)")
    ap.add_argument("--batch", type=int, default=1, help="rows (sessions) in the step, one token each")
    ap.add_argument("--length", type=int, default=128, help="the static cache's slots")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: as a worker's --threads 1)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N (no CUDA graphs here: the plan's own cost)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if not families:
        ap.error("--families names none")
    if unknown:
        ap.error(f"unknown families {unknown}: known are {', '.join(FAMILIES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for family in families:
        row = one_family(family, args.width, args.batch, args.length, args.repeat, getattr(torch, args.dtype),
                         args.device)
        rows.append(row)
        if args.json:  # a line per family as it comes (a run cut short keeps those), the summary last
            print(json.dumps(row), flush=True)
        else:
            print(f"{family:10s} {row['layers']} layers d={row['hidden']} {row['nodes']:4d} nodes: eager "
                  f"{row['eager_ms']:.3f} ms, compiled plan {row['plan_ms']:.3f} ms ({row['plan_vs_eager']:.2f}x), "
                  f"as a worker runs it {row['worker_ms']:.3f} ms ({row['worker_vs_eager']:.2f}x)"
                  f"{'' if row['outputs_match'] else '  OUTPUTS DIFFER'}", flush=True)
    worst = max(rows, key=lambda r: r["worker_vs_eager"])
    summary = {"benchmark": "decoders", "device": args.device, "batch": args.batch, "length": args.length,
               "width": args.width, "threads": args.threads, "dtype": args.dtype, "families": rows,
               "median_worker_vs_eager": round(statistics.median(r["worker_vs_eager"] for r in rows), 3),
               "worst": {"family": worst["family"], "worker_vs_eager": worst["worker_vs_eager"]},
               "target_worker_vs_eager": 1.2 if args.device.startswith("cuda") else 1.1,
               "all_outputs_match": all(r["outputs_match"] for r in rows)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"the worker's way against eager: median {summary['median_worker_vs_eager']:.2f}x, worst "
              f"{worst['worker_vs_eager']:.2f}x ({worst['family']}); target <= {summary['target_worker_vs_eager']}x")


if __name__ == "__main__":
    main()
