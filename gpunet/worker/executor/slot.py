"""One executor process and the parent's end of its pipe (the pool, :mod:`gpunet.worker.executor.pool`, owns
several); the process itself runs :func:`gpunet.worker.executor.child.child_main`.

Its process comes from :func:`gpunet.worker.executor.forkserver.context` (a fork server that imported torch once) and is
followed through :class:`~gpunet.worker.executor.forkserver.Tracked`."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from multiprocessing import reduction

import msgpack

from gpunet.errors import ExecutorStartFailed, JobFailed
from gpunet.utils import wait_out
from gpunet.worker.executor.child import child_main
from gpunet.worker.executor.forkserver import Tracked, sigint_ignored_by_children

_STARTUP_TIMEOUT = 180.0  # importing torch in a fresh process can be slow on a loaded machine
#: Pipe messages up to this size are written and read on the event loop (the pipe drains at GB/s); bigger ones in a
#: thread, so a large payload never stalls other jobs' network I/O.
_INLINE_PIPE_BYTES = 1 << 20
_IN_HEADER_BYTES = 64 * 1024  # inputs/outputs this small travel inside the header message
_HAVE_MEMFD = hasattr(os, "memfd_create")  # Linux; elsewhere big inputs go through the pipe
#: How long a run asked to stop at its next node (preempted, cancelled, or past its time on an executor holding
#: sessions' state) may take before it is killed after all: one op cannot be interrupted.
STOP_GRACE = 2.0

class Slot:
    """One executor process and the parent's end of its pipe."""

    def __init__(self, ctx, config: dict):
        self._ctx, self._config = ctx, config
        self.hashes: set[str] = set()  # programs this process holds in memory (mirrors the child's LRU, roughly)
        self.busy = False  # reserved by a caller (the pool is used from one event loop: no lock)
        self.generation = 0  # which process this is: sessions held by an earlier one are gone
        self.in_flight = False  # a job has been sent and not answered
        self.run_id = 0  # the number of the job sent last (a stop names the run it means)
        self.graphs_broken = -1  # the generation whose CUDA graph capture failed half way (executor.graphs)
        self.closed = False
        # stop() (the pool closing, from any thread) and restart() (a thread) each end the process and close its
        # descriptors; one at a time, so none is closed twice and no process starts after the slot stopped.
        self._lifecycle = threading.Lock()
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
        the old (process, pipe) for :func:`reap`, or the spare's own if this slot is stopping or stopped (the pool
        closing, in another thread: it is not waited for here, on the event loop)."""
        if not self._lifecycle.acquire(blocking=False):
            return spare.proc, spare.conn
        try:
            if self.closed:
                return spare.proc, spare.conn
            old = (self.proc, self.conn)
            self.proc, self.conn, self.stop_word, self.dry_word = (spare.proc, spare.conn, spare.stop_word,
                                                                   spare.dry_word)
            self.ready, self.killed, self.hashes = False, False, set()
            self.generation += 1
            return old
        finally:
            self._lifecycle.release()

    def start(self) -> None:
        self.killed = False
        self.conn, child = self._ctx.Pipe(duplex=True)
        # A word of shared memory: the parent writes there the number of a run it wants stopped, and the child checks
        # it between the program's nodes (gpunet.job.interpreter.execute), so the process lives on.
        self.stop_word = self._ctx.RawValue("q", -1)
        self.dry_word = self._ctx.RawArray("d", [-1.0, 0.0, -1.0, -1.0, 0.0])  # see _DRY_RUN
        proc = self._ctx.Process(target=child_main, args=(child, self._config, self.stop_word, self.dry_word),
                                 daemon=True, name="gpunet-executor")
        if self._ctx.get_start_method() == "forkserver":  # its signals are the fork server's (start_forkserver)
            proc.start()
        else:
            with sigint_ignored_by_children():
                proc.start()
        child.close()
        self.proc = Tracked(proc)
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
        how = await asyncio.to_thread(self.proc.exit_status)
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

        sentinel = self.proc.sentinel
        if sentinel is None:  # reaped (the pool closed meanwhile): nothing more will come
            return True
        fds = (self.conn.fileno(), sentinel)
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

    def stop(self, grace: float = 2.0) -> None:
        """Ask politely, then kill; always reap the process. A stopped slot is never restarted."""
        with self._lifecycle:
            self.closed = True
            if self.proc.alive():
                try:
                    self.conn.send_bytes(msgpack.packb({"op": "exit"}))
                except (OSError, ValueError):
                    pass
                self.proc.join(grace)
            reap(self.proc, self.conn)

    def kill(self) -> None:
        """Stop the process at once (no waiting: safe on the event loop); ``ensure_ready`` replaces it later."""
        self.proc.kill()
        if not self.killed:
            self.generation += 1  # the sessions it held are gone now, not once it is replaced
        self.ready, self.killed = False, True

    def restart(self) -> None:
        """Reap the old process and start a new one (blocking: joins and spawns)."""
        with self._lifecycle:
            reap(self.proc, self.conn)
            if not self.closed:
                self.start()


def reap(proc: Tracked, conn) -> None:
    """Kill, wait and close: an executor's process and the parent's end of its pipe (blocking)."""
    proc.reap()
    conn.close()


