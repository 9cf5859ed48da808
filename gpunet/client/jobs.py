"""One job on the client's side, by the names it goes under on its way, so each thing has one name:

* :class:`Prepared`: the job encoded and estimated once, however many workers it goes to;
* :class:`JobRequest`: what one worker is asked;
* :class:`Delivery`: what that worker answered, with the way back to it for the client's verdict (the transport's);
* :class:`CheckedDelivery`: a delivery whose outputs passed the client's checks, not paid yet;
* :class:`JobResult`: the answer paid for, as the caller gets it.

Every other client module imports these downward (settlement and the transport alike), so none of them needs another
for its types.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Awaitable, Callable, Sequence

import torch

from gpunet import protocol
from gpunet.client.routing import JobShape, Requirements
from gpunet.errors import DeadlineUnreachable, UsageError
from gpunet.ledger.receipts import Receipt, price_to_nano
from gpunet.protocol import Countersign, Refuse
from gpunet.utils import LRU, sha256_hex

MAX_OUTPUT_BYTES = 4 * 1024**3
#: Inputs this big are copied and hashed in a thread (other jobs' I/O keeps moving); the hash is only needed to check
#: the receipt, so it is computed while they travel.
LARGE_BYTES = 1 << 20
#: Room for the safetensors header of a job's outputs (names, dtypes, shapes as JSON) on top of their data.
OUTPUT_HEADER_ALLOWANCE = 64 * 1024
MAX_ESTIMATES = 1024

Verdict = Countersign | Refuse


@dataclass(frozen=True)
class JobRequest:
    """One job as it goes to one worker."""

    job_id: str
    program_hash: str
    program: bytes  # the container; sent only when the worker asks for it
    inputs: bytes
    timeout: float
    max_price: int | None  # nano-credits per TFLOP
    max_output_bytes: int = MAX_OUTPUT_BYTES  # the most the answer may declare (known from the dry run)
    private: bool = False  # Requirements.private: see gpunet.protocol.Submit
    shared: bool = False  # Requirements.shared: see gpunet.protocol.Submit
    #: Other workers that hold the program (id, addresses): a worker lacking it may fetch it from them instead.
    holders: tuple[tuple[str, tuple[str, ...]], ...] = ()
    session: protocol.SessionStep | None = None  # a step of an inference session (docs/sessions.md)
    lane: str = protocol.INTERACTIVE  # Requirements.priority (docs/market.md)
    deadline: float | None = None  # unix time: Requirements.deadline
    #: The bytes of a weight the program names by reference, by sha256 (Job.referenced), for a worker that asks.
    weights: Callable[[str], Any] | None = None
    weights_named: int = 0  # how many weights it names so
    #: Workers that keep the checkpoint those weights come from (their records list it): a worker that lacks them
    #: fetches them from these, and asks this client only for what they do not deliver.
    weight_holders: tuple[str, ...] = ()


async def _nothing(verdict: Verdict) -> None:
    pass


@dataclass
class Delivery:
    """A worker's answer: outputs and receipt, with the way back to that worker for the client's verdict."""

    worker_id: str  # the peer that answered, as the libp2p channel authenticated it
    outputs: bytes
    receipt: Receipt | None  # None only for a session step its session's tab bills later (gpunet.ledger.tabs)
    bytes_sent: int
    transfer_seconds: float
    via_unary: bool = False  # countersignatures for unary answers can ride on the next job to the worker
    finish: Callable[[Verdict], Awaitable[None]] = _nothing  # send the verdict (and close the stream, if any)
    close: Callable[[], None] = lambda: None  # hang up without a verdict: the work stays unpaid
    input_hash: str | None = None  # a session step whose input was pushed to the worker: the input it says it ran on
    arrived: float = field(default_factory=time.monotonic)  # when it came (a late verdict goes by batch, not stream)


@dataclass
class CheckedDelivery:
    """A delivery whose outputs decoded against the dry run and whose receipt matched: accepted, not paid yet."""

    delivery: Delivery
    outputs: object  # the decoded tensor(s)
    attempts: list[str]  # the workers this copy of the job went to, in order, the last one delivered
    compute_seconds: float | None = None  # its compute time as this client measured it (Router.on_success)

    @property
    def worker_id(self) -> str:
        return self.delivery.worker_id


@dataclass(frozen=True)
class JobResult:
    """A finished job: decoded outputs, the worker that ran it, and the receipt both sides signed."""

    outputs: torch.Tensor | tuple[torch.Tensor, ...]
    worker_id: str
    receipt: Receipt
    attempts: list[str]  # worker ids tried, in order, the last one delivered
    bytes_sent: int  # to the worker that delivered: inputs, plus the program unless it had it cached
    checked: bool = False  # compared with another worker's result, and agreed


@dataclass
class Prepared:
    """One job, encoded and estimated once, however many workers it goes to."""

    job: object
    req: Requirements
    job_id: str
    encoded: bytes
    input_hash: str | None  # None while ``hashing`` computes it (big inputs: alongside their transfer)
    flops: int
    program: bytes
    deadline: float  # monotonic
    shape: JobShape
    max_price: int | None
    outputs: tuple  # (dtype, shape) of each output, from the dry run: a worker's answer must match exactly
    max_output_bytes: int  # their data plus room for the header: a bigger answer is refused before it is read
    hashing: asyncio.Future | None = None
    inputs: tuple | None = None  # the tensors themselves, kept for verified jobs: the client may compute the job here
    peak_memory: int = 0  # the dry run's peak, in bytes
    raises_here: asyncio.Future | None = None  # this client's own run of the job, once a worker said it raised


class Estimates:
    """FLOPs and memory by the same dry run the worker bills from; cached per program and input shapes."""

    def __init__(self, size: int = MAX_ESTIMATES):
        self._cache: LRU[tuple, object] = LRU(size)

    async def of(self, job, inputs: Sequence[torch.Tensor]):
        key = (job.program_hash, *((tuple(t.shape), t.dtype) for t in inputs))
        estimate = self._cache.get(key)
        if estimate is None:
            # The first dry run of a program also validates it exactly as a worker would; keep it off the loop.
            estimate = await asyncio.to_thread(job.estimate, *inputs)
            self._cache.put(key, estimate)
        return estimate


async def prepare_job(job, inputs: Sequence[torch.Tensor], req: Requirements, job_id: str,
                      estimates: Estimates) -> Prepared:
    """Encode, hash and estimate a job once (JobRejected: inputs misfit; DeadlineUnreachable: its deadline passed)."""
    encoded = await _off_loop_if_large(job.encode_inputs, inputs)
    hashing = None
    if len(encoded) >= LARGE_BYTES:  # only needed to check the receipt: hash big inputs while they travel
        input_hash, hashing = None, asyncio.ensure_future(asyncio.to_thread(sha256_hex, encoded))
    else:
        input_hash = sha256_hex(encoded)
    estimate = await estimates.of(job, inputs)
    program = job.program_bytes()
    return Prepared(
        job=job, req=req, job_id=job_id, encoded=encoded, input_hash=input_hash, flops=estimate.flops,
        program=program, deadline=time.monotonic() + seconds_left(req),
        shape=JobShape(estimate.flops, job.program_hash, len(encoded), len(program), req.dtype or dtype_of(job),
                       req.private),
        max_price=price_to_nano(req.max_price) if req.max_price is not None else None,
        outputs=estimate.outputs,
        max_output_bytes=estimate.output_bytes + OUTPUT_HEADER_ALLOWANCE, hashing=hashing,
        inputs=tuple(inputs) if req.verify != "none" or req.redundancy > 1 else None,
        peak_memory=estimate.peak_memory_bytes,
    )


async def prepare_step(job, inputs: Sequence[torch.Tensor], session: protocol.SessionStep,
                       state: Sequence[torch.Tensor], req: Requirements, estimates: Estimates
                       ) -> tuple[Prepared, protocol.SessionStep]:
    """A session step, encoded and estimated: its inputs (with the first state when the step opens a session that is
    not ``fresh``; nothing when the input is pushed to the worker), and the step as sent (step 0 says how much state
    the worker reserves before it runs)."""
    if session.step == 0 and session.state_bytes is None:
        session = replace(session, state_bytes=job.manifest.state_bytes)
    sends_state = session.step == 0 and not session.fresh
    full = (*inputs, *state)
    if session.input_from is not None:
        encoded = b""
    else:
        encoded = job.encode_inputs(*full) if sends_state else job.encode_step_inputs(*inputs)
    estimate = await estimates.of(job, full)
    program = job.program_bytes()
    n_out = len(job.manifest.outputs) - job.manifest.state
    return Prepared(
        job=job, req=req, job_id=f"{session.id}.{session.step}{'p' if session.input_from else ''}", encoded=encoded,
        input_hash=sha256_hex(encoded),
        flops=estimate.flops, program=program, deadline=time.monotonic() + req.timeout,
        shape=shape_of(job, estimate, len(encoded), req),
        max_price=price_to_nano(req.max_price) if req.max_price is not None else None,
        outputs=estimate.outputs[:n_out],
        max_output_bytes=replace(estimate, outputs=estimate.outputs[:n_out]).output_bytes + OUTPUT_HEADER_ALLOWANCE,
    ), session


def shape_of(job, estimate, input_bytes: int, req: Requirements) -> JobShape:
    return JobShape(estimate.flops, job.program_hash, input_bytes, len(job.program_bytes()),
                    req.dtype or dtype_of(job), req.private, job.manifest.refs_bytes, getattr(job, "checkpoint", None))


def check_call(job, inputs: Sequence, named: dict | None = None) -> tuple[torch.Tensor, ...]:
    """What a submit was handed, as a Job and tensors in its input order (numpy arrays are taken as they are; named
    inputs go where their names say); UsageError otherwise, saying what to pass. Called where the user calls, so the
    mistake surfaces there and not in a future."""
    from gpunet.job import Job

    if not isinstance(job, Job):
        hint = (" (trace it first: gpunet.Job.from_module(model, example_inputs=(x,)))"
                if isinstance(job, torch.nn.Module) or callable(job) else "")
        raise UsageError(f"submit takes a gpunet.Job, not a {type(job).__name__}{hint}")
    return job.bind(inputs, named)


def seconds_left(req: Requirements) -> float:
    """How long a job may take in all: its timeout, cut to its deadline (DeadlineUnreachable if that has passed)."""
    if req.deadline is None:
        return req.timeout
    left = req.deadline - time.time()
    if left <= 0:
        raise DeadlineUnreachable(f"the job's deadline passed {-left:.1f} s ago")
    return min(req.timeout, left)


def check_seconds(req: Requirements) -> float:
    """How long a check of a job's answers may take, from when it begins (the client's own run of the job, the
    checkers drawn to settle a vote): the job's timeout again, cut to its deadline (0 once that has passed). Never
    what the workers left of the job's time: a worker that answers at the last moment must not shorten its own
    check (docs/trust.md, "Late answers")."""
    if req.deadline is None:
        return req.timeout
    return max(0.0, min(req.timeout, req.deadline - time.time()))


async def _off_loop_if_large(encode, inputs):
    """Copying big inputs takes a while; do it in a thread so other jobs' I/O keeps moving."""
    if sum(t.numel() * t.element_size() for t in inputs) >= LARGE_BYTES:
        return await asyncio.to_thread(encode, *inputs)
    return encode(*inputs)


_THROUGHPUT_DTYPES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}


def dtype_of(job) -> str | None:
    """The throughput figure that fits a job: that of its first floating-point input (fp32 for most models)."""
    for spec in job.manifest.inputs:
        if spec.dtype in _THROUGHPUT_DTYPES:
            return _THROUGHPUT_DTYPES[spec.dtype]
    return None
