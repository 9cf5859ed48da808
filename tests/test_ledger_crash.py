"""Kill -9 a process while it appends receipts; the ledger must verify and lose at most the entry in flight."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpunet.ledger import Ledger

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.strip())
    into.put(None)  # end of output: the process is gone


@pytest.mark.timeout(180)
def test_sigkill_while_appending_leaves_a_ledger_that_verifies(tmp_path):
    path = tmp_path / "ledger.sqlite"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    confirmed: list[str] = []
    kills = 0
    for round_ in range(3):  # the later rounds append after a crash, to a ledger that was killed mid-write
        lines: queue.Queue = queue.Queue()
        with open(tmp_path / f"child-{round_}.err", "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "_ledger_append_loop.py"), str(path), f"r{round_}"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            )  # fmt: skip
        reader = threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 90
            seen = 0
            while seen < 150 + 97 * round_:  # vary where in the loop the kill lands
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                assert line is not None, (tmp_path / f"child-{round_}.err").read_text()
                confirmed.append(line)
                seen += 1
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        finally:
            proc.kill()
            proc.wait(timeout=30)
        reader.join(timeout=30)
        while (line := lines.get_nowait()) is not None:  # appends confirmed just before the kill
            confirmed.append(line)
        proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        with Ledger(path) as ledger:
            head = ledger.verify()
            stored = [r.job_id for r in ledger.receipts()]
        assert set(confirmed) <= set(stored), "a confirmed append was lost"
        assert head.count == len(stored) <= len(confirmed) + kills  # at most the one in flight per kill
