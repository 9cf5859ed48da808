"""The job path on a worker: screen, de-duplicate, receive, wait its turn, run, sign. Both job doors
(:mod:`gpunet.worker.doors`) call :meth:`Jobs.execute`; what to take is decided by the pure
:mod:`~gpunet.worker.state.admission`, whose turn it is by :mod:`~gpunet.worker.turns`, what a run earns by
:mod:`~gpunet.worker.billing`, and a session step's bookkeeping by :mod:`~gpunet.worker.sessions`.

Job ids are per client: the same (client, job id) is never run twice; a repeat waits for, or gets, the first run's
answer and the same receipt, so a retry is never billed twice. Every size is checked before it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from gpunet.errors import (
    DeadlineUnreachable,
    ExecutorDied,
    GpunetError,
    JobFailed,
    JobPreempted,
    JobRejected,
    JobTimeout,
    SessionLost,
    WeightsMismatch,
    WorkerBusy,
)
from gpunet.identity import Identity
from gpunet.ledger import tabs
from gpunet.ledger.receipts import Receipt
from gpunet.ledger.store import Ledger
from gpunet.protocol import INTERACTIVE, PIECE, RUN, Submit
from gpunet.protocol import holding
from gpunet.rpc import RPC
from gpunet.utils import LRU, wait_out
from gpunet.worker import metrics, steptrace
from gpunet.worker.batching import Rows, Together
from gpunet.worker.billing import Billing
from gpunet.worker.executor import DryRun, RefFiles
from gpunet.worker.faults import NONE, Faults
from gpunet.worker.handoff import Handoff
from gpunet.worker.holdings import HoldingKeys
from gpunet.worker.payloads import FROM_CLIENT, FROM_COPY, FROM_PEERS, Inputs
from gpunet.worker.peers import Fetcher, PieceServer
from gpunet.worker.proofs import Prover
from gpunet.worker.sessions import SessionHost
from gpunet.worker.state.admission import Admission
from gpunet.worker.state.lanes import Ticket
from gpunet.worker.state.limits import SessionLimits, SessionRun
from gpunet.worker.state.owners import Owners
from gpunet.worker.state.pushes import Pushes
from gpunet.worker.state.sessions import Bill, PushOn, Reoffer
from gpunet.worker.turns import Turns
from gpunet.worker.uploads import Upload, Uploads, content_hash
from gpunet.worker.weights import Weights

logger = logging.getLogger("gpunet.worker")

#: An executor killed by a job counts as this many stopped jobs against its client (see Admission): a crash is no
#: accident an honest client makes often, and each one costs the worker a new process and what it had cached.
CRASH_WEIGHT = 5
MAX_RECENT_RESULTS = 4096
#: Upload tokens kept per program (gpunet.protocol.holding): the latest few clients' that sent or proved it.
MAX_TOKENS = 4


@dataclass
class Answer:
    """What the worker answers a job with: its outputs and receipt (and, for a session step, what it cost, billed
    later by its session's tab)."""

    outputs: bytes
    receipt: Receipt | None  # None: a session step its session's tab bills later (gpunet.ledger.tabs)
    state_bytes: int = 0  # a session step: what the session's state holds on this worker
    flops: int = 0
    wall_time_us: int = 0
    started_at_us: int = 0
    ended_at_us: int = 0
    input_hash: str | None = None  # a step whose input was pushed: what it ran on, for its client to compare


@dataclass
class _Job:
    """An admitted job: its answer to come (a retry of the same id waits for it), once running its task, and the
    program's bytes if this job brought them (other jobs for that program use this copy meanwhile)."""

    answer: asyncio.Future
    run: asyncio.Task | None = None
    ticket: Ticket | None = None  # its place in the lanes, once its bytes are in
    upload: Upload | None = None
    got: Inputs | None = None  # its bytes, once here
    session: SessionRun | None = None  # a session step, once begun
    charged: int = 0  # payload bytes charged to the worker's buffer budget, given back when the job ends
    awaits_push: str | None = None  # the session whose pushed input this step waits for (a cancel calls that off)
    pushed: bytes | None = None  # the pushed input it took (given back if the step is refused as busy: it is retried)
    marks: dict[str, int] | None = None  # a session step's, while GPUNET_STEP_TRACE is set (gpunet.worker.steptrace)
    together: Together | None = None  # the steps of its group message, let into the lanes at once


class Jobs:
    """The jobs of one worker, from admission to receipt, and the rooms they pass through."""

    def __init__(self, *, identity: Identity, executor, ledger: Ledger, admission: Admission,
                 record: Callable[[], Any], spool_dir: str | None = None, device: str = "cpu",
                 peer_rate: float | None = None, session_limits: SessionLimits | None = None, faults: Faults = NONE,
                 weights: Weights | None = None, batch_sessions: bool = True):
        """``device``: where speed challenges run (the executors' device: the speed a worker proves is theirs);
        ``peer_rate``: the most bytes a second it serves programs to other workers at (None: no cap);
        ``spool_dir``: where big inputs are written as they arrive (None: kept in memory); ``batch_sessions``:
        sessions' steps that wait together may run as one forward (gpunet.worker.batching)."""
        self.identity, self.executor, self.admission, self.limits = identity, executor, admission, admission.limits
        self.spool_dir, self.faults = spool_dir, faults
        # Finished answers, kept for retries of the same job id; one client's up to its share of the bytes (its own
        # oldest go first: one big answer, or many, must not push every other client's out).
        self.results: LRU[tuple[str, str], Answer] = LRU(
            MAX_RECENT_RESULTS, self.limits.recent_results_bytes, owner=lambda key: key[0],
            share=self.limits.buffer_share)
        self.billing = Billing(identity, ledger, admission, find_receipt=self._recent_receipt)
        self.turns = Turns(admission, executor)
        self.rows = Rows(executor)  # sessions' steps started together, run as one forward (gpunet.worker.batching)
        self.batch_sessions = batch_sessions
        pushes = Pushes()
        self.sessions = SessionHost(session_limits or SessionLimits(), executor, self.billing, pushes)
        self.handoff = Handoff(identity.peer_id, self.sessions.sessions, pushes, self.limits, faults)
        self.prover = Prover(admission, record, identity, device)
        # Who may run what is held here without sending it (a hash is no capability), and the keys that check the
        # proofs of holding clients and fetching peers present (gpunet.protocol.holding).
        self.owners = Owners()
        disk = getattr(executor, "disk", None)
        self.keys = HoldingKeys(disk)
        self.weights = weights or Weights(disk=disk)  # what programs name by reference (gpunet.worker.weights)
        self.weights.own_id = identity.peer_id
        self.uploads = Uploads()
        # Upload tokens of the programs clients sent here or pointed here (gpunet.protocol.holding): grants made with
        # them fetch the pieces, while the program comes and once it is cached.
        self._tokens: LRU[str, frozenset[bytes]] = LRU(4096)
        self._jobs: dict[tuple[str, str], _Job] = {}
        # Programs between workers (gpunet.worker.peers): pieces of what the disk cache holds, served to peers, and
        # programs this worker lacks fetched from them (set up once the network is there).
        self.piece_server = PieceServer(disk, peer_rate, coming=self._public_upload_coming,
                                        corrupt=faults.corrupt_pieces, may_serve=self._may_serve,
                                        tensors=self.weights.for_peer) if disk is not None else None
        self.fetcher: Fetcher | None = None

    @property
    def lanes(self):
        return self.turns.lanes

    async def start(self, rpc: RPC) -> None:
        self.handoff.start(rpc)
        self.sessions.start()
        if self.piece_server is not None:
            await self.piece_server.start(rpc)
            self.fetcher = Fetcher(rpc, self.identity.peer_id, spool_dir=self.spool_dir)

    async def stop(self) -> None:
        self.admission.drain()
        self.sessions.stop()
        self.handoff.stop()

    def _public_upload_coming(self, program_hash: str) -> Upload | None:
        """The public program on its way here (its pieces served as they arrive), if any."""
        upload = self.uploads.coming(program_hash)
        if upload is None or upload.private or self.owners.is_private(program_hash):
            return None
        return upload

    async def _may_serve(self, program_hash: str, peer_id: str, grant: bytes | None, upload: Upload | None = None,
                         from_disk: bool = True) -> bool:
        """Whether a peer may fetch a program's pieces: it is shared, or the peer presents a grant from a client that
        holds it, made for this holder and that peer (gpunet.protocol.holding). Pieces of a copy still coming
        (``upload``) go against that copy's own upload token: the client that sent those (unchecked) bytes may hand
        them on. The disk's checked copy goes against the holding key, a token that came with bytes proven to be the
        program's, or the coming copy's token once its bytes hash to the program."""
        me = self.identity.peer_id
        if self.owners.is_shared(program_hash):
            return True
        by_token = upload is not None and upload.token is not None and holding.verifies(
            upload.token, grant, PIECE, me, peer_id)
        if by_token:  # its client sends it this program too: it fetches the same copy (and serves what it has)
            upload.met(peer_id)
        if not from_disk:
            return by_token
        if by_token and await upload.proven():
            return True
        if any(holding.verifies(t, grant, PIECE, me, peer_id) for t in self._tokens.get(program_hash) or ()):
            return True
        return await self.keys.verifies(program_hash, grant, PIECE, me, peer_id)

    def _token_proven(self, submit: Submit, upload: Upload | None) -> None:
        """The upload token that came with bytes now proven to be the program's (they loaded against its hash, or
        its client proved it holds what the peers served): grants made with it fetch the cached copy too."""
        if upload is None or upload.token is None or submit.private or self.owners.is_private(submit.program):
            return
        tokens = self._tokens.get(submit.program) or frozenset()
        if upload.token not in tokens:  # a few clients' tokens per program (each costs an HMAC per piece served)
            self._tokens.put(submit.program, frozenset([*list(tokens)[-(MAX_TOKENS - 1):], upload.token]))

    def _recent_receipt(self, key: tuple[str, str]) -> Receipt | None:
        answer = self.results.get(key)
        return answer.receipt if answer is not None else None

    def busy(self, why: str = "worker queue is full") -> WorkerBusy:
        metrics.JOBS.labels("busy").inc()
        return WorkerBusy(why, self.admission.queue_length)

    # --- the path ---------------------------------------------------------------------------------------------------

    async def execute(self, client_id: str, submit: Submit, payloads, reader, host: str = "",
                      together: Together | None = None) -> Answer:
        """Admit, de-duplicate and run one job; WorkerBusy when the worker (or this client's share of it) is full.
        ``payloads`` brings what the job lacks (gpunet.worker.payloads); ``reader``: the stream its client hangs up
        on (None: the unary door); ``together``: a session step's group (gpunet.worker.batching.Together)."""
        if submit.session is None:
            arrived = time.monotonic()
            answer = await self._admit_and_run(client_id, submit, payloads, reader, host)
            await self.faults.hold(arrived, submit.timeout)
            return answer
        # A session step moves its session's state on in the executor: once begun, it is seen through with its
        # bookkeeping, whatever becomes of the door that carried it (the daemon cancels a unary call whose caller
        # has gone), and its answer waits in the recent results for the client's retry.
        step = asyncio.ensure_future(self._admit_and_run(client_id, submit, payloads, reader, host, steptrace.begin(),
                                                         together))
        step.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody may be left to ask
        if together is not None:  # ended, perhaps before it got to the lanes: the rest of its group goes on
            step.add_done_callback(lambda _: together.leave(submit.job_id))
        return await asyncio.shield(step)

    async def _admit_and_run(self, client_id: str, submit: Submit, payloads, reader, host: str = "",
                             marks: dict[str, int] | None = None, together: Together | None = None) -> Answer:
        """A job whose bytes must still arrive takes no queue place while they do (see
        :mod:`~gpunet.worker.state.admission`): it counts as an upload of its client and address, its payload is
        charged to the buffer budget before it is read, and it is admitted once the bytes are in."""
        key = (client_id, submit.job_id)
        # Before the screen: from the screen to counting the job as coming (admission.coming) nothing may await, or
        # jobs screened together would each find the credit line open.
        await self._proven(client_id, submit)
        try:
            self.admission.screen(client_id, submit, host=host)
        except JobRejected:
            if not self.billing.awaiting.arriving_from(client_id):
                raise
            # Its countersignatures came riding on this very call (or one just before) and wait a moment to be
            # filed in a batch: filed now, so that a client paying as it goes is never refused as owing them.
            await self.billing.awaiting.file_arriving(client_id)
            self.admission.screen(client_id, submit, host=host)
        known = self.results.get(key)
        if known is not None:  # a retry of a finished job: same answer, same receipt, no second bill
            return known
        if key in self._jobs:  # a retry while the first run is still going: wait for it
            return await asyncio.shield(self._jobs[key].answer)
        need_program = self._screen_new(client_id, submit, host)
        if submit.session is not None and submit.session.input_from is not None:  # its input comes from a peer
            self.handoff.may_wait(client_id, submit, need_program)
        payloads.precheck(submit, need_program)
        uploading = need_program or submit.inputs is None
        if uploading and not self.admission.begin_upload(client_id, host):
            raise self.busy("this client (or its address) has as many uploads in progress as this worker takes")
        job = self._jobs[key] = _Job(asyncio.get_running_loop().create_future(), marks=marks, together=together)
        self.admission.coming(client_id, submit.job_id, host)  # (no await since the screen: counted as screened)
        try:
            answer = await self._bring_and_run(key, job, submit, payloads, reader, host, need_program, uploading)
        except BaseException as e:
            self._not_answered(client_id, submit, job, e)
            raise
        finally:
            self._let_go(key, job, submit, host)
        self.results.put(key, answer, len(answer.outputs))
        return answer

    def _screen_new(self, client_id: str, submit: Submit, host: str) -> bool:
        """What a job not seen before must pass before any of its bytes are read; returns whether it must bring its
        program."""
        self.admission.check_share(client_id, host)  # (a retry adds nothing: its answer is held already)
        # One job, one receipt, ever: a second receipt for a client's job id would read as fraud by this worker (and
        # a run nobody pays for). Job ids are each client's own: another client using the same id (guessed, or seen
        # while running a replica) is a different job, so it can neither block nor take over this one. (A session
        # step is billed in its session's tabs, under job ids no step can take: no receipt is kept under its own.)
        if submit.session is None and self.billing.books.signed(client_id, submit.job_id) is not None:
            raise JobRejected(f"job id {submit.job_id[:16]} was already run here and its result is no longer kept; "
                              "use a fresh job id")
        if tabs.parse(submit.job_id) is not None:
            raise JobRejected("job ids of the form <session>.<nonce>.<first>-<last> name session tabs; use another")
        if submit.session is not None and submit.lane != INTERACTIVE:
            raise JobRejected("session steps are interactive: a step stopped for another job would lose the state")
        if not self.admission.has_room(client_id, submit.lane):  # busy or draining first: no use switching doors
            raise self.busy()
        if submit.deadline is not None:
            self.turns.check_deadline(submit)
        return not self._holds_for(client_id, submit.program)

    async def _bring_and_run(self, key: tuple[str, str], job: _Job, submit: Submit, payloads, reader, host: str,
                             need_program: bool, uploading: bool) -> Answer:
        client_id = key[0]
        pushed = submit.session is not None and submit.session.input_from is not None
        with self._upload_place(client_id, host, uploading):
            if pushed:
                submit = await self._pushed_input(client_id, job, submit)
            job.got = await self._receive(client_id, job, submit, payloads, need_program,
                                          charge=partial(self._charge, job, client_id, host))
        steptrace.mark(job.marks, "input")
        # Once its bytes are here: a slow upload must not hold a session place (or its reserved memory).
        job.session = self.sessions.begin(client_id, submit, host, job.answer)
        got = job.got
        metrics.BYTES_IN.inc(len(got.inputs) + (len(got.program or b"") if job.upload else 0))
        await self._check_program(client_id, submit, got)
        if got.origin == FROM_PEERS:  # checked against the hash, and its client proved it holds them
            self._token_proven(submit, job.upload)
        answer = await self._run_with_weights(key, job, submit, payloads, reader, host)
        if got.origin == FROM_CLIENT:  # its own bytes, checked against the hash as they loaded: it holds them
            self._holder(client_id, submit)
            self._token_proven(submit, job.upload)
        if pushed:
            answer.input_hash = got.input_hash
        if job.session is not None:
            answer.receipt = self.sessions.done(
                client_id, submit, job.session, answer.outputs, answer.state_bytes, got.input_hash, answer.flops,
                answer.wall_time_us, answer.started_at_us, answer.ended_at_us, host)
        job.answer.set_result(answer)
        if submit.session is not None and submit.session.push_to is not None:
            self.handoff.push_on(client_id, submit.session.push_to, answer.outputs)
        if job.marks is not None:
            steptrace.mark(job.marks, "answered")
            asyncio.get_running_loop().call_soon(steptrace.write, self.identity.peer_id, submit.session.id,
                                                 submit.session.step, job.marks)
        return answer

    async def _run_with_weights(self, key: tuple[str, str], job: _Job, submit: Submit, payloads, reader,
                                host: str) -> Answer:
        """Run it, with the weights its program names by reference found first (gpunet.worker.weights); a checkpoint
        file that no longer matches its hashes costs one more try, those weights brought from the client."""
        private = submit.private or self.owners.is_private(submit.program)
        program = job.got.program
        checked = job.got.origin != FROM_CLIENT  # a client's own bytes are checked as they load

        async def ask(wanted, store):  # what the worker found nowhere: from the client (the stream door only), or
            async with asyncio.timeout(submit.timeout):  # from workers it names (for half the job's time)
                await payloads.fetch_tensors(wanted, store, submit.timeout / 2)

        # A session's later steps run in the executor that loaded the program at step 0 (it holds the state): it
        # needs none of the weights, so none is looked up (or asked for again) on a decode step's path.
        loaded = program is None and submit.session is not None and submit.session.step > 0
        refs = None if loaded else await self.weights.prepare(key[0], submit.program, program, private, ask, checked)
        for attempt in range(2):
            try:
                batches = self._rows_key(job.session, submit, job.got) is not None
                with self._admitted(key[0], submit.lane, job.together if batches else None, submit.program):
                    answer = await self._run(key, job, submit, reader, host, refs)
                if not checked:
                    await self.weights.loaded(submit.program, program)
                return answer
            except WeightsMismatch as e:
                if attempt or refs is None:
                    raise
                self.weights.condemn(e.hashes)
                refs = await self.weights.prepare(key[0], submit.program, program, private, ask, checked)
        raise AssertionError("unreachable")

    # --- who may run what is held here (gpunet.worker.state.owners) ------------------------------------------------

    async def _proven(self, client_id: str, submit: Submit) -> None:
        """A client naming a program held here that it did not send here becomes one of its holders if its proof of
        holding (``Submit.holds``) checks against this worker's copy. Without one it is asked for the bytes, as if
        the program were not here: nothing of the program (not even its input shapes) is told to it."""
        if (submit.holds is None or submit.private or self.owners.may_run(submit.program, client_id)
                or self.owners.is_private(submit.program) or not self.executor.has_program(submit.program)):
            return
        if await self.keys.verifies(submit.program, submit.holds, RUN, self.identity.peer_id, client_id):
            self.owners.add(submit.program, client_id, shared=submit.shared)

    async def _check_program(self, client_id: str, submit: Submit, got: Inputs) -> None:
        """A program that came with a job runs for its client only if it is the program's: bytes the client sent must
        hash to it (checked here when a copy is held already, else by the executor as they load). One fetched from
        the peers it named came here only if its proof of holding checked against the bytes (gpunet.worker.payloads):
        it holds them."""
        if got.origin == FROM_CLIENT and self.executor.has_program(submit.program) and not self._holds_for(
                client_id, submit.program):
            if await asyncio.to_thread(content_hash, got.program) != submit.program:
                raise JobRejected("the program bytes sent do not match the program's hash")
        if got.origin == FROM_PEERS:
            self._holder(client_id, submit)

    def _holder(self, client_id: str, submit: Submit) -> None:
        marks_private = submit.private and submit.program not in self.executor.disk  # public stays public
        self.owners.add(submit.program, client_id, private=marks_private, shared=submit.shared)

    def _not_answered(self, client_id: str, submit: Submit, job: _Job, error: BaseException) -> None:
        """What a job that did not end well leaves behind: for a session step, what its session decides (a pushed
        input held again for the retry of a step refused as busy, the next span told to ask the client, a tab billed,
        state freed); for any job, the retries waiting on its answer get the error."""
        if submit.session is not None:
            for action in self.sessions.failed(client_id, submit, job.session, error, job.pushed):
                if isinstance(action, Reoffer):
                    self.handoff.give_back(client_id, submit, action.data)
                elif isinstance(action, PushOn):
                    self.handoff.push_on(client_id, action.to, None)  # the next span's worker asks the client
                elif isinstance(action, Bill):
                    self.billing.ended(action.ended)
                else:
                    self.sessions.drop([action.key])
        job.answer.set_exception(error if isinstance(error, GpunetError)
                                 else JobFailed(f"job did not finish: {type(error).__name__}"))
        job.answer.exception()  # retrieved: a waiting retry gets it, an unwatched one does not warn

    def _let_go(self, key: tuple[str, str], job: _Job, submit: Submit, host: str) -> None:
        """Whatever became of it, the job gives back what it held."""
        del self._jobs[key]
        self.admission.not_coming(*key)
        if job.session is not None:
            self.sessions.finished(key[0], submit.session.id)
        if job.upload is not None:  # run or not, the program is cached now or will not be from this copy
            self.uploads.end(job.upload)
        self.admission.release_bytes(job.charged, key[0], host)
        if job.got is not None:
            job.got.release()
        job.got = job.upload = None

    @contextlib.contextmanager
    def _upload_place(self, client_id: str, host: str, uploading: bool):
        try:
            yield
        finally:
            if uploading:
                self.admission.upload_done(client_id, host)

    def _rows_key(self, session: SessionRun | None, submit: Submit, got: Inputs | None) -> str | None:
        """The key this step may ride in a batched forward under (gpunet.worker.batching.Rows.key); None: alone."""
        if not self.batch_sessions or self.executor is None or got is None:
            return None
        return self.rows.key(session, submit.program, got.program, got.inputs)

    @contextlib.contextmanager
    def _admitted(self, client_id: str, lane: str, together: Together | None = None, program: str = ""):
        """A place in the lanes while it runs; the steps of one group for one program that batch share one (they
        run as one forward: see Together)."""
        if (together is not None and self.admission.accepting and self.admission.paused is None
                and together.share_place(program, lane)):
            self.admission.joined()
        else:
            if not self.admission.admit(client_id, lane):
                raise self.busy()
            if together is not None:
                together.took_place(program, lane)
        try:
            yield
        finally:
            if together is None or together.drop_place(program, lane):
                self.admission.released(client_id, lane)  # (the last to leave gives the place back)
            else:
                self.admission.left()

    # --- its bytes --------------------------------------------------------------------------------------------------

    async def _pushed_input(self, client_id: str, job: _Job, submit: Submit) -> Submit:
        job.awaits_push = submit.session.id
        try:
            submit = await self.handoff.input_of(client_id, submit)
        finally:
            job.awaits_push = None
        job.pushed = submit.inputs
        return submit

    def _holds_for(self, client_id: str, program_hash: str) -> bool:
        """Whether this client's job may run without sending the program: it is held here, and this client sent or
        proved it, or it is shared."""
        return self.owners.may_run(program_hash, client_id) and self.executor.has_program(program_hash)

    def _charge(self, job: _Job, client_id: str, host: str, nbytes: int, dry: bool = False) -> None:
        self.admission.charge(nbytes, client_id, host, dry=dry)
        if not dry:
            job.charged += nbytes

    async def _receive(self, client_id: str, job: _Job, submit: Submit, payloads, need_program: bool,
                       charge: Callable[[int], None]) -> Inputs:
        """What the job lacks, each program crossing the link once: a job whose program is already on its way in (or
        being loaded) for another job uses that copy instead of asking its own client for one more."""
        tried: set[Upload] = set()
        while need_program:
            upload = self.uploads.coming(submit.program)
            if upload is None or upload in tried:
                break  # none on its way (or only one we gave up on): this job brings its own
            if upload.client_id != client_id and (upload.private or not self.owners.may_run(submit.program, client_id)):
                break  # another client's copy of a program this one never sent or proved: it brings its own
            tried.add(upload)
            program = await upload.share(limit=submit.timeout)
            if program is not None:
                got = await payloads.fetch(submit, need_program=False, charge=charge)
                got.program, got.origin = program, FROM_COPY
                return got
            # That copy failed or is too slow. The program may have been loaded meanwhile, or another job may have
            # taken over bringing it: look again.
            need_program = not self._holds_for(client_id, submit.program)
        if not need_program:
            return await payloads.fetch(submit, need_program=False, charge=charge)
        job.upload = self.uploads.begin(submit.program, client_id, private=submit.private)
        got = await payloads.fetch(submit, need_program=True, charge=charge, sink=job.upload)
        job.upload.arrived(got.program)
        return got

    # --- its run ----------------------------------------------------------------------------------------------------

    async def _run(self, key: tuple[str, str], job: _Job, submit: Submit, reader, host: str = "",
                   refs: RefFiles | None = None) -> Answer:
        """Run a job, stoppable while queued or running: by a cancel call from its client, or (stream door) by the
        client hanging up. Either way the run is stopped (see Executor.run), so abandoned work stops using the machine.

        A session step is the exception to the hang-up: it runs to its end (within its time limit). Its client asks
        for it again (a stream can break on the way without anyone leaving) and gets the answer it missed; cut short,
        the step would cost the span a move and a replay elsewhere."""
        job.ticket = Ticket(key[0], submit.lane, submit.max_price, host=host, job=key[1])
        job.run = asyncio.ensure_future(self._run_now(key, submit, job.got, host, job.session, job.ticket, refs,
                                                      job.marks, job.together))
        self.turns.track(job.ticket, job.run)
        # The client sends nothing between its payload and our answer, so any byte or EOF here means it is gone.
        gone = asyncio.ensure_future(reader.read(1)) if reader is not None else None
        tasks = {job.run, gone} if gone is not None else {job.run}
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if job.session is not None and not job.run.done():
                await asyncio.wait([job.run])
        finally:
            for task in tasks:  # the job if still running (a hang-up, a cancel), and always the watch
                task.cancel()
            # Let the job give back its slot and executor before we answer; the reader is free again only once the
            # watch has really ended. A second cancel of ours must not leave either behind.
            await wait_out(*tasks)
            self.turns.untrack(job.ticket)
        stopped = job.run.cancelled() or isinstance(job.run.exception(), JobPreempted)
        if stopped and job.ticket.preempted and self.turns.leaving:
            raise self.turns.leaving_error()
        if stopped and job.ticket.preempted and self.admission.paused is not None:
            raise self.admission.pause_error()  # the owner took the machine back: run it elsewhere
        if job.run.cancelled():
            if job.ticket.preempted:
                raise JobPreempted("an interactive job needed this worker's slot: the job was stopped, not billed; "
                                   "run it again elsewhere or later", self.admission.queue_length)
            raise JobFailed("job stopped before it finished: its client cancelled it or went away")
        return job.run.result()

    async def _run_now(self, key: tuple[str, str], submit: Submit, got: Inputs, host: str,
                       session: SessionRun | None, ticket: Ticket, refs: RefFiles | None = None,
                       marks: dict[str, int] | None = None, together: Together | None = None) -> Answer:
        client_id, job_id = key
        ticket.rows = self._rows_key(session, submit, got)  # steps that wait together may run as one forward
        try:
            await self.turns.wait(ticket, submit.deadline, together)
        except BaseException:
            self.rows.gone(ticket)  # (started with others as it was cancelled: they do not wait for it)
            raise
        timeout = submit.timeout
        if submit.deadline is not None:  # due by then: it never runs past it
            timeout = min(timeout, submit.deadline - time.time())
            if timeout <= 0:
                self.rows.gone(ticket)
                self.turns.ended(ticket, 0.0)
                raise DeadlineUnreachable("the job's deadline passed as it was about to start")
        if session is not None and session.step > 0:  # its executor must be free: lower lanes' work there stops
            for other in self.executor.running_where(session.key):
                if other.lane != INTERACTIVE:
                    self.turns.stop_run(other)
        self.admission.started()
        done = False
        started, clock = time.time(), time.monotonic()
        logger.debug("Running job %s for client %s (%s lane)", job_id[:12], client_id[-8:], ticket.lane)
        dry = DryRun()  # what its dry run took, whatever happens (see _dry_run_cost)
        steptrace.mark(marks, "sent")
        try:
            with metrics.JOB_SECONDS.time():
                # ProgramNotCached (evicted since admission) reaches the client as "not_cached": it resends the program.
                # Tagged with its ticket: the pool can stop it (preempted, paused) and say where it runs.
                # A client's own bytes run as they are (fresh), checked against the hash as they load, even where a
                # copy is loaded already (one it may not run: it became a holder only by sending these).
                # Started with others (gpunet.worker.batching): one forward for them all (None: none came).
                result = None if ticket.rows is None else await self.rows.run(
                    ticket, submit.program, session, got.inputs, timeout)
                if result is None:
                    result = await self.executor.run(
                        submit.program, got.program, got.inputs, timeout=timeout,
                        private=submit.private or self.owners.is_private(submit.program), tag=ticket,
                        spare_sessions=session is None, dry=dry,
                        **({"fresh": True} if got.origin == FROM_CLIENT else {}),
                        **({"refs": refs} if refs is not None else {}),
                        **({"session": session} if session is not None else {}))
            done = True
            if marks is not None:
                steptrace.mark(marks, "back")
                marks.update(zip(steptrace.EXECUTOR_MARKS, result.marks))
            self._dry_run_cost(client_id, host, dry, billed=True)
        except BaseException as e:
            self._run_failed(key, submit, ticket, host, dry, e)
            raise
        finally:
            self.admission.ended(done)
            self.turns.ended(ticket, time.monotonic() - clock)
        ended = max(time.time(), started)  # a clock stepped back mid-job must not make the receipt unsignable
        outputs = self.faults.outputs(result.outputs)
        if submit.session is not None:  # billed by its session's tab (see SessionHost.done)
            metrics.JOBS.labels("done").inc()
            return Answer(outputs, None, result.state_bytes, int(result.flops), int(result.wall_time * 1e6),
                          int(started * 1e6), int(ended * 1e6))
        receipt = self.billing.job(key, submit, ticket, got.input_hash, outputs, result.flops, result.wall_time,
                                   started, ended)
        metrics.JOBS.labels("done").inc()
        logger.debug("Job %s for client %s done in %.2f s (%.3g GFLOP)", job_id[:12], client_id[-8:],
                     ended - started, result.flops / 1e9)
        return Answer(outputs, receipt)

    def _run_failed(self, key: tuple[str, str], submit: Submit, ticket: Ticket, host: str, dry: DryRun,
                    error: BaseException) -> None:
        """What a run that did not end well counts against its client, and the unbilled work it leaves."""
        client_id, job_id = key
        if isinstance(error, (ExecutorDied, JobTimeout)):  # the job cost this worker its executor: counted
            metrics.JOBS.labels(type(error).__name__).inc()
            self._dry_run_cost(client_id, host, dry)
            self.admission.stopped_running(client_id, weight=CRASH_WEIGHT if isinstance(error, ExecutorDied) else 1,
                                           host=host)
            if isinstance(error, ExecutorDied):
                logger.warning("Job %s for client %s killed its executor: %s", job_id[:12], client_id[-8:], error)
            self.billing.unbilled(key, submit, "timed_out" if isinstance(error, JobTimeout) else "failed", str(error))
        elif isinstance(error, JobPreempted):  # stopped at a node boundary (the worker's doing): nothing counts
            self._preempted(key, submit)
        elif isinstance(error, WeightsMismatch):  # this worker's own checkpoint files: tried again, nothing counts
            return
        elif isinstance(error, GpunetError):
            metrics.JOBS.labels(type(error).__name__).inc()
            self._dry_run_cost(client_id, host, dry)
            if isinstance(error, JobFailed) and not isinstance(error, SessionLost):  # it ran, and broke: its own error
                self.billing.unbilled(key, submit, "failed", str(error))
                if ticket.victim is not None:  # another client's job was stopped for one that fails: not free
                    self.admission.stopped_running(client_id, host=host)
        elif isinstance(error, asyncio.CancelledError):
            if ticket.preempted:  # the worker's choice, not the client's doing: nothing counts against it
                self._preempted(key, submit)
                return
            metrics.JOBS.labels("cancelled").inc()
            self._dry_run_cost(client_id, host, dry)
            self.admission.stopped_running(client_id, host=host)
            logger.info("Job %s for client %s stopped while running (cancelled, or the client went away)",
                        job_id[:12], client_id[-8:])
            self.billing.unbilled(key, submit, "cancelled", "its client cancelled it or went away while it ran")

    def _preempted(self, key: tuple[str, str], submit: Submit) -> None:
        if self.turns.leaving:
            metrics.JOBS.labels("drained").inc()
            self.billing.unbilled(key, submit, "drained", "stopped: this worker left the network before it finished")
            return
        if self.admission.paused is not None:
            metrics.JOBS.labels("paused").inc()
            self.billing.unbilled(key, submit, "paused", f"stopped: this worker paused ({self.admission.paused})")
            return
        metrics.JOBS.labels("preempted").inc()
        logger.info("Batch job %s for client %s stopped for an interactive job (not billed; its client runs it again)",
                    key[1][:12], key[0][-8:])
        self.billing.unbilled(key, submit, "preempted", "stopped for an interactive job; its client runs it again")

    def _dry_run_cost(self, client_id: str, host: str, dry: DryRun, billed: bool = False) -> None:
        """Count a dry run's time against its client like stopped jobs (Admission.dry_ran); one stopped before it
        ended (the run timed out or was cancelled) counts what it may have been."""
        seconds = dry.cost(time.monotonic())
        if seconds and self.admission.dry_ran(client_id, seconds, billed=billed, host=host):
            logger.info("A dry run for client %s took %.2f s (%s): counted against it", client_id[-8:], seconds,
                        "billed" if billed else "not billed")

    # --- a client's call to stop one -------------------------------------------------------------------------------

    def cancel(self, client_id: str, job_id: str) -> bool:
        """A client stops one of its own jobs (queued or running: see Executor.run for how a run stops); whether it
        was stopped. A step still waiting for its pushed input stops waiting."""
        job = self._jobs.get((client_id, job_id))
        if job is not None and job.awaits_push is not None:
            self.handoff.pushes.call_off(client_id, job.awaits_push)
            return True
        # Only a job still running can be stopped (cancel() is False for one that has just finished).
        return job is not None and job.run is not None and job.run.cancel()
