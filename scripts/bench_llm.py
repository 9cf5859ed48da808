#!/usr/bin/env python
"""A Hugging Face causal LM served by local workers, beside HF's ``generate`` in this process from the same run.

* time to first token (a --prompt-token prompt) and decode tokens/s of one stream through ``client.causal_lm``
  (``lm.stream``) vs HF's ``generate`` here, same weights, same threads;
* the gateway's overhead per token: the same greedy request streamed over HTTP (``gpunet gateway``, server-sent
  events) vs through the Python API, whole requests' times over their tokens, the median of --rounds alternating
  pairs (both clients on this machine, on the same workers);
* greedy tokens are required identical on the CPU (the stream, HF's, and the gateway's text).

    python scripts/bench_llm.py [--json] [--quick] [--family llama] [--hidden N] [--layers N] [--rounds N]
                                 [--device cuda:0]

``--device cuda:N``: the workers serve that GPU and the local baseline runs on it too (tokens compared, not required
equal: kernels there may round differently).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet.llm import load  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.llm import save_checkpoint  # noqa: E402


@torch.no_grad()
def local(model, prompt: torch.Tensor, new: int, device: str) -> tuple[list[int], float, float]:
    """HF's generate here: (tokens, time to first token, decode tokens/s)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    ids = prompt.to(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None)
    sync()
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
    sync()
    total = time.perf_counter() - t0
    return out[0, prompt.shape[1]:].tolist(), ttft, (new - 1) / max(total - ttft, 1e-9)


def remote(lm, prompt: torch.Tensor, new: int) -> tuple[list[int], float, list[float], float]:
    """Through the swarm: (tokens, time to first token, each later token's gap, the whole request's time)."""
    tokens, times = [], []
    t0 = time.perf_counter()
    for step in lm.stream(prompt, max_new_tokens=new, eos_token_id=None):
        times.append(time.perf_counter())
        tokens.append(int(step[0]))
    return tokens, times[0] - t0, [b - a for a, b in zip(times, times[1:])], time.perf_counter() - t0


def gateway_stream(url: str, prompt: list[int], new: int) -> tuple[str, float, float]:
    """The same through the gateway's /v1/completions stream: (text, time to first text, the whole request's time).
    Per-chunk gaps are not per-token ones: a token that ends mid-character (or could begin a stop string) is held and
    sent with the next, so the overhead is measured on whole requests."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    conn.request("POST", u.path + "/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    text, times = [], []
    while True:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
    conn.close()
    return "".join(text), times[0] - t0, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a shorter prompt and fewer tokens")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:N for the workers and the local baseline")
    parser.add_argument("--rounds", type=int, default=5, help="Python API and gateway requests, alternating")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.new_tokens = 128, 24
    max_length = args.prompt_tokens + args.new_tokens + 8
    heads = max(1, args.hidden // 64)
    with tempfile.TemporaryDirectory(prefix="bench-llm-") as tmp:
        folder = save_checkpoint(Path(tmp) / "bench", args.family, seed=0, hidden_size=args.hidden,
                                 intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                 num_attention_heads=heads, num_key_value_heads=heads,
                                 max_position_embeddings=max_length)
        model, _ = load(folder)
        model.config._attn_implementation = "eager"
        model.to(args.device).eval()
        prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(0))
        with LocalNetwork(Path(tmp) / "net", network="bench-llm", heartbeat=2.0) as net:
            net.start_bootstrap()
            net.start_workers(args.workers, "--device", args.device)
            with gpunet.Client(initial_peers=[net.bootstrap_addr], network=net.network,
                               data_dir=Path(tmp) / "client") as client:
                wait_for(lambda: len(client.workers(refresh=True)) == args.workers, 60, "the workers")
                lm = client.causal_lm(folder, max_length=max_length, spans=args.workers)
                remote(lm, prompt[:, :8], 2)  # warm: programs sent and loaded, sessions' process started
                _, url = net.start_gateway(folder, "--name", "bench", "--max-length", str(max_length), "--spans",
                                           str(args.workers))
                gateway_stream(url, prompt[0, :8].tolist(), 2)  # warm
                want, ttft_local, tps_local = local(model, prompt, args.new_tokens, args.device)
                # Alternating rounds, so both see the same machine; the gateway's overhead per token is the median
                # over rounds of (its request's time - the Python API's) / tokens.
                rounds = []
                for _ in range(args.rounds):
                    py = remote(lm, prompt, args.new_tokens)
                    gw = gateway_stream(url, prompt[0].tolist(), args.new_tokens)
                    rounds.append((py, gw))
                placement = lm.last.placement[0]
                cost = lm.last.cost
                same_text = all(gw[0] == lm.tokenizer.decode(py[0], skip_special_tokens=True) for py, gw in rounds)
                same_tokens = all(py[0] == want for py, _ in rounds)
    tps_remote = statistics.median(1 / statistics.mean(py[2]) for py, _ in rounds)
    ttft_remote = statistics.median(py[1] for py, _ in rounds)
    ttft_gw = statistics.median(gw[1] for _, gw in rounds)
    per_token_py = statistics.median(py[3] for py, _ in rounds) / args.new_tokens
    per_token_gw = statistics.median(gw[2] for _, gw in rounds) / args.new_tokens
    overheads = [(gw[2] - py[3]) / args.new_tokens for py, gw in rounds]
    results = {
        "device": args.device, "family": args.family, "hidden": args.hidden, "layers": args.layers,
        "workers": args.workers, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "rounds": args.rounds, "greedy_identical": same_tokens, "gateway_text_identical": same_text,
        "local_ttft_s": ttft_local, "remote_ttft_s": ttft_remote, "gateway_ttft_s": ttft_gw,
        "local_tokens_per_s": tps_local, "remote_tokens_per_s": tps_remote,
        "remote_vs_local": tps_remote / tps_local,
        "python_ms_per_token": per_token_py * 1e3, "gateway_ms_per_token": per_token_gw * 1e3,  # whole requests
        "gateway_overhead_ms_per_token": statistics.median(overheads) * 1e3,
        "gateway_overhead_ms_per_token_rounds": [o * 1e3 for o in overheads],
        "placement": [(a, b, (w or "?")[-8:]) for a, b, w in placement], "cost_credits": cost,
    }
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.family}, hidden {args.hidden}, {args.layers} layers, {args.workers} workers on {args.device}; "
          f"prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    print(f"  greedy tokens identical to HF's generate: {results['greedy_identical']}; gateway's text identical: "
          f"{same_text}")
    print(f"  time to first token:  local {ttft_local * 1e3:8.1f} ms   swarm {ttft_remote * 1e3:8.1f} ms   "
          f"gateway {ttft_gw * 1e3:8.1f} ms")
    print(f"  decode tokens/s:      local {tps_local:8.1f}      swarm {tps_remote:8.1f} (median)      "
          f"({results['remote_vs_local']:.0%} of local)")
    print(f"  per token (request):  python API {per_token_py * 1e3:6.2f} ms   gateway {per_token_gw * 1e3:6.2f} ms   "
          f"overhead {results['gateway_overhead_ms_per_token']:+.2f} ms (median of {args.rounds} rounds: "
          f"{', '.join(f'{o * 1e3:+.2f}' for o in overheads)})")
    print(f"  spans: {results['placement']}; cost {cost:.6f} credits")


if __name__ == "__main__":
    main()
