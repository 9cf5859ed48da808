"""A small decoder-only transformer in plain torch, written as gpunet blocks (the generation demo, tests, benchmark).

Its blocks follow gpunet's convention for stateful blocks (docs/sessions.md): ``forward(x, *state) -> (y, *new_state)``
with every state tensor of a fixed shape, so a session's memory is known before it starts and the state can stay on
the worker that holds the block. Each attention block keeps a static KV cache of ``max_len`` positions and its own
position counter; new keys and values are written into the cache with one-hot matrices (plain arithmetic, no
in-place writes, which safe jobs do not allow). Random init only: nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 6
    max_len: int = 128
    batch: int = 1


class Embed(nn.Module):
    """Token ids -> hidden states, plus sinusoidal positions counted from its state (the number of tokens seen)."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        half = cfg.d_model // 2
        self.register_buffer("freqs", torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half))

    def initial_state(self) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(1, dtype=torch.float32),)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor):
        t = ids.shape[1]
        where = pos + torch.arange(t, dtype=torch.float32)  # [T]
        angles = where[:, None] * self.freqs[None, :]
        positions = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)  # [T, D]
        if positions.dtype != self.tokens.weight.dtype:  # (positions are counted in float32 whatever the weights)
            positions = positions.to(self.tokens.weight.dtype)
        return self.tokens(ids) + positions[None], where[-1:] + 1  # tensor arithmetic only: no symbolic sizes


class Block(nn.Module):
    """Pre-norm attention + MLP with a static KV cache: state (keys, values, tokens seen)."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def initial_state(self) -> tuple[torch.Tensor, ...]:
        c = self.cfg
        cache = torch.zeros(c.batch, c.n_heads, c.max_len, c.d_model // c.n_heads, dtype=self.qkv.weight.dtype)
        return cache, cache.clone(), torch.zeros(1, dtype=torch.float32)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor):
        c = self.cfg
        b, t, d = x.shape
        h, dh = c.n_heads, d // c.n_heads
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, h, dh).transpose(1, 2) for z in (q, k, v))  # [B, H, T, Dh]
        slots = torch.arange(c.max_len, dtype=torch.float32)  # [L]
        where = pos + torch.arange(t, dtype=torch.float32)  # [T]: the positions these tokens take
        onehot = (slots[None, :] == where[:, None]).to(x.dtype)  # [T, L]
        keep = 1.0 - onehot.sum(0)[None, None, :, None]
        keys = keys * keep + torch.einsum("tl,bhtd->bhld", onehot, k)
        values = values * keep + torch.einsum("tl,bhtd->bhld", onehot, v)
        visible = slots[None, :] <= where[:, None]  # [T, L]: causal, and nothing past what has been written
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(dh)
        scores = scores.masked_fill(~visible[None, None], float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ values  # [B, H, T, Dh]
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.norm2(x))
        return x, keys, values, where[-1:] + 1


class Head(nn.Module):
    """Hidden states -> next-token logits (stateless)."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def tiny_gpt(cfg: TinyConfig = TinyConfig(), seed: int = 0) -> list[nn.Module]:
    """The model as a list of blocks (embedding, ``n_layers`` attention blocks, head), random init from ``seed``."""
    torch.manual_seed(seed)
    blocks: list[nn.Module] = [Embed(cfg), *(Block(cfg) for _ in range(cfg.n_layers)), Head(cfg)]
    for block in blocks:
        block.eval()
    return blocks


def initial_state(block: nn.Module) -> tuple[torch.Tensor, ...]:
    """A block's first state: what its ``initial_state()`` returns, none for a stateless block."""
    make = getattr(block, "initial_state", None)
    return tuple(make()) if make is not None else ()


@torch.no_grad()
def generate_locally(blocks: list[nn.Module], prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """Greedy generation in this process, the reference a networked session must equal token for token."""
    states = [initial_state(b) for b in blocks]
    x, out = prompt, []
    for _ in range(new_tokens):
        h = x
        for i, block in enumerate(blocks):
            if states[i]:
                h, *new = block(h, *states[i])
                states[i] = tuple(new)
            else:
                h = block(h)
        token = int(h[0, -1].argmax())
        out.append(token)
        x = torch.tensor([[token]])
    return out
