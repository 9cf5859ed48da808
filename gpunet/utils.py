"""Small pieces every part of gpunet uses: a bounded cache, a debounce timer, a hash. One copy each."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import os
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


#: Set to 0 to run gpunet's own event loops on the standard asyncio loop (benchmarks compare both).
UVLOOP_ENV = "GPUNET_UVLOOP"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (faster per message; hivemind's DHT process uses it already), else
    asyncio's own. ``GPUNET_UVLOOP=0`` chooses asyncio's."""
    if os.environ.get(UVLOOP_ENV, "1") != "0":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def first_line(error: BaseException, limit: int = 200) -> str:
    """An error's first line, for a log line (its type when it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def human_bytes(n: int) -> str:
    """A size as people read it: ``13.1 TiB``, ``512 KiB``, ``12 bytes``."""
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def plural(n: int, thing: str) -> str:
    """``3 workers``, ``1 worker``: a count and its noun, plural only where it is."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def human_seconds(seconds: float) -> str:
    """A duration for people: milliseconds under a second (a deadline 0.04 s away is not "0.0 s away")."""
    seconds = max(0.0, seconds)
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


async def wait_out(*futures: asyncio.Future) -> None:
    """Wait until every one of ``futures`` is done, however often the caller is cancelled meanwhile (a cleanup that
    must not leave a task, a pipe or a slot half-handled behind a second cancel); the caller sees its own cancellation
    in what those futures end with."""
    while not all(f.done() for f in futures):
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            pass


class LRU(Generic[K, V]):
    """A dict bounded by entry count and (optionally) by total bytes, evicting the least recently used first.

    Every cache that holds what peers send or ask for must be bounded, or a peer could grow it without end. Not
    thread-safe: callers that share one across threads hold their own lock.
    """

    def __init__(self, max_items: int, max_bytes: int | None = None, owner: Callable[[K], Hashable] | None = None,
                 share: float = 1.0):
        """A value larger than ``max_bytes`` is not kept (rather than evicting everything else for it). ``owner``:
        whose each key is; one owner's values are kept up to ``share`` of the items and of the bytes, its own least
        recently used evicted first, so one owner's values (big ones, or many) do not push out everyone else's."""
        self.max_items, self.max_bytes = max_items, max_bytes
        self._owner = owner
        self._owner_items = max(1, int(max_items * share))
        self._owner_bytes = None if max_bytes is None else int(max_bytes * share)
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        # With an owner function: owner -> its keys, least recently used first, and the bytes they hold (so evicting
        # an owner's oldest is one step, not a scan of every key: a worker's kept results are 4,096 places).
        self._owned: dict[Hashable, tuple[OrderedDict[K, None], list[int]]] = {}
        self.nbytes = 0

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value (now the most recently used), or ``default``."""
        item = self._items.get(key)
        if item is None:
            return default
        self._items.move_to_end(key)
        if self._owner is not None:
            self._owned[self._owner(key)][0].move_to_end(key)
        return item[0]

    def put(self, key: K, value: V, nbytes: int = 0) -> None:
        """Insert or replace, then evict the least recently used down to the bounds."""
        self.pop(key)
        cap = self.max_bytes if self._owner_bytes is None or self._owner is None else self._owner_bytes
        if cap is not None and nbytes > cap:
            return
        if self._owner is not None:
            owner = self._owner(key)
            keys, held = self._owned.get(owner) or (OrderedDict(), [0])
            while keys and (len(keys) + 1 > self._owner_items or (cap is not None and held[0] + nbytes > cap)):
                self.pop(next(iter(keys)))  # its own, oldest first
            keys[key] = None
            held[0] += nbytes
            self._owned[owner] = (keys, held)
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        while len(self._items) > 1 and (len(self._items) > self.max_items
                                        or (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            self.pop(next(iter(self._items)))

    def pop(self, key: K, default: V | None = None) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return default
        self.nbytes -= item[1]
        if self._owner is not None:
            owner = self._owner(key)
            keys, held = self._owned[owner]
            del keys[key]
            held[0] -= item[1]
            if not keys:
                del self._owned[owner]
        return item[0]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        """Least recently used first."""
        return list(self._items)

    def values(self) -> list[V]:
        return [v for v, _ in self._items.values()]


class Debounce:
    """Runs ``callback`` once, ``delay`` seconds after the first :meth:`poke` since it last ran: many pokes, one call.

    How a node batches work that need not happen at once (ledger writes, countersignatures), without a timer per item.
    Use from one event loop's thread.
    """

    def __init__(self, delay: float, callback: Callable[[], None]):
        self.delay = delay
        self._callback = callback
        self._timer: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> bool:
        return self._timer is not None

    def poke(self, delay: float | None = None) -> None:
        """Schedule the callback unless it already is (RuntimeError outside a running event loop)."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay if delay is None else delay, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._callback()


class When:
    """Futures that resolve once ``condition()`` is seen to hold: call :meth:`check` whenever it may have become true.

    How a node waits for a state (drained, all paid) without polling it.
    """

    def __init__(self, condition: Callable[[], bool]):
        self._condition = condition
        self._waiting: list[asyncio.Future] = []

    def wait(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.check()
        return future

    def check(self) -> None:
        if self._waiting and self._condition():
            waiting, self._waiting = self._waiting, []
            for future in waiting:
                if not future.done():
                    future.set_result(None)


def host_of(maddr) -> str:
    """The network-address part of a peer's multiaddr (``/ip4/1.2.3.4`` of ``/ip4/1.2.3.4/tcp/5``): identities are
    free, so some limits count per address. An IPv6 peer is counted by its /64 (one subscriber usually holds a whole
    /64); a relayed peer by its whole address (it ends in its relay)."""
    text = str(maddr)
    if "/p2p-circuit" in text:
        return text
    parts = text.split("/")
    if len(parts) >= 3 and parts[1] == "ip6":
        try:
            return f"/ip6/{ipaddress.IPv6Network(parts[2] + '/64', strict=False).network_address}/64"
        except ValueError:
            pass
    return "/".join(parts[:3])


def wide_console(**kwargs):
    """A rich Console for tables: the terminal's width, or 160 columns when output goes to a pipe or file (rich would
    assume 80 there and cut every column short)."""
    import sys

    from rich.console import Console

    stream = kwargs.get("file") or sys.stdout
    tty = getattr(stream, "isatty", lambda: False)()
    return Console(width=None if tty else 160, **kwargs)


async def bounded(awaitable, seconds: float, default=None, result=None):
    """``await awaitable`` for at most ``seconds``: its value (or ``result`` when given), else ``default``."""
    try:
        value = await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        return default
    return value if result is None else result
