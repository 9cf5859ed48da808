"""A running node's hold on its data dir (``<data dir>/node.lock``) and its ready file (``<data dir>/ready.json``).

One node per data dir: the dir holds the node's identity, so two nodes started on one dir would run as one peer id
and take each other's countersignatures (and the second's start would delete the first's ready file). A node holds an
exclusive ``flock`` on ``node.lock`` for its lifetime (:func:`hold`); a second node on the same dir stops at once with
the first's pid. The kernel drops the lock when the node's process ends, however it ends, so a crash leaves no stale
lock to clean up.

The ready file is what deployment tools read instead of scraping a node's output.

``gpunet worker`` and ``gpunet bootstrap`` write it once they have joined the network and rewrite it at each change of
state (``joining`` → ``online`` → ``draining`` → ``offline``); a clean exit removes it. It holds at least ``pid``,
``id`` (the peer id), ``addresses`` (the multiaddrs others dial, each ending in ``/p2p/<id>``), ``network`` and
``state``. It is replaced atomically (temp file + ``os.replace``), so a reader sees the old or the new file, never half
of one. A node that was killed leaves its file behind: trust one only if its ``pid`` is the process you started (a node
also removes a leftover file when it starts).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from gpunet.errors import ConfigError, DataDirInUse

READY_FILENAME = "ready.json"
LOCK_FILENAME = "node.lock"


class DataDirLock:
    """This process's hold on a node's data dir; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, data_dir: Path, file):
        self.data_dir, self._file = data_dir, file
        _HELD.add(self)

    def release(self) -> None:
        _HELD.discard(self)
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None


#: Holds taken by this process. A flock belongs to the open file, which a forked child (hivemind's DHT process)
#: shares: the child lets go of its copy at once, so a node whose main process died frees its dir at that moment, not
#: when its orphaned children notice and exit.
_HELD: set[DataDirLock] = set()


def _not_in_children() -> None:
    for lock in list(_HELD):
        if lock._file is not None:
            lock._file.close()  # the child's reference only: the parent still holds the lock
        lock._file = None
    _HELD.clear()


os.register_at_fork(after_in_child=_not_in_children)


def hold(data_dir: str | os.PathLike, role: str) -> DataDirLock:
    """Take ``data_dir`` for this node (``role``: worker, bootstrap) until it exits; DataDirInUse if another node runs
    there. Take it before anything else touches the dir (the identity, a leftover ready file)."""
    data_dir = Path(data_dir)
    path = data_dir / LOCK_FILENAME
    try:
        file = open(path, "a+")
    except OSError as e:
        raise ConfigError(f"cannot open {path}: {e.strerror}") from None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # a file system without locks (some NFS mounts)
            file.close()
            raise ConfigError(f"cannot lock {path} ({e.strerror}): put the data dir on a local disk") from None
        file.seek(0)
        try:
            other = json.loads(file.read())
        except ValueError:
            other = {}
        file.close()
        other = other if isinstance(other, dict) else {}
        who = f"a gpunet {other.get('role')}" if isinstance(other.get("role"), str) else "another gpunet node"
        pid = f" (pid {other['pid']})" if isinstance(other.get("pid"), int) else ""
        raise DataDirInUse(f"data dir {data_dir} is in use by {who}{pid}: one node per data dir (it holds the node's "
                           "identity); give this one its own with --data-dir DIR (or GPUNET_DATA_DIR)") from None
    file.seek(0)
    file.truncate()
    file.write(json.dumps({"pid": os.getpid(), "role": role}))
    file.flush()
    return DataDirLock(data_dir, file)


def ready_path(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / READY_FILENAME


def write_ready(data_dir: str | os.PathLike, **fields: Any) -> Path:
    """Replace the ready file with ``fields`` (plus this process's ``pid`` and the time), atomically."""
    path = ready_path(data_dir)
    doc = {"pid": os.getpid(), **fields, "updated_at": time.time()}
    fd, tmp = tempfile.mkstemp(prefix=f".{READY_FILENAME}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_ready(data_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ready file's contents, or None if there is none (or it is not one: a reader never trusts a foreign file)."""
    try:
        doc = json.loads(ready_path(data_dir).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def remove_ready(data_dir: str | os.PathLike) -> None:
    """Remove the ready file: on a clean exit, and at start (one left by an earlier run that died says nothing now)."""
    try:
        ready_path(data_dir).unlink()
    except FileNotFoundError:
        pass
