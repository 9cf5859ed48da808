"""Weights travel once: a worker that lacks a program fetches it from peers that hold it, each piece checked against
the digest the client gave, so the client uploads a program once, not once per worker. Real workers on 127.0.0.1."""

from __future__ import annotations

import re

import pytest
import torch

import gpunet
from tests.swarm import wait_for


def _big_model(seed: int = 0) -> torch.nn.Module:
    """About 200 MB of fp32 weights (3 x 4096 x 4096), a cheap forward pass for one row."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(3))).eval()


def _peer_bytes(status: dict) -> dict[str, dict]:
    return {w["id"]: w["peer_bytes"] for w in status["workers"]}


@pytest.mark.swarm
def test_a_program_crosses_the_client_link_once_and_workers_fetch_it_from_each_other(swarm):
    """One job with redundancy 3 on three cold workers: the client uploads the program to one; the other two fetch
    it from that one (their records say so), and all three answers agree with the local result."""
    workers = swarm.start_workers(3)
    model = _big_model()
    x = torch.randn(1, 4096)
    job = gpunet.Job.from_module(model, example_inputs=(x,))
    size = len(job.program_bytes())
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=swarm.root / "client") as client:
        wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers known")
        future = client.submit(job, x, requirements=gpunet.Requirements(redundancy=3, timeout=300))
        y = future.result(timeout=300)
        sent = client.program_bytes_sent
    with torch.no_grad():
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
    assert future.checked
    assert sent == size, f"the client sent {sent} program bytes for a {size}-byte program"
    ids = {swarm.worker_id(w) for w in workers}
    peer_bytes = _peer_bytes(swarm.wait_for_status(
        lambda s: sum(v["fetched"] for v in _peer_bytes(s).values()) == 2 * size,
        "two workers' records to say they fetched the program from a peer", timeout=30))
    assert set(peer_bytes) == ids
    assert sorted(v["fetched"] for v in peer_bytes.values()) == [0, size, size]
    assert sum(v["served"] for v in peer_bytes.values()) == 2 * size


@pytest.mark.swarm
def test_a_peer_serving_a_corrupted_piece_is_caught_banned_and_the_fetch_completes_elsewhere(swarm):
    """Two holders, one of which corrupts every piece it serves: a third, cold worker catches the bad piece, fetches
    it from the honest holder, bans the liar, and runs the job right; the client still sent no extra copy."""
    honest = swarm.start_worker()
    liar = swarm.start_worker("--fault-corrupt-pieces")
    model = _big_model(1)
    x = torch.randn(1, 4096)
    job = gpunet.Job.from_module(model, example_inputs=(x,))
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=swarm.root / "client") as client:
        wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both holders known")
        client.submit(job, x, requirements=gpunet.Requirements(redundancy=2, timeout=300)).result(timeout=300)
        before = client.program_bytes_sent  # one copy, or two if the liar got the upload and fed the other
        cold = swarm.start_worker()
        wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "the third worker known")
        y = client.submit(job, x, requirements=gpunet.Requirements(redundancy=3, timeout=300)).result(timeout=300)
        assert client.program_bytes_sent == before, "the cold worker should have fetched the program from peers"
    with torch.no_grad():
        torch.testing.assert_close(y, model(x), rtol=1e-4, atol=1e-4)
    liar_id = swarm.worker_id(liar)
    cold.wait_for_line(rf"Peer {re.escape(liar_id[-8:])} served a corrupted piece", timeout=30)
    cold.wait_for_line(rf"Banned peer {re.escape(liar_id[-8:])}", timeout=30)
    assert swarm.worker_id(honest) != liar_id


@pytest.mark.swarm
def test_a_cold_start_of_five_workers_at_once_costs_the_client_one_copy(swarm):
    """Many jobs of one large program sent at once to five fresh workers: each worker that lacks it is pointed at
    those already getting it, who serve the pieces they have as they arrive (from the client, or from peers), so
    the client's link carries the program about once. Every worker's copy is accounted for: it came from the client
    or from peers, and the peers served what was fetched."""
    workers = swarm.start_workers(5)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False), torch.nn.Linear(4096, 1024)).eval()
    x = torch.randn(1, 4096)
    job = gpunet.Job.from_module(model, example_inputs=(x,))
    size = len(job.program_bytes())
    with gpunet.Client(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                       data_dir=swarm.root / "client") as client:
        wait_for(lambda: len(client.workers(refresh=True)) == 5, 30, "all five workers known")
        futures = [client.submit(job, x, requirements=gpunet.Requirements(timeout=300)) for _ in range(40)]
        results = [f.result(timeout=300) for f in futures]
        sent = client.program_bytes_sent
        ran = {f.worker_id for f in futures}
    with torch.no_grad():
        want = model(x)
    assert all(torch.allclose(y, want, rtol=1e-4, atol=1e-4) for y in results)
    assert sent <= 1.2 * size, f"the client sent {sent / size:.2f} copies"
    # The copy each worker that ran it holds came from the client or, whole, from peers (their records say which).
    copies = round(sent / size)
    peer_bytes = _peer_bytes(swarm.wait_for_status(
        lambda s: sum(v["fetched"] for v in _peer_bytes(s).values()) + sent >= len(ran) * size,
        "the workers' records to account for every copy", timeout=30))
    assert set(peer_bytes) == {swarm.worker_id(w) for w in workers}
    assert all(v["fetched"] in (0, size) for v in peer_bytes.values())
    fetched = sum(v["fetched"] for v in peer_bytes.values())
    assert fetched // size + copies >= len(ran) and sum(v["served"] for v in peer_bytes.values()) >= fetched
