"""The gpunet job format, shared by client and worker: manifest + JSON graph + safetensors weights, no code."""

import warnings

# torch.export's pytree code warns about its own deprecated internals on every trace and dry run; not the user's business.
warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

from gpunet.job.format import Estimate, JobLimits, Manifest  # noqa: E402
from gpunet.job.job import Job  # noqa: E402

__all__ = ["Estimate", "Job", "JobLimits", "Manifest"]
