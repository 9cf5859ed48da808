"""gpunet: a peer-to-peer compute network for tensor jobs.

The public surface is what ``__all__`` lists; everything else is internal.
"""

from gpunet._version import __version__
from gpunet.errors import *  # noqa: F401,F403  (the error family is public)
from gpunet.errors import __all__ as _errors_all

__all__ = ["__version__", "Job", "JobLimits", "Estimate", *_errors_all]


def __getattr__(name: str):
    # Job pulls in torch; import it on first use so `gpunet ledger ...` and friends start fast.
    if name in ("Job", "JobLimits", "Estimate"):
        import gpunet.job

        return getattr(gpunet.job, name)
    raise AttributeError(f"module 'gpunet' has no attribute {name!r}")
