"""Worker-side validation: everything a job is checked against before any of it runs.

Order: capped container and JSON parsing (gpunet.job.format), the op allowlist and schema match, typed arguments
(strings are only ever keys into closed tables), the worker's device forced on every op that takes one, weights
decoded; then, per input shape, a dry run on meta tensors that counts FLOPs and tracks peak memory and rejects the
job over a limit before a byte is allocated on the real device. Failures raise JobRejected naming the node, op or limit.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from gpunet.errors import DryRunTooLong, JobPreempted, JobRejected, WeightsMismatch
from gpunet.job import graph as g
from gpunet.job import cost, guards, tensors
from gpunet.job.format import (
    DEFAULT_MAX_PROGRAM_BYTES,
    MAX_GRAPH_BYTES,
    Estimate,
    Manifest,
    ProgramParts,
    WeightRef,
    check_inputs,
    parse_json,
)
from gpunet.job.interpreter import DEVICE_SLOT, MemoryTracker, Plan, Step, execute, reads, to_device
from gpunet.utils import LRU, human_bytes

# PyTorch's core ATen opset (torch.Tag.core, torch 2.13) minus what a stranger's job must not do:
#   file I/O and printing (not in core, never added), random ops and seeding (rand, randn, randperm, native_dropout,
#   bernoulli...: no job-supplied seed is supported yet), raw memory (as_strided, resize_, set_, _unsafe_*),
#   uninitialised memory (empty.memory_format, empty_strided, new_empty), data-dependent shapes the dry run cannot
#   bound (nonzero, _local_scalar_dense), layout probes (sym_is_contiguous, sym_stride, sym_storage_offset),
#   backward kernels and training-mode batch norm that updates running stats (inference only), and out= variants.
_CORE_ALLOWED = """
_adaptive_avg_pool2d.default _adaptive_avg_pool3d.default _cdist_forward.default _embedding_bag.default
_fft_c2r.default _fft_r2c.default _log_softmax.default _native_batch_norm_legit_no_training.default _pdist_forward.default
_softmax.default _to_copy.default abs.default acos.default acosh.default adaptive_avg_pool1d.default add.Scalar
add.Tensor addmm.default alias.default amax.default amin.default any.default any.dim any.dims arange.start_step
argmax.default argmin.default asin.default asinh.default atan.default atan2.default atanh.default avg_pool1d.default
avg_pool2d.default avg_pool3d.default bitwise_and.Scalar bitwise_and.Tensor bitwise_not.default bitwise_or.Scalar
bitwise_or.Tensor bitwise_xor.Scalar bitwise_xor.Tensor bmm.default cat.default ceil.default clamp.Tensor
clamp.default clone.default col2im.default constant_pad_nd.default convolution.default copy.default cos.default
cosh.default cumsum.default diagonal.default div.Scalar div.Scalar_mode div.Tensor div.Tensor_mode elu.default
embedding.default eq.Scalar eq.Tensor erf.default exp.default expand.default expm1.default fill.Scalar flip.default
floor.default fmod.Scalar fmod.Tensor full.default full_like.default gather.default ge.Scalar ge.Tensor gelu.default
grid_sampler_2d.default gt.Scalar gt.Tensor hardtanh.default index.Tensor index_put.default index_select.default
isinf.default isnan.default le.Scalar le.Tensor leaky_relu.default log.default log10.default log1p.default
log2.default logical_and.default logical_not.default logical_or.default logical_xor.default lt.Scalar lt.Tensor
masked_scatter.default max.dim max_pool2d_with_indices.default max_pool3d_with_indices.default maximum.default
mean.default mean.dim min.dim minimum.default mm.default mul.Scalar mul.Tensor native_group_norm.default
native_layer_norm.default ne.Scalar ne.Tensor neg.default permute.default pow.Scalar pow.Tensor_Scalar
pow.Tensor_Tensor prod.default prod.dim_int reciprocal.default reflection_pad1d.default reflection_pad2d.default
reflection_pad3d.default relu.default remainder.Scalar remainder.Tensor repeat.default replication_pad2d.default
replication_pad3d.default round.default rsqrt.default scalar_tensor.default scatter.src scatter.value
scatter_add.default scatter_reduce.two select.int select_scatter.default sigmoid.default sign.default sin.default
sinh.default slice.Tensor slice_scatter.default sort.default split_with_sizes.default sqrt.default squeeze.dim
squeeze.dims sub.Scalar sub.Tensor sum.dim_IntList sym_numel.default sym_size.int tan.default tanh.default
topk.default trunc.default unsqueeze.default upsample_bilinear2d.vec upsample_nearest2d.vec var.correction var.dim
view.default where.self
"""
# Not tagged core but emitted by run_decompositions() for common models, and as safe as their core relatives.
_EXTRA_ALLOWED = """
tril.default triu.default sym_size.default split.Tensor
"""


def _resolve_allowlist() -> dict[str, torch._ops.OpOverload]:
    ops = {}
    for name in (_CORE_ALLOWED + _EXTRA_ALLOWED).split():
        packet, overload = name.rsplit(".", 1)
        try:
            op = getattr(getattr(torch.ops.aten, packet), overload)
        except (AttributeError, RuntimeError):
            continue  # absent from this torch build
        ops[f"aten.{name}"] = op
    return ops


ALLOWED_OPS: dict[str, torch._ops.OpOverload] = _resolve_allowlist()


@dataclass(frozen=True)
class WorkerLimits:
    """The worker's own caps, applied to every job (the job's manifest may only tighten them)."""

    max_program_bytes: int = DEFAULT_MAX_PROGRAM_BYTES
    max_input_bytes: int = 2 * 1024**3
    max_nodes: int = 200_000
    max_peak_memory_bytes: int | None = 8 * 1024**3  # None: no limit (a client's own dry run, gpunet.job.job)
    max_flops: int = 10**15
    # The dry run costs the worker time no receipt pays for (its work is counted from shapes; some ops' meta
    # decompositions take ms a node): past this it stops and the job is refused. Models of up to 1,200 nodes dry-run
    # in 15-120 ms here, about 0.1 ms a node, so this is about 50,000 nodes (under max_nodes): a bigger model is
    # several jobs (client.sequential). The worker counts dry runs' time against their client (Admission.dry_ran).
    max_dry_run_seconds: float = 5.0


_MAX_INT = 2**63 - 1
_MAX_LIST = 4096
_MAX_STR = 64


class _Ref:
    """A reference to an earlier value while compiling a node's arguments."""

    __slots__ = ("slot",)

    def __init__(self, slot: int):
        self.slot = slot


class Program:
    """A validated program bound to a device: compiled steps, weights on the device, cached dry-run estimates."""

    def __init__(self, program_hash: str, manifest: Manifest, device: torch.device, limits: WorkerLimits):
        self.program_hash = program_hash  # the bytes themselves are not kept: a cached program holds only its weights
        self.manifest = manifest
        self.device = device
        self.limits = limits
        self.steps: list[Step] = []
        self.output_slots: list[int] = []
        self.view_outputs: tuple[bool, ...] = ()  # per output: delivering it is uncounted work (see _compile)
        self.weights: list[torch.Tensor] = []
        self._meta_weights: list[torch.Tensor] = []
        self._estimates: LRU[tuple, Estimate] = LRU(64)
        self._lock = threading.Lock()
        self._plans: dict[tuple[bool, bool], Plan | None] = {}

    @property
    def n_inputs(self) -> int:
        return len(self.manifest.inputs)

    def new_env(self, inputs: Sequence[Any], weights: Sequence[Any] | None = None) -> list:
        env = [None] * (1 + len(inputs) + len(self.weights) + len(self.steps))
        env[DEVICE_SLOT] = self.device if weights is None else torch.device("meta")
        env[1 : 1 + len(inputs)] = inputs
        env[1 + len(inputs) : 1 + len(inputs) + len(self.weights)] = self.weights if weights is None else weights
        return env

    def plan(self, stoppable: bool, paced: bool) -> Plan | None:
        """The real run compiled (gpunet.job.interpreter.Plan), once per use of the stop word and the pacer; None
        where it cannot be (the generic loop runs it)."""
        key = (stoppable, paced)
        with self._lock:
            if key not in self._plans:
                try:
                    self._plans[key] = Plan(self.steps, self.output_slots, 1 + self.n_inputs + len(self.weights),
                                            stoppable, paced)
                except (ValueError, SyntaxError, RecursionError, MemoryError):
                    self._plans[key] = None
            return self._plans[key]

    def inputs_from_dict(self, d: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        keys = [f"input_{i}" for i in range(self.n_inputs)]
        if sorted(d) != sorted(keys):
            raise JobRejected(f"expected inputs {keys[:8]}, got {list(d)[:8]}")
        return [d[k] for k in keys]

    def estimate(self, inputs: Sequence[torch.Tensor]) -> Estimate:
        """Check inputs against the manifest, then dry-run on meta tensors: FLOPs and peak bytes, limits enforced."""
        return self.dry_run(inputs)[0]

    def dry_run(self, inputs: Sequence[torch.Tensor],
                stop: Callable[[], bool] | None = None) -> tuple[Estimate, float]:
        """:meth:`estimate`, and the CPU seconds its dry run took (0 when an earlier one for these shapes answered).

        ``stop`` is asked before each node, as in a real run (see :func:`gpunet.job.interpreter.execute`); past
        ``max_dry_run_seconds`` the dry run stops with :class:`DryRunTooLong`. A refusal is kept like an estimate, so
        the same shapes are refused at once the next time. A JobRejected or JobPreempted raised here carries
        ``dry_seconds``.
        """
        check_inputs(self.manifest, inputs)
        key = tuple((t.dtype, tuple(t.shape)) for t in inputs)
        with self._lock:
            known = self._estimates.get(key)
        if isinstance(known, JobRejected):
            raise JobRejected(known.reason)
        if known is not None:
            return known, 0.0
        # Its own thread's CPU time: a loaded machine must not make a client's dry run look long (nor cost it more).
        t0 = time.thread_time()
        try:
            est = self._dry_run(inputs, key, self._deadline(t0, stop))
        except (JobRejected, JobPreempted) as e:
            if isinstance(e, JobRejected) and not isinstance(e, DryRunTooLong):  # the same shapes fail the same way:
                with self._lock:  # refused at once next time (not e: its traceback holds the run's frames)
                    self._estimates.put(key, JobRejected(e.reason))
            e.dry_seconds = time.thread_time() - t0
            raise
        return est, time.thread_time() - t0

    def _deadline(self, t0: float, stop: Callable[[], bool] | None) -> Callable[[], bool]:
        limit = self.limits.max_dry_run_seconds
        deadline = t0 + limit

        def asked() -> bool:
            if time.thread_time() > deadline:
                raise DryRunTooLong(
                    f"the dry run took over {limit:g} s of CPU (counting the program's work from its {len(self.steps)} "
                    "nodes' shapes) and was stopped: split the program into smaller jobs, e.g. a remote "
                    "sequential's spans (client.sequential)")
            return stop is not None and stop()

        return asked

    def _dry_run(self, inputs: Sequence[torch.Tensor], key: tuple, stop: Callable[[], bool]) -> Estimate:
        mem_limit = _tighter(self.limits.max_peak_memory_bytes, self.manifest.limits.max_peak_memory_bytes)
        flop_limit = _tighter(self.limits.max_flops, self.manifest.limits.max_flops)
        meta_inputs = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs]
        tracker = MemoryTracker(mem_limit)
        env = self.new_env(meta_inputs, self._meta_weights)
        for slot in range(1, 1 + len(meta_inputs) + len(self.weights)):
            tracker.pin(slot, env[slot])
        meter, per_node = [0], []
        with torch.inference_mode():
            outs = execute(self.steps, env, self.output_slots, tracker, meter, stop=stop, per_node=per_node)
        try:
            outputs = tuple((tensors.dtype_name(o.dtype), tuple(o.shape)) for o in outs)
        except (AttributeError, JobRejected) as e:
            raise JobRejected(f"dry run: an output is not a tensor gpunet can carry ({e})") from None
        flops = meter[0] + cost.delivered_views(outs, self.view_outputs)
        if flop_limit is not None and flops > flop_limit:
            raise JobRejected(f"job needs {flops:.3g} FLOPs, over the limit of {flop_limit:.3g} (counted work: "
                              "matmuls and convolutions by their FLOPs, every other op by a documented equivalent)")
        tracker.materialise_outputs(outs)
        est = Estimate(flops=flops, peak_memory_bytes=int(tracker.peak), outputs=outputs, node_flops=tuple(per_node))
        with self._lock:
            self._estimates.put(key, est)
        return est


#: Why common ops are missing from the allowlist, in the user's terms: what to change in the model.
_HINTS = (
    (("dropout", "bernoulli"), "dropout is active: call model.eval() before Job.from_module"),
    (("rand", "normal", "uniform", "multinomial", "randperm", "exponential"),
     "workers run deterministic graphs (results are compared and paid by content): draw the random numbers on the "
     "client, e.g. noise = torch.randn(...), and pass them to the job as an input; if it comes from dropout, call "
     "model.eval() before Job.from_module"),
    (("empty",), "uninitialised memory could leak another job's data: use torch.zeros/torch.full instead"),
    (("from_file", "_local_scalar", "item"), "the job may not read files or turn tensors into Python numbers"),
)


_OP_NAME = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*")
#: Op namespaces PyTorch itself defines (an op there that is not allowed is not an extension's).
_TORCH_NAMESPACES = frozenset({"aten", "sym", "prims", "rngprims", "debugprims", "torch", "c10d", "_c10d_functional",
                               "quantized", "_quantized", "quantized_decomposed", "higher_order", "inductor",
                               "profiler", "_operator"})


def _hint(op: str) -> str:
    namespace, _, rest = op.partition(".")
    if namespace not in _TORCH_NAMESPACES and _OP_NAME.fullmatch(op):  # torchvision.nms.default: an extension's
        return (" (not one of PyTorch's aten ops: a worker runs only those, whose work it can count and check; an "
                "extension's op, such as torchvision's nms, belongs on the client)")
    name = rest.split(".")[0]
    for keys, hint in _HINTS:
        if any(k in name for k in keys):
            return f" ({hint})"
    return ""


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def load_program(
    data: bytes | ProgramParts, *, device: str | torch.device = "cpu", limits: WorkerLimits = WorkerLimits(),
    expected_hash: str | None = None, refs: Callable[[WeightRef], Any] | None = None, refs_as_meta: bool = False,
) -> Program:
    """Parse and validate program bytes, and load its weights onto ``device``. Runs nothing from the job.

    ``refs``: the bytes of a weight the program names by reference (``Manifest.refs``), as a buffer; each is checked
    against its hash here, before it loads (WeightsMismatch names every one that does not match). ``refs_as_meta``:
    those weights are meta tensors instead, for a program only estimated (a client estimating a span of a model
    whose layers stay on disk), never run.

    Raises JobRejected (and nothing else) for anything malformed, forbidden or over a limit.
    """
    parts = data if isinstance(data, ProgramParts) else ProgramParts.from_bytes(data, limits.max_program_bytes)
    program_hash = parts.hash
    if expected_hash is not None and program_hash != expected_hash:
        raise JobRejected(f"program bytes hash to {program_hash}, not the claimed {expected_hash}")
    manifest = Manifest.from_json(parts.manifest)
    graph = parse_json(parts.graph, "graph", MAX_GRAPH_BYTES)
    device = torch.device(device)
    prog = Program(program_hash, manifest, device, limits)
    _compile(prog, graph)
    weights = tensors.decode(parts.weights, max_total_bytes=limits.max_program_bytes)
    misaligned = sum(w.nbytes for w in weights.values() if w.data_ptr() % tensors.ALIGN)
    if device.type == "cpu" and misaligned > len(parts.weights) // 2:
        # Mostly misaligned (an older container): one memcpy into aligned memory instead of a copy per tensor (see
        # interpreter.to_device, which copies the few misaligned ones of a container gpunet now writes).
        weights = tensors.decode(tensors.aligned_copy(parts.weights), max_total_bytes=limits.max_program_bytes)
    if manifest.refs and refs_as_meta:
        weights.update({r.name: torch.empty(r.shape, dtype=tensors.DTYPES[r.dtype], device="meta")
                        for r in manifest.refs})
    elif manifest.refs:
        weights.update(_resolved(manifest, weights, refs, limits, len(parts.weights)))
    names = graph["weights"]
    if sorted(weights) != sorted(names):
        missing = sorted(set(names) - set(weights))[:4]
        extra = sorted(set(weights) - set(names))[:4]
        raise JobRejected(f"weights do not match the graph (missing {missing}, unexpected {extra})")
    prog.weights = [to_device(weights[n], device) for n in names]
    prog._meta_weights = [torch.empty(w.shape, dtype=w.dtype, device="meta") for w in prog.weights]
    return prog


def _resolved(manifest: Manifest, carried: dict, resolve, limits: WorkerLimits, carried_bytes: int) -> dict:
    """The weights named by reference, each from ``resolve`` and checked against its hash."""
    both = sorted({r.name for r in manifest.refs} & set(carried))[:4]
    if both:
        raise JobRejected(f"weights both carried and named by reference: {both}")
    total = carried_bytes + manifest.refs_bytes
    if limits.max_program_bytes is not None and total > limits.max_program_bytes:
        raise JobRejected(f"the program's weights take {human_bytes(total)} with those it names by reference, over "
                          f"the limit of {human_bytes(limits.max_program_bytes)}")
    if resolve is None:
        raise JobRejected(f"the program names {len(manifest.refs)} weight(s) by reference and nothing here "
                          "resolves them")
    out, bad = {}, []
    for r in manifest.refs:
        data = memoryview(resolve(r)).cast("B")
        if data.nbytes != r.nbytes or hashlib.sha256(data).hexdigest() != r.sha256:
            bad.append(r.sha256)
            continue
        out[r.name] = tensors.decode_raw(data, r.dtype, r.shape)
    if bad:
        raise WeightsMismatch(f"{len(bad)} weight(s) named by reference did not match their hash as they loaded "
                              f"(first: {bad[0][:16]})", tuple(bad))
    return out


def validate_program(data: bytes, limits: WorkerLimits = WorkerLimits()) -> Manifest:
    """Validate program bytes without running them (weights stay on the CPU); returns the manifest."""
    return load_program(data, device="cpu", limits=limits).manifest


# --- graph compilation -------------------------------------------------------------------------------------------


def _reject(where: str, msg: str) -> JobRejected:
    return JobRejected(f"{where}: {msg}")


def _compile(prog: Program, graph: Any) -> None:
    if not isinstance(graph, dict):
        raise JobRejected("graph is not a JSON object")
    inputs, weights, nodes, outputs = (graph.get(k) for k in ("inputs", "weights", "nodes", "outputs"))
    for what, lst in (("inputs", inputs), ("weights", weights), ("nodes", nodes), ("outputs", outputs)):
        if not isinstance(lst, list):
            raise JobRejected(f"graph {what} must be a list")
    if len(nodes) > prog.limits.max_nodes:
        raise JobRejected(f"graph has {len(nodes)} nodes, over the limit of {prog.limits.max_nodes}")
    if len(inputs) != prog.n_inputs:
        raise JobRejected(f"graph has {len(inputs)} inputs but the manifest lists {prog.n_inputs}")
    slots: dict[str, int] = {}
    kinds: dict[int, tuple] = {}

    def declare(name: Any, kind: tuple, where: str) -> int:
        if not isinstance(name, str) or not g.GRAPH_NAME_RE.match(name):
            raise _reject(where, f"name {str(name)[:40]!r} is not a plain identifier")
        if name in slots:
            raise _reject(where, f"name {name!r} is defined twice")
        slot = 1 + len(slots)
        slots[name] = slot
        kinds[slot] = kind
        return slot

    for name in inputs:
        declare(name, ("tensor",), "graph inputs")
    for name in weights:
        declare(name, ("tensor",), "graph weights")
    used_by: dict[int, int] = {}
    # Views (and items of a view's list), each mapped to whether delivering it would be work nobody counted: a
    # weight's or a session state's bytes (sent once, held here, returned by every call) or an expand's (a few bytes
    # standing for many). Other views deliver no more than a counted node made or the client sent.
    sent = len(inputs) - prog.manifest.state
    aliases: dict[int, bool] = {slot: slot > sent for slot in range(1, 1 + len(slots))}
    for index, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise JobRejected(f"node #{index} is not an object")
        name = node.get("name")
        where = f"node {str(name)[:40]!r}"
        op = node.get("op")
        if not isinstance(op, str):
            raise _reject(where, "op must be a string")
        step, kind = _compile_node(prog, node, where, op, slots, kinds)
        for s in _ref_slots(step):
            used_by[s] = len(prog.steps)
        step.slot = declare(name, kind, where)
        prog.steps.append(step)
        if step.view_of is not None and (op != g.GETITEM or step.view_of in aliases):
            aliases[step.slot] = aliases.get(step.view_of, False) or op == "aten.expand.default"
    for i, out in enumerate(outputs):
        ref = _ref(out, slots, kinds, f"output {i}", "tensor")
        prog.output_slots.append(ref.slot)
    prog.view_outputs = tuple(aliases.get(s, False) for s in prog.output_slots)
    if len(outputs) != len(prog.manifest.outputs):
        raise JobRejected(f"graph has {len(outputs)} outputs but the manifest lists {len(prog.manifest.outputs)}")
    keep = set(prog.output_slots)
    frees: dict[int, list[int]] = {}
    for s, last in used_by.items():
        if s not in keep:
            frees.setdefault(last, []).append(s)
    for i, step in enumerate(prog.steps):
        step.free_after = tuple(frees.get(i, ()))


def _ref_slots(step: Step) -> list[int]:
    return [s for s in reads(step) if s != DEVICE_SLOT]


def _ref(v: Any, slots: dict, kinds: dict, where: str, want: str) -> _Ref:
    if not (isinstance(v, dict) and len(v) == 1 and "ref" in v):
        raise _reject(where, f"expected a reference to a {want}, got {_describe(v)}")
    name = v["ref"]
    if not isinstance(name, str) or name not in slots:
        raise _reject(where, f"reference to a missing node {str(name)[:40]!r}")
    slot = slots[name]
    if kinds[slot][0] != want:
        raise _reject(where, f"{name!r} is a {kinds[slot][0]}, expected a {want}")
    return _Ref(slot)


def _refers_to(v: Any, slots: dict, kinds: dict, want: str) -> bool:
    return (isinstance(v, dict) and len(v) == 1 and isinstance(v.get("ref"), str) and v["ref"] in slots
            and kinds[slots[v["ref"]]][0] == want)


def _describe(v: Any) -> str:
    if isinstance(v, dict):
        return f"an object with keys {sorted(map(str, v))[:4]} (unknown argument encoding)"
    return f"{type(v).__name__} {str(v)[:40]!r}"


def _compile_node(prog: Program, node: dict, where: str, op: str, slots: dict, kinds: dict) -> tuple[Step, tuple]:
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise _reject(where, "args must be a list and kwargs an object")
    where = f"{where} ({op[:80]})"
    name = str(node.get("name"))[:40]
    if op == g.GETITEM:
        if len(args) != 2 or kwargs:
            raise _reject(where, "getitem takes (node, index)")
        src = args[0]
        if not (isinstance(src, dict) and isinstance(src.get("ref"), str) and src["ref"] in slots):
            raise _reject(where, f"getitem of a missing node {_describe(src)}")
        kind = kinds[slots[src["ref"]]]
        if kind[0] not in ("tuple", "tensorlist"):
            raise _reject(where, f"getitem of a {kind[0]}")
        idx = args[1]
        if type(idx) is not int or not 0 <= idx < (kind[1] if kind[0] == "tuple" else _MAX_LIST):
            raise _reject(where, f"getitem index {str(idx)[:20]} out of range")
        s = slots[src["ref"]]
        return Step(name, op, _getitem, 0, [None, idx], {}, arg_refs=[(0, s)], view_of=s), ("tensor",)
    if op in g.SYM_OPS:
        arity = 1 if op == "sym.neg" else 2
        if len(args) != arity or kwargs:
            raise _reject(where, f"{op} takes {arity} integer arguments")
        tmpl = [_decode(a, "int", where, slots, kinds) for a in args]
        step = Step(name, op, g.SYM_OPS[op], 0, *_patches(tmpl, {}))
        return step, ("symint",)
    aten = ALLOWED_OPS.get(op)
    if aten is None:
        raise _reject(where, f"op {op[:80]!r} is not in the worker's allowlist{_hint(op)}")
    formula = cost.formula_for(op, aten)
    if formula is None:  # every op a job may use has a counted cost, or it is not run
        raise _reject(where, f"op {op[:80]!r} has no cost formula in this worker")
    schema = aten._schema
    if prog.manifest.ops.get(op) != str(schema):
        raise _reject(where, f"the manifest's schema for {op} does not match this worker's ({schema})")
    params = schema.arguments
    if any(p.alias_info is not None and p.alias_info.is_write for p in params):
        raise _reject(where, "ops that write to their arguments are not allowed")
    positional = [p for p in params if not p.kwarg_only]
    if len(args) > len(positional):
        raise _reject(where, f"{len(args)} positional arguments, the schema takes {len(positional)}")
    by_name = {p.name: p for p in params}
    given = {p.name for p in positional[: len(args)]}
    pos_t = [_decode(a, str(p.real_type), f"{where} argument {p.name}", slots, kinds, scalar_ok=i > 0) for i, (a, p) in enumerate(zip(args, positional))]
    kw_t = {}
    for k, v in kwargs.items():
        if k not in by_name or k in given:
            raise _reject(where, f"unexpected keyword argument {str(k)[:40]!r}")
        kw_t[k] = _decode(v, str(by_name[k].real_type), f"{where} argument {k}", slots, kinds)
    for p in params:  # force the worker's device on every op that can place a tensor
        t = str(p.real_type)
        if t in ("Device", "Optional[Device]"):
            if p.name in given:
                pos_t[[q.name for q in positional].index(p.name)] = _Ref(DEVICE_SLOT)
            else:
                kw_t[p.name] = _Ref(DEVICE_SLOT)
        elif p.name == "pin_memory" and p.name in kw_t:
            kw_t[p.name] = None
    rets = [str(r.real_type) for r in schema.returns]
    if rets == ["Tensor"]:
        kind = ("tensor",)
    elif rets in (["int"], ["SymInt"]):
        kind = ("symint",)
    elif rets == ["List[Tensor]"]:
        kind = ("tensorlist",)
    elif rets and all(r == "Tensor" for r in rets):
        kind = ("tuple", len(rets))
    else:
        raise _reject(where, f"unsupported return type {rets}")
    view_of = None
    if schema.returns[0].alias_info is not None:  # a view: shares the storage of its (first) tensor argument
        first = pos_t[0] if pos_t else None
        view_of = first.slot if isinstance(first, _Ref) else None
    step = Step(name, op, aten, 0, *_patches(pos_t, kw_t), view_of=view_of, guard=guards.GUARDS.get(op),
                cost=formula, workspace=cost.workspace_for(op, prog.device, aten))
    return step, kind


def _patches(pos_t: list, kw_t: dict) -> tuple:
    """Split argument templates into constants and (position, slot) patches the interpreter fills in."""
    args, arg_refs, arg_lists = [], [], []
    for i, a in enumerate(pos_t):
        args.append(_plain(a, lambda subs, i=i: arg_lists.append((i, subs)), lambda s, i=i: arg_refs.append((i, s))))
    kwargs, kw_refs, kw_lists = {}, [], []
    for k, a in kw_t.items():
        kwargs[k] = _plain(a, lambda subs, k=k: kw_lists.append((k, subs)), lambda s, k=k: kw_refs.append((k, s)))
    return args, kwargs, arg_refs, arg_lists, kw_refs, kw_lists


def _plain(a: Any, on_list: Any, on_ref: Any) -> Any:
    if isinstance(a, _Ref):
        on_ref(a.slot)
        return None
    if isinstance(a, list):
        subs = [(j, x.slot) for j, x in enumerate(a) if isinstance(x, _Ref)]
        if subs:
            on_list(subs)
            return [None if isinstance(x, _Ref) else x for x in a]
    return a


def _decode(v: Any, typ: str, where: str, slots: dict, kinds: dict, scalar_ok: bool = False) -> Any:
    """One argument, checked against its schema type; returns a constant, a _Ref or a list of both.

    ``scalar_ok``: a Tensor argument other than ``self`` may be a Python number (export writes ``mul(x, 2)``)."""
    if typ.startswith("Optional["):
        return None if v is None else _decode(v, typ[9:-1], where, slots, kinds)
    if typ.startswith("List["):
        if not isinstance(v, list) or len(v) > _MAX_LIST:
            raise _reject(where, f"expected a list (at most {_MAX_LIST} items), got {_describe(v)}")
        return [_decode(x, typ[5:-1], where, slots, kinds) for x in v]
    if typ == "Tensor":
        if scalar_ok and (type(v) in (int, float, bool) or (isinstance(v, dict) and "float" in v)):
            return _decode(v, "number", where, slots, kinds)  # export passes Python scalars to Tensor arguments
        if scalar_ok and _refers_to(v, slots, kinds, "symint"):
            return _ref(v, slots, kinds, where, "symint")  # ...and symbolic sizes (`pos + x.shape[1]`): an int
        return _ref(v, slots, kinds, where, "tensor")
    if typ in ("int", "SymInt"):
        if type(v) is int and -_MAX_INT <= v <= _MAX_INT:
            return v
        return _ref(v, slots, kinds, where, "symint")
    if typ == "bool":
        if type(v) is bool:
            return v
    elif typ in ("float", "number"):
        if type(v) is float or (type(v) is int and abs(v) <= _MAX_INT) or (typ == "number" and type(v) is bool):
            return v
        if _tag(v, "float") in g.SPECIAL_FLOATS:
            return g.SPECIAL_FLOATS[v["float"]]
        if typ == "number" and isinstance(v, dict) and "ref" in v:
            return _ref(v, slots, kinds, where, "symint")
    elif typ == "str":
        if isinstance(v, str) and len(v) <= _MAX_STR:
            return v  # passed to the op as data (e.g. rounding_mode="floor"), which checks it; never evaluated
    elif typ == "ScalarType":
        if _tag(v, "dtype") in tensors.DTYPES:
            return tensors.DTYPES[v["dtype"]]
    elif typ == "Layout":
        if _tag(v, "layout") in g.LAYOUTS:
            return g.LAYOUTS[v["layout"]]
    elif typ == "MemoryFormat":
        if _tag(v, "memory_format") in g.MEMORY_FORMATS:
            return g.MEMORY_FORMATS[v["memory_format"]]
    elif typ == "Device":
        if isinstance(v, dict) and len(v) == 1 and "device" in v:
            return _Ref(DEVICE_SLOT)
    else:
        raise _reject(where, f"argument type {typ} is not supported")
    raise _reject(where, f"expected {typ}, got {_describe(v)}")


def _tag(v: Any, key: str) -> str | None:
    """The string in a one-key tagged value ``{key: "..."}``, or None (never an unhashable or non-string value)."""
    if isinstance(v, dict) and len(v) == 1 and isinstance(v.get(key), str):
        return v[key]
    return None


def _getitem(seq: Any, i: int) -> Any:
    return seq[i]


__all__ = ["ALLOWED_OPS", "Program", "WorkerLimits", "check_inputs", "load_program", "validate_program"]
