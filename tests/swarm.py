"""Test helpers over :mod:`gpunet.testing`: the same local network the demo runs, plus CLI-driven checks."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
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
        """Watch the network through one ``gpunet status --json --watch`` (a look every half second, one JSON line
        each) until ``predicate`` holds for a look; return that look. One process joins the network once: a fresh
        ``gpunet status`` per look cost seconds of CPU each (imports, its own p2p daemon)."""
        cmd = gpunet_cmd("status", "--network", network or self.network, "--initial-peers", self.bootstrap_addr,
                         "--json", "--watch", "--interval", "0.5")
        looks: queue.Queue = queue.Queue()
        with tempfile.TemporaryFile("w+") as errors:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL, text=True,
                                    start_new_session=True)  # (its own group: stopped whole, its daemon with it)
            reader = threading.Thread(target=lambda: [looks.put(line) for line in proc.stdout] + [looks.put(None)],
                                      daemon=True)
            reader.start()
            deadline = time.monotonic() + timeout
            last = None
            try:
                while True:
                    try:
                        line = looks.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}; last look: "
                                           f"{json.dumps(last)[:2000]}") from None
                    if line is None:
                        proc.wait(timeout=30)
                        errors.seek(0)
                        raise AssertionError(f"gpunet status --watch exited ({proc.returncode}) waiting for "
                                             f"{message}: {errors.read()[-2000:]}")
                    last = json.loads(line)
                    if predicate(last):
                        return last
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                reader.join(timeout=5)
                proc.stdout.close()
