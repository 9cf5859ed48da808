"""The client's side of paying: countersignatures (and refusals) on their way to workers, off the caller's path.

A result that came on a stream is countersigned on that stream. One that came through the unary door is owed: the
countersignature rides on this client's next job to that worker (no extra message in steady traffic), or goes in a
batch call ``SETTLE_DELAY`` seconds later. A batch that does not get through (the worker's relay died, its connection
broke) is owed again: it rides on the next job, which reaches the worker by whatever way it is reachable now, or is
sent again after ``RETRY_DELAY``, up to ``SETTLE_TRIES`` times. Every send is tracked, so :meth:`close` delivers what
is owed before the client leaves; one that still fails leaves the job in the worker's unpaid list.

Pacing: a worker lets a client hold ``CREDIT_LINE`` results uncountersigned at once (its credit line), and refuses
its next job beyond it. A client that pays for everything holds its next job instead (:meth:`Settlement.paced`)
while what the worker may count against it could reach the line: each job in flight to it (its result may be on the
way back unpaid) or the countersignatures riding on it (a job that has reached the worker brings them, and the worker
files them before it refuses anyone), whichever is more, and every countersignature on its way in a batch or on a
stream. What is still owed rides on the job being let through, so it does not count against it. Clients sharing an
address share that address's line too: a worker that says "pay first" all the same lowers this client's line for it
by a quarter (once per ``SQUEEZE_INTERVAL``), and each job that ends there raises it again by 1/line, up to
``CREDIT_LINE`` (additive increase, multiplicative decrease: clients at full speed behind one NAT converge on
shares of it, held back on the client rather than refused).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Protocol, Sequence

from gpunet.client.jobs import Delivery
from gpunet.protocol import CREDIT_LINE, Countersign, Refuse
from gpunet.utils import Debounce

logger = logging.getLogger("gpunet.client")

#: How long a countersignature may wait to ride on the next job to the same worker before it is sent on its own.
SETTLE_DELAY = 0.05
MAX_RIDE_ALONG = 256
MAX_BATCH = 256
#: Batch sends one countersignature gets before it is given up, and the pause before the next (doubling).
SETTLE_TRIES = 4
RETRY_DELAY = 1.0
#: A countersignature for a result that came on a stream is written there only this soon after it came: the worker
#: waits for it on the stream for 30 s (worker.doors.COUNTERSIGN_TIMEOUT), then at its settle door.
STREAM_VERDICT_SECONDS = 20.0
#: A worker's "pay first" lowers this client's pace for it at most once in this many seconds (a burst of refusals
#: is one signal), never below MIN_PACE jobs.
SQUEEZE_INTERVAL = 0.25
MIN_PACE = 4


class Settles(Protocol):
    """What settlement needs of a transport (``BaseTransport`` has it), declared here so that the transport, which
    takes a :class:`Settlement` for the countersignatures riding along, is the one importing the other."""

    async def settle(self, worker_id: str, items: Sequence[tuple[str, bytes]]) -> None: ...


class Settlement:
    def __init__(self, transport: Settles, credit_line: int = CREDIT_LINE):
        """``credit_line``: results a worker lets this client hold uncountersigned at once (see the module's doc)."""
        self.transport = transport
        self.credit_line = credit_line
        self._owed: dict[str, list[tuple[str, bytes]]] = {}  # worker id -> (job id, signature) not yet sent
        self._timer = Debounce(SETTLE_DELAY, self.flush)
        self._sending: set[asyncio.Future] = set()
        self._failed: dict[str, int] = {}  # job id -> batch sends that did not get through
        # Per worker: jobs in flight (slot -> countersignatures riding on it), and verdicts on their way to it.
        self._slots: dict[str, dict[int, int]] = {}
        self._transit: dict[str, int] = {}
        self._numbers = itertools.count()
        self._landed: asyncio.Event | None = None  # set (and replaced) whenever something lands or a job ends
        self._lines: dict[str, float] = {}  # per worker, where lowered below credit_line: this client's pace there
        self._squeezed: dict[str, float] = {}  # per worker: when its pace was last lowered (loop time)

    # --- pacing ----------------------------------------------------------------------------------------------------

    def in_use(self, worker_id: str) -> int:
        """What ``worker_id`` may count against this client's credit line now (what is owed and not yet sent aside:
        it rides on the next job)."""
        slots = self._slots.get(worker_id) or {}
        return sum(max(1, riding) for riding in slots.values()) + self._transit.get(worker_id, 0)

    def line(self, worker_id: str) -> int:
        """The most this client lets ``worker_id`` count against it: its credit line, or less after "pay first"."""
        return int(self._lines.get(worker_id, self.credit_line))

    @asynccontextmanager
    async def paced(self, worker_id: str) -> AsyncIterator[int]:
        """Hold a job to ``worker_id`` until it fits under the worker's credit line, and count it in flight while
        inside (the slot it yields takes the countersignatures riding on it: :meth:`take`)."""
        while self.in_use(worker_id) + 1 > self.line(worker_id):
            if self._landed is None:
                self._landed = asyncio.Event()
            await self._landed.wait()
        slot = next(self._numbers)
        self._slots.setdefault(worker_id, {})[slot] = 0
        try:
            yield slot
        finally:
            slots = self._slots[worker_id]
            del slots[slot]
            if not slots:
                del self._slots[worker_id]
            lowered = self._lines.get(worker_id)
            if lowered is not None:  # additive increase: about one job more per line's worth of jobs ended
                if lowered + 1 / lowered >= self.credit_line:
                    del self._lines[worker_id]
                else:
                    self._lines[worker_id] = lowered + 1 / lowered
            self._moved()

    def _moved(self) -> None:
        """Something this client's credit counted has landed (or gone): wake the jobs held for room."""
        if self._landed is not None:
            self._landed.set()
            self._landed = None

    def _sent(self, worker_id: str, n: int) -> None:
        value = self._transit.get(worker_id, 0) + n
        if value > 0:
            self._transit[worker_id] = value
        else:
            self._transit.pop(worker_id, None)
        if n < 0:
            self._moved()

    async def _verdict(self, worker_id: str, send: Awaitable) -> None:
        """A countersignature (or refusal) on a stream, counted on its way until it is written."""
        self._sent(worker_id, +1)
        try:
            await send
        finally:
            self._sent(worker_id, -1)

    async def pay_up(self, worker_id: str, timeout: float) -> None:
        """The worker says this client (or its address) is at its credit line: pace it lower there (see the module's
        doc), send what is owed to it now, and wait (at most ``timeout`` seconds) until nothing is on its way to it
        any more."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._squeezed.get(worker_id, -SQUEEZE_INTERVAL) >= SQUEEZE_INTERVAL:
            self._squeezed[worker_id] = loop.time()
            self._lines[worker_id] = max(float(MIN_PACE), min(self.line(worker_id), self.in_use(worker_id) + 1) * 0.75)
        items = self._owed.pop(worker_id, [])
        for lo in range(0, len(items), MAX_BATCH):
            self.track(self._send(worker_id, items[lo : lo + MAX_BATCH]))
        deadline = loop.time() + timeout
        while self._transit.get(worker_id) and loop.time() < deadline:
            if self._landed is None:
                self._landed = asyncio.Event()
            try:
                await asyncio.wait_for(self._landed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break

    # --- verdicts --------------------------------------------------------------------------------------------------

    def countersign(self, delivery: Delivery, signature: bytes) -> None:
        if delivery.via_unary or time.monotonic() - delivery.arrived > STREAM_VERDICT_SECONDS:
            # Unary, or held on its stream longer than the worker waits there (a check that ran long): the worker
            # awaits it at its settle door, so it goes in a batch (or rides on the next job).
            if not delivery.via_unary:
                delivery.close()
            self._owe(delivery.worker_id, delivery.receipt.job_id, signature)
        else:
            self.track(self._on_stream(delivery, signature))

    async def _on_stream(self, delivery: Delivery, signature: bytes) -> None:
        try:
            await self._verdict(delivery.worker_id, delivery.finish(Countersign(delivery.receipt.job_id, signature)))
        except Exception:  # the stream broke under it: the worker awaits it at its settle door
            self._owe(delivery.worker_id, delivery.receipt.job_id, signature)
            raise

    def _owe(self, worker_id: str, job_id: str, signature: bytes) -> None:
        self._owed.setdefault(worker_id, []).append((job_id, signature))
        self._timer.poke()

    def refuse(self, delivery: Delivery, reason: str) -> None:
        self.track(self._verdict(delivery.worker_id, delivery.finish(Refuse(delivery.receipt.job_id, reason[:500]))))

    def take(self, worker_id: str, slot: int | None = None) -> list[tuple[str, bytes]]:
        """Countersignatures to ride on a job to ``worker_id`` (at most MAX_RIDE_ALONG; the rest go in a batch);
        ``slot``: the job's, from :meth:`paced` (they count in flight with it)."""
        owed = self._owed.pop(worker_id, [])
        if len(owed) > MAX_RIDE_ALONG:
            owed, self._owed[worker_id] = owed[:MAX_RIDE_ALONG], owed[MAX_RIDE_ALONG:]
            self._timer.poke()
        slots = self._slots.get(worker_id)
        if slot is not None and slots is not None and slot in slots:
            slots[slot] = len(owed)
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
        self._sent(worker_id, len(items))
        try:
            await self.transport.settle(worker_id, items)
        except Exception as e:
            self._sent(worker_id, -len(items))  # owed again (not counted), or given up
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
        except BaseException:
            self._sent(worker_id, -len(items))
            raise
        self._sent(worker_id, -len(items))
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
