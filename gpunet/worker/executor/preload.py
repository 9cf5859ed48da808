"""What the executors' fork server imports once (:func:`gpunet.worker.executor.forkserver.context`), so that every
executor forked from it starts with it in memory instead of importing it itself: torch, the validator and
interpreter, and torch's Python meta registrations, whose first use imports ``torch._dynamo`` (sympy, mpmath: about
800 modules). On a 2-core machine that was 4-5 s of CPU per executor; a fork costs milliseconds, and a crashed
executor's replacement, a session's own process and a spare come at that price too.

Nothing here runs a stranger's code, and the fork server never does: each executor enters its sandbox after the fork
(:func:`gpunet.worker.executor.child.child_main`), single-threaded then whatever torch started here."""

import importlib
import os

# OpenMP's threads sleep between parallel regions instead of spinning: jobs come in bursts (a session's step, then
# nothing until the next), and spinning threads took the cores from the worker's own I/O, the p2p daemon and any
# other process (three workers on two cores computed a step 60% slower). Read when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

for _name in ("gpunet.job.tensors", "gpunet.job.validator", "gpunet.job.interpreter"):
    importlib.import_module(_name)

# The first meta kernel that needs torch's Python registrations imports about 800 modules (sympy, mpmath): here, not
# in a client's first dry run (whose time it is charged).
torch.ops.aten.mean.dim(torch.empty(2, 3, device="meta"), [1])
