import pytest

from tests.swarm import Swarm


@pytest.fixture
def swarm(tmp_path):
    """A bootstrap node on 127.0.0.1; tests add workers. Everything started is stopped afterwards."""
    s = Swarm(tmp_path, network="gpunet-test", heartbeat=1.0)
    try:
        s.start_bootstrap()
        yield s
    finally:
        s.close()
