"""hivemind's parts without its package ``__init__``.

``import hivemind.dht`` runs ``hivemind/__init__.py`` first, which imports all of hivemind: averaging, mixture of
experts, optimizers and, through them, scipy. gpunet uses the DHT, p2p and utils only; the rest cost every process
that joins a network (each worker, each CLI call, each DHT process's parent) about 1.1 s of CPU at start. So the first
import of gpunet puts an unexecuted ``hivemind`` package in ``sys.modules``: its submodules import as they always
do, and the package's own ``__init__`` runs the first time anyone asks it for a name (``hivemind.Optimizer``,
``from hivemind import DHT``, ``hivemind.__version__``), so a program that uses the rest of hivemind beside gpunet sees
it whole. Where hivemind is already imported, or cannot be found, nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

_lock = threading.RLock()


def defer_package_init() -> None:
    """Put hivemind's package in ``sys.modules`` with its ``__init__`` left to run on the first name asked of it."""
    with _lock:
        if "hivemind" in sys.modules:
            return
        spec = importlib.util.find_spec("hivemind")
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return
        package = importlib.util.module_from_spec(spec)  # __path__, __spec__ and __file__ set; nothing run yet
        running: list[int] = []  # the thread running __init__ now
        failed: list[BaseException] = []

        def init_on_first_name(name: str):
            """PEP 562: called only for names the package does not hold yet, i.e. what its ``__init__`` defines (or
            nobody does: AttributeError as usual, once it ran). A submodule still importing is not one of them:
            ``import hivemind.p2p.x as y`` inside hivemind.p2p asks the package for ``p2p`` before it is set. The
            hook stays until ``__init__`` has run, so another thread asking meanwhile waits for it, never sees half
            a package; ``__init__`` itself asking for a name not set yet gets AttributeError, as any import would."""
            if (submodule := sys.modules.get(f"hivemind.{name}")) is not None:
                return submodule
            if threading.get_ident() in running:
                raise AttributeError(f"partially initialised module 'hivemind' has no attribute {name!r}")
            with _lock:
                if package.__dict__.get("__getattr__") is init_on_first_name:
                    if failed:  # a part of hivemind that cannot import: probes (hasattr) want AttributeError
                        raise AttributeError(f"module 'hivemind' has no attribute {name!r} (its __init__ failed: "
                                             f"{failed[0]})") from failed[0]
                    if "__version__" not in package.__dict__:  # (importlib.reload ran __init__ past this hook)
                        running.append(threading.get_ident())
                        try:
                            spec.loader.exec_module(package)
                        except BaseException as e:
                            failed.append(e)
                            raise
                        finally:
                            running.clear()
                    del package.__getattr__
            return getattr(package, name)

        package.__getattr__ = init_on_first_name
        sys.modules["hivemind"] = package


def share_memory_by_descriptor() -> None:
    """hivemind keeps its futures' state in torch shared memory, by name ("file_system") unless told otherwise: torch
    then starts a ``torch_shm_manager`` beside every process, which inherits its stderr and outlives it by ~2 s, so
    ``gpunet status | jq`` (and a script or test reading any CLI call to the end) waited 2 s after gpunet had exited,
    and each node ran one more process. By descriptor (torch's own default on Linux) there is no manager. A strategy
    set in the environment is kept; a hivemind imported already keeps the one it set."""
    if "hivemind.utils.mpfuture" not in sys.modules:
        os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


def package_initialised() -> bool:
    """Whether hivemind's ``__init__`` has run."""
    module = sys.modules.get("hivemind")
    return module is not None and ("__getattr__" not in module.__dict__ or "__version__" in module.__dict__)
