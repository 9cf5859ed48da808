"""The client's view of the workers: kept fresh from the DHT, struck when they fail, and this client's own load on
them (a job waits here, not in a worker's queue, while the workers that fit are full of this client's jobs).

Routing (:mod:`gpunet.client.routing`, pure) decides from this view; this room does its I/O: the refreshes, the
waits, telling the transport to forget a worker as a program's holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Sequence

from hivemind.utils import get_dht_time

from gpunet.client.routing import JobShape, Requirements, Router
from gpunet.client.reputation import Reputation
from gpunet.dht.records import WorkerEntry, WorkerState
from gpunet.errors import NoWorkersAvailable

if TYPE_CHECKING:
    from gpunet.client.proofs import SpeedProofs
    from gpunet.client.transport import BaseTransport

logger = logging.getLogger("gpunet.client")

#: A client spends at most about 1/REFRESH_DUTY of its time refreshing the worker list (listing 10,000 workers takes
#: seconds of signature checks, which every 2 s would keep a core busy for a client that only waits), and waits at
#: most MAX_REFRESH_PAUSE seconds between two (a refresh slowed by a peer that does not answer is no measure of size);
#: a failed refresh, or one that found nobody, is followed by the next at the configured period.
REFRESH_DUTY = 10
MAX_REFRESH_PAUSE = 30.0
#: Waiters for room that timed out, left in the queue for an end to skip, before the queue is swept.
MAX_WAITERS = 1024


def refresh_pause(period: float, took: float) -> float:
    """Seconds until the next refresh of the worker list, after one that took ``took`` seconds."""
    return max(period, min(REFRESH_DUTY * took, MAX_REFRESH_PAUSE))


class WorkerView:
    def __init__(self, router: Router, reputation: Reputation, transport: "BaseTransport", network: str,
                 refresh_period: float = 2.0, discovery_wait: float = 10.0, proofs: "SpeedProofs | None" = None):
        """``proofs``: speed challenges to schedule for the workers each refresh finds (None: none are sent)."""
        self.router, self.reputation, self.transport, self.proofs = router, reputation, transport, proofs
        self.network, self.refresh_period, self.discovery_wait = network, refresh_period, discovery_wait
        self._said_skips: dict[str, str] = {}  # worker id -> the reason last logged for leaving it out
        self._fresh = asyncio.Event()
        self._refresher: asyncio.Task | None = None
        self._waiting: deque[asyncio.Future] = deque()  # jobs waiting for room, oldest first (see finished)

    # --- keeping it fresh ------------------------------------------------------------------------------------------

    async def refresh(self) -> list[WorkerEntry]:
        """Look at the records again; returns the live workers this look found. A look can miss live workers (a
        bucket's search lost under load: CI once saw one of three, and a session's span then had nowhere to move), so
        a worker missing from it stays while its record holds, unless the look found its tombstone (it said it left).
        One whose record lapsed is gone, or going: no longer named as a holder."""
        listed = await self.transport.discover()
        entries = [e for e in listed if e.record.state is not WorkerState.OFFLINE]
        seen, live, now = {e.id for e in listed}, {e.id for e in entries}, get_dht_time()
        missed = [e for e in self.router.workers.values() if e.id not in seen and e.expiration_time > now]
        for gone in self.router.workers.keys() - live - {e.id for e in missed}:
            self.transport.forget(gone)
        self.router.update(entries + missed, left=seen - live)
        if self.router.workers:
            self._fresh.set()
        else:  # every record lapsed at once (heartbeats late under load, a partition): jobs wait for the next look
            self._fresh.clear()  # that finds workers, as for the first ones
        if self.proofs is not None:
            self.proofs.schedule(entries)
        return entries

    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            try:
                await self._refresher
            except (asyncio.CancelledError, Exception):
                pass

    async def _refresh_forever(self) -> None:
        took = 0.0
        while True:
            # An empty view is looked at again soon whatever a look costs: jobs wait for its first workers.
            await asyncio.sleep(refresh_pause(self.refresh_period, took if self.router.workers else 0.0))
            t0 = time.monotonic()
            try:
                await self.refresh()
                took = time.monotonic() - t0
            except Exception as e:  # a slow or broken refresh must not kill the client; the next one may work
                logger.warning("Refreshing the worker list failed: %s", e)
                took = 0.0  # no measure of the network's size

    async def look_again(self, pause: float) -> None:
        """The network looks empty under a job: refresh after ``pause`` (a failure is the next look's to mend)."""
        await asyncio.sleep(pause)
        try:
            await self.refresh()
        except Exception as e:  # the next look may work; the job's deadline bounds it
            logger.debug("Looking for workers again failed: %s", e)

    def workers(self) -> list[WorkerEntry]:
        return list(self.router.workers.values())

    # --- waiting for workers -----------------------------------------------------------------------------------------

    async def some_workers(self, req: Requirements) -> None:
        """Wait (a while) for discovery to find the first workers; NoWorkersAvailable, saying where it looked."""
        if self.router.workers:
            return
        wait = min(self.discovery_wait, req.timeout)
        try:
            await asyncio.wait_for(self._fresh.wait(), wait)
        except asyncio.TimeoutError:
            raise NoWorkersAvailable(
                f"no workers appeared in network {self.network!r} within {wait:.0f} s: is that the network the "
                "workers joined (`gpunet demo` uses 'gpunet-demo'), and are the initial peers right? "
                f"`gpunet status --network {self.network}` lists what can be seen") from None

    async def could_take(self, req: Requirements, k: int) -> int:
        """How many known workers could take a job, waiting (``discovery_wait`` at most, as for the first ones) for
        more to appear while there are fewer than ``k``."""
        deadline = time.monotonic() + min(self.discovery_wait, req.timeout)
        while (n := self.router.could_take(req)) < k and time.monotonic() < deadline:
            self._fresh.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._fresh.wait(), max(0.0, deadline - time.monotonic()))
        return n

    async def place(self, req: Requirements, shape: JobShape, exclude: set[str], avoid: set[str],
                    drawn: bool, prefer: Sequence[str] = ()) -> WorkerEntry:
        """The worker routing would send a job to now, waiting for busy or joining ones within the job's timeout;
        ``drawn``: one drawn at random, as a checker is; ``prefer``: see Router.choose."""
        await self.some_workers(req)
        deadline = time.monotonic() + req.timeout
        while True:
            try:
                worker = (self.router.choose_checker(req, exclude=set(exclude), replicas=set(avoid)) if drawn else
                          self.router.choose(req, shape, exclude=set(exclude), avoid=set(avoid), prefer=prefer))
                break
            except NoWorkersAvailable as e:  # busy, or still joining: wait for them within the timeout
                if e.retry_at is None or e.retry_at >= deadline:
                    raise
                await self.room_or(e.retry_at)
        self.say_skips()
        return worker

    # --- this client's jobs on the workers ---------------------------------------------------------------------------

    def started(self, worker_id: str) -> int:
        """A job of ours went to ``worker_id``; returns how many were there ahead of it (``Router.started``)."""
        return self.router.started(worker_id)

    def finished(self, worker_id: str) -> None:
        """One of our jobs left ``worker_id``: the job that has waited longest for room (Router.full) may go (one
        at a time, in order: waking every waiter on every end costs each a pass over the workers)."""
        self.router.finished(worker_id)
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def room_or(self, until: float) -> None:
        """Wait until monotonic time ``until``, or until one of our jobs ends somewhere (making room there)."""
        if len(self._waiting) > MAX_WAITERS:  # waiters that timed out, left for an end to skip: drop them
            self._waiting = deque(w for w in self._waiting if not w.done())
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await asyncio.wait([waiter], timeout=max(0.0, until - time.monotonic()))
        finally:
            waiter.cancel()  # (a timed-out waiter stays in the queue until an end skips it)

    # --- what the workers did ----------------------------------------------------------------------------------------

    def strike(self, worker_id: str, outcome: str) -> float:
        """A worker failed (or lied): routing bans it for a while, no other worker is sent to it for a program, and
        ``outcome`` is recorded against it. Returns the ban's length. Forgotten as a holder on any failure, not only
        an unreachable one: a worker that failed may be dying, and one that lied only wastes a fetcher's time (pieces
        are checked), while a dead holder costs a cold worker seconds of dialling; forgetting a live one costs at
        most one upload from here."""
        self.transport.forget(worker_id)
        ban = self.router.on_failure(worker_id)
        self.reputation.record(worker_id, outcome)
        return ban

    def say_skips(self) -> None:
        """Log, once per worker and reason, why routing leaves a known worker out while others get the work."""
        skipped = self.router.skipped
        if skipped == self._said_skips:
            return
        for worker_id, why in skipped.items():
            if self._said_skips.get(worker_id) != why:
                entry = self.router.workers.get(worker_id)
                name = f" ({entry.record.name})" if entry is not None and entry.record.name else ""
                logger.info("Routing skips worker %s%s: it %s", worker_id[-8:], name, why)
        self._said_skips = dict(skipped)
