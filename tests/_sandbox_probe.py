"""The attacker's side of tests/test_sandbox.py, in a module that does not import torch: a spawned process imports the
module its target lives in, and the sandbox's first phase must run while the process has a single thread (as in
an executor, whose module does not import torch either)."""

from __future__ import annotations

import os
import socket

from gpunet.worker.executor import sandbox


def _attempt(what, fn) -> str:
    try:
        fn()
        return f"{what}: allowed"
    except OSError as e:
        return f"{what}: refused ({e.errno})"


def _root_powers() -> str:
    """Any capability left in any thread of this process (what root's processes have unless they drop them)."""
    left = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                left += [line.split()[0] for line in f if line.startswith(("CapEff", "CapPrm", "CapBnd", "CapAmb"))
                         and int(line.split()[1], 16)]
        except (ProcessLookupError, FileNotFoundError):
            continue  # a thread (one of torch's) that ended between the listing and the read
    return f"root powers: allowed ({', '.join(sorted(set(left)))})" if left else "root powers: refused (none left)"


def probe(config: dict, key: str, home_file: str, parent: int, out) -> None:
    """Runs in a fresh process that locks itself down exactly as an executor does (files before torch starts its
    threads, system calls after), then tries what an attacker would, from a thread started before the lockdown too."""
    import threading

    report = sandbox.enter_files([config["cache_dir"]], protected=config["protected"])
    import torch  # noqa: F401  (as the executor: imported between the two phases)

    early = threading.Event()
    go, done = threading.Event(), []
    thread = threading.Thread(target=lambda: (early.set(), go.wait(), done.append(
        _attempt("thread socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)))))
    thread.start()
    early.wait()
    report += sandbox.enter_syscalls(config["disk_cache_bytes"])
    go.set()
    thread.join()
    named = threading.Event()
    worker = threading.Thread(target=named.wait)  # a thread to name from this one, as CUDA names the threads it starts
    worker.start()
    results = [
        _attempt("read key", lambda: open(key, "rb").read()),
        _attempt("read home", lambda: open(home_file, "rb").read()),
        _attempt("list data dir", lambda: os.listdir(os.path.dirname(key))),
        _attempt("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
        _attempt("unix socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
        _attempt("exec", lambda: os.execv("/bin/true", ["true"])),
        _attempt("fork", lambda: os._exit(0) if os.fork() == 0 else None),
        _attempt("parent memory", lambda: open(f"/proc/{parent}/mem", "rb").read(1)),
        _attempt("write outside cache", lambda: open(os.path.join(os.path.dirname(key), "x"), "wb").write(b"x")),
        _attempt("other process's cmdline", lambda: open(f"/proc/{parent}/cmdline", "rb").read()),
        _attempt("socketpair", lambda: socket.socketpair()),
        _attempt("signal the parent", lambda: os.kill(parent, 0)),
        _attempt("name the parent's thread", lambda: open(f"/proc/{parent}/task/{parent}/comm", "w").write("x")),
        _root_powers(),
        *done,
        _attempt("name its own thread", lambda: open(f"/proc/self/task/{worker.native_id}/comm", "w").write("job")),
        _attempt("write cache", lambda: open(os.path.join(config["cache_dir"], "ok"), "wb").write(b"x")),
    ]
    named.set()
    worker.join()
    out.send((report, results))


