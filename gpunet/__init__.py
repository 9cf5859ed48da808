"""gpunet: a peer-to-peer compute network for tensor jobs.

The public surface is what ``__all__`` lists; everything else is internal.
"""

from gpunet._version import __version__
from gpunet.errors import *  # noqa: F401,F403  (the error family is public)
from gpunet.errors import __all__ as _errors_all
from gpunet.job import Estimate, Job, JobLimits

__all__ = ["__version__", "Job", "JobLimits", "Estimate", *_errors_all]
