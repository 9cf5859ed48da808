"""Stopping nodes the way people stop them: Ctrl-C in a terminal and `timeout`/`systemctl stop` signal the whole
process group (the p2p daemon dies at the same moment); `kill PID` signals the main process alone. Either way the
node leaves within seconds and nothing of it keeps running."""

import os
import signal
import subprocess
import sys

import pytest

from tests.swarm import wait_for

pytestmark = pytest.mark.swarm


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return False
    except ProcessLookupError:
        return True


def test_bootstrap_leaves_cleanly_on_ctrl_c_to_its_process_group(swarm):
    proc = swarm.bootstrap
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert proc.popen.wait(timeout=20) == 0, proc.output
    wait_for(lambda: _group_gone(proc.pid), 15, "the bootstrap's DHT process and p2p daemon to exit")
    assert "Traceback" not in proc.output
    assert proc.read_ready() is None  # it said it left


def test_killing_status_watch_leaves_no_dht_or_daemon_behind(swarm):
    watch = subprocess.Popen(
        [sys.executable, "-m", "gpunet", "status", "--network", swarm.network, "--initial-peers", swarm.bootstrap_addr,
         "--watch", "--json", "--interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        assert watch.stdout.readline().startswith("{")  # it has joined (DHT process and p2p daemon up) and read once
        watch.send_signal(signal.SIGTERM)  # `kill PID`: the main process alone
        watch.wait(timeout=15)
        wait_for(lambda: _group_gone(watch.pid), 20, "status's DHT process and p2p daemon to exit after it")
    finally:
        try:
            os.killpg(watch.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        watch.wait(timeout=10)
