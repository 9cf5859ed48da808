"""The executor pool: jobs run in sandboxed processes apart from the worker's network process.

* :mod:`.pool` — the pool the worker drives from its event loop (which process runs what, sessions pinned to theirs,
  a warm spare, deadlines and stops);
* :mod:`.slot` — one process and the parent's end of its pipe; :mod:`.forkserver` — where those processes come from
  (a fork server that imported torch once), and how each is followed;
* :mod:`.child` — what runs in the executor process (load, validate, cache, run); :mod:`.preload` — what the fork
  server that forks them imports once;
* :mod:`.sandbox` — how that process locks itself down; :mod:`.cache` — the programs it keeps, on disk and in memory.
"""

from gpunet.worker.executor.child import job_limits
from gpunet.worker.executor.pool import DryRun, Executor, RefFiles, RunResult
from gpunet.worker.executor.slot import STOP_GRACE

__all__ = ["DryRun", "Executor", "RefFiles", "RunResult", "STOP_GRACE", "job_limits"]
