"""FAULT INJECTION, for tests of trust only: the ways a worker can be told to lie, in one object.

Built from the hidden ``--fault-*`` flags (:meth:`Faults.from_config`) and nowhere else; a worker without them gets
:data:`NONE`, and every room that could lie asks this object, so a reader finds every fault in one place."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("gpunet.worker")


@dataclass(frozen=True)
class Faults:
    corrupt_outputs: Callable[[bytes], bytes] | None = None  # wrong outputs, signed as if right (a cheat for credits)
    corrupt_pieces: bool = False  # program pieces served to other workers with one byte wrong
    corrupt_pushes: bool = False  # wrong inputs pushed to the next span's worker
    drop_pushes: bool = False  # pushes lost on the way
    #: Seconds before the client's timeout each job's answer is held until (the client says how long it has left):
    #: a stall meant to leave the client no time to check the answer, as colluding liars would do.
    answer_late: float | None = None

    @classmethod
    def from_config(cls, cfg) -> "Faults":
        """The faults a worker's config (its hidden test flags) asks for; each one is said in the log."""
        faults = cls(corrupt_outputs=_corrupter(cfg.fault_corrupt_fraction) if cfg.fault_corrupt_fraction else None,
                     corrupt_pieces=cfg.fault_corrupt_pieces, corrupt_pushes=cfg.fault_corrupt_pushes,
                     drop_pushes=cfg.fault_drop_pushes, answer_late=cfg.fault_answer_late or None)
        if faults.corrupt_pieces:
            logger.warning("FAULT INJECTION: this worker serves other workers program pieces with one byte wrong")
        if faults.corrupt_pushes:
            logger.warning("FAULT INJECTION: this worker pushes wrong inputs to the next span's worker")
        if faults.drop_pushes:
            logger.warning("FAULT INJECTION: this worker pushes nothing to the next span's worker")
        if faults.answer_late is not None:
            logger.warning("FAULT INJECTION: this worker holds each answer until %g s before its client's timeout",
                           faults.answer_late)
        return faults

    async def hold(self, arrived: float, timeout: float) -> None:
        """Hold a job's answer (``answer_late``): ``arrived`` is when the job came (monotonic), ``timeout`` the
        seconds its client said it had left then."""
        if self.answer_late is not None:
            await asyncio.sleep(max(0.0, arrived + timeout - self.answer_late - time.monotonic()))

    def outputs(self, outputs: bytes) -> bytes:
        return outputs if self.corrupt_outputs is None else self.corrupt_outputs(outputs)

    def push(self, data: bytes | None) -> bytes | None:
        if data is not None and self.corrupt_pushes:
            return data[:-1] + bytes([data[-1] ^ 1])
        return data


NONE = Faults()


def _corrupter(fraction: float) -> Callable[[bytes], bytes]:
    """Wrong outputs (validly encoded, plausibly shaped) for ``fraction`` of jobs, signed as if they were right —
    what a volunteer cheating for credits would do."""
    from gpunet.job import tensors

    rng = random.Random()
    logger.warning("FAULT INJECTION: this worker corrupts %.0f%% of its outputs", 100 * fraction)

    def corrupt(outputs: bytes) -> bytes:
        if rng.random() >= fraction:
            return outputs
        decoded = tensors.decode(outputs)
        return tensors.encode({k: (v * 1.5 + 1) if v.is_floating_point() else v + 1 for k, v in decoded.items()})

    return corrupt
