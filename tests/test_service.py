"""The worker without a network: admission (a pure state machine), settlement, and the service's cancel door."""

import asyncio
import socket
import time
from dataclasses import replace

import pytest

from gpunet import protocol
from gpunet.errors import (
    InvalidReceipt,
    JobFailed,
    JobRejected,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    WorkerBusy,
)
from gpunet.ledger import Identity, Ledger, Receipt, countersign, sign_as_worker
from gpunet.ledger.writer import LedgerWriter
from gpunet.protocol import Cancel, Countersign, Ok, Refuse, Submit
from gpunet.worker.state.admission import Admission, ServiceLimits
from gpunet.worker.executor import RunResult
from gpunet.worker.billing import Countersignatures
from gpunet.worker.doors import Doors
from gpunet.worker.jobs import Jobs
from gpunet.worker.payloads import UnaryPayloads

PROGRAM = "ab" * 32


def serve(**kw) -> Doors:
    """A worker's doors over its job path, with no network (the tests call the handlers and the path directly)."""
    from gpunet.worker.faults import Faults

    faults = {k: kw.pop(k) for k in ("corrupt_outputs", "corrupt_pieces", "corrupt_pushes", "drop_pushes") if k in kw}
    doors = Doors(Jobs(**kw, faults=Faults(**faults)))
    # PROGRAM (and the others) stand for programs their owner shared (anyone may name them): these tests are about
    # other things than who may run a program (tests/test_owners.py is).
    for program in (PROGRAM, "ee" * 32, "ff" * 32, "cc" * 32, "cd" * 32):
        doors.jobs.owners.add(program, "its-owner", shared=True)
    return doors
ALICE, BOB, CAROL = (Identity.generate().peer_id for _ in range(3))


def job(job_id: str = "job-1", **kw) -> Submit:
    return Submit(job_id, PROGRAM, 4, b"abcd", kw.pop("timeout", 60.0), kw.pop("max_price", None), **kw)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- admission: decisions and counts, no I/O --------------------------------------------------------------------


def test_admission_refuses_by_price_limits_and_job_id_reuse():
    a = Admission(price_nano=5 * 10**9, max_concurrent=1, max_queue=1, limits=ServiceLimits(max_timeout=60, max_input_bytes=3))
    with pytest.raises(JobRejected, match="price 5.00 credits/TFLOP is above the job.s bound 4.50"):
        a.screen(ALICE, job(max_price=4_500_000_000))
    with pytest.raises(ProtocolError, match="timeout"):
        a.screen(ALICE, job(timeout=61))
    with pytest.raises(JobRejected, match="inputs of 4 bytes exceed"):
        a.screen(ALICE, job())
    a.limits = ServiceLimits()
    a.screen(ALICE, job(max_price=5 * 10**9))


def test_admission_counts_places_and_answers_busy_when_full():
    a = Admission(price_nano=1, max_concurrent=1, max_queue=2)
    assert a.admit(ALICE) and a.admit(ALICE)
    assert not a.admit(ALICE)  # one client holds at most the running slots and half the queue
    assert a.admit(BOB)
    assert not a.admit(BOB) and not a.has_room(BOB)  # one running + two queued: full
    a.started()
    assert (a.running, a.queue_length, a.active) == (1, 2, 3)
    a.ended(done=True)
    a.released(ALICE)
    assert a.jobs_done == 1 and a.admit(BOB)


def test_uploads_take_no_queue_place_but_are_capped_per_client_and_per_address():
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0,
                  limits=ServiceLimits(max_uploads_per_client=2, max_uploads_per_host=3))
    assert a.begin_upload(ALICE, "/ip4/10.0.0.1") and a.begin_upload(ALICE, "/ip4/10.0.0.1")
    assert not a.begin_upload(ALICE, "/ip4/10.0.0.2")  # the same identity from anywhere
    assert a.begin_upload(BOB, "/ip4/10.0.0.1")
    assert not a.begin_upload("sybil", "/ip4/10.0.0.1")  # a fresh identity from the same address
    assert a.begin_upload("sybil", "/ip4/10.0.0.9")
    assert a.has_room(CAROL) and a.queue_length == 0  # nine idle uploads make nobody busy
    a.upload_done(ALICE, "/ip4/10.0.0.1")
    assert a.uploads(ALICE) == 1 and a.begin_upload("sybil2", "/ip4/10.0.0.1")


def test_payload_bytes_are_charged_before_reading_and_given_back():
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, limits=ServiceLimits(max_buffered_bytes=100))
    a.charge(40, ALICE, "/ip4/10.0.0.1")
    a.charge(40, BOB, "/ip4/10.0.0.2")
    with pytest.raises(WorkerBusy, match="receiving"):
        a.charge(21, CAROL, "/ip4/10.0.0.3")  # not now: the buffer is full
    with pytest.raises(JobRejected, match="one client may send"):
        a.charge(51, CAROL, "/ip4/10.0.0.3")  # never: over one client's share
    a.release_bytes(40, BOB, "/ip4/10.0.0.2")
    with pytest.raises(WorkerBusy, match="share"):
        a.charge(11, ALICE, "/ip4/10.0.0.1")  # Alice holds 40 of her 50 already
    with pytest.raises(WorkerBusy, match="share"):
        a.charge(11, "sybil", "/ip4/10.0.0.1")  # a fresh identity at her address: the same share
    a.charge(50, CAROL, "/ip4/10.0.0.3")
    assert a.buffered_bytes == 90


def test_draining_takes_nothing_new_and_resolves_when_the_last_job_is_paid():
    async def scenario():
        a = Admission(price_nano=1, max_concurrent=2, max_queue=0)
        a.stream_opened()  # as the service does: a job stream counts from its submit...
        assert a.admit(ALICE)
        drained = None
        a.drain()
        drained = a.drained()
        with pytest.raises(WorkerBusy, match="draining"):
            a.admit(ALICE)
        a.released(ALICE)  # ...so the job leaving admission, its result still to be written, is no gap to leave through
        await asyncio.sleep(0)
        assert not drained.done()
        a.stream_closed()  # result sent, countersignature read (or given up on)
        await asyncio.wait_for(drained, 1)
        assert a.drained().done()  # already drained: resolves at once

    asyncio.run(scenario())


def test_a_client_that_keeps_stopping_jobs_is_refused_until_its_stops_age_out():
    clock = Clock()
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, clock=clock,
                  limits=ServiceLimits(max_stopped_jobs=2, stopped_jobs_window=600))
    a.stopped_running(ALICE)
    clock.now += 300
    a.stopped_running(ALICE)
    with pytest.raises(JobRejected, match="running jobs here 2 times"):
        a.screen(ALICE, job())
    a.screen(BOB, job())  # others are unaffected
    clock.now += 301  # the first stop is now older than the window
    assert a.recent_stops(ALICE) == 1
    a.screen(ALICE, job())


def test_a_client_that_does_not_pay_is_refused_past_its_credit_line():
    """Outputs go out before their countersignature (a client compares replicas first), so a worker extends credit:
    results left unpaid past the grace count against their client, and at the limit its jobs are refused."""
    clock = Clock()
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, clock=clock,
                  limits=ServiceLimits(max_unpaid_jobs=3, countersign_grace=60, unpaid_window=3600))
    for i in range(3):
        a.delivered(ALICE, f"job-{i}", host="10.0.0.1")
    a.screen(ALICE, job())  # within the grace: its countersignatures may still be on their way
    clock.now += 61
    with pytest.raises(JobRejected, match="not paid for 3 results"):
        a.screen(ALICE, job())
    a.screen(BOB, job())  # others are unaffected
    a.paid(ALICE, "job-1")  # a late countersignature restores the credit
    a.screen(ALICE, job())
    a.delivered(ALICE, "job-3")
    clock.now += 61
    with pytest.raises(JobRejected, match="not paid"):
        a.screen(ALICE, job())
    clock.now += 3600  # an hour on, old debts are forgiven
    a.screen(ALICE, job())
    for n in range(12):  # fresh identities from one address: the address has a line too (x host_stops_factor)
        a.delivered(f"sybil-{n}", "job", host="10.0.0.9")
    clock.now += 61
    with pytest.raises(JobRejected, match="clients at this address"):
        a.screen("sybil-new", job(), host="10.0.0.9")


def test_an_address_has_one_credit_line_for_all_its_identities_counting_every_unpaid_result_at_once():
    """Issue 38: fresh identities from one address each took a client's whole line, since the address counted only
    results unpaid past the grace. Every result not yet countersigned counts against the address at once."""
    from gpunet.errors import PayFirst

    clock = Clock()
    limits = ServiceLimits(max_unpaid_jobs=2, host_credit_factor=3, countersign_grace=60, unpaid_window=3600)
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, clock=clock, limits=limits)
    assert a.credit_line == 8  # one client: 4 x 2 at once
    for n in range(3):  # three fresh identities, 8 results each, all within the grace: the address holds 24
        for i in range(8):
            a.screen(f"sybil-{n}", job(), host="/ip4/10.0.0.9")
            a.delivered(f"sybil-{n}", f"job-{i}", host="/ip4/10.0.0.9")
    with pytest.raises(PayFirst, match="clients at this address hold 24 results"):
        a.screen("sybil-new", job(), host="/ip4/10.0.0.9")
    with pytest.raises(PayFirst, match="this client holds 8 results"):  # its own line, a PayFirst too
        a.screen("sybil-0", job(), host="/ip4/10.0.0.7")
    a.screen("sybil-new", job(), host="/ip4/10.0.0.8")  # another address is unaffected
    a.paid("sybil-1", "job-0")  # one countersignature lands: room for one more result at the address
    a.screen("sybil-new", job(), host="/ip4/10.0.0.9")
    clock.now += 3601  # an hour on, debts are forgiven
    a.screen("sybil-new", job(), host="/ip4/10.0.0.9")
    assert a.owed_by_address("/ip4/10.0.0.9") == 0


def test_jobs_screened_at_once_count_against_the_line_before_their_results_go_out():
    """Screening happens before a job runs: jobs let through together (a client's whole queue share, or several
    identities at once) must not each find the line still open."""
    from gpunet.errors import PayFirst

    a = Admission(price_nano=1, max_concurrent=1, max_queue=0,
                  limits=ServiceLimits(max_unpaid_jobs=1, host_credit_factor=2))
    for i in range(4):
        a.screen(ALICE, job(), host="/ip4/10.0.0.9")
        a.coming(ALICE, f"job-{i}", host="/ip4/10.0.0.9")
    with pytest.raises(PayFirst, match="this client holds 4"):
        a.screen(ALICE, job(), host="/ip4/10.0.0.9")
    a.not_coming(ALICE, "job-0")  # it failed: nothing went out
    a.delivered(ALICE, "job-1", host="/ip4/10.0.0.9")  # owed now, counted once
    a.screen(ALICE, job(), host="/ip4/10.0.0.9")
    for i in range(5):
        a.coming(BOB, f"job-{i}", host="/ip4/10.0.0.9")
    with pytest.raises(PayFirst, match="clients at this address hold 8"):
        a.screen(CAROL, job(), host="/ip4/10.0.0.9")


def test_clients_behind_a_relay_share_the_relays_address_line():
    """A relay vouches for no client address, and relays are free identities too: relayed clients count against the
    relay's network address (an attacker's own relays on its own address add no line); an IPv6 address by its /64."""
    from gpunet.errors import PayFirst
    from gpunet.utils import host_of
    from gpunet.worker.state.admission import credit_address

    relay1 = host_of("/ip4/10.0.0.5/tcp/4001/p2p/QmRelayOne/p2p-circuit")
    relay2 = host_of("/ip4/10.0.0.5/udp/4001/quic-v1/p2p/QmRelayTwo/p2p-circuit")
    assert credit_address(relay1) == credit_address(relay2) == "/ip4/10.0.0.5"
    assert credit_address("/p2p/QmRelayOne/p2p-circuit") == "/p2p/QmRelayOne"  # no address known: the relay
    assert credit_address("/p2p-circuit") == "/p2p-circuit"  # nor the relay: still a line of its own
    assert credit_address(host_of("/ip6/2001:db8::1/tcp/1")) == credit_address(host_of("/ip6/2001:db8::ff/tcp/2"))
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0,
                  limits=ServiceLimits(max_unpaid_jobs=1, host_credit_factor=2))
    for n, via in enumerate((relay1, relay2, "/ip4/10.0.0.5", relay1, relay2, relay1, relay2, relay1)):
        a.delivered(f"sybil-{n}", "job", host=via)
    with pytest.raises(PayFirst, match="clients at this address hold 8"):
        a.screen("sybil-new", job(), host=relay2)
    a.screen("sybil-new", job(), host=host_of("/ip4/10.0.0.6/tcp/1/p2p/QmRelayThree/p2p-circuit"))


def test_a_countersignature_pays_off_the_credit_line_through_the_settlement(tmp_path):
    async def scenario(ledger):
        worker, client = Identity.generate(), Identity.generate()
        clock = Clock()
        a = Admission(price_nano=1, max_concurrent=1, max_queue=0, clock=clock,
                      limits=ServiceLimits(max_unpaid_jobs=1, countersign_grace=0))
        books = LedgerWriter(ledger, delay=3600)
        settlement = Countersignatures(books, on_paid=a.paid)
        receipt = _delivered(worker, client, "job-paid")
        a.delivered(client.peer_id, "job-paid")
        settlement.expect(client.peer_id, receipt)
        clock.now += 1
        with pytest.raises(JobRejected, match="not paid"):
            a.screen(client.peer_id, job())
        settlement.settle(client.peer_id, Countersign("job-paid", client.sign(receipt.signing_bytes())))
        a.screen(client.peer_id, job())
        books.close()

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        asyncio.run(scenario(ledger))


# --- settlement: receipts wait for their countersignature --------------------------------------------------------


def _delivered(worker: Identity, client: Identity, job_id: str):
    return sign_as_worker(worker, job_id=job_id, client_id=client.peer_id, program_hash=PROGRAM, input_hash="0" * 64,
                          output_hash="1" * 64, flops=10**9, wall_time_us=10, price=1, max_price=None,
                          started_at_us=1, ended_at_us=2)


def test_settlement_files_countersigned_receipts_and_refuses_forged_or_unknown_ones(tmp_path):
    worker, client = Identity.generate(), Identity.generate()

    async def scenario(ledger):
        books = LedgerWriter(ledger)
        s = Countersignatures(books, max_unsettled=8)  # one client: a quarter of it
        receipts = [_delivered(worker, client, f"job-{i}") for i in range(3)]
        for r in receipts:
            books.record_unpaid(r)
            s.expect(client.peer_id, r)
        assert len(s.unsettled) == 2  # bounded: its oldest went (it stays in the ledger's unpaid list)
        good = countersign(receipts[1], client, output_hash="1" * 64, max_price=None)
        s.ride_along(client.peer_id, (("job-1", good.client_signature),))
        with pytest.raises(InvalidReceipt):
            s.settle(client.peer_id, Countersign("job-2", b"\x00" * 64))
        with pytest.raises(JobRejected, match="no result of job job-0"):
            s.settle(client.peer_id, Countersign("job-0", good.client_signature))
        s.settle(client.peer_id, Refuse("job-2", "outvoted"))
        await asyncio.wait_for(s.all_settled(), 1)  # ...once the ride-along signature is checked and filed
        await s.close()
        return books

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        asyncio.run(scenario(ledger))
        assert [r.job_id for r in ledger.receipts()] == ["job-1"]
        assert {r.job_id for r in ledger.unpaid()} == {"job-0", "job-2"}


def test_a_batch_of_made_up_countersignatures_is_skipped_with_one_log_line(tmp_path, caplog):
    """From a review: each unknown item of a 1,024-item batch was a warning of its own (138 KiB of log per 7 KB
    request, from any peer)."""
    worker, client = Identity.generate(), Identity.generate()

    async def scenario(ledger):
        books = LedgerWriter(ledger)
        s = Countersignatures(books)
        receipt = _delivered(worker, client, "real")
        books.record_unpaid(receipt)
        s.expect(client.peer_id, receipt)
        good = countersign(receipt, client, output_hash="1" * 64, max_price=None)
        junk = tuple((str(i), b"") for i in range(1000))
        with caplog.at_level("WARNING", logger="gpunet.worker"):
            await s.batch(client.peer_id, (*junk, ("real", good.client_signature)))
        await s.close()

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        asyncio.run(scenario(ledger))
        assert [r.job_id for r in ledger.receipts()] == ["real"]  # the real one among them is filed
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpunet.worker"]
    assert line.startswith("Skipped 1000 bad countersignature(s)")


def test_a_countersignature_sent_again_after_it_was_filed_is_taken_quietly(tmp_path, caplog):
    """A client that did not hear its stream's word that a verdict was filed sends it again by the settle door; the
    worker may have filed it meanwhile, and its kept result may be gone: filed once, and no warning of bad ones."""
    worker, client = Identity.generate(), Identity.generate()

    async def scenario(ledger):
        books = LedgerWriter(ledger)
        s = Countersignatures(books)
        receipt = _delivered(worker, client, "job")
        books.record_unpaid(receipt)
        good = countersign(receipt, client, output_hash="1" * 64, max_price=None)
        s.settle(client.peer_id, Countersign("job", good.client_signature), receipt)  # on its stream
        books.flush()
        with caplog.at_level("WARNING", logger="gpunet.worker"):
            await s.batch(client.peer_id, (("job", good.client_signature),))  # and again, by the settle door
        await s.close()

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        asyncio.run(scenario(ledger))
        assert [r.job_id for r in ledger.receipts()] == ["job"] and not list(ledger.unpaid())
    assert not [r for r in caplog.records if r.name == "gpunet.worker"]


# --- the service's cancel door ----------------------------------------------------------------------------------


class _NoStops:
    """What the service asks of a pool about stopping runs: this fake's runs can only be cancelled."""

    def stop(self, tag) -> bool:
        return False

    def holds_sessions_of(self, tag) -> bool:
        return False

    def running_where(self, session_key: str) -> list:
        return []

    def expected_end(self, tag):
        return None  # its runs count no work

    def rows_key(self, session_key: str, program_hash: str):
        return None  # no program of its runs batches sessions' steps


class HangingExecutor(_NoStops):
    """Stands in for the executor pool: holds every program and never finishes a job (until cancelled)."""

    def has_program(self, program_hash: str) -> bool:
        return True

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        await asyncio.Event().wait()


@pytest.fixture
def service(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        admission = Admission(price_nano=1, max_concurrent=1, max_queue=4, limits=ServiceLimits(max_stopped_jobs=2))
        yield serve(identity=Identity.generate(), executor=HangingExecutor(), ledger=ledger, admission=admission,
                         record=lambda: None)


def submit(service, client: str, job_id: str) -> asyncio.Future:
    return asyncio.ensure_future(service.jobs.execute(client, job(job_id), UnaryPayloads(), None))


async def until(condition, what: str, deadline: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + deadline
    while not condition():
        assert asyncio.get_running_loop().time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def cancel_by_rpc(service, client: str, job_id: str) -> bool:
    reply = await service.cancel(protocol.encode(Cancel(job_id)), client)
    return protocol.decode(reply, Ok).cancelled


def test_cancel_rpc_stops_only_the_callers_own_job(service):
    async def scenario():
        job = submit(service, ALICE, "job-1")
        await until(lambda: service.admission.running == 1, "the job to run")
        assert not await cancel_by_rpc(service, BOB, "job-1")  # the id is Alice's: Bob cannot touch it
        assert await cancel_by_rpc(service, ALICE, "job-1")
        with pytest.raises(JobFailed, match="stopped before it finished"):
            await job
        assert service.admission.running == 0 and service.admission.admitted == 0 and not service.jobs._jobs
        assert not await cancel_by_rpc(service, ALICE, "job-1")

    asyncio.run(scenario())


def test_a_client_that_keeps_stopping_running_jobs_is_refused_for_a_while(service):
    async def scenario():
        for i in range(2):
            job = submit(service, ALICE, f"job-{i}")
            await until(lambda: service.admission.running == 1, "the job to run")
            assert await cancel_by_rpc(service, ALICE, f"job-{i}")
            with pytest.raises(JobFailed):
                await job
        with pytest.raises(JobRejected, match="running jobs here 2 times"):
            await submit(service, ALICE, "job-9")
        other = submit(service, BOB, "job-b")  # others are unaffected
        await until(lambda: service.admission.running == 1, "Bob's job to run")
        other.cancel()
        with pytest.raises((asyncio.CancelledError, JobFailed)):
            await other

    asyncio.run(scenario())


def test_a_queued_job_cancelled_before_it_runs_does_not_count(service):
    async def scenario():
        first = submit(service, ALICE, "job-run")
        await until(lambda: service.admission.running == 1, "the first job to run")
        for i in range(3):  # queued behind it (one slot): stopping these costs the worker nothing
            queued = submit(service, ALICE, f"job-q{i}")
            await until(lambda: service.admission.queue_length == 1, "the job to queue")
            assert await cancel_by_rpc(service, ALICE, f"job-q{i}")
            with pytest.raises(JobFailed):
                await queued
        assert service.admission.recent_stops(ALICE) == 0
        first.cancel()
        with pytest.raises((asyncio.CancelledError, JobFailed)):
            await first

    asyncio.run(scenario())


def test_limits_are_said_in_units_people_read():
    from gpunet.utils import human_bytes

    assert [human_bytes(n) for n in (12, 2048, 14_400_240_000_000)] == ["12 bytes", "2.0 KiB", "13.1 TiB"]
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, limits=ServiceLimits(max_input_bytes=2**30))
    with pytest.raises(JobRejected, match=r"inputs of 2.0 GiB exceed this worker's limit of 1.0 GiB"):
        a.screen(ALICE, Submit("j", PROGRAM, 2**31))


class QuickExecutor(HangingExecutor):
    """Finishes every job at once with the same small output."""

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        return RunResult(outputs=b"out", flops=10**9, wall_time=0.001, peak_memory_bytes=0)


def test_a_job_id_is_run_once_ever_not_again_once_its_result_is_forgotten(tmp_path):
    """A second receipt for one job id would read as fraud by this worker (and be work nobody pays for)."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=QuickExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4), record=lambda: None)

        async def scenario():
            first = await service.jobs.execute(ALICE, job("job-x"), UnaryPayloads(), None)
            assert await service.jobs.execute(ALICE, job("job-x"), UnaryPayloads(), None) is first  # a retry: same
            service.jobs.results.pop((ALICE, "job-x"))  # pushed out of the cache by later work
            with pytest.raises(JobRejected, match="already run here .* use a fresh job id"):
                await service.jobs.execute(ALICE, job("job-x"), UnaryPayloads(), None)
            bobs = await service.jobs.execute(BOB, job("job-x"), UnaryPayloads(), None)  # his own job, by his own id
            assert bobs.receipt.client_id == BOB
            service.billing.books.flush()

        asyncio.run(scenario())
        assert sorted((r.client_id, r.job_id) for r in ledger.unpaid()) == sorted([(ALICE, "job-x"), (BOB, "job-x")])


def test_another_clients_job_under_the_same_id_is_a_different_job_in_the_ledger(tmp_path):
    """Job ids are each client's own: a receipt two strangers sign under a real job's id is no conflict with it (in
    schema 1 it was, and turned the real receipt into disputed evidence)."""
    from tests._ledger_util import full_receipt

    worker, alice, mallory, sybil = (Identity.generate() for _ in range(4))
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        real = ledger.append(full_receipt(worker, alice, "job-1")).receipt
        ledger.append(full_receipt(sybil, mallory, "job-1"))  # planted under the same id
        assert ledger.conflicts() == [] and ledger.get("job-1", alice.peer_id) == real
        assert [r.client_id for r in ledger.find("job-1")] == [alice.peer_id, mallory.peer_id]


def test_the_same_job_id_in_flight_for_two_clients_is_two_jobs(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=HangingExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=2, max_queue=4), record=lambda: None)

        async def scenario():
            alice = submit(service, ALICE, "shared-id")
            await until(lambda: service.admission.running == 1, "Alice's job to run")
            bob = submit(service, BOB, "shared-id")  # not blocked by Alice's, nor joined to it
            await until(lambda: service.admission.running == 2, "Bob's job to run beside it")
            for task in (alice, bob):
                task.cancel()
                with pytest.raises((asyncio.CancelledError, JobFailed)):
                    await task

        asyncio.run(scenario())


class CrashingExecutor(HangingExecutor):
    """Every job kills its executor, as a kernel segfault would."""

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        from gpunet.errors import ExecutorDied

        raise ExecutorDied("executor process died while running the job (killed by signal SIGSEGV); it was replaced")


def test_a_client_whose_jobs_crash_executors_is_refused_after_a_few(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=CrashingExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4,
                                                 limits=ServiceLimits(max_stopped_jobs=20)), record=lambda: None)

        async def scenario():
            from gpunet.errors import JobFailed

            for i in range(4):  # each crash counts five times
                with pytest.raises(JobFailed, match="SIGSEGV"):
                    await service.jobs.execute(ALICE, job(f"crash-{i}"), UnaryPayloads(), None)
            with pytest.raises(JobRejected, match="crashed running jobs here 20 times"):
                await service.jobs.execute(ALICE, job("crash-5"), UnaryPayloads(), None)
            with pytest.raises(JobFailed, match="SIGSEGV"):  # another client is still served
                await service.jobs.execute(BOB, job("bob-1"), UnaryPayloads(), None)

        asyncio.run(scenario())


class SlowDryRunExecutor(HangingExecutor):
    """Programs whose dry runs take long: "ee..." is refused after 0.4 s, "ff..." fails after a 1.2 s dry run, "cc..."
    is cancelled by its client during its dry run, any other runs after 1.5 s of dry run."""

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, dry=None, **_):
        dry.cap = 5.0
        if program_hash.startswith("cc"):  # its dry run began a minute ago and had not ended: the cap counts
            dry.began = time.monotonic() - 60.0
            raise asyncio.CancelledError()
        dry.seconds = {"ee": 0.4, "ff": 1.2}.get(program_hash[:2], 1.5)
        if program_hash.startswith("ee"):
            raise JobRejected("dry run failed: over the limit")
        if program_hash.startswith("ff"):
            raise JobFailed("node 'x' raised")
        return RunResult(outputs=b"out", flops=10**9, wall_time=0.001, peak_memory_bytes=0)


def test_dry_runs_count_against_their_client_like_stopped_jobs(tmp_path):
    """The dry run is paid by no receipt: its CPU seconds count as stops, fractions carried over per client and per
    address, a billed job's first quarter second free, so neither short refusals nor fresh names are free."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=SlowDryRunExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4,
                                                 limits=ServiceLimits(max_stopped_jobs=10, host_stops_factor=2)),
                             record=lambda: None)
        run = lambda client, job_id, program=PROGRAM, host="/ip4/10.0.0.1": service.jobs.execute(
            client, replace(job(job_id), program=program), UnaryPayloads(), None, host)

        async def scenario():
            await run(ALICE, "slow-1")
            assert service.admission.recent_stops(ALICE) == 1  # 1.5 s, billed: 1.25 counted, 0.25 carried
            for i in range(2):
                with pytest.raises(JobRejected, match="over the limit"):
                    await run(ALICE, f"refused-{i}", "ee" * 32)
            assert service.admission.recent_stops(ALICE) == 2  # 0.25 + 0.8: one more, 0.05 carried
            with pytest.raises(JobFailed):  # its dry run passed, the job then failed: nothing billed
                await run(ALICE, "fails", "ff" * 32)
            assert service.admission.recent_stops(ALICE) == 3  # 1.25: one more, 0.25 carried
            with pytest.raises(JobFailed, match="went away"):  # hung up during a dry run: the cap (5 s) counts
                await run(ALICE, "gone", "cc" * 32)
            assert service.admission.recent_stops(ALICE) == 3 + 5 + 1  # and the stop itself
            await run(ALICE, "slow-2")
            with pytest.raises(JobRejected, match="crashed running jobs here 10 times"):
                await run(ALICE, "slow-9")
            for i in range(3):  # fresh names at the same address: the address carries its own fractions
                with pytest.raises(JobRejected, match="over the limit"):
                    await run(f"sybil-{i}", f"s-{i}", "ee" * 32)
            assert sum(service.admission.recent_stops(f"sybil-{i}") for i in range(3)) == 0
            await run(BOB, "bob-1", host="/ip4/10.0.0.2")  # another client elsewhere is still served

        asyncio.run(scenario())
        assert service.admission._recent(service.admission._host_stops, "/ip4/10.0.0.1") == 10 + 1  # + the sybils'


def test_crashes_from_fresh_identities_at_one_address_are_refused_too(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=CrashingExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4,
                                                 limits=ServiceLimits(max_stopped_jobs=5, host_stops_factor=2)),
                             record=lambda: None)

        async def scenario():
            from gpunet.errors import JobFailed

            for i in range(2):  # two sybils, one crash each: 2 x 5 = the address's allowance of 2 x 5
                with pytest.raises(JobFailed, match="SIGSEGV"):
                    await service.jobs.execute(f"sybil-{i}", job(f"crash-{i}"), UnaryPayloads(), None, "/ip4/10.6.6.6")
            with pytest.raises(JobRejected, match="clients at this address"):
                await service.jobs.execute("sybil-9", job("crash-9"), UnaryPayloads(), None, "/ip4/10.6.6.6")
            with pytest.raises(JobFailed, match="SIGSEGV"):  # elsewhere, still served
                await service.jobs.execute(BOB, job("bob-1"), UnaryPayloads(), None, "/ip4/10.0.0.2")

        asyncio.run(scenario())


class RememberingExecutor(_NoStops):
    """Holds a program once a job has brought its bytes (in memory: it has no disk cache here)."""

    def __init__(self):
        self.held, self.disk, self.private_runs = set(), set(), []

    def has_program(self, program_hash: str) -> bool:
        return program_hash in self.held

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        if program_bytes is None and program_hash not in self.held:
            raise ProgramNotCached(program_hash)
        self.held.add(program_hash)
        self.private_runs.append(private)
        return RunResult(outputs=b"out", flops=10**9, wall_time=0.001, peak_memory_bytes=0)


class _BringsProgram:
    """A client that sends the program's bytes with its job (as the stream door does when asked)."""

    def __init__(self, program: bytes):
        self.program = program

    def precheck(self, submit, need_program):
        pass

    async def fetch(self, submit, need_program, charge, sink=None):
        from gpunet.utils import sha256_hex
        from gpunet.worker.payloads import FROM_CLIENT, Inputs

        return Inputs(self.program if need_program else None, submit.inputs, sha256_hex(submit.inputs),
                      FROM_CLIENT if need_program else None)


def test_a_private_program_runs_only_for_clients_that_sent_its_bytes(tmp_path):
    """Cached programs were public: a stranger who learnt a hash ran a private model and recovered its weights."""
    from gpunet.worker.payloads import NeedsStream

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        executor = RememberingExecutor()
        service = serve(identity=Identity.generate(), executor=executor, ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4), record=lambda: None)

        import torch

        from gpunet import Job

        secret = Job.from_function(lambda x: x * 2 + 1, (torch.randn(4),))
        weights = secret.program_bytes()

        def sub(job_id, **kw):
            return Submit(job_id, secret.program_hash, 4, b"abcd", 60.0, None, **kw)

        async def scenario():
            await service.jobs.execute(ALICE, sub("a-1", private=True), _BringsProgram(weights), None)
            await service.jobs.execute(ALICE, sub("a-2", private=True), UnaryPayloads(), None)  # hers: held for her
            with pytest.raises(NeedsStream):  # anyone else must send the bytes: knowing the hash is not enough
                await service.jobs.execute(BOB, sub("b-1"), UnaryPayloads(), None)
            with pytest.raises(JobRejected, match="do not match"):  # and not just any bytes: the program's own
                await service.jobs.execute(BOB, sub("b-2"), _BringsProgram(b"\x84 anything at all"), None)
            await service.jobs.execute(BOB, sub("b-3"), _BringsProgram(weights), None)  # the weights are the capability
            await service.jobs.execute(BOB, sub("b-4"), UnaryPayloads(), None)
            service.billing.books.flush()

        asyncio.run(scenario())
        assert executor.private_runs == [True, True, True, True]  # never written to the disk cache


def test_a_client_paying_as_it_goes_is_not_refused_for_countersignatures_still_being_filed(tmp_path):
    """Seen in bench_network_jobs: 32 tiny jobs in flight through the unary door outran the batch that files the
    countersignatures riding on them, and the client was refused as owing 64 results it had paid for."""
    async def scenario(ledger):
        client = Identity.generate()
        service = serve(identity=Identity.generate(), executor=QuickExecutor(), ledger=ledger,
                        admission=Admission(price_nano=1, max_concurrent=1, max_queue=4,
                                            limits=ServiceLimits(max_unpaid_jobs=2)), record=lambda: None)
        answers = [await service.jobs.execute(client.peer_id, job(f"job-{i}"), UnaryPayloads(), None)
                   for i in range(8)]  # 8 = 4 x 2: the most a client may hold uncountersigned
        for answer in answers:
            service.billing.awaiting.expect(client.peer_id, answer.receipt)
        with pytest.raises(JobRejected, match="not yet countersigned"):
            await service.jobs.execute(client.peer_id, job("job-8"), UnaryPayloads(), None)
        paid = tuple((a.receipt.job_id, client.sign(a.receipt.signing_bytes())) for a in answers[:2])
        service.billing.awaiting.ride_along(client.peer_id, paid)  # as the run door takes them, before the job
        answers.append(await service.jobs.execute(client.peer_id, job("job-8"), UnaryPayloads(), None))
        answers.append(await service.jobs.execute(client.peer_id, job("job-9"), UnaryPayloads(), None))
        for answer in answers[-2:]:
            service.billing.awaiting.expect(client.peer_id, answer.receipt)
        # At the line again; two more paid, their batch already being checked in a thread when the next job comes.
        paid = tuple((a.receipt.job_id, client.sign(a.receipt.signing_bytes())) for a in answers[2:4])
        service.billing.awaiting.ride_along(client.peer_id, paid)
        service.billing.awaiting._check_soon()  # (what the 20 ms batch timer does)
        assert (await service.jobs.execute(client.peer_id, job("job-10"), UnaryPayloads(), None)).outputs == b"out"
        service.billing.books.flush()
        assert sorted(e.receipt.job_id for e in ledger.entries()) == ["job-0", "job-1", "job-2", "job-3"]

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        asyncio.run(scenario(ledger))


def test_the_credit_line_also_bounds_fresh_debts_and_the_unary_door_needs_a_paying_history():
    """From a review: a client could take any number of results inside the grace, and the unary door (which does not
    see the peer's address) let free identities each take their own allowance."""
    clock = Clock()
    a = Admission(price_nano=1, max_concurrent=1, max_queue=0, clock=clock,
                  limits=ServiceLimits(max_unpaid_jobs=2, countersign_grace=60, unpaid_window=3600))
    a.came_from(ALICE, "10.0.0.1")
    assert a.unary_host(ALICE) is None  # a newcomer uses the stream door, where its address counts
    for i in range(8):
        a.delivered(ALICE, f"job-{i}")
    with pytest.raises(JobRejected, match="not yet countersigned"):  # 8 = 4 x 2 outstanding, none overdue yet
        a.screen(ALICE, job())
    a.paid(ALICE, "job-0")
    a.screen(ALICE, job())
    assert a.unary_host(ALICE) == "10.0.0.1"  # ...and its unary jobs count against the address it came from
    a.paid(BOB, "job-0")
    assert a.unary_host(BOB) is None  # paid, but never seen on a stream: its address is not known
    for i in range(8, 20):
        a.delivered(ALICE, f"job-{i}")
    clock.now += 3601  # an hour on, debts are forgiven: the outstanding count too, not only the overdue one
    a.screen(ALICE, job())


def test_a_flood_of_programs_cannot_make_someone_elses_program_runnable_by_others(tmp_path, monkeypatch):
    """The table of who may run what is bounded; forgetting fails closed: a program whose entry a flood pushed out is
    runnable by nobody without its bytes (its owner included, who sends them again), never by everybody."""
    import torch

    from gpunet.worker.state import owners
    from gpunet import Job
    from gpunet.worker.payloads import NeedsStream

    monkeypatch.setattr(owners, "MAX_PROGRAMS", 3)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        executor = RememberingExecutor()
        service = serve(identity=Identity.generate(), executor=executor, ledger=ledger,
                        admission=Admission(price_nano=1, max_concurrent=1, max_queue=8), record=lambda: None)
        programs = [Job.from_function(lambda x, k=k: x * k, (torch.randn(4),)) for k in range(5)]

        def sub(program, job_id, **kw):
            return Submit(job_id, program.program_hash, 4, b"abcd", 60.0, None, **kw)

        async def scenario():
            secret = programs[0]
            await service.jobs.execute(ALICE, sub(secret, "a-1", private=True), _BringsProgram(secret.program_bytes()),
                                       None)
            for k, p in enumerate(programs[1:], 1):  # more programs than the table keeps: the secret's entry goes
                await service.jobs.execute(BOB, sub(p, f"b-{k}"), _BringsProgram(p.program_bytes()), None)
            assert len(service.jobs.owners) == 3
            with pytest.raises(NeedsStream):  # still held by an executor, and still not Bob's to run
                await service.jobs.execute(BOB, sub(secret, "b-5"), UnaryPayloads(), None)
            with pytest.raises(NeedsStream):  # nor, now, Alice's without its bytes: she sends them again
                await service.jobs.execute(ALICE, sub(secret, "a-2", private=True), UnaryPayloads(), None)
            await service.jobs.execute(ALICE, sub(secret, "a-3", private=True), _BringsProgram(secret.program_bytes()),
                                       None)
            await service.jobs.execute(ALICE, sub(secret, "a-4", private=True), UnaryPayloads(), None)
            service.billing.books.flush()

        asyncio.run(scenario())


class GatedExecutor(HangingExecutor):
    """Finishes each job once the test opens the gate; counts the runs it was asked for."""

    def __init__(self):
        self.gate, self.runs = asyncio.Event(), 0

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        self.runs += 1
        await self.gate.wait()
        return RunResult(outputs=b"out", flops=10**9, wall_time=0.001, peak_memory_bytes=0, state_bytes=4)

    def holds_session(self, key: str) -> bool:
        return True


class HungUp:
    """A stream whose client has gone: reading it ends at once."""

    async def read(self, n: int) -> bytes:
        return b""


def test_a_session_step_whose_client_hangs_up_runs_to_its_end_and_a_retry_gets_its_answer(tmp_path):
    """A stream can break on the way without the client leaving; the step it carried is not cut short (which would
    cost the span a move and a replay elsewhere): the client's retry of it gets the answer it missed. A plain job
    whose client hangs up is stopped, as before."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        executor = GatedExecutor()
        service = serve(identity=Identity.generate(), executor=executor, ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=2, max_queue=4), record=lambda: None)

        async def scenario():
            step = job("s1.0", session=protocol.SessionStep("s1", 0))
            first = asyncio.ensure_future(service.jobs.execute(ALICE, step, UnaryPayloads(), HungUp()))
            plain = asyncio.ensure_future(service.jobs.execute(ALICE, job("plain"), UnaryPayloads(), HungUp()))
            with pytest.raises(JobFailed, match="went away"):
                await plain
            await until(lambda: executor.runs == 2, "both to have reached the executor")
            assert not first.done()  # the hang-up did not stop the step
            retry = asyncio.ensure_future(service.jobs.execute(ALICE, step, UnaryPayloads(), None))
            executor.gate.set()
            answer = await first
            assert await retry is answer and executor.runs == 2  # joined, not run twice
            assert await service.jobs.execute(ALICE, step, UnaryPayloads(), None) is answer  # and kept after
            assert service.jobs.sessions.sessions.running(ALICE, "s1") is False

            # The unary door: the daemon cancels the handler of a call whose caller has gone. The step goes on.
            executor.gate.clear()
            step = job("s1.1", session=protocol.SessionStep("s1", 1))
            call = asyncio.ensure_future(service.jobs.execute(ALICE, step, UnaryPayloads(), None))
            await until(lambda: executor.runs == 3, "the step to reach the executor")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            retry = asyncio.ensure_future(service.jobs.execute(ALICE, step, UnaryPayloads(), None))
            executor.gate.set()
            assert (await retry).outputs == b"out" and executor.runs == 3
            assert service.jobs.sessions.sessions.running(ALICE, "s1") is False

        asyncio.run(scenario())


class SpanExecutor(GatedExecutor):
    """A span's step: answers one tensor (what a span returns besides its state); keeps the inputs it ran on."""

    def __init__(self):
        super().__init__()
        self.gate.set()
        self.inputs: list[bytes] = []

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        import torch

        from gpunet.job import tensors

        self.inputs.append(bytes(inputs))
        return RunResult(outputs=tensors.encode({"output_0": torch.full((1, 1, 4), float(len(self.inputs)))}),
                         flops=10**9, wall_time=0.001, peak_memory_bytes=0, state_bytes=4)

    async def drop_sessions(self, keys) -> None:
        pass


class PushesHeard:
    """Stands in for the worker's RPC: the pushes it sends."""

    def __init__(self):
        self.sent: list[tuple[str, protocol.Push]] = []

    async def call(self, peer_id, door, message, *expect):
        self.sent.append((peer_id, message))
        return Ok()


def test_a_pushed_step_runs_on_the_input_its_named_worker_pushed_and_passes_its_own_output_on(tmp_path):
    """The input of a pushed step comes from the worker the client named, for a session open here, and nobody else;
    the answer says the hash of that input; the output goes on to the next span's worker as its input; a step whose
    push does not come stops waiting when its client cancels it."""
    from dataclasses import replace

    from gpunet.utils import sha256_hex
    from gpunet.worker.handoff import as_next_input

    before, after = Identity.generate().peer_id, Identity.generate().peer_id
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        executor = SpanExecutor()
        service = serve(identity=Identity.generate(), executor=executor, ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=2, max_queue=4), record=lambda: None)
        service.jobs.handoff.rpc = rpc = PushesHeard()

        def pushed(step: int) -> Submit:
            return Submit(f"s.{step}p", PROGRAM, 0, b"", session=protocol.SessionStep(
                "s", step, input_from=before, push_to=protocol.PushTo(after, "t", step)))

        async def push(sender: str, client: str, session: str, step: int, data: bytes | None):
            reply = await service.push(protocol.encode(protocol.Push(client, session, step, data)), sender)
            return protocol.decode(reply, Ok, protocol.Error)

        async def scenario():
            await service.jobs.execute(ALICE, job("s.0", session=protocol.SessionStep("s", 0)), UnaryPayloads(), None)
            with pytest.raises(SessionLost):  # nobody waits here for a push to a session not held here
                await service.jobs.execute(BOB, pushed(1), UnaryPayloads(), None)
            other = replace(pushed(1), program="cd" * 32)  # nor for a program it lacks (it must come with its input)
            executor.has_program = lambda program_hash: program_hash == PROGRAM
            with pytest.raises(ProgramNotCached):
                await service.jobs.execute(ALICE, other, UnaryPayloads(), None)
            with pytest.raises(ProgramNotCached):  # the stream door too, and no upload is left counted
                await service.jobs.execute(ALICE, other, _BringsProgram(b"x"), None)
            assert service.admission.uploads(ALICE) == 0
            # Nobody can park bytes for a session not held here (another client's, a guessed one, a closed one).
            refused = await push(before, BOB, "s", 1, b"x")
            assert isinstance(refused, protocol.Error) and refused.code == "session_lost"
            # A stranger's push for Alice's open session is held apart: the step takes only its named worker's.
            assert isinstance(await push(CAROL, ALICE, "s", 1, b"forged"), Ok)
            assert isinstance(await push(before, ALICE, "s", 1, b"right"), Ok)
            outcome = await service.jobs.execute(ALICE, pushed(1), UnaryPayloads(), None)
            assert executor.inputs[-1] == b"right" and outcome.input_hash == sha256_hex(b"right")
            await until(lambda: rpc.sent, "the output to be pushed on")
            # (Bob's step, for a session not held here, made this worker push nothing anywhere.)
            assert rpc.sent == [(after, protocol.Push(ALICE, "t", 1, as_next_input(outcome.outputs)))]

            # Refused as busy once its input is here (its client asks again): the input waits for the retry.
            assert isinstance(await push(before, ALICE, "s", 2, b"again"), Ok)
            admit, service.admission.admit = service.admission.admit, lambda *args, **kwargs: False
            with pytest.raises(WorkerBusy):
                await service.jobs.execute(ALICE, pushed(2), UnaryPayloads(), None)
            service.admission.admit = admit
            # The next span's worker was not told "it will not come" (nor is about to be).
            assert len(rpc.sent) == 1 and not service.jobs.handoff._pushing
            assert (await service.jobs.execute(ALICE, pushed(2), UnaryPayloads(), None)).input_hash == sha256_hex(b"again")

            # The step can come first; its push then goes straight to it.
            step = asyncio.ensure_future(service.jobs.execute(ALICE, pushed(3), UnaryPayloads(), None))
            await until(lambda: service.jobs.handoff.pushes._waiting, "the step to wait for its push")
            assert isinstance(await push(before, ALICE, "s", 3, b"later"), Ok)
            assert (await step).input_hash == sha256_hex(b"later")

            # A push that will not come (the worker before failed): the step is refused at once, untouched, and
            # the next span's worker hears the same from this one.
            assert isinstance(await push(before, ALICE, "s", 4, None), Ok)
            with pytest.raises(JobRejected, match="did not come"):
                await service.jobs.execute(ALICE, pushed(4), UnaryPayloads(), None)
            await until(lambda: len(rpc.sent) == 4, "the refusal to be passed on")
            assert rpc.sent[-1] == (after, protocol.Push(ALICE, "t", 4, None))
            # The client gave up on it (its cancel): the step stops waiting, and the same step sent with its input
            # runs.
            step = asyncio.ensure_future(service.jobs.execute(ALICE, pushed(4), UnaryPayloads(), None))
            await until(lambda: service.jobs.handoff.pushes._waiting, "the step to wait for its push")
            assert await cancel_by_rpc(service, ALICE, "s.4p")
            with pytest.raises(JobRejected, match="did not come"):
                await step
            await service.jobs.execute(ALICE, job("s.4", session=protocol.SessionStep("s", 4)), UnaryPayloads(), None)
            assert executor.inputs[-1] == b"abcd" and len(executor.inputs) == 5

        asyncio.run(scenario())


def test_a_client_that_closes_saying_it_received_nothing_is_not_billed_but_is_counted_as_not_paying(tmp_path):
    """``CloseSession.received`` lets an honest client not pay for an answer lost on the way. Steps it disclaims
    ran all the same: they are noted as unbilled work, and count against the client (16 such closes an hour by
    default), so "I received nothing" cannot get an open tab's work free again and again."""
    clock = Clock()
    limits = ServiceLimits(max_unpaid_jobs=2, countersign_grace=60, unpaid_window=3600)
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=SpanExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=2, max_queue=4, clock=clock,
                                                 limits=limits), record=lambda: None)

        async def session_closed_unpaid(sid: str, steps: int, received: int):
            for step in range(steps):
                await service.jobs.execute(ALICE, job(f"{sid}.{step}", session=protocol.SessionStep(sid, step)),
                                       UnaryPayloads(), None)
            reply = await service.cancel(protocol.encode(protocol.CloseSession(sid, received)), ALICE)
            return protocol.decode(reply, protocol.SessionClosed)

        async def scenario():
            closed = await session_closed_unpaid("s1", 5, received=0)
            assert closed.closed and closed.receipt is None  # nothing billed...
            service.billing.books.flush()
            (note,) = [u for u in ledger.unbilled() if u.job_id.startswith("s1.")]
            assert note.reason == "disclaimed" and note.flops == 5 * 10**9  # ...but the work is on the books
            closed = await session_closed_unpaid("s2", 4, received=3)
            assert closed.receipt is not None  # the three it received are billed as usual
            assert service.admission.overdue(ALICE) == 0  # not as unpaid receipts (that would shut the unary door)
            with pytest.raises(JobRejected, match="did not receive steps that ran"):  # two disclaims: the limit
                await service.jobs.execute(ALICE, job("s3.0", session=protocol.SessionStep("s3", 0)), UnaryPayloads(),
                                       None)
            await service.jobs.execute(BOB, job("b.0", session=protocol.SessionStep("b", 0)), UnaryPayloads(), None)
            clock.now += 3601  # an hour on, forgiven
            await service.jobs.execute(ALICE, job("s3.0", session=protocol.SessionStep("s3", 0)), UnaryPayloads(), None)

        asyncio.run(scenario())


def test_one_clients_pushes_to_a_peer_that_never_answers_do_not_take_every_other_clients_place(tmp_path):
    """A client names the peer its step's output is pushed to; one that never answers holds each push for its
    timeout. From a review: 64 such pushes from one client left none for anyone else's session."""
    from gpunet.worker.handoff import MAX_PUSHING_PER_SESSION

    sink, after = Identity.generate().peer_id, Identity.generate().peer_id

    class Rpc:
        def __init__(self):
            self.calls: list[str] = []

        async def call(self, peer_id, door, message, *expect):
            self.calls.append(peer_id)
            if peer_id == sink:
                await asyncio.Event().wait()
            return Ok()

    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        service = serve(identity=Identity.generate(), executor=SpanExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=2, max_queue=4), record=lambda: None)
        service.jobs.handoff.rpc = rpc = Rpc()

        async def step(client: str, session: str, n: int, to: str):
            await service.jobs.execute(client, job(f"{session}.{n}", session=protocol.SessionStep(
                session, n, push_to=protocol.PushTo(to, "t", n))), UnaryPayloads(), None)

        per_client = MAX_PUSHING_PER_SESSION * service.jobs.sessions.sessions.limits.max_per_client

        async def scenario():
            for n in range(per_client + 4):
                await step(ALICE, "s", n, sink)
            await until(lambda: len(rpc.calls) == per_client, "Alice's pushes to be under way")
            await step(BOB, "b", 0, after)
            await until(lambda: rpc.calls[-1] == after, "Bob's push to go out")
            assert rpc.calls.count(sink) == per_client  # the rest of Alice's were never sent
            held = list(service.jobs.handoff._pushing)
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            assert not service.jobs.handoff._pushes_of  # each ended push gave its place back

        asyncio.run(scenario())


# --- results: kept for retries, held while written ---------------------------------------------------------------


class SizedExecutor(HangingExecutor):
    """Each job's output is as many bytes as its timeout says (a test's way to pick sizes)."""

    async def run(self, program_hash, program_bytes, inputs, timeout=None, private=False, **_):
        return RunResult(outputs=bytes(int(timeout)), flops=10**9, wall_time=0.001, peak_memory_bytes=0)


def test_one_clients_big_results_do_not_push_every_other_clients_kept_results_out(tmp_path):
    """A result over the kept bytes used to stay, alone: one big answer emptied the cache, and honest retries of
    finished jobs were told to use a fresh job id. A client's results are kept up to its share, its own go first."""
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        limits = ServiceLimits(recent_results_bytes=1000, max_timeout=10**6)  # one client: 500 bytes
        service = serve(identity=Identity.generate(), executor=SizedExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4, limits=limits),
                             record=lambda: None)

        async def scenario():
            run = lambda client, job_id, size: service.jobs.execute(client, job(job_id, timeout=size), UnaryPayloads(),
                                                                 None)
            bobs = await run(BOB, "bob-1", 300)
            alices = [await run(ALICE, f"alice-{i}", 200) for i in range(2)]
            await run(ALICE, "alice-huge", 5000)  # over everything: not kept, nothing pushed out for it
            await run(ALICE, "alice-2", 200)  # over her share: her oldest goes
            assert await run(BOB, "bob-1", 300) is bobs  # Bob's retry is answered from his kept result
            assert await run(ALICE, "alice-1", 200) is alices[1]
            for gone in ("alice-0", "alice-huge"):
                with pytest.raises(JobRejected, match="no longer kept"):
                    await run(ALICE, gone, 200)

        asyncio.run(scenario())


def test_a_result_its_client_does_not_read_counts_against_its_share_and_its_receipt_still_settles(tmp_path):
    """While a result is written it is held in this process: against its client's share of the payload buffer (a
    client that does not read has its next payloads refused, not the worker's memory filled). A client that hangs up
    may still countersign it later, whatever the kept results have done since."""
    size = 8 << 20
    client = Identity.generate()
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        limits = ServiceLimits(max_buffered_bytes=2 * size, recent_results_bytes=1, max_timeout=10**9)
        service = serve(identity=Identity.generate(), executor=SizedExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4, limits=limits),
                             record=lambda: None)

        async def scenario():
            ours, theirs = socket.socketpair()
            reader, writer = await asyncio.open_connection(sock=ours)
            their_reader, their_writer = await asyncio.open_connection(sock=theirs)
            await protocol.write(their_writer, job("big", timeout=size))
            serving = asyncio.ensure_future(service.job(client.peer_id, reader, writer, "/ip4/10.0.0.1"))
            await until(lambda: service.admission.buffered_bytes == size, "the result to be held while written")
            with pytest.raises(WorkerBusy, match="share"):
                service.admission.charge(1024, client.peer_id)
            service.admission.charge(1024, BOB)  # another client's payload still fits
            service.admission.release_bytes(1024, BOB)
            result = await protocol.read(their_reader, protocol.Result)  # the header, then it stops reading
            their_writer.close()  # hangs up mid-result
            await asyncio.wait_for(serving, 30)
            assert service.admission.buffered_bytes == 0
            assert (client.peer_id, "big") not in service.jobs.results  # not kept (over the kept bytes)
            return result

        result = asyncio.run(scenario())
        receipt = Receipt.from_bytes(result.receipt)
        service.billing.awaiting.settle(client.peer_id, Countersign("big", client.sign(receipt.signing_bytes())))
        service.billing.books.flush()
        assert ledger.get("big", client.peer_id) is not None


def test_retries_of_a_result_being_written_hold_its_bytes_once_and_a_client_at_its_share_is_busy(tmp_path):
    size = 8 << 20
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        limits = ServiceLimits(max_buffered_bytes=4 * size, recent_results_bytes=4 * size, max_timeout=10**9)
        service = serve(identity=Identity.generate(), executor=SizedExecutor(), ledger=ledger,
                             admission=Admission(price_nano=1, max_concurrent=1, max_queue=4, limits=limits),
                             record=lambda: None)

        async def stream(job_id: str):
            ours, theirs = socket.socketpair()
            reader, writer = await asyncio.open_connection(sock=ours)
            their_reader, their_writer = await asyncio.open_connection(sock=theirs)
            await protocol.write(their_writer, job(job_id, timeout=size))
            serving = asyncio.ensure_future(service.job(ALICE, reader, writer, "/ip4/10.0.0.1"))
            await protocol.read(their_reader, protocol.Result)  # the header, then it stops reading
            return serving, their_writer

        async def scenario():
            streams = [await stream("big") for _ in range(3)]  # the first, then two retries of its job id
            assert service.admission.buffered_bytes == size  # one result in memory, held once
            other = await stream("other")  # another unread result: now the client holds its share (2 x size)
            with pytest.raises(WorkerBusy, match="results it has not read"):
                await service.jobs.execute(ALICE, job("next", timeout=1), UnaryPayloads(), None, "/ip4/10.0.0.1")
            await service.jobs.execute(BOB, job("bobs", timeout=1), UnaryPayloads(), None, "/ip4/10.0.0.2")
            for serving, their_writer in [*streams, other]:
                their_writer.close()
            await asyncio.wait_for(asyncio.gather(*(serving for serving, _ in [*streams, other])), 30)
            assert service.admission.buffered_bytes == 0 and not service._writing
            await service.jobs.execute(ALICE, job("next", timeout=1), UnaryPayloads(), None, "/ip4/10.0.0.1")

        asyncio.run(scenario())
