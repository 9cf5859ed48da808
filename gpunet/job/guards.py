"""Argument checks for allowlisted ops whose CPU kernels are not memory-safe on every input.

The meta-device dry run checks shapes and dtypes but cannot see values; most kernels check values themselves and
raise (an index out of range is an IndexError), but a few trust their arguments and read or write out of bounds —
a segfault at best. Each such op gets a guard here, run on the real arguments just before the kernel, found and kept
honest by the op fuzzer (:mod:`gpunet.testing.opfuzz`, ``scripts/fuzz_ops.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpunet.errors import JobRaised

Guard = Callable[[list, dict], None]


def _bind(overload, args: list, kwargs: dict) -> dict[str, Any]:
    """Every argument of a call by its schema name, defaults filled in: a guard must see an argument however the
    program passed it (positionally or by keyword)."""
    bound = {}
    for i, arg in enumerate(overload._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _refuse(op: str, why: str) -> None:
    raise JobRaised(f"{op}: {why} (refused before the kernel ran)")  # the job's own values: the same anywhere


def _embedding_bag(args: list, kwargs: dict) -> None:
    """The CPU kernel trusts its offsets: empty offsets in max mode segfault (and with ``include_last_offset``, a
    single offset does), and decreasing or negative ones read outside the indices (one error even printed a heap
    address)."""
    op = "aten._embedding_bag"
    a = _bind(torch.ops.aten._embedding_bag.default, args, kwargs)
    weight, indices, offsets = a["weight"], a["indices"], a["offsets"]
    if indices.dim() != 1 or offsets.dim() != 1 or weight.dim() != 2:
        _refuse(op, "weight must be 2-D, indices and offsets 1-D")
    n = indices.numel()
    if a["include_last_offset"]:
        if offsets.numel() < 2 or int(offsets[-1]) != n:
            _refuse(op, "with include_last_offset, offsets must hold at least one bag and end at the number of "
                        "indices")
    elif offsets.numel() == 0 and n:
        _refuse(op, "offsets must not be empty when there are indices")
    if offsets.numel() and (int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > n):
        _refuse(op, "offsets must start at 0, never decrease, and stay within the indices")
    if n and (int(indices.min()) < 0 or int(indices.max()) >= weight.shape[0]):
        _refuse(op, f"indices must be in [0, {weight.shape[0]})")
    per_sample = a["per_sample_weights"]
    if per_sample is not None and tuple(per_sample.shape) != tuple(indices.shape):
        _refuse(op, "per_sample_weights must have the shape of indices")


def _fft_dims(op: str, tensor, dims: list, normalization) -> None:
    """The FFT kernels trust ``dim`` to be what torch.fft passes them: wrapped, in range and unique. A negative or
    out-of-range dim segfaults or corrupts the heap (found by the fuzzer)."""
    if not dims or any(not 0 <= d < tensor.dim() for d in dims) or len(set(dims)) != len(dims):
        _refuse(op, f"dim must list distinct dimensions in [0, {tensor.dim()})")
    if normalization not in (0, 1, 2):
        _refuse(op, "normalization must be 0, 1 or 2")


def _fft_r2c(args: list, kwargs: dict) -> None:
    a = _bind(torch.ops.aten._fft_r2c.default, args, kwargs)
    _fft_dims("aten._fft_r2c", a["self"], list(a["dim"]), a["normalization"])


def _fft_c2r(args: list, kwargs: dict) -> None:
    a = _bind(torch.ops.aten._fft_c2r.default, args, kwargs)
    _fft_dims("aten._fft_c2r", a["self"], list(a["dim"]), a["normalization"])
    if a["last_dim_size"] < 1:
        _refuse("aten._fft_c2r", "last_dim_size must be at least 1")


def _batch_norm_no_training(args: list, kwargs: dict) -> None:
    """The CPU kernel reads ``input.size(1)`` values of each of weight, bias, running_mean and running_var, whatever
    their size; the meta dry run broadcasts a one-element one and passes. A one-element bias read another client's
    session input back out of the executor's heap (an attacker's review), a big channel count segfaulted."""
    op = "aten._native_batch_norm_legit_no_training"
    a = _bind(torch.ops.aten._native_batch_norm_legit_no_training.default, args, kwargs)
    x = a["input"]
    if x.dim() < 2:
        _refuse(op, "input must have a channel dimension")
    channels = x.shape[1]
    for name in ("weight", "bias", "running_mean", "running_var"):
        t = a[name]
        if t is not None and (t.dim() != 1 or t.shape[0] != channels):
            _refuse(op, f"{name} must be 1-D with one value per channel ({channels}), not {list(t.shape)}")


#: Guards by op name as it appears in a program ("aten.<name>.<overload>").
GUARDS: dict[str, Guard] = {
    "aten._native_batch_norm_legit_no_training.default": _batch_norm_no_training,
    "aten._embedding_bag.default": _embedding_bag,
    "aten._fft_r2c.default": _fft_r2c,
    "aten._fft_c2r.default": _fft_c2r,
}


def check(op: str, args: list[Any], kwargs: dict[str, Any] | None = None) -> None:
    """Raise JobRaised if this call would make ``op``'s kernel unsafe; nothing for ops without a guard."""
    guard = GUARDS.get(op)
    if guard is not None:
        guard(args, kwargs or {})

