"""The house: kvproto's modules form layers, read from their own imports (every ``import``
statement, at module level or inside a function). A module imports only its own layer or
lower ones, the import graph has no circle, the production path never imports verification,
testing or benchmark code, and no module is over 1,000 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kvproto"

# Lowest first. ``cli`` holds the argument helpers every command uses and loads commands
# by name (importlib), so it sits at the bottom with the wire format (``__main__``, for
# ``python -m kvproto``, only calls it).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "wire", "cli", "__main__"),
    ("lifecycle",),
    ("port", "journal", "metrics", "diagram"),
    ("nixl",),
    ("vllm",),
    ("verify",),
    ("testing",),
    ("bench",),
)
PRODUCTION: frozenset[str] = frozenset({"errors", "wire", "cli", "__main__", "lifecycle", "port",
                                        "journal", "metrics", "diagram", "nixl", "vllm"})
MAX_LINES = 1000


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join([*here, *([node.module] if node.module else [])])
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for t in targets:
                if t == "kvproto" or t.startswith("kvproto."):
                    r = _resolve(t, mods)
                    if r and r != m and not m.startswith(r + "."):
                        edges[m].add(r)
    return edges


def top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def layer(module: str) -> int:
    t = top(module)
    for i, names in enumerate(LAYERS):
        if t in names:
            return i
    return len(LAYERS)  # the package's __init__: the public API, above everything


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_every_module_has_a_layer() -> None:
    unknown = sorted(m for m in _modules() if m != "kvproto" and layer(m) == len(LAYERS))
    assert not unknown, f"modules outside every layer (add them to LAYERS): {unknown}"


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    bad = sorted(f"{a} -> {b}" for a, bs in import_graph().items() for b in bs
                 if a != "kvproto" and b != "kvproto" and layer(b) > layer(a))
    assert not bad, "imports that go up the layers:\n" + "\n".join(bad)


def test_production_path_never_imports_verification_or_testing() -> None:
    bad = sorted(f"{a} -> {b}" for a, bs in import_graph().items() for b in bs
                 if top(a) in PRODUCTION and top(b) not in PRODUCTION)
    assert not bad, "\n".join(bad)


def test_no_module_over_the_line_cap() -> None:
    sizes = {str(f.relative_to(PKG.parent)): len(f.read_text(encoding="utf-8").splitlines())
             for f in PKG.rglob("*.py")}
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


@pytest.mark.parametrize("edges, want", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_circle_finder_finds_circles(edges: dict[str, set[str]],
                                         want: list[list[str]]) -> None:
    assert circles(edges) == want
