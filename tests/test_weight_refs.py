"""Weights by reference (docs/weights.md, "Weights by reference"): a program names tensors by content hash; a worker loads them from its own
``--models-dir`` checkpoints, or asks the client for them, and checks each against its hash as it loads."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from safetensors.torch import save_file

import gpunet
from gpunet import Job
from gpunet.errors import JobRejected, WeightsMismatch
from gpunet.job import tensors
from gpunet.job.checkpoints import CheckpointIndex, tensor_sha256
from gpunet.job.format import Manifest, manifest_bytes
from gpunet.testing.localnet import wait_for


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32))


def _checkpoint(folder, model: torch.nn.Module, name: str = "model.safetensors"):
    """The model's parameters as a checkpoint file, the way HF saves one (its own names, not the trace's)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / name))
    return folder


def test_a_job_names_the_weights_a_checkpoint_holds_and_runs_the_same(tmp_path):
    model = _model()
    x = torch.randn(3, 64)
    folder = _checkpoint(tmp_path / "ckpt", model)
    index = CheckpointIndex([folder]).scan()
    assert len(index) == 4
    job = Job.from_module(model, (x,))
    ref = job.by_reference(index)
    assert ref.program_hash != job.program_hash and len(ref.manifest.refs) == 4
    assert len(ref.to_bytes()) < 2048 < len(job.to_bytes())  # the container carries none of them
    assert torch.equal(ref.run_locally(x), job.run_locally(x))
    # The manifest says what each is, and survives the bytes: a worker reads it from the container's first bytes.
    again = Manifest.from_json(manifest_bytes(ref.to_bytes()[:4096]))
    assert again.refs == ref.manifest.refs and again.refs_bytes == sum(p.numel() * 4 for p in model.parameters())
    # Nothing is named that the checkpoint does not hold: a job of another model's weights is unchanged.
    assert Job.from_module(_model(seed=1), (x,)).by_reference(index).manifest.refs == ()


def test_weights_that_do_not_match_their_hash_are_named_and_refused(tmp_path):
    model = _model()
    x = torch.randn(2, 64)
    job = Job.from_module(model, (x,)).by_reference(CheckpointIndex([_checkpoint(tmp_path, model)]).scan())
    from gpunet.job.validator import load_program

    good = {r.sha256: bytes(job.referenced(r.sha256)) for r in job.manifest.refs}
    bad = dict(good)
    first = job.manifest.refs[0].sha256
    bad[first] = bytes([bad[first][0] ^ 1]) + bad[first][1:]
    with pytest.raises(WeightsMismatch) as caught:
        load_program(job.to_bytes(), refs=lambda r: bad[r.sha256])
    assert caught.value.hashes == (first,)
    with pytest.raises(JobRejected, match="nothing here resolves"):
        load_program(job.to_bytes())
    assert load_program(job.to_bytes(), refs=lambda r: good[r.sha256]).manifest.refs == job.manifest.refs


@pytest.mark.parametrize("field,value,reason", [
    ("sha256", "../../etc/passwd", "sha256"),
    ("dtype", "F128", "dtype"),
    ("shape", [-1], "shape"),
    ("name", "a b", "identifier"),
])
def test_a_malformed_reference_is_refused_with_its_reason(field, value, reason):
    import json

    job = Job.from_module(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
    obj = json.loads(job.parts.manifest)
    ref = {"name": "w", "sha256": "0" * 64, "dtype": "F32", "shape": [4, 4], field: value}
    obj["refs"] = [ref]
    with pytest.raises(JobRejected, match=reason):
        Manifest.from_json(json.dumps(obj).encode())


def test_the_index_keeps_its_hashes_and_never_follows_a_symlink_out(tmp_path):
    inside = _checkpoint(tmp_path / "models" / "a", _model())
    outside = _checkpoint(tmp_path / "elsewhere", _model(seed=2))
    os.symlink(outside / "model.safetensors", inside / "escape.safetensors")
    # A link inside the folder (how a Hugging Face cache links snapshots to blobs) is taken.
    blobs = _checkpoint(tmp_path / "models" / "blobs", _model(seed=3), "blob.safetensors")
    (tmp_path / "models" / "snap").mkdir()
    os.symlink(blobs / "blob.safetensors", tmp_path / "models" / "snap" / "model.safetensors")
    cache = tmp_path / "index.json"
    index = CheckpointIndex([tmp_path / "models"], cache=cache).scan()
    assert len(index) == 8  # a and blobs; nothing of elsewhere
    assert any("escape.safetensors" in line and "not followed" in line for line in index.skipped)
    outside_hash = tensor_sha256(tensors.raw_bytes(_model(seed=2)[0].weight))
    assert outside_hash not in index
    # The cache is used: an unchanged file is not hashed again (its entry is taken as it is).
    import json

    obj = json.loads(cache.read_text())
    path = str((inside / "model.safetensors").resolve())
    obj["files"][path]["tensors"][0][0] = "f" * 64
    cache.write_text(json.dumps(obj))
    assert "f" * 64 in CheckpointIndex([tmp_path / "models"], cache=cache).scan()
    os.utime(inside / "model.safetensors", ns=(1, 1))  # changed: hashed again
    assert "f" * 64 not in CheckpointIndex([tmp_path / "models"], cache=cache).scan()


@pytest.mark.swarm
def test_a_worker_with_the_checkpoint_loads_it_from_disk_and_one_without_asks_the_client(swarm, client_for, tmp_path):
    """The client sends no weight byte to a worker that keeps the checkpoint in its models dir; a models-dir file
    damaged after it was indexed is caught as it loads, named in the worker's log, and only its broken tensor is
    brought from the client; a worker without the checkpoint gets each weight once (kept for this client's next
    job)."""
    from gpunet.job.checkpoints import read_header

    x = torch.randn(4, 64)
    model, other = _model(), _model(seed=4)
    folder = _checkpoint(tmp_path / "models" / "tiny", model)
    damaged = _checkpoint(tmp_path / "models" / "other", other) / "model.safetensors"
    job = Job.from_module(model, (x,)).by_reference(CheckpointIndex([folder]).scan())
    job2 = Job.from_module(other, (x,)).by_reference(CheckpointIndex([damaged.parent]).scan())
    holder = swarm.start_worker("--models-dir", str(tmp_path / "models"))
    holder.wait_for_line(r"holds checkpoint", timeout=30)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 1, 30, "the worker")
    assert torch.equal(client.submit(job, x).result(timeout=60), model(x).detach())
    assert client.weight_bytes_sent == 0 and client.program_bytes_sent < 4096

    *_, (_, _, _, offset, length) = sorted(read_header(damaged), key=lambda t: t[3])  # the file's last tensor
    data = bytearray(damaged.read_bytes())
    data[offset] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert torch.equal(client.submit(job2, x).result(timeout=60), other(x).detach())
    assert client.weight_bytes_sent == length
    holder.wait_for_line(r"no longer holds what it held when indexed", timeout=30)
    assert str(damaged.resolve()) in holder.output

    bare = swarm.start_worker()
    holder.terminate()
    wait_for(lambda: {w.id for w in client.workers(refresh=True)} == {swarm.worker_id(bare)}, 60, "the bare worker")
    before = client.weight_bytes_sent
    assert torch.equal(client.submit(job, x).result(timeout=60), model(x).detach())
    assert client.weight_bytes_sent - before == job.manifest.refs_bytes
    assert torch.equal(client.submit(job, x * 2).result(timeout=60), model(x * 2).detach())
    assert client.weight_bytes_sent - before == job.manifest.refs_bytes  # kept there: not sent twice


def test_doctor_shows_what_a_models_dir_holds(tmp_path):
    from gpunet.worker.doctor import Verdict, check_models

    models = tmp_path / "models"
    _checkpoint(models / "a", _model())
    found = check_models(tmp_path / "data", [models])
    assert found.outcome is Verdict.PASS and "1 checkpoint(s)" in found.detail
    assert (tmp_path / "data" / "models-index.json").is_file()  # the worker starts without hashing them again
    os.symlink(_checkpoint(tmp_path / "out", _model(seed=1)) / "model.safetensors", models / "a" / "x.safetensors")
    warned = check_models(tmp_path / "data", [models])
    assert warned.outcome is Verdict.WARN and "not followed" in warned.detail
    assert check_models(tmp_path / "data", [tmp_path / "nope"]).outcome is Verdict.FAIL


@pytest.mark.swarm
def test_a_worker_without_the_checkpoint_fetches_it_from_one_that_keeps_it(swarm, client_for, tmp_path):
    """Redundancy 2 on a worker that keeps the checkpoint and one that does not: the second fetches the weights from
    the first (the client names it, from its record), each checked against its hash, and the client sends none.
    A holder whose file was damaged since it indexed it: only that tensor crosses the client's link, once, for both
    workers (the second to ask fetches it from the first)."""
    from gpunet.job.checkpoints import read_header

    x = torch.randn(4, 64)
    model = _model(seed=5)
    folder = _checkpoint(tmp_path / "models" / "tiny", model)
    job = Job.from_module(model, (x,)).by_reference(CheckpointIndex([folder]).scan())
    holder = swarm.start_worker("--models-dir", str(tmp_path / "models"))
    bare = swarm.start_worker()
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2 and any(w.record.checkpoints for w in client.workers()),
             30, "both workers, the holder's checkpoint in its record")
    y = client.submit(job, x, requirements=gpunet.Requirements(redundancy=2, timeout=120)).result(timeout=120)
    assert torch.equal(y, model(x).detach())
    assert client.weight_bytes_sent == 0
    bare.wait_for_line(r"Fetched 4 weight\(s\) \(\d+ bytes\) from workers that keep their checkpoint", timeout=30)

    other = _model(seed=6)
    damaged = _checkpoint(tmp_path / "models2" / "other", other) / "model.safetensors"
    job2 = Job.from_module(other, (x,)).by_reference(CheckpointIndex([damaged.parent]).scan())
    liar = swarm.start_worker("--models-dir", str(tmp_path / "models2"))
    liar.wait_for_line(r"holds checkpoint", timeout=30)
    *_, (_, _, _, offset, length) = sorted(read_header(damaged), key=lambda t: t[3])
    data = bytearray(damaged.read_bytes())
    data[offset] ^= 0xFF
    damaged.write_bytes(bytes(data))
    holder.terminate()
    wait_for(lambda: {w.id for w in client.workers(refresh=True)} == {swarm.worker_id(bare), swarm.worker_id(liar)},
             60, "the bare worker and the damaged holder")
    before = client.weight_bytes_sent
    y2 = client.submit(job2, x, requirements=gpunet.Requirements(redundancy=2, timeout=120)).result(timeout=120)
    assert torch.equal(y2, other(x).detach())
    # The damaged holder found its own file wrong as it loaded it; the bare worker, fetching from it, either caught
    # the wrong bytes or heard "not here" (it had found out first). Only the good bytes of that one tensor crossed
    # the client's link, once: where each gave up on the other at the same moment (CI saw it under load), the
    # second to ask the client again was pointed at the first, which had them coming.
    liar.wait_for_line(r"no longer holds what it held when indexed", timeout=30)
    assert client.weight_bytes_sent - before == length, "\n".join(
        line for proc in (bare, liar) for line in proc.output.splitlines() if "tensor" in line or "weight" in line)


def test_one_hash_with_two_sizes_is_refused_and_a_forgotten_file_is_hashed_again_after_a_restart(tmp_path):
    """Attacks from an attacker's review: a manifest naming one tensor's hash twice, with two sizes, made the worker's
    executor see a mismatch and the worker stop offering a good file; and a file found damaged was taken as it was at
    the next start (its cached hashes still matched its size and time)."""
    import json

    job = Job.from_module(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
    obj = json.loads(job.parts.manifest)
    obj["refs"] = [{"name": "a", "sha256": "0" * 64, "dtype": "F32", "shape": [4]},
                   {"name": "b", "sha256": "0" * 64, "dtype": "F32", "shape": [2]}]
    with pytest.raises(JobRejected, match="two sizes"):
        Manifest.from_json(json.dumps(obj).encode())

    folder = _checkpoint(tmp_path / "models" / "a", _model())
    cache = tmp_path / "index.json"
    index = CheckpointIndex([tmp_path / "models"], cache=cache).scan()
    sha = next(iter(index._by_hash))
    assert index.forget(sha) == str((folder / "model.safetensors").resolve())
    assert sha not in index
    again = CheckpointIndex([tmp_path / "models"], cache=cache).scan()
    assert sha in again  # hashed again (the file is in fact fine), not taken from the cache
    assert json.loads(cache.read_text())["files"][str((folder / "model.safetensors").resolve())]["mtime_ns"] > 0
    cache.write_text('{"version": 1, "files": {"x": {"size": "big"}}}')  # a malformed cache is ignored, not fatal
    assert len(CheckpointIndex([tmp_path / "models"], cache=cache).scan()) == 4


@pytest.mark.swarm
def test_weights_nobody_keeps_cross_the_client_link_once_for_three_workers(swarm, client_for, tmp_path):
    """Redundancy 3 on three bare workers, weights by reference that no models dir holds: the client sends them to
    the first worker that asks, and points the others at it (and at each other), who fetch them from it as they
    arrive against the client's grants: one copy from the client, not three."""
    x = torch.randn(4, 64)
    model = _model(seed=8)
    job = Job.from_module(model, (x,)).by_reference(CheckpointIndex([_checkpoint(tmp_path / "ckpt", model)]).scan())
    swarm.start_workers(3)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 3, 30, "all three workers")
    y = client.submit(job, x, requirements=gpunet.Requirements(redundancy=3, timeout=120)).result(timeout=120)
    assert torch.equal(y, model(x).detach())
    assert client.weight_bytes_sent == job.manifest.refs_bytes


def test_a_tensor_a_client_sent_goes_only_to_the_workers_it_grants_it_to(tmp_path):
    """What the piece door serves of a worker's tensors (Weights.for_peer): a models-dir tensor to anyone; one a
    client sent, only against a grant made with that client's upload token for this holder and that fetcher; one on
    its way here: "busy"; anything else: nothing."""
    import hashlib

    from gpunet.errors import WorkerBusy
    from gpunet.protocol import PIECE, proof
    from gpunet.worker.executor.cache import DiskCache
    from gpunet.worker.weights import Weights

    public = _checkpoint(tmp_path / "models" / "a", _model())
    weights = Weights((str(tmp_path / "models"),), disk=DiskCache(tmp_path / "programs", 1 << 30))
    weights.own_id = "holder"
    asyncio.run(weights.start())
    sha_public = next(iter(weights.index._by_hash))
    assert bytes(weights.for_peer(sha_public, "anyone", None))[:8] == bytes(weights.index.read(sha_public))[:8]

    data = os.urandom(4096)
    sha = hashlib.sha256(data).hexdigest()
    with weights.store.incoming(sha) as f:
        f.write(data)
    token = os.urandom(32)
    weights.store.granted(sha, token)
    assert bytes(weights.for_peer(sha, "fetcher", proof(token, PIECE, "holder", "fetcher"))) == data
    assert isinstance(weights.for_peer(sha, "fetcher", None), JobRejected)
    assert isinstance(weights.for_peer(sha, "other", proof(token, PIECE, "holder", "fetcher")), JobRejected)
    assert isinstance(weights.for_peer(sha, "fetcher", proof(os.urandom(32), PIECE, "holder", "fetcher")),
                      JobRejected)
    weights.store.expect(["ab" * 32], weights.store.CLIENT)
    assert isinstance(weights.for_peer("ab" * 32, "fetcher", None), WorkerBusy)
    assert weights.for_peer("cd" * 32, "fetcher", None) is None
    # Fetched from peers: only a peer whose id sorts after this worker's waits for it, so two workers fetching one
    # tensor from each other never both wait (CI saw them wait out their time, then both ask the client).
    weights.store.expect(["ef" * 32], weights.store.PEERS)
    assert isinstance(weights.for_peer("ef" * 32, "later", None), WorkerBusy)
    assert weights.for_peer("ef" * 32, "earlier", None) is None


def test_two_workers_missing_one_weight_at_once_cost_the_client_one_copy():
    """Issue 40's concurrent cold start, at the client's end of the job streams (P2PTransport._send_tensors): two
    workers told of the same holder both find it lacks a weight (a damaged file) and ask the client again at the same
    moment. The first to ask gets the bytes; the second is pointed at the first (which answers "busy" until they
    land), once; asked once more, it gets the bytes too. A worker that does not say ``again`` (an older one) gets the
    bytes at once, as before."""
    from gpunet.client.jobs import JobRequest
    from gpunet.client.transport import P2PTransport
    from gpunet.protocol import Payload, Send, TensorHolders, decode

    holder, first_id, second_id, old_id = ("12D3KooW" + c * 44 for c in "HFSo")
    data = os.urandom(1 << 16)
    sha = __import__("hashlib").sha256(data).hexdigest()
    request = JobRequest("j", "ab" * 32, b"program", b"", 60.0, None, weights={sha: data}.get, weights_named=1,
                         weight_holders=(holder,))

    class Writer:  # a stream whose sends stall until let go (a big weight on its way)
        def __init__(self):
            self.frames, self.gate = [], asyncio.Event()
            self.gate.set()

        def write(self, data):
            self.frames.append(bytes(data))

        async def drain(self):
            await self.gate.wait()

    async def scenario():
        client = P2PTransport(None, None, peer_id="client")
        first, second = Writer(), Writer()
        asked_first, asked_second = {}, {}
        for worker, writer, asked in ((first_id, first, asked_first), (second_id, second, asked_second)):
            assert await client._send_tensors(worker, request, Send(False, False, tensors=(sha,)), writer, asked) == 0
            told = decode(writer.frames.pop()[4:], TensorHolders)
            assert holder in told.holders
        # Both ask again; the first's bytes are still on their way when the second asks.
        first.gate.clear()
        again = Send(False, False, tensors=(sha,), again=True)
        sending = asyncio.ensure_future(client._send_tensors(first_id, request, again, first, asked_first))
        await asyncio.sleep(0)
        assert await client._send_tensors(second_id, request, again, second, asked_second) == 0
        told = decode(second.frames.pop()[4:], TensorHolders)
        assert told.holders == (first_id,) and dict(told.grants).keys() == {first_id}
        first.gate.set()
        assert await sending == len(data)
        assert isinstance(decode(first.frames[0][4:]), Payload) and b"".join(first.frames[1:]) == data
        # The first did not deliver after all (it died, say): asked once more, with or without `again`, the bytes.
        assert await client._send_tensors(second_id, request, again, second, asked_second) == len(data)
        assert client.weight_bytes_sent == 2 * len(data)
        # An older worker, asking again without `again`: the bytes, as before.
        old = Writer()
        asked_old: dict = {}
        await client._send_tensors(old_id, request, Send(False, False, tensors=(sha,)), old, asked_old)
        old.frames.clear()
        assert await client._send_tensors(old_id, request, Send(False, False, tensors=(sha,)), old, asked_old) == \
            len(data)

    asyncio.run(scenario())
