"""The records that cross the wire through the DHT, in one place.

Each record is a strict pydantic model: on the wire it is a msgpack map whose unknown fields are ignored (so old and
new versions share a network) while known fields must have exactly their type (no silent coercion of ``"1"`` to 1).
A record's ``format`` is its major version: a reader refuses formats newer than it understands.
"""

from __future__ import annotations

import enum
import hashlib
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpunet.errors import InvalidRecord

#: 2: ``price`` is in credits per TFLOP (it was per PFLOP in format 1; such records are read with it converted).
WORKER_RECORD_FORMAT = 2

#: Worker records are spread over this many DHT keys so that one key stays far below hivemind's 4 MiB message limit
#: (about 400 bytes a record: 10,000 workers put ~60 KiB in a bucket). Readers and writers must agree, so it is part
#: of the record format, not a setting.
WORKER_BUCKETS = 64

#: Caps applied before a record is accepted; they bound what a malicious peer can make every reader parse and every
#: DHT node store and serve. A record whose every field is at its schema maximum packs to about 3.5 KiB (honest ones
#: are ~500 bytes); fields this version does not know (a newer version's) may add at most ``MAX_UNKNOWN_FIELD_BYTES``.
#: A bucket of padded records could otherwise be pushed past the daemon's 4 MiB reply cap by a few hundred sybils.
MAX_RECORD_BYTES = 4 * 1024
MAX_UNKNOWN_FIELD_BYTES = 512
MAX_CACHED_PROGRAMS = 16
MAX_CHECKPOINTS = 4  # checkpoint ids one record lists (a record is capped at 4 KiB, room for later fields kept)
MAX_ADVERTISED_MADDRS = 6
#: The longest address a record carries (a relayed IPv6 one is about 180); what fits the record cap with the rest.
MAX_MADDR_CHARS = 200
#: A device's name (a GPU's is about 25 characters, a CPU model's up to about 50) and a paused worker's reason: cut to
#: this by the worker (the lanes' and pause fields took the room that longer ones had).
MAX_DEVICE_NAME = 72
MAX_PAUSE_REASON = 64

#: Text readers print (status tables, the explorer, logs) has none of these: control characters (an ESC clears a
#: reader's screen or plants a terminal hyperlink) and the invisible or direction-changing ones (U+202E shows a name
#: backwards: another worker's, to a reader). Markup in text is escaped where it is printed.
_UNPRINTABLE = ((0x00, 0x1F), (0x7F, 0x9F), (0x200B, 0x200F), (0x2028, 0x202E), (0x2060, 0x2069), (0xFEFF, 0xFEFF))
_PRINTABLE = "^[^" + "".join(f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in _UNPRINTABLE) + "]*$"  # pydantic's (Rust) regex
_UNPRINTABLE_RE = re.compile("[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in _UNPRINTABLE) + "]")


def printable(text: str, max_length: int) -> str:
    """``text`` as a record may carry it: unprintable characters as spaces, cut to ``max_length``."""
    return _UNPRINTABLE_RE.sub(" ", text)[:max_length]


def _text(max_length: int):
    return Annotated[str, Field(max_length=max_length, pattern=_PRINTABLE)]


_Name = _text(64)
_NonNegInt = Annotated[int, Field(ge=0, le=2**62)]
#: Figures are summed and scaled by readers (a network's TFLOPS, credits in nano-credits): finite and far from
#: float's limits, so no total overflows to inf (not JSON) or an int conversion fails.
_NonNegFloat = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]


class WorkerState(str, enum.Enum):
    """Lifecycle of a worker as others see it: only ``online`` workers get new jobs."""

    JOINING = "joining"
    ONLINE = "online"
    PAUSED = "paused"  # its owner is using the machine (or asked it to pause): ``pause_reason`` says which
    DRAINING = "draining"
    OFFLINE = "offline"  # a tombstone: the worker left cleanly, readers drop it at once


def _no_extension(code: int, data: bytes):
    """Records are plain msgpack. hivemind's readers decode extension types with hooks of their own, and one that
    raises there leaves their whole search unanswered (every worker of the bucket hidden, discovery hung): refused
    at store time instead."""
    raise ValueError(f"msgpack extension type {code} in a record")


def _plain(data) -> bool:
    """Only nil, bool, int, float, str, bytes, arrays and maps (msgpack's timestamps, decoded without the hook, too
    are refused); iterative, so a deeply nested record cannot exhaust the stack."""
    todo = [data]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif item is not None and not isinstance(item, (bool, int, float, str, bytes)):
            return False
    return True


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    @classmethod
    def unknown_field_bytes(cls, data: dict) -> int:
        """Packed size of the fields of ``data`` this version does not know, nested models included."""
        size = 0
        for name, value in data.items():
            field = cls.model_fields.get(name) if isinstance(name, str) else None
            if field is None:
                size += len(msgpack.packb([name, value], default=repr))
            elif isinstance(value, dict) and isinstance(field.annotation, type) and issubclass(field.annotation,
                                                                                               _WireModel):
                size += field.annotation.unknown_field_bytes(value)
        return size


class DeviceInfo(_WireModel):
    """What a worker computes on: one kind of device, possibly several of them."""

    kind: Annotated[str, Field(pattern=r"^(cpu|cuda)$")]
    name: _text(MAX_DEVICE_NAME)
    count: Annotated[int, Field(ge=1, le=1024)] = 1
    memory_total: _NonNegInt = 0  # bytes, per device
    memory_free: _NonNegInt = 0  # bytes, per device (the least free across devices)
    cores: _NonNegInt = 0  # CPU cores (cpu devices)
    driver: _text(32) | None = None  # NVML's: "550.54.15"
    cuda: _text(16) | None = None  # "12.4"
    utilization: Annotated[float, Field(ge=0, le=100)] | None = None  # percent, mean across devices


class WorkerRecord(_WireModel):
    """A worker's advertisement: what status shows and what routing reads. Keyed in the DHT by the worker's peer id."""

    format: Annotated[int, Field(ge=1)] = WORKER_RECORD_FORMAT
    version: _text(32)
    state: Annotated[WorkerState, Field(strict=False)]  # lax only here: accepts the enum's string value
    device: DeviceInfo
    tflops: dict[_text(16), _NonNegFloat] = Field(default_factory=dict, max_length=6)
    price: _NonNegFloat = 0.0  # credits per TFLOP of counted work (format 1: per PFLOP, converted on reading)
    max_concurrent: Annotated[int, Field(ge=1, le=4096)] = 1
    #: Jobs one client may have there at once per lane, running or queued (its share: all running slots, half the
    #: queue); more are answered "busy", so a client keeps the rest waiting on its side. None: it predates this field.
    client_places: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    queue: _NonNegInt = 0
    jobs_done: _NonNegInt = 0
    started_at: _NonNegFloat = 0.0  # unix time the worker came up; uptime = now - started_at
    updated_at: _NonNegFloat = 0.0  # unix time of this heartbeat (by the worker's clock)
    programs: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(default_factory=list,
                                                                          max_length=MAX_CACHED_PROGRAMS)
    #: The checkpoints its models dirs hold in full (gpunet.job.checkpoints.checkpoint_id): programs naming their
    #: weights by reference load them from its disk (docs/weights.md).
    checkpoints: list[Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = Field(default_factory=list,
                                                                             max_length=MAX_CHECKPOINTS)
    name: _Name | None = None
    maddrs: list[_text(MAX_MADDR_CHARS)] = Field(default_factory=list,
                                                                           max_length=MAX_ADVERTISED_MADDRS)
    ledger_count: _NonNegInt = 0
    ledger_head: _text(64) | None = None
    #: Credits earned by receipts the worker vouches for (its own job path, or a party it trusts; never merged ones of
    #: peers it never dealt with: docs/ledger.md). Its own word, like every field.
    credits_earned: _NonNegFloat = 0.0
    #: How peers reach it (gpunet.dht.reachability): "direct", "relayed" (through the relays in its maddrs) or
    #: "unknown". Any other short word (a later version's) is read as it is.
    reachability: _text(16) = "unknown"
    #: Workers behind NAT it reaches by a direct connection now (hole-punched: gpunet.dht.observers): pushes
    #: between it and them go straight, not through two relay legs.
    punched: _NonNegInt = 0
    #: Program bytes it served to other workers, and fetched from them, since it started (gpunet.worker.peers).
    peer_bytes_served: _NonNegInt = 0
    peer_bytes_fetched: _NonNegInt = 0
    #: The batch lane (docs/market.md): the least its floor goes (credits per TFLOP), the floor now (it rises with
    #: interactive demand, up to ``price``), how busy interactive work kept it lately (0-1) and how many batch jobs
    #: it stopped for it lately (a batch job's chance of being preempted here), and batch jobs waiting. No batch_price: a worker that predates lanes (it sells batch
    #: work as interactive, at ``price``).
    batch_price: _NonNegFloat | None = None
    batch_floor: _NonNegFloat | None = None
    interactive_load: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0
    preemptions_per_hour: _NonNegFloat = 0.0  # batch jobs it stopped for interactive work, lately
    batch_queue: _NonNegInt = 0
    #: Why a ``paused`` worker takes no jobs now (gpunet.worker.state.availability), in its owner's words or the rule's.
    pause_reason: _text(MAX_PAUSE_REASON) | None = None

    def to_wire(self) -> dict[str, Any]:
        """A plain dict for the DHT (hivemind msgpack-encodes it); enum values as strings."""
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_wire(cls, data: Any) -> "WorkerRecord":
        """Parse a record read from the network, strictly; raises InvalidRecord with the first problem."""
        if not isinstance(data, dict):
            raise InvalidRecord(f"worker record must be a map, got {type(data).__name__}")
        fmt = data.get("format")
        if isinstance(fmt, int) and fmt > WORKER_RECORD_FORMAT:
            raise InvalidRecord(f"worker record format {fmt} is newer than this gpunet understands")
        unknown = cls.unknown_field_bytes(data)
        if unknown > MAX_UNKNOWN_FIELD_BYTES:
            raise InvalidRecord(f"worker record carries {unknown} bytes of unknown fields; at most "
                                f"{MAX_UNKNOWN_FIELD_BYTES} are allowed")
        if fmt == 1 and type(data.get("price")) in (int, float):
            data = {**data, "price": data["price"] / 1000}  # per PFLOP -> per TFLOP
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            why = first["msg"].removeprefix("Value error, ")  # pydantic's wording for a validator's own message
            raise InvalidRecord(f"worker record field {'.'.join(map(str, first['loc']))}: {why}") from None

    @classmethod
    def from_wire_bytes(cls, raw: bytes) -> "WorkerRecord":
        """Decode msgpack bytes with every size capped before parsing."""
        if len(raw) > MAX_RECORD_BYTES:
            raise InvalidRecord(f"worker record is {len(raw)} bytes, over the {MAX_RECORD_BYTES}-byte cap")
        try:
            data = msgpack.unpackb(raw, raw=False, strict_map_key=True, ext_hook=_no_extension)
        except Exception as e:  # msgpack raises several unrelated types on malformed input
            raise InvalidRecord(f"worker record is not valid msgpack: {e}") from None
        if not _plain(data):
            raise InvalidRecord("worker record holds a msgpack extension type")
        return cls.from_wire(data)

    def uptime(self, now: float | None = None) -> float:
        return max(0.0, (now if now is not None else time.time()) - self.started_at) if self.started_at else 0.0

    @property
    def best_tflops(self) -> float:
        return max(self.tflops.values(), default=0.0)


def worker_bucket(worker_id: str) -> int:
    """Which bucket key a worker's record lives under: a stable hash of its id."""
    return int.from_bytes(hashlib.sha256(worker_id.encode()).digest()[:4], "big") % WORKER_BUCKETS


def worker_key(network: str, bucket: int) -> str:
    return f"{network}.workers.{bucket}"


def worker_keys(network: str) -> list[str]:
    return [worker_key(network, b) for b in range(WORKER_BUCKETS)]


@dataclass(frozen=True)
class WorkerEntry:
    """A worker as discovery sees it: its id (a peer id), its record, and when the record expires."""

    id: str
    record: WorkerRecord
    expiration_time: float

    @property
    def state(self) -> WorkerState:
        return self.record.state
