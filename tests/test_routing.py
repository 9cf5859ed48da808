"""Routing on synthetic worker views: filtering with reasons, ranking, bans, busy skips, load spreading, exploration."""

import time

import pytest

from gpunet.client.routing import GiB, JobShape, Requirements, Router
from gpunet.dht.records import DeviceInfo, WorkerRecord
from gpunet.dht.records import WorkerEntry
from gpunet.errors import ConfigError, DeadlineUnreachable, NoWorkersAvailable

PROGRAM = "ab" * 32
TINY = JobShape(flops=512, program_hash=PROGRAM, input_bytes=1024, program_bytes=10_000, dtype="fp32")
HEAVY = JobShape(flops=10**12, program_hash=PROGRAM, input_bytes=1024, program_bytes=10_000, dtype="fp32")


def worker(name: str, *, kind="cpu", tflops=1.0, price=1.0, state="online", queue=0, free_gb=8.0, programs=(),
           **lanes):
    record = WorkerRecord(
        version="test", state=state, price=price, queue=queue, programs=list(programs), tflops={"fp32": tflops},
        device=DeviceInfo(kind=kind, name=name, memory_total=int(16 * GiB), memory_free=int(free_gb * GiB)), **lanes,
    )
    return WorkerEntry(id=name, record=record, expiration_time=1e12)


def router(*entries) -> Router:
    r = Router()
    r.update(entries)
    return r


def test_requirements_filter_with_reasons():
    r = router(worker("cpu-a"), worker("gpu-b", kind="cuda", price=9.0), worker("gone", state="draining"))
    assert r.choose(Requirements(device="gpu"), TINY).id == "gpu-b"
    assert r.choose(Requirements(max_price=2.0), TINY).id == "cpu-a"
    with pytest.raises(NoWorkersAvailable) as e:
        r.choose(Requirements(device="gpu", max_price=2.0), TINY)
    assert "has no GPU" in str(e.value) and "charges 9 credits/TFLOP" in str(e.value) and "is draining" in str(e.value)
    with pytest.raises(NoWorkersAvailable, match="GiB free"):
        r.choose(Requirements(min_memory_gb=64), TINY)


def test_heavy_jobs_go_to_the_fastest_and_cheap_ones_by_preference():
    r = router(worker("slow-cheap", tflops=0.1, price=0.5), worker("fast-dear", tflops=10.0, price=5.0))
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "fast-dear"
    assert r.choose(Requirements(prefer="cheapest"), HEAVY).id == "slow-cheap"
    assert r.choose(Requirements(), HEAVY).id == "fast-dear"  # balanced: 100x faster outweighs 10x dearer


def test_a_cached_program_saves_the_transfer():
    big = JobShape(flops=512, program_hash=PROGRAM, input_bytes=1024, program_bytes=2 * 10**9, dtype="fp32")
    r = router(worker("cold"), worker("warm", programs=[PROGRAM]))
    assert r.choose(Requirements(), big).id == "warm"


def test_a_program_a_peer_holds_costs_a_cold_worker_less_than_our_upload_unless_private():
    big = JobShape(flops=512, program_hash=PROGRAM, input_bytes=1024, program_bytes=2 * 10**9, dtype="fp32")
    r = router(worker("cold"), worker("holder", programs=[PROGRAM]))
    r.bandwidth = 10e6  # our uplink: slow; workers fetch from each other at peer_bandwidth
    cold = r.workers["cold"]
    from_peer = r.expected_seconds(cold, big)
    assert from_peer == pytest.approx(big.program_bytes / r.config.peer_bandwidth, rel=0.01)
    private = JobShape(**{**big.__dict__, "private": True})
    assert r.expected_seconds(cold, private) == pytest.approx(big.program_bytes / 10e6, rel=0.01)
    assert [h.id for h in r.holders(PROGRAM, exclude="cold")] == ["holder"]


def test_a_worker_that_just_failed_is_named_to_no_one_as_a_holder():
    """A worker told to fetch a program from a dead peer spends seconds dialling it before it asks the client: one
    banned for a failure is not named until its ban ends; one merely busy still is."""
    r = router(worker("cold"), worker("dead", programs=[PROGRAM]), worker("busy", programs=[PROGRAM]))
    r.on_failure("dead", now=time.monotonic())
    r.on_busy("busy")
    assert [h.id for h in r.holders(PROGRAM, exclude="cold")] == ["busy"]
    r.bans["dead"].until = time.monotonic() - 1  # the ban is over: tried again, as for jobs
    assert {h.id for h in r.holders(PROGRAM, exclude="cold")} == {"dead", "busy"}


def test_each_workers_own_link_is_priced_in():
    """A worker behind a relay (or far away) is slower to send to: routing learns that link's bandwidth, not only a
    global one, and weighs it for jobs with big inputs, without banning the worker for it."""
    bulky = JobShape(flops=512, program_hash=PROGRAM, input_bytes=64 << 20, program_bytes=10_000, dtype="fp32")
    r = router(worker("near", programs=[PROGRAM]), worker("relayed", programs=[PROGRAM]))
    r.on_success("near", bulky, 0.7, 64 << 20, 0.6)  # ~110 MB/s
    r.on_success("relayed", bulky, 6.1, 64 << 20, 6.0)  # ~11 MB/s
    assert r.expected_seconds(r.workers["relayed"], bulky) > 5 * r.expected_seconds(r.workers["near"], bulky)
    assert r.choose(Requirements(), bulky).id == "near"
    assert r.choose(Requirements(), TINY).id in {"near", "relayed"}  # small jobs: both fine


def test_load_spreads_over_idle_workers():
    r = router(worker("a"), worker("b"), worker("c"))
    chosen = []
    for _ in range(6):  # six jobs in flight at once, none finished
        w = r.choose(Requirements(), HEAVY)
        r.started(w.id)
        chosen.append(w.id)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]
    assert r.choose(Requirements(), HEAVY, exclude={"a", "b"}).id == "c"


def test_a_new_worker_gets_tried_even_when_an_incumbent_is_fast():
    r = router(worker("incumbent"))
    for _ in range(20):
        r.on_success("incumbent", TINY, seconds=0.001, bytes_sent=1024, transfer_seconds=0.0)
    r.update([worker("incumbent"), worker("newcomer", programs=[PROGRAM])])
    assert r.choose(Requirements(), TINY).id == "newcomer"  # optimistic until measured
    r.on_success("newcomer", TINY, seconds=0.010, bytes_sent=1024, transfer_seconds=0.0)  # it turns out slower
    assert r.choose(Requirements(), TINY).id == "incumbent"


def test_failures_ban_with_exponential_backoff_and_busy_is_a_short_skip():
    r = router(worker("flaky"), worker("steady", tflops=0.01))
    assert r.choose(Requirements(prefer="fastest"), HEAVY).id == "flaky"
    first = r.on_failure("flaky", now=100.0)
    second = r.on_failure("flaky", now=100.0)
    assert second == 2 * first
    assert [w.id for w in r.eligible(Requirements(), now=100.0 + second - 0.1)] == ["steady"]
    assert {w.id for w in r.eligible(Requirements(), now=100.0 + second + 0.1)} == {"flaky", "steady"}
    r.on_success("flaky", HEAVY, seconds=1.0, bytes_sent=0, transfer_seconds=0.0)  # a success wipes the strikes
    assert r.on_failure("flaky", now=200.0) == first

    only = router(worker("busy"))
    only.on_busy("busy", now=50.0)
    with pytest.raises(NoWorkersAvailable) as e:
        only.eligible(Requirements(), now=50.1)
    assert "is busy" in str(e.value) and e.value.retry_at == pytest.approx(50.0 + only.config.busy_cooldown)


def test_a_cold_start_does_not_count_as_the_workers_speed():
    """The first job to a worker carries the program (transfer, validation, load): it must not rank the worker last."""
    r = router(worker("a"), worker("b"))
    r.on_success("a", TINY, seconds=0.002, bytes_sent=1024, transfer_seconds=0.0)
    r.on_success("b", TINY, seconds=0.800, bytes_sent=1024 + TINY.program_bytes, transfer_seconds=0.0, cold=True)
    assert r.choose(Requirements(), TINY).id == "b"  # still unmeasured: explored, not buried
    r.on_success("b", TINY, seconds=0.0015, bytes_sent=1024, transfer_seconds=0.0)
    assert r.choose(Requirements(), TINY).id == "b"  # measured warm: it is the faster one


def test_waiting_behind_our_own_jobs_is_not_counted_as_the_workers_speed():
    """A job sent behind 4 of ours took 5 places' worth of time: per place it was the faster worker (a demo run once
    split 200 jobs 150/43/7 because queue time was learned as per-job cost and counted again as wait)."""
    r = router(worker("queued"), worker("idle"))
    r.on_success("queued", TINY, seconds=0.010, bytes_sent=1024, transfer_seconds=0.0, ahead=4)  # 2 ms a place
    r.on_success("idle", TINY, seconds=0.003, bytes_sent=1024, transfer_seconds=0.0, ahead=0)
    assert r.choose(Requirements(), TINY).id == "queued"
    assert r.started("queued") == 0 and r.started("queued") == 1  # started() reports the jobs already ahead


def test_an_estimate_from_a_bad_moment_is_measured_again(monkeypatch):
    import gpunet.client.routing as routing

    clock = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: clock[0])
    r = router(worker("hiccup"), worker("steady"))
    r.on_success("hiccup", TINY, seconds=0.700, bytes_sent=1024, transfer_seconds=0.0)  # one bad moment
    r.on_success("steady", TINY, seconds=0.005, bytes_sent=1024, transfer_seconds=0.0)
    assert r.choose(Requirements(), TINY).id == "steady"
    clock[0] += r.config.remeasure_after + 1  # steady keeps getting work; hiccup's figure goes stale
    r.on_success("steady", TINY, seconds=0.005, bytes_sent=1024, transfer_seconds=0.0)
    assert r.choose(Requirements(), TINY).id == "hiccup"  # one probe job...
    r.started("hiccup")
    assert r.choose(Requirements(), TINY).id == "steady"  # ...not a pile of them while it runs
    r.finished("hiccup")
    r.on_success("hiccup", TINY, seconds=0.002, bytes_sent=1024, transfer_seconds=0.0)  # replaces, not blends
    assert r.choose(Requirements(), TINY).id == "hiccup"


def test_why_a_worker_is_left_out_is_kept_while_others_get_the_work():
    r = router(worker("fine"), worker("dear", price=9.0), worker("flaky"), worker("leaving", state="draining"))
    r.on_failure("flaky")
    assert r.choose(Requirements(max_price=2.0), TINY, exclude={"fine-but-failed-this-job"}).id == "fine"
    assert r.skipped == {"dear": "charges 9 credits/TFLOP (> 2)", "flaky": "is banned for recent failures",
                         "leaving": "is draining"}
    r.choose(Requirements(), TINY, exclude={"fine"})  # a per-job exclusion is not a reason to report
    assert "fine" not in r.skipped and "dear" not in r.skipped  # eligible again: no longer reported


def test_checkers_are_drawn_at_random_not_by_price_or_claimed_speed():
    """Two sybils advertising the lowest price and the highest speed got both replicas and confirmed each other."""
    import random

    from gpunet.client.reputation import Reputation
    from gpunet.client.trust import ESTABLISHED_AFTER

    def at(name, ip, **kw):
        entry = worker(name, **kw)
        record = entry.record.model_copy(update={"maddrs": [f"/ip4/{ip}/tcp/1/p2p/{name}"]})
        return WorkerEntry(id=name, record=record, expiration_time=1e12)

    sybils = [at(f"sybil-{i}", "10.9.9.9", price=0.01, tflops=1000.0) for i in range(2)]
    honest = [at(f"honest-{i}", f"10.0.0.{i}", price=2.0) for i in range(3)]
    r = router(*sybils, *honest)
    r.reputation = Reputation(rng=random.Random(0))
    assert r.choose(Requirements(), HEAVY).id.startswith("sybil")  # the main copy may go by price and speed...
    rng = random.Random(1)
    drawn = {r.choose_checker(Requirements(), replicas={"sybil-0"}, rng=rng).id for _ in range(200)}
    assert drawn == {"honest-0", "honest-1", "honest-2"}  # ...its checker comes from another address, at random
    for _ in range(ESTABLISHED_AFTER):
        r.reputation.record("honest-1", "valid", checked=True)
    assert r.reputation.established("honest-1") and not r.reputation.established("sybil-1")
    assert {r.choose_checker(Requirements(), replicas={"sybil-0"}, rng=rng).id for _ in range(50)} == {"honest-1"}


def test_batch_work_goes_where_the_floor_is_lowest_and_preemption_least_likely():
    quiet = worker("quiet", price=2.0, batch_price=1.0, batch_floor=1.0)
    crowded = worker("crowded", price=2.0, batch_price=0.8, batch_floor=2.0, interactive_load=0.9)
    r = router(quiet, crowded)
    batch = Requirements(priority="batch", max_price=1.5)
    assert batch.price_at(crowded) == 2.0 and Requirements().price_at(crowded) == 2.0
    assert r.choose(batch, HEAVY).id == "quiet"  # cheaper now, and not kept busy by interactive work
    # A bid under a worker's batch price can never run there; between its batch price and its floor, it may (it waits).
    with pytest.raises(NoWorkersAvailable, match="sells batch work from 1 credits/TFLOP"):
        router(quiet).choose(Requirements(priority="batch", max_price=0.5), TINY)
    assert router(crowded).choose(Requirements(priority="batch", max_price=1.0), TINY).id == "crowded"
    old = worker("before-lanes", price=1.0)  # no batch_price: it sells batch work as interactive, at its price
    assert Requirements(priority="batch").price_at(old) == 1.0
    with pytest.raises(NoWorkersAvailable):
        router(old).choose(Requirements(priority="batch", max_price=0.5), TINY)


def test_a_deadline_no_worker_can_meet_is_refused_with_the_soonest_estimate():
    r = router(worker("slow", tflops=0.01), worker("fast", tflops=1.0))
    assert r.choose(Requirements(), HEAVY, within=10.0).id == "fast"  # 1 TFLOP at 1 TFLOPS: about a second
    with pytest.raises(DeadlineUnreachable, match=r"soonest \(fast\) would take about 1.0 s"):
        r.choose(Requirements(), HEAVY, within=0.5)
    with pytest.raises(ConfigError):
        Requirements(deadline=-1)
    with pytest.raises(ConfigError):
        Requirements(priority="spot")
    from datetime import datetime, timedelta, timezone

    due = datetime.now(timezone.utc) + timedelta(minutes=5)
    assert Requirements(deadline=due).deadline == pytest.approx(due.timestamp())


@pytest.mark.parametrize("kwargs", [dict(max_price=float("inf")), dict(max_price=float("nan")), dict(max_price="2"),
                                    dict(min_memory_gb=-1), dict(min_tflops=float("nan")),
                                    dict(timeout=0), dict(timeout=float("inf")), dict(redundancy=2.0)])
def test_a_requirement_that_is_no_usable_number_is_refused_when_it_is_made(kwargs):
    """inf or nan used to pass here and fail at submit as a receipt error; a string as a bare TypeError."""
    with pytest.raises(ConfigError, match=f"Requirements.{next(iter(kwargs))}"):
        Requirements(**kwargs)


def test_a_bid_above_any_workers_price_is_that_price_and_numpy_numbers_do():
    import numpy as np

    assert Requirements(max_price=20000).max_price == 10000  # no worker may charge more (WorkerConfig.price)
    picked = Requirements(max_price=np.float32(1.5), min_memory_gb=np.int64(2), timeout=np.float32(30))
    assert picked.max_price == 1.5 and type(picked.timeout) is float and type(picked.min_memory_gb) is float


def test_a_joining_worker_that_fits_is_waited_for_but_not_for_ever():
    """A record saying "joining" costs nothing to publish: jobs wait for one a while (it is proving its speed,
    starting executors), then fail as they would without it."""
    from gpunet.client.routing import JOINING_PATIENCE

    r = router(worker("soon", state="joining"))
    with pytest.raises(NoWorkersAvailable, match="is joining") as e:
        r.eligible(Requirements(), now=100.0)
    assert e.value.retry_at is not None and e.value.retry_at <= 101.0
    assert r.could_take(Requirements(), now=100.0) == 1
    assert r.could_take(Requirements(device="gpu"), now=100.0) == 0  # it would not fit once online either
    with pytest.raises(NoWorkersAvailable) as e:
        r.eligible(Requirements(), now=100.0 + JOINING_PATIENCE + 1)
    assert e.value.retry_at is None and r.could_take(Requirements(), now=100.0 + JOINING_PATIENCE + 1) == 0


def test_a_worker_whose_record_lapsed_keeps_its_sessions_for_a_grace_period(monkeypatch):
    """On a loaded machine a live worker's record can lapse from one refresh: a session's span on it stays there
    (CI saw spans moved off live workers that way), while routing itself stops offering the worker at once."""
    from gpunet.client import routing

    clock = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: clock[0])
    r = router(worker("holder"), worker("other"))
    r.update([worker("other")])
    assert r.holding("holder") is not None and "holder" not in r.workers
    assert [w.id for w in r.eligible(Requirements())] == ["other"]
    clock[0] += routing.LAPSE_GRACE - 1
    r.update([worker("other")])
    assert r.holding("holder") is not None
    clock[0] += 2
    assert r.holding("holder") is None
    r.update([worker("other")])
    assert r.holding("holder") is None and not r._lapsed
    assert r.holding("never") is None


def test_a_span_nothing_listed_can_take_falls_back_on_the_worker_whose_record_lapsed_last(monkeypatch):
    """The last resort of a session span (Session._choose): of the workers whose record lapsed within half the grace
    period, the one seen last that would otherwise be eligible (one not holding another span first); never one
    excluded, banned for failures, unfit, unproven or past half the grace period."""
    from gpunet.client import routing

    clock = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: clock[0])
    r = router(worker("early"), worker("late"), worker("small", free_gb=0.1), worker("liar"))
    r.update([worker("late"), worker("liar")])  # "early" and "small" lapse first...
    clock[0] += 5
    r.update([worker("liar")])  # ...then "late"
    need = Requirements(min_memory_gb=1.0)
    assert r.lapsed_fallback(need, exclude={"liar"}).id == "late"
    assert r.lapsed_fallback(need, exclude={"liar", "late"}).id == "early"
    assert r.lapsed_fallback(need, exclude={"liar"}, avoid={"late"}).id == "early"  # it holds another span
    assert r.lapsed_fallback(need, exclude={"liar", "early"}, avoid={"late"}).id == "late"  # ...but is the only one
    r.on_proof("late", 0.0)  # its speed proof failed
    assert r.lapsed_fallback(Requirements(min_memory_gb=1.0, min_tflops=0.5), exclude={"liar", "early"}) is None
    r.on_failure("early")
    assert r.lapsed_fallback(need, exclude={"liar", "late"}) is None  # banned; "small" has no room
    assert r.lapsed_fallback(Requirements(), exclude={"liar", "late"}).id == "small"
    clock[0] += routing.LAPSE_GRACE / 2  # half the grace is past: the rest is for what follows (a replay)
    assert r.lapsed_fallback(Requirements(), exclude={"liar"}) is None
