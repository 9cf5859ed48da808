"""Sessions without a network: span planning, the worker's session table, the stateful-program format, the wire."""

import asyncio
import dataclasses
import json

import pytest
import torch
from torch.export import Dim

from gpunet import protocol
from gpunet.client.sessions.spans import _SpanModule, plan_spans, spans_needed, trace_spans
from gpunet.errors import JobRejected, ProtocolError, SessionLost, UnsupportedProgram, UsageError, WorkerBusy
from gpunet.job import Job
from gpunet.job.format import Manifest
from gpunet.identity import Identity
from gpunet.models import TinyConfig, generate_locally, tiny_gpt
from gpunet.ledger.tabs import TAB_FLOPS, TAB_STEPS, Tab, parse, steps_of
from gpunet.worker.state.sessions import SessionLimits, Sessions


def test_spans_are_contiguous_and_balanced():
    assert plan_spans([1, 1, 1, 1, 1, 1], 3) == [(0, 2), (2, 4), (4, 6)]
    assert plan_spans([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert plan_spans([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert plan_spans([7], 1) == [(0, 1)]
    for sizes, n in [([3, 1, 4, 1, 5, 9, 2, 6], k) for k in range(1, 9)]:
        ranges = plan_spans(sizes, n)
        assert len(ranges) == n and ranges[0][0] == 0 and ranges[-1][1] == len(sizes)
        assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(n - 1))
    with pytest.raises(Exception, match="between 1 and"):
        plan_spans([1, 1], 3)


def test_span_count_follows_worker_memory():
    mib = 2**20
    assert spans_needed([100 * mib] * 6, []) == 1  # nothing known: one span
    assert spans_needed([100 * mib] * 6, [8 * 1024 * mib]) == 1
    assert spans_needed([100 * mib] * 6, [8 * 1024 * mib, 400 * mib]) == 3  # 200 MiB spans fit 400 / 1.5
    with pytest.raises(Exception, match="does not fit"):
        spans_needed([900 * mib], [400 * mib])


H = "ab" * 32


def step_done(t, client, sid, state_bytes=0, now=0.0, close=False, flops=10):
    return t.done(client, sid, state_bytes, now, input_hash=H, output_hash=H, flops=flops, wall_time_us=5,
                  started_at_us=1, ended_at_us=2, max_price=None, close=close)


def test_session_table_orders_bounds_and_expires():
    t = Sessions(SessionLimits(max_bytes=1000, max_client_share=1.0, max_sessions=3, max_per_client=2, max_ttl=60))
    assert t.begin("A", "s1", "p", 0, ttl=10, now=0) == 1000  # size not declared: all it may take, while it opens
    with pytest.raises(WorkerBusy, match="others are opening"):
        t.begin("B", "s9", "p", 0, ttl=10, now=0, declared=100)
    assert step_done(t, "A", "s1", 400, now=1) is None  # on the tab
    assert t.held_bytes == 400
    assert t.begin("A", "s2", "p", 0, ttl=10, now=1) == 600
    step_done(t, "A", "s2", 100, now=1)
    with pytest.raises(JobRejected, match="sessions open here"):
        t.begin("A", "s3", "p", 0, ttl=10, now=1)
    with pytest.raises(SessionLost):  # another client's id names nothing of its own
        t.begin("B", "s1", "p", 1, ttl=10, now=1)
    with pytest.raises(JobRejected, match="at step 1, not 2"):
        t.begin("A", "s1", "p", 2, ttl=10, now=1)
    with pytest.raises(JobRejected, match="program that opened it"):
        t.begin("A", "s1", "q", 1, ttl=10, now=1)
    t.begin("A", "s1", "p", 1, ttl=10, now=2)
    with pytest.raises(JobRejected, match="one step at a time"):
        t.begin("A", "s1", "p", 2, ttl=10, now=2)
    (gone,) = t.expired(now=100)  # s1 is running: never expires under a step
    assert gone.key == "A/s2" and gone.tab.steps == 1
    assert parse(gone.tab.job_id("s2"))[::2] == ("s2", 0) and parse(gone.tab.job_id("s2"))[3] == 0
    step_done(t, "A", "s1", now=3)
    assert t.expired(now=12) == []
    (gone,) = t.expired(now=13)  # idle 10 s since its last step
    assert gone.key == "A/s1" and gone.tab.steps == 2 and gone.tab.flops == 20
    assert len(t) == 0 and t.held_bytes == 0
    t.begin("A", "s4", "p", 0, ttl=1e9, now=0)
    t.failed("A", "s4", lost=False)  # never opened: nothing held
    assert len(t) == 0
    t.begin("A", "s5", "p", 0, ttl=1e9, now=0)
    step_done(t, "A", "s5", 10)
    assert t.expired(now=59) == [] and len(t.expired(now=60)) == 1  # ttl capped by the worker's max
    t.begin("A", "s6", "p", 0, ttl=5, now=0)
    tab = step_done(t, "A", "s6", 10, close=True).tab  # a one-step session: billed at once
    assert tab.steps == 1 and len(t) == 0 and t.held_bytes == 0
    assert t.close("A", "nope") is None


def test_a_closing_client_is_billed_for_the_steps_it_received_and_one_client_cannot_take_all_memory():
    t = Sessions(SessionLimits(max_bytes=1000, max_client_share=0.5))
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    for step in range(5):
        if step:
            t.begin("A", "s", "p", step, ttl=10, now=0)
        step_done(t, "A", "s", 400)
    ended = t.close("A", "s", received=3)  # the answer to steps 3 and 4 never reached it
    assert ended.tab.steps == 3 and ended.tab.last == 2
    # ...which ran all the same: not billed, but handed back to be counted against the client
    assert (ended.disclaimed.first, ended.disclaimed.last, ended.disclaimed.flops) == (3, 4, 20)
    assert parse(ended.disclaimed.job_id("s"))[2:] == (3, 4)
    t.begin("A", "s1", "p", 0, ttl=10, now=0)
    step_done(t, "A", "s1", 400)
    assert t.begin("A", "s2", "p", 0, ttl=10, now=0) == 100  # half of 1000 for one client, 400 held


def test_openings_declare_their_state_and_run_at_once_without_waiting_for_each_other():
    """From a review: one opening at a time let anyone hold every other client's openings off for as long as its own
    first step took. Each opening now reserves the size it declares; only what does not fit waits."""
    t = Sessions(SessionLimits(max_bytes=1000, max_client_share=0.5))
    assert t.begin("A", "a", "p", 0, ttl=10, now=0, declared=300) == 300
    assert t.begin("B", "b", "p", 0, ttl=10, now=0, declared=400) == 400  # while A's first step still runs
    assert t.held_bytes == 700
    with pytest.raises(WorkerBusy, match="others are opening"):  # 300 left: it may fit once one of them is done
        t.begin("C", "c", "p", 0, ttl=10, now=0, declared=350)
    with pytest.raises(JobRejected, match="takes 600 bytes"):  # over a client's share: it never will
        t.begin("C", "c", "p", 0, ttl=10, now=0, declared=600)
    step_done(t, "A", "a", 300)
    t.failed("B", "b", lost=False)  # B's opening failed: its reservation goes
    assert t.held_bytes == 300 and len(t) == 1
    assert t.begin("C", "c", "p", 0, ttl=10, now=0, declared=350) == 350


def test_free_identities_at_one_address_cannot_take_every_session_place_or_all_the_memory():
    t = Sessions(SessionLimits(max_bytes=1000, max_client_share=0.5, max_sessions=64, max_per_client=8,
                               max_per_host=16))
    for n in range(16):  # two identities' worth of sessions from one address
        t.begin(f"sybil-{n}", "s", "p", 0, ttl=10, now=0, host="10.0.0.9")
        step_done(t, f"sybil-{n}", "s", 30 if n < 15 else 0)
    with pytest.raises(JobRejected, match="at this address"):
        t.begin("sybil-new", "s", "p", 0, ttl=10, now=0, host="10.0.0.9")
    assert t.begin("honest", "s", "p", 0, ttl=10, now=0, host="10.0.0.1") == 500  # another address: its own share
    step_done(t, "honest", "s", 0)
    t.close("sybil-0", "s")
    # A place is free again, but the address holds 420 of its 500 bytes: a new identity there gets the rest only.
    assert t.begin("sybil-new", "s", "p", 0, ttl=10, now=0, host="10.0.0.9") == 80
    # Clients of a home worker come through its relay, all at the relay's circuit address: not one address there.
    relayed = "/ip4/10.0.0.7/tcp/4001/p2p/12D3KooWRelay/p2p-circuit"
    t2 = Sessions(SessionLimits(max_bytes=1000, max_per_host=2))
    for n in range(4):
        assert t2.begin(f"far-{n}", "s", "p", 0, ttl=10, now=0, host=relayed, declared=100) == 100
        step_done(t2, f"far-{n}", "s", 100)


def test_an_opening_that_may_fit_once_another_opening_of_its_own_ends_is_told_busy_not_refused():
    """From a review: only the worker-wide room counted running openings' reservations back, so an opening blocked
    by its own client's (or address's) running opening was refused outright though that one might fail."""
    t = Sessions(SessionLimits(max_bytes=1000, max_client_share=0.5))
    assert t.begin("A", "a", "p", 0, ttl=10, now=0) == 500  # an older client: no size declared, all its share
    with pytest.raises(WorkerBusy, match="others are opening"):
        t.begin("A", "b", "p", 0, ttl=10, now=0, declared=200)
    step_done(t, "A", "a", 100)  # it took 100 in the end
    assert t.begin("A", "b", "p", 0, ttl=10, now=0, declared=200) == 200


def test_a_close_asked_while_a_step_runs_ends_the_session_with_that_step_billed_as_the_client_said():
    """A client that closes while a step still runs (its answer lost, or the client gave up on it) is not told "not
    closed" and left to the session's expiry, which would bill the step it never got: the session ends when the step
    does, its tab cut at the steps the client said it received; a step that fails ends it too, billed the same way."""
    t = Sessions(SessionLimits(max_bytes=1000))
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    step_done(t, "A", "s", 300)
    t.begin("A", "s", "p", 1, ttl=10, now=0)
    assert t.close("A", "s", received=1) is None  # step 1 still runs
    with pytest.raises(SessionLost, match="being closed"):
        t.begin("A", "s", "p", 2, ttl=10, now=0)
    ended = step_done(t, "A", "s", 300)  # step 1 ends: so does the session
    assert (ended.tab.first, ended.tab.steps) == (0, 1) and ended.disclaimed.steps == 1
    assert len(t) == 0 and t.held_bytes == 0 and t.owing == 0

    t.begin("A", "u", "p", 0, ttl=10, now=0)
    step_done(t, "A", "u", 300)
    t.begin("A", "u", "p", 1, ttl=10, now=0)
    assert t.close("A", "u", received=1) is None
    ended = t.failed("A", "u", lost=False)
    assert ended.tab.steps == 1 and len(t) == 0 and t.held_bytes == 0

    t.begin("A", "v", "p", 0, ttl=10, now=0)
    step_done(t, "A", "v", 300)
    t.begin("A", "v", "p", 1, ttl=10, now=0)
    assert t.close("A", "v", received=0) is None  # it got nothing: nothing is billed
    ended = step_done(t, "A", "v", 300)
    assert ended.tab is None and ended.disclaimed.steps == 2 and len(t) == 0


def test_a_lost_session_takes_no_steps_but_its_tab_is_still_owed():
    t = Sessions(SessionLimits(max_bytes=1000))
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    step_done(t, "A", "s", 300)
    t.begin("A", "s", "p", 1, ttl=10, now=0)
    t.failed("A", "s", lost=True)
    assert t.held_bytes == 0  # the executor's memory is gone with it
    with pytest.raises(SessionLost):
        t.begin("A", "s", "p", 1, ttl=10, now=0)
    ended = t.close("A", "s")
    assert ended.tab.steps == 1 and len(t) == 0


def test_a_step_that_did_not_end_well_says_what_is_left_to_do_in_order():
    """One event in, actions out (the lanes' form): the job path carries them out, the table decides them."""
    from gpunet.protocol import PushTo, SessionStep
    from gpunet.worker.state.sessions import Bill, Drop, PushOn, Reoffer

    t = Sessions(SessionLimits(max_bytes=1000))
    to = PushTo("12D3KooWNext", "t", 1)
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    step_done(t, "A", "s", 300)
    step = SessionStep("s", 1, input_from="12D3KooWBefore", push_to=to)

    # Refused as busy before it began: the pushed input is held again for the client's retry; nothing else.
    assert t.step_failed("A", step, begun=False, busy=True, lost=False, pushed=b"x") == [Reoffer(b"x")]
    # Failed before it began (its push never came): the next span asks the client; the session is as it was.
    assert t.step_failed("A", step, begun=False, busy=False, lost=False, pushed=None) == [PushOn(to)]
    assert t.is_open("A", "s") and t.held_bytes == 300
    # Failed while running, its state lost: the next span asks the client, the session takes no more steps.
    t.begin("A", "s", "p", 1, ttl=10, now=0)
    assert t.step_failed("A", step, begun=True, busy=False, lost=True, pushed=b"x") == [PushOn(to)]
    assert t.held_bytes == 0 and t.is_open("A", "s")
    # Closed by its client while a step ran, then the step failed: the session ends, billed and freed.
    t.begin("A", "u", "p", 0, ttl=10, now=0)
    step_done(t, "A", "u", 100)
    t.begin("A", "u", "p", 1, ttl=10, now=0)
    assert t.close("A", "u", received=1) is None
    actions = t.step_failed("A", SessionStep("u", 1), begun=True, busy=False, lost=False, pushed=None)
    assert [type(a) for a in actions] == [Bill, Drop] and actions[0].ended.tab.steps == 1
    assert actions[1].key == actions[0].ended.key and not t.is_open("A", "u")


def test_a_leaving_worker_knows_which_sessions_still_owe_steps_and_ends_them_all():
    t = Sessions()
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    assert t.owing == 0  # opening, nothing done yet
    step_done(t, "A", "s", 10)
    t.begin("B", "idle", "p", 0, ttl=10, now=0)
    t.failed("B", "idle", lost=False)  # never opened: gone
    t.begin("B", "t", "p", 0, ttl=10, now=0)
    step_done(t, "B", "t", 10)
    assert t.owing == 2
    assert t.close("A", "s").tab.steps == 1 and t.owing == 1
    ended = t.end_all()  # the worker leaves: what its clients did not close, it bills itself
    assert [(e.client_id, e.tab.steps) for e in ended] == [("B", 1)]
    assert len(t) == 0 and t.owing == 0 and t.held_bytes == 0


def test_tabs_bill_every_step_once_in_receipts_of_a_bounded_size():
    t = Sessions(SessionLimits())
    t.begin("A", "s", "p", 0, ttl=10, now=0)
    tabs = []
    for step in range(TAB_STEPS * 2 + 5):
        if step:
            t.begin("A", "s", "p", step, ttl=10, now=0)
        tab = step_done(t, "A", "s", 8)
        if tab is not None:
            tabs.append(tab)
    assert [(x.first, x.last) for x in tabs] == [(0, TAB_STEPS - 1), (TAB_STEPS, 2 * TAB_STEPS - 1)]
    assert t.close("A", "s").tab.steps == 5
    # The client's own tab of the same steps is the same, chains and all: that is what it checks a receipt against.
    mine = Tab()
    for step in range(TAB_STEPS):
        mine.add(step, H, H, 10)
    assert (mine.input_chain, mine.output_chain, mine.flops) == (tabs[0].input_chain, tabs[0].output_chain,
                                                                  tabs[0].flops)
    other = Tab()
    for step in range(TAB_STEPS):
        other.add(step, H if step != 7 else "cd" * 32, H, 10)
    assert other.input_chain != mine.input_chain  # one changed step changes the receipt
    mine.nonce = "0badcafe"
    assert steps_of(mine.job_id("sess")) == TAB_STEPS and steps_of("a1b2c3") == 1
    assert tabs[0].nonce == tabs[1].nonce  # one session, one nonce; another session (or a reopened id) another
    assert mine.prefix(3).steps == 3 and mine.prefix(3).input_chain != mine.input_chain
    with pytest.raises(ValueError):
        mine.add(TAB_STEPS + 3, H, H, 1)
    heavy = Tab()
    heavy.add(0, H, H, TAB_FLOPS // 2)
    assert not heavy.full
    heavy.add(1, H, H, TAB_FLOPS // 2)
    assert heavy.full and heavy.steps == 2  # a tab worth a TFLOP is billed at once, however few its steps


def test_stateful_blocks_trace_and_round_trip_their_state():
    cfg = TinyConfig(n_layers=1, max_len=16)
    embed, block, head = tiny_gpt(cfg)
    span = _SpanModule([embed, block], [1, 3]).eval()
    state = (*embed.initial_state(), *block.initial_state())
    ids = torch.randint(0, cfg.vocab, (1, 3))
    job = Job.from_module(span, (ids, *state), dynamic_shapes=({1: Dim("T", min=1, max=16)}, (None,) * 4), state=4)
    assert job.manifest.state == 4 and job.manifest.state_bytes == 4 + 2 * 16 * 64 * 4 + 4
    assert Manifest.from_json(job.manifest.to_json()).state == 4
    with torch.no_grad():
        want = span(ids, *state)
    got = job.run_locally(ids, *state)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # Local generation through the blocks is the reference sessions are held to.
    assert len(generate_locally(tiny_gpt(cfg), ids, 4)) == 4


def test_a_block_passes_one_tensor_on_and_one_that_returns_more_is_told_how_to_fit():
    """Older Hugging Face blocks return ``(hidden_states,)``: taken as the tensor. A block returning more is refused
    eagerly, with the convention, not with torch.export's error from inside the next block."""
    class Block(torch.nn.Module):
        def __init__(self, outputs: int = 1):
            super().__init__()
            self.linear, self.outputs = torch.nn.Linear(4, 4), outputs

        def forward(self, x):
            return (self.linear(x),) * self.outputs

    torch.manual_seed(0)
    blocks, x = [Block(), Block(), Block()], torch.randn(2, 4)
    spans = trace_spans(blocks, (x,), None, [(0, 2), (2, 3)])
    got = spans[1].job.run_locally(spans[0].job.run_locally(x))
    with torch.no_grad():
        assert torch.equal(got, blocks[2](blocks[1](blocks[0](x)[0])[0])[0])
    with pytest.raises(UsageError, match=r"a block \(Block\) returned a tuple: .* passes one tensor to the next"):
        trace_spans([Block(), Block(2), Block()], (x,), None, [(0, 2), (2, 3)])
    with pytest.raises(UnsupportedProgram, match="blocks 0-1 fail on the example input: RuntimeError"):
        trace_spans([torch.nn.Linear(4, 4), torch.nn.Linear(5, 5)], (x,), None, [(0, 2)])  # a model error, as such


def test_a_span_of_stateless_blocks_traces_with_dynamic_shapes():
    """A span with no state passes torch.export one varargs entry, not an empty tuple for a state it lacks."""
    torch.manual_seed(0)
    blocks, x = [torch.nn.Linear(8, 8) for _ in range(3)], torch.randn(1, 3, 8)
    spans = trace_spans(blocks, (x,), ({1: Dim("S", min=1, max=16)},), [(0, 2), (2, 3)])
    longer = torch.randn(1, 11, 8)
    with torch.no_grad():
        assert torch.allclose(spans[1].job.run_locally(spans[0].job.run_locally(longer)),
                              blocks[2](blocks[1](blocks[0](longer))), atol=1e-6)


def test_a_state_must_come_back_in_the_same_shape():
    class Grows(torch.nn.Module):
        def forward(self, x, cache):
            return x * 2, torch.cat([cache, x], dim=0)

    with pytest.raises(UnsupportedProgram, match="same dtype and shape"):
        Job.from_module(Grows(), (torch.ones(1, 4), torch.zeros(2, 4)), state=1)

    class Fine(torch.nn.Module):
        def forward(self, x, h):
            return x + h, h + 1

    job = Job.from_module(Fine(), (torch.ones(1, 4), torch.zeros(1, 4)), state=1)
    raw = json.loads(job.manifest.to_json())  # edited as a hostile peer would
    assert Manifest.from_json(job.manifest.to_json()).state == 1
    for bad in (2, -1, "1", True):
        raw["state"] = bad
        with pytest.raises(JobRejected):
            Manifest.from_json(json.dumps(raw).encode())


def test_session_steps_parse_strictly():
    step = protocol.SessionStep("abc", 3, fresh=True, close=False, ttl=30)
    submit = protocol.Submit("abc.3", "0" * 64, 0, b"", session=step)
    assert protocol.decode(protocol.encode(submit), protocol.Submit).session == step
    opening = dataclasses.replace(submit, session=protocol.SessionStep("abc", 0, state_bytes=4096))
    assert protocol.decode(protocol.encode(opening), protocol.Submit).session.state_bytes == 4096
    for bad in ({"id": "a/b", "step": 0}, {"id": "a.b", "step": 0}, {"id": "x", "step": -1},
                {"id": "x", "step": 0, "ttl": 1e9}, {"id": "x", "step": 0, "ttl": 0},
                {"id": "x", "step": 0, "ttl": float("nan")}, {"id": "x", "step": True}, "x",
                {"id": "x", "step": 0, "state": -1}, {"id": "x", "step": 0, "state": "1"},
                {"id": "x", "step": 1, "state": 10}):
        wire = submit.to_wire()
        wire["session"] = bad
        with pytest.raises(ProtocolError):
            protocol.Submit.from_wire(wire)
    assert protocol.decode(protocol.encode(protocol.CloseSession("abc")), protocol.CloseSession).session_id == "abc"
    wire = submit.to_wire()
    wire["session"] = {"id": "x" * 25, "step": 0}  # a tab's job id must still fit in 64 characters
    with pytest.raises(ProtocolError):
        protocol.Submit.from_wire(wire)
    err = protocol.Error.of(SessionLost("gone"))
    assert err.code == "session_lost" and isinstance(err.exception(), SessionLost)


def test_pushed_steps_parse_strictly():
    peer = Identity.generate().peer_id
    pushed = protocol.Submit("abc.3p", "0" * 64, 0, b"", session=protocol.SessionStep(
        "abc", 3, input_from=peer, push_to=protocol.PushTo(peer, "def", 3)))
    assert protocol.decode(protocol.encode(pushed), protocol.Submit) == pushed
    for bad in ({"from": "not a peer id"}, {"from": peer, "step": 0},  # step 0 opens the session: sent whole
                {"push": {"peer": peer, "session": "a.b", "step": 3}}, {"push": {"peer": "x", "session": "d", "step": 3}},
                {"push": {"peer": peer, "session": "d", "step": -1}}, {"push": [peer, "d", 3]}):
        wire = pushed.to_wire()
        wire["session"] = {**wire["session"], **bad}
        with pytest.raises(ProtocolError):
            protocol.Submit.from_wire(wire)
    wire = pushed.to_wire()
    wire["inputs"], wire["inputs_size"] = b"abc", 3  # its input comes from the other worker, never with it
    with pytest.raises(ProtocolError, match="carries no inputs"):
        protocol.Submit.from_wire(wire)
    push = protocol.Push(peer, "def", 3, b"x" * (protocol.MAX_PUSH_BYTES + 1))
    with pytest.raises(ProtocolError, match="at most"):
        protocol.decode(protocol.encode(push), protocol.Push)
    result = protocol.Result(3, b"", b"xyz", "not a hash")
    with pytest.raises(ProtocolError, match="input_hash"):
        protocol.decode(protocol.encode(result), protocol.Result)


def test_a_pushed_input_reaches_only_the_step_that_names_its_sender_and_what_waits_is_bounded():
    from gpunet.worker.state.pushes import Pushes

    async def scenario():
        pushes = Pushes(max_bytes=10, max_held=2, keep=5.0)
        # Pushed before the step asks: held for it, and taken once.
        assert pushes.offer("w1", "alice", "s", 1, b"abc", now=0.0)
        assert not pushes.offer("w1", "alice", "s", 1, b"abc", now=0.0)  # one per sender and step
        assert await pushes.take("w1", "alice", "s", 1, timeout=1) == b"abc"
        assert len(pushes) == 0 and pushes.held_bytes == 0
        # The step asks first: the push goes straight to it.
        waiting = asyncio.ensure_future(pushes.take("w1", "alice", "s", 2, timeout=5))
        await asyncio.sleep(0)
        assert pushes.offer("w1", "alice", "s", 2, b"def", now=1.0)
        assert await waiting == b"def"
        # Someone other than the worker the step names pushes: held apart, never given to that step.
        assert pushes.offer("mallory", "alice", "s", 3, b"bad", now=1.0)
        assert await pushes.take("w1", "alice", "s", 3, timeout=0.05) is None
        # Bounded: by bytes and by count; and what waits too long goes.
        assert not pushes.offer("w1", "bob", "t", 1, b"x" * 8, now=1.0)  # 3 + 8 > 10 bytes
        assert pushes.offer("w1", "bob", "t", 1, b"x" * 7, now=1.0)
        assert not pushes.offer("w1", "carol", "u", 1, b"", now=1.0)  # two held already
        assert pushes.offer("w1", "carol", "u", 1, b"", now=7.0)  # the two before expired
        assert pushes.held_bytes == 0 and len(pushes) == 1
        one = Pushes(max_per_session=2)  # whoever knows one session's id cannot take the room of all
        assert one.offer("w1", "a", "s", 1, b"", now=0) and one.offer("w2", "a", "s", 2, b"", now=0)
        assert not one.offer("w3", "a", "s", 3, b"", now=0) and one.offer("w1", "a", "t", 3, b"", now=0)
        one.forget("a", "s")
        assert len(one) == 1 and one.offer("w3", "a", "s", 3, b"", now=0)
        # "It will not come" (None) ends the wait at once; so does a cancel, or another step of the session.
        waiting = asyncio.ensure_future(pushes.take("w1", "alice", "s", 4, timeout=5))
        await asyncio.sleep(0)
        assert pushes.offer("w1", "alice", "s", 4, None, now=7.0) and await waiting is None
        waiting = asyncio.ensure_future(pushes.take("w1", "alice", "s", 5, timeout=5))
        await asyncio.sleep(0)
        pushes.call_off("alice", "s")
        assert await waiting is None
        first = asyncio.ensure_future(pushes.take("w1", "alice", "s", 6, timeout=5))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(pushes.take("w1", "alice", "s", 7, timeout=5))
        await asyncio.sleep(0)
        assert await first is None and not second.done()
        pushes.offer("w1", "alice", "s", 7, b"g", now=7.0)
        assert await second == b"g"

    asyncio.run(scenario())


def test_a_pushed_output_is_byte_for_byte_the_input_the_client_would_send():
    """Both sides hash the same bytes: the next span's worker bills (and the client checks) the input it ran on."""
    from gpunet.job import tensors
    from gpunet.worker.handoff import as_next_input

    for t in (torch.randn(1, 1, 768), torch.randn(1, 7, 3).half(), torch.arange(5), torch.randn(())):
        assert as_next_input(tensors.encode({"output_0": t})) == tensors.encode({"input_0": t})
    assert as_next_input(tensors.encode({"output_0": torch.ones(2), "output_1": torch.ones(2)})) is None
    assert as_next_input(tensors.encode({"output_0": torch.ones(protocol.MAX_PUSH_BYTES // 4)})) is None
    assert as_next_input(b"\xff" * 20) is None and as_next_input(b"") is None


def _session(key, step, **kw):
    from gpunet.worker.state.limits import SessionRun

    return SessionRun(key, step, kw.get("fresh", True), kw.get("close", False), kw.get("room", 1 << 20))


def test_an_executor_keeps_each_session_apart_and_refuses_a_state_that_lies_about_its_size(tmp_path):
    import asyncio

    from gpunet.job import tensors
    from gpunet.job.format import ProgramParts
    from gpunet.worker.executor import Executor

    class Counter(torch.nn.Module):
        def forward(self, x, h):
            return x + h, h + 1

    job = Job.from_module(Counter(), (torch.ones(1, 4), torch.zeros(1, 4)), state=1)

    class Grows(torch.nn.Module):  # declares a (1, 4) state, returns a (2, 4) one
        def forward(self, x, h):
            return x, torch.cat([h, h])

    traced = Job.from_module(Grows(), (torch.ones(1, 4), torch.zeros(1, 4)))
    raw = json.loads(traced.manifest.to_json())
    raw["state"] = 1
    raw["outputs"][1]["shape"] = [1, 4]
    liar = Job(ProgramParts(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode(), traced.parts.graph,
                            traced.parts.weights))
    x = tensors.encode({"input_0": torch.ones(1, 4)})

    async def scenario(ex):
        outs = []
        for step in range(3):  # two sessions of the same program, interleaved: each counts on its own
            for key in ("A/s", "B/s"):
                r = await ex.run(job.program_hash, job.to_bytes() if step == 0 else None, x,
                                 session=_session(key, step))
                outs.append((key, tensors.decode(r.outputs)["output_0"][0, 0].item(), r.state_bytes))
        assert outs == [(k, 1.0 + step, 16) for step in range(3) for k in ("A/s", "B/s")]
        with pytest.raises(JobRejected, match="new state"):
            await ex.run(liar.program_hash, liar.to_bytes(), x, session=_session("A/t", 0))
        with pytest.raises(SessionLost):  # refused: nothing was kept for it
            await ex.run(liar.program_hash, None, x, session=_session("A/t", 1))
        await ex.drop_sessions(["A/s"])
        with pytest.raises(SessionLost):
            await ex.run(job.program_hash, None, x, session=_session("A/s", 3))
        r = await ex.run(job.program_hash, None, x, session=_session("B/s", 3, close=True))
        assert tensors.decode(r.outputs)["output_0"][0, 0].item() == 4.0
        assert not ex.holds_session("B/s")

    with Executor(processes=2, memory_budget_bytes=1 << 30, cache_dir=tmp_path, sandbox=False) as ex:
        asyncio.run(scenario(ex))


def test_a_position_counter_can_advance_by_a_symbolic_size():
    """`pos + x.shape[1]` (a symbolic size as the other operand of a tensor op) converts, and counts as a number."""

    class Counts(torch.nn.Module):
        def forward(self, ids, pos):
            return ids.float().sum(1) + pos, pos + ids.shape[1]

    module = Counts()
    job = Job.from_module(module, (torch.ones(1, 4, dtype=torch.long), torch.zeros(1)),
                          dynamic_shapes=({1: Dim("T", min=1, max=64)}, None), state=1)
    for t in (1, 3, 9):
        x = torch.randint(0, 5, (1, t))
        assert all(torch.equal(a, b) for a, b in zip(job.run_locally(x, torch.full((1,), 2.0)),
                                                     module(x, torch.full((1,), 2.0))))


# --- checked steps (gpunet.client.sessions.audit), the rulings alone -----------------------------------------------


class _DoublingJob:
    """A span's job stand-in: y = 2x, and the state counts steps."""

    def run_locally(self, x, count):
        return x * 2, count + 1


class _FakeSpan:
    stateful, fresh = True, True

    def __init__(self):
        self.job, self.state = _DoublingJob(), (torch.zeros(()),)


class _FakeCore:
    def __init__(self):
        from gpunet.client.reputation import Reputation

        self.reputation = Reputation()


def _checks(mode):
    from gpunet.client.sessions.audit import SessionChecks

    return SessionChecks(_FakeCore(), [_FakeSpan()], mode, lambda span: None, 60.0, lambda receipt: None)


def _done(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def test_a_checked_step_is_ruled_by_the_replay_and_a_checkers_word_by_the_clients_own():
    from gpunet.client.sessions.audit import Caught
    from gpunet.errors import VerificationFailed

    history = [torch.full((2,), float(k)) for k in range(6)]  # the span doubles: the right output at step k is 2k
    right = [2 * h for h in history]

    async def main():
        checks = _checks("local-sample")
        # Step 0 due: replayed and compared; step 1 returned unchecked, waiting; step 2 carries a receipt: compared,
        # with step 1, before anything is paid.
        await checks.settle(0, "0-1", "honest", 0, right[0], checks.replay(0, 0, history, "honest"), history, False)
        await checks.settle(0, "0-1", "honest", 1, right[1], None, history, False)
        assert checks.report.checked == 1 and len(checks.spans[0].pending) == 1
        await checks.settle(0, "0-1", "honest", 2, right[2], None, history, True)
        assert checks.report.checked == 3 and not checks.spans[0].pending
        assert checks.reputation.streak("honest") == 3
        # A wrong output caught at its own step: the replay's output stands in for it.
        with pytest.raises(Caught) as caught:
            await checks.settle(0, "0-1", "liar", 3, torch.zeros(2), checks.replay(0, 3, history, "liar"), history,
                                False)
        assert torch.equal(caught.value.truth, right[3])
        assert checks.report.caught == ["liar"] and "liar" in checks.banned and checks.reputation.avoided("liar")
        # A wrong output that went out unchecked, found at the next check: it cannot be taken back.
        await checks.settle(0, "0-1", "sly", 4, torch.zeros(2), None, history, False)
        with pytest.raises(VerificationFailed, match="already returned"):
            await checks.settle(0, "0-1", "sly", 5, right[5], checks.replay(0, 5, history, "sly"), history, False)
        assert "sly" in checks.banned

        # The checker says 7, the worker 2: the client's own replay (2 x 1) sides with the worker.
        checks = _checks("adaptive")
        checks.spans[0].checker.worker_id = "checker"
        checks.spans[0].checker.drop = lambda pay: None
        await checks.settle(0, "0-1", "worker", 1, right[1], _done([torch.full((2,), 7.0)]), history, False)
        assert checks.report.caught == ["checker"] and checks.reputation.avoided("checker")
        assert not checks.reputation.avoided("worker")
        # This machine cannot replay: one worker's word against another's brands nobody, and the step fails.
        checks = _checks("adaptive")
        checks.spans[0].checker.worker_id = "established"
        for _ in range(20):
            checks.reputation.record("established", "valid", checked=True)
        checks.spans[0].checker.drop = lambda pay: None

        async def cannot(*args):
            return None

        checks._own = cannot
        with pytest.raises(VerificationFailed, match="could not replay"):
            await checks.settle(0, "0-1", "worker", 1, right[1], _done([torch.full((2,), 7.0)]), history, False)
        assert not checks.report.caught and not checks.reputation.avoided("worker")

    asyncio.run(main())


def test_a_span_every_worker_failed_waits_for_another_before_trying_them_again(monkeypatch):
    """When every worker a session sees has failed a span once, the span waits a little for another to show up (on
    a loaded machine live workers' records lapse for a moment, while a killed worker's has not expired: CI saw a span
    moved three times to the killed one) before it tries the failed ones again."""
    from gpunet.client.sessions import session as session_module
    from gpunet.errors import NoWorkersAvailable

    monkeypatch.setattr(session_module, "OTHERS_WAIT", 0.5)
    monkeypatch.setattr(session_module, "OTHERS_POLL", 0.01)
    calls = []

    def records_back_after(n):
        async def place(exclude):
            calls.append(set(exclude))
            if len(calls) < n:
                raise NoWorkersAvailable("none outside those that failed it")
            return "live"
        return place

    another = session_module.SessionCore._another
    assert asyncio.run(another(records_back_after(3), {"dead"})) == "live"
    assert calls == [{"dead"}] * 3  # the failed one stayed excluded all along
    calls.clear()
    assert asyncio.run(another(records_back_after(10**6), {"dead"})) is None  # none came: the caller tries them again
    assert len(calls) > 1


def test_a_span_whose_only_listed_worker_lied_goes_to_a_worker_whose_record_lapsed_a_moment_ago(monkeypatch):
    """The liar caught is the one worker listed (under load the honest ones' records lapsed together: CI saw it):
    once none shows up within OTHERS_WAIT the span tries the honest worker seen last rather than fail the session;
    with no such worker the session's error stands."""
    from types import SimpleNamespace

    from gpunet.client.routing import Requirements, Router
    from gpunet.client.sessions import session as session_module
    from gpunet.errors import NoWorkersAvailable
    from tests.test_routing import worker

    monkeypatch.setattr(session_module, "OTHERS_WAIT", 0.05)
    monkeypatch.setattr(session_module, "OTHERS_POLL", 0.01)
    router = Router()
    router.update([worker("liar"), worker("honest")])
    router.update([worker("liar")])  # the honest worker's record lapsed from this look
    session = object.__new__(session_module.SessionCore)
    session.seq = SimpleNamespace(core=SimpleNamespace(router=router))

    async def nothing_listed(exclude):
        raise NoWorkersAvailable("the one known worker does not meet the requirements: it already failed this job")

    placed = session_module._Placed(failed={"liar"})
    chosen = asyncio.run(session._choose(nothing_listed, placed, {"liar"}, Requirements(), set()))
    assert chosen.id == "honest"
    with pytest.raises(NoWorkersAvailable, match="already failed"):
        asyncio.run(session._choose(nothing_listed, placed, {"liar", "honest"}, Requirements(), set()))
    with pytest.raises(NoWorkersAvailable):  # a first placement fails with its reasons
        asyncio.run(session._choose(nothing_listed, session_module._Placed(), {"liar"}, Requirements(), set()))
