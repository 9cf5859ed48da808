"""The worker's job service without a network: cancel by RPC, and the budget on stopping running jobs."""

import asyncio
from types import SimpleNamespace

import msgpack
import pytest

from gpunet.errors import JobFailed, JobRejected
from gpunet.ledger import Identity, Ledger
from gpunet.wire import pack
from gpunet.worker.service import JobService, ServiceLimits, _Submit, _UnaryPayloads

PROGRAM = "ab" * 32
ALICE, BOB = Identity.generate().peer_id, Identity.generate().peer_id


class HangingExecutor:
    """Stands in for the executor pool: holds every program and never finishes a job (until cancelled)."""

    def has_program(self, program_hash: str) -> bool:
        return True

    async def run(self, program_hash, program_bytes, inputs, timeout=None):
        await asyncio.Event().wait()


@pytest.fixture
def service(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        yield JobService(identity=Identity.generate(), network="t", executor=HangingExecutor(), ledger=ledger,
                         price_micro=1, max_concurrent=1, max_queue=4, record=lambda: None,
                         limits=ServiceLimits(max_stopped_jobs=2))


def submit(service, client: str, job_id: str) -> asyncio.Future:
    job = _Submit(job_id, PROGRAM, 4, b"abcd", 60.0, None)
    return asyncio.ensure_future(service._execute(client, job, _UnaryPayloads(), None))


async def until(condition, what: str, deadline: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + deadline
    while not condition():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def cancel_by_rpc(service, client: str, job_id: str) -> bool:
    reply = await service._handle_cancel(pack({"t": "cancel", "job": job_id}), SimpleNamespace(to_base58=lambda: client))
    return msgpack.unpackb(reply)["cancelled"]


def test_cancel_rpc_stops_only_the_callers_own_job(service):
    async def scenario():
        job = submit(service, ALICE, "job-1")
        await until(lambda: service.running == 1, "the job to run")
        assert not await cancel_by_rpc(service, BOB, "job-1")  # the id is Alice's: Bob cannot touch it
        assert await cancel_by_rpc(service, ALICE, "job-1")
        with pytest.raises(JobFailed, match="stopped before it finished"):
            await job
        assert service.running == 0 and service.admitted == 0 and not service._running
        assert not await cancel_by_rpc(service, ALICE, "job-1")

    asyncio.run(scenario())


def test_a_client_that_keeps_stopping_running_jobs_is_refused_for_a_while(service):
    async def scenario():
        for i in range(2):
            job = submit(service, ALICE, f"job-{i}")
            await until(lambda: service.running == 1, "the job to run")
            assert await cancel_by_rpc(service, ALICE, f"job-{i}")
            with pytest.raises(JobFailed):
                await job
        with pytest.raises(JobRejected, match="stopped 2 running jobs"):
            await submit(service, ALICE, "job-9")
        other = submit(service, BOB, "job-b")  # others are unaffected
        await until(lambda: service.running == 1, "Bob's job to run")
        other.cancel()
        with pytest.raises((asyncio.CancelledError, JobFailed)):
            await other

    asyncio.run(scenario())


def test_a_queued_job_cancelled_before_it_runs_does_not_count(service):
    async def scenario():
        first = submit(service, ALICE, "job-run")
        await until(lambda: service.running == 1, "the first job to run")
        for i in range(3):  # queued behind it (one slot): stopping these costs the worker nothing
            queued = submit(service, ALICE, f"job-q{i}")
            await until(lambda: service.queue_length == 1, "the job to queue")
            assert await cancel_by_rpc(service, ALICE, f"job-q{i}")
            with pytest.raises(JobFailed):
                await queued
        assert service._recent_stops(ALICE) == 0
        first.cancel()
        with pytest.raises((asyncio.CancelledError, JobFailed)):
            await first

    asyncio.run(scenario())
