"""The gpunet job format, shared by client and worker: manifest + JSON graph + safetensors weights, no code."""

from gpunet.job.format import Estimate, Job, JobLimits, Manifest

__all__ = ["Estimate", "Job", "JobLimits", "Manifest"]
