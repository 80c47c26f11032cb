"""Code outside ``kvproto/lifecycle/`` reads the machines through their public views
(``state``, ``held``, ``peer``, ``request``, ``clone()``...) and changes them only through
their events and documented public hooks (``tally``, ``sweep``): no module of ``kvproto/``
or ``tests/`` outside the lifecycle package imports or touches a private name (one leading
underscore) that the lifecycle defines.

The check reads each module's syntax tree. A private name the lifecycle defines counts as
touched when a module imports it from ``kvproto.lifecycle``; reads, writes or calls it as
an attribute (``ledger._live``, ``super()._sweep(...)``, ``c._next_hb = 0``); or defines
it in a subclass of a lifecycle class (overriding ``_step``). A module may use a private
name of the same spelling that it, or a kvproto module it imports, defines for itself
(the NIXL adapter's own ``_count``), except on ``self``/``super()`` inside a subclass of
a lifecycle class, where the name is the lifecycle's. ``ALLOWED`` lists the few uses
with no public way, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvproto"
LIFECYCLE = PKG / "lifecycle"

# (file, name) -> why no public way exists. Each entry must still be needed.
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/test_ledger.py", "_hold"):
        "a double free needs a hold and two drops the ledger itself never makes",
    ("tests/test_ledger.py", "_drop"):
        "a double free needs a drop the ledger itself never makes",
    ("tests/test_sim.py", "_drop"):
        "the simulator's NoDoubleFree check is shown to fire on a drop no machine makes",
    ("kvproto/bench/ledger.py", "_maybe_compact"):
        "the no-compaction baseline measures a heap that is never rebuilt",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: a class reaching its own (or inherited) name."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
        and node.func.id == "super"


def defined_names(tree: ast.Module) -> set[str]:
    """The private names a module defines for itself: functions, classes, module and
    class level assignments, ``__slots__`` entries and ``self.x``/``cls.x`` stores."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _is_self(node.value):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            out.update(c.value for c in ast.walk(node.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in out if _private(n)}


def lifecycle_names() -> tuple[frozenset[str], frozenset[str]]:
    """(private names the lifecycle defines, public class names it defines)."""
    private: set[str] = set()
    classes: set[str] = set()
    for f in LIFECYCLE.glob("*.py"):
        tree = ast.parse(f.read_text(encoding="utf-8"), str(f))
        private |= defined_names(tree)
        classes |= {n.name for n in ast.walk(tree)
                    if isinstance(n, ast.ClassDef) and not n.name.startswith("_")}
    return frozenset(private), frozenset(classes)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(tree: ast.Module) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def touches(source: str, private: frozenset[str], classes: frozenset[str],
            own: frozenset[str] = frozenset()) -> list[tuple[int, str, str]]:
    """(line, name, how) for every private lifecycle name ``source`` touches. ``own``:
    the private names the module (or a kvproto module it imports) defines for itself."""
    tree = ast.parse(source)
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvproto.lifecycle"):
            found += [(node.lineno, a.name, "import") for a in node.names if _private(a.name)]
    # Subclasses of lifecycle classes (directly, or through a class of this module).
    sub: set[str] = set()
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for c in defs:
            if c.name in sub:
                continue
            names = {n.id for b in c.bases for n in ast.walk(b) if isinstance(n, ast.Name)} \
                | {n.attr for b in c.bases for n in ast.walk(b) if isinstance(n, ast.Attribute)}
            if names & (classes | sub):
                sub.add(c.name)
                grew = True
    inside: set[int] = set()  # ids of nodes within a lifecycle subclass
    for c in defs:
        if c.name in sub:
            for stmt in c.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and stmt.name in private:
                    found.append((stmt.lineno, stmt.name, "override"))
                if isinstance(stmt, ast.Assign):
                    found += [(stmt.lineno, t.id, "override") for t in stmt.targets
                              if isinstance(t, ast.Name) and t.id in private]
            inside.update(id(n) for n in ast.walk(c))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            mine = node.attr in own and not (id(node) in inside and _is_self(node.value))
            if not mine:
                found.append((node.lineno, node.attr, "attribute"))
    return sorted(found)


def _sources() -> list[Path]:
    files = [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    return sorted(f for f in files if LIFECYCLE not in f.parents)


def all_touches() -> dict[tuple[str, str], list[str]]:
    private, classes = lifecycle_names()
    trees = {f: ast.parse(f.read_text(encoding="utf-8"), str(f)) for f in _sources()}
    own_of = {_module_of(f): defined_names(t) for f, t in trees.items()}
    out: dict[tuple[str, str], list[str]] = {}
    for f, tree in trees.items():
        own = set(own_of[_module_of(f)])
        for m in _imported_modules(tree):
            if m in own_of and m.startswith("kvproto."):
                own |= own_of[m]
        rel = f.relative_to(ROOT).as_posix()
        for line, name, how in touches(f.read_text(encoding="utf-8"), private, classes,
                                       frozenset(own)):
            out.setdefault((rel, name), []).append(f"{rel}:{line}: {how} {name}")
    return out


def test_no_module_outside_the_lifecycle_touches_its_private_names() -> None:
    bad = [line for key, lines in all_touches().items() if key not in ALLOWED
           for line in lines]
    assert not bad, "private lifecycle names used outside kvproto/lifecycle/ " \
        "(use or add a public view):\n" + "\n".join(bad)


def test_every_allowed_use_is_still_needed() -> None:
    stale = sorted(set(ALLOWED) - set(all_touches()))
    assert not stale, f"ALLOWED entries no longer used (remove them): {stale}"


def test_the_lifecycle_has_private_names_to_protect() -> None:
    private, classes = lifecycle_names()
    assert {"_live", "_lease_heap", "_next_hb", "_Req", "_DReq", "_step"} <= private
    assert {"Ledger", "Consumer", "BlockPool"} <= classes


@pytest.mark.parametrize("snippet, name", [
    ("from kvproto.lifecycle.producer import _Req\n", "_Req"),
    ("from kvproto.lifecycle.consumer import _DReq, _Peer\n", "_DReq"),
    ("def f(c):\n    return c._next_hb\n", "_next_hb"),
    ("def f(ledger):\n    ledger._live.clear()\n", "_live"),
    ("def f(c):\n    c._lease_heap = []\n", "_lease_heap"),
    ("from kvproto import lifecycle\nX = lifecycle._DURATIONS\n", "_DURATIONS"),
    ("from kvproto.lifecycle import Ledger\nclass M(Ledger):\n"
     "    def _step(self, r, event, guard, now, out):\n        pass\n", "_step"),
    ("from kvproto.lifecycle import Ledger\nclass M(Ledger):\n"
     "    def tick(self, now):\n        return self._clock(now)\n", "_clock"),
    ("from kvproto.lifecycle import Ledger\nclass M(Ledger):\n"
     "    def _count(self, name, n=1):\n        super()._count(name, n)\n", "_count"),
    ("from kvproto import lifecycle\nclass A(lifecycle.Consumer):\n    pass\n"
     "class B(A):\n    def f(self):\n        return self._group_owner\n", "_group_owner"),
])
def test_the_check_catches_a_private_use(snippet: str, name: str) -> None:
    private, classes = lifecycle_names()
    assert name in {n for _, n, _ in touches(snippet, private, classes)}, snippet


@pytest.mark.parametrize("snippet", [
    "def f(ledger):\n    return ledger.held(1), ledger.clone(), ledger.heap_entries\n",
    "def f(c):\n    return c.next_heartbeat_at, c.peer('P0'), c.request('r1')\n",
    "from kvproto.lifecycle import Ledger\nclass M(Ledger):\n"
    "    def sweep(self, now, out):\n        self.expire(1, now, out)\n",
    # A class of its own with a private name of the same spelling.
    "class Adapter:\n    def _count(self, name):\n        pass\n"
    "    def f(self):\n        self._count('x')\n",
])
def test_the_check_lets_public_use_pass(snippet: str) -> None:
    private, classes = lifecycle_names()
    tree = ast.parse(snippet)
    assert touches(snippet, private, classes, frozenset(defined_names(tree))) == []
