"""The packages import downward only (docs/architecture.md: tools > runtime >
lazyfs > pmem > composer > chunkstore) and no module of ours imports,
however indirectly, one that imports it back: every `import` counts, at the
top of a module or inside a function (a lazy import is still a dependency),
except those under `if TYPE_CHECKING:` (types only, never run)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lower first: a module may import its own package's and those before it
LAYERS = ["chunkstore", "composer", "pmem", "lazyfs", "runtime", "tools"]
RANK = {p: i for i, p in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_pkg: bool,
             known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                 for a in node.names]
    out = []
    for name in names:
        while name and name not in known:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def imports() -> dict[str, set[tuple[str, int]]]:
    """module -> {(module it imports, line)} over our packages."""
    known = _modules()
    graph: dict[str, set[tuple[str, int]]] = {m: set() for m in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree)
                       if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in typing_only:
                for target in _targets(module, node, path.name == "__init__.py", known):
                    graph[module].add((target, node.lineno))
    return graph


def cycles(graph: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _ in es}) for m, es in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_packages_import_downward_only() -> None:
    graph = imports()
    up = [f"{m}:{line} imports {t}" for m, es in sorted(graph.items()) for t, line in sorted(es)
          if RANK[t.split(".")[0]] > RANK[m.split(".")[0]]]
    assert up == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert cycles(imports()) == []


def test_the_check_sees_a_cycle_and_an_upward_import() -> None:
    """(The rules above can fail: the same walk over a made-up graph.)"""
    graph = {"composer.a": {("lazyfs.b", 3)}, "lazyfs.b": {("composer.a", 9)},
             "chunkstore.c": set()}
    assert cycles(graph) == [["composer.a", "lazyfs.b"]]
    assert RANK["lazyfs"] > RANK["composer"]


def test_runtime_shows_its_rooms() -> None:
    """runtime/'s top level holds the API declaration and the value types
    every room shares, and the rooms; the node's class stays under 500
    lines (its collaborators hold the rest)."""
    top = {p.stem for p in (ROOT / "runtime").glob("*.py")}
    assert top == {"__init__", "api", "config", "errors", "files", "images", "native", "spec"}
    rooms = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert rooms == {"agent", "backends", "client", "docker", "fleet", "guest", "isolation",
                     "node"}
    assert len((ROOT / "runtime/node/core.py").read_text().splitlines()) <= 500
