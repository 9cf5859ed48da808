"""Test helpers over :mod:`gpunet.testing`: the same local network the demo runs, plus CLI-driven checks."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Callable

from gpunet.testing import LocalNetwork, Proc, free_port, gpunet_cmd, wait_for  # noqa: F401  (re-exported for tests)


def group_gone(pgid: int) -> bool:
    """Whether no process of process group ``pgid`` is left."""
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


def run_cli(*args: str, timeout: float = 90, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``gpunet ARGS`` as a user would, capturing its output."""
    return subprocess.run(
        gpunet_cmd(*args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


class Swarm(LocalNetwork):
    """A local network whose tests read it through ``gpunet status --json``."""

    def status(self, network: str | None = None, *extra: str) -> dict:
        result = run_cli("status", "--network", network or self.network, "--initial-peers", self.bootstrap_addr, "--json",
                         *extra)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait_for_status(
        self, predicate: Callable[[dict], object], message: str, network: str | None = None, timeout: float = 45
    ) -> dict:
        """Poll ``gpunet status --json`` until ``predicate`` holds for it; return that status."""

        def check():
            status = self.status(network)
            return status if predicate(status) else None

        return wait_for(check, timeout, message, interval=0.5)
