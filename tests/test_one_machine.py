"""The README's one-machine flow with default data dirs, as a newcomer types it: ``gpunet bootstrap``, then ``gpunet
worker --initial-peers <the address it printed>``, ``gpunet status`` and a client script, all in one home directory.
One node per data dir: a second node on a dir in use stops at once, naming the first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpunet.readyfile import read_ready
from gpunet.testing.localnet import LOOPBACK, Proc, gpunet_cmd
from tests.swarm import run_cli

pytestmark = pytest.mark.swarm


def _home_env(home: Path) -> dict[str, str]:
    """A user's environment with ``home`` as their home and no gpunet settings: every node on its default data dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUNET_")}
    return {**env, "HOME": str(home), "PYTHONUNBUFFERED": "1"}


class _Nodes:
    """Processes started as a user would in one home; each stopped by its process group at the end."""

    def __init__(self, home: Path):
        self.home, self.procs = home, []

    def start(self, role: str, data_dir: Path, *args: str) -> Proc:
        popen = subprocess.Popen(gpunet_cmd(role, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, text=True, env=_home_env(self.home), start_new_session=True)
        proc = Proc(f"{role}-{len(self.procs) + 1}", role, popen, data_dir)
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(gpunet_cmd(*args), capture_output=True, text=True, timeout=timeout,
                              env=_home_env(self.home), stdin=subprocess.DEVNULL)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.request_stop()
        for proc in reversed(self.procs):
            proc.cleanup()

    def readme_flow(self) -> tuple[Proc, str, Proc]:
        """`gpunet bootstrap`, then `gpunet worker --initial-peers <its address>`, both on their default data dirs
        (loopback only): the bootstrap, its address and the worker, online."""
        boot = self.start("bootstrap", self.home / ".gpunet" / "bootstrap", "--host-maddrs", LOOPBACK)
        address = boot.wait_ready("online")["addresses"][0]
        worker = self.start("worker", self.home / ".gpunet", "--initial-peers", address, "--host-maddrs", LOOPBACK,
                            "--device", "cpu")
        worker.wait_ready("online", timeout=120)
        return boot, address, worker


@pytest.fixture
def nodes(tmp_path):
    n = _Nodes(tmp_path)
    yield n
    n.close()


def test_the_readme_flow_works_on_one_machine_with_default_data_dirs(nodes, tmp_path):
    boot, address, worker = nodes.readme_flow()
    assert worker.id != boot.id  # two identities: the bootstrap's default data dir is not the worker's
    assert boot.read_ready() is not None  # the worker's start left the bootstrap's ready file alone

    status = nodes.run("status", "--initial-peers", address, "--json")
    assert status.returncode == 0, status.stderr
    assert worker.id in status.stdout

    script = textwrap.dedent(f"""
        import torch, gpunet
        job = gpunet.Job.from_module(torch.nn.Linear(4, 2), example_inputs=(torch.randn(3, 4),))
        with gpunet.Client(initial_peers=[{address!r}]) as client:
            x = torch.randn(3, 4)
            assert torch.allclose(client.submit(job, x).result(timeout=120), job.run_locally(x))
        print("ok")
    """)
    client = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                            env=_home_env(tmp_path), stdin=subprocess.DEVNULL)
    assert client.returncode == 0 and "ok" in client.stdout, client.stderr[-3000:]


def test_a_second_node_on_a_data_dir_in_use_stops_at_once_naming_the_first(nodes, tmp_path):
    boot, address, worker = nodes.readme_flow()

    for args, holder in ((["worker", "--initial-peers", address, "--host-maddrs", LOOPBACK], worker),
                         (["bootstrap", "--host-maddrs", LOOPBACK], boot),
                         (["worker", "--initial-peers", address, "--data-dir", str(tmp_path / ".gpunet" / "bootstrap")],
                          boot)):
        second = nodes.run(*args, timeout=60)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: data dir"), second.stderr
        assert f"in use by a gpunet {holder.role} (pid {holder.pid})" in lines[0] and "--data-dir" in lines[0]
    # the running nodes are untouched: same ready files, same identities
    assert read_ready(tmp_path / ".gpunet")["pid"] == worker.pid
    assert read_ready(tmp_path / ".gpunet" / "bootstrap")["pid"] == boot.pid

    # a node that is gone, however it went, leaves its dir free at once: one whose main process alone was killed
    # too, while its DHT process (which shares the lock's open file) is still there
    os.kill(worker.pid, signal.SIGKILL)
    worker.popen.wait(timeout=30)
    again = nodes.start("worker", tmp_path / ".gpunet", "--initial-peers", address, "--host-maddrs", LOOPBACK,
                        "--device", "cpu")
    assert again.wait_ready("online", timeout=120)["id"] == worker.ready["id"]


def test_two_workers_given_one_data_dir_by_the_environment_are_refused(tmp_path):
    data_dir = tmp_path / "shared"
    data_dir.mkdir()
    (data_dir / "node.lock").write_text("not json")  # a lock file left behind says nothing by itself
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, gpunet.readyfile as r; h = r.hold(sys.argv[1], 'worker'); "
                               "print('held', flush=True); sys.stdin.read()", str(data_dir)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_cli("worker", "--host-maddrs", LOOPBACK, env={"GPUNET_DATA_DIR": str(data_dir)}, timeout=60)
        assert result.returncode == 2 and f"(pid {holder.pid})" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert not (data_dir / "identity.key").exists()  # refused before it made an identity
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_bootstrap_upgraded_from_the_shared_data_dir_keeps_its_peer_id(nodes, tmp_path):
    """Earlier versions kept a bootstrap's key in ~/.gpunet itself; its address (with the peer id) is what every
    worker was given, so the key moves into ~/.gpunet/bootstrap rather than a new one being made."""
    from gpunet.identity import Identity

    old = Identity.load_or_create(tmp_path / ".gpunet").peer_id
    boot = nodes.start("bootstrap", tmp_path / ".gpunet" / "bootstrap", "--host-maddrs", LOOPBACK)
    assert boot.wait_ready("online")["id"] == old
    assert not (tmp_path / ".gpunet" / "identity.key").exists()  # a worker here gets a key of its own
