"""A model's blocks cut into spans: contiguous ranges, as even in bytes as they can be, each traced into one safe job
that a worker runs (``forward(x, *state) -> (y, *new_state)``, the span's state its blocks' own, in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gpunet.errors import GpunetError, UnsupportedProgram, UsageError

#: What a span's worker needs besides the span's weights and state, as a share of them (activations, the program's
#: container while it loads).
MEMORY_HEADROOM = 1.5


class _SpanModule(torch.nn.Module):
    """Consecutive blocks as one module: ``forward(x, *state) -> (y, *new_state)`` (just ``y`` with no state)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], n_state: Sequence[int]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.n_state = list(n_state)

    def forward(self, x, *state):
        new: list[torch.Tensor] = []
        at = 0
        for block, k in zip(self.blocks, self.n_state):
            if k:
                x, *out = block(x, *state[at:at + k])
                if len(out) != k:
                    raise UsageError(f"a stateful block takes {k} state tensors and must return as many new ones "
                                     f"after its output, returned {len(out)}")
                new += out
                at += k
            else:
                x = _passed_on(block, block(x))
        return (x, *new) if new else x


def _passed_on(block: torch.nn.Module, out: Any) -> torch.Tensor:
    """A stateless block's output as the next block's input: one tensor (or a 1-tuple of one, as older Hugging Face
    blocks return ``(hidden_states,)``)."""
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise UsageError(f"a block ({type(block).__name__}) returned a {type(out).__name__}: in a sequence each block "
                         "passes one tensor to the next. Wrap a block that returns more so that it returns the hidden "
                         "state only; a stateful block is forward(x, *state) -> (y, *new_state), with initial_state "
                         "given (docs/sessions.md)")
    return out


@dataclass
class Span:
    """Blocks ``start`` to ``stop - 1`` as one traced job, with the first state its session starts from."""

    start: int
    stop: int
    job: Any  # gpunet.Job
    state: tuple[torch.Tensor, ...]  # the first state (empty: a stateless span)
    fresh: bool  # that state is all zeros: workers allocate it themselves instead of receiving it
    weight_bytes: int

    @property
    def stateful(self) -> bool:
        return bool(self.state)

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state)

    def meta_state(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in self.state)


def block_bytes(block: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))


def plan_spans(sizes: Sequence[int], n_spans: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges, ``n_spans`` of them, making the biggest span as small as it can be
    (exact: a binary search on the bound, each checked greedily)."""
    n = len(sizes)
    if not 1 <= n_spans <= n:
        raise UsageError(f"spans must be between 1 and the number of blocks ({n}), not {n_spans}")

    def cut(bound: int) -> list[tuple[int, int]] | None:
        ranges, start, total = [], 0, 0
        for i, size in enumerate(sizes):
            if size > bound:
                return None
            if total + size > bound or n - i < n_spans - len(ranges):  # must leave a block for every span to come
                ranges.append((start, i))
                start, total = i, 0
            total += size
        ranges.append((start, n))
        return ranges if len(ranges) <= n_spans else None

    lo, hi = max(sizes, default=0), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    ranges = cut(lo) or [(0, n)]
    while len(ranges) < n_spans:  # fewer were needed: split the longest (by blocks) to use the workers asked for
        i = max(range(len(ranges)), key=lambda j: ranges[j][1] - ranges[j][0])
        a, b = ranges[i]
        m = (a + b) // 2
        ranges[i:i + 1] = [(a, m), (m, b)]
    return ranges


def block_state(block: torch.nn.Module, given: Any) -> tuple[torch.Tensor, ...]:
    """A block's first state: the one given, else its ``initial_state()``, else none (a stateless block)."""
    if given is not None:
        state = tuple(given)
    else:
        make = getattr(block, "initial_state", None)
        state = tuple(make()) if make is not None else ()
    if not all(isinstance(t, torch.Tensor) for t in state):
        raise UsageError("a block's state is a tuple of tensors (its initial_state(), or initial_state=[...])")
    return state


def _dims_of(job, output: int = 0) -> dict[int, Any] | None:
    """The dynamic dims of a traced job's output, as torch.export Dims: the next span's input has the same."""
    from torch.export import Dim

    spec = job.manifest.outputs[output]
    dims = {}
    for axis, d in enumerate(spec.shape):
        if isinstance(d, str):
            r = job.manifest.dims[d]
            dims[axis] = Dim(d, min=r.min, max=r.max) if r.max is not None else Dim(d, min=r.min)
    return dims or None


def trace_spans(blocks: Sequence[torch.nn.Module], example_inputs: Sequence[torch.Tensor], dynamic_shapes: Any,
                ranges: Sequence[tuple[int, int]], initial_state: Sequence[Any] | None = None,
                stand_ins=None, rows=None, trace_key: Any = None) -> list[Span]:
    """Trace each range of blocks into a job, feeding each the previous span's output on the example input.
    ``stand_ins`` (gpunet.job.checkpoints.StandIns): the blocks' weights stand for a checkpoint's tensors.
    ``rows`` (a torch.export Dim): the blocks compute each row of dim 0 of their input and state from its own rows
    alone, so a stateful span is traced with that dim dynamic and declared its batch dim (Manifest.batch): a worker
    may run several sessions' steps of it as one forward. Each session holds one row. ``trace_key``: the blocks
    are built alike with others traced under this key (a model's class and configuration, its dtype and length):
    a span whose range and example are the same again takes their graph (gpunet.job.trace.trace_alike)."""
    from gpunet.job import Job

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if len(example_inputs) != 1:
        raise UsageError("a sequence of blocks passes one tensor from block to block: give one example input")
    if initial_state is not None and len(initial_state) != len(blocks):
        raise UsageError(f"initial_state has {len(initial_state)} entries for {len(blocks)} blocks (None for a "
                         "stateless block)")
    states = [block_state(b, initial_state[i] if initial_state is not None else None) for i, b in enumerate(blocks)]
    x = example_inputs[0]
    x_dims = dynamic_shapes[0] if isinstance(dynamic_shapes, (tuple, list)) else dynamic_shapes
    spans = []
    for start, stop in ranges:
        module = _SpanModule(blocks[start:stop], [len(s) for s in states[start:stop]]).eval()
        state = tuple(t for s in states[start:stop] for t in s)
        # forward(x, *state): torch.export takes the varargs' shapes as one tuple
        shapes = None if x_dims is None else (x_dims, (None,) * len(state)) if state else (x_dims,)
        examples, batch = (x, *state), None
        if rows is not None and state:
            # Traced on two rows (one would specialise the dim to 1), each a copy of the example's.
            shapes = ({**(x_dims or {}), 0: rows}, tuple({0: rows} for _ in state))
            examples, batch = tuple(torch.cat([t, t]) for t in examples), rows.__name__
        try:  # eagerly first (on copies of the state): a block that does not fit the convention says so itself
            with torch.no_grad():
                out = module(x, *(t.clone() for t in state))
        except GpunetError:
            raise
        except Exception as e:
            raise UnsupportedProgram(f"blocks {start}-{stop - 1} fail on the example input: {type(e).__name__}: "
                                     f"{str(e)[:500]}") from e
        key = None if trace_key is None else (trace_key, start, stop, _example_key(examples), _shapes_key(shapes),
                                              batch, stand_ins is not None)
        job = Job.from_module(module, example_inputs=examples, dynamic_shapes=shapes, state=len(state),
                              stand_ins=stand_ins, batch=batch, trace_key=key)
        x = out[0] if state else out
        x_dims = _dims_of(job)
        spans.append(Span(start, stop, job, state, all(not t.any() for t in state),
                          sum(block_bytes(b) for b in blocks[start:stop])))
    return spans


def _example_key(examples: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype), t.device.type) for t in examples)


def _shapes_key(shapes: Any) -> str:
    """Dynamic shapes as text: torch.export's Dims by name and range."""
    def text(d):
        if hasattr(d, "min") and hasattr(d, "max"):
            return f"Dim({d.__name__},{d.min},{d.max})"
        if isinstance(d, dict):
            return "{" + ",".join(f"{k}:{text(v)}" for k, v in sorted(d.items())) + "}"
        if isinstance(d, (tuple, list)):
            return "(" + ",".join(text(v) for v in d) + ")"
        return repr(d)
    return text(shapes)


def spans_needed(sizes: Sequence[int], free_memory: Sequence[int]) -> int:
    """The fewest spans whose biggest fits (with headroom) in the smallest free memory among the workers known:
    fewer spans, fewer round trips per step; a model no one worker can hold is spread."""
    room = min((m for m in free_memory if m > 0), default=0) / MEMORY_HEADROOM
    if room <= 0:
        return 1
    for n in range(1, len(sizes) + 1):
        if max(sum(sizes[a:b]) for a, b in plan_spans(sizes, n)) <= room:
            return n
    raise UsageError(f"a block of {max(sizes) / 2**20:.0f} MiB does not fit in the memory of the workers known "
                     f"({room * MEMORY_HEADROOM / 2**20:.0f} MiB free on the smallest)")


def x_meta(span: Span) -> torch.Tensor:
    """A meta tensor shaped like the span's first input at its smallest (routing needs only the shape)."""
    spec = span.job.manifest.inputs[0]
    from gpunet.job import tensors

    shape = [d if isinstance(d, int) else span.job.manifest.dims[d].min for d in spec.shape]
    return torch.empty(shape, dtype=tensors.DTYPES[spec.dtype], device="meta")
