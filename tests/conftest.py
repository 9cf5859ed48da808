import fcntl
import signal
import warnings

import pytest

from tests.swarm import Swarm, wait_for


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run long tests at their full size (CI runs a bounded version of each): the honest client "
                          "mapping at full speed in tests/test_credit.py maps 10,000 jobs instead of 1,000, and "
                          "tests/test_llm.py takes every family over the swarm instead of one of each kind")


@pytest.fixture
def full(request) -> bool:
    """Whether long tests run at their full size (``pytest --full``) rather than CI's bounded version."""
    return request.config.getoption("--full")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can tell whether its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(autouse=True)
def _ctrl_c_as_a_terminal_gives_it():
    """Every test starts with SIGINT as Python sets it, and hands the same on: the processes a test starts inherit an
    ignored SIGINT across exec, and a "Ctrl-C" the test sends them then does nothing (a full run once saw a session
    script step on to its end through one). A test that leaves it otherwise is named."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"this test left SIGINT as {left!r}; restored")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """The suite runs two test files at a time (pytest-xdist, see .ci/run); a test marked ``exclusive`` reads this
    machine's load (a worker pausing while the CPU is busy) and runs alone. A readers-writer lock over files shared by
    the xdist workers: every other test holds it shared. The turnstile, held while an exclusive test waits, keeps new
    tests from starting meanwhile, so it is not starved. Taken around the whole protocol: module fixtures set up or
    torn down with a test are covered, and pytest-timeout's clock (inside) does not count the wait."""
    root = item.config._tmp_path_factory.getbasetemp()  # the tmp_path_factory fixture's own object
    if hasattr(item.config, "workerinput"):  # an xdist worker's base is under the run's shared one
        root = root.parent
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(root / "machine.lock", "a") as machine, open(root / "turnstile.lock", "a") as turnstile:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture
def swarm(request, tmp_path):
    """A bootstrap node on 127.0.0.1; tests add workers. Everything started is stopped afterwards. When the test
    fails, the tail of every node's log is printed (a failure seen only in CI is then readable from its output)."""
    s = Swarm(tmp_path, network="gpunet-test", heartbeat=1.0)
    try:
        s.start_bootstrap()
        yield s
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            for proc in s.procs:
                print(f"--- {proc.name} (pid {proc.pid}), last lines of its log ---")
                print("\n".join(proc.lines[-60:]))
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
