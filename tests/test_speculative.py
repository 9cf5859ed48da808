"""Speculative decoding (issue 43, item 3): a draft on the client proposes tokens, one session step checks them
through every span, and the output is token for token what decoding without a draft gives."""

import pytest
import torch

from gpunet.client.llm.speculative import Draft
from gpunet.errors import UsageError
from gpunet.llm import load
from gpunet.testing.llm import save_checkpoint, tiny_causal_lm
from tests.swarm import wait_for

MAX = 64


def test_a_draft_proposes_greedily_and_keeps_its_cache_across_a_cut():
    model = tiny_causal_lm("llama", seed=2).eval()
    draft = Draft(model)
    ids = [5, 9, 17, 3]
    first = draft.propose(ids, 4)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert first == want
    # The model kept two of them and then said another token: the cache is cut back, not rebuilt, and the next
    # proposals are what the draft says after that context.
    context = ids + first[:2] + [(first[2] + 1) % 300]
    nxt = draft.propose(context, 3)
    with torch.no_grad():
        assert nxt == model.generate(torch.tensor([context]), max_new_tokens=3, do_sample=False)[0, len(context):] \
            .tolist()
    assert Draft(model, vocab=min(first) if min(first) else 1).propose(ids, 4) == []  # past the served vocabulary


@pytest.mark.swarm
def test_speculative_decoding_over_a_swarm_gives_the_tokens_of_plain_decoding(swarm, client_for, tmp_path):
    """Three spans on three workers. With the served model itself as its draft every proposal is kept (the spans take
    five tokens a step); with another random model nearly none are (every step drops the rest from the spans'
    caches). Greedy, both equal HF's ``generate``; sampled with a seed, both equal the same sampling without a
    draft; a batch of prompts or a silly draft_tokens is refused."""
    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=5)
    other = save_checkpoint(tmp_path / "other", "llama", seed=6)
    swarm.start_workers(3)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    lm = client.causal_lm(folder, max_length=MAX, spans=3)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    ids = tok(["the quick brown fox jumps over"], return_tensors="pt").input_ids
    with torch.no_grad():
        want = reference.generate(ids, max_new_tokens=20, do_sample=False)
    well, _ = load(folder)
    for draft, kept in ((well, "all"), (load(other)[0], "few")):
        got = lm.generate(ids, max_new_tokens=20, do_sample=False, draft=draft, draft_tokens=4)
        assert torch.equal(got, want), kept
        usage = lm.last
        assert usage.completion_tokens == [20] and usage.draft_proposed > 0
        if kept == "all":
            assert usage.draft_accepted == usage.draft_proposed
        else:
            assert usage.draft_accepted < usage.draft_proposed  # steps that dropped proposals from the caches
        streamed = torch.cat(list(lm.stream(ids, max_new_tokens=20, do_sample=False, draft=draft)))
        assert torch.equal(streamed, want[0, ids.shape[1]:])

    plain = lm.generate(ids, max_new_tokens=16, do_sample=True, seed=7, temperature=0.9, top_k=40)
    for draft in (well, tmp_path / "other"):
        assert torch.equal(lm.generate(ids, max_new_tokens=16, do_sample=True, seed=7, temperature=0.9, top_k=40,
                                       draft=draft), plain)

    with pytest.raises(UsageError, match="one row"):
        lm.generate(ids.repeat(2, 1), max_new_tokens=4, draft=well)
    with pytest.raises(UsageError, match="draft_tokens"):
        lm.generate(ids, max_new_tokens=4, draft=well, draft_tokens=0)


@pytest.mark.swarm
def test_a_worker_that_changes_the_control_channel_is_caught(swarm, client_for, tmp_path):
    """A worker that corrupts its outputs changes the channel that tells the spans how many tokens to drop (a shift
    the checks' tolerance would pass in bf16 could make later spans keep a refused proposal): the client sees the last
    span's channel differ from what it sent and ends the generation, trusting nothing of it."""
    from gpunet.errors import VerificationFailed

    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=5)
    swarm.start_worker("--fault-corrupt-fraction", "1.0")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 1, 30, "the worker")
    lm = client.causal_lm(folder, max_length=MAX, spans=1)
    ids = torch.tensor([[5, 9, 17, 3]])
    with pytest.raises(VerificationFailed, match="control channel"):
        lm.generate(ids, max_new_tokens=4, do_sample=False, draft=folder)
