"""A hostile client edits the bytes: every forbidden or malformed program is refused with JobRejected, naming why,
before any of it runs on a real device."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch.export import Dim

from gpunet import Job, JobRejected
from gpunet.job import interpreter, tensors
from gpunet.job.format import ProgramParts, canonical_json
from gpunet.job.validator import ALLOWED_OPS, load_program


@pytest.fixture(scope="module")
def base():
    """y = x * 2 + 1 with a dynamic batch in [1, 8] and one weight: small enough to edit by hand."""
    w = torch.randn(3)
    job = Job.from_function(lambda x: x * 2 + w, (torch.randn(2, 3),), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    return job


@pytest.fixture(autouse=True)
def nothing_runs_for_real(monkeypatch):
    """Fail the test if the interpreter runs a single step on a real device (the dry run, on meta, is allowed)."""
    real = interpreter.execute

    def guarded(steps, env, outputs, tracker=None, meter=None, stop=None, **kw):
        assert tracker is not None, "a tampered program reached the real interpreter"
        return real(steps, env, outputs, tracker, meter, stop, **kw)

    monkeypatch.setattr(interpreter, "execute", guarded)

    def compiled(program, env, stop=None, pace=None):
        raise AssertionError("a tampered program reached the real interpreter")

    monkeypatch.setattr(interpreter, "run_steps", compiled)
    import gpunet.job.validator as v

    monkeypatch.setattr(v, "execute", guarded)


def _edit(job: Job, graph=None, manifest=None, weights=None) -> bytes:
    g = json.loads(job.parts.graph)
    m = json.loads(job.parts.manifest)
    if graph:
        graph(g)
    if manifest:
        manifest(m)
    return ProgramParts(canonical_json(m), canonical_json(g), weights if weights is not None else job.parts.weights).to_bytes()


def _add_node(op: str, args: list, kwargs: dict | None = None, output: bool = True):
    """Graph edit: append a node calling ``op``, declare its real schema in the manifest, and make it the output."""

    def graph(g):
        g["nodes"].append({"name": "evil", "op": op, "args": args, "kwargs": kwargs or {}})
        if output:
            g["outputs"] = [{"ref": "evil"}]

    def manifest(m):
        packet = op.split(".")
        try:
            m["ops"][op] = str(getattr(getattr(torch.ops.aten, packet[1]), packet[2])._schema)
        except (AttributeError, IndexError, RuntimeError):
            m["ops"][op] = "whatever"

    return dict(graph=graph, manifest=manifest)


def _rejected(data: bytes, *inputs, match: str) -> JobRejected:
    with pytest.raises(JobRejected, match=match) as e:
        prog = load_program(data)
        interpreter.run_program(prog, list(inputs) or [torch.randn(2, 3)])
    return e.value


def test_the_untampered_program_runs(base, monkeypatch):
    monkeypatch.undo()
    x = torch.randn(4, 3)
    prog = load_program(_edit(base))
    assert torch.equal(interpreter.run_program(prog, [x])[0], base.run_locally(x))


@pytest.mark.parametrize(
    "op, args, kwargs",
    [
        ("aten.from_file.default", ["/etc/passwd", None, 100], {"dtype": {"dtype": "U8"}}),
        ("aten._print.default", ["hello"], {}),
        ("aten.manual_seed.default", [0], {}),
        ("aten.seed.default", [], {}),
        ("aten.rand.default", [[2, 3]], {}),
        ("aten.as_strided.default", [{"ref": "args_0"}, [100, 100], [1, 1]], {}),
        ("aten.empty.memory_format", [[2, 3]], {}),
        ("aten.empty_strided.default", [[2, 3], [3, 1]], {}),
        ("aten.new_empty.default", [{"ref": "args_0"}, [2, 3]], {}),
        ("aten.resize_.default", [{"ref": "args_0"}, [1000]], {}),
        ("aten.set_.source_Tensor", [{"ref": "args_0"}, {"ref": "args_0"}], {}),
        ("aten.native_dropout.default", [{"ref": "args_0"}, 0.5, True], {}),
        ("torch.os.system", ["rm -rf /"], {}),
        ("__import__('os').system('id')", [], {}),
        ("aten.add_.Tensor", [{"ref": "args_0"}, 1], {}),
        ("c10d.allreduce_.default", [], {}),
    ],
)
def test_forbidden_ops_are_rejected_by_name(base, op, args, kwargs):
    err = _rejected(_edit(base, **_add_node(op, args, kwargs)), match="not in the worker's allowlist")
    assert "evil" in err.reason and op[:40] in err.reason


def test_training_mode_dropout_traced_by_a_client_is_rejected():
    job = Job.from_module(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)).train(), (torch.randn(2, 3),))
    with pytest.raises(JobRejected, match="not in the worker's allowlist"):
        job.run_locally(torch.randn(2, 3))


@torch.library.custom_op("gpunet_test::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_triple.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_extension_op_traced_by_a_client_is_rejected_with_where_it_belongs():
    """A C++ extension's op (torchvision's nms, a custom kernel) has no counted cost and no check: the error says to
    run that part on the client."""
    class UsesExtension(torch.nn.Module):
        def forward(self, x):
            return _triple(x) + 1

    job = Job.from_module(UsesExtension(), (torch.ones(3),))
    with pytest.raises(JobRejected, match="gpunet_test.triple.default' is not in the worker's allowlist .*not one "
                                          "of PyTorch's aten ops.*on the client"):
        job.run_locally(torch.ones(3))


def test_the_allowlist_excludes_every_dangerous_family():
    for bad in ("from_file", "_print", "as_strided", "empty", "empty_strided", "new_empty", "resize_", "set_",
                "native_dropout", "rand", "randn", "randperm", "bernoulli", "manual_seed", "seed", "nonzero",
                "_local_scalar_dense", "_unsafe_view"):
        assert not [k for k in ALLOWED_OPS if k.split(".")[1] == bad], bad
    for op in ALLOWED_OPS.values():
        assert not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments), op


def test_reference_to_a_missing_node(base):
    _rejected(_edit(base, **_add_node("aten.relu.default", [{"ref": "ghost"}])), match="missing node 'ghost'")


def test_reference_to_a_later_node_is_missing_too(base):
    def graph(g):
        g["nodes"][0]["args"][0] = {"ref": g["nodes"][-1]["name"]}

    _rejected(_edit(base, graph=graph), match="missing node")


@pytest.mark.parametrize("arg", [{"pickle": "gASV..."}, {"ref": "args_0", "eval": "1"}, {"float": "1e999"}, {"dtype": "torch.float32"}])
def test_unknown_argument_encodings(base, arg):
    _rejected(_edit(base, **_add_node("aten.mul.Tensor", [{"ref": "args_0"}, arg])), match="argument other")


def test_wrongly_typed_arguments(base):
    _rejected(_edit(base, **_add_node("aten.relu.default", [3])), match="expected a reference to a tensor")
    _rejected(_edit(base, **_add_node("aten.sum.dim_IntList", [{"ref": "args_0"}, "[0]"])), match="argument dim")
    _rejected(_edit(base, **_add_node("aten.relu.default", [{"ref": "args_0"}, 1])), match="positional arguments")
    _rejected(_edit(base, **_add_node("aten.relu.default", [{"ref": "args_0"}], {"out": None})), match="unexpected keyword")


def test_schema_mismatch_with_the_worker_torch(base):
    def manifest(m):
        m["ops"]["aten.mul.Tensor"] = "aten::mul.Tensor(Tensor self, Tensor other, int extra) -> Tensor"

    _rejected(_edit(base, manifest=manifest), match="schema")


@pytest.mark.parametrize("name", ["__import__('os').system('id')", "batch; rm -rf /", "s0 + 1", ""])
def test_code_in_a_symbolic_dimension_name(base, name):
    def manifest(m):
        m["dims"][name] = m["dims"].pop("batch")
        m["inputs"][0]["shape"][0] = name

    _rejected(_edit(base, manifest=manifest), match="dimension name")


def test_huge_full_is_caught_by_the_dry_run(base):
    data = _edit(base, **_add_node("aten.full.default", [[2**20, 2**20], 1.0]))
    load_program(data)  # statically fine: every op and argument is allowed
    err = _rejected(data, match="peak memory")
    assert "evil" in err.reason and "aten.full.default" in err.reason


def test_an_expanded_view_output_is_counted_as_the_dense_copy_it_becomes(base):
    """expand() of 12 bytes is a 0-byte view in the dry run; returned, it would be made dense: 12 GiB."""
    data = _edit(base, **_add_node("aten.expand.default", [{"ref": "add_3"}, [2**30, 2, 3]]))
    err = _rejected(data, match="peak memory")
    assert "outputs" in err.reason


def test_dynamic_dimension_outside_its_range(base):
    _rejected(_edit(base), torch.randn(9, 3), match=r"'batch' = 9 is outside its range \[1, 8\]")
    _rejected(_edit(base), torch.randn(2, 4), match="dim 1 is 4, expected 3")
    _rejected(_edit(base), torch.randn(2, 3, dtype=torch.float64), match="dtype")


def test_unknown_manifest_format_version(base):
    def manifest(m):
        m["format_version"] = 2

    _rejected(_edit(base, manifest=manifest), match="unknown manifest format version")


def test_claimed_hash_must_match_the_bytes(base):
    with pytest.raises(JobRejected, match="hash"):
        load_program(base.to_bytes(), expected_hash="0" * 64)


def _weights_with_header(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize(
    "weights, match",
    [
        (lambda w: _weights_with_header({"c0": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(12)), "need 12"),
        (lambda w: _weights_with_header({"c0": {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}}, bytes(16)), "starts at 4"),
        (lambda w: struct.pack("<Q", 2**60) + w[8:], "header length"),
        (lambda w: w[: len(w) - 5], "outside the 7-byte data section"),
        (lambda w: w[:20], "runs past the end"),
        (lambda w: _weights_with_header({"c0": {"dtype": "C64", "shape": [3], "data_offsets": [0, 24]}}, bytes(24)), "unsupported dtype"),
        (lambda w: _weights_with_header({"other": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}, bytes(12)), "weights do not match"),
    ],
)
def test_malformed_weights(base, weights, match):
    name = json.loads(base.parts.graph)["weights"][0]
    w = tensors.encode({"c0": torch.randn(3)})

    def graph(g):
        g["weights"] = ["c0"]
        for n in g["nodes"]:
            n["args"] = [{"ref": "c0"} if a == {"ref": name} else a for a in n["args"]]

    _rejected(_edit(base, graph=graph, weights=weights(w)), match=match)


def test_tensor_codec_round_trip_and_zero_copy():
    ts = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int8), "c": torch.randn(2, dtype=torch.bfloat16),
          "d": torch.tensor([True, False]), "e": torch.zeros(0, 3)}
    data = tensors.encode(ts)
    back = tensors.decode(data)
    # Largest item size first; of one size, whole multiples of ALIGN bytes first (e: none at all).
    assert list(back) == sorted(ts, key=lambda k: (-ts[k].element_size(), ts[k].nbytes % tensors.ALIGN != 0, k))
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
    buf = bytearray(data)
    a = tensors.decode(buf)["a"]
    before = a.clone()
    (header_len,) = struct.unpack("<Q", buf[:8])
    assert (8 + header_len) % tensors.ALIGN == 0
    buf[8 + header_len] ^= 0xFF  # the first byte of "a" (largest item size first): the decoded view must see it
    assert not torch.equal(a, before)


def test_tensor_codec_is_compatible_with_the_safetensors_library():
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    ts = {"w": torch.randn(4, 5), "i": torch.arange(7)}
    assert all(torch.equal(st_load(tensors.encode(ts))[k], v) for k, v in ts.items())
    assert all(torch.equal(tensors.decode(st_save(ts))[k], v) for k, v in ts.items())


def test_the_worker_forces_its_own_device(base, monkeypatch):
    monkeypatch.undo()  # this one runs for real
    data = _edit(base, **_add_node("aten.full.default", [[2, 3], 1.5], {"device": {"device": "cuda:7"}, "pin_memory": True}))
    out = interpreter.run_program(load_program(data, device="cpu"), [torch.randn(2, 3)])[0]
    assert out.device.type == "cpu" and torch.equal(out, torch.full((2, 3), 1.5))
    # ...and an op whose job omitted the device still gets the worker's, not torch's default
    data = _edit(base, **_add_node("aten.arange.start_step", [0, 4, 1]))
    prog = load_program(data, device="meta")
    assert interpreter.run_program(prog, [torch.randn(2, 3)])[0].device.type == "meta"
