"""``gpunet.Client`` and ``gpunet.AsyncClient``: twins over one :class:`~gpunet.client.core.ClientCore`.

``AsyncClient`` runs the core on the caller's event loop; ``Client`` runs it on a private loop in a background thread
and hands back ``concurrent.futures.Future`` s. Both take the same arguments and return the same things.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import weakref
from collections import deque
from functools import partial
from pathlib import Path
from typing import AsyncIterator, Iterable, Iterator, Sequence

from gpunet.client import sessions
from gpunet.client.core import ClientConfig, ClientCore
from gpunet.client.jobs import JobResult, check_call
from gpunet.client.sessions import AsyncRemoteSequential, RemoteSequential
from gpunet.client.routing import Requirements
from gpunet.config import DEFAULT_NETWORK
from gpunet.dht.records import WorkerEntry
from gpunet.errors import GpunetError
from gpunet.ledger.receipts import Receipt
from gpunet.ledger.store import Ledger, open_ledger
from gpunet.utils import new_event_loop


class JobFuture(concurrent.futures.Future):
    """A submitted job. ``result()`` is the output tensor(s); once done, ``worker_id`` and ``receipt`` say who ran it
    and what was paid, ``attempts`` lists every worker tried (also when it failed) and ``bytes_sent`` what the
    delivering one received.
    ``checked`` is True when the result was compared with another worker's (redundancy, or an adaptive spot check)
    and agreed; an adaptive job that found no second worker to check with says False here (and in the log)."""

    worker_id: str | None = None
    receipt: Receipt | None = None
    attempts: list[str] = []
    bytes_sent: int = 0
    checked: bool = False

    def _fill(self, result: JobResult) -> None:
        self.worker_id, self.receipt, self.attempts, self.bytes_sent, self.checked = (
            result.worker_id, result.receipt, result.attempts, result.bytes_sent, result.checked)

    def _settle(self, outcome) -> None:
        """Mirror a finished ``outcome`` (a concurrent future or an asyncio task of a JobResult) onto this future."""
        if self.done():  # cancelled by the caller meanwhile
            return
        if outcome.cancelled():
            self.cancel()
            return
        error = outcome.exception()
        if error is not None:
            self.attempts = list(error.attempts) if isinstance(error, GpunetError) else []
            self.set_exception(error)
            return
        result: JobResult = outcome.result()
        self._fill(result)
        self.set_result(result.outputs)


class AsyncJobFuture(asyncio.Future):
    """The awaitable twin of :class:`JobFuture`: ``await`` it for the outputs; ``worker_id``/``receipt`` once done."""

    worker_id: str | None = None
    receipt: Receipt | None = None
    attempts: list[str] = []
    bytes_sent: int = 0
    checked: bool = False
    _fill = JobFuture._fill
    _settle = JobFuture._settle


def _shut_down(core: ClientCore, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Close the core on its loop, then stop the loop (explicitly by ``Client.close``, or at interpreter exit)."""
    try:
        if thread.is_alive():
            asyncio.run_coroutine_threadsafe(core.close(), loop).result(timeout=60)
    finally:
        _stop_loop(loop, thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _progress(total: int | None, enabled: bool):
    if not enabled:
        return None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    # While running: the time left; once done: the time it took (not a frozen "0:00:00").
    progress = Progress(TextColumn("gpunet"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(elapsed_when_finished=True), transient=False)
    progress.start()
    task = progress.add_task("jobs", total=total)
    return progress, task


def _window(core: ClientCore, requirements: Requirements | None) -> int:
    """Jobs kept in flight by ``map``: enough to fill every eligible worker twice over."""
    return max(4, 2 * core.router.capacity(requirements or Requirements()))


class AsyncClient:
    """Submit jobs to a gpunet network from asyncio code. Use as ``async with AsyncClient(...) as client``."""

    def __init__(
        self,
        initial_peers: Sequence[str] | None = None,
        network: str = DEFAULT_NETWORK,
        data_dir: str | Path | None = None,
        config: ClientConfig | None = None,
    ):
        self._core = ClientCore(initial_peers, network, data_dir, config)

    @property
    def id(self) -> str:
        return self._core.id

    async def __aenter__(self) -> "AsyncClient":
        await self._core.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._core.close()

    def submit(self, job, *inputs, requirements: Requirements | None = None, **named) -> AsyncJobFuture:
        self._core.check_open()
        inputs = check_call(job, inputs, named)  # a wrong argument fails here, not later in the future
        future = AsyncJobFuture()
        task = asyncio.ensure_future(self._core.run(job, inputs, requirements))
        task.add_done_callback(future._settle)
        future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)
        return future

    async def map(
        self, job, *iterables: Iterable, requirements: Requirements | None = None, progress: bool = True
    ) -> AsyncIterator:
        """Like builtin ``map`` (one iterable per job input), in order, spread over the network."""
        window = _window(self._core, requirements)
        pending: deque[AsyncJobFuture] = deque()
        bar = _progress(_total(iterables), progress)
        try:
            for args in zip(*iterables):
                pending.append(self.submit(job, *_positional(args), requirements=requirements, **_named(args)))
                while len(pending) >= window:
                    yield await _advance(pending.popleft(), bar)
            while pending:
                yield await _advance(pending.popleft(), bar)
        finally:
            for f in pending:
                f.cancel()
            if bar:
                bar[0].stop()

    async def workers(self, refresh: bool = False) -> list[WorkerEntry]:
        if refresh:
            await self._core.refresh()
        return self._core.workers()

    def sequential(self, blocks, example_inputs, dynamic_shapes=None, *, spans: int | None = None,
                   initial_state=None, requirements: Requirements | None = None) -> AsyncRemoteSequential:
        """Like :meth:`Client.sequential`, awaited: ``await remote(x)``, ``async with remote.session() as s``."""
        self._core.check_open()
        return AsyncRemoteSequential(sessions.build(self._core, blocks, example_inputs, dynamic_shapes, spans,
                                                      initial_state, requirements))

    async def causal_lm(self, model_or_path, *, tokenizer=None, max_length: int | None = None,
                        spans: int | None = None, dtype=None, requirements: Requirements | None = None):
        """Like :meth:`Client.causal_lm`, awaited: ``await lm.generate(...)``, ``async for t in lm.stream(...)``."""
        from gpunet.client.llm import AsyncRemoteCausalLM, CausalLMCore

        self._core.check_open()
        core = await asyncio.to_thread(  # loading and tracing take seconds
            partial(CausalLMCore.open, self._core, model_or_path, tokenizer=tokenizer, dtype=dtype,
                    max_length=max_length, spans=spans, requirements=requirements))
        return AsyncRemoteCausalLM(core)

    @property
    def program_bytes_sent(self) -> int:
        """Program bytes uploaded to workers so far: about one copy per program, as workers fetch from each other."""
        return self._core.program_bytes_sent

    @property
    def weight_bytes_sent(self) -> int:
        """Of those, bytes of weights named by reference (``Job.by_reference``, ``causal_lm`` of a folder) that no
        worker found in its models dirs: 0 when the volunteers hold the checkpoint."""
        return self._core.weight_bytes_sent

    @property
    def ledger(self) -> Ledger:
        """This client's ledger of receipts (the one the client appends to), with every returned job in it."""
        if self._core.books is not None:
            self._core.books.flush()
        return self._core.ledger


def _positional(args: tuple) -> tuple:
    """map's items: one per iterable; a dict among them is a set of inputs by name (``{"input_ids": …}``)."""
    return tuple(a for a in args if not isinstance(a, dict))


def _named(args: tuple) -> dict:
    return {k: v for a in args if isinstance(a, dict) for k, v in a.items()}


async def _advance(future: AsyncJobFuture, bar):
    result = await future
    if bar:
        bar[0].advance(bar[1])
    return result


def _total(iterables: tuple) -> int | None:
    try:
        return min(len(it) for it in iterables)  # type: ignore[arg-type]
    except TypeError:
        return None


class Client:
    """Submit jobs to a gpunet network. Use as ``with Client(initial_peers=[...]) as client``."""

    def __init__(
        self,
        initial_peers: Sequence[str] | None = None,
        network: str = DEFAULT_NETWORK,
        data_dir: str | Path | None = None,
        config: ClientConfig | None = None,
    ):
        self._core = ClientCore(initial_peers, network, data_dir, config)
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gpunet-client", daemon=True)
        self._thread.start()
        self._local = threading.local()
        self._closed = False
        self._calls: set[asyncio.Task] = set()  # jobs and calls running for the caller: stopped by close()
        try:
            self._call(self._core.start())
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        # A script that ends without close() still files its receipts and sends the countersignatures it owes.
        self._shutdown = weakref.finalize(self, _shut_down, self._core, self._loop, self._thread)

    @property
    def id(self) -> str:
        return self._core.id

    def _call(self, coro):
        """Run ``coro`` on the client's loop and wait for it; a closed client (or one closed meanwhile) says so."""
        if self._closed:
            coro.close()
            raise GpunetError("client is closed")
        try:
            return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop).result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise GpunetError("the client was closed while this call ran") from None
            raise

    async def _tracked(self, coro):
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            return await coro
        finally:
            self._calls.discard(task)

    async def _stop_calls(self) -> None:
        """What still runs for the caller (other threads' jobs and steps): stopped before the core closes, so no
        one waits on a loop that is gone."""
        calls = [task for task in self._calls if task is not asyncio.current_task()]
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls, timeout=10)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            try:
                if self._thread.is_alive():
                    asyncio.run_coroutine_threadsafe(self._stop_calls(), self._loop).result(timeout=30)
            finally:
                self._shutdown()
        finally:
            ledger = getattr(self._local, "ledger", None)
            if ledger is not None:
                ledger.close()

    def submit(self, job, *inputs, requirements: Requirements | None = None, **named) -> JobFuture:
        """Send ``job`` with ``inputs`` (and inputs by name, ``input_ids=…``) to the network; returns at once with a
        future of the output(s), in the structure the module returned."""
        if self._closed:
            raise GpunetError("client is closed")
        inputs = check_call(job, inputs, named)  # a wrong argument fails here, not later in the future
        future = JobFuture()
        self._loop.call_soon_threadsafe(self._start, future, job, inputs, requirements)
        return future

    def _start(self, future: JobFuture, job, inputs, requirements) -> None:
        """On the client's loop: run the job as a task that settles ``future`` (one cross-thread hop each way)."""
        if future.cancelled():
            return
        if self._closed:  # closed between submit and now
            future.set_exception(GpunetError("client is closed"))
            return
        task = self._loop.create_task(self._core.run(job, inputs, requirements))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        task.add_done_callback(partial(self._settle, future))
        future.add_done_callback(lambda f: self._loop.call_soon_threadsafe(task.cancel) if f.cancelled() else None)

    def _settle(self, future: JobFuture, task: asyncio.Task) -> None:
        if task.cancelled() and self._closed and not future.done():
            future.set_exception(GpunetError("the client was closed before this job finished"))
        else:
            future._settle(task)

    def map(
        self, job, *iterables: Iterable, requirements: Requirements | None = None, progress: bool = True
    ) -> Iterator:
        """Like builtin ``map`` (one iterable per job input): results in order, jobs spread over many workers."""
        window = _window(self._core, requirements)
        pending: deque[JobFuture] = deque()
        bar = _progress(_total(iterables), progress)
        args_iter = zip(*iterables)
        try:
            for args in itertools.islice(args_iter, window):
                pending.append(self.submit(job, *_positional(args), requirements=requirements, **_named(args)))
            while pending:
                result = pending.popleft().result()
                if bar:
                    bar[0].advance(bar[1])
                for args in itertools.islice(args_iter, 1):
                    pending.append(self.submit(job, *_positional(args), requirements=requirements, **_named(args)))
                yield result
        finally:
            for f in pending:
                f.cancel()
            if bar:
                bar[0].stop()

    def sequential(self, blocks, example_inputs, dynamic_shapes=None, *, spans: int | None = None,
                   initial_state=None, requirements: Requirements | None = None) -> RemoteSequential:
        """A model spread over workers, Petals-style (docs/sessions.md): ``blocks`` (a transformer's layers, each an
        ``nn.Module`` passing one tensor on) are cut into ``spans`` contiguous spans (default: as few as the workers'
        memory allows), each traced into one job; ``remote(x)`` runs them in order, each where routing puts it, and
        ``remote.session()`` keeps each span's state (a stateful block is ``forward(x, *state) -> (y, *new_state)``
        with ``initial_state()``, or ``initial_state=[...]`` per block) on its worker between steps."""
        if self._closed:
            raise GpunetError("client is closed")
        return RemoteSequential(sessions.build(self._core, blocks, example_inputs, dynamic_shapes, spans,
                                                 initial_state, requirements), self._call)

    def causal_lm(self, model_or_path, *, tokenizer=None, max_length: int | None = None, spans: int | None = None,
                  dtype=None, requirements: Requirements | None = None):
        """A language model served by the network (docs/llm.md): a transformers causal LM, or the path of a
        checkpoint folder in Hugging Face layout (config.json, safetensors, tokenizer files; nothing is fetched).
        Embeddings and head run here; the decoder layers, HF's own, run in ``spans`` on workers, each keeping a
        static KV cache of ``max_length`` tokens per session. ``lm.generate(ids, max_new_tokens=...)`` returns what
        HF's ``generate`` returns; ``lm.stream(...)`` yields tokens as they come; ``lm(ids).logits``."""
        from gpunet.client.llm import CausalLMCore, RemoteCausalLM

        if self._closed:
            raise GpunetError("client is closed")
        core = CausalLMCore.open(self._core, model_or_path, tokenizer=tokenizer, dtype=dtype, max_length=max_length,
                                 spans=spans, requirements=requirements)
        return RemoteCausalLM(core, self._call)

    def workers(self, refresh: bool = False) -> list[WorkerEntry]:
        """The workers discovery sees now (refreshed in the background every couple of seconds)."""
        if refresh:
            self._call(self._core.refresh())
        return self._core.workers()

    @property
    def program_bytes_sent(self) -> int:
        """Program bytes uploaded to workers so far: about one copy per program, as workers fetch from each other."""
        return self._core.program_bytes_sent

    @property
    def weight_bytes_sent(self) -> int:
        """Of those, bytes of weights named by reference (``Job.by_reference``, ``causal_lm`` of a folder) that no
        worker found in its models dirs: 0 when the volunteers hold the checkpoint."""
        return self._core.weight_bytes_sent

    @property
    def ledger(self) -> Ledger:
        """This client's ledger, opened for the calling thread (SQLite connections are per thread), with every returned
        job in it (receipts still queued for the next group commit are written first)."""
        if not self._closed:
            self._call(self._core.flush_ledger())
        ledger = getattr(self._local, "ledger", None)
        if ledger is None:
            ledger = self._local.ledger = open_ledger(self._core.data_dir)
        return ledger
