"""``gpunet demo``: the whole product on one machine — a local network, real jobs through the client, the ledger.

Starts a bootstrap node and workers as separate processes on 127.0.0.1, traces a small transformer and a
compute-heavy matmul chain into safe jobs, sends them through ``Client.map`` (nobody picks a machine), checks every
answer against local execution, then shows who did what, the network status and the ledgers.

``--generate`` shows the Petals-style part instead: a small decoder-only transformer (gpunet.models) cut into spans
over the workers, generating tokens greedily through an inference session whose KV caches stay on the workers.
``--chat`` serves a checkpoint folder (random init, made on the spot) through ``gpunet gateway`` and streams a few
chat completions from it, each checked against local generation.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

import gpunet
from gpunet.cli.status import render_table
from gpunet.dht.status import NetworkStatus
from gpunet.identity import short_id
from gpunet.ledger import format_credits, open_ledger
from gpunet.ledger.tabs import steps_of
from gpunet.utils import plural, wide_console
from gpunet.worker.throughput import CACHE_FILENAME
from gpunet.testing import LocalNetwork, wait_for


class MatmulChain(torch.nn.Module):
    """Compute-bound: a few large matmuls with a nonlinearity, about 0.8 GFLOP per step at n=512."""

    def __init__(self, n: int = 512, steps: int = 8):
        super().__init__()
        self.weights = torch.nn.Parameter(torch.randn(steps, n, n) / n**0.5)

    def forward(self, x):
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


@dataclass
class DemoReport:
    jobs: int
    per_worker: dict[str, int]
    seconds: float
    max_error: float
    tokens: list[int] | None = None  # --generate: the tokens the network generated (equal to local generation)


def _interrupter(console: Console):
    """SIGINT and SIGTERM end the demo through the context managers, which stop every process; said at once (closing
    the client and the nodes takes seconds, which were silent)."""

    def interrupt(*_) -> None:
        # Once: the stopping itself must not be cut short by the same Ctrl-C coming back (a process forked from this
        # one relays it) or by an impatient second one, which would leave the demo's processes running.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: console.print("Still stopping…"))
        console.print("\nStopping the client and every process the demo started (a few seconds)…")
        raise KeyboardInterrupt

    return interrupt


def _transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0)
    return layer.eval()


def _check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = (got - want).abs().max().item()
    if not err <= tol:
        raise gpunet.GpunetError(f"{name}: a result differs from local execution by {err:.3g} (> {tol:g})")
    return err


def run_demo(workers: int = 3, jobs: int = 200, keep: bool = False, console: Console | None = None,
             generate: bool = False, chat: bool = False) -> DemoReport:
    console = console or wide_console()
    # The client's modules now, not on first use once the network is up: a Ctrl-C that lands in the middle of an
    # import leaves half-imported modules behind, and the demo then died of the signal instead of stopping.
    from gpunet.client.api import Client  # noqa: F401
    # SIGTERM ends the demo like Ctrl-C does: through the context managers, which stop every process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupter(console))
    with LocalNetwork(network="gpunet-demo", heartbeat=2.0) as net:
        console.rule("[bold]gpunet demo: a local network on 127.0.0.1")
        bootstrap = net.start_bootstrap()
        console.print(f"bootstrap node: {bootstrap}", soft_wrap=True)
        prices = [1.0 + 0.5 * i for i in range(workers)]  # credits per TFLOP; 1 is a worker's default

        def start(i: int, wait_online: bool):
            return net.start_worker("--price", str(prices[i]), "--public-name", f"volunteer-{i + 1}",
                                    data_dir=net.root / f"volunteer-{i + 1}", wait_online=wait_online)

        # The first measures this machine's speed alone; the others, on the same machine, start from its figure
        # (measured side by side on shared cores, each would publish a fraction of it, a different one each time).
        first = start(0, wait_online=True)
        measured = first.data_dir / CACHE_FILENAME
        for i in range(1, workers):
            (net.root / f"volunteer-{i + 1}").mkdir(parents=True, exist_ok=True)
            if measured.exists():
                shutil.copyfile(measured, net.root / f"volunteer-{i + 1}" / CACHE_FILENAME)
        procs = [first, *(start(i, wait_online=False) for i in range(1, workers))]
        for proc in procs:
            net.wait_online(proc)
        console.print(f"{plural(workers, 'worker')} online (prices {', '.join(f'{p:g}' for p in prices)} credits/TFLOP)")

        if chat:  # the gateway is this demo's client (its data dir the client's): it pays the workers
            report, client_id = _chat(console, net, workers)
            names = {net.worker_id(proc): f"volunteer-{i + 1}" for i, proc in enumerate(net.workers)}
        else:
            with gpunet.Client(initial_peers=[bootstrap], network=net.network, data_dir=net.root / "client") as client:
                console.print(f"client {short_id(client.id)} sees "
                              f"{plural(len(client.workers(refresh=True)), 'worker')}")
                report = _generation(console, client, workers) if generate else _jobs(console, client, jobs, workers)
                names = {w.id: w.record.name for w in client.workers(refresh=True) if w.record.name}
                _print_work(console, client, names)
                # Records refresh every heartbeat: show the table once they carry the final job counts.
                wait_for(lambda: sum(w.record.jobs_done for w in client.workers(refresh=True)) >= report.jobs,
                         10 * net.heartbeat, "worker records to report every job")
                console.print(render_table(NetworkStatus(net.network, client.workers()), console.width))
                client_id = client.id

        _print_ledgers(console, net, client_id, names)
        if keep:
            dirs = "".join(f"\n  {names.get(net.worker_id(proc), proc.name)}: {proc.data_dir}" for proc in net.workers)
            console.print(
                f"\nThe network stays up. Join or inspect it with:\n"
                f"  gpunet status --network {net.network} --initial-peers {bootstrap}\n"
                f"  gpunet worker --network {net.network} --initial-peers {bootstrap}\n"
                f"Each node's data dir (for `gpunet ledger show --data-dir DIR`, `gpunet earnings --data-dir DIR`; "
                f"removed when the demo stops):{dirs}\n  client: {net.root / 'client'}\n"
                "Press Ctrl-C to stop it.",
                soft_wrap=True,
            )
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass  # (said by the handler)
        else:
            console.print("stopping the local network…")
    console.print("[green]demo finished: every process it started has stopped.")
    return report


def _jobs(console: Console, client: gpunet.Client, jobs: int, workers: int) -> DemoReport:
    # 1. a small transformer over many batches, spread over the network
    model = _transformer()
    batch = torch.export.Dim("batch", min=1, max=256)
    example = torch.randn(8, 16, 64)
    job = gpunet.Job.from_module(model, (example,), dynamic_shapes=({0: batch},))
    console.print(f"traced a TransformerEncoderLayer into a safe job: {job}")
    batches = [torch.randn(8, 16, 64) for _ in range(jobs)]
    start = time.perf_counter()
    outputs = list(client.map(job, batches, progress=True))
    seconds = time.perf_counter() - start
    with torch.no_grad():
        max_error = max(_check("transformer", y, model(x), 1e-4) for x, y in zip(batches, outputs))
    console.print(f"{jobs} transformer batches in {seconds:.1f} s, all equal to local execution "
                  f"(max difference {max_error:.1e})")

    # 2. a compute-bound job, a few times
    heavy = MatmulChain()
    heavy_job = gpunet.Job.from_module(heavy, (torch.randn(256, 512),))
    heavy_inputs = [torch.randn(256, 512) for _ in range(max(2, workers))]
    start = time.perf_counter()
    fastest = gpunet.Requirements(prefer="fastest")
    futures = [client.submit(heavy_job, x, requirements=fastest) for x in heavy_inputs]
    with torch.no_grad():
        for x, f in zip(heavy_inputs, futures):
            _check("matmul chain", f.result(), heavy(x), 1e-4)
    flops = sum(f.receipt.flops for f in futures)
    console.print(f"{len(futures)} compute-heavy jobs ({flops / 1e9:.1f} GFLOP) in "
                  f"{time.perf_counter() - start:.1f} s, all equal to local execution")
    per_worker = Counter(r.worker_id for r in client.ledger.receipts())
    return DemoReport(jobs=sum(per_worker.values()), per_worker=dict(per_worker), seconds=seconds,
                      max_error=max_error)


def _generation(console: Console, client: gpunet.Client, workers: int, new_tokens: int = 32) -> DemoReport:
    """A decoder-only transformer spread over the workers, generating through one session (KV caches on them)."""
    from gpunet.models import TinyConfig, generate_locally, tiny_gpt

    cfg = TinyConfig(n_layers=6, d_model=128, n_heads=4, max_len=64)
    blocks = tiny_gpt(cfg, seed=0)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    start = time.perf_counter()
    remote = client.sequential(blocks, example_inputs=(prompt,), spans=min(3, workers),
                               dynamic_shapes=({1: torch.export.Dim("T", min=1, max=cfg.max_len)},))
    console.print(f"traced a {cfg.n_layers}-layer decoder ({len(blocks)} blocks, random init) into {len(remote.spans)} "
                  f"spans in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    tokens, x = [], prompt
    with remote.session() as session:
        for _ in range(new_tokens):
            token = int(session.step(x)[0, -1].argmax())
            tokens.append(token)
            x = torch.tensor([[token]])
        placement, pushed = session.placement, session.pushed
    seconds = time.perf_counter() - start
    receipts = session.receipts  # closing the session billed the steps of its last tabs
    want = generate_locally(blocks, prompt, new_tokens)
    if tokens != want:
        raise gpunet.GpunetError(f"networked generation differs from local generation: {tokens} != {want}")
    names = {w.id: w.record.name or short_id(w.id) for w in client.workers()}
    table = Table(title="where the model ran (one session: each span's KV cache stayed on its worker)")
    for column in ("span", "blocks", "worker", "steps paid", "receipts", "credits"):
        table.add_column(column)
    for i, (first, stop, worker_id) in enumerate(placement):
        mine = [r for r in receipts if r.worker_id == worker_id]
        what = ", ".join(type(b).__name__ for b in blocks[first:stop])
        table.add_row(str(i), f"{first}-{stop - 1} ({what})", names.get(worker_id, short_id(worker_id or "?")),
                      str(sum(steps_of(r.job_id) for r in mine)), str(len(mine)),
                      format_credits(sum(r.amount for r in mine)))
    console.print(table)
    console.print(f"generated {new_tokens} tokens in {seconds:.1f} s ({new_tokens / seconds:.1f} tokens/s), "
                  f"identical to generating locally: {tokens}", soft_wrap=True)
    if len(placement) > 1:
        console.print(f"{pushed} of {(len(placement) - 1) * new_tokens} span inputs went straight from worker to "
                      "worker (the first step opens each span's session by way of this client)", soft_wrap=True)
    per_worker = Counter()
    for r in client.ledger.receipts():
        per_worker[r.worker_id] += steps_of(r.job_id)
    return DemoReport(jobs=sum(per_worker.values()), per_worker=dict(per_worker), seconds=seconds, max_error=0.0,
                      tokens=tokens)


#: What --chat asks the model, one chat each (a random-init model answers gibberish: the point is that the network's
#: answer is the one local generation gives, streamed through an OpenAI-compatible API).
CHAT_PROMPTS = ("hello network", "what do the volunteers run?", "the quick brown fox")


def _chat(console: Console, net: LocalNetwork, workers: int, new_tokens: int = 24) -> tuple[DemoReport, str]:
    """A checkpoint folder made here (random-init Llama and a tokenizer trained here) served through ``gpunet
    gateway`` over the workers; a few streamed chat completions, each checked against HF's generation in this
    process. Returns the report and the gateway's client id (its ledger is the demo client's)."""
    from gpunet.identity import Identity
    from gpunet.llm import load
    from gpunet.testing.llm import greedy_text, save_checkpoint, stream_chat

    folder = save_checkpoint(net.root / "tiny-chat", "llama", seed=0, hidden_size=64, num_hidden_layers=6)
    spans = min(3, workers)
    start = time.perf_counter()
    gateway, url = net.start_gateway(folder, "--name", "tiny-chat", "--spans", str(spans), "--max-length", "128",
                                     "--data-dir", str(net.root / "client"))
    console.print(f"gateway up in {time.perf_counter() - start:.1f} s: {url} (OpenAI-compatible) serves tiny-chat, a "
                  f"random-init 6-layer Llama from a checkpoint folder made here, in {spans} spans", soft_wrap=True)
    reference, tok = load(folder)
    reference.config._attn_implementation = "eager"
    tokens, start = 0, time.perf_counter()
    for prompt in CHAT_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = greedy_text(reference, tok, list(ids), new_tokens)
        console.print(f"[bold]user:[/bold] {prompt}\n[bold]tiny-chat:[/bold] ", end="", soft_wrap=True)
        text, finish, usage = stream_chat(url, {"model": "tiny-chat", "messages": messages,
                                                "max_tokens": new_tokens, "temperature": 0},
                                          on_text=lambda piece: console.print(piece, end="", markup=False,
                                                                              highlight=False, soft_wrap=True))
        console.print(f"\n  ({usage.get('completion_tokens', '?')} tokens, finish: {finish}; "
                      f"{'identical to' if text == want else 'DIFFERENT from'} local generation)", soft_wrap=True)
        if text != want:
            raise gpunet.GpunetError(f"the gateway's answer differs from local generation: {text!r} != {want!r}")
        tokens += usage.get("completion_tokens", 0)
    seconds = time.perf_counter() - start
    gateway.terminate()  # its last tabs are paid as it stops
    with open_ledger(net.root / "client") as ledger:
        receipts = list(ledger.receipts())
    per_worker = Counter()
    table = Table(title="what each worker earned serving the chats (from the gateway's ledger)")
    for column in ("worker", "steps paid", "receipts", "credits"):
        table.add_column(column)
    names = {net.worker_id(proc): f"volunteer-{i + 1}" for i, proc in enumerate(net.workers)}
    for worker_id in sorted({r.worker_id for r in receipts}):
        mine = [r for r in receipts if r.worker_id == worker_id]
        per_worker[worker_id] = sum(steps_of(r.job_id) for r in mine)
        table.add_row(_named(worker_id, names), str(per_worker[worker_id]), str(len(mine)),
                      format_credits(sum(r.amount for r in mine)))
    console.print(table)
    console.print(f"{len(CHAT_PROMPTS)} chats, {tokens} tokens streamed in {seconds:.1f} s, each identical to "
                  "generating locally", soft_wrap=True)
    client_id = Identity.load_or_create(net.root / "client").peer_id
    return DemoReport(jobs=sum(per_worker.values()), per_worker=dict(per_worker), seconds=seconds,
                      max_error=0.0), client_id


def _named(worker_id: str, names: dict[str, str]) -> str:
    """A worker as the status table shows it: its public name, and the end of its peer id."""
    return f"{names[worker_id]} ({short_id(worker_id)})" if worker_id in names else short_id(worker_id)


def _print_work(console: Console, client: gpunet.Client, names: dict[str, str]) -> None:
    work: dict[str, list] = defaultdict(lambda: [0, 0, 0])
    for r in client.ledger.receipts():
        w = work[r.worker_id]
        w[0] += steps_of(r.job_id)  # a session's tab receipt bills many steps
        w[1] += r.flops
        w[2] += r.amount
    table = Table(title="who did what (from the client's ledger)")
    for column in ("worker", "jobs (or steps)", "GFLOP", "paid (credits)"):
        table.add_column(column, justify="left" if column == "worker" else "right")
    for worker_id, (count, flops, amount) in sorted(work.items(), key=lambda kv: -kv[1][0]):
        table.add_row(_named(worker_id, names), str(count), f"{flops / 1e9:.2f}", format_credits(amount))
    console.print(table)


def _count(data_dir) -> int:
    with open_ledger(data_dir) as ledger:
        return ledger.head().count


def _print_ledgers(console: Console, net: LocalNetwork, client_id: str, names: dict[str, str]) -> None:
    """Each node's own ledger file, verified. Workers file the last countersignatures by group commit a moment after
    the client has gone, so each worker's file is read once it holds every receipt the client paid it for (or after
    a deadline, and then the shortfall is shown)."""
    with open_ledger(net.root / "client") as ledger:
        paid = Counter(r.worker_id for r in ledger.receipts())
    table = Table(title="ledgers (each node's own SQLite file, verified)")
    for column in ("node", "receipts", "earned (credits)", "spent (credits)", "verify"):
        table.add_column(column)
    for proc in net.workers:
        worker_id = net.worker_id(proc)
        try:
            wait_for(lambda: _count(proc.data_dir) >= paid[worker_id], 10, "the worker to file its receipts",
                     interval=0.02)
        except TimeoutError:
            console.print(f"[yellow]worker {short_id(worker_id)} holds fewer receipts than the client paid it "
                          f"for ({_count(proc.data_dir)} < {paid[worker_id]}); see `gpunet ledger unpaid`")
        with open_ledger(proc.data_dir) as ledger:
            head = ledger.verify()
            mine = ledger.balances().get(worker_id)
            table.add_row(f"worker {_named(worker_id, names)}", str(head.count), format_credits(mine.earned if mine else 0),
                          "0.00", "[green]ok")
    with open_ledger(net.root / "client") as ledger:
        head = ledger.verify()
        spent = ledger.balances().get(client_id)
        table.add_row("client", str(head.count), "0.00", format_credits(spent.spent if spent else 0), "[green]ok")
    console.print(table)
