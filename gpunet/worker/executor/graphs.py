"""Runs that repeat their shapes, captured once and replayed (CUDA graphs; issue 41, docs/architecture.md).

A session's decode step with a static cache, or a ``map`` over equal batches, runs the same program at the same input
shapes again and again. At decode shapes a forward is hundreds of small kernels and the GPU waits on Python to launch
each one; a CUDA graph records the launches once and replays them in one call. After :data:`WARM_RUNS` plain runs of
one program object at one set of input shapes (dtype, shape and strides of each), the next is the warm-up of a
capture (the run itself, billed and paced as any, on the capture's stream) and is then captured; the runs after it
replay the graph: inputs go into the graph's own buffers (one copy each), the replay writes its outputs into its own,
and what is returned are copies of those (a session's new state is kept between steps, and the next replay, perhaps
another session's, overwrites the graph's outputs). Results are the plain run's: the same kernels in the same order.

What is not captured runs as before, and says why (the worker's metrics count it, its log names it once per reason):
a program whose guard reads tensor values (a host sync, and a check a replay would skip), a run that synchronises with
the host (found by the warm-up, run with torch's sync debug mode set to raise), a graph whose dry run says it needs
more than its share of the executor's memory budget. A capture that fails half way may leave torch's allocator as it
was mid-capture: that executor captures no more (its graphs still replay, their memory cannot be given back), new
sessions go elsewhere where they can, and the worker replaces it once it holds no session. Graphs hold device memory
(their buffers and their memory pool), counted against :data:`BUDGET_SHARE` of the budget and evicted least recently
used; a program's graphs go when the program does (its weights' addresses are baked into them); a run that runs out
of memory while graphs hold some (plain, its warm-up or a replay's copies) runs plain once more without them.

The device itself is behind a seam (:class:`CudaGraphs`; the tests' CPU stand-in is :class:`FakeCudaGraphs`), so what
is captured, when, eviction and fallback are tested on a machine without a GPU; that replays equal plain runs bit for
bit is checked on the GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gpunet.errors import JobFailed, JobPreempted, JobRaised, JobTimeout
from gpunet.utils import LRU, first_line, human_bytes

#: Plain runs of one program at one set of shapes before the next is captured (lazy initialisation, cuBLAS handles
#: and the allocator's first blocks happen outside the capture, as torch's docs ask).
WARM_RUNS = 2
#: The share of the executor's memory budget its graphs may hold.
BUDGET_SHARE = 0.25
#: Shapes whose runs are counted or whose refusal is kept, per executor (LRU): a program run at many shapes (prefill
#: of every prompt length) is never warm at most of them and must not grow this process.
MAX_SHAPES = 256
#: Guards that read tensor values (gpunet.job.guards): a host sync while capturing, and a check a replay would skip.
VALUE_GUARDS = frozenset({"aten._embedding_bag.default"})

# Why a run was not captured, as the worker's metrics label it (bounded); the detail goes to the worker's log.
SYNC, GUARDED, FAILED, TOO_BIG = "host sync", "guard reads values", "capture failed", "over graph budget"
REASONS = frozenset({SYNC, GUARDED, FAILED, TOO_BIG})
#: What a run did: replayed a graph, was the warm-up of a capture, ran plain before one, or ran plain (not captured).
OUTCOMES = frozenset({"replayed", "captured", "warming", "refused"})


class CudaGraphs:
    """The device behind :class:`GraphCache`: CUDA graphs on one device (torch.cuda.CUDAGraph), warmed up and
    captured on one side stream of its own (a new stream per capture would leave cuBLAS a workspace per stream)."""

    def __init__(self, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self._side = None

    def _stream(self):
        if self._side is None:
            self._side = self.torch.cuda.Stream(self.device)
        return self._side

    def check(self, run: Callable[[], list]) -> list:
        """Run ``run`` on the side stream (the warm-up torch asks for before a capture), with torch's sync debug mode
        set to raise if it synchronises with the host (a replay would not wait where it waited); its outputs."""
        torch = self.torch
        current, side = torch.cuda.current_stream(self.device), self._stream()
        side.wait_stream(current)
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                outputs = run()
        finally:
            torch.cuda.set_sync_debug_mode(before)
            current.wait_stream(side)
        for o in outputs:  # used on the current stream from now on: their blocks are not reused before it is done
            o.record_stream(current)
        return outputs

    def capture(self, run: Callable[[], list]) -> tuple[Any, list, int]:
        """The graph of ``run``, the outputs its replays write, and the device memory its pool took. Raises if the
        capture failed; then this process's allocator and streams may be left as a half-ended capture leaves them
        (torch's capture_end raises before it gives the pool back): the caller stops capturing here."""
        torch = self.torch
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # (done first, so that what the graph's pool takes is seen)
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        current, side = torch.cuda.current_stream(self.device), self._stream()
        side.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(side):  # (the stream is restored however it ends)
            graph.capture_begin()
            try:
                outputs = run()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph, outputs, max(0, torch.cuda.memory_reserved(self.device) - before)

    def replay(self, graph: Any) -> None:
        graph.replay()

    def release(self) -> None:
        """Give the device memory freed graphs held back to the driver (a run that ran out of memory runs again)."""
        self.torch.cuda.empty_cache()

    def is_for(self, device) -> bool:
        return getattr(device, "type", None) == "cuda"


@dataclass
class _Graph:
    """One captured run: the buffers its replays read and write, and the device memory it holds."""

    graph: Any
    inputs: list
    outputs: list
    nbytes: int


@dataclass
class Counts:
    """What runs did since the executor last reported (its reply carries them to the worker's metrics)."""

    runs: Counter = field(default_factory=Counter)  # outcome -> runs: replayed, captured, warming, refused
    refused: list = field(default_factory=list)  # (reason, detail) per shape refused, once each
    nbytes: int = 0  # device memory the graphs hold now


class GraphCache:
    """Captured runs per (program, input shapes), replayed in place of plain runs (see the module's docstring).

    Called as the plain run is (``run_program(prog, inputs, stop=, pace=)``), and falls back to it."""

    def __init__(self, backend, max_bytes: int, run_program: Callable, warm_runs: int = WARM_RUNS):
        self.backend, self.max_bytes, self.warm_runs, self._run_program = backend, max_bytes, warm_runs, run_program
        self.nbytes = 0
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # least recently used first
        self._seen: LRU[tuple, int] = LRU(MAX_SHAPES)  # plain runs so far, per shape not yet captured
        self._refused: LRU[tuple, str] = LRU(MAX_SHAPES)
        self._programs: dict[int, str | None] = {}  # id(program) -> why it is never captured (None: it may be)
        self.counts = Counts()
        #: Why this process captures no more (a capture failed half way): the executor asks to be replaced once it
        #: holds no session (gpunet.worker.executor.child).
        self.broken: str | None = None

    def __call__(self, prog, inputs: Sequence | dict, stop: Callable[[], bool] | None = None, pace=None) -> list:
        if isinstance(inputs, dict):
            inputs = prog.inputs_from_dict(inputs)
        outcome, outputs = self._try(prog, inputs, stop, pace)
        self.counts.runs[outcome] += 1
        if outputs is not None:
            return outputs
        try:
            return self._run_program(prog, inputs, stop=stop, pace=pace)
        except JobFailed as e:
            # The graphs' memory is the same allocator's as the runs' (a job may be admitted up to the whole budget):
            # a plain run that ran out of it runs again without them (programs change no input: nothing to undo).
            if not self._graphs or not _out_of_memory(e):
                raise
        self.clear()
        return self._run_program(prog, inputs, stop=stop, pace=pace)

    def clear(self) -> None:
        """Drop every graph (a later run of their shapes warms up again), and give their memory back to the device
        (not while torch's allocator is mid-capture: see :attr:`broken`)."""
        self._graphs.clear()
        self.nbytes = 0
        if self.broken is None:
            self.backend.release()

    def tell(self, reply: dict, holding_sessions: bool) -> None:
        """Into the executor's ``reply``: what happened since the last (``graphs``), and, when a capture failed half
        way here and no session's state would go with this process, that the worker should replace it (``recycle``:
        the job's result stands; the process exits after sending it)."""
        counts = self.take_counts()
        if counts is not None:
            reply["graphs"] = {"runs": dict(counts.runs), "refused": counts.refused, "bytes": counts.nbytes}
        if self.broken is not None:  # (the worker sends new sessions elsewhere, where it can)
            reply["graphs_broken"] = True
            if not holding_sessions:
                reply["recycle"] = True

    def take_counts(self) -> Counts | None:
        """What happened since the last call (None if nothing did)."""
        counts, self.counts = self.counts, Counts()
        counts.nbytes = self.nbytes
        return counts if counts.runs or counts.refused else None

    def _try(self, prog, inputs: Sequence, stop, pace) -> tuple[str, list | None]:
        """(what this run is, its outputs if it ran here; None: the plain run is the caller's)."""
        if not self.backend.is_for(prog.device) or self._never(prog) is not None:
            return "refused", None
        key = (id(prog), tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in inputs))
        found = self._graphs.get(key)
        if found is None:
            if key in self._refused or self.broken is not None:
                return "refused", None
            runs = (self._seen.get(key) or 0) + 1
            self._seen.put(key, runs)
            if runs <= self.warm_runs:
                return "warming", None
            self._seen.pop(key)
            return self._capture(key, prog, inputs, stop, pace)
        self._may_start(stop, pace)
        self._graphs.move_to_end(key)
        try:
            return "replayed", self._replay(found, inputs)
        except Exception as e:  # out of memory copying in or out: the plain run follows, with the graphs' freed
            if not _out_of_memory(e):
                raise
            self.clear()
            return "refused", None

    def _never(self, prog) -> str | None:
        """Why ``prog`` is never captured, found once per program (and forgotten with it)."""
        pid = id(prog)
        if pid not in self._programs:
            guarded = sorted({step.op for step in prog.steps if step.op in VALUE_GUARDS})
            self._programs[pid] = f"{guarded[0]}'s guard reads tensor values" if guarded else None
            if guarded:
                self.counts.refused.append((GUARDED, self._programs[pid]))
            weakref.finalize(prog, self._forget, pid)
        return self._programs[pid]

    def _forget(self, pid: int) -> None:
        """A program is gone (evicted, or loaded fresh for one job): its graphs go, they read its weights."""
        self._programs.pop(pid, None)
        for key in [k for k in self._graphs if k[0] == pid]:
            self._drop(key)
        for table in (self._seen, self._refused):
            for key in [k for k in table.keys() if k[0] == pid]:
                table.pop(key)

    def _may_start(self, stop, pace) -> None:
        """What the plain run checks before each node, checked once before the replay: the stop word, and that the
        run can end within the job's time at the device's speed (gpunet.worker.executor.child.Pacer)."""
        if stop is not None and stop():
            from gpunet.job.interpreter import _PREEMPTED

            raise JobPreempted(_PREEMPTED)
        if pace is not None:
            least = sum(pace.least)  # (a few microseconds: its speed may be measured again meanwhile)
            left = pace.deadline - time.monotonic()
            if least > left:
                raise JobTimeout(f"the run needs at least {least:.2g} s for its counted work on this worker, more "
                                 f"than the {max(0.0, left):.2g} s left of the job's time: stopped before it ran "
                                 "(not billed)")

    def _capture(self, key: tuple, prog, inputs: Sequence, stop, pace) -> tuple[str, list | None]:
        """This run is the warm-up (the job's own run, on the capture's stream, with its stop word and pacer: billed
        as any run), then its launches are recorded (no computing) for the next run of these shapes to replay."""
        import torch

        from gpunet.job.interpreter import run_steps

        need, buffers = self.need(prog, inputs), sum(t.numel() * t.element_size() for t in inputs)
        if need > self.max_bytes:
            return self._refuse(key, TOO_BIG, f"it would hold about {human_bytes(need)}, the graphs' share of this "
                                              f"executor's budget is {human_bytes(self.max_bytes)}")
        program = weakref.ref(prog)  # (a graph does not keep its program alive: it goes with it, _forget)
        with torch.inference_mode():
            try:
                static = [torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=prog.device)
                          for t in inputs]
                for buffer, t in zip(static, inputs):
                    buffer.copy_(t)
            except Exception:  # (out of memory: this time only)
                return "refused", None

            def run(stop=None, pace=None) -> list:
                p = program()
                return [o.contiguous() for o in run_steps(p, p.new_env(list(static)), stop, pace)]

            try:
                outputs = self.backend.check(lambda: run(stop, pace))
            except (JobPreempted, JobTimeout, JobRaised):
                raise  # stopped, or the job's own error: as a plain run would have ended (and is not run again)
            except Exception as e:
                if "synchroniz" in str(e):  # its shapes are never captured here
                    return self._refuse(key, SYNC, f"its warm-up run: {first_line(e, 300)}")[0], None
                if _out_of_memory(e):  # the plain run follows, with the graphs' memory freed
                    self.clear()
                    return "refused", None
                return self._refuse(key, FAILED, f"its warm-up run: {first_line(e, 300)}")[0], None
            while self._graphs and self.nbytes + need > self.max_bytes:  # room for it, now that it will be captured
                self._drop(next(iter(self._graphs)))
            try:
                graph, written, pool = self.backend.capture(run)
            except Exception as e:
                # The graphs it holds still replay (a replay allocates nothing); their memory cannot be given back
                # while torch's allocator is mid-capture, and the worker is asked to replace this process.
                self.broken = f"{type(e).__name__}: {first_line(e, 300)}"
                self._refuse(key, FAILED, f"{self.broken}; this executor captures no more and is replaced once it "
                                          "holds no session")
                return "refused", outputs
        nbytes = pool + buffers
        if nbytes > self.max_bytes:
            return self._refuse(key, TOO_BIG, f"it holds {human_bytes(nbytes)}, the graphs' share of this "
                                              f"executor's budget is {human_bytes(self.max_bytes)}")[0], outputs
        while self._graphs and self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._graphs)))
        self._graphs[key] = _Graph(graph, static, written, nbytes)
        self.nbytes += nbytes
        return "captured", outputs

    @staticmethod
    def need(prog, inputs: Sequence) -> int:
        """About what a graph of ``prog`` at these inputs' shapes holds, from its dry run: the run's peak (its inputs,
        which become the graph's buffers, and what its pool holds) less the weights (the program's own) and the
        encoded reply the peak counts (host memory, not the graph's)."""
        from gpunet.job.tensors import DTYPES

        weights = sum(w.numel() * w.element_size() for w in prog.weights)
        est = prog.estimate(inputs)
        reply = sum(math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in est.outputs if dtype in DTYPES)
        return max(0, est.peak_memory_bytes - weights - reply)

    def _refuse(self, key: tuple, reason: str, detail: str) -> tuple[str, None]:
        self._refused.put(key, reason)
        self.counts.refused.append((reason, detail))
        return "refused", None

    def _drop(self, key: tuple) -> None:
        self.nbytes -= self._graphs.pop(key).nbytes

    def _replay(self, found: _Graph, inputs: Sequence) -> list:
        import torch

        with torch.inference_mode():
            for buffer, t in zip(found.inputs, inputs):
                buffer.copy_(t)
            self.backend.replay(found.graph)
            return [o.clone() for o in found.outputs]


class FakeCudaGraphs:
    """FAKE HARDWARE for tests: a CPU stand-in for :class:`CudaGraphs` (this machine has no GPU; ``gpunet worker
    --fake-cuda-graphs``, hidden, and its log says so). It cannot record kernels, so a replay runs the captured
    function again and writes its results into the captured outputs' memory, as a CUDA replay writes the graph's fixed
    buffers: a caller that forgot to copy new inputs into the graph's buffers, or kept an output past the next replay,
    gets wrong numbers here as it would on a GPU. ``sync_ops`` name ops that stand for host syncs: a warm-up run that
    reaches one raises as CUDA's sync debug mode does. Counts what it was asked."""

    def __init__(self, sync_ops: frozenset[str] = frozenset(), fail_capture: bool = False):
        self.sync_ops, self.fail_capture = sync_ops, fail_capture
        self.checks = self.captures = self.replays = self.releases = 0

    def is_for(self, device) -> bool:
        return True  # stands in for a CUDA device on any device

    def check(self, run: Callable[[], list]) -> list:
        self.checks += 1
        if not self.sync_ops:
            return run()
        import torch

        seen = set()

        class Watch(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.add(f"aten.{func._opname}.{func._overloadname}")
                return func(*args, **(kwargs or {}))

        with Watch():
            outputs = run()
        syncing = sorted(seen & self.sync_ops)
        if syncing:
            raise RuntimeError(f"called a synchronizing CUDA operation ({syncing[0]}; fake, for tests)")
        return outputs

    def release(self) -> None:
        self.releases += 1

    def capture(self, run: Callable[[], list]) -> tuple[Any, list, int]:
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing (fake, for tests)")
        self.captures += 1
        outputs = run()  # (on a GPU these hold nothing until the first replay)
        return _FakeGraph(run, outputs), outputs, sum(o.numel() * o.element_size() for o in outputs)

    def replay(self, graph: "_FakeGraph") -> None:
        self.replays += 1
        for out, fresh in zip(graph.outputs, graph.run()):  # written where the capture's outputs are, as on a GPU
            out.copy_(fresh)


class _FakeGraph:
    def __init__(self, run: Callable[[], list], outputs: list):
        self.run, self.outputs = run, outputs


def _out_of_memory(error: Exception) -> bool:
    """Whether ``error`` is the device's memory running out (torch's own, or named in the interpreter's JobFailed)."""
    return "OutOfMemoryError" in f"{type(error).__name__}: {error}" or "out of memory" in str(error)


def graph_cache(mode: str | None, device: str, budget: int, run_program: Callable) -> GraphCache | None:
    """The executor's graph cache for ``mode`` ("cuda": CUDA graphs on a CUDA device; "fake": the tests' CPU stand-in,
    FAKE HARDWARE; None: off), or None where there is none."""
    if mode == "fake":
        return GraphCache(FakeCudaGraphs(), int(budget * BUDGET_SHARE), run_program)
    if mode == "cuda" and device.startswith("cuda"):
        return GraphCache(CudaGraphs(device), int(budget * BUDGET_SHARE), run_program)
    return None
