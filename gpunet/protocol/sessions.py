"""The messages of inference sessions (docs/sessions.md): a job that is one step of a session (:class:`SessionStep`,
riding on :class:`~gpunet.protocol.jobs.Submit`), a step's output pushed from one span's worker to the next
(:class:`PushTo`, :class:`Push` on the ``push`` door, :class:`PushGroup` for several at once), and ending a
session (:class:`CloseSession` -> :class:`SessionClosed` on the ``cancel`` door).

A session id is short and has no dots, so a tab's job id (gpunet.ledger.tabs) splits back into its parts; a step
number is below 2**31; a session lives at most :data:`MAX_SESSION_TTL` idle seconds on a worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from gpunet.errors import ProtocolError
from gpunet.protocol.fields import Message, peer_id_field, size_field, typed_field

#: The biggest session step output a worker pushes to the next span's worker (docs/sessions.md, pushed steps); a
#: bigger one goes by way of the client.
MAX_PUSH_BYTES = 1 << 20
#: A ``steps`` stream (a session's steps over one stream) the client sends nothing on for this long is closed by the
#: worker; a client reuses one idle for less than STEPS_REUSE, so it never writes to one the worker is closing.
STEPS_IDLE = 60.0
STEPS_REUSE = 40.0
#: The longest a session may stay idle on a worker before its state is dropped (a client asks for less or gets this).
MAX_SESSION_TTL = 3600.0
MAX_SESSION_STEP = 2**31
#: A session id: short, and without the dots that separate a tab's job id (gpunet.ledger.tabs) into its parts.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,24}\Z")


def _session_id(d: dict, name: str) -> str:
    session_id = typed_field(d, name, str)
    if not SESSION_ID_RE.match(session_id):
        raise ProtocolError("a session id is 1-24 characters of [A-Za-z0-9_-]")
    return session_id


def _step(d: dict, name: str) -> int:
    step = size_field(d, name)
    if step >= MAX_SESSION_STEP:
        raise ProtocolError("session step out of range")
    return step


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
        return cls(peer_id_field(d, "peer"), _session_id(d, "session"), _step(d, "step"))


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
        ttl = typed_field(d, "ttl", (int, float), optional=True)
        ttl = 300.0 if ttl is None else float(ttl)
        if not (0 < ttl <= MAX_SESSION_TTL):  # also refuses NaN
            raise ProtocolError(f"session ttl must be between 0 and {MAX_SESSION_TTL:.0f} s")
        input_from = peer_id_field(d, "from") if d.get("from") is not None else None
        push_to = PushTo.from_wire(d["push"]) if d.get("push") is not None else None
        if input_from is not None and step == 0:
            raise ProtocolError("a session's first step cannot take a pushed input: it opens the session")
        state_bytes = size_field(d, "state") if d.get("state") is not None else None
        if state_bytes is not None and step != 0:
            raise ProtocolError("only a session's first step declares its state's size")
        return cls(session_id, step, bool(typed_field(d, "fresh", bool, optional=True)),
                   bool(typed_field(d, "close", bool, optional=True)), ttl, input_from, push_to, state_bytes)


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
        inputs = typed_field(d, "inputs", bytes, optional=True)
        if inputs is not None and len(inputs) > MAX_PUSH_BYTES:
            raise ProtocolError(f"a pushed input is at most {MAX_PUSH_BYTES} bytes")
        return cls(peer_id_field(d, "client"), _session_id(d, "session"), _step(d, "step"), inputs)


#: The most pushes one PushGroup carries.
MAX_PUSH_GROUP = 64


@dataclass(frozen=True, slots=True)
class PushGroup(Message):
    """Pushes to one worker made in the same turn of the sender's loop (the rows of one batched forward), sent as one
    frame on a ``pushes`` stream: the next span's steps waiting for them get their inputs at once. Answered Ok when
    every push was taken, else the first Error (the sender only logs it: a step not given its input asks its
    client)."""

    T: ClassVar[str] = "push_group"
    pushes: tuple[Push, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "pushes": [p.to_wire() for p in self.pushes]}

    @classmethod
    def from_wire(cls, d: dict) -> "PushGroup":
        raw = d.get("pushes")
        if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_PUSH_GROUP:
            raise ProtocolError(f"a push group carries 1 to {MAX_PUSH_GROUP} pushes")
        if not all(isinstance(p, dict) for p in raw):
            raise ProtocolError("a push group's pushes are maps")
        return cls(tuple(Push.from_wire(p) for p in raw))


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
        received = size_field(d, "received", optional=True)
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
        return cls(bool(typed_field(d, "closed", bool)), typed_field(d, "receipt", bytes, optional=True))
