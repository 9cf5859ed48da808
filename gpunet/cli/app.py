"""The ``gpunet`` command: a thin shell over the library; every command calls public functions the tests call too.

Defaults come from the library (``WorkerConfig``, ``DEFAULT_NETWORK``), never restated here; every command ends on an
error the same way (``error: <message>``, exit 1 for a runtime failure, 2 for unusable input: see gpunet.cli.exits).
This module is the root app and :func:`main`; ``gpunet worker ...`` is gpunet.cli.worker, ``gpunet ledger ...`` and
``gpunet earnings`` gpunet.cli.ledger.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
import typer.core
from rich.console import Console

from gpunet._version import __version__
from gpunet.cli import checkpoint, ledger
from gpunet.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, handle_errors, print_error
from gpunet.cli.options import (
    AnnounceMaddrs,
    DataDir,
    Device,
    HostMaddrs,
    InitialPeers,
    Network,
    Verbose,
    setup_logging,
)
from gpunet.cli.worker import worker_app

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

app.add_typer(ledger.app, name="ledger", help="Read, verify, export and merge this node's ledger of receipts.")
app.add_typer(checkpoint.app, name="checkpoint", help="Checkpoint folders for serving language models (slim copies "
              "for clients).")

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


app.add_typer(worker_app)
app.command("earnings")(ledger.earnings_command)


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

    setup_logging(verbose)
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
    from gpunet.client.reputation import Reputation
    from gpunet.cli.status import render_table
    from gpunet.dht.status import StatusReader
    from gpunet.utils import wide_console

    setup_logging(verbose)
    console = wide_console()
    ratings_dir = client_data_dir(client_dir, create=False)  # status only reads: it needs no writable home
    if serve:  # a port in use is said now, in one line, not after reading the network
        from gpunet.dht.network import check_local_ports_free

        check_local_ports_free(serve=serve)

    def ratings():
        return Reputation.load(ratings_dir) if ratings_dir.is_dir() else None

    with StatusReader(network, initial_peers, ratings=ratings) as reader:
        if serve:
            from gpunet.cli.explorer import serve as serve_explorer

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
def gateway(
    model: Path = typer.Option(..., "--model", metavar="DIR",
                               help="A checkpoint folder in Hugging Face layout (config.json, safetensors, tokenizer "
                                    "files). Nothing is downloaded."),
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    host: str = typer.Option("127.0.0.1", "--host", metavar="HOST", help="Address to listen on (0.0.0.0: every interface; set "
                                                          "--api-key then)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, metavar="PORT", help="Port to listen on (0: any free one)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="GPUNET_API_KEY", metavar="KEY",
                                          help="Answer only requests bearing this key (Authorization: Bearer KEY)."),
    name: Optional[str] = typer.Option(None, "--name", metavar="NAME", help="The model's id in the API (default: the folder's name)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", min=2, metavar="TOKENS",
                                             help="Prompt plus completion tokens per request (each session's cache)."),
    spans: Optional[int] = typer.Option(None, "--spans", min=1, metavar="N",
                                        help="Spans to cut the decoder layers into (default: as few as the workers' "
                                             "memory allows)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", metavar="DIR",
                                            help="The client's data dir (identity, ledger; default ~/.gpunet/client)."),
    max_concurrent: int = typer.Option(16, "--max-concurrent", min=1, metavar="N",
                                       help="Completions generated at once (each holds a session per span on the "
                                            "workers); more are answered 429."),
    draft: Optional[Path] = typer.Option(None, "--draft", metavar="DIR",
                                         help="A small model's checkpoint folder (same tokenizer) proposing tokens "
                                              "that each step checks several at a time: speculative decoding, the "
                                              "same text in fewer round trips."),
    draft_tokens: int = typer.Option(4, "--draft-tokens", min=1, max=8, metavar="K",
                                     help="Proposals a step checks (with --draft)."),
    verbose: int = Verbose,
) -> None:
    """Serve a language model over the network with an OpenAI-compatible API (/v1/models, /v1/completions,
    /v1/chat/completions, streaming): point any OpenAI client at http://HOST:PORT/v1."""
    import asyncio

    from gpunet.llm.gateway import run_gateway

    setup_logging(verbose)
    if not (model / "config.json").is_file():
        print_error(f"--model {model}: not a checkpoint folder (no config.json there)")
        raise typer.Exit(EXIT_USAGE)
    if draft is not None and not (draft / "config.json").is_file():
        print_error(f"--draft {draft}: not a checkpoint folder (no config.json there)")
        raise typer.Exit(EXIT_USAGE)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print_error(f"--host {host} lets other machines spend this gateway's credits: set --api-key too")
        raise typer.Exit(EXIT_USAGE)

    def ready(url: str) -> None:
        print(f"Serving {name or model.resolve().name} at {url} (OpenAI-compatible; Ctrl-C stops)", flush=True)

    asyncio.run(run_gateway(str(model), list(initial_peers or []), network, host, port, api_key=api_key,
                            max_length=max_length, spans=spans, data_dir=data_dir, name=name, ready=ready,
                            max_concurrent=max_concurrent, draft=str(draft) if draft is not None else None,
                            draft_tokens=draft_tokens))


@app.command()
@handle_errors
def demo(
    workers: int = typer.Option(3, "--workers", metavar="N", min=1, max=16, help="Worker processes to start."),
    jobs: int = typer.Option(200, "--jobs", metavar="N", min=1, help="Transformer batches to send through the network."),
    keep: bool = typer.Option(False, "--keep", help="Leave the network up afterwards and print how to connect."),
    generate: bool = typer.Option(
        False, "--generate", help="Instead of the jobs: a small transformer spread over the workers generates tokens "
                                  "through an inference session (KV caches stay on the workers)."),
    chat: bool = typer.Option(
        False, "--chat", help="Instead of the jobs: a language model (a checkpoint folder made on the spot) served "
                              "over the workers through `gpunet gateway`, with a few streamed chat completions."),
    verbose: int = Verbose,
) -> None:
    """Run the whole thing on this machine: a local network, real jobs, the status table and the ledgers."""
    from gpunet.cli.demo import run_demo

    setup_logging(verbose)
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
    if generate and chat:
        print_error("--generate and --chat: choose one")
        raise typer.Exit(EXIT_USAGE)
    run_demo(workers=workers, jobs=jobs, keep=keep, generate=generate, chat=chat)


@app.command()
@handle_errors
def doctor(
    initial_peers: Optional[List[str]] = InitialPeers,
    network: str = Network,
    data_dir: Optional[Path] = DataDir,
    device: str = Device,
    host_maddrs: Optional[List[str]] = HostMaddrs,
    models_dirs: Optional[List[Path]] = typer.Option(
        None, "--models-dir", metavar="DIR", file_okay=False,
        help="A models dir you will give `gpunet worker`: the checkpoints found there and their disk use (indexed "
             "now, so the worker starts without hashing them)."),
    as_json: bool = typer.Option(False, "--json", help="Print the checks as JSON."),
) -> None:
    """Check this host before volunteering it: GPU and driver, AVX, RAM, disk, models dirs, clock, reachability."""
    from gpunet.worker.doctor import Verdict, render_checks, run_checks

    setup_logging(0)
    checks = run_checks(
        data_dir=data_dir, device=device, network=network, initial_peers=initial_peers, host_maddrs=host_maddrs,
        models_dirs=list(models_dirs or []),
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
    one ``error: ...`` line on stderr, exit code 2 (gpunet.cli.exits)."""
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
