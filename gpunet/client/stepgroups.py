"""Session steps to one worker sent in the same turn of the client's loop go as one StepGroup frame (docs/sessions.md,
group steps): a generation of many rows steps every row's session at once, so each span's worker gets its rows in
one message, lets them into its lanes together and runs them as one forward, and the p2p daemons carry one message
and one answer per span instead of one per row.

Nothing else changes for a step: each is its own Submit, with its own job id, session, tab and answer, checked and
paid by the same code as a step sent alone (gpunet.client.delivery). A step in a group that is answered UseStream
(its answer did not fit in the group's frame, or it needs the job door), and every step of a group the worker could
not answer, are sent again alone: a step that ran is answered from the worker's recent results by its job id, not
run twice.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from gpunet import protocol
from gpunet.errors import LocalNetworkDown, NetworkError
from gpunet.protocol import Message, StepGroup, StepGroupAnswer, Submit
from gpunet.utils import LRU

#: A step this big or bigger goes alone (a prompt's chunk): a decode step's frame is a few KiB.
GROUP_ROW_BYTES = 16 * 1024
#: What a Submit's frame holds besides its inputs, at most (its ids, hashes, session, a countersignature or two).
SUBMIT_OVERHEAD_BYTES = 1024
#: A worker that did not answer a group (one that predates them, or a stream that broke) gets its steps one by one
#: for this long (each such try costs its steps one more round trip).
NO_GROUPS_SECONDS = 10.0


class StepGroups:
    """Gathers the steps sent to each worker in one turn of the loop (see the module docstring)."""

    def __init__(self, streams):
        self.streams = streams  # the transport's kept ``steps`` streams (gpunet.rpc.KeptStreams)
        self._waiting: dict[str, list[tuple[Submit, asyncio.Future]]] = {}
        self._sending: set[asyncio.Task] = set()
        self._no_groups: LRU[str, float] = LRU(4096)
        self.groups = self.grouped = 0  # groups sent, and the steps they carried
        self._closed = False

    async def send(self, worker_id: str, maddrs: Sequence[str], submit: Submit) -> Message | None:
        """This step's reply when it went in a group (Result, Error or UseStream); None: it goes alone (it is big,
        it was the only step to that worker this turn, or the worker takes no groups now)."""
        if (self._closed or submit.inputs is None or _row_bytes(submit) > GROUP_ROW_BYTES
                or time.monotonic() < self._no_groups.get(worker_id, 0.0)):
            return None
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        queue = self._waiting.get(worker_id)
        if queue is None:
            queue = self._waiting[worker_id] = []
            loop.call_soon(self._flush, worker_id, tuple(maddrs))
        queue.append((submit, future))
        return await future

    def _flush(self, worker_id: str, maddrs: tuple[str, ...]) -> None:
        rows = [(s, f) for s, f in self._waiting.pop(worker_id, ()) if not f.done()]  # (a cancelled caller: not sent)
        chunks = protocol.pack(rows, lambda row: _row_bytes(row[0]), protocol.MAX_FRAME_BYTES - SUBMIT_OVERHEAD_BYTES,
                               protocol.MAX_GROUP_ROWS)
        for chunk in chunks:
            if len(chunk) == 1:
                chunk[0][1].set_result(None)
                continue
            task = asyncio.ensure_future(self._exchange(worker_id, maddrs, chunk))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _exchange(self, worker_id: str, maddrs: tuple[str, ...], rows: list[tuple[Submit, asyncio.Future]]):
        try:
            frame = protocol.encode_frame(StepGroup(tuple(s for s, _ in rows)))
            answer = await self.streams.exchange(worker_id, maddrs, frame,
                                                 lambda reader: protocol.read(reader, StepGroupAnswer))
            if len(answer.replies) != len(rows):
                raise protocol.ProtocolError(f"worker {worker_id[-8:]} answered {len(answer.replies)} of a group's "
                                             f"{len(rows)} steps")
        except LocalNetworkDown as e:  # our own daemon went: nothing goes alone either
            for _, future in rows:
                if not future.done():
                    future.set_exception(e)
            return
        except (NetworkError, OSError, ConnectionError):
            self._no_groups.put(worker_id, time.monotonic() + NO_GROUPS_SECONDS)
            answer = None
        except BaseException:
            for _, future in rows:  # (cancelled: the transport is closing) each goes alone, or finds it closed
                if not future.done():
                    future.set_result(None)
            raise
        self.groups += answer is not None
        self.grouped += len(rows) if answer is not None else 0
        for i, (_, future) in enumerate(rows):
            if not future.done():
                future.set_result(answer.replies[i] if answer is not None else None)

    def close(self) -> None:
        self._closed = True
        for rows in self._waiting.values():  # (each goes alone, and finds the transport closed)
            for _, future in rows:
                if not future.done():
                    future.set_result(None)
        self._waiting.clear()
        for task in list(self._sending):
            task.cancel()


def _row_bytes(submit: Submit) -> int:
    return submit.inputs_size + SUBMIT_OVERHEAD_BYTES + 160 * len(submit.settle)

