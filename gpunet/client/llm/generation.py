"""What ``generate`` does between steps, as Hugging Face's ``generate`` does it: settings merged the same way (HF's
defaults, then the model's generation config, then the call's arguments), HF's own logits processors in HF's order,
greedy or sampled picks, the same stopping rules and the same padding of finished rows. So greedy output equals HF's
on the same weights, and sampling with a seed equals HF's after ``torch.manual_seed`` of that seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gpunet.errors import UsageError

#: The generation arguments gpunet takes (HF's names); others are refused by name, not silently ignored.
SUPPORTED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p",
             "repetition_penalty", "eos_token_id", "pad_token_id", "stop_strings", "seed"}
#: HF's settings that would change the output but gpunet does not do; refused when set to a non-default value.
_NOT_DONE = {"num_beams": 1, "num_return_sequences": 1, "no_repeat_ngram_size": 0, "typical_p": 1.0,
             "bad_words_ids": None, "sequence_bias": None, "guidance_scale": None, "forced_bos_token_id": None,
             "forced_eos_token_id": None, "suppress_tokens": None, "begin_suppress_tokens": None,
             "min_length": 0, "min_new_tokens": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
             "exponential_decay_length_penalty": None, "top_h": None, "watermarking_config": None}


@dataclass
class Settings:
    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


def settings(generation_config: Any, prompt_length: int, max_length: int, **kwargs) -> Settings:
    """HF's way: its global defaults, the model's ``generation_config``, then ``kwargs``; ``max_length`` is the
    session's (the static cache's) and bounds prompt plus new tokens."""
    unknown = set(kwargs) - SUPPORTED
    if unknown:
        raise UsageError(f"generate() does not take {', '.join(sorted(unknown))} (it takes "
                         f"{', '.join(sorted(SUPPORTED))}, and streamer)")
    from transformers import GenerationConfig

    merged: dict[str, Any] = dict(GenerationConfig._get_default_generation_params())
    if generation_config is not None:
        merged.update({k: v for k, v in generation_config.to_dict().items() if v is not None})
    merged.update({k: v for k, v in kwargs.items() if v is not None})  # None: the default, as in HF
    for name, default in _NOT_DONE.items():
        if merged.get(name) is not None and merged[name] != default:
            raise UsageError(f"generation with {name}={merged[name]!r} (from the model's generation config) is not "
                             "supported; set it to its default")
    new = merged.get("max_new_tokens")
    if new is None:
        new = merged.get("max_length", 20) - prompt_length
    if new < 1:
        raise UsageError(f"nothing to generate: max_new_tokens={new} (a prompt of {prompt_length} tokens)")
    if prompt_length + new > max_length:
        raise UsageError(f"a prompt of {prompt_length} tokens plus {new} new ones is more than this model's "
                         f"max_length ({max_length}, the length of each session's cache; causal_lm(max_length=...))")
    eos = merged.get("eos_token_id")
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    pad = merged.get("pad_token_id")
    if pad is None and eos:
        pad = eos[0]  # as HF does (it warns)
    stops = merged.get("stop_strings") or ()
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    return Settings(max_new_tokens=new, do_sample=bool(merged.get("do_sample")),
                    temperature=merged.get("temperature", 1.0), top_k=merged.get("top_k"),
                    top_p=merged.get("top_p"), min_p=merged.get("min_p"),
                    repetition_penalty=merged.get("repetition_penalty"), eos_token_id=eos, pad_token_id=pad,
                    stop_strings=stops, seed=kwargs.get("seed"))


def processors(s: Settings):
    """HF's logits processors for these settings, in the order HF's ``generate`` applies them."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    out = LogitsProcessorList()
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty=s.repetition_penalty))
    if s.do_sample:
        if s.temperature is not None and s.temperature != 1.0:
            out.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k is not None and s.top_k != 0:
            out.append(TopKLogitsWarper(top_k=s.top_k, min_tokens_to_keep=1))
        if s.top_p is not None and s.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=s.top_p, min_tokens_to_keep=1))
        if s.min_p is not None:
            out.append(MinPLogitsWarper(min_p=s.min_p, min_tokens_to_keep=1))
    return out


class Picker:
    """Picks each step's next tokens for every row at once (as HF does: one draw over the batch), and tracks which
    rows are finished."""

    def __init__(self, s: Settings, ids: torch.Tensor, tokenizer=None):
        self.s, self.ids = s, ids  # ids: [B, n], the prompt as given (left padding included), then what is picked
        self.procs = processors(s)
        self.unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
        self.produced = [0] * ids.shape[0]  # each row's new tokens, the one that finished it included
        self.generator = None
        if s.do_sample and s.seed is not None:
            self.generator = torch.Generator().manual_seed(int(s.seed))
        if s.stop_strings and tokenizer is None:
            raise UsageError("stop strings need the model's tokenizer (causal_lm(..., tokenizer=...))")
        self.tokenizer, self.prompt_length = tokenizer, ids.shape[1]
        if s.eos_token_id and s.pad_token_id is None:
            raise UsageError("generation that stops at eos_token_id needs a pad_token_id for the finished rows")

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens [B] from the last position's logits [B, vocab] (finished rows get the pad token)."""
        scores = self.procs(self.ids, logits.float())
        if self.s.do_sample:
            probs = torch.softmax(scores, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            nxt = torch.argmax(scores, dim=-1)
        if self.s.eos_token_id:  # as HF: finished rows are padded only where an end token can finish them
            nxt = torch.where(self.unfinished, nxt, torch.full_like(nxt, self.s.pad_token_id))
        self.ids = torch.cat([self.ids, nxt[:, None]], dim=-1)
        for row in range(nxt.shape[0]):
            self.produced[row] += int(self.unfinished[row])
        if self.s.eos_token_id:
            self.unfinished &= ~torch.isin(nxt, torch.tensor(self.s.eos_token_id))
        if self.s.stop_strings:
            for row in range(nxt.shape[0]):
                if self.unfinished[row] and self._stopped(row):
                    self.unfinished[row] = False
        return nxt

    def _stopped(self, row: int) -> bool:
        text = self.tokenizer.decode(self.ids[row, self.prompt_length:].tolist())
        return any(stop in text for stop in self.s.stop_strings)

    def stepping(self, row: int) -> bool:
        """Whether ``row`` needs its next logits: unfinished, or finished by a stop string with no end token to pad
        it (HF goes on generating such a row's tokens until every row is done)."""
        return bool(self.unfinished[row]) or not self.s.eos_token_id

    @property
    def done(self) -> bool:
        return not bool(self.unfinished.any()) or self.ids.shape[1] - self.prompt_length >= self.s.max_new_tokens


def rows_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int | None,
            eos: Sequence[int]) -> list[list[int]]:
    """Each row's real tokens (left padding dropped), with HF's rule for a missing mask: the pad token marks
    padding when it is set and is not also the end-of-sequence token."""
    if input_ids.dim() != 2:
        raise UsageError(f"input_ids is [batch, tokens], got shape {list(input_ids.shape)}")
    if attention_mask is None:
        if pad_token_id is not None and pad_token_id not in eos and bool((input_ids == pad_token_id).any()):
            attention_mask = (input_ids != pad_token_id).long()
        else:
            attention_mask = torch.ones_like(input_ids)
    rows = []
    for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
        kept = [t for t, m in zip(ids, mask) if m]
        first = next((i for i, m in enumerate(mask) if m), len(mask))
        if any(not m for m in mask[first:]):
            raise UsageError("attention_mask: only left padding is supported (zeros before a row's tokens)")
        if not kept:
            raise UsageError("a row of input_ids has no tokens (its attention_mask is all zeros)")
        rows.append(kept)
    return rows
