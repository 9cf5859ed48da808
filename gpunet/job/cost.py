"""What a job costs: a counted amount of work for every op in the allowlist, in FLOPs or a documented equivalent.

The dry run adds each node's cost (on meta tensors, from shapes alone), so the client and the worker count the same
number; it is what receipts bill and what ``max_flops`` limits. torch's own FLOP counter knows only matrix products,
convolutions and attention: a matrix product spelled ``_cdist_forward`` was billed 0, and 40 s of sorts and
elementwise chains passed any limit. So here every allowlisted op has a formula, and an op without one is refused by
the validator (``tests/test_job_cost.py`` checks the allowlist against this table).

The equivalents, per op class (``n`` = elements of the output unless said otherwise):

* **matmul, convolution**: torch's formulas (2 FLOPs per multiply-add).
* **distances**: ``_cdist_forward`` 3·B·M·N·D (a difference, a product and a sum per term), ``_pdist_forward``
  3·N(N-1)/2·D.
* **elementwise and copies** (arithmetic, comparisons, activations, casts, gathers, scatters, padding, concatenation,
  fills, index ops): ``ELEMENTWISE`` per output element. Memory-bound work is slower per element than a matmul is per
  FLOP, so the constant is above 1; it makes the time a worker allows a job (see ``seconds_allowed``) cover it.
* **transcendental** (exp, log, trig, erf, gelu, sigmoid, tanh, pow, ...): ``TRANSCENDENTAL`` per output element.
* **reductions and normalisations** (sum, mean, var, softmax, layer/group/batch norm, cumsum, argmax, ...):
  ``REDUCTION`` per *input* element.
* **sort, topk**: ``ELEMENTWISE`` · n · ceil(log2(size of the sorted dim)) over the input.
* **pooling, upsampling, grid sampling**: ``ELEMENTWISE`` per output element per window element (or per
  interpolation point); adaptive pooling per input element.
* **FFT**: 5·n·log2(n) over the transformed signal.
* **views and shape queries** (view, permute, expand, slice, select, squeeze, alias, sym_size...): 0 — no data moves.
  But an *output* that is a weight, a session's state, or an ``expand`` (or a view of one) is copied into the answer
  for work no node counted: ``ELEMENTWISE`` per element (an ``expand`` of one number into a gigabyte answer, or a
  weight returned by every call, was free).

Every op that is not a view also costs at least the elements it reads and writes (the sum over its tensor arguments
and its output): a scatter through a huge, freely expanded index, or an adaptive pool that upsamples, is billed for
the elements it touches whatever its class formula says. Arguments are bound by the op's schema first, so a program
passing them by keyword is counted the same.
"""

from __future__ import annotations

import array
import functools
import math
from typing import Any, Callable, Sequence

import torch
from torch.utils.flop_counter import flop_registry

ELEMENTWISE = 4
TRANSCENDENTAL = 8
REDUCTION = 4

#: A worker assumes no job runs slower than this share of its measured peak (matmul) speed: memory-bound ops on a
#: large GPU reach roughly 0.1-0.5% of its matmul peak in FLOP-equivalents of ELEMENTWISE per element (gathers and
#: fp64 less), a CPU's far more; the margin below that keeps honest jobs from being stopped.
MIN_EFFICIENCY = 0.0005
#: Seconds every job is allowed on top of its counted work (program load, a cold executor, the first kernel launches).
GRACE_SECONDS = 30.0


def _numel(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(v) for v in x)
    return 0


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            found = _first_tensor(tuple(a))
            if found is not None:
                return found
    return None


def _per_output(k: int) -> Callable:
    return lambda args, kwargs, out: k * _numel(out)


def _per_input(k: int) -> Callable:
    return lambda args, kwargs, out: k * _numel(_first_tensor(args))


def _free(args, kwargs, out) -> int:
    return 0


def _torch_formula(packet) -> Callable:
    formula = flop_registry[packet]
    return lambda args, kwargs, out: int(formula(*args, **kwargs, out_val=out))


def _cdist(args, kwargs, out) -> int:
    return 3 * out.numel() * args[0].shape[-1]  # one term per output distance and feature (batch broadcast included)


def _pdist(args, kwargs, out) -> int:
    x = args[0]
    n, d = x.shape[0], x.shape[1]
    return 3 * (n * (n - 1) // 2) * d


def _log2_ceil(size: int) -> int:
    """ceil(log2(size)), at least 1, in integers: both sides bill this count, and a libm's log2 may differ by a bit."""
    return max(1, (max(int(size), 2) - 1).bit_length())


def _sort(args, kwargs, out) -> int:
    x = args[0]
    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim", -1)
    size = x.shape[dim] if x.dim() else 1
    return ELEMENTWISE * x.numel() * _log2_ceil(size)


def _topk(args, kwargs, out) -> int:
    x = args[0]
    dim = args[2] if len(args) > 2 and isinstance(args[2], int) else kwargs.get("dim", -1)
    size = x.shape[dim] if x.dim() else 1
    return ELEMENTWISE * x.numel() * _log2_ceil(size)


def _window(spatial: int) -> Callable:
    """A pooling window's work per output element: the kernel's size over ``spatial`` dimensions (one number, or a
    one-element list, stands for every one of them: ``[25]`` in 3-D is 25**3, not 25)."""

    def count(args, kwargs, out) -> int:
        kernel = args[1] if len(args) > 1 else kwargs.get("kernel_size", [1])
        kernel = list(kernel) if isinstance(kernel, (list, tuple)) else [int(kernel)]
        if len(kernel) == 1:
            kernel = kernel * spatial
        return ELEMENTWISE * _numel(out) * max(1, math.prod(kernel))

    return count


def _interpolate(points: int) -> Callable:
    return lambda args, kwargs, out: ELEMENTWISE * points * _numel(out)


def _fft(args, kwargs, out) -> int:
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim", [])
    n = math.prod(x.shape[d] for d in dims) if dims and x.dim() else max(1, x.numel())
    batch = x.numel() // max(1, n)
    return int(5 * batch * n * max(1.0, math.log2(max(n, 2))))


def _embedding_bag(args, kwargs, out) -> int:
    weight, indices = args[0], args[1]
    return ELEMENTWISE * indices.numel() * (weight.shape[1] if weight.dim() > 1 else 1)


_VIEWS = """alias expand permute select slice split split_with_sizes squeeze unsqueeze view diagonal sym_size
sym_numel"""
_ELEMENTWISE_OPS = """abs add bitwise_and bitwise_not bitwise_or bitwise_xor ceil clamp clone _to_copy copy div eq
fill floor fmod ge gt hardtanh isinf isnan le leaky_relu logical_and logical_not logical_or logical_xor lt maximum
minimum mul ne neg relu remainder round sign sub trunc where cat constant_pad_nd flip full full_like arange
scalar_tensor gather index index_put index_select masked_scatter repeat scatter scatter_add scatter_reduce
select_scatter slice_scatter embedding reflection_pad1d reflection_pad2d reflection_pad3d replication_pad2d
replication_pad3d tril triu col2im"""
_TRANSCENDENTAL_OPS = """acos acosh asin asinh atan atan2 atanh cos cosh elu erf exp expm1 gelu log log10 log1p log2
pow reciprocal rsqrt sigmoid sin sinh sqrt tan tanh"""
_REDUCTION_OPS = """amax amin any argmax argmin cumsum max mean min prod sum var _softmax _log_softmax
native_layer_norm native_group_norm _native_batch_norm_legit_no_training _adaptive_avg_pool2d _adaptive_avg_pool3d
adaptive_avg_pool1d"""

#: Cost formula by op packet name (``aten.<name>`` without the overload): every allowlisted op must have one.
FORMULAS: dict[str, Callable] = {
    **{name: _free for name in _VIEWS.split()},
    **{name: _per_output(ELEMENTWISE) for name in _ELEMENTWISE_OPS.split()},
    **{name: _per_output(TRANSCENDENTAL) for name in _TRANSCENDENTAL_OPS.split()},
    **{name: _per_input(REDUCTION) for name in _REDUCTION_OPS.split()},
    "mm": _torch_formula(torch.ops.aten.mm),
    "addmm": _torch_formula(torch.ops.aten.addmm),
    "bmm": _torch_formula(torch.ops.aten.bmm),
    "convolution": _torch_formula(torch.ops.aten.convolution),
    "_cdist_forward": _cdist,
    "_pdist_forward": _pdist,
    "sort": _sort,
    "topk": _topk,
    "avg_pool1d": _window(1),
    "avg_pool2d": _window(2),
    "avg_pool3d": _window(3),
    "max_pool2d_with_indices": _window(2),
    "max_pool3d_with_indices": _window(3),
    "upsample_nearest2d": _interpolate(1),
    "upsample_bilinear2d": _interpolate(4),
    "grid_sampler_2d": lambda args, kwargs, out: ELEMENTWISE * (16 if len(args) > 2 and args[2] == 2 else 4)
    * _numel(out),  # interpolation_mode 2 is bicubic: 16 taps
    "_fft_r2c": _fft,
    "_fft_c2r": _fft,
    "_embedding_bag": _embedding_bag,
}


def packet_name(op_name: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    return op_name.split(".")[1] if op_name.startswith("aten.") else op_name.split(".")[0]


def formula_for(op_name: str, overload=None) -> Callable | None:
    """The counted cost of one call of ``op_name`` as ``cost(args, kwargs, out)``; None for an op without a formula.
    ``overload`` (the op's ``OpOverload``) lets keyword arguments be bound by its schema."""
    formula = FORMULAS.get(packet_name(op_name))
    if formula is None or formula is _free:
        return formula

    def counted(args, kwargs, out) -> int:
        if kwargs and overload is not None:
            from gpunet.job.guards import _bind

            bound = _bind(overload, list(args), kwargs)
            params = overload._schema.arguments
            args = [bound[a.name] for a in params if not a.kwarg_only and a.name in bound]
            kwargs = {a.name: bound[a.name] for a in params if a.kwarg_only and a.name in bound}
        touched = _numel(list(args)) + _numel(list(kwargs.values())) + _numel(out)
        return max(int(formula(args, kwargs, out)), touched)

    return counted


# --- memory some kernels take beyond their output ---------------------------------------------------------------


def _conv_columns(args, kwargs, out) -> int:
    """torch's CPU convolution outside oneDNN (float64, float16; oneDNN takes float32 and bfloat16) unfolds its input
    into "columns" (im2col, vol2col) first: (C/groups)·prod(kernel)·prod(spatial)·N elements, measured equal to this
    on torch 2.13, three times it for a transposed float16 one (computed through float32)."""
    x, weight = args[0], args[1]
    if x.dtype in (torch.float32, torch.bfloat16) or weight.dim() < 3:
        return 0
    transposed = bool(args[6]) if len(args) > 6 else False
    # weight: (C_out, C_in/groups, *kernel), transposed (C_in, C_out/groups, *kernel): its dim 1 is the channels
    # unfolded per group either way; the positions, the output's (the input's when transposed): the larger, here.
    spatial = max(math.prod(x.shape[2:]), math.prod(out.shape[2:]))
    columns = x.shape[0] * weight.shape[1] * math.prod(weight.shape[2:]) * spatial * x.element_size()
    return columns * (3 if transposed and x.dtype == torch.float16 else 1)


def workspace_for(op_name: str, device: torch.device, overload=None) -> Callable | None:
    """Bytes one call of ``op_name`` allocates for itself on ``device`` beyond its output (the dry run counts them at
    their node, gone after it), as ``workspace(args, kwargs, out)``; None where that is small. Only the CPU's are
    known: a 31x31 float64 convolution took 1.9 GiB beside a 2 MiB output. Elsewhere the device's memory limit on the
    executor (gpunet.worker.executor) is what bounds them."""
    if device.type != "cpu" or packet_name(op_name) != "convolution":
        return None

    def workspace(args, kwargs, out) -> int:
        if kwargs and overload is not None:
            from gpunet.job.guards import _bind

            bound = _bind(overload, list(args), kwargs)
            args = [bound.get(a.name) for a in overload._schema.arguments]
        return _conv_columns(args, kwargs, out)

    return workspace


def delivered_views(outputs: list[torch.Tensor], views: Sequence[bool]) -> int:
    """The copy that delivers each output that is a weight or an expand (``views``, per output; see the module's
    table). Decided from the graph, not from strides: the client and the worker must count the same."""
    return sum(ELEMENTWISE * o.numel() for o, view in zip(outputs, views) if view)


def seconds_allowed(cost: int, tflops: float) -> float:
    """The longest a job of ``cost`` counted work may run on a device measured at ``tflops`` (its best dtype): what
    it is paid for, at ``MIN_EFFICIENCY`` of that speed, plus ``GRACE_SECONDS``."""
    rate = max(tflops, 1e-3) * 1e12 * MIN_EFFICIENCY
    return GRACE_SECONDS + cost / rate


#: No node runs faster than this many times the device's measured peak (matmul, best dtype): a figure measured on a
#: busy machine can be low, and an honest job must never be stopped for a speed the device does reach.
PEAK_SLACK = 2.0
#: Seconds any node may take on top of what its counted work allows at ``MIN_EFFICIENCY`` (a loaded machine).
NODE_FLOOR_SECONDS = 5.0


def least_seconds(cost: int, tflops: float) -> float:
    """The least time one node of ``cost`` counted work can take on a device measured at ``tflops``: a node that
    cannot end before its job's time is up is not started (stopped before it runs, not killed inside it)."""
    return cost / (max(tflops, 1e-3) * 1e12 * PEAK_SLACK)


def node_seconds_allowed(cost: int, tflops: float) -> float:
    """The longest one node of ``cost`` counted work may take (as ``seconds_allowed`` for a job, per node): a node
    past it stops its run at the next node, whatever time the job has left."""
    return NODE_FLOOR_SECONDS + cost / (max(tflops, 1e-3) * 1e12 * MIN_EFFICIENCY)


@functools.lru_cache(maxsize=16)
def node_bounds(costs: tuple[int, ...], tflops: float) -> tuple[array.array, array.array]:
    """:func:`least_seconds` and :func:`node_seconds_allowed` of every node at once, for one shape's counted work (a
    run's pacer binds them before its first node: a call each per node cost a forward at decode shapes a tenth of its
    time; the same shapes come back every step of a session). 16 bytes a node, 16 shapes."""
    best, worst = max(tflops, 1e-3) * 1e12 * PEAK_SLACK, max(tflops, 1e-3) * 1e12 * MIN_EFFICIENCY
    return (array.array("d", (c / best for c in costs)),
            array.array("d", (NODE_FLOOR_SECONDS + c / worst for c in costs)))
