"""Client side: trace a module with ``torch.export`` and convert it into gpunet's graph, manifest and weights.

This runs only on the client, on the client's own module. What comes out is plain data: op names, JSON arguments,
named integer dimension ranges and safetensors weights. The worker never sees a pickle or an exported program.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import io
import logging
import math
import operator
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from gpunet.errors import GpunetError, UnsupportedProgram
from gpunet.job import graph as g
from gpunet.job.tensors import dtype_name

# Export-time assertions the worker replaces by its own checks of the input dims against the manifest ranges.
_DROPPED_TARGETS = {"aten._assert_scalar.default", "aten._assert_tensor_metadata.default", "aten.sym_constrain_range_for_size.default"}


@dataclass
class Traced:
    """What the tracer hands to :class:`gpunet.Job`: the graph as a JSON object, signature records, weights."""

    graph: dict
    ops: dict[str, str]  # op name -> schema string
    inputs: list[dict]  # {"name", "dtype", "shape": [int | dim name]}
    outputs: list[dict]
    output_structure: str  # "tensor" | "tuple"
    dims: dict[str, dict]  # name -> {"min": int, "max": int | None}
    weights: dict[str, torch.Tensor]
    #: How the flat outputs nest, as the module returned them (dicts, ModelOutputs, nested tuples), in the manifest's
    #: JSON form (see gpunet.job.format.check_output_tree); None for a tensor or a flat tuple.
    output_tree: Any = None
    out_spec: Any = None  # the same as torch's TreeSpec: rebuilds the very types, in this process
    #: The module's own tensor behind each weight (a stand-in for a checkpoint's tensor is known by identity).
    sources: dict[str, torch.Tensor] | None = None
    #: Where each weight came from: the module's parameter or persistent buffer (``("module", its name)``), else a
    #: tensor attribute or a constant its code made (``("constant", name)``), for :func:`trace_alike`.
    targets: dict[str, tuple[str, str]] | None = None


#: How deep, and how many containers, an output structure may have.
MAX_TREE_DEPTH = 32
MAX_TREE_NODES = 4096


def _output_tree(spec: Any) -> Any:
    """torch's output TreeSpec as plain JSON: a leaf is the output's index; ``{"tuple": [...]}``, ``{"list": [...]}``,
    ``{"dict": [...], "keys": [...]}``, with ``"name"`` (and a named tuple's ``"fields"``) for named types."""
    leaves = iter(range(1 << 30))
    nodes = 0

    def walk(node: Any, depth: int) -> Any:
        nonlocal nodes
        if node.is_leaf():
            return next(leaves)
        nodes += 1
        if depth > MAX_TREE_DEPTH or nodes > MAX_TREE_NODES:
            raise UnsupportedProgram(f"the module's output is nested deeper than {MAX_TREE_DEPTH} or has more than "
                                     f"{MAX_TREE_NODES} containers")
        kids = [walk(c, depth + 1) for c in _children(node)]
        kind = node.type
        if kind is tuple or kind is list:
            return {kind.__name__: kids}
        named = node.context if isinstance(node.context, type) else kind  # torch files named tuples' class there
        if isinstance(named, type) and issubclass(named, tuple) and hasattr(named, "_fields"):  # a named tuple
            return {"tuple": kids, "name": named.__name__, "fields": list(named._fields)}
        if isinstance(kind, type) and issubclass(kind, dict):  # dict, OrderedDict, Hugging Face's ModelOutput
            keys = list(node.context)
            if not all(isinstance(k, str) for k in keys):
                raise UnsupportedProgram("a dict the module returns must have string keys")
            tree = {"dict": kids, "keys": keys}
            if kind is not dict:
                tree["name"] = kind.__name__
            return tree
        raise UnsupportedProgram(f"the module returns a {getattr(kind, '__name__', kind)}: outputs must be tensors in "
                                 "tuples, lists, named tuples or dicts (ModelOutput included)")

    return walk(spec, 0)


class _FunctionModule(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class _KeywordModule(torch.nn.Module):
    """A module called with keyword inputs (``input_ids=…, attention_mask=…``), as one that takes them all by
    position: the job's inputs are then the positional ones followed by these, in this order, under these names."""

    def __init__(self, module: torch.nn.Module, positional: int, names: Sequence[str]):
        super().__init__()
        self.module, self.positional, self.names = module, positional, tuple(names)

    def forward(self, *args):
        return self.module(*args[:self.positional], **dict(zip(self.names, args[self.positional:])))


def trace(
    module: torch.nn.Module | Callable, example_inputs: Sequence[torch.Tensor], dynamic_shapes: Any = None,
    example_kwargs: dict[str, torch.Tensor] | None = None,
) -> Traced:
    """Export ``module`` on ``example_inputs`` (and ``example_kwargs``), decompose to core ATen, and convert to
    gpunet's plain-data form. With keyword inputs, ``dynamic_shapes`` is a dict by parameter name (or a tuple for the
    positional inputs alone)."""
    if not isinstance(module, torch.nn.Module):
        module = _FunctionModule(module)
    example_inputs = tuple(example_inputs)
    names: list[str] = []
    if example_kwargs:
        if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                           for k in example_kwargs):
            raise UnsupportedProgram("example_kwargs must map input names to tensors")
        names = list(example_kwargs)
        by_name = dynamic_shapes if isinstance(dynamic_shapes, dict) else {}
        if dynamic_shapes is not None and not isinstance(dynamic_shapes, dict):
            by_name = dict(zip(_positional_names(module, len(example_inputs)), dynamic_shapes))
        positional_names = _positional_names(module, len(example_inputs))
        unknown = set(by_name) - set(positional_names) - set(names)
        if unknown:
            raise UnsupportedProgram(f"dynamic_shapes names {sorted(unknown)}, which are not inputs of this call")
        module = _KeywordModule(module, len(example_inputs), names)
        dynamic_shapes = [by_name.get(n) for n in (*positional_names, *names)] if by_name else None
        example_inputs = example_inputs + tuple(example_kwargs.values())
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise UnsupportedProgram("example inputs must all be tensors")
    example_inputs = _unaliased(example_inputs)
    export_dynamic = dynamic_shapes
    if isinstance(module, _KeywordModule) and dynamic_shapes is not None:
        export_dynamic = (tuple(dynamic_shapes),)  # forward(*args): one varargs tuple
    if isinstance(module, _FunctionModule) and isinstance(dynamic_shapes, (list, tuple)):
        export_dynamic = (tuple(dynamic_shapes),)  # forward(*args) takes its inputs as one varargs tuple
    try:
        # torch.export's deprecation chatter, and the partial graph it prints to stderr (twice) before raising on
        # data-dependent control flow, are noise to a gpunet user: the error below says what to change.
        with warnings.catch_warnings(), _quiet_torch_loggers(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            ep = torch.export.export(module, example_inputs, dynamic_shapes=export_dynamic)
    except GpunetError:
        raise
    except Exception as e:  # torch.export raises many types; the user needs the message
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if "data-dependent" in str(e) or "GuardOnDataDependent" in type(e).__name__:
            raise UnsupportedProgram(
                "the model branches on tensor values (an `if`/`while` on a tensor, or `.item()`), which a traced job "
                "cannot do: compute both sides and pick with torch.where, or make the decision on the client and "
                f"submit a different job (torch.export: {first[:300]})") from None
        if "Cache" in str(e) and "cache_utils" in str(e):
            raise UnsupportedProgram(
                "the model returns its KV cache object (a Hugging Face Cache, which a job cannot carry): trace it "
                "with use_cache=False in its config (or call), and for generation keep the cache on the workers "
                f"with client.sequential and a static cache (docs/sessions.md) (torch.export: {first[:200]})") from None
        hint = _hf_layer_hint(module, example_inputs, example_kwargs)
        if hint:
            raise UnsupportedProgram(f"{hint} (torch.export: {type(e).__name__}: {first[:200]})") from None
        raise UnsupportedProgram(f"torch.export could not trace the module: {type(e).__name__}: {e} (this is the "
                                 "first of three steps: torch.export, then torch's decompositions, then gpunet's "
                                 "converter; check the model runs with these example inputs, and see torch.export's "
                                 "documentation for what it needs)") from e
    try:
        with warnings.catch_warnings(), _quiet_torch_loggers():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                decomposed = ep.run_decompositions(_decompositions())
            except Exception as e:
                if "Cannot view a tensor" not in str(e) or not _views_as_reshapes(ep):
                    raise
                decomposed = ep.run_decompositions(_decompositions())
            ep = decomposed
            _drop_relayouts(ep.graph)
    except Exception as e:
        if "is mutated in the forward method" in str(e):  # a constant updated in place: a cache's tensors
            raise UnsupportedProgram(_IN_PLACE + f" (torch: {str(e).strip().splitlines()[0][:200]})") from None
        raise UnsupportedProgram(f"torch's decompositions (the second of three steps, after torch.export traced the "
                                 f"module) failed: {type(e).__name__}: {str(e)[:500]}; this is torch's step, not "
                                 "gpunet's: another torch version may decompose it, or replace the layer that fails"
                                 ) from e
    try:
        traced = _convert(ep, _user_dim_names(module, example_inputs, dynamic_shapes), training=module.training)
    except UnsupportedProgram as e:
        raise UnsupportedProgram(f"gpunet's converter (the last step, after torch.export and its decompositions): "
                                 f"{e}") from None
    if names:  # the keyword inputs go by their own names (submit(job, input_ids=...) matches them)
        for spec, name in zip(traced.inputs[len(example_inputs) - len(names):], names):
            spec["name"] = name
    return traced


#: Traces of modules built alike (the caller's ``key`` to :func:`trace_alike`), kept in this process without their
#: weights: the most recently used this many.
TRACES_KEPT = 64
_traces: OrderedDict[Hashable, tuple[Traced, tuple]] = OrderedDict()
_traces_lock = threading.Lock()


def trace_alike(key: Hashable | None, module: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                dynamic_shapes: Any = None) -> Traced:
    """:func:`trace`, or the graph of a module traced before that the caller built alike, with this module's own
    weights. ``key`` must name everything the graph depends on besides this process's code: a model's class and
    configuration, its dtype, the example inputs' shapes and dynamic dims (gpunet.client.llm keys a span so). Tracing
    a decoder span takes seconds to minutes; the same architecture opened again (the same folder, another
    checkpoint of it, each of a gateway's models alike) takes its graph from here. Each weight is bound to the
    module's tensor of the same name; the module must have the very parameters and buffers of the one traced (names,
    shapes, dtypes, strides, which are tied) and no hooks, else it is traced anew; constants its code made are the
    graph's own."""
    if key is None or _hooked(module):  # (a hook's code is nobody's key)
        return trace(module, example_inputs, dynamic_shapes)
    with _traces_lock:
        kept = _traces.get(key)
        if kept is not None:
            _traces.move_to_end(key)
    if kept is not None:
        bound = _bind(*kept, module)
        if bound is not None:
            return bound
    traced = trace(module, example_inputs, dynamic_shapes)
    if traced.targets is not None:
        # A constant that is one of the module's tensor attributes (a buffer it keeps out of its state dict) is
        # bound like a weight; one its code made is kept with the graph.
        targets = {name: ("attribute", target) if kind == "constant" and isinstance(_attribute(module, target),
                                                                                    torch.Tensor) else (kind, target)
                   for name, (kind, target) in traced.targets.items()}
        made = {name: w for name, w in traced.weights.items() if targets[name][0] == "constant"}
        bare = copy.deepcopy(dataclasses.replace(traced, weights=made, sources=None, out_spec=None, targets=targets))
        with _traces_lock:
            _traces[key] = (dataclasses.replace(bare, out_spec=traced.out_spec), _tensors_of(module))
            while len(_traces) > TRACES_KEPT:
                _traces.popitem(last=False)
    return traced


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride(), t.device.type, t.requires_grad


def _tensors_of(module: torch.nn.Module) -> tuple:
    """Every parameter and buffer of the module by name, with its layout and which earlier name it is (tied)."""
    first: dict[int, str] = {}
    out = []
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        out.append((name, _layout(t), first.setdefault(id(t), name)))
    return tuple(out)


def _hooked(module: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    glob = [getattr(nn_module, n, None) for n in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                  "_global_forward_hooks_always_called")]
    return any(glob) or any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _bind(kept: Traced, tensors: tuple, module: torch.nn.Module) -> Traced | None:
    """A kept trace with ``module``'s weights; None unless the module has the very parameters and buffers of the one
    traced (names, layouts, which are one tensor) and each tensor attribute the graph reads."""
    if _tensors_of(module) != tensors:
        return None
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    weights, sources = {}, {}
    for name, (kind, target) in kept.targets.items():
        if kind == "module":
            t = named.get(target)
        elif kind == "attribute":
            t = _attribute(module, target)
        else:
            t = kept.weights[name]  # made by the module's code: the same for a module built alike
        if not isinstance(t, torch.Tensor):
            return None
        sources[name], weights[name] = t, t.detach().contiguous()
    fresh = copy.deepcopy(dataclasses.replace(kept, weights={}, out_spec=None))
    return dataclasses.replace(fresh, weights=weights, sources=sources, out_spec=kept.out_spec)


def _attribute(module: torch.nn.Module, path: str) -> Any:
    """``module.a.b.c`` for ``"a.b.c"`` (a tensor attribute torch.export lifted as a constant), or None."""
    found: Any = module
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


#: Why a module that updates tensors in place cannot be a job, and what to do instead.
_IN_PLACE = ("the module updates one of its tensors in place (a Hugging Face StaticCache does this with its KV "
             "cache): a job's only effect is its outputs, so it must return new values instead. Keep such state as a "
             "stateful block, forward(x, *state) -> (y, *new_state), whose state a session keeps on the worker "
             "(client.sequential(...).session(); docs/sessions.md)")


def _hf_layer_hint(module: torch.nn.Module, inputs: tuple, kwargs: dict | None) -> str | None:
    """What a bare Hugging Face decoder layer lacks when it fails to trace: the rotary ``position_embeddings`` and the
    cache its model hands it (as a layer alone it got None for them: "cannot unpack non-iterable NoneType")."""
    inner = getattr(module, "module", module)  # a keyword wrapper's module
    if not type(inner).__module__.startswith("transformers."):
        return None
    try:
        params = inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return None
    given = set(kwargs or ()) | set(list(params)[: len(inputs) - len(kwargs or ())])
    what = {"position_embeddings": "position_embeddings (the rotary (cos, sin) its model computes once for all "
                                   "layers)", "past_key_values": "past_key_values (the KV cache)",
            "past_key_value": "past_key_value (the KV cache)", "cache_position": "cache_position"}
    missing = [what[p] for p in what if p in params and p not in given]
    if not missing:
        return None
    return (f"{type(inner).__name__} is a Hugging Face layer that its model calls with {', '.join(missing)}: "
            "called alone it gets None for them. Trace a module that makes them itself: the positions and the rotary "
            "embedding from the model's rotary_emb, and the KV cache as explicit state, forward(x, *state) -> "
            "(y, *new_state), which client.sequential's sessions keep on the workers (docs/sessions.md)")


def _unaliased(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The example inputs, each with memory of its own. torch.export takes two inputs that share memory (the same
    tensor passed twice, one zeros tensor for both halves of a KV cache) for one, and its graph then reads the first
    wherever the second was meant: a program that ignores an input, silently. They are only examples: copies do."""
    seen: set[int] = set()
    out = []
    for x in inputs:
        if isinstance(x, torch._subclasses.fake_tensor.FakeTensor):  # no memory: each stands alone
            out.append(x)
            continue
        ptr = x.untyped_storage().data_ptr() if x.numel() else None
        if ptr is not None and ptr in seen:
            x = x.clone()
            ptr = x.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        out.append(x)
    return tuple(out)


def _rsub(self, other, alpha=1):
    """``other - alpha * self`` with the tensor first (torch's own rsub decomposition puts a scalar first, as in
    ``6 - x``, which the worker refuses: its ops take tensors where their schema says Tensor)."""
    aten = torch.ops.aten
    return aten.add.Tensor(aten.mul.Tensor(self, -alpha), other)


def _batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    """InstanceNorm's batch norm over the batch's own statistics, in mean/sub/mul/rsqrt (torch's own decomposition
    uses var_mean, which the worker does not run); returns (output, mean, rstd) as the op does."""
    aten = torch.ops.aten
    dims = [0, *range(2, input.dim())]
    mean = aten.mean.dim(input, dims, True)
    centered = aten.sub.Tensor(input, mean)
    rstd = aten.rsqrt.default(aten.add.Tensor(aten.mean.dim(aten.mul.Tensor(centered, centered), dims, True), eps))
    out = aten.mul.Tensor(centered, rstd)
    shape = [1, -1] + [1] * (input.dim() - 2)
    if weight is not None:
        out = aten.mul.Tensor(out, aten.view.default(weight, shape))
    if bias is not None:
        out = aten.add.Tensor(out, aten.view.default(bias, shape))
    return out, aten.squeeze.dims(mean, dims), aten.squeeze.dims(rstd, dims)


def _decompositions():
    """Core ATen, plus decompositions of ops that would otherwise block whole model families: weight norm
    (``linalg_vector_norm``, torch's own decomposition: wav2vec2), InstanceNorm (``_native_batch_norm_legit.no_stats``)
    and ``rsub`` with the tensor first. Each becomes ops the worker already runs, checked as any others."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = torch.export.default_decompositions()
    table.update(get_decompositions([aten.linalg_vector_norm.default]))
    table[aten._native_batch_norm_legit.no_stats] = _batch_norm_no_stats
    table[aten.rsub.Scalar] = _rsub
    table[aten.rsub.Tensor] = _rsub
    return table


def _views_as_reshapes(ep: torch.export.ExportedProgram) -> bool:
    """Turn the graph's ``view`` nodes into ``reshape`` (the same values; a copy where the input's layout needs one),
    so that torch's decompositions can replay a view recorded against eager's memory layout on the layout they give
    (their attention lays its output out transposed, where GPT-2's Conv1D views the merged heads as eager had them).
    Only for a graph without in-place ops (there a view's aliasing could matter); returns whether it did."""
    nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    if any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable for n in nodes):
        return False
    views = [n for n in nodes if n.target is torch.ops.aten.view.default]
    for n in views:
        n.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    return bool(views)


def _drop_relayouts(graph: torch.fx.Graph) -> None:
    """Remove ``as_strided`` nodes that only restride a tensor to another memory layout of the same values (export
    adds them to keep eager's strides, e.g. a channels-last pooling output: ConvNeXt, Swin). gpunet's tensors have no
    layout to keep, and ``as_strided`` in general (reading storage through arbitrary strides) is not allowed."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.as_strided.default or len(n.args) < 3:
            continue
        src, size, stride = n.args[:3]
        offset = n.args[3] if len(n.args) > 3 else n.kwargs.get("storage_offset", 0)
        val = getattr(src, "meta", {}).get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or offset not in (0, None):
            continue
        try:
            same = (list(size) == list(val.shape) and all(
                int(want) == int(have) for dim, want, have in zip(val.shape, stride, val.stride()) if int(dim) > 1))
        except (TypeError, ValueError):  # symbolic sizes: leave it (the worker will refuse it, saying so)
            continue
        if same:
            n.replace_all_uses_with(src)
            graph.erase_node(n)


def _positional_names(module: torch.nn.Module, count: int) -> list[str]:
    """The names of ``module.forward``'s first ``count`` parameters (input_0, … where it has none to give)."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return (params + [f"input_{i}" for i in range(len(params), count)])[:count]


@contextlib.contextmanager
def _quiet_torch_loggers():
    names = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _user_dim_names(module: torch.nn.Module, inputs: tuple, dynamic_shapes: Any) -> dict[tuple[int, int], str]:
    """(input index, dim) -> the name the user gave that dimension with ``torch.export.Dim``."""
    if dynamic_shapes is None:
        return {}
    if isinstance(dynamic_shapes, dict):
        params = list(inspect.signature(module.forward).parameters)
        per_input = [dynamic_shapes.get(p) for p in params[: len(inputs)]]
    else:
        per_input = list(dynamic_shapes)
    names = {}
    for i, spec in enumerate(per_input):
        items = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for d, dim in items:
            name = getattr(dim, "__name__", None)
            if isinstance(name, str) and g.GRAPH_NAME_RE.match(name):
                names[(i, d)] = name
    return names


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.addmm.default"
    if target is operator.getitem:
        return g.GETITEM
    if target in g.SYM_OP_NAMES:
        return g.SYM_OP_NAMES[target]
    raise UnsupportedProgram(f"the traced graph calls {target!r}, which gpunet cannot carry")


def _encode_arg(a: Any) -> Any:
    if isinstance(a, torch.fx.Node):
        return {"ref": a.name}
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        if math.isfinite(a):
            return a
        return {"float": "nan" if math.isnan(a) else ("inf" if a > 0 else "-inf")}
    if isinstance(a, (list, tuple)):
        return [_encode_arg(x) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": None}  # the worker always uses its own device
    if isinstance(a, torch.layout) and a in g.LAYOUT_NAMES:
        return {"layout": g.LAYOUT_NAMES[a]}
    if isinstance(a, torch.memory_format) and a in g.MEMORY_FORMAT_NAMES:
        return {"memory_format": g.MEMORY_FORMAT_NAMES[a]}
    raise UnsupportedProgram(f"the traced graph has an argument gpunet cannot carry: {type(a).__name__} {a!r:.80}")


def _finite_int(x: Any) -> int | None:
    """A sympy bound as a Python int, or None for an infinite one (export's int_oo)."""
    try:
        return int(x) if math.isfinite(float(x)) else None
    except (TypeError, ValueError, OverflowError):
        return None


def _children(spec: Any) -> list:
    return list(spec.children()) if callable(getattr(spec, "children", None)) else list(spec.children_specs)


def _convert(ep: torch.export.ExportedProgram, user_dims: dict[tuple[int, int], str], training: bool = False) -> Traced:
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    weights: dict[str, torch.Tensor] = {}
    sources: dict[str, torch.Tensor] = {}
    targets: dict[str, tuple[str, str]] = {}
    input_names: list[str] = []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            input_names.append(name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            t = ep.state_dict.get(spec.target)
            targets[name] = ("module" if t is not None else "constant", spec.target)
            if t is None:
                t = ep.constants[spec.target]
            sources[name] = t
            weights[name] = t.detach().contiguous()
        else:
            raise UnsupportedProgram(f"input {name} of kind {spec.kind.name} is not supported")
    for spec in sig.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            if spec.kind == OutputKind.BUFFER_MUTATION and training:
                raise UnsupportedProgram(
                    f"the module updates its buffer {spec.target} in place, as a module in training mode does "
                    "(BatchNorm's running statistics): put it in eval mode (model.eval()) before tracing")
            raise UnsupportedProgram(f"{_IN_PLACE} ({spec.kind.name} of {spec.target})")

    # Name the symbolic dimensions of the inputs; record only names and integer bounds.
    dims: dict[str, dict] = {}
    sym_names: dict[Any, str] = {}
    inputs = []
    for i, name in enumerate(input_names):
        val = placeholders[name].meta["val"]
        shape: list[int | str] = []
        for d, size in enumerate(val.shape):
            if isinstance(size, int):
                shape.append(size)
                continue
            expr = size.node.expr
            if not getattr(expr, "is_Symbol", False):
                raise UnsupportedProgram(f"input {i} dim {d} is a derived dimension ({expr}); use plain Dims on inputs")
            if expr not in sym_names:
                dim_name = user_dims.get((i, d), str(expr))
                if dim_name in dims:
                    dim_name = f"{dim_name}_{len(dims)}"
                vr = ep.range_constraints.get(expr)
                lo = (_finite_int(vr.lower) if vr is not None else None) or 0
                hi = _finite_int(vr.upper) if vr is not None else None
                sym_names[expr] = dim_name
                dims[dim_name] = {"min": lo, "max": hi}
            shape.append(sym_names[expr])
        inputs.append({"name": name, "dtype": dtype_name(val.dtype), "shape": shape})

    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    out_args = list(out_node.args[0])
    # Keep only what the outputs need: drops export's runtime assertions and their size arithmetic.
    live: set[str] = set()
    stack = [a for a in out_args if isinstance(a, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n.name not in live:
            live.add(n.name)
            stack.extend(n.all_input_nodes)
    nodes, ops = [], {}
    for n in ep.graph.nodes:
        if n.op in ("placeholder", "output") or n.name not in live:
            continue
        if n.op != "call_function":
            what = ("control flow (torch.cond, torch.while_loop, torch.map) and submodule calls"
                    if n.op == "get_attr" else f"{n.op} nodes")
            raise UnsupportedProgram(f"node {n.name}: {what} cannot travel in a gpunet job: write the computation as "
                                     "straight-line tensor code (select with torch.where instead of branching)")
        op = _op_name(n.target)
        if op in _DROPPED_TARGETS:
            continue
        if isinstance(n.target, torch._ops.OpOverload):
            ops[op] = str(n.target._schema)
        nodes.append({"name": n.name, "op": op, "args": _encode_arg(list(n.args)), "kwargs": {k: _encode_arg(v) for k, v in n.kwargs.items()}})

    outputs = []
    for a in out_args:
        if not isinstance(a, torch.fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor):
            raise UnsupportedProgram("every output must be a tensor")
        val = a.meta["val"]
        shape = [s if isinstance(s, int) else sym_names.get(s.node.expr) for s in val.shape]
        outputs.append({"dtype": dtype_name(val.dtype), "shape": shape})
    out_spec = ep.call_spec.out_spec
    tree = None
    if out_spec is None or out_spec.is_leaf():
        structure = "tensor"
    else:  # the worker returns the outputs flat; the client nests them again as the module returned them
        structure = "tuple"
        if not (out_spec.type in (tuple, list) and all(c.is_leaf() for c in _children(out_spec))):
            tree = _output_tree(out_spec)
    graph = {"inputs": input_names, "weights": list(weights), "nodes": nodes, "outputs": [_encode_arg(a) for a in out_args]}
    return Traced(graph, ops, inputs, outputs, structure, dims, weights, tree, out_spec if tree is not None else None,
                  sources, targets)
