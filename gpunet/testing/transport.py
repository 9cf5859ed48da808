"""A fake transport, for tests: the client over in-process workers, in milliseconds, no go-libp2p, no sockets (like
httpx's ``MockTransport``). ``ClientCore(transport=FakeTransport(...))``.

Each :class:`FakeWorker` runs its jobs for real (the job's own validator and interpreter, on this CPU) and signs a real
receipt with its own key, so the client's checks, countersignatures and ledger see what they would see from a
network; its ``script`` makes it misbehave on purpose. Only the bytes never leave the process.
"""

from __future__ import annotations

import asyncio
import hashlib

import torch

import gpunet
from gpunet.client.jobs import Delivery, JobRequest
from gpunet.client.transport import BaseTransport
from gpunet.dht.records import DeviceInfo, WorkerRecord
from gpunet.dht.records import WorkerEntry
from gpunet.errors import (
    DeadlineUnreachable,
    JobFailed,
    JobPreempted,
    JobRaised,
    JobRejected,
    NetworkError,
    ProgramNotCached,
    StreamBroken,
    WorkerBusy,
)
from gpunet.job import tensors
from gpunet.ledger import Identity, price_to_nano, sign_as_worker
from gpunet.protocol import Countersign, Refuse

__all__ = ["FakeTransport", "FakeWorker"]

#: Seconds before the client's timeout a "stall" worker answers.
STALL_MARGIN = 0.1


class FakeWorker:
    """A worker in-process. ``script``: what it does with each job it gets, in turn ("ok" once the script runs out):
    ok, lie, garble (a receipt for other outputs), busy, fail, vanish, hang, lost (program evicted), reject,
    preempt (a batch job stopped for interactive work), late (refused for its deadline), break (the stream cut),
    raise (says the job raised when it did not; one that does raise, raises here for real), stall (holds its answer
    until 0.1 s before the client's time runs out, then lies, as colluders leaving no time to check it would)."""

    def __init__(self, name: str, *script: str, price: float = 1.0, tflops: float = 1.0):
        self.name, self.script, self.price = name, list(script), price
        self.identity = Identity.generate()
        self.id = self.identity.peer_id
        self.jobs: list[str] = []
        self.verdicts: list[Countersign | Refuse] = []
        self.states: dict[str, tuple[torch.Tensor, ...]] = {}  # session id -> its state, as a worker keeps it
        self.answered: dict[str, Delivery] = {}  # session step job id -> its answer (a worker's results cache)
        self.entry = WorkerEntry(self.id, WorkerRecord(
            version="test", state="online", price=price, tflops={"fp32": tflops},
            device=DeviceInfo(kind="cpu", name=name, memory_total=16 * 2**30, memory_free=8 * 2**30)), 1e12)


class FakeTransport(BaseTransport):
    """Workers in-process: each job runs here, as its worker's script says, and comes back signed by that worker."""

    def __init__(self, client_id: str, *workers: FakeWorker):
        self.client_id = client_id
        self.workers = {w.id: w for w in workers}
        self.settled: dict[str, list[str]] = {}
        self.forgotten: list[str] = []  # workers the client said never to name as holders
        self.closed = False

    async def discover(self) -> list[WorkerEntry]:
        return [w.entry for w in self.workers.values()]

    def forget(self, worker_id: str) -> None:
        self.forgotten.append(worker_id)

    async def submit(self, worker: WorkerEntry, request: JobRequest, *, cached: bool, settlement) -> Delivery:
        w = self.workers[worker.id]
        w.jobs.append(request.job_id)
        act = w.script.pop(0) if w.script else "ok"
        if act == "busy":
            raise WorkerBusy("worker queue is full", 3)
        if act == "break":
            raise StreamBroken("peer closed the stream mid-message")
        if act == "preempt":
            raise JobPreempted("an interactive job needed this worker's slot", 1)
        if act == "late":
            raise DeadlineUnreachable("this worker cannot start the job before its deadline")
        if act == "fail":
            raise JobFailed("executor crashed")
        if act == "vanish":
            raise NetworkError(f"worker {worker.id[-8:]} did not answer")
        if act == "reject":
            raise JobRejected("this worker's limit is lower")
        if act == "lost":
            raise ProgramNotCached(request.program_hash)
        if act == "hang":
            await asyncio.Event().wait()
        if act == "raise":
            raise JobRaised("node 'x' (aten.add.Tensor) raised RuntimeError: made up")
        if act == "stall":
            await asyncio.sleep(max(0.0, request.timeout - STALL_MARGIN))
        if request.session is not None:
            return self._step(w, request, act)
        job = gpunet.Job.from_bytes(request.program)
        inputs = tensors.decode(request.inputs)
        x = [inputs[f"input_{i}"] for i in range(len(inputs))]
        out = job.run_locally(*x)
        if act in ("lie", "stall"):
            out = out * 1.5 + 1
        outputs = tensors.encode({"output_0": out})
        signed_outputs = b"not what was sent" if act == "garble" else outputs  # a receipt for other outputs
        receipt = sign_as_worker(
            w.identity, job_id=request.job_id, client_id=self.client_id, program_hash=request.program_hash,
            input_hash=hashlib.sha256(request.inputs).hexdigest(), output_hash=hashlib.sha256(signed_outputs).hexdigest(),
            flops=job.estimate(*x).flops, wall_time_us=10, price=price_to_nano(w.price),
            max_price=request.max_price, started_at_us=1, ended_at_us=2, lane=request.lane)

        async def finish(verdict):
            w.verdicts.append(verdict)

        sent = len(request.inputs) + (0 if cached else len(request.program))
        return Delivery(worker.id, outputs, receipt, sent, 0.0, via_unary=cached, finish=finish)

    def _step(self, w: FakeWorker, request: JobRequest, act: str) -> Delivery:
        """A session step: the state stays here between steps; a step asked again is answered from memory.
        ``act`` "cut": the step runs, and its answer is lost on the way back."""
        if request.job_id in w.answered:
            return w.answered[request.job_id]
        job = gpunet.Job.from_bytes(request.program)
        inputs = tensors.decode(request.inputs)
        x = [inputs[f"input_{i}"] for i in range(len(inputs))]
        if request.session.step > 0:
            x += w.states[request.session.id]
        out, *state = job.run_locally(*x)
        w.states[request.session.id] = tuple(state)
        w.answered[request.job_id] = delivery = Delivery(
            w.id, tensors.encode({"output_0": out}), None, len(request.inputs), 0.0, via_unary=True)
        if act == "cut":
            raise StreamBroken("peer closed the stream mid-message")
        return delivery

    async def close_session(self, worker_id: str, session_id: str, received) -> None:
        self.workers[worker_id].states.pop(session_id, None)  # its steps stay unbilled: these fakes sign no tabs

    async def settle(self, worker_id: str, items) -> None:
        self.settled.setdefault(worker_id, []).extend(job_id for job_id, _ in items)

    async def cancel(self, worker_id: str, job_id: str) -> bool:
        return False

    async def close(self) -> None:
        self.closed = True
