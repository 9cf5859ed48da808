"""A running node's ready file, ``<data dir>/ready.json``: what deployment tools read instead of scraping its output.

``gpunet worker`` and ``gpunet bootstrap`` write it once they have joined the network and rewrite it at each change of
state (``joining`` → ``online`` → ``draining`` → ``offline``); a clean exit removes it. It holds at least ``pid``,
``id`` (the peer id), ``addresses`` (the multiaddrs others dial, each ending in ``/p2p/<id>``), ``network`` and
``state``. It is replaced atomically (temp file + ``os.replace``), so a reader sees the old or the new file, never half
of one. A node that was killed leaves its file behind: trust one only if its ``pid`` is the process you started (a node
also removes a leftover file when it starts).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

READY_FILENAME = "ready.json"


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
