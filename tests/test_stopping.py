"""Stopping nodes the way people stop them: Ctrl-C in a terminal and `timeout`/`systemctl stop` signal the whole
process group (the p2p daemon dies at the same moment); `kill PID` signals the main process alone. Either way the
node leaves within seconds and nothing of it keeps running."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from gpunet.testing.workloads import Spin

from tests.swarm import group_gone, wait_for

pytestmark = pytest.mark.swarm


def test_bootstrap_leaves_cleanly_on_ctrl_c_to_its_process_group(swarm):
    proc = swarm.bootstrap
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert proc.popen.wait(timeout=20) == 0, proc.output
    wait_for(lambda: group_gone(proc.pid), 15, "the bootstrap's DHT process and p2p daemon to exit")
    assert "Traceback" not in proc.output
    assert "the hard way" not in proc.output  # its daemon gone too, it did not wait out a polite DHT shutdown
    assert "[ERROR]" not in proc.output  # the daemon's own "use of closed network connection" as it stops
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
        wait_for(lambda: group_gone(watch.pid), 20, "status's DHT process and p2p daemon to exit after it")
    finally:
        try:
            os.killpg(watch.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        watch.wait(timeout=10)


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        names[int(entry)] = name
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, names[child]))
            todo.append(child)
    return found


def _assert_left_cleanly(worker, timeout: float = 20) -> None:
    try:
        code = worker.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {timeout} s:\n{worker.output}")
    assert code == 0, worker.output
    wait_for(lambda: group_gone(worker.pid), 20, "the worker's executors, DHT process and p2p daemon to exit")
    assert "Traceback" not in worker.output, worker.output


@pytest.mark.parametrize("attempt", range(2))
def test_worker_leaves_within_seconds_on_ctrl_c_to_its_process_group(swarm, attempt):
    worker = swarm.start_worker()
    os.killpg(worker.pid, signal.SIGINT)  # the p2p daemon and executors get it at the same moment
    _assert_left_cleanly(worker)
    assert "KeyboardInterrupt" not in worker.output, worker.output


def test_worker_leaves_on_sigterm_to_its_process_group(swarm):
    worker = swarm.start_worker()
    os.killpg(worker.pid, signal.SIGTERM)  # `systemctl stop` with the default KillMode=control-group
    _assert_left_cleanly(worker)


def test_worker_leaves_on_sigterm_to_itself_alone(swarm):
    worker = swarm.start_worker()
    worker.popen.send_signal(signal.SIGTERM)
    _assert_left_cleanly(worker)
    assert worker.read_ready() is None


def test_worker_whose_p2p_daemon_died_first_still_leaves(swarm):
    worker = swarm.start_worker()
    daemons = [pid for pid, name in _descendants(worker.pid) if name == "p2pd"]
    assert daemons, _descendants(worker.pid)
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)
    worker.popen.send_signal(signal.SIGINT)
    _assert_left_cleanly(worker)


@pytest.mark.parametrize("moment", ["Speed: ", "Joined gpunet network"])
@pytest.mark.parametrize("to_group", [False, True], ids=["sigterm", "ctrl-c-to-group"])
def test_worker_stopped_while_it_starts_leaves_within_seconds(swarm, moment, to_group):
    """SIGTERM while the worker is still starting (a restart loop, `systemctl stop` right after start), or Ctrl-C to
    its process group as it joins (its p2p daemon and torch's shared-memory manager stop under the join): it stops
    there, never coming online, with status 0, instead of waiting for a part that had not started yet or reporting
    the join's failure as an error."""
    worker = swarm.start_worker(wait_online=False)
    wait_for(lambda: moment in worker.output, 90, f"the worker to reach {moment!r}")
    if to_group:
        os.killpg(worker.pid, signal.SIGINT)
    else:
        worker.popen.send_signal(signal.SIGTERM)
    _assert_left_cleanly(worker, timeout=30)
    assert "Online" not in worker.output and "error" not in worker.output, worker.output


def _signals_seen_by_parent_when_its_forked_child_gets_one(queue) -> None:
    import asyncio
    import multiprocessing
    import time

    import gpunet.dht.network  # noqa: F401  (what a node imports before its DHT process is forked)

    async def main() -> int:
        seen = []
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, seen.append, 1)
        fork = multiprocessing.get_context("fork")  # as hivemind's DHT process is started
        running = fork.Event()
        child = fork.Process(target=lambda: running.set() or time.sleep(30))
        child.start()
        try:
            assert running.wait(30)
            os.kill(child.pid, signal.SIGINT)  # the child's share of a Ctrl-C to the group
            await asyncio.sleep(0.5)
        finally:
            child.kill()
            child.join()
        return len(seen)

    queue.put(asyncio.run(main()))


def test_a_signal_to_the_dht_process_is_not_also_the_nodes():
    """A forked child keeps its parent's signal wakeup socket: a Ctrl-C reaching hivemind's DHT process as it starts
    woke the node's event loop a second time, which took it for a second Ctrl-C ("leaving without waiting for running
    jobs", status 1)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: this one's handlers are pytest's
    queue = ctx.Queue()
    proc = ctx.Process(target=_signals_seen_by_parent_when_its_forked_child_gets_one, args=(queue,))
    proc.start()
    try:
        assert queue.get(timeout=120) == 0
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_a_drain_that_runs_out_of_time_stops_its_job_which_runs_elsewhere(swarm, client_for):
    """``--drain-timeout`` over: the job still running is stopped as a pause stops one (not billed, noted as
    "drained"), its client hears the worker left and runs it elsewhere. It used to be killed with the executors, read
    as the job's own crash (held against its client), and noted after the ledger had closed (lost)."""
    import gpunet
    from gpunet.ledger import open_ledger

    # The leaving worker is the cheaper one, so the job goes there first; the other is where it ends up.
    leaving = swarm.start_worker("--drain-timeout", "1", "--threads", "1", "--price", "1", "-v")
    other = swarm.start_worker("--price", "2")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "the client to see both workers")
    job = gpunet.Job.from_module(Spin(k=300), (torch.randn(1024, 1024),))  # seconds on one thread
    x = torch.randn(1024, 1024)
    future = client.submit(job, x, requirements=gpunet.Requirements(prefer="cheapest", timeout=300))
    leaving.wait_for_line(r"Running job", timeout=60)
    leaving.popen.send_signal(signal.SIGTERM)  # to the worker alone: its daemon lives on, so it drains
    _assert_left_cleanly(leaving, timeout=30)
    assert "stopping them (not billed" in leaving.output, leaving.output
    assert "killed its executor" not in leaving.output and "Could not note" not in leaving.output, leaving.output
    with torch.no_grad():
        assert torch.allclose(future.result(timeout=240), job.run_locally(x))
    assert future.worker_id == swarm.worker_id(other)
    with open_ledger(leaving.data_dir) as ledger:
        assert [note.reason for note in ledger.unbilled()] == ["drained"]


_SESSION_SCRIPT = """
import logging, sys, torch, gpunet
logging.basicConfig(level=logging.INFO)
from torch.export import Dim
from gpunet.models import TinyConfig, tiny_gpt
cfg = TinyConfig(n_layers=4, d_model=1024, max_len=2048)  # a step of 64 tokens: about a second here
with gpunet.Client(initial_peers=[sys.argv[1]], network=sys.argv[2], data_dir=sys.argv[3]) as client:
    remote = client.sequential(tiny_gpt(cfg, seed=0), example_inputs=(torch.randint(0, cfg.vocab, (1, 4)),),
                               dynamic_shapes=({1: Dim("T", min=1, max=cfg.max_len)},), spans=1)
    with remote.session() as s:
        for i in range(cfg.max_len // 64):
            s.step(torch.randint(0, cfg.vocab, (1, 64)))
            if i == 1:
                print("stepping", flush=True)
"""


def test_ctrl_c_to_a_client_during_a_session_step_blames_no_worker(swarm, tmp_path):
    """The script's own p2p daemon dies with the Ctrl-C, under the step still running: that is no lost worker (it
    logged "Span ... lost its worker ... moving it and replaying" and counted a failure against the worker)."""
    from gpunet.client.reputation import Reputation

    worker = swarm.start_worker()
    client_dir = tmp_path / "client"
    script = subprocess.Popen([sys.executable, "-c", _SESSION_SCRIPT, swarm.bootstrap_addr, swarm.network,
                               str(client_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert script.stdout.readline().strip() == "stepping", script.stderr.read()[-3000:]
        os.killpg(script.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the script and its p2p daemon
        _, err = script.communicate(timeout=60)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(timeout=30)
    wait_for(lambda: group_gone(script.pid), 15, "the script's DHT process and daemon to exit")
    assert "KeyboardInterrupt" in err, err[-3000:]
    assert "lost its worker" not in err and "replaying" not in err, err[-3000:]
    # Its close raced the step still running: the tab it closed with is the one it says it received (it refused the
    # worker's honest receipt as "for steps 0-1, the steps were 0-2" and held it against the worker as invalid)
    assert "refuses" not in err, err[-3000:]
    trust = Reputation.load(client_dir).workers.get(worker.id)
    assert trust is None or (trust.failures == 0 and trust.invalid == 0), trust
