#!/usr/bin/env python
"""Direct vs relayed, on a real NAT built from network namespaces (needs root, iproute2 and nftables).

One lab, two networks side by side, each with its own bootstrap/relay node in the public namespace: on one the
worker sits beside the bootstrap (direct), on the other it sits behind a home NAT router and is reached through the
bootstrap's relay (relayed). One client process in the public namespace sends the same tiny jobs (1 KB in and out)
to both, alternating blocks of 25, then one job with 8 MiB of input to each. Printed: tiny-job p50/p99 per path and
the ratio (target: relayed <= 2x direct), bulk MB/s per path (target: relayed >= 50% of direct), and whether the
relay came up in libp2p's limited mode (128 KiB per connection, see docs/reachability.md), in which the bulk job
cannot pass.

    python scripts/bench_reachability.py [--jobs 200] [--json]     (as root)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.netns import NatLab  # noqa: E402

_CLIENT = r'''
import json, statistics, sys, time
import torch
import gpunet

(direct_boot, relayed_boot, root, jobs) = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)


class Tiny(torch.nn.Module):  # no weights: the program is a few KB, so it fits through a limited relay too
    def forward(self, x):
        return torch.tanh(x) * 2.0


tiny = gpunet.Job.from_module(Tiny(), example_inputs=(torch.randn(1, 256),))


class Sum(torch.nn.Module):
    def forward(self, x):
        return x.sum(dim=0, keepdim=True)


bulk = gpunet.Job.from_module(Sum(), example_inputs=(torch.randn(2048, 1024),))
clients = {"direct": gpunet.Client(initial_peers=[direct_boot], network="bench-direct", data_dir=f"{root}/c-direct"),
           "relayed": gpunet.Client(initial_peers=[relayed_boot], network="bench-relayed",
                                    data_dir=f"{root}/c-relayed")}
try:
    for c in clients.values():
        deadline = time.monotonic() + 60
        while not c.workers(refresh=True) and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            c.submit(tiny, torch.randn(1, 256)).result(timeout=120)  # warm: the program crosses once
        except gpunet.GpunetError as e:
            print(f"warm-up failed: {e}", file=sys.stderr)
    times = {name: [] for name in clients}
    failures = {name: 0 for name in clients}
    for block in range(max(1, jobs // 25)):
        for name, c in clients.items():
            for _ in range(25):
                t0 = time.perf_counter()
                try:
                    c.submit(tiny, torch.randn(1, 256)).result(timeout=60)
                    times[name].append(time.perf_counter() - t0)
                except gpunet.GpunetError:
                    failures[name] += 1
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"p50_ms": 1000 * statistics.median(ts) if ts else None,
                     "p99_ms": 1000 * ts[min(len(ts) - 1, int(0.99 * len(ts)))] if ts else None,
                     "failed": failures[name]}
    x = torch.randn(2048, 1024)
    for name, c in clients.items():
        t0 = time.perf_counter()
        try:
            c.submit(bulk, x).result(timeout=120)
            out[name]["bulk_MBps"] = x.numel() * 4 / (time.perf_counter() - t0) / 1e6
        except gpunet.GpunetError as e:
            out[name]["bulk_MBps"] = None
            out[name]["bulk_error"] = str(e)[:200]
    print(json.dumps(out), flush=True)
finally:
    for c in clients.values():
        c.close()
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    why = NatLab.available()
    if why:
        raise SystemExit(f"bench_reachability needs network namespaces: {why}")
    with tempfile.TemporaryDirectory() as tmp, NatLab(homes_count=1) as lab:
        root = Path(tmp)
        with LocalNetwork(root / "direct", network="bench-direct", heartbeat=2.0) as direct, \
                LocalNetwork(root / "relayed", network="bench-relayed", heartbeat=2.0) as relayed:
            public = f"/ip4/{lab.public_addr}/tcp/0"
            direct_boot = direct.start_bootstrap(ns=lab.public, host_maddrs=public)
            relayed_boot = relayed.start_bootstrap(ns=lab.public, host_maddrs=public)
            direct.start_worker(ns=lab.public, host_maddrs=public)
            worker = relayed.start_worker(ns=lab.homes[0].ns, host_maddrs="/ip4/0.0.0.0/tcp/0")
            assert "Reachable through relays" in worker.output, worker.output[-2000:]
            relay = wait_for(lambda: ("limited" if "relays in libp2p's limited mode" in relayed.bootstrap.output else
                                      "full" if "passed its self-test" in relayed.bootstrap.output else None),
                             60, "the relay's self-test")
            run = subprocess.run(lab.exec_argv(lab.public, [sys.executable, "-c", _CLIENT, direct_boot, relayed_boot,
                                                             str(root), str(args.jobs)]),
                                 capture_output=True, text=True, timeout=1800)
            if run.returncode != 0:
                raise SystemExit(run.stderr[-3000:])
            result = json.loads(run.stdout.strip().splitlines()[-1])
    d, r = result["direct"], result["relayed"]
    ratio = r["p50_ms"] / d["p50_ms"] if d["p50_ms"] and r["p50_ms"] else None
    print(f"relay mode: {relay} ({'libp2p limited relay: 128 KiB per connection' if relay == 'limited' else 'as configured'})")
    for name, row in result.items():
        p50 = f"{row['p50_ms']:.2f}" if row["p50_ms"] else "-"
        p99 = f"{row['p99_ms']:.2f}" if row["p99_ms"] else "-"
        bulk = f"{row['bulk_MBps']:.0f} MB/s" if row.get("bulk_MBps") else f"failed ({row.get('bulk_error', '')[:80]})"
        print(f"{name:<8} tiny job p50 {p50} ms, p99 {p99} ms, {row['failed']} failed | bulk 8 MiB: {bulk}")
    if ratio:
        print(f"relayed / direct tiny p50: {ratio:.2f}x (target <= 2x)")
    if d.get("bulk_MBps") and r.get("bulk_MBps"):
        print(f"relayed / direct bulk: {r['bulk_MBps'] / d['bulk_MBps']:.0%} (target >= 50%)")
    if args.json:
        print(json.dumps({"benchmark": "reachability", "relay": relay, **result, "tiny_p50_ratio": ratio}))


if __name__ == "__main__":
    main()
