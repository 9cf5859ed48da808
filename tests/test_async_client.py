"""AsyncClient: the same API as Client, awaited, over the same core."""

import asyncio

import pytest
import torch

import gpunet

pytestmark = pytest.mark.swarm


def test_async_client_submits_maps_and_fails_fast(swarm, tmp_path):
    swarm.start_worker()
    job = gpunet.Job.from_function(lambda x: x * 3, (torch.randn(8),))

    async def main():
        async with gpunet.AsyncClient(initial_peers=[swarm.bootstrap_addr], network=swarm.network,
                                      data_dir=tmp_path / "client") as client:
            deadline = asyncio.get_running_loop().time() + 30
            while not await client.workers(refresh=True):
                assert asyncio.get_running_loop().time() < deadline, "no worker appeared"
                await asyncio.sleep(0.2)
            future = client.submit(job, torch.ones(8))
            assert torch.equal(await future, torch.full((8,), 3.0))
            assert future.worker_id and future.receipt.is_countersigned
            ys = [y async for y in client.map(job, [torch.ones(8) * i for i in range(10)])]
            assert [float(y[0]) for y in ys] == [3.0 * i for i in range(10)]
            with pytest.raises(gpunet.NoWorkersAvailable, match="has no GPU"):
                await client.submit(job, torch.ones(8), requirements=gpunet.Requirements(device="gpu"))
            assert client.ledger.verify().count == 11

    asyncio.run(main())
