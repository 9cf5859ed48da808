"""A worker proves how fast it multiplies matrices, so routing relies on speed it has checked, not on a claim.

A worker's record claims TFLOPS per dtype, and a free identity can claim anything: the fastest-looking worker gets
the first jobs (and, before this proof, kept them until real jobs had measured it). So the client challenges each
worker once, and routes on the lower of the claim and what the worker proved (see ``Router.speed_factor``).

The challenge (both ends run this module; nothing big travels):

1. The client sends a random ``seed``, a matrix size ``n`` and a time budget. Both ends can generate a pool of
   ``n x n`` matrices with entries in {-1, 0, 1} from the seed and the prover's peer id (:attr:`Challenge.key`,
   :func:`matrix`, integer arithmetic that gives the same numbers on any CPU or GPU): the prover takes its own id,
   never one the request names, and signs its commitment with the key behind that id, so an identity with no device
   that relays its challenges to a real one gets products of the other identity's matrices, which check out for
   nobody else (issue 38). An older client sends the unbound form (the seed alone, nothing signed). Product ``j`` multiplies two of them (:func:`pair`; a pool of m matrices gives m**2
   products, so generating them is cheap next to multiplying).
2. The worker multiplies, in the dtype of its best claim, as many products as it can within the budget and answers, per product, a 16-byte
   hash of that product's *row digests* (:func:`row_digests`: a sum over the row of a non-linear function of each
   entry, so no shortcut gives it without every entry of the product). The client's clock, from sending the
   challenge to reading the answer less one ping's round trip, gives the speed: products x 2n**3 / seconds.
3. The client then picks products and rows at random (:func:`pick`) and asks for them opened: the product's digest
   vector (the worker kept them) and the picked rows (recomputed: a row of a product costs n**2 multiply-adds, the
   whole product n**3). It checks each row exactly against its own computation (float64 is exact here), the row's
   digest, and the digest vector against the committed hash (:func:`verify`).

A worker that skipped a fraction f of the products it claims passes with probability (1 - f) ** PICK_PRODUCTS: one
claiming twice its speed (f = 1/2) is caught 98.4 % of the time, one claiming ten times its speed (f = 0.9) passes once
in a million. One that computed only some rows of each product is caught by the opened rows. Freivalds' algorithm
would check a whole product in n**2 time too, but needs the whole product sent (16 MiB per product at n = 2048);
digests plus a few opened rows check the same claim with kilobytes. Entries in {-1, 0, 1} keep every product exact in
fp32 (|c| <= n < 2**24), so an honest worker's rows match to the bit on any device.

What this proves, and what not: a lower bound on how fast the worker multiplies matrices, as the client sees it, in
the dtype of its best claim; so it bounds every figure the worker advertises (routing scales them all by the same
factor). Ternary matrices are exact in narrower formats too, so a device with faster integer or fp8 units could use
them and prove more than its fp16/bf16 speed: the bound is loose by that much, never in the liar's favour beyond it. Network delay beyond one
ping, a busy device, and the generation and digest work (a third to a half of the time on a CPU, little on a GPU)
make an honest worker look slower than its claim, which is why routing allows :data:`SLACK`. It says nothing about the
results of jobs (verification does that).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gpunet.errors import SpeedProofFailed

if TYPE_CHECKING:
    import torch

#: Matrix sizes a challenge may use, and the claimed TFLOPS from which each is used: a bigger matrix makes the digest
#: and generation work (n**2) smaller next to the product (n**3), which matters on fast devices.
SIZES = (1024, 2048, 4096)
SIZE_FROM = (0.0, 2.0, 50.0)
#: The most products one challenge can ask for (a pool of 32 matrices: 2 GiB of fp32 at n = 4096, on a device that
#: claims 50 TFLOPS or more).
MAX_PRODUCTS = 1024
#: How long the worker computes, at most (the client asks for less; see ``DEFAULT_SECONDS``).
MAX_SECONDS = 2.0
DEFAULT_SECONDS = 0.5
#: Products and rows per product the client asks to see opened.
PICK_PRODUCTS, PICK_ROWS = 6, 2
#: Routing allows a claim up to this many times the proven speed (the proof's own overhead and network delay; see
#: ``scripts/bench_speedproof.py`` for the ratio an honest worker shows).
SLACK = 2.0


def credit_cap(proven_tflops: float) -> float:
    """The most TFLOPS routing credits a worker that proved ``proven_tflops``: the one expression both routing and
    anything checking it use (computed along two paths, two floats can differ in the last bit)."""
    return SLACK * proven_tflops


SEED_BYTES = 16
#: A bound challenge's key (:attr:`Challenge.key`): never the length of a seed.
BOUND_KEY_BYTES = 32
COMMIT_BYTES = 16
_BIND = b"gpunet-speedprf1"  # blake2b's personalisation (16 bytes): a bound challenge's key and signed statement

_MASK = (1 << 31) - 1
_K = 7919


#: The dtypes a challenge may be multiplied in (the names of a worker record's ``tflops``). Ternary products must be
#: exact in each: fp16 keeps every integer up to 2048, bf16 only up to 256. An entry of a product is a sum of n terms
#: in {-1, 0, 1} (standard deviation sqrt(2n/3)): |c| > 256 is 8.5 standard deviations at n = 2048 (never seen), but
#: only 6 at n = 4096, where about one proof in 20,000 would hold an entry bf16 rounds and an honest worker would fail.
#: So a client never asks for bf16 beyond :data:`MAX_EXACT_N` (:func:`terms`): a claim that calls for 4096 is proven
#: in fp16 where the worker claims it (the devices that fast run both on the same units), else at 2048. A worker
#: still takes a 4096 bf16 challenge from an older client.
DTYPES = ("fp32", "fp16", "bf16")
#: The largest matrix size per dtype at which every product is exact (see DTYPES).
MAX_EXACT_N = {"bf16": 2048}


#: The longest prover id a challenge may be bound to (a libp2p peer id is 52 characters for an Ed25519 key).
MAX_PROVER_CHARS = 128


@dataclass(frozen=True)
class Challenge:
    """``prover``: the peer id the challenge is bound to ("": the unbound form older clients send). Its matrices come
    from :attr:`key`, a hash of the seed *and* the prover's id, so an answer computed by (or for) another identity
    checks out for nobody else: a relay that forwards a challenge to a real device gets products of that device's
    matrices, not its own. The prover sets ``prover`` to its own id, never to one a requester names."""

    seed: bytes
    n: int
    seconds: float = DEFAULT_SECONDS
    dtype: str = "fp32"
    prover: str = ""

    @classmethod
    def for_claim(cls, tflops: dict[str, float], seconds: float = DEFAULT_SECONDS, prover: str = "") -> "Challenge":
        """A challenge for a worker claiming ``tflops`` per dtype: in the dtype of its best claim (so the proof bounds
        the highest figure it advertises), at the matrix size that claim calls for; bound to ``prover``."""
        dtype, n = terms(tflops)
        return cls(os.urandom(SEED_BYTES), n, seconds, dtype, prover)

    @property
    def key(self) -> bytes:
        """What the matrices and row weights are generated from: the seed itself (unbound), else a hash of the seed
        and the prover's id (the seed has a fixed length, so no two (seed, id) pairs hash the same bytes). A bound key
        is longer than any seed: a relay asking an honest worker for the unbound form with the relay's own bound key
        as the seed would otherwise have the relay's matrices computed for it (an unbound seed is SEED_BYTES long)."""
        if not self.prover:
            return self.seed
        return hashlib.blake2b(self.seed + self.prover.encode(), digest_size=BOUND_KEY_BYTES, person=_BIND).digest()

    def statement(self, commitments: Sequence[bytes]) -> bytes:
        """What a bound prover signs with its identity key: the challenge, its own id and a hash of its commitments."""
        digest = hashlib.blake2b(b"".join(commitments), digest_size=32).digest()
        return b"\0".join([_BIND, self.seed, str(self.n).encode(), self.dtype.encode(), repr(float(self.seconds)).encode(),
                           self.prover.encode(), digest])

    def check(self) -> None:
        """Raise ValueError unless this is a challenge a worker should take."""
        if len(self.seed) != SEED_BYTES:
            raise ValueError(f"a challenge seed is {SEED_BYTES} bytes")
        if self.n not in SIZES:
            raise ValueError(f"a challenge's matrix size is one of {SIZES}")
        if not 0 < self.seconds <= MAX_SECONDS:
            raise ValueError(f"a challenge may take at most {MAX_SECONDS:g} s")
        if self.dtype not in DTYPES:
            raise ValueError(f"a challenge's dtype is one of {', '.join(DTYPES)}")
        if len(self.prover) > MAX_PROVER_CHARS or not self.prover.isascii():
            raise ValueError("a challenge is bound to a peer id")

    @property
    def flops_per_product(self) -> int:
        return 2 * self.n**3


def terms(tflops: dict[str, float]) -> tuple[str, int]:
    """The dtype and matrix size of a challenge to a worker claiming ``tflops``: its best claim's dtype, at the size
    that claim calls for (:func:`fits` says what else a worker takes)."""
    known = _claims(tflops)
    dtype = max(known, key=known.get)
    n = SIZES[_size_step(known[dtype])]
    if n > MAX_EXACT_N.get(dtype, n):  # not exact there (see DTYPES)
        if "fp16" in known and n in SIZES[: _size_step(known["fp16"]) + 2]:
            return "fp16", n
        return dtype, MAX_EXACT_N[dtype]
    return dtype, n


def fits(tflops: dict[str, float], dtype: str, n: int) -> bool:
    """Whether a worker claiming ``tflops`` should take a challenge in ``dtype`` at size ``n``: a dtype it claims, at
    most one size above what that claim calls for (a claim measured again, lower, since the client read it must not
    turn an honest challenge away; a product one size up is 8x the work, a 4096 one on a CPU hundreds)."""
    known = _claims(tflops)
    return dtype in known and n in SIZES[: _size_step(known[dtype]) + 2]


def _claims(tflops: dict[str, float]) -> dict[str, float]:
    """The claims a challenge can be in (none: fp32, at the smallest size)."""
    return {k: v for k, v in tflops.items() if k in DTYPES} or {"fp32": 0.0}


def _size_step(claimed: float) -> int:
    """The index in SIZES of the matrix size a claim of ``claimed`` TFLOPS calls for."""
    return max(i for i, start in enumerate(SIZE_FROM) if claimed >= start)


def pair(j: int) -> tuple[int, int]:
    """Product ``j``'s two pool matrices, in shells: products 0 .. (s+1)**2 - 1 use only matrices 0 .. s, so a worker
    generates a new matrix for every 2s+1 products, not two per product."""
    s = math.isqrt(j)
    k = j - s * s
    return (s, k) if k <= s else (k - s - 1, s)


def _mix(x: "torch.Tensor") -> "torch.Tensor":
    """A 31-bit integer hash of each element (values stay below 2**62: no overflow on any device)."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK
    return x ^ (x >> 15)


def _key(seed: bytes, label: str) -> int:
    return int.from_bytes(hashlib.blake2b(seed + label.encode(), digest_size=4).digest(), "little") & _MASK


def matrix(seed: bytes, index: int, n: int, device="cpu", rows: Sequence[int] | None = None) -> "torch.Tensor":
    """Pool matrix ``index`` (or just some of its ``rows``), float32 with entries in {-1, 0, 1}; identical on any
    device."""
    import torch

    cols = torch.arange(n, dtype=torch.int64, device=device)
    starts = (torch.arange(n, dtype=torch.int64, device=device) if rows is None
              else torch.tensor(list(rows), dtype=torch.int64, device=device)) * n
    scale, shift = _key(seed, f"a{index}") | 1, _key(seed, f"b{index}")  # each matrix its own affine re-indexing
    x = _mix(((starts[:, None] + cols[None, :]) * scale + shift) & _MASK)
    return ((x % 3) - 1).to(torch.float32)


def _weights(seed: bytes, n: int, device) -> "torch.Tensor":
    import torch

    return (_mix(torch.arange(n, dtype=torch.int64, device=device) ^ _key(seed, "w")) & 0x7FFF).to(torch.int32)


def row_digests(product: "torch.Tensor", weights: "torch.Tensor") -> "torch.Tensor":
    """One int64 per row of ``product``: sum_k w_k * ((c + n)(c + n + K) mod 2**16). The reduction of each entry makes
    it non-linear, so it cannot be had from a few matrix-vector products the way a linear sketch could (int32 all the
    way: (c + n)(c + n + K) < 2**26 and w_k < 2**15)."""
    import torch

    n = product.shape[-1]
    c = product.to(torch.int32) + n
    return ((c * (c + _K)) & 0xFFFF).mul_(weights).sum(dim=-1, dtype=torch.int64)


def _le_bytes(t: "torch.Tensor", dtype: str) -> bytes:
    return t.cpu().numpy().astype(dtype).tobytes()


def commitment(digests: "torch.Tensor | bytes") -> bytes:
    """The hash a worker commits to for one product: of its row digests (a tensor, or their little-endian bytes)."""
    raw = digests if isinstance(digests, bytes) else _le_bytes(digests, "<i8")
    return hashlib.blake2b(raw, digest_size=COMMIT_BYTES).digest()


def commit(digests: Sequence[bytes]) -> list[bytes]:
    return [commitment(d) for d in digests]


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


# --- the worker's side ---------------------------------------------------------------------------------------------


def prove(ch: Challenge, device="cpu", max_products: int = MAX_PRODUCTS, clock=time.monotonic) -> list[bytes]:
    """Multiply products 0, 1, 2, ... until ``ch.seconds`` have passed (at least one) or ``max_products``; the row
    digests of each (n little-endian int64: keep them to open the proof; :func:`commit` gives what to send). Call it
    off the event loop: it keeps the device busy for the whole budget.

    The same numbers as :func:`matrix` and :func:`row_digests`, computed in place in buffers made once: an honest
    worker's proof should be its matmul speed, not its allocator's (fresh 4 MiB tensors per product cost a third)."""
    import torch

    ch.check()
    deadline = clock() + ch.seconds
    n, key = ch.n, ch.key
    index = torch.arange(n * n, dtype=torch.int64, device=device).view(n, n)
    scratch, spare = torch.empty_like(index), torch.empty_like(index)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[ch.dtype]
    product = torch.empty(n, n, dtype=dtype, device=device)
    c, d = (torch.empty(n, n, dtype=torch.int32, device=device) for _ in range(2))
    weights = _weights(ch.key, n, device)
    pool: list[torch.Tensor] = []
    digests = []
    with torch.no_grad():
        for j in range(min(max_products, MAX_PRODUCTS)):
            a, b = pair(j)
            while len(pool) <= max(a, b):
                i = len(pool)
                torch.mul(index, _key(key, f"a{i}") | 1, out=scratch)
                _mix_(scratch.add_(_key(key, f"b{i}")).bitwise_and_(_MASK), spare)
                pool.append(scratch.remainder_(3).sub_(1).to(dtype))
            torch.matmul(pool[a], pool[b], out=product)
            c.copy_(product).add_(n)
            torch.add(c, _K, out=d)
            digests.append(d.mul_(c).bitwise_and_(0xFFFF).mul_(weights).sum(dim=-1, dtype=torch.int64))
            if j % 8 == 7 or clock() >= deadline:  # on a GPU the clock runs ahead of the queued work: sync now and then
                _sync(device)
                if clock() >= deadline:
                    break
        _sync(device)
    out = [_le_bytes(x, "<i8") for x in digests]
    if str(device).startswith("cuda"):  # the pool (up to 600 MiB at n = 2048) is not kept by torch's allocator
        del pool, product, index, scratch, spare, c, d, digests
        torch.cuda.empty_cache()
    return out


def _mix_(x: "torch.Tensor", spare: "torch.Tensor") -> "torch.Tensor":
    """:func:`_mix` in place (``spare``: a buffer of x's shape)."""
    import torch

    for shift, factor in ((15, 0x2C1B3C6D), (12, 0x297A2D39)):
        torch.bitwise_right_shift(x, shift, out=spare)
        x.bitwise_xor_(spare).mul_(factor).bitwise_and_(_MASK)
    torch.bitwise_right_shift(x, 15, out=spare)
    return x.bitwise_xor_(spare)


@dataclass(frozen=True)
class Opening:
    """One opened product: its whole digest vector, and the rows asked for."""

    product: int
    digests: bytes  # n little-endian int64
    rows: dict[int, bytes]  # row index -> n little-endian int32


def open_products(ch: Challenge, picks: dict[int, list[int]], digests: Sequence[bytes], device="cpu") -> list[Opening]:
    """Open the picked products of a proof whose row ``digests`` the worker kept: the digests as they were, and each
    picked row recomputed (a row of a product costs n**2, so opening is cheap next to proving)."""
    import torch

    ch.check()
    out = []
    with torch.no_grad():
        for j, rows in sorted(picks.items()):
            a, b = pair(j)
            picked = matrix(ch.key, a, ch.n, device, rows=rows) @ matrix(ch.key, b, ch.n, device)
            out.append(Opening(j, digests[j], {i: _le_bytes(picked[k].to(torch.int32), "<i4")
                                               for k, i in enumerate(rows)}))
    return out


# --- the client's side ---------------------------------------------------------------------------------------------


def pick(products: int, n: int, rng: random.Random | None = None) -> dict[int, list[int]]:
    """Which products and rows to open: drawn after the worker has committed, so it cannot know them in advance."""
    rng = rng or random.SystemRandom()
    chosen = rng.sample(range(products), min(products, PICK_PRODUCTS))
    return {j: sorted(rng.sample(range(n), PICK_ROWS)) for j in chosen}


def verify(ch: Challenge, commitments: Sequence[bytes], picks: dict[int, list[int]],
           openings: Sequence[Opening]) -> None:
    """Raise SpeedProofFailed unless every picked row is right, its digest matches and each opened digest vector is
    the one committed to. Costs the client about one n x n matrix generation per distinct second factor."""
    import numpy as np
    import torch

    got = {o.product: o for o in openings}
    if set(got) != set(picks) or len(openings) != len(got):
        raise SpeedProofFailed("the worker did not open exactly the products asked for")
    key = ch.key
    weights = _weights(key, ch.n, "cpu")
    pool: dict[int, torch.Tensor] = {}
    for j, rows in picks.items():
        o = got[j]
        if j >= len(commitments) or len(o.digests) != 8 * ch.n:
            raise SpeedProofFailed(f"product {j}: no commitment, or a digest vector of the wrong size")
        if hashlib.blake2b(o.digests, digest_size=COMMIT_BYTES).digest() != commitments[j]:
            raise SpeedProofFailed(f"product {j}: the opened digests are not the ones committed to")
        digests = np.frombuffer(o.digests, dtype="<i8")
        a, b = pair(j)
        if b not in pool:
            pool[b] = matrix(key, b, ch.n).double()
        expected = matrix(key, a, ch.n, rows=rows).double() @ pool[b]  # exact: integers far below 2**53
        for k, i in enumerate(rows):
            raw = o.rows.get(i)
            if raw is None or len(raw) != 4 * ch.n:
                raise SpeedProofFailed(f"product {j}: row {i} missing or of the wrong size")
            row = torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype("int64"))
            if not torch.equal(row, expected[k].to(torch.int64)):
                raise SpeedProofFailed(f"product {j}: row {i} is wrong")
            if int(row_digests(row[None, :], weights)[0]) != int(digests[i]):
                raise SpeedProofFailed(f"product {j}: row {i} does not match its committed digest")


def check_signature(ch: Challenge, commitments: Sequence[bytes], signature: bytes) -> None:
    """Raise SpeedProofFailed unless ``signature`` is the bound prover's, by the key behind its peer id, over this
    challenge, that id and these commitments (an answer signed by another identity was computed for another id)."""
    from gpunet.identity import verify as verify_signature

    if not ch.prover or not verify_signature(ch.prover, signature, ch.statement(commitments)):
        raise SpeedProofFailed(f"the commitment is not signed by {ch.prover[-8:] or 'the prover'} for this challenge "
                               "(an answer from another identity, relayed?)")


def proven_tflops(ch: Challenge, products: int, seconds: float) -> float:
    """The speed a proof of ``products`` products in ``seconds`` (the client's clock, less a round trip) shows."""
    return products * ch.flops_per_product / max(seconds, 1e-6) / 1e12
