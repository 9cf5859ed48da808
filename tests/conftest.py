import pytest

from tests.swarm import Swarm, wait_for


@pytest.fixture
def swarm(tmp_path):
    """A bootstrap node on 127.0.0.1; tests add workers. Everything started is stopped afterwards."""
    s = Swarm(tmp_path, network="gpunet-test", heartbeat=1.0)
    try:
        s.start_bootstrap()
        yield s
    finally:
        s.close()


@pytest.fixture
def client_for(tmp_path):
    """``client_for(swarm, name="client")``: a gpunet.Client of ``swarm`` with its own data dir (so its own identity)
    per name, once it sees a worker. Every client made is closed afterwards."""
    import gpunet

    clients = []

    def make(swarm, name: str = "client"):
        c = gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network, data_dir=tmp_path / name)
        clients.append(c)
        wait_for(lambda: c.workers(refresh=True), 30, "the client to see workers")
        return c

    yield make
    for c in clients:
        c.close()
