"""Argument checks for allowlisted ops whose CPU kernels are not memory-safe on every input.

The meta-device dry run checks shapes and dtypes but cannot see values; most kernels check values themselves and
raise (an index out of range is an IndexError), but a few trust their arguments and read or write out of bounds —
a segfault at best. Each such op gets a guard here, run on the real arguments just before the kernel, found and kept
honest by the op fuzzer (:mod:`gpunet.testing.opfuzz`, ``scripts/fuzz_ops.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from gpunet.errors import JobFailed

Guard = Callable[[list], None]


def _refuse(op: str, why: str) -> None:
    raise JobFailed(f"{op}: {why} (refused before the kernel ran)")


def _embedding_bag(args: list) -> None:
    """The CPU kernel trusts its offsets: empty offsets in max mode segfault, and decreasing or negative ones read
    outside the indices (one error message even printed a heap address)."""
    op = "aten._embedding_bag"
    weight, indices, offsets = args[0], args[1], args[2]
    if indices.dim() != 1 or offsets.dim() != 1:
        _refuse(op, "indices and offsets must be 1-D")
    n = indices.numel()
    if offsets.numel() == 0:
        if n:
            _refuse(op, "offsets must not be empty when there are indices")
    elif int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > n:
        _refuse(op, "offsets must start at 0, never decrease, and stay within the indices")
    if n and (int(indices.min()) < 0 or int(indices.max()) >= weight.shape[0]):
        _refuse(op, f"indices must be in [0, {weight.shape[0]})")
    per_sample = args[6] if len(args) > 6 else None
    if per_sample is not None and tuple(per_sample.shape) != tuple(indices.shape):
        _refuse(op, "per_sample_weights must have the shape of indices")


def _fft_dims(op: str, tensor, dims: list, normalization) -> None:
    """The FFT kernels trust ``dim`` to be what torch.fft passes them: wrapped, in range and unique. A negative or
    out-of-range dim segfaults or corrupts the heap (found by the fuzzer)."""
    if not dims or any(not 0 <= d < tensor.dim() for d in dims) or len(set(dims)) != len(dims):
        _refuse(op, f"dim must list distinct dimensions in [0, {tensor.dim()})")
    if normalization not in (0, 1, 2):
        _refuse(op, "normalization must be 0, 1 or 2")


def _fft_r2c(args: list) -> None:
    _fft_dims("aten._fft_r2c", args[0], list(args[1]), args[2])


def _fft_c2r(args: list) -> None:
    _fft_dims("aten._fft_c2r", args[0], list(args[1]), args[2])
    if args[3] < 1:
        _refuse("aten._fft_c2r", "last_dim_size must be at least 1")


#: Guards by op name as it appears in a program ("aten.<name>.<overload>").
GUARDS: dict[str, Guard] = {
    "aten._embedding_bag.default": _embedding_bag,
    "aten._fft_r2c.default": _fft_r2c,
    "aten._fft_c2r.default": _fft_c2r,
}


def check(op: str, args: list[Any]) -> None:
    """Raise JobFailed if ``args`` would make ``op``'s kernel unsafe; nothing for ops without a guard."""
    guard = GUARDS.get(op)
    if guard is not None:
        guard(args)

