"""Jobs of a known cost for tests and benchmarks: seconds of matmuls from a small program or a tiny input."""

from __future__ import annotations

import torch


class Spin(torch.nn.Module):
    """``k`` matmuls with one shared ``n``x``n`` weight: seconds of work on a CPU worker from a 4 MiB program."""

    def __init__(self, n: int = 1024, k: int = 96, seed: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(n, n) / n**0.5)
        self.k = k

    def forward(self, x):
        for _ in range(self.k):
            x = torch.tanh(x @ self.w)
        return x


class Churn(torch.nn.Module):
    """Work from a tiny input: ``k`` products of a 1024x1024 weight with itself (about 2 GFLOP each), so the job
    travels inline and costs what ``k`` says."""

    def __init__(self, k: int = 24, seed: int = 4):
        super().__init__()
        torch.manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(1024, 1024) / 32)
        self.k = k

    def forward(self, x):
        h = self.w + x.mean()
        for _ in range(self.k):
            h = torch.tanh(h @ self.w)
        return h[:1]
