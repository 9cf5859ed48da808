"""The client's retry, ban, busy, resend and verification logic over an in-process fake transport: no go-libp2p,
no sockets, milliseconds a test. (The same paths over the real network are in test_jobs_swarm.py and test_trust.py.)

The fake (gpunet.testing.transport) runs each job for real (the job's own validator and interpreter, on this CPU) and
signs a real receipt with each fake worker's own key, so the client's checks, countersignatures and ledger see what
they would see from a network; only the bytes never leave the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

import gpunet
from gpunet.client import local, view
from gpunet.client.core import ClientCore
from gpunet.dht.records import WorkerState
from gpunet.errors import (
    DeadlineUnreachable,
    JobFailed,
    JobRaised,
    JobRejected,
    JobTimeout,
    NoWorkersAvailable,
    ProtocolError,
)
from gpunet.ledger import Identity, price_to_nano, sign_as_worker
from gpunet.protocol import Countersign, Refuse
from gpunet.testing.transport import FakeTransport, FakeWorker

JOB = gpunet.Job.from_function(lambda x: torch.tanh(x) * 2, (torch.randn(4, 8),))
X = torch.randn(4, 8)


def run(tmp_path, workers, scenario, with_transport=False):
    """Start a ClientCore over a FakeTransport of ``workers``, run ``scenario(core)``, close it; return the result."""
    data_dir = tmp_path / "client"
    transport = FakeTransport(Identity.load_or_create(data_dir).peer_id, *workers)

    async def main():
        core = ClientCore(network="gpunet-test", data_dir=data_dir, transport=transport)
        await core.start()
        try:
            return await scenario(core)
        finally:
            await core.close()

    result = asyncio.run(main())
    assert transport.closed
    return (result, transport) if with_transport else result


def test_a_failing_worker_is_banned_and_the_job_retried_elsewhere(tmp_path):
    bad, good = FakeWorker("bad", "vanish", tflops=100.0), FakeWorker("good")  # routing tries the fast one first

    async def scenario(core):
        result = await core.run(JOB, [X])
        assert core.router.bans[bad.id].strikes == 1 and core.router.bans[bad.id].until > 0
        return result

    result, transport = run(tmp_path, [bad, good], scenario, with_transport=True)
    assert torch.allclose(result.outputs, JOB.run_locally(X))
    assert result.worker_id == good.id and result.attempts == [bad.id, good.id]
    assert result.receipt.client_signature and result.receipt.worker_id == good.id
    assert transport.forgotten == [bad.id]  # no other worker is sent to it for a program meanwhile


EMBED = gpunet.Job.from_module(torch.nn.Embedding(10, 4), example_inputs=(torch.tensor([[1, 2]]),))
OUT_OF_RANGE = torch.tensor([[1, 50]])


def test_a_job_that_raises_is_its_own_error_once_the_client_sees_it_raise_too(tmp_path):
    """An index out of range raises on any worker: a job small enough is run here to see (no second worker needed),
    the caller gets JobRaised (not NoWorkersAvailable after every worker tried it), and no worker is banned."""
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]

    async def scenario(core):
        with pytest.raises(JobRaised, match=r"index out of range .*this client's own run raised the same"):
            await core.run(EMBED, [OUT_OF_RANGE])
        assert not core.router.bans and all(core.reputation.workers.get(w.id) is None
                                            or core.reputation.workers[w.id].failures == 0 for w in workers)
        return await core.run(EMBED, [torch.tensor([[3, 4]])])  # the next job goes as fast as ever

    result = run(tmp_path, workers, scenario)
    assert sorted(len(w.jobs) for w in workers) in ([0, 0, 2], [0, 1, 1])
    assert torch.equal(result.outputs, EMBED.run_locally(torch.tensor([[3, 4]])))


def test_a_redundant_job_that_raises_bans_no_worker(tmp_path):
    """Replicas start together: each worker's "it raised" waits on the same run here (once), not a checker's strike."""
    workers = [FakeWorker(name) for name in "abcd"]

    async def scenario(core):
        with pytest.raises(JobRaised, match="this client's own run raised the same"):
            await core.run(EMBED, [OUT_OF_RANGE], gpunet.Requirements(redundancy=2))
        assert not core.router.bans

    run(tmp_path, workers, scenario)


def test_a_job_too_big_to_run_here_raises_once_a_second_worker_drawn_at_random_says_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "LOCAL_CONFIRM_FLOPS", 0)
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]

    async def scenario(core):
        with pytest.raises(JobRaised, match=r"index out of range .*worker \S+ raised the same"):
            await core.run(EMBED, [OUT_OF_RANGE])
        assert not core.router.bans

    run(tmp_path, workers, scenario)
    assert sorted(len(w.jobs) for w in workers) == [0, 1, 1]


def test_a_worker_that_says_the_job_raised_is_struck_once_the_job_runs(tmp_path):
    liar, good = FakeWorker("liar", "raise", tflops=100.0), FakeWorker("good")  # routing tries the liar first

    async def scenario(core):
        result = await core.run(JOB, [X])  # small: this client ran it, and it did not raise
        assert core.router.bans[liar.id].strikes == 1 and core.reputation.workers[liar.id].failures == 1
        return result

    result = run(tmp_path, [liar, good], scenario)
    assert result.worker_id == good.id and result.attempts == [liar.id, good.id]


def test_a_checker_that_says_the_job_raised_is_a_failure_not_the_jobs_error(tmp_path):
    """The result it was to check exists: its word cannot end the job (nor unpay the worker that ran it)."""
    good, checker = FakeWorker("good", tflops=100.0), FakeWorker("checker", "raise")

    async def scenario(core):
        result = await core.run(JOB, [X], gpunet.Requirements(verify="adaptive"))
        assert core.router.bans[checker.id].strikes == 1
        return result

    result = run(tmp_path, [good, checker], scenario)
    assert result.worker_id == good.id and result.checked  # this client checked it itself
    assert torch.allclose(result.outputs, JOB.run_locally(X))


def test_a_job_that_raises_on_the_only_worker_and_is_too_big_to_run_here_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "LOCAL_CONFIRM_FLOPS", 0)
    alone = FakeWorker("alone")

    async def scenario(core):
        with pytest.raises(JobRaised, match="no other worker could run it to confirm, nor this client") as raised:
            await core.run(EMBED, [OUT_OF_RANGE])
        assert raised.value.attempts == [alone.id]  # JobFuture.attempts, for a job that failed

    run(tmp_path, [alone], scenario)


def test_a_worker_missing_from_a_look_stays_while_its_record_holds_and_goes_once_it_lapses_or_said_it_left(tmp_path):
    """A look at the records can miss live workers (a bucket's search lost under load: CI saw one of three, and a
    session's span then had nowhere to move): one missing stays routable while its record holds. One whose record
    lapsed, or whose tombstone the look found, is gone: no longer routed to, nor named as a holder."""
    stays, missed, left, lapses = (FakeWorker(name) for name in ("stays", "missed", "left", "lapses"))

    async def scenario(core):
        transport = core.transport
        assert set(core.router.workers) == {stays.id, missed.id, left.id, lapses.id}
        del transport.workers[missed.id]  # this look misses it
        left.entry = dataclasses.replace(left.entry, record=left.entry.record.model_copy(
            update={"state": WorkerState.OFFLINE}))  # its tombstone
        del transport.workers[lapses.id]
        core.router.update([e if e.id != lapses.id else dataclasses.replace(e, expiration_time=0.0)
                            for e in core.router.workers.values()])  # its record's time ran out
        await core.refresh()
        assert set(core.router.workers) == {stays.id, missed.id}
        assert sorted(transport.forgotten) == sorted([left.id, lapses.id])
        # A session's span there: one that lapsed may be back in a moment (LAPSE_GRACE); one that said it left is not
        assert core.router.holding(lapses.id) is not None and core.router.holding(left.id) is None
        transport.workers.clear()  # a look that finds nobody says little: nobody is forgotten for it
        await core.refresh()
        assert set(core.router.workers) == {stays.id, missed.id}
        core.router.update([dataclasses.replace(e, expiration_time=0.0) for e in core.router.workers.values()])
        await core.refresh()  # ...until their records lapse
        assert not core.router.workers
        assert sorted(transport.forgotten) == sorted([left.id, lapses.id, stays.id, missed.id])

    run(tmp_path, [stays, missed, left, lapses], scenario)


def test_the_worker_list_is_refreshed_less_often_when_listing_it_takes_long():
    """A big network takes seconds to list (every record's signature checked): refreshed every 2 s regardless, a
    client that only waits would keep a core busy. Small networks stay at the configured period; a listing slowed
    by a peer that does not answer puts off the next one by half a minute at most."""
    assert view.refresh_pause(2.0, 0.05) == 2.0
    assert view.refresh_pause(2.0, 2.5) == 25.0
    assert view.refresh_pause(2.0, 28.0) == view.MAX_REFRESH_PAUSE
    assert view.refresh_pause(90.0, 28.0) == 90.0  # never sooner than the configured period


def test_a_job_waits_for_workers_whose_records_all_lapsed_while_they_restart(tmp_path):
    """Churn can empty the network for a moment (every worker restarting, their records lapsed together): a job that
    already tried workers looks again for a while instead of failing with NoWorkersAvailable at once."""
    w, other = FakeWorker("restarting", "vanish", tflops=100.0), FakeWorker("other")  # routing tries w first

    async def scenario(core):
        transport = core.transport
        gone = asyncio.Event()
        listed = transport.discover

        async def discover():
            return [] if gone.is_set() else await listed()

        real_submit = transport.submit

        async def submit(worker, request, **kw):
            if not w.jobs:  # its first job: it dies, and every record lapses before the client looks again
                gone.set()
                core.router.update([])
                asyncio.get_running_loop().call_later(1.5, gone.clear)  # the records are back
            return await real_submit(worker, request, **kw)

        transport.discover, transport.submit = discover, submit
        return await core.run(JOB, [X])

    result = run(tmp_path, [w, other], scenario)
    assert result.worker_id == other.id and result.attempts == [w.id, other.id]


def test_a_session_placing_a_span_while_every_record_lapsed_waits_for_the_next_look(tmp_path):
    """Heartbeats late under load can let every record lapse together: placing a session's span then waits for the
    refresher's next look that finds workers (as for the first ones), not NoWorkersAvailable at once."""
    w = FakeWorker("late")

    async def scenario(core):
        transport, listed = core.transport, core.transport.discover
        gone = asyncio.Event()

        async def discover():
            return [] if gone.is_set() else await listed()

        transport.discover = discover
        gone.set()
        core.router.update([dataclasses.replace(w.entry, expiration_time=0.0)])  # every record lapsed
        await core.refresh()
        assert not core.router.workers
        asyncio.get_running_loop().call_later(1.0, gone.clear)  # the heartbeats arrive
        return await core.place(JOB, [X])

    assert run(tmp_path, [w], scenario).id == w.id


def test_a_busy_worker_is_skipped_for_a_moment_not_banned(tmp_path):
    busy = FakeWorker("busy", "busy", tflops=100.0)

    async def scenario(core):
        result = await core.run(JOB, [X])
        assert busy.id not in core.router.bans or core.router.bans[busy.id].strikes == 0
        return result

    result = run(tmp_path, [busy], scenario)
    assert result.worker_id == busy.id and busy.jobs == [result.receipt.job_id] * 2  # asked again after the pause


def test_a_lost_program_is_resent_to_the_same_worker_without_a_ban(tmp_path):
    w = FakeWorker("forgetful", "lost")

    async def scenario(core):
        core.router.known_programs[w.id] = {JOB.program_hash}
        result = await core.run(JOB, [X])
        assert not core.router.bans.get(w.id)
        return result

    result = run(tmp_path, [w], scenario)
    assert result.worker_id == w.id and result.bytes_sent > len(JOB.program_bytes())  # sent the program again


def test_refusals_stop_after_max_rejections_and_say_why(tmp_path):
    workers = [FakeWorker(f"r{i}", "reject") for i in range(4)]

    async def scenario(core):
        with pytest.raises(JobRejected, match="3 workers refused .* limit is lower"):
            await core.run(JOB, [X])

    run(tmp_path, workers, scenario)
    assert sum(len(w.jobs) for w in workers) == 3


def test_a_job_that_runs_out_of_time_says_whom_it_tried(tmp_path):
    slow = FakeWorker("slow", "hang")

    async def scenario(core):
        with pytest.raises(JobTimeout, match="did not finish within 0.3 s; tried"):
            await core.run(JOB, [X], gpunet.Requirements(timeout=0.3))

    run(tmp_path, [slow], scenario)


def test_redundancy_outvotes_a_liar_who_is_then_not_paid(tmp_path):
    liar, a, b = FakeWorker("liar", "lie", tflops=100.0), FakeWorker("a"), FakeWorker("b")

    async def scenario(core):
        result = await core.run(JOB, [X], gpunet.Requirements(redundancy=3))
        await core.flush_ledger()
        paid = {r.worker_id for r in core.ledger.receipts()}
        assert core.reputation.avoided(liar.id) or core.reputation.score(liar.id) < core.reputation.score(a.id)
        return result, paid

    result, paid = run(tmp_path, [liar, a, b], scenario)
    assert torch.allclose(result.outputs, JOB.run_locally(X))
    assert liar.id not in paid and paid == {a.id, b.id}
    assert [type(v) for v in liar.verdicts] == [Refuse]


def _computed_here(run_locally):
    """JOB as this client computes it (``run_locally``: how); the workers' copies run the program's bytes, as ever."""
    job = gpunet.Job.from_bytes(JOB.program_bytes())
    job.run_locally = run_locally
    return job


def _slowly(*inputs):  # a job that takes this client a while (0.4 s) to compute itself
    time.sleep(0.4)
    return JOB.run_locally(*inputs)


def test_colluders_who_answer_just_before_the_timeout_leave_the_check_its_own_time(tmp_path):
    """Stall then lie: two strangers agree on a lie, answering 0.1 s before the job's 1 s timeout, and this client
    takes 0.4 s to compute the job itself. That check used to get what the liars left of the job's time: their
    answer came back (marked unchecked) and they were paid. It has time of its own now."""
    liars = [FakeWorker(f"liar-{i}", "stall", price=0.5) for i in range(2)]
    honest = FakeWorker("honest")

    async def scenario(core):
        result = await core.run(_computed_here(_slowly), [X], gpunet.Requirements(redundancy=3, timeout=1.0))
        await core.flush_ledger()
        return result, {r.worker_id for r in core.ledger.receipts()}, core.reputation

    result, paid, reputation = run(tmp_path, [*liars, honest], scenario)
    assert torch.allclose(result.outputs, JOB.run_locally(X)) and result.checked and result.worker_id == honest.id
    assert paid == {honest.id}
    assert all(reputation.avoided(w.id) for w in liars)  # the client's own run proved them wrong
    assert all([type(v) for v in w.verdicts] == [Refuse] for w in liars)


def test_a_worker_that_holds_its_answer_through_the_check_holds_up_only_its_own_ask(tmp_path):
    """The client's own run proved the first answer wrong; the further workers are asked two at a time, so one that
    never answers (a colluder stalling through the check's time) cannot use up that time before an honest one is
    asked."""
    liar, hung, honest = FakeWorker("liar", "lie", price=0.5, tflops=100.0), FakeWorker("hung", "hang"), \
        FakeWorker("honest")

    async def scenario(core):
        return await core.run(JOB, [X], gpunet.Requirements(verify="local-sample", prefer="cheapest", timeout=0.5))

    result = run(tmp_path, [liar, hung, honest], scenario)
    assert result.worker_id == honest.id and result.checked and torch.allclose(result.outputs, JOB.run_locally(X))
    assert [type(v) for v in liar.verdicts] == [Refuse]


def _cannot(*inputs):
    raise JobFailed("this machine lacks what the job needs")


def test_a_redundant_vote_nothing_settles_is_not_returned_and_pays_nobody(tmp_path):
    """Two strangers agree (on a lie) and this client cannot compute the job itself: that vote used to be returned
    marked unchecked, and both were paid. A redundant request fails closed: VerificationFailed, both refused."""
    liars = [FakeWorker(f"liar-{i}", "lie") for i in range(2)]

    async def scenario(core):
        with pytest.raises(gpunet.VerificationFailed, match="could not compute the job itself .* nobody is paid"):
            await core.run(_computed_here(_cannot), [X], gpunet.Requirements(redundancy=2))
        await core.flush_ledger()
        assert list(core.ledger.receipts()) == []
        assert not any(core.reputation.avoided(w.id) for w in liars)  # nothing proved them wrong

    run(tmp_path, liars, scenario)
    assert all([type(v) for v in w.verdicts] == [Refuse] for w in liars)


def test_a_copy_out_of_time_leaves_the_results_in_hand_to_the_check(tmp_path):
    """A replica that never answers used to fail the whole job (JobTimeout) and leave the other worker unpaid; the
    result in hand is checked (here: by this client's own run) and paid."""
    honest, hung = FakeWorker("honest"), FakeWorker("hung", "hang")

    async def scenario(core):
        return await core.run(JOB, [X], gpunet.Requirements(redundancy=2, timeout=0.5))

    result = run(tmp_path, [honest, hung], scenario)
    assert result.worker_id == honest.id and result.checked and [type(v) for v in honest.verdicts] == [Countersign]


def test_unary_countersignatures_are_delivered_before_the_client_closes(tmp_path):
    w = FakeWorker("w")

    async def scenario(core):
        core.router.known_programs[w.id] = {JOB.program_hash}  # it holds the program: the one-round-trip door
        return [await core.run(JOB, [X]) for _ in range(3)]

    results, transport = run(tmp_path, [w], scenario, with_transport=True)
    assert all(r.receipt.client_signature for r in results)
    assert w.verdicts == []  # nothing went back on a stream: each rode along or went in a batch, none lost at close
    assert sorted(transport.settled[w.id]) == sorted(r.receipt.job_id for r in results)


def test_wrong_arguments_say_what_to_pass_and_numpy_arrays_are_taken_as_they_are(tmp_path):

    from gpunet.errors import UsageError

    model = torch.nn.Linear(8, 8)

    async def scenario(core):
        with pytest.raises(UsageError, match="not a Linear .* gpunet.Job.from_module"):
            await core.run(model, [X])
        with pytest.raises(UsageError, match="input 0 is a list; pass each input as a torch.Tensor"):
            await core.run(JOB, [X.tolist()])
        for wrong in ([X, X], []):  # at the call, like a wrong name, not as a worker's refusal later
            with pytest.raises(UsageError, match=rf"the job takes 1 input\(s\) \(args_0\), got {len(wrong)}"):
                await core.run(JOB, wrong)
        assert JOB.estimate(args_0=X) == JOB.estimate(X)  # by name, as run_locally and submit take them
        return await core.run(JOB, [X.numpy()])

    result = run(tmp_path, [FakeWorker("w")], scenario)
    assert torch.allclose(result.outputs, JOB.run_locally(X))
    assert torch.allclose(gpunet.Job.from_module(model, torch.randn(4, 8)).run_locally(X), model(X).detach())  # 1 tensor


def test_too_few_workers_for_the_redundancy_asked_is_said_before_any_copy_is_sent(tmp_path):
    """The copies used to run, then the job failed: work no one would pay for ("never countersigned")."""
    a, b = FakeWorker("a"), FakeWorker("b")

    async def scenario(core):
        with pytest.raises(gpunet.NoWorkersAvailable) as e:
            await core.run(JOB, [X], gpunet.Requirements(redundancy=3))
        assert "redundancy=3 needs 3 distinct workers, but only 2 of the 2 known workers" in str(e.value)

    run(tmp_path, [a, b], scenario)
    assert a.jobs == [] and b.jobs == []


def test_an_unavailable_worker_is_not_treated_as_a_liar_but_a_wrong_answer_is(tmp_path):
    flaky, wrong, good = FakeWorker("flaky", *["vanish"] * 3), FakeWorker("wrong", "garble"), FakeWorker("good")

    async def scenario(core):
        for _ in range(3):  # each job: maybe flaky (it vanishes), maybe wrong, then the good one
            core.router.bans.clear()
            await core.run(JOB, [X])
        return core.reputation

    rep = run(tmp_path, [flaky, wrong, good], scenario)
    assert rep.workers[flaky.id].failures > 0.9 and not rep.avoided(flaky.id)  # unavailable: ranked lower, not shunned
    assert rep.score(flaky.id) < rep.score(good.id)
    assert rep.workers[wrong.id].invalid > 0.9 and rep.avoided(wrong.id)  # a hash that does not match: shunned


def test_a_preempted_batch_job_runs_again_elsewhere_is_paid_once_and_costs_its_worker_nothing(tmp_path):
    cheap, other = FakeWorker("cheap", "preempt", price=0.5), FakeWorker("other", price=0.8)

    async def scenario(core):
        result = await core.run(JOB, [X], gpunet.Requirements(priority="batch", prefer="cheapest"))
        assert cheap.id not in core.router.bans  # not held against it, nor kept from other jobs
        return result

    result = run(tmp_path, [cheap, other], scenario)
    assert result.attempts == [cheap.id, other.id] and result.worker_id == other.id
    assert result.receipt.lane == "batch" and result.receipt.is_countersigned
    assert len(cheap.jobs) == 1 and cheap.jobs == other.jobs  # the same job id, run once to the end


def test_a_preempted_batch_job_with_nowhere_else_to_go_waits_its_turn_on_the_same_worker(tmp_path):
    only = FakeWorker("only", "preempt", "preempt")

    async def scenario(core):
        return await core.run(JOB, [X], gpunet.Requirements(priority="batch"))

    result = run(tmp_path, [only], scenario)
    assert result.attempts == [only.id] * 3 and result.receipt.lane == "batch"


def test_workers_refusing_a_job_for_its_deadline_end_in_deadline_unreachable(tmp_path):
    import time

    workers = [FakeWorker(f"w{i}", "late") for i in range(3)]

    async def scenario(core):
        with pytest.raises(DeadlineUnreachable, match="deadline"):
            await core.run(JOB, [X], gpunet.Requirements(deadline=time.time() + 60))
        with pytest.raises(DeadlineUnreachable, match="passed"):
            await core.run(JOB, [X], gpunet.Requirements(deadline=time.time() - 1))

    run(tmp_path, workers, scenario)
    assert all(len(w.jobs) == 1 for w in workers)


def test_a_stream_broken_on_the_way_is_tried_a_few_more_times_on_the_same_worker(tmp_path):
    from gpunet.client.attempts import REDIALS

    thrice = FakeWorker("thrice", *["break"] * REDIALS)
    always = FakeWorker("always", *["break"] * (REDIALS + 1))

    async def scenario(core):
        return await core.run(JOB, [X])

    result = run(tmp_path / "a", [thrice], scenario)
    assert result.attempts == [thrice.id] * (REDIALS + 1) and len(thrice.jobs) == REDIALS + 1  # one job id, answered once
    with pytest.raises(NoWorkersAvailable, match="peer closed the stream"):
        run(tmp_path / "b", [always], scenario)


class Accumulate(torch.nn.Module):
    """A stateful block: y = x + the sum of every x before it."""

    def forward(self, x, total):
        total = total + x
        return total, total


def test_a_session_step_whose_answer_is_lost_is_asked_again_of_the_worker_holding_the_state(tmp_path):
    from gpunet.ledger.tabs import Tab

    job = gpunet.Job.from_module(Accumulate(), (torch.ones(2), torch.zeros(2)), state=1)
    holder = FakeWorker("holder", "ok", "cut", "ok", "break")

    async def scenario(core):
        await core.refresh()
        tab, outs = Tab(), []
        for step in range(3):
            session = gpunet.protocol.SessionStep("s1", step)
            result = await core.run_step(job, (torch.full((2,), step + 1.0),), holder.id, session,
                                         (torch.zeros(2),), tab)
            outs.append(result.outputs[0].tolist())
        return outs

    # Step 1 ran but its answer was cut, step 2 never arrived: each was asked again once, and counted once.
    assert run(tmp_path, [holder], scenario) == [[1.0, 1.0], [3.0, 3.0], [6.0, 6.0]]
    assert holder.jobs == ["s1.0", "s1.1", "s1.1", "s1.2", "s1.2"]

    twice = FakeWorker("twice", "break", "break")

    async def cut_twice(core):
        await core.refresh()
        await core.run_step(job, (torch.ones(2),), twice.id, gpunet.protocol.SessionStep("s2", 0),
                            (torch.zeros(2),), Tab())

    with pytest.raises(ProtocolError, match="mid-message"):  # the second break is the span's to handle: it moves
        run(tmp_path / "b", [twice], cut_twice)


def test_a_session_tab_billed_above_the_workers_advertised_price_is_refused(tmp_path):
    """A tab receipt is checked like a job's: its price is at most what the worker advertises (whatever bound the
    client's requirements left open), and a worker whose price the client never saw gets nothing countersigned."""
    from gpunet.client.jobs import Delivery
    from gpunet.errors import InvalidReceipt
    from gpunet.ledger.tabs import Tab

    honest, greedy = FakeWorker("honest", price=1.0), FakeWorker("greedy", price=1.0)
    stranger = FakeWorker("stranger")

    def tab_and_receipt(worker: FakeWorker, client_id: str, price: float):
        tab = Tab("0badc0de")
        for step in range(2):
            tab.add(step, "aa" * 32, "bb" * 32, 4 * 10**11)
        receipt = sign_as_worker(
            worker.identity, job_id=tab.job_id("s1"), client_id=client_id, program_hash="cd" * 32,
            input_hash=tab.input_chain, output_hash=tab.output_chain, flops=tab.flops, wall_time_us=10,
            price=price_to_nano(price), max_price=None, started_at_us=1, ended_at_us=2)
        return tab, Delivery(worker.id, b"", receipt, 0, 0.0, finish=lambda verdict: worker.verdicts.append(verdict)
                             or asyncio.sleep(0))

    async def scenario(core):
        await core.refresh()
        tab, delivery = tab_and_receipt(greedy, core.identity.peer_id, 18e9)
        with pytest.raises(InvalidReceipt, match="above the 1 this worker advertises"):
            core.payment.pay_tab(delivery, "s1", tab, None)
        tab, delivery = tab_and_receipt(stranger, core.identity.peer_id, 1.0)
        with pytest.raises(InvalidReceipt, match="never saw"):
            core.payment.pay_tab(delivery, "s1", tab, None)
        tab, delivery = tab_and_receipt(honest, core.identity.peer_id, 1.0)
        core.router.update([greedy.entry])  # the honest worker's record lapsed (it left): its last tab is still paid
        return core.payment.pay_tab(delivery, "s1", tab, None)

    paid = run(tmp_path, [honest, greedy], scenario)
    assert paid.flops == 8 * 10**11 and paid.client_signature
    assert [type(v) for v in greedy.verdicts] == [Refuse] and [type(v) for v in stranger.verdicts] == [Refuse]


def test_a_checkers_last_tab_is_closed_under_the_price_bound_its_steps_were_sent_with():
    """The worker signs a tab under the bound its steps carried; a close without it would fail the countersignature
    and mark an honest checker as lying."""
    from gpunet.client.sessions.audit import CheckerReplay
    from gpunet.client.routing import Requirements
    from gpunet.ledger.tabs import Tab

    closed = []

    class Core:
        async def close_session(self, worker_id, session_id, tab=None, max_price=None):
            closed.append((worker_id, session_id, max_price))

    async def scenario():
        checker = CheckerReplay(Core(), span=None, requirements=Requirements(max_price=2.5), ttl=60,
                                on_receipt=lambda receipt: None, worker_id="w", session_id="s", tab=Tab())
        checker.drop(pay=True)
        await checker.close()

    asyncio.run(scenario())
    assert closed == [("w", "s", price_to_nano(2.5))]


class EmbedSum(torch.nn.Module):
    """A stateful block: sums the embeddings of every token it has seen."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids, total):
        total = total + self.embed(ids).sum(1)
        return total, total


def test_a_session_step_that_raises_or_is_refused_leaves_the_session_usable(tmp_path):
    """A token out of the vocabulary raises on the worker (and on a second one, after a move): the step's own
    error. A wrong dtype is refused before anything is sent. Neither step was taken by any span, so the session goes
    on, and its sums count only the steps that ran."""
    from gpunet.client.sessions import SessionCore, build

    torch.manual_seed(0)
    block = EmbedSum()

    async def scenario(core):
        await core.refresh()
        session = SessionCore(build(core, [block], (torch.tensor([[1]]),), spans=1,
                                    initial_state=[(torch.ones(1, 4),)]))  # sent with step 0 (not "fresh")
        first = await session.step(torch.tensor([[1]]))
        with pytest.raises(JobRaised, match="index out of range.*the same on two workers"):
            await session.step(torch.tensor([[50]]))
        with pytest.raises(JobRejected, match="dtype"):
            await session.step(torch.tensor([[1.5]]))
        second = await session.step(torch.tensor([[2]]))
        await session.close()
        return first, second, session.moves

    first, second, moves = run(tmp_path, [FakeWorker("a"), FakeWorker("b")], scenario)
    with torch.no_grad():
        assert torch.allclose(second, 1 + block.embed(torch.tensor([[1, 2]])).sum(1))
    assert moves == 1  # one more worker asked, not every worker three times
