"""Hardware detection against FakeNVML (this machine has no GPU), the CPU path for real, and the throughput cache."""

import itertools
from types import SimpleNamespace

import pytest

from gpunet.errors import ConfigError
from gpunet.worker import hardware as hw
from gpunet.worker import throughput
from gpunet.worker.doctor import Verdict, check_gpu, check_reachability, run_checks


class FakeNVML:
    """A stand-in for pynvml with made-up GPUs: NVML needs NVIDIA hardware this CI machine lacks."""

    def __init__(self, gpus=(("NVIDIA GeForce RTX 4090", 24 * 2**30, 20 * 2**30, 37),), fail_init=False):
        self.gpus = gpus
        self.fail_init = fail_init
        self.initialised = 0

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        return "550.54.14"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h][0].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self.gpus[h][1], free=self.gpus[h][2], used=self.gpus[h][1] - self.gpus[h][2])

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.gpus[h][3], memory=0)


def test_gpus_are_read_through_nvml():
    nvml = FakeNVML(gpus=(("A100", 80 * 2**30, 70 * 2**30, 10), ("A100", 80 * 2**30, 60 * 2**30, 30)))
    found = hw.detect("auto", nvml)
    assert found.info.kind == "cuda" and found.info.count == 2 and found.info.name == "A100"
    assert found.info.memory_free == 60 * 2**30 and found.info.utilization == 20.0
    assert found.info.driver == "550.54.14" and found.info.cuda == "12.4"
    assert found.torch_device == "cuda:0" and found.indices == (0, 1)
    one = hw.detect("cuda:1", nvml)
    assert one.info.count == 1 and one.torch_device == "cuda:1" and one.info.memory_free == 60 * 2**30
    assert nvml.initialised == 0  # every init was matched by a shutdown


def test_without_nvml_or_gpu_the_cpu_is_served():
    for nvml in (FakeNVML(fail_init=True), FakeNVML(gpus=())):
        found = hw.detect("auto", nvml)
        assert found.info.kind == "cpu" and found.torch_device == "cpu"
        assert found.info.cores >= 1 and found.info.memory_total > found.info.memory_free > 0
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        hw.detect("cuda:0", FakeNVML(fail_init=True))
    with pytest.raises(ConfigError, match="GPUs 0..0"):
        hw.detect("cuda:3", FakeNVML())
    with pytest.raises(ConfigError):
        hw.detect("tpu", FakeNVML())


def test_throughput_is_measured_once_then_cached(tmp_path, monkeypatch):
    cpu = hw.cpu_hardware()
    first = throughput.benchmark(cpu, tmp_path)
    assert first["fp32"] > 0 and set(first) == {"fp32", "bf16"}
    monkeypatch.setattr(throughput, "measure_matmul_tflops", lambda *a, **k: pytest.fail("should use the cache"))
    assert throughput.benchmark(cpu, tmp_path) == first
    monkeypatch.setattr(throughput, "measure_matmul_tflops", lambda *a, **k: 123.0)
    assert throughput.benchmark(cpu, tmp_path, rebenchmark=True) == {"fp32": 123.0, "bf16": 123.0}


def test_a_cpu_speed_is_cached_per_thread_count(tmp_path, monkeypatch):
    """`gpunet worker --threads N` measures the speed N threads give: a figure taken with another count is not read."""
    cpu = hw.cpu_hardware()
    measured = itertools.count(1.0)  # each measurement a new figure
    monkeypatch.setattr(throughput, "measure_matmul_tflops", lambda *a, **k: next(measured))
    one = throughput.benchmark(cpu, tmp_path, threads=1)
    two = throughput.benchmark(cpu, tmp_path, threads=2)
    assert two != one and throughput.benchmark(cpu, tmp_path, threads=1) == one  # measured once per count, both kept
    assert hw.job_threads(3) == 3 and hw.job_threads(None, 1) >= hw.job_threads(None, 2) >= 1


def test_an_idle_remeasurement_replaces_a_figure_taken_under_load(tmp_path, monkeypatch):
    """The published figure is the best of the last few measurements: one from a busy moment neither sticks forever
    nor drags a good figure down; a lasting change shows once the good one has aged out."""
    cpu = hw.cpu_hardware()
    readings = iter([0.02, 0.12, 0.03, 0.05, 0.05, 0.05])
    monkeypatch.setattr(throughput, "_measure", lambda hardware: {"fp32": next(readings)})
    assert throughput.benchmark(cpu, tmp_path) == {"fp32": 0.02}  # started while the machine was busy
    assert throughput.remeasure(cpu, tmp_path) == {"fp32": 0.12}  # measured again while idle
    assert throughput.remeasure(cpu, tmp_path) == {"fp32": 0.12}  # a busy moment does not drag it down
    assert throughput.benchmark(cpu, tmp_path) == {"fp32": 0.12}  # and a restart publishes the same
    assert throughput.remeasure(cpu, tmp_path) == {"fp32": 0.12}
    assert throughput.remeasure(cpu, tmp_path) == {"fp32": 0.05}  # slower for good: shows after RECENT rounds
    assert throughput.benchmark(cpu, tmp_path, rebenchmark=True) == {"fp32": 0.05}  # --rebenchmark starts afresh


def test_a_cache_written_before_remeasurement_is_still_read(tmp_path, monkeypatch):
    import json

    cpu = hw.cpu_hardware()
    (tmp_path / throughput.CACHE_FILENAME).write_text(json.dumps({throughput._cache_key(cpu): {"fp32": 0.07}}))
    monkeypatch.setattr(throughput, "_measure", lambda hardware: pytest.fail("should use the cache"))
    assert throughput.benchmark(cpu, tmp_path) == {"fp32": 0.07}
    (tmp_path / throughput.CACHE_FILENAME).write_text("{not json")
    monkeypatch.setattr(throughput, "_measure", lambda hardware: {"fp32": 0.09})
    assert throughput.benchmark(cpu, tmp_path) == {"fp32": 0.09}  # a damaged cache is measured again


def test_doctor_reports_gpu_and_reachability():
    assert check_gpu("auto", hw.read_nvml(FakeNVML(fail_init=True)))[0].outcome is Verdict.WARN
    assert check_gpu("cuda:0", hw.read_nvml(FakeNVML(fail_init=True)))[0].outcome is Verdict.FAIL
    gpu_checks = check_gpu("auto", hw.read_nvml(FakeNVML()))
    assert gpu_checks[0].outcome is Verdict.PASS and "RTX 4090" in gpu_checks[0].detail
    assert gpu_checks[1].outcome is Verdict.FAIL  # the CPU build of torch cannot use it: say so
    assert check_reachability(["/ip4/127.0.0.1/tcp/0"]).outcome is Verdict.FAIL
    assert check_reachability(["/ip4/192.168.1.5/tcp/0"]).outcome is Verdict.WARN
    assert check_reachability(["/ip4/8.8.8.8/tcp/31337"]).outcome is Verdict.PASS


def test_doctor_runs_every_check(tmp_path):
    checks = {c.name: c for c in run_checks(data_dir=tmp_path, nvml=FakeNVML(fail_init=True))}
    assert set(checks) == {"gpu", "cpu", "ram", "disk", "models", "reachability", "network", "clock"}
    assert checks["disk"].outcome in (Verdict.PASS, Verdict.WARN)
    assert checks["models"].outcome is Verdict.SKIP and "weights from clients" in checks["models"].detail
    assert checks["network"].outcome is Verdict.SKIP and checks["network"].advice


def test_a_dtype_the_device_only_emulates_is_measured_at_a_smaller_size(monkeypatch):
    """bf16 on a CPU without native support takes seconds per 1024 product: the worker's start must not wait for
    four of them, so a product that alone would outlast the measurement is measured smaller."""
    import torch

    sizes = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: sizes.append(a.shape[0]) or real(a, b))
    monkeypatch.setattr(throughput, "_seconds_per_product", lambda *a: 0.1)  # at 256: 6.4 s at 1024
    assert throughput.measure_matmul_tflops("cpu", torch.float32, 1024) > 0
    assert set(sizes) == {256}
    sizes.clear()
    monkeypatch.setattr(throughput, "_seconds_per_product", lambda *a: 0.001)  # 64 ms at 1024: measured as asked
    assert throughput.measure_matmul_tflops("cpu", torch.float32, 1024) > 0
    assert set(sizes) == {1024}
