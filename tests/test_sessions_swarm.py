"""A model spread over several workers (Petals-style) and inference sessions with state on the workers, on a real
swarm, through the public API."""

import pytest
import torch
from torch.export import Dim

import gpunet
import gpunet.protocol
from gpunet.dht.records import WorkerState
from gpunet.ledger.tabs import Tab, steps_of
from gpunet.models import TinyConfig, generate_locally, tiny_gpt
from tests.swarm import wait_for

pytestmark = pytest.mark.swarm

CFG = TinyConfig(n_layers=4, max_len=96)


def sequential(client, blocks, spans=3):
    return client.sequential(blocks, example_inputs=(torch.randint(0, CFG.vocab, (1, 4)),),
                             dynamic_shapes=({1: Dim("T", min=1, max=CFG.max_len)},), spans=spans)


def generate(session, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    x, out = prompt, []
    for _ in range(new_tokens):
        logits = session.step(x)
        token = int(logits[0, -1].argmax())
        out.append(token)
        x = torch.tensor([[token]])
    return out


def generate_in_one_session(client, workers: int, seed: int, new_tokens: int):
    """Once ``client`` sees ``workers`` workers: ``new_tokens`` generated through one session, local generation's
    tokens, and the (closed) session."""
    wait_for(lambda: len(client.workers(refresh=True)) == workers, 30, f"all {workers} workers")
    blocks = tiny_gpt(CFG, seed=seed)
    remote = sequential(client, blocks)
    prompt = torch.randint(0, CFG.vocab, (1, 5))
    want = generate_locally(blocks, prompt, new_tokens)
    with remote.session() as s:
        got = generate(s, prompt, new_tokens)
    return got, want, s


def test_spread_model_forward_and_session_equal_local(swarm, client_for):
    workers = swarm.start_workers(3)
    ids = {swarm.worker_id(w) for w in workers}
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    blocks = tiny_gpt(CFG, seed=1)
    remote = sequential(client, blocks)
    assert [(s.start, s.stop) for s in remote.spans] == [(0, 2), (2, 4), (4, 6)]

    prompt = torch.randint(0, CFG.vocab, (1, 6))
    with torch.no_grad():
        local = prompt
        h = local
        for b, st in zip(blocks, [b.initial_state() if hasattr(b, "initial_state") else () for b in blocks]):
            h = b(h, *st)[0] if st else b(h)
    assert torch.equal(remote(prompt), h)  # stateless: each span from its first state

    want = generate_locally(blocks, prompt, 64)
    with remote.session() as s:
        got = generate(s, prompt, 64)
        placement = s.placement
        receipts = s.receipts
        pushed = s.pushed
    assert got == want
    # After the first step (which opens each span's session), every span's input went worker to worker.
    assert pushed == 2 * 63
    assert len({w for _, _, w in placement}) == 3 and {w for _, _, w in placement} <= ids
    assert all(r.is_countersigned for r in receipts)
    # Billed by tabs: one receipt per span for its 64 steps, not 192 ledger rows.
    assert sorted(steps_of(r.job_id) for r in receipts) == [64, 64, 64] and len(receipts) == 3
    assert {r.job_id for r in client.ledger.receipts()} >= {r.job_id for r in receipts}


def test_session_survives_a_killed_worker_with_identical_tokens(swarm, client_for):
    workers = swarm.start_workers(4)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 4, 30, "all four workers")
    blocks = tiny_gpt(CFG, seed=2)
    remote = sequential(client, blocks)
    prompt = torch.randint(0, CFG.vocab, (1, 5))
    want = generate_locally(blocks, prompt, 36)
    by_id = {swarm.worker_id(w): w for w in workers}
    with remote.session() as s:
        got = generate(s, prompt, 12)
        victim_id = s.placement[1][2]
        pushed = s.pushed
        by_id[victim_id].kill()  # SIGKILL: a crash, as far as the network can tell
        got += generate(s, torch.tensor([[got[-1]]]), 24)
        assert s.moves >= 1
        assert s.placement[1][2] != victim_id
        # The step that found the victim gone went by way of the client, and so did the 15 after it; then the
        # workers pushed again (to the replacement too).
        assert pushed == 2 * 11 and s.pushed == pushed + 2 * 8
    receipts = s.receipts  # closing paid the steps not billed yet
    assert got == want
    span_1 = remote.spans[1].job.program_hash  # (under load the replacement may also hold another span: a worker
    # that held none could have been busy or joining when the span moved)
    replacement = [r for r in receipts if r.worker_id == s.placement[1][2] and r.program_hash == span_1]
    # The replacement replayed the span's 12 steps and ran the 24 after: paid for exactly that work; the killed
    # worker's unbilled steps are not paid (it is gone), the other spans' 36 steps each are.
    assert sum(steps_of(r.job_id) for r in replacement) == 36
    assert not [r for r in receipts if r.worker_id == victim_id]
    assert sum(steps_of(r.job_id) for r in receipts) == 3 * 36
    # The client saw the victim fail: the replacement was not sent to fetch the span's program from it (dialling a
    # dead peer cost a move 5 s).
    lines = by_id[s.placement[1][2]].lines
    assert any("INFO" in line for line in lines)  # its log, where a fetch from the victim would say so, is here
    assert not [line for line in lines if victim_id[-8:] in line]


def test_a_worker_pushing_the_next_span_a_wrong_input_changes_no_token(swarm, client_for):
    """A worker answers its client rightly but pushes the next span's worker something else: that worker says which
    input it ran on, the client sees it is not the output it got, rebuilds that span's state elsewhere and sends the
    session's activations itself from then on. The tokens are those of local generation."""
    swarm.start_workers(3, "--fault-corrupt-pushes")
    swarm.start_workers(1)
    got, want, s = generate_in_one_session(client_for(swarm), workers=4, seed=4, new_tokens=10)
    assert got == want
    # Three of four workers lie, so one of the two pushing spans' workers is a liar on the first pushed step: the
    # span after it moved at once, and nothing was pushed after.
    assert s.moves >= 1 and s.pushed <= 1


def test_pushes_lost_on_the_way_cost_a_short_wait_and_no_move(swarm, client_for):
    """Workers whose pushes never arrive (a peer they cannot dial, a full room): the next span's step is waited for a
    couple of seconds once the client holds its input, then cancelled (the worker stops waiting, its state untouched)
    and sent with its input; the session goes on by way of the client, on the same workers."""
    swarm.start_workers(3, "--fault-drop-pushes")
    # (each step of the second and third spans waits for its push first: 5 tokens, not more, on a loaded CI machine)
    got, want, s = generate_in_one_session(client_for(swarm), workers=3, seed=5, new_tokens=5)
    assert got == want
    assert s.pushed == 0 and s.moves == 0
    # Closing paid each worker for its 5 steps, once (the cancelled attempts ran nothing).
    assert sorted(steps_of(r.job_id) for r in s.receipts) == [5, 5, 5]


def test_a_draining_worker_finishes_its_step_and_hands_its_span_off(swarm, client_for):
    workers = swarm.start_workers(4)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 4, 30, "all four workers")
    blocks = tiny_gpt(CFG, seed=4)
    remote = sequential(client, blocks)
    prompt = torch.randint(0, CFG.vocab, (1, 5))
    want = generate_locally(blocks, prompt, 20)
    by_id = {swarm.worker_id(w): w for w in workers}
    with remote.session() as s:
        got = generate(s, prompt, 10)
        leaving_id = s.placement[0][2]
        leaving = by_id[leaving_id]
        leaving.request_stop()  # SIGTERM, as `systemctl stop` sends: it drains, taking no new steps
        got += generate(s, torch.tensor([[got[-1]]]), 10)
        assert s.placement[0][2] != leaving_id and s.moves == 1
    assert got == want
    assert leaving.terminate(timeout=60) == 0  # it left cleanly (waited for: a second SIGTERM would hurry it)
    # Its steps were billed when the client closed the session there, and paid: the 10 before the SIGTERM, and an
    # 11th when the signal landed while that step was in hand (a draining worker finishes it, then takes no more).
    paid = [r for r in s.receipts if r.worker_id == leaving_id]
    assert sum(steps_of(r.job_id) for r in paid) in (10, 11) and all(r.is_countersigned for r in paid)


def test_sessions_are_private_bounded_and_expire(swarm, client_for):
    (worker,) = swarm.start_workers(1, "--max-sessions-per-client", "1", "--session-ttl", "30")
    client, stranger = client_for(swarm), client_for(swarm, "stranger")
    cfg = TinyConfig(n_layers=1, max_len=32)
    blocks = tiny_gpt(cfg, seed=3)
    remote = client.sequential(blocks, example_inputs=(torch.randint(0, 256, (1, 2)),), spans=1,
                               dynamic_shapes=({1: Dim("T", min=1, max=cfg.max_len)},))
    prompt = torch.randint(0, 256, (1, 3))
    want = generate_locally(blocks, prompt, 6)
    with remote.session() as s:
        got = generate(s, prompt, 3)
        # Another client naming this session (its id seen, or guessed) reaches nothing: sessions are per client.
        span, placed = remote.spans[0], s._core.placed[0]
        step = gpunet.protocol.SessionStep(placed.session_id, placed.step)
        with pytest.raises(gpunet.SessionLost):
            stranger._call(stranger._core.run_step(span.job, (torch.tensor([[1]]),), placed.worker_id, step,
                                                   span.state, Tab()))
        # One session per client on this worker: a second is refused, with the reason.
        with pytest.raises(gpunet.GpunetError, match="sessions open here"):
            with remote.session() as other:
                other.step(prompt)
        got += generate(s, torch.tensor([[got[-1]]]), 3)  # untouched by all that
    assert got == want
    # Closed: the worker freed it, so the one place is free again.
    with remote.session(ttl=2) as s:
        got = generate(s, prompt, 3)
        worker.wait_for_line(r"1 session\(s\) expired; their state is freed \(0 session\(s\), 0 bytes", timeout=30)
        # Expired on the worker: the next step finds no state, and the session rebuilds it by replay.
        got += generate(s, torch.tensor([[got[-1]]]), 3)
        assert s.moves == 1
    assert got == want


def test_a_worker_lying_in_a_session_is_caught_by_a_replay_and_the_tokens_stay_exact(swarm, client_for):
    """The cheapest worker corrupts every output. verify='local-sample': the client replays the span beside it and
    catches the first wrong step; verify='adaptive' (another client, which does not know the liar yet): a checker
    worker's shadow session disagrees, and the client's own replay decides. Either way the wrong output is never
    returned (the replay's stands), the liar is not paid, and the span moves."""
    liar = swarm.start_worker("--price", "0.5", "--fault-corrupt-fraction", "1.0")
    swarm.start_workers(2)
    liar_id = swarm.worker_id(liar)
    blocks = tiny_gpt(CFG, seed=5)
    prompt = torch.randint(0, CFG.vocab, (1, 5))
    want = generate_locally(blocks, prompt, 8)
    for name, mode in (("sampler", "local-sample"), ("adaptive", "adaptive")):
        client = client_for(swarm, name)
        # Online as this client sees them: a record still saying "joining" (CI saw it under load) is passed over,
        # and the spans would go to the honest two.
        wait_for(lambda: sum(w.record.state is WorkerState.ONLINE for w in client.workers(refresh=True)) == 3, 60,
                 "all three workers online")
        remote = client.sequential(blocks, example_inputs=(torch.randint(0, CFG.vocab, (1, 4)),), spans=2,
                                   dynamic_shapes=({1: Dim("T", min=1, max=CFG.max_len)},),
                                   requirements=gpunet.Requirements(verify=mode, prefer="cheapest"))
        with remote.session() as s:
            got = generate(s, prompt, 8)
            assert liar_id in s.checks.caught and s.moves >= 1
            assert liar_id not in {w for _, _, w in s.placement}
            assert s.checks.checked >= 8
        assert got == want, mode
        assert liar_id not in {r.worker_id for r in s.receipts}  # its steps are not paid
        assert liar_id not in {r.worker_id for r in client.ledger.receipts()}
        assert client._core.reputation.avoided(liar_id)
        # Two spans of 8 steps (the moved span's new worker replayed the caught step, its answer taken from the
        # replay). With adaptive, checker workers took each span's steps again in shadow sessions, paid like any work.
        paid = sum(steps_of(r.job_id) for r in s.receipts)
        assert paid == 16 if mode == "local-sample" else paid >= 32, (mode, paid)
