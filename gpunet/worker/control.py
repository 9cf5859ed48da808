"""The owner's hand on a running worker: ``gpunet worker pause|resume`` and the dashboard's buttons.

A pause is a file in the worker's data dir (``paused.json``: the reason and when), so it holds across restarts until
the owner resumes; the command also sends the running worker SIGUSR1, which makes it read the file at once rather
than at its next look (every second or so). Only someone who may write the data dir (or signal the process) can
pause a worker: the same person who runs it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from gpunet import readyfile

PAUSE_FILE = "paused.json"


def read_pause(data_dir: Path) -> str | None:
    """The owner's pause reason ("" for none given), or None when not paused by hand."""
    try:
        state = json.loads((data_dir / PAUSE_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""  # a file there, unreadable: the owner meant to pause
    return str(state.get("reason", ""))[:200] if isinstance(state, dict) else ""


def set_pause(data_dir: Path, reason: str | None) -> int | None:
    """Pause (``reason``: a string, maybe empty) or resume (None) the worker of ``data_dir``; returns the pid of the
    running worker told at once, or None when none runs there (it starts paused, or not, next time)."""
    path = data_dir / PAUSE_FILE
    if reason is None:
        path.unlink(missing_ok=True)
    else:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"reason": reason, "since": time.time()}))
        tmp.replace(path)
    ready = readyfile.read_ready(data_dir)
    if ready is None or ready.get("role") != "worker" or not _is_gpunet_worker(ready["pid"]):
        return None  # no worker runs there (a ready file left by one that died names a pid someone else may have)
    try:
        os.kill(ready["pid"], signal.SIGUSR1)
    except (ProcessLookupError, PermissionError):
        return None
    return ready["pid"]


def _is_gpunet_worker(pid: int) -> bool:
    """Whether ``pid`` runs ``gpunet worker`` (SIGUSR1 would end any other process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"gpunet" in a for a in argv) and b"worker" in argv
