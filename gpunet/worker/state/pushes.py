"""Session step inputs pushed by the worker holding the span before (docs/sessions.md, pushed steps).

A step sent with ``input_from`` waits here for the input that worker sends straight to this one (Petals'
server-to-server hop: the activation does not travel back to the client and out again). The push and the step can
arrive in either order, so a push may wait for its step and a step for its push. What is kept is bounded: pushes are
taken only for sessions open here (the caller checks), one per (session, step, sender) and two per session, in a
byte budget, for ``keep`` seconds; a step's wait for its push ends when its client cancels it or another step of its
session comes.

No I/O here: the doors decode the Push messages, gpunet.worker.handoff hands them over, the job path runs the steps.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

#: Bytes of pushed inputs held, all waiting pushes together, before new ones are refused (their steps then ask the
#: client for their inputs instead).
MAX_WAITING_BYTES = 32 * 2**20
#: Pushes held at once (each for one session step), and for one session (an honest sender is a step ahead of its
#: client's request at most: whoever knows a session's id can fill only that session's room, and 64 sessions at two
#: each leave room for all).
MAX_WAITING = 256
MAX_PER_SESSION = 2
#: How long a push waits for its step.
KEEP_SECONDS = 30.0

_Key = tuple[str, str, int, str]  # client, session, step, the worker that pushed


@dataclass
class _Held:
    data: bytes | None
    until: float


class Pushes:
    """Pushed inputs waiting for their step, and steps waiting for their pushed input."""

    def __init__(self, max_bytes: int = MAX_WAITING_BYTES, max_held: int = MAX_WAITING, keep: float = KEEP_SECONDS,
                 max_per_session: int = MAX_PER_SESSION):
        self.max_bytes, self.max_held, self.keep, self.max_per_session = max_bytes, max_held, keep, max_per_session
        self._held: OrderedDict[_Key, _Held] = OrderedDict()
        self._bytes = 0
        self._waiting: dict[tuple[str, str], tuple[_Key, asyncio.Future]] = {}  # (client, session) -> its step

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def offer(self, sender: str, client: str, session: str, step: int, data: bytes | None, now: float) -> bool:
        """A push arrived (``data`` None: the sender says it will not come). Given to its step if that waits, else
        held for it; False when there is no room (or one from this sender for that step is held already)."""
        key = (client, session, step, sender)
        waiting = self._waiting.get((client, session))
        if waiting is not None and waiting[0] == key and not waiting[1].done():
            waiting[1].set_result(data)
            return True
        self._expire(now)
        size = len(data) if data is not None else 0
        if (key in self._held or len(self._held) >= self.max_held or self._bytes + size > self.max_bytes
                or sum(k[:2] == (client, session) for k in self._held) >= self.max_per_session):
            return False
        self._held[key] = _Held(data, now + self.keep)
        self._bytes += size
        return True

    async def take(self, sender: str, client: str, session: str, step: int, timeout: float) -> bytes | None:
        """The input ``sender`` pushed for this step: at once if held, else when it comes; None if it will not come,
        does not come within ``timeout``, or the wait is called off (:meth:`call_off`, or another step of the
        session waits now)."""
        key = (client, session, step, sender)
        if key in self._held:
            return self._pop(key)
        self.call_off(client, session)
        future = asyncio.get_running_loop().create_future()
        self._waiting[(client, session)] = (key, future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            if self._waiting.get((client, session), (None, None))[1] is future:
                del self._waiting[(client, session)]

    def call_off(self, client: str, session: str) -> None:
        """A step of this session waiting for its push stops waiting (its client moved on, or cancelled it)."""
        waiting = self._waiting.pop((client, session), None)
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(None)

    def forget(self, client: str, session: str) -> None:
        """The session ended here: what was pushed for it goes, and a step waiting stops."""
        self.call_off(client, session)
        for key in [k for k in self._held if k[:2] == (client, session)]:
            self._pop(key)

    def _expire(self, now: float) -> None:
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.until > now:
                break
            self._pop(key)

    def _pop(self, key: _Key) -> bytes | None:
        data = self._held.pop(key).data
        self._bytes -= len(data) if data is not None else 0
        return data
