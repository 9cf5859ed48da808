"""Pushed steps: a session step's output goes from this span's worker straight to the next span's (docs/sessions.md),
Petals' server-to-server hop, so the activation does not travel back to the client and out again.

The waiting itself (pushes for steps, steps for pushes, bounded) is the pure :class:`~gpunet.worker.state.pushes.Pushes`;
this room takes pushes in, hands a waiting step its input, and sends this worker's outputs on in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import replace

from gpunet import protocol
from gpunet.errors import GpunetError, JobRejected, ProgramNotCached, SessionLost, WorkerBusy
from gpunet.protocol import STEPS_REUSE, Door, Error, Ok, Push, PushGroup, PushTo, Submit, tensorframe
from gpunet.rpc import RPC, KeptStreams
from gpunet.worker.faults import NONE, Faults
from gpunet.worker.state.limits import ServiceLimits
from gpunet.worker.state.pushes import Pushes
from gpunet.worker.state.sessions import Sessions

logger = logging.getLogger("gpunet.worker")

#: How long a worker tries to push a step's output to the next span's worker (that step then asks its client), and
#: how many pushes it has on their way at most.
PUSH_TIMEOUT = 10.0
MAX_PUSHING = 64
#: ...and at most this many per session a client may hold here (--max-sessions-per-client): its client names the peer
#: a push goes to, and a peer that never answers holds each for PUSH_TIMEOUT, so one client's pushes must not take
#: every other client's place (a session pushes one output per step, one step at a time: two leave room for a slow one).
MAX_PUSHING_PER_SESSION = 2
#: A push this big or bigger goes alone; smaller ones made in one turn to one worker share a frame (PushGroup).
GROUP_PUSH_BYTES = 16 * 1024
PUSH_OVERHEAD_BYTES = 256


class Handoff:
    """Pushed inputs in (for sessions held here) and this worker's outputs out (to the next span's worker)."""

    def __init__(self, peer_id: str, sessions: Sessions, pushes: Pushes, limits: ServiceLimits,
                 faults: Faults = NONE):
        """``pushes``: session steps' inputs pushed by the previous span's worker, and steps waiting for theirs."""
        self.peer_id, self.sessions, self.pushes, self.limits, self.faults = peer_id, sessions, pushes, limits, faults
        self.rpc: RPC | None = None  # set once the network is there (start)
        self.streams: KeptStreams | None = None  # pushes to the next spans' workers over streams kept open
        self._pushing: set[asyncio.Future] = set()  # this worker's outputs on their way to the next span's worker
        self._pushes_of: Counter[str] = Counter()  # ...of each client's sessions
        self._queued: dict[str, list[tuple[Push, asyncio.Future]]] = {}  # pushes made this turn, by worker
        self._sends: set[asyncio.Task] = set()

    def offer(self, sender_id: str, push: Push) -> None:
        """Another worker's output for the next step of a session held here. Taken only for a session open here (so
        only bounded room is spent on it); the step itself says which worker's push it takes."""
        if not self.sessions.is_open(push.client, push.session):
            raise SessionLost(f"session {push.session[:16]} is not held here")
        if push.inputs is not None:
            protocol.check_payload_size(len(push.inputs), self.limits.max_input_bytes, "pushed inputs")
        if not self.pushes.offer(sender_id, push.client, push.session, push.step, push.inputs, time.monotonic()):
            raise WorkerBusy("no room for more pushed inputs for this session here; the step will ask its client")

    def may_wait(self, client_id: str, submit: Submit, need_program: bool) -> None:
        """A pushed step waits only for a session held here (so what waits is bounded by the sessions), whose program
        is here (else it would be sent again with the program, and its input with it)."""
        if not self.sessions.is_open(client_id, submit.session.id):
            raise SessionLost(f"session {submit.session.id[:16]} is not held here")
        if need_program:
            raise ProgramNotCached(submit.program)

    async def input_of(self, client_id: str, submit: Submit) -> Submit:
        """The step with the input its client said another worker pushes here; JobRejected (the client then sends
        it itself) if it does not come."""
        step = submit.session
        data = await self.pushes.take(step.input_from, client_id, step.id, step.step,
                                      timeout=submit.timeout if submit.deadline is None
                                      else min(submit.timeout, submit.deadline - time.time()))
        if data is None:
            raise JobRejected(f"the input of session step {step.step} did not come from worker "
                              f"{step.input_from[-8:]}; send it with the step")
        return replace(submit, inputs=data, inputs_size=len(data))

    def give_back(self, client_id: str, submit: Submit, data: bytes) -> None:
        """A pushed input whose step was refused as busy: held again for the client's retry of that step."""
        step = submit.session
        self.pushes.offer(step.input_from, client_id, step.id, step.step, data, time.monotonic())

    def push_on(self, client_id: str, to: PushTo, outputs: bytes | None) -> None:
        """Send a step's output on to the next span's worker (in the background: the client's answer does not wait
        for it); None, or an output that is not one tensor small enough, tells it to ask the client instead."""
        if self.faults.drop_pushes:
            return
        push = Push(client_id, to.session, to.step, self.faults.push(as_next_input(outputs) if outputs is not None else None))
        if to.peer == self.peer_id:  # both spans here (no other worker could take one)
            try:
                self.offer(to.peer, push)
            except GpunetError as e:
                logger.debug("A session step's output was not passed on here: %s", e)
            return
        if (len(self._pushing) >= MAX_PUSHING
                or self._pushes_of[client_id] >= MAX_PUSHING_PER_SESSION * self.sessions.limits.max_per_client):
            return  # the step there asks its client
        task = self._queue(to.peer, push)
        self._pushing.add(task)
        self._pushes_of[client_id] += 1

        def sent(done: asyncio.Future) -> None:
            self._pushing.discard(done)
            self._pushes_of[client_id] -= 1
            if not self._pushes_of[client_id]:
                del self._pushes_of[client_id]

        task.add_done_callback(sent)

    def _queue(self, peer_id: str, push: Push) -> asyncio.Future:
        """``push`` sent with the others made to that worker in this turn of the loop (the rows of one batched
        forward: one PushGroup frame, so the next span's steps get their inputs at once); done once sent or given
        up."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        queue = self._queued.get(peer_id)
        if queue is None:
            queue = self._queued[peer_id] = []
            loop.call_soon(self._flush, peer_id)
        queue.append((push, done))
        return done

    def _flush(self, peer_id: str) -> None:
        def size(queued: tuple[Push, asyncio.Future]) -> int:
            return len(queued[0].inputs or b"") + PUSH_OVERHEAD_BYTES

        # A big one goes alone (by the push door when it does not fit in a frame).
        groups = protocol.pack(self._queued.pop(peer_id, ()), size, protocol.MAX_FRAME_BYTES - PUSH_OVERHEAD_BYTES,
                               protocol.MAX_PUSH_GROUP, alone=lambda queued: size(queued) > GROUP_PUSH_BYTES)
        for group in groups:
            task = asyncio.ensure_future(self._send(peer_id, group[0][0]) if len(group) == 1
                                         else self._send_group(peer_id, [p for p, _ in group]))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
            for _, done in group:
                task.add_done_callback(lambda _, done=done: done.done() or done.set_result(None))

    async def _send_group(self, peer_id: str, pushes: list[Push]) -> None:
        """Several pushes in one frame; each alone if the worker did not take the group (one that predates them)."""
        try:
            if self.streams is None:
                raise GpunetError("no kept streams yet")
            async with asyncio.timeout(PUSH_TIMEOUT):
                reply = await self.streams.exchange(peer_id, (), protocol.encode_frame(PushGroup(tuple(pushes))),
                                                    lambda reader: protocol.read(reader, Ok, Error))
            if isinstance(reply, Error):
                logger.debug("Worker %s did not take every pushed input: %s", peer_id[-8:], reply.message)
            return
        except (GpunetError, TimeoutError, ConnectionError, OSError) as e:
            logger.debug("Could not push %d outputs to worker %s at once (%s); one by one", len(pushes),
                         peer_id[-8:], e)
        await asyncio.gather(*(self._send(peer_id, push) for push in pushes))

    def start(self, rpc: RPC) -> None:
        self.rpc, self.streams = rpc, KeptStreams(rpc, Door.PUSHES, STEPS_REUSE, per_peer=8)

    async def _send(self, peer_id: str, push: Push) -> None:
        try:
            async with asyncio.timeout(PUSH_TIMEOUT):
                reply = await self._sent(peer_id, push)
            if isinstance(reply, Error):
                logger.debug("Worker %s did not take a pushed input: %s", peer_id[-8:], reply.message)
        except (GpunetError, TimeoutError, ConnectionError, OSError) as e:  # its step asks the client instead
            logger.debug("Could not push a session step's output to worker %s: %s", peer_id[-8:], e)

    async def _sent(self, peer_id: str, push: Push) -> Ok | Error:
        """One push: over a stream kept open to that worker; by the push door when it is too big for a frame or
        the worker has no pushes door (an older version)."""
        async def unary() -> Ok | Error:
            return await self.rpc.call(peer_id, Door.PUSH, push, Ok, Error)

        if self.streams is None:
            return await unary()
        return await self.streams.exchange_or(peer_id, (), push, lambda r: protocol.read(r, Ok, Error), unary)

    def stop(self) -> None:
        for task in [*self._sends, *self._pushing]:
            task.cancel()
        if self.streams is not None:
            self.streams.close()


def as_next_input(outputs: bytes) -> bytes | None:
    """A span's step output as the next span's step input: its one tensor, ``output_0``, renamed ``input_0``, so the
    bytes are those the client would send and both sides hash the same. None if the output is not one tensor, or is
    bigger than a push may be."""
    if len(outputs) > protocol.MAX_PUSH_BYTES + 1024:
        return None
    data = tensorframe.renamed(outputs, "output_0", "input_0")
    return data if data is not None and len(data) <= protocol.MAX_PUSH_BYTES else None
