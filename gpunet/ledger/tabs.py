"""A session's tab: many steps of one inference session on one worker, billed by one receipt (docs/ledger.md).

A 1,000-token generation over three workers would otherwise be 3,000 receipts. Both sides keep the same tab, step by
step: the steps it covers, the work they counted, and hash chains of each step's input and output hashes. When the
tab holds :data:`TAB_STEPS` steps or :data:`TAB_FLOPS` of work, or the session closes or expires, the worker signs
one ordinary receipt for it:
job id ``<session>.<nonce>.<first>-<last>``, input and output hash the chains' heads, FLOPs the steps' sum. The client checks it
against its own tab (the chains bind every step it sent and received) and countersigns as for any job. Pure: no I/O.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field

#: Steps one receipt covers at most: what a worker risks on a client that never pays is bounded by it (and by the
#: worker's usual limit on results a client holds unpaid), and a long generation costs a ledger row per this many.
TAB_STEPS = 64
#: ...and at most this much counted work (a tab closes at whichever comes first): 64 steps of a big model's span can be
#: a lot of work to do on credit, so a tab is billed once it is worth a TFLOP (1 credit at the default price).
TAB_FLOPS = 10**12
#: ``<session>.<nonce>.<first>-<last>``: the nonce is the worker's, drawn when the session opens, so a session id a
#: client reuses never names a receipt signed before; ordinary job ids of this form are refused by workers.
TAB_JOB_RE = re.compile(r"(?P<session>[A-Za-z0-9_-]{1,24})\.(?P<nonce>[0-9a-f]{8})\.(?P<first>\d{1,10})-(?P<last>\d{1,10})\Z")


def chain(head: str, digest: str) -> str:
    """The next head of a hash chain: sha256(head bytes || digest bytes); the empty chain's head is ''."""
    return hashlib.sha256(bytes.fromhex(head) + bytes.fromhex(digest)).hexdigest()


@dataclass
class Tab:
    """The open tab of one session on one worker: each step's hashes and counted work, in order."""

    nonce: str | None = None  # the worker's, from the session's first receipt (the client learns it there)
    first: int = 0  # the first step it covers
    inputs: list[str] = field(default_factory=list)  # each step's input hash
    outputs: list[str] = field(default_factory=list)
    work: list[int] = field(default_factory=list)  # each step's counted FLOPs
    wall_time_us: int = 0
    started_at_us: int = 0
    ended_at_us: int = 0

    @property
    def steps(self) -> int:
        return len(self.inputs)

    @property
    def flops(self) -> int:
        return sum(self.work)

    @property
    def input_chain(self) -> str:
        return functools.reduce(chain, self.inputs, "")

    @property
    def output_chain(self) -> str:
        return functools.reduce(chain, self.outputs, "")

    def add(self, step: int, input_hash: str, output_hash: str, flops: int, wall_time_us: int = 0,
            started_at_us: int = 0, ended_at_us: int = 0) -> None:
        if not self.inputs:
            self.first, self.started_at_us = step, started_at_us
        elif step != self.first + self.steps:
            raise ValueError(f"a tab covers consecutive steps: {step} does not follow {self.first + self.steps - 1}")
        self.inputs.append(input_hash)
        self.outputs.append(output_hash)
        self.work.append(flops)
        self.wall_time_us += wall_time_us
        self.ended_at_us = max(ended_at_us, self.started_at_us)  # a clock set back mid-tab must not void the receipt

    def prefix(self, steps: int) -> "Tab":
        """The tab of its first ``steps`` steps (what a client that closes says it received)."""
        steps = max(0, min(steps, self.steps))
        return Tab(self.nonce, self.first, self.inputs[:steps], self.outputs[:steps], self.work[:steps],
                   self.wall_time_us if steps == self.steps else self.wall_time_us * steps // max(1, self.steps),
                   self.started_at_us, self.ended_at_us)

    def split(self, steps: int) -> tuple["Tab", "Tab"]:
        """Its first ``steps`` steps, and the rest (each a tab of its own, same nonce)."""
        head = self.prefix(steps)
        rest = Tab(self.nonce, head.first + head.steps, self.inputs[head.steps:], self.outputs[head.steps:],
                   self.work[head.steps:], self.wall_time_us - head.wall_time_us,
                   self.started_at_us if not head.steps else head.ended_at_us, self.ended_at_us)
        return head, rest

    def next(self) -> "Tab":
        """The tab after this one is billed: empty, same session."""
        return Tab(self.nonce)

    @property
    def full(self) -> bool:
        """Due to be billed: TAB_STEPS steps, or TAB_FLOPS of work (both sides count the same work)."""
        return self.steps >= TAB_STEPS or self.flops >= TAB_FLOPS

    @property
    def last(self) -> int:
        return self.first + self.steps - 1

    def job_id(self, session_id: str) -> str:
        return f"{session_id}.{self.nonce}.{self.first}-{self.last}"


def parse(job_id: str) -> tuple[str, str, int, int] | None:
    """(session, nonce, first step, last step) of a tab's job id; None for any other job id."""
    m = TAB_JOB_RE.match(job_id)
    return (m["session"], m["nonce"], int(m["first"]), int(m["last"])) if m else None


def steps_of(job_id: str) -> int:
    """How many session steps a receipt's job id covers (1 for an ordinary job)."""
    parsed = parse(job_id)
    return parsed[3] - parsed[2] + 1 if parsed and parsed[3] >= parsed[2] else 1
