"""How every ``gpunet`` command ends on an error: one line on stderr and one exit code, the same for all commands.

Exit codes (``gpunet`` and ``gpunet ledger`` alike):

- 0: success.
- 1: a runtime failure: the network could not be joined, a job failed, a check or a verification failed.
- 2: unusable input: a bad option or setting (:class:`ConfigError`, as click itself answers a usage error) or a file
  that is not a usable ledger (:class:`LedgerError`: a ledger command was pointed at something it cannot read).
- 130: interrupted (Ctrl-C).

Kept apart from the root app (gpunet.cli.app) so the sub-apps it imports (gpunet.cli.worker, gpunet.cli.ledger) can
use it too.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from gpunet.errors import ConfigError, GpunetError, LedgerError

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

F = TypeVar("F", bound=Callable)


def exit_code(error: GpunetError) -> int:
    return EXIT_USAGE if isinstance(error, (ConfigError, LedgerError)) else EXIT_FAILURE


def fail(error: GpunetError) -> typer.Exit:
    """Print ``error: <message>`` on one line (never wrapped, never read as markup); the Exit to raise."""
    print_error(str(error))
    return typer.Exit(exit_code(error))


def print_error(message: str) -> None:
    """``error: <message>`` on stderr, on one line; the message is Text, never markup (it may quote a peer)."""
    Console(stderr=True).print(Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)


def handle_errors(command: F) -> F:
    """Wrap a command so a gpunet error or Ctrl-C ends it with the documented exit code, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GpunetError as e:
            raise fail(e) from None
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]
