"""A real NAT built from network namespaces (gpunet.testing.netns): what a home worker behind a router meets.

These tests need root, iproute2 and nftables (``.ci/run`` installs them; CI runs as root). Where namespaces cannot
be made they skip, saying why. Every namespace and process made here is removed at the end, also on failure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from gpunet.testing import LocalNetwork, free_port, wait_for
from gpunet.testing.netns import LabUnavailable, NatLab
from tests.swarm import gpunet_cmd


@pytest.fixture
def lab():
    why = NatLab.available()
    if why:
        pytest.skip(f"NAT tests need network namespaces: {why}")
    try:
        with NatLab() as made:
            yield made
    except LabUnavailable as e:
        pytest.skip(f"NAT tests need network namespaces, and this kernel refused: {e}")


def _listen(lab: NatLab, ns: str, port: int) -> subprocess.Popen:
    code = ("import socket,sys,time\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('0.0.0.0',{port}));s.listen();print('up',flush=True);time.sleep(60)")
    proc = subprocess.Popen(lab.exec_argv(ns, [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_the_lab_is_a_real_nat_nothing_gets_into_a_home_from_outside(lab):
    home, other = lab.homes
    listeners = [_listen(lab, lab.public, 9000), _listen(lab, home.ns, 9001)]
    try:
        assert lab.can_connect(home.ns, lab.public_addr, 9000)  # out through the router: fine
        assert not lab.can_connect(lab.public, home.addr, 9001)  # in, to the private address: no route
        assert not lab.can_connect(lab.public, home.router_public, 9001)  # in, to the router: dropped
        assert not lab.can_connect(other.ns, home.addr, 9001)  # from the neighbour's home: no
    finally:
        for proc in listeners:
            proc.kill()
            proc.wait()


_CLIENT = r'''
import json, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
import torch
import gpunet

boot, network, data_dir, jobs, wanted = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
one_by_one = sys.argv[6:] == ["one-by-one"]  # so that some job is in flight whenever the test breaks something
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).eval()
job = gpunet.Job.from_module(model, example_inputs=(torch.randn(2, 16),))
with gpunet.Client(initial_peers=[boot], network=network, data_dir=data_dir) as client:
    deadline = time.monotonic() + 60
    while len(client.workers(refresh=True)) < wanted and time.monotonic() < deadline:
        time.sleep(0.5)
    right, by = 0, {}

    def check(future, x):
        global right
        y = future.result(timeout=180)
        with torch.no_grad():
            right += bool(torch.allclose(y, model(x), atol=1e-5))
        by[future.worker_id] = by.get(future.worker_id, 0) + 1
        assert future.receipt.client_signature and future.receipt.worker_signature

    xs = [torch.randn(2, 16) for _ in range(jobs)]
    if one_by_one:
        for i, x in enumerate(xs):
            check(client.submit(job, x), x)
            print("done", i + 1, flush=True)
    else:
        for future, x in zip([client.submit(job, x) for x in xs], xs):
            check(future, x)
    client._core.books.flush()
    print(json.dumps({"right": right, "by": by, "id": client.id}), flush=True)
'''


def _reachability_check(lab: NatLab, ns: str, boot: str) -> dict:
    """``gpunet doctor``'s reachability check, run inside namespace ``ns``."""
    result = subprocess.run(lab.exec_argv(ns, gpunet_cmd("doctor", "--network", "nat-test", "--initial-peers", boot,
                                                         "--device", "cpu", "--json")),
                            capture_output=True, text=True, timeout=180)
    checks = json.loads(result.stdout)
    return next(c for c in checks if c["name"] == "reachability")


def _ledger_balance(data_dir) -> dict:
    """``gpunet ledger balance --json`` of a node, per identity."""
    result = subprocess.run(gpunet_cmd("ledger", "balance", "--json", "--data-dir", str(data_dir)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return {b["identity"]: b for b in json.loads(result.stdout)["balances"]}


@pytest.mark.swarm
def test_home_workers_behind_nat_serve_jobs_through_relays(lab, tmp_path):
    """Two workers, each behind its own NAT router, find out they cannot be dialled, reserve relay slots on the
    bootstrap node, are listed relayed, and serve a client in the public namespace: answers right, spread over both,
    every receipt signed by both sides and in every ledger."""
    with LocalNetwork(tmp_path, network="nat-test", heartbeat=1.0) as net:
        boot = net.start_bootstrap(ns=lab.public, host_maddrs=f"/ip4/{lab.public_addr}/tcp/0")
        workers = [net.start_worker(ns=home.ns, host_maddrs="/ip4/0.0.0.0/tcp/0", wait_online=False)
                   for home in lab.homes]
        for worker in workers:
            net.wait_online(worker)
            assert "Not directly reachable" in worker.output and "Reachable through relays" in worker.output, \
                [line for line in worker.output.splitlines() if "each" in line or "elay" in line]

        def status() -> list[dict]:
            result = subprocess.run(lab.exec_argv(lab.public, gpunet_cmd(
                "status", "--network", "nat-test", "--initial-peers", boot, "--json")),
                capture_output=True, text=True, timeout=90)
            return json.loads(result.stdout)["workers"] if result.returncode == 0 else []

        listed = wait_for(lambda: (lambda ws: ws if len(ws) == 2 and all(w["state"] == "online" for w in ws)
                                   else None)(status()), 60, "both home workers listed online")
        assert {w["reachability"] for w in listed} == {"relayed"}
        assert all("/p2p-circuit/" in w["maddrs"][0] for w in listed)
        for home in lab.homes:  # and still nothing from outside gets into either home
            assert not lab.can_connect(lab.public, home.router_public, 22)
        doctor = {ns: _reachability_check(lab, ns, boot) for ns in (lab.homes[0].ns, lab.public)}
        home_check, public_check = doctor[lab.homes[0].ns], doctor[lab.public]
        assert home_check["outcome"] == "warn" and "not directly reachable" in home_check["detail"]
        assert f"reachable through relay /ip4/{lab.public_addr}/" in home_check["detail"]
        assert "forward TCP port" in home_check["advice"] and "--announce-maddrs" in home_check["advice"]
        assert public_check["outcome"] == "pass" and "directly reachable" in public_check["detail"]

        relay = wait_for(lambda: "limited" if "relays in libp2p's limited mode" in net.bootstrap.output else
                         "full" if "passed its self-test" in net.bootstrap.output else None, 60,
                         "the bootstrap's relay self-test")
        if relay == "limited":  # after all of the bootstrap's restarts
            pytest.skip("the bootstrap's relay came up in libp2p's limited mode (a start-up race in hivemind 1.1.12's "
                        "p2pd, see docs/reachability.md): jobs through it are cut off after 128 KiB per connection")
        client_dir = tmp_path / "client"
        run = subprocess.run(lab.exec_argv(lab.public, [sys.executable, "-c", _CLIENT, boot, "nat-test",
                                                         str(client_dir), "50", "2"]),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, "\n".join(
            [line for line in run.stderr.splitlines() if "Task was destroyed" not in line and "task: <Task" not in line
             and " DEBUG " not in line][-60:] + ["--- bootstrap:", net.bootstrap.output[-1500:]]
            + [f"--- worker {w.id[-8:]}:\n" + w.output[-1500:] for w in workers])
        outcome = json.loads(run.stdout.strip().splitlines()[-1])
        assert outcome["right"] == 50
        assert set(outcome["by"]) == {w.id for w in workers} and min(outcome["by"].values()) >= 3
        spent = _ledger_balance(client_dir)
        for worker in workers:
            earned = wait_for(lambda: (lambda b: b if b.get(worker.id, {}).get("jobs_worked") == outcome["by"][worker.id]
                                       else None)(_ledger_balance(worker.data_dir)), 90,
                              "the worker's ledger to hold every receipt")  # (a late one goes by the settle door)
            assert earned[worker.id]["earned"] == spent[worker.id]["earned"] > 0


@pytest.mark.swarm
def test_workers_that_start_together_behind_one_address_all_find_they_are_direct(swarm):
    """Dial-back checks are rationed, but a node turned away hears "busy" and asks again: three workers on one
    address starting at once must not conclude they are unreachable (they did, and routing then skipped two)."""
    workers = swarm.start_workers(3)
    for worker in workers:
        assert "Reachability: direct" in worker.output, worker.output[-2000:]
    listed = swarm.wait_for_status(lambda s: len(s["workers"]) == 3, "all three workers listed")
    assert {w["reachability"] for w in listed["workers"]} == {"direct"}


#: How long a home worker may take to announce only the relays it still holds after one dies (heartbeat 1 s here).
RELAY_FAILOVER = 30.0


@pytest.mark.swarm
def test_home_worker_whose_relay_dies_keeps_serving_through_another(lab, tmp_path):
    """A home worker holds reservations on two public relays. One dies mid-stream (its whole process group killed):
    within RELAY_FAILOVER the worker's record lists only the live relay, the job in flight is retried, and every job
    completes, right, paid once."""
    import os
    import signal

    with LocalNetwork(tmp_path, network="nat-test", heartbeat=1.0) as net:
        public = f"/ip4/{lab.public_addr}/tcp/0"
        doomed = net.start_bootstrap(ns=lab.public, host_maddrs=public)
        doomed_proc = net.bootstrap
        spare = net.start_bootstrap("--initial-peers", doomed, ns=lab.public, host_maddrs=public)
        boots = [p for p in net.procs if p.role == "bootstrap"]
        if any("relays in libp2p's limited mode" in p.output for p in boots):
            pytest.skip("a bootstrap's relay came up in libp2p's limited mode after all its restarts (a start-up race "
                        "in hivemind 1.1.12's p2pd, see docs/reachability.md)")
        worker = net.start_worker(ns=lab.homes[0].ns, host_maddrs="/ip4/0.0.0.0/tcp/0", initial_peers=[doomed, spare])
        relay_ids = {addr.rsplit("/p2p/", 1)[1]: name for addr, name in ((doomed, "doomed"), (spare, "spare"))}

        def relays_listed() -> set[str]:
            result = subprocess.run(lab.exec_argv(lab.public, gpunet_cmd(
                "status", "--network", "nat-test", "--initial-peers", spare, "--json")),
                capture_output=True, text=True, timeout=90)
            if result.returncode != 0:
                return set()
            mine = [w for w in json.loads(result.stdout)["workers"] if w["id"] == worker.id]
            if not mine or mine[0]["reachability"] != "relayed":
                return set()
            return {relay_ids.get(m.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1], "?") for m in mine[0]["maddrs"]
                    if "/p2p-circuit" in m}

        seen: list = []
        try:
            wait_for(lambda: seen.append(relays_listed()) or seen[-1] == {"doomed", "spare"}, 60,
                     "the worker to hold reservations on both relays")
        except TimeoutError as e:
            raise AssertionError(f"{e}: listed {seen[-3:]}\n{worker.output[-3000:]}") from None
        client_dir = tmp_path / "client"
        client = subprocess.Popen(lab.exec_argv(lab.public, [sys.executable, "-c", _CLIENT, spare, "nat-test",
                                                              str(client_dir), "30", "1", "one-by-one"]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert client.stdout.readline().startswith("done")  # jobs are flowing
            for _ in range(4):
                client.stdout.readline()
            os.killpg(doomed_proc.pid, signal.SIGKILL)  # the relay machine is gone, daemon and all
            wait_for(lambda: relays_listed() == {"spare"}, RELAY_FAILOVER, "the worker to list only the live relay")
            out, err = client.communicate(timeout=600)
        finally:
            if client.poll() is None:
                client.kill()
                client.communicate()
        assert client.returncode == 0, "\n".join(
            [line for line in err.splitlines() if "Task was destroyed" not in line and "task: <Task" not in line][-40:]
            + ["--- worker:", worker.output[-2000:]])
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome["right"] == 30 and outcome["by"] == {worker.id: 30}
        books: list = []

        def each_job_once():
            books.append(_ledger_balance(worker.data_dir))
            return books[-1] if books[-1].get(worker.id, {}).get("jobs_worked") == 30 else None

        try:
            earned = wait_for(each_job_once, 30, "the worker's ledger to hold each job once")
        except TimeoutError as e:  # what it holds instead, and why, for a failure seen only in CI
            raise AssertionError(f"{e}: the worker's balance {books[-1:]}, the client's {_ledger_balance(client_dir)}"
                                 f"\n--- worker:\n{worker.output[-4000:]}\n--- client:\n{err[-3000:]}") from None
        assert earned[worker.id]["earned"] == _ledger_balance(client_dir)[worker.id]["earned"] > 0


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.swarm
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_an_ipv6_worker_is_dialled_back_at_its_own_address(tmp_path):
    """The dial-back goes to the caller's whole IPv6 address (limits count per /64; a dial needs the address): an
    IPv6 worker that can be dialled is direct (it was once told it could not be, and would have gone relayed)."""
    with LocalNetwork(tmp_path, network="v6-test", heartbeat=1.0) as net:
        net.start_bootstrap(host_maddrs="/ip6/::1/tcp/0")
        worker = net.start_worker(host_maddrs="/ip6/::1/tcp/0")
        assert "Reachability: direct (a peer dialled this worker back at /ip6/::1," in worker.output, \
            worker.output[-2000:]


def test_the_daemon_flags_of_a_worker_that_relays_and_of_one_that_does_not():
    """Without --relay-service the daemon keeps the relay transport (it still dials peers behind NAT through their
    relays) but runs no configured relay service; with it, the worker's --relay-* values reach the daemon."""
    from hivemind.p2p import P2P

    from gpunet.dht import network

    quiet = network._reachability_options("no-relay", [])
    assert "use_relay" not in quiet and P2P.FORCE_REACHABILITY_MAPPING[quiet["force_reachability"]] == {
        "relayService": 0}
    limits = network.relay_limits(circuit_mb=1.5, circuit_minutes=10, circuits=8, reservations=32)
    assert limits == {"relayMaxReservations": 32, "relayMaxCircuits": 8, "relayDataLimit": 3 * 2**19,
                      "relayTimeLimit": "600s"}
    relaying = network._reachability_options(None, [], limits)
    assert P2P.FORCE_REACHABILITY_MAPPING[relaying["force_reachability"]] == limits
    public = network._reachability_options("public", [])
    assert P2P.FORCE_REACHABILITY_MAPPING[public["force_reachability"]]["relayDataLimit"] == 4 * 2**30  # bootstrap


@pytest.mark.swarm
def test_a_stranger_gets_no_free_transit_through_a_public_worker(lab, tmp_path):
    """Attack: one stranger, two plain libp2p peers (no gpunet identity) in two homes behind NAT, asks a public
    worker's relay for a reservation and pushes bytes through it as fast as it can, dialling again whenever a circuit
    is reset (on main: 1.9 MB/s per stream through libp2p's always-on relay, 128 KiB a circuit, reopened at will).
    A worker relays only with --relay-service: by default the reservation is refused and nothing crosses (the same
    stranger gets one from the bootstrap node, so the refusal is the worker's). With --relay-service, no circuit
    carries more than --relay-circuit-mb."""
    from gpunet.testing.relay_stranger import NoReservation, run_pusher, start_holder

    public = f"/ip4/{lab.public_addr}/tcp/0"
    with LocalNetwork(tmp_path, network="nat-test", heartbeat=1.0) as net:
        boot = net.start_bootstrap(ns=lab.public, host_maddrs=public)
        worker = net.start_worker(ns=lab.public, host_maddrs=public)
        relay = next(a for a in worker.wait_ready("online")["addresses"] if lab.public_addr in a)
        with pytest.raises(NoReservation):
            holder = start_holder(lab, lab.homes[0].ns, relay=relay, wait=20.0)
            try:  # granted (the attack works): what it carries, for the failure message
                pushed = run_pusher(lab, lab.homes[1].ns, holder, 3.0)
                wait_for(lambda: holder.circuits, 15, "the holder's count")
            finally:
                holder.stop()
            raise AssertionError(f"a public worker without --relay-service relayed for a stranger: "
                                 f"{sum(holder.circuits)} bytes crossed in {pushed['seconds']:.1f} s")
        control = start_holder(lab, lab.homes[1].ns, relay=boot)  # a relay that does relay: the stranger works
        control.stop()

        limit_mb = 1
        opted = net.start_worker("--relay-service", "--relay-circuit-mb", str(limit_mb), ns=lab.public,
                                 host_maddrs=public)
        relay = next(a for a in opted.wait_ready("online")["addresses"] if lab.public_addr in a)
        holder = start_holder(lab, lab.homes[0].ns, relay=relay)
        try:
            pushed = run_pusher(lab, lab.homes[1].ns, holder, 5.0)
            assert pushed["opened"], f"the stranger's pusher opened no stream through the opted-in relay: {pushed}"
            wait_for(lambda: holder.circuits, 15, "the holder to count a circuit")
        finally:
            holder.stop()
        assert holder.circuits and sum(holder.circuits) > 0, pushed  # it relays...
        assert max(holder.circuits) <= limit_mb * 2**20, (holder.circuits, pushed)  # ...within the circuit limit


_SESSIONS = r'''
import json, sys, time
import torch
import gpunet
from gpunet.llm import load

boot, network, data_dir, folder, seconds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
model, tok = load(folder)
ids = tok("hello there", return_tensors="pt").input_ids
with torch.no_grad():
    local = model.generate(ids, max_new_tokens=8, do_sample=False)
with gpunet.Client(initial_peers=[boot], network=network, data_dir=data_dir) as client:
    deadline = time.monotonic() + 60
    while len(client.workers(refresh=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    lm = client.causal_lm(folder, max_length=64, spans=2)
    runs, same, placements, end = 0, 0, set(), time.monotonic() + seconds
    while time.monotonic() < end:
        out = lm.generate(ids, max_new_tokens=8, do_sample=False)
        runs, same = runs + 1, same + bool(torch.equal(out, local))
        placements.add(tuple(w for _, _, w in lm.last.placement[0]))
print(json.dumps({"runs": runs, "same": same, "placements": sorted(placements)}))
'''


def test_two_home_workers_hole_punch_a_direct_connection(tmp_path):
    """Two workers behind two cone NATs, four public nodes at distinct addresses (what go-libp2p needs to confirm a
    public address before it hole-punches): once both are online and a session's steps go span to span between them,
    a direct TCP connection joins the two homes (each router letting in only what answers its own outgoing
    connection), both records say they reach one NATed worker directly (and doctor, beside a worker, says its connection
    is hole-punched), and the session's tokens are HF's."""
    from gpunet.testing.llm import save_checkpoint

    why = NatLab.available()
    if why:
        pytest.skip(f"NAT tests need network namespaces: {why}")
    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=0, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=128)
    try:
        lab = NatLab(observers=4).__enter__()
    except LabUnavailable as e:
        pytest.skip(f"NAT tests need network namespaces, and this kernel refused: {e}")
    try:
        with LocalNetwork(tmp_path, network="nat-test", heartbeat=2.0) as net:
            boots = [net.start_bootstrap(ns=lab.public, host_maddrs=f"/ip4/{addr}/tcp/0") for addr in lab.public_addrs]
            workers = [net.start_worker("--threads", "1", "--dashboard-port", str(free_port()), ns=home.ns,
                                        host_maddrs="/ip4/0.0.0.0/tcp/0", wait_online=False, initial_peers=boots)
                       for home in lab.homes]
            for worker in workers:
                net.wait_online(worker)
            for worker in workers:  # (the look for observers runs beside the heartbeat: it may end after "online")
                try:  # (said once, with the count when it reached 4: it may be more by then)
                    wait_for(lambda: any(int(n) >= 4 for n in re.findall(
                        r"Connected to (\d+) public peer\(s\) of distinct addresses", worker.output)), 90,
                             "a home worker connected to 4 public observers")
                except TimeoutError as e:
                    raise AssertionError(f"{e}:\n{worker.output[-4000:]}") from None
            client = subprocess.Popen(lab.exec_argv(lab.public, [sys.executable, "-c", _SESSIONS, boots[0], "nat-test",
                                                                  str(tmp_path / "client"), str(folder), "20"]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                (one, two), (h1, h2) = workers, lab.homes
                # The other home's router, seen from inside each home: a connection only a punch can make. (Here it
                # comes about 7 s after both are online; the client's own start takes longer on a loaded machine.)
                try:
                    wait_for(lambda: h2.router_public in lab.tcp_peers(h1.ns)
                             and h1.router_public in lab.tcp_peers(h2.ns), 60, "a direct connection between homes")
                except TimeoutError as e:
                    raise AssertionError(f"{e}: home 1 holds {lab.tcp_peers(h1.ns)}\n--- worker 1:\n"
                                         f"{one.output[-2500:]}\n--- worker 2:\n{two.output[-2500:]}") from None
                out, err = client.communicate(timeout=300)
            finally:
                if client.poll() is None:
                    client.kill()
                    client.communicate()
            assert client.returncode == 0, err[-3000:]
            outcome = json.loads(out.strip().splitlines()[-1])
            assert outcome["runs"] >= 1 and outcome["same"] == outcome["runs"], outcome
            assert [one.id, two.id] in outcome["placements"] or [two.id, one.id] in outcome["placements"], outcome

            def status() -> dict[str, int]:
                result = subprocess.run(lab.exec_argv(lab.public, gpunet_cmd(
                    "status", "--network", "nat-test", "--initial-peers", boots[0], "--json")),
                    capture_output=True, text=True, timeout=90)
                return {w["id"]: w.get("punched", 0) for w in json.loads(result.stdout)["workers"]} \
                    if result.returncode == 0 else {}

            wait_for(lambda: (lambda s: s.get(one.id) == s.get(two.id) == 1)(status()), 30,
                     "both records to say they reach the other worker directly")
            # `gpunet doctor` on the machine of a running worker says which way its connections go.
            doctor = subprocess.run(lab.exec_argv(h1.ns, gpunet_cmd("doctor", "--data-dir", str(one.data_dir),
                                                                    "--device", "cpu", "--json")),
                                    capture_output=True, text=True, timeout=120)
            paths = next(c for c in json.loads(doctor.stdout) if c["name"] == "connections")
            assert paths["outcome"] == "pass" and "1 hole-punched" in paths["detail"], paths
            for home in lab.homes:  # and still nothing unasked gets into either home
                assert not lab.can_connect(lab.public, home.router_public, 22)
    finally:
        lab.close()
