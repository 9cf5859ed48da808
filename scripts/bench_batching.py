#!/usr/bin/env python
"""Many users at once: N concurrent generations (one session each) on a 3-span pipeline, with the workers batching
the steps that wait together and, in the same run, with batching off, beside the same model generating N rows at
once locally (HF's own ``generate``, eager, one thread per process as the workers' jobs get).

Per N: the decode rate of each stream (tokens/s from its first new token to its last, as they stream: the prompt's
prefill and the sessions' opening are left out) and the aggregate (N times that), and how each compares with one
stream alone. The workers' own count of the steps they batched is read from their metrics.

    python scripts/bench_batching.py [--json] [--quick] [--sessions 1,4,8,16] [--tokens N] [--d-model N]
                                     [--device cuda:0] [--chats 16]

Then, on the batching workers, ``gpunet gateway`` serves the same checkpoint and ``--chats`` streamed chat completions
are sent to it at once (raw server-sent events, as an OpenAI client reads them), beside one chat alone: the time
between two streamed tokens (p50, p99 over every gap of every chat), the time to the first token, and the aggregate.

On a GPU the exported graph's kernels may round differently from eager HF's: the tokens are compared, not required
equal.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet.llm import load  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.llm import save_checkpoint, stream_chat  # noqa: E402
from gpunet.testing.localnet import free_port  # noqa: E402

PROMPT = "the volunteers run workers on their home machines and"


def batched_steps(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r"^gpunet_batched_steps_total (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


class StepClock:
    """A streamer for HF's ``generate`` (``put``, ``end``) that keeps only when each step's tokens came."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def decode_rate(stream, n: int, tokens: int, rounds: int) -> tuple[float, torch.Tensor]:
    """Tokens/s of each of ``n`` streams from its first new token to its last (the prompt's prefill and the
    sessions' opening left out), the median over ``rounds``; and the first stream's new tokens. ``stream(n, new)``
    returns the time each step's tokens came and the first stream's new tokens."""
    rates, first = [], None
    for _ in range(rounds):
        times, first = stream(n, tokens)
        rates.append((tokens - 1) / max(1e-9, times[-1] - times[0]))
    return statistics.median(rates), first


def whole_characters(folder: Path) -> None:
    """The random checkpoint's head made to never pick a token that is a piece of a character (a lone byte of a
    byte-level BPE): a gateway holds such text back until the character is whole, so random bytes would arrive as one
    chunk at the end and no time per token could be seen. Their rows of the head are zeroed, so their logits are 0
    and the greedy pick among hundreds of random ones is always above."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    pieces = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    with torch.no_grad():
        model.get_output_embeddings().weight[pieces] = 0
    model.save_pretrained(folder, safe_serialization=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def chats(url: str, n: int, tokens: int) -> dict:
    """``n`` streamed chat completions sent at once to the gateway at ``url``: per-token gaps and first tokens."""
    def one(i: int) -> tuple[float, list[float], int]:
        arrived: list[float] = []
        sent = time.perf_counter()
        body = {"model": "ckpt", "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}], "max_tokens": tokens,
                "temperature": 0, "stream_options": {"include_usage": True}}
        _, _, usage = stream_chat(url, body, on_text=lambda piece: arrived.append(time.perf_counter()))
        return sent, arrived, int(usage.get("completion_tokens") or len(arrived))

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        done = list(pool.map(one, range(n)))
    gaps = [b - a for _, arrived, _ in done for a, b in zip(arrived, arrived[1:])]
    first = [arrived[0] - sent for sent, arrived, _ in done if arrived]
    span = max(arrived[-1] for _, arrived, _ in done if arrived) - min(sent for sent, _, _ in done)
    made = sum(count for _, _, count in done)
    return {"chats": n, "tokens": made, "token_gap_p50_ms": 1e3 * percentile(gaps, 0.5),
            "token_gap_p99_ms": 1e3 * percentile(gaps, 0.99), "first_token_p50_ms": 1e3 * percentile(first, 0.5),
            "first_token_p99_ms": 1e3 * percentile(first, 0.99), "aggregate_tps": made / span}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer sessions, tokens and rounds")
    parser.add_argument("--sessions", default="1,4,8,16", help="concurrent generations, comma-separated")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for the workers and the local baseline")
    parser.add_argument("--chats", type=int, default=16, help="streamed chats sent at once through the gateway "
                        "(0: none)")
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="passed on to each `gpunet worker` (repeatable)")
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    if args.quick:
        counts, args.tokens, args.rounds, args.chats = [1, 4], 12, 1, min(args.chats, 4)
    folder = Path(tempfile.mkdtemp(prefix="gpunet-bench-batching-")) / "ckpt"
    d = args.d_model
    save_checkpoint(folder, "llama", seed=0, hidden_size=d, intermediate_size=4 * d, num_hidden_layers=args.layers,
                    num_attention_heads=max(1, d // 64), num_key_value_heads=max(1, d // 128),
                    max_position_embeddings=256)
    whole_characters(folder)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    reference.to(args.device)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    max_length = ids.shape[1] + args.tokens + 8
    results: dict = {"benchmark": "batching", "device": args.device, "d_model": d, "layers": args.layers,
                     "tokens": args.tokens,
                     "rounds": args.rounds, "spans": 3, "threads_per_job": 1, "sessions": {}}

    torch.set_num_threads(1)  # as each worker's jobs run (--threads 1)

    @torch.no_grad()
    def local(n: int, new: int):
        clock = StepClock()
        out = reference.generate(ids.repeat(n, 1).to(args.device), max_new_tokens=new, do_sample=False,
                                 streamer=clock)
        return clock.times[1:], out[0, ids.shape[1]:].cpu()  # (the first put is the prompt)

    expected = local(1, args.tokens)[1]
    for n in counts:
        results["sessions"][str(n)] = {"local_stream_tps": decode_rate(local, n, args.tokens, args.rounds)[0]}
    for batching in (True, False):
        ports = [free_port() for _ in range(3)]
        flag = [] if batching else ["--no-batch-sessions"]
        with LocalNetwork(network="bench-batching", heartbeat=2.0) as net:
            bootstrap = net.start_bootstrap()
            for port in ports:
                # One client (this script, then the gateway) holds every session: each worker takes as many of
                # its sessions as there are streams (the default, 8 a client, is a volunteer's guard against one
                # client filling the worker).
                most = str(max(counts + [args.chats]))
                net.start_worker("--threads", "1", "--device", args.device, "--metrics-port", str(port), *flag,
                                 "--max-sessions-per-client", most, *args.worker_arg)
            with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
                wait_for(lambda: len(client.workers(refresh=True)) == 3, 60, "three workers")
                lm = client.causal_lm(folder, max_length=max_length, spans=3)

                def remote(n: int, new: int):
                    times, steps = [], []
                    for step in lm.stream(ids.repeat(n, 1), max_new_tokens=new, do_sample=False):
                        times.append(time.perf_counter())
                        steps.append(step[0])
                    return times, torch.stack(steps)

                remote(1, 2)  # programs loaded, sessions' processes started
                for n in counts:
                    before = sum(batched_steps(p) for p in ports)
                    rate, got = decode_rate(remote, n, args.tokens, args.rounds)
                    key = "batched" if batching else "unbatched"
                    row = results["sessions"][str(n)]
                    row[f"{key}_stream_tps"] = rate
                    row[f"{key}_aggregate_tps"] = rate * n
                    if batching:
                        row["batched_steps"] = sum(batched_steps(p) for p in ports) - before
                    row[f"{key}_tokens_as_local"] = bool(torch.equal(got, expected))
            if batching and args.chats:  # the gateway, a client of the same swarm, serving chats at once
                _, url = net.start_gateway(folder, "--spans", "3", "--max-length", str(max_length + 64))
                chats(url, 1, 4)  # its programs loaded
                results["gateway"] = {"alone": chats(url, 1, args.tokens), "together": chats(url, args.chats,
                                                                                            args.tokens)}
    one = results["sessions"][str(counts[0])]
    for n, row in results["sessions"].items():
        for key in ("batched", "unbatched"):
            row[f"{key}_aggregate_x_one"] = row[f"{key}_aggregate_tps"] / one[f"{key}_stream_tps"]
            row[f"{key}_stream_share_of_solo"] = row[f"{key}_stream_tps"] / one[f"{key}_stream_tps"]
        row["local_aggregate_tps"] = row["local_stream_tps"] * int(n)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"llama d={d}, {args.layers} layers in 3 spans on 3 workers (1 thread each), {args.tokens} tokens, "
          f"decode rate after the first token, median of {args.rounds}")
    print(f"{'streams':>7} | {'batched: each':>13} {'all':>8} {'x one':>6} {'steps':>6} | "
          f"{'unbatched: each':>15} {'all':>8} {'x one':>6} | {'local HF: all':>13}")
    for n, row in results["sessions"].items():
        print(f"{n:>7} | {row['batched_stream_tps']:>13.1f} {row['batched_aggregate_tps']:>8.1f} "
              f"{row['batched_aggregate_x_one']:>6.2f} {row['batched_steps']:>6.0f} | "
              f"{row['unbatched_stream_tps']:>15.1f} {row['unbatched_aggregate_tps']:>8.1f} "
              f"{row['unbatched_aggregate_x_one']:>6.2f} | {row['local_aggregate_tps']:>13.1f}")
    for name, row in results.get("gateway", {}).items():
        print(f"gateway, {row['chats']:>2} streamed chat(s) at once ({name}): time per token p50 "
              f"{row['token_gap_p50_ms']:.1f} ms, p99 {row['token_gap_p99_ms']:.1f} ms; first token p50 "
              f"{row['first_token_p50_ms']:.0f} ms, p99 {row['first_token_p99_ms']:.0f} ms; "
              f"{row['aggregate_tps']:.1f} tokens/s in all")
    same = all(row["batched_tokens_as_local"] and row["unbatched_tokens_as_local"]
               for row in results["sessions"].values())
    print("tokens (first stream) equal local generation's:", "yes" if same else "NO")


if __name__ == "__main__":
    main()
