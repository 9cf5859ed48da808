"""The shell: the ``gpunet`` command, a thin layer over the library (console script ``gpunet = "gpunet.cli:main"``,
and ``python -m gpunet``).

* :mod:`~gpunet.cli.app` -- the root Typer app, ``gpunet bootstrap | status | demo | doctor | version``, and
  :func:`main` (click's usage errors end like every other error);
* :mod:`~gpunet.cli.worker` -- ``gpunet worker`` (its options are WorkerConfig's fields) and ``worker pause|resume``;
* :mod:`~gpunet.cli.ledger` -- ``gpunet ledger balance|show|verify|export|merge|unpaid|conflicts|trust`` and ``earnings``;
* :mod:`~gpunet.cli.options` -- the options several commands share, and their logging;
* :mod:`~gpunet.cli.exits` -- how every command ends on an error: one ``error: ...`` line, one exit code;
* :mod:`~gpunet.cli.status` -- the status table (the network itself is read by gpunet.dht.status);
* :mod:`~gpunet.cli.explorer` -- the network explorer, ``gpunet status --serve`` (its page is in gpunet.web);
* :mod:`~gpunet.cli.demo` -- ``gpunet demo``: a local network, real jobs, the status and the ledgers.
"""

from gpunet.cli.app import app, main

__all__ = ["app", "main"]
