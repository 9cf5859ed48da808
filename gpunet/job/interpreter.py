"""Runs a validated program: a flat loop over precompiled steps, on the worker's device.

The same loop serves the dry run (meta tensors, with a memory tracker and a FLOP counter) and the real run, so
what was measured is what runs. Values are freed after their last use, as the dry run assumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gpunet.errors import GpunetError, JobFailed, JobPreempted, JobRaised, JobRejected
from gpunet.job.graph import GETITEM
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
                raise JobPreempted(_PREEMPTED)
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
        if tracker is not None:
            raise JobRejected(f"dry run failed: {_raised(step, e)}") from None
        _failed(step, e)
    return [env[s] for s in outputs]


def _raised(step: Step | None, e: Exception) -> str:
    where = f"node {step.name!r} ({step.op})" if step is not None else "program"
    return f"{where} raised {type(e).__name__}: {str(e)[:500]}"


def _failed(step: Step | None, e: Exception) -> None:
    """An op of a real run raised: say which node, never a raw torch error (the generic loop and the plan alike)."""
    if _the_jobs_own(e):
        raise JobRaised(_raised(step, e)) from None  # it would raise the same on any worker
    raise JobFailed(_raised(step, e)) from None  # perhaps this machine's (memory, a dtype its kernels lack, a library)


class Plan:
    """A program's real run compiled once into one Python function (as torch.fx's code generation does), so that a
    node costs its kernel and little else: arguments bound at load (no templates filled per node), values in local
    variables (no list of slots), each op's dispatcher called directly (no OpOverload.__call__ frame), frees as
    ``del``, and the stop word and the pacer's bounds checked inline. At decode shapes a forward is hundreds of small
    kernels, and the generic loop's few microseconds per node were a third of the time (issue 41).

    The source is built from integers and templates only: every op, constant and guard is a closure variable named
    by its index; keyword names come from the op's schema (the validator refuses any other) and are checked to be
    identifiers. Each node's result is what :func:`execute` computes, in the same order (tests compare bitwise)."""

    def __init__(self, steps: Sequence[Step], outputs: Sequence[int], first_node_slot: int, stoppable: bool,
                 paced: bool):
        self.steps = steps
        self.run = _compile(steps, outputs, first_node_slot, stoppable, paced)

    def __call__(self, env: list, stop: Callable[[], bool] | None, pace) -> list:
        if pace is None:
            return self.run(env, stop, None, None, 0.0)
        return self.run(env, stop, pace.least, pace.allowed, pace.deadline, pace.stop_at)


def _compile(steps: Sequence[Step], outputs: Sequence[int], first_node_slot: int, stoppable: bool,
             paced: bool) -> Callable:
    import keyword

    terms = sum(1 + len(st.args) + len(st.kwargs) + sum(len(st.args[k]) for k, _ in st.arg_lists)
                + sum(len(st.kwargs[k]) for k, _ in st.kw_lists) for st in steps)
    if len(steps) > PLAN_MAX_STEPS or terms > PLAN_MAX_TERMS:  # (compiling costs time and memory by the source's size)
        raise ValueError(f"{len(steps)} steps, {terms} terms: run by the generic loop")
    consts: list = []

    def const(value: Any) -> str:
        consts.append(value)
        return f"_c[{len(consts) - 1}]"

    def value(template: Any, refs: dict, lists: dict, key) -> str:
        if key in refs:
            return f"v{refs[key]}"
        if key in lists:
            subs = dict(lists[key])
            return "[" + ", ".join(f"v{subs[j]}" if j in subs else const(x) for j, x in enumerate(template)) + "]"
        return const(template)

    read = sorted({s for step in steps for s in reads(step)} | set(outputs))
    body = [f"v{s} = env[{s}]" for s in read if s < first_node_slot]
    body.append("env.clear()")  # (the dels below then free inputs, as execute's env[s] = None does)
    head = 4  # the lines before the body's first (def _make, def run, _t0 = ..., try:)
    node_at: dict[int, int] = {}  # line -> node: which node raised, from the traceback (no statement per node)
    fns, guards = [], []
    for i, step in enumerate(steps):
        fn = step.fn
        fast = FAST_CALLS.get(step.op) if step.args else None  # (a method takes its tensor positionally only)
        fns.append(fast or (fn._op if isinstance(fn, torch._ops.OpOverload) else fn))
        args = [value(a, dict(step.arg_refs), dict(step.arg_lists), k) for k, a in enumerate(step.args)]
        kwrefs, kwlists = dict(step.kw_refs), dict(step.kw_lists)
        kwargs = []
        for k, a in step.kwargs.items():
            if not (isinstance(k, str) and k.isascii() and k.isidentifier() and not keyword.iskeyword(k)):
                raise ValueError(f"keyword {k!r} cannot be compiled")
            kwargs.append((k, value(a, kwrefs, kwlists, k)))
        lines = []
        if stoppable:
            lines.append(f"if _stop(): _stop_now({i})")
        if paced:  # the time it starts, against the previous node's (alternate names: no copy per node)
            now, before = f"_t{i % 2}", f"_t{(i + 1) % 2}"
            lines.append(f"{now} = _mono()")
            lines.append(f"if {now} + _L[{i}] > _D{f' or {now} - {before} > _A[{i - 1}]' if i else ''}: "
                         f"_stop_at({i}, {now}, {before if i else 'None'})")
        call = ", ".join(args + [f"{k}={v}" for k, v in kwargs])
        if step.guard is not None:
            guards.append(step.guard)
            lines.append(f"_g[{len(guards) - 1}]([{', '.join(args)}], "
                         f"{{{', '.join(f'{k!r}: {v}' for k, v in kwargs)}}})")
        if step.op == GETITEM:  # one of a node's results: indexed in place, no call
            lines.append(f"v{step.slot} = {args[0]}[{args[1]}]")
        else:
            lines.append(f"v{step.slot} = _f[{i}]({call})")
        for line in lines:
            node_at[head + len(body) + 1] = i
            body.append(line)
        body.extend(f"del v{s}" for s in step.free_after)
    body.append(f"return [{', '.join(f'v{s}' for s in outputs)}]")
    source = "\n".join([
        "def _make(_f, _c, _g, _mono, _stop_now, _GpunetError, _failed):",
        "    def run(env, _stop, _L, _A, _D, _stop_at=None):",
        "        _t0 = _t1 = None",
        "        try:",
        *("            " + line for line in body),
        "        except _GpunetError:",
        "            raise",
        "        except Exception as _e:",
        "            _failed(_e)",
        "    return run", ""])

    def failed(e: Exception) -> None:
        tb = e.__traceback__  # the generated frame first: its line names the node
        _failed(steps[node_at[tb.tb_lineno]] if tb is not None and tb.tb_lineno in node_at else None, e)

    def stop_now(i: int) -> None:
        raise JobPreempted(_PREEMPTED)

    space: dict = {}
    exec(compile(source, "<gpunet program>", "exec"), {"__builtins__": {"Exception": Exception}}, space)  # noqa: S102
    return space["_make"](tuple(fns), tuple(consts), tuple(guards), time.monotonic, stop_now, GpunetError, failed)


def reads(step: Step) -> list[int]:
    """The slots a step reads."""
    return ([s for _, s in step.arg_refs] + [s for _, s in step.kw_refs]
            + [s for _, subs in step.arg_lists + step.kw_lists for _, s in subs])


#: Ops called through the Tensor method of the same schema rather than the op's dispatcher entry, which parses its
#: arguments against the schema at run time (0.4-0.7 us more a call: at decode shapes a third of the nodes are these).
#: Only views and copies, whose result has no arithmetic to differ in; tests/test_interpreter.py holds each to the op.
FAST_CALLS: dict[str, Callable] = {
    "aten.view.default": torch.Tensor.view,
    "aten.permute.default": torch.Tensor.permute,
    "aten.expand.default": torch.Tensor.expand,
    "aten.unsqueeze.default": torch.Tensor.unsqueeze,
    "aten.squeeze.dim": torch.Tensor.squeeze,
    "aten.t.default": torch.Tensor.t,
    "aten.transpose.int": torch.Tensor.transpose,
    "aten.select.int": torch.Tensor.select,
    "aten.split_with_sizes.default": torch.Tensor.split_with_sizes,
    "aten.clone.default": torch.Tensor.clone,
}

_PREEMPTED = "stopped for a job of a higher lane (not billed: run it again elsewhere or later)"
#: Programs of more nodes, or more terms (arguments and list elements) in all, run by the generic loop: compiling
#: costs about 10 us and 5 KB (freed after) a line of source, a few lines a node, once per program; a program that
#: big spends its time in kernels, not in the loop (a 32-layer decoder span is about 3,200 nodes, 15,000 terms).
PLAN_MAX_STEPS = 8_000
PLAN_MAX_TERMS = 40_000


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
        outs = run_steps(program, env, stop, pace)
        return [o.contiguous() for o in outs]


def run_steps(program: Any, env: list, stop: Callable[[], bool] | None = None, pace=None) -> list:
    """The real run of a program's steps over ``env`` (which it consumes): its :class:`Plan` (compiled at its first
    run, per use of the stop word and the pacer), or :func:`execute` where a program cannot be compiled or ``pace``
    is a plain callable. ``pace``: what bounds each node's time (``least``, ``allowed``, ``deadline`` and
    ``stop_at``: gpunet.worker.executor.child.Pacer)."""
    plan = program.plan(stop is not None, pace is not None) if pace is None or hasattr(pace, "stop_at") else None
    if plan is None:
        return execute(program.steps, env, program.output_slots, stop=stop, pace=pace)
    return plan(env, stop, pace)
