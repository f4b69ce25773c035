"""The import rule of ARCHITECTURE.md, checked on the source: no module of a lower layer imports
one of a higher layer (at module level or inside a function), units of one layer do not import
each other, and no two modules import each other, directly or around a cycle."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "gcache"

# Lowest first. A unit is a module or a package (all its modules).
LAYERS: list[list[str]] = [
    ["gcache", "gcache.errors", "gcache.protocol", "gcache.sizes", "gcache.argtypes", "gcache.ratelog", "gcache.process", "gcache.env",
     "gcache.mooncake_trace"],
    ["gcache.net"],
    ["gcache.tier", "gcache.meta", "gcache.transport"],
    ["gcache.client", "gcache.server"],
    ["gcache.ops"],
    ["gcache.cluster", "gcache.daemon", "gcache.masterd", "gcache.doctor"],
    ["gcache.bench"],
    ["gcache.bench_cli"],
    ["gcache.cli"],
    ["gcache.__main__"],
]
BASE = set(LAYERS[0])  # the base modules may import each other (errors is the bottom of it)
# Known breaks of the rule, each with the change that removes it (none).
KNOWN: set[tuple[str, str]] = set()


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> list[tuple[str, bool, int]]:
    """(imported gcache module, whether only for type checking, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                typing_only.update(id(n) for n in ast.walk(sub))

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name == "gcache" or name.startswith("gcache."):
                target = resolve(name)
                if target is not None:
                    out.append((target, id(node) in typing_only, node.lineno))
    return out


def unit(module: str) -> str:
    for layer in LAYERS:
        for u in sorted(layer, key=len, reverse=True):
            if module == u or (u != "gcache" and module.startswith(u + ".")):
                return u
    return "?"


def layer_of(u: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if u in layer)


def test_every_module_has_a_layer():
    assert [m for m in modules() if unit(m) == "?"] == []


def test_no_module_imports_a_higher_layer_or_a_sibling_unit():
    known = modules()
    bad = []
    for mod, path in sorted(known.items()):
        src = unit(mod)
        for target, _typing, line in imports(path, known):
            dst = unit(target)
            if dst == src or (src in BASE and dst in BASE) or (mod, target) in KNOWN:
                continue
            if layer_of(dst) >= layer_of(src):
                bad.append(f"{mod}:{line} imports {target} ({src}, layer {layer_of(src)} -> {dst}, "
                           f"layer {layer_of(dst)})")
    assert bad == []


def test_no_import_cycles():
    known = modules()
    graph = {m: sorted({t for t, typing, _ in imports(p, known) if not typing and t != m}) for m, p in known.items()}
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert cycles == []


def test_client_and_transport_modules_stay_small():
    big = {str(p.relative_to(ROOT.parent)): n for pkg in ("client", "transport")
           for p in (ROOT / pkg).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert big == {}
