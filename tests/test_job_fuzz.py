"""Property tests on the byte decoders: random and mutated inputs are either accepted or refused with JobRejected;
they never raise anything else, crash the process or hang."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.export import Dim

from gpunet import Job, JobFailed, JobRejected
from gpunet.job import tensors
from gpunet.job.format import ProgramParts, canonical_json
from gpunet.job.interpreter import run_program
from gpunet.job.validator import WorkerLimits, load_program

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LIMITS = WorkerLimits(max_peak_memory_bytes=64 * 1024**2, max_flops=10**9)

_W = torch.randn(4, 3)
JOB = Job.from_function(lambda x: torch.relu(x @ _W.T).sum(-1), (torch.randn(2, 3),), dynamic_shapes=({0: Dim("b", min=1, max=16)},))
PROGRAM = JOB.to_bytes()
WEIGHTS = tensors.encode({"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int16), "c": torch.ones(2, dtype=torch.bool)})


@st.composite
def mutated(draw, data: bytes):
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not b:
            break
        i = draw(st.integers(0, len(b) - 1))
        if kind == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            b[i] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            del b[i : i + draw(st.integers(1, 16))]
    return bytes(b)


def _accept_or_reject(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except JobRejected as e:
        assert e.reason
        return None


def _load_and_run(data: bytes) -> None:
    """Whatever validates may run, and then only ever fail with JobFailed."""
    prog = _accept_or_reject(load_program, data, limits=LIMITS)
    if prog is not None:
        try:
            run_program(prog, [torch.randn(2, 3)])
        except (JobRejected, JobFailed):
            pass


@SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_as_tensors(data):
    _accept_or_reject(tensors.decode, data)


@SETTINGS
@given(mutated(WEIGHTS))
def test_mutated_tensor_bytes(data):
    out = _accept_or_reject(tensors.decode, data)
    if out is not None:  # whatever was accepted is internally consistent
        assert sum(t.numel() * t.element_size() for t in out.values()) <= len(data)


@SETTINGS
@given(st.binary(max_size=512))
def test_random_bytes_as_program(data):
    _accept_or_reject(load_program, data, limits=LIMITS)


@settings(max_examples=150, deadline=None)
@given(mutated(PROGRAM))
def test_mutated_program_bytes(data):
    _load_and_run(data)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["ref", "float", "dtype", "device", "x"]), inner, max_size=2),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_json_in_graph_arguments(data):
    g = json.loads(JOB.parts.graph)
    node = data.draw(st.sampled_from(g["nodes"]))
    if node["args"]:
        i = data.draw(st.integers(0, len(node["args"]) - 1))
        node["args"][i] = data.draw(JSON)
    else:
        node["kwargs"]["x"] = data.draw(JSON)
    try:
        body = ProgramParts(JOB.parts.manifest, canonical_json(g), JOB.parts.weights).to_bytes()
    except (ValueError, OverflowError):
        return  # not representable as JSON/msgpack: cannot come off the wire either
    _load_and_run(body)


@pytest.mark.parametrize("n", [2**60, 2**64 - 1, 2**24 + 1])
def test_huge_header_lengths_are_refused_before_allocating(n):
    with pytest.raises(JobRejected, match="header length"):
        tensors.decode(struct.pack("<Q", n) + b"{}")


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64 + 5], [0, 2**40, 2**40, 2**40], [2**62, 0, 2**62]])
def test_an_empty_tensor_with_dimensions_no_tensor_can_have_is_refused(shape):
    """Zero elements, so zero bytes: but torch cannot even compute such a tensor's strides (TypeError/RuntimeError,
    which would escape a client's checks of a worker's answer)."""
    head = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    with pytest.raises(JobRejected, match="too large"):
        tensors.decode(struct.pack("<Q", len(head)) + head)


@SETTINGS
@given(st.dictionaries(st.text(max_size=4), st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BOOL", "I64", "U8", "X"]),
    "shape": st.lists(st.sampled_from([0, 1, 2, 3, 2**31, 2**62, 2**63, 2**64]), max_size=5),
    "data_offsets": st.lists(st.integers(0, 24), min_size=2, max_size=2)}), max_size=3), st.binary(max_size=24))
def test_headers_of_any_shape_and_offsets(header, data):
    head = json.dumps(header).encode()
    _accept_or_reject(tensors.decode, struct.pack("<Q", len(head)) + head + data)


def test_deep_json_nesting_is_refused():
    head = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(JobRejected, match="JSON"):
        tensors.decode(struct.pack("<Q", len(head)) + head)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_json_in_the_manifest(data):
    m = json.loads(JOB.parts.manifest)
    key = data.draw(st.sampled_from(sorted(m)))
    target = m
    if isinstance(m[key], dict) and m[key] and data.draw(st.booleans()):
        target, key = m[key], data.draw(st.sampled_from(sorted(m[key])))
    elif isinstance(m[key], list) and m[key] and data.draw(st.booleans()):
        target, key = m[key][0], data.draw(st.sampled_from(sorted(m[key][0])))
    target[key] = data.draw(JSON)
    try:
        body = ProgramParts(canonical_json(m), JOB.parts.graph, JOB.parts.weights).to_bytes()
    except (ValueError, OverflowError):
        return
    _load_and_run(body)


ARG = st.one_of(
    st.just({"ref": "args_0"}), st.just({"ref": "relu"}), st.integers(-3, 3), st.floats(-2, 2), st.booleans(), st.none(),
    st.lists(st.integers(-2, 4), max_size=3), st.lists(st.just({"ref": "args_0"}), max_size=2),
    st.sampled_from([{"dtype": "F32"}, {"dtype": "I64"}, {"float": "inf"}, {"device": None}, "floor", "tanh"]),
)
_TENSOR = st.sampled_from([{"ref": "args_0"}, {"ref": "relu"}])
_BY_TYPE = {
    "Tensor": _TENSOR, "int": st.integers(-3, 4), "SymInt": st.integers(-3, 4), "float": st.floats(-2, 2),
    "number": st.one_of(st.integers(-3, 3), st.floats(-2, 2)), "bool": st.booleans(), "str": st.sampled_from(["floor", "trunc", "tanh", "none", "sum", "x"]),
    "ScalarType": st.sampled_from([{"dtype": "F32"}, {"dtype": "I64"}, {"dtype": "BOOL"}]), "Device": st.just({"device": None}),
    "Layout": st.just({"layout": "strided"}), "MemoryFormat": st.just({"memory_format": "contiguous_format"}),
}


def _for_type(typ: str):
    if typ.startswith("Optional["):
        return st.one_of(st.none(), _for_type(typ[9:-1]))
    if typ.startswith("List["):
        return st.lists(_for_type(typ[5:-1]), max_size=4)
    return _BY_TYPE.get(typ, ARG)


@st.composite
def allowed_call(draw):
    """An allowed op and arguments shaped like its schema (mostly well typed, so the dry run and run get exercised)."""
    from gpunet.job.validator import ALLOWED_OPS

    op = draw(st.sampled_from(sorted(ALLOWED_OPS)))
    positional = [a for a in ALLOWED_OPS[op]._schema.arguments if not a.kwarg_only]
    n = draw(st.integers(0, len(positional)))
    args = [draw(_for_type(str(a.real_type)) if draw(st.integers(0, 9)) else ARG) for a in positional[:n]]
    return op, args


@settings(max_examples=300, deadline=None)
@given(allowed_call())
def test_any_allowed_op_with_arbitrary_arguments(call):
    """Whatever a client puts in an allowed op's arguments, validation and execution fail only with gpunet errors."""
    from gpunet.job.validator import ALLOWED_OPS

    op, args = call
    g = {"inputs": ["args_0"], "weights": [], "outputs": [{"ref": "evil"}],
         "nodes": [{"name": "relu", "op": "aten.relu.default", "args": [{"ref": "args_0"}], "kwargs": {}},
                   {"name": "evil", "op": op, "args": args, "kwargs": {}}]}
    m = json.loads(JOB.parts.manifest)
    m["ops"] = {"aten.relu.default": str(torch.ops.aten.relu.default._schema), op: str(ALLOWED_OPS[op]._schema)}
    m["outputs"] = [{"name": "output_0", "dtype": "F32", "shape": []}]
    _load_and_run(ProgramParts(canonical_json(m), canonical_json(g), tensors.encode({})).to_bytes())
