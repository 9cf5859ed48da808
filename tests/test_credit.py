"""A worker's credit line against a real local network (issue 38): fresh identities from one address share one line,
and an honest client at full speed paces itself under it instead of being refused.

The pacing test maps 1,000 tiny jobs by default; ``pytest --full`` runs the 10,000 the issue names."""

import asyncio
import csv
import io
import json
import logging
import uuid

import pytest
import torch

import gpunet
from gpunet.dht.records import WorkerState
from tests.swarm import run_cli, wait_for

pytestmark = pytest.mark.swarm


async def _discover(transport):
    for _ in range(300):
        found = [e for e in await transport.discover() if e.record.state is not WorkerState.OFFLINE]
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError("no worker discovered")


def _filed(worker, n: int, timeout: float) -> tuple[list[dict], list]:
    """The worker's ledger once it holds ``n`` countersigned receipts (its export), with its unpaid list then."""

    def filed():
        exported = run_cli("ledger", "export", "--data-dir", str(worker.data_dir))
        unpaid = run_cli("ledger", "unpaid", "--json", "--data-dir", str(worker.data_dir))
        if exported.returncode or unpaid.returncode:
            return None
        rows = list(csv.DictReader(io.StringIO(exported.stdout)))
        return (rows, json.loads(unpaid.stdout)) if len(rows) >= n else None

    return wait_for(filed, timeout, "the worker to file every countersignature")


def test_fresh_identities_from_one_address_get_no_more_free_answers_than_the_address_line(swarm, tmp_path):
    """The attack: identities are free, so a client that never countersigns came back as new ones from the same
    address, each taking free answers of its own (the address counted only results unpaid past the two-minute grace:
    after the first identity's 64, three new ones got 20 of 20 each, 124 answers, none paid). Every unpaid result
    counts against the address at once now: one identity from 127.0.0.1 takes its line, then three fresh ones try
    theirs at once; all together get at most the address's line (1.5 x 64 = 96; on main each took 64, 256 in all),
    and the fresh ones are refused saying the address is at its line."""
    from gpunet.client.transport import JobRequest, P2PTransport
    from gpunet.errors import JobRejected, WorkerBusy
    from gpunet.identity import Identity
    from gpunet.worker.state.admission import OUTSTANDING_FACTOR, ServiceLimits

    proc = swarm.start_worker()
    job = gpunet.Job.from_module(torch.nn.Linear(4, 4).eval(), example_inputs=(torch.randn(1, 4),))
    line = OUTSTANDING_FACTOR * ServiceLimits().max_unpaid_jobs  # one identity's: 64
    address_line = line * 3 // 2  # ServiceLimits.host_credit_factor (checked below)

    async def freeload(n: int) -> tuple[int, str]:
        """Results taken (the stream closed on each without a verdict) until a refusal, and its reason."""
        identity = Identity.load_or_create(tmp_path / f"sybil-{n}")
        transport = await P2PTransport.connect(swarm.network, [swarm.bootstrap_addr], identity)
        served = 0
        try:
            worker = await _discover(transport)
            while served <= line:
                request = JobRequest(uuid.uuid4().hex, job.program_hash, job.program_bytes(),
                                     job.encode_inputs(torch.randn(1, 4)), 30.0, None)
                try:
                    delivery = await transport.run_stream(worker.id, list(worker.record.maddrs), request)
                except WorkerBusy:  # the identities share one worker's queue: ask again
                    await asyncio.sleep(0.05)
                    continue
                except JobRejected as e:
                    return served, e.reason
                delivery.close()  # the outputs are in hand; no countersignature, no refusal
                served += 1
            return served, ""
        finally:
            await transport.close()

    async def attack():
        first = await freeload(0)
        return [first, *await asyncio.gather(*(freeload(n) for n in range(1, 4)))]

    results = asyncio.run(attack())
    total = sum(served for served, _ in results)
    print(f"free answers to 127.0.0.1: {[served for served, _ in results]}")
    assert total <= address_line, f"{total} free answers to one address (its line: {address_line}): {results}"
    assert results[0] == (line, results[0][1]) and "not yet countersigned" in results[0][1], results
    assert all("clients at this address" in reason for _, reason in results[1:]), results
    assert int(ServiceLimits().host_credit_factor * line) == address_line
    # The debt is on the worker's books, every answer of it.
    def listed():
        shown = run_cli("ledger", "unpaid", "--json", "--data-dir", str(proc.data_dir))
        return json.loads(shown.stdout) if shown.returncode == 0 and len(json.loads(shown.stdout)) >= total else None

    unpaid = wait_for(listed, 60, "the worker's books to show the unpaid work")
    assert len(unpaid) == total


@pytest.fixture
def jobs_to_map(full) -> int:
    return 10_000 if full else 1_000


def test_a_countersignature_lost_with_its_stream_goes_again_by_the_settle_door(swarm, tmp_path, monkeypatch):
    """CI saw it once in 1,000 jobs at full speed: a countersignature the client wrote on its job's stream was lost
    with the stream (the p2p daemon resets one now and then under a burst of streams, and a client's daemon stops a
    moment after the client leaves), the client took it as delivered, and the worker recorded that job as unpaid for
    good. Here every verdict written on a stream is lost so: the worker still files every countersignature, since
    the client counts one as delivered only once the worker says it filed it, and sends it by the settle door
    otherwise. (On the previous main: all 3 unpaid.)"""
    from gpunet import protocol
    from gpunet.protocol import Countersign

    worker = swarm.start_worker()
    job = gpunet.Job.from_function(lambda x: x.repeat(20_000), (torch.randn(16),))  # 1.3 MB out: it comes by stream
    x = torch.randn(16)
    real_write, lost = protocol.write, []

    async def lossy_write(writer, message):
        if isinstance(message, Countersign):
            lost.append(message.job_id)
            writer.transport.abort()  # gone with its stream
            return
        await real_write(writer, message)

    monkeypatch.setattr(protocol, "write", lossy_write)
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network, data_dir=tmp_path / "c") as client:
        wait_for(lambda: client.workers(refresh=True), 30, "the client to see the worker")
        for _ in range(3):
            assert torch.equal(client.submit(job, x).result(timeout=60), x.repeat(20_000))
    assert len(lost) == 3  # each was written on its stream, and lost there

    rows, unpaid = _filed(worker, 3, timeout=30)
    assert unpaid == [] and sorted(row["job_id"] for row in rows) == sorted(lost)


def test_a_client_at_full_speed_paces_itself_under_the_credit_line_and_pays_for_everything(swarm, tmp_path,
                                                                                           jobs_to_map, caplog):
    """bench_network_jobs failed on an idle machine: an honest client whose countersignatures trailed its results at
    ~600 jobs/s was refused at the worker's credit line ("holds 68 results not yet countersigned"), and its job failed.
    Tiny jobs, 64 in flight to one worker (room for all of them there): none fails, and the worker holds every
    receipt countersigned."""
    worker = swarm.start_worker("--max-concurrent", "2", "--max-queue", "128")
    job = gpunet.Job.from_function(lambda x: x * 2 + 1, (torch.randn(16),))
    x = torch.randn(16)
    caplog.set_level(logging.DEBUG, logger="gpunet.client")
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=tmp_path / "honest") as client:
        wait_for(lambda: client.workers(refresh=True), 30, "the client to see the worker")
        pending, failures, done = [], [], 0

        def collect(future):
            nonlocal done
            try:
                result = future.result(timeout=120)
                assert torch.equal(result, x * 2 + 1)
                done += 1
            except gpunet.GpunetError as e:
                failures.append(e)

        for _ in range(jobs_to_map):
            pending.append(client.submit(job, x))
            if len(pending) >= 64:
                collect(pending.pop(0))
        for future in pending:
            collect(future)
        assert not failures, f"{len(failures)} of {jobs_to_map} jobs failed; first: {failures[0]!r}"
        assert done == jobs_to_map
        client_id = client.id
    told = sum("at its credit line; paying up" in r.getMessage() for r in caplog.records)
    print(f"'pay first' heard {told} times in {jobs_to_map} jobs at 64 in flight")
    # The client has left, having delivered every countersignature it owed: the worker holds none unpaid.

    rows, unpaid = _filed(worker, jobs_to_map, timeout=60)
    assert unpaid == [] and len(rows) == jobs_to_map, (len(rows), unpaid[:3])
    assert {row["client_id"] for row in rows} == {client_id}


def test_honest_clients_sharing_an_address_at_full_speed_share_its_line_without_failures(swarm, tmp_path, caplog):
    """An office behind one NAT: two honest clients from 127.0.0.1, 64 jobs in flight each to one worker, together
    more than the address's line (96). Told "pay first", each holds its jobs back (its pace for that worker lowered,
    then won back) and asks again there: no job fails, and every receipt is countersigned."""
    worker = swarm.start_worker("--max-concurrent", "2", "--max-queue", "256")
    job = gpunet.Job.from_function(lambda x: x * 2 + 1, (torch.randn(16),))
    x = torch.randn(16)
    per_client = 400
    caplog.set_level(logging.DEBUG, logger="gpunet.client")
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network, data_dir=tmp_path / "a") as a, \
            gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network, data_dir=tmp_path / "b") as b:
        for c in (a, b):
            wait_for(lambda c=c: c.workers(refresh=True), 30, "the clients to see the worker")
        pending, failures = [], []
        for _ in range(per_client):
            for c in (a, b):
                pending.append(c.submit(job, x))
            while len(pending) >= 128:
                try:
                    pending.pop(0).result(timeout=120)
                except gpunet.GpunetError as e:
                    failures.append(e)
        for future in pending:
            try:
                future.result(timeout=120)
            except gpunet.GpunetError as e:
                failures.append(e)
        assert not failures, f"{len(failures)} of {2 * per_client} jobs failed; first: {failures[0]!r}"
    # (How often a worker said "pay first" depends on how far the worker lags the clients; each time it did, the
    # client paid up and asked again.)
    told = sum("at its credit line; paying up" in r.getMessage() for r in caplog.records)
    print(f"'pay first' heard {told} times by two clients at 64 in flight each")

    rows, unpaid = _filed(worker, 2 * per_client, timeout=60)
    assert unpaid == [] and len(rows) == 2 * per_client
