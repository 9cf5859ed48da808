"""The job run on this machine: the one answer no worker can fake. It confirms or refutes a worker's "the job raised"
(:mod:`gpunet.client.delivery`) and checks results (:mod:`gpunet.client.verify`).

Apart from both because both need it, and verification asks delivery for more copies of a job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from gpunet.client.jobs import Prepared
from gpunet.errors import GpunetError, JobRaised

logger = logging.getLogger("gpunet.client")

#: A job a worker says raised (JobRaised) is run here to see, when it is this small (a few seconds on a CPU at most);
#: a bigger one needs a second worker, drawn at random, to say the same.
LOCAL_CONFIRM_FLOPS = 10**11
LOCAL_CONFIRM_BYTES = 2**30
LOCAL_CONFIRM_SECONDS = 30.0


def small_enough(p: Prepared) -> bool:
    """Whether this client runs the job itself to check a worker that says it raised."""
    return p.flops <= LOCAL_CONFIRM_FLOPS


class LocalRuns:
    def __init__(self):
        self._checks: concurrent.futures.ThreadPoolExecutor | None = None  # see raises_here

    async def raises_here(self, p: Prepared, until: float | None = None) -> bool | None:
        """Whether the job raises on this machine too (True), runs (False), or was not tried here (None: too big to
        run on a client, or this machine cannot), waiting at most until ``until`` (monotonic; the job's deadline
        by default). Decides a worker's "the job raised" without trusting anyone. Run
        once per job, and one job at a time on a thread of its own: lying workers cannot make the client run a job
        again and again, nor fill its threads (a run past its time finishes there, holding up only later checks)."""
        if p.flops > LOCAL_CONFIRM_FLOPS or p.peak_memory > LOCAL_CONFIRM_BYTES:
            return None
        if p.raises_here is None:
            if self._checks is None:
                self._checks = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpunet-check")
            p.raises_here = asyncio.get_running_loop().run_in_executor(self._checks, _raises, p)
        try:
            left = (p.deadline if until is None else until) - time.monotonic()
            async with asyncio.timeout(max(0.1, min(LOCAL_CONFIRM_SECONDS, left))):
                return await asyncio.shield(p.raises_here)
        except TimeoutError:
            logger.info("Could not run job %s here in time to check that it raises", p.job_id[:12])
            return None

    async def compute(self, p: Prepared, until: float):
        """The job computed on this machine, by ``until`` (monotonic; TimeoutError past it: the check's own time,
        not what the workers left of the job's); a JobRaised from it is confirmed here (``confirmed_here``): results
        in hand for it were made up, not checked ones."""
        try:
            async with asyncio.timeout(max(0.1, until - time.monotonic())):
                return await asyncio.to_thread(p.job.run_locally, *p.inputs)
        except JobRaised as e:
            e.confirmed_here = True
            raise

    def close(self) -> None:
        if self._checks is not None:
            self._checks.shutdown(wait=False, cancel_futures=True)


def _raises(p: Prepared) -> bool | None:
    """The job run here (in a thread): True if it raises as a job's own error, False if it runs, None if it cannot
    run here (memory, a dtype this machine lacks)."""
    inputs = p.inputs
    if inputs is None:
        from gpunet.job import tensors

        given = tensors.decode(p.encoded)
        inputs = tuple(given[f"input_{i}"] for i in range(len(given)))
    try:
        p.job.run_locally(*inputs)
    except JobRaised:
        return True
    except (GpunetError, MemoryError):
        return None
    return False
