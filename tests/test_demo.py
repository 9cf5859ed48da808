"""`gpunet demo`, the README's first command, run exactly as a newcomer would."""

import pytest

from tests.swarm import run_cli

pytestmark = pytest.mark.swarm


def test_demo_runs_the_whole_product_and_exits_cleanly(tmp_path):
    result = run_cli("demo", timeout=600, env={"GPUNET_DATA_DIR": str(tmp_path), "COLUMNS": "120"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "3 workers online" in out
    assert "200 transformer batches" in out and "all equal to local execution" in out
    assert "compute-heavy jobs" in out
    assert "3 workers (3 online)" in out
    assert out.count("│ ok") == 4  # three workers' ledgers and the client's, each verified
    assert "every process it started has stopped" in out


def test_demo_generate_spreads_a_model_and_generates_what_local_generation_does(tmp_path):
    result = run_cli("demo", "--generate", timeout=600, env={"GPUNET_DATA_DIR": str(tmp_path), "COLUMNS": "140"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "into 3 spans" in out
    assert "generated 32 tokens" in out and "identical to generating locally" in out
    for name in ("volunteer-1", "volunteer-2", "volunteer-3"):  # each span on its own worker
        assert name in out.split("where the model ran")[1].split("who did what")[0]
    assert out.count("│ ok") == 4
    assert "every process it started has stopped" in out


def test_demo_chat_serves_a_checkpoint_through_the_gateway_as_local_generation_does(tmp_path):
    result = run_cli("demo", "--chat", timeout=600, env={"GPUNET_DATA_DIR": str(tmp_path), "COLUMNS": "140"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "(OpenAI-compatible) serves tiny-chat" in out and "in 3 spans" in out
    assert out.count("identical to local generation") == 3 and "DIFFERENT" not in out
    earned = out.split("what each worker earned")[1].split("ledgers")[0]
    assert all(name in earned for name in ("volunteer-1", "volunteer-2", "volunteer-3"))
    assert out.count("│ ok") == 4  # three workers' ledgers and the gateway's (the demo's client), each verified
    assert "Loading weights" not in out + result.stderr  # no progress bars from transformers
    assert "every process it started has stopped" in out


def test_ctrl_c_in_the_demo_says_at_once_that_it_stops_everything_and_does(tmp_path):
    """Closing the client and the nodes takes seconds: 12 of them were silent after a Ctrl-C."""
    import os
    import signal
    import subprocess
    import time

    from gpunet.testing.localnet import gpunet_cmd
    from tests.swarm import group_gone, wait_for

    demo = subprocess.Popen(gpunet_cmd("demo", "--workers", "1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "GPUNET_DATA_DIR": str(tmp_path), "COLUMNS": "120"},
                            stdin=subprocess.DEVNULL, start_new_session=True)
    lines: list[str] = []
    try:
        import threading

        threading.Thread(target=lambda: lines.extend(iter(demo.stdout.readline, "")), daemon=True).start()
        wait_for(lambda: any("1 worker online" in line for line in lines), 300, "the demo's worker online")
        os.killpg(demo.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        t0 = time.monotonic()
        wait_for(lambda: any("Stopping the client and every process" in line for line in lines), 5,
                 "the demo to say it stops")
        assert time.monotonic() - t0 < 5
        assert demo.wait(timeout=90) == 130, "".join(lines)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(timeout=30)
    wait_for(lambda: group_gone(demo.pid), 30, "every process the demo started to exit")
