"""One job's tries (gpunet.client.attempts), told outcomes directly: what each means, with no transport, no network
and no clock but the one handed in. (The same paths through the client, over a fake transport: test_client_core.py.)"""

import logging

import pytest

from gpunet.client.attempts import (
    Accept,
    Answered,
    Attempts,
    Busy,
    GiveUp,
    Look,
    PayUp,
    ProgramLost,
    REDIALS,
    Raise,
    Raised,
    Replicas,
    Retry,
    Say,
    Strike,
    Try,
    Wait,
    WrongAnswer,
)
from gpunet.client.routing import JobShape, Requirements, Router
from gpunet.dht.records import DeviceInfo, WorkerRecord
from gpunet.dht.records import WorkerEntry
from gpunet.errors import (
    DeadlineUnreachable,
    InvalidReceipt,
    JobFailed,
    JobPreempted,
    JobRaised,
    JobRejected,
    JobTimeout,
    LocalNetworkDown,
    NetworkError,
    NoWorkersAvailable,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    StreamBroken,
    WorkerBusy,
    WorkerDraining,
)

SHAPE = JobShape(flops=512, program_hash="ab" * 32, input_bytes=1024, program_bytes=10_000, dtype="fp32")
NOW = 1000.0
RAISED = JobRaised("node 'x' (aten.add.Tensor) raised RuntimeError: index out of range")


def worker(name: str, tflops: float = 1.0, reachability: str = "direct") -> WorkerEntry:
    return WorkerEntry(name, WorkerRecord(
        version="test", state="online", price=1.0, tflops={"fp32": tflops}, reachability=reachability,
        device=DeviceInfo(kind="cpu", name=name, memory_total=2**34, memory_free=2**33)), 1e12)


def router(*entries: WorkerEntry) -> Router:
    r = Router()
    r.update(entries)
    return r


def attempts(req: Requirements = Requirements(), **kw) -> Attempts:
    return Attempts("job-1", req, SHAPE, NOW + 60, **kw)


A, B, C = worker("a", tflops=100.0), worker("b", tflops=10.0), worker("c")


def tried(a: Attempts, r: Router, outcome, now: float = NOW) -> list:
    """Try the next worker and tell the machine ``outcome``: the actions it answers with."""
    step = a.next(r, now)
    assert isinstance(step, Try)
    return a.on(step.worker, outcome, now)


# --- which worker next ---------------------------------------------------------------------------------------------


def test_the_first_try_goes_to_the_worker_routing_ranks_first_with_the_time_left():
    a = attempts()
    assert a.next(router(A, B), NOW) == Try(A, 60.0)
    assert a.tried == ["a"] and a.replicas.taken == {"a"}


def test_a_copy_of_a_verified_job_never_goes_where_another_copy_runs():
    replicas = Replicas(taken={"a"})
    assert attempts(replicas=replicas).next(router(A, B), NOW).worker == B


def test_a_job_out_of_time_gives_up_naming_the_workers_it_tried():
    a = attempts()
    tried(a, router(A, B), JobFailed("executor crashed"))
    step = a.next(router(A, B), NOW + 61)
    assert isinstance(step, GiveUp) and isinstance(step.error, JobTimeout)
    assert "tried a (last error: executor crashed)" in str(step.error)


def test_workers_busy_or_full_for_a_moment_are_waited_for():
    import time

    r, now = router(A), time.monotonic()  # routing's own clock: its bans are on it
    r.on_busy("a", now)
    step = Attempts("job-1", Requirements(), SHAPE, now + 60).next(r, now)
    assert isinstance(step, Wait) and step.until == r.bans["a"].until


def test_an_emptied_network_is_looked_at_again_for_a_while_then_given_up_on():
    a = attempts(empty_wait=20.0, look_pause=0.5)
    assert a.next(router(), NOW) == Look(0.5)
    step = a.next(router(), NOW + 21)
    assert isinstance(step, GiveUp) and "no workers are online" in str(step.error)


def test_a_copy_left_without_a_worker_its_other_copies_do_not_hold_looks_again_for_a_while():
    """Redundancy 2 on two workers, one of whose records lapsed for a heartbeat under load (CI saw it): the second
    copy looks again for the other worker instead of giving up at once; later, with still only one, it gives up."""
    second = attempts(Requirements(redundancy=2), replicas=Replicas(taken={"a"}), empty_wait=20.0, look_pause=0.5)
    assert second.next(router(A), NOW) == Look(0.5)
    assert second.next(router(A, B), NOW + 1).worker == B
    late = attempts(Requirements(redundancy=2), replicas=Replicas(taken={"a"}), empty_wait=20.0, look_pause=0.5)
    late.next(router(A), NOW)
    assert isinstance(late.next(router(A), NOW + 21), GiveUp)


def test_with_no_worker_left_to_try_the_job_gives_up_saying_whom_it_tried():
    a = attempts()
    tried(a, router(A), JobFailed("executor crashed"))
    step = a.next(router(A), NOW)
    assert isinstance(step, GiveUp) and isinstance(step.error, NoWorkersAvailable)
    assert "tried a; last error: executor crashed" in str(step.error)


def test_a_deadline_no_worker_can_meet_gives_up_at_once():
    import time

    step = attempts(Requirements(deadline=time.time() + 60)).next(router(A), NOW + 60 - 1e-9)
    assert isinstance(step, GiveUp) and isinstance(step.error, DeadlineUnreachable)


# --- what each outcome means ---------------------------------------------------------------------------------------


def test_an_answer_is_accepted():
    a = attempts()
    assert tried(a, router(A), Answered()) == [Accept()]
    assert a.replicas.delivered == 1


def test_a_wrong_answer_is_struck_as_invalid_and_the_job_goes_elsewhere():
    a = attempts()
    actions = tried(a, router(A, B), WrongAnswer(InvalidReceipt("receipt's output hash is not the hash")))
    assert actions == [Strike("a", "invalid", "answered job job-1 wrongly (receipt's output hash is not the hash)",
                              logging.WARNING), Retry()]
    assert a.next(router(A, B), NOW).worker == B


def test_a_preempted_batch_job_runs_again_elsewhere_first_and_costs_its_worker_nothing():
    a = attempts(Requirements(priority="batch"))
    actions = tried(a, router(A, B), JobPreempted("an interactive job needed the slot", 1))
    assert [type(x) for x in actions] == [Say, Retry] and "a" not in a.failed
    assert a.next(router(A, B), NOW).worker == B


def test_an_interactive_job_stopped_for_another_strikes_its_worker():
    actions = tried(attempts(), router(A, B), JobPreempted("an interactive job needed the slot", 1))
    assert actions == [Strike("a", "failure", "stopped interactive job job-1"), Retry()]


@pytest.mark.parametrize("busy", [WorkerBusy("queue full", 3), WorkerDraining("shutting down")])
def test_a_busy_or_draining_worker_is_skipped_for_a_moment_not_struck(busy):
    assert tried(attempts(), router(A), busy) == [Busy("a"), Retry(0.01)]


def test_a_lost_program_is_resent_without_a_strike_until_the_worker_keeps_losing_it():
    a = attempts(max_resends=2)
    for _ in range(2):
        assert tried(a, router(A), ProgramNotCached("ab")) == [ProgramLost("a"), Retry()]
        assert "a" not in a.failed
    tried(a, router(A), ProgramNotCached("ab"))
    assert "a" in a.failed


def test_a_refusal_sends_the_job_elsewhere_until_enough_refusals_make_it_final():
    a = attempts(max_rejections=2)
    assert tried(a, router(A, B, C), JobRejected("its limit is lower")) == [Retry()]
    [final] = tried(a, router(A, B, C), JobRejected("its price is higher"))
    assert isinstance(final, Raise) and type(final.error) is JobRejected
    assert str(final.error) == "2 workers refused job job-1; last: its price is higher"


def test_pay_first_pays_up_and_asks_the_same_worker_again_until_the_line_does_not_clear():
    """A worker holding this client at its credit line: the countersignatures of a client paying as it goes are on
    their way, so the same worker is asked again (whatever routing would rank first), not struck, not left."""
    a, r = attempts(max_pay_waits=2, max_rejections=1), router(A, B, C)
    assert tried(a, r, PayFirst("holds 64 results not yet countersigned")) == [PayUp("a"), Retry(0.02)]
    r.on_busy("a")  # (even where routing would now skip it)
    step = a.next(r, NOW)
    assert isinstance(step, Try) and step.worker.id == "a" and not a.failed
    assert a.on(step.worker, PayFirst("still"), NOW) == [PayUp("a"), Retry(0.04)]
    step = a.next(r, NOW)
    assert step.worker.id == "a" and a.tried == ["a", "a", "a"]
    [final] = a.on(step.worker, PayFirst("the line does not clear"), NOW)  # then it is a refusal like any other
    assert isinstance(final, Raise) and isinstance(final.error, JobRejected) and "a" in a.failed


def test_a_worker_saying_pay_first_stays_this_copys_so_no_other_copy_of_a_vote_picks_it():
    """Otherwise a worker answering "pay first" at will could be drawn by the vote's other copy meanwhile and supply
    both of its votes."""
    replicas = Replicas()
    first, second = attempts(Requirements(redundancy=2), replicas=replicas), attempts(Requirements(redundancy=2),
                                                                                      replicas=replicas)
    assert tried(first, router(A, B), PayFirst("holds 64 results not yet countersigned")) == [PayUp("a"),
                                                                                                Retry(0.02)]
    assert second.next(router(A, B), NOW).worker == B


def test_refusals_all_for_the_deadline_end_in_deadline_unreachable():
    a = attempts(max_rejections=1)
    [final] = tried(a, router(A), DeadlineUnreachable("cannot start it in time"))
    assert isinstance(final, Raise) and isinstance(final.error, DeadlineUnreachable)


def test_a_stream_broken_on_the_way_is_tried_again_a_few_times_on_the_same_worker_pausing_more_each_time():
    a = attempts()
    assert [type(x) for x in tried(a, router(A, B), StreamBroken("peer closed the stream"))] == [Say, Retry]
    pauses = []
    for _ in range(REDIALS - 1):
        assert a.next(router(A, B), NOW).worker == A
        say, retry = a.on(A, StreamBroken("peer closed the stream"), NOW)
        pauses.append(retry.pause)
    assert pauses == sorted(pauses) and pauses[0] > 0 and pauses[-1] < 1
    assert a.next(router(A, B), NOW).worker == A
    assert a.on(A, StreamBroken("peer closed the stream"), NOW)[0].outcome == "failure"


def test_a_malformed_answer_is_tried_again_only_once():
    a = attempts()
    assert [type(x) for x in tried(a, router(A, B), ProtocolError("peer sent nothing for 30 s"))] == [Say, Retry]
    assert a.next(router(A, B), NOW).worker == A
    assert a.on(A, ProtocolError("peer sent nothing for 30 s"), NOW)[0].outcome == "failure"


def test_a_relayed_worker_that_did_not_answer_is_tried_again_once_a_direct_one_is_not():
    relayed = worker("r", tflops=100.0, reachability="relayed")
    assert [type(x) for x in tried(attempts(), router(relayed), NetworkError("no answer"))] == [Say, Retry]
    assert tried(attempts(), router(A), NetworkError("no answer"))[0] == Strike(
        "a", "failure", "failed job job-1 (no answer)")


def test_a_worker_past_the_jobs_time_is_struck_as_a_timeout():
    [strike, retry] = tried(attempts(), router(A), TimeoutError())
    assert strike == Strike("a", "timeout", "failed job job-1 (worker a took too long)") and retry == Retry()


def test_a_worker_that_fails_the_job_is_struck_as_a_failure():
    assert tried(attempts(), router(A), JobFailed("executor crashed"))[0].outcome == "failure"


def test_our_own_daemon_going_is_raised_at_once_against_no_worker():
    down = LocalNetworkDown("the p2p daemon is gone")
    assert tried(attempts(), router(A), down) == [Raise(down)]


# --- "the job raised" ------------------------------------------------------------------------------------------------


def test_the_job_raised_once_this_clients_own_run_raises_too():
    [final] = tried(attempts(), router(A, B), Raised(RAISED, here=True))
    assert isinstance(final, Raise) and final.error.confirmed_here
    assert "this client's own run raised the same" in str(final.error)


def test_a_worker_whose_claim_this_clients_run_contradicts_is_struck():
    [strike, _] = tried(attempts(), router(A, B), Raised(RAISED, here=False))
    assert strike.worker_id == "a" and strike.outcome == "failure" and "which this client ran" in strike.say


def test_a_claim_made_too_late_to_check_here_is_struck_as_a_timeout():
    a = attempts(runs_here=True)
    [strike, _] = tried(a, router(A, B), Raised(RAISED, here=None), now=NOW + 59.95)
    assert strike.outcome == "timeout" and "too late to check" in strike.say


def test_a_claim_that_cannot_be_checked_here_is_put_to_a_second_worker_drawn_at_random():
    a = attempts()
    assert [type(x) for x in tried(a, router(A, B), Raised(RAISED, here=None))] == [Say, Retry]
    assert a.raised == [("a", "node 'x' (aten.add.Tensor) raised RuntimeError")]
    assert a.next(router(A, B), NOW).worker == B  # drawn (Router.choose_checker): the only one left


def test_a_second_worker_naming_the_same_place_makes_it_the_jobs_own_error():
    a = attempts()
    tried(a, router(A, B), Raised(RAISED, here=None))
    [final] = tried(a, router(A, B), Raised(RAISED, here=None))
    assert isinstance(final, Raise) and not final.error.confirmed_here and "worker a raised the same" in str(final.error)


def test_a_second_worker_naming_another_place_leaves_the_job_to_a_third():
    a = attempts()
    tried(a, router(A, B, C), Raised(RAISED, here=None))
    assert [type(x) for x in tried(a, router(A, B, C), Raised(JobRaised("node 'y' raised KeyError"), here=None))] \
        == [Say, Retry]


def test_once_this_client_sees_it_raise_the_workers_that_named_another_place_are_struck():
    a = attempts()
    tried(a, router(A, B, C), Raised(JobRaised("node 'y' raised KeyError"), here=None))
    actions = tried(a, router(A, B, C), Raised(RAISED, here=True))
    assert actions[0] == Strike("a", "failure") and isinstance(actions[1], Raise)


def test_a_claim_that_the_job_raised_after_another_copy_answered_is_not_believed():
    a = attempts(replicas=Replicas(delivered=1))
    assert [type(x) for x in tried(a, router(A, B), Raised(RAISED, here=None))] == [Say, Retry]
    assert a.raised == []  # a result in hand: not the job's error, whoever says so next


def test_a_worker_that_said_the_job_raised_is_struck_once_another_runs_it():
    a = attempts()
    tried(a, router(A, B), Raised(RAISED, here=None))
    actions = tried(a, router(A, B), Answered())
    assert actions[0] == Strike("a", "failure") and isinstance(actions[1], Say) and actions[-1] == Accept()


def test_with_no_second_worker_to_ask_the_job_gives_up_with_the_claim():
    a = attempts()
    tried(a, router(A), Raised(RAISED, here=None))
    step = a.next(router(A), NOW)
    assert isinstance(step, GiveUp) and isinstance(step.error, JobRaised)
    assert "no other worker could run it to confirm, nor this client" in str(step.error)
