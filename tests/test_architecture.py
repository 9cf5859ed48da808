"""The seams of the code base, checked so they stay where they are (read from the source; nothing is imported).

* No import cycle between gpunet's modules, counting imports inside functions too (a lazy import only hides a
  cycle); imports under ``if TYPE_CHECKING:`` are for annotations and never run, so they do not count.
* The worker never imports the client nor the shell (the status table, the CLI, the explorer, the demo: the
  network reader they share is gpunet.dht.status); the job format (``gpunet.job``) never imports the worker, the client or the
  network; identity and config import no other part of gpunet but errors.
* Only ``gpunet/rpc.py`` touches hivemind's private p2p internals (``P2P._client``), so a hivemind upgrade changes
  one file.
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


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (annotations only: never imported at run time)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(name: str) -> set[str]:
    """The gpunet modules ``name`` imports, anywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
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


def _is_reexport(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own submodule ``b``: how a package re-exports, not a dependency."""
    return b.startswith(a + ".") and MODULES[a].name == "__init__.py"


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


@pytest.mark.parametrize("layer, forbidden", [
    ("gpunet.worker", ("gpunet.client", "gpunet.status", "gpunet.cli", "gpunet.explorer", "gpunet.demo")),
    ("gpunet.job", ("gpunet.worker", "gpunet.client", "gpunet.dht", "gpunet.ledger", "gpunet.rpc")),
    ("gpunet.dht", ("gpunet.worker", "gpunet.client", "gpunet.ledger", "gpunet.status")),
    ("gpunet.ledger", ("gpunet.worker", "gpunet.client", "gpunet.dht", "gpunet.job")),
    ("gpunet.identity", ("gpunet.worker", "gpunet.client", "gpunet.dht", "gpunet.ledger", "gpunet.job")),
    ("gpunet.config", ("gpunet.worker", "gpunet.client", "gpunet.dht", "gpunet.ledger", "gpunet.job",
                       "gpunet.identity")),
    ("gpunet.protocol", ("gpunet.worker", "gpunet.client", "gpunet.dht", "gpunet.ledger", "gpunet.job")),
])
def test_layers_do_not_reach_upwards(layer, forbidden):
    """Not directly, and not through another module either."""
    members = [n for n in MODULES if n == layer or n.startswith(layer + ".")]
    bad = sorted(f"{m} -> {t}" for m in members for t in _reaches(m) if t.startswith(forbidden))
    assert not bad, f"{layer} must not import {', '.join(forbidden)}:\n" + "\n".join(bad)


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


def test_only_the_rpc_adapter_touches_hiveminds_p2p_internals():
    offenders = []
    for name, path in MODULES.items():
        if name == "gpunet.rpc":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "_client":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "add_binary_stream_handler", "call_binary_stream_handler", "add_unary_handler",
                    "call_unary_handler"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} ({node.func.attr})")
    assert not offenders, "only gpunet/rpc.py may call hivemind's p2p handlers:\n" + "\n".join(offenders)


def test_the_checker_sees_imports():
    """Guards the guard: the graph has the edges we know are there."""
    assert "gpunet.protocol" in GRAPH["gpunet.worker.doors"]
    assert "gpunet.job.validator" in GRAPH["gpunet.job.job"]  # a lazy or module-level import, either counts
    assert "gpunet.identity" in GRAPH["gpunet.ledger.receipts"]
    assert "gpunet.ledger.store" in _reaches("gpunet.ledger.receipts")  # through gpunet/ledger/__init__.py
    assert "gpunet.client.trust" in _reaches("gpunet.cli")  # through a lazy import in a command
