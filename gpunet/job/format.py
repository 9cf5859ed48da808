"""The job container: a versioned manifest, a JSON graph and safetensors weights. Plain data, no code.

Container bytes are a msgpack map ``{"gpunet_program": 1, "manifest": bin, "graph": bin, "weights": bin}``; manifest
and graph are compact, key-sorted JSON. ``program_hash`` is the sha256 of those three byte strings (length-prefixed),
so it covers everything the worker validates against, and never the inputs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import torch

from gpunet.errors import JobRejected
from gpunet.job import tensors
from gpunet.job.graph import GRAPH_NAME_RE
from gpunet.utils import human_bytes

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_GRAPH_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_PROGRAM_BYTES = 8 * 1024**3


@dataclass(frozen=True)
class Estimate:
    """What the dry run on meta tensors predicts: the FLOPs billed, the peak memory needed, and each output's dtype
    (safetensors name) and shape, which the client holds a worker's answer to."""

    flops: int
    peak_memory_bytes: int
    outputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Each node's counted work, in program order: what bounds its time in a real run (gpunet.job.cost.least_seconds).
    node_flops: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def output_bytes(self) -> int:
        """The outputs' data size: what a worker's answer carries, besides a small header."""
        return sum(math.prod(shape) * tensors.DTYPES[dtype].itemsize for dtype, shape in self.outputs)


@dataclass(frozen=True)
class TensorSpec:
    """An input or output: dtype (safetensors name) and shape, each dim an int or the name of a ranged dim."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...]

    def to_obj(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class WeightRef:
    """A weight the program names by content instead of carrying it (docs/weights.md): the sha256 of its bytes as
    safetensors stores them (C order, little-endian), its dtype (safetensors name) and shape. A worker finds those
    bytes in its own checkpoints, or asks for them, and checks them against the hash before they load."""

    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * tensors.DTYPES[self.dtype].itemsize

    def to_obj(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "dtype": self.dtype, "shape": list(self.shape)}


#: The most weights one program may name by reference.
MAX_REFS = 65536


@dataclass(frozen=True)
class DimRange:
    """A dynamic dimension's inclusive bounds (``max`` None = unbounded; the worker's limits still apply)."""

    min: int
    max: int | None


@dataclass(frozen=True)
class JobLimits:
    """Caps the client sets for its own job; the worker applies the stricter of these and its own."""

    max_flops: int | None = None
    max_peak_memory_bytes: int | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything the worker checks a program and its inputs against. Unknown fields are ignored."""

    torch_version: str
    ops: dict[str, str]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    output_structure: str
    dims: dict[str, DimRange]
    limits: JobLimits = field(default_factory=JobLimits)
    format_version: int = FORMAT_VERSION
    #: How the outputs nest as the module returned them (check_output_tree); None: a tensor or a flat tuple. Only the
    #: client reads it: the worker returns the outputs flat, so a worker that predates it runs such jobs too.
    output_tree: Any = None
    #: How many of the last inputs are carried state, returned updated as the same number of last outputs (the
    #: stateful-block convention ``forward(x, *state) -> (y, *new_state)``, docs/sessions.md). Fixed shapes, so a
    #: session's memory is known before it opens.
    state: int = 0
    #: Weights named by content hash, not carried in the container (WeightRef): resolved by the worker.
    refs: tuple[WeightRef, ...] = ()
    #: A stateful program whose rows are sessions (docs/sessions.md, batching): the name of the dynamic dim that is
    #: the first of every input and output, state included, each row computed from its own rows alone. A worker may
    #: then run several sessions' steps of it as one forward. A session holds one row (its state's shapes with this
    #: dim at 1). None: every session's steps run alone.
    batch: str | None = None

    @property
    def refs_bytes(self) -> int:
        """What the weights named by reference take once loaded."""
        return sum(r.nbytes for r in self.refs)

    @property
    def state_bytes(self) -> int:
        """Bytes a session of this program holds on its worker between steps (one row of a batched program)."""
        return sum(math.prod(self.row_shape(s)) * tensors.DTYPES[s.dtype].itemsize for s in self.state_specs)

    @property
    def state_specs(self) -> tuple[TensorSpec, ...]:
        return self.inputs[len(self.inputs) - self.state:] if self.state else ()

    def row_shape(self, spec: TensorSpec) -> tuple:
        """A spec's shape for one session: the batch dim (if the program has one) at 1."""
        return tuple(1 if d == self.batch and self.batch is not None else d for d in spec.shape)

    def to_json(self) -> bytes:
        obj = {
            "format_version": self.format_version,
            "torch_version": self.torch_version,
            "ops": self.ops,
            "inputs": [s.to_obj() for s in self.inputs],
            "outputs": [s.to_obj() for s in self.outputs],
            "output_structure": self.output_structure,
            "dims": {k: {"min": v.min, "max": v.max} for k, v in self.dims.items()},
            "limits": {"max_flops": self.limits.max_flops, "max_peak_memory_bytes": self.limits.max_peak_memory_bytes},
        }
        if self.output_tree is not None:  # absent otherwise: older programs keep their hash
            obj["output_tree"] = self.output_tree
        if self.state:
            obj["state"] = self.state
        if self.refs:  # absent otherwise: programs that carry every weight keep their hash
            obj["refs"] = [r.to_obj() for r in self.refs]
        if self.batch is not None:
            obj["batch"] = self.batch
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        obj = parse_json(data, "manifest", MAX_MANIFEST_BYTES)
        _expect(isinstance(obj, dict), "manifest is not a JSON object")
        version = obj.get("format_version")
        _expect(type(version) is int and version == FORMAT_VERSION, f"unknown manifest format version {str(version)[:20]!r} (this worker reads {FORMAT_VERSION})")
        ops = obj.get("ops")
        _expect(isinstance(ops, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in ops.items()), "manifest ops must map op names to schema strings")
        dims_obj = obj.get("dims", {})
        _expect(isinstance(dims_obj, dict), "manifest dims must be an object")
        dims = {}
        for name, r in dims_obj.items():
            _expect(isinstance(name, str) and bool(GRAPH_NAME_RE.match(name)), f"dimension name {str(name)[:40]!r} is not a plain identifier")
            _expect(isinstance(r, dict) and _is_int(r.get("min")) and (r.get("max") is None or _is_int(r.get("max"))), f"dimension {name}: bounds must be integers")
            _expect(0 <= r["min"] and (r.get("max") is None or r["min"] <= r["max"]), f"dimension {name}: empty or negative range")
            dims[name] = DimRange(r["min"], r.get("max"))
        inputs = tuple(_tensor_spec(s, dims, "input") for s in _list(obj.get("inputs"), "inputs"))
        outputs = tuple(_tensor_spec(s, dims, "output", outputs=True) for s in _list(obj.get("outputs"), "outputs"))
        structure = obj.get("output_structure")
        _expect(isinstance(structure, str) and structure in ("tensor", "tuple"), "output_structure must be 'tensor' or 'tuple'")
        _expect(structure == "tuple" or len(outputs) == 1, "a 'tensor' output_structure needs exactly one output")
        lim = obj.get("limits") or {}
        _expect(isinstance(lim, dict) and all(lim.get(k) is None or _is_int(lim.get(k)) for k in ("max_flops", "max_peak_memory_bytes")), "manifest limits must be integers or null")
        tv = obj.get("torch_version")
        _expect(isinstance(tv, str) and len(tv) < 64, "manifest torch_version must be a short string")
        tree = obj.get("output_tree")
        if tree is not None:
            _expect(structure == "tuple", "an output_tree goes with a 'tuple' output_structure")
            check_output_tree(tree, len(outputs))
        state = obj.get("state", 0)
        batch = obj.get("batch")
        check_batch(batch, state, dims, inputs, outputs)
        check_state(state, inputs, outputs, structure, tree, batch)
        refs = tuple(_weight_ref(r) for r in _list(obj.get("refs", []), "refs", MAX_REFS))
        _expect(len({r.name for r in refs}) == len(refs), "manifest refs name a weight twice")
        sizes: dict[str, int] = {}
        _expect(all(sizes.setdefault(r.sha256, r.nbytes) == r.nbytes for r in refs),
                "manifest refs give one sha256 two sizes")  # one content, one size: else a worker blames its file
        return cls(tv, dict(ops), inputs, outputs, structure, dims,
                   JobLimits(lim.get("max_flops"), lim.get("max_peak_memory_bytes")), output_tree=tree, state=state,
                   refs=refs, batch=batch)


def check_batch(batch: Any, state: Any, dims: dict[str, DimRange], inputs: Sequence[TensorSpec],
                outputs: Sequence[TensorSpec]) -> None:
    """A batched program's ``batch`` dim (Manifest.batch): a stateful program's, one of its dims, from 1 row up,
    first of every input and output and nowhere else."""
    if batch is None:
        return
    _expect(isinstance(batch, str) and batch in dims, "manifest batch must name one of the program's dims")
    _expect(_is_int(state) and state > 0, "manifest batch goes with a stateful program (its rows are sessions)")
    _expect(dims[batch].min == 1, f"the batch dim {batch} must allow one row (min 1), not {dims[batch].min}")
    for spec in (*inputs, *outputs):
        _expect(len(spec.shape) > 0 and spec.shape[0] == batch and batch not in spec.shape[1:],
                f"{spec.name}: a batched program's inputs and outputs have the batch dim {batch} first and only "
                f"there, got {list(spec.shape)}")


def check_state(state: Any, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], structure: str,
                tree: Any, batch: str | None = None) -> None:
    """A stateful program's last ``state`` inputs come back, same dtypes and fixed shapes (but a batched program's
    rows, see check_batch), as its last ``state`` outputs; at least one input and one output are not state (what
    each step sends and gets)."""
    _expect(_is_int(state) and state >= 0, "manifest state must be a non-negative integer")
    if not state:
        return
    _expect(structure == "tuple" and tree is None, "a stateful program returns a flat tuple (y, *new_state)")
    _expect(state < len(inputs) and state < len(outputs),
            "a stateful program needs an input and an output besides its state")
    for i, (a, b) in enumerate(zip(inputs[len(inputs) - state:], outputs[len(outputs) - state:])):
        _expect(a.dtype == b.dtype and a.shape == b.shape,
                f"state {i}: input {a.name} ({a.dtype} {list(a.shape)}) and the output that replaces it "
                f"({b.dtype} {list(b.shape)}) must have the same dtype and shape")
        _expect(all(_is_int(d) for d in a.shape[1 if batch is not None else 0:]),
                f"state {i} ({a.name}): state tensors need fixed shapes, "
                f"got {list(a.shape)} (allocate a static cache of the longest length instead of growing one)")


def check_output_tree(tree: Any, n_outputs: int, max_depth: int = 32, max_nodes: int = 4096) -> None:
    """An output structure: each leaf an output index, each used once; containers ``{"tuple"|"list": [...]}`` or
    ``{"dict": [...], "keys": [str, ...]}``, optionally with a short ``"name"`` (and a named tuple's ``"fields"``)."""
    seen: set[int] = set()
    count = 0

    def short_strs(xs: Any, n: int) -> bool:
        return isinstance(xs, list) and len(xs) == n and all(isinstance(x, str) and len(x) <= 128 for x in xs)

    def walk(node: Any, depth: int) -> None:
        nonlocal count
        if _is_int(node):
            _expect(0 <= node < n_outputs and node not in seen, "output_tree names an output twice or one it lacks")
            seen.add(node)
            return
        count += 1
        _expect(depth <= max_depth and count <= max_nodes, "output_tree is too deep or too big")
        _expect(isinstance(node, dict), "output_tree nodes are output indices or containers")
        kinds = [k for k in ("tuple", "list", "dict") if k in node]
        _expect(len(kinds) == 1 and isinstance(node[kinds[0]], list), "an output_tree container is one of tuple, list, dict")
        kids = node[kinds[0]]
        _expect(set(node) <= {kinds[0], "keys", "name", "fields"}, "output_tree container has unknown fields")
        if kinds[0] == "dict":
            _expect(short_strs(node.get("keys"), len(kids)) and len(set(node["keys"])) == len(kids),
                    "an output_tree dict needs one distinct string key per entry")
        if "name" in node:
            _expect(isinstance(node["name"], str) and bool(GRAPH_NAME_RE.match(node["name"])), "output_tree name must be an identifier")
        if "fields" in node:
            _expect(kinds[0] == "tuple" and short_strs(node["fields"], len(kids))
                    and all(GRAPH_NAME_RE.match(f) for f in node["fields"]), "output_tree fields must name each entry")
        for kid in kids:
            walk(kid, depth + 1)

    walk(tree, 0)
    _expect(len(seen) == n_outputs, "output_tree leaves out some outputs")


def nest_outputs(tree: Any, outputs: Sequence[Any]) -> Any:
    """The flat outputs nested as ``tree`` says. Named types come back as what they are made of: a named tuple as a
    named tuple of that name, a ModelOutput or OrderedDict as a dict (the class itself is the client's, not data)."""
    if _is_int(tree):
        return outputs[tree]
    if "dict" in tree:
        return dict(zip(tree["keys"], (nest_outputs(k, outputs) for k in tree["dict"])))
    kids = [nest_outputs(k, outputs) for k in tree.get("tuple", tree.get("list", []))]
    if "list" in tree:
        return kids
    if "fields" in tree:
        import collections

        return collections.namedtuple(tree.get("name", "Outputs"), tree["fields"])(*kids)
    return tuple(kids)


def _tensor_spec(s: Any, dims: dict, what: str, outputs: bool = False) -> TensorSpec:
    _expect(isinstance(s, dict), f"{what} spec is not an object")
    name = s.get("name", "")
    dtype, shape = s.get("dtype"), s.get("shape")
    _expect(isinstance(name, str) and len(name) <= 128, f"{what} name is not a short string")
    _expect(isinstance(dtype, str) and dtype in tensors.DTYPES, f"{what} {name}: unsupported dtype {str(dtype)[:20]!r}")
    _expect(isinstance(shape, list) and len(shape) <= tensors.MAX_NDIM, f"{what} {name}: shape must be a list")
    for d in shape:
        ok = (_is_int(d) and d >= 0) or (isinstance(d, str) and d in dims) or (outputs and d is None)
        _expect(ok, f"{what} {name}: dimension {str(d)[:40]!r} is neither a size nor a declared dimension name")
    return TensorSpec(name, dtype, tuple(shape))


def _weight_ref(r: Any) -> WeightRef:
    _expect(isinstance(r, dict) and set(r) == {"name", "sha256", "dtype", "shape"},
            "a manifest ref is an object of name, sha256, dtype and shape")
    name, digest, dtype, shape = r["name"], r["sha256"], r["dtype"], r["shape"]
    _expect(isinstance(name, str) and bool(GRAPH_NAME_RE.match(name)), "a manifest ref's name is not a plain identifier")
    _expect(isinstance(digest, str) and bool(SHA256_RE.match(digest)), f"ref {name}: sha256 is not 64 lowercase hex digits")
    _expect(isinstance(dtype, str) and dtype in tensors.DTYPES, f"ref {name}: unsupported dtype {str(dtype)[:20]!r}")
    _expect(isinstance(shape, list) and len(shape) <= tensors.MAX_NDIM and all(_is_int(d) and d >= 0 for d in shape)
            and math.prod(max(d, 1) for d in shape) <= tensors.MAX_EXTENT, f"ref {name}: invalid shape")
    return WeightRef(name, digest, dtype, tuple(shape))


SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _list(x: Any, what: str, most: int = 4096) -> list:
    _expect(isinstance(x, list) and len(x) <= most, f"manifest {what} must be a list")
    return x


def _is_int(x: Any) -> bool:
    return type(x) is int


def _expect(cond: bool, reason: str) -> None:
    if not cond:
        raise JobRejected(reason)


def canonical_json(obj: Any) -> bytes:
    """Compact, key-sorted JSON: the one byte form a graph or manifest is hashed in."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_json(data: bytes, what: str, max_bytes: int) -> Any:
    """Parse untrusted JSON with a size cap; JobRejected on anything wrong (deep nesting -> RecursionError)."""
    if len(data) > max_bytes:
        raise JobRejected(f"{what} is {human_bytes(len(data))}, over the limit of {human_bytes(max_bytes)}")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise JobRejected(f"{what} is not valid JSON ({type(e).__name__})") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def program_hash(manifest: bytes, graph: bytes, weights: bytes) -> str:
    """sha256 (hex) over the length-prefixed manifest, graph and weights bytes."""
    h = hashlib.sha256(b"gpunet-program-v1\0")
    for part in (manifest, graph, weights):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.hexdigest()


@dataclass(frozen=True)
class ProgramParts:
    """The three byte strings of a program, as shipped (what the hash covers). Read from a container, ``weights`` is
    a view into the container's bytes, not a copy: a program of several GiB is held once, not twice."""

    manifest: bytes
    graph: bytes
    weights: bytes | memoryview

    @functools.cached_property
    def hash(self) -> str:
        """Computed once: hashing a large program's weights on every submit would dominate the client's time."""
        return program_hash(self.manifest, self.graph, self.weights)

    def to_bytes(self) -> bytes:
        return self._container

    @functools.cached_property
    def _container(self) -> bytes:
        return msgpack.packb(
            {"gpunet_program": FORMAT_VERSION, "manifest": self.manifest, "graph": self.graph, "weights": self.weights},
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, max_bytes: int = DEFAULT_MAX_PROGRAM_BYTES) -> "ProgramParts":
        """Split container bytes without copying the weights (see :func:`_split_container`); manifest and graph, which
        are capped in size, are copied out as bytes."""
        if not isinstance(data, (bytes, bytearray, memoryview, mmap.mmap)):  # (mmap: a worker's spooled program)
            raise JobRejected("program must be bytes")
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n > max_bytes:
            raise JobRejected(f"program is {human_bytes(n)}, over the limit of {human_bytes(max_bytes)}")
        obj = _split_container(view)
        unknown = sorted(set(obj) - {"gpunet_program", "manifest", "graph", "weights"})
        # Refused, not ignored: the weights are a view into the container, so any extra field would stay in memory
        # as long as the program does, uncounted.
        _expect(not unknown, f"program container has unknown field {unknown[0][:40]!r}" if unknown else "")
        version = obj.get("gpunet_program")
        _expect(type(version) is int and version == FORMAT_VERSION, f"unknown program format version {str(version)[:20]!r}")
        parts = [obj.get(k) for k in ("manifest", "graph", "weights")]
        _expect(all(isinstance(p, memoryview) for p in parts), "program container needs manifest, graph and weights as bytes")
        manifest, graph, weights = parts
        # One program, one byte form: peers serve a program's container bytes piece by piece against digests of
        # the form gpunet writes, so a re-encoded copy (other key order, longer headers) would read as corrupted.
        _expect(list(obj) == _FIELDS and n == _canonical_size(p.nbytes for p in parts),
                "program container is not in the form gpunet writes (re-encode it with gpunet.Job)")
        _expect(manifest.nbytes <= MAX_MANIFEST_BYTES, f"manifest is over {human_bytes(MAX_MANIFEST_BYTES)}")
        _expect(graph.nbytes <= MAX_GRAPH_BYTES, f"graph is over {human_bytes(MAX_GRAPH_BYTES)}")
        return cls(bytes(manifest), bytes(graph), weights)


_FIELDS = ["gpunet_program", "manifest", "graph", "weights"]


def manifest_bytes(prefix: bytes | bytearray | memoryview) -> bytes:
    """A program's manifest bytes from the start of its container (the manifest is its second field, as gpunet
    writes it): what a worker reads to learn what a cached program names by reference without reading its weights."""
    view = memoryview(prefix).cast("B")
    head = b"\x84\xaegpunet_program" + bytes([FORMAT_VERSION]) + b"\xa8manifest"
    _expect(bytes(view[:len(head)]) == head, "program container is not in the form gpunet writes")
    pos = len(head)
    tag = view[pos] if view.nbytes > pos else None
    _expect(tag in _BIN, "program container is not in the form gpunet writes")
    width = _BIN[tag]
    size = int.from_bytes(view[pos + 1:pos + 1 + width], "big")
    start = pos + 1 + width
    _expect(size <= MAX_MANIFEST_BYTES and start + size <= view.nbytes, "program manifest is truncated or too big")
    return bytes(view[start:start + size])


def _canonical_size(sizes) -> int:
    """The container's size as msgpack writes it: a fixmap, short keys, the version as a fixint, and each part with
    the shortest bin header for its length."""
    return 1 + sum(1 + len(k) for k in _FIELDS) + 1 + sum(n + _bin_header(n) for n in sizes)


def _bin_header(n: int) -> int:
    return 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5


def weights_start(manifest_len: int, graph_len: int, weights_len: int) -> int:
    """Where the weights' bytes begin in the container of parts of these lengths: their tensors' header is padded so
    the data lands aligned there (gpunet.job.tensors.encode's ``start``), and a worker that maps the container
    page-aligned (a spooled or cached program) runs on the weights where they lie, no copy."""
    return _canonical_size((manifest_len, graph_len, weights_len)) - weights_len


_UINT = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_STR = {0xD9: 1, 0xDA: 2, 0xDB: 4}


def _split_container(view: memoryview) -> dict[str, Any]:
    """The container's top-level map, with each bin value a memoryview into ``view`` (no copy).

    msgpack's own unpacker copies every bin into a new bytes object, so checking a received program's hash held it
    twice. This reads exactly the shapes a container has: a map (at most 16 entries) of str keys to positive ints,
    nil, booleans, str or bin; anything else, a duplicate key, trailing bytes or a length past the end is refused.
    """
    n = view.nbytes
    pos = 0

    def take(count: int) -> memoryview:
        nonlocal pos
        if count > n - pos:
            raise JobRejected("program container is truncated (a length runs past its end)")
        out = view[pos:pos + count]
        pos += count
        return out

    def length(size: int) -> int:
        return int.from_bytes(take(size), "big")

    def value() -> Any:
        tag = take(1)[0]
        if tag <= 0x7F:
            return tag
        if 0xA0 <= tag <= 0xBF or tag in _STR:
            raw = take(tag & 0x1F if tag <= 0xBF else length(_STR[tag]))
            _expect(raw.nbytes <= 1024, "program container has an over-long string")
            try:
                return bytes(raw).decode()
            except UnicodeDecodeError:
                raise JobRejected("program container has a string that is not UTF-8") from None
        if tag in _BIN:
            return take(length(_BIN[tag]))
        if tag in _UINT:
            return length(_UINT[tag])
        if tag in (0xC0, 0xC2, 0xC3):
            return {0xC0: None, 0xC2: False, 0xC3: True}[tag]
        raise JobRejected(f"program container is not a gpunet container (msgpack type 0x{tag:02x} where none belongs)")

    tag = take(1)[0] if n else None
    if tag is not None and 0x80 <= tag <= 0x8F:
        entries = tag & 0x0F
    elif tag == 0xDE:
        entries = length(2)
    else:
        raise JobRejected("program container is not a msgpack map")
    _expect(entries <= 16, "program container has too many fields")
    out: dict[str, Any] = {}
    for _ in range(entries):
        key = value()
        _expect(isinstance(key, str), "program container has a key that is not a string")
        _expect(key not in out, f"program container has field {key[:40]!r} twice")
        out[key] = value()
    _expect(pos == n, "program container has trailing bytes")
    return out


def check_inputs(manifest: Manifest, inputs: Sequence[Any], without_state: bool = False) -> None:
    """Inputs must match the manifest: count, dtype, rank, fixed sizes, and each named dim within its range.
    ``without_state``: a session step's inputs, which leave out the state its worker holds."""
    specs = manifest.inputs[:len(manifest.inputs) - manifest.state] if without_state else manifest.inputs
    if len(inputs) != len(specs):
        held = " besides the state its worker holds" if without_state and manifest.state else ""
        raise JobRejected(f"job takes {len(specs)} inputs{held}, got {len(inputs)}")
    bound: dict[str, int] = {}
    for i, (spec, t) in enumerate(zip(specs, inputs)):
        if not isinstance(t, torch.Tensor):
            raise JobRejected(f"input {i} ({spec.name}) is a {type(t).__name__}, not a tensor")
        if tensors.DTYPE_NAMES.get(t.dtype) != spec.dtype:
            raise JobRejected(f"input {i} ({spec.name}) has dtype {t.dtype}, the job was traced with {spec.dtype}")
        if t.dim() != len(spec.shape):
            raise JobRejected(f"input {i} ({spec.name}) has {t.dim()} dims, expected {len(spec.shape)}")
        for d, (want, got) in enumerate(zip(spec.shape, t.shape)):
            if isinstance(want, int):
                if got != want:
                    raise JobRejected(f"input {i} ({spec.name}) dim {d} is {got}, expected {want}")
                continue
            r = manifest.dims[want]
            if got < r.min or (r.max is not None and got > r.max):
                raise JobRejected(f"input {i} ({spec.name}) dim {d} '{want}' = {got} is outside its range [{r.min}, {r.max}]")
            if bound.setdefault(want, got) != got:
                raise JobRejected(f"dimension '{want}' is {bound[want]} in one input and {got} in input {i} ({spec.name})")


def decode_outputs(
    manifest: Manifest, data: bytes, expected: Sequence[tuple[str, tuple[int, ...]]] | None = None,
    without_state: bool = False,
) -> list[torch.Tensor]:
    """Output bytes -> tensors in order, checked against the manifest's count and dtypes (and, given ``expected``,
    against the exact dtypes and shapes the dry run predicts). ``without_state``: a session step's answer, which
    leaves out the new state its worker keeps."""
    d = tensors.decode(data)
    n = len(manifest.outputs) - (manifest.state if without_state else 0)
    keys = [f"output_{i}" for i in range(n)]
    _expect(sorted(d) == sorted(keys), f"expected outputs {keys}, got {list(d)[:8]}")
    outs = [d[k] for k in keys]
    for spec, t in zip(manifest.outputs, outs):
        _expect(tensors.DTYPE_NAMES.get(t.dtype) == spec.dtype and t.dim() == len(spec.shape), f"{spec.name} does not match the manifest")
    for i, (t, (dtype, shape)) in enumerate(zip(outs, expected or ())):
        got = tensors.DTYPE_NAMES.get(t.dtype)
        _expect(tuple(t.shape) == tuple(shape) and got == dtype,
                f"output {i} is {got} {list(t.shape)}, the dry run predicts {dtype} {list(shape)}")
    return outs
