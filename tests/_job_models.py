"""Small models of the four families a gpunet job must reproduce exactly: MLP, encoder layer, conv net, GPT block."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 4))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class GPTBlock(nn.Module):
    """Pre-norm decoder block with causal self-attention (explicit mask) and a GELU MLP; returns (out, logits)."""

    def __init__(self, d: int = 32, heads: int = 4, vocab: int = 50):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.mlp(self.ln2(x))
        return x, self.lm_head(x)


def families():
    """(name, module, example inputs, dynamic shapes, inputs at other sizes) for each model family."""
    torch.manual_seed(0)
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=64)
    enc = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.1)
    return [
        ("mlp", MLP().eval(), (torch.randn(3, 16),), ({0: batch},), [torch.randn(1, 16), torch.randn(17, 16)]),
        ("encoder", enc.eval(), (torch.randn(2, 5, 16),), ({0: batch, 1: seq},), [torch.randn(1, 2, 16), torch.randn(6, 11, 16)]),
        ("convnet", ConvNet().eval(), (torch.randn(2, 3, 16, 16),), ({0: batch},), [torch.randn(1, 3, 16, 16), torch.randn(5, 3, 16, 16)]),
        ("gpt", GPTBlock().eval(), (torch.randint(0, 50, (2, 8)),), ({0: batch, 1: seq},), [torch.randint(0, 50, (1, 3)), torch.randint(0, 50, (4, 13))]),
    ]
