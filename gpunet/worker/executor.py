"""Jobs run in a pool of executor processes, apart from the worker's network process.

Each executor is a ``spawn``-started process (fork is unsafe beside threads and the libp2p daemon) that validates,
caches and runs programs under a memory budget. The parent waits on the reply *or* the process's death, with a
deadline: a job that crashes or hangs its executor fails (JobFailed / JobTimeout), the executor is replaced, and the
worker keeps serving. A job whose caller gives up (cancel, client gone) is stopped at its program's next node, and
its executor serves on; one still running :data:`STOP_GRACE` later is stopped as a hung one is, except in a process
holding inference sessions' state (a kill would lose every session there). Parent and child exchange msgpack over a
pipe, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path

import msgpack

from gpunet.errors import (
    DryRunTooLong, ExecutorDied, ExecutorStartFailed, JobFailed, JobPreempted, JobRaised, JobRejected, JobTimeout,
    ProgramNotCached, SessionLost, WorkerDraining,
)
from gpunet.utils import first_line, wait_out
from gpunet.worker.cache import DiskCache, MemoryLRU, check_hash
from gpunet.worker.hardware import job_threads

_STARTUP_TIMEOUT = 180.0  # importing torch in a fresh process can be slow on a loaded machine
#: Pipe messages up to this size are written and read on the event loop (the pipe drains at GB/s); bigger ones in a
#: thread, so a large payload never stalls other jobs' network I/O.
_INLINE_PIPE_BYTES = 1 << 20
_IN_HEADER_BYTES = 64 * 1024  # inputs/outputs this small travel inside the header message
_HAVE_MEMFD = hasattr(os, "memfd_create")  # Linux; elsewhere big inputs go through the pipe
#: How long a run asked to stop at its next node (preempted, cancelled, or past its time on an executor holding
#: sessions' state) may take before it is killed after all: one op cannot be interrupted.
STOP_GRACE = 2.0

_ERRORS = {"JobRejected": JobRejected, "JobFailed": JobFailed, "SessionLost": SessionLost, "JobPreempted": JobPreempted,
           "DryRunTooLong": DryRunTooLong, "JobRaised": JobRaised}


@dataclass(frozen=True)
class RunResult:
    """A finished job: output tensor bytes (safetensors layout) and what it cost (``flops`` from the dry run)."""

    outputs: bytes
    flops: int
    wall_time: float
    peak_memory_bytes: int
    state_bytes: int = 0  # a session step: what its state holds in the executor now


@dataclass
class DryRun:
    """What a run's dry run took, for its caller whatever the run's outcome (a result, an error, a cancellation):
    :meth:`Executor.run` fills it in. The dry run's time is paid by no receipt (gpunet.worker.admission.dry_ran)."""

    began: float | None = None  # when its dry run began (time.monotonic()); None: it never did
    seconds: float | None = None  # the CPU time it took (0: the same shapes answered); None: stopped before it ended
    cap: float = 0.0  # the longest a dry run may take in that executor

    def cost(self, now: float) -> float:
        """The dry run's time; for one stopped before it ended, what it may have been (at most ``cap``)."""
        if self.seconds is not None:
            return self.seconds
        return 0.0 if self.began is None else min(max(0.0, now - self.began), self.cap)


#: The shared words a child writes as a run's dry run begins and ends: the run's number (written last), when it
#: began (time.monotonic(), one clock for all processes), the CPU seconds it took (-1 until it ends), the work it
#: counted (-1 until it ends well) and when it ended. Read by the parent however the run ended, even if the process was
#: killed before it could say; the counted work caps the run's time (Executor._work_deadline) with no message sent.
_DRY_RUN, _DRY_BEGAN, _DRY_SECONDS, _DRY_FLOPS, _DRY_ENDED = range(5)


class _Slot:
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

    stop_asked_at = 0.0  # when the running job was first asked to stop (time.monotonic())
    sandbox: list[str] = []  # what the process's sandbox enforces, as it reported once ready
    dry_cap = 0.0  # the longest a dry run may take there, as it reported once ready

    def ask_stop(self) -> float:
        """Ask the running job to stop at its program's next node (read there through the shared stop word); returns
        the seconds of STOP_GRACE it has left, counted from the first time it was asked."""
        if self.stop_word.value != self.run_id:
            self.stop_word.value, self.stop_asked_at = self.run_id, time.monotonic()
        return max(0.0, self.stop_asked_at + STOP_GRACE - time.monotonic())

    def take_over(self, spare: "_Slot") -> tuple:
        """Use ``spare``'s process (started earlier, torch likely imported already) instead of starting one; returns
        the old (process, pipe) to reap."""
        old = (self.proc, self.conn)
        self.proc, self.conn, self.stop_word, self.dry_word = spare.proc, spare.conn, spare.stop_word, spare.dry_word
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
        self.proc = self._ctx.Process(target=_child_main, args=(child, self._config, self.stop_word, self.dry_word),
                                      daemon=True, name="gpunet-executor")
        with _sigint_ignored_by_children():
            self.proc.start()
        child.close()
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

        fds = (self.conn.fileno(), self.proc.sentinel)
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

    def send(self, messages: list[bytes], shared: bytes | None = None) -> None:
        """Pipe messages, then (``shared``) a memfd holding those bytes, passed as a file descriptor."""
        for message in messages:
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
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgpack.packb({"op": "exit"}))
            except (OSError, ValueError):
                pass
            self.proc.join(grace)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()

    def kill(self) -> None:
        """Stop the process at once (no waiting: safe on the event loop); ``ensure_ready`` replaces it later."""
        if self.proc.is_alive():
            self.proc.kill()
        if not self.killed:
            self.generation += 1  # the sessions it held are gone now, not once it is replaced
        self.ready, self.killed = False, True

    def restart(self) -> None:
        """Reap the old process and start a new one (blocking: joins and spawns)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()
        if not self.closed:
            self.start()


class Executor:
    """A pool of executor processes that validate, cache and run programs, driven from one asyncio loop.

    The parent talks to each process over its pipe from the event loop itself: waiting is ``add_reader`` on the pipe
    and on the process sentinel, so a small job costs no thread hop; only payloads over :data:`_INLINE_PIPE_BYTES`
    move in a thread. Cancelling :meth:`run` while the job runs stops it at its program's next node, the process
    serving on; one that does not stop within :data:`STOP_GRACE` (an op running long) has its executor killed (the
    pool starts a fresh one), except in a process holding sessions' state (see :meth:`run`).
    """

    def __init__(
        self,
        device: str = "cpu",
        processes: int = 2,
        memory_budget_bytes: int = 4 * 1024**3,
        default_timeout: float = 60.0,
        cache_dir: str | Path | None = None,
        disk_cache_bytes: int = 8 * 1024**3,
        memory_cache_programs: int = 8,
        max_flops: int = 10**15,
        threads_per_process: int | None = None,
        sandbox: bool = True,
        protected: list[str] = (),
        speed_tflops: float | None = None,
        max_dry_run_seconds: float | None = None,
    ):
        self.default_timeout = default_timeout
        #: The device's measured speed (best dtype): a job runs no longer than its counted work allows at a small share
        #: of it (gpunet.job.cost.seconds_allowed). None: only the job's own timeout applies.
        self.speed_tflops = speed_tflops
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="gpunet-programs-")
            cache_dir = self._tmp
        self.disk = DiskCache(cache_dir, disk_cache_bytes)
        config = {
            "device": device,
            "memory_budget_bytes": memory_budget_bytes,
            "cache_dir": str(cache_dir),
            "disk_cache_bytes": disk_cache_bytes,
            "memory_cache_programs": memory_cache_programs,
            "max_flops": max_flops,
            "threads": job_threads(threads_per_process, processes),
            "sandbox": sandbox,  # see gpunet.worker.sandbox
            "tmp_dir": str(Path(cache_dir).parent / "executor-tmp"),
            "protected": [str(p) for p in protected],
            "max_dry_run_seconds": max_dry_run_seconds,  # None: WorkerLimits' own
        }
        self._ctx, self._config = multiprocessing.get_context("spawn"), config
        self._slots = [_Slot(self._ctx, config) for _ in range(processes)]
        # Once an executor has died, a warm spare stands by: the next death (a crash loop is one client's doing) costs
        # the jobs of others no torch import.
        self._spare: _Slot | None = None
        self._spare_starting = False
        self._spare_lock = threading.Lock()  # the spare is started in a thread; close() may run in another
        self._waiters: deque[asyncio.Future] = deque()  # callers waiting for an idle executor, first come first served
        # Inference sessions (docs/sessions.md): each session's state lives in one executor process, so its steps go
        # to that one (waiting for it, ahead of jobs that could run anywhere). key -> (slot, its generation then).
        self._pins: dict[str, tuple[_Slot, int]] = {}
        self._pinned_waiters: dict[_Slot, deque[asyncio.Future]] = {}
        self._tagged: dict[object, _Slot] = {}  # runs that may be stopped for another job -> the executor running it
        self._closed = False

    # --- public -----------------------------------------------------------------------------------------------------

    def has_program(self, program_hash: str) -> bool:
        """Whether a job can be sent without its program bytes."""
        return any(program_hash in s.hashes for s in self._slots) or program_hash in self.disk

    def cached_programs(self) -> list[str]:
        """Hashes this worker can run without a transfer (for the worker record)."""
        return self.disk.hashes()

    async def run(self, program_hash: str, program_bytes: bytes | None, inputs: bytes, timeout: float | None = None,
                  private: bool = False, session: dict | None = None, tag: object = None,
                  spare_sessions: bool = False, dry: DryRun | None = None) -> RunResult:
        """Run a job in an executor process. Raises ProgramNotCached, JobRejected, JobFailed or JobTimeout.

        ``session``: the job is a step of an inference session, ``{"key", "step", "fresh", "close", "room"}``; its
        state stays in the executor that ran step 0 (SessionLost once that process is gone); ``room``: the most bytes
        a new session's state may take. ``tag``: a name for this run, to :meth:`stop` it by while it runs.
        ``spare_sessions``: take an executor holding no session's state if one is idle (work that may be stopped keeps
        out of the way of the sessions' steps, which must run there). ``dry``: filled in with what the job's dry run
        took, whatever the outcome.

        Cancelling a run stops it at its program's next node, the process serving on; one op that outlasts
        STOP_GRACE has its process killed, unless the process holds sessions' state: a kill would lose every session
        there (any client's), so a run there is only ever stopped, and so is a run past its time there (killed only
        if one op outlasts STOP_GRACE)."""
        if self._closed:  # the worker is leaving: the job runs elsewhere
            raise _leaving("before")
        check_hash(program_hash)
        if program_bytes is None and not self.has_program(program_hash):
            raise ProgramNotCached(program_hash)
        timeout = self.default_timeout if timeout is None else timeout
        pinned = None
        if session is not None and session["step"] > 0:
            pinned = self._pinned_slot(session["key"])
        slot = await (self._acquire_slot(pinned) if pinned is not None else self._acquire(program_hash,
                                                                                           spare_sessions))
        if tag is not None:
            self._tagged[tag] = slot
        try:
            if pinned is not None and self._pins.get(session["key"], (None, -1))[1] != slot.generation:
                raise SessionLost("the session's state was lost while its step waited: its executor restarted")
            result = await self._run_on(slot, program_hash, program_bytes, inputs, timeout, private, session,
                                        DryRun() if dry is None else dry)
            if session is not None:
                if session.get("close"):
                    self._pins.pop(session["key"], None)
                else:
                    self._pins[session["key"]] = (slot, slot.generation)
            return result
        finally:
            if tag is not None:
                self._tagged.pop(tag, None)
            self._release(slot)

    def stop(self, tag: object) -> bool:
        """Ask the executor running the job tagged ``tag`` to stop it at the next node of its program: its ``run``
        raises JobPreempted and the process serves the next job, no restart. False when that job is not running in an
        executor now (the caller then cancels it). A single op that runs long keeps going until it returns: the
        caller bounds the wait (a cancel kills the process after STOP_GRACE, unless it holds sessions' state)."""
        slot = self._tagged.get(tag)
        if slot is None or not slot.in_flight or slot.killed:
            return False
        slot.ask_stop()
        return True

    def running_where(self, session_key: str) -> list[object]:
        """Tags of the runs on the executor holding this session's state (what its next step waits for)."""
        pin = self._pins.get(session_key)
        if pin is None:
            return []
        return [tag for tag, slot in self._tagged.items() if slot is pin[0]]

    def holds_sessions_of(self, tag: object) -> bool:
        """Whether the executor running the job tagged ``tag`` holds sessions' state (a cancel there will not kill)."""
        slot = self._tagged.get(tag)
        return slot is not None and self._holds_sessions(slot)

    def warm_spare(self) -> None:
        """Start a spare executor now if none stands by, so the next one killed is replaced without a torch import."""
        if self._spare is None and not self._spare_starting and not self._closed:
            self._spare_starting = True
            asyncio.get_running_loop().run_in_executor(None, self._start_spare)

    def _pinned_slot(self, key: str) -> "_Slot":
        pin = self._pins.get(key)
        if pin is None or pin[0].generation != pin[1] or pin[0].closed:
            self._pins.pop(key, None)
            raise SessionLost("this worker no longer holds the session's state (its executor restarted, or the "
                              "session expired or was closed)")
        return pin[0]

    def holds_session(self, key: str) -> bool:
        pin = self._pins.get(key)
        return pin is not None and pin[0].generation == pin[1] and not pin[0].closed

    async def drop_sessions(self, keys: list[str]) -> None:
        """Free sessions' state (expired, or their client is gone): each executor holding some is told once it is
        free; one that restarted since holds none of it anyway."""
        by_slot: dict[_Slot, list[str]] = {}
        for key in keys:
            pin = self._pins.pop(key, None)
            if pin is not None and pin[0].generation == pin[1] and not pin[0].closed:
                by_slot.setdefault(pin[0], []).append(key)
        for slot, held in by_slot.items():
            slot = await self._acquire_slot(slot)
            try:
                if slot.ready and not slot.killed:
                    slot.send([msgpack.packb({"op": "drop", "keys": held}, use_bin_type=True)])
            except (OSError, ValueError):
                slot.kill()
            finally:
                self._release(slot)

    async def sandbox_report(self) -> list[str]:
        """What the executors' sandbox enforces (each executor locks itself down once torch is imported)."""
        slot = self._slots[0]
        if not slot.ready:
            await slot.ensure_ready()
        return slot.sandbox

    def busy_pids(self) -> list[int]:
        """Process ids of executors with a job in flight (for monitoring, and for tests that kill one)."""
        return [s.proc.pid for s in self._slots if s.in_flight]

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._slots]

    def close(self) -> None:
        """Stop every executor process this pool started, and remove a temporary cache directory."""
        if self._closed:
            return
        with self._spare_lock:
            self._closed = True
        for waiter in list(self._waiters):  # may run in another thread (the worker closes the pool in one)
            if not waiter.done():
                waiter.get_loop().call_soon_threadsafe(_fail, waiter, _leaving("before"))
        for s in self._slots:
            s.stop()
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------------------------------

    async def _acquire(self, program_hash: str, spare_sessions: bool = False) -> _Slot:
        """An idle executor, preferring one that already holds the program in memory (and, ``spare_sessions``, one
        holding no session's state); else wait in line (FIFO): a released executor is handed straight to the first
        caller waiting, so no newcomer can overtake it."""
        if self._closed:
            raise _leaving("before")
        idle = [s for s in self._slots if not s.busy]
        if idle and not self._waiters:
            if spare_sessions:
                pinned = {slot for slot, generation in self._pins.values() if slot.generation == generation}
                idle = sorted(idle, key=lambda s: s in pinned)
            slot = next((s for s in idle if program_hash in s.hashes), idle[0])
            slot.busy = True
            return slot
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed a slot, then cancelled before using it: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    async def _acquire_slot(self, slot: _Slot) -> _Slot:
        """This very executor (it holds a session's state), once it is free; callers waiting for it come first."""
        if self._closed:
            raise _leaving("before")
        if not slot.busy:
            slot.busy = True
            return slot
        waiter = asyncio.get_running_loop().create_future()
        queue = self._pinned_waiters.setdefault(slot, deque())
        queue.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())
            elif waiter in queue:
                queue.remove(waiter)
            raise

    def _release(self, slot: _Slot) -> None:
        pinned = self._pinned_waiters.get(slot) if self._pinned_waiters else None
        while pinned:
            waiter = pinned.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)  # stays busy: it changes hands
                return
        slot.busy = False

    async def _revive(self, slot: _Slot) -> None:
        """A killed executor is replaced by the warm spare if one is ready, and a new spare is started."""
        if not slot.killed or self._closed:
            return
        if self._spare is not None:
            spare, self._spare = self._spare, None
            old_proc, old_conn = slot.take_over(spare)
            await asyncio.to_thread(_reap, old_proc, old_conn)
        self.warm_spare()

    def _start_spare(self) -> None:
        try:
            spare = _Slot(self._ctx, self._config)
        finally:
            self._spare_starting = False
        with self._spare_lock:
            if not self._closed:
                self._spare, spare = spare, None
        if spare is not None:
            spare.stop()

    async def _run_on(self, slot: _Slot, program_hash: str, program_bytes: bytes | None, inputs: bytes, timeout: float,
                      private: bool, session: dict | None, dry: DryRun) -> RunResult:
        if self._closed:  # the worker is leaving: this job runs elsewhere
            raise _leaving("before")
        await self._revive(slot)
        await slot.ensure_ready()
        dry.cap = slot.dry_cap
        # A small msgpack header, then the program and inputs as raw pipe messages: packing hundreds of MiB into one
        # msgpack message would copy them once more for nothing. Small inputs ride in the header (one write, one wake).
        # Big inputs go through shared memory instead: one copy into a memfd whose descriptor is passed over the
        # pipe, mapped by the child page-aligned, so its tensors are zero-copy views (no pipe copy, no re-alignment).
        slot.run_id += 1
        header = {"op": "run", "hash": program_hash, "program": program_bytes is not None, "private": private,
                  "run": slot.run_id}
        if session is not None:
            header["session"] = session
        payloads = [program_bytes] if program_bytes is not None else []
        shared = None
        if hasattr(inputs, "fileno"):  # spooled to a file by the service: the child maps the file itself
            header["inputs_fd"], shared = len(inputs), inputs
        elif len(inputs) <= _IN_HEADER_BYTES:
            header["inputs"] = inputs
        elif len(inputs) > _INLINE_PIPE_BYTES and _HAVE_MEMFD:
            header["inputs_fd"], shared = len(inputs), inputs
        else:
            payloads.append(inputs)
        messages = [msgpack.packb(header, use_bin_type=True), *payloads]
        slot.in_flight = True
        work = asyncio.ensure_future(self._send_and_await(slot, messages, shared, program_hash, timeout))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The caller gave up on the run. It is asked to stop at its program's next node (or before its first, if
            # it has not reached the process yet), so the process, torch imported and programs cached, serves the
            # next job: killed, it cost that job a fresh executor's start (2.7 s on a 2-core machine). A run still
            # going after STOP_GRACE (one op running long) is killed, unless its process holds sessions' state (any
            # client's, lost with it): that one is waited for within its own time limit (past it, _await_reply
            # kills it as for any run).
            grace = slot.ask_stop()  # asked already (a preemption, a pause): what is left of that grace
            overdue = None
            if not self._holds_sessions(slot):
                def kill_if_running() -> None:
                    if not work.done():
                        slot.kill()  # the next job gets a fresh process
                        work.cancel()

                overdue = asyncio.get_running_loop().call_later(grace, kill_if_running)
            try:
                await wait_out(work)  # a second cancel must not leave the pipe half read or written under a thread
            finally:
                if overdue is not None:
                    overdue.cancel()
            if session is not None and not work.cancelled() and work.exception() is None:
                # The step ended before it could stop (on a GPU, the stop is seen long before the queued kernels
                # finish): its session's state in the process has moved on with it, so it is done, and taken as
                # done; dropped, the worker's table would be a step behind the state and a rerun would compute on
                # the wrong one.
                asyncio.current_task().uncancel()
                return work.result()
            if not work.cancelled():
                work.exception()  # stopped, failed or ended: the run is over and nobody wants its result
            raise
        finally:
            slot.in_flight = False
            word = slot.dry_word  # what the run's dry run took, as far as it got (before a kill's restart replaces it)
            if word[_DRY_RUN] == slot.run_id:
                dry.began = word[_DRY_BEGAN]
                dry.seconds = None if word[_DRY_SECONDS] < 0 else word[_DRY_SECONDS]

    async def _send_and_await(self, slot: _Slot, messages: list[bytes], shared, program_hash: str,
                              timeout: float) -> RunResult:
        try:
            if shared is None and sum(len(m) for m in messages) <= _INLINE_PIPE_BYTES:
                slot.send(messages)
            else:  # a big pipe write blocks until the child has read it: not on the event loop
                await slot.in_thread(slot.send, messages, shared)
        except (OSError, ValueError):
            return self._died(slot, "before the job was sent", by_the_job=False)
        return await self._await_reply(slot, program_hash, timeout)

    def _holds_sessions(self, slot: _Slot) -> bool:
        return any(s is slot and g == slot.generation for s, g in self._pins.values())

    def _work_deadline(self, slot: _Slot, loop) -> tuple[float, str] | None:
        """When the run in ``slot`` has used the time its counted work pays for (on ``loop``'s clock), and why; None
        until its dry run has counted it."""
        from gpunet.job.cost import seconds_allowed

        word = slot.dry_word
        run = word[_DRY_RUN]
        flops, ended = word[_DRY_FLOPS], word[_DRY_ENDED]
        if run != slot.run_id or word[_DRY_RUN] != run or flops < 0:  # another run's words, or rewritten meanwhile
            return None
        allowed = seconds_allowed(int(flops), self.speed_tflops)
        why = (f"job ran past the {allowed:.0f} s its counted work ({flops:.3g} FLOPs) allows on this worker "
               f"({self.speed_tflops:.3g} TFLOPS)")
        return loop.time() + (ended + allowed - time.monotonic()), why

    async def _await_reply(self, slot: _Slot, program_hash: str, timeout: float) -> RunResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        why = f"job did not finish within {timeout:.1f} s"
        stopping = False
        # The run's counted work caps its time, from the end of its dry run. The child sends no message when that
        # ends (one more wake of this loop per job): the cap is never sooner than GRACE_SECONDS after it, so looking at
        # the shared words that often finds it in time. (Imported here: this module is the executor's entry point and
        # must not import torch before the sandbox is entered.)
        look_every = None
        if self.speed_tflops:
            from gpunet.job.cost import GRACE_SECONDS

            look_every = max(GRACE_SECONDS, 0.05)
        while True:
            wait = deadline - loop.time()
            if look_every is not None and not stopping:
                wait = min(wait, look_every)
            try:
                if await slot.readable(max(0.0, wait)):
                    break
            except (OSError, ValueError):  # its pipe was closed under it: the pool is closing (the worker leaves)
                raise _leaving("while") from None
            if look_every is not None and not stopping:
                cap = self._work_deadline(slot, loop)
                if cap is not None:
                    look_every = None
                    if cap[0] < deadline:
                        deadline, why = cap
                if loop.time() < deadline:
                    continue
            if not stopping and self._holds_sessions(slot):
                # A kill would take every session this process holds (any client's) with it: first ask the run to
                # stop at its program's next node.
                slot.ask_stop()
                stopping, deadline = True, loop.time() + STOP_GRACE
                continue
            slot.kill()
            raise JobTimeout(f"{why}; its executor was killed and replaced")
        try:
            reply = msgpack.unpackb(slot.conn.recv_bytes(), raw=False)
            outputs = reply.get("outputs")
            if reply.get("ok") and outputs is None:
                if reply.get("outputs_size", 0) <= _INLINE_PIPE_BYTES:
                    outputs = slot.conn.recv_bytes()
                else:
                    outputs = await slot.in_thread(slot.conn.recv_bytes)
        except (EOFError, OSError, ValueError):
            return self._died(slot, "while running the job")
        if reply.get("restart"):  # the job poisoned the process's CUDA context: the process (and every session it
            slot.kill()           # held) goes, which is the job's doing, counted as a crash against its client
            raise ExecutorDied(f"{reply.get('message', 'CUDA error')}; its executor had to be replaced")
        if reply.get("ok"):
            slot.hashes.add(program_hash)
            return RunResult(outputs, reply["flops"], reply["wall_time"], reply["peak_memory_bytes"],
                             reply.get("state_bytes", 0))
        if reply.get("error") == "ProgramNotCached":
            raise ProgramNotCached(program_hash)
        if stopping and reply.get("error") == "JobPreempted":
            raise JobTimeout(f"{why}; it was stopped (its executor serves on, with the sessions it holds)")
        raise _ERRORS.get(reply.get("error"), JobFailed)(reply.get("message", "executor error"))

    def _died(self, slot: _Slot, when: str, by_the_job: bool = True) -> RunResult:
        """Raise for a dead executor: ExecutorDied (counted against the job's client) only when the job was running
        in it; a process that died before the job reached it is no fault of the job's."""
        if self._closed:  # stopped by close(): the worker is leaving, and the job did nothing wrong
            raise _leaving("while")
        how = slot.exit_status()  # the process is gone: reaping it is immediate
        slot.kill()
        raise (ExecutorDied if by_the_job else JobFailed)(f"executor process died {when} ({how}); it was replaced")


def _leaving(when: str) -> WorkerDraining:
    """What a job hears when the pool closed before or while it ran: the worker is leaving; it runs elsewhere."""
    return WorkerDraining(f"the worker stopped {when} the job ran; run it elsewhere")


def _reap(proc, conn) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(5)
    conn.close()


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


# --- the executor process -------------------------------------------------------------------------------------------


def _limit_memory(budget: int, device: str) -> None:
    """Cap this process's address space at what it uses now plus the budget (CPU). On CUDA the budget is the
    allocator's fraction instead: CUDA reserves huge virtual ranges, so an address-space limit would break it."""
    import torch

    if device.startswith("cuda"):
        dev = torch.device(device)
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
        return
    try:
        import resource

        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        slack = 1024**3  # thread stacks and allocator arenas that come with running ops
        limit = vm + budget + slack
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError, StopIteration):
        pass  # not Linux: the dry-run limit still applies


@contextlib.contextmanager
def _sigint_ignored_by_children():
    """Start processes with SIGINT ignored: an ignored signal stays ignored across exec, and Python then never
    installs its KeyboardInterrupt handler, so a Ctrl-C to the process group while an executor boots cannot kill it
    with a traceback (stopping executors is the worker's call, after it drains). Only the main thread may change
    signal handlers; a process started from another thread (a respawn) relies on _child_main alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def _child_main(conn: Connection, config: dict, stop_word=None, dry_word=None) -> None:
    """Executor process: load/validate/cache programs and run jobs until told to exit or the pipe closes."""
    # Ctrl-C in a terminal reaches the whole process group; stopping executors is the worker's call (it drains
    # first), so a keypress must not kill one mid-job or mid-import with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from gpunet.worker import sandbox

    # Files first, while this process has a single thread (Landlock binds the threads started after it); the rest
    # once torch is imported (a seccomp filter synchronised to all of torch's threads). See gpunet.worker.sandbox.
    report = ["no sandbox (turned off)"]
    if config.get("sandbox"):
        # Some torch code paths want a temporary directory: a private one, the only other place it may write.
        os.makedirs(config["tmp_dir"], exist_ok=True)
        os.environ["TMPDIR"] = config["tmp_dir"]
        report = sandbox.enter_files([config["cache_dir"], config["tmp_dir"]], protected=config.get("protected", []))
    # OpenMP's threads sleep between parallel regions instead of spinning: jobs come in bursts (a session's step,
    # then nothing until the next), and spinning threads took the cores from the worker's own I/O, the p2p daemon and
    # any other process (three workers on two cores computed a step 60% slower). Read when torch loads OpenMP.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from gpunet.job import tensors
    from gpunet.job.interpreter import run_program
    from gpunet.job.validator import load_program

    # The first meta kernel that needs torch's Python registrations imports about 800 modules (sympy, mpmath): 1.2 s
    # of CPU. Here, before the executor says it is ready, not in a client's first dry run (whose time it is charged).
    torch.ops.aten.mean.dim(torch.empty(2, 3, device="meta"), [1])

    torch.set_num_threads(config["threads"])
    device = config["device"]
    budget = config["memory_budget_bytes"]
    limits = job_limits(budget, config["max_flops"], config.get("max_dry_run_seconds"))
    disk = DiskCache(config["cache_dir"], config["disk_cache_bytes"])
    programs: MemoryLRU = MemoryLRU(config["memory_cache_programs"], budget)
    try:  # the first call that starts the device (CUDA here): a driver or sandbox that refuses it is said, not crashed
        _limit_memory(budget, device)
    except Exception as e:
        conn.send_bytes(msgpack.packb({"ready": False, "error": f"{device}: {type(e).__name__}: {first_line(e, 400)}"}))
        raise SystemExit(1) from None
    if config.get("sandbox"):
        report += sandbox.enter_syscalls(max_file_bytes=config["disk_cache_bytes"])
    conn.send_bytes(msgpack.packb({"ready": True, "sandbox": report, "max_dry_run_seconds": limits.max_dry_run_seconds}))
    sessions: dict[str, list] = {}  # inference sessions' state, between their steps (the parent bounds it)
    while True:
        try:
            req = msgpack.unpackb(conn.recv_bytes(), raw=False)
            if req.get("op") == "drop":
                for key in req.get("keys", ()):
                    sessions.pop(key, None)
                continue
            if req.get("op") != "run":
                return
            req["program"] = conn.recv_bytes() if req.get("program") else None
            if "inputs_fd" in req:
                req["inputs"] = _map_shared(reduction.recv_handle(conn), req["inputs_fd"])
            elif "inputs" not in req:
                req["inputs"] = conn.recv_bytes()
        except (EOFError, OSError):
            return
        run = req.get("run")
        try:
            reply = _run_one(req, device, limits, disk, programs, tensors, load_program, run_program,
                             dry_word=dry_word,
                             sessions=sessions,
                             stop=(lambda: stop_word.value == run) if stop_word is not None and run else None)
        except (JobRejected, JobFailed, JobPreempted) as e:
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        except ProgramNotCached as e:
            reply = {"ok": False, "error": "ProgramNotCached", "message": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": "JobFailed", "message": "job ran out of memory in its executor"}
        except Exception as e:  # a bug or a torch failure outside an op: report it, keep serving
            reply = {"ok": False, "error": "JobFailed", "message": f"{type(e).__name__}: {str(e)[:500]}"}
        if device.startswith("cuda") and not reply["ok"]:
            # A run stopped or failed between nodes may leave kernels queued: they finish here, before the reply
            # frees this process for the next job (whose time and errors they are not); an error they raise is this
            # run's.
            try:
                torch.cuda.synchronize(device)
            except Exception as e:
                reply["message"] = f"{reply.get('message', '')}; then {type(e).__name__}: {str(e)[:300]}"
        # A CUDA error (e.g. a device-side assert from an out-of-range index) poisons this process's context:
        # report the failure, then exit so the pool starts a clean executor.
        poisoned = device.startswith("cuda") and not reply["ok"] and "CUDA error" in reply.get("message", "")
        reply["restart"] = poisoned
        outputs = reply.pop("outputs", None)
        if outputs is not None:
            reply["outputs_size"] = len(outputs)
            if len(outputs) <= _IN_HEADER_BYTES:
                reply["outputs"], outputs = outputs, None
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
        if outputs is not None:
            conn.send_bytes(outputs)
        if poisoned:
            return


def job_limits(budget: int, max_flops: int = 10**15, max_dry_run_seconds: float | None = None):
    """The limits an executor with a memory ``budget`` checks every job against (gpunet.job.validator.WorkerLimits)."""
    from gpunet.job.validator import WorkerLimits

    limits = WorkerLimits(max_peak_memory_bytes=budget, max_flops=max_flops, max_program_bytes=budget,
                          max_input_bytes=budget)
    if max_dry_run_seconds is not None:
        limits = dataclasses.replace(limits, max_dry_run_seconds=max_dry_run_seconds)
    return limits


def _map_shared(fd: int, size: int) -> memoryview:
    """The parent's memfd, mapped read-only; unmapped when the last tensor viewing it is gone."""
    try:
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def _run_one(req, device, limits, disk, programs, tensors, load_program, run_program,
             sessions: dict | None = None, stop=None, dry_word=None) -> dict:
    h = check_hash(req["hash"])
    prog = programs.get(h)
    if prog is None:
        data = req.get("program") or disk.get(h)
        if data is None:
            raise ProgramNotCached(h)
        prog = load_program(data, device=device, limits=limits, expected_hash=h)
        if req.get("program") and not req.get("private"):  # a private program's weights never touch the disk
            disk.put(h, data)
        # Charged at least the container's size: weights may be views into it, which keep all of it alive.
        programs.put(h, prog, max(len(data), sum(w.numel() * w.element_size() for w in prog.weights)))
    given = tensors.decode(req["inputs"], max_total_bytes=limits.max_input_bytes)
    session = req.get("session")
    if session is not None:
        given, state_bytes = _with_state(prog, session, given, sessions, device)
    inputs = prog.inputs_from_dict(given)
    est = _dry_run(prog, inputs, stop, dry_word, req.get("run"))  # the parent caps the run's time by its count
    t0 = time.perf_counter()
    outs = run_program(prog, inputs, stop=stop)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    reply = {"flops": est.flops, "wall_time": wall, "peak_memory_bytes": est.peak_memory_bytes}
    new_state = None
    if session is not None:  # the new state stays here; the step's answer is the rest
        k = prog.manifest.state
        new_state = _own_state(prog, outs[len(outs) - k:])
        outs = outs[:len(outs) - k]
        reply["state_bytes"] = state_bytes
    data = tensors.encode({f"output_{i}": o for i, o in enumerate(outs)})
    if session is not None:  # last of all: a step that failed on the way leaves the state as it was
        sessions.pop(session["key"], None)
        if not session.get("close"):
            sessions[session["key"]] = new_state
    return {"ok": True, "outputs": data, **reply}


def _dry_run(prog, inputs, stop, dry_word, run):
    """The program's dry run, what it took written to the shared ``dry_word`` as it goes (see _DRY_RUN)."""
    if dry_word is None or not run:
        return prog.dry_run(inputs, stop=stop)[0]
    dry_word[_DRY_BEGAN], dry_word[_DRY_SECONDS], dry_word[_DRY_FLOPS] = time.monotonic(), -1.0, -1.0
    dry_word[_DRY_RUN] = run  # last: the parent reads this first
    try:
        est, seconds = prog.dry_run(inputs, stop=stop)
    except (JobRejected, JobPreempted) as e:  # refused or stopped by the dry run: what it took
        dry_word[_DRY_SECONDS] = getattr(e, "dry_seconds", 0.0)
        raise
    dry_word[_DRY_ENDED], dry_word[_DRY_SECONDS] = time.monotonic(), seconds
    dry_word[_DRY_FLOPS] = est.flops  # last: the parent takes it as the sign that the rest is written
    return est


def _own_state(prog, state: list) -> list:
    """The new state as the manifest declares it, each tensor holding exactly its own memory: a state that is a
    slice of a big intermediate, or an input passed through, must not keep more alive than the session is charged
    (and a program whose real state differs from its declared one is refused: its session's size would be a lie)."""
    import torch

    from gpunet.job import tensors

    manifest = prog.manifest
    specs = manifest.inputs[len(manifest.inputs) - manifest.state:]
    owned = []
    for spec, t in zip(specs, state):
        if tensors.DTYPE_NAMES.get(t.dtype) != spec.dtype or tuple(t.shape) != tuple(spec.shape):
            raise JobRejected(f"the program's new state {spec.name} is {tensors.DTYPE_NAMES.get(t.dtype)} "
                              f"{list(t.shape)}, its manifest declares {spec.dtype} {list(spec.shape)}")
        whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
        owned.append(t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format))
    return owned


def _with_state(prog, session: dict, given: dict, sessions: dict, device: str) -> tuple[dict, int]:
    """A session step's full inputs: what the client sent, then the state (held here since the last step; at step 0
    sent by the client, or zeros of the declared shapes when ``fresh``)."""
    import torch

    from gpunet.job import tensors

    manifest = prog.manifest
    k, n = manifest.state, len(manifest.inputs)
    if not k:
        raise JobRejected("this program holds no state (its manifest declares none): run it as a plain job")
    state_bytes = manifest.state_bytes
    specs = manifest.inputs[n - k:]
    if session["step"] == 0:
        if state_bytes > session.get("room", 0):
            raise JobRejected(f"the session's state takes {state_bytes} bytes; this worker has "
                              f"{max(0, session.get('room', 0))} left for sessions now")
        if session.get("fresh"):
            state = [torch.zeros(spec.shape, dtype=tensors.DTYPES[spec.dtype], device=device) for spec in specs]
        else:
            return given, state_bytes  # the client sent the first state with the inputs
    else:
        state = sessions.get(session["key"])
        if state is None:
            raise SessionLost("this worker no longer holds the session's state")
    if len(given) != n - k:
        raise JobRejected(f"a session step sends {n - k} inputs (the state stays on the worker), got {len(given)}")
    given = dict(given)
    for i, t in enumerate(state):
        given[f"input_{n - k + i}"] = t
    return given, state_bytes
