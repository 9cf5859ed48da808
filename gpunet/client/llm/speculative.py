"""Speculative decoding: a small causal LM on the client proposes the next few tokens, and one session step checks
them all through every span, so a token costs a fraction of the network's round trips (docs/llm.md).

The served model's verdict is exact: the step returns its logits at every proposed position, and the generation's
own picker (HF's processors, greedy or sampling with its generator) picks each next token from them in turn, as it
would one step at a time; a proposal is kept while it is what the picker picked, and the first pick that differs is
the next token itself. So the output is what decoding without a draft gives, greedy or sampled with a seed (one draw
per emitted token either way), up to floating-point near-ties: a step of several tokens rounds as a prompt's step
does, not as one-token steps do (1e-6 apart on CPU), which can flip a pick between two tokens that close. A draft
otherwise changes only how many steps it takes. The spans then drop the rejected proposals' slots
(adapter.with_control's rewind).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from gpunet.errors import UsageError


class Draft:
    """Greedy proposals from a causal LM on this machine (it must share the served model's vocabulary), its KV cache
    kept across proposals and cut back to what the served model accepted."""

    def __init__(self, model: nn.Module, vocab: int | None = None):
        """``vocab``: the served model's vocabulary size; a proposal past it ends the proposals there."""
        from transformers import DynamicCache

        if not hasattr(model, "generation_config") or not hasattr(model, "config"):
            raise UsageError(f"a draft is a transformers causal LM (or its checkpoint folder), got "
                             f"{type(model).__name__}")
        self.model, self.vocab = model.eval(), vocab
        self.device = next(model.parameters()).device
        # What the model's forward calls its cache (``cache`` in newer transformers, ``past_key_values`` before).
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._cache_type = DynamicCache
        self.cache = None
        self.ids: list[int] = []  # the tokens whose keys and values the cache holds

    def _forward(self, ids: list[int]):
        return self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True,
                          **{self._cache_arg: self.cache})

    @torch.no_grad()
    def propose(self, ids: list[int], k: int) -> list[int]:
        """The ``k`` tokens the draft expects after ``ids`` (greedy)."""
        if k <= 0:
            return []
        common = 0
        for a, b in zip(self.ids, ids[:-1]):  # (at least the last token is fed: its logits are the first proposal)
            if a != b:
                break
            common += 1
        if self.cache is None or common == 0:
            self.cache, common = self._cache_type(), 0
        elif common < len(self.ids):
            self.cache.crop(common - len(self.ids))  # (a negative count: tokens to drop, in every transformers)
        out = self._forward(ids[common:])
        tokens: list[int] = []
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == k:
                break
            out = self._forward(tokens[-1:])
        self.ids = list(ids) + tokens[:-1]
        if self.vocab is not None:
            tokens = tokens[:next((i for i, t in enumerate(tokens) if t >= self.vocab), len(tokens))]
        return tokens
