#!/usr/bin/env python
"""What trust costs and what it catches, on a real local network with one lying worker.

For each liar rate (the share of its outputs the liar corrupts: 0, 1%, 10%, 50%) a network of three honest workers
and one liar (started with the hidden ``--fault-corrupt-fraction``, and charging half their price, so routing
favours it) runs the same jobs under three policies:
no verification (the baseline: what a marketplace without checks delivers), ``redundancy=2`` and
``verify="adaptive"``. Printed per policy: the fraction of answers that differ from local execution (bad answers
delivered), the extra compute (executions per job - 1, overall and over the second half of the jobs, i.e. after
adaptive mode's warm-up), and how many of the liar's jobs passed before it was first caught.

``--collusion`` runs the free-identity attack instead: three honest workers and two colluding liars that return the
same wrong answer for every job (so they confirm each other) and undercut everyone's price, each policy by a fresh
client (no worker established with it yet), plus ``verify="local-sample"`` (the client's own computation is the
check).

Beside either, the relayed-proof case (issue 38): identities with no device advertise a big one and pass every speed
challenge they get on to an honest worker (:class:`gpunet.testing.attacks.ProofRelay`: as they came, re-signed with
their own key, or asked in the unbound form); printed is how many of them the client credits any speed
(``--relayed-proof-only`` runs just that).

``--stall`` runs stall-then-lie: the same two colluders also hold every answer until ``--stall-margin`` seconds
before the client's timeout (hidden ``--fault-answer-late``), on a job that takes a client about a second to compute
itself (54 GFLOP), so that the check would have no time left if it got only what the workers left; adds
``redundancy=3``. Both may be given: their rows are printed one after the other, and in one ``--json``. ``failed``
counts jobs that ended in an error (VerificationFailed: a vote nothing settled; JobTimeout); ``liars paid``: liars
holding any receipt this client countersigned.

    python scripts/bench_trust.py [--jobs 200] [--collusion] [--stall [--stall-margin 0.3]] [--relayed-proof-only] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import gpunet  # noqa: E402
from gpunet import Requirements  # noqa: E402
from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.attacks import CLAIM_TFLOPS, ProofRelay  # noqa: E402

# Price-sensitive users (prefer="cheapest") are the liar's best customers: the adversarial case.
POLICIES = {
    "none (baseline)": Requirements(timeout=300, prefer="cheapest"),
    "redundancy=2": Requirements(redundancy=2, timeout=300, prefer="cheapest"),
    "adaptive": Requirements(verify="adaptive", timeout=300, prefer="cheapest"),
    "local-sample": Requirements(verify="local-sample", timeout=300, prefer="cheapest"),
}


STALL_POLICIES = {
    "none (baseline)": Requirements(timeout=60, prefer="cheapest"),
    "redundancy=2": Requirements(redundancy=2, timeout=60, prefer="cheapest"),
    "redundancy=3": Requirements(redundancy=3, timeout=60, prefer="cheapest"),
    "adaptive": Requirements(verify="adaptive", timeout=60, prefer="cheapest"),
    "local-sample": Requirements(verify="local-sample", timeout=60, prefer="cheapest"),
}


def small_model(jobs: int):
    """A tiny MLP: every check is cheap."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    xs = [torch.randn(4, 32) for _ in range(jobs)]
    with torch.no_grad():
        return gpunet.Job.from_module(model, (torch.randn(4, 32),)), xs, [model(x) for x in xs]


def sum_of_products(x):
    y = x @ x
    for i in range(24):
        y = y + (x * (i + 2)) @ x
    return y.sum(0)


def slow_job(jobs: int):
    """About 54 GFLOP from a 4 MiB input, a 4 KiB answer: about a second for a client to compute itself."""
    torch.manual_seed(0)
    xs = [torch.randn(1024, 1024) / 32 for _ in range(jobs)]
    return gpunet.Job.from_function(sum_of_products, (xs[0],)), xs, [sum_of_products(x) for x in xs]


def run_policy(net: LocalNetwork, bootstrap: str, liar_ids: set[str], name: str, req: Requirements, jobs: int,
               workers: int, workload=small_model) -> dict:
    job, xs, expected = workload(jobs)
    data_dir = net.root / f"client-{name.split()[0]}"
    with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=data_dir) as client:
        wait_for(lambda: len(client.workers(refresh=True)) == workers, 60, f"{workers} workers")
        bad = executions = liar_jobs = late_executions = settled = failed = 0
        caught_after = None
        window = []

        def settle(f, want):
            nonlocal bad, executions, liar_jobs, caught_after, late_executions, settled, failed
            settled += 1
            try:
                got = f.result()
            except (gpunet.VerificationFailed, gpunet.JobTimeout):
                failed += 1
                executions += len(f.attempts) if f.attempts else 3
                return
            executions += len(f.attempts)
            if settled > jobs // 2:
                late_executions += len(f.attempts)
            liar_jobs += sum(f.attempts.count(liar) for liar in liar_ids)
            bad += not torch.allclose(got, want, rtol=1e-4, atol=1e-3)
            rep = client._core.reputation
            if caught_after is None and any(liar in rep.workers and rep.workers[liar].rejected > 0 for liar in liar_ids):
                caught_after = liar_jobs

        for x, want in zip(xs, expected):
            window.append((client.submit(job, x, requirements=req), want))
            if len(window) >= 8:
                settle(*window.pop(0))
        for f, want in window:
            settle(f, want)
        client._call(client._core.flush_ledger())
        # Every receipt this client countersigned, not only the returned results' (a vote pays all its majority).
        paid_liars = {r.worker_id for r in client.ledger.receipts() if r.worker_id in liar_ids}
    late_jobs = jobs - jobs // 2
    return {"policy": name, "jobs": jobs, "bad_answers": bad / jobs, "failed": failed,
            "extra_compute": executions / jobs - 1, "extra_compute_second_half": late_executions / late_jobs - 1,
            "liar_jobs": liar_jobs, "liar_caught_after": caught_after, "liars_paid": len(paid_liars)}


def run_relayed_proof(timeout: float = 300) -> dict:
    """One honest worker, three relays of its speed proofs (one per way to relay), one fresh client: which relays the
    client credits any speed once it has challenged them all."""
    with LocalNetwork(network="bench-trust-relay", heartbeat=2.0) as net:
        bootstrap = net.start_bootstrap()
        honest_id = net.worker_id(net.start_worker())
        with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client-relay") as client:
            router = client._core.router
            honest_proof = wait_for(lambda: router.proven.get(honest_id), 120, "the honest worker's proof")
            target = next(e for e in client.workers(refresh=True) if e.id == honest_id)
            with ProofRelay(net.root / "relays", net.network, [bootstrap], honest_id, dict(target.record.tflops),
                            heartbeat=net.heartbeat) as relay:
                wait_for(lambda: all(i in router.proven for i in relay.ids.values()), timeout,
                         "the client to challenge every relay")
                entries = {e.id: e for e in client.workers(refresh=True)}
                credited = {m: router.credited_tflops(entries[i]) if i in entries else router.proven.get(i)
                            for m, i in relay.ids.items()}
                relayed = dict(relay.relayed)
    return {"scenario": "relayed-proof", "relays": len(credited), "relays_credited": sum(v > 0 for v in credited.values()),
            "credited_tflops": credited, "challenges_relayed": relayed, "relay_claim_tflops": CLAIM_TFLOPS,
            "honest_proven_tflops": honest_proof}


def print_relayed(row: dict) -> None:
    modes = ", ".join(f"{m} {v:.3g}" for m, v in row["credited_tflops"].items())
    print(f"{row['relays']} relayed proofs  | relays credited any speed: {row['relays_credited']} of {row['relays']} "
          f"(credited TFLOPS: {modes}; each claims {row['relay_claim_tflops']:g}, the honest worker they relay to "
          f"proved {row['honest_proven_tflops']:.3g})", flush=True)


def colluders(jobs: int, stall_margin: float | None) -> list[dict]:
    """Three honest workers and two colluding liars at half their price, a fresh client per policy; with
    ``stall_margin``, the liars hold each answer until that long before the client's timeout (stall then lie)."""
    rows = []
    with LocalNetwork(network="bench-trust", heartbeat=2.0) as net:
        bootstrap = net.start_bootstrap()
        net.start_workers(3, "--max-queue", "32", "--price", "1.0")
        stalls = ["--fault-answer-late", str(stall_margin)] if stall_margin is not None else []
        liars = net.start_workers(2, "--fault-corrupt-fraction", "1.0", *stalls, "--max-queue", "32", "--price", "0.5")
        liar_ids = {net.worker_id(w) for w in liars}
        for name, req in (POLICIES if stall_margin is None else STALL_POLICIES).items():
            if stall_margin is None:
                row = {"scenario": "collusion", **run_policy(net, bootstrap, liar_ids, name, req, jobs, 5)}
                label = "2 colluding liars"
            else:
                row = {"scenario": "stall-then-lie", "stall_margin": stall_margin,
                       **run_policy(net, bootstrap, liar_ids, name, req, jobs, 5, workload=slow_job)}
                label = f"2 liars, answer {stall_margin:g} s before the timeout"
            rows.append(row)
            print(f"{label} | {name:<15} | bad answers accepted {row['bad_answers']:6.1%} | failed {row['failed']} | "
                  f"extra compute {row['extra_compute']:6.1%} (second half {row['extra_compute_second_half']:6.1%}) "
                  f"| liars ran {row['liar_jobs']} jobs, {row['liars_paid']} of them ever paid", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rates", type=float, nargs="*", default=[0.0, 0.01, 0.1, 0.5])
    parser.add_argument("--collusion", action="store_true", help="two colluding liars instead of one")
    parser.add_argument("--stall", action="store_true",
                        help="two colluding liars that answer just before the client's timeout (stall then lie)")
    parser.add_argument("--stall-margin", type=float, default=0.3, metavar="SECONDS",
                        help="how long before the client's timeout the stalling liars answer")
    parser.add_argument("--relayed-proof-only", action="store_true", help="only the relayed speed proof case")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    if args.relayed_proof_only:
        rows.append(run_relayed_proof())
        print_relayed(rows[-1])
        if args.json:
            print(json.dumps({"benchmark": "trust", "rows": rows}))
        return
    if args.collusion or args.stall:
        for stall in [False] * args.collusion + [True] * args.stall:
            rows += colluders(args.jobs, args.stall_margin if stall else None)
        rows.append(run_relayed_proof())
        print_relayed(rows[-1])
        if args.json:
            print(json.dumps({"benchmark": "trust", "rows": rows}))
        return
    for rate in args.rates:
        with LocalNetwork(network="bench-trust", heartbeat=2.0) as net:
            bootstrap = net.start_bootstrap()
            net.start_workers(3, "--max-queue", "32", "--price", "1.0")
            # The liar undercuts everyone, as a cheater would: without checks it gets most of the work.
            liar = net.start_worker("--fault-corrupt-fraction", str(rate), "--max-queue", "32", "--price", "0.5")
            liar_id = net.worker_id(liar)
            for name, req in POLICIES.items():
                row = {"liar_rate": rate, **run_policy(net, bootstrap, {liar_id}, name, req, args.jobs, 4)}
                rows.append(row)
                caught = "" if row["liar_caught_after"] is None else f", liar caught after {row['liar_caught_after']} of its jobs"
                print(f"liar rate {rate:>4.0%} | {name:<15} | bad answers delivered {row['bad_answers']:6.1%} | "
                      f"extra compute {row['extra_compute']:6.1%} (second half {row['extra_compute_second_half']:6.1%}) | "
                      f"liar ran {row['liar_jobs']} jobs{caught}", flush=True)
    rows.append(run_relayed_proof())
    print_relayed(rows[-1])
    if args.json:
        print(json.dumps({"benchmark": "trust", "rows": rows}))


if __name__ == "__main__":
    main()
