"""One executor process and the parent's end of its pipe (the pool, :mod:`gpunet.worker.executor.pool`, owns
several); the process itself runs :func:`gpunet.worker.executor.child.child_main`.

Executors are forked by a fork server (multiprocessing's ``forkserver``, :func:`context`): a fresh interpreter, started
once, that imports what every executor needs (:mod:`gpunet.worker.executor.preload`) and forks a child per executor.
Not forked from the worker itself: fork is unsafe beside its threads and the libp2p daemon. Not spawned afresh each
time: that was a torch import (4-5 s of CPU on a 2-core machine) per executor, per replacement, per session process."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import select
import signal
import threading
import time
from multiprocessing import forkserver, reduction

import msgpack

from gpunet.errors import ExecutorStartFailed, JobFailed
from gpunet.utils import wait_out
from gpunet.worker.executor import sandbox
from gpunet.worker.executor.child import child_main

_STARTUP_TIMEOUT = 180.0  # importing torch in a fresh process can be slow on a loaded machine
#: Pipe messages up to this size are written and read on the event loop (the pipe drains at GB/s); bigger ones in a
#: thread, so a large payload never stalls other jobs' network I/O.
_INLINE_PIPE_BYTES = 1 << 20
_IN_HEADER_BYTES = 64 * 1024  # inputs/outputs this small travel inside the header message
_HAVE_MEMFD = hasattr(os, "memfd_create")  # Linux; elsewhere big inputs go through the pipe
#: How long a run asked to stop at its next node (preempted, cancelled, or past its time on an executor holding
#: sessions' state) may take before it is killed after all: one op cannot be interrupted.
STOP_GRACE = 2.0
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
        with _sigint_ignored_by_children():
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


class Slot:
    """One executor process and the parent's end of its pipe."""

    def __init__(self, ctx, config: dict):
        self._ctx, self._config = ctx, config
        self.hashes: set[str] = set()  # programs this process holds in memory (mirrors the child's LRU, roughly)
        self.busy = False  # reserved by a caller (the pool is used from one event loop: no lock)
        self.generation = 0  # which process this is: sessions held by an earlier one are gone
        self.in_flight = False  # a job has been sent and not answered
        self.run_id = 0  # the number of the job sent last (a stop names the run it means)
        self.closed = False
        self.start()

    for_sessions = False  # one of the pool's processes for inference sessions' state alone (no plain job runs there)
    stop_asked_at = 0.0  # when the running job was first asked to stop (time.monotonic())
    sandbox: list[str] = []  # what the process's sandbox enforces, as it reported once ready
    dry_cap = 0.0  # the longest a dry run may take there, as it reported once ready

    def ask_stop(self) -> float:
        """Ask the running job to stop at its program's next node (read there through the shared stop word); returns
        the seconds of STOP_GRACE it has left, counted from the first time it was asked."""
        if self.stop_word.value != self.run_id:
            self.stop_word.value, self.stop_asked_at = self.run_id, time.monotonic()
        return max(0.0, self.stop_asked_at + STOP_GRACE - time.monotonic())

    def take_over(self, spare: "Slot") -> tuple:
        """Use ``spare``'s process (started earlier, torch likely imported already) instead of starting one; returns
        the old (process, pipe) to reap."""
        old = (self.proc, self.conn, self.pidfd)
        self.proc, self.conn, self.stop_word, self.dry_word = spare.proc, spare.conn, spare.stop_word, spare.dry_word
        self.pidfd = spare.pidfd
        self.ready, self.killed, self.hashes = False, False, set()
        self.generation += 1
        return old

    def start(self) -> None:
        self.killed = False
        self.conn, child = self._ctx.Pipe(duplex=True)
        # A word of shared memory: the parent writes there the number of a run it wants stopped, and the child checks
        # it between the program's nodes (gpunet.job.interpreter.execute), so the process lives on.
        self.stop_word = self._ctx.RawValue("q", -1)
        self.dry_word = self._ctx.RawArray("d", [-1.0, 0.0, -1.0, -1.0, 0.0])  # see _DRY_RUN
        self.proc = self._ctx.Process(target=child_main, args=(child, self._config, self.stop_word, self.dry_word),
                                      daemon=True, name="gpunet-executor")
        if self._ctx.get_start_method() == "forkserver":  # its signals are the fork server's (start_forkserver)
            self.proc.start()
        else:
            with _sigint_ignored_by_children():
                self.proc.start()
        child.close()
        self.pidfd = _pidfd(self.proc.pid)
        self.ready = False
        self.hashes = set()
        self.generation += 1

    async def ensure_ready(self) -> None:
        """Wait (without blocking the loop) for a freshly started process to finish importing torch; a process killed
        earlier (timeout, crash, cancel) is reaped and replaced here, in a thread."""
        if self.ready:
            return
        if self.killed:
            await asyncio.to_thread(self.restart)
        if await self.readable(_STARTUP_TIMEOUT):
            try:
                hello = msgpack.unpackb(self.conn.recv_bytes())
                if isinstance(hello, dict) and hello.get("ready") is True:
                    self.ready = True
                    self.sandbox = list(hello.get("sandbox") or [])
                    self.dry_cap = float(hello.get("max_dry_run_seconds", 0.0))
                    return
                if isinstance(hello, dict) and hello.get("error"):
                    self.kill()
                    raise ExecutorStartFailed(f"executor process could not start ({hello['error']})")
            except (EOFError, OSError, ValueError):
                pass
        how = await asyncio.to_thread(self.exit_status)
        self.kill()  # the next job starts a fresh process
        raise JobFailed(f"executor process died before the job was sent ({how}); it was replaced")

    async def readable(self, timeout: float) -> bool:
        """Wait until the pipe has a message or the process has died (True), or ``timeout`` passes (False)."""
        if self.conn.poll():
            return True
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle(value: bool) -> None:
            if not done.done():
                done.set_result(value)

        fds = (self.conn.fileno(), self.pidfd if self.pidfd is not None else self.proc.sentinel)
        for fd in fds:
            loop.add_reader(fd, settle, True)
        timer = loop.call_later(timeout, settle, False)
        try:
            return await done
        finally:
            timer.cancel()
            for fd in fds:
                loop.remove_reader(fd)
            # uvloop (libuv) switches a watched descriptor to non-blocking mode; the pipe's reads that follow expect
            # a blocking one (a reply is read whole once its first bytes are in), so put it back.
            os.set_blocking(self.conn.fileno(), True)

    def send(self, messages: list[bytes], shared: bytes | None = None, files: list[int] = ()) -> None:
        """Pipe messages (one already in a file, a spooled program, as its descriptor), then (``shared``) a memfd
        holding those bytes, passed as a file descriptor, then ``files`` (open descriptors: the files of the weights a
        program names by reference)."""
        for message in messages:
            if hasattr(message, "fileno"):
                reduction.send_handle(self.conn, message.fileno(), self.proc.pid)
            else:
                self.conn.send_bytes(message)
        if shared is not None and hasattr(shared, "fileno"):  # already in a file (a spooled payload): pass it as is
            reduction.send_handle(self.conn, shared.fileno(), self.proc.pid)
        elif shared is not None:
            fd = os.memfd_create("gpunet-inputs", os.MFD_CLOEXEC)
            try:
                view = memoryview(shared).cast("B")
                while view:
                    view = view[os.write(fd, view):]
                reduction.send_handle(self.conn, fd, self.proc.pid)
            finally:
                os.close(fd)
        for fd in files:
            reduction.send_handle(self.conn, fd, self.proc.pid)

    async def in_thread(self, fn, *args):
        """Blocking pipe I/O (a big payload) in a thread. If the caller is cancelled meanwhile, the process is killed
        first, so the thread's read or write fails at once, and the pipe is closed only after the thread is done with
        it (a closed descriptor number could be reused by the next pipe)."""
        io = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(io)
        except asyncio.CancelledError:
            self.kill()
            await wait_out(io)  # a second cancel must not let the pipe close under the thread either
            raise

    def exit_status(self) -> str:
        self.proc.join(5)
        code = self.proc.exitcode
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def stop(self, grace: float = 2.0) -> None:
        """Ask politely, then kill; always reap the process. A stopped slot is never restarted."""
        self.closed = True
        if _alive(self.proc, self.pidfd):
            try:
                self.conn.send_bytes(msgpack.packb({"op": "exit"}))
            except (OSError, ValueError):
                pass
            self.proc.join(grace)
        _reap(self.proc, self.conn, self.pidfd)
        self.pidfd = None

    def kill(self) -> None:
        """Stop the process at once (no waiting: safe on the event loop); ``ensure_ready`` replaces it later."""
        _kill(self.proc, self.pidfd)
        if not self.killed:
            self.generation += 1  # the sessions it held are gone now, not once it is replaced
        self.ready, self.killed = False, True

    def restart(self) -> None:
        """Reap the old process and start a new one (blocking: joins and spawns)."""
        _reap(self.proc, self.conn, self.pidfd)
        self.pidfd = None
        if not self.closed:
            self.start()



@contextlib.contextmanager
def _sigint_ignored_by_children():
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



def _reap(proc, conn, pidfd: int | None = None) -> None:
    _kill(proc, pidfd)
    proc.join(5)
    conn.close()
    if pidfd is not None:
        os.close(pidfd)


# A fork server's child is not this process's: its end is read from the server (a pipe that also ends, "exit code
# 255", if the server itself dies, with the executor alive). A pidfd follows the process itself: whether it lives, and
# a kill that reaches it whatever became of the server.

def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+: the multiprocessing sentinel alone
        return None


def _alive(proc, pidfd: int | None) -> bool:
    if pidfd is None:
        return proc.is_alive()
    return not select.select([pidfd], [], [], 0)[0]  # a pidfd turns readable when its process ends


def _kill(proc, pidfd: int | None) -> None:
    if pidfd is None:
        if proc.is_alive():
            proc.kill()
        return
    with contextlib.suppress(ProcessLookupError, OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
