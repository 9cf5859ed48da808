#!/usr/bin/env python
"""What a speed proof shows next to the speed it is meant to check, on a real local network.

Two workers on this machine: one honest, one whose cached benchmark claims 1000 TFLOPS (its record publishes that).
A client challenges both over the prove door (gpunet.speedproof) and checks their answers. Printed:

* baseline: this machine's matmul speed measured in this process (the worker's own benchmark, best of repeats, in its
  best dtype), and ``speedproof.prove`` in that dtype in this process, without a network (the proof's own overhead:
  generation and digests);
* each worker's proven TFLOPS, as the client saw it over the network, and its ratio to the baseline (routing credits a
  claim up to SLACK times the proven figure, so an honest worker keeps its claim while this ratio is above 1/SLACK);
* the boaster's claim and the speed routing credits it;
* the client's cost of checking one proof (its own share of the work), and each proof's wall time.

    python scripts/bench_speedproof.py [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpunet  # noqa: E402
from gpunet import speedproof  # noqa: E402
from gpunet.client.core import ClientConfig  # noqa: E402
from gpunet.client.proofs import ProofConfig  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.worker import hardware, throughput  # noqa: E402


def local_baseline(rounds: int) -> dict:
    """The worker's own benchmark (best of repeats, per dtype), and the proof in its best dtype, in this process."""
    measured = [throughput._measure(hardware.cpu_hardware()) for _ in range(rounds)]
    figures = {k: max(m[k] for m in measured) for k in measured[0]}
    best = max(figures, key=figures.get)
    matmul = figures[best]
    proofs, checks = [], []
    for _ in range(rounds):
        ch = speedproof.Challenge.for_claim(figures)
        t0 = time.perf_counter()
        digests = speedproof.prove(ch)
        proofs.append(speedproof.proven_tflops(ch, len(digests), time.perf_counter() - t0))
        commitments = speedproof.commit(digests)
        picks = speedproof.pick(len(commitments), ch.n)
        opened = speedproof.open_products(ch, picks, digests)
        t0 = time.perf_counter()
        speedproof.verify(ch, commitments, picks, opened)
        checks.append(time.perf_counter() - t0)
    return {"matmul_tflops": matmul, "dtype": best, "local_proof_tflops": max(proofs),
            "check_seconds": statistics.median(checks)}


def over_the_network(rounds: int) -> dict:
    results = {"honest": [], "honest_claim": [], "boaster": [], "boaster_credited": [], "proof_seconds": []}
    with LocalNetwork(network="bench-speedproof", heartbeat=1.0) as net:
        bootstrap = net.start_bootstrap()
        boaster_dir = net.root / "boaster"
        boaster_dir.mkdir()
        key = throughput._cache_key(hardware.cpu_hardware())
        (boaster_dir / throughput.CACHE_FILENAME).write_text(json.dumps({key: {"fp32": 1000.0, "bf16": 1000.0}}))
        honest = net.start_worker("--remeasure-every", "0")
        net.start_worker("--remeasure-every", "0", data_dir=boaster_dir)
        for r in range(rounds):  # a fresh client each round: each client challenges each worker once
            # One challenge at a time: both workers share this machine's cores (on a real network they would not).
            config = ClientConfig(proofs=ProofConfig(concurrent=1))
            with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / f"client{r}",
                               config=config) as c:
                wait_for(lambda: len(c.workers(refresh=True)) == 2, 60, "both workers")
                router = c._core.router
                t0 = time.perf_counter()
                wait_for(lambda: len(router.proven) == 2, 120, "both proofs")
                results["proof_seconds"].append((time.perf_counter() - t0) / 2)
                for entry in c.workers():
                    name = "honest" if entry.id == honest.id else "boaster"
                    results[name].append(router.proven.get(entry.id))
                    if name == "honest":
                        results["honest_claim"].append(entry.record.best_tflops)
                    if name == "boaster":
                        results["boaster_credited"].append(router.credited_tflops(entry, "fp32"))
    return {k: statistics.median(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    before = local_baseline(args.rounds)
    net = over_the_network(args.rounds)
    after = local_baseline(args.rounds)
    base = {k: max(before[k], after[k]) if k != "check_seconds" else min(before[k], after[k]) for k in before}
    base["dtype"] = before["dtype"]
    row = {**base, **net, "honest_ratio": net["honest"] / base["matmul_tflops"], "slack": speedproof.SLACK}
    print(f"baseline (this process): matmul {base['matmul_tflops']:.3f} TFLOPS {base['dtype']} (the worker's own "
          f"benchmark, its best dtype); proof run locally "
          f"{base['local_proof_tflops']:.3f} TFLOPS ({base['local_proof_tflops'] / base['matmul_tflops']:.0%})")
    print(f"honest worker claims {net['honest_claim']:.3f}, proved {net['honest']:.3f} TFLOPS over the network "
          f"({row['honest_ratio']:.0%} of the baseline; routing keeps a claim up to {speedproof.SLACK:g}x the proof)")
    print(f"boaster claims 1000 TFLOPS, proved {net['boaster']:.3f}; routing credits it {net['boaster_credited']:.3f}")
    print(f"a proof takes {net['proof_seconds']:.2f} s of wall time; checking it costs the client "
          f"{base['check_seconds'] * 1000:.0f} ms")
    if args.json:
        print(json.dumps({"benchmark": "speedproof", **row}))


if __name__ == "__main__":
    main()
