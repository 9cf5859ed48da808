"""Measure and cache how fast this device multiplies matrices, per dtype; routing divides a job's FLOPs by it.

The measurement takes a second or two, so it is cached in the data dir keyed by device name, device kind and torch
version: a restarted worker is up at once; a new driver/torch or ``--rebenchmark`` measures again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from gpunet.worker.hardware import Hardware

logger = logging.getLogger(__name__)

CACHE_FILENAME = "throughput.json"


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
    """Best-of-repeats TFLOPS of an n x n matmul: the sustained peak a compute-bound job can expect."""
    a = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda *a: None)
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


def _cache_key(hardware: Hardware) -> str:
    return f"{hardware.info.kind}|{hardware.info.name}|{hardware.info.count}|torch {torch.__version__}"


def benchmark(hardware: Hardware, data_dir: Path, rebenchmark: bool = False) -> dict[str, float]:
    """TFLOPS per dtype name for ``hardware``, from the cache unless absent or ``rebenchmark``."""
    path = Path(data_dir) / CACHE_FILENAME
    key = _cache_key(hardware)
    cache: dict = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    cached = cache.get(key)
    if cached and not rebenchmark and isinstance(cached, dict):
        return {str(k): float(v) for k, v in cached.items()}
    n = 4096 if hardware.is_gpu else 1024
    logger.info("Measuring this device's speed (once; cached in %s)", path)
    result = {}
    for dtype in supported_dtypes(hardware):
        result[dtype_name(dtype)] = round(measure_matmul_tflops(hardware.torch_device, dtype, n), 4)
    cache[key] = result
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)
    return result
