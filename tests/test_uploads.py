"""Programs on their way into a worker, without a network: one copy serves every job that wants it, checked first."""

import asyncio

import torch

import gpunet
from gpunet.worker.uploads import Uploads

JOB = gpunet.Job.from_function(lambda x: x * 2, (torch.randn(3),))
GOOD = JOB.program_bytes()
OTHER = gpunet.Job.from_function(lambda x: x + 2, (torch.randn(3),)).program_bytes()


def test_a_copy_on_its_way_serves_later_jobs_once_checked():
    async def scenario():
        uploads = Uploads()
        upload = uploads.begin(JOB.program_hash)
        waiting = [asyncio.ensure_future(uploads.coming(JOB.program_hash).share()) for _ in range(5)]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)  # nothing yet: they wait, nobody asks for another copy
        upload.arrived(GOOD)
        assert [await w for w in waiting] == [GOOD] * 5
        assert await uploads.coming(JOB.program_hash).share() is GOOD  # still there while it is being loaded
        uploads.end(upload)
        assert uploads.coming(JOB.program_hash) is None and len(uploads) == 0

    asyncio.run(scenario())


def test_a_copy_that_fails_or_lies_or_dawdles_serves_nobody():
    async def scenario():
        uploads = Uploads()
        liar = uploads.begin(JOB.program_hash)
        liar.arrived(OTHER)  # bytes of another program under this hash: never handed to another client's job
        assert await liar.share() is None
        quitter = uploads.begin(JOB.program_hash)
        waiter = asyncio.ensure_future(quitter.share())
        uploads.end(quitter)  # its client hung up before the bytes came
        assert await waiter is None and uploads.coming(JOB.program_hash) is None
        slow = uploads.begin(JOB.program_hash)
        assert await slow.share(timeout=0.05) is None  # too slow in coming: the waiter asks its own client
        uploads.end(liar)  # an old upload ending never removes a newer one
        assert uploads.coming(JOB.program_hash) is slow

    asyncio.run(scenario())


def test_a_copy_still_growing_is_waited_for_however_slow_and_one_that_stopped_is_not(monkeypatch):
    """On a slow link a program takes minutes to come: a job that gave up on the copy on its way after a fixed wait
    brought its own (a whole copy more over the link, and in memory). A copy is waited for while it grows."""
    from gpunet.worker import uploads as uploads_module
    from gpunet.worker.payloads import Receiving

    monkeypatch.setattr(uploads_module, "SHARED_CHECK", 0.01)

    async def scenario(stop_at: int):
        upload = Uploads().begin(JOB.program_hash)
        coming = Receiving(len(GOOD))
        upload.receiving(len(GOOD), coming, None)
        waiter = asyncio.ensure_future(upload.share(timeout=0.1))
        while coming.received < stop_at:  # 40 bytes every 0.04 s: slower in all than the timeout, never still for it
            await asyncio.sleep(0.04)
            coming.write(GOOD[coming.received:coming.received + 40])
        if stop_at == len(GOOD):
            upload.arrived(bytes(coming.buffer))
        return await waiter

    assert asyncio.run(scenario(stop_at=len(GOOD))) == GOOD
    assert asyncio.run(scenario(stop_at=80)) is None


def test_a_copy_is_waited_for_no_longer_than_the_waiting_jobs_own_time(monkeypatch):
    from gpunet.worker import uploads as uploads_module
    from gpunet.worker.payloads import Receiving

    monkeypatch.setattr(uploads_module, "SHARED_CHECK", 0.01)

    async def scenario():
        upload = Uploads().begin(JOB.program_hash)
        coming = Receiving(len(GOOD))
        upload.receiving(len(GOOD), coming, None)
        waiter = asyncio.ensure_future(upload.share(timeout=10, limit=0.2))
        while not waiter.done():  # a junk upload at a trickle: growing, never done
            await asyncio.sleep(0.02)
            coming.write(GOOD[coming.received:coming.received + 1])
        return await waiter

    assert asyncio.run(scenario()) is None
