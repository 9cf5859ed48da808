"""gpunet: a peer-to-peer compute network for tensor jobs.

The public surface is what ``__all__`` lists; everything else is internal::

    import gpunet
    with gpunet.Client(initial_peers=[...]) as client:
        job = gpunet.Job.from_module(model, example_inputs=(x,))
        y = client.submit(job, x, requirements=gpunet.Requirements(max_price=2.0)).result()
"""

from gpunet._version import __version__
from gpunet.dht import hivemind_parts as _hivemind_parts

_hivemind_parts.defer_package_init()  # before anything imports hivemind: see gpunet.dht.hivemind_parts
_hivemind_parts.share_memory_by_descriptor()
from gpunet.errors import *  # noqa: F401,F403  (the error family is public)
from gpunet.errors import __all__ as _errors_all

_LAZY = {
    # These pull in torch and hivemind; import them on first use so `gpunet ledger ...` and friends start fast.
    "Job": "gpunet.job",
    "JobLimits": "gpunet.job",
    "Estimate": "gpunet.job",
    "CheckpointIndex": "gpunet.job.checkpoints",
    "Client": "gpunet.client.api",
    "AsyncClient": "gpunet.client.api",
    "JobFuture": "gpunet.client.api",
    "Requirements": "gpunet.client.routing",
    "RemoteSequential": "gpunet.client.sessions",
    "Session": "gpunet.client.sessions",
}

__all__ = ["__version__", *_LAZY, *_errors_all]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpunet' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, so ``dir(gpunet)`` and autocompletion offer ``Client``, ``Job``, ..."""
    return sorted({*globals(), *_LAZY})
