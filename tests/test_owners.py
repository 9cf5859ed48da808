"""A program hash is no capability, and a client names no address a worker dials (issue 38, items 2 and 8). Real
workers on 127.0.0.1; the attacker is a client of its own identity speaking the wire as the protocol allows."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import threading

import pytest
import torch

import gpunet
from gpunet import protocol
from gpunet.identity import Identity
from gpunet.job import tensors
from gpunet.protocol import Door, Error, Payload, PieceData, PieceList, Result, Send, UseStream, piece_size_for
from tests.swarm import wait_for


# The proof of holding as docs/trust.md states it (gpunet.protocol.holding), computed here the way any client would:
# a key from every byte of the program, and an HMAC naming the worker that checks it and the identity presenting it.
def holding_key(program: bytes) -> bytes:
    return hashlib.sha256(b"gpunet-holding-v1\0" + program).digest()


def proof(key: bytes, purpose: str, verifier: str, prover: str) -> bytes:
    return hmac.new(key, f"{purpose}\0{verifier}\0{prover}".encode(), hashlib.sha256).digest()


RUN, PIECE = "run", "piece"


class _Wire:
    """A message as an attacker writes it: a plain map (fields a worker does not know are ignored)."""

    def __init__(self, **fields):
        self.fields = fields

    def to_wire(self) -> dict:
        return self.fields


def Submit(job_id: str, program: str, inputs: bytes, **extra) -> _Wire:
    return _Wire(t="submit", job=job_id, program=program, inputs_size=len(inputs), inputs=inputs, timeout=60.0,
                 max_price=None, **extra)


def _secret_layer(seed: int, out: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, out).eval()


def _on(client, coro, timeout: float = 120):
    """Run ``coro`` on ``client``'s own loop (where its transport lives)."""
    return asyncio.run_coroutine_threadsafe(coro, client._loop).result(timeout)


async def _stream(rpc, worker_id: str, submit: _Wire, answer_send=None):
    """One job over the stream door as a hand-written client: the worker's first reply, and (if ``answer_send`` is
    given and the worker asked for something) what it said after that answer."""
    reader, writer = await rpc.open(worker_id, Door.JOB)
    try:
        await protocol.write(writer, submit)
        first = await protocol.read(reader, Send, Result, Error)
        if answer_send is None or not isinstance(first, Send):
            return first, None
        await answer_send(first, writer)
        return first, await protocol.read(reader, Send, Result, Error, timeout=120)
    finally:
        writer.close()


def _says_nothing_of(message: str, layer: torch.nn.Module) -> None:
    """A refusal to a stranger names no input, shape or dtype of the program."""
    words = message.lower()
    assert not any(w in words for w in ("input", "shape", "dtype", "f32", "float", "[2, 8]", "[8]")), message
    assert str(layer.in_features) not in message, message


@pytest.mark.swarm
def test_a_program_runs_only_for_clients_holding_its_bytes_unless_its_owner_shared_it(swarm, client_for):
    """Client A runs a private layer (default settings) on two workers; B, another identity, names its published
    hash: it gets no answer and no word of the layer's shapes, on either door, with no proof, a made-up one, or A's
    proofs replayed (made for this worker or for the other), nor its weights from the piece door. A client that does
    hold the bytes proves it and runs without uploading; a program its owner shared runs for B."""
    swarm.start_workers(2)
    owner, stranger, other_holder = client_for(swarm, "a"), client_for(swarm, "b"), client_for(swarm, "c")
    wait_for(lambda: len(owner.workers(refresh=True)) == 2, 30, "both workers known to the owner")
    secret = _secret_layer(0)
    x = torch.randn(2, 8)
    job = gpunet.Job.from_module(secret, example_inputs=(x,))
    y = owner.submit(job, x, requirements=gpunet.Requirements(redundancy=2, timeout=120)).result(timeout=120)
    with torch.no_grad():
        torch.testing.assert_close(y, secret(x))
    # The stranger is a paying client of both workers (its own job, countersigned): their unary door takes its jobs.
    own = gpunet.Job.from_module(_secret_layer(3), example_inputs=(x,))
    stranger.submit(own, x, requirements=gpunet.Requirements(redundancy=2, timeout=120)).result(timeout=120)

    def both_list_it():  # (a look that misses a worker lists fewer: waited out, not taken as "all of them")
        ids = [w.id for w in stranger.workers(refresh=True) if job.program_hash in w.record.programs]
        return ids if len(ids) == 2 else None

    workers = wait_for(both_list_it, 30, "both workers' records to list the secret program (its hash is published)")
    key = holding_key(job.program_bytes())
    rpc = stranger._core.transport.rpc
    inputs = job.encode_inputs(x)
    wrong = tensors.encode({job.input_names[0]: torch.randn(3, 5)})  # a misfit: its refusal would name the spec

    def sub(job_id: str, data: bytes = inputs, **kw) -> _Wire:
        return Submit(job_id, job.program_hash, data, **kw)

    attempts = {"none": {}, "made-up": {"holds": os.urandom(32)}}
    for n, w in enumerate(workers):
        attempts[f"owner's proof for worker {n}"] = {"holds": proof(key, RUN, w, owner.id)}
    for t, target in enumerate(workers):
        for a, (name, kw) in enumerate(attempts.items()):
            for n, data in enumerate((inputs, wrong)):
                unary = _on(stranger, rpc.call(target, Door.RUN, sub(f"u-{t}-{a}-{n}", data, **kw),
                                               Result, UseStream, Error))
                assert isinstance(unary, UseStream), (name, unary)  # "send it by stream": nothing ran, nothing said
                first, _ = _on(stranger, _stream(rpc, target, sub(f"s-{t}-{a}-{n}", data, **kw)))
                assert isinstance(first, Send) and first.program, (name, first)  # asked for the bytes it lacks

    async def ask_piece(target: str):  # as a worker fetching the program would (knowing its hash, as anyone does)
        reader, writer = await rpc.open(target, Door.PIECE)
        try:
            await protocol.write(writer, _Wire(t="get_piece", program=job.program_hash, index=0,
                                               piece_size=piece_size_for(len(job.program_bytes()))))
            return await protocol.read(reader, PieceData, Error)
        finally:
            writer.close()

    for target in workers:  # nor are its weights handed out piece by piece
        refused = _on(stranger, ask_piece(target))
        assert isinstance(refused, Error), refused
        _says_nothing_of(refused.message, secret)

    async def garbage(ask: Send, writer) -> None:  # not the program: bytes that cannot pass for it
        await protocol.write(writer, Payload(64, None))
        await protocol.write_payload(writer, b"\x84" + b"x" * 63)

    for n, data in enumerate((inputs, wrong)):
        first, then = _on(stranger, _stream(rpc, workers[0], sub(f"garbage-{n}", data, holds=os.urandom(32)),
                                            garbage))
        assert isinstance(then, Error), then
        _says_nothing_of(then.message, secret)

    # A client that holds the bytes (its own copy of the same model) proves it and runs without uploading them.
    wait_for(lambda: all(job.program_hash in w.record.programs for w in other_holder.workers(refresh=True)), 30,
             "the other holder to read that the workers cache the program")
    y2 = other_holder.submit(job, x, requirements=gpunet.Requirements(timeout=120)).result(timeout=120)
    torch.testing.assert_close(y2, y)
    assert other_holder.program_bytes_sent == 0

    # A program its owner published as shared runs for anyone who names it.
    public = _secret_layer(1, out=3)
    shared = gpunet.Job.from_module(public, example_inputs=(x,))
    owner.submit(shared, x, requirements=gpunet.Requirements(redundancy=2, shared=True, timeout=120)).result(120)
    data = shared.encode_inputs(x)
    for n, target in enumerate(workers):
        reply = _on(stranger, rpc.call(target, Door.RUN, Submit(f"shared-{n}", shared.program_hash, data),
                                       Result, UseStream, Error))
        assert isinstance(reply, Result), reply
        reply, _ = _on(stranger, _stream(rpc, target, Submit(f"shared-s-{n}", shared.program_hash, data)))
        assert isinstance(reply, Result), reply


class _Listener:
    """A plain TCP server on the worker's loopback, counting the connections anyone opens to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self._thread.join(5)


@pytest.mark.swarm
def test_a_worker_never_dials_the_addresses_a_client_names_for_the_holders_of_a_program(swarm, client_for):
    """A job answers the worker's "fetch it from peers?" with holders at a listener on the worker's own loopback (a
    made-up peer id, and the client's own id, beside that address): the worker opens no connection to it, then asks
    the client for the program, and the job runs."""
    worker = swarm.start_worker()
    worker_id = swarm.worker_id(worker)
    client = client_for(swarm, "prober")
    layer = _secret_layer(2)
    x = torch.randn(2, 8)
    job = gpunet.Job.from_module(layer, example_inputs=(x,))
    program, inputs = job.program_bytes(), job.encode_inputs(x)
    key, pieces = holding_key(program), PieceList.of(program)
    listener = _Listener()
    there = [f"/ip4/127.0.0.1/tcp/{listener.port}"]
    holders = [(Identity.generate().peer_id, there) for _ in range(protocol.MAX_HOLDERS - 1)] + [(client.id, there)]

    async def name_holders(ask: Send, writer) -> None:
        assert ask.program and ask.pieces, ask
        await protocol.write(writer, _Wire(
            t="pieces", size=pieces.size, piece_size=pieces.piece_size, hashes=pieces.hashes,
            holders=[[peer, maddrs] for peer, maddrs in holders], coming=[],
            grants=[[peer, proof(key, PIECE, peer, worker_id)] for peer, _ in holders],
            holds=proof(key, RUN, worker_id, client.id)))
        await protocol.write(writer, Payload(None, None))

    async def job_naming_holders():
        reader, writer = await client._core.transport.rpc.open(worker_id, Door.JOB)
        try:
            await protocol.write(writer, Submit("probe-1", job.program_hash, inputs,
                                                holds=proof(key, RUN, worker_id, client.id)))
            await name_holders(await protocol.read(reader, Send), writer)
            again = await protocol.read(reader, Send, Result, Error, timeout=60)  # the peers failed: "send it"
            assert isinstance(again, Send) and again.program and not again.pieces, again
            await protocol.write(writer, Payload(len(program), None))
            await protocol.write_payload(writer, program)
            return await protocol.read(reader, Result, Error, timeout=60)
        finally:
            writer.close()

    try:
        result = _on(client, job_naming_holders())
        assert isinstance(result, Result), result
    finally:
        listener.close()
    assert listener.accepted == 0, f"the worker opened {listener.accepted} connection(s) to an address a client named"
