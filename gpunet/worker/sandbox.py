"""The executor's sandbox: what a job's process may touch, enforced by the kernel, without privileges.

Jobs are data (a graph of allowlisted ops), so they cannot ask for a file or a socket; but the kernels those ops
reach are native code and not all memory-safe (see :mod:`gpunet.job.guards`), so a memory-corruption bug could turn
a crafted job into code running as the volunteer. Defence in depth: once an executor process has imported what it
needs, it locks itself down before it takes a job.

* **Landlock** (Linux >= 5.13; no privileges): files are read-only and only beneath what the executor needs — the
  Python installation and virtualenv, the gpunet and torch packages, ``/usr``, ``/lib``, ``/proc``, ``/sys``, a few
  device files — plus read-write access to the program cache directory alone. The data dir (the identity key!) and
  the home directory are out of reach. Where the kernel supports it (ABI 4), TCP connect and bind are denied too, and
  Landlock also stops the process from ptrace-ing (or reading the memory of) its parent.
* **seccomp** (no privileges once ``no_new_privs`` is set): no new sockets of any kind, no ``execve``, no new
  processes (threads only).
* **rlimits**: open files, the size of files written, no core dumps (plus the address-space limit the executor sets
  for its memory budget).

What applied is returned (and logged by the worker once); what the kernel lacks is skipped and said.
Not done: a separate uid when started as root (Landlock binds root too, but a distinct uid would add ownership
checks), and network/mount namespaces (they need privileges or unprivileged user namespaces).
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
_DIR_RW = _DIR_READ | _WRITE_FILE | _TRUNCATE | _REMOVE_FILE | _MAKE_REG

# --- seccomp ----------------------------------------------------------------------------------------------------------
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_CLONE_THREAD = 0x00010000
# (audit arch, syscall numbers) by machine: socket, execve, execveat, fork, vfork, clone, clone3
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(socket=41, execve=59, execveat=322, fork=57, vfork=58, clone=56, clone3=435)),
    "aarch64": (0xC00000B7, dict(socket=198, execve=221, execveat=281, fork=None, vfork=None, clone=220, clone3=435)),
}

#: Reads beneath these are allowed when they exist (system libraries, process and device information).
_SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/proc", "/sys", "/etc/ld.so.cache", "/etc/ld.so.conf",
                "/etc/ld.so.conf.d", "/etc/localtime", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group")
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
    """What an executor reads: the interpreter's installation and virtualenv, the packages it imports lazily."""
    import torch

    import gpunet

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             str(Path(gpunet.__file__).resolve().parent), str(Path(torch.__file__).resolve().parent)}
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


def _seccomp() -> list[str]:
    machine = platform.machine()
    if machine not in _SYSCALLS:
        return []
    arch, nr = _SYSCALLS[machine]
    deny = _RET_ERRNO | errno.EACCES
    prog: list[tuple[int, int, int, int]] = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 1, 0, arch),
        (_RET_K, 0, 0, deny),  # another ABI (i386 int 0x80): nothing it could ask for is needed
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JGE_K, 0, 1, 0x40000000),
        (_RET_K, 0, 0, deny),  # x32 syscalls
    ]
    for name in ("socket", "execve", "execveat", "fork", "vfork"):
        if nr[name] is not None:
            prog += [(_JEQ_K, 0, 1, nr[name]), (_RET_K, 0, 0, deny)]
    prog += [(_JEQ_K, 0, 1, nr["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]  # libc falls back to clone
    # clone: threads (CLONE_THREAD set) only
    prog += [(_JEQ_K, 0, 3, nr["clone"]), (_LD_W_ABS, 0, 0, 16), (_JSET_K, 1, 0, _CLONE_THREAD),
             (_RET_K, 0, 0, deny), (_RET_K, 0, 0, _RET_ALLOW)]
    filters = b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    buf = ctypes.create_string_buffer(filters, len(filters))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Prog(len(prog), ctypes.addressof(buf))
    if _libc().prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise _fail("seccomp")
    return ["seccomp: no new sockets, no execve, no new processes"]


def _rlimits(max_file_bytes: int) -> list[str]:
    for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 512),
                         (resource.RLIMIT_FSIZE, max_file_bytes)):
        soft, hard = resource.getrlimit(limit)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    return [f"rlimits: 512 open files, files up to {max_file_bytes >> 20} MiB, no core dumps"]


def enter(writable_dirs: list[str], max_file_bytes: int, protected: list[str] = ()) -> list[str]:
    """Lock this process down (irreversibly); returns what applied, one line each. ``protected``: paths that must end
    up out of reach (the data dir): a warning line is returned if one lies beneath something readable."""
    if sys.platform != "linux":
        return ["no sandbox: not Linux"]
    applied = []
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return [f"no sandbox: {_fail('no_new_privs')}"]
    applied += _rlimits(max_file_bytes)
    abi = landlock_abi()
    if abi:
        roots = readable_roots()
        applied += _landlock(roots, writable_dirs, abi)
        for path in protected:
            inside = [r for r in roots if _beneath(path, r)]
            if inside:
                applied.append(f"WARNING: {path} lies beneath {inside[0]}, which executors can read")
    else:
        applied.append("no landlock in this kernel: executors can read what the worker's user can")
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
