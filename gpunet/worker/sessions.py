"""Inference sessions on the worker (docs/sessions.md): the I/O around the pure
:class:`~gpunet.worker.state.sessions.Sessions` — a step begun and what its end bills, the sweeper that expires idle
sessions, their state freed in the executors, and the closes and leaving that end them."""

from __future__ import annotations

import asyncio
import logging
import time

from gpunet.errors import GpunetError, SessionLost, WorkerBusy, WorkerDraining
from gpunet.ledger.receipts import Receipt
from gpunet.protocol import Submit
from gpunet.utils import When, sha256_hex
from gpunet.worker import metrics
from gpunet.worker.billing import Billing
from gpunet.worker.state.limits import SessionLimits, SessionRun
from gpunet.worker.state.pushes import Pushes
from gpunet.worker.state.sessions import Action, Ended, Sessions

logger = logging.getLogger("gpunet.worker")

#: How long a close waits for a step of its session still running (its answer may be on its way).
CLOSE_WAIT = 30.0


class SessionHost:
    def __init__(self, limits: SessionLimits, executor, billing: Billing, pushes: Pushes):
        """``pushes``: inputs pushed for sessions' steps (gpunet.worker.handoff), which go when their session does."""
        self.sessions = Sessions(limits)
        self.executor, self.billing, self.pushes = executor, billing, pushes
        self._steps: dict[tuple[str, str], asyncio.Future] = {}  # (client, session) -> its running step's answer
        self._drops: set[asyncio.Future] = set()  # sessions' state being freed in executors
        self._paid = When(lambda: not self.sessions.owing)
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._expire())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    # --- a step -----------------------------------------------------------------------------------------------------

    def begin(self, client_id: str, submit: Submit, host: str, answer: asyncio.Future) -> SessionRun | None:
        """A session step may run (its client's, in order, within the limits): what the executor is told of it.
        ``answer``: the step's result to come (a close waits for it)."""
        step = submit.session
        if step is None:
            return None
        room = self.sessions.begin(client_id, step.id, submit.program, step.step, step.ttl, time.monotonic(),
                                   host, step.state_bytes)
        self.pushes.call_off(client_id, step.id)  # a step of it still waiting for a push is overtaken
        self._steps[(client_id, step.id)] = answer
        return SessionRun(Sessions.key(client_id, step.id), step.step, step.fresh, step.close, room)

    def done(self, client_id: str, submit: Submit, run: SessionRun, outputs: bytes, state_bytes: int,
             input_hash: str, flops: int, wall_time_us: int, started_at_us: int, ended_at_us: int,
             host: str) -> Receipt | None:
        """A step ran: it goes on its session's tab. Returns the receipt of a tab it filled, or of the session it
        ended, to go with its answer."""
        step = submit.session
        billed = self.sessions.done(
            client_id, step.id, state_bytes, time.monotonic(), input_hash=input_hash,
            output_hash=sha256_hex(outputs), flops=flops, wall_time_us=wall_time_us, started_at_us=started_at_us,
            ended_at_us=ended_at_us, max_price=submit.max_price, close=step.close)
        self.count()
        receipt = None
        if isinstance(billed, Ended):
            receipt = self.billing.ended(billed, await_payment=False)
        elif billed is not None:
            receipt = self.billing.tab(client_id, step.id, submit.program, billed, submit.max_price, host)
        if not step.close and not self.sessions.is_open(client_id, step.id):
            # Its client closed it while this step ran: the state goes, and the tab (only the steps it said it
            # received) is awaited from it like a closed session's.
            self.drop([run.key])
            if receipt is not None:
                self.billing.awaiting.expect(client_id, receipt)
        return receipt

    def failed(self, client_id: str, submit: Submit, run: SessionRun | None, error: BaseException,
               pushed: bytes | None) -> list[Action]:
        """A step did not end well (``run``: None if it never began): what is left to do, in order
        (:meth:`Sessions.step_failed`; the job path carries it out)."""
        step = submit.session
        busy = isinstance(error, WorkerBusy) and not isinstance(error, WorkerDraining)
        lost = isinstance(error, SessionLost) or (
            run is not None and step.step > 0 and not self.executor.holds_session(run.key))
        actions = self.sessions.step_failed(client_id, step, begun=run is not None, busy=busy, lost=lost,
                                            pushed=pushed)
        if run is not None:
            self.count()
        return actions

    def finished(self, client_id: str, session_id: str) -> None:
        self._steps.pop((client_id, session_id), None)

    def is_open(self, client_id: str, session_id: str) -> bool:
        return self.sessions.is_open(client_id, session_id)

    # --- ending -----------------------------------------------------------------------------------------------------

    async def close(self, client_id: str, session_id: str, received: int | None) -> tuple[bool, Receipt | None]:
        """Its client is done with it: whether it was open here, and the receipt of its tab."""
        self.pushes.forget(client_id, session_id)  # a step waiting for a push stops waiting
        step = self._steps.get((client_id, session_id))
        if step is not None:  # a step still running (its answer may be on its way): close once it is done
            await asyncio.wait([step], timeout=CLOSE_WAIT)
        ended = self.sessions.close(client_id, session_id, received)
        if ended is None:
            return False, None
        self.count()
        receipt = self.billing.ended(ended)
        self.drop([ended.key])
        return True, receipt

    async def _expire(self) -> None:
        """Sessions idle past their time lose their state (checked every second; a step in progress never expires)."""
        while True:
            await asyncio.sleep(1.0)
            gone = self.sessions.expired(time.monotonic())
            if gone:
                self.count()
                for ended in gone:
                    self.billing.ended(ended)  # work done is owed, whether or not its client comes back to pay
                logger.info("%d session(s) expired; their state is freed (%d session(s), %d bytes of state held now)",
                            len(gone), len(self.sessions), self.sessions.held_bytes)
                self.drop([ended.key for ended in gone])

    def drop(self, keys: list[str]) -> None:
        """Free sessions' state in the executors holding it, in the background (an executor busy with a long job
        frees it when that job is done; nothing waits for it meanwhile)."""
        async def drop() -> None:
            try:
                await self.executor.drop_sessions(keys)
            except GpunetError:  # the pool is closing: the state goes with its processes
                pass

        task = asyncio.ensure_future(drop())
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    def count(self) -> None:
        metrics.SESSIONS.set(len(self.sessions))
        metrics.SESSION_BYTES.set(self.sessions.held_bytes)
        self._paid.check()

    def all_billed(self) -> asyncio.Future:
        """Resolves once no session holds steps not billed yet. A client told that this worker drains moves its span
        and closes the session here, which bills those steps: a leaving worker waits for that."""
        return self._paid.wait()

    def end_all(self) -> int:
        """Leaving: end the sessions still open, signing the tabs their clients did not close (owed, not awaited: they
        stay in `gpunet ledger unpaid` until their clients pay). Returns how many tabs were signed."""
        ended = self.sessions.end_all()
        self.count()
        signed = sum(self.billing.ended(e, await_payment=False) is not None for e in ended)
        self.drop([e.key for e in ended])
        return signed
