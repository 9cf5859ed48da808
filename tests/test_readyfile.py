"""The ready file a node writes (gpunet.readyfile) and how the local network harness trusts it: only when the process
it started wrote it."""

import json
import os
import subprocess
import sys

import pytest

from gpunet.readyfile import READY_FILENAME, read_ready, remove_ready, write_ready
from tests.swarm import Proc


def test_write_replaces_the_file_whole_and_leaves_no_temp_file(tmp_path):
    write_ready(tmp_path, id="a", state="joining")
    write_ready(tmp_path, id="a", state="online")
    info = read_ready(tmp_path)
    assert (info["pid"], info["id"], info["state"]) == (os.getpid(), "a", "online")
    assert [p.name for p in tmp_path.iterdir()] == [READY_FILENAME]
    remove_ready(tmp_path)
    remove_ready(tmp_path)  # already gone: not an error
    assert read_ready(tmp_path) is None


def test_a_file_that_is_not_a_ready_file_reads_as_none(tmp_path):
    (tmp_path / READY_FILENAME).write_text("{half a file")
    assert read_ready(tmp_path) is None
    (tmp_path / READY_FILENAME).write_text('{"state": "online"}')  # no pid: cannot be checked, so not trusted
    assert read_ready(tmp_path) is None


@pytest.fixture
def waiting_proc(tmp_path):
    """A real process that waits for its stdin to close, watched as the harness watches a node."""
    popen = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc = Proc("sleeper-1", "worker", popen, tmp_path)
    try:
        yield proc
    finally:
        proc.cleanup()


def test_the_harness_never_trusts_a_ready_file_from_another_process(waiting_proc, tmp_path):
    stale = {"pid": waiting_proc.pid + 100_000, "id": "old", "addresses": [], "network": "n", "state": "online"}
    (tmp_path / READY_FILENAME).write_text(json.dumps(stale))
    assert waiting_proc.read_ready() is None
    with pytest.raises(TimeoutError, match="sleeper-1 to be online"):
        waiting_proc.wait_ready("online", timeout=0.3)

    (tmp_path / READY_FILENAME).write_text(json.dumps({**stale, "pid": waiting_proc.pid, "id": "new"}))
    assert waiting_proc.wait_ready("online", timeout=5)["id"] == "new"
    assert waiting_proc.id == "new"


def test_waiting_on_a_process_that_exited_fails_at_once(waiting_proc):
    waiting_proc.popen.stdin.close()
    with pytest.raises(RuntimeError, match="exited with code 0"):
        waiting_proc.wait_ready("online", timeout=30)


@pytest.mark.swarm
def test_nodes_keep_a_ready_file_and_a_stale_one_is_never_read(swarm, tmp_path):
    boot = swarm.bootstrap.read_ready()
    assert (boot["role"], boot["state"], boot["network"]) == ("bootstrap", "online", swarm.network)
    assert boot["addresses"][0] == swarm.bootstrap_addr and swarm.bootstrap_addr.endswith(f"/p2p/{boot['id']}")

    data_dir = tmp_path / "volunteer"
    first = swarm.start_worker(data_dir=data_dir)
    info = first.read_ready()
    assert (info["pid"], info["role"], info["state"], info["network"]) == (first.pid, "worker", "online", swarm.network)
    assert info["addresses"] and all(a.endswith(f"/p2p/{info['id']}") for a in info["addresses"])

    # A crash leaves the file behind, saying "online" for a process that is gone...
    first.kill()
    assert read_ready(data_dir)["pid"] == first.pid
    # ...and the next run in the same data dir is waited on through its own file, never that one.
    second = swarm.start_worker(data_dir=data_dir)
    assert second.read_ready()["pid"] == second.pid and second.id == first.id

    # A clean exit removes it.
    assert second.terminate() == 0
    assert read_ready(data_dir) is None
