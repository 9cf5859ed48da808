"""``gpunet checkpoint …``: checkpoint folders for serving language models (docs/weights.md). A thin shell over
:mod:`gpunet.client.llm.skeleton`.

Exit codes, as for every ``gpunet`` command (gpunet.cli.exits): 0 success; 2 unusable input (not a checkpoint folder,
a model that cannot be served from a slim folder, a target that is not empty).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from gpunet.cli.exits import handle_errors
from gpunet.errors import ConfigError, UsageError
from gpunet.utils import human_bytes

app = typer.Typer(
    name="checkpoint",
    help="Checkpoint folders for serving language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command()
@handle_errors
def slim(
    source: Annotated[Path, typer.Argument(metavar="SOURCE", help="A checkpoint folder in Hugging Face layout.")],
    target: Annotated[Path, typer.Argument(metavar="TARGET", help="The slim folder to write (new, or empty).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for programs.")] = False,
) -> None:
    """Write a slim copy of a checkpoint for clients: its config and tokenizer, the embeddings and head the client
    runs itself, and the hashes of every other tensor (gpunet-weights.json). client.causal_lm(TARGET) serves the
    model from workers that keep the whole checkpoint (gpunet worker --models-dir), and never holds or sends a
    decoder layer's bytes."""
    from gpunet.client.llm.engine import need_transformers
    from gpunet.client.llm.skeleton import slim as write_slim

    need_transformers()
    try:
        done = write_slim(source, target)
    except UsageError as e:  # the folders given are the input: unusable input, as the module says
        raise ConfigError(str(e)) from None
    if as_json:
        sys.stdout.write(json.dumps({"folder": str(done.folder), "checkpoint": done.checkpoint, "ends": done.ends,
                                     "ends_bytes": done.ends_bytes, "listed": done.listed,
                                     "listed_bytes": done.listed_bytes}, indent=2) + "\n")
        return
    print(f"Wrote {done.folder}: the ends ({done.ends} tensors, {human_bytes(done.ends_bytes)}) and the hashes of "
          f"{done.listed} tensors ({human_bytes(done.listed_bytes)}) of checkpoint {done.checkpoint}.")
    print(f"Serve it with client.causal_lm({str(done.folder)!r}) (or gpunet gateway {done.folder}) from workers that "
          "keep the checkpoint: gpunet worker --models-dir DIR, with the whole folder in DIR.")
