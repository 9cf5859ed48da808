"""A worker's local dashboard (``gpunet worker --dashboard-port N``): its state and why, device and speed,
reachability and prices, jobs now and lately, earnings over time, unpaid and unbilled work, and pause / resume.

Served on 127.0.0.1 from the worker's own event loop (gpunet.web.Site: a Host check, a strict CSP, and a key made at
every start, which the worker logs with the address and writes to ``<data dir>/dashboard.url``, mode 0600: only the
owner opens it). The JSON API, the page's and any script's, takes the key in the header ``X-Gpunet-Token``
(docs/volunteer.md):

``GET /api/status``    the worker's live record (gpunet status's fields), its pause reason and lane figures, and
                       each peer it is connected to with the way it goes (direct, punched, relayed)
``GET /api/jobs``      jobs running now and the latest that ended here, with how each ended
``GET /api/earnings``  ``?days=N`` (default 14): totals of all time and by lane, each of the last N days (days
                       without jobs too), the newest 50 unpaid and unbilled jobs and how many there are, and apart
                       (``unvouched``) merged receipts naming this worker that it does not vouch for (docs/ledger.md)
``POST /api/pause``    ``{"reason": "..."}``, and ``POST /api/resume`` ``{}``: as ``gpunet worker pause|resume``
"""

from __future__ import annotations

import asyncio
import os
import time

from gpunet.ledger.earnings import EarningsBook
from gpunet.ledger.store import open_ledger
from gpunet.protocol import LANES
from gpunet.web import BadRequest, Site
from gpunet.worker import control


URL_FILE = "dashboard.url"


class Dashboard:
    def __init__(self, worker):
        self.worker = worker
        self._book = EarningsBook(worker.id)
        self._reading = asyncio.Lock()
        name = worker.config.public_name or worker.id[-8:]
        self.site = Site("dashboard.html", f"gpunet worker {name}", private=True)
        self.site.get("/api/status", self.status)
        self.site.get("/api/jobs", self.jobs)
        self.site.get("/api/earnings", self.earnings)
        self.site.post("/api/pause", self.pause)
        self.site.post("/api/resume", self.resume)

    async def start(self, port: int) -> str:
        """Serve; returns the address to open (with its key), also written to ``<data dir>/dashboard.url`` (0600)."""
        await self.site.start(port)
        path = self.worker.data_dir / URL_FILE
        path.unlink(missing_ok=True)  # made afresh: mode 0600 from the start
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.site.url + "\n")
        return self.site.url

    async def stop(self) -> None:
        await self.site.stop()
        (self.worker.data_dir / URL_FILE).unlink(missing_ok=True)

    async def status(self, request) -> dict:
        w = self.worker
        record = w.announcer.record().to_wire()
        lanes = w.jobs.lanes
        return {
            "id": w.id, "record": record, "state": w.state.value, "pause_reason": w.availability.reason,
            "paused_by_hand": control.read_pause(w.data_dir) is not None,
            "lanes": {lane: {"running": lanes.count(lane, waiting=False), "waiting": lanes.count(lane, running=False),
                             "load": round(lanes.load(lane), 3)} for lane in LANES},
            "batch_floor": lanes.floor / 1e9, "preemptions": lanes.preemptions, "time": time.time(),
            "connections": await self._connections(),
        }

    async def _connections(self) -> list[dict]:
        """Each peer this worker's p2p daemon is connected to now, and which way: ``direct`` (a hole-punched
        connection to a NATed worker among them: ``punched``) or ``relayed`` (docs/reachability.md)."""
        from gpunet.dht.observers import paths
        from gpunet.rpc import connections

        w = self.worker
        if w.rpc is None:
            return []
        try:
            conns = await asyncio.wait_for(connections(w.rpc.p2p), 3.0)
        except Exception:  # the daemon busy or going: nothing to say this time
            return []
        natted = set(w.announcer.observers.natted) if w.announcer.observers is not None else set()
        return [{"peer": peer, "path": "punched" if path == "direct" and peer in natted else path,
                 "addresses": sorted(a for p, a in conns if p == peer)}
                for peer, path in sorted(paths(conns).items())]

    async def jobs(self, request) -> dict:
        jobs, now = self.worker.jobs, time.monotonic()
        running = [{"job_id": t.job, "client_id": t.client, "lane": t.lane, "seconds": round(now - t.started_at, 2),
                    "price": t.price} for t in jobs.lanes.running]
        return {"running": running, "recent": list(reversed(jobs.billing.recent))}

    async def earnings(self, request) -> dict:
        try:
            days = max(1, min(366, int(request.query.get("days", 14))))
        except ValueError:
            days = 14
        async with self._reading:  # one reader at a time: the book is read incrementally, off the event loop
            return await asyncio.to_thread(self._report, days)

    def _report(self, days: int) -> dict:
        with open_ledger(self.worker.data_dir) as ledger:  # its own connection: this runs in a thread
            return self._book.report(ledger, days, trusted=self.worker.trust.current())

    async def pause(self, body: dict) -> dict:
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise BadRequest('"reason" is text (or left out)')
        control.set_pause(self.worker.data_dir, reason[:200])
        self.worker.poke_owner()
        return {"paused": True}

    async def resume(self, body: dict) -> dict:
        control.set_pause(self.worker.data_dir, None)
        self.worker.poke_owner()
        return {"paused": False}


