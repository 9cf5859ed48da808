"""Jobs run in a pool of executor processes, apart from the worker's network process.

Each executor is a ``spawn``-started process (fork is unsafe beside threads and the libp2p daemon) that validates,
caches and runs programs under a memory budget. The parent waits on the reply *or* the process's death, with a
deadline: a job that crashes or hangs its executor fails (JobFailed / JobTimeout), the executor is replaced, and the
worker keeps serving; a job whose caller gives up (cancel, client gone) is stopped the same way. Parent and child exchange msgpack over a pipe, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from gpunet.errors import ExecutorDied, JobFailed, JobRejected, JobTimeout, ProgramNotCached
from gpunet.worker.cache import DiskCache, MemoryLRU, check_hash

_STARTUP_TIMEOUT = 180.0  # importing torch in a fresh process can be slow on a loaded machine
#: Pipe messages up to this size are written and read on the event loop (the pipe drains at GB/s); bigger ones in a
#: thread, so a large payload never stalls other jobs' network I/O.
_INLINE_PIPE_BYTES = 1 << 20
_IN_HEADER_BYTES = 64 * 1024  # inputs/outputs this small travel inside the header message
_HAVE_MEMFD = hasattr(os, "memfd_create")  # Linux; elsewhere big inputs go through the pipe
_ERRORS = {"JobRejected": JobRejected, "JobFailed": JobFailed}


@dataclass(frozen=True)
class RunResult:
    """A finished job: output tensor bytes (safetensors layout) and what it cost (``flops`` from the dry run)."""

    outputs: bytes
    flops: int
    wall_time: float
    peak_memory_bytes: int


class _Slot:
    """One executor process and the parent's end of its pipe."""

    def __init__(self, ctx, config: dict):
        self._ctx, self._config = ctx, config
        self.hashes: set[str] = set()  # programs this process holds in memory (mirrors the child's LRU, roughly)
        self.busy = False  # reserved by a caller (the pool is used from one event loop: no lock)
        self.in_flight = False  # a job has been sent and not answered
        self.closed = False
        self.start()

    sandbox: list[str] = []  # what the process's sandbox enforces, as it reported once ready

    def take_over(self, spare: "_Slot") -> tuple:
        """Use ``spare``'s process (started earlier, torch likely imported already) instead of starting one; returns
        the old (process, pipe) to reap."""
        old = (self.proc, self.conn)
        self.proc, self.conn = spare.proc, spare.conn
        self.ready, self.killed, self.hashes = False, False, set()
        return old

    def start(self) -> None:
        self.killed = False
        self.conn, child = self._ctx.Pipe(duplex=True)
        self.proc = self._ctx.Process(target=_child_main, args=(child, self._config), daemon=True, name="gpunet-executor")
        with _sigint_ignored_by_children():
            self.proc.start()
        child.close()
        self.ready = False
        self.hashes = set()

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
                    return
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
            while not io.done():  # a second cancel must not let the pipe close under the thread either
                try:
                    await asyncio.wait([io])
                except asyncio.CancelledError:
                    pass
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
    move in a thread. Cancelling :meth:`run` while the job runs kills that executor (the pool starts a fresh one):
    that is how a cancelled or abandoned job stops using the machine.
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
            "threads": threads_per_process or max(1, (os.cpu_count() or 1) // processes),
            "sandbox": sandbox,  # see gpunet.worker.sandbox
            "tmp_dir": str(Path(cache_dir).parent / "executor-tmp"),
            "protected": [str(p) for p in protected],
        }
        self._ctx, self._config = multiprocessing.get_context("spawn"), config
        self._slots = [_Slot(self._ctx, config) for _ in range(processes)]
        # Once an executor has died, a warm spare stands by: the next death (a crash loop is one client's doing) costs
        # the jobs of others no torch import.
        self._spare: _Slot | None = None
        self._spare_starting = False
        self._spare_lock = threading.Lock()  # the spare is started in a thread; close() may run in another
        self._waiters: deque[asyncio.Future] = deque()  # callers waiting for an idle executor, first come first served
        self._closed = False

    # --- public -----------------------------------------------------------------------------------------------------

    def has_program(self, program_hash: str) -> bool:
        """Whether a job can be sent without its program bytes."""
        return any(program_hash in s.hashes for s in self._slots) or program_hash in self.disk

    def cached_programs(self) -> list[str]:
        """Hashes this worker can run without a transfer (for the worker record)."""
        return self.disk.hashes()

    async def run(self, program_hash: str, program_bytes: bytes | None, inputs: bytes, timeout: float | None = None,
                  private: bool = False) -> RunResult:
        """Run a job in an executor process. Raises ProgramNotCached, JobRejected, JobFailed or JobTimeout."""
        if self._closed:
            raise JobFailed("executor is closed")
        check_hash(program_hash)
        if program_bytes is None and not self.has_program(program_hash):
            raise ProgramNotCached(program_hash)
        timeout = self.default_timeout if timeout is None else timeout
        slot = await self._acquire(program_hash)
        try:
            return await self._run_on(slot, program_hash, program_bytes, inputs, timeout, private)
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
                waiter.get_loop().call_soon_threadsafe(_fail, waiter, JobFailed("executor is closed"))
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

    async def _acquire(self, program_hash: str) -> _Slot:
        """An idle executor, preferring one that already holds the program in memory; else wait in line (FIFO): a
        released executor is handed straight to the first caller waiting, so no newcomer can overtake it."""
        if self._closed:
            raise JobFailed("executor is closed")
        idle = [s for s in self._slots if not s.busy]
        if idle and not self._waiters:
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

    def _release(self, slot: _Slot) -> None:
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
        if not self._spare_starting:
            self._spare_starting = True
            asyncio.get_running_loop().run_in_executor(None, self._start_spare)

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
                      private: bool = False) -> RunResult:
        await self._revive(slot)
        await slot.ensure_ready()
        # A small msgpack header, then the program and inputs as raw pipe messages: packing hundreds of MiB into one
        # msgpack message would copy them once more for nothing. Small inputs ride in the header (one write, one wake).
        # Big inputs go through shared memory instead: one copy into a memfd whose descriptor is passed over the
        # pipe, mapped by the child page-aligned, so its tensors are zero-copy views (no pipe copy, no re-alignment).
        header = {"op": "run", "hash": program_hash, "program": program_bytes is not None, "private": private}
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
        try:
            try:
                if shared is None and sum(len(m) for m in messages) <= _INLINE_PIPE_BYTES:
                    slot.send(messages)
                else:  # a big pipe write blocks until the child has read it: not on the event loop
                    await slot.in_thread(slot.send, messages, shared)
            except (OSError, ValueError):
                return self._died(slot, "before the job was sent", by_the_job=False)
            return await self._await_reply(slot, program_hash, timeout)
        except asyncio.CancelledError:
            # The caller gave up on a job that is running: stop it (the next job gets a fresh process).
            slot.kill()
            raise
        finally:
            slot.in_flight = False

    async def _await_reply(self, slot: _Slot, program_hash: str, timeout: float) -> RunResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        why = f"job did not finish within {timeout:.1f} s"
        while True:
            if not await slot.readable(max(0.0, deadline - loop.time())):
                slot.kill()
                raise JobTimeout(f"{why}; its executor was killed and replaced")
            try:
                reply = msgpack.unpackb(slot.conn.recv_bytes(), raw=False)
            except (EOFError, OSError, ValueError):
                return self._died(slot, "while running the job")
            if not reply.get("started"):
                break
            # The dry run has counted the job's work: it runs no longer than that pays for. (Imported here: this
            # module is the executor's entry point and must not import torch before the sandbox is entered.)
            from gpunet.job.cost import seconds_allowed

            allowed = seconds_allowed(int(reply.get("flops", 0)), self.speed_tflops) if self.speed_tflops else None
            if allowed is not None and loop.time() + allowed < deadline:
                deadline = loop.time() + allowed
                why = (f"job ran past the {allowed:.0f} s its counted work ({reply.get('flops', 0):.3g} FLOPs) allows "
                       f"on this worker ({self.speed_tflops:.3g} TFLOPS)")
        try:
            outputs = reply.get("outputs")
            if reply.get("ok") and outputs is None:
                if reply.get("outputs_size", 0) <= _INLINE_PIPE_BYTES:
                    outputs = slot.conn.recv_bytes()
                else:
                    outputs = await slot.in_thread(slot.conn.recv_bytes)
        except (EOFError, OSError, ValueError):
            return self._died(slot, "while running the job")
        if reply.get("restart"):
            slot.kill()
        if reply.get("ok"):
            slot.hashes.add(program_hash)
            return RunResult(outputs, reply["flops"], reply["wall_time"], reply["peak_memory_bytes"])
        if reply.get("error") == "ProgramNotCached":
            raise ProgramNotCached(program_hash)
        raise _ERRORS.get(reply.get("error"), JobFailed)(reply.get("message", "executor error"))

    def _died(self, slot: _Slot, when: str, by_the_job: bool = True) -> RunResult:
        """Raise for a dead executor: ExecutorDied (counted against the job's client) only when the job was running
        in it; a process that died before the job reached it is no fault of the job's."""
        how = slot.exit_status()  # the process is gone: reaping it is immediate
        slot.kill()
        raise (ExecutorDied if by_the_job else JobFailed)(f"executor process died {when} ({how}); it was replaced")


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


def _child_main(conn: Connection, config: dict) -> None:
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
    import torch

    from gpunet.job import tensors
    from gpunet.job.interpreter import run_program
    from gpunet.job.validator import WorkerLimits, load_program

    torch.set_num_threads(config["threads"])
    device = config["device"]
    budget = config["memory_budget_bytes"]
    limits = WorkerLimits(max_peak_memory_bytes=budget, max_flops=config["max_flops"], max_program_bytes=budget, max_input_bytes=budget)
    disk = DiskCache(config["cache_dir"], config["disk_cache_bytes"])
    programs: MemoryLRU = MemoryLRU(config["memory_cache_programs"], budget)
    _limit_memory(budget, device)
    if config.get("sandbox"):
        report += sandbox.enter_syscalls(max_file_bytes=config["disk_cache_bytes"])
    conn.send_bytes(msgpack.packb({"ready": True, "sandbox": report}))
    while True:
        try:
            req = msgpack.unpackb(conn.recv_bytes(), raw=False)
            if req.get("op") != "run":
                return
            req["program"] = conn.recv_bytes() if req.get("program") else None
            if "inputs_fd" in req:
                req["inputs"] = _map_shared(reduction.recv_handle(conn), req["inputs_fd"])
            elif "inputs" not in req:
                req["inputs"] = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            reply = _run_one(req, device, limits, disk, programs, tensors, load_program, run_program,
                             started=lambda flops: conn.send_bytes(msgpack.packb({"started": True, "flops": flops})))
        except (JobRejected, JobFailed) as e:
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        except ProgramNotCached as e:
            reply = {"ok": False, "error": "ProgramNotCached", "message": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": "JobFailed", "message": "job ran out of memory in its executor"}
        except Exception as e:  # a bug or a torch failure outside an op: report it, keep serving
            reply = {"ok": False, "error": "JobFailed", "message": f"{type(e).__name__}: {str(e)[:500]}"}
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


def _map_shared(fd: int, size: int) -> memoryview:
    """The parent's memfd, mapped read-only; unmapped when the last tensor viewing it is gone."""
    try:
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def _run_one(req, device, limits, disk, programs, tensors, load_program, run_program, started=None) -> dict:
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
    inputs = prog.inputs_from_dict(tensors.decode(req["inputs"], max_total_bytes=limits.max_input_bytes))
    est = prog.estimate(inputs)
    if started is not None:  # the parent caps the run time by the counted work
        started(est.flops)
    t0 = time.perf_counter()
    outs = run_program(prog, inputs)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    data = tensors.encode({f"output_{i}": o for i, o in enumerate(outs)})
    return {"ok": True, "outputs": data, "flops": est.flops, "wall_time": wall, "peak_memory_bytes": est.peak_memory_bytes}
