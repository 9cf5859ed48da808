"""The worker's lanes as a pure state machine: floor, priorities, preemption, fair share (no sockets, no sleeps)."""

import pytest

from gpunet.worker.state.lanes import BACKGROUND, BATCH, INTERACTIVE, Blame, Lanes, Preempt, Start, Ticket, Wake

NANO = 10**9


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lanes(slots=1, price=2 * NANO, batch_price=NANO, **kw):
    clock = Clock()
    return Lanes(slots, price, batch_price, clock=clock, **kw), clock


def started(actions):
    return [a.ticket for a in actions if isinstance(a, Start)]


def preempted(actions):
    return [a.ticket for a in actions if isinstance(a, Preempt)]


def test_the_batch_floor_rises_with_interactive_demand_and_is_what_a_batch_job_pays():
    m, _ = lanes(slots=2, price=3 * NANO, batch_price=NANO)
    assert m.floor == NANO  # idle: the volunteer's batch price
    m.enqueue(Ticket("a"))
    assert m.floor == 2 * NANO  # one of two slots wanted by interactive work: halfway
    m.enqueue(Ticket("b"))
    assert m.floor == 3 * NANO  # every slot wanted: the interactive price
    m.enqueue(Ticket("c"))
    assert m.floor == 3 * NANO  # never above it
    assert m.charge(INTERACTIVE) == 3 * NANO and m.charge(BACKGROUND) == 0


def test_batch_runs_only_when_no_interactive_job_waits_and_its_bid_reaches_the_floor():
    m, clock = lanes(slots=1, price=2 * NANO, batch_price=NANO)
    first = Ticket("i1")
    assert started(m.enqueue(first)) == [first]
    low = Ticket("b", BATCH, bid=int(1.5 * NANO))
    assert m.enqueue(low) == []  # a slot is busy: it waits (the floor is 2 credits now, above its bid)
    high = Ticket("c", BATCH, bid=2 * NANO)
    assert m.enqueue(high) == []  # it waits for the slot too: batch never preempts interactive
    clock.now += 1
    assert started(m.ended(first)) == [low]  # the floor fell to 1 credit: the oldest affordable batch job runs
    assert low.price == NANO
    clock.now += 1
    assert started(m.ended(low)) == [high] and high.price == NANO


def test_a_batch_job_below_the_floor_waits_until_the_floor_drops():
    m, clock = lanes(slots=2, price=3 * NANO, batch_price=NANO)
    i1, i2 = Ticket("i"), Ticket("i")
    m.enqueue(i1)
    m.enqueue(i2)
    cheap = Ticket("b", BATCH, bid=int(1.5 * NANO))
    assert m.enqueue(cheap) == [] and m.floor == 3 * NANO
    clock.now += 1
    assert started(m.ended(i1)) == []  # one slot free, but the floor is 2 credits: above its bid
    assert not cheap.running and m.floor == 2 * NANO
    clock.now += 1
    assert started(m.ended(i2)) == [cheap] and cheap.price == NANO


def test_an_interactive_job_preempts_the_batch_job_that_started_last_which_is_not_charged():
    m, clock = lanes(slots=2)
    b1, b2 = Ticket("x", BATCH), Ticket("y", BATCH)
    assert started(m.enqueue(b1)) == [b1]
    clock.now += 5
    assert started(m.enqueue(b2)) == [b2]
    clock.now += 1
    urgent = Ticket("z")
    actions = m.enqueue(urgent)
    assert preempted(actions) == [b2] and started(actions) == []  # the least work lost
    assert m.enqueue(Ticket("z")) and m.preemptions == 2  # a second waiter takes the other batch job
    assert started(m.ended(b2)) == [urgent]
    assert m._lanes[BATCH].served_client.get("y", 0.0) == 0.0  # not charged for the time it ran


def test_background_work_yields_to_any_paying_job_first():
    m, clock = lanes(slots=2)
    own, batch = Ticket("me", BACKGROUND), Ticket("x", BATCH)
    m.enqueue(own)
    clock.now += 1
    m.enqueue(batch)
    assert own.running and batch.running
    clock.now += 1
    actions = m.enqueue(Ticket("z"))
    assert preempted(actions) == [own]  # background before batch, although batch started later
    m2, _ = lanes(slots=1)
    bg = Ticket("me", BACKGROUND)
    m2.enqueue(bg)
    assert preempted(m2.enqueue(Ticket("x", BATCH))) == [bg]  # a paying batch job stops free work too
    assert m.preemptions == m2.preemptions == 0 and m.preemption_rate() == 0  # no client's job was stopped
    assert bg.price == 0


def test_a_job_that_may_not_be_stopped_is_left_running():
    m, _ = lanes(slots=1, can_preempt=lambda t: t.client != "holds-sessions")
    m.enqueue(Ticket("holds-sessions", BATCH))
    assert preempted(m.enqueue(Ticket("z"))) == []


def simulate(m, clock, arrivals, seconds=1.0, steps=1000):
    """Run the slot(s) for ``steps`` job ends, each job taking ``seconds``; returns the clients in start order."""
    order = []
    for ticket in arrivals:
        for t in started(m.enqueue(ticket)):
            order.append(t)
    for _ in range(steps):
        if not m.running:
            break
        clock.now += seconds
        first = min(m.running, key=lambda t: t.started_at)
        order.extend(started(m.ended(first, seconds)))
    return [t.client for t in order]


def test_one_client_flooding_a_lane_cannot_starve_another():
    m, clock = lanes(slots=1)
    flood = [Ticket("A") for _ in range(100)]
    order = simulate(m, clock, flood + [Ticket("B") for _ in range(10)], steps=19)
    first_20 = order[:20]
    assert first_20.count("B") >= 9  # B's ten jobs interleave with A's, not behind A's hundred
    assert m.shares(INTERACTIVE)["A"] == pytest.approx(0.5, abs=0.1)


def test_fair_share_is_by_executor_time_not_by_job_count():
    m, clock = lanes(slots=1)
    for _ in range(40):
        m.enqueue(Ticket("long"))
        m.enqueue(Ticket("short"))
    time_of = {"long": 4.0, "short": 1.0}
    done = {"long": 0, "short": 0}
    for _ in range(50):
        (ticket,) = m.running
        clock.now += time_of[ticket.client]
        done[ticket.client] += 1
        m.ended(ticket, time_of[ticket.client])
    assert done["short"] >= 3 * done["long"]  # about 4 short jobs per long one: equal seconds each


def test_a_client_that_was_idle_does_not_bank_its_unused_share():
    m, clock = lanes(slots=1)
    order = simulate(m, clock, [Ticket("A") for _ in range(50)], steps=20)
    assert set(order) == {"A"}
    late = [Ticket("B") for _ in range(20)]
    for t in late:
        m.enqueue(t)
    order = []
    for _ in range(20):
        (ticket,) = m.running
        clock.now += 1
        order += started(m.ended(ticket, 1.0))
    clients = [t.client for t in order]
    assert 8 <= clients.count("B") <= 12  # half from now on, not all twenty to make up for A's head start


def test_lane_load_shows_how_busy_interactive_work_keeps_the_worker():
    m, clock = lanes(slots=1)
    assert m.load(INTERACTIVE) == 0.0
    t = Ticket("a")
    m.enqueue(t)
    clock.now += 120
    assert m.load(INTERACTIVE) > 0.9
    m.ended(t)
    clock.now += 300
    assert m.load(INTERACTIVE) < 0.01


def test_wait_estimates_count_the_work_ahead_in_its_lane_and_above_only():
    m, clock = lanes(slots=1)
    t = Ticket("a")
    m.enqueue(t)
    clock.now += 2
    m.ended(t, 2.0)  # a's jobs take 2 s
    for _ in range(3):
        m.enqueue(Ticket("a"))
    assert m.wait_estimate(BATCH) == pytest.approx(6.0)  # the one running and two waiting, 2 s each
    clock.now += 1.5
    assert m.wait_estimate(INTERACTIVE) == pytest.approx(4.5)  # half a second left of the one running
    m.enqueue(Ticket("b", BATCH))
    assert m.wait_estimate(INTERACTIVE) == pytest.approx(4.5)  # a waiting batch job is not ahead of interactive
    idle, clock = lanes(slots=1)
    own = Ticket("me", BACKGROUND)
    idle.enqueue(own)
    idle.ended(own, 600.0)
    idle.enqueue(Ticket("me", BACKGROUND))  # the owner's 10-minute runs: stopped for paying work, not waited for
    assert idle.wait_estimate(INTERACTIVE) == 0.0 and idle.wait_estimate(BATCH) == 0.0


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError):
        Lanes(0, NANO, NANO)
    with pytest.raises(ValueError):
        Lanes(1, NANO, 2 * NANO)
    m, _ = lanes()
    with pytest.raises(ValueError):
        m.enqueue(Ticket("a", "spot"))


def test_an_interactive_job_that_has_a_batch_job_stopped_for_it_and_then_leaves_is_blamed():
    m, clock = lanes(slots=1)
    batch = Ticket("x", BATCH)
    m.enqueue(batch)
    clock.now += 30
    greedy = Ticket("z", host="10.0.0.9")
    assert preempted(m.enqueue(greedy)) == [batch] and greedy.victim is batch
    blamed = m.withdraw(greedy)  # it leaves before it runs: the stop was for nothing
    assert [type(a) for a in blamed] == [Blame] and blamed[0].ticket is greedy
    honest = Ticket("h")
    assert m.enqueue(honest) == []  # the stop under way serves the next waiter: no second batch job stopped
    assert honest.victim is batch and m.preemptions == 1
    assert started(m.ended(batch)) == [honest] and m.withdraw(honest) == []  # it ran: nothing to blame
    assert m.preemption_rate() > 0


def test_fair_share_goes_to_addresses_first_so_sybils_of_one_address_share_one_share():
    m, clock = lanes(slots=1)
    arrivals = [Ticket(f"sybil-{i % 10}", host="6.6.6.6") for i in range(60)] + [Ticket("alone", host="1.2.3.4")
                                                                                  for _ in range(10)]
    order = simulate(m, clock, arrivals, steps=19)
    assert order[:20].count("alone") >= 9  # ten identities at one address get one share, as the one client gets


def test_a_batch_job_whose_counted_work_ends_within_the_grace_is_left_to_end_once():
    ends = {}
    m, clock = lanes(slots=1, expected_end=lambda t: ends.get(t))
    job = Ticket("b", BATCH)
    m.enqueue(job)
    clock.now += 5
    ends[job] = clock.now + 0.1  # its dry run's count at this worker's speed: a tenth of a second left
    actions = m.enqueue(Ticket("i"))
    assert preempted(actions) == []  # the interactive job waits for it...
    assert [a.at for a in actions if isinstance(a, Wake)] == [ends[job]]  # ...no longer than its expected end
    clock.now += 0.1
    assert preempted(m.recheck()) == [job]  # overrun: stopped at the next look
    # The grace is given once: had it been cut short, a second waiter would not buy it a second one.
    m2, clock2 = lanes(slots=1, expected_end=lambda t: ends.get(t))
    other = Ticket("b", BATCH)
    m2.enqueue(other)
    clock2.now += 5
    ends[other] = clock2.now + 0.15
    assert preempted(m2.enqueue(Ticket("i1"))) == []
    clock2.now += 0.15
    ends[other] = clock2.now + 0.15  # a later count (or a lie) saying "nearly done" again changes nothing
    assert preempted(m2.enqueue(Ticket("i2"))) == [other]


def test_nearly_done_comes_from_the_jobs_own_work_not_its_clients_history():
    """A client whose five tiny batch jobs made its typical time tiny could run a long batch job past it, and that job
    counted as nearly done for ever: it held the slot against interactive work for its whole run at the batch price."""
    ends = {}
    m, clock = lanes(slots=1, expected_end=lambda t: ends.get(t))
    for _ in range(5):
        tiny = Ticket("b", BATCH)
        m.enqueue(tiny)
        clock.now += 0.01
        m.ended(tiny, 0.01)
    long = Ticket("b", BATCH)
    m.enqueue(long)
    clock.now += 3
    ends[long] = clock.now + 60  # its count says a minute more
    assert preempted(m.enqueue(Ticket("i"))) == [long]
    unknown = Ticket("b", BATCH)  # not counted yet (its dry run still going): nothing says it is nearly done
    m2, clock2 = lanes(slots=1)
    m2.enqueue(unknown)
    clock2.now += 3
    assert preempted(m2.enqueue(Ticket("i"))) == [unknown]
    overrun = Ticket("b", BATCH)
    m3, clock3 = lanes(slots=1, expected_end=lambda t: ends.get(t))
    m3.enqueue(overrun)
    clock3.now += 3
    ends[overrun] = clock3.now - 1  # past its expected end
    assert preempted(m3.enqueue(Ticket("i"))) == [overrun]
    fresh = Ticket("b", BATCH)  # one that has run less than its remaining grace is not spared either
    m4, clock4 = lanes(slots=1, expected_end=lambda t: ends.get(t))
    m4.enqueue(fresh)
    clock4.now += 0.05
    ends[fresh] = clock4.now + 0.1
    assert preempted(m4.enqueue(Ticket("i"))) == [fresh]


def test_jobs_that_run_as_one_forward_start_with_the_first_of_them_and_take_no_slot_of_their_own():
    """Sessions' steps batched on a span (gpunet.worker.batching): when a job with a ``rows`` key starts, the jobs of
    its lane waiting with that key start with it, oldest first and at most MAX_ROWS in all; jobs with another key or
    none wait for a slot as before, and the riders leave nothing behind when they end."""
    from gpunet.worker.state import lanes as lanes_module

    m, clock = lanes(slots=1)
    running = Ticket("a", rows="span")
    assert started(m.enqueue(running)) == [running]
    waiting = [Ticket(c, rows="span") for c in ("b", "c", "d")]
    other, alone = Ticket("e", rows="other"), Ticket("f")
    for t in (waiting[0], other, waiting[1], alone, waiting[2]):
        assert started(m.enqueue(t)) == []  # the slot is taken: even a job of the same key waits for the next start
    clock.now += 1
    actions = m.ended(running, 1.0)
    leader = started(actions)[0]
    assert leader is waiting[0] and started(actions) == waiting and leader.riders == waiting[1:]
    assert all(t.leader is leader for t in waiting[1:]) and all(t.price == leader.price for t in waiting)
    assert m.count(INTERACTIVE, waiting=False) == 3 and m.count(INTERACTIVE, running=False) == 2
    for rider in waiting[1:]:  # riders end first: the slot is still the leader's
        assert started(m.ended(rider, 1.0)) == []
    assert started(m.ended(leader, 1.0)) == [other]
    assert started(m.ended(other, 1.0)) == [alone]
    m.ended(alone, 1.0)
    assert not m.running and not list(m._lanes[INTERACTIVE].tickets())
    # A leader that leaves before its riders' forward ends (cancelled as it started) hands them the slot.
    m, _ = lanes(slots=1)
    first = Ticket("x", rows="k")
    m.enqueue(first)
    more = [Ticket(c, rows="k") for c in ("y", "z")]
    for t in more:
        m.enqueue(t)
    later = Ticket("w")
    m.enqueue(later)
    assert started(m.ended(first, 1.0)) == more and more[0].group == tuple(more)
    assert started(m.ended(more[0], 0.0)) == []  # the leader left: its rider holds the slot
    assert more[1].leader is None and more[0].riders == []
    assert started(m.ended(more[1], 1.0)) == [later]
    # At most MAX_ROWS in one start.
    m, _ = lanes(slots=1)
    first = Ticket("x", rows="k")
    m.enqueue(first)
    many = [Ticket(f"c{i}", rows="k") for i in range(lanes_module.MAX_ROWS + 5)]
    for t in many:
        m.enqueue(t)
    assert len(started(m.ended(first, 1.0))) == lanes_module.MAX_ROWS
