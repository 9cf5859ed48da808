"""The client's side of paying: countersignatures (and refusals) on their way to workers, off the caller's path.

A result that came on a stream is countersigned on that stream. One that came through the unary door is owed: the
countersignature rides on this client's next job to that worker (no extra message in steady traffic), or goes in a
batch call ``SETTLE_DELAY`` seconds later. A batch that does not get through (the worker's relay died, its connection
broke) is owed again: it rides on the next job, which reaches the worker by whatever way it is reachable now, or is
sent again after ``RETRY_DELAY``, up to ``SETTLE_TRIES`` times. Every send is tracked, so :meth:`close` delivers what
is owed before the client leaves; one that still fails leaves the job in the worker's unpaid list.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Protocol, Sequence

from gpunet.client.jobs import Delivery
from gpunet.protocol import Countersign, Refuse
from gpunet.utils import Debounce

logger = logging.getLogger("gpunet.client")

#: How long a countersignature may wait to ride on the next job to the same worker before it is sent on its own.
SETTLE_DELAY = 0.05
MAX_RIDE_ALONG = 256
MAX_BATCH = 256
#: Batch sends one countersignature gets before it is given up, and the pause before the next (doubling).
SETTLE_TRIES = 4
RETRY_DELAY = 1.0


class Settles(Protocol):
    """What settlement needs of a transport (``BaseTransport`` has it), declared here so that the transport, which
    takes a :class:`Settlement` for the countersignatures riding along, is the one importing the other."""

    async def settle(self, worker_id: str, items: Sequence[tuple[str, bytes]]) -> None: ...


class Settlement:
    def __init__(self, transport: Settles):
        self.transport = transport
        self._owed: dict[str, list[tuple[str, bytes]]] = {}  # worker id -> (job id, signature) not yet sent
        self._timer = Debounce(SETTLE_DELAY, self.flush)
        self._sending: set[asyncio.Future] = set()
        self._failed: dict[str, int] = {}  # job id -> batch sends that did not get through

    def countersign(self, delivery: Delivery, signature: bytes) -> None:
        if delivery.via_unary:
            self._owed.setdefault(delivery.worker_id, []).append((delivery.receipt.job_id, signature))
            self._timer.poke()
        else:
            self.track(delivery.finish(Countersign(delivery.receipt.job_id, signature)))

    def refuse(self, delivery: Delivery, reason: str) -> None:
        self.track(delivery.finish(Refuse(delivery.receipt.job_id, reason[:500])))

    def take(self, worker_id: str) -> list[tuple[str, bytes]]:
        """Countersignatures to ride on a job to ``worker_id`` (at most MAX_RIDE_ALONG; the rest go in a batch)."""
        owed = self._owed.pop(worker_id, [])
        if len(owed) > MAX_RIDE_ALONG:
            owed, self._owed[worker_id] = owed[:MAX_RIDE_ALONG], owed[MAX_RIDE_ALONG:]
            self._timer.poke()
        return owed

    def delivered(self, items: list[tuple[str, bytes]]) -> None:
        """Countersignatures taken to ride on a job that got through: the count of their failed batch sends goes."""
        if self._failed:
            for job_id, _ in items:
                self._failed.pop(job_id, None)

    def give_back(self, worker_id: str, items: list[tuple[str, bytes]], after: float = 0.0) -> None:
        """Taken but not delivered (the job failed, or the batch did not get through): owed still, sent in a batch
        ``after`` seconds from now (plus SETTLE_DELAY) unless a job to that worker takes them first."""
        if items:
            self._owed.setdefault(worker_id, [])[:0] = items
            if after:
                asyncio.get_running_loop().call_later(after, self._timer.poke)
            else:
                self._timer.poke()

    def flush(self) -> None:
        """Send every countersignature still owed, in one call per worker (per MAX_BATCH)."""
        self._timer.cancel()
        owed, self._owed = self._owed, {}
        for worker_id, items in owed.items():
            for lo in range(0, len(items), MAX_BATCH):
                self.track(self._send(worker_id, items[lo : lo + MAX_BATCH]))

    async def _send(self, worker_id: str, items: list[tuple[str, bytes]]) -> None:
        try:
            await self.transport.settle(worker_id, items)
        except Exception as e:
            again = []
            for job_id, signature in items:
                tries = self._failed[job_id] = self._failed.get(job_id, 0) + 1
                if tries < SETTLE_TRIES:
                    again.append((job_id, signature))
                else:
                    del self._failed[job_id]
            logger.debug("Countersignatures for worker %s did not get through (%s); %d owed again", worker_id[-8:],
                         e, len(again))
            if again:
                self.give_back(worker_id, again, after=RETRY_DELAY * 2 ** (min(self._failed[j] for j, _ in again) - 1))
            raise
        for job_id, _ in items:
            self._failed.pop(job_id, None)

    def track(self, send: Awaitable) -> None:
        """Run ``send`` in the background; :meth:`close` waits for it."""
        future = asyncio.ensure_future(_quietly(send))
        self._sending.add(future)
        future.add_done_callback(self._sending.discard)

    async def close(self, timeout: float = 10.0) -> None:
        """Deliver what is owed before leaving (workers are waiting for it): what does not get through is sent once
        more, within ``timeout`` in all."""
        deadline = asyncio.get_running_loop().time() + timeout
        for _ in range(2):
            self.flush()
            if self._sending:
                await asyncio.wait(set(self._sending), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
            if not self._owed:
                break


#: The longest one countersignature (or refusal) may take to deliver; a worker that never answers is not waited for.
SEND_TIMEOUT = 30.0


async def _quietly(send: Awaitable) -> None:
    try:
        async with asyncio.timeout(SEND_TIMEOUT):
            await send
    except Exception as e:  # the worker keeps the job as unpaid; nothing else to do
        logger.debug("A countersignature could not be delivered: %s", e)
