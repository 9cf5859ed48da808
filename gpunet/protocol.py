"""Every message of the job protocol, defined once for both ends: typed, with one encoder and one strict parser each.

Jobs travel through *doors*, one libp2p protocol each (:class:`Door`):

* ``job`` (a stream, any size)::

      client -> Submit{job, program, inputs_size, [inputs], timeout, max_price}
      worker -> Error{busy | rejected | ...}            at once: admission, before any payload moves
      worker -> Send{program, inputs}                   only when it lacks the program or the inputs were not inline
      client -> Payload{program_size, inputs_size} + raw program + raw inputs
      worker -> Result{outputs_size, [outputs], receipt} + raw outputs   | Error{code, message}
      client -> Countersign{job, signature} | Refuse{job, reason}         (or nothing: the work stays unpaid)

* ``run`` (unary, one round trip): Submit with inline inputs and ride-along countersignatures -> Result | UseStream |
  Error; ``settle`` (unary): Countersign | Refuse | SettleBatch -> Ok; ``cancel`` (unary): Cancel -> Ok,
  CloseSession -> SessionClosed;
  ``ping`` (unary): Ping -> Pong; ``info`` (a stream): GetInfo -> Info; ``prove`` (unary, see
  :mod:`gpunet.speedproof`): ProveSpeed -> SpeedCommitment, then OpenProof -> ProofOpening; ``reach`` (a stream,
  served by every node, see :mod:`gpunet.dht.reachability`): CheckReach -> ReachResult.

On a stream a *frame* is a 4-byte big-endian length then a msgpack map whose ``"t"`` names the message, at most
64 KiB; a *payload* is raw bytes whose size a preceding frame declared, checked against the reader's cap before
anything is allocated and read in 1 MiB chunks. A unary body is the same msgpack map (hivemind caps it at 4 MiB).
Nothing read from the wire is ever unpickled or evaluated; unknown fields are ignored, so either end may add some.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
import struct
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgpack

from gpunet.config import NETWORK_NAME
from gpunet.errors import (
    GpunetError,
    JobFailed,
    JobRaised,
    JobRejected,
    JobTimeout,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    JobPreempted,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.speedproof import COMMIT_BYTES, MAX_PRODUCTS, PICK_PRODUCTS, PICK_ROWS, SEED_BYTES, SIZES, Challenge, Opening
from gpunet.utils import human_bytes

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
CHUNK_BYTES = 1 << 20
#: Inputs and outputs at most this big ride inside a control frame (or a unary message), saving a round trip.
INLINE_BYTES = 32 * 1024
#: Unary replies ride hivemind's persistent daemon connection, whose messages are capped at 4 MiB.
UNARY_OUTPUT_BYTES = 1 << 20
#: A stream peer must send its next frame within this many seconds (a stalled peer must not hold a job slot).
FRAME_TIMEOUT = 10.0
#: ...and a payload at no less than this rate, beyond the frame timeout.
MIN_PAYLOAD_RATE = 1 << 20
#: The most a ping echoes: a session step's hidden state (d_model 16,384 in fp32), so a raw round trip can stand beside
#: a step of the same size (scripts/bench_pipeline.py's baseline).
MAX_PING_BYTES = 64 * 1024
#: Countersignatures one message may carry.
MAX_SETTLE_ITEMS = 1024
#: The biggest session step output a worker pushes to the next span's worker (docs/sessions.md, pushed steps); a
#: bigger one goes by way of the client.
MAX_PUSH_BYTES = 1 << 20
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}\Z")
_PEER_ID_RE = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}\Z")  # base58
PROGRAM_HASH_RE = re.compile(r"[0-9a-f]{64}\Z")  # it becomes a file name: no path tricks
_LEN = struct.Struct(">I")


class Door(enum.Enum):
    """A way into a worker: one libp2p protocol name each, and whether it is a stream or a unary call."""

    JOB = ("job", True)
    INFO = ("info", True)
    RUN = ("run", False, 256 * 1024)  # inline inputs (32 KiB) and up to 256 ride-along countersignatures
    SETTLE = ("settle", False, 256 * 1024)
    CANCEL = ("cancel", False, 4096)
    PING = ("ping", False, 2 * MAX_PING_BYTES)
    PROVE = ("prove", False, 4096)
    REACH = ("reach", True)  # a stream: the answering node must see the caller's address
    RELAY_PROBE = ("relay-probe", True)  # a bootstrap node's own check of its relay (gpunet.dht.reachability)
    PIECE = ("piece", True)  # a worker fetching a program it lacks from a peer that holds it (gpunet.worker.peers)
    PUSH = ("push", False, MAX_PUSH_BYTES + 4096)  # a session step's output, straight to the next span's worker
    HELLO = ("hello", False, 1024)  # which network a node runs: the one door outside any network (gpunet.dht.hello)

    def __init__(self, slug: str, stream: bool, max_request: int = MAX_FRAME_BYTES):
        """``max_request``: the largest request body this door reads (a unary door refuses bigger ones unread)."""
        self.slug, self.stream, self.max_request = slug, stream, max_request

    def protocol(self, network: str) -> str:
        if self is Door.HELLO:  # asked of a node whatever network it runs, to learn which
            return f"/gpunet/{self.slug}/{PROTOCOL_VERSION}"
        return f"/gpunet/{network}/{self.slug}/{PROTOCOL_VERSION}"


# --- checked fields ------------------------------------------------------------------------------------------------


def _get(d: dict, name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    """A field of the expected type (bool is never accepted as int); ProtocolError otherwise."""
    value = d.get(name)
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"message {d.get('t')!r}: field {name!r} must be {'/'.join(k.__name__ for k in kinds)}")
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _text(d: dict, name: str, limit: int) -> str:
    """A free-text field (a reason, a message): a string cut to ``limit`` with control characters replaced (it ends
    up in logs and terminals: no forged log lines, no escape sequences), or empty when it is anything else."""
    value = d.get(name)
    return _CONTROL.sub("?", value[:limit]) if isinstance(value, str) else ""


def _time(d: dict, name: str) -> float:
    value = float(_get(d, name, (int, float)))
    if not math.isfinite(value):
        raise ProtocolError(f"message {d.get('t')!r}: {name} must be a finite number")
    return value


def _job_id(d: dict, name: str = "job") -> str:
    job_id = _get(d, name, str)
    if not JOB_ID_RE.match(job_id):
        raise ProtocolError("job id must be 1-64 characters of [A-Za-z0-9_.:-]")
    return job_id


def _program_hash(d: dict, name: str = "program") -> str:
    program = _get(d, name, str)
    if not PROGRAM_HASH_RE.match(program):
        raise ProtocolError("program hash must be 64 lowercase hex characters")
    return program


def _size(d: dict, name: str, optional: bool = False) -> int | None:
    size = _get(d, name, int, optional)
    if size is not None and size < 0:
        raise ProtocolError(f"message {d.get('t')!r}: {name} must be a non-negative integer")
    return size


def _settle_items(raw: Any) -> tuple[tuple[tuple[str, bytes], ...], int]:
    """Countersignatures ``[[job id, signature], ...]``: the well-formed ones, and how many were not."""
    if raw is None:
        return (), 0
    if not isinstance(raw, list) or len(raw) > MAX_SETTLE_ITEMS:
        return (), 1
    good = tuple((i[0], i[1]) for i in raw if isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                 and JOB_ID_RE.match(i[0]) and isinstance(i[1], bytes))
    return good, len(raw) - len(good)


# --- the messages --------------------------------------------------------------------------------------------------

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


#: The longest a session may stay idle on a worker before its state is dropped (a client asks for less or gets this).
MAX_SESSION_TTL = 3600.0
MAX_SESSION_STEP = 2**31
#: A session id: short, and without the dots that separate a tab's job id (gpunet.ledger.tabs) into its parts.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,24}\Z")


def _session_id(d: dict, name: str) -> str:
    session_id = _get(d, name, str)
    if not SESSION_ID_RE.match(session_id):
        raise ProtocolError("a session id is 1-24 characters of [A-Za-z0-9_-]")
    return session_id


@dataclass(frozen=True, slots=True)
class PushTo:
    """Where a session step's output goes besides its client: the worker holding the next span (``peer``), as the
    input of step ``step`` of that span's session ``session`` (the same client's)."""

    peer: str
    session: str
    step: int

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer, "session": self.session, "step": self.step}

    @classmethod
    def from_wire(cls, d: Any) -> "PushTo":
        if not isinstance(d, dict):
            raise ProtocolError("push must be a map")
        return cls(_peer_id(d, "peer"), _session_id(d, "session"), _step(d, "step"))


@dataclass(frozen=True, slots=True)
class SessionStep:
    """A job that is one step of an inference session (docs/sessions.md): the program's last ``state`` inputs are
    held on the worker between steps instead of sent. ``step`` 0 opens the session (its state given by the client,
    or ``fresh``: zeros of the declared shapes); each next step must be the one after the last; ``close`` drops the
    state once this step is done; ``ttl``: seconds the state may stay idle.

    Pushed steps (Petals' server-to-server hops): ``push_to`` asks the worker to send its output on to the next span's
    worker as well; ``input_from`` says this step's input comes that way, from that worker (the job then carries
    no inputs, and its answer says the hash of the input it used, for the client to compare).

    ``state_bytes`` (step 0 only): the bytes its state takes (the program's declared state), reserved before the step
    runs, so that sessions opening at once each count the others'; a state larger than declared is refused. Without
    it the worker reserves all the room this client may take, until the state's size is known."""

    id: str
    step: int
    fresh: bool = False
    close: bool = False
    ttl: float = 300.0
    input_from: str | None = None
    push_to: PushTo | None = None
    state_bytes: int | None = None

    def to_wire(self) -> dict[str, Any]:
        d = {"id": self.id, "step": self.step, "ttl": float(self.ttl)}
        if self.fresh:
            d["fresh"] = True
        if self.close:
            d["close"] = True
        if self.input_from is not None:
            d["from"] = self.input_from
        if self.push_to is not None:
            d["push"] = self.push_to.to_wire()
        if self.state_bytes is not None:
            d["state"] = self.state_bytes
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "SessionStep":
        if not isinstance(d, dict):
            raise ProtocolError("session must be a map")
        session_id = _session_id(d, "id")
        step = _step(d, "step")
        ttl = _get(d, "ttl", (int, float), optional=True)
        ttl = 300.0 if ttl is None else float(ttl)
        if not (0 < ttl <= MAX_SESSION_TTL):  # also refuses NaN
            raise ProtocolError(f"session ttl must be between 0 and {MAX_SESSION_TTL:.0f} s")
        input_from = _peer_id(d, "from") if d.get("from") is not None else None
        push_to = PushTo.from_wire(d["push"]) if d.get("push") is not None else None
        if input_from is not None and step == 0:
            raise ProtocolError("a session's first step cannot take a pushed input: it opens the session")
        state_bytes = _size(d, "state") if d.get("state") is not None else None
        if state_bytes is not None and step != 0:
            raise ProtocolError("only a session's first step declares its state's size")
        return cls(session_id, step, bool(_get(d, "fresh", bool, optional=True)),
                   bool(_get(d, "close", bool, optional=True)), ttl, input_from, push_to, state_bytes)


def _step(d: dict, name: str) -> int:
    step = _size(d, name)
    if step >= MAX_SESSION_STEP:
        raise ProtocolError("session step out of range")
    return step


def _peer_id(d: dict, name: str) -> str:
    peer_id = _get(d, name, str)
    if not _PEER_ID_RE.match(peer_id):
        raise ProtocolError(f"{name} must be a base58 peer id")
    return peer_id


@dataclass(frozen=True, slots=True)
class Push(Message):
    """One worker's session step output, sent to the worker holding the next span as the input of that span's step
    (``SessionStep.push_to``); ``inputs`` None: it will not come (the step failed, or its output is too big to push),
    ask the client for it."""

    T: ClassVar[str] = "push"
    client: str  # whose session
    session: str
    step: int
    inputs: bytes | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "client": self.client, "session": self.session, "step": self.step,
                "inputs": self.inputs}

    @classmethod
    def from_wire(cls, d: dict) -> "Push":
        inputs = _get(d, "inputs", bytes, optional=True)
        if inputs is not None and len(inputs) > MAX_PUSH_BYTES:
            raise ProtocolError(f"a pushed input is at most {MAX_PUSH_BYTES} bytes")
        return cls(_peer_id(d, "client"), _session_id(d, "session"), _step(d, "step"), inputs)


#: The market's lanes (docs/market.md), highest priority first; a client asks for one of CLIENT_LANES.
INTERACTIVE, BATCH, BACKGROUND = "interactive", "batch", "background"
LANES = (INTERACTIVE, BATCH, BACKGROUND)
CLIENT_LANES = (INTERACTIVE, BATCH)


@dataclass(frozen=True, slots=True)
class Submit(Message):
    """A job: which program, the inputs (inline when small), how long it may take and the most it may cost."""

    T: ClassVar[str] = "submit"
    job_id: str
    program: str
    inputs_size: int
    inputs: bytes | None = None
    timeout: float = 60.0
    max_price: int | None = None
    settle: tuple[tuple[str, bytes], ...] = ()  # unary door: countersignatures owed to this worker, riding along
    settle_malformed: int = 0  # parsed but unusable settle items (logged by the worker; never fatal to the job)
    private: bool = False  # only clients that sent the program's bytes may run it; never advertised or kept on disk
    session: SessionStep | None = None  # a step of an inference session, its state kept on the worker
    lane: str = INTERACTIVE  # batch: runs when no interactive job waits, at the worker's floor, preemptible
    deadline: float | None = None  # unix time by which it must be done: a worker that cannot start it by then refuses

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "job": self.job_id, "program": self.program, "inputs_size": self.inputs_size,
             "timeout": float(self.timeout), "max_price": self.max_price}
        if self.lane != INTERACTIVE:  # absent means interactive: what workers that predate lanes sell
            d["lane"] = self.lane
        if self.deadline is not None:
            d["deadline"] = float(self.deadline)
        if self.inputs is not None:
            d["inputs"] = self.inputs
        if self.private:
            d["private"] = True
        if self.session is not None:
            d["session"] = self.session.to_wire()
        if self.settle:
            d["settle"] = [list(i) for i in self.settle]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Submit":
        program = _program_hash(d)
        inputs_size = _size(d, "inputs_size")
        inputs = _get(d, "inputs", bytes, optional=True)
        if inputs is not None and len(inputs) != inputs_size:
            raise ProtocolError("inline inputs do not match the declared inputs size")
        timeout = float(_get(d, "timeout", (int, float), optional=True) or 60.0)
        if not timeout > 0:  # also refuses NaN
            raise ProtocolError("timeout must be a positive number of seconds")
        settle, malformed = _settle_items(d.get("settle"))
        session = SessionStep.from_wire(d["session"]) if d.get("session") is not None else None
        lane = _get(d, "lane", str, optional=True) or INTERACTIVE
        if lane not in CLIENT_LANES:
            raise ProtocolError(f"unknown lane {lane[:16]!r} (this worker sells {' and '.join(CLIENT_LANES)})")
        deadline = _time(d, "deadline") if d.get("deadline") is not None else None
        if deadline is not None and deadline <= 0:
            raise ProtocolError("deadline must be a unix time")
        if session is not None and session.input_from is not None and inputs != b"":
            raise ProtocolError("a step whose input is pushed to the worker carries no inputs of its own")
        return cls(_job_id(d), program, inputs_size, inputs, timeout, _get(d, "max_price", int, optional=True),
                   settle, malformed, bool(_get(d, "private", bool, optional=True)), session, lane, deadline)


@dataclass(frozen=True, slots=True)
class Send(Message):
    """The worker asks for what it lacks."""

    T: ClassVar[str] = "send"
    program: bool
    inputs: bool
    #: Lacking the program, the worker can fetch it from peers: the client may answer with :class:`Pieces` (who
    #: holds it, and each piece's digest) instead of the program's bytes.
    pieces: bool = False

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "program": self.program, "inputs": self.inputs}
        if self.pieces:
            d["pieces"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Send":
        return cls(_get(d, "program", bool), _get(d, "inputs", bool), bool(_get(d, "pieces", bool, optional=True)))


#: Peers one Pieces message may name, and addresses per peer.
MAX_HOLDERS = 8
MAX_HOLDER_MADDRS = 4


@dataclass(frozen=True, slots=True)
class Pieces(Message):
    """The client's answer to ``Send(pieces=True)``: fetch the program from these peers (id and addresses), checking
    each piece against these digests (:mod:`gpunet.pieces`); a :class:`Payload` with the inputs, if asked for, follows.
    The client vouches for the list: it is the one whose job runs on the bytes."""

    T: ClassVar[str] = "pieces"
    size: int
    piece_size: int
    hashes: bytes
    holders: tuple[tuple[str, tuple[str, ...]], ...]
    #: Those of the holders the client vouches for (it is sending them the program right now, or they ran it for
    #: this client): worth waiting for while they say "busy".
    coming: frozenset[str] = frozenset()

    def piece_list(self):
        from gpunet.pieces import PieceList

        return PieceList(self.size, self.piece_size, self.hashes)

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "size": self.size, "piece_size": self.piece_size, "hashes": self.hashes,
                "holders": [[peer, list(maddrs)] for peer, maddrs in self.holders],
                "coming": sorted(self.coming)}

    @classmethod
    def from_wire(cls, d: dict) -> "Pieces":
        raw = _get(d, "holders", list)
        ok = len(raw) <= MAX_HOLDERS and all(
            isinstance(h, list) and len(h) == 2 and isinstance(h[0], str) and _PEER_ID_RE.match(h[0])
            and isinstance(h[1], list) and len(h[1]) <= MAX_HOLDER_MADDRS
            and all(isinstance(m, str) and 0 < len(m) <= 256 for m in h[1]) for h in raw)
        if not ok:
            raise ProtocolError(f"pieces: holders must be at most {MAX_HOLDERS} [peer id, [multiaddr, ...]] pairs")
        holders = tuple((h[0], tuple(h[1])) for h in raw)
        coming = d.get("coming") or []
        if not isinstance(coming, list) or not all(isinstance(c, str) for c in coming):
            raise ProtocolError("pieces: coming must list holders' peer ids")
        message = cls(_size(d, "size"), _size(d, "piece_size"), _get(d, "hashes", bytes), holders,
                      frozenset(coming) & {peer for peer, _ in holders})
        try:
            message.piece_list()
        except ValueError as e:
            raise ProtocolError(f"pieces: {e}") from None
        return message


@dataclass(frozen=True, slots=True)
class GetPiece(Message):
    """Ask a peer for piece ``index`` of a program it holds (pieces of ``piece_size`` bytes)."""

    T: ClassVar[str] = "get_piece"
    program: str
    index: int
    piece_size: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "program": self.program, "index": self.index, "piece_size": self.piece_size}

    @classmethod
    def from_wire(cls, d: dict) -> "GetPiece":
        program = _program_hash(d)
        return cls(program, _size(d, "index"), _size(d, "piece_size"))


@dataclass(frozen=True, slots=True)
class PieceData(Message):
    """Announces the piece's raw bytes, which follow on the stream."""

    T: ClassVar[str] = "piece_data"
    size: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "size": self.size}

    @classmethod
    def from_wire(cls, d: dict) -> "PieceData":
        return cls(_size(d, "size"))


@dataclass(frozen=True, slots=True)
class Payload(Message):
    """Announces the raw bytes that follow on the stream: the program, then the inputs (either may be absent)."""

    T: ClassVar[str] = "payload"
    program_size: int | None
    inputs_size: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "program_size": self.program_size, "inputs_size": self.inputs_size}

    @classmethod
    def from_wire(cls, d: dict) -> "Payload":
        return cls(_size(d, "program_size", optional=True), _size(d, "inputs_size", optional=True))


@dataclass(frozen=True, slots=True)
class Result(Message):
    """The outputs (inline when small, else raw bytes after this frame) and the worker-signed receipt (empty for a
    session step that its session's tab bills later, gpunet.ledger.tabs)."""

    T: ClassVar[str] = "result"
    outputs_size: int
    receipt: bytes
    outputs: bytes | None = None
    input_hash: str | None = None  # a step whose input was pushed: the sha256 of the input it ran on

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "outputs_size": self.outputs_size, "receipt": self.receipt}
        if self.outputs is not None:
            d["outputs"] = self.outputs
        if self.input_hash is not None:
            d["input_hash"] = self.input_hash
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Result":
        size = _size(d, "outputs_size")
        outputs = _get(d, "outputs", bytes, optional=True)
        if outputs is not None and len(outputs) != size:
            raise ProtocolError("inline outputs do not match their declared size")
        input_hash = _get(d, "input_hash", str, optional=True)
        if input_hash is not None and not PROGRAM_HASH_RE.match(input_hash):
            raise ProtocolError("input_hash must be 64 lowercase hex characters")
        return cls(size, _get(d, "receipt", bytes), outputs, input_hash)


@dataclass(frozen=True, slots=True)
class Countersign(Message):
    """The client accepts a result: its signature over the receipt."""

    T: ClassVar[str] = "countersign"
    job_id: str
    signature: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "job": self.job_id, "signature": self.signature}

    @classmethod
    def from_wire(cls, d: dict) -> "Countersign":
        return cls(_job_id(d), _get(d, "signature", bytes))


@dataclass(frozen=True, slots=True)
class Refuse(Message):
    """The client rejects a result (wrong hash, outvoted, bad terms): it is not paid."""

    T: ClassVar[str] = "refuse"
    job_id: str
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "job": self.job_id, "reason": self.reason[:500]}

    @classmethod
    def from_wire(cls, d: dict) -> "Refuse":
        return cls(_job_id(d), _text(d, "reason", 500))


@dataclass(frozen=True, slots=True)
class SettleBatch(Message):
    """Countersignatures of several unary-door results to one worker, in one call."""

    T: ClassVar[str] = "countersign_batch"
    items: tuple[tuple[str, bytes], ...]
    malformed: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "items": [list(i) for i in self.items]}

    @classmethod
    def from_wire(cls, d: dict) -> "SettleBatch":
        items, malformed = _settle_items(d.get("items"))
        return cls(items, malformed)


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    """Stop a job this client submitted (queued or running). A stream job is cancelled by closing its stream."""

    T: ClassVar[str] = "cancel"
    job_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "job": self.job_id}

    @classmethod
    def from_wire(cls, d: dict) -> "Cancel":
        return cls(_job_id(d))


@dataclass(frozen=True, slots=True)
class CloseSession(Message):
    """End one of this client's inference sessions on a worker (its state is freed); answered SessionClosed."""

    T: ClassVar[str] = "close_session"
    session_id: str
    received: int | None = None  # the steps whose answers the client got, in all: the last tab bills no more

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "session": self.session_id, "received": self.received}

    @classmethod
    def from_wire(cls, d: dict) -> "CloseSession":
        received = _size(d, "received", optional=True)
        return cls(_session_id(d, "session"), received)


@dataclass(frozen=True, slots=True)
class SessionClosed(Message):
    """The answer to CloseSession: whether it was open, and the receipt of its last, not yet billed steps."""

    T: ClassVar[str] = "session_closed"
    closed: bool
    receipt: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "closed": self.closed}
        if self.receipt is not None:
            d["receipt"] = self.receipt
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "SessionClosed":
        return cls(bool(_get(d, "closed", bool)), _get(d, "receipt", bytes, optional=True))


@dataclass(frozen=True, slots=True)
class Ok(Message):
    """A unary call was taken; ``cancelled`` answers a Cancel (whether the job was still queued or running)."""

    T: ClassVar[str] = "ok"
    cancelled: bool | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "cancelled": self.cancelled}

    @classmethod
    def from_wire(cls, d: dict) -> "Ok":
        return cls(_get(d, "cancelled", bool, optional=True))


@dataclass(frozen=True, slots=True)
class UseStream(Message):
    """The unary door cannot take this job (the worker lacks the program, or the outputs are large): use the stream."""

    T: ClassVar[str] = "use_stream"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "UseStream":
        return cls()


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """A liveness and clock probe (and the raw-RPC baseline in benchmarks): the echo comes back."""

    T: ClassVar[str] = "ping"
    echo: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "echo": self.echo}

    @classmethod
    def from_wire(cls, d: dict) -> "Ping":
        return cls(_get(d, "echo", bytes, optional=True) or b"")


@dataclass(frozen=True, slots=True)
class Pong(Message):
    T: ClassVar[str] = "pong"
    time: float
    echo: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "time": self.time, "echo": self.echo}

    @classmethod
    def from_wire(cls, d: dict) -> "Pong":
        return cls(_time(d, "time"), _get(d, "echo", bytes, optional=True) or b"")


@dataclass(frozen=True, slots=True)
class GetInfo(Message):
    T: ClassVar[str] = "get_info"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "GetInfo":
        return cls()


@dataclass(frozen=True, slots=True)
class Info(Message):
    """A worker's live record (as in the DHT) and its clock, straight from the worker."""

    T: ClassVar[str] = "info"
    time: float
    record: dict

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "time": self.time, "record": self.record}

    @classmethod
    def from_wire(cls, d: dict) -> "Info":
        return cls(_time(d, "time"), _get(d, "record", dict))


@dataclass(frozen=True, slots=True)
class ProveSpeed(Message):
    """A speed challenge (:mod:`gpunet.speedproof`): multiply the seed's products for up to ``seconds``, then commit."""

    T: ClassVar[str] = "prove_speed"
    seed: bytes
    n: int
    seconds: float
    dtype: str = "fp32"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seed": self.seed, "n": self.n, "seconds": float(self.seconds), "dtype": self.dtype}

    @classmethod
    def from_wire(cls, d: dict) -> "ProveSpeed":
        challenge = Challenge(_get(d, "seed", bytes), _get(d, "n", int), _time(d, "seconds"),
                              _get(d, "dtype", str, optional=True) or "fp32")
        try:
            challenge.check()
        except ValueError as e:
            raise ProtocolError(f"speed challenge: {e}") from None
        return cls(challenge.seed, challenge.n, challenge.seconds, challenge.dtype)


@dataclass(frozen=True, slots=True)
class SpeedCommitment(Message):
    """The products done within the challenge's time, as one commitment each (in order, concatenated)."""

    T: ClassVar[str] = "speed_commitment"
    commitments: tuple[bytes, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "commitments": b"".join(self.commitments)}

    @classmethod
    def from_wire(cls, d: dict) -> "SpeedCommitment":
        raw = _get(d, "commitments", bytes)
        if not raw or len(raw) % COMMIT_BYTES or len(raw) > MAX_PRODUCTS * COMMIT_BYTES:
            raise ProtocolError(f"a speed commitment is 1 to {MAX_PRODUCTS} hashes of {COMMIT_BYTES} bytes")
        return cls(tuple(raw[i:i + COMMIT_BYTES] for i in range(0, len(raw), COMMIT_BYTES)))


@dataclass(frozen=True, slots=True)
class OpenProof(Message):
    """Open these products of a challenge this client sent: ``picks`` maps a product to the rows wanted."""

    T: ClassVar[str] = "open_proof"
    seed: bytes
    n: int
    picks: dict[int, list[int]]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seed": self.seed, "n": self.n, "picks": [[j, list(r)] for j, r in self.picks.items()]}

    @classmethod
    def from_wire(cls, d: dict) -> "OpenProof":
        seed, n, raw = _get(d, "seed", bytes), _get(d, "n", int), _get(d, "picks", list)
        if len(seed) != SEED_BYTES or n not in SIZES or not 0 < len(raw) <= PICK_PRODUCTS:
            raise ProtocolError("an opening names its challenge and 1 to %d products" % PICK_PRODUCTS)
        picks: dict[int, list[int]] = {}
        for item in raw:
            ok = (isinstance(item, list) and len(item) == 2 and _index(item[0], MAX_PRODUCTS)
                  and isinstance(item[1], list) and 0 < len(item[1]) <= PICK_ROWS
                  and all(_index(i, n) for i in item[1]) and item[0] not in picks)
            if not ok:
                raise ProtocolError(f"an opening asks for up to {PICK_ROWS} rows < {n} of distinct products")
            picks[item[0]] = sorted(set(item[1]))
        return cls(seed, n, picks)


@dataclass(frozen=True, slots=True)
class ProofOpening(Message):
    """Per opened product: its digest vector and the rows asked for (see :class:`gpunet.speedproof.Opening`)."""

    T: ClassVar[str] = "proof_opening"
    openings: tuple  # of speedproof.Opening

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "openings": [[o.product, o.digests, [[i, r] for i, r in o.rows.items()]]
                                          for o in self.openings]}

    @classmethod
    def from_wire(cls, d: dict) -> "ProofOpening":
        raw = _get(d, "openings", list)
        if len(raw) > PICK_PRODUCTS:
            raise ProtocolError(f"a proof opening opens at most {PICK_PRODUCTS} products")
        openings = []
        for item in raw:
            ok = (isinstance(item, list) and len(item) == 3 and _index(item[0], MAX_PRODUCTS)
                  and isinstance(item[1], bytes) and isinstance(item[2], list) and len(item[2]) <= PICK_ROWS
                  and all(isinstance(r, list) and len(r) == 2 and _index(r[0], 1 << 16) and isinstance(r[1], bytes)
                          for r in item[2]))
            if not ok:
                raise ProtocolError("a proof opening is [product, digests, [[row, bytes], ...]] per product")
            openings.append(Opening(item[0], item[1], {r[0]: r[1] for r in item[2]}))
        return cls(tuple(openings))


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """"Which network do you run?" (the ``hello`` door, outside every network)."""

    T: ClassVar[str] = "hello"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "Hello":
        return cls()


@dataclass(frozen=True, slots=True)
class Greeting(Message):
    """A node's answer to Hello: the network it runs, its role (worker, bootstrap) and gpunet version."""

    T: ClassVar[str] = "greeting"
    network: str
    role: str = ""
    version: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "network": self.network, "role": self.role, "version": self.version}

    @classmethod
    def from_wire(cls, d: dict) -> "Greeting":
        network = _get(d, "network", str)
        if not NETWORK_NAME.match(network):  # it is shown in a command to type: nothing but a network name
            raise ProtocolError("a greeting names a network: 1-64 letters, digits, '-' or '_'")
        return cls(network, _text(d, "role", 32), _text(d, "version", 32))


#: Ports one reachability check may ask to be dialled on.
MAX_REACH_PORTS = 4


@dataclass(frozen=True, slots=True)
class CheckReach(Message):
    """"Dial me back": open a TCP connection to each of these ports at the address you see me coming from."""

    T: ClassVar[str] = "check_reach"
    ports: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "ports": list(self.ports)}

    @classmethod
    def from_wire(cls, d: dict) -> "CheckReach":
        ports = _get(d, "ports", list)
        if not 0 < len(ports) <= MAX_REACH_PORTS or not all(_index(p, 65536) and p > 0 for p in ports):
            raise ProtocolError(f"a reachability check names 1 to {MAX_REACH_PORTS} TCP ports")
        return cls(tuple(dict.fromkeys(ports)))


@dataclass(frozen=True, slots=True)
class ReachResult(Message):
    """The address the caller was seen at, and which of its ports a fresh connection from here reached."""

    T: ClassVar[str] = "reach_result"
    observed: str
    open: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "observed": self.observed, "open": list(self.open)}

    @classmethod
    def from_wire(cls, d: dict) -> "ReachResult":
        ports = _get(d, "open", list)
        if len(ports) > MAX_REACH_PORTS or not all(_index(p, 65536) for p in ports):
            raise ProtocolError("a reachability result names at most a few TCP ports")
        return cls(_text(d, "observed", 64), tuple(ports))


def _index(value: Any, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit


# --- errors across the wire: a code, the same exception on both sides ----------------------------------------------

_CODES: dict[str, type[GpunetError]] = {
    "session_lost": SessionLost,  # before "failed": the first matching family names an error
    "busy": WorkerBusy,
    "rejected": JobRejected,
    "failed": JobFailed,
    "timeout": JobTimeout,
    "protocol": ProtocolError,
    "not_cached": ProgramNotCached,
}


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A refusal or failure; :meth:`exception` is the same gpunet error the worker raised."""

    T: ClassVar[str] = "error"
    code: str
    message: str
    queue: int = 0  # busy: the worker's queue length
    program: str | None = None  # not_cached: the program to resend
    draining: bool = False  # busy because it is leaving (a code of its own would read as a failure to older clients)
    preempted: bool = False  # busy because a higher lane took its slot (likewise: older clients retry it as busy)
    raised: bool = False  # failed because an op of the job raised: the job's own error (older clients: a failure)

    @classmethod
    def of(cls, error: GpunetError, queue: int = 0) -> "Error":
        """The message that carries ``error`` to the peer (first matching family wins)."""
        code = next((c for c, kind in _CODES.items() if isinstance(error, kind)), "failed")
        program = error.program_hash if isinstance(error, ProgramNotCached) else None
        return cls(code, str(error)[:2000], queue, program, isinstance(error, WorkerDraining),
                   isinstance(error, JobPreempted), isinstance(error, JobRaised))

    def exception(self) -> GpunetError:
        """The exception this stands for; unknown codes become JobFailed."""
        message = self.message or "worker reported an error"
        if self.code == "busy":
            kind = WorkerDraining if self.draining else JobPreempted if self.preempted else WorkerBusy
            return kind(message, self.queue)
        if self.code == "not_cached":
            return ProgramNotCached(self.program or "?")
        if self.code == "failed" and self.raised:
            return JobRaised(message)
        return _CODES.get(self.code, JobFailed)(message)

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "code": self.code, "message": self.message, "queue": self.queue}
        if self.program is not None:
            d["program"] = self.program
        if self.draining:
            d["draining"] = True
        if self.preempted:
            d["preempted"] = True
        if self.raised:
            d["raised"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Error":
        queue = d.get("queue")
        program = d.get("program")
        return cls(_text(d, "code", 32) or "failed", _text(d, "message", 2000),
                   queue if type(queue) is int and 0 <= queue < 2**31 else 0,
                   program if isinstance(program, str) and PROGRAM_HASH_RE.match(program) else None,
                   d.get("draining") is True, d.get("preempted") is True, d.get("raised") is True)


# --- encoding: unary bodies and stream frames ----------------------------------------------------------------------


def encode(message: Message) -> bytes:
    """A unary message body."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def decode(data: bytes, *expect: type[M]) -> M:
    """Parse a message; ProtocolError unless it is well formed and one of ``expect`` (any type when none given)."""
    try:  # container sizes capped too: a small body of many tiny arrays must not cost a second of parsing
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_SETTLE_ITEMS,
                            max_map_len=256, max_str_len=MAX_FRAME_BYTES, max_bin_len=len(data))
    except Exception as e:  # msgpack raises several unrelated exception types on malformed input
        raise ProtocolError(f"message is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise ProtocolError("message is not a map with a type")
    kind = MESSAGES.get(d["t"])
    if kind is None or (expect and kind not in expect):
        wanted = "/".join(k.T for k in expect) or "a known message"
        raise ProtocolError(f"expected {wanted}, got {d['t'][:32]!r}")
    try:
        return kind.from_wire(d)
    except GpunetError:
        raise
    except Exception as e:  # a parser bug must still read as a peer's bad message, never crash a handler
        raise ProtocolError(f"malformed {kind.T!r} message ({type(e).__name__})") from None


def encode_frame(message: Message) -> bytes:
    body = encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _LEN.pack(len(body)) + body


async def write(writer: asyncio.StreamWriter, message: Message) -> None:
    try:
        writer.write(encode_frame(message))
        await writer.drain()
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke: {e}") from None


async def read(reader: asyncio.StreamReader, *expect: type[M], timeout: float | None = None) -> M:
    """Read one frame; ProtocolError on EOF, oversize, bad msgpack, an unexpected type, or ``timeout`` seconds of
    silence (a stalled peer must not hold what it holds forever)."""
    try:
        async with asyncio.timeout(timeout):
            (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"peer announced a {size}-byte frame; the cap is {MAX_FRAME_BYTES}")
            body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ProtocolError("peer closed the stream mid-message") from None
    except TimeoutError:
        raise ProtocolError(f"peer sent nothing for {timeout:.0f} s") from None
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke: {e}") from None
    return decode(body, *expect)


def payload_deadline(size: int) -> float:
    return FRAME_TIMEOUT + size / MIN_PAYLOAD_RATE


async def write_payload(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    try:
        for offset in range(0, len(view), CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await writer.drain()
    except (ConnectionError, OSError) as e:
        raise ProtocolError(f"stream broke while writing: {e}") from None


def check_payload_size(size: Any, cap: int, what: str) -> None:
    """A declared payload size, checked before anything is allocated or charged for it."""
    if type(size) is not int or size < 0:
        raise ProtocolError(f"{what} size must be a non-negative integer")
    if size > cap:
        raise ProtocolError(f"{what} of {size} bytes ({human_bytes(size)}) exceeds this peer's limit of {human_bytes(cap)}")


async def read_payload(reader: asyncio.StreamReader, size: Any, cap: int, what: str, hasher=None,
                       timeout: float | None = None, into=None) -> bytearray | None:
    """Read exactly ``size`` declared bytes, refusing sizes over ``cap`` before allocating anything.

    ``hasher`` (a hashlib object) is fed each chunk as it arrives, so hashing overlaps the transfer. ``timeout``
    bounds the whole read (see :func:`payload_deadline`). ``into``: a binary file the bytes are written to instead
    (None is returned): a big payload then lives in the page cache, not in this process's heap.
    """
    check_payload_size(size, cap, what)
    # Grown as bytes arrive (amortised doubling), so a declared size costs memory only once it is actually sent.
    buf = bytearray()
    offset = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with asyncio.timeout(timeout):
            while offset < size:
                # Progress, not just a deadline: every chunk within FRAME_TIMEOUT, and at MIN_PAYLOAD_RATE overall once
                # past that grace, so a declared size cannot hold a job slot open without the bytes coming.
                async with asyncio.timeout(FRAME_TIMEOUT):
                    chunk = await reader.read(min(CHUNK_BYTES, size - offset))
                if not chunk:
                    raise ProtocolError(f"peer closed the stream after {offset} of {size} {what} bytes")
                if into is None:
                    buf += chunk
                else:
                    into.write(chunk)
                offset += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                elapsed = loop.time() - started
                if offset < size and offset < (elapsed - FRAME_TIMEOUT) * MIN_PAYLOAD_RATE:
                    raise ProtocolError(f"{what} arrives too slowly ({offset} of {size} bytes in {elapsed:.0f} s)")
    except TimeoutError:
        buf.clear()  # the exception's traceback keeps this frame alive: free its buffer now
        raise ProtocolError(f"{what} arrived too slowly ({offset} of {size} bytes)") from None
    except (ConnectionError, OSError) as e:
        buf.clear()
        raise ProtocolError(f"stream broke while reading {what}: {e}") from None
    except BaseException:
        buf.clear()
        raise
    if into is not None:
        into.flush()
        return None
    return buf
