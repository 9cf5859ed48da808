"""What the client checks in a worker's answer before it accepts and pays: the receipt's terms, who signed it, and
outputs exactly as the dry run predicts them (shape and dtype), each refusal naming the problem."""

import asyncio
import hashlib

import pytest
import torch

import gpunet
from gpunet.client.core import ClientCore
from gpunet.client.jobs import Delivery, Prepared
from gpunet.client.payment import Payment
from gpunet.client.routing import JobShape, Requirements
from gpunet.client.settlement import Settlement
from gpunet.errors import InvalidReceipt, ProtocolError
from gpunet.job import tensors
from gpunet.ledger import Identity, sign_as_worker
from gpunet.protocol import Refuse

JOB = gpunet.Job.from_function(lambda x: torch.tanh(x) * 2, (torch.randn(4, 8),))
X = torch.randn(4, 8)


@pytest.fixture
def core(tmp_path):
    core = ClientCore(initial_peers=[], network="gpunet-test", data_dir=tmp_path / "client")
    # Refusals go through each delivery's own way back: no transport needed.
    core.payment = Payment(core.identity, core.router, core.reputation, Settlement(transport=None), books=None)
    return core


def prepared(core) -> Prepared:
    encoded = JOB.encode_inputs(X)
    est = JOB.estimate(X)
    return Prepared(
        job=JOB, req=Requirements(), job_id="job-1", encoded=encoded, input_hash=hashlib.sha256(encoded).hexdigest(),
        flops=est.flops, program=JOB.program_bytes(), deadline=0.0,
        shape=JobShape(est.flops, JOB.program_hash, len(encoded), 0), max_price=None, outputs=est.outputs,
        max_output_bytes=est.output_bytes + 65536,
    )


def answer(core, p: Prepared, outputs: bytes, *, worker=None, signer=None, claimed_by=None) -> Delivery:
    worker = worker or Identity.generate()
    receipt = sign_as_worker(
        signer or worker, job_id=p.job_id, client_id=core.id, program_hash=JOB.program_hash, input_hash=p.input_hash,
        output_hash=hashlib.sha256(outputs).hexdigest(), flops=p.flops, wall_time_us=10, price=1, max_price=None,
        started_at_us=1, ended_at_us=2,
    )
    refused = []

    async def finish(verdict):
        refused.append(verdict)

    core.router.advertised.put(worker.peer_id, 1.0)  # a worker routing found, at the price it advertised
    delivery = Delivery(claimed_by or worker.peer_id, outputs, receipt, len(p.encoded), 0.0, via_unary=True,
                        finish=finish)
    delivery.refused = refused
    return delivery


def check(core, p, delivery):
    async def run():
        try:
            return core.payment.check(p, delivery)
        finally:
            await asyncio.sleep(0)  # let the refusal go out
    return asyncio.run(run())


def test_a_correct_answer_is_accepted(core):
    p = prepared(core)
    out = check(core, p, answer(core, p, tensors.encode({"output_0": JOB.run_locally(X)})))
    assert torch.allclose(out, JOB.run_locally(X))


@pytest.mark.parametrize("wrong, match", [
    (torch.randn(4, 9), r"output 0 is F32 \[4, 9\], the dry run predicts F32 \[4, 8\]"),
    (torch.randn(2, 8), r"output 0 is F32 \[2, 8\]"),
    (torch.randn(4, 8, dtype=torch.float64), "does not match the manifest"),
])
def test_outputs_of_the_wrong_shape_or_dtype_are_refused(core, wrong, match):
    p = prepared(core)
    delivery = answer(core, p, tensors.encode({"output_0": wrong}))
    with pytest.raises(ProtocolError, match=match):
        check(core, p, delivery)
    assert delivery.refused and isinstance(delivery.refused[0], Refuse)


def test_a_receipt_naming_another_worker_is_refused(core):
    """The answer came from one peer (the libp2p channel says which); a receipt naming another is not accepted."""
    p = prepared(core)
    delivery = answer(core, p, tensors.encode({"output_0": JOB.run_locally(X)}), claimed_by=Identity.generate().peer_id)
    with pytest.raises(InvalidReceipt, match="answer came from"):
        check(core, p, delivery)


def test_the_output_cap_follows_the_dry_run():
    est = JOB.estimate(X)
    assert est.outputs == (("F32", (4, 8)),) and est.output_bytes == 4 * 8 * 4


def test_countersignatures_that_do_not_get_through_are_owed_again_and_delivered(monkeypatch):
    """A batch of countersignatures sent while the worker's relay dies must not leave that work unpaid for good: it
    is owed again (riding on the next job there, or sent again after a pause) until a few tries have failed."""
    import gpunet.client.settlement as settlement_module
    from gpunet.errors import NetworkError

    class _Flaky:
        def __init__(self, failures: int):
            self.failures, self.delivered = failures, []

        async def settle(self, worker_id, items):
            if self.failures:
                self.failures -= 1
                raise NetworkError("worker did not answer (settle)")
            self.delivered += items

    async def rides_on_a_job():
        """Owed again after a failed batch, then carried by a job that got through: nothing of it is kept."""
        s = Settlement(_Flaky(1))
        s._owed["w"] = [("job-2", b"sig")]
        s.flush()
        await asyncio.gather(*s._sending)
        carried = s.take("w")
        s.delivered(carried)  # what transport.submit says once the job's answer came
        assert carried == [("job-2", b"sig")] and s._owed == {} and s._failed == {}
        s._timer.cancel()

    async def main(failures: int):
        transport = _Flaky(failures)
        s = Settlement(transport)
        s._owed["w"] = [("job-1", b"sig")]
        s.flush()
        await asyncio.gather(*s._sending)
        assert s._owed == {"w": [("job-1", b"sig")]}  # owed again: the next job to w takes it
        assert s.take("w") == [("job-1", b"sig")]
        s.give_back("w", [("job-1", b"sig")])  # that job failed too
        await s.close(timeout=5)
        await asyncio.sleep(1.0)  # the pauses between tries are over: any send left would have gone by now
        await asyncio.gather(*s._sending)
        return transport.delivered, failures - transport.failures

    monkeypatch.setattr(settlement_module, "RETRY_DELAY", 0.01)
    assert asyncio.run(main(2)) == ([("job-1", b"sig")], 2)  # the third send got through
    asyncio.run(rides_on_a_job())
    # A worker that never answers: given up after SETTLE_TRIES sends (the job stays unpaid), nothing loops.
    assert asyncio.run(main(100)) == ([], settlement_module.SETTLE_TRIES)


def test_a_paid_job_teaches_the_speed_its_worker_delivered(core):
    """Issue 38: what a worker delivered on paid jobs (counted FLOPs over the compute time the client measured) is
    what routing credits it, checked jobs setting it and unchecked ones only lowering it."""
    from dataclasses import replace

    from gpunet.client.jobs import CheckedDelivery
    from gpunet.client.settlement import Settlement as _Settlement

    class _Quiet(_Settlement):
        def countersign(self, delivery, signature):
            pass

    core.payment.settlement, core.payment.books = _Quiet(transport=None), []
    p = replace(prepared(core), flops=4 * 10**12)  # as if the job counted 4 TFLOP
    for checked, seconds in ((True, 2.0), (False, 8.0)):
        delivery = answer(core, p, tensors.encode({"output_0": JOB.run_locally(X)}))
        core.router.on_proof(delivery.worker_id, 50.0)
        c = CheckedDelivery(delivery, None, [delivery.worker_id], compute_seconds=seconds)
        asyncio.run(core.payment.pay(p, c, [], checked=checked))
        expected = core.router.delivered.get(delivery.worker_id) if checked else None
        assert expected == (2.0 if checked else None)  # 4 TFLOP in 2 s
        assert core.router._known_limit(delivery.worker_id) == (4.0 if checked else 1.0)  # SLACK x delivered


def test_a_client_paying_as_it_goes_holds_its_next_job_under_the_workers_credit_line():
    """Issue 38: a client whose countersignatures trailed its results was refused at a worker's credit line. What the
    worker may count against it (each job in flight, or the countersignatures riding on it if more; verdicts on their
    way) keeps its next job waiting instead, and what lands lets it go."""
    class _Held:
        def __init__(self):
            self.gate = asyncio.Event()

        async def settle(self, worker_id, items):
            await self.gate.wait()

    async def main():
        transport = _Held()
        s = Settlement(transport, credit_line=4)
        entered = []

        async def job(name: str, release: asyncio.Event, ride: int = 0, worker: str = "w"):
            async with s.paced(worker) as slot:
                entered.append(name)
                if ride:
                    s._owed["w"] = [(f"{name}-{i}", b"sig") for i in range(ride)]
                    assert len(s.take("w", slot)) == ride
                await release.wait()

        first, second = asyncio.Event(), asyncio.Event()
        a = asyncio.ensure_future(job("a", first, ride=2))  # counts 2: what rides on it, more than the job
        b = asyncio.ensure_future(job("b", second))
        s._owed["w"] = [("paid-1", b"sig")]
        s.flush()  # one countersignature on its way in a batch
        await asyncio.sleep(0)
        assert entered == ["a", "b"] and s.in_use("w") == 4
        c = asyncio.ensure_future(job("c", second))
        other = asyncio.ensure_future(job("x", second, worker="v"))  # another worker's line is its own
        await asyncio.wait_for(_until(lambda: "x" in entered), 5)
        assert "c" not in entered and s.in_use("w") == 4
        transport.gate.set()  # the batch lands: room for one job
        await asyncio.wait_for(_until(lambda: "c" in entered), 5)
        assert s.in_use("w") == 4
        first.set()
        second.set()
        await asyncio.gather(a, b, c, other)
        assert s.in_use("w") == 0 and s._slots == {} and s._transit == {}

    async def _until(condition):
        while not condition():
            await asyncio.sleep(0.01)

    asyncio.run(main())


def test_pay_first_lowers_the_pace_for_that_worker_and_jobs_ending_there_raise_it_again():
    """Clients behind one address share its line: "pay first" while this client itself is under its own line means
    others at its address hold the rest, so it holds more of its jobs back there (a quarter less, once per burst),
    and wins the room back one job per line's worth of jobs ended."""
    async def main():
        s = Settlement(transport=None, credit_line=8)
        held = []
        for _ in range(6):
            slot = s.paced("w")
            await slot.__aenter__()
            held.append(slot)
        await s.pay_up("w", timeout=0)
        assert s.line("w") == 5 and s.line("v") == 8  # 7 x 3/4: the job refused and the six in flight
        await s.pay_up("w", timeout=0)
        assert s.line("w") == 5  # the same burst: lowered once
        held.append(s.paced("w"))
        waiting = asyncio.ensure_future(held[-1].__aenter__())
        await asyncio.sleep(0.01)
        assert not waiting.done()  # 6 in flight, over the lowered line: held back here, not sent to be refused
        for slot in held[:2]:
            await slot.__aexit__(None, None, None)
        await asyncio.wait_for(waiting, 5)
        assert s.in_use("w") == 5 and s.line("w") == 5
        for slot in held[2:]:
            await slot.__aexit__(None, None, None)
        for _ in range(40):  # jobs ending there win the room back
            async with s.paced("w"):
                pass
        assert s.line("w") == 8 and "w" not in s._lines and s.in_use("w") == 0

    asyncio.run(main())


def test_a_countersignature_for_a_result_held_long_by_its_check_goes_by_batch_not_on_the_stale_stream():
    """A worker waits 30 s for the verdict on a result's stream, then at its settle door: a result held longer (its
    check ran long) used to be countersigned on the dead stream only, and the honest worker went unpaid. So did one
    whose stream broke as the verdict was written."""
    import time as _time
    from types import SimpleNamespace

    class _Batches:
        def __init__(self):
            self.delivered = []

        async def settle(self, worker_id, items):
            self.delivered += [(worker_id, job_id) for job_id, _ in items]

    async def main():
        transport = _Batches()
        s = Settlement(transport)
        written, closed = [], []

        async def finish(verdict):
            written.append(verdict.job_id)

        async def broken(verdict):
            raise ConnectionResetError("stream closed")

        receipt = SimpleNamespace(job_id="held")
        late = Delivery("w", b"", receipt, 0, 0.0, finish=finish, close=lambda: closed.append("held"),
                        arrived=_time.monotonic() - 25)
        fresh = Delivery("w", b"", SimpleNamespace(job_id="fresh"), 0, 0.0, finish=finish)
        cut = Delivery("w", b"", SimpleNamespace(job_id="cut"), 0, 0.0, finish=broken)
        for d in (late, fresh, cut):
            s.countersign(d, b"sig")
        await asyncio.gather(*s._sending)
        s.flush()
        await asyncio.gather(*s._sending)
        return written, closed, sorted(transport.delivered)

    written, closed, batched = asyncio.run(main())
    assert written == ["fresh"] and closed == ["held"]
    assert batched == [("w", "cut"), ("w", "held")]
