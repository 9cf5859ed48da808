"""The volunteer's standing job (``gpunet worker --background-job FILE``): their own work, filling idle time.

Vast.ai hosts name a "background job" that runs whenever nobody rents the machine; BOINC runs a project's work when
the owner is away. Here the owner names a job of their own (a program saved with ``Job.save``, and its inputs as a
safetensors file ``input_0``, ``input_1``, ...); the worker runs it again and again in the ``background`` lane
(gpunet.worker.state.lanes): only while no paying job waits, and any paying job stops it at once (the run is simply
dropped and started again later). It runs in the same sandboxed executors as any job.

Each finished run leaves its outputs in ``<data dir>/background/`` (the newest :data:`KEEP_OUTPUTS` runs, as
safetensors files) and a receipt in the worker's ledger, signed by the worker and by the owner's client identity
(``<data dir>/client``, the identity ``gpunet.Client`` uses on this machine) at price 0 in the ``background`` lane:
the owner's own work is on the books, and never billed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path

from gpunet.errors import ConfigError, GpunetError, JobPreempted
from gpunet.identity import Identity
from gpunet.ledger.receipts import countersign, sign_as_worker
from gpunet.protocol import BACKGROUND
from gpunet.utils import sha256_hex
from gpunet.worker import metrics

logger = logging.getLogger("gpunet.worker")

KEEP_OUTPUTS = 16
#: Seconds to wait after a run that failed before trying again (a broken job must not spin the machine).
FAILURE_BACKOFF = 60.0


def load_standing_job(job_path: Path, inputs_path: Path | None, memory_budget: int = 8 * 2**30,
                      device: str = "cpu"):
    """The job and its inputs (canonical bytes), checked as this worker's executors (``memory_budget``, ``device``)
    check any job (ConfigError, with the reason, when either will not do), so a mistake shows when the worker starts,
    not at the first idle moment."""
    from gpunet.job import Job
    from gpunet.job import tensors
    from gpunet.job.validator import load_program
    from gpunet.worker.executor import job_limits

    try:
        job = Job.load(job_path)
    except (OSError, GpunetError) as e:
        raise ConfigError(f"--background-job {job_path}: not a gpunet job file ({e}); save one with Job.save") from None
    inputs: list = []
    if inputs_path is not None:
        try:
            named = tensors.decode(Path(inputs_path).read_bytes())
        except (OSError, GpunetError) as e:
            raise ConfigError(f"--background-inputs {inputs_path}: not a safetensors file of inputs ({e})") from None
        inputs = [named[f"input_{i}"] for i in range(len(named)) if f"input_{i}" in named]
        if len(inputs) != len(named):
            raise ConfigError(f"--background-inputs {inputs_path}: tensors are named input_0, input_1, ... (found "
                              f"{', '.join(sorted(named))})")
    try:
        encoded = job.encode_inputs(*inputs)  # the job's own check of count, dtypes and shapes
        # Validated (allowlisted ops, bounded memory and dry run) as this worker's executors load it: with their
        # limits, not the client's own estimate, which leaves those to each worker. Weights stay off a GPU (meta):
        # only its kernels' memory rules matter here.
        where = "cpu" if str(device) == "cpu" else "meta"
        load_program(job.parts, device=where, limits=job_limits(memory_budget)).estimate(inputs)
    except GpunetError as e:
        raise ConfigError(f"--background-job {job_path}: {e}") from None
    return job, encoded


class StandingJob:
    """Runs the owner's job whenever the worker is otherwise idle, until stopped."""

    def __init__(self, jobs, job, inputs: bytes, worker: Identity, owner: Identity, out_dir: Path):
        self.jobs, self.job, self.inputs = jobs, job, inputs
        self.worker, self.owner = worker, owner
        self.out_dir = out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.runs = 0
        self.stopped = 0  # runs stopped for paying work
        self._input_hash = sha256_hex(inputs)

    async def run_forever(self) -> None:
        program = self.job.program_bytes()
        logger.info("Background job %s: runs whenever no paying job wants this machine (outputs in %s)",
                    self.job.program_hash[:12], self.out_dir)
        while True:
            started = time.time()
            try:
                result = await self.jobs.turns.run_own(self.owner.peer_id, self.job.program_hash, program, self.inputs)
            except JobPreempted:
                self.stopped += 1
                metrics.BACKGROUND_RUNS.labels("stopped").inc()
                continue  # back in the queue: it runs again once nothing paying waits
            except GpunetError as e:
                logger.warning("Background job failed: %s; trying again in %.0f s", e, FAILURE_BACKOFF)
                await asyncio.sleep(FAILURE_BACKOFF)
                continue
            self.runs += 1
            metrics.BACKGROUND_RUNS.labels("done").inc()
            self._keep(result.outputs)
            self._book(result, started)
            (logger.info if self.runs == 1 else logger.debug)(
                "Background job run %d done in %.1f s", self.runs, result.wall_time)

    def _keep(self, outputs: bytes) -> None:
        path = self.out_dir / f"{self.runs:08d}.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(outputs)
        tmp.replace(path)
        for old in sorted(self.out_dir.glob("*.safetensors"))[:-KEEP_OUTPUTS]:
            old.unlink(missing_ok=True)

    def _book(self, result, started: float) -> None:
        """A receipt at price 0, signed by the worker and by the owner's client key: the owner's work, on the books."""
        output_hash = sha256_hex(result.outputs)
        receipt = sign_as_worker(
            self.worker, job_id=f"background-{secrets.token_hex(8)}", client_id=self.owner.peer_id,
            program_hash=self.job.program_hash, input_hash=self._input_hash, output_hash=output_hash,
            flops=int(result.flops), wall_time_us=int(result.wall_time * 1e6), price=0, max_price=None,
            started_at_us=int(started * 1e6), ended_at_us=int(time.time() * 1e6), lane=BACKGROUND)
        self.jobs.billing.books.append(countersign(receipt, self.owner, output_hash=output_hash, max_price=None,
                                              lane=BACKGROUND))
