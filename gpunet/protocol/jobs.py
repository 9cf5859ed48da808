"""The messages of a job's path (the ``job`` stream, the ``run``, ``settle`` and ``cancel`` unary doors)::

      client -> Submit{job, program, inputs_size, [inputs], timeout, max_price}
      worker -> Error{busy | rejected | ...}            at once: admission, before any payload moves
      worker -> Send{program, inputs}                   only when it lacks the program or the inputs were not inline
      client -> Payload{program_size, inputs_size} + raw program + raw inputs
                (or Pieces: fetch the program from peers, gpunet.protocol.peers)
      worker -> Result{outputs_size, [outputs], receipt} + raw outputs   | Error{code, message}
      client -> Countersign{job, signature} | Refuse{job, reason}         (or nothing: the work stays unpaid)

``run`` (unary, one round trip): Submit with inline inputs and ride-along countersignatures -> Result | UseStream |
Error; ``settle``: Countersign | Refuse | SettleBatch -> Ok; ``cancel``: Cancel -> Ok. Also the market's lanes a job
asks for, and the sizes that decide whether bytes ride inside a message or follow it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpunet.errors import ProtocolError
from gpunet.protocol.fields import (
    JOB_ID_RE,
    PROGRAM_HASH_RE,
    Message,
    job_id_field,
    program_hash_field,
    proof_field,
    size_field,
    text_field,
    time_field,
    typed_field,
)
from gpunet.protocol.peers import MAX_PIECES
from gpunet.protocol.sessions import SessionStep

#: Inputs and outputs at most this big ride inside a control frame (or a unary message), saving a round trip.
INLINE_BYTES = 32 * 1024
#: Unary replies ride hivemind's persistent daemon connection, whose messages are capped at 4 MiB.
UNARY_OUTPUT_BYTES = 1 << 20
#: Countersignatures one message may carry.
MAX_SETTLE_ITEMS = 1024
#: Results a worker lets one client hold uncountersigned at once (its credit line; gpunet.worker.state.admission):
#: a client keeps what it has received and not yet paid for, plus its jobs in flight to that worker, under it
#: (gpunet.client.settlement), so paying as it goes it is never refused there.
CREDIT_LINE = 64
#: The market's lanes (docs/market.md), highest priority first; a client asks for one of CLIENT_LANES.
INTERACTIVE, BATCH, BACKGROUND = "interactive", "batch", "background"
LANES = (INTERACTIVE, BATCH, BACKGROUND)
CLIENT_LANES = (INTERACTIVE, BATCH)


def settle_items(raw: Any) -> tuple[tuple[tuple[str, bytes], ...], int]:
    """Countersignatures ``[[job id, signature], ...]``: the well-formed ones, and how many were not."""
    if raw is None:
        return (), 0
    if not isinstance(raw, list) or len(raw) > MAX_SETTLE_ITEMS:
        return (), 1
    good = tuple((i[0], i[1]) for i in raw if isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                 and JOB_ID_RE.match(i[0]) and isinstance(i[1], bytes))
    return good, len(raw) - len(good)


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
    #: The owner publishes the program for anyone who names its hash (public checkpoints); taken only from a client
    #: that sent the bytes or proved it holds them, and never undone (gpunet.worker.state.owners).
    shared: bool = False
    #: Proof that this client holds the program's bytes (gpunet.protocol.holding, purpose RUN, verifier the worker):
    #: without it (or the bytes), a program the client did not send this worker is asked for, not run.
    holds: bytes | None = None
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
        if self.shared:
            d["shared"] = True
        if self.holds is not None:
            d["holds"] = self.holds
        if self.session is not None:
            d["session"] = self.session.to_wire()
        if self.settle:
            d["settle"] = [list(i) for i in self.settle]
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Submit":
        program = program_hash_field(d)
        inputs_size = size_field(d, "inputs_size")
        inputs = typed_field(d, "inputs", bytes, optional=True)
        if inputs is not None and len(inputs) != inputs_size:
            raise ProtocolError("inline inputs do not match the declared inputs size")
        timeout = float(typed_field(d, "timeout", (int, float), optional=True) or 60.0)
        if not timeout > 0:  # also refuses NaN
            raise ProtocolError("timeout must be a positive number of seconds")
        settle, malformed = settle_items(d.get("settle"))
        session = SessionStep.from_wire(d["session"]) if d.get("session") is not None else None
        lane = typed_field(d, "lane", str, optional=True) or INTERACTIVE
        if lane not in CLIENT_LANES:
            raise ProtocolError(f"unknown lane {lane[:16]!r} (this worker sells {' and '.join(CLIENT_LANES)})")
        deadline = time_field(d, "deadline") if d.get("deadline") is not None else None
        if deadline is not None and deadline <= 0:
            raise ProtocolError("deadline must be a unix time")
        if session is not None and session.input_from is not None and inputs != b"":
            raise ProtocolError("a step whose input is pushed to the worker carries no inputs of its own")
        job_id, max_price = job_id_field(d), typed_field(d, "max_price", int, optional=True)
        holds = proof_field(d, "holds", "submit")
        return cls(job_id, program, inputs_size, inputs, timeout, max_price,
                   settle, malformed, bool(typed_field(d, "private", bool, optional=True)),
                   bool(typed_field(d, "shared", bool, optional=True)), holds, session, lane, deadline)


@dataclass(frozen=True, slots=True)
class Send(Message):
    """The worker asks for what it lacks."""

    T: ClassVar[str] = "send"
    program: bool
    inputs: bool
    #: Lacking the program, the worker can fetch it from peers: the client may answer with :class:`Pieces` (who
    #: holds it, and each piece's digest) instead of the program's bytes.
    pieces: bool = False
    #: Weights the program names by reference (their sha256) that the worker found nowhere else: the client answers
    #: with a Payload of ``tensors_size`` and their bytes, one after another in this order.
    tensors: tuple[str, ...] = ()
    #: Asking for the program after the peers the client named delivered only part of it: the indices (ascending)
    #: of the pieces they did not (of the piece list the client sent). The client sends those pieces, one after
    #: another, ``program_size`` their total; an older client sends the whole program (``program_size`` its size).
    missing: tuple[int, ...] = ()
    #: Asking for ``tensors`` again, after the holders the client named did not deliver them: the client may answer
    #: once more with :class:`TensorHolders`, naming workers it began sending them to since (they answer "busy" until
    #: the bytes land): two workers missing one weight at once then cost the client one copy, not two. Unset (an
    #: older worker, or the last ask), the bytes come.
    again: bool = False

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "program": self.program, "inputs": self.inputs}
        if self.again:
            d["again"] = True
        if self.pieces:
            d["pieces"] = True
        if self.tensors:
            d["tensors"] = list(self.tensors)
        if self.missing:
            d["missing"] = list(self.missing)
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Send":
        wanted = d.get("tensors", [])
        if not (isinstance(wanted, list) and len(wanted) <= MAX_TENSORS_ASKED
                and all(isinstance(h, str) and PROGRAM_HASH_RE.match(h) for h in wanted)):
            raise ProtocolError(f"send: tensors must be a list of at most {MAX_TENSORS_ASKED} sha256 hex digests")
        missing = d.get("missing", [])
        if not (isinstance(missing, list) and len(missing) <= MAX_PIECES
                and all(type(i) is int and 0 <= i < MAX_PIECES for i in missing)
                and all(a < b for a, b in zip(missing, missing[1:]))):
            raise ProtocolError(f"send: missing must list ascending piece indices below {MAX_PIECES}")
        message = cls(typed_field(d, "program", bool), typed_field(d, "inputs", bool),
                      bool(typed_field(d, "pieces", bool, optional=True)), tuple(wanted), tuple(missing),
                      bool(typed_field(d, "again", bool, optional=True)))
        if message.missing and not message.program:
            raise ProtocolError("send: missing pieces are pieces of the program")
        if message.again and not message.tensors:
            raise ProtocolError("send: again is said of weights asked for again")
        return message


#: The most weights one Send asks for (a program naming more is asked in rounds): the message stays far below the
#: daemon's 4 MiB.
MAX_TENSORS_ASKED = 1024


@dataclass(frozen=True, slots=True)
class Payload(Message):
    """Announces the raw bytes that follow on the stream: the program, then the inputs (either may be absent)."""

    T: ClassVar[str] = "payload"
    program_size: int | None
    inputs_size: int | None
    tensors_size: int | None = None  # the weights a Send named, in its order
    #: With a (public) program's bytes: the client's upload token for it (gpunet.protocol.holding, "Upload
    #: tokens"): the worker serves pieces of it to other workers, as they arrive, against grants made with it.
    token: bytes | None = None

    def to_wire(self) -> dict[str, Any]:
        d = {"t": self.T, "program_size": self.program_size, "inputs_size": self.inputs_size}
        if self.tensors_size is not None:
            d["tensors_size"] = self.tensors_size
        if self.token is not None:
            d["token"] = self.token
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Payload":
        return cls(size_field(d, "program_size", optional=True), size_field(d, "inputs_size", optional=True),
                   size_field(d, "tensors_size", optional=True), proof_field(d, "token", "payload"))


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
        size = size_field(d, "outputs_size")
        outputs = typed_field(d, "outputs", bytes, optional=True)
        if outputs is not None and len(outputs) != size:
            raise ProtocolError("inline outputs do not match their declared size")
        input_hash = typed_field(d, "input_hash", str, optional=True)
        if input_hash is not None and not PROGRAM_HASH_RE.match(input_hash):
            raise ProtocolError("input_hash must be 64 lowercase hex characters")
        return cls(size, typed_field(d, "receipt", bytes), outputs, input_hash)


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
        return cls(job_id_field(d), typed_field(d, "signature", bytes))


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
        return cls(job_id_field(d), text_field(d, "reason", 500))


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
        items, malformed = settle_items(d.get("items"))
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
        return cls(job_id_field(d))


@dataclass(frozen=True, slots=True)
class Ok(Message):
    """A unary call was taken; ``cancelled`` answers a Cancel (whether the job was still queued or running)."""

    T: ClassVar[str] = "ok"
    cancelled: bool | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "cancelled": self.cancelled}

    @classmethod
    def from_wire(cls, d: dict) -> "Ok":
        return cls(typed_field(d, "cancelled", bool, optional=True))


@dataclass(frozen=True, slots=True)
class UseStream(Message):
    """The unary door cannot take this job (the worker lacks the program, or the outputs are large): use the stream."""

    T: ClassVar[str] = "use_stream"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, d: dict) -> "UseStream":
        return cls()


#: The most session steps one StepGroup carries (the spans' batch dim's bound).
MAX_GROUP_ROWS = 64


@dataclass(frozen=True, slots=True)
class StepGroup(Message):
    """Session steps of one client to one worker sent as one frame on a ``steps`` stream (each a Submit with its
    inputs inline, each its own session, job id, tab and answer): the worker lets them into its lanes together, so
    the steps of a batched span run as one forward (docs/sessions.md, group steps), and the p2p daemons carry one
    message for them all. Answered with one StepGroupAnswer."""

    T: ClassVar[str] = "step_group"
    submits: tuple[Submit, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "submits": [s.to_wire() for s in self.submits]}

    @classmethod
    def from_wire(cls, d: dict) -> "StepGroup":
        raw = d.get("submits")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_GROUP_ROWS:
            raise ProtocolError(f"a step group carries 1 to {MAX_GROUP_ROWS} submits")
        submits = tuple(Submit.from_wire(s) if isinstance(s, dict) else _not_a_map() for s in raw)
        if any(s.session is None or s.inputs is None for s in submits):
            raise ProtocolError("a step group carries session steps with their inputs inline")
        if len({s.job_id for s in submits}) != len(submits) or len({s.session.id for s in submits}) != len(submits):
            raise ProtocolError("a step group names each job and each session once")
        return cls(submits)


def _not_a_map():
    raise ProtocolError("a step group's submits are maps")


@dataclass(frozen=True, slots=True)
class StepGroupAnswer(Message):
    """A StepGroup's answers, one per submit in its order: a Result with its outputs inline, an Error, or UseStream
    (this step's answer did not fit in the frame, or it needs the job door: ask for it alone, by its job id; a step
    that ran is answered from the worker's recent results, not run again)."""

    T: ClassVar[str] = "step_group_answer"
    replies: tuple[Message, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "replies": [r.to_wire() for r in self.replies]}

    @classmethod
    def from_wire(cls, d: dict) -> "StepGroupAnswer":
        from gpunet.protocol.errors import Error

        raw = d.get("replies")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_GROUP_ROWS:
            raise ProtocolError(f"a step group's answer carries 1 to {MAX_GROUP_ROWS} replies")
        kinds = {k.T: k for k in (Result, UseStream, Error)}
        replies = []
        for r in raw:
            kind = kinds.get(r.get("t")) if isinstance(r, dict) else None
            if kind is None:
                raise ProtocolError("a step group's replies are results, errors or use_stream")
            reply = kind.from_wire(r)
            if isinstance(reply, Result) and reply.outputs is None:
                raise ProtocolError("a step group's results carry their outputs inline")
            replies.append(reply)
        return cls(tuple(replies))
