"""Errors across a boundary: the same gpunet exception on both sides, through one table.

:data:`CROSSING` lists every error that crosses, most specific first, each with its *code* on the wire and the
:class:`Error` flag that narrows the code to it. Both directions read that one table:

* an exception becomes an :class:`Error` message (:meth:`Error.of`): its code is that of the first row it is an
  instance of ("failed" for any other error), and each flag says whether it is an instance of that flag's class;
* an :class:`Error` becomes an exception (:meth:`Error.exception`): the first row with its code whose flag, if any,
  it sets (an unknown code is a ``JobFailed``);
* an error named by its class (an executor process's reply to its worker) becomes an exception with
  :func:`error_named`: the row of that name; any other name is a ``JobFailed``.

A code is a family, not a class, and stays one: a new subclass crosses as its family (an older peer knows no more),
and a flag, which older peers ignore, says what it is within the family. So a ``DryRunTooLong`` crosses the wire as
a ``JobRejected``, and only the executor's pipe, which names classes, keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpunet.errors import (
    DryRunTooLong,
    GpunetError,
    JobFailed,
    JobPreempted,
    JobRaised,
    JobRejected,
    JobTimeout,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.protocol.fields import PROGRAM_HASH_RE, Message, text_field


@dataclass(frozen=True, slots=True)
class Crossing:
    """One error that crosses: its class, its family's code on the wire, and the :class:`Error` field that narrows
    the code to this class (None: the code alone names it)."""

    error: type[GpunetError]
    code: str
    flag: str | None = None


#: Every error that crosses, most specific first (the first row an error is an instance of gives its code; the first
#: row whose code and flag a message carries gives its exception).
CROSSING: tuple[Crossing, ...] = (
    Crossing(SessionLost, "session_lost"),  # before "failed": the first matching family names an error
    Crossing(WorkerDraining, "busy", "draining"),  # a code of its own would read as a failure to older clients
    Crossing(JobPreempted, "busy", "preempted"),  # likewise: older clients retry it as busy
    Crossing(WorkerBusy, "busy"),
    Crossing(PayFirst, "rejected", "pay_first"),  # older clients: a refusal; newer ones pay and ask again
    Crossing(JobRejected, "rejected"),
    Crossing(JobRaised, "failed", "raised"),  # the job's own error (older clients: a failure)
    Crossing(JobFailed, "failed"),
    Crossing(JobTimeout, "timeout"),
    Crossing(ProtocolError, "protocol"),
    Crossing(ProgramNotCached, "not_cached"),
    Crossing(DryRunTooLong, "rejected"),  # after JobRejected: on the wire it is one; named, it is itself
)
_NAMED = {c.error.__name__: c.error for c in CROSSING}
_FLAGS = tuple(c for c in CROSSING if c.flag is not None)


def _make(kind: type[GpunetError], message: str, queue: int = 0, program: str | None = None) -> GpunetError:
    """An instance of ``kind``: each family's constructor takes what it carries."""
    if issubclass(kind, ProgramNotCached):
        return kind(program or "?")
    if issubclass(kind, WorkerBusy):
        return kind(message, queue)
    return kind(message)


def error_named(name: Any, message: str) -> GpunetError:
    """The exception an error's class name stands for (an executor process names the error it raised so); a name
    not in :data:`CROSSING` (or not a string) is a ``JobFailed`` with the same message. A ``ProgramNotCached`` named
    so says no program hash: its receiver knows which program it asked for and raises its own."""
    return _make(_NAMED.get(name, JobFailed) if isinstance(name, str) else JobFailed, message)


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A refusal or failure; :meth:`exception` is the same gpunet error the worker raised."""

    T: ClassVar[str] = "error"
    code: str
    message: str
    queue: int = 0  # busy: the worker's queue length
    program: str | None = None  # not_cached: the program to resend
    draining: bool = False  # busy because it is leaving
    preempted: bool = False  # busy because a higher lane took its slot
    raised: bool = False  # failed because an op of the job raised
    pay_first: bool = False  # rejected at the credit line: taken again once this client's countersignatures land

    @classmethod
    def of(cls, error: GpunetError, queue: int = 0) -> "Error":
        """The message that carries ``error`` to the peer (first matching family wins)."""
        code = next((c.code for c in CROSSING if isinstance(error, c.error)), "failed")
        program = error.program_hash if isinstance(error, ProgramNotCached) else None
        flags = {c.flag: isinstance(error, c.error) for c in _FLAGS}
        return cls(code, str(error)[:2000], queue, program, **flags)

    def exception(self) -> GpunetError:
        """The exception this stands for; unknown codes become JobFailed."""
        kind = next((c.error for c in CROSSING if c.code == self.code and (c.flag is None or getattr(self, c.flag))),
                    JobFailed)
        return _make(kind, self.message or "worker reported an error", self.queue, self.program)

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
        if self.pay_first:
            d["pay_first"] = True
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Error":
        queue = d.get("queue")
        program = d.get("program")
        return cls(text_field(d, "code", 32) or "failed", text_field(d, "message", 2000),
                   queue if type(queue) is int and 0 <= queue < 2**31 else 0,
                   program if isinstance(program, str) and PROGRAM_HASH_RE.match(program) else None,
                   d.get("draining") is True, d.get("preempted") is True, d.get("raised") is True,
                   d.get("pay_first") is True)
