"""Sessions batched on a span (issue 42): the batched program format, and an executor running several sessions'
steps of one LLM span as one forward, each session's rows its own."""

import asyncio
import json
import re
import urllib.request

import pytest
import torch
from torch.export import Dim

from gpunet.client.llm import adapter
from gpunet.client.sessions.spans import trace_spans
from gpunet.errors import JobRejected, SessionLost
from gpunet.job import tensors
from gpunet.job.format import Manifest
from gpunet.llm import load
from gpunet.testing.llm import save_checkpoint, tiny_causal_lm
from gpunet.testing.localnet import free_port
from gpunet.worker.executor import Executor, RunResult
from gpunet.worker.state.limits import SessionRun
from tests.swarm import wait_for

ROOM = 1 << 24


def _span(family: str = "llama"):
    model = adapter.prepare(tiny_causal_lm(family))
    blocks = adapter.blocks_of(model, 16)
    x = adapter.with_control(torch.zeros(1, 2, model.config.hidden_size))
    span, = trace_spans(blocks[:2], (x,), ({1: Dim("T", min=1, max=16)},), [(0, 2)], rows=Dim("B", min=1, max=8))
    return span, model.config.hidden_size


def _h(*shape: int) -> torch.Tensor:
    """A span step's input: random hidden states of ``shape``, and the control channel (no rewind)."""
    return adapter.with_control(torch.randn(*shape))


def _step(key: str, step: int, close: bool = False) -> SessionRun:
    return SessionRun(key, step, True, close, ROOM)


def _x(x: torch.Tensor) -> bytes:
    return tensors.encode({"input_0": x})


def _y(result) -> torch.Tensor:
    return tensors.decode(result.outputs)["output_0"]


def test_an_llm_span_declares_its_rows_and_a_session_holds_one():
    span, d = _span()
    m = span.job.manifest
    assert m.batch == "B" and m.dims["B"].min == 1
    assert all(s.shape[0] == "B" for s in (*m.inputs, *m.outputs))
    assert m.state_bytes == span.state_bytes  # one row: what a session holds
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize("change, reason", [
    (lambda raw: raw["dims"]["B"].update(min=2), "allow one row"),
    (lambda raw: raw.update(batch="T"), "first and only there"),
    (lambda raw: raw.update(batch="nope"), "name one of"),
    (lambda raw: raw.pop("state"), "stateful"),
])
def test_a_batch_dim_that_is_not_every_tensors_first_is_refused(change, reason):
    span, _ = _span()
    raw = json.loads(span.job.manifest.to_json())
    change(raw)
    with pytest.raises(JobRejected, match=reason):
        Manifest.from_json(json.dumps(raw).encode())


def test_an_executor_runs_sessions_steps_as_one_forward_each_row_its_own(tmp_path):
    """Sessions with different histories step together: each gets what it gets alone (to float rounding: CPU BLAS
    takes other kernels for one row than for several), bitwise the same whatever the other rows of its batch hold
    (a row that saw another's state would change), and moves its own state on. A step whose state is gone, whose
    input has another shape or more than one row fails alone; each row is billed what its step counts alone."""
    span, d = _span()
    job = span.job
    torch.manual_seed(1)
    prompts = {"A/s": _h(1, 5, d), "B/s": _h(1, 2, d), "C/s": _h(1, 7, d), "D/s": _h(1, 1, d)}
    nxt = {k: _h(1, 1, d) for k in prompts}

    async def open_all(ex, keys):
        await ex.drop_sessions(list(prompts))
        for key in keys:
            await ex.run(job.program_hash, job.to_bytes(), _x(prompts[key]), session=_step(key, 0))

    async def rows(ex, keys, step=1):
        return dict(zip(keys, await ex.run_rows(job.program_hash, [(_step(k, step), _x(nxt[k])) for k in keys])))

    async def scenario(ex):
        await open_all(ex, ["A/s", "B/s", "C/s"])
        alone = {k: _y(await ex.run(job.program_hash, None, _x(nxt[k]), session=_step(k, 1)))
                 for k in ("A/s", "B/s", "C/s")}
        await open_all(ex, ["A/s", "B/s"])
        with_b = await rows(ex, ["A/s", "B/s"])
        await open_all(ex, ["A/s", "C/s"])
        with_c = await rows(ex, ["C/s", "A/s"])
        assert torch.equal(_y(with_b["A/s"]), _y(with_c["A/s"]))
        for k, r in (*with_b.items(), *with_c.items()):
            assert r.rows == 2
            torch.testing.assert_close(_y(r), alone[k], rtol=1e-5, atol=1e-5)
        # Each row billed what its step counts alone (its client's own count): the same as the solo step's.
        await open_all(ex, ["A/s"])
        solo = await ex.run(job.program_hash, None, _x(nxt["A/s"]), session=_step("A/s", 1))
        assert with_c["A/s"].flops == with_c["C/s"].flops == solo.flops
        await open_all(ex, ["A/s", "C/s"])
        await rows(ex, ["A/s", "C/s"])
        # The states moved on: a third step, batched, from there.
        more = await rows(ex, ["A/s", "C/s"], step=2)
        assert all(r.state_bytes == job.manifest.state_bytes and r.rows == 2 for r in more.values())
        # A lost session, an input of another shape (two tokens, not one), two rows, a session twice: each alone.
        await ex.run(job.program_hash, None, _x(prompts["D/s"]), session=_step("D/s", 0))
        mixed = await ex.run_rows(job.program_hash, [
            (_step("A/s", 3), _x(nxt["A/s"])), (_step("gone/s", 3), _x(nxt["A/s"])),
            (_step("C/s", 3), _x(_h(1, 2, d))), (_step("D/s", 1), _x(_h(2, 1, d))),
            (_step("A/s", 4), _x(nxt["A/s"]))])
        assert isinstance(mixed[0].outputs, bytes) and isinstance(mixed[2].outputs, bytes)
        assert isinstance(mixed[1], SessionLost)
        assert isinstance(mixed[3], JobRejected)  # two rows are not one session's step
        assert isinstance(mixed[4], JobRejected)  # nor is a session's second step in the batch of its first
        assert ex.holds_session("C/s") and ex.holds_session("D/s")

    with Executor(processes=1, session_processes=1, memory_budget_bytes=1 << 30, cache_dir=tmp_path,
                  sandbox=False) as ex:
        asyncio.run(scenario(ex))



def batched_steps(port: int, metric: str = "gpunet_batched_steps_total") -> float:
    """What a worker's Prometheus endpoint says of the sessions' steps it ran batched (or of another ``metric``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf"^{re.escape(metric)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.swarm
def test_a_batch_of_prompts_shares_its_workers_forwards_and_generates_what_hf_does(swarm, client_for, tmp_path):
    """The rows of a batch of prompts are sessions that step together: on a worker holding their span, the steps that
    wait together run as one forward (the worker says so in its metrics), the tokens are HF's own, and every tab is
    billed as its client counts it. The workers replay forwards whose shapes came before through the CPU stand-in for
    CUDA graphs (FAKE HARDWARE: FakeCudaGraphs): batched decode steps are such forwards."""
    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=5)
    ports = [free_port() for _ in range(2)]
    for port in ports:
        swarm.start_worker("--metrics-port", str(port), "--fake-cuda-graphs")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    lm = client.causal_lm(folder, max_length=48, spans=2)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    batch = tok(["hello network", "the quick brown fox jumps over", "volunteers run", "a b c d e f g"],
                return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        want = reference.generate(**batch, max_new_tokens=12, do_sample=False)
    assert torch.equal(lm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=12, do_sample=False), want)
    # The rows' steps went to each span's worker as one group message and were let into its lanes together: most
    # of the 4 rows x 11 decode steps x 2 spans ran batched (a row alone only where its input came too late).
    assert sum(batched_steps(port) for port in ports) >= 44
    assert sum(batched_steps(port, 'gpunet_graph_runs_total{outcome="replayed"}') for port in ports) >= 8
    # Every session's tab on each of its two spans was billed as its client counted it, and paid.
    assert len(lm.last.receipts) == 4 * 2 and all(r.client_signature for r in lm.last.receipts)


def test_a_batch_whose_pushes_are_lost_still_generates_what_hf_does(swarm, client_for, tmp_path):
    """Group steps whose pushed inputs never come (workers that cannot push to each other): each row's step on the
    next span is called off after the client's short wait and sent again with its input, by way of the client; the
    tokens are HF's own."""
    folder = save_checkpoint(tmp_path / "ckpt", "llama", seed=6)
    swarm.start_workers(2, "--fault-drop-pushes")
    client = client_for(swarm)
    wait_for(lambda: len(client.workers(refresh=True)) == 2, 30, "both workers")
    lm = client.causal_lm(folder, max_length=32, spans=2)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    batch = tok(["hello network", "the quick brown fox", "volunteers run"], return_tensors="pt", padding=True,
                padding_side="left")
    with torch.no_grad():
        want = reference.generate(**batch, max_new_tokens=4, do_sample=False)
    assert torch.equal(lm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=4, do_sample=False), want)
    # Every row's session holds its spans on the same workers (they opened together and followed the first).
    assert len({tuple(w for *_, w in row) for row in lm.last.placement}) == 1


class _Pool:
    """A stand-in for the executor pool, for Rows alone: records each run_rows and answers what it is told to."""

    def __init__(self, answer=None):
        self.calls, self.answer = [], answer

    def rows_key(self, session_key, program_hash):
        return f"{program_hash}/slot"

    async def run_rows(self, program_hash, steps, timeout=None):
        self.calls.append((program_hash, [s.key for s, _ in steps], timeout))
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer:
            return self.answer(steps)
        return [RunResult(b"out-" + s.key.encode(), 10, 0.0, 0) for s, _ in steps]


def _started(n: int):
    """n steps the lanes started together (a leader and its riders)."""
    from gpunet.worker.state.lanes import Lanes, Ticket

    lanes = Lanes(1, 2, 1)
    busy = Ticket("busy", rows="k")
    lanes.enqueue(busy)
    tickets = [Ticket(f"c{i}", rows="k") for i in range(n)]
    for t in tickets:
        lanes.enqueue(t)
    lanes.ended(busy, 0.1)
    assert all(t.group == tuple(tickets) for t in tickets)
    return tickets


def test_steps_started_together_meet_and_go_as_one_forward_whoever_leaves_or_fails():
    """gpunet.worker.batching.Rows: the steps the lanes started together wait for exactly each other (one that leaves
    is not waited for), go as one run_rows under the longest timeout any of them has, and each gets its own row's
    answer. A step whose row failed runs alone for a while; a forward that killed its executor is counted against
    none of them; a program evicted from memory sends each back to run alone; a step cancelled before the forward
    went is not sent."""
    from gpunet.errors import ExecutorDied, JobFailed, ProgramNotCached
    from gpunet.worker.batching import Rows

    async def scenario():
        pool = _Pool()
        rows = Rows(pool)
        a, b, c = _started(3)
        runs = [asyncio.ensure_future(rows.run(t, "p", _step(f"{t.client}/s", 1), b"x", timeout))
                for t, timeout in ((a, 5.0), (c, 30.0))]
        await asyncio.sleep(0)
        assert pool.calls == []  # b was started with them: waited for
        rows.gone(b)
        got = await asyncio.gather(*runs)
        assert pool.calls == [("p", ["c0/s", "c2/s"], 30.0)] and [r.outputs for r in got] == [b"out-c0/s", b"out-c2/s"]

        a, b = _started(2)
        rows.gone(b)
        assert await rows.run(a, "p", _step("c0/s", 2), b"x", 5.0) is None  # alone after all: the usual way

        pool.answer = lambda steps: [SessionLost("gone"), RunResult(b"y", 1, 0.0, 0)]
        a, b = _started(2)
        results = await asyncio.gather(*(rows.run(t, "p", _step(f"{t.client}/s", 3), b"x", 5.0) for t in (a, b)),
                                       return_exceptions=True)
        assert isinstance(results[0], SessionLost) and results[1].outputs == b"y"
        assert rows.key(_step("c0/s", 4), "p", None, b"x") is None  # its row failed: alone for a while
        assert rows.key(_step("c1/s", 4), "p", None, b"x") == "p/slot/1"

        pool.answer = ExecutorDied("executor process died while running the job")
        a, b = _started(2)
        results = await asyncio.gather(*(rows.run(t, "p", _step(f"{t.client}/s", 5), b"x", 5.0) for t in (a, b)),
                                       return_exceptions=True)
        assert all(type(r) is JobFailed and "counted against none" in str(r) for r in results)

        pool.answer = lambda steps: [ProgramNotCached("p")] * len(steps)
        a, b = _started(2)
        assert await asyncio.gather(*(rows.run(t, "p", _step(f"{t.client}/s", 6), b"x", 5.0) for t in (a, b))) == [
            None, None]

        pool.answer, calls = None, len(pool.calls)
        a, b = _started(2)
        first = asyncio.ensure_future(rows.run(a, "p", _step("c0/s", 7), b"x", 5.0))
        await asyncio.sleep(0)
        first.cancel()  # before the forward went, and then the other leaves: nothing is sent for it
        rows.gone(b)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(pool.calls) == calls

    asyncio.run(scenario())


def test_a_group_goes_into_the_lanes_at_once_each_program_apart_and_shares_one_place():
    """gpunet.worker.batching.Together: the steps of one group message for one program wait for each other at the
    lanes (one that ends first is not waited for; at most TOGETHER_WAIT), then go in at once, so the lanes start
    them as one forward; steps of another program in the group go in without them; a group's steps for one program
    hold one place between them."""
    from gpunet.protocol import SessionStep, Submit
    from gpunet.worker import batching
    from gpunet.worker.state.lanes import Lanes, Ticket

    def submit(job: str, program: str) -> Submit:
        return Submit(job, program * 64, 1, b"x", session=SessionStep(job.replace(".", "-"), 1))

    async def scenario():
        lanes = Lanes(1, 2, 1)
        busy = Ticket("other", rows="k", job="busy")
        lanes.enqueue(busy)  # another client's job runs: the group's steps queue behind it
        went: list[list[str]] = []

        def enqueue_all(tickets):
            went.append([t.job for t in tickets])
            lanes.enqueue_all(tickets)

        group = batching.Together([submit(j, p) for j, p in (("a.1", "a"), ("b.1", "a"), ("c.1", "a"),
                                                              ("d.1", "b"))], enqueue_all)
        tickets = {j: Ticket("c", rows="k" if j != "d.1" else None, job=j) for j in ("a.1", "b.1", "c.1", "d.1")}
        assert group.arrive(tickets["a.1"]) and group.arrive(tickets["d.1"])
        assert went == [["d.1"]]  # the other program's step did not wait
        group.leave("c.1")  # ended before the lanes (refused, or answered from the results): not waited for
        assert went == [["d.1"]]
        assert group.arrive(tickets["b.1"])
        assert went == [["d.1"], ["a.1", "b.1"]]
        lanes.ended(busy, 0.1)  # d.1 came first: its turn
        lanes.ended(tickets["d.1"], 0.1)
        assert tickets["a.1"].group == (tickets["a.1"], tickets["b.1"])  # started as one forward
        assert not group.arrive(Ticket("c", job="a.1"))  # its program's steps went in: a latecomer goes alone

        late = batching.Together([submit("e.1", "a"), submit("f.1", "a")], enqueue_all)
        assert late.arrive(Ticket("c", job="e.1"))
        await asyncio.sleep(batching.TOGETHER_WAIT * 1.5)
        assert went[-1] == ["e.1"]  # f.1's input never came: e.1 went in without it

        assert not group.share_place("a" * 64, "interactive")
        group.took_place("a" * 64, "interactive")
        assert group.share_place("a" * 64, "interactive") and not group.share_place("b" * 64, "interactive")
        assert not group.drop_place("a" * 64, "interactive") and group.drop_place("a" * 64, "interactive")

    asyncio.run(scenario())
