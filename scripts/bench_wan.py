#!/usr/bin/env python
"""Home to home over a WAN, in the lab: per named profile (gpunet.testing.wan.PROFILES: latency between homes, each
home on a 20 Mbit/s uplink and a 100 Mbit/s downlink), three workers in three homes serve a client, reached
directly (public addresses: gpunet.testing.netns.LinkLab) and through the bootstrap node's relay (each home behind
its own NAT router: NatLab). Reported per profile and path, each beside its floor from the same lab:

- a tiny job's round trip, p50 of 20 in a row (floor: one round trip between the client and a home, raw TCP);
- bulk: a job whose input is 8 MiB (floor: the same bytes over one raw TCP connection into a home);
- a 3-span session's decode rate (a Llama d=128, 6 layers, one span a worker; tokens/s from the first new token to
  the last, as they stream), beside the physical floor: each token crosses client -> span 1 -> span 2 -> span 3 ->
  client, three of those transits into a home;
- the same with speculative decoding (4 proposals a step): a draft that always agrees (the served weights
  themselves, the ceiling of a well-matched draft) and one that nearly never does (another random model).

The client sits on the lab's public side (a well-connected machine; the relay node is there too, so a relayed
transit here costs what a direct one does, where a real relay adds its own distance). A third path, ``punched``
(not run by default): the homes behind NAT again, with four public nodes at distinct addresses, so the workers
hole-punch direct connections to each other (docs/reachability.md); the row says how many pairs were direct when
the figures were taken. In this lab its latency is the relayed path's (the relay costs no distance here): what it
saves is the relay's bytes and the second leg of a real relay's distance; ``--far-relay`` shows that leg: the
relays (and the punched path's public nodes) then sit in a namespace of their own, a profile's latency from
everyone, so a relayed transit costs two legs, as through a real relay. Needs root, iproute2, nftables and
iptables. Each profile/path starts a fresh network (about a minute).

    python scripts/bench_wan.py [--json] [--profiles lan,city,continent,world] [--paths direct,relayed,punched]
                                [--tokens N] [--far-relay]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpunet.testing import LocalNetwork  # noqa: E402
from gpunet.testing.llm import save_checkpoint  # noqa: E402
from gpunet.testing.netns import LinkLab, NatLab  # noqa: E402
from gpunet.testing.wan import PROFILES  # noqa: E402

BULK_BYTES = 8 << 20
SPANS = 3

_CLIENT = r'''
import json, statistics, sys, time
import torch
import gpunet
from gpunet.llm import load

boot, network, data_dir, folder, other, workers, tokens = sys.argv[1:8]
workers, tokens = int(workers), int(tokens)
out = {}
with gpunet.Client(initial_peers=[boot], network=network, data_dir=data_dir) as client:
    deadline = time.monotonic() + 180
    while len(client.workers(refresh=True)) < workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(client.workers())} of {workers} workers seen")
        time.sleep(0.5)

    def timed(job, x, warm, n):
        """The median seconds of n jobs in a row, after warm ones (the program cached on the workers first)."""
        times = []
        for i in range(warm + n):
            t0 = time.perf_counter()
            client.submit(job, x).result(timeout=600)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[warm:])

    torch.manual_seed(0)
    x = torch.randn(1, 4)
    out["tiny_p50_ms"] = 1e3 * timed(gpunet.Job.from_module(torch.nn.Linear(4, 4), (x,)), x, 3, 20)
    big = torch.randn(BULK // 4 // 1024, 1024)
    out["bulk_s"] = timed(gpunet.Job.from_function(lambda t: t.sum(0, keepdim=True), (big,)), big, 1, 3)
    _, tok = load(folder)
    ids = tok("the volunteers run workers on their home machines and", return_tensors="pt").input_ids
    lm = client.causal_lm(folder, max_length=ids.shape[1] + tokens + 8, spans=SPANS)
    lm.generate(ids, max_new_tokens=2, do_sample=False)  # spans placed, programs loaded

    def rate(**draft):
        arrived = [time.perf_counter() for _ in lm.stream(ids, max_new_tokens=tokens, do_sample=False, **draft)]
        return (len(arrived) - 1) / (arrived[-1] - arrived[0])

    out["session_tps"] = rate()
    # Speculative decoding, 4 proposals a step: a draft that always agrees (the served weights themselves: the
    # ceiling of a well-matched draft) and one that nearly never does (another random model).
    for name, draft in (("same", folder), ("other", other)):
        out[f"draft_{name}_tps"] = rate(draft=draft, draft_tokens=4)
        out[f"draft_{name}_kept"] = lm.last.draft_accepted / max(1, lm.last.draft_proposed)
print(json.dumps(out), flush=True)
'''.replace("BULK", str(BULK_BYTES)).replace("SPANS", str(SPANS))


def measure(profile_name: str, path: str, folder: Path, other: Path, tokens: int, far_relay: bool = False) -> dict:
    """One profile over one path, in a lab and network of its own."""
    profile = PROFILES[profile_name]
    lab_type = LinkLab if path == "direct" else NatLab
    kwargs = {"hosts_count": SPANS} if path == "direct" else {"homes_count": SPANS}
    if path == "punched":  # public nodes at 4 distinct addresses: what go-libp2p needs before it punches
        kwargs["observers"] = 4
    if path != "direct" and far_relay:
        kwargs["far_relays"] = True
    with tempfile.TemporaryDirectory() as tmp, lab_type(profile=profile, **kwargs) as lab, \
            LocalNetwork(Path(tmp), network="bench-wan", heartbeat=2.0) as net:
        homes = lab.hosts if path == "direct" else [h.ns for h in lab.homes]
        publics = lab.public_addrs if path != "direct" else [lab.public_addr]
        boots = [net.start_bootstrap(ns=lab.public if path == "direct" else lab.relay_ns,
                                     host_maddrs=f"/ip4/{addr}/tcp/0") for addr in publics]
        boot = boots[0]
        procs = [net.start_worker("--threads", "1", ns=ns, wait_online=False, initial_peers=boots,
                                  host_maddrs=f"/ip4/{lab.addrs[i]}/tcp/0" if path == "direct" else
                                  "/ip4/0.0.0.0/tcp/0") for i, ns in enumerate(homes)]
        for proc in procs:
            net.wait_online(proc)
        row: dict = {"profile": profile_name, "path": path, "one_way_ms": profile.one_way_ms,
                     "far_relay": far_relay and path != "direct"}
        if path == "direct":  # the floors (the same links behind the NAT routers)
            row["floor_round_trip_ms"] = lab.round_trip_ms(lab.public, homes[0], lab.addrs[0])
            row["floor_bulk_s"] = lab.tcp_seconds(lab.public, homes[0], lab.addrs[0], BULK_BYTES)
        done = subprocess.run(lab.exec_argv(lab.public, [sys.executable, "-c", _CLIENT, boot, net.network,
                                                          str(Path(tmp) / "client"), str(folder), str(other),
                                                          str(SPANS), str(tokens)]),
                              capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            raise RuntimeError(f"{profile_name}/{path}: the client failed: {done.stderr[-3000:]}")
        lab.check_delayers()  # (the figures are the profile's only if every home's delay held throughout)
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        if path == "punched":  # pairs of homes joined by a direct TCP connection (each home sees the other's router)
            seen = [lab.tcp_peers(h.ns) for h in lab.homes]
            row["punched_pairs"] = sum(lab.homes[j].router_public in seen[i]
                                       for i in range(SPANS) for j in range(i + 1, SPANS))
        # A token's transits into delayed namespaces: client -> span 1 -> ... -> span n -> client is n into homes;
        # through a far relay every leg first arrives there (the relayed path: 2n + 1), a punched path only the
        # client's two (n + 2).
        transits = (SPANS if not row["far_relay"] else 2 * SPANS + 1 if path == "relayed" else SPANS + 2)
        row["floor_session_tps"] = (1 / profile.floor_token_s(transits)) if profile.one_way_ms else None
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profiles", default="lan,city,continent,world")
    parser.add_argument("--paths", default="direct,relayed")
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--far-relay", action="store_true",
                        help="the relays as far from everyone as a home is (a relayed transit: two legs)")
    args = parser.parse_args()
    why = LinkLab.available(latency=True)
    if why:
        raise SystemExit(f"bench_wan needs network namespaces: {why}")
    folder = Path(tempfile.mkdtemp(prefix="gpunet-bench-wan-")) / "ckpt"
    shape = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128)
    save_checkpoint(folder, "llama", seed=0, **shape)
    other = save_checkpoint(folder.parent / "other", "llama", seed=1, **shape)  # a draft that nearly never agrees
    rows, floors = [], {}
    try:
        for name in args.profiles.split(","):
            for path in args.paths.split(","):
                t0 = time.perf_counter()
                row = measure(name, path, folder, other, args.tokens, args.far_relay)
                floors.setdefault(name, {k: row[k] for k in ("floor_round_trip_ms", "floor_bulk_s") if k in row})
                row.update({k: v for k, v in floors[name].items() if k not in row})
                row["bench_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"# {name}/{path}: done in {row['bench_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    result = {"benchmark": "wan", "spans": SPANS, "tokens": args.tokens, "bulk_bytes": BULK_BYTES, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'profile':>10} {'path':>8} | {'tiny p50':>9} {'floor':>7} | {'8 MiB':>7} {'floor':>7} | "
          f"{'session tok/s':>13} {'floor':>7} | {'draft agrees':>12} {'x':>5} | {'draft does not':>14} {'x':>5}")
    for r in rows:
        floor_tps = f"{r['floor_session_tps']:.1f}" if r.get("floor_session_tps") else "-"
        print(f"{r['profile']:>10} {r['path']:>8} | {r['tiny_p50_ms']:>7.1f}ms "
              f"{r.get('floor_round_trip_ms', 0):>5.1f}ms | {r['bulk_s']:>6.2f}s {r.get('floor_bulk_s', 0):>6.2f}s | "
              f"{r['session_tps']:>13.1f} {floor_tps:>7} | {r['draft_same_tps']:>12.1f} "
              f"{r['draft_same_tps'] / r['session_tps']:>5.2f} | {r['draft_other_tps']:>14.1f} "
              f"{r['draft_other_tps'] / r['session_tps']:>5.2f}")
    for r in rows:
        if "punched_pairs" in r:
            print(f"{r['profile']}/punched: {r['punched_pairs']} of {SPANS * (SPANS - 1) // 2} pairs of homes joined "
                  "directly when measured")


if __name__ == "__main__":
    main()
