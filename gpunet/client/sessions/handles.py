"""The user's handles on a model spread over workers and its sessions: sync over a Client's loop, async on the
caller's, over one engine (:mod:`gpunet.client.sessions.session`).
"""

from __future__ import annotations

import torch

from gpunet.client.sessions.audit import CheckReport
from gpunet.client.sessions.session import SequentialCore, SessionCore
from gpunet.client.sessions.spans import Span
from gpunet.ledger.receipts import Receipt


class AsyncRemoteSequential:
    """A model spread over workers (``await remote(x)``, ``async with remote.session() as s: await s.step(x)``)."""

    def __init__(self, core: SequentialCore):
        self._core = core

    @property
    def spans(self) -> list[Span]:
        return self._core.spans

    async def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return await self._core.forward(x)

    def session(self, ttl: float = 300.0, push: bool = True) -> "AsyncSession":
        return AsyncSession(self._core.session(ttl, push))


class _SessionView:
    """What a session shows, sync or async alike."""

    _core: SessionCore

    @property
    def placement(self) -> list[tuple[int, int, str | None]]:
        """(first block, last block + 1, worker id) per span, where each runs now."""
        return self._core.placement

    @property
    def receipts(self) -> list[Receipt]:
        """Every step's receipt, countersigned (replays after a move included: that work was done)."""
        return list(self._core.receipts)

    @property
    def moves(self) -> int:
        """Times a span moved to another worker (its state rebuilt by replaying its past inputs)."""
        return self._core.moves

    @property
    def pushed(self) -> int:
        """Span steps whose input went straight from the previous span's worker to this span's (docs/sessions.md)."""
        return self._core.pushed

    @property
    def checks(self) -> CheckReport | None:
        """With verify='adaptive' or 'local-sample': span steps checked against a replay, returned unchecked, and
        the workers caught returning a wrong one (docs/sessions.md); None without verify."""
        return self._core.checks.report if self._core.checks is not None else None


class AsyncSession(_SessionView):
    def __init__(self, core: SessionCore):
        self._core = core

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def step(self, x: torch.Tensor) -> torch.Tensor:
        return await self._core.step(x)

    async def close(self) -> None:
        await self._core.close()


class RemoteSequential:
    """A model spread over workers: ``y = remote(x)``; ``with remote.session() as s: y = s.step(x)``."""

    def __init__(self, core: SequentialCore, call):
        self._core, self._call = core, call

    @property
    def spans(self) -> list[Span]:
        """The spans: blocks ``start``..``stop - 1`` each, as one traced job."""
        return self._core.spans

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._core.forward(x))

    def session(self, ttl: float = 300.0, push: bool = True) -> "Session":
        """An inference session: each span's state (KV caches) stays on its worker between steps; idle past
        ``ttl`` seconds, workers free it."""
        return Session(self._core.session(ttl, push), self._call)


class Session(_SessionView):
    """``with remote.session() as s: y = s.step(x)``: steps in order, state on the workers, moved if one is lost."""

    def __init__(self, core: SessionCore, call):
        self._core, self._call = core, call

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._core.step(x))

    def close(self) -> None:
        self._call(self._core.close())
