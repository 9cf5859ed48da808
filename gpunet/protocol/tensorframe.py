"""The framing of tensor bytes, without torch: an 8-byte little-endian header length, a compact JSON header padded
so the data section starts ALIGN-aligned, then the data (the safetensors layout).

Its one home: ``gpunet.job.tensors`` encodes tensors with it, and the worker's service, which needs no torch, uses
it to pass a span's step output on as the next span's input byte for byte as the client would encode it (both
sides hash those bytes).
"""

from __future__ import annotations

import json
import struct

ALIGN = 64  # what PyTorch's CPU allocator guarantees; BLAS kernels choose their code path by alignment


def frame_header(header: dict, start: int = 0) -> bytes:
    """The length prefix and padded compact JSON of ``header`` (the bytes before the data section). ``start``: where
    these bytes will begin in a bigger buffer (a program's container), so the data section lands ALIGN-aligned there:
    mapped page-aligned, its tensors are used where they lie."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(start + 8 + len(head)) % ALIGN)
    return struct.pack("<Q", len(head)) + head


#: One tensor's header is a few hundred bytes; a longer one is not renamed.
MAX_RENAMED_HEADER = 64 * 1024


def renamed(data: bytes, old: str, new: str) -> bytes | None:
    """``data`` holding exactly one tensor, named ``old``, as the same tensor named ``new``; None for anything else.

    The header is only re-framed, not checked: the receiver decodes the result like any input.
    """
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_RENAMED_HEADER or 8 + n > len(data):
        return None
    try:
        header = json.loads(data[8:8 + n])
        if not isinstance(header, dict) or list(header) != [old]:
            return None
        return frame_header({new: header[old]}) + data[8 + n:]
    except (ValueError, RecursionError):  # not JSON, or nested too deep to write back
        return None
