"""The network explorer (``gpunet status --serve PORT``): a read-only page of a network, built from the DHT as
``gpunet status`` reads it, and its history while it runs.

Every worker (state and why, device, measured speed, prices per lane, reachability, jobs, credits earned), the
network's totals, the programs most held (the models the network serves), and the totals over time. It reads the
DHT like any client and changes nothing: its only endpoints are GETs. JSON for scripts: ``GET /api/network``
(``gpunet status --json``'s object, plus ``programs`` and ``history``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections import Counter, deque

from gpunet.errors import ConfigError
from gpunet.dht.status import NetworkStatus, StatusReader
from gpunet.web import Site

logger = logging.getLogger("gpunet.explorer")

#: Points of history kept (at the default 5 s between reads: an hour).
HISTORY = 720
TOP_PROGRAMS = 20


class Explorer:
    def __init__(self, reader: StatusReader, every: float = 5.0, timeout: float = 30.0):
        self.reader, self.every, self.timeout = reader, every, timeout
        self.latest: NetworkStatus | None = None
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.site = Site("explorer.html", f"gpunet network {reader.network}")
        self.site.get("/api/network", self.network)

    async def network(self, request) -> dict:
        if self.latest is None:
            return {"network": self.reader.network, "workers": [], "totals": {}, "programs": [], "history": [],
                    "read_at": None}
        doc = self.latest.to_json()
        held = Counter(h for w in self.latest.workers for h in w.record.programs)
        doc["programs"] = [{"hash": h, "holders": n} for h, n in held.most_common(TOP_PROGRAMS)]
        doc["history"] = list(self.history)
        doc["read_at"] = self.latest.read_at
        return doc

    async def refresh_forever(self) -> None:
        while True:
            try:
                status = await asyncio.to_thread(self.reader.read, self.timeout)
            except Exception as e:  # a read that failed: keep showing the last one, say so in the log
                logger.warning("Reading the network failed: %s", e)
            else:
                self.latest = status
                t = status.totals
                self.history.append({"at": status.read_at, "online": t.get("online", 0), "workers": t.get("workers", 0),
                                     "tflops": t.get("tflops", 0.0), "jobs_done": t.get("jobs_done", 0),
                                     "queued": t.get("queued", 0)})
            await asyncio.sleep(self.every)

    async def serve(self, port: int, ready=None) -> None:
        """Serve until SIGINT or SIGTERM; ``ready(url)`` is called once the page answers."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.site.start(port)
        except OSError as e:  # taken since it was checked
            raise ConfigError(f"--serve {port}: cannot listen on it ({e.strerror})") from None
        refresher = asyncio.create_task(self.refresh_forever())
        try:
            if ready is not None:
                ready(self.site.url)
            await stop.wait()
        finally:
            refresher.cancel()
            await self.site.stop()


def serve(reader: StatusReader, port: int, every: float = 5.0, timeout: float = 30.0, ready=None) -> None:
    """Run the explorer over ``reader`` (whose DHT the caller closes) until SIGINT or SIGTERM."""
    asyncio.run(Explorer(reader, every, timeout).serve(port, ready))
