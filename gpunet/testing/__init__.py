"""A gpunet network deployed on this machine, as real processes on 127.0.0.1: what ``gpunet demo``, the benchmarks and
the end-to-end tests all run on (see :mod:`gpunet.testing.localnet`)."""

from gpunet.testing.localnet import LOOPBACK, LocalNetwork, Proc, free_port, gpunet_cmd, wait_for

__all__ = ["LOOPBACK", "LocalNetwork", "Proc", "free_port", "gpunet_cmd", "wait_for"]
