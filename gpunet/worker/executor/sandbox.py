"""The executor's sandbox: what a job's process may touch, enforced by the kernel, without privileges.

Jobs are data (a graph of allowlisted ops), so they cannot ask for a file or a socket; but the kernels those ops
reach are native code and not all memory-safe (see :mod:`gpunet.job.guards`), so a memory-corruption bug could turn
a crafted job into code running as the volunteer. Defence in depth: once an executor process has imported what it
needs, it locks itself down before it takes a job.

* **Landlock** (Linux >= 5.13; no privileges): files are read-only and only beneath what the executor needs — the
  Python installation and virtualenv, the gpunet and torch packages, ``/usr``, ``/lib``, ``/proc``, ``/sys``, a few
  device files — plus read-write access to the program cache directory and the process's own thread entries in
  ``/proc``. The data dir (the identity key!) and the home directory are out of reach. Where the kernel supports it
  (ABI 4), TCP connect and bind are denied too, and Landlock also stops the process from ptrace-ing (or reading the
  memory of) its parent.
* **seccomp** (no privileges once ``no_new_privs`` is set): no new sockets of any kind, no ``execve``, no new
  processes (threads only).
* **rlimits**: open files, the size of files written, no core dumps (plus the address-space limit the executor sets
  for its memory budget).
* **capabilities**: a worker started as root (a container, a systemd unit without ``User=``) gives its executors none
  of root's powers: every capability is dropped from the process and its bounding set, so the kernel treats it as
  an ordinary user's process that happens to own root's files (which Landlock keeps out of reach) — no raw I/O, no
  module loading, no bypassing file permissions, nothing to regain by ``setuid``.

What applied is returned (and logged by the worker once); what the kernel lacks is skipped and said.
Not done: a separate uid when started as root (the executor needs its cache directory inside the data dir, which is
root's and mode 0700; with no capabilities left, the remaining difference is ownership of root's files, which
Landlock already denies), and network/mount namespaces (they need privileges or unprivileged user namespaces).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import platform
import resource
import struct
import sys
from pathlib import Path

# --- Landlock (include/uapi/linux/landlock.h) -----------------------------------------------------------------------
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
_MAKE_REG, _MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1

_FILE_READ = _EXECUTE | _READ_FILE
_DIR_READ = _FILE_READ | _READ_DIR
_FILE_RW = _FILE_READ | _WRITE_FILE | _TRUNCATE
_DIR_RW = _DIR_READ | _WRITE_FILE | _TRUNCATE | _REMOVE_FILE | _MAKE_REG | _MAKE_DIR | _REMOVE_DIR

# --- capabilities (include/uapi/linux/capability.h, prctl.h) ---------------------------------------------------------
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522

# --- seccomp ----------------------------------------------------------------------------------------------------------
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_CLONE_THREAD = 0x00010000
# (audit arch, syscall numbers) by machine
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(
        socket=41, socketpair=53, execve=59, execveat=322, fork=57, vfork=58, clone=56, clone3=435, seccomp=317,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427, ptrace=101, process_vm_readv=310,
        process_vm_writev=311, perf_event_open=298, bpf=321, userfaultfd=323, keyctl=250, add_key=248,
        request_key=249, tkill=200, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, kill=62, tgkill=234,
        unshare=272, setns=308, mount=165, open_by_handle_at=304)),
    "aarch64": (0xC00000B7, dict(
        socket=198, socketpair=199, execve=221, execveat=281, fork=None, vfork=None, clone=220, clone3=435,
        seccomp=277, io_uring_setup=425, io_uring_enter=426, io_uring_register=427, ptrace=117,
        process_vm_readv=270, process_vm_writev=271, perf_event_open=241, bpf=280, userfaultfd=282, keyctl=219,
        add_key=217, request_key=218, tkill=130, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, kill=129,
        tgkill=131, unshare=97, setns=268, mount=40, open_by_handle_at=265)),
}
#: Refused outright: new sockets (io_uring can make them too), running programs and new processes, reaching into
#: other processes, and kernel interfaces a job never needs.
_DENIED = ("socket", "socketpair", "io_uring_setup", "io_uring_enter", "io_uring_register", "execve", "execveat",
           "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "perf_event_open", "bpf",
           "userfaultfd", "keyctl", "add_key", "request_key", "tkill", "pidfd_open", "pidfd_send_signal",
           "pidfd_getfd", "unshare", "setns", "mount", "open_by_handle_at")

#: Reads beneath these are allowed when they exist (system libraries, process and device information).
#: Of /proc, only this process and system-wide facts: another process's cmdline (the p2p daemon's names its control
#: socket) or environment is none of an executor's business.
_SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sys", "/etc/ld.so.cache", "/etc/ld.so.conf",
                "/etc/ld.so.conf.d", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group",
                "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/proc/stat", "/proc/sys/kernel", "/proc/sys/vm",
                "/proc/driver/nvidia")
#: Written by the process itself: CUDA's start fails without it ("cudaGetDeviceCount(): Error 304: OS call failed",
#: seen on an H200; most likely it names the threads it starts, which writes /proc/self/task/TID/comm). Only this
#: process's own threads lie beneath, and with every capability dropped nothing there reaches further.
_PROC_WRITE = ("/proc/self/task",)
#: Device files a job's process may read and write (GPU devices are added when present).
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/dev/full")


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when it has none (or it is disabled)."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, int(abi))


def readable_roots() -> list[str]:
    """What an executor reads: the interpreter's installation and virtualenv, the packages it imports (found without
    importing them: Landlock is entered before torch starts its threads)."""
    import importlib.util

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for package in ("gpunet", "torch"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            roots.add(str(Path(spec.origin).resolve().parent))
    for entry in sys.path:  # site-packages and the like; never the working directory (it may be a home directory)
        if entry and os.path.isdir(entry) and Path(entry).resolve() != Path.cwd().resolve():
            if "site-packages" in entry or "dist-packages" in entry or entry.startswith(sys.base_prefix):
                roots.add(entry)
    return sorted(roots)


def _landlock(read_roots: list[str], write_dirs: list[str], abi: int) -> list[str]:
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    handled_fs = (1 << 13) - 1
    if abi >= 2:
        handled_fs |= _REFER
    if abi >= 3:
        handled_fs |= _TRUNCATE
    if abi >= 5:
        handled_fs |= _IOCTL_DEV
    handled_net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    buf = ctypes.create_string_buffer(attr[:size], size)
    ruleset = libc.syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    granted = []
    try:
        def allow(path: str, access: int) -> None:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                return  # absent here: nothing to allow
            try:
                if not os.path.isdir(path):
                    access &= _FILE_RW | _IOCTL_DEV  # file rights only, or the kernel refuses the rule
                rule = ctypes.create_string_buffer(struct.pack("=Qi", access & handled_fs, fd), 12)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) < 0:
                    raise _fail(f"landlock_add_rule {path}")
                granted.append(path)
            finally:
                os.close(fd)

        for path in [*read_roots, *_SYSTEM_READ]:
            allow(path, _DIR_READ)
        for path in [*_DEVICES, *glob.glob("/dev/nvidia*"), *glob.glob("/dev/dri/*")]:
            allow(path, _FILE_RW | _IOCTL_DEV)
        for path in _PROC_WRITE:
            allow(path, _FILE_RW)
        for path in write_dirs:
            allow(path, _DIR_RW)
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)
    what = [f"landlock ABI {abi}: files read-only beneath {len(granted) - len(write_dirs)} system and Python paths, "
            f"read-write only in {', '.join(write_dirs) or 'nothing'}"]
    if handled_net:
        what.append("landlock: no TCP connect or bind")
    return what


def seccomp_filter_here() -> bool:
    """Whether this platform has the seccomp filter (its syscall numbers are known here)."""
    return sys.platform == "linux" and platform.machine() in _SYSCALLS


def _seccomp() -> list[str]:
    """A filter for every thread of the process (TSYNC: torch has started threads by now)."""
    machine = platform.machine()
    if machine not in _SYSCALLS:
        return [f"no seccomp filter for {machine}"]
    arch, nr = _SYSCALLS[machine]
    deny = _RET_ERRNO | errno.EACCES
    pid = os.getpid()
    prog: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, deny),  # another ABI (i386 int 0x80): nothing it could ask for is needed
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE_K, 0, 1, 0x40000000),
        (_RET_K, 0, 0, deny),  # x32 syscalls
    ]
    for name in _DENIED:
        if nr.get(name) is not None:
            prog += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, deny)]
    prog += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]  # libc falls back to clone
    # clone: threads (CLONE_THREAD set) only. Each block below ends in a return when its syscall matches, and is
    # skipped whole (the accumulator still holding the syscall number) when it does not.
    prog += [(_JEQ_K, 0, 4, nr["clone"]), (_LD_W_ABS, 0, 0, 16), (_JSET_K, 1, 0, _CLONE_THREAD),
             (_RET_K, 0, 0, deny), (_RET_K, 0, 0, _RET_ALLOW)]
    # kill and tgkill: this process only (the first argument, low 32 bits, must be our pid)
    for name in ("kill", "tgkill"):
        prog += [(_JEQ_K, 0, 4, nr[name]), (_LD_W_ABS, 0, 0, 16), (_JEQ_K, 1, 0, pid), (_RET_K, 0, 0, deny),
                 (_RET_K, 0, 0, _RET_ALLOW)]
    prog += [(_RET_K, 0, 0, _RET_ALLOW)]
    filters = b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    buf = ctypes.create_string_buffer(filters, len(filters))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Prog(len(prog), ctypes.addressof(buf))
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(nr["seccomp"], ctypes.c_uint(_SECCOMP_SET_MODE_FILTER), ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC),
                    ctypes.byref(fprog)) != 0:
        raise _fail("seccomp")
    return ["seccomp (every thread): no sockets, io_uring, execve, new processes, ptrace, bpf or signals to others"]


def _rlimits(max_file_bytes: int) -> list[str]:
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 512),
                         (resource.RLIMIT_FSIZE, max_file_bytes)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    return [f"rlimits: 512 open files, files up to {max_file_bytes >> 20} MiB, no core dumps"]


def capabilities() -> dict[str, int]:
    """This thread's capability sets from /proc (``CapEff``, ``CapPrm``, ``CapBnd``, ...) as integers."""
    sets = {}
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith("Cap"):
                    name, value = line.split(":", 1)
                    sets[name] = int(value, 16)
    except OSError:
        pass
    return sets


def _drop_capabilities() -> list[str]:
    """Every capability out of the permitted, effective, inheritable, ambient and bounding sets of this thread (and
    so of the threads it starts); a no-op for an ordinary user, whose sets are empty already."""
    if not any(capabilities().get(s) for s in ("CapPrm", "CapEff", "CapBnd", "CapAmb")):
        return []
    libc = _libc()
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):  # the bounding set first: dropping it needs CAP_SETPCAP, which capset removes
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)

    class _Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class _Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(_Header(_CAPABILITY_VERSION_3, 0)), (_Data * 2)()) != 0:
        raise _fail("capset")
    left = capabilities()
    if left.get("CapEff") or left.get("CapPrm"):
        raise OSError(errno.EPERM, "capabilities remain after capset")
    return [f"capabilities: all dropped (uid {os.getuid()} keeps none of root's powers)"]


def threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def enter_files(writable_dirs: list[str], protected: list[str] = ()) -> list[str]:
    """Phase 1, first thing in a fresh executor process, while it has one thread: Landlock binds the calling thread
    and the threads it starts later, so it must come before torch starts its thread pools."""
    if sys.platform != "linux":
        return ["no sandbox: not Linux"]
    if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return [f"no sandbox: {_fail('no_new_privs')}"]
    running = threads()
    if running > 1:
        return [f"no landlock: the process already has {running} threads (it must be entered before any start)"]
    try:  # capabilities are per thread: dropped here, while this is the only one, none of the later ones has any
        dropped = _drop_capabilities()
    except OSError as e:
        dropped = [f"WARNING: capabilities not dropped: {e}"]
    abi = landlock_abi()
    if not abi:
        return [*dropped, "no landlock in this kernel: executors can read what the worker's user can"]
    roots = readable_roots()
    try:
        applied = dropped + _landlock(roots, writable_dirs, abi)
    except OSError as e:
        return [*dropped, f"no landlock: {e}"]
    for path in protected:
        inside = [r for r in roots if _beneath(path, r)]
        if inside:
            applied.append(f"WARNING: {path} lies beneath {inside[0]}, which executors can read")
    return applied


def enter_syscalls(max_file_bytes: int) -> list[str]:
    """Phase 2, once torch is imported (its threads exist): rlimits, then a seccomp filter synchronised to every
    thread. Each part applies on its own: one the kernel refuses does not turn off the others."""
    if sys.platform != "linux":
        return []
    applied = []
    try:
        applied += _rlimits(max_file_bytes)
    except (OSError, ValueError) as e:
        applied.append(f"no rlimits: {e}")
    try:
        applied += _seccomp()
    except OSError as e:
        applied.append(f"no seccomp: {e}")
    return applied


def _beneath(path: str, root: str) -> bool:
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False
