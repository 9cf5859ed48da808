"""Measure and cache how fast this device multiplies matrices, per dtype; routing divides a job's FLOPs by it.

The measurement takes a second or two, so it is cached in the data dir keyed by device name, device kind and torch
version: a restarted worker is up at once; a new driver/torch or ``--rebenchmark`` measures again.

A figure taken while the machine was busy (two workers starting together measured 0.02 TFLOPS, later 0.05-0.16) would
otherwise stay forever, so a running worker measures again now and then while it has no jobs (:func:`remeasure`).
The published figure is the best of the last :data:`RECENT` measurements: one taken at a bad moment cannot drag it
down, while a lasting change (a throttled or replaced card) shows within a few rounds.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from gpunet.worker.hardware import Hardware, job_threads

logger = logging.getLogger(__name__)

CACHE_FILENAME = "throughput.json"
RECENT = 3  # measurements the published figure is the best of


def supported_dtypes(hardware: Hardware) -> list[torch.dtype]:
    """fp32 everywhere; bf16 and fp16 where the device runs them natively."""
    if not hardware.is_gpu:
        return [torch.float32, torch.bfloat16]
    dtypes = [torch.float32, torch.float16]
    with torch.cuda.device(hardware.torch_device):
        if torch.cuda.is_bf16_supported():
            dtypes.append(torch.bfloat16)
    return dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def measure_matmul_tflops(device: str, dtype: torch.dtype, n: int, min_seconds: float = 0.25) -> float:
    """Best-of-repeats TFLOPS of an n x n matmul: the sustained peak a compute-bound job can expect.

    A dtype this device only emulates (bf16 on a CPU without AVX512-BF16 or AMX: 0.0005 TFLOPS on an AMD EPYC, where
    one 1024 product takes 3 s) is measured at a smaller size, found by timing a product of a quarter the size first:
    its figure is as low either way, and a worker's start is not held up for tens of seconds."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda *a: None)
    probe = max(n // 4, 64)
    estimate = _seconds_per_product(device, dtype, probe, sync) * (n / probe) ** 3
    while n > probe and estimate > min_seconds:  # one product alone would outlast the whole measurement
        n, estimate = n // 2, estimate / 8
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, allocator
    sync(device)
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
        reps += 1
        if reps >= 50:
            break
    return 2.0 * n**3 / best / 1e12


def _seconds_per_product(device: str, dtype: torch.dtype, n: int, sync) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    torch.matmul(a, a)  # warm-up
    sync(device)
    start = time.perf_counter()
    torch.matmul(a, a)
    sync(device)
    return time.perf_counter() - start


def _cache_key(hardware: Hardware, threads: int | None = None) -> str:
    """``threads``: a CPU's speed is that of the threads a job gets (gpunet worker --threads; None: the default
    count, :func:`~gpunet.worker.hardware.job_threads`): another count, another figure. The caller has set torch to
    that count before measuring."""
    key = f"{hardware.info.kind}|{hardware.info.name}|{hardware.info.count}|torch {torch.__version__}"
    return f"{key}|threads {job_threads(threads)}" if hardware.info.kind == "cpu" else key


def benchmark(hardware: Hardware, data_dir: Path, rebenchmark: bool = False, threads: int | None = None
              ) -> dict[str, float]:
    """TFLOPS per dtype name for ``hardware``, from the cache unless absent or ``rebenchmark``."""
    path = Path(data_dir) / CACHE_FILENAME
    key = _cache_key(hardware, threads)
    cache, recent = _read(path, key)
    if recent and not rebenchmark:
        logger.info("Using the speed measured earlier (cached in %s; --rebenchmark measures it again)", path)
        return _best(recent)
    logger.info("Measuring this device's speed (once; cached in %s)", path)
    return _record(path, hardware, cache, [], key)


def remeasure(hardware: Hardware, data_dir: Path, threads: int | None = None) -> dict[str, float]:
    """Measure again and return the figure to publish: the best of the last ``RECENT`` measurements (cached)."""
    path = Path(data_dir) / CACHE_FILENAME
    key = _cache_key(hardware, threads)
    cache, recent = _read(path, key)
    return _record(path, hardware, cache, recent, key)


def _measure(hardware: Hardware) -> dict[str, float]:
    n = 4096 if hardware.is_gpu else 1024
    return {dtype_name(dtype): round(measure_matmul_tflops(hardware.torch_device, dtype, n), 4)
            for dtype in supported_dtypes(hardware)}


def _best(recent: list[dict[str, float]]) -> dict[str, float]:
    names = {name for figures in recent for name in figures}
    return {name: max(figures.get(name, 0.0) for figures in recent) for name in sorted(names)}


def _read(path: Path, key: str) -> tuple[dict, list[dict[str, float]]]:
    """The whole cache file, and this device's recent measurements (newest last); a damaged file reads as empty."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, []
    if not isinstance(cache, dict):
        return {}, []
    entry = cache.get(key)
    if isinstance(entry, dict) and "recent" in entry:
        raw = entry["recent"]
    elif isinstance(entry, dict):
        raw = [entry]  # the layout before idle re-measurement: one figure per dtype
    else:
        raw = []
    recent = []
    for figures in raw if isinstance(raw, list) else []:
        if isinstance(figures, dict):
            try:
                recent.append({str(k): float(v) for k, v in figures.items()})
            except (TypeError, ValueError):
                continue
    return cache, recent[-RECENT:]


def _record(path: Path, hardware: Hardware, cache: dict, recent: list[dict[str, float]], key: str
            ) -> dict[str, float]:
    recent = [*recent, _measure(hardware)][-RECENT:]
    cache[key] = {"recent": recent}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)
    return _best(recent)
