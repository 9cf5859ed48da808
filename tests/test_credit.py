"""A worker's credit line against a real local network (issue 38): fresh identities from one address share one line,
and an honest client at full speed paces itself under it instead of being refused.

The pacing test maps 1,000 tiny jobs by default; ``pytest --full`` runs the 10,000 the issue names."""

import asyncio
import csv
import io
import json
import uuid

import pytest
import torch

import gpunet
from tests.swarm import run_cli, wait_for

pytestmark = pytest.mark.swarm


async def _discover(transport):
    for _ in range(300):
        found = await transport.discover()
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise AssertionError("no worker discovered")


def test_fresh_identities_from_one_address_get_no_more_free_answers_than_the_address_line(swarm, tmp_path):
    """The attack: identities are free, so a client that never countersigns came back as new ones from the same
    address, each taking a whole client's line of free answers (the address counted only results unpaid past the
    two-minute grace: 20 of 20 each for three identities, 124 answers, none paid). Every unpaid result counts against
    the address at once now: five identities from 127.0.0.1 together get at most the address's line (4 x 64; on main
    each took 64, 320 in all), and the identity that finds the address at its line is refused saying so."""
    from gpunet.client.transport import JobRequest, P2PTransport
    from gpunet.errors import JobRejected, WorkerBusy
    from gpunet.identity import Identity
    from gpunet.worker.state.admission import OUTSTANDING_FACTOR, ServiceLimits

    proc = swarm.start_worker()
    job = gpunet.Job.from_module(torch.nn.Linear(4, 4).eval(), example_inputs=(torch.randn(1, 4),))
    line = OUTSTANDING_FACTOR * ServiceLimits().max_unpaid_jobs  # one identity's: 64
    address_line = 4 * line  # ServiceLimits.host_credit_factor (checked below)
    identities = address_line // line + 1

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
        return await asyncio.gather(*(freeload(n) for n in range(identities)))

    results = asyncio.run(attack())
    total = sum(served for served, _ in results)
    assert total <= address_line, f"{total} free answers to one address (its line: {address_line}): {results}"
    assert all(reason for _, reason in results), results  # every identity was cut off, none ran out of jobs to try
    assert any("clients at this address" in reason for _, reason in results), results
    assert ServiceLimits().host_credit_factor * line == address_line
    # The debt is on the worker's books, every answer of it.
    unpaid = wait_for(lambda: (lambda r: json.loads(r.stdout) if r.returncode == 0 and len(json.loads(r.stdout)) >= total
                               else None)(run_cli("ledger", "unpaid", "--json", "--data-dir", str(proc.data_dir))),
                      60, "the worker's books to show the unpaid work")
    assert len(unpaid) == total


@pytest.fixture
def jobs_to_map(request) -> int:
    return 10_000 if request.config.getoption("--full") else 1_000


def test_a_client_at_full_speed_paces_itself_under_the_credit_line_and_pays_for_everything(swarm, tmp_path,
                                                                                           jobs_to_map):
    """bench_network_jobs failed on an idle machine: an honest client whose countersignatures trailed its results at
    ~600 jobs/s was refused at the worker's credit line ("holds 68 results not yet countersigned"), and its job failed.
    Tiny jobs, 64 in flight to one worker (room for all of them there): none fails, and the worker holds every
    receipt countersigned."""
    worker = swarm.start_worker("--max-concurrent", "2", "--max-queue", "128")
    job = gpunet.Job.from_function(lambda x: x * 2 + 1, (torch.randn(16),))
    x = torch.randn(16)
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
    # The client has left, having delivered every countersignature it owed: the worker holds none unpaid.

    def countersigned():
        exported = run_cli("ledger", "export", "--data-dir", str(worker.data_dir))
        unpaid = run_cli("ledger", "unpaid", "--json", "--data-dir", str(worker.data_dir))
        if exported.returncode or unpaid.returncode:
            return None
        rows = list(csv.DictReader(io.StringIO(exported.stdout)))
        return (rows, json.loads(unpaid.stdout)) if len(rows) >= jobs_to_map else None

    rows, unpaid = wait_for(countersigned, 60, "the worker to file every countersignature")
    assert unpaid == [] and len(rows) == jobs_to_map, (len(rows), unpaid[:3])
    assert {row["client_id"] for row in rows} == {client_id}
