"""The seams of the code base, checked so they stay where they are (read from the source; nothing is imported).

* Imports only go down the layers (docs/architecture.md): kernel (errors, config, identity, utils, readyfile, web) <
  wire (protocol, rpc, speedproof) < data (job, ledger, dht, which never import each other) < sides (worker,
  client, which never import each other) < apps (llm) < shell (cli, testing). Every import counts: inside functions (a lazy
  import only hides a dependency) and under ``if TYPE_CHECKING:`` (an annotation is a dependency too).
* No import cycle between gpunet's modules, counted the same way.
* The pure parts do no I/O: the worker's state machines (``gpunet/worker/state/``) and the client's routing, trust
  and attempts read no socket or file, start nothing, sleep nowhere and log nothing; the clock is all they may read.
* Only ``gpunet/rpc.py`` touches hivemind's private p2p internals (``P2P._client``), so a hivemind upgrade changes
  one file.
* No class over 600 lines and no function over 120 without the reason written in a comment above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpunet"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The gpunet modules ``name`` imports, anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import gpunet.a.b` is an import of the module gpunet.a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}

#: The layers, lowest first: each module's layer is that of its top-level name under gpunet.
LAYERS = {
    "kernel": ("errors", "config", "identity", "utils", "readyfile", "web", "_version", "models"),
    "wire": ("protocol", "rpc", "speedproof"),
    "data": ("job", "ledger", "dht"),
    "sides": ("worker", "client"),
    "apps": ("llm",),  # what is built on a side: the OpenAI-compatible gateway over the client
    "shell": ("cli", "testing", "__main__"),
}
#: Layers whose packages stand side by side and never import each other.
APART = ("data", "sides")


def _layer(module: str) -> tuple[int, str]:
    top = module.split(".")[1]
    for rank, (layer, members) in enumerate(LAYERS.items()):
        if top in members:
            return rank, layer
    raise LookupError(f"{module} has no layer: add gpunet.{top} to LAYERS in tests/test_architecture.py")


def _is_reexport(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own submodule ``b``: how a package re-exports, not a dependency."""
    return b.startswith(a + ".") and MODULES[a].name == "__init__.py"


def test_every_module_has_a_layer():
    for name in MODULES:
        if name != "gpunet":  # the facade (gpunet/__init__.py), which imports the sides lazily, by name
            _layer(name)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "gpunet"))
def test_imports_only_go_down(module):
    rank, layer = _layer(module)
    bad = []
    for target in sorted(GRAPH[module]):
        if target == "gpunet":  # the root package: run by any import of gpunet, never a dependency of its parts
            continue
        their_rank, their_layer = _layer(target)
        if their_rank > rank:
            bad.append(f"{module} ({layer}) -> {target} ({their_layer}): imports go down only")
        elif layer == their_layer and layer in APART and module.split(".")[1] != target.split(".")[1]:
            bad.append(f"{module} -> {target}: the {layer} packages never import each other")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {a: sorted(b for b in GRAPH[a] if not _is_reexport(a, b)) for a in GRAPH}
    cycles, state = [], {}  # state: 1 on the DFS stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


#: What the pure modules may not import (reading sockets or files, starting processes or threads, talking to the
#: network or the ledger), and may not call.
IO_MODULES = ("socket", "subprocess", "os", "pathlib", "shutil", "tempfile", "threading", "multiprocessing", "hivemind",
              "urllib", "http", "sqlite3", "gpunet.rpc", "gpunet.dht.network", "gpunet.dht.registry",
              "gpunet.ledger.store", "gpunet.ledger.writer", "gpunet.worker.executor", "gpunet.client.transport")
IO_CALLS = ("open", "print", "sleep", "getLogger", "to_thread", "run_in_executor", "create_task", "ensure_future")
PURE = sorted(m for m in MODULES if m.startswith("gpunet.worker.state")) + [
    "gpunet.client.routing", "gpunet.client.trust", "gpunet.client.attempts"]


@pytest.mark.parametrize("module", PURE)
def test_the_state_machines_do_no_io(module):
    bad = []
    for node in ast.walk(TREES[module]):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        bad += [f"imports {n}" for n in names if n.split(".")[0] in IO_MODULES or n.startswith(IO_MODULES)]
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in IO_CALLS:
                bad.append(f"calls {called}() at line {node.lineno}")
    assert not bad, f"{module} is one of the pure state machines (no I/O):\n" + "\n".join(bad)


def test_only_the_rpc_adapter_touches_hiveminds_p2p_internals():
    offenders = []
    for name, path in MODULES.items():
        if name == "gpunet.rpc":
            continue
        for node in ast.walk(TREES[name]):
            if isinstance(node, ast.Attribute) and node.attr == "_client":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "add_binary_stream_handler", "call_binary_stream_handler", "add_unary_handler",
                    "call_unary_handler"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} ({node.func.attr})")
    assert not offenders, "only gpunet/rpc.py may call hivemind's p2p handlers:\n" + "\n".join(offenders)


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 120


def test_no_class_or_function_grows_past_its_size_without_a_reason():
    """A reason is a comment just above the definition (or its decorators)."""
    lines = {name: path.read_text().splitlines() for name, path in MODULES.items()}
    bad = []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            else:
                continue
            size = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if size > limit and not lines[name][first - 2].strip().startswith("#"):
                bad.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name}: {size} lines (> {limit})")
    assert not bad, "split these, or say why not in a comment above them:\n" + "\n".join(bad)


def _reaches(start: str) -> set[str]:
    """Every module that importing ``start`` loads, at once or later."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        parents = [p for p in (node.rsplit(".", k)[0] for k in range(1, node.count(".") + 1)) if p in MODULES]
        for nxt in [*GRAPH[node], *parents]:  # importing a.b.c runs a/__init__ and a/b/__init__ first
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_checker_sees_imports():
    """Guards the guard: the graph has the edges we know are there, and the rules catch what they are for."""
    assert "gpunet.protocol" in GRAPH["gpunet.worker.doors"]
    assert "gpunet.job.validator" in GRAPH["gpunet.job.job"]  # a lazy or module-level import, either counts
    assert "gpunet.identity" in GRAPH["gpunet.ledger.receipts"]
    assert "gpunet.ledger.store" in _reaches("gpunet.ledger.receipts")  # through gpunet/ledger/__init__.py
    assert "gpunet.client.trust" in _reaches("gpunet.cli")  # through a lazy import in a command
    assert _layer("gpunet.worker.jobs") > _layer("gpunet.ledger.store") > _layer("gpunet.protocol.jobs")
    with pytest.raises(LookupError):
        _layer("gpunet.somewhere_new")
