"""Every command ends on an error the same way, seen through the real CLI: one ``error: ...`` line on stderr, no
traceback, and the documented exit code (gpunet.cli.exits): 2 for unusable input, 1 for a runtime failure."""

import pytest

from tests.swarm import run_cli


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.fixture
def unusable_dir(tmp_path):
    """A data dir that cannot be created: its parent is a file."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "data")


@pytest.mark.parametrize(
    "args, message",
    [
        (["worker", "--device", "cpu", "--data-dir", "{dir}"], "cannot create data dir"),
        (["ledger", "balance", "--data-dir", "{dir}"], "no ledger at"),  # reading creates nothing
        (["status", "--initial-peers", "not-an-address"], "initial peer 'not-an-address' is not a multiaddr"),
        (["bootstrap", "--network", "no.dots", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "network name 'no.dots'"),
        (["worker", "--device", "cpu", "--threads", "100000"], "--threads must be from 1 to the"),
        (["worker", "--device", "cpu", "--dashboard-port", "18999", "--metrics-port", "18999"], "give each its own"),
    ],
    ids=["worker", "ledger", "status", "bootstrap", "worker-threads", "worker-ports"],
)
def test_a_config_error_is_one_line_and_exit_code_2(args, message, unusable_dir, tmp_path):
    result = run_cli(*(a.format(dir=unusable_dir) for a in args), timeout=120, env={"GPUNET_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["status", "--bogus"], "No such option: --bogus (Possible options: --verbose) (see `"),
    (["ledger", "show", "-n", "0"], "Invalid value for '--limit'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
    (["worker", "--dashboard-port", "80000"], "Invalid value for '--dashboard-port'"),
    (["worker", "--metrics-port", "65536"], "Invalid value for '--metrics-port'"),
    (["status", "--serve", "70000"], "Invalid value for '--serve'"),
], ids=["unknown-option", "bad-value", "unknown-command", "dashboard-port", "metrics-port", "serve-port"])
def test_a_usage_error_is_one_line_and_exit_code_2_too(args, message, tmp_path):
    """Click's own usage errors end like gpunet's: one ``error: ...`` line, not click's usage block."""
    result = run_cli(*args, timeout=60, env={"GPUNET_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_help_and_version_still_end_with_exit_code_0(tmp_path):
    for args in (["--help"], ["ledger", "show", "--help"], ["--version"]):
        result = run_cli(*args, timeout=60, env={"GPUNET_DATA_DIR": str(tmp_path)})
        assert result.returncode == 0 and result.stdout and not result.stderr, (args, result.stderr)


def test_a_worker_whose_dashboard_port_is_taken_says_so_before_it_joins(tmp_path):
    """Found after joining, the worker used to be listed "joining" for nobody until its record expired."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_cli("worker", "--device", "cpu", "--dashboard-port", str(port), "--initial-peers",
                         "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq",
                         timeout=120, env={"GPUNET_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert _error_lines(result.stderr)[-1] == f"error: --dashboard-port {port}: cannot listen on it (Address already in use)"
    assert "initial peers" not in result.stderr and "Joined" not in result.stdout  # it never tried to join


def test_serving_the_explorer_on_a_port_in_use_is_one_line_at_once(tmp_path):
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        result = run_cli("status", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPsS6WVgn6NikYPt6GFjsnxXuFDX5YHMHeymcq9WqUm4L",
                         "--serve", str(port), timeout=60, env={"GPUNET_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and f"--serve {port}: cannot listen on it" in lines[0], result.stderr
    assert time.monotonic() - t0 < 20  # before any look at the network (the initial peer here answers nobody)
