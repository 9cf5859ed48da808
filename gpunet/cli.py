"""The ``gpunet`` command: a thin shell over the library; every command calls public functions the tests call too."""

from __future__ import annotations

import typer

from gpunet._version import __version__

app = typer.Typer(
    name="gpunet",
    help="gpunet: a peer-to-peer compute network for tensor jobs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def version() -> None:
    """Print gpunet's version."""
    typer.echo(__version__)


def main() -> None:
    app()
