"""Getting a job to a worker and its answer back: the loop that carries out :mod:`gpunet.client.attempts`' decisions
over the transport, and a session's steps, each on the one worker that holds its state.

A failed, timed-out or busy worker is skipped and the job retried elsewhere, as
:class:`~gpunet.client.attempts.Attempts` decides; every try's job id is the same, so a worker answers it once and
bills it once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, Sequence

import torch

from gpunet import protocol
from gpunet.client import attempts as tries
from gpunet.client.attempts import Attempts, Replicas
from gpunet.client.jobs import CheckedDelivery, Delivery, Estimates, JobRequest, JobResult, Prepared, prepare_step
from gpunet.client.local import LocalRuns, small_enough
from gpunet.client.payment import Payment
from gpunet.client.routing import Requirements
from gpunet.client.settlement import Settlement
from gpunet.client.transport import BaseTransport
from gpunet.client.view import WorkerView
from gpunet.dht.records import WorkerEntry
from gpunet.errors import (
    GpunetError,
    JobFailed,
    JobRaised,
    JobTimeout,
    LocalNetworkDown,
    NetworkError,
    PayFirst,
    ProgramNotCached,
    ProtocolError,
    SessionLost,
    WorkerBusy,
    WorkerDraining,
)
from gpunet.ledger.receipts import Receipt
from gpunet.ledger.tabs import Tab

logger = logging.getLogger("gpunet.client")

#: Seconds a job that already tried workers waits for them to reappear when the network looks empty (their records
#: lapse together while they restart) before it fails with NoWorkersAvailable.
EMPTY_NETWORK_WAIT = 20.0
#: The longest a job refused at a worker's credit line waits for this client's countersignatures to land there.
PAY_UP_WAIT = 2.0


class PushedInputDiffers(JobFailed):
    """A pushed session step ran on an input other than the one the client holds for it (the span before pushed one
    thing and answered another, or this worker says so): its state there went on from the wrong input."""


class Deliverer:
    def __init__(self, transport: BaseTransport, view: WorkerView, settlement: Settlement, payment: Payment,
                 local: LocalRuns, estimates: Estimates, *, max_rejections: int = 3, max_resends: int = 2,
                 refresh_period: float = 2.0):
        self.transport, self.view, self.settlement, self.payment = transport, view, settlement, payment
        self.local, self.estimates = local, estimates
        self.max_rejections, self.max_resends, self.refresh_period = max_rejections, max_resends, refresh_period

    @property
    def router(self):
        return self.view.router

    # --- a job, to whichever worker can take it -------------------------------------------------------------------

    async def deliver(self, p: Prepared, job_id: str, replicas: Replicas, checker: bool = False,
                      deadline: float | None = None) -> CheckedDelivery:
        """One checked result from one worker not running another copy (``replicas``), retrying elsewhere on
        failure, by ``deadline`` (monotonic; the job's by default, a check's own for a checker drawn to settle a
        vote); an error says in ``attempts`` which workers it went to (``JobFuture.attempts``)."""
        attempts = Attempts(job_id, p.req, p.shape, p.deadline if deadline is None else deadline, replicas=replicas,
                            checker=checker, runs_here=small_enough(p), max_rejections=self.max_rejections,
                            max_resends=self.max_resends, empty_wait=EMPTY_NETWORK_WAIT,
                            look_pause=self.refresh_period / 4)
        try:
            return await self._deliver(p, attempts)
        except GpunetError as e:
            e.attempts = list(attempts.tried)
            raise

    async def _deliver(self, p: Prepared, attempts: Attempts) -> CheckedDelivery:
        while True:
            step = attempts.next(self.router, time.monotonic())
            if isinstance(step, tries.GiveUp):
                raise step.error from None
            if isinstance(step, tries.Wait):
                await self.view.room_or(step.until)
                continue
            if isinstance(step, tries.Look):
                await self.view.look_again(step.pause)
                continue
            self.view.say_skips()
            outcome, answer = await self._try(p, attempts, step.worker, step.seconds)
            for action in attempts.on(step.worker, outcome, time.monotonic()):
                if isinstance(action, tries.Accept):
                    return answer
                await self._carry_out(action, p)

    async def _try(self, p: Prepared, attempts: Attempts, worker: WorkerEntry, seconds: float
                   ) -> tuple[tries.Outcome, CheckedDelivery | None]:
        """Send the job to ``worker`` and check its answer: what it came to, and the answer if it passed."""
        req = p.req
        ahead = self.view.started(worker.id)
        # Cold: sent before this worker was known to hold the program, so it waited for the program to arrive and
        # load (whether this job carried it or another one did).
        cold = not self.router.holds_program(worker, p.job.program_hash)
        t0 = time.perf_counter()
        holders = () if req.private else tuple(
            (h.id, tuple(h.record.maddrs[:protocol.MAX_HOLDER_MADDRS]))
            for h in self.router.holders(p.job.program_hash, exclude=worker.id)[:protocol.MAX_HOLDERS])
        request = JobRequest(attempts.job_id, p.job.program_hash, p.program, p.encoded, max(0.1, seconds),
                             p.max_price, p.max_output_bytes, private=req.private, shared=req.shared,
                             holders=holders, lane=req.priority, deadline=req.deadline,
                             weights=p.job.referenced, weights_named=len(p.job.manifest.refs),
                             weight_holders=self.router.checkpoint_holders(p.job, exclude=worker.id))
        try:
            try:
                async with asyncio.timeout(seconds):  # no extra task per job, unlike wait_for
                    delivery = await self.transport.submit(worker, request, cached=not cold,
                                                           settlement=self.settlement)
                    if p.input_hash is None:
                        p.input_hash = await p.hashing
            except JobRaised as e:
                return tries.Raised(e, await self.local.raises_here(p, attempts.deadline)), None
            except (TimeoutError, GpunetError) as e:  # the transport raises only gpunet errors
                return e, None
            try:
                outputs = self.payment.check(p, delivery)
            except GpunetError as e:
                return tries.WrongAnswer(e), None
        finally:
            self.view.finished(worker.id)
        compute = self.router.on_success(worker.id, p.shape, time.perf_counter() - t0, delivery.bytes_sent,
                                         delivery.transfer_seconds, cold=cold, ahead=ahead)
        return tries.Answered(), CheckedDelivery(delivery, outputs, list(attempts.tried), compute)

    async def _carry_out(self, action: tries.Action, p: Prepared) -> None:
        if isinstance(action, tries.Strike):
            ban = self.view.strike(action.worker_id, action.outcome)
            if action.say is not None:
                logger.log(action.level, "Worker %s %s; banned %.0f s, retrying elsewhere", action.worker_id[-8:],
                           action.say, ban)
        elif isinstance(action, tries.Busy):
            self.router.on_busy(action.worker_id)
        elif isinstance(action, tries.ProgramLost):
            self.router.on_program_lost(action.worker_id, p.job.program_hash)
        elif isinstance(action, tries.PayUp):
            logger.debug("Worker %s holds this client (or its address) at its credit line; paying up, then asking "
                         "it again", action.worker_id[-8:])
            await self.settlement.pay_up(action.worker_id, timeout=max(0.0, min(PAY_UP_WAIT,
                                                                                 p.deadline - time.monotonic())))
        elif isinstance(action, tries.Say):
            logger.log(action.level, "%s", action.message)
        elif isinstance(action, tries.Retry):
            if action.pause:
                await asyncio.sleep(action.pause)
        elif isinstance(action, tries.Raise):
            raise action.error from None

    # --- a session's step, to the worker that holds its state -------------------------------------------------------

    async def step(self, job, inputs: Sequence[torch.Tensor], worker_id: str, session: protocol.SessionStep,
                   state: Sequence[torch.Tensor], tab: Tab, req: Requirements,
                   check: Callable[[object, bool], Awaitable[None]] | None = None,
                   pushed: asyncio.Future | None = None) -> JobResult:
        """One session step on the worker that holds (or, step 0, will hold) its state; never retried elsewhere:
        a lost worker raises, and the caller rebuilds the session on another (gpunet.client.sessions). Only a busy
        worker is waited for, a lost program resent, and a stream broken on the way asked again once.
        ``state``: the first state (sent when the step opens a session that is not ``fresh``; its shapes are what
        the dry run needs either way). ``tab``: this session's open tab on that worker, which the step joins; when
        the step fills it (or closes the session) the worker's receipt for it comes back, checked against the tab and
        countersigned (``JobResult.receipt``; None for the other steps), and the tab starts again. ``check``: awaited
        with the step's outputs (and whether a receipt came) before anything is paid (gpunet.client.sessions.audit);
        what it raises refuses the receipt.

        ``session.input_from``: the input is pushed to the worker by that worker (``inputs``: meta tensors of its
        shapes) and ``pushed`` resolves to the hash of the input this client holds for the step (the previous span's
        output); the worker says which it ran on, and PushedInputDiffers is raised when the two differ. Such a step
        has a job id of its own, so the same step sent afterwards with its input never gets this answer."""
        p, session = await prepare_step(job, inputs, session, state, req, self.estimates)
        resends = busy = pay_waits = 0
        redialled = False
        while True:
            worker = self.router.holding(worker_id)
            if worker is None:
                self.transport.forget(worker_id)
                raise SessionLost(f"worker {worker_id[-8:]} holding the session has left the network")
            remaining = p.deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(f"session step {p.job_id[:24]} did not finish within {req.timeout:g} s")
            cold = not self.router.holds_program(worker, job.program_hash)
            request = JobRequest(p.job_id, job.program_hash, p.program, p.encoded, max(0.1, remaining), p.max_price,
                                 p.max_output_bytes, private=req.private, shared=req.shared, session=session,
                                 weights=job.referenced, weights_named=len(job.manifest.refs),
                                 weight_holders=self.router.checkpoint_holders(job, exclude=worker_id))
            ahead = self.view.started(worker_id)
            t0 = time.perf_counter()
            delivery = None
            try:
                async with asyncio.timeout(remaining):
                    delivery = await self.transport.submit(worker, request, cached=not cold,
                                                           settlement=self.settlement)
                    if pushed is not None:
                        p.input_hash = await self._pushed_input(delivery, pushed)
                outputs = self.payment.check_step(p, delivery, session, tab)
            except (WorkerDraining, LocalNetworkDown):
                raise
            except NetworkError as e:
                relayed = worker.record.reachability == "relayed"
                if delivery is None and not redialled and (isinstance(e, ProtocolError) or relayed):
                    # The stream broke on the way (see attempts: the p2p daemon now and then closes one before the
                    # answer is through; a relay resets its circuits): ask the same worker again, once, before
                    # moving the span and replaying its steps elsewhere. The step's job id makes this safe: the
                    # worker answers a step it ran from its results, and one still running it joins.
                    redialled = True
                    logger.info("The connection to worker %s broke during session step %s (%s); asking again",
                                worker_id[-8:], p.job_id[:24], e)
                    continue
                self.view.strike(worker_id, "failure")
                raise
            except WorkerBusy:  # its queue is full for a moment: the state is there, wait for it (backing off)
                busy += 1
                await asyncio.sleep(min(0.5, 0.01 * 2 ** min(busy, 6)) * (0.5 + random.random()))
                continue
            except PayFirst:  # at its credit line: pay up and ask again (see attempts), not move the span
                pay_waits += 1
                if pay_waits > tries.MAX_PAY_WAITS:
                    raise
                await self.settlement.pay_up(worker_id,
                                             timeout=max(0.0, min(PAY_UP_WAIT, p.deadline - time.monotonic())))
                await asyncio.sleep(tries.PAY_PAUSE * 2 ** (pay_waits - 1))
                continue
            except ProgramNotCached:
                self.router.on_program_lost(worker_id, job.program_hash)
                resends += 1
                if resends > self.max_resends:
                    raise
                continue
            except asyncio.TimeoutError:
                self.view.strike(worker_id, "failure")
                raise JobTimeout(f"worker {worker_id[-8:]} took too long with session step {p.job_id[:24]}") from None
            finally:
                self.view.finished(worker_id)
            self.router.on_success(worker_id, p.shape, time.perf_counter() - t0, delivery.bytes_sent,
                                   delivery.transfer_seconds, cold=cold, ahead=ahead)
            if check is not None:
                try:
                    await check(outputs, delivery.receipt is not None)
                except BaseException as e:
                    if delivery.receipt is not None:
                        self.settlement.refuse(delivery, str(e) or "the step's check did not complete")
                    raise
            receipt = None
            if delivery.receipt is not None:
                receipt = self.payment.pay_tab(delivery, session.id, tab, p.max_price)
            return JobResult(outputs, worker_id, receipt, [worker_id], delivery.bytes_sent)

    async def _pushed_input(self, delivery: Delivery, pushed: asyncio.Future) -> str:
        """The hash of a pushed step's input, once this client holds that input too, if the worker ran on the same."""
        try:
            expected = await asyncio.shield(pushed)
            if delivery.input_hash != expected:
                raise PushedInputDiffers(
                    f"worker {delivery.worker_id[-8:]} ran the step on an input other than the previous span's output"
                    if delivery.input_hash is not None else
                    f"worker {delivery.worker_id[-8:]} did not say which input it ran a pushed step on")
        except BaseException:
            if delivery.receipt is not None:
                self.settlement.refuse(delivery, "the step's input is not the one this client holds")
            raise
        return expected

    async def close_session(self, worker_id: str, session_id: str, tab: Tab | None = None,
                            max_price: int | None = None) -> Receipt | None:
        """Free a session's state on its worker, and pay the receipt of the steps on ``tab`` (the ones not billed
        yet). None when there was nothing to pay, or the worker is gone (those steps then stay unpaid)."""
        # The tab as it stands now: a step still running when the session is closed (a Ctrl-C under it) may add
        # itself to it meanwhile, and the worker bills only what we say here we received.
        tab = tab.prefix(tab.steps) if tab is not None else None
        received = tab.first + tab.steps if tab is not None and tab.steps else None
        try:
            delivery = await self.transport.close_session(worker_id, session_id, received)
        except GpunetError:
            return None
        if delivery is None:
            return None
        if tab is None or not tab.steps:
            self.settlement.refuse(delivery, "this client holds no unbilled steps of that session")
            return None
        try:
            return self.payment.pay_tab(delivery, session_id, tab, max_price)
        except GpunetError as e:
            logger.warning("Worker %s closed session %s with a receipt this client refuses: %s", worker_id[-8:],
                           session_id[:12], e)
            return None
