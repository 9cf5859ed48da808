#!/usr/bin/env python
"""What one stranger can push through a public gpunet worker's relay, on a real NAT built from network namespaces
(needs root, iproute2 and nftables).

The stranger (gpunet.testing.relay_stranger) is two plain libp2p peers in two homes behind NAT: one holds a
reservation on the public worker's relay, the other pushes zeros to it through the relay for --seconds, dialling a
new circuit whenever the relay resets one. The same pusher then pushes to a peer it dials directly (the baseline:
what the lab's links carry without a relay). Printed: MB/s that crossed (counted by the receiving peer), the
projected GB per hour, the bytes the largest circuit carried and how many circuits were reset.

    python scripts/bench_relay_abuse.py [--seconds 20] [--streams 4] [--json] [-- WORKER FLAGS...]   (as root)

Worker flags after ``--`` are passed to ``gpunet worker`` (e.g. ``-- --relay-circuit-mb 64``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunet.testing import LocalNetwork, wait_for  # noqa: E402
from gpunet.testing.netns import NatLab  # noqa: E402
from gpunet.testing.relay_stranger import NoReservation, run_pusher, start_holder  # noqa: E402


def measure(lab: NatLab, holder_args: dict, seconds: float, streams: int) -> dict:
    """One stranger's push at a holder started with ``holder_args``; what crossed, per second and per circuit."""
    try:
        holder = start_holder(lab, **holder_args)
    except NoReservation as e:
        return {"MBps": 0.0, "GB_per_hour": 0.0, "crossed_bytes": 0, "circuits": 0, "largest_circuit_bytes": 0,
                "resets": 0, "refused": 0, "reservation": str(e)}
    try:
        pushed = run_pusher(lab, lab.homes[1].ns, holder, seconds, streams)
        try:  # every stream the pusher opened has ended: the holder has counted its last circuits
            wait_for(lambda: len(holder.circuits) >= pushed["opened"], 15, "the holder's counts")
        except TimeoutError:  # a stream that died on a reset circuit before it reached the holder is never counted
            pass
        crossed = sum(holder.circuits)
    finally:
        holder.stop()
    mbps = crossed / pushed["seconds"] / 1e6
    return {"MBps": mbps, "GB_per_hour": mbps * 3600 / 1000, "crossed_bytes": crossed, "seconds": pushed["seconds"],
            "circuits": len(holder.circuits), "largest_circuit_bytes": max(holder.circuits, default=0),
            "resets": pushed["resets"], "refused": pushed["refused"], "errors": pushed["errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=4, help="streams the pusher keeps open at once")
    parser.add_argument("--relay", choices=("worker", "bootstrap"), default="worker",
                        help="whose relay: a public worker's (default) or the bootstrap node's")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("worker_flags", nargs="*", help="after --: flags for the public worker")
    args = parser.parse_args()
    why = NatLab.available()
    if why:
        raise SystemExit(f"bench_relay_abuse needs network namespaces: {why}")
    with tempfile.TemporaryDirectory() as tmp, NatLab(homes_count=2) as lab:
        public = f"/ip4/{lab.public_addr}/tcp/0"
        with LocalNetwork(Path(tmp), network="relay-abuse", heartbeat=2.0) as net:
            net.start_bootstrap(ns=lab.public, host_maddrs=public)
            worker = net.start_worker(*args.worker_flags, ns=lab.public, host_maddrs=public)
            node = worker if args.relay == "worker" else net.bootstrap
            relay = next(a for a in node.wait_ready("online")["addresses"] if lab.public_addr in a)
            relayed = measure(lab, {"ns": lab.homes[0].ns, "relay": relay, "wait": 30.0}, args.seconds,
                              args.streams)
        direct = measure(lab, {"ns": lab.public, "direct": f"/ip4/{lab.public_addr}/tcp/47311"}, args.seconds,
                         args.streams)
    print(f"relay: the {args.relay}'s, worker flags {' '.join(args.worker_flags) or '(defaults)'}")
    for name, row in (("relayed", relayed), ("direct", direct)):
        if "reservation" in row:
            print(f"{name:<8} {row['reservation'][:140]}")
            continue
        print(f"{name:<8} {row['MBps']:8.1f} MB/s = {row['GB_per_hour']:7.1f} GB/hour | {row['circuits']} circuits, "
              f"largest {row['largest_circuit_bytes'] / 2**20:.1f} MiB, {row['resets']} reset, "
              f"{row['refused']} dials refused")
    print(f"relayed / direct: {relayed['MBps'] / direct['MBps']:.0%}")
    if args.json:
        print(json.dumps({"benchmark": "relay_abuse", "worker_flags": args.worker_flags, "seconds": args.seconds,
                          "streams": args.streams, "relay": args.relay, "relayed": relayed, "direct": direct}))


if __name__ == "__main__":
    main()
