"""The container and manifest: hashes cover the program and not the inputs, versions are checked, unknown fields
are ignored, and inputs are checked against the manifest on the client too."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from torch.export import Dim

import gpunet
from gpunet import GpunetError, Job, JobRejected, UnsupportedProgram
from gpunet.job.format import Manifest, ProgramParts, canonical_json
from gpunet.job.validator import validate_program


@pytest.fixture(scope="module")
def job():
    lin = torch.nn.Linear(4, 2)
    return Job.from_module(lin, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=1, max=10)},))


def test_job_is_public_and_errors_share_one_base():
    assert "Job" in gpunet.__all__ and gpunet.Job is Job
    for name in ("JobRejected", "JobFailed", "JobTimeout", "ProgramNotCached", "UnsupportedProgram"):
        assert issubclass(getattr(gpunet, name), GpunetError)


def test_example_inputs_that_share_memory_trace_as_separate_inputs():
    """torch.export takes the same tensor passed twice for one input, and its graph then ignores the second: a job
    traced on ``(a, a)`` (or on a view of ``a``) must still compute with each input it is given."""
    def f(p, q):
        return torch.tanh(p) + q

    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for example in ((a, a), (a, a[:]), (a, a.view(4, 5))):
        job = Job.from_function(f, example)
        assert torch.allclose(job.run_locally(a, b), f(a, b))
        assert len(job.manifest.inputs) == 2


def test_manifest_records_ops_inputs_and_ranges(job):
    m = job.manifest
    assert m.format_version == 1 and m.torch_version == torch.__version__
    assert m.ops["aten.addmm.default"].startswith("aten::addmm(")
    assert m.inputs[0].shape == ("batch", 4) and (m.dims["batch"].min, m.dims["batch"].max) == (1, 10)
    assert m.outputs[0].dtype == "F32" and m.output_structure == "tensor"


def test_program_hash_covers_weights_but_not_inputs(job):
    lin = torch.nn.Linear(4, 2)
    other = Job.from_module(lin, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=1, max=10)},))
    assert other.program_hash != job.program_hash
    again = Job.from_bytes(job.to_bytes())
    assert again.program_hash == job.program_hash
    again.run_locally(torch.randn(5, 4))
    assert again.program_hash == job.program_hash


def test_unknown_manifest_fields_are_ignored(job):
    m = json.loads(job.parts.manifest)
    m["future_field"] = {"anything": [1, 2]}
    m["inputs"][0]["layout_hint"] = "nhwc"
    parts = ProgramParts(canonical_json(m), job.parts.graph, job.parts.weights)
    assert Manifest.from_json(parts.manifest).inputs == job.manifest.inputs
    validate_program(parts.to_bytes())


def test_unknown_container_version_and_garbage(job):
    obj = msgpack.unpackb(job.to_bytes())
    obj["gpunet_program"] = 99
    with pytest.raises(JobRejected, match="unknown program format version"):
        Job.from_bytes(msgpack.packb(obj))
    with pytest.raises(JobRejected, match="msgpack"):
        Job.from_bytes(b"\xc1garbage")
    with pytest.raises(JobRejected, match="over the limit"):
        Job.from_bytes(job.to_bytes(), max_bytes=100)


def test_encode_inputs_checks_the_manifest(job):
    job.encode_inputs(torch.randn(10, 4))
    with pytest.raises(JobRejected, match="outside its range"):
        job.encode_inputs(torch.randn(11, 4))
    with pytest.raises(JobRejected, match="dtype"):
        job.encode_inputs(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(JobRejected, match="takes 1 inputs"):
        job.encode_inputs(torch.randn(2, 4), torch.randn(2, 4))


def test_shared_dimension_must_agree_across_inputs():
    b = Dim("batch", min=1, max=10)
    j = Job.from_function(lambda x, y: x + y, (torch.randn(3, 4), torch.randn(3, 4)), dynamic_shapes=({0: b}, {0: b}))
    assert j.manifest.inputs[1].shape == ("batch", 4)
    with pytest.raises(JobRejected, match="'batch' is 3 in one input and 4"):
        j.encode_inputs(torch.randn(3, 4), torch.randn(4, 4))


def test_modules_that_cannot_be_carried_are_refused_on_the_client():
    assert list(Job.from_function(lambda x: {"y": x}, (torch.randn(2),)).run_locally(torch.randn(2))) == ["y"]
    with pytest.raises(UnsupportedProgram, match="string keys"):  # a dict output is fine; its keys must be text
        Job.from_function(lambda x: {0: x}, (torch.randn(2),))
    with pytest.raises(UnsupportedProgram):
        Job.from_function(lambda x: x, (3,))
    assert issubclass(UnsupportedProgram, ValueError)


def test_unbounded_dimensions_are_recorded_without_a_max():
    j = Job.from_function(lambda x: x.relu(), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("n"), 1: Dim("m", min=3)},))
    assert j.manifest.dims["n"].max is None and j.manifest.dims["m"].min == 3
    assert j.run_locally(torch.randn(100, 5)).shape == (100, 5)
    with pytest.raises(JobRejected, match="'m' = 2 is outside"):
        j.run_locally(torch.randn(2, 2))


def test_the_jobs_own_limits_are_enforced_by_the_dry_run():
    w = torch.randn(64, 64)
    j = Job.from_function(lambda x: x @ w, (torch.randn(8, 64),), limits=gpunet.JobLimits(max_flops=2 * 8 * 64 * 64))
    j.run_locally(torch.randn(8, 64))
    again = Job.from_bytes(j.to_bytes())
    assert again.manifest.limits.max_flops == 2 * 8 * 64 * 64
    j2 = Job.from_function(lambda x: x @ w, (torch.randn(9, 64),), dynamic_shapes=({0: Dim("b", min=1, max=100)},),
                           limits=gpunet.JobLimits(max_flops=2 * 8 * 64 * 64))
    with pytest.raises(JobRejected, match="FLOPs, over the limit"):
        j2.run_locally(torch.randn(9, 64))


def test_a_dimension_without_max_parses_as_unbounded(job):
    """Regression (found by hypothesis): a range given without "max" once raised KeyError instead of parsing."""
    obj = json.loads(job.parts.manifest)
    name = next(iter(obj["dims"]))
    obj["dims"][name] = {"min": 1}
    assert Manifest.from_json(json.dumps(obj).encode()).dims[name].max is None


def test_a_received_program_is_held_once_its_weights_a_view_of_the_container(job):
    """Checking a multi-GiB program's hash must not copy it: the weights are read in place."""
    data = job.to_bytes()
    parts = ProgramParts.from_bytes(data)
    assert isinstance(parts.weights, memoryview) and parts.weights.obj is data
    assert parts.hash == job.program_hash and bytes(parts.weights) == job.parts.weights


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 70_000), st.integers(0, 20_000), st.integers(0, 3))
def test_a_containers_weights_lie_aligned_whatever_the_parts_sizes(manifest_len, elements, small):
    """A worker maps a big program page-aligned and runs on its weights where they lie: the weights' data section
    must start ALIGN-aligned within the container, across msgpack's bin header sizes (256 bytes, 64 KiB), and so
    does every tensor until the first one whose size is not a whole number of ALIGN bytes (those go last of their
    item size)."""
    from gpunet.job import tensors
    from gpunet.job.job import program_parts

    weights = {"w": torch.arange(elements, dtype=torch.float32), "v": torch.ones(16 * small, dtype=torch.float32),
               "b": torch.ones(small, dtype=torch.int8)}
    parts = program_parts(b" " * manifest_len, b"{}", weights)
    container = parts.to_bytes()
    again = ProgramParts.from_bytes(container)
    assert bytes(again.weights) == parts.weights
    start = len(container) - len(parts.weights)
    base = torch.frombuffer(again.weights, dtype=torch.uint8).data_ptr() if len(again.weights) else 0
    assert (start + 8 + int.from_bytes(parts.weights[:8], "little")) % tensors.ALIGN == 0
    for name, t in sorted(tensors.decode(again.weights).items(), key=lambda kv: kv[1].data_ptr()):
        if t.numel():
            assert (start + t.data_ptr() - base) % tensors.ALIGN == 0, name
        if t.nbytes % tensors.ALIGN:
            break
    assert {k: v.tolist() for k, v in tensors.decode(parts.weights).items()} == {k: v.tolist() for k, v in
                                                                                weights.items()}


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.one_of(st.binary(max_size=300), st.integers(0, 2**64 - 1),
                                                      st.none(), st.booleans(), st.text(max_size=30)), max_size=16))
def test_the_container_reader_agrees_with_msgpack(fields):
    from gpunet.job.format import _split_container

    data = msgpack.packb(fields, use_bin_type=True)
    read = _split_container(memoryview(data))
    assert {k: bytes(v) if isinstance(v, memoryview) else v for k, v in read.items()} == fields
    for cut in {1, len(data) // 2, len(data) - 1} - {0, len(data)}:  # truncated anywhere: refused, never a crash
        with pytest.raises(JobRejected):
            _split_container(memoryview(data[:cut]))


def test_a_container_with_fields_nobody_reads_is_refused(job):
    """The weights are a view into the container: an extra field would be kept in memory, uncounted, with them."""
    obj = msgpack.unpackb(job.to_bytes())
    obj["padding"] = b"\x00" * 1024
    with pytest.raises(JobRejected, match="unknown field 'padding'"):
        Job.from_bytes(msgpack.packb(obj, use_bin_type=True))


def test_run_locally_and_estimate_take_the_same_inputs_as_submit_numpy_arrays_too():
    import numpy as np

    from gpunet import Job, UsageError

    model = torch.nn.Linear(4, 3)
    job = Job.from_module(model, example_inputs=(torch.randn(2, 4),))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        assert torch.allclose(job.run_locally(x), model(torch.from_numpy(x)), atol=1e-6)
    assert job.estimate(x).flops == job.estimate(torch.from_numpy(x)).flops
    with pytest.raises(UsageError, match="input 0 is a list"):
        job.run_locally([[1.0] * 4] * 2)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return cfg, LlamaForCausalLM(cfg).eval()


def test_a_bare_hugging_face_decoder_layer_is_told_what_its_model_passes_it():
    """It failed with torch.export's "cannot unpack non-iterable NoneType object"."""
    _, model = _tiny_llama()
    with pytest.raises(UnsupportedProgram, match=r"LlamaDecoderLayer is a Hugging Face layer that its model calls with "
                                                 r"position_embeddings \(the rotary"):
        Job.from_module(model.model.layers[0], example_inputs=(torch.randn(1, 4, 64),))


def test_a_cache_updated_in_place_is_told_to_become_state_and_training_mode_to_become_eval():
    from transformers import StaticCache

    cfg, model = _tiny_llama()
    cache = StaticCache(config=cfg, max_cache_len=32)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, positions):
            return self.model(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True).logits

    with pytest.raises(UnsupportedProgram, match=r"updates one of its tensors in place \(a Hugging Face StaticCache") as e:
        Job.from_module(Step(), example_inputs=(torch.randint(0, 128, (1, 4)), torch.arange(4)))
    assert "eval mode" not in str(e.value) and "forward(x, *state) -> (y, *new_state)" in str(e.value)
    with pytest.raises(UnsupportedProgram, match=r"put it in eval mode"):
        Job.from_module(torch.nn.BatchNorm1d(4).train(), example_inputs=(torch.randn(3, 4),))
