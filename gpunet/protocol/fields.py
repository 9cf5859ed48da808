"""What every message stands on: :class:`Message` (a type tag, one encoder, one strict parser, and the registry
:data:`MESSAGES` that :func:`gpunet.protocol.framing.decode` looks a tag up in) and the checked fields its parsers read.

A field parser takes the decoded map and a field name and returns the value or raises :class:`ProtocolError`: the
type is exact (bool is never an int), ids match their pattern before they become file names or log text, numbers are
finite and sizes non-negative. Free text is cut and cleaned rather than refused.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar, TypeVar

from gpunet.errors import ProtocolError
from gpunet.protocol.holding import PROOF_BYTES

JOB_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")
PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}\Z")  # base58
PROGRAM_HASH_RE = re.compile(r"[0-9a-f]{64}\Z")  # it becomes a file name: no path tricks


def typed_field(d: dict, name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """A field of the expected type (bool is never accepted as int); ProtocolError otherwise."""
    value = d.get(name)
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"message {d.get('t')!r}: field {name!r} must be {'/'.join(k.__name__ for k in kinds)}")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def text_field(d: dict, name: str, limit: int) -> str:
    """A free-text field (a reason, a message): a string cut to ``limit`` with control characters replaced (it ends
    up in logs and terminals: no forged log lines, no escape sequences), or empty when it is anything else."""
    value = d.get(name)
    return _CONTROL.sub("?", value[:limit]) if isinstance(value, str) else ""


def time_field(d: dict, name: str) -> float:
    value = float(typed_field(d, name, (int, float)))
    if not math.isfinite(value):
        raise ProtocolError(f"message {d.get('t')!r}: {name} must be a finite number")
    return value


def job_id_field(d: dict, name: str = "job") -> str:
    job_id = typed_field(d, name, str)
    if not JOB_ID_RE.match(job_id):
        raise ProtocolError("job id must be 1-64 characters of [A-Za-z0-9_.:-]")
    return job_id


def program_hash_field(d: dict, name: str = "program") -> str:
    program = typed_field(d, name, str)
    if not PROGRAM_HASH_RE.match(program):
        raise ProtocolError("program hash must be 64 lowercase hex characters")
    return program


def size_field(d: dict, name: str, optional: bool = False) -> int | None:
    size = typed_field(d, name, int, optional)
    if size is not None and size < 0:
        raise ProtocolError(f"message {d.get('t')!r}: {name} must be a non-negative integer")
    return size


def is_index(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


def peer_id_field(d: dict, name: str) -> str:
    peer_id = typed_field(d, name, str)
    if not PEER_ID_RE.match(peer_id):
        raise ProtocolError(f"{name} must be a base58 peer id")
    return peer_id


M = TypeVar("M", bound="Message")
MESSAGES: dict[str, type["Message"]] = {}


class Message:
    """A protocol message: ``T`` is its type tag on the wire."""

    T: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        MESSAGES[cls.T] = cls

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_wire(cls: type[M], d: dict) -> M:
        raise NotImplementedError


def proof_field(d: dict, name: str, what: str) -> bytes | None:
    """An optional field of PROOF_BYTES bytes: a proof of holding, a grant or an upload token (gpunet.protocol.holding)."""
    value = typed_field(d, name, bytes, optional=True)
    if value is not None and len(value) != PROOF_BYTES:
        raise ProtocolError(f"{what}: {name} must be {PROOF_BYTES} bytes")
    return value
