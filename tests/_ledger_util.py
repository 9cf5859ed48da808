"""Receipts for ledger tests, made through the real flow: the worker signs, the client checks and countersigns."""

from __future__ import annotations

import hashlib

from gpunet.ledger import (
    Identity,
    Receipt,
    attach_countersignature,
    countersign,
    sign_as_worker,
)

T0_US = 1_767_225_600_000_000  # 2026-01-01 UTC


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def worker_signed(
    worker: Identity,
    client: Identity,
    job_id: str,
    *,
    flops: int = 3 * 10**12,
    price: int = 2_500_000,
    max_price: int | None = 3_000_000,
    ended_at_us: int = T0_US + 20_000,
    lane: str = "interactive",
) -> Receipt:
    return sign_as_worker(
        worker,
        job_id=job_id,
        client_id=client.peer_id,
        program_hash=digest("program"),
        input_hash=digest(f"in-{job_id}"),
        output_hash=digest(f"out-{job_id}"),
        flops=flops,
        wall_time_us=12_345,
        price=price,
        max_price=max_price,
        started_at_us=min(T0_US, ended_at_us),
        ended_at_us=ended_at_us,
        lane=lane,
    )


def full_receipt(worker: Identity, client: Identity, job_id: str, **terms) -> Receipt:
    half = worker_signed(worker, client, job_id, **terms)
    signed = countersign(half, client, output_hash=half.output_hash, max_price=half.max_price, flops=half.flops,
                         lane=half.lane)
    return attach_countersignature(half, signed.client_signature)
