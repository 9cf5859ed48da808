"""Jobs run in a pool of executor processes, apart from the worker's network process.

Each executor is a process forked by a fork server that imported torch once (:func:`.forkserver.context`; fork from the
worker itself is unsafe beside its threads and the libp2p daemon) that validates, caches and runs programs under a
memory budget. The parent waits on the reply *or* the process's death, with a
deadline: a job that crashes or hangs its executor fails (JobFailed / JobTimeout), the executor is replaced, and the
worker keeps serving. A job whose caller gives up (cancel, client gone) is stopped at its program's next node, and
its executor serves on; one still running :data:`STOP_GRACE` later is stopped as a hung one is, except in a process
holding inference sessions' state (a kill would lose every session there). With ``session_processes``, sessions'
state lives in processes of its own that plain jobs never reach, so no stranger's job that must be killed can take
it along. Parent and child exchange msgpack over a pipe, never pickle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgpack

from gpunet.errors import (
    ExecutorDied,
    JobFailed,
    JobTimeout,
    ProgramNotCached,
    SessionLost,
    WeightsMismatch,
    WorkerDraining,
)
from gpunet.protocol.errors import error_named
from gpunet.utils import LRU, wait_out
from gpunet.worker.executor import forkserver
from gpunet.worker.executor import slot as slots  # (its STOP_GRACE read at use: tests shorten it)
from gpunet.worker.executor.cache import DiskCache, check_hash
from gpunet.worker.executor.child import _DRY_BEGAN, _DRY_ENDED, _DRY_FLOPS, _DRY_RUN, _DRY_SECONDS, _IN_HEADER_BYTES
from gpunet.worker.executor.slot import _HAVE_MEMFD, _INLINE_PIPE_BYTES, Slot, reap
from gpunet.worker.hardware import job_threads
from gpunet.worker.state.limits import SessionRun

logger = logging.getLogger(__name__)




@dataclass(frozen=True)
class RunResult:
    """A finished job: output tensor bytes (safetensors layout) and what it cost (``flops`` from the dry run)."""

    outputs: bytes
    flops: int
    wall_time: float
    peak_memory_bytes: int
    state_bytes: int = 0  # a session step: what its state holds in the executor now
    marks: tuple[int, ...] = ()  # a session step: the executor's marks (gpunet.worker.steptrace.EXECUTOR_MARKS)
    rows: int = 1  # sessions' steps in the forward that computed it (run_rows): its flops are its share


@dataclass(frozen=True)
class RefFiles:
    """Where the weights a program names by reference lie, for an executor that must load it: ``entries`` are
    ``[sha256, file index, offset, length]``, ``paths`` the files (opened by the worker and handed over as
    descriptors: the sandboxed process names no path). Each range is checked against its hash as it loads."""

    entries: list
    paths: list

    def open(self) -> list[int]:
        """The files, opened read-only; WeightsMismatch naming the weights of a file that is gone."""
        fds: list[int] = []
        try:
            for i, path in enumerate(self.paths):
                try:
                    fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                except OSError as e:
                    raise WeightsMismatch(f"{path}: {e.strerror}",
                                          tuple(sha for sha, index, _, _ in self.entries if index == i)) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds


@dataclass
class DryRun:
    """What a run's dry run took, for its caller whatever the run's outcome (a result, an error, a cancellation):
    :meth:`Executor.run` fills it in. The dry run's time is paid by no receipt (gpunet.worker.state.admission.dry_ran)."""

    began: float | None = None  # when its dry run began (time.monotonic()); None: it never did
    seconds: float | None = None  # the CPU time it took (0: the same shapes answered); None: stopped before it ended
    cap: float = 0.0  # the longest a dry run may take in that executor

    def cost(self, now: float) -> float:
        """The dry run's time; for one stopped before it ended, what it may have been (at most ``cap``)."""
        if self.seconds is not None:
            return self.seconds
        return 0.0 if self.began is None else min(max(0.0, now - self.began), self.cap)


# Past 600 lines with run_rows (sessions batched, issue 42): the sessions' pins (which executor holds whose state,
# and who waits for it) are the next part to move into a class of their own.
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
        session_processes: int = 0,
        session_memory_budget_bytes: int | None = None,
        graphs: str | None = "cuda",
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
            "sandbox": sandbox,  # see gpunet.worker.executor.sandbox
            "tmp_dir": str(Path(cache_dir).parent / "executor-tmp"),
            "protected": [str(p) for p in protected],
            "max_dry_run_seconds": max_dry_run_seconds,  # None: WorkerLimits' own
            # Runs that repeat their shapes, replayed as CUDA graphs (gpunet.worker.executor.graphs): "cuda" (on a
            # CUDA device), "fake" (FAKE HARDWARE for tests: the CPU stand-in) or None.
            "graphs": graphs,
        }
        self._ctx, self._config = forkserver.context(), config
        self._slots = [Slot(self._ctx, config) for _ in range(processes)]
        # Inference sessions' own processes (docs/sessions.md): plain jobs never run there, so a stranger's job that
        # must be killed cannot take any session's state with it. Started at the first session (a fork of the
        # fork server, which imported torch), with their own memory budget. 0: sessions share the plain executors.
        self._session_config = {**config, "memory_budget_bytes": session_memory_budget_bytes or memory_budget_bytes}
        self._session_processes = session_processes
        self._session_slots: list[Slot] = []
        self._session_waiters: deque[asyncio.Future] = deque()
        self._session_starting = 0
        # Once an executor has died, a warm spare stands by: the next death (a crash loop is one client's doing) costs
        # the jobs of others no wait for a new process (a fork and its sandbox; a torch import if the server died).
        self._spare: Slot | None = None
        self._spare_starting = False
        self._spare_lock = threading.Lock()  # the spare is started in a thread; close() may run in another
        self._waiters: deque[asyncio.Future] = deque()  # callers waiting for an idle executor, first come first served
        # Inference sessions (docs/sessions.md): each session's state lives in one executor process, so its steps go
        # to that one (waiting for it, ahead of jobs that could run anywhere). key -> (slot, its generation then).
        self._pins: dict[str, tuple[Slot, int]] = {}
        self._pinned_waiters: dict[Slot, deque[asyncio.Future]] = {}
        self._tagged: dict[object, Slot] = {}  # runs that may be stopped for another job -> the executor running it
        self._batched: LRU[str, bool] = LRU(4096)  # programs whose sessions' steps may go as one forward
        from gpunet.worker.metrics import GraphReports  # (here: executors never load the metrics)

        self._graph_reports = GraphReports()  # what the executors' CUDA graphs did, into the metrics
        self._closed = False

    # --- public -----------------------------------------------------------------------------------------------------

    def has_program(self, program_hash: str) -> bool:
        """Whether a job can be sent without its program bytes."""
        return any(program_hash in s.hashes for s in self._all_slots()) or program_hash in self.disk

    def _all_slots(self) -> list[Slot]:
        return self._slots + self._session_slots

    def cached_programs(self) -> list[str]:
        """Hashes this worker can run without a transfer (for the worker record)."""
        return self.disk.hashes()

    async def run(self, program_hash: str, program_bytes: bytes | None, inputs: bytes, timeout: float | None = None,
                  private: bool = False, session: SessionRun | None = None, tag: object = None,
                  spare_sessions: bool = False, dry: DryRun | None = None, fresh: bool = False,
                  refs: RefFiles | None = None) -> RunResult:
        """Run a job in an executor process. Raises ProgramNotCached, JobRejected, JobFailed or JobTimeout.

        ``session``: the job is a step of an inference session, ``{"key", "step", "fresh", "close", "room"}``; its
        state stays in the executor that ran step 0 (SessionLost once that process is gone); ``room``: the most bytes
        a new session's state may take. ``tag``: a name for this run, to :meth:`stop` it by while it runs.
        ``spare_sessions``: take an executor holding no session's state if one is idle (work that may be stopped keeps
        out of the way of the sessions' steps, which must run there). ``dry``: filled in with what the job's dry run
        took, whatever the outcome. ``fresh``: run the program from ``program_bytes`` (checked against its hash as they
        load) even where a copy is loaded already: the bytes are what a client that may not run that copy brought.
        ``refs``: where the weights the program names by reference lie (files the executor is handed open, never
        named), for an executor that must load it.

        Cancelling a run stops it at its program's next node, the process serving on; one op that outlasts
        STOP_GRACE has its process killed, unless the process holds sessions' state: a kill would lose every session
        there (any client's), so a run there is only ever stopped, and so is a run past its time there (killed only
        if one op outlasts what its counted work allows and STOP_GRACE: ExecutorDied, a crash of its client).
        With ``session_processes``, a session's step 0 goes to a sessions' process and plain jobs never do."""
        if self._closed:  # the worker is leaving: the job runs elsewhere
            raise _leaving("before")
        check_hash(program_hash)
        if program_bytes is None and not self.has_program(program_hash):
            raise ProgramNotCached(program_hash)
        timeout = self.default_timeout if timeout is None else timeout
        pinned = None
        if session is not None and session.step > 0:
            pinned = self._pinned_slot(session.key)
        if pinned is not None:
            slot = await self._acquire_slot(pinned)
        elif session is not None and self._session_processes:
            slot = await self._acquire_session(program_hash)
        else:
            slot = await self._acquire(program_hash, spare_sessions)
        if tag is not None:
            self._tagged[tag] = slot
        try:
            if pinned is not None and self._pins.get(session.key, (None, -1))[1] != slot.generation:
                raise SessionLost("the session's state was lost while its step waited: its executor restarted")
            result = await self._run_on(slot, program_hash, program_bytes, inputs, timeout, private, session,
                                        DryRun() if dry is None else dry, fresh, refs)
            if session is not None:
                if session.close:
                    self._pins.pop(session.key, None)
                else:
                    self._pins[session.key] = (slot, slot.generation)
            return result
        finally:
            if tag is not None:
                self._tagged.pop(tag, None)
            self._release(slot)

    async def run_rows(self, program_hash: str, steps: list[tuple[SessionRun, bytes]], timeout: float | None = None
                       ) -> list[RunResult | BaseException]:
        """Later steps (``step > 0``) of sessions of one batched program (Manifest.batch), held in one executor, as
        one forward (docs/sessions.md, batching): per step, in order, its result or what failed it (a step fails
        alone: its state lost, its inputs unlike the rest's, a failure of its own). Raises only what fails them all
        (the executor died, the pool is closing). Runs to its end, like any session step: a cancel waits for it."""
        results: list = [self._pinned_slot(session.key, lost=True) for session, _ in steps]
        slot = next((r for r in results if isinstance(r, Slot)), None)
        if slot is not None:
            slot = await self._acquire_slot(slot)
        try:  # (the executor may have restarted while the batch waited for it)
            rows = [i for i, r in enumerate(results)
                    if r is slot and self._pins.get(steps[i][0].key) == (slot, slot.generation)]
            results = [r if i in rows or isinstance(r, BaseException) else JobFailed(
                "the session's state is in another executor than the batch's") if r is not slot else SessionLost(
                "the session's state was lost while its step waited: its executor restarted")
                for i, r in enumerate(results)]
            if rows:
                await slot.ensure_ready()
                slot.run_id += 1
                timeout = self.default_timeout if timeout is None else timeout
                message = _rows_message(program_hash, slot.run_id, [steps[i] for i in rows], self.speed_tflops, timeout)
                slot.in_flight = True
                work = asyncio.ensure_future(self._send_and_await(slot, [message], None, program_hash, timeout))
                try:
                    await wait_out(work)  # session steps run to their end (a cancel waits, and takes them as done)
                finally:
                    slot.in_flight = False
                for i, got in zip(rows, work.result()):
                    results[i] = got
                    if isinstance(got, RunResult) and steps[i][0].close:
                        self._pins.pop(steps[i][0].key, None)
            return results
        finally:
            if slot is not None:
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

    def expected_end(self, tag: object) -> float | None:
        """When the run tagged ``tag`` should end (time.monotonic) if it ran at this worker's measured speed: the end of
        its dry run plus its counted work at that speed. None until the dry run has counted it, or with no measured
        speed. An optimistic bound (a run is rarely faster), which is what lets the lanes spare a job about to end
        without a client being able to stretch the grace."""
        slot = self._tagged.get(tag)
        counted = _counted(slot) if slot is not None and self.speed_tflops and not slot.killed else None
        if counted is None:
            return None
        flops, ended = counted
        return ended + flops / (self.speed_tflops * 1e12)

    def warm_spare(self) -> None:
        """Start a spare executor now if none stands by, so the next one killed is replaced without waiting for one."""
        if self._spare is None and not self._spare_starting and not self._closed:
            self._spare_starting = True
            asyncio.get_running_loop().run_in_executor(None, self._start_spare)

    def rows_key(self, session_key: str, program_hash: str) -> str | None:
        """What steps that may run as one forward (:meth:`run_rows`) share: a batched program's, of sessions whose
        state one executor holds. None: the step runs alone."""
        pin = self._pinned_slot(session_key, lost=True)
        if not isinstance(pin, Slot) or self._batched.get(program_hash) is None:
            return None
        return f"{program_hash}/{id(pin)}/{pin.generation}"

    def _pinned_slot(self, key: str, lost: bool = False) -> "Slot | SessionLost":
        """The executor holding a session's state; SessionLost raised (``lost``: returned) when none does."""
        pin = self._pins.get(key)
        if pin is None or pin[0].generation != pin[1] or pin[0].closed:
            self._pins.pop(key, None)
            error = SessionLost("this worker no longer holds the session's state (its executor restarted, or the "
                                "session expired or was closed)")
            if lost:
                return error
            raise error
        return pin[0]

    def holds_session(self, key: str) -> bool:
        pin = self._pins.get(key)
        return pin is not None and pin[0].generation == pin[1] and not pin[0].closed

    async def drop_sessions(self, keys: list[str]) -> None:
        """Free sessions' state (expired, or their client is gone): each executor holding some is told once it is
        free; one that restarted since holds none of it anyway."""
        by_slot: dict[Slot, list[str]] = {}
        for key in keys:
            pin = self._pins.pop(key, None)
            if pin is not None and pin[0].generation == pin[1] and not pin[0].closed:
                by_slot.setdefault(pin[0], []).append(key)
        for slot, held in by_slot.items():
            slot = await self._acquire_slot(slot)
            try:
                if slot.ready and not slot.killed:
                    slot.send([msgpack.packb({"op": "drop", "keys": held}, use_bin_type=True)])
                if slot.graphs_broken == slot.generation and not self._holds_sessions(slot):
                    self._replace_broken(slot)
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
        return [s.proc.pid for s in self._all_slots() if s.in_flight]

    def pids(self) -> list[int]:
        """Process ids of the plain executors (those of sessions' own processes: :meth:`session_pids`)."""
        return [s.proc.pid for s in self._slots]

    def session_pids(self) -> list[int]:
        return [s.proc.pid for s in self._session_slots]

    def close(self) -> None:
        """Stop every executor process this pool started, and remove a temporary cache directory."""
        if self._closed:
            return
        with self._spare_lock:
            self._closed = True
        for waiter in [*self._waiters, *self._session_waiters]:  # may run in another thread (the worker closes
            if not waiter.done():                                  # the pool in one)
                waiter.get_loop().call_soon_threadsafe(_fail, waiter, _leaving("before"))
        for s in self._all_slots():
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

    async def _acquire(self, program_hash: str, spare_sessions: bool = False) -> Slot:
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
        return await self._wait_in_line(self._waiters)

    async def _wait_in_line(self, waiters: list) -> Slot:
        """Wait (FIFO, in ``waiters``) until :meth:`_release` hands this caller a slot."""
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release(waiter.result())  # handed a slot, then cancelled before using it: pass it on
            elif waiter in waiters:
                waiters.remove(waiter)
            raise

    async def _acquire_session(self, program_hash: str) -> Slot:
        """A sessions' process for a session's first step: an idle one (preferring one holding the program, then
        the one holding the fewest sessions), a new one while fewer than ``session_processes`` run, else wait in
        line (FIFO) for the first one free."""
        if self._closed:
            raise _leaving("before")
        idle = [s for s in self._session_slots if not s.busy]
        if idle and not self._session_waiters:
            held = [s for s, generation in self._pins.values() if s.generation == generation]
            slot = min(idle, key=lambda s: (s.graphs_broken == s.generation, program_hash not in s.hashes,
                                            held.count(s)))
            slot.busy = True
            return slot
        if len(self._session_slots) + self._session_starting < self._session_processes:
            self._session_starting += 1
            try:
                slot = await asyncio.to_thread(Slot, self._ctx, self._session_config)  # starting blocks a moment
            finally:
                self._session_starting -= 1
            if self._closed:
                slot.stop()
                raise _leaving("before")
            slot.busy = slot.for_sessions = True
            self._session_slots.append(slot)
            return slot
        return await self._wait_in_line(self._session_waiters)

    async def _acquire_slot(self, slot: Slot) -> Slot:
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

    def _release(self, slot: Slot) -> None:
        pinned = self._pinned_waiters.get(slot) if self._pinned_waiters else None
        while pinned:
            waiter = pinned.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        waiters = self._session_waiters if getattr(slot, "for_sessions", False) else self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)  # stays busy: it changes hands
                return
        slot.busy = False

    async def _revive(self, slot: Slot) -> None:
        """A killed executor is replaced by the warm spare if one is ready, and a new spare is started."""
        if not slot.killed or self._closed:
            return
        if slot.for_sessions:  # started with its own budget: a plain spare will not do
            return
        if self._spare is not None:
            spare, self._spare = self._spare, None
            old = slot.take_over(spare)
            await asyncio.to_thread(reap, *old)
        self.warm_spare()

    def _start_spare(self) -> None:
        try:
            spare = Slot(self._ctx, self._config)
        finally:
            self._spare_starting = False
        with self._spare_lock:
            if not self._closed:
                self._spare, spare = spare, None
        if spare is not None:
            spare.stop()

    async def _run_on(self, slot: Slot, program_hash: str, program_bytes: bytes | None, inputs: bytes, timeout: float,
                      private: bool, session: SessionRun | None, dry: DryRun, fresh: bool = False,
                      refs: RefFiles | None = None) -> RunResult:
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
        if fresh and program_bytes is not None:
            header["fresh"] = True
        if self.speed_tflops:  # each node's time is bounded by its counted work (child.Pacer): one that cannot end
            header["tflops"] = self.speed_tflops  # within the job's time is never started
            header["deadline"] = time.monotonic() + timeout
        if session is not None:
            header["session"] = session.to_wire()
        payloads = [program_bytes] if program_bytes is not None else []
        if hasattr(program_bytes, "fileno"):  # spooled to a file (gpunet.worker.spool): the child maps the file itself
            header["program_fd"] = len(program_bytes)
        shared = None
        if hasattr(inputs, "fileno"):  # spooled to a file by the service: the child maps the file itself
            header["inputs_fd"], shared = len(inputs), inputs
        elif len(inputs) <= _IN_HEADER_BYTES:
            header["inputs"] = inputs
        elif len(inputs) > _INLINE_PIPE_BYTES and _HAVE_MEMFD:
            header["inputs_fd"], shared = len(inputs), inputs
        else:
            payloads.append(inputs)
        files: list[int] = []
        if refs is not None and (program_bytes is not None or program_hash not in slot.hashes):
            # A process that holds the program loaded needs none. Opened before anything is sent: a file gone
            # fails this run alone (WeightsMismatch: the worker brings those weights from elsewhere).
            header["refs"], header["ref_files"], files = refs.entries, len(refs.paths), refs.open()
        messages = [msgpack.packb(header, use_bin_type=True), *payloads]
        slot.in_flight = True
        work = asyncio.ensure_future(self._send_and_await(slot, messages, shared, program_hash, timeout, files))
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

    async def _send_and_await(self, slot: Slot, messages: list[bytes], shared, program_hash: str,
                              timeout: float, files: list[int] = ()) -> RunResult:
        try:
            if shared is None and sum(len(m) for m in messages) <= _INLINE_PIPE_BYTES:
                slot.send(messages, files=files)
            else:  # a big pipe write blocks until the child has read it: not on the event loop
                await slot.in_thread(slot.send, messages, shared, files)
        except (OSError, ValueError):
            return self._died(slot, "before the job was sent", by_the_job=False)
        finally:
            for fd in files:
                os.close(fd)
        return await self._await_reply(slot, program_hash, timeout)

    def _holds_sessions(self, slot: Slot) -> bool:
        return any(s is slot and g == slot.generation for s, g in self._pins.values())

    def _work_deadline(self, slot: Slot, loop) -> tuple[float, str] | None:
        """When the run in ``slot`` has used the time its counted work pays for (on ``loop``'s clock), and why; None
        until its dry run has counted it."""
        from gpunet.job.cost import seconds_allowed

        counted = _counted(slot)
        if counted is None:
            return None
        flops, ended = counted
        allowed = seconds_allowed(int(flops), self.speed_tflops)
        why = (f"job ran past the {allowed:.0f} s its counted work ({flops:.3g} FLOPs) allows on this worker "
               f"({self.speed_tflops:.3g} TFLOPS)")
        return loop.time() + (ended + allowed - time.monotonic()), why

    async def _await_reply(self, slot: Slot, program_hash: str, timeout: float) -> RunResult:
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
                # stop at its program's next node, and let one op run on while its counted work says it may (the
                # interpreter never starts one that cannot end within the job's time at this device's speed).
                slot.ask_stop()
                stopping, deadline = True, loop.time() + slots.STOP_GRACE
                cap = self._work_deadline(slot, loop) if self.speed_tflops else None
                if cap is not None:
                    deadline = max(deadline, cap[0] + slots.STOP_GRACE)
                continue
            held = self._holds_sessions(slot)
            slot.kill()
            if held:  # every session there is lost: as costly as a crash, and counted against the client as one
                raise ExecutorDied(f"{why}, and one op outlasted what its counted work allows; its executor, which "
                                   "held inference sessions' state, was killed")
            raise JobTimeout(f"{why}; its executor was killed and replaced")
        try:
            reply = msgpack.unpackb(slot.conn.recv_bytes(), raw=False)
            outputs = reply.get("outputs")
            if reply.get("ok") and outputs is None and "rows" not in reply:
                if reply.get("outputs_size", 0) <= _INLINE_PIPE_BYTES:
                    outputs = slot.conn.recv_bytes()
                else:
                    outputs = await slot.in_thread(slot.conn.recv_bytes)
        except (EOFError, OSError, ValueError):
            return self._died(slot, "while running the job")
        if reply.get("graphs") is not None:
            self._graph_reports.count(slot, reply["graphs"], self._all_slots())
        if reply.get("graphs_broken"):  # a capture failed half way there: new sessions go elsewhere where they can
            slot.graphs_broken = slot.generation
        if reply.get("recycle") and not reply.get("restart"):  # the job's result stands
            self._replace_broken(slot)
        if reply.get("restart"):  # the job poisoned the process's CUDA context: the process (and every session it
            slot.kill()           # held) goes, which is the job's doing, counted as a crash against its client
            raise ExecutorDied(f"{reply.get('message', 'CUDA error')}; its executor had to be replaced")
        if reply.get("ok") and "rows" in reply:  # run_rows: each row's result or error
            return [RunResult(r["outputs"], r["flops"], r["wall_time"], r["peak_memory_bytes"], r.get("state_bytes", 0),
                              rows=r.get("rows", 1)) if r.get("ok") else _row_error(r, program_hash)
                    for r in reply["rows"]]
        if reply.get("ok"):
            if not slot.killed:
                slot.hashes.add(program_hash)
            if reply.get("batched"):
                self._batched.put(program_hash, True)
            return RunResult(outputs, reply["flops"], reply["wall_time"], reply["peak_memory_bytes"],
                             reply.get("state_bytes", 0), tuple(reply.get("marks", ())))
        if reply.get("error") == "ProgramNotCached":
            raise ProgramNotCached(program_hash)
        if reply.get("error") == "WeightsMismatch":
            raise WeightsMismatch(reply.get("message", "weights did not match"),
                                  tuple(h for h in reply.get("hashes", ()) if isinstance(h, str)))
        if stopping and reply.get("error") == "JobPreempted":
            raise JobTimeout(f"{why}; it was stopped (its executor serves on, with the sessions it holds)")
        raise error_named(reply.get("error"), reply.get("message", "executor error"))

    @staticmethod
    def _replace_broken(slot: Slot) -> None:
        """Replace an executor whose CUDA graph capture failed half way, now that it holds no session (no fault of
        any job's)."""
        logger.warning("An executor whose CUDA graph capture failed half way is replaced (it holds no session now)")
        slot.kill()

    def _died(self, slot: Slot, when: str, by_the_job: bool = True) -> RunResult:
        """Raise for a dead executor: ExecutorDied (counted against the job's client) only when the job was running
        in it; a process that died before the job reached it is no fault of the job's."""
        if self._closed:  # stopped by close(): the worker is leaving, and the job did nothing wrong
            raise _leaving("while")
        how = slot.proc.exit_status()  # the process is gone: reaping it is immediate
        slot.kill()
        raise (ExecutorDied if by_the_job else JobFailed)(f"executor process died {when} ({how}); it was replaced")


def _counted(slot: Slot) -> tuple[float, float] | None:
    """The work the run now in ``slot`` counted in its dry run and when that ended (time.monotonic), from the shared
    words (see child._DRY_RUN); None until it has, or when the words are another run's or being rewritten."""
    word = slot.dry_word
    run = word[_DRY_RUN]
    flops, ended = word[_DRY_FLOPS], word[_DRY_ENDED]
    if run != slot.run_id or word[_DRY_RUN] != run or flops < 0:
        return None
    return flops, ended


def _rows_message(program_hash: str, run_id: int, steps: list, tflops: float | None, timeout: float) -> bytes:
    """The header of a run of several sessions' steps (Executor.run_rows; their inputs ride in it)."""
    header = {"op": "run", "hash": program_hash, "run": run_id, "rows": [session.to_wire() for session, _ in steps],
              "inputs": [bytes(data) for _, data in steps]}
    if tflops:
        header["tflops"], header["deadline"] = tflops, time.monotonic() + timeout
    return msgpack.packb(header, use_bin_type=True)


def _row_error(reply: dict, program_hash: str) -> BaseException:
    if reply.get("error") == "ProgramNotCached":
        return ProgramNotCached(program_hash)
    return error_named(reply.get("error"), reply.get("message", "executor error"))


def _leaving(when: str) -> WorkerDraining:
    """What a job hears when the pool closed before or while it ran: the worker is leaving; it runs elsewhere."""
    return WorkerDraining(f"the worker stopped {when} the job ran; run it elsewhere")



def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)

