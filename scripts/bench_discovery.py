#!/usr/bin/env python
"""How long a client takes to list the whole network as it grows, and what it moves.

Starts a real local network (a bootstrap node and N real worker processes on 127.0.0.1), then grows it with synthetic
signed worker records written by a few writer nodes (each holding the keys of many synthetic workers), up to 1,000 and
10,000 workers. At each size a fresh client node times full listings (every bucket, every record signature- and
schema-checked). Baseline in the same run: hivemind's own ``get`` of ONE key holding a value of the same total size,
i.e. the same bytes without sharding, signatures or schema checks.

    python scripts/bench_discovery.py [--workers 8] [--sizes 1000 10000] [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hivemind  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from gpunet.dht import network, registry  # noqa: E402
from gpunet.dht.records import DeviceInfo, WorkerRecord, worker_bucket, worker_key  # noqa: E402
from gpunet.dht.validation import SIGNATURE_TAG  # noqa: E402
from gpunet.identity import Identity  # noqa: E402
from gpunet.testing import LOOPBACK, LocalNetwork, wait_for  # noqa: E402

NETWORK = "bench"
WRITERS = 4


def synthetic_record(i: int) -> WorkerRecord:
    return WorkerRecord(
        version="0.1.0",
        state="online",
        device=DeviceInfo(kind="cuda", name="NVIDIA GeForce RTX 4090", memory_total=24 * 2**30,
                          memory_free=20 * 2**30, cores=16, driver="550.54.14", cuda="12.4", utilization=12.0),
        tflops={"fp32": 82.6, "fp16": 165.2, "bf16": 165.2},
        price=1.0 + (i % 7) / 10,
        max_concurrent=2,
        queue=i % 3,
        jobs_done=i,
        started_at=time.time() - 3600,
        updated_at=time.time(),
        name=f"synthetic-{i}",
        maddrs=[f"/ip4/127.0.0.1/tcp/{20000 + i % 40000}/p2p/12D3KooWSyntheticAddressPlaceholderXXXXXXXXXXXXXXXX"],
    )


def synthetic_identity(i: int) -> Identity:
    """Deterministic keys, so the writer's DHT process can rebuild them from an index (its pipe takes only small
    messages: hivemind's DHT pipe is non-blocking and fails on large pickles)."""
    seed = hashlib.sha256(f"gpunet-bench-worker-{i}".encode()).digest()
    return Identity(Ed25519PrivateKey.from_private_bytes(seed))


async def _store_range(_dht, node, indices: range) -> int:
    """Runs inside a writer's DHT process: sign-and-store synthetic records for ``indices`` in batches."""
    stored = 0
    expiration = get_dht_time() + 500
    for lo in range(0, len(indices), 250):
        batch = indices[lo : lo + 250]
        ids = [synthetic_identity(i).peer_id for i in batch]
        ok = await node.store_many(
            [worker_key(NETWORK, worker_bucket(peer_id)) for peer_id in ids],
            [synthetic_record(i).to_wire() for i in batch],
            [expiration] * len(batch),
            subkeys=ids,
        )
        stored += sum(bool(v) for v in ok.values())
    return stored


def write_synthetic(bootstrap: str, start: int, stop: int) -> int:
    """Write records start..stop-1 from WRITERS nodes, each signing for its share of synthetic identities."""
    shares = [range(start + w, stop, WRITERS) for w in range(WRITERS)]
    writers = [
        network.join(NETWORK, [bootstrap], host_maddrs=[LOOPBACK], signing_identities=map(synthetic_identity, share))
        for share in shares
    ]
    try:
        futures = [w.run_coroutine(partial(_store_range, indices=share), return_future=True) for w, share in zip(writers, shares)]
        return sum(f.result(timeout=900) for f in futures)
    finally:
        for w in writers:
            w.shutdown()


def wire_bytes(entries) -> int:
    """Signed record bytes a listing delivers (msgpack value + signature footer + subkey)."""
    import msgpack

    return sum(len(msgpack.packb(e.record.to_wire())) + len(SIGNATURE_TAG) + 64 + len(e.id) for e in entries)


def time_listing(bootstrap: str, expected: int, repeats: int) -> dict:
    client = network.join_as_client(NETWORK, [bootstrap])
    try:
        # Wait until replication settled and the whole network is visible, then time steady-state listings.
        wait_for(lambda: len(registry.discover(client, NETWORK)) >= expected, 120, f"{expected} workers listed")
        times, counts = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            entries = registry.discover(client, NETWORK)
            times.append(time.perf_counter() - t0)
            counts.append(len(entries))
        nbytes = wire_bytes(entries)
    finally:
        client.shutdown()
    return {"p50_s": statistics.median(times), "min_s": min(times), "listed": min(counts), "bytes": nbytes}


async def _store_blob(_dht, node, key, nbytes):
    # Built inside the DHT process: hivemind's DHT pipe is non-blocking and breaks on messages over ~4 KiB.
    return await node.store(key, b"x" * nbytes, get_dht_time() + 300)


async def _get_one(_dht, node, key):
    result = await node.get(key, latest=True)
    return 0 if result is None else len(result.value)


def time_baseline(bootstrap: str, nbytes: int, repeats: int) -> dict:
    """hivemind's plain get of one unsigned key whose value has the same size as the whole listing."""
    writer = hivemind.DHT(initial_peers=[bootstrap], start=True, host_maddrs=[LOOPBACK])
    client = hivemind.DHT(initial_peers=[bootstrap], start=True, client_mode=True, host_maddrs=[LOOPBACK])
    key = f"baseline-{nbytes}"
    try:
        assert writer.run_coroutine(partial(_store_blob, key=key, nbytes=min(nbytes, 4_000_000)))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            got = client.run_coroutine(partial(_get_one, key=key))
            times.append(time.perf_counter() - t0)
            assert got > 0
    finally:
        client.shutdown()
        writer.shutdown()
    return {"p50_s": statistics.median(times), "bytes": min(nbytes, 4_000_000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8, help="real worker processes")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000], help="network sizes to grow to")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rows = []
    with LocalNetwork(network=NETWORK, heartbeat=5.0) as net:
        bootstrap = net.start_bootstrap()
        net.start_workers(args.workers)
        sizes = [args.workers, *[s for s in args.sizes if s > args.workers]]
        present = args.workers
        for size in sizes:
            if size > present:
                t0 = time.perf_counter()
                stored = write_synthetic(bootstrap, present, size)
                print(f"  wrote {stored} synthetic records in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
                present = size
            listing = time_listing(bootstrap, size, args.repeats)
            baseline = time_baseline(bootstrap, listing["bytes"], args.repeats)
            rows.append({
                "workers": size,
                "listed": listing["listed"],
                "p50_s": round(listing["p50_s"], 4),
                "us_per_worker": round(listing["p50_s"] / size * 1e6, 1),
                "bytes": listing["bytes"],
                "baseline_one_key_p50_s": round(baseline["p50_s"], 4),
                "baseline_bytes": baseline["bytes"],
            })
            r = rows[-1]
            print(
                f"{size:>6} workers: full listing p50 {r['p50_s'] * 1000:8.1f} ms ({r['us_per_worker']:6.1f} us/worker), "
                f"{r['bytes'] / 1024:8.1f} KiB of records, listed {r['listed']} | baseline: one hivemind key of "
                f"{r['baseline_bytes'] / 1024:.0f} KiB {r['baseline_one_key_p50_s'] * 1000:.1f} ms",
                flush=True,
            )
    if args.json:
        print(json.dumps({"benchmark": "discovery", "rows": rows}))


if __name__ == "__main__":
    main()
