"""What runs in an executor process (forked by :mod:`gpunet.worker.executor.forkserver`'s fork server): load, validate,
cache and run programs under a memory budget and the sandbox, answering over the pipe in msgpack, never pickle.

Nothing here is imported by the worker's network process except the names the parent shares with the child (the
layout of the dry-run word, :func:`job_limits`)."""

from __future__ import annotations

import array
import dataclasses
import importlib
import mmap
import os
import signal
import tempfile
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection

import msgpack

from gpunet.errors import (
    JobFailed,
    JobPreempted,
    JobRejected,
    JobTimeout,
    ProgramNotCached,
    SessionLost,
    WeightsMismatch,
)
from gpunet.utils import first_line
from gpunet.worker.executor.cache import DiskCache, MemoryLRU, check_hash

_IN_HEADER_BYTES = 64 * 1024  # inputs/outputs this small travel inside the header message


#: The shared words a child writes as a run's dry run begins and ends: the run's number (written last), when it
#: began (time.monotonic(), one clock for all processes), the CPU seconds it took (-1 until it ends), the work it
#: counted (-1 until it ends well) and when it ended. Read by the parent however the run ended, even if the process was
#: killed before it could say; the counted work caps the run's time (Executor._work_deadline) with no message sent.
_DRY_RUN, _DRY_BEGAN, _DRY_SECONDS, _DRY_FLOPS, _DRY_ENDED = range(5)


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




def child_main(conn: Connection, config: dict, stop_word=None, dry_word=None) -> None:
    """Executor process: load/validate/cache programs and run jobs until told to exit or the pipe closes."""
    # Ctrl-C in a terminal reaches the whole process group; stopping executors is the worker's call (it drains
    # first), so a keypress must not kill one mid-job or mid-import with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from gpunet.worker.executor.forkserver import let_go_of_the_fork_server, name_process

    let_go_of_the_fork_server()
    name_process(b"gpunet-executor")
    from gpunet.worker.executor import sandbox

    # Files first, while this process has a single thread (Landlock binds the threads started after it): forked by the
    # fork server, it has just the one; spawned (no fork server here), it has not imported torch yet. The rest once
    # torch is in (a seccomp filter synchronised to all of torch's threads). See gpunet.worker.executor.sandbox.
    report = ["no sandbox (turned off)"]
    if config.get("sandbox"):
        # Some torch code paths want a temporary directory: a private one, the only other place it may write (and
        # the one Python's tempfile names from now on, though the fork server's imports asked it already).
        os.makedirs(config["tmp_dir"], exist_ok=True)
        os.environ["TMPDIR"] = config["tmp_dir"]
        tempfile.tempdir = None
        report = sandbox.enter_files([config["cache_dir"], config["tmp_dir"]], protected=config.get("protected", []))
    # What the fork server imported already (in a spawned executor: imported now, under the files sandbox).
    importlib.import_module("gpunet.worker.executor.preload")
    import torch

    from gpunet.job import tensors
    from gpunet.job.interpreter import run_program
    from gpunet.job.validator import load_program
    from gpunet.worker.executor.graphs import graph_cache

    torch.set_num_threads(config["threads"])
    device = config["device"]
    budget = config["memory_budget_bytes"]
    # Runs that repeat their shapes are captured and replayed (CUDA graphs): called in place of the plain run.
    graphs = graph_cache(config.get("graphs"), device, budget, run_program)
    run_program = graphs or run_program
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
            header = conn.recv_bytes()
            received = time.monotonic_ns()
            req = msgpack.unpackb(header, raw=False)
            if req.get("op") == "drop":
                for key in req.get("keys", ()):
                    sessions.pop(key, None)
                continue
            if req.get("op") != "run":
                return
            if "program_fd" in req:  # spooled by the worker (gpunet.worker.spool): the same pages, mapped here
                req["program"] = _map_shared(reduction.recv_handle(conn), req["program_fd"])
            else:
                req["program"] = conn.recv_bytes() if req.get("program") else None
            if "inputs_fd" in req:
                req["inputs"] = _map_shared(reduction.recv_handle(conn), req["inputs_fd"])
            elif "inputs" not in req:
                req["inputs"] = conn.recv_bytes()
            files = [reduction.recv_handle(conn) for _ in range(int(req.get("ref_files", 0)))]
        except (EOFError, OSError):
            return
        run = req.get("run")
        req["refs"] = refs = _RefReader(req.get("refs"), files)
        try:
            reply = (_run_rows if "rows" in req else _run_one)(
                req, device, limits, disk, programs, tensors, load_program, run_program, dry_word=dry_word,
                sessions=sessions, stop=(lambda: stop_word.value == run) if stop_word is not None and run else None)
        except WeightsMismatch as e:
            reply = {"ok": False, "error": "WeightsMismatch", "message": str(e), "hashes": list(e.hashes)}
        except (JobRejected, JobFailed, JobPreempted, JobTimeout) as e:
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        except ProgramNotCached as e:
            reply = {"ok": False, "error": "ProgramNotCached", "message": str(e)}
        except MemoryError:
            reply = {"ok": False, "error": "JobFailed", "message": "job ran out of memory in its executor"}
        except Exception as e:  # a bug or a torch failure outside an op: report it, keep serving
            reply = {"ok": False, "error": "JobFailed", "message": f"{type(e).__name__}: {str(e)[:500]}"}
        finally:
            refs.close()
        failed = [r for r in reply.get("rows") or [reply] if r is not None and not r["ok"]]  # (rows: any of them)
        if device.startswith("cuda") and failed:
            # A run stopped or failed between nodes may leave kernels queued: they finish here, before the reply
            # frees this process for the next job (whose time and errors they are not); an error they raise is this
            # run's.
            try:
                torch.cuda.synchronize(device)
            except Exception as e:
                for r in failed:
                    r["message"] = f"{r.get('message', '')}; then {type(e).__name__}: {str(e)[:300]}"
        # A CUDA error (e.g. a device-side assert from an out-of-range index) poisons this process's context:
        # report the failure, then exit so the pool starts a clean executor.
        poisoned = device.startswith("cuda") and any("CUDA error" in r.get("message", "") for r in failed)
        reply["restart"] = poisoned
        if graphs is not None:  # what CUDA graphs did (the worker's metrics); "recycle": replace this process
            graphs.tell(reply, holding_sessions=bool(sessions))
        if reply.get("ok") and "began" in reply:  # a session step's marks (gpunet.worker.steptrace): four ints
            reply["marks"] = [received, reply.pop("began"), reply.pop("ended"), time.monotonic_ns()]
        outputs = reply.pop("outputs", None)
        if outputs is not None:
            reply["outputs_size"] = len(outputs)
            if len(outputs) <= _IN_HEADER_BYTES:
                reply["outputs"], outputs = outputs, None
        conn.send_bytes(msgpack.packb(reply, use_bin_type=True))
        if outputs is not None:
            conn.send_bytes(outputs)
        if poisoned or reply.get("recycle"):
            return
        # Let go of the job's bytes now, not when the next job comes: a spooled program's mapping would keep its
        # unlinked file (its blocks reserved) on the worker's disk while this process waits.
        req = reply = outputs = None


def job_limits(budget: int, max_flops: int = 10**15, max_dry_run_seconds: float | None = None):
    """The limits an executor with a memory ``budget`` checks every job against (gpunet.job.validator.WorkerLimits)."""
    from gpunet.job.validator import WorkerLimits

    limits = WorkerLimits(max_peak_memory_bytes=budget, max_flops=max_flops, max_program_bytes=budget,
                          max_input_bytes=budget)
    if max_dry_run_seconds is not None:
        limits = dataclasses.replace(limits, max_dry_run_seconds=max_dry_run_seconds)
    return limits


_MAPPED_REF_BYTES = 64 * 1024


class _RefReader:
    """What loads the weights a program names by reference: each read from its range of a file the worker handed
    over (as a descriptor: this process names no path), into memory of its own (load_program then checks it against
    its hash). Read, not mapped: a mapping of a whole checkpoint shard would count against this process's address
    space limit, and a file changed after the check would change what runs."""

    def __init__(self, entries, files: list[int]):
        self.files = files
        self.where = {}
        for entry in entries or ():
            sha, index, offset, length = entry
            self.where[sha] = (index, offset, length)

    def __call__(self, ref):
        found = self.where.get(ref.sha256)
        if found is None:  # the worker did not say where (it believed this process had the program loaded)
            raise ProgramNotCached("")
        index, offset, length = found
        if not 0 <= index < len(self.files):
            return b""
        # Big ones into page-aligned memory, so the weight is used where it was read (not copied again to align it).
        buf = mmap.mmap(-1, length) if length >= _MAPPED_REF_BYTES else bytearray(length)
        view, got = memoryview(buf), 0
        while got < length:
            n = os.preadv(self.files[index], [view[got:]], offset + got)
            if n <= 0:  # the file is shorter than it was: what came is checked (and does not match)
                break
            got += n
        return view[:got]

    def close(self) -> None:
        for fd in self.files:
            os.close(fd)
        self.files = []


def _map_shared(fd: int, size: int) -> memoryview:
    """The parent's memfd, mapped read-only; unmapped when the last tensor viewing it is gone."""
    try:
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def _run_one(req, device, limits, disk, programs, tensors, load_program, run_program,
             sessions: dict | None = None, stop=None, dry_word=None) -> dict:
    h = check_hash(req["hash"])
    # "fresh": the bytes sent are what this job may run (its client may not run a copy loaded here): load, check them.
    prog = None if req.get("fresh") and req.get("program") else programs.get(h)
    if prog is None:
        data = req.get("program") or disk.get(h)
        if data is None:
            raise ProgramNotCached(h)
        prog = load_program(data, device=device, limits=limits, expected_hash=h, refs=req.get("refs"))
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
    pace = None
    if req.get("tflops") and req.get("deadline") and len(est.node_flops) == len(prog.steps):
        pace = Pacer(prog.steps, est.node_flops, float(req["tflops"]), float(req["deadline"]),
                     overrun=not device.startswith("cuda"))
    began = time.monotonic_ns()
    outs = run_program(prog, inputs, stop=stop, pace=pace)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    ended = time.monotonic_ns()
    reply = {"flops": est.flops, "wall_time": (ended - began) / 1e9, "peak_memory_bytes": est.peak_memory_bytes}
    if session is not None:
        reply["began"], reply["ended"] = began, ended
        if prog.manifest.batch is not None:  # its sessions' later steps may go as one forward (run_rows)
            reply["batched"] = True
    new_state = None
    if session is not None:  # the new state stays here; the step's answer is the rest
        k = prog.manifest.state
        new_state = _own_state(prog, outs[len(outs) - k:])
        outs = outs[:len(outs) - k]
        reply["state_bytes"] = state_bytes
    data = tensors.encode({f"output_{i}": o for i, o in enumerate(outs)})
    if session is not None:  # last of all: a step that failed on the way leaves the state as it was
        _keep_state(sessions, session, new_state)
    return {"ok": True, "outputs": data, **reply}


def _keep_state(sessions: dict, session: dict, new_state: list) -> None:
    """A session step succeeded: its new state replaces the old (a closing step's goes with it)."""
    sessions.pop(session["key"], None)
    if not session.get("close"):
        sessions[session["key"]] = new_state


def _run_rows(req, device, limits, disk, programs, tensors, load_program, run_program,
              sessions: dict, stop=None, dry_word=None) -> dict:
    """Several sessions' steps of one batched program (Manifest.batch) as one forward: each session's inputs and
    state stacked as a row, the outputs and new states split back (docs/sessions.md, batching). A row that cannot
    run (its state gone, inputs of another shape than the rest) fails alone; if the batched forward fails, each row
    is run alone, so one session's inputs cannot fail another's step. A session's state changes only with its own
    step's success. Each row's ``flops`` is what its step counts alone (what its client counts: see
    docs/sessions.md, batching, on the price)."""
    h = check_hash(req["hash"])
    prog = programs.get(h)
    if prog is None:  # (later steps only: the program is loaded where their sessions' state is)
        raise ProgramNotCached(h)
    if prog.manifest.batch is None:
        raise JobRejected("this program declares no batch dim: its sessions' steps run one by one")
    results: list = [None] * len(req["rows"])
    groups: dict[tuple, list] = {}  # rows of one shape, batched together
    keys: set[str] = set()
    for i, (session, data) in enumerate(zip(req["rows"], req["inputs"])):
        try:
            if session["key"] in keys or session["step"] == 0:
                raise JobRejected("a batch holds later steps of distinct sessions")
            keys.add(session["key"])
            given = tensors.decode(data, max_total_bytes=limits.max_input_bytes)
            given, state_bytes = _with_state(prog, session, given, sessions, device)
        except Exception as e:
            results[i] = _failed(e)
            continue
        shapes = tuple((name, t.dtype, tuple(t.shape)) for name, t in sorted(given.items()))
        groups.setdefault(shapes, []).append((i, session, given, state_bytes))
    most = prog.manifest.dims[prog.manifest.batch].max or len(results)  # rows one forward may take
    batches = [group[at:at + most] for group in groups.values() for at in range(0, len(group), most)]
    for rows in batches:
        try:
            done = _forward_rows(prog, rows, run_program, stop, dry_word, req.get("run"), device, tensors)
        except Exception as e:  # (MemoryError, a torch error in an op: as _run_one's caller reports them)
            if len(rows) == 1 or isinstance(e, (JobPreempted, JobTimeout)) or "CUDA error" in str(e):
                # Stopped (the worker's doing, for all of them), or a device error (the process restarts): as
                # one. Anything else is some row's doing: each is run alone, so the others' steps go on.
                for row in rows:
                    results[row[0]] = _failed(e)
                continue
            done = {}
            for row in rows:
                try:
                    done.update(_forward_rows(prog, [row], run_program, stop, dry_word, req.get("run"), device,
                                              tensors))
                except Exception as e:
                    results[row[0]] = _failed(e)
        for i, (reply, session, new_state) in done.items():  # last: a failure above leaves every state as it was
            _keep_state(sessions, session, new_state)
            results[i] = reply
    return {"ok": True, "rows": results}


def _forward_rows(prog, rows: list, run_program, stop, dry_word, run, device, tensors) -> dict:
    """One forward of ``rows`` (index, session, full inputs, state bytes) stacked: per index, its reply, session
    and new state."""
    import torch

    names = list(rows[0][2])
    stacked = {name: torch.cat([given[name] for _, _, given, _ in rows]) if len(rows) > 1 else rows[0][2][name]
               for name in names}
    inputs = prog.inputs_from_dict(stacked)
    est = _dry_run(prog, inputs, stop, dry_word, run)
    began = time.monotonic_ns()
    outs = run_program(prog, inputs, stop=stop)
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    wall = (time.monotonic_ns() - began) / 1e9
    k, n = prog.manifest.state, len(rows)
    # Each row is billed its own step's count, which its client checks: one dry run of one row's shapes (cached).
    flops = int(est.flops if n == 1 else prog.dry_run(prog.inputs_from_dict(rows[0][2]), stop=stop)[0].flops)
    done = {}
    for r, (i, session, _, state_bytes) in enumerate(rows):
        row = [o[r:r + 1] for o in outs]
        new_state = _own_state(prog, row[len(row) - k:])
        data = tensors.encode({f"output_{j}": o.contiguous() for j, o in enumerate(row[:len(row) - k])})
        done[i] = ({"ok": True, "outputs": data, "flops": flops, "wall_time": wall,
                    "peak_memory_bytes": est.peak_memory_bytes, "state_bytes": state_bytes, "rows": n},
                   session, new_state)
    return done


def _failed(e: BaseException) -> dict:
    """A row's failure as the worker reads it (an error that is not gpunet's own is the job's failure)."""
    if isinstance(e, (JobRejected, JobFailed, JobPreempted, JobTimeout, SessionLost, ProgramNotCached)):
        return {"ok": False, "error": type(e).__name__, "message": str(e)}
    if isinstance(e, MemoryError):
        return {"ok": False, "error": "JobFailed", "message": "job ran out of memory in its executor"}
    return {"ok": False, "error": "JobFailed", "message": f"{type(e).__name__}: {str(e)[:500]}"}


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


class Pacer:
    """Bounds each node's time by its counted work (gpunet.job.cost), so that a run is stopped between nodes (its
    process, with the programs it caches and the sessions it holds, serving on) rather than killed inside one: a node
    that cannot end before the job's ``deadline`` (time.monotonic()) at the device's measured speed is not started,
    and (``overrun``; on a CPU, where a node's time is its own) one that ran far past what its work allows stops the
    run at the next node. Either raises JobTimeout, which counts against the client as a run past its time."""

    def __init__(self, steps, costs, tflops: float, deadline: float, overrun: bool = True):
        from gpunet.job.cost import node_bounds

        self.steps, self.costs, self.tflops, self.deadline, self.overrun = steps, costs, tflops, deadline, overrun
        self.began: float | None = None
        # Per node, bound once (a compiled run checks them inline: gpunet.job.interpreter.Plan): the least time it
        # takes, and the most it may take (no bound where a node's time is not its own).
        self.least, self.allowed = node_bounds(tuple(costs), tflops)
        if not overrun:
            self.allowed = array.array("d", [float("inf")]) * len(costs)

    def __call__(self, i: int) -> None:
        now = time.monotonic()
        began = self.began if i > 0 else None
        if (began is not None and now - began > self.allowed[i - 1]) or now + self.least[i] > self.deadline:
            self.stop_at(i, now, began)
        self.began = now

    def stop_at(self, i: int, now: float, began: float | None) -> None:
        """Node ``i`` is not started at ``now``: the one before it (begun at ``began``) ran past what its work allows,
        or it cannot end within the job's time."""
        if began is not None and i > 0 and now - began > self.allowed[i - 1]:
            took = now - began
            raise JobTimeout(f"{self._node(i - 1)} ran {took:.1f} s; its counted work ({self.costs[i - 1]:.3g} "
                             f"FLOPs) allows {self.allowed[i - 1]:.1f} s on this worker ({self.tflops:.3g} TFLOPS): "
                             "the job was stopped after it (not billed)")
        raise JobTimeout(f"{self._node(i)} needs at least {self.least[i]:.2g} s for its counted work "
                         f"({self.costs[i]:.3g} FLOPs) on this worker ({self.tflops:.3g} TFLOPS), more than the "
                         f"{max(0.0, self.deadline - now):.2g} s left of the job's time: stopped before it ran "
                         "(not billed)")

    def _node(self, i: int) -> str:
        return f"node {self.steps[i].name!r} ({self.steps[i].op})"


def _own_state(prog, state: list) -> list:
    """The new state as the manifest declares it, each tensor holding exactly its own memory: a state that is a
    slice of a big intermediate, or an input passed through, must not keep more alive than the session is charged
    (and a program whose real state differs from its declared one is refused: its session's size would be a lie)."""
    import torch

    from gpunet.job import tensors

    manifest = prog.manifest
    owned = []
    for spec, t in zip(manifest.state_specs, state):
        shape = manifest.row_shape(spec)
        if tensors.DTYPE_NAMES.get(t.dtype) != spec.dtype or tuple(t.shape) != shape:
            raise JobRejected(f"the program's new state {spec.name} is {tensors.DTYPE_NAMES.get(t.dtype)} "
                              f"{list(t.shape)}, its manifest declares {spec.dtype} {list(shape)}")
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
    specs = manifest.state_specs
    if manifest.batch is not None and any(t.dim() == 0 or t.shape[0] != 1 for t in given.values()):
        raise JobRejected(f"a session of a batched program is one row: its step's inputs have 1 in their first dim "
                          f"({manifest.batch})")
    if session["step"] == 0:
        if state_bytes > session.get("room", 0):
            raise JobRejected(f"the session's state takes {state_bytes} bytes; this worker has "
                              f"{max(0, session.get('room', 0))} left for sessions now")
        if session.get("fresh"):
            state = [torch.zeros(manifest.row_shape(spec), dtype=tensors.DTYPES[spec.dtype], device=device)
                     for spec in specs]
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
