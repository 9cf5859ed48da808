"""Where a session step's time goes on a worker, stage by stage: a benchmark's instrument (``scripts/bench_pipeline.py
--trace`` reads it; docs/architecture.md says what it found).

With ``GPUNET_STEP_TRACE`` naming a directory, a worker writes one JSON line per session step it answered to
``<dir>/<its peer id>.jsonl``: CLOCK_MONOTONIC timestamps in ns (one clock for every process on a machine, so a
client's, the workers' and their executors' marks line up) when the step arrived, when its input was here (a pushed
one waits for the previous span), when it went to the executor, the executor's own marks (received it, began and
ended the run, replied) and when it came back and was answered. Unset (the default), a step pays one test of a
module constant.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

#: The directory the traces go to (None: no trace is kept).
DIRECTORY = os.environ.get("GPUNET_STEP_TRACE") or None
#: The executor's marks, in the order its reply lists them (gpunet.worker.executor.child).
EXECUTOR_MARKS = ("received", "began", "ended", "replied")


def begin() -> dict[str, int] | None:
    """A step's marks, its arrival first; None while tracing is off."""
    return {"arrived": time.monotonic_ns()} if DIRECTORY else None


def mark(marks: dict[str, int] | None, name: str) -> None:
    if marks is not None:
        marks[name] = time.monotonic_ns()


def write(peer_id: str, session_id: str, step: int, marks: dict[str, int]) -> None:
    """Append one step's marks to this worker's trace (a line is written whole: readers never see half of one)."""
    path = Path(DIRECTORY) / f"{peer_id}.jsonl"
    line = json.dumps({"session": session_id, "step": step, **marks}) + "\n"
    with open(path, "a") as f:
        f.write(line)
