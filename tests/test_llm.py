"""Language models from a checkpoint with no glue (issue 39): HF's own decoder layers of every family as gpunet
blocks, generation as HF's ``generate`` does it, over a real swarm through ``client.causal_lm``."""

import pytest
import torch
from torch.export import Dim

from gpunet.client.sessions.spans import trace_spans
from gpunet.errors import GpunetError, UsageError
from gpunet.client.llm import adapter
from gpunet.llm import load
from gpunet.testing.llm import FAMILIES, save_checkpoint, tiny_causal_lm
from tests.swarm import wait_for

MAX = 48
#: One family of each kind the swarm test takes in CI's bounded run (``pytest --full``: all of them): learned positions
#: and Conv1D (gpt2), rotary with grouped KV heads (llama), ALiBi (bloom), a sliding window with soft-capping (gemma2),
#: experts (qwen2_moe). The other nine share these kinds' mechanisms (a swarm test of every family took 2.7 minutes of
#: a loaded CI run).
BOUNDED_FAMILIES = ("bloom", "gemma2", "gpt2", "llama", "qwen2_moe")


def _generate_through_programs(model, prompt: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens with the decoder layers run as the workers run them: traced into two spans, each step through
    gpunet's validator and interpreter (``Job.run_locally``), the ends on the client's side."""
    blocks = adapter.blocks_of(adapter.prepare(model), MAX)
    ends = adapter.Ends(model)
    hidden = adapter.text_config(model.config).hidden_size
    spans = trace_spans(blocks, (adapter.with_control(torch.zeros(1, 2, hidden)),), ({1: Dim("T", min=1, max=MAX)},),
                        [(0, 2), (2, len(blocks))])
    states = [span.state for span in spans]
    x, seen, out = prompt, 0, []
    for _ in range(new):
        h = adapter.with_control(ends.embed(x, torch.arange(seen, seen + x.shape[1])[None]))
        seen += x.shape[1]
        for i, span in enumerate(spans):
            h, *state = span.job.run_locally(h, *states[i])
            states[i] = tuple(state)
        out.append(int(ends.head(adapter.hidden_of(h)[:, -1:])[0, -1].argmax()))
        x = torch.tensor([[out[-1]]])
    return out


def _hf_greedy(folder, text: str, new: int):
    """HF's model from ``folder``, the prompt's ids, and HF's greedy ``generate`` of ``new`` tokens."""
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    ids = tok([text], return_tensors="pt").input_ids
    with torch.no_grad():
        return reference, ids, reference.generate(ids, max_new_tokens=new, do_sample=False)


@pytest.mark.parametrize("family", ["bloom", "gemma2", "qwen2_moe"])
def test_a_family_generates_what_hf_generates_through_the_programs_workers_run(family):
    """A family's own layers (ALiBi; sliding window and soft-capping; experts) traced with gpunet's static cache, run
    step by step through the validator and interpreter workers run, no network: a 12-token prompt and 20 greedy tokens
    equal HF's ``generate`` on the same weights (every family goes over a real swarm below)."""
    model = tiny_causal_lm(family, seed=3)
    prompt = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 12:].tolist()
    assert len(want) == 20 or want[-1] == model.generation_config.eos_token_id  # HF stops at the end token
    assert _generate_through_programs(model, prompt, 20)[:len(want)] == want


def test_a_model_that_is_no_decoder_is_refused_saying_what_is_missing():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(adapter.UnsupportedModel, match="BertModel is not a decoder-only causal language model"):
        adapter.prepare(bert)



@pytest.mark.swarm
def test_a_checkpoint_folder_served_by_three_workers_generates_as_hf_does(swarm, client_for, tmp_path):
    """The whole way a user goes: a folder (config, safetensors, tokenizer), three workers, no glue. A batch of two
    prompts of different lengths (left padding), greedy and sampled with a seed, equals HF's ``generate``; the
    stream yields the same tokens; every request leaves receipts naming who served which span. The workers replay
    their decode steps through the CPU stand-in for CUDA graphs (FAKE HARDWARE: FakeCudaGraphs), so the graphs' way
    is held to HF's tokens across the whole stack."""
    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=5)
    workers = {swarm.worker_id(w) for w in swarm.start_workers(3, "--fake-cuda-graphs")}
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    lm = client.causal_lm(folder, max_length=MAX, spans=3)
    assert lm.spans == [(0, 2), (2, 3), (3, 4)]
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    batch = tok(["hello network", "the quick brown fox jumps over"], return_tensors="pt", padding=True,
                padding_side="left")
    with torch.no_grad():
        want = reference.generate(**batch, max_new_tokens=12, do_sample=False)
    got = lm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    usage = lm.last
    assert usage.prompt_tokens == [int(m.sum()) for m in batch.attention_mask]
    assert usage.completion_tokens == [12, 12]
    # Spans spread over the workers it sees (tests/test_sessions_swarm.py holds routing to that); a loaded machine
    # can let records lapse for a moment, so here only who served what is checked against the receipts.
    ids = {w for row in usage.placement for _, _, w in row}
    assert ids <= workers and all(r.is_countersigned for r in usage.receipts) and usage.cost > 0
    assert {r.worker_id for r in usage.receipts} == ids

    streamed = torch.stack(list(lm.stream(batch.input_ids, batch.attention_mask, max_new_tokens=12)), dim=1)
    assert torch.equal(streamed, want[:, batch.input_ids.shape[1]:])

    torch.manual_seed(11)
    with torch.no_grad():
        sampled = reference.generate(**batch, max_new_tokens=8, do_sample=True, temperature=0.7, top_k=40,
                                     top_p=0.9, repetition_penalty=1.3)
    assert torch.equal(lm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=8, do_sample=True,
                                   temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=11), sampled)

    one = batch.input_ids[1:]
    with torch.no_grad():
        logits = reference(one).logits
    assert torch.allclose(lm(one).logits, logits, atol=1e-4)

    with pytest.raises(UsageError, match="max_length"):
        lm.generate(one, max_new_tokens=MAX)
    with pytest.raises(UsageError, match="num_beams"):
        lm.generate(one, max_new_tokens=4, num_beams=2)


@pytest.mark.swarm
def test_volunteers_who_keep_the_checkpoint_serve_it_without_a_weight_from_the_client(swarm, client_for, tmp_path):
    """Weights by reference (docs/weights.md): two workers keep the checkpoint in their --models-dir; the client
    sends each span's program (a manifest and a graph) and not one weight, and generates what HF generates. Their
    records name the checkpoint, which `gpunet status --json` shows."""
    from gpunet.job.checkpoints import CheckpointIndex

    folder = save_checkpoint(tmp_path / "models" / "llama", "llama", seed=7)
    held = CheckpointIndex([folder]).scan().id
    workers = {swarm.worker_id(w) for w in swarm.start_workers(2, "--models-dir", str(tmp_path / "models"))}
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    assert all(w.record.checkpoints == [held] for w in client.workers())
    assert {w["id"]: w["checkpoints"] for w in swarm.status()["workers"]} == {w: [held] for w in workers}
    lm = client.causal_lm(folder, max_length=MAX, spans=2)
    reference, ids, want = _hf_greedy(folder, "volunteers keep the weights", 10)
    assert torch.equal(lm.generate(ids, max_new_tokens=10, do_sample=False), want)
    layers = sum(p.numel() * p.element_size() for p in reference.model.layers.parameters())
    # Each span's program went (its graph: tens of KB here, more than these tiny layers' weights), no weight did.
    assert client.weight_bytes_sent == 0 and client.program_bytes_sent < layers


@pytest.mark.swarm
def test_a_client_with_a_slim_folder_generates_from_workers_that_keep_the_checkpoint(swarm, client_for, tmp_path):
    """A client with only a slim folder (`gpunet checkpoint slim`: config, tokenizer, ends, hashes) and two workers:
    one keeps the checkpoint, the other fetches each tensor of its span from it. HF's tokens, and not one weight
    byte from the client, which has none; with no worker that keeps it, the request fails saying so."""
    from typer.testing import CliRunner

    from gpunet.cli.app import app

    folder = save_checkpoint(tmp_path / "models" / "llama", "llama", seed=9)
    result = CliRunner().invoke(app, ["checkpoint", "slim", str(folder), str(tmp_path / "slim")])
    assert result.exit_code == 0, result.output
    holder = swarm.start_worker("--models-dir", str(tmp_path / "models"))
    bare = swarm.start_worker()
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2 and any(w.record.checkpoints for w in client.workers()),
             30, "both workers, the holder's checkpoint in its record")
    lm = client.causal_lm(tmp_path / "slim", max_length=MAX, spans=2)
    _, ids, want = _hf_greedy(folder, "only the hashes travel", 10)
    assert torch.equal(lm.generate(ids, max_new_tokens=10, do_sample=False), want)
    assert client.weight_bytes_sent == 0
    served = {w for row in lm.last.placement for _, _, w in row}
    if swarm.worker_id(bare) in served:  # it fetched its span's tensors from the holder
        bare.wait_for_line(r"Fetched \d+ weight\(s\) \(\d+ bytes\) from workers that keep their checkpoint", timeout=30)

    holder.terminate()
    wait_for(lambda: [w.id for w in client.workers(refresh=True)] == [swarm.worker_id(bare)], 60, "the bare worker")
    other = save_checkpoint(tmp_path / "other", "llama", seed=10)  # spans no worker has run yet
    result = CliRunner().invoke(app, ["checkpoint", "slim", str(other), str(tmp_path / "slim2")])
    lm2 = client.causal_lm(tmp_path / "slim2", max_length=MAX, spans=1)
    with pytest.raises(GpunetError, match="only by its hash"):
        lm2.generate(ids, max_new_tokens=2)


@pytest.mark.swarm
def test_every_family_over_the_swarm_generates_a_padded_batch_as_hf_does(swarm, client_for, full):
    """All 14 families (``--full``; one of each kind in CI's run) through real workers with no glue (two spans over
    two workers): a batch of two prompts of different lengths (left padding) with an end token that finishes a row
    early, which is then padded as HF pads it; the greedy output equals HF's ``generate`` for each."""
    swarm.start_workers(2)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    for family in sorted(FAMILIES) if full else BOUNDED_FAMILIES:
        model = tiny_causal_lm(family, seed=2)
        lm = client.causal_lm(model, max_length=32, spans=2)
        prompt = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(prompt)
        prompt[1, :2], mask[1, :2] = 0, 0  # row 1: four tokens, left-padded
        with torch.no_grad():
            free = model.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
        eos = int(free[0, 9])  # row 0's 4th new token (or an earlier one, if the same) ends it
        with torch.no_grad():
            want = model.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)
        got = lm.generate(prompt, mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(got, want), family
        assert lm.last.completion_tokens[0] == free[0, 6:].tolist().index(eos) + 1, family
