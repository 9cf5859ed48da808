"""The worker registry: workers announce themselves under sharded keys; anyone lists them by reading every bucket."""

from __future__ import annotations

import asyncio
from functools import partial

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from gpunet.dht.records import (  # WorkerEntry: re-exported, discovery's result
    WorkerEntry,
    WorkerRecord,
    WorkerState,
    worker_bucket,
    worker_key,
    worker_keys,
)
from gpunet.dht.validation import MAX_RECORD_TTL
from gpunet.errors import GpunetError, NetworkError

#: The longest one bucket's search may take before the listing goes on without it: just under discover()'s 30 s, so
#: a slow honest bucket still comes back when it would have, and a client's listing (which has no limit of its own)
#: never waits for ever on one.
BUCKET_TIMEOUT = 28.0
#: Buckets read by one DHT search (see _read_buckets).
BUCKETS_PER_SEARCH = 16


def announce(
    dht: DHT, network: str, worker_id: str, record: WorkerRecord, expiration_time: float
) -> bool:
    """Store (or refresh) this worker's record; True when at least one peer (or we) accepted it."""
    return bool(_store(dht, network, worker_id, record, expiration_time).result())


async def announce_async(
    dht: DHT, network: str, worker_id: str, record: WorkerRecord, expiration_time: float
) -> bool:
    return bool(await _store(dht, network, worker_id, record, expiration_time))


def _store(dht: DHT, network: str, worker_id: str, record: WorkerRecord, expiration_time: float):
    key = worker_key(network, worker_bucket(worker_id))
    return dht.store(key, record.to_wire(), expiration_time=expiration_time, subkey=worker_id, return_future=True)


def discover(dht: DHT, network: str, *, include_offline: bool = False, timeout: float = 30.0) -> list[WorkerEntry]:
    """Every live worker of ``network``, read from all buckets concurrently, sorted by id."""
    future = dht.run_coroutine(partial(_read_buckets, keys=worker_keys(network)), return_future=True)
    try:
        raw = future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise NetworkError(f"listing the workers of {network!r} took over {timeout:.0f} s") from None
    return _entries(raw, include_offline)


async def discover_async(dht: DHT, network: str, *, include_offline: bool = False) -> list[WorkerEntry]:
    raw = await dht.run_coroutine(partial(_read_buckets, keys=worker_keys(network)), return_future=True)
    return _entries(raw, include_offline)


def _entries(raw: list[tuple[str, object, float]], include_offline: bool) -> list[WorkerEntry]:
    now = get_dht_time()
    entries = {}
    for worker_id, value, expiration in raw:
        if expiration < now:
            continue
        try:
            record = WorkerRecord.from_wire(value)
        except GpunetError:
            continue  # the DHT validated it; a newer format we cannot read is skipped, never fatal
        if record.state is WorkerState.OFFLINE and not include_offline:
            continue
        entries[worker_id] = WorkerEntry(worker_id, record, expiration)
    return [entries[k] for k in sorted(entries)]


async def _read_buckets(_dht: DHT, node, keys: list[str]) -> list[tuple[str, object, float]]:
    """Runs inside the DHT process: the latest value of every bucket, in a few searches of BUCKETS_PER_SEARCH.

    One search of several keys asks each node it reaches for about the square root of them at once (hivemind's
    ``queries_per_call``: 4 of 16), so a reply holds at most 4 buckets (~1 MiB at 60,000 workers of 1 KiB records;
    the daemon refuses 4 MiB); a search per key cost 4 to 8 times as many requests (about 160 ms of CPU per listing
    on the reader and as much on a 4-node network). A search that fails costs its group of buckets, not the listing.
    """
    futures: dict = {}
    for start in range(0, len(keys), BUCKETS_PER_SEARCH):
        futures.update(await node.get_many(keys[start:start + BUCKETS_PER_SEARCH],
                                           sufficient_expiration_time=float("inf"), return_futures=True))

    async def one(key: str):
        # A search that never ends (a reader-side failure inside hivemind leaves its future unset) costs its buckets
        # for a while, never the whole listing, nor a client's every refresh (waiting stops that key's search).
        return await asyncio.wait_for(futures[key], BUCKET_TIMEOUT)

    results = await asyncio.gather(*(one(key) for key in keys), return_exceptions=True)
    if keys and all(isinstance(r, BaseException) for r in results):
        raise NetworkError(f"no bucket of the worker list could be read ({type(results[0]).__name__})")
    out = []
    for result in results:
        if isinstance(result, BaseException) or result is None or not isinstance(result.value, dict):
            continue
        for subkey, item in result.value.items():
            if isinstance(subkey, str):
                out.append((subkey, item.value, item.expiration_time))
    return out


def default_ttl(heartbeat: float) -> float:
    """Records live for three heartbeats (one missed refresh does not drop a worker, a dead one goes soon), and
    never longer than validators accept."""
    return min(3.0 * heartbeat, MAX_RECORD_TTL - 60.0)

