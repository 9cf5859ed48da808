"""What the owner is doing with their machine: the readings :mod:`gpunet.worker.state.availability` decides on.

:class:`SystemProbe` reads the machine as it is: the CPU time other processes used (``/proc``, everything but this
worker and its descendants: executors, DHT process, p2p daemon), and through NVML the processes on the GPUs and their
temperature. :class:`FakeGpuProbe` stands in for a GPU this machine lacks (tests: ``gpunet worker
--fake-gpu-probe FILE``, a JSON file the test rewrites); it says so in its name and in the worker's log.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from gpunet.worker.state.availability import Reading

logger = logging.getLogger("gpunet.worker")

_NVML_TEMPERATURE_GPU = 0


def _cpu_busy_and_total() -> tuple[int, int]:
    """Jiffies of all CPUs since boot: (busy, total); busy leaves out idle and iowait."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is within user)
    return total - fields[3] - fields[4], total


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, jiffies used by it and by its children it has reaped), for every process visible (an
    executor that dies is reaped by the worker: its time moves into the worker's, and stays ours)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces
        table[int(entry.name)] = (int(rest[1]), sum(int(v) for v in rest[11:15]))  # utime stime cutime cstime
    return table


def descendants(root: int, table: dict[int, tuple[int, int]]) -> set[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


class SystemProbe:
    """This machine as it is, apart from the worker's own processes (``root`` and below)."""

    def __init__(self, root: int, gpu_indices: tuple[int, ...] = (), nvml: Any | None = None,
                 cpu=_cpu_busy_and_total, processes=_process_table):
        """``cpu`` and ``processes``: how /proc is read (a test hands in its own)."""
        self.root, self.gpu_indices = root, gpu_indices
        self._cpu, self._processes = cpu, processes
        self._nvml = nvml
        if gpu_indices and nvml is None:
            from gpunet.worker.hardware import _load_pynvml

            self._nvml = _load_pynvml()
        self._last: tuple[int, int, int] | None = None  # (busy, total, ours) at the previous reading

    def read(self) -> Reading:
        table = self._processes()
        ours = descendants(self.root, table)
        busy, total = self._cpu()
        mine = sum(table[pid][1] for pid in ours if pid in table)
        load = 0.0
        if self._last is not None and total > self._last[1]:
            others = (busy - self._last[0]) - max(0, mine - self._last[2])
            load = max(0.0, min(1.0, others / (total - self._last[1])))
        self._last = (busy, total, mine)
        if not self.gpu_indices or self._nvml is None:
            return Reading(time.time(), gpu=False, others_cpu_load=load)
        processes, temperature = self._gpus(ours, table)
        return Reading(time.time(), gpu=True, other_gpu_processes=processes, others_cpu_load=load,
                       temperature=temperature)

    def _gpus(self, ours: set[int], table: dict) -> tuple[int, float | None]:
        """Other processes on our GPUs (those this process can see: in a container NVML may report the host's pids,
        which are neither ours nor visible, and are left out), and the hottest GPU."""
        nvml = self._nvml
        others: set[int] = set()
        hottest = None
        try:
            nvml.nvmlInit()
            for index in self.gpu_indices:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                    try:
                        found = getattr(nvml, query)(handle)
                    except Exception:  # not supported on this GPU or driver
                        continue
                    others |= {p.pid for p in found if p.pid not in ours and p.pid in table}
                try:
                    t = float(nvml.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU))
                    hottest = t if hottest is None else max(hottest, t)
                except Exception:
                    pass
        except Exception as e:
            logger.debug("NVML reading failed: %s", e)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
        return len(others), hottest


class FakeGpuProbe:
    """FAKE HARDWARE for tests: a GPU as a JSON file says it is (``{"other_gpu_processes": 1, "temperature":
    85}``), read afresh at each reading; no file is an idle, cool GPU."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        logger.warning("FAKE GPU PROBE: the owner's use of the GPU and its temperature are read from %s", self.path)

    def read(self) -> Reading:
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError):
            state = {}
        return Reading(time.time(), gpu=True, other_gpu_processes=int(state.get("other_gpu_processes", 0)),
                       temperature=state.get("temperature"))
