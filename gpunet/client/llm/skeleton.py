"""A checkpoint folder opened without reading its decoder layers (docs/weights.md, "the client's memory").

A client serving a model from a folder runs only the embeddings and the head; the decoder layers run on workers,
which load them from their own disks when they keep the checkpoint. So the client builds the model on torch's meta
device, loads the tensors of its ends from the folder, and gives each decoder layer's weights a stand-in
(:class:`gpunet.job.checkpoints.StandIns`: shape and dtype, no bytes) that the spans are traced with and that names
the file's tensor by its hash. A 70B model's client holds its ends (a few GB), not 140 GB.

This works when every decoder weight is a file tensor as it is, in the dtype asked for (under its name, or one
transformers renames it from); a family whose loading converts tensors (experts fused into one), or a ``dtype``
other than the file's, is loaded whole instead (:func:`open_skeleton` says why, and returns None).

The folder may also be slim (``gpunet checkpoint slim``): the config, the tokenizer, the ends' tensors and a weights
list (``gpunet-weights.json``: every tensor's name, hash, dtype and shape). Its client needs workers that keep the
checkpoint, or fetch it from ones that do: it has no layer's bytes to send.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gpunet.errors import UsageError
from gpunet.job import tensors
from gpunet.job.checkpoints import WEIGHTS_LIST, CheckpointIndex, ListedTensor, StandIns, checkpoint_id, \
    read_weights_list, tensor_sha256, write_weights_list

logger = logging.getLogger("gpunet.llm")


class _NotThin(Exception):
    """Why this folder is loaded whole (the message is logged)."""


@dataclass
class Skeleton:
    """A model whose decoder layers' weights are stand-ins; ``ends``: the file tensors read for the rest."""

    model: nn.Module
    stand_ins: StandIns
    ends: set[str]


def model_files(path: str | Path) -> list[str]:
    """The safetensors files transformers loads from a folder, by name: the shards its index lists, else
    ``model.safetensors`` (a training run's ``checkpoint-500/`` beside them, or a stale shard, is not the model)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = json.loads(index.read_text())["weight_map"].values()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{index} is not a safetensors index: {type(e).__name__}: {e}") from None
        if not all(isinstance(s, str) and s and s == Path(s).name and s.endswith(".safetensors") for s in shards):
            raise UsageError(f"{index} names a shard outside its folder, or not a safetensors file")
        return sorted(set(shards))
    return ["model.safetensors"] if (path / "model.safetensors").is_file() else []


def open_skeleton(path: str | Path, dtype: torch.dtype | None, index: CheckpointIndex) -> Skeleton | None:
    """The model with the ends loaded and the decoder layers' weights as stand-ins, or None when this checkpoint
    must be loaded whole (logged, with the reason). A slim folder (``gpunet checkpoint slim``: the ends and a weights
    list) cannot be loaded whole: UsageError, saying why."""
    path = Path(path)
    listed = weights_list(path)
    try:
        return _open(path, dtype, index, listed)
    except _NotThin as e:
        not_thin(path, index, listed, str(e))
        return None


def weights_list(path: Path) -> dict[str, ListedTensor] | None:
    try:
        return read_weights_list(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def not_thin(path: Path, index: CheckpointIndex, listed: dict | None, why: str) -> None:
    """Says why a folder is loaded whole; UsageError when it cannot be (a slim folder)."""
    if listed is not None and not set(listed) <= set(index.named()):
        raise UsageError(f"{path} is a slim checkpoint folder (its ends, and the hashes of the rest), and this "
                         f"model cannot be served from one: {why}; use the whole checkpoint")
    logger.info("Loading %s whole (its decoder layers are traced from their bytes): %s", path, why)


def _tensors(index: CheckpointIndex, listed: dict[str, ListedTensor] | None) -> dict:
    """Every tensor of the checkpoint by its file name: (ListedTensor, where its bytes lie here or None)."""
    out = {name: (ListedTensor(name, sha, loc.dtype, loc.shape), loc) for name, (sha, loc) in index.named().items()}
    for name, t in (listed or {}).items():
        have = out.get(name)
        if have is not None and have[0] != t:
            raise UsageError(f"{have[1].path} holds {name} with other bytes than the folder's {WEIGHTS_LIST} lists")
        out.setdefault(name, (t, None))
    return out


def _open(path: Path, dtype: torch.dtype | None, index: CheckpointIndex, listed: dict | None) -> Skeleton:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from gpunet.client.llm.adapter import decoder_layers

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if getattr(config, "quantization_config", None) is not None:
        raise _NotThin("a quantized checkpoint (transformers' quantizer makes its weights)")
    named = _tensors(index, listed)
    if dtype is None:  # as transformers' dtype="auto": the config's, else the files' first floating dtype
        dtype = getattr(config, "dtype", None) or next(
            (tensors.DTYPES[t.dtype] for t, _ in named.values() if tensors.DTYPES[t.dtype].is_floating_point),
            torch.float32)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise _NotThin(f"config.json names dtype {config.dtype!r}")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except Exception as e:  # the whole load says what is wrong with the folder, in transformers' words
        raise _NotThin(f"{type(e).__name__}: {str(e)[:200]}") from None
    plan = getattr(model, "_get_dtype_plan", lambda _: {})(dtype)
    if plan:  # modules transformers keeps in fp32 under this dtype: their weights are converted as they load
        raise _NotThin(f"transformers keeps {', '.join(sorted(plan))[:100]} in float32 under {dtype}")
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)

    files = _by_model_key(model, named)
    stand_ins = StandIns(index, checkpoint_id(t.sha256 for t, _ in named.values()))
    _, _, layers = decoder_layers(model)
    in_layers = {id(m) for m in layers.modules()}
    persistent = set(model.state_dict())
    ends: set[str] = set()
    for prefix, module in model.named_modules():
        if id(module) in in_layers:
            _stand_in_for(model, module, prefix, files, stand_ins)
        else:
            ends |= _materialize(model, module, prefix, files, persistent, index)
    model.tie_weights()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise _NotThin(f"{len(left)} tensors are not in the files as the model names them ({left[0]}, ...)")
    return Skeleton(model, stand_ins, ends)


def _by_model_key(model: nn.Module, named: dict) -> dict:
    """The files' tensors by the name the model gives each: transformers renames some checkpoints' keys as it loads
    them (``embed_out`` is GPT-NeoX's ``lm_head``); a tensor it converts (experts fused into one) names nothing, so
    the weight made from it is not found and the folder is loaded whole."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model) or []
    except (ImportError, AttributeError, TypeError) as e:  # another transformers: its keys as they are
        logger.info("transformers' key renaming is not available (%s): the files' names are taken as they are", e)
        return named
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    out = {}
    for key, found in named.items():
        renamed, converted = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                               meta)
        if converted is None:
            out.setdefault(renamed, found)
    return out


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _stand_in_for(model: nn.Module, module: nn.Module, prefix: str, files: dict, stand_ins: StandIns) -> None:
    """A decoder layer's module: its non-persistent buffers (tables computed at init) made for real, as transformers
    makes them when it loads a model; then each weight a stand-in for the file tensor of its name."""
    _init_computed_buffers(model, module)
    for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
        for name, t in list(table.items()):
            if t is None or (kind == "buffer" and name in module._non_persistent_buffers_set):
                continue
            key = _key(prefix, name)
            found = files.get(key)
            if found is None:
                raise _NotThin(f"the model's {key} is no tensor of the checkpoint's files")
            listed, _ = found
            _same(key, listed, t)
            table[name] = stand_ins.make(listed, parameter=kind == "parameter")


def _materialize(model: nn.Module, module: nn.Module, prefix: str, files: dict, persistent: set,
                 index: CheckpointIndex) -> set[str]:
    """One module of the ends (embeddings, norms, head, rotary tables): its buffers computed as at init, then its
    weights read from the files, each checked against its hash (a tied weight, absent from them, is tied after).
    Returns the file names read."""
    _init_computed_buffers(model, module)
    read = set()
    for table in (module._parameters, module._buffers):
        for name, t in list(table.items()):
            key = _key(prefix, name)
            if t is None or t.device.type != "meta" or key not in persistent:
                continue
            found = files.get(key)
            if found is None:  # a tied weight is tied later; anything else stays meta, and says so
                continue
            listed, loc = found
            _same(key, listed, t)
            if loc is None:
                raise _NotThin(f"the client runs {key} itself, and this folder holds only its hash")
            raw = index.read(listed.sha256)
            if raw is None or len(raw) != loc.length or tensor_sha256(raw) != listed.sha256:
                raise _NotThin(f"{loc.path} no longer holds {key} as it did when it was hashed")
            value = tensors.decode_raw(raw, loc.dtype, loc.shape).clone()
            table[name] = nn.Parameter(value, requires_grad=False) if table is module._parameters else value
            read.add(listed.name)
    return read


def _same(key: str, listed: ListedTensor, t: torch.Tensor) -> None:
    if tensors.DTYPES[listed.dtype] != t.dtype or tuple(listed.shape) != tuple(t.shape):
        raise _NotThin(f"{key} is {listed.dtype} {list(listed.shape)} in the files, {t.dtype} {list(t.shape)} in "
                       "the model")


def _init_computed_buffers(model: nn.Module, module: nn.Module) -> None:
    """A module's non-persistent buffers (rotary frequencies, masks) as the model's own init computes them:
    transformers builds a model on the meta device and fills these the same way when it loads one. Run while the
    module's weights are still meta (the init's writes to them do nothing); a table the init leaves unwritten (NaN
    where it started) is no stand-in's to guess: the model is loaded whole."""
    made = []
    for name in module._non_persistent_buffers_set:
        t = module._buffers.get(name)
        if t is not None and t.device.type == "meta":
            real = torch.empty_like(t, device="cpu")
            if real.is_floating_point():
                real.fill_(float("nan"))
            module._buffers[name] = real
            made.append(name)
    if not made:
        return
    model._init_weights(module)
    for name in made:
        t = module._buffers[name]
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise _NotThin(f"{type(module).__name__}.{name} is computed at init in a way transformers' loading does "
                           "not repeat")


#: Files of a checkpoint folder a slim one leaves out: weights, in any format (the ends go into model.safetensors).
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt",
                    ".h5", ".msgpack", ".gguf", ".onnx")


@dataclass(frozen=True)
class Slimmed:
    """What :func:`slim` wrote: the ends' tensors and bytes, the tensors listed by hash only, and the checkpoint."""

    folder: Path
    ends: int
    ends_bytes: int
    listed: int
    listed_bytes: int
    checkpoint: str


def slim(source: str | Path, target: str | Path) -> Slimmed:
    """Write a slim copy of a checkpoint folder: its config, tokenizer and other small files, the tensors of the ends
    the client runs itself (``model.safetensors``), and a weights list (every tensor's name, hash, dtype and shape).
    A client serves the model from it (``causal_lm``) on workers that keep the whole checkpoint, without holding or
    sending a decoder layer's bytes. UsageError when this model cannot be served that way (it says why)."""
    import shutil

    from safetensors.torch import save_file

    source, target = Path(source), Path(target)
    if not (source / "config.json").is_file():
        raise UsageError(f"{source} is not a checkpoint folder (no config.json there)")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(f"{target} exists and is not an empty folder")
    index = CheckpointIndex([source], files=model_files(source)).scan()
    if not len(index):
        raise UsageError(f"{source} holds no safetensors weights (model.safetensors, or the shards its index lists)")
    named = index.named()
    listed = weights_list(source)
    if listed is not None and not set(listed) <= set(named):
        raise UsageError(f"{source} is a slim folder already: slim the whole checkpoint")
    try:
        skeleton = _open(source, None, index, listed)
    except _NotThin as e:
        raise UsageError(f"{source} cannot be served from a slim folder: {e}") from None
    # The ends are what the client read (the weights list names every tensor of the model's files, so that it makes
    # the checkpoint id workers keeping the same files advertise).
    ends = {name: tensors.decode_raw(index.read(named[name][0]), named[name][1].dtype, named[name][1].shape).clone()
            for name in sorted(skeleton.ends)}
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != WEIGHTS_LIST:
            shutil.copy2(path, target / path.name)
    save_file(ends, str(target / "model.safetensors"), metadata={"format": "pt"})
    write_weights_list(target, index)
    rest = [loc for name, (_, loc) in named.items() if name not in skeleton.ends]
    return Slimmed(target, len(ends), sum(t.numel() * t.element_size() for t in ends.values()), len(rest),
                   sum(loc.length for loc in rest), index.id)
