"""Speed proofs, the client's side: which workers to challenge and when; routing learns what they proved.

The exchange and its checks are :mod:`gpunet.speedproof`; the bytes move through the transport. Each worker is
challenged once per client run, a few at a time and in the background (no job waits for a proof): every other
challenge goes to the fastest claim waiting (the fastest claims attract jobs first, so they are the ones worth
checking first), the rest to a worker drawn at random, so a flood of top claims cannot keep the others unchecked. Until a worker's proof
is in, routing credits it at most the fastest proof seen (see :meth:`Router.speed_factor`).

* Every challenge is bound to the worker's peer id (its matrices come from the seed and that id, its commitment is
  signed by that id's key): a worker answering with what another identity computed (a relay) fails it.
* A proof that checks out gives ``Router.on_proof(worker, tflops)``.
* A proof that does not (the worker committed to products it did not compute) gives 0 TFLOPS and an *invalid*
  outcome in the client's reputation: the worker lied about work.
* A worker that answers unsigned (it predates bound challenges: :class:`NotBound`), is busy, refuses or does not
  answer before it has committed is asked again later (``retry_after``),
  its claim capped meanwhile as for any unproven worker. Once those tries are used up it is credited no speed: a
  worker that never takes a challenge must not keep the benefit of the doubt.
* A worker that committed and then does not open its proof (it saw the picks land on products it skipped) is
  credited no speed at once, and asked again only on the retry schedule.
* A proof far below the claim (credited less than claimed) is asked again later (``reprove_after``), and routing keeps
  the best valid proof. A proof is timed on the client's clock and includes the checking work (generating matrices,
  digests: about half of a CPU's time in bf16), so a busy worker, or a client busy tracing a model (its event loop
  reads the answer late), proves less than it can; one unlucky moment must not cap an honest worker for good.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

from gpunet import speedproof
from gpunet.errors import GpunetError, SpeedProofFailed
from gpunet.protocol import OpenProof, ProveSpeed

if TYPE_CHECKING:
    from gpunet.client.routing import Router
    from gpunet.client.transport import BaseTransport
    from gpunet.client.reputation import Reputation
    from gpunet.dht.records import WorkerEntry

logger = logging.getLogger("gpunet.client")

class NotBound(GpunetError):
    """A worker answered a bound challenge in the unbound form (it predates binding): nothing is proven, nothing is
    held against it; it is asked again on the retry schedule, as a worker that did not take the challenge."""


#: ProofConfig.max_workers new challenges per this many seconds.
BUDGET_WINDOW = 3600.0


@dataclass
class ProofConfig:
    """How the client challenges workers' claimed speeds."""

    enabled: bool = True
    concurrent: int = 2  # challenges in flight at once
    seconds: float = speedproof.DEFAULT_SECONDS  # how long each worker computes
    retry_after: tuple[float, ...] = (30.0, 120.0, 600.0)  # after a busy, refused or failed-to-answer challenge
    max_workers: int = 256  # new workers challenged per hour at most; the rest stay capped meanwhile
    timeout: float = 30.0  # beyond the challenge's own seconds
    #: After a proof that came out below the claim: when to ask again (past the worker's ration of one challenge per
    #: client every 300 s, gpunet.worker.state.admission), at most this many times.
    reprove_after: tuple[float, ...] = (330.0, 1800.0)


@dataclass(frozen=True)
class Proof:
    """What one challenge proved: ``products`` products of ``n x n`` ``dtype`` matrices in ``seconds`` on the client's
    clock (less one ping), so ``tflops``."""

    dtype: str
    n: int
    products: int
    seconds: float
    tflops: float


@dataclass
class _Attempts:
    tries: int = 0
    next_at: float = 0.0
    running: bool = False
    done: bool = False  # proven, or its answer did not check out: not asked again
    low: int = 0  # proofs that came out below the claim (each asked again after ``reprove_after``)


@dataclass
class SpeedProofs:
    transport: "BaseTransport"  # one that proves (BaseTransport.proves)
    router: "Router"
    reputation: "Reputation"
    config: ProofConfig = field(default_factory=ProofConfig)
    clock: object = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    _attempts: dict[str, _Attempts] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _first_tries: deque = field(default_factory=deque)  # when each worker was first challenged (the last hour's)
    _picks: int = 0

    def due(self, entries: Iterable["WorkerEntry"], now: float | None = None) -> list["WorkerEntry"]:
        """The workers to challenge now (pure: which, not how): every other one the fastest claim waiting, the
        others drawn at random among those waiting. Claims alone would let a flood of records claiming the top
        speeds (never answering, each taking its retries) keep every other worker, a liar among them, unchallenged
        for good, and with nobody proven a claim is credited as it stands."""
        now = self.clock() if now is None else now
        free = self.config.concurrent - sum(a.running for a in self._attempts.values())
        if free <= 0:
            return []
        while self._first_tries and now - self._first_tries[0] > BUDGET_WINDOW:
            self._first_tries.popleft()
        new = self.config.max_workers - len(self._first_tries)
        # Not through relays: libp2p's relays often run limited (128 KiB per connection), and a proof's opening takes
        # most of that. An unproven worker is credited no more than the median proven one, so this gains it nothing.
        # A worker not challenged yet only within the budget of new challenges; a retry always.
        waiting = [e for e in entries if e.record.best_tflops > 0 and e.record.reachability != "relayed"
                   and self._may_try(e.id, now) and (e.id in self._attempts or new > 0)]
        waiting.sort(key=lambda e: e.record.best_tflops, reverse=True)
        due, k = [], self._picks
        while waiting and len(due) < free:
            pick = waiting.pop(0 if k % 2 == 0 else self.rng.randrange(len(waiting)))
            k += 1
            if pick.id not in self._attempts:
                if new <= 0:
                    continue
                new -= 1
            due.append(pick)
        return due

    def _may_try(self, worker_id: str, now: float) -> bool:
        a = self._attempts.get(worker_id)
        return a is None or (not a.done and not a.running and a.tries <= len(self.config.retry_after)
                             and now >= a.next_at)

    def schedule(self, entries: Iterable["WorkerEntry"]) -> None:
        """Start challenges for the workers due (call after each refresh of the worker view)."""
        due = self.due(entries)
        self._picks += len(due)
        for entry in due:
            attempt = self._attempts.setdefault(entry.id, _Attempts())
            attempt.running = True
            attempt.tries += 1
            if attempt.tries == 1:
                self._first_tries.append(self.clock())
            task = asyncio.ensure_future(self._challenge(entry, attempt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _challenge(self, entry: "WorkerEntry", attempt: _Attempts) -> None:
        committed = [False]
        try:
            proof = await self.prove(entry, committed)
        except SpeedProofFailed as e:
            logger.warning("Worker %s failed its speed proof (%s): it is credited no speed, and recorded as having "
                           "answered falsely", entry.id[-8:], e)
            self.router.on_proof(entry.id, 0.0)
            self.reputation.record(entry.id, "invalid")
            attempt.done = True
        except (GpunetError, TimeoutError) as e:
            waits = self.config.retry_after
            attempt.next_at = self.clock() + waits[min(attempt.tries - 1, len(waits) - 1)]
            # See the module docstring: no proof, no credit. A proof asked again (``low``) that does not complete
            # keeps the one it had (the worker may be rationing challenges, or busy with this client's own jobs);
            # one that committed and would not open loses it all the same.
            if committed[0] or (attempt.tries > len(waits) and not attempt.low):
                self.router.on_proof(entry.id, 0.0)
            logger.info("Speed challenge to worker %s did not complete (%s)%s", entry.id[-8:], str(e) or "timed out",
                        "; it is credited no speed until it proves one" if self.router.proven.get(entry.id) == 0.0 else
                        "; asking again later")
        except Exception:  # a broken worker must not break the client
            logger.exception("Speed challenge to worker %s failed unexpectedly", entry.id[-8:])
        else:
            self.router.on_proof(entry.id, proof.tflops)
            self._said(entry, proof, attempt)
        finally:
            attempt.running = False

    def _said(self, entry: "WorkerEntry", proof: "Proof", attempt: _Attempts) -> None:
        """A proof checked out: done, unless it came out below the claim and may be asked again; say so in the claim's
        own unit (a low proof logged bare made honest CPU workers look like 100x over-claimers)."""
        claimed = entry.record.tflops.get(proof.dtype, entry.record.best_tflops)
        cap = speedproof.credit_cap(proof.tflops)
        low = cap < claimed
        again = self.config.reprove_after[attempt.low] if low and attempt.low < len(self.config.reprove_after) else None
        attempt.done = again is None
        if again is not None:
            attempt.low += 1
            attempt.tries = 0  # a fresh set of retries for the next proof
            attempt.next_at = self.clock() + again
        (logger.info if low else logger.debug)(
            "Worker %s proved %.3g TFLOPS %s (%d products of %dx%d in %.2f s, as this client timed it, checking work "
            "included); it claims %.3g TFLOPS %s%s", entry.id[-8:], proof.tflops, proof.dtype, proof.products,
            proof.n, proof.n, proof.seconds, claimed, proof.dtype,
            "" if not low else f". Routing credits it at most {cap:.3g} TFLOPS"
            + (f" until it proves more (asked again in {again:.0f} s: a busy worker or client proves less)"
               if again is not None else ""))

    async def prove(self, entry: "WorkerEntry", committed_flag: list[bool] | None = None) -> "Proof":
        """One challenge to ``entry``, bound to its peer id: what it proved; SpeedProofFailed if its answer does not
        check out (a commitment signed by another identity, or rows of another id's matrices: a relayed answer).
        ``committed_flag[0]`` becomes True once the worker has committed (what fails after that is held against it).
        An unsigned commitment is the unbound form of a worker that predates binding: NotBound, it proves nothing."""
        ch = speedproof.Challenge.for_claim(entry.record.tflops, self.config.seconds, prover=entry.id)
        async with asyncio.timeout(ch.seconds + self.config.timeout):
            committed, seconds = await self.transport.prove(
                entry.id, ProveSpeed(ch.seed, ch.n, ch.seconds, ch.dtype, bind=True))
            if not committed.signature:
                raise NotBound("it answered with an unsigned commitment (a worker older than bound challenges): "
                               "unproven")
            speedproof.check_signature(ch, committed.commitments, committed.signature)
            if committed_flag is not None:
                committed_flag[0] = True
            picks = speedproof.pick(len(committed.commitments), ch.n)
            opened = await self.transport.open_proof(entry.id, OpenProof(ch.seed, ch.n, picks))
            await asyncio.to_thread(speedproof.verify, ch, committed.commitments, picks, opened.openings)
        products = len(committed.commitments)
        return Proof(ch.dtype, ch.n, products, seconds, speedproof.proven_tflops(ch, products, seconds))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
