"""Verified jobs: redundancy (a quorum of distinct workers must agree), adaptive spot checks, and ``local-sample``
(this client's own computation is the check). Only agreeing results are paid; the rules are
:mod:`gpunet.client.trust`'s (docs/trust.md).

A vote among workers this client does not trust yet proves little (free identities can agree with each other), so
where no established worker is among the agreeing ones the client's own computation decides, when this machine can
run the job. That check has time of its own (:func:`~gpunet.client.jobs.check_seconds`), from when it begins: workers
that answer at the last moment of the job's time cannot leave it none. A redundant job whose vote nothing settles
raises VerificationFailed and pays nobody; it is never returned unchecked.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

from gpunet.client.attempts import Replicas
from gpunet.client.delivery import Deliverer
from gpunet.client.jobs import CheckedDelivery, JobResult, Prepared, check_seconds
from gpunet.client.local import LocalRuns
from gpunet.client.payment import Payment
from gpunet.client.reputation import Reputation
from gpunet.client.trust import agree, describe, majority, quorum
from gpunet.client.view import WorkerView
from gpunet.errors import GpunetError, JobRaised, JobRejected, JobTimeout, NoWorkersAvailable, VerificationFailed
from gpunet.utils import plural

logger = logging.getLogger("gpunet.client")


@dataclass
class _Vote:
    """One verified job's results so far, and which of them are settled (paid, or refused on purpose)."""

    p: Prepared
    replicas: Replicas = field(default_factory=Replicas)
    results: list[CheckedDelivery] = field(default_factory=list)
    settled: set[int] = field(default_factory=set)
    check_until: float | None = None  # monotonic: the end of the check's own time, once the check has begun

    def until(self) -> float:
        """When the check of these results must end: its own time (the job's timeout again, within its deadline),
        counted from the first call, never from when the workers answered."""
        if self.check_until is None:
            self.check_until = time.monotonic() + check_seconds(self.p.req)
        return self.check_until


#: What ends the search for one more result, leaving the results in hand to be settled: out of time, nobody left,
#: everyone left refused it.
_NO_MORE = (JobTimeout, NoWorkersAvailable, JobRejected)
#: Further workers asked at once when no result agrees with the client's own computation.
FURTHER_AT_ONCE = 2


class Verifier:
    def __init__(self, deliverer: Deliverer, payment: Payment, view: WorkerView, local: LocalRuns,
                 reputation: Reputation):
        self.deliverer, self.payment, self.view, self.local = deliverer, payment, view, local
        self.reputation = reputation

    async def run(self, p: Prepared) -> JobResult:
        """Redundant or adaptive: collect results from distinct workers until a quorum agrees, pay only that."""
        vote = _Vote(p)
        try:
            return await self._verify(vote)
        except BaseException as e:
            # Whatever went wrong (a replica failed, the caller cancelled), no result we did not pay for stays open.
            raises = isinstance(e, JobRaised) and e.confirmed_here  # it raises here: those results were made up
            why = ("a result for a job that raises" if raises else
                   "the job's results could not be settled (VerificationFailed): none is paid"
                   if isinstance(e, VerificationFailed) else "job abandoned before its results were compared")
            for i, c in enumerate(vote.results):
                if i not in vote.settled:
                    if raises:
                        self.reputation.record(c.worker_id, "invalid")
                    self.payment.settlement.refuse(c.delivery, why)
            raise

    async def _one_more(self, vote: _Vote, checker: bool = True, until: float | None = None) -> None:
        """One more result, from a worker not asked yet, by ``until`` (the job's deadline by default)."""
        # Unguessable: a worker that ran one replica must not be able to tell which ids the others will have.
        # Checkers are drawn at random (Router.choose_checker), never by price or claimed speed.
        vote.results.append(await self.deliverer.deliver(vote.p, f"{vote.p.job_id}.{secrets.token_hex(8)}",
                                                         vote.replicas, checker=checker, deadline=until))

    def _reject(self, vote: _Vote, i: int, why: str, brand: bool) -> None:
        """Result ``i`` is not the answer: refused (its worker unpaid), and held against its worker if ``brand``
        (a verdict this client trusts)."""
        if brand:
            self.reputation.record(vote.results[i].worker_id, "rejected")
        vote.settled.add(i)
        self.payment.settlement.refuse(vote.results[i].delivery, why)

    async def _verify(self, vote: _Vote) -> JobResult:
        p, results = vote.p, vote.results
        if p.req.verify == "local-sample" and p.req.redundancy == 1:
            return await self._check_locally(vote)
        k = p.req.redundancy
        if k > 1:
            await self._enough_for(p, k)
        # A copy out of the job's time leaves the others' results to the check, in its own time (why no further
        # result could be had: ``short``); without any, the job timed out.
        short = await self._copies(vote, k)
        checked = k > 1
        if p.req.verify == "adaptive" and k == 1 and self.reputation.should_check(results[0].worker_id):
            k, checked = 2, True
            try:
                await self._one_more(vote)
            except _NO_MORE:  # nobody to compare with (in time): this client checks it itself, or says it did not
                return await self._check_alone(vote)
        group = majority([c.outputs for c in results])
        while short is None and (group is None or len(group) < quorum(k)) and len(results) < 2 * k - 1:
            try:
                await self._one_more(vote)
            except _NO_MORE as e:  # out of the job's time (a late answer took it) or of workers: the results in
                short = e  # hand are settled below, in the check's own time
                break
            group = majority([c.outputs for c in results])
        group, how = await self._settle(vote, group, quorum(k))
        trusted = how is not None
        if group is None or (not trusted and p.req.redundancy > 1):
            # Fail closed: an answer nothing settles is not returned to a redundant request, and nobody is paid.
            raise VerificationFailed(self._unsettled(vote, group, quorum(k), short))
        for i in range(len(results)):
            if i not in group and i not in vote.settled:
                # Only a trusted verdict brands the dissenter a liar: two fresh sybils outvoting an honest worker
                # must not turn it into the one recorded as lying.
                self._reject(vote, i, "result differs from the client's own computation of the job" if how == "own"
                             else "result outvoted by the majority of redundant results", brand=trusted)
                logger.warning("Worker %s returned a result the %s rejected (job %s); it is not paid%s",
                               results[i].worker_id[-8:], "client's own computation" if how == "own" else "majority",
                               p.job_id[:12], "" if trusted else
                               " (no established worker in that majority: not held against it)")
        if not trusted:  # an adaptive spot check among workers this client does not trust yet, and it could not
            # compute the job itself: returned as an unchecked job is (a redundant request never gets here)
            logger.warning("Job %s: the agreeing results come from workers this client has not come to trust, and it "
                           "could not compute the job itself; returned marked unchecked", p.job_id[:12])
        return await self._pay(vote, group, checked=checked and trusted, trusted=trusted)

    async def _pay(self, vote: _Vote, paid: list[int], checked: bool, trusted: bool) -> JobResult:
        """Pay every result in ``paid`` (they agree, and each did the work); the first is the answer."""
        attempts = [c.worker_id for c in vote.results]
        result = None
        for i in paid:
            vote.settled.add(i)
            outcome = await self.payment.pay(vote.p, vote.results[i], attempts, checked=checked, trusted=trusted)
            result = result or outcome
        self.reputation.save()
        return result

    async def _copies(self, vote: _Vote, k: int) -> JobTimeout | None:
        """The job's first ``k`` copies, side by side. One that ran out of the job's time (a late answer, or none) is
        returned once the others are in, so that their results are settled rather than lost (raised when no result
        came at all); any other error is raised at once, the other copies cancelled."""
        pending = {asyncio.ensure_future(self._one_more(vote, checker=i > 0)) for i in range(k)}
        late = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    error = task.exception()
                    if isinstance(error, JobTimeout):
                        late = late or error
                    elif error is not None:
                        raise error
        finally:
            for task in pending:
                task.cancel()
        if late is not None and not vote.results:
            raise late
        return late

    async def _settle(self, vote: _Vote, group: list[int] | None, need: int) -> tuple[list[int] | None, str | None]:
        """Whom to believe, and why ("vouched", "own", or None: nothing this client trusts). A quorum vouched for by
        an established worker stands. Otherwise this client's own computation decides; and where this machine cannot
        compute the job, established workers not asked yet are drawn as checkers while any is left. Both in the
        check's own time (``_Vote.until``), however late the answers came."""
        results = vote.results

        def vouched(g: list[int] | None) -> bool:  # a quorum of distinct workers: one may not be two votes
            return g is not None and len({results[i].worker_id for i in g}) >= need and any(
                self.reputation.established(results[i].worker_id) for i in g)

        if vouched(group):
            return group, "vouched"
        if vote.p.inputs is not None:
            own = await self._own_verdict(vote)
            if own is not None:
                return own, "own"
        for _ in range(len(self._established_left(vote))):
            try:
                await self._one_more(vote, until=vote.until())
            except _NO_MORE:
                break
            group = majority([c.outputs for c in results])
            if vouched(group):
                return group, "vouched"
        return (group if group is not None and len(group) >= need else None), None

    def _established_left(self, vote: _Vote) -> list[str]:
        """Workers established with this client that have not given (or been asked for) a result of this job."""
        asked = {c.worker_id for c in vote.results} | vote.replicas.taken
        return [w for w in self.view.router.workers if w not in asked and self.reputation.established(w)]

    def _unsettled(self, vote: _Vote, group: list[int] | None, need: int, short: Exception | None) -> str:
        results, job = vote.results, vote.p.job_id[:12]
        if group is None:
            text = f"job {job}: {len(results)} results, no {need} agree"
        else:
            text = (f"job {job}: {len(group)} of {len(results)} results agree, but none of the workers giving them is "
                    "established with this client, and it could not compute the job itself to settle it: not "
                    "returned unchecked, and nobody is paid")
        if short is not None:
            text += f" (no further result could be had: {short})"
        return text + ": " + describe([c.outputs for c in results], [c.worker_id for c in results])

    async def _enough_for(self, p: Prepared, k: int) -> None:
        """Redundancy ``k`` needs k distinct workers: NoWorkersAvailable, with the count, before any copy is sent (the
        copies that ran would be wasted work, refused unpaid). Workers still appearing are waited for a while, as
        the first ones are."""
        n = await self.view.could_take(p.req, k)
        if n < k:
            raise NoWorkersAvailable(
                f"redundancy={k} needs {k} distinct workers, but only {n} of the "
                f"{plural(len(self.view.router.workers), 'known worker')} in network {self.view.network!r} could "
                f"take this job: lower redundancy, or ease the requirements")

    async def _check_alone(self, vote: _Vote) -> JobResult:
        """An adaptive spot check with no second worker to ask (or none in the job's time): the client's own
        computation is the check, in its own time. If this machine cannot run the job, the result is returned marked
        unchecked (never silently taken as checked)."""
        p, results = vote.p, vote.results
        own = await self._own_verdict(vote) if p.inputs is not None else None
        if own is None:
            logger.warning("No second worker to spot-check job %s; its result is returned marked unchecked "
                           "(future.checked is False)", p.job_id[:12])
            vote.settled.add(0)
            return await self.payment.pay(p, results[0], [], checked=False)
        for i in range(len(results)):
            if i not in own and i not in vote.settled:
                self._reject(vote, i, "result differs from the client's own computation of the job", brand=True)
        return await self._pay(vote, own, checked=True, trusted=True)

    async def _own_verdict(self, vote: _Vote) -> list[int] | None:
        """The results that agree with this client's own computation of the job, asking further (randomly drawn)
        workers until one does, all in the check's own time; VerificationFailed (every result refused, its worker
        recorded as lying) when none does. None when this machine cannot compute the job in that time."""
        p, results = vote.p, vote.results
        until = vote.until()
        try:
            mine = await self.local.compute(p, until)
        except JobRaised:  # it raises here: the results in hand were made up, not checked ones
            raise
        except (GpunetError, TimeoutError) as e:
            logger.warning("Could not compute job %s here to settle whom to trust (%s)", p.job_id[:12],
                           e or f"not within {check_seconds(p.req):g} s")
            return None
        good = [i for i, c in enumerate(results) if agree(c.outputs, mine)]
        if not good:
            logger.warning("No result of job %s agrees with this client's own computation; asking other workers",
                           p.job_id[:12])
            good = await self._further(vote, mine, until)
        return good

    async def _further(self, vote: _Vote, mine, until: float) -> list[int]:
        """The results of further workers, drawn at random and asked ``FURTHER_AT_ONCE`` at a time by ``until``,
        that agree with this client's own computation ``mine``: asked until one does. Several at once, so that a liar
        that stalls until the end of the check holds up only its own ask. None agreeing: VerificationFailed, every
        result refused and its worker recorded as lying (the client's own run proved each wrong)."""
        results, start = vote.results, len(vote.results)
        asking: set[asyncio.Future] = set()
        short = None  # why no further worker could be asked
        try:
            while True:
                while short is None and len(asking) < FURTHER_AT_ONCE:
                    asking.add(asyncio.ensure_future(self._one_more(vote, until=until)))
                if not asking:
                    break
                done, asking = await asyncio.wait(asking, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    error = task.exception()
                    if isinstance(error, _NO_MORE):
                        short = short or error
                    elif error is not None:
                        raise error
                if any(agree(c.outputs, mine) for c in results[start:]):
                    break
        finally:
            for task in asking:
                task.cancel()
            if asking:
                await asyncio.wait(asking)  # a result that came meanwhile is in ``results``: judged below
        good = [i for i in range(start, len(results)) if agree(results[i].outputs, mine)]
        if not good:
            for i in range(len(results)):
                if i not in vote.settled:
                    self._reject(vote, i, "result differs from the client's own computation of the job", brand=True)
            self.reputation.save()
            raise VerificationFailed(
                f"job {vote.p.job_id[:12]}: none of its {len(results)} results agrees with this client's own "
                f"computation of it, and no further worker could be had ({short}); nobody is paid")
        return good

    async def _check_locally(self, vote: _Vote) -> JobResult:
        """verify="local-sample": on adaptive's schedule, the client computes the job itself and pays only a result
        that agrees. A worker that disagrees is recorded as rejected, not paid, and the job goes to another worker
        (checked against the same local answer) until one agrees. Nothing another worker says is trusted, so
        identities that check each other gain nothing."""
        p, results = vote.p, vote.results
        results.append(await self.deliverer.deliver(p, p.job_id, vote.replicas))
        if not self.reputation.should_check(results[0].worker_id):
            vote.settled.add(0)
            return await self.payment.pay(p, results[0], [], checked=False)
        until = vote.until()  # its own time, however late the answer came
        try:
            mine = await self.local.compute(p, until)
        except JobRaised:  # it raises here: the result in hand was made up, not a checked one
            raise
        except (GpunetError, TimeoutError) as e:  # this machine cannot run it (memory, time): not the worker's fault
            logger.warning("Could not compute job %s here to check it (%s); its result is returned marked unchecked",
                           p.job_id[:12], e)
            vote.settled.add(0)
            return await self.payment.pay(p, results[0], [], checked=False)
        if agree(results[0].outputs, mine):
            good = [0]
        else:
            self._reject(vote, 0, "result differs from the client's own computation of the job", brand=True)
            logger.warning("Worker %s returned a result that differs from this client's own computation (job %s); "
                           "it is not paid, and the job goes to other workers", results[0].worker_id[-8:],
                           p.job_id[:12])
            good = await self._further(vote, mine, until)
        for i in range(len(results)):
            if i not in good and i not in vote.settled:
                self._reject(vote, i, "result differs from the client's own computation of the job", brand=True)
        return await self._pay(vote, good, checked=True, trusted=True)
