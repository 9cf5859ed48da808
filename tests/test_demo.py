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
