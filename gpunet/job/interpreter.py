"""Runs a validated program: a flat loop over precompiled steps, on the worker's device.

The same loop serves the dry run (meta tensors, with a memory tracker and a FLOP counter) and the real run, so
what was measured is what runs. Values are freed after their last use, as the dry run assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gpunet.errors import GpunetError, JobFailed, JobPreempted, JobRaised, JobRejected
from gpunet.job.tensors import ALIGN
from gpunet.utils import human_bytes


@dataclass
class Step:
    """One node, compiled: the callable, argument templates, and where to patch in earlier values."""

    name: str
    op: str
    fn: Callable
    slot: int
    args: list
    kwargs: dict
    arg_refs: list[tuple[int, int]] = field(default_factory=list)  # (position, slot)
    arg_lists: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)  # (position, [(index, slot)])
    kw_refs: list[tuple[str, int]] = field(default_factory=list)
    kw_lists: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    free_after: tuple[int, ...] = ()
    view_of: int | None = None  # slot whose storage the output aliases (views), for memory accounting
    guard: Callable[[list, dict], None] | None = None  # checks real argument values first (gpunet.job.guards)
    cost: Callable[[list, dict, Any], int] | None = None  # counted work from shapes (gpunet.job.cost); None: free
    workspace: Callable[[list, dict, Any], int] | None = None  # bytes the kernel takes beside its output, while it runs


DEVICE_SLOT = 0  # env[0] holds the device; every Device argument is a reference to it


class MemoryTracker:
    """Counts live bytes per storage during the dry run; raises JobRejected the moment a limit is crossed."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.live = 0
        self.peak = 0
        self._storage_of: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._counter = 0

    def pin(self, slot: int, value: Any) -> None:
        """An input or weight: counted, never freed."""
        self._new(slot, nbytes(value), where="inputs and weights")
        self._refs[self._storage_of[slot]] += 1

    def produced(self, step: Step, value: Any, workspace: int = 0) -> None:
        """``value`` is live from now; ``workspace``: bytes the kernel also held while it ran (at the peak, not after)."""
        if step.view_of is not None and step.view_of in self._storage_of:
            sid = self._storage_of[step.view_of]
            self._storage_of[step.slot] = sid
            self._refs[sid] += 1
        else:
            self._new(step.slot, nbytes(value), where=f"node {step.name!r} ({step.op})")
        if workspace:
            self._grow(workspace, where=f"node {step.name!r} ({step.op}, with the kernel's own buffers)")
            self.live -= workspace

    def materialise_outputs(self, outputs: Sequence[Any]) -> None:
        """What the end of a run allocates on top of what is live: each output that is a strided view (an ``expand``
        of a few bytes can stand for gigabytes) is copied dense, and every output is then encoded into the reply."""
        extra = 0
        for out in outputs:
            size = nbytes(out)
            extra += size  # the encoded reply
            if isinstance(out, torch.Tensor) and not out.is_contiguous():
                extra += size  # the dense copy made before encoding
        self._grow(extra, where="the outputs (made dense and encoded)")

    def freed(self, slot: int) -> None:
        sid = self._storage_of.pop(slot, None)
        if sid is not None:
            self._refs[sid] -= 1
            if self._refs[sid] == 0:
                self.live -= self._size.pop(sid)
                del self._refs[sid]

    def _new(self, slot: int, size: int, where: str) -> None:
        self._counter += 1
        sid = self._counter
        self._size[sid] = size
        self._refs[sid] = 1
        self._storage_of[slot] = sid
        self._grow(size, where)

    def _grow(self, size: int, where: str) -> None:
        self.live += size
        if self.live > self.peak:
            self.peak = self.live
            if self.limit is not None and self.peak > self.limit:
                raise JobRejected(f"{where}: peak memory {human_bytes(self.peak)} exceeds the limit of "
                                  f"{human_bytes(self.limit)}")


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list or tuple; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def _fill(template: Any, refs: list, lists: list, env: list) -> Any:
    """A copy of an argument template (list or dict) with earlier values patched in."""
    out = template.copy()
    for k, s in refs:
        out[k] = env[s]
    for k, subs in lists:
        lst = list(out[k])
        for j, s in subs:
            lst[j] = env[s]
        out[k] = lst
    return out


def execute(
    steps: Sequence[Step], env: list, outputs: Sequence[int], tracker: MemoryTracker | None = None,
    meter: list[int] | None = None, stop: Callable[[], bool] | None = None,
    per_node: list[int] | None = None, pace: Callable[[int], None] | None = None,
) -> list:
    """Run ``steps`` over ``env`` (device, inputs, weights, then one slot per node) and return the output values.

    Errors raised by an op become JobFailed naming the node (JobRejected in a dry run, where the tracker is set).
    ``meter``: a one-element list the dry run adds each node's counted work to (see :mod:`gpunet.job.cost`).
    ``stop``: asked before each node; True stops the run there with JobPreempted (the worker wants the device for
    a job of a higher lane, gpunet.worker.state.lanes). ``per_node``: a list the dry run appends each node's
    counted work to. ``pace``: called with each node's index before it runs; it raises (JobTimeout) to stop the run
    there (the worker bounds each node's time by its counted work: gpunet.worker.executor.child).
    """
    step = None
    try:
        for i, step in enumerate(steps):
            if stop is not None and stop():
                raise JobPreempted("stopped for a job of a higher lane (not billed: run it again elsewhere or later)")
            if pace is not None:
                pace(i)
            args = _fill(step.args, step.arg_refs, step.arg_lists, env) if step.arg_refs or step.arg_lists else step.args
            kwargs = _fill(step.kwargs, step.kw_refs, step.kw_lists, env) if step.kw_refs or step.kw_lists else step.kwargs
            if step.guard is not None and tracker is None:  # values exist only in a real run
                step.guard(args, kwargs)
            out = step.fn(*args, **kwargs)
            env[step.slot] = out
            if meter is not None:
                counted = step.cost(args, kwargs, out) if step.cost is not None else 0
                meter[0] += counted
                if per_node is not None:
                    per_node.append(counted)
            if tracker is not None:
                tracker.produced(step, out, step.workspace(args, kwargs, out) if step.workspace is not None else 0)
                for s in step.free_after:
                    tracker.freed(s)
            for s in step.free_after:
                env[s] = None
    except GpunetError:
        raise
    except Exception as e:  # an op raised: report which node, never a raw torch error
        where = f"node {step.name!r} ({step.op})" if step is not None else "program"
        msg = f"{where} raised {type(e).__name__}: {str(e)[:500]}"
        if tracker is not None:
            raise JobRejected(f"dry run failed: {msg}") from None
        if _the_jobs_own(e):
            raise JobRaised(msg) from None  # it would raise the same on any worker
        raise JobFailed(msg) from None  # perhaps this machine's (memory, a dtype its kernels lack, a library)
    return [env[s] for s in outputs]


def _the_jobs_own(error: Exception) -> bool:
    """Whether an op's error comes from the job's own values, the same on any machine: an index out of range. Others
    (out of memory, a dtype a CPU kernel lacks, a library's refusal) may be the worker's, and count as its failure."""
    text = str(error)
    return isinstance(error, IndexError) or (isinstance(error, (RuntimeError, ValueError))
                                             and ("out of bounds" in text or "out of range" in text)
                                             and "memory" not in text)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move to ``device``; on the CPU, copy only zero-copy views that are not 64-byte aligned, because BLAS kernels
    pick their code path by alignment and eager PyTorch's own tensors are always aligned (exact equality needs it)."""
    if device.type != "cpu":
        return t.to(device, non_blocking=False)
    return t.clone() if t.data_ptr() % ALIGN else t


def run_program(program: Any, inputs: Sequence[torch.Tensor] | dict, stop: Callable[[], bool] | None = None,
                pace: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Check ``inputs`` against the program's manifest and limits (dry run), then run it on the program's device.

    ``inputs`` is a list of tensors or the dict decoded from input bytes (``input_0``, ``input_1``, ...); ``stop``
    and ``pace``: see :func:`execute`.
    """
    if isinstance(inputs, dict):
        inputs = program.inputs_from_dict(inputs)
    program.estimate(inputs)  # validates shapes and enforces the memory/FLOP limits before anything is allocated
    with torch.inference_mode():
        env = program.new_env([to_device(t, program.device) for t in inputs])
        outs = execute(program.steps, env, program.output_slots, stop=stop, pace=pace)
        return [o.contiguous() for o in outs]
