"""Where executor processes come from, and how the pool follows each one.

Executors are forked by a fork server (multiprocessing's ``forkserver``, :func:`context`), started once, that imports
what every executor needs (:mod:`gpunet.worker.executor.preload`) and forks a child per executor. ``gpunet worker``
forks that server from itself as it starts (:func:`start_forkserver`), before it has threads, a libp2p daemon, its key
or its data dir; a worker built inside another program spawns it, a fresh interpreter. Executors are not forked from
the running worker (unsafe beside its threads and the daemon), nor spawned afresh each time (a torch import, 4-5 s of
CPU on a 2-core machine, per executor, per replacement, per session process).

A fork server's child is not the worker's: multiprocessing reads its end from the server, through a pipe that also
ends ("exit code 255") if the server dies with the executor alive. :class:`Tracked` follows the process itself
through a pidfd: whether it lives, and a kill that reaches it whatever became of the server."""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import multiprocessing
import os
import select
import signal
import socket
import threading
import traceback
import warnings
from multiprocessing import connection, forkserver, resource_tracker

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


def start_forkserver(from_here: bool = False) -> None:
    """Start the fork server now, so it imports what executors need while the worker joins its network (its first
    executor then starts at once). From the main thread it starts with SIGINT ignored, as every executor forked from it
    then is: a Ctrl-C to the process group while it imports cannot kill it with a traceback (stopping is the worker's
    call).

    ``from_here``: fork it from this process, which has imported torch already, instead of spawning an interpreter that
    imports it again (seconds of CPU for every worker that starts). Only for a process that holds nothing an executor
    must not see: ``gpunet worker`` calls it before it opens its data dir or reads its key (a fork copies this
    process's memory; its descriptors are closed). Else, or where that cannot be done, the server is spawned."""
    if context().get_start_method() != "forkserver":
        return
    with sigint_ignored_by_children():
        if not (from_here and _fork_server()):
            forkserver.ensure_running()


def _fork_server() -> bool:
    """Start the fork server as a fork of this process (multiprocessing's own start, ``ForkServer.ensure_running``,
    with ``os.fork`` in place of a spawned interpreter); False if it cannot be done here."""
    server = forkserver._forkserver  # (multiprocessing has no public handle on its fork server)
    if set(inspect.signature(forkserver.main).parameters) != {"listener_fd", "alive_r", "preload", "main_path",
                                                               "sys_path"}:
        return False  # another Python's protocol (3.14 authenticates its clients): spawn it as that Python does
    if "OMP_WAIT_POLICY" not in os.environ:
        return False  # OpenMP read its settings when torch loaded here: without preload.py's, executors' threads spin
    with server._lock:
        if server._forkserver_pid is not None:
            return True
        resource_tracker.ensure_running()  # (as ensure_running does: executors are handed its pipe)
        address = connection.arbitrary_address("AF_UNIX")
        alive_r = alive_w = None
        try:
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(address)
                os.chmod(address, 0o600)
                listener.listen()
                alive_r, alive_w = os.pipe()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "multi-threaded" (BLAS's pool)
                    pid = os.fork()
                if pid == 0:
                    _serve(listener.fileno(), alive_r)  # never returns
        except OSError:  # (no room for a process, a socket or a pipe): spawned after all, or said so there
            for fd in (alive_r, alive_w):
                if fd is not None:
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(address)
            return False
        os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve(listener_fd: int, alive_r: int) -> None:
    """The forked fork server: keep only standard streams, its socket and its end of the keep-alive pipe, forget the
    worker's multiprocessing state (as a fresh interpreter has none), then serve as multiprocessing's own does
    (importing :data:`_PRELOAD`) until every process that could ask has gone."""
    code = 1
    try:
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        forkserver._forkserver._lock = threading.Lock()  # (held by the worker's thread at the fork)
        tracker = resource_tracker._resource_tracker  # the worker's tracker: executors are handed its pipe anew
        tracker._fd = tracker._pid = None
        multiprocessing.current_process()._config.pop("tempdir", None)  # (the worker's; an executor makes its own)
        name_process(b"gpunet-forksrv")
        forkserver.main(listener_fd, alive_r, _PRELOAD)
        code = 0
    except SystemExit as e:  # (how it leaves when the last client has gone)
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def let_go_of_the_fork_server() -> None:
    """In an executor: it never asks the fork server for a process, so it drops the write end of the pipe that keeps
    the server alive (one byte written there would stop it), which it inherited."""
    server = forkserver._forkserver  # (multiprocessing's own state: no public handle)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def name_process(name: bytes) -> None:
    """What ``ps``, ``top`` and /proc/PID/comm call this process (15 bytes at most; Linux): a volunteer looking at
    their machine sees which of a worker's processes is which."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME


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
    def sentinel(self) -> int | None:
        """A descriptor that turns readable when the process ends (for the event loop); None once it is reaped."""
        with self._lock:
            if self._reaped:
                return None
            return self._pidfd if self._pidfd is not None else self.proc.sentinel

    def alive(self) -> bool:
        with self._lock:
            if self._reaped:
                return False
            if self._pidfd is None:
                return self.proc.is_alive()
            poll = select.poll()  # (select.select refuses descriptors past 1023)
            poll.register(self._pidfd, select.POLLIN)
            return not poll.poll(0)  # a pidfd turns readable when its process ends

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
