"""Hugging Face causal LMs as gpunet blocks, with no glue per family.

A decoder layer of any family is run as it is (HF's own module, in eager attention) inside :class:`DecoderBlock`, a
stateful block ``forward(x, keys, values, seen) -> (y, keys, values, seen)`` (docs/sessions.md): its KV cache is a
static cache of ``max_length`` slots that the block passes in as a duck-typed ``Cache`` (:class:`StepCache`, HF's
``update(key, value, layer_idx)``), writing the step's keys and values into their slots with ``scatter``. What a
layer needs beside its input is made the same way for every family, from what its ``forward`` names: the attention
mask (causal over the slots written so far, with the layer's sliding window), position ids and the model's own
rotary embeddings, or ALiBi built by the family's own ``build_alibi_tensor``. The cache's shape (KV heads, head size)
is learned by running each layer once on one token, not from per-family config names.

The embeddings and the head stay with the client and are run as HF runs them, by running the model's own forward
with its layer list swapped for one :class:`_Gate` (:class:`Ends`): up to the first layer (token and position
embeddings, scaling, embedding norms), and from after the last (final norm, head, logit soft-capping). One row
(batch 1) per session: a batch of prompts is one session per row, which the worker batches (the batching issue).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpunet.errors import UsageError

#: What HF calls the per-layer cache argument, by era and family.
_CACHE_NAMES = ("cache", "past_key_values", "layer_past", "past_key_value")
#: Families whose layers need a config switch to trace as safe jobs (mixture-of-experts: one batched matmul per
#: expert set, not a loop over data-dependent token lists).
_CONFIG_SWITCHES = {"experts_implementation": "batched_mm"}


class UnsupportedModel(UsageError):
    """A model gpunet cannot serve as a causal LM, saying what is missing."""


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The module holding the decoder layers, the attribute naming them, and the list itself: the ModuleList of
    ``num_hidden_layers`` entries (``model.layers``, ``transformer.h``, ``decoder.layers``, ``gpt_neox.layers``)."""
    n = getattr(text_config(model.config), "num_hidden_layers", None)
    found = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == n:
                found.append((parent_name, parent, name, child))
    if len(found) != 1:
        raise UnsupportedModel(f"{type(model).__name__}: found {len(found)} lists of {n} decoder layers, not one")
    _, parent, name, layers = found[0]
    return parent, name, layers


def _rotary(base: nn.Module) -> nn.Module | None:
    """The model's rotary embedding module (one per model in the families served), if it has one."""
    found = [m for name, m in base.named_children() if "rotary" in name]
    if len(found) > 1:
        raise UnsupportedModel(f"{type(base).__name__} has {len(found)} rotary embeddings (per-layer-type rotary is "
                               "not supported yet)")
    return found[0] if found else None


class StepCache:
    """One layer's static KV cache for one step, as HF's attention calls it (``update`` returns every slot's keys
    and values; the step's are written at slots ``where``). Slots past those written are masked out."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, where: torch.Tensor | None):
        self.keys, self.values, self.where = keys, values, where
        self.seen_shapes: tuple[torch.Size, torch.Size] | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, *args, **kwargs):
        if self.where is None:  # a probe: say the shapes, attend to this step only
            self.seen_shapes = (key.shape, value.shape)
            self.keys, self.values = key, value
            return key, value
        rows, steps = self.where.shape  # [B, T]: each row's own slots (sessions batched on a span: issue 42)
        k_at = self.where.view(rows, 1, steps, 1).expand(-1, key.shape[1], -1, key.shape[3])
        v_at = self.where.view(rows, 1, steps, 1).expand(-1, value.shape[1], -1, value.shape[3])
        self.keys = self.keys.scatter(2, k_at, key.to(self.keys.dtype))
        self.values = self.values.scatter(2, v_at, value.to(self.values.dtype))
        return self.keys, self.values

    # What some attention code asks of a cache besides update.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys.shape[2]

    is_compileable = False


@dataclass(frozen=True)
class LayerCall:
    """How a family's decoder layer is called: the names its forward takes."""

    cache: str | None
    mask: bool
    position_ids: bool
    position_embeddings: bool
    alibi: bool
    use_cache: bool

    @classmethod
    def of(cls, layer: nn.Module) -> "LayerCall":
        params = inspect.signature(layer.forward).parameters
        cache = next((n for n in _CACHE_NAMES if n in params), None)
        if cache is None:
            raise UnsupportedModel(f"{type(layer).__name__}.forward takes no cache argument (one of "
                                   f"{', '.join(_CACHE_NAMES)}): its keys and values cannot be kept between steps")
        return cls(cache, "attention_mask" in params, "position_ids" in params, "position_embeddings" in params,
                   "alibi" in params, "use_cache" in params)


def with_control(hidden: torch.Tensor, rewind: int = 0) -> torch.Tensor:
    """A span step's input: the hidden states [B, T, d] and one control channel after them, whose first token
    carries how many of the tokens the spans last wrote to drop before this step's (speculative decoding: drafted
    tokens the model did not accept). Every span passes the channel on unchanged, so each hears it (a step's
    pushes from span to span carry only its hidden states). A small integer: exact in any float dtype."""
    control = torch.zeros(*hidden.shape[:2], 1, dtype=hidden.dtype)
    control[:, 0, 0] = rewind
    return torch.cat([hidden, control], dim=-1)


def hidden_of(x: torch.Tensor) -> torch.Tensor:
    """The hidden states of a span step's output (its control channel dropped)."""
    return x[..., :-1]


class DecoderBlock(nn.Module):
    """One HF decoder layer as a gpunet stateful block: ``forward(x, keys, values, seen) -> (y, keys, values,
    seen)``; ``seen`` counts the tokens this session has written (the next one's slot and position); ``x`` and
    ``y`` carry the control channel of :func:`with_control` after the hidden states."""

    def __init__(self, layer: nn.Module, index: int, config, rotary: nn.Module | None, alibi_heads: int | None,
                 max_length: int, kv_shape: tuple[int, int], kv_dtype: torch.dtype):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.call = LayerCall.of(layer)
        self.max_length, self.kv_shape, self.kv_dtype = max_length, kv_shape, kv_dtype
        self.window = _window(config, index)
        self.alibi_heads = alibi_heads
        self._alibi_of = _alibi_builder(layer) if self.call.alibi and alibi_heads else None

    def initial_state(self) -> tuple[torch.Tensor, ...]:
        heads, size = self.kv_shape
        cache = torch.zeros(1, heads, self.max_length, size, dtype=self.kv_dtype)
        return cache, cache.clone(), torch.zeros(1, dtype=torch.int64)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor):
        """Per row (one session each, when a worker batches sessions on its span): ``x`` [B, T, d + 1], ``seen`` [B].
        Slots past a rewind keep what the dropped tokens wrote, unseen: no token attends past its own slot, and the
        step's own tokens overwrite theirs first."""
        control, x = x[..., -1:], x[..., :-1]
        # Never before the first slot nor past the last written, whatever the channel holds (NaN included: it
        # converts to the least int64).
        start = (seen - control[:, 0, 0].round().to(torch.int64).clamp(min=0)).clamp(min=0)
        # [B, T]: each row's slots and positions (made where x is: the traced program is the same either way)
        where = start[:, None] + torch.arange(x.shape[1], dtype=torch.int64, device=x.device)
        cache = StepCache(keys, values, where)
        slots = torch.arange(self.max_length, dtype=torch.int64, device=x.device)
        visible = slots[None, None, :] <= where[:, :, None]  # [B, T, L]: causal, and only slots written
        if self.window is not None:
            visible = visible & (slots[None, None, :] > where[:, :, None] - self.window)
        y = self.layer(x, **self.kwargs(x, cache, where, visible))
        if isinstance(y, (tuple, list)):
            y = y[0]
        return torch.cat([y, control.to(y.dtype)], dim=-1), cache.keys, cache.values, where[:, -1] + 1

    def kwargs(self, x: torch.Tensor, cache: Any, where: torch.Tensor, visible: torch.Tensor) -> dict:
        call, out = self.call, {}
        out[call.cache] = cache
        positions = where  # [B, T]
        if call.mask:
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(~visible,
                                                                                   torch.finfo(x.dtype).min)
            out["attention_mask"] = mask[:, None]  # [B, 1, T, L]
        if call.position_ids:
            out["position_ids"] = positions
        if call.position_embeddings and self.rotary is not None:
            out["position_embeddings"] = self.rotary(x, positions)
        if call.alibi:
            out["alibi"] = None if self._alibi_of is None else self._alibi_of(
                torch.ones(visible.shape[0], visible.shape[-1], dtype=torch.int64, device=x.device), self.alibi_heads,
                x.dtype)
        if call.use_cache:
            out["use_cache"] = True
        return out


def _window(config, index: int) -> int | None:
    """The layer's sliding window (keys further back than it are not attended to), as HF's masks set it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[index] == "sliding_attention" and window else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window or None


def _alibi_builder(layer: nn.Module):
    build = getattr(sys.modules[type(layer).__module__], "build_alibi_tensor", None)
    if build is None:
        raise UnsupportedModel(f"{type(layer).__name__} takes alibi but its module has no build_alibi_tensor")
    return build


def check_causal(model: nn.Module) -> None:
    """A decoder-only language model with its LM head, as transformers names them (``...ForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or \
            type(model).__name__ not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise UnsupportedModel(f"{type(model).__name__} is not a decoder-only causal language model with its LM "
                               "head (a transformers ...ForCausalLM); give that, or its checkpoint folder")


def prepare(model: nn.Module) -> nn.Module:
    """The model in eval mode, eager attention, and the config switches its layers need to trace."""
    check_causal(model)
    model.eval()
    config = model.config
    for c in {id(config): config, id(text_config(config)): text_config(config)}.values():
        if hasattr(c, "_attn_implementation"):
            c._attn_implementation = "eager"
        for key, value in _CONFIG_SWITCHES.items():
            if hasattr(c, key) or hasattr(c, f"_{key}"):
                with contextlib.suppress(Exception):
                    setattr(c, key, value)
    if hasattr(model, "set_experts_implementation"):
        with contextlib.suppress(Exception):
            model.set_experts_implementation("batched_mm")
    return model


def blocks_of(model: nn.Module, max_length: int) -> list[DecoderBlock]:
    """The model's decoder layers as gpunet blocks, each probed once (one token) for its cache's shape."""
    config = text_config(model.config)
    base, _, layers = decoder_layers(model)
    rotary = _rotary(base)
    alibi_heads = getattr(config, "num_attention_heads", None) if (
        getattr(config, "alibi", True) and "alibi" in inspect.signature(layers[0].forward).parameters) else None
    dtype = next(model.parameters()).dtype
    blocks = []
    for i, layer in enumerate(layers):
        probe = DecoderBlock(layer, i, config, rotary, alibi_heads, 1, (1, 1), dtype)
        x = torch.zeros(1, 1, config.hidden_size, dtype=dtype)
        cache = StepCache(None, None, None)
        try:
            with torch.no_grad():
                layer(x, **probe.kwargs(x, cache, torch.zeros(1, 1, dtype=torch.int64),
                                        torch.ones(1, 1, 1, dtype=torch.bool)))
        except Exception as e:  # a family whose layers want more than gpunet gives (Gemma-3's per-type rotary)
            raise UnsupportedModel(f"{type(layer).__name__} cannot run with what gpunet passes a decoder layer "
                                   f"(a static cache, a mask, positions, the model's rotary or ALiBi): "
                                   f"{type(e).__name__}: {str(e)[:300]}") from e
        if cache.seen_shapes is None:
            raise UnsupportedModel(f"{type(layer).__name__} did not write its keys and values to the cache it was "
                                   "given")
        k, v = cache.seen_shapes
        if k != v or len(k) != 4:
            raise UnsupportedModel(f"{type(layer).__name__} caches keys {list(k)} and values {list(v)}; gpunet's "
                                   "static cache holds [batch, heads, length, head size] for both")
        blocks.append(DecoderBlock(layer, i, config, rotary, alibi_heads, max_length, (k[1], k[3]), dtype))
    return blocks


class _Stop(Exception):
    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden


class _Gate(nn.Module):
    """Stands in for the decoder layers in the client's ends: stops the model at its first layer with what it would
    get (``inject`` None), or passes ``inject`` on in place of what the last layer would have returned."""

    attention_type = "full_attention"

    def __init__(self, inject: torch.Tensor | None, tuple_of: int = 0):
        super().__init__()
        self.inject, self.tuple_of = inject, tuple_of

    def forward(self, hidden_states, *args, **kwargs):
        if self.inject is None:
            raise _Stop(hidden_states)
        # Returned as a layer of this family returns (older ones: a tuple, hidden states first).
        return (self.inject, *(None,) * (self.tuple_of - 1)) if self.tuple_of else self.inject


#: One lock per model object: its layer list is swapped while an end runs, whoever runs it (two remote LMs made from
#: the same model object, on a sync and an async client, share it).
_SWAP_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.Lock]" = weakref.WeakKeyDictionary()
_SWAP_LOCKS_GUARD = threading.Lock()


class Ends:
    """The embeddings and the head, run on the client by the model's own forward (see the module's docstring). The
    model object is borrowed: while an end runs its layer list is swapped for a gate (under the model's lock), so the
    caller should not run it in another thread meanwhile."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.parent, self.name, self.layers = decoder_layers(model)
        with _SWAP_LOCKS_GUARD:
            self._lock = _SWAP_LOCKS.setdefault(model, threading.Lock())
        self._tuple_of = 0
        seen = []
        hook = self.layers[0].register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros(1, 1, dtype=torch.int64), use_cache=False)
        finally:
            hook.remove()
        if seen and isinstance(seen[0], (tuple, list)):
            self._tuple_of = len(seen[0])

    @contextlib.contextmanager
    def _gated(self, inject: torch.Tensor | None):
        with self._lock:
            setattr(self.parent, self.name, nn.ModuleList([_Gate(inject, self._tuple_of)]))
            try:
                yield
            finally:
                setattr(self.parent, self.name, self.layers)

    @torch.no_grad()
    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states entering the first layer, for token ``ids`` [B, T] at ``positions`` [B, T] (each row's
        own: the layers before the first are per token)."""
        with self._gated(None):
            try:
                self.model(input_ids=ids, position_ids=positions, use_cache=False)
            except _Stop as stop:
                return stop.hidden
        raise UnsupportedModel(f"{type(self.model).__name__}'s forward never reached its decoder layers")

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] from the last layer's hidden states [B, T, H]."""
        ids = torch.zeros(hidden.shape[:2], dtype=torch.int64)
        with self._gated(hidden):
            positions = torch.arange(hidden.shape[1]).expand(hidden.shape[:2])
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
        return out.logits
