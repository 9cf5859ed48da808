"""Trust without a central authority: comparing redundant results, reputation, and adaptive replication.

**Agreement.** Two results agree when every output has the same shape and dtype and the values match within a
tolerance that fits the dtype and the spread expected across devices (CPU vs GPU kernels, different GPUs):
``|a - b| <= atol + rtol * |b|`` elementwise, with NaN matching NaN and infinities matching by sign. Integer and
bool outputs must be equal. See :data:`TOLERANCES`. In half precision the elementwise bound is loose (bf16 keeps 8
bits), so a liar could shift *every* output by a few percent within it; honest differences are rounding noise, not a
shift, so there the whole output must also agree in norm: ``||a - b|| <= ntol * max(||b||, atol * sqrt(n))``
(:data:`NORM_TOLERANCES`: 2% for bf16; a bf16 transformer against its fp32 run differs by 0.7%).

**Majority.** A job run on ``k`` workers needs a *quorum* of ``k // 2 + 1`` agreeing results. If the first results
leave no group that large, more workers are asked, up to ``2k - 1`` results in all (for ``k = 2``: a third worker
breaks a tie); still no quorum → :class:`~gpunet.VerificationFailed`. Results outside the winning group are not
countersigned: their workers are not paid, and it counts against them.

**Reputation** (per worker, kept by each client in ``<data dir>/reputation.json`` by
:mod:`gpunet.client.reputation`, never self-reported) has two
parts, kept apart because being unavailable is not lying::

    honesty      = (valid + 1) / (valid + 1 + 10 * rejected + 3 * invalid)
    availability = (valid + 1) / (valid + 1 + failures + 0.5 * timeouts)
    track_record = (valid + 4) / (valid + 5)
    score        = honesty * availability * track_record

where each count decays with a half-life of one day, so recent behaviour weighs most. A result outvoted by the
majority is *rejected*; an answer that fails the client's own checks (hashes, the dry run's shapes, a void or
overreaching receipt) is *invalid*; a job the worker did not finish (it crashed, drained, vanished) is a *failure*,
or a *timeout*. Routing skips workers whose honesty is under 0.5 (saying so when no worker is left) and divides the
expected speed of the others by their score: an unreliable worker gets less work, never a liar's treatment, and
short outages are handled by routing's bans, not by reputation. *Track record* is what identities being free calls
for: a worker this client has never used starts at 0.8, not at the best score (a liar caught and back under a new
identity ranks below the workers with a history), and reaches 0.96 after 20 good results; it is mild on purpose,
so routing still tries newcomers.

**Adaptive replication** (``Requirements(verify="adaptive")``), after BOINC: a worker's *streak* is its number of
consecutive results that were checked and valid. A worker with a streak under 50 is always checked (its result is
compared with a second worker's); beyond that it is spot-checked with probability ``max(1/streak, 0.05)``. A single
rejected result resets the streak to 0. On an honest network this costs about 5% extra compute after warm-up, and a
worker lying on 10% of its jobs is caught within its first 50 with probability 1 - 0.9^50 > 99%.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

HALF_LIFE = 24 * 3600.0
REJECTED_WEIGHT = 10.0
INVALID_WEIGHT = 3.0
TIMEOUT_WEIGHT = 0.5
TRACK_PRIOR = 4.0  # track_record = (valid + TRACK_PRIOR) / (valid + TRACK_PRIOR + 1): a stranger starts at 0.8
AVOID_BELOW = 0.5
ALWAYS_CHECK_UNTIL = 50
#: Consecutive checked-and-valid results after which a worker is *established* with this client: preferred as a
#: checker of others, and needed in a majority for the minority to be counted as lying.
ESTABLISHED_AFTER = 10
MIN_CHECK_PROBABILITY = 0.05

#: (rtol, atol) per dtype: loose enough for honest cross-device differences, far tighter than any useful lie.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-3, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
#: Relative tolerance on the norm of the difference, where the elementwise one alone would let a systematic shift pass.
NORM_TOLERANCES: dict[torch.dtype, float] = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    """A result's tensors in order, however they nest (a tensor, a tuple, dicts or ModelOutputs)."""
    from torch.utils._pytree import tree_leaves

    return tuple(tree_leaves(outputs))


def max_difference(a, b) -> float:
    """The largest absolute difference between two results (inf when shapes or dtypes differ)."""
    worst = 0.0
    for x, y in zip(_as_tuple(a), _as_tuple(b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return math.inf
        if x.numel():
            diff = (x.double() - y.double()).abs().nan_to_num(nan=0.0, posinf=math.inf)
            worst = max(worst, float(diff.max()))
    return worst


def agree(a, b) -> bool:
    """Whether two results match within their dtype's tolerance (see the module docstring)."""
    xs, ys = _as_tuple(a), _as_tuple(b)
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype in TOLERANCES:
            rtol, atol = TOLERANCES[x.dtype]
            if not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
            if x.dtype in NORM_TOLERANCES and not _close_in_norm(x, y, NORM_TOLERANCES[x.dtype], atol):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _close_in_norm(x: torch.Tensor, y: torch.Tensor, ntol: float, atol: float) -> bool:
    finite = torch.isfinite(x) & torch.isfinite(y)  # non-finite entries were matched elementwise already
    diff = torch.where(finite, x.float() - y.float(), 0.0)
    ref = torch.where(finite, y.float(), 0.0)
    # Near-zero outputs are measured against atol's scale instead (their noise is absolute, not relative).
    return float(diff.norm()) <= ntol * max(float(ref.norm()), atol * math.sqrt(max(1, int(finite.sum()))))


def quorum(k: int) -> int:
    return k // 2 + 1


def majority(results: Sequence) -> list[int] | None:
    """Indices of the largest group of mutually agreeing results, if it is a strict majority of them."""
    n = len(results)
    best: list[int] = []
    for i in range(n):
        group = [j for j in range(n) if j == i or agree(results[i], results[j])]
        if len(group) > len(best):
            best = group
    return best if len(best) * 2 > n else None


def describe(results: Sequence, workers: Sequence[str]) -> str:
    """What each worker returned, for a VerificationFailed message: shapes and max differences to the first."""
    parts = []
    for w, r in zip(workers, results):
        shapes = [tuple(t.shape) for t in _as_tuple(r)]
        parts.append(f"{w[-8:]}: shapes {shapes}, max diff to first {max_difference(r, results[0]):.3g}")
    return "; ".join(parts)


@dataclass
class WorkerTrust:
    valid: float = 0.0
    rejected: float = 0.0
    invalid: float = 0.0
    failures: float = 0.0
    timeouts: float = 0.0
    streak: int = 0  # consecutive checked-and-valid results
    updated: float = field(default_factory=time.time)

    def decay(self, now: float) -> None:
        factor = 0.5 ** (max(0.0, now - self.updated) / HALF_LIFE)
        self.valid *= factor
        self.rejected *= factor
        self.invalid *= factor
        self.failures *= factor
        self.timeouts *= factor
        self.updated = now

    @property
    def honesty(self) -> float:
        return (self.valid + 1) / (self.valid + 1 + REJECTED_WEIGHT * self.rejected + INVALID_WEIGHT * self.invalid)

    @property
    def availability(self) -> float:
        return (self.valid + 1) / (self.valid + 1 + self.failures + TIMEOUT_WEIGHT * self.timeouts)

    @property
    def track_record(self) -> float:
        return (self.valid + TRACK_PRIOR) / (self.valid + TRACK_PRIOR + 1)

    @property
    def score(self) -> float:
        return self.honesty * self.availability * self.track_record
