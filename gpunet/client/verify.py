"""Verified jobs: redundancy (a quorum of distinct workers must agree), adaptive spot checks, and ``local-sample``
(this client's own computation is the check). Only agreeing results are paid; the rules are
:mod:`gpunet.client.trust`'s (docs/trust.md).

A vote among workers this client does not trust yet proves little (free identities can agree with each other), so
where no established worker is among the agreeing ones the client's own computation decides, when this machine can
run the job.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

from gpunet.client.attempts import Replicas
from gpunet.client.delivery import Deliverer
from gpunet.client.jobs import CheckedDelivery, JobResult, Prepared
from gpunet.client.local import LocalRuns
from gpunet.client.payment import Payment
from gpunet.client.reputation import Reputation
from gpunet.client.trust import agree, describe, majority, quorum
from gpunet.client.view import WorkerView
from gpunet.errors import GpunetError, JobRaised, NoWorkersAvailable, VerificationFailed
from gpunet.utils import plural

logger = logging.getLogger("gpunet.client")


@dataclass
class _Vote:
    """One verified job's results so far, and which of them are settled (paid, or refused on purpose)."""

    p: Prepared
    replicas: Replicas = field(default_factory=Replicas)
    results: list[CheckedDelivery] = field(default_factory=list)
    settled: set[int] = field(default_factory=set)


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
            for i, c in enumerate(vote.results):
                if i not in vote.settled:
                    if raises:
                        self.reputation.record(c.worker_id, "invalid")
                    self.payment.settlement.refuse(c.delivery, "a result for a job that raises" if raises else
                                                   "job abandoned before its results were compared")
            raise

    async def _one_more(self, vote: _Vote, checker: bool = True) -> None:
        # Unguessable: a worker that ran one replica must not be able to tell which ids the others will have.
        # Checkers are drawn at random (Router.choose_checker), never by price or claimed speed.
        vote.results.append(await self.deliverer.deliver(vote.p, f"{vote.p.job_id}.{secrets.token_hex(8)}",
                                                         vote.replicas, checker=checker))

    async def _verify(self, vote: _Vote) -> JobResult:
        p, results = vote.p, vote.results
        if p.req.verify == "local-sample" and p.req.redundancy == 1:
            return await self._check_locally(vote)
        k = p.req.redundancy
        if k > 1:
            await self._enough_for(p, k)
        copies = [asyncio.ensure_future(self._one_more(vote, checker=i > 0)) for i in range(k)]
        try:
            await asyncio.gather(*copies)
        except BaseException:
            for task in copies:
                task.cancel()
            raise
        checked = k > 1
        if p.req.verify == "adaptive" and k == 1 and self.reputation.should_check(results[0].worker_id):
            k, checked = 2, True
            try:
                await self._one_more(vote)
            except NoWorkersAvailable:  # nobody to compare with: this client checks it itself, or says it did not
                return await self._check_alone(vote)
        group = majority([c.outputs for c in results])
        while (group is None or len(group) < quorum(k)) and len(results) < 2 * k - 1:
            await self._one_more(vote)
            group = majority([c.outputs for c in results])
        quorate = group is not None and len(group) >= quorum(k)
        # An answer counts as vouched for when an established worker is among those giving it. Otherwise identities
        # this client does not know yet agree with each other, which free identities can always arrange: the
        # client's own computation decides instead (see docs/trust.md, "Against free identities").
        trusted = quorate and any(self.reputation.established(results[i].worker_id) for i in group)
        if not trusted and p.inputs is not None:
            own = await self._own_verdict(vote)
            if own is not None:
                group, trusted, quorate = own, True, True
        if not quorate:
            raise VerificationFailed(
                f"job {p.job_id[:12]}: {len(results)} results, no {quorum(k)} agree: "
                + describe([c.outputs for c in results], [c.worker_id for c in results]))
        for i, c in enumerate(results):
            if i not in group:
                # Only a trusted verdict brands the dissenter a liar: two fresh sybils outvoting an honest worker
                # must not turn it into the one recorded as lying.
                if trusted:
                    self.reputation.record(c.worker_id, "rejected")
                vote.settled.add(i)  # refused on purpose
                self.payment.settlement.refuse(c.delivery, "result outvoted by the majority of redundant results")
                logger.warning("Worker %s returned a result the majority rejected (job %s); it is not paid%s",
                               c.worker_id[-8:], p.job_id[:12],
                               "" if trusted else " (no established worker in that majority: not held against it)")
        if not trusted:  # agreement among workers this client does not trust yet, and it could not check itself
            logger.warning("Job %s: the agreeing results come from workers this client has not come to trust, and it "
                           "could not compute the job itself; returned marked unchecked", p.job_id[:12])
        attempts = [c.worker_id for c in results]
        result = None
        for i in group:
            vote.settled.add(i)
            outcome = await self.payment.pay(p, results[i], attempts, checked=checked and trusted, trusted=trusted)
            result = result or outcome
        self.reputation.save()
        return result

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
        """An adaptive spot check with no second worker to ask: the client's own computation is the check. If this
        machine cannot run the job, the result is returned marked unchecked (never silently taken as checked)."""
        p, results = vote.p, vote.results
        own = await self._own_verdict(vote) if p.inputs is not None else None
        if own is None:
            logger.warning("No second worker to spot-check job %s; its result is returned marked unchecked "
                           "(future.checked is False)", p.job_id[:12])
            vote.settled.add(0)
            return await self.payment.pay(p, results[0], [], checked=False)
        for i, c in enumerate(results):
            if i not in own:
                self.reputation.record(c.worker_id, "rejected")
                vote.settled.add(i)
                self.payment.settlement.refuse(c.delivery,
                                               "result differs from the client's own computation of the job")
        vote.settled.add(own[0])
        result = await self.payment.pay(p, results[own[0]], [c.worker_id for c in results], checked=True,
                                        trusted=True)
        self.reputation.save()
        return result

    async def _own_verdict(self, vote: _Vote) -> list[int] | None:
        """The results that agree with this client's own computation of the job, asking further (randomly drawn)
        workers until one does; None when this machine cannot run the job (then the vote stands as it is)."""
        p, results = vote.p, vote.results
        try:
            mine = await self.local.compute(p)
        except JobRaised:  # it raises here: the results in hand were made up, not checked ones
            raise
        except (GpunetError, TimeoutError) as e:
            logger.warning("Could not compute job %s here to settle whom to trust (%s)", p.job_id[:12],
                           e or "not within the job's timeout")
            return None
        good = [i for i, c in enumerate(results) if agree(c.outputs, mine)]
        while not good:
            logger.warning("No result of job %s agrees with this client's own computation; asking another worker",
                           p.job_id[:12])
            await self._one_more(vote)
            if agree(results[-1].outputs, mine):
                good = [len(results) - 1]
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
        try:
            mine = await self.local.compute(p)
        except JobRaised:  # it raises here: the result in hand was made up, not a checked one
            raise
        except (GpunetError, TimeoutError) as e:  # this machine cannot run it (memory, time): not the worker's fault
            logger.warning("Could not compute job %s here to check it (%s); its result is returned marked unchecked",
                           p.job_id[:12], e)
            vote.settled.add(0)
            return await self.payment.pay(p, results[0], [], checked=False)
        while True:
            c = results[-1]
            vote.settled.add(len(results) - 1)
            if agree(c.outputs, mine):
                result = await self.payment.pay(p, c, [x.worker_id for x in results], checked=True, trusted=True)
                self.reputation.save()
                return result
            self.reputation.record(c.worker_id, "rejected")
            self.payment.settlement.refuse(c.delivery, "result differs from the client's own computation of the job")
            logger.warning("Worker %s returned a result that differs from this client's own computation (job %s); "
                           "it is not paid, and the job goes to another worker", c.worker_id[-8:], p.job_id[:12])
            results.append(await self.deliverer.deliver(p, f"{p.job_id}.{secrets.token_hex(8)}", vote.replicas))
