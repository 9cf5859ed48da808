"""What a newcomer hits first, through the real CLI and the public API: each mistake gets one clear line and the
documented exit code (2: unusable input), never a traceback, and nothing is created or started by a mistake."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import gpunet
from tests.swarm import run_cli, wait_for


def _no_traceback(result) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr


@pytest.fixture
def immutable_dir(tmp_path):
    """A data dir nobody may write into, not even root (chattr +i)."""
    d = tmp_path / "locked"
    d.mkdir()
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    yield d
    subprocess.run(["chattr", "-i", str(d)], check=True)


@pytest.mark.parametrize("command", [["worker"], ["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]])
def test_an_unwritable_data_dir_is_said_at_once(immutable_dir, command):
    result = run_cli(*command, "--data-dir", str(immutable_dir), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "is not writable" in result.stderr and "--data-dir" in result.stderr
    _no_traceback(result)


def test_an_unwritable_client_dir_and_doctor_say_so(immutable_dir):
    with pytest.raises(gpunet.ConfigError, match="is not writable"):
        gpunet.Client(initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPsS6WVgn6NikYPt6GFjsnxXuFDX5YHMHeymcq9WqUm4L"],
                      data_dir=immutable_dir)
    result = run_cli("doctor", "--data-dir", str(immutable_dir), "--json", timeout=120)
    disk = next(c for c in json.loads(result.stdout) if c["name"] == "disk")
    assert disk["outcome"] == "fail" and "not writable" in disk["detail"]


@pytest.mark.parametrize("price", ["inf", "nan", "1e30", "-5"])
def test_a_price_that_cannot_be_paid_is_refused(tmp_path, price):
    result = run_cli("worker", "--price", price, "--data-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "price" in result.stderr.lower()
    _no_traceback(result)


def test_garbage_initial_peers_are_refused_before_the_speed_test(tmp_path):
    t0 = time.monotonic()
    result = run_cli("worker", "--initial-peers", "not-an-address", "--data-dir", str(tmp_path), timeout=60)
    assert result.returncode == 2 and "is not a multiaddr" in result.stderr, result.stderr
    assert "Measuring" not in result.stderr and not (tmp_path / "throughput.json").exists()
    assert time.monotonic() - t0 < 30
    _no_traceback(result)


def test_reading_a_ledger_that_is_not_there_creates_nothing(tmp_path):
    typo = tmp_path / "no-such-dir"
    for command in (["balance"], ["show"], ["verify"], ["unpaid"], ["export"]):
        result = run_cli("ledger", *command, "--data-dir", str(typo), timeout=60)
        assert result.returncode == 2 and "no ledger at" in result.stderr, (command, result.stderr)
        _no_traceback(result)
    assert not typo.exists()


def test_version_and_short_help():
    assert run_cli("--version").stdout.strip() == gpunet.__version__
    result = run_cli("ledger", "merge", "-h")
    assert result.returncode == 0 and "FILE" in result.stdout and "<bool>" not in result.stdout
    assert "{FILE}" not in result.stdout  # the usage line as people write it, not Typer's braces


@pytest.mark.swarm
def test_a_second_node_on_a_port_in_use_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    maddr = f"/ip4/127.0.0.1/tcp/{port}"
    first = subprocess.Popen([sys.executable, "-m", "gpunet", "bootstrap", "--host-maddrs", maddr, "--data-dir",
                              str(tmp_path / "a")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    try:
        wait_for(lambda: (tmp_path / "a" / "ready.json").exists(), 60, "the first bootstrap to be up")
        second = run_cli("bootstrap", "--host-maddrs", maddr, "--data-dir", str(tmp_path / "b"), timeout=60)
        assert second.returncode == 2 and "cannot listen on" in second.stderr, second.stderr
        _no_traceback(second)
    finally:
        os.killpg(first.pid, 2)
        first.wait(timeout=30)


class _Noisy(__import__("torch").nn.Module):
    def forward(self, x):
        return x + __import__("torch").randn_like(x)


class _Branchy(__import__("torch").nn.Module):
    def forward(self, x):
        import torch

        return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))


def test_models_that_cannot_travel_say_what_to_change():
    import torch

    x = torch.randn(4, 8)
    dropout = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    with pytest.raises(gpunet.GpunetError, match=r"model.eval\(\)"):
        gpunet.Job.from_module(dropout, (x,)).run_locally(x)
    with pytest.raises(gpunet.GpunetError, match="pass them to the job as an input"):
        gpunet.Job.from_module(_Noisy(), (x,)).run_locally(x)
    with pytest.raises(gpunet.GpunetError, match="control flow"):
        gpunet.Job.from_module(_Branchy(), (x,)).run_locally(x)


class _IfOnTensor(__import__("torch").nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_an_if_on_a_tensor_is_explained_once_without_torch_dumping_its_graph(capfd):
    import torch

    with pytest.raises(gpunet.UnsupportedProgram, match="branches on tensor values.*torch.where"):
        gpunet.Job.from_module(_IfOnTensor(), (torch.randn(3),))
    assert "def forward" not in capfd.readouterr().err


@pytest.mark.swarm
def test_a_speed_measured_under_load_is_refreshed_while_idle(swarm, client_for, tmp_path):
    """A worker that first measured itself while the machine was busy publishes a real figure later, by itself."""
    from gpunet.worker import hardware, throughput

    data_dir = tmp_path / "slow-start"
    data_dir.mkdir()
    key = throughput._cache_key(hardware.cpu_hardware())
    (data_dir / throughput.CACHE_FILENAME).write_text(json.dumps({key: {"fp32": 1e-5, "bf16": 1e-5}}))
    proc = swarm.start_worker("--remeasure-every", "1", data_dir=data_dir)
    client = client_for(swarm)

    def fp32() -> float:
        workers = client.workers(refresh=True)
        return workers[0].record.tflops.get("fp32", 0.0) if workers else 0.0

    wait_for(lambda: fp32() > 1e-3, 60, "the worker to publish a re-measured speed")
    assert "Speed measured again while idle" in proc.output


@pytest.mark.swarm
def test_a_worker_of_another_network_stops_naming_the_network_its_initial_peer_runs(swarm):
    """`--network gpunett` against a `gpunet-local` bootstrap went "Online" and never got a job; the only hint blamed
    NAT. It now stops before it is listed, with one line naming what the peer runs and the fix."""
    worker = swarm.start_worker(network=swarm.network + "x", wait_online=False)
    assert worker.popen.wait(timeout=120) == 2, worker.output
    errors = [line for line in worker.lines if line.startswith("error:")]
    assert len(errors) == 1, worker.output
    assert f"none of the initial peers runs network '{swarm.network}x'" in errors[0]
    assert f"runs '{swarm.network}' (a bootstrap)" in errors[0] and f"--network {swarm.network}" in errors[0]
    assert "Online" not in worker.output and "Traceback" not in worker.output
    assert swarm.status()["workers"] == []


def test_a_worker_given_its_own_address_as_initial_peer_says_so(tmp_path):
    from gpunet.identity import Identity

    own = Identity.load_or_create(tmp_path).peer_id
    result = run_cli("worker", "--initial-peers", f"/ip4/127.0.0.1/tcp/4001/p2p/{own}", "--data-dir", str(tmp_path),
                     timeout=60)
    assert result.returncode == 2, result.stderr
    assert "is this node itself" in result.stderr and own in result.stderr
    assert "Measuring" not in result.stderr  # said at once, before the speed test
    _no_traceback(result)


def test_a_listen_address_this_machine_lacks_is_said_without_the_daemons_log_prefixes(tmp_path):
    import re

    result = run_cli("worker", "--host-maddrs", "/ip4/192.0.2.123/tcp/0", "--data-dir", str(tmp_path), timeout=120)
    assert result.returncode == 1, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "cannot assign requested address" in error[0], result.stderr
    assert not re.search(r"\d{4}/\d\d/\d\d \d\d:\d\d|\[ERROR\]", error[0]), error[0]
    _no_traceback(result)


def test_initial_peers_of_another_network_stop_a_node_only_when_every_one_said_so():
    from gpunet.dht.hello import mismatch
    from gpunet.protocol import Greeting

    other, ours = Greeting("gpunet", "bootstrap"), Greeting("mine", "worker")
    assert "none of the initial peers runs network 'mine'" in mismatch("mine", [("/a", other), ("/b", other)])
    assert mismatch("mine", [("/a", other), ("/b", None)]) is None  # the silent one may run it: go on, warned
    assert mismatch("mine", [("/a", other), ("/b", ours)]) is None
    assert mismatch("mine", [("/a", None)]) is None  # an older gpunet, or no answer: nothing known
