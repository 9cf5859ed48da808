"""The program caches: bounded, least-recently-used out first, and hashes can never name a path."""

from __future__ import annotations

import os
import time

import pytest

from gpunet import JobRejected
from gpunet.worker.executor.cache import DiskCache, MemoryLRU, check_hash

H = [f"{i:064x}" for i in range(6)]


def test_memory_lru_bounds_items_and_bytes():
    lru = MemoryLRU(max_items=2, max_bytes=100)
    lru.put("a", 1, 10)
    lru.put("b", 2, 10)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3, 10)
    assert lru.keys() == ["a", "c"]
    lru.put("d", 4, 95)  # over the byte budget: evicts until it fits
    assert lru.keys() == ["d"]
    lru.put("huge", 5, 101)  # larger than the whole cache: not kept, nothing evicted
    assert lru.keys() == ["d"] and "huge" not in lru


def test_disk_cache_round_trip_and_lru_eviction(tmp_path):
    disk = DiskCache(tmp_path, max_bytes=250)
    for i, h in enumerate(H[:2]):
        disk.put(h, bytes([i]) * 100)
        os.utime(disk._path(h), (time.time() - 100 + i, time.time() - 100 + i))
    assert disk.get(H[0]) == bytes([0]) * 100  # touching H0 makes H1 the least recently used
    disk.put(H[2], b"x" * 100)
    assert H[0] in disk and H[2] in disk and H[1] not in disk
    assert sorted(disk.hashes()) == sorted([H[0], H[2]])
    assert disk.get(H[5]) is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_disk_cache_is_bounded_in_files_too(tmp_path):
    """A flood of tiny programs: bytes alone would let the directory (and every scan of it) grow without end."""
    disk = DiskCache(tmp_path, max_bytes=10**9, max_files=3)
    hashes = [f"{i:064x}" for i in range(10)]
    for i, h in enumerate(hashes):
        disk.put(h, b"x")
        os.utime(disk._path(h), (time.time() - 100 + i, time.time() - 100 + i))
    assert disk.hashes() == hashes[-3:]  # least recently used first
    stale = tmp_path / ".tmp-left-by-a-killed-executor"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    disk.put(hashes[0], b"y")
    assert not stale.exists() and len(list(tmp_path.iterdir())) == 3


def test_disk_cache_skips_programs_larger_than_itself(tmp_path):
    disk = DiskCache(tmp_path, max_bytes=10)
    disk.put(H[0], b"x" * 11)
    assert H[0] not in disk


@pytest.mark.parametrize("bad", ["../" * 3 + "etc/passwd", "A" * 64, "a" * 63, "a" * 64 + "/", "", None, "0" * 64 + "\n"])
def test_hashes_that_could_name_a_path_are_rejected(tmp_path, bad):
    with pytest.raises(JobRejected):
        check_hash(bad)
    assert bad not in DiskCache(tmp_path, 100)


def test_a_cached_program_runs_on_its_weights_where_they_lie_in_the_file(tmp_path):
    """The disk cache maps a program read-only and page-aligned, and gpunet's containers put every weight
    ALIGN-aligned, so loading copies none of them (one copy in the page cache, shared by the executors); a container
    written without that alignment (an older client) is still loaded, its weights copied into aligned memory."""
    import numpy as np
    import torch

    from gpunet import Job
    from gpunet.job import tensors
    from gpunet.job.format import ProgramParts
    from gpunet.job.interpreter import run_program
    from gpunet.job.validator import load_program

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    job = Job.from_module(model, (torch.randn(2, 64),))
    old = ProgramParts(job.parts.manifest, job.parts.graph, tensors.encode(tensors.decode(job.parts.weights)))
    disk = DiskCache(tmp_path, max_bytes=10**8)
    x = torch.randn(2, 64)
    for parts, where_they_lie in ((job.parts, True), (old, False)):
        disk.put(parts.hash, parts.to_bytes())
        data = disk.get(parts.hash)
        assert isinstance(data, memoryview) and data.readonly and bytes(data) == parts.to_bytes()
        start = np.frombuffer(data, dtype=np.uint8).ctypes.data
        prog = load_program(data, device="cpu", expected_hash=parts.hash)
        assert [start <= w.data_ptr() < start + len(data) for w in prog.weights] == [where_they_lie] * 4
        assert all(w.data_ptr() % tensors.ALIGN == 0 for w in prog.weights)
        assert torch.equal(run_program(prog, [x])[0], model(x))
