"""A real local gpunet swarm for tests: bootstrap and workers as separate processes on 127.0.0.1, driven by the CLI.

Every process is started in its own session, so it and its children (the DHT process, the p2p daemon) are stopped
by process-group id — never by name. Waiting is always on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, message: str, interval: float = 0.1) -> T:
    """Poll ``condition`` until it returns something truthy; fail the test with ``message`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s: {message}")
        time.sleep(interval)


def gpunet_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpunet", *args]


def run_cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        gpunet_cmd(*args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@dataclass(eq=False)
class Proc:
    """A gpunet process with its output collected line by line."""

    name: str
    popen: subprocess.Popen
    data_dir: Path
    lines: list[str] = field(default_factory=list)

    def __post_init__(self):
        for stream in (self.popen.stdout, self.popen.stderr):
            threading.Thread(target=self._drain, args=(stream,), daemon=True).start()

    def _drain(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append(line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def find(self, pattern: str) -> re.Match | None:
        for line in list(self.lines):
            match = re.search(pattern, line)
            if match:
                return match
        return None

    def wait_for_line(self, pattern: str, timeout: float = 60) -> re.Match:
        def found():
            if self.popen.poll() is not None and not self.find(pattern):
                raise AssertionError(f"{self.name} exited with {self.popen.returncode}:\n{self.output}")
            return self.find(pattern)

        return wait_for(found, timeout, f"{self.name} to print {pattern!r}; output so far:\n{self.output}")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM the main process and wait for it to exit; returns its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the main process only: a crash, as far as the network can tell."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)

    def cleanup(self) -> None:
        """Make sure nothing of this process group is left running."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)


class Swarm:
    """Start gpunet processes on loopback; ``close()`` stops everything it started."""

    def __init__(self, root: Path, network: str = "gpunet-test"):
        self.root = root
        self.network = network
        self.procs: list[Proc] = []
        self.bootstrap_addr: str | None = None
        self._count = 0

    def _start(self, name: str, args: list[str], data_dir: Path | None = None) -> Proc:
        self._count += 1
        data_dir = data_dir or self.root / f"{name}-{self._count}"
        data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GPUNET_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
        env.pop("GPUNET_INITIAL_PEERS", None)
        popen = subprocess.Popen(
            gpunet_cmd(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        proc = Proc(name, popen, data_dir)
        self.procs.append(proc)
        return proc

    def start_bootstrap(self) -> str:
        proc = self._start("bootstrap", ["bootstrap", "--network", self.network, "--host-maddrs", LOOPBACK])
        self.bootstrap_addr = proc.wait_for_line(r"--initial-peers (/ip4/127\.0\.0\.1/\S+)").group(1)
        return self.bootstrap_addr

    def start_worker(
        self, *extra: str, network: str | None = None, data_dir: Path | None = None, wait_online: bool = True
    ) -> Proc:
        assert self.bootstrap_addr, "start_bootstrap() first"
        args = [
            "worker", "--network", network or self.network, "--initial-peers", self.bootstrap_addr,
            "--host-maddrs", LOOPBACK, "--device", "cpu", "--heartbeat", "1", *extra,
        ]
        proc = self._start("worker", args, data_dir)
        if wait_online:
            proc.wait_for_line(r"Online: taking jobs")
        return proc

    def start_workers(self, count: int, *extra: str, **kwargs) -> list[Proc]:
        """Start ``count`` workers at once (they boot in parallel), then wait until each is online."""
        procs = [self.start_worker(*extra, wait_online=False, **kwargs) for _ in range(count)]
        for proc in procs:
            proc.wait_for_line(r"Online: taking jobs")
        return procs

    @staticmethod
    def worker_id(proc: Proc) -> str:
        return proc.wait_for_line(r"Worker id: (\S+)").group(1)

    def status(self, network: str | None = None) -> dict:
        result = run_cli("status", "--network", network or self.network, "--initial-peers", self.bootstrap_addr, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait_for_status(self, predicate: Callable[[dict], bool], message: str, network: str | None = None,
                        timeout: float = 30) -> dict:
        """Poll ``gpunet status --json`` until ``predicate`` holds for it; return that status."""

        def check():
            status = self.status(network)
            return status if predicate(status) else None

        return wait_for(check, timeout, message, interval=0.5)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.cleanup()
        for proc in self.procs:
            assert not proc.group_alive(), f"{proc.name} (pid {proc.pid}) left processes behind"
