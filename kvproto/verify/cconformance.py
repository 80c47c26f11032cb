"""Coverage state-graph equality: the Python ``Coverage`` machine against
``KVCoverage.tla`` on the ``coverage`` model (``MC_coverage``), as
``kvproto.verify.dconformance`` does for the Consumer.

TLC dumps the reachable graph of ``MC_coverage.cfg``; a BFS of the Python machine over the
same inputs (``Expect(r)``, ``PartFailed(r, p)``, ``PartRead(r, p, S)`` for every subset S
of the part's regions, each only where the TLA+ action is enabled) builds the other. Both
are projected on ``cst``, ``got`` and ``left`` (``ceff`` is the effects of one step; the
stutter ``CEnd`` is left out) and their labelled edge sets must be equal.

ABSTRACTION: cst[r] = Coverage.state(r); got[r] = {<<p, l, g>> : Coverage.read(r)};
left[r] = Coverage.pending(r).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, combinations
from pathlib import Path
from typing import Final

from kvproto.lifecycle.coverage import COVERING, Coverage, Region
from kvproto.verify.conformance import read_dot
from kvproto.verify.tlc import Fn, Value, mk_fn, require_ok, run_tlc, spec_dir

REQUESTS: Final = ("r1", "r2")
PARTS: Final = (0, 1)
LAYERS: Final = (0, 1)
GROUPS: Final = (0,)
NEED: Final = {"r1": (0, 1), "r2": (0,)}  # MC_coverage.tla's MCNeedOf


def _regions(p: int) -> frozenset[Region]:
    return frozenset(Region(p, layer, g) for layer in LAYERS for g in GROUPS)


def _subsets(s: frozenset[Region]) -> Iterator[frozenset[Region]]:
    xs = sorted(s)
    return (frozenset(c) for c in chain.from_iterable(
        combinations(xs, n) for n in range(len(xs) + 1)))


def abstract(c: Coverage) -> Fn:
    def fn(f: dict[str, Value]) -> Value:
        return mk_fn(f)
    return Fn((
        ("cst", fn({r: c.state(r) for r in REQUESTS})),
        ("got", fn({r: frozenset(tuple(x) for x in c.read(r)) for r in REQUESTS})),
        ("left", fn({r: frozenset(c.pending(r)) for r in REQUESTS})),
    ))


Edge = tuple[Fn, str, Fn]


def explore_python(factory: type[Coverage] = Coverage) -> set[Edge]:
    """Every labelled edge of the Python machine's reachable graph (abstract states)."""
    root = factory()
    s0 = abstract(root)
    rep = {s0: root}
    seen = {s0}
    queue: deque[Fn] = deque([s0])
    edges: set[Edge] = set()
    while queue:
        s = queue.popleft()
        node = rep.pop(s)
        steps: list[tuple[str, Coverage]] = []
        for r in REQUESTS:
            if node.state(r) == "new":
                n = node.clone()
                n.expect(r, {p: _regions(p) for p in NEED[r]})
                steps.append(("Expect", n))
            if node.state(r) != COVERING:
                continue
            for p in node.pending(r):
                n = node.clone()
                n.part_failed(r, p)
                steps.append(("PartFailed", n))
                for sub in _subsets(_regions(p)):
                    n = node.clone()
                    n.part_read(r, p, sub)
                    steps.append(("PartRead", n))
        for label, n in steps:
            t = abstract(n)
            edges.add((s, label, t))
            if t not in seen:
                seen.add(t)
                rep[t] = n
                queue.append(t)
    return edges


def explore_tlc(workdir: Path | None = None) -> set[Edge]:
    """TLC's graph of MC_coverage.cfg, projected on cst, got and left."""
    wd = Path(tempfile.mkdtemp(prefix="cconf-")) if workdir is None else workdir
    try:
        for f in ("KVCoverage.tla", "MC_coverage.tla", "MC_coverage.cfg"):
            shutil.copy(spec_dir() / f, wd / f)
        dot = wd / "coverage.dot"
        require_ok(run_tlc("MC_coverage.cfg", module="MC_coverage", workdir=wd, workers=1,
                           name="coverage_graph",
                           args=["-nowarning", "-dump", "dot,actionlabels", str(dot)]))
        g = read_dot(dot)
        out: set[Edge] = set()
        for a, b, k in g.edges(keys=True):
            if k == "CEnd":
                continue
            out.add((_project(a), k, _project(b)))
        return out
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)


def _project(st: Fn) -> Fn:
    return Fn(tuple((k, v) for k, v in st.items if k in ("cst", "got", "left")))


@dataclass
class CComparison:
    only_py: list[Edge]
    only_tlc: list[Edge]
    edges: int

    @property
    def equal(self) -> bool:
        return not self.only_py and not self.only_tlc


def compare(factory: type[Coverage] = Coverage) -> CComparison:
    py, tlc = explore_python(factory), explore_tlc()
    key = repr
    return CComparison(sorted(py - tlc, key=key), sorted(tlc - py, key=key), len(py))
