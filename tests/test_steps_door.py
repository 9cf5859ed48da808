"""A session's steps over one stream kept open (the ``steps`` door), on a real swarm: the steps of a session to a
worker share one stream, the door answers what the run door would, and what a hostile peer sends on it closes its
own stream without touching the worker's service."""

import asyncio

import msgpack
import pytest
import torch

from gpunet import protocol
from gpunet.models import generate_locally, tiny_gpt
from gpunet.protocol import Door, Error, ProtocolError, SessionStep, StepGroup, StepGroupAnswer, Submit, UseStream
from tests.swarm import wait_for
from tests.test_sessions_swarm import CFG, generate, sequential

pytestmark = pytest.mark.swarm


def test_a_sessions_steps_ride_one_stream_and_a_hostile_frame_closes_only_its_own(swarm, client_for):
    worker = swarm.start_worker()
    worker_id = swarm.worker_id(worker)
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 1, 30, "the worker")
    transport = client._core.transport
    blocks = tiny_gpt(CFG, seed=4)
    remote = sequential(client, blocks, spans=1)
    prompt = torch.randint(0, CFG.vocab, (1, 5))
    with remote.session() as s:
        got = generate(s, prompt, 12)
        # Every step after the first (which brought the program by the job door) went on one steps stream.
        doors = []  # streams opened and unary calls made meanwhile
        real_open, real_call = transport.rpc.open, transport.rpc.call_raw

        async def counted_open(peer, door, maddrs=()):
            doors.append(door)
            return await real_open(peer, door, maddrs)

        async def counted_call(peer, door, body):
            doors.append(door)
            return await real_call(peer, door, body)

        transport.rpc.open, transport.rpc.call_raw = counted_open, counted_call
        try:
            more = generate(s, torch.tensor([[got[-1]]]), 5)
        finally:
            transport.rpc.open, transport.rpc.call_raw = real_open, real_call
        assert Door.RUN not in doors and Door.STEPS not in doors and Door.JOB not in doors, doors
        assert transport.steps.idle(worker_id) == 1
    assert got + more == generate_locally(blocks, prompt, 17)

    rpc, maddrs = transport.rpc, client.workers()[0].record.maddrs
    h = "ab" * 32

    async def hostile() -> tuple[Error, str]:
        reader, writer = await rpc.open(worker_id, Door.STEPS, maddrs)
        try:
            # A job that is no session step: refused as such, and the stream serves on.
            await protocol.write(writer, Submit("plain-1", h, 3, b"abc", 10.0, None))
            refused = await protocol.read(reader, Error, timeout=30)
            # A group of steps of sessions it never opened here: each gets its own answer, and the stream serves on.
            await protocol.write(writer, StepGroup(tuple(
                Submit(f"g-{i}.1", h, 3, b"abc", 10.0, None, session=SessionStep(f"g-{i}", 1)) for i in range(3))))
            group = await protocol.read(reader, StepGroupAnswer, timeout=30)
            assert len(group.replies) == 3 and all(isinstance(r, (Error, UseStream)) for r in group.replies)
            await protocol.write(writer, Submit("plain-2", h, 3, b"abc", 10.0, None))
            await protocol.read(reader, Error, timeout=30)
            # A malformed frame: the worker closes this stream, unanswered.
            body = msgpack.packb({"t": "submit", "job": 7}, use_bin_type=True)
            writer.write(len(body).to_bytes(4, "big") + body)
            await writer.drain()
            try:
                await protocol.read(reader, Error, timeout=30)
                return refused, "answered"
            except ProtocolError as e:
                return refused, str(e)
        finally:
            writer.close()

    refused, after = asyncio.run_coroutine_threadsafe(hostile(), client._loop).result(90)
    assert refused.code == "rejected" and "session steps" in refused.message
    assert "closed" in after, after
    with remote.session() as s:  # the worker serves on, sessions included
        assert generate(s, prompt, 4) == generate_locally(blocks, prompt, 4)
    assert worker.popen.poll() is None
