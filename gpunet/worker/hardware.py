"""What this machine can compute on: GPUs through NVML (nvidia-ml-py), otherwise the CPU.

NVML is passed in as a module-like object so tests can hand in ``FakeNVML`` (this machine has no GPU); production code
uses ``pynvml`` from nvidia-ml-py. Detection never raises for a missing driver: a host without one is a CPU worker.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass
from typing import Any

from gpunet.config import usable_cpus
from gpunet.dht.records import MAX_DEVICE_NAME, DeviceInfo, printable
from gpunet.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hardware:
    """The device a worker serves: its record for the DHT and the torch device string its jobs run on."""

    info: DeviceInfo
    torch_device: str  # "cpu" or "cuda:N"
    indices: tuple[int, ...] = ()  # NVML indices of the GPUs served

    @property
    def is_gpu(self) -> bool:
        return self.info.kind == "cuda"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_total: int
    memory_free: int
    utilization: float | None


@dataclass(frozen=True)
class NvmlReport:
    driver: str
    cuda: str | None
    gpus: tuple[GpuInfo, ...]


def _load_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any | None = None) -> NvmlReport | None:
    """Query every GPU through NVML; None when there is no NVML library, no driver or no GPU."""
    nvml = nvml if nvml is not None else _load_pynvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        logger.debug("NVML unavailable: %s", e)
        return None
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda_int = int(nvml.nvmlSystemGetCudaDriverVersion())
            cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        except Exception:
            cuda = None
        gpus = []
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                utilization = None
            gpus.append(
                GpuInfo(index, _text(nvml.nvmlDeviceGetName(handle)), int(memory.total), int(memory.free), utilization)
            )
        return NvmlReport(driver, cuda, tuple(gpus)) if gpus else None
    except Exception as e:
        logger.warning("NVML query failed, treating this host as CPU-only: %s", e)
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") or line.startswith("Features"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def memory_bytes() -> tuple[int, int]:
    """(total, available) RAM in bytes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return total, available


def job_threads(threads: int | None = None, processes: int = 1) -> int:
    """CPU threads one job may use: ``threads`` (gpunet worker --threads), else the CPUs this process may run on
    (its affinity: taskset, a container's cpuset), shared among ``processes`` executors."""
    if threads:
        return threads
    return max(1, usable_cpus() // processes)


def cpu_hardware() -> Hardware:
    total, available = memory_bytes()
    info = DeviceInfo(
        kind="cpu", name=printable(cpu_model(), MAX_DEVICE_NAME), count=1, memory_total=total, memory_free=available,
        cores=usable_cpus()
    )
    return Hardware(info=info, torch_device="cpu")


def detect(device: str = "auto", nvml: Any | None = None) -> Hardware:
    """The hardware to serve for ``--device auto|cpu|cuda:N``.

    ``auto`` serves every GPU NVML reports (jobs run on the first, executors spread later), else the CPU.
    ``cuda:N`` serves GPU N and fails clearly if it does not exist.
    """
    if device == "cpu":
        return cpu_hardware()
    if device != "auto" and not device.startswith("cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda:N, not {device!r}")
    report = read_nvml(nvml)
    if report is None:
        if device != "auto":
            raise ConfigError(f"--device {device}: no NVIDIA GPU or driver found (run `gpunet doctor`)")
        return cpu_hardware()
    if device == "auto":
        chosen = report.gpus
    else:
        try:
            index = int(device.split(":", 1)[1]) if ":" in device else 0
        except ValueError:
            raise ConfigError(f"--device {device!r}: expected cuda:N") from None
        chosen = tuple(g for g in report.gpus if g.index == index)
        if not chosen:
            raise ConfigError(f"--device {device}: this host has GPUs 0..{len(report.gpus) - 1}")
    utilizations = [g.utilization for g in chosen if g.utilization is not None]
    info = DeviceInfo(
        kind="cuda",
        name=printable(chosen[0].name, MAX_DEVICE_NAME),
        count=len(chosen),
        memory_total=min(g.memory_total for g in chosen),
        memory_free=min(g.memory_free for g in chosen),
        cores=os.cpu_count() or 1,
        driver=printable(report.driver, 32) if report.driver else None,
        cuda=printable(report.cuda, 16) if report.cuda else None,
        utilization=sum(utilizations) / len(utilizations) if utilizations else None,
    )
    return Hardware(info=info, torch_device=f"cuda:{chosen[0].index}", indices=tuple(g.index for g in chosen))


def refresh(hardware: Hardware, nvml: Any | None = None) -> Hardware:
    """Re-read free memory and utilisation for a heartbeat (cheap: NVML or /proc/meminfo)."""
    if not hardware.is_gpu:
        _, available = memory_bytes()
        return Hardware(hardware.info.model_copy(update={"memory_free": available}), hardware.torch_device)
    report = read_nvml(nvml)
    if report is None:
        return hardware
    chosen = [g for g in report.gpus if g.index in hardware.indices]
    if not chosen:
        return hardware
    utilizations = [g.utilization for g in chosen if g.utilization is not None]
    update = {
        "memory_free": min(g.memory_free for g in chosen),
        "utilization": sum(utilizations) / len(utilizations) if utilizations else None,
    }
    return Hardware(hardware.info.model_copy(update=update), hardware.torch_device, hardware.indices)
