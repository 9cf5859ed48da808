"""The ``gpunet`` command: a thin shell over the library; every command calls public functions the tests call too.

Defaults come from the library (``WorkerConfig``, ``DEFAULT_NETWORK``), never restated here; every command ends on an
error the same way (``error: <message>``, exit 1 for a runtime failure, 2 for unusable input: see gpunet.cli_errors).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console

from gpunet._version import __version__
from gpunet.cli_errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, handle_errors, print_error
from gpunet.config import DEFAULT_HOST_MADDRS, DEFAULT_NETWORK, WorkerConfig

app = typer.Typer(
    name="gpunet",
    help="gpunet: a peer-to-peer compute network for tensor jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: flags shown as flags (rich's renders "--json <bool>"), arguments as FILE
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _usage_name(argument) -> str:
    """An argument in a usage line as people write it (``FILE``, ``[FILE]``), not Typer's ``{FILE}`` for a required
    one."""
    name = argument.display_name_raw if argument.required else f"[{argument.display_name_raw}]"
    return name + ("..." if argument.nargs != 1 else "")


if hasattr(typer.core.TyperArgument, "_usage_display_name"):  # Typer's own rendering, where it has one
    typer.core.TyperArgument._usage_display_name = _usage_name

from gpunet.ledger import cli as ledger_cli  # noqa: E402  (a sub-app; imports nothing heavy)
from gpunet.ledger.cli import app as ledger_app  # noqa: E402

app.add_typer(ledger_app, name="ledger", help="Read, verify, export and merge this node's ledger of receipts.")

#: The worker's defaults, shown and used by its options: WorkerConfig is their one source.
_WORKER = WorkerConfig()

# Options shared by several commands.
InitialPeers = typer.Option(
    None, "--initial-peers", metavar="MADDR", help="Multiaddr of a peer already in the network (repeatable). Env: GPUNET_INITIAL_PEERS."
)
Network = typer.Option(DEFAULT_NETWORK, "--network", metavar="NAME", help="Network name; networks with different names never mix.")
DataDir = typer.Option(None, "--data-dir", metavar="DIR", envvar="GPUNET_DATA_DIR", help="Where the node key, caches and ledger live (default: ~/.gpunet).")
HostMaddrs = typer.Option(
    None, "--host-maddrs", metavar="MADDR",
    help=f"Multiaddr to listen on, repeatable (default: {', '.join(DEFAULT_HOST_MADDRS)}, all interfaces, a random "
    "port).",
)
AnnounceMaddrs = typer.Option(
    None, "--announce-maddrs", metavar="MADDR",
    help="Multiaddr others should dial, repeatable: your public address and a port you forwarded to this machine "
    "(checked at start by a peer dialling it back).",
)
Device = typer.Option(_WORKER.device, "--device", metavar="DEVICE", help="auto, cpu or cuda:N.")
Verbose = typer.Option(0, "--verbose", "-v", count=True, help="-v: log every job; -vv: network internals too.")


def _setup_logging(verbose: int) -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "DEBUG" if verbose >= 2 else "WARNING")
    logging.getLogger("gpunet").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.basicConfig(
        level=logging.DEBUG if verbose >= 2 else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


@app.command()
def version() -> None:
    """Print gpunet's version."""
    typer.echo(__version__)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print gpunet's version and exit."),
) -> None:
    """gpunet: a peer-to-peer compute network for tensor jobs."""


worker_app = typer.Typer(
    name="worker",
    invoke_without_command=True,  # `gpunet worker [OPTIONS]` runs a worker; `gpunet worker pause` talks to one
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(worker_app)


@worker_app.callback()
@handle_errors
def worker(
    ctx: typer.Context,
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    device: str = Device,
    price: float = typer.Option(_WORKER.price, "--price", metavar="CREDITS", min=0,
                                help="Credits per TFLOP of counted work, interactive lane (default 1)."),
    batch_price: Optional[float] = typer.Option(
        None, "--batch-price", metavar="CREDITS", min=0,
        help="The batch lane's floor: the least batch work sells for here, credits per TFLOP (default: half of "
             "--price). It rises toward --price while interactive work is wanted; see docs/market.md."),
    max_concurrent: int = typer.Option(
        _WORKER.max_concurrent, "--max-concurrent", metavar="N", min=1, help="Jobs executing at once."),
    threads: Optional[int] = typer.Option(
        _WORKER.threads, "--threads", metavar="N", min=1,
        help="CPU threads a job may use (default: the cores, shared among --max-concurrent jobs). Fewer leave cores "
             "free for you; the speed advertised is measured with them."),
    max_queue: int = typer.Option(
        _WORKER.max_queue, "--max-queue", metavar="N", min=0, help="Jobs waiting; beyond this the worker answers busy."),
    public_name: Optional[str] = typer.Option(
        _WORKER.public_name, "--public-name", metavar="NAME", help="A name shown in `gpunet status`."),
    host_maddrs: Optional[List[str]] = HostMaddrs,
    data_dir: Optional[Path] = DataDir,
    heartbeat: float = typer.Option(
        _WORKER.heartbeat, "--heartbeat", metavar="SECONDS", min=0.5, help="Seconds between record refreshes."),
    drain_timeout: float = typer.Option(
        _WORKER.drain_timeout, "--drain-timeout", metavar="SECONDS", min=0, help="Seconds running jobs get after SIGTERM."),
    rebenchmark: bool = typer.Option(_WORKER.rebenchmark, "--rebenchmark", help="Measure the device's speed again."),
    remeasure_every: float = typer.Option(
        _WORKER.remeasure_every, "--remeasure-every", metavar="SECONDS", min=0,
        help="Measure the speed again after this long, when no job is running (0: never)."),
    memory_budget_gb: Optional[float] = typer.Option(
        _WORKER.memory_budget_gb, "--memory-budget-gb", metavar="GIB", min=0.1, help="Memory per executor."),
    buffer_gb: Optional[float] = typer.Option(
        _WORKER.buffer_gb, "--buffer-gb", metavar="GIB", min=0.01,
        help="Job payloads held in memory at once (default: a quarter of RAM, at least 1 GiB)."),
    sandbox: bool = typer.Option(
        _WORKER.sandbox, "--sandbox/--no-sandbox",
        help="Lock executors down (Landlock, seccomp, rlimits; see docs/security.md). Turn off only if your kernel or "
             "GPU driver refuses it."),
    metrics_port: int = typer.Option(
        _WORKER.metrics_port, "--metrics-port", metavar="PORT", min=0, max=65535, help="Serve Prometheus metrics on 127.0.0.1:PORT."),
    announce_maddrs: Optional[List[str]] = AnnounceMaddrs,
    relay_service: bool = typer.Option(
        _WORKER.relay_service, "--relay-service/--no-relay-service",
        help="When directly reachable, relay for workers behind NAT (circuit relay v2, within its limits; see the "
             "README)."),
    peer_upload_mbps: float = typer.Option(
        _WORKER.peer_upload_mbps, "--peer-upload-mbps", metavar="MB/S", min=0.0,
        help="Serve programs to other workers (so a client uploads each once) at most this fast, in all; 0: no cap."),
    session_memory_gb: Optional[float] = typer.Option(
        _WORKER.session_memory_gb, "--session-memory-gb", metavar="GIB", min=0.0,
        help="Memory for inference sessions' state (KV caches), all together; default: a quarter of the executor "
             "memory budget; 0: no sessions."),
    max_sessions_per_client: int = typer.Option(
        _WORKER.max_sessions_per_client, "--max-sessions-per-client", metavar="N", min=0,
        help="Inference sessions one client may hold open here."),
    session_ttl: float = typer.Option(
        _WORKER.session_ttl, "--session-ttl", metavar="SECONDS", min=1.0,
        help="The longest a session may stay idle before its state is freed (a client may ask for less)."),
    background_job: Optional[Path] = typer.Option(
        _WORKER.background_job, "--background-job", metavar="FILE", exists=True, dir_okay=False,
        help="A job of your own (saved with gpunet.Job.save) to run whenever no paying job wants this machine; any "
             "paying job stops it. Outputs go to <data dir>/background/."),
    background_inputs: Optional[Path] = typer.Option(
        _WORKER.background_inputs, "--background-inputs", metavar="FILE", exists=True, dir_okay=False,
        help="The background job's inputs: a safetensors file with tensors input_0, input_1, ..."),
    pause_when_busy: bool = typer.Option(
        _WORKER.pause_when_busy, "--pause-when-busy",
        help="Pause while other processes use the GPU (on a CPU worker: keep more than half the CPU busy); resume "
             "once the machine has been free for --resume-after seconds."),
    active_hours: Optional[str] = typer.Option(
        _WORKER.active_hours, "--active-hours", metavar="HOURS",
        help="Take jobs only in these local hours: 22:00-08:00, Mon-Fri 18:00-08:00, several joined by commas."),
    max_temperature: Optional[float] = typer.Option(
        _WORKER.max_temperature, "--max-temperature", metavar="CELSIUS",
        help="Pause while the hottest GPU is above this (NVML); resume 5 degrees below."),
    resume_after: float = typer.Option(
        _WORKER.resume_after, "--resume-after", metavar="SECONDS", min=0,
        help="With --pause-when-busy: how long the machine must be free before the worker takes jobs again."),
    pause_grace: float = typer.Option(
        _WORKER.pause_grace, "--pause-grace", metavar="SECONDS", min=0,
        help="When the worker pauses, running jobs get this long to finish; then they are stopped (their clients "
             "run them elsewhere)."),
    dashboard_port: int = typer.Option(
        _WORKER.dashboard_port, "--dashboard-port", metavar="PORT", min=0, max=65535,
        help="Serve this worker's dashboard (state, jobs, earnings, pause) on http://127.0.0.1:PORT."),
    fake_gpu_probe: Optional[Path] = typer.Option(
        _WORKER.fake_gpu_probe, "--fake-gpu-probe", metavar="FILE", hidden=True,
        help="FAKE HARDWARE for tests: read the GPU's use by others and its temperature from this JSON file."),
    fault_corrupt_fraction: float = typer.Option(
        _WORKER.fault_corrupt_fraction, "--fault-corrupt-fraction", metavar="F", min=0.0, max=1.0, hidden=True,
        help="FAULT INJECTION for tests: return corrupted outputs for this fraction of jobs."),
    fault_corrupt_pieces: bool = typer.Option(
        _WORKER.fault_corrupt_pieces, "--fault-corrupt-pieces", hidden=True,
        help="FAULT INJECTION for tests: serve other workers program pieces with one byte wrong."),
    fault_corrupt_pushes: bool = typer.Option(
        _WORKER.fault_corrupt_pushes, "--fault-corrupt-pushes", hidden=True,
        help="FAULT INJECTION for tests: push the next span's worker a session step output with one byte wrong "
             "(and answer the client rightly)."),
    fault_drop_pushes: bool = typer.Option(
        _WORKER.fault_drop_pushes, "--fault-drop-pushes", hidden=True,
        help="FAULT INJECTION for tests: never push a session step's output to the next span's worker."),
    verbose: int = Verbose,
) -> None:
    """Join a network (or start one) and serve jobs on this machine's GPU or CPU; `gpunet worker pause` / `resume`
    control one that runs."""
    if ctx.invoked_subcommand is not None:
        return
    from gpunet.worker.server import Worker

    _setup_logging(verbose)
    config = WorkerConfig(
        network=network,
        initial_peers=list(initial_peers or []),
        device=device,
        price=price,
        batch_price=batch_price,
        max_concurrent=max_concurrent,
        threads=threads,
        max_queue=max_queue,
        public_name=public_name,
        data_dir=data_dir,
        heartbeat=heartbeat,
        drain_timeout=drain_timeout,
        rebenchmark=rebenchmark,
        remeasure_every=remeasure_every,
        memory_budget_gb=memory_budget_gb,
        buffer_gb=buffer_gb,
        sandbox=sandbox,
        metrics_port=metrics_port,
        announce_maddrs=list(announce_maddrs or []),
        relay_service=relay_service,
        peer_upload_mbps=peer_upload_mbps,
        session_memory_gb=session_memory_gb,
        max_sessions_per_client=max_sessions_per_client,
        session_ttl=session_ttl,
        background_job=background_job,
        background_inputs=background_inputs,
        pause_when_busy=pause_when_busy,
        active_hours=active_hours,
        max_temperature=max_temperature,
        resume_after=resume_after,
        pause_grace=pause_grace,
        dashboard_port=dashboard_port,
        fake_gpu_probe=fake_gpu_probe,
        fault_corrupt_fraction=fault_corrupt_fraction,
        fault_corrupt_pieces=fault_corrupt_pieces,
        fault_corrupt_pushes=fault_corrupt_pushes,
        fault_drop_pushes=fault_drop_pushes,
    )
    if host_maddrs:
        config.host_maddrs = list(host_maddrs)
    raise typer.Exit(Worker(config).run())


@worker_app.command("pause")
@handle_errors
def worker_pause(
    data_dir: Optional[Path] = DataDir,
    reason: str = typer.Option("", "--reason", metavar="TEXT", help="Why (shown in its record and dashboard)."),
) -> None:
    """Pause the worker of this data dir: it takes no new jobs, and running ones get --pause-grace to finish. It
    stays paused, across restarts too, until `gpunet worker resume`."""
    from gpunet.config import resolve_data_dir
    from gpunet.worker.control import set_pause

    where = resolve_data_dir(data_dir)
    pid = set_pause(where, reason)
    print(f"Paused the worker of {where} (pid {pid}); it finishes running jobs and takes no new ones." if pid else
          f"No worker runs from {where} now; the next one started there starts paused.")


@worker_app.command("resume")
@handle_errors
def worker_resume(data_dir: Optional[Path] = DataDir) -> None:
    """Let a worker paused by `gpunet worker pause` take jobs again (its other rules still apply)."""
    from gpunet.config import resolve_data_dir
    from gpunet.worker.control import set_pause

    where = resolve_data_dir(data_dir)
    pid = set_pause(where, None)
    print(f"Resumed the worker of {where} (pid {pid})." if pid else f"No worker runs from {where} now; the next one "
          "started there will not start paused.")


app.command("earnings")(ledger_cli.earnings_command)


@app.command()
@handle_errors
def bootstrap(
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    host_maddrs: Optional[List[str]] = HostMaddrs,
    announce_maddrs: Optional[List[str]] = AnnounceMaddrs,
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", metavar="DIR",
        help="Where the node key lives (default: bootstrap/ in $GPUNET_DATA_DIR or ~/.gpunet, apart from a worker's: "
             "one node per data dir)."),
    verbose: int = Verbose,
) -> None:
    """Run a DHT-only node: a stable entry point for a network, which also relays for workers behind NAT and dials
    nodes back to tell them whether they are reachable. Prints the address to join with."""
    from gpunet.dht.bootstrap import run_bootstrap

    _setup_logging(verbose)
    raise typer.Exit(run_bootstrap(network, list(initial_peers or []), list(host_maddrs or []) or None, data_dir,
                                   announce_maddrs=list(announce_maddrs or []) or None))


@app.command()
@handle_errors
def status(
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    watch: bool = typer.Option(False, "--watch", help="Refresh until Ctrl-C."),
    interval: float = typer.Option(5.0, "--interval", metavar="SECONDS", min=0.5, help="Seconds between refreshes with --watch."),
    timeout: float = typer.Option(30.0, "--timeout", metavar="SECONDS", min=1, help="Give up reading the network after this long."),
    client_dir: Optional[Path] = typer.Option(
        None, "--client-dir", metavar="DIR", help="Show the ratings of the client using this data dir (default: ~/.gpunet/client)."),
    serve: int = typer.Option(
        0, "--serve", metavar="PORT", min=0, max=65535,
        help="Serve the network explorer, a read-only web page of the network and its history, on "
             "http://127.0.0.1:PORT until Ctrl-C (refreshed every --interval seconds)."),
    verbose: int = Verbose,
) -> None:
    """Show every live worker of a network, the network's totals, and how your client rates each worker."""
    from gpunet.client.core import client_data_dir
    from gpunet.client.trust import Reputation
    from gpunet.status import StatusReader, render_table
    from gpunet.utils import wide_console

    _setup_logging(verbose)
    console = wide_console()
    ratings_dir = client_data_dir(client_dir, create=False)  # status only reads: it needs no writable home
    if serve:  # a port in use is said now, in one line, not after reading the network
        from gpunet.dht.network import check_local_ports_free

        check_local_ports_free(serve=serve)

    def ratings():
        return Reputation.load(ratings_dir) if ratings_dir.is_dir() else None

    with StatusReader(network, initial_peers, ratings=ratings) as reader:
        if serve:
            from gpunet.explorer import serve as serve_explorer

            serve_explorer(reader, serve, interval, timeout,
                           ready=lambda url: print(f"Network explorer: {url} (Ctrl-C to stop)", flush=True))
            return
        snapshot = reader.read(timeout)
        if not watch:
            if as_json:
                typer.echo(json.dumps(snapshot.to_json()))
            else:
                console.print(render_table(snapshot, console.width))
            if not snapshot.workers:
                Console(stderr=True).print(f"no workers in network {network!r}: is that the right --network?")
            return
        from rich.live import Live

        try:
            if as_json or not console.is_terminal:
                # Into a pipe or file: one complete frame (or JSON line) per refresh, written as it is read, never a
                # terminal animation that only lands at exit.
                while True:
                    if as_json:
                        typer.echo(json.dumps(snapshot.to_json()))
                    else:
                        console.print(render_table(snapshot, console.width))
                    sys.stdout.flush()
                    time.sleep(interval)
                    snapshot = reader.read(timeout)
            with Live(render_table(snapshot, console.width), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render_table(reader.read(timeout), console.width), refresh=True)
        except KeyboardInterrupt:
            pass  # the way to leave --watch: not a failure


@app.command()
@handle_errors
def demo(
    workers: int = typer.Option(3, "--workers", metavar="N", min=1, max=16, help="Worker processes to start."),
    jobs: int = typer.Option(200, "--jobs", metavar="N", min=1, help="Transformer batches to send through the network."),
    keep: bool = typer.Option(False, "--keep", help="Leave the network up afterwards and print how to connect."),
    generate: bool = typer.Option(
        False, "--generate", help="Instead of the jobs: a small transformer spread over the workers generates tokens "
                                  "through an inference session (KV caches stay on the workers)."),
    verbose: int = Verbose,
) -> None:
    """Run the whole thing on this machine: a local network, real jobs, the status table and the ledgers."""
    from gpunet.demo import run_demo

    _setup_logging(verbose)
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
    run_demo(workers=workers, jobs=jobs, keep=keep, generate=generate)


@app.command()
@handle_errors
def doctor(
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    data_dir: Optional[Path] = DataDir,
    device: str = Device,
    host_maddrs: Optional[List[str]] = HostMaddrs,
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Check this host before volunteering it: GPU and driver, AVX, RAM, disk, clock, reachability."""
    from gpunet.worker.doctor import Verdict, render_checks, run_checks

    _setup_logging(0)
    checks = run_checks(
        data_dir=data_dir, device=device, network=network, initial_peers=initial_peers, host_maddrs=host_maddrs
    )
    if as_json:
        typer.echo(json.dumps([c.to_json() for c in checks]))
    else:
        Console().print(render_checks(checks))
    raise typer.Exit(EXIT_FAILURE if any(c.outcome is Verdict.FAIL for c in checks) else 0)


try:  # typer >= 0.28 carries its own copy of click, whose errors derive from this
    from typer import TyperException as _UsageErrors
except ImportError:  # older typer: click's own
    from click import ClickException as _UsageErrors


def main() -> None:
    """The ``gpunet`` command. Click's own usage errors (an unknown option, a bad value) end like every other error:
    one ``error: ...`` line on stderr, exit code 2 (gpunet.cli_errors)."""
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit comes back as its code
    except _UsageErrors as e:  # click's usage and file errors
        ctx = getattr(e, "ctx", None)
        if ctx is not None and e.format_message() == ctx.get_help():  # `gpunet`, `gpunet ledger`: their help
            e.show()
            sys.exit(EXIT_USAGE)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        print_error(e.format_message() + where)
        sys.exit(getattr(e, "exit_code", EXIT_USAGE))
    except typer.Abort:  # end of input at a prompt
        sys.exit(EXIT_INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)
