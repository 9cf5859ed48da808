"""A gpunet network on this machine: a bootstrap node and workers as real processes on 127.0.0.1.

A deployment helper, used by ``gpunet demo``, the benchmarks and the end-to-end tests alike. Each process runs in its
own session, so it and its children (DHT process, p2p daemon) are stopped by process-group id, never by name. A node is
ready when its ready file (:mod:`gpunet.readyfile`) says so, written by the very process started here; addresses and
ids come from that file too, never from the node's output. Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from gpunet.config import LOOPBACK_MADDR
from gpunet.readyfile import read_ready

LOOPBACK = LOOPBACK_MADDR
T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, message: str, interval: float = 0.1) -> T:
    """Poll ``condition`` until it returns something truthy; raise TimeoutError with ``message`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {message}")
        time.sleep(interval)


def child_pids(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them (a worker's executor pool respawns
    executors in a thread; /proc lists a child under the thread that started it)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (ended, not yet reaped by its parent) counts as ended."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def parent_pid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def open_files(pid: int) -> set[str]:
    """What ``pid``'s descriptors point at, as /proc shows them (``pipe:[INODE]``, a path, ...); empty once it is gone
    or was never ours to read."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # (closed meanwhile)
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        pass
    return found


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of ``pid`` so far (None once it is gone)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None


def executor_pids(pid: int) -> tuple[int | None, list[int]]:
    """A worker's executors' fork server (None if it has none now) and the executors it forked."""
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/comm") as f:
                forked = f.read().strip() == "gpunet-forksrv"  # forked from the worker (forkserver.start_forkserver)
            with open(f"/proc/{child}/cmdline") as f:
                if forked or "multiprocessing.forkserver" in f.read():
                    return child, child_pids(child)
        except OSError:
            continue
    return None, []


#: The speed test's result (the worker's throughput.json) from the first worker this interpreter started that
#: measured its own (not a file a test wrote), given to every worker started after it, as a volunteer's worker finds
#: its own on a second start: measuring took a third of a second of both cores at each start, hundreds of starts in
#: the test suite. A worker with another device or --threads measures its own (the file is keyed by both); one given
#: a file of its own keeps it.
_measured: bytes | None = None


def _seed_speed(data_dir: Path) -> None:
    from gpunet.worker.throughput import CACHE_FILENAME

    path = data_dir / CACHE_FILENAME
    if _measured is not None and not path.exists():
        path.write_bytes(_measured)


def _keep_speed(data_dir: Path) -> None:
    from gpunet.worker.throughput import CACHE_FILENAME

    global _measured
    if _measured is None:
        try:
            _measured = (data_dir / CACHE_FILENAME).read_bytes()
        except OSError:
            pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a node's metrics or dashboard in tests and demos)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpunet_cmd(*args: str) -> list[str]:
    """The ``gpunet`` command run by this very interpreter (so a venv's gpunet, never another on PATH)."""
    return [sys.executable, "-m", "gpunet", *args]


@dataclass(eq=False)
class Proc:
    """A gpunet process: its ready file, and its output collected line by line (for people, and for tests that watch
    its log)."""

    name: str
    role: str  # "bootstrap", "worker" or "gateway"
    popen: subprocess.Popen
    data_dir: Path
    lines: list[str] = field(default_factory=list)
    ready: dict[str, Any] | None = None  # its ready file as last read: the id and addresses outlive the process
    stop_sent: bool = False  # SIGTERM sent by request_stop (a second one makes a node leave without its jobs)

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

    def read_ready(self) -> dict[str, Any] | None:
        """This process's ready file as it stands, or None. A file another process wrote (left in the same data dir by
        an earlier run) is never taken for this one's."""
        info = read_ready(self.data_dir)
        if info is None or info["pid"] != self.pid:
            return None
        self.ready = info
        return info

    def wait_ready(self, *states: str, timeout: float = 90) -> dict[str, Any]:
        """Wait until this process's ready file says one of ``states`` (any, if none given); return the file."""

        def ready():
            info = self.read_ready()
            return info if info is not None and (not states or info.get("state") in states) else None

        return self._wait_while_running(ready, timeout, f"to be {' or '.join(states) or 'up'}")

    @property
    def id(self) -> str:
        """The node's peer id, from its ready file (waiting for the node to write it, if it has not yet)."""
        return (self.ready or self.wait_ready())["id"]

    def wait_for_line(self, pattern: str, timeout: float = 90) -> re.Match:
        """Wait for a line of output matching ``pattern``: for watching a node's log, not for readiness."""

        def found():
            return next(filter(None, (re.search(pattern, line) for line in list(self.lines))), None)

        return self._wait_while_running(found, timeout, f"to print {pattern!r}")

    def _wait_while_running(self, check: Callable[[], T], timeout: float, what: str) -> T:
        """``wait_for(check)``, failing at once if this process exits first; either failure shows its output."""

        def poll():
            result = check()
            if not result and self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode}:\n{self.output}")
            return result

        try:
            return wait_for(poll, timeout, f"{self.name} {what}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; output so far:\n{self.output}") from None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def request_stop(self) -> None:
        """SIGTERM the main process (a clean leave), once; do not wait."""
        if self.popen.poll() is None and not self.stop_sent:
            self.stop_sent = True
            self.popen.send_signal(signal.SIGTERM)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM the main process (a clean leave) and wait for it; returns its exit code."""
        self.request_stop()
        return self.popen.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL the main process only: a crash, as far as the network can tell."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)

    def cleanup(self) -> None:
        """Leave nothing of this process group running."""
        if self.popen.poll() is None:
            self.request_stop()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.popen.poll() is None:
            self.popen.wait(timeout=10)
        try:  # children reparented to init are reaped a moment after the kill
            wait_for(lambda: not self.group_alive(), 10, f"{self.name}'s process group to exit", interval=0.05)
        except TimeoutError:
            pass


class LocalNetwork:
    """Start gpunet processes on loopback; ``close()`` (or leaving the ``with`` block) stops all of them."""

    def __init__(self, root: Path | None = None, network: str = "gpunet-local", heartbeat: float = 2.0):
        self._tmp = None
        if root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gpunet-local-")
            root = Path(self._tmp.name)
        self.root = Path(root)
        self.network = network
        self.heartbeat = heartbeat
        self.procs: list[Proc] = []
        self.bootstrap: Proc | None = None
        self.bootstrap_addr: str | None = None
        self._count = 0

    def __enter__(self) -> "LocalNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, role: str, args: list[str], data_dir: Path | None = None, ns: str | None = None) -> Proc:
        """``ns``: run it inside that network namespace (see gpunet.testing.netns)."""
        self._count += 1
        name = f"{role}-{self._count}"
        data_dir = Path(data_dir or self.root / name)
        data_dir.mkdir(parents=True, exist_ok=True)
        if role == "worker":
            _seed_speed(data_dir)
        env = {**os.environ, "GPUNET_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
        env.pop("GPUNET_INITIAL_PEERS", None)
        argv = gpunet_cmd(*args)
        popen = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv] if ns else argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
        proc = Proc(name, role, popen, data_dir)
        self.procs.append(proc)
        return proc

    def start_bootstrap(self, *extra: str, ns: str | None = None, host_maddrs: str = LOOPBACK,
                        data_dir: Path | None = None, network: str | None = None) -> str:
        """Start an entry point; returns the address workers and clients join with. The first one started is the one
        :meth:`start_worker` joins by default. ``data_dir``: that of an earlier one, to restart it (same identity);
        ``network``: another network's entry point (workers of a network join through a node of that network)."""
        data_dir = Path(data_dir or self.root / f"bootstrap-{self._count + 1}")  # (its default is a subdir)
        proc = self._start("bootstrap", ["bootstrap", "--network", network or self.network, "--host-maddrs",
                                         host_maddrs, "--data-dir", str(data_dir), *extra], data_dir, ns=ns)
        addr = proc.wait_ready("online")["addresses"][0]
        if self.bootstrap is None or self.bootstrap.data_dir == proc.data_dir:
            self.bootstrap, self.bootstrap_addr = proc, addr
        return addr

    def start_worker(
        self, *extra: str, network: str | None = None, data_dir: Path | None = None, wait_online: bool = True,
        ns: str | None = None, host_maddrs: str = LOOPBACK, initial_peers: list[str] | None = None,
    ) -> Proc:
        """``initial_peers``: instead of the first bootstrap node."""
        if not self.bootstrap_addr:
            raise RuntimeError("start_bootstrap() first")
        peers = [arg for peer in initial_peers or [self.bootstrap_addr] for arg in ("--initial-peers", peer)]
        args = [
            "worker", "--network", network or self.network, *peers,
            "--host-maddrs", host_maddrs, "--device", "cpu", "--heartbeat", str(self.heartbeat), *extra,
        ]
        proc = self._start("worker", args, data_dir, ns=ns)
        if wait_online:
            self.wait_online(proc)
        return proc

    def start_workers(self, count: int, *extra: str, **kwargs) -> list[Proc]:
        """Start ``count`` workers at once (they boot in parallel), then wait until each is online."""
        procs = [self.start_worker(*extra, wait_online=False, **kwargs) for _ in range(count)]
        for proc in procs:
            self.wait_online(proc)
        return procs

    def start_gateway(self, model_dir: str | Path, *extra: str, timeout: float = 180) -> tuple[Proc, str]:
        """``gpunet gateway`` for the checkpoint folder ``model_dir``, on a free port: the process and its base URL
        (``http://127.0.0.1:PORT/v1``), once it serves."""
        if not self.bootstrap_addr:
            raise RuntimeError("start_bootstrap() first")
        proc = self._start("gateway", ["gateway", "--model", str(model_dir), "--network", self.network,
                                       "--initial-peers", self.bootstrap_addr, "--port", "0", *extra])
        return proc, proc.wait_for_line(r"Serving .* at (http://\S+) ", timeout=timeout).group(1)

    @property
    def workers(self) -> list[Proc]:
        """Every worker started here, in order (running or not)."""
        return [p for p in self.procs if p.role == "worker"]

    @staticmethod
    def wait_online(proc: Proc) -> None:
        """Wait until the worker has published its ``online`` record and takes jobs."""
        proc.wait_ready("online")
        if any("Measuring this device's speed" in line for line in proc.lines):  # its own figure, not a test's
            _keep_speed(proc.data_dir)

    @staticmethod
    def worker_id(proc: Proc) -> str:
        return proc.id

    def close(self) -> None:
        # Workers leave together (one after another took 10-17 s a swarm), then the bootstrap nodes they say
        # goodbye through.
        for group in ([p for p in self.procs if p.role != "bootstrap"], [p for p in self.procs if p.role == "bootstrap"]):
            for proc in reversed(group):
                proc.request_stop()
            for proc in reversed(group):
                proc.cleanup()
        leftovers = [p for p in self.procs if p.group_alive()]
        if self._tmp is not None:
            self._tmp.cleanup()
        if leftovers:
            raise RuntimeError(f"processes left behind: {[(p.name, p.pid) for p in leftovers]}")
