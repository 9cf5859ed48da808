"""A checkpoint folder served without the client reading its decoder layers (issue 40, docs/weights.md): the client
builds the model around stand-ins for the layers' tensors, traces the spans with them, and names those weights by
reference; only the ends (embeddings, head) are read into its memory. No network here: the spans' programs run
through the workers' validator and interpreter (``Job.run_locally``), which read the referenced bytes from the
folder as a worker reads them from its models dir. The swarm tests of tests/test_llm.py serve folders this way too.
"""

import json
import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from gpunet.client.llm import adapter
from gpunet.client.llm.engine import CausalLMCore
from gpunet.client.routing import Requirements
from gpunet.job.checkpoints import CheckpointIndex, checkpoint_id
from gpunet.llm import load
from gpunet.testing.llm import FAMILIES, save_checkpoint

MAX = 32
#: Families whose loading converts the file's tensors (experts fused into one): loaded whole, named by reference
#: where a weight is a file tensor as it is.
CONVERTED = {"mixtral", "qwen2_moe"}


class _NoWorkers:
    """The part of a client core tracing asks for: the workers known (none: spans are cut as asked)."""

    def __init__(self, data_dir=None):
        self.data_dir = data_dir

    def workers(self):
        return []


def _real_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
               if not isinstance(t, FakeTensor) and t.device.type != "meta")


def _greedy(lm: CausalLMCore, prompt: torch.Tensor, new: int) -> list[int]:
    """Greedy tokens through the spans' programs, run as workers run them, with the client's own ends."""
    states = [span.state for span in lm.spans]
    x, seen, out = prompt, 0, []
    for _ in range(new):
        h = adapter.with_control(lm.ends.embed(x, torch.arange(seen, seen + x.shape[1])[None]))
        seen += x.shape[1]
        for i, span in enumerate(lm.spans):
            h, *state = span.job.run_locally(h, *states[i])
            states[i] = tuple(state)
        out.append(int(lm.ends.head(adapter.hidden_of(h)[:, -1:])[0, -1].argmax()))
        x = torch.tensor([[out[-1]]])
    return out


#: One family of each kind the thin path meets: plain; tied embeddings and Conv1D layers; renamed keys (embed_out);
#: ALiBi; sliding windows and soft-capping; experts (loaded whole). Every family's loading is classified below.
KINDS = ["llama", "gpt2", "gpt_neox", "bloom", "gemma2", "mixtral"]


def test_twelve_of_the_fourteen_families_open_thin(tmp_path):
    """Which families a folder opens thin (decoder layers as stand-ins): all but the experts' ones."""
    from gpunet.client.llm.skeleton import model_files, open_skeleton

    thin = set()
    for family in sorted(FAMILIES):
        folder = save_checkpoint(tmp_path / family, family, seed=5)
        if open_skeleton(folder, None, CheckpointIndex([folder], files=model_files(folder)).scan()) is not None:
            thin.add(family)
    assert set(FAMILIES) - thin == CONVERTED


@pytest.mark.parametrize("family", KINDS)
def test_a_folder_is_served_without_reading_its_decoder_layers(family, tmp_path, caplog):
    """HF's greedy tokens through the spans' programs; for families whose files hold the model's tensors as they
    are, the client holds none of the decoder layers' bytes and every layer weight is named by reference (the
    programs carry only computed tables: rotary frequencies); the experts' families are loaded whole, saying why,
    and name what they can."""
    folder = save_checkpoint(tmp_path / family, family, seed=5)
    reference, _ = load(folder)
    reference.config._attn_implementation = "eager"
    prompt = torch.randint(3, 300, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=8, do_sample=False)[0, 7:].tolist()
    with caplog.at_level(logging.INFO, logger="gpunet.llm"):
        lm = CausalLMCore.open(_NoWorkers(), folder, max_length=MAX, spans=2)
    assert _greedy(lm, prompt, 8)[:len(want)] == want
    layer_bytes = sum(p.numel() * p.element_size() for p in lm.ends.layers.parameters())
    carried = sum(len(span.job.parts.weights) for span in lm.spans)
    assert all(span.job.manifest.refs for span in lm.spans)
    assert all(span.job.checkpoint == CheckpointIndex([folder]).scan().id for span in lm.spans)
    if family in CONVERTED:
        assert "Loading" in caplog.text and "whole" in caplog.text
        return
    assert "whole" not in caplog.text
    assert all(isinstance(p, FakeTensor) for p in lm.ends.layers.parameters())  # stand-ins, never read
    assert _real_bytes(lm.ends.layers) == 0 < layer_bytes
    assert _real_bytes(lm.model) < _real_bytes(reference) - layer_bytes + 4096  # its ends, and small tables
    assert carried < 4096


def test_a_dtype_other_than_the_files_or_a_private_model_is_loaded_whole(tmp_path, caplog):
    """A weight in another dtype than its file's is not that file's tensor: the model is loaded whole (and converted)
    and carries those weights. A private model carries all of its weights (by reference, a worker would load them
    from its own disk, and a hash says which checkpoint it is)."""
    folder = save_checkpoint(tmp_path / "llama", "llama", seed=1)
    with caplog.at_level(logging.INFO, logger="gpunet.llm"):
        lm = CausalLMCore.open(_NoWorkers(), folder, max_length=MAX, spans=1, dtype=torch.bfloat16)
    assert "whole" in caplog.text and "bfloat16" in caplog.text
    assert not lm.spans[0].job.manifest.refs
    assert lm.spans[0].job.manifest.inputs[0].dtype == "BF16"
    private = CausalLMCore.open(_NoWorkers(), folder, max_length=MAX, spans=1,
                                requirements=Requirements(private=True))
    assert not private.spans[0].job.manifest.refs and private.spans[0].job.checkpoint is None


def test_the_folders_hashes_are_kept_in_the_clients_data_dir(tmp_path):
    """A folder is hashed once per change, not at every open (a 140 GB checkpoint takes minutes to hash): the hashes
    are kept in the client's data dir, one file per folder; a changed file is hashed again."""
    folder = save_checkpoint(tmp_path / "llama", "llama", seed=1)
    core = _NoWorkers(tmp_path / "client")
    first = CausalLMCore.open(core, folder, max_length=MAX, spans=1)
    kept = list((tmp_path / "client" / "checkpoints").iterdir())
    assert len(kept) == 1
    stamp = kept[0].stat().st_mtime_ns
    again = CausalLMCore.open(core, folder, max_length=MAX, spans=1)
    assert again.spans[0].job.program_hash == first.spans[0].job.program_hash
    # Another model written over the same folder: its files changed, so they are hashed again.
    save_checkpoint(folder, "llama", seed=2)
    changed = CausalLMCore.open(core, folder, max_length=MAX, spans=1)
    assert changed.spans[0].job.program_hash != first.spans[0].job.program_hash
    assert kept[0].stat().st_mtime_ns >= stamp


def test_a_model_alike_takes_the_traced_spans_with_its_own_weights(tmp_path, monkeypatch):
    """Tracing a decoder's spans takes seconds (minutes for a big model); a second model of the same architecture in
    the same process (the folder opened again, another checkpoint of it: the same class and configuration, dtype
    and length) takes the graphs traced for the first and binds its own weights: its programs are byte for byte the
    ones a fresh trace makes, named by reference or carried. Another length is another architecture: traced."""
    from gpunet.job import trace as tracing

    one = save_checkpoint(tmp_path / "one", "llama", seed=1)
    two = save_checkpoint(tmp_path / "two", "llama", seed=2)
    fresh = {}
    for by_reference in (True, False):
        tracing._traces.clear()
        fresh[by_reference] = [s.job.program_hash for s in CausalLMCore.open(
            _NoWorkers(), two, max_length=MAX, spans=1, by_reference=by_reference).spans]
    tracing._traces.clear()
    for by_reference in (True, False):
        CausalLMCore.open(_NoWorkers(), one, max_length=MAX, spans=1, by_reference=by_reference)
    traced = []
    real_trace = tracing.trace
    monkeypatch.setattr(tracing, "trace", lambda *a, **k: traced.append(1) or real_trace(*a, **k))
    for by_reference in (True, False):
        alike = CausalLMCore.open(_NoWorkers(), two, max_length=MAX, spans=1, by_reference=by_reference)
        assert [s.job.program_hash for s in alike.spans] == fresh[by_reference]
    assert traced == []
    assert bool(alike.spans[0].job.manifest.refs) is False and fresh[True] != fresh[False]
    CausalLMCore.open(_NoWorkers(), two, max_length=MAX // 2, spans=1)
    assert traced == [1]


def _slim(source, target) -> None:
    from typer.testing import CliRunner

    from gpunet.cli.app import app

    result = CliRunner().invoke(app, ["checkpoint", "slim", str(source), str(target)])
    assert result.exit_code == 0, result.output
    assert "hashes of" in result.output


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_a_slim_folder_traces_the_same_programs_with_only_its_ends(family, tmp_path):
    """`gpunet checkpoint slim`: the config, tokenizer, the ends' tensors and the hashes of the rest. A client opening
    it traces the very programs (same hashes) as from the whole checkpoint, names the same checkpoint, and holds no
    decoder layer's bytes; a worker asking it for one hears that it holds only its hash."""
    from gpunet.errors import WeightsNotHeld
    from gpunet.job.checkpoints import WEIGHTS_LIST

    whole = save_checkpoint(tmp_path / "whole", family, seed=3)
    _slim(whole, tmp_path / "slim")
    files = sorted(p.name for p in (tmp_path / "slim").iterdir())
    assert WEIGHTS_LIST in files and "model.safetensors" in files and "config.json" in files
    layers = sum(p.stat().st_size for p in whole.glob("*.safetensors"))
    assert (tmp_path / "slim" / "model.safetensors").stat().st_size < layers
    a = CausalLMCore.open(_NoWorkers(), whole, max_length=MAX, spans=2)
    b = CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=2)
    assert [s.job.program_hash for s in a.spans] == [s.job.program_hash for s in b.spans]
    assert b.spans[0].job.checkpoint == a.spans[0].job.checkpoint == CheckpointIndex([whole]).scan().id
    ids = torch.tensor([[4, 8, 15]])
    assert torch.equal(a.ends.embed(ids, torch.arange(3)[None]), b.ends.embed(ids, torch.arange(3)[None]))
    on_disk = CheckpointIndex([tmp_path / "slim"]).scan()  # (a layer norm's ones are the final norm's bytes too)
    ref = next(r for r in b.spans[0].job.manifest.refs if r.sha256 not in on_disk)
    assert a.spans[0].job.referenced(ref.sha256) is not None
    with pytest.raises(WeightsNotHeld, match="only by its hash"):
        b.spans[0].job.referenced(ref.sha256)
    # Routing's estimate (the workers' dry run, on meta tensors) needs no weight's bytes.
    x = adapter.with_control(torch.zeros(1, 3, b.config.hidden_size))
    assert b.spans[0].job.estimate(x, *b.spans[0].state).flops == a.spans[0].job.estimate(x, *a.spans[0].state).flops


def test_a_slim_folder_refuses_what_it_cannot_serve(tmp_path):
    """A model whose loading fuses tensors cannot be slimmed (exit 2, saying why); a slim folder's list that does not
    match its own files, or a dtype other than its files', is refused when opened, not served wrong."""
    from typer.testing import CliRunner

    from gpunet.cli.app import app
    from gpunet.errors import UsageError
    from gpunet.job.checkpoints import WEIGHTS_LIST

    moe = save_checkpoint(tmp_path / "moe", "mixtral")
    result = CliRunner().invoke(app, ["checkpoint", "slim", str(moe), str(tmp_path / "moe-slim")])
    assert result.exit_code == 2 and "cannot be served from a slim folder" in result.output
    whole = save_checkpoint(tmp_path / "whole", "llama", seed=1)
    _slim(whole, tmp_path / "slim")
    with pytest.raises(UsageError, match="slim checkpoint folder"):
        CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=1, dtype=torch.bfloat16)
    listed = tmp_path / "slim" / WEIGHTS_LIST
    text = listed.read_text()
    sha = text.split('"')[text.split('"').index("model.embed_tokens.weight") + 2]
    listed.write_text(text.replace(sha, "0" * 64))
    with pytest.raises(UsageError, match="but its hashes make"):  # its checkpoint id no longer matches
        CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=1)
    obj = json.loads(listed.read_text())  # the id made to match: the list and the file then disagree
    obj["checkpoint"] = checkpoint_id(t[1] for t in obj["tensors"])
    listed.write_text(json.dumps(obj))
    with pytest.raises(UsageError, match="model.embed_tokens.weight with other bytes than"):
        CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=1)


def test_only_the_files_transformers_loads_are_the_model(tmp_path):
    """A training run's folder keeps older checkpoints beside the model (checkpoint-500/): the thin client reads the
    model's own files, as transformers does, so it traces the same programs as from a clean copy, its ends are the
    model's, and a slim copy of it opens."""
    folder = save_checkpoint(tmp_path / "run", "llama", seed=1)
    save_checkpoint(folder / "checkpoint-500", "llama", seed=2)
    clean = save_checkpoint(tmp_path / "clean", "llama", seed=1)
    a = CausalLMCore.open(_NoWorkers(), folder, max_length=MAX, spans=2)
    b = CausalLMCore.open(_NoWorkers(), clean, max_length=MAX, spans=2)
    assert [s.job.program_hash for s in a.spans] == [s.job.program_hash for s in b.spans]
    ids = torch.tensor([[3, 1, 4]])
    assert torch.equal(a.ends.embed(ids, torch.arange(3)[None]), b.ends.embed(ids, torch.arange(3)[None]))
    _slim(folder, tmp_path / "slim")
    c = CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=2)
    assert [s.job.program_hash for s in c.spans] == [s.job.program_hash for s in b.spans]


def test_a_file_changed_under_its_kept_hashes_is_not_served_stale(tmp_path, caplog):
    """The client keeps a folder's hashes by each file's size and time. A file rewritten with both unchanged would
    leave them stale: the ends it reads are checked against their hashes, and on a mismatch the folder is loaded
    whole (its weights named by what they hold now), so the client never serves old layers with new ends."""
    import os

    from gpunet.job.checkpoints import read_header

    folder = save_checkpoint(tmp_path / "llama", "llama", seed=1)
    core = _NoWorkers(tmp_path / "client")
    CausalLMCore.open(core, folder, max_length=MAX, spans=1)
    path = folder / "model.safetensors"
    st = path.stat()
    _, _, _, offset, length = next(t for t in read_header(path) if t[0] == "model.embed_tokens.weight")
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0xFF  # (not its first row: the padding token's, zeros)
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.INFO, logger="gpunet.llm"):
        lm = CausalLMCore.open(core, folder, max_length=MAX, spans=1)
    assert "no longer holds model.embed_tokens.weight" in caplog.text
    reference, _ = load(folder)
    ids = torch.tensor([[0, 1, 2]])
    with torch.no_grad():
        want = reference.model.embed_tokens(ids)
    assert torch.equal(lm.ends.embed(ids, torch.arange(3)[None]), want)


def test_a_slim_client_cannot_check_spans_on_its_own_machine(tmp_path):
    """verify='local-sample' and 'adaptive' replay spans on the client, which needs their weights: a slim folder
    refuses them at the call, saying so, instead of returning steps nobody checked."""
    from gpunet.errors import UsageError

    whole = save_checkpoint(tmp_path / "whole", "llama", seed=1)
    _slim(whole, tmp_path / "slim")
    with pytest.raises(UsageError, match="replays spans on this machine"):
        CausalLMCore.open(_NoWorkers(), tmp_path / "slim", max_length=MAX, spans=1,
                          requirements=Requirements(verify="local-sample"))
