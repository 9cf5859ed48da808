"""Speed challenges on the worker's side (:mod:`gpunet.speedproof`): multiply for the time asked and commit, or open
the products the client picked; rationed by admission, run in a thread on the executors' device.

A challenge that asks to be bound is computed for this worker's own peer id and its commitment signed with this
worker's identity key: the id comes from here, never from the request, so a relay that forwards its challenges here
gets an answer for this worker's id, which checks out for nobody else (:class:`gpunet.speedproof.Challenge`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from gpunet import speedproof
from gpunet.errors import JobRejected
from gpunet.identity import Identity
from gpunet.protocol import OpenProof, ProofOpening, ProveSpeed, SpeedCommitment
from gpunet.utils import LRU
from gpunet.worker.state.admission import Admission

logger = logging.getLogger("gpunet.worker")

#: Speed proofs whose row digests are kept for their opening (8 n bytes per product: 16 KiB at n = 2048, so at most
#: 16 MiB per proof and 256 MiB in all; a CPU worker's proof is a few hundred KiB).
MAX_OPEN_PROOFS = 16


class Prover:
    def __init__(self, admission: Admission, record: Callable[[], Any], identity: Identity, device: str = "cpu"):
        """``device``: where challenges run (the executors' device: the speed a worker proves is theirs);
        ``record``: the worker's record now (the speeds it claims decide which challenges it takes);
        ``identity``: this worker's key, whose peer id bound challenges are computed for and which signs them."""
        self.admission, self.record, self.identity, self.device = admission, record, identity, device
        #: client -> its last challenge (as computed here) and that proof's row digests
        self._digests: LRU[str, tuple[speedproof.Challenge, list[bytes]]] = LRU(MAX_OPEN_PROOFS)

    async def prove(self, client_id: str, message: ProveSpeed) -> SpeedCommitment:
        challenge = speedproof.Challenge(message.seed, message.n, message.seconds, message.dtype,
                                         self.identity.peer_id if message.bind else "")
        record = self.record()
        claims = record.tflops if record is not None else {}
        if not speedproof.fits(claims, challenge.dtype, challenge.n):
            dtype, n = speedproof.terms(claims)
            raise JobRejected(f"this worker takes speed challenges of {n}x{n} {dtype} matrices (what its "
                              f"claimed speed calls for), not {challenge.n}x{challenge.n} {challenge.dtype}")
        self.admission.screen_proof(client_id)
        self.admission.proof_started(client_id, message.seed, message.n)
        started = time.perf_counter()
        digests = await self._device_work(client_id, speedproof.prove, challenge, self.device, commits=True)
        logger.debug("Speed challenge from %s: %d products of %s %dx%d in %.3f s", client_id[-8:],
                     len(digests), challenge.dtype, challenge.n, challenge.n, time.perf_counter() - started)
        self._digests.put(client_id, (challenge, digests))
        commitments = tuple(speedproof.commit(digests))
        signature = self.identity.sign(challenge.statement(commitments)) if challenge.prover else b""
        return SpeedCommitment(commitments, signature)

    async def open(self, client_id: str, message: OpenProof) -> ProofOpening:
        self.admission.screen_opening(client_id, message.seed, message.n, message.picks)
        held = self._digests.pop(client_id)  # opened once, whatever happens next
        if held is None or (held[0].seed, held[0].n) != (message.seed, message.n):
            raise JobRejected("that speed challenge is no longer held here (too many others since); ask again later")
        challenge, digests = held
        self.admission.opening_started(client_id)
        openings = await self._device_work(client_id, speedproof.open_products, challenge, message.picks, digests,
                                           self.device)
        return ProofOpening(tuple(openings))

    async def _device_work(self, client_id: str, fn, *args, commits: bool = False):
        """Run a challenge's work in a thread. Admission hears it has ended only when the thread has (a call cancelled
        by its client must not let the next challenge start while this one still holds the device)."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))

        def ended(done: asyncio.Future) -> None:
            ok = not done.cancelled() and done.exception() is None
            self.admission.proof_ended(client_id, len(done.result()) if commits and ok else None)

        work.add_done_callback(ended)
        return await asyncio.shield(work)
