"""Where executor processes come from, and how the pool follows each one.

Executors are forked by a fork server (multiprocessing's ``forkserver``, :func:`context`): a fresh interpreter, started
once, that imports what every executor needs (:mod:`gpunet.worker.executor.preload`) and forks a child per executor.
Not forked from the worker itself: fork is unsafe beside its threads and the libp2p daemon. Not spawned afresh each
time: that was a torch import (4-5 s of CPU on a 2-core machine) per executor, per replacement, per session process.

A fork server's child is not the worker's: multiprocessing reads its end from the server, through a pipe that also
ends ("exit code 255") if the server dies with the executor alive. :class:`Tracked` follows the process itself
through a pidfd: whether it lives, and a kill that reaches it whatever became of the server."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import threading
from multiprocessing import forkserver

from gpunet.worker.executor import sandbox

_PRELOAD = ["gpunet.worker.executor.preload", "gpunet.worker.executor.child", "gpunet.worker.executor.sandbox"]


def context():
    """The multiprocessing context executors start from: the fork server where this platform has one and the seccomp
    filter (which keeps an executor from opening a socket: until Python 3.14 the server's socket takes a request from
    any process of this user), else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or not sandbox.seccomp_filter_here():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Start the fork server now, so it imports torch while the worker joins its network (its first executor then
    starts at once). From the main thread it starts with SIGINT ignored, as every executor forked from it then is: a
    Ctrl-C to the process group while it imports cannot kill it with a traceback (stopping is the worker's call)."""
    if context().get_start_method() == "forkserver":
        with sigint_ignored_by_children():
            forkserver.ensure_running()


def stop_forkserver() -> None:
    """Stop the fork server at once (the worker is leaving): on its own it leaves only once every process that could
    ask it for a child has exited (its own DHT process too), and not while it still imports. A later
    :func:`start_forkserver` starts a fresh one."""
    server = forkserver._forkserver  # (multiprocessing has no public handle on its fork server)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(ChildProcessError, OSError, AttributeError):
        server._stop()  # reaps it, and forgets it


@contextlib.contextmanager
def sigint_ignored_by_children():
    """Start processes with SIGINT ignored: an ignored signal stays ignored across exec, and Python then never
    installs its KeyboardInterrupt handler, so a Ctrl-C to the process group while an executor boots cannot kill it
    with a traceback (stopping executors is the worker's call, after it drains). Only the main thread may change
    signal handlers; a process started from another thread (a respawn) relies on child_main alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


class Tracked:
    """A started process, followed through a pidfd where the kernel has them (Linux 5.3+; else multiprocessing's
    sentinel). The pidfd is closed once, under a lock, by :meth:`reap`: a descriptor closed twice, or signalled after
    it was closed, would reach whatever file or process reused its number."""

    def __init__(self, proc: multiprocessing.process.BaseProcess):
        self.proc = proc
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self._reaped = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        """A descriptor that turns readable when the process ends (for the event loop)."""
        return self._pidfd if self._pidfd is not None else self.proc.sentinel

    def alive(self) -> bool:
        with self._lock:
            if self._reaped:
                return False
            if self._pidfd is None:
                return self.proc.is_alive()
            return not select.select([self._pidfd], [], [], 0)[0]

    def kill(self) -> None:
        """SIGKILL, at once (no waiting: safe on the event loop)."""
        with self._lock:
            if self._reaped:
                return
            if self._pidfd is None:
                if self.proc.is_alive():
                    self.proc.kill()
                return
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        self.proc.join(timeout)

    def exit_status(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def reap(self) -> None:
        """Kill, wait (a few seconds at most) and let go of the pidfd; again is a no-op (blocking)."""
        self.kill()
        self.proc.join(5)
        with self._lock:
            if self._pidfd is not None and not self._reaped:
                os.close(self._pidfd)
            self._reaped = True
