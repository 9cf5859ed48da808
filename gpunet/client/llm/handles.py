"""The user's handles on a remote causal LM: sync over a Client's loop, async on the caller's, over one engine
(:class:`gpunet.client.llm.engine.CausalLMCore`)."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import torch

from gpunet.client.llm.engine import CausalLMCore, Usage


class _View:
    _core: CausalLMCore

    @property
    def tokenizer(self):
        """The checkpoint's tokenizer (None when the model came without one)."""
        return self._core.tokenizer

    @property
    def config(self):
        return self._core.config

    @property
    def max_length(self) -> int:
        """Prompt plus new tokens a session holds (each span's static KV cache)."""
        return self._core.max_length

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(first layer, last layer + 1) of each span of decoder layers, as traced."""
        return [(s.start, s.stop) for s in self._core.spans]

    @property
    def last(self) -> Usage | None:
        """What the last finished request did: tokens, who served which span, receipts and cost."""
        return self._last


class AsyncRemoteCausalLM(_View):
    """``await lm.generate(ids, max_new_tokens=...)``, ``async for tokens in lm.stream(...)``, ``await lm(ids)``."""

    def __init__(self, core: CausalLMCore):
        self._core, self._last = core, None

    async def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=await self._core.forward(input_ids, attention_mask))

    async def generate(self, input_ids, attention_mask=None, *, streamer=None, **kwargs) -> torch.Tensor:
        """What HF's ``generate`` returns for the same arguments: [B, prompt + new] token ids."""
        usage = Usage()
        out = await self._core.generate(input_ids, attention_mask, streamer=streamer, usage=usage, **kwargs)
        self._last = usage
        return out

    async def stream(self, input_ids, attention_mask=None, **kwargs) -> AsyncIterator[torch.Tensor]:
        """Each step's new tokens [B] as they come (a finished row's are its pad token)."""
        usage = Usage()
        try:
            async for tokens in self._core.steps(input_ids, attention_mask, usage=usage, **kwargs):
                yield tokens
        finally:
            self._last = usage


class RemoteCausalLM(_View):
    """``lm.generate(ids, max_new_tokens=...)`` as HF's, ``for tokens in lm.stream(...)``, ``lm(ids).logits``."""

    def __init__(self, core: CausalLMCore, call):
        self._core, self._call, self._last = core, call, None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=self._call(self._core.forward(input_ids, attention_mask)))

    def generate(self, input_ids, attention_mask=None, *, streamer=None, **kwargs) -> torch.Tensor:
        """What HF's ``generate`` returns for the same arguments: [B, prompt + new] token ids. ``streamer`` is
        HF's (``TextStreamer``, ``TextIteratorStreamer``): ``put`` with the prompt, then each step's tokens."""
        usage = Usage()
        out = self._call(self._core.generate(input_ids, attention_mask, streamer=streamer, usage=usage, **kwargs))
        self._last = usage
        return out

    def stream(self, input_ids, attention_mask=None, **kwargs) -> Iterator[torch.Tensor]:
        """Each step's new tokens [B] as they come; leaving the loop early ends the request's sessions."""
        usage = Usage()
        steps = self._core.steps(input_ids, attention_mask, usage=usage, **kwargs)
        try:
            while True:
                try:
                    yield self._call(steps.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(steps.aclose())
            self._last = usage
