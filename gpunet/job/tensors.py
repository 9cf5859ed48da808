"""Tensors as bytes in the safetensors layout: 8-byte little-endian header length, JSON header, raw data.

Used for weights, inputs and outputs. Decoding trusts nothing: every size is capped before anything is allocated,
dtypes come from a closed list, offsets must tile the data exactly, and tensors come back as zero-copy views of the
buffer when the data is aligned. Never pickle.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from typing import Mapping, NamedTuple

import torch

from gpunet.errors import JobRejected
from gpunet.protocol.tensorframe import ALIGN, frame_header  # noqa: F401 (ALIGN: tensors.ALIGN to its users)

# Closed list: safetensors dtype name <-> torch dtype. Anything else is rejected.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_TENSORS = 100_000
MAX_NDIM = 16
#: The most elements a shape may span, counting an empty dimension as 1: past it, torch cannot compute the strides
#: (even of an empty tensor such as shape [0, 2**63]).
MAX_EXTENT = 2**62
MAX_NAME_LEN = 512
DEFAULT_MAX_TOTAL_BYTES = 16 * 1024**3


def aligned_copy(data: bytes | bytearray | memoryview) -> memoryview:
    """One copy of ``data`` into ALIGN-aligned memory (so decoded views are aligned like eager PyTorch's tensors)."""
    src = memoryview(data).cast("B")
    dst = torch.empty(src.nbytes, dtype=torch.uint8)
    if src.nbytes:
        dst.numpy()[:] = src
    return memoryview(dst.numpy())


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; raises JobRejected for dtypes gpunet does not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise JobRejected(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})") from None


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of ``t``'s data (copying only if it is not contiguous or not on the CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def encode(tensors: Mapping[str, torch.Tensor], start: int = 0) -> bytes:
    """Serialise named tensors. Tensors are ordered by decreasing item size so every one starts aligned to its item,
    and, of one item size, those of a whole number of ALIGN bytes first, so they all start ALIGN-aligned (``start``:
    where the bytes will begin in a bigger buffer, a program's container: see frame_header)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise JobRejected(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    entries = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[1].nbytes % ALIGN != 0, kv[0]))
    prefix = _encoded_header(tuple((name, t.dtype, tuple(t.shape)) for name, t in entries), start % ALIGN)
    return b"".join([prefix, *(raw_bytes(t) for _, t in entries)])


@functools.lru_cache(maxsize=1024)
def _encoded_header(layout: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...], start: int = 0) -> bytes:
    """Length prefix + padded JSON header for tensors of these names, dtypes and shapes (the same for every batch of
    one job, so built once)."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    return frame_header(header, start)


def _reject(msg: str) -> JobRejected:
    return JobRejected(f"bad tensor bytes: {msg}")


def decode(data: bytes | bytearray | memoryview, *, max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES) -> dict[str, torch.Tensor]:
    """Parse safetensors-layout bytes into named tensors (zero-copy views where aligned), in file order.

    Raises JobRejected, and nothing else, for any malformed input.
    """
    buf = memoryview(data).cast("B")
    total = buf.nbytes
    if total > max_total_bytes:
        raise _reject(f"{total} bytes exceeds the limit of {max_total_bytes}")
    if total < 8:
        raise _reject(f"{total} bytes is too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER_BYTES:
        raise _reject(f"header length {n} exceeds the limit of {MAX_HEADER_BYTES}")
    if 8 + n > total:
        raise _reject(f"header length {n} runs past the end of the {total}-byte buffer (truncated?)")
    head = bytes(buf[8 : 8 + n])
    plan = (_plan if n <= _PLAN_CACHE_HEADER_BYTES else _plan.__wrapped__)(head, total - (8 + n))
    data_start = 8 + n
    out = {name: _view(buf, data_start + begin, end - begin, dtype, shape)
           for begin, end, name, dtype, shape in plan.specs}
    return {name: out[name] for name in plan.order}


def decode_raw(data: memoryview, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor over raw bytes (a weight named by reference: gpunet.job.format.WeightRef), zero-copy where
    aligned. The caller checked the size."""
    return _view(memoryview(data).cast("B"), 0, math.prod(shape) * DTYPES[dtype].itemsize, DTYPES[dtype], tuple(shape))


class _Plan(NamedTuple):
    specs: tuple[tuple[int, int, str, torch.dtype, tuple[int, ...]], ...]  # sorted by offset
    order: tuple[str, ...]  # the header's order


#: Headers up to this size have their checked layout cached: a job's inputs and outputs repeat the same header.
_PLAN_CACHE_HEADER_BYTES = 4096


@functools.lru_cache(maxsize=1024)
def _plan(head: bytes, data_len: int) -> _Plan:
    """Parse and check a header against a data section of ``data_len`` bytes; raises JobRejected (never cached)."""
    try:
        header = json.loads(head, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:
        raise _reject(f"header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise _reject("header is not a JSON object")
    header.pop("__metadata__", None)  # free-form strings in the format; ignored
    if len(header) > MAX_TENSORS:
        raise _reject(f"{len(header)} tensors exceeds the limit of {MAX_TENSORS}")
    specs = []
    for name, spec in header.items():
        if len(name) > MAX_NAME_LEN:
            raise _reject(f"tensor name longer than {MAX_NAME_LEN} characters")
        if not isinstance(spec, dict):
            raise _reject(f"entry {name!r} is not an object")
        dtype = DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
        if dtype is None:
            raise _reject(f"tensor {name!r} has unsupported dtype {str(spec.get('dtype'))[:32]!r}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(d) and d >= 0 for d in shape):
            raise _reject(f"tensor {name!r} has an invalid shape")
        if math.prod(max(d, 1) for d in shape) > MAX_EXTENT:  # an empty tensor's strides must still be int64s
            raise _reject(f"tensor {name!r} has dimensions too large for any tensor")
        offs = spec.get("data_offsets")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise _reject(f"tensor {name!r} has invalid data_offsets")
        begin, end = offs
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if not 0 <= begin <= end <= data_len:
            raise _reject(f"tensor {name!r} offsets [{begin}, {end}] are outside the {data_len}-byte data section")
        if end - begin != nbytes:
            raise _reject(f"tensor {name!r} has {end - begin} bytes but its shape and dtype need {nbytes}")
        specs.append((begin, end, name, dtype, tuple(shape)))
    specs.sort(key=lambda s: (s[0], s[1]))
    cursor = 0
    for begin, end, name, _, _ in specs:
        if begin != cursor:
            raise _reject(f"tensor {name!r} starts at {begin}, expected {cursor} (overlap or hole)")
        cursor = end
    if cursor != data_len:
        raise _reject(f"data section has {data_len} bytes but the tensors cover {cursor}")
    return _Plan(tuple(specs), tuple(header))


def _view(buf: memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buf[offset:offset+nbytes]``: zero-copy if aligned, else a copy. Never written to by gpunet."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset) if not buf.readonly else _ro(buf, offset, nbytes)
    itemsize = dtype.itemsize
    if raw.data_ptr() % itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _ro(buf: memoryview, offset: int, nbytes: int) -> torch.Tensor:
    # torch.frombuffer warns on read-only buffers; the interpreter only runs functional ops, so nothing writes to it.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)


# That warning is a warn-once inside torch: spend it here, silently, rather than wrap every decode in
# catch_warnings (which costs more than decoding a small tensor).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


def _is_int(x: object) -> bool:
    return type(x) is int


def _no_constants(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")
