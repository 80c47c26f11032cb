r"""Conformance between the Python P machine (``kvproto.lifecycle.Ledger``) and the TLA+
ledger spec (``kvproto/tla/KVLedger.tla``): state-graph equality and the TLC graph as an oracle.

How it works (spec/TLA.md, section 6, has the full story):

* A :class:`~kvproto.verify.models.GraphModel` is one small bounded configuration (requests, readers, shared blocks,
  sibling groups, lease terms in discrete time units, staging caps). It generates a TLA+
  harness module ``MC_conf_<name>.tla`` that EXTENDS ``kvproto/tla/KVLedger.tla`` and has one
  *named action per input instance* (``Done_r1_d2_1 == Done("r1", "d2", 1) /\ TRUE``),
  so every edge of TLC's state graph carries its arguments in its label, not just the
  operator name.
* TLC dumps the reachable graph (``-dump dot,actionlabels``); :func:`read_dot` reads it
  into an ``nx.MultiDiGraph`` whose nodes are the *values* of the states (fingerprints
  change from run to run) and whose edge keys are the action labels.
* :func:`explore_python` explores the Python ``Ledger``'s reachable graph by BFS over the
  same inputs, mapping each concrete ledger through :func:`abstract` (the abstraction
  function documented in KVLedger.tla's header) and de-duplicating by abstract state.
* :func:`compare` checks that both graphs have the same states and the same labelled
  edges, and renders the first few differences with the shortest input path to them.

Python "refuses" an input when it answers with a ``Rejected`` effect (register of a known
handle); the spec then has no successor. Every other input is a step of the spec, possibly
a stuttering self-loop (a stale ``done``, a duplicate ``abort``...).
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeAlias

import networkx as nx

from kvproto.lifecycle import (
    Ledger,
)
from kvproto.verify.abstraction import (
    LedgerFactory,
    PyNode,
    abstract,
    apply_action,
    describe,
    initial_node,
)
from kvproto.verify.models import GRAPH_MODELS, GraphModel
from kvproto.verify.oracle import refused
from kvproto.verify.tlc import (
    MissingDependency,
    ParseError,
    State,
    conformance_dir,
    parse_state,
    paused_gc,
    require_ok,
    run_tlc,
    shared_states,
    spec_dir,
)

log = logging.getLogger(__name__)

# The graph-equality models and their type, under the names this module always used.
MODELS: Final = GRAPH_MODELS
Model: TypeAlias = GraphModel
TLCMissing = MissingDependency


# ---------------------------------------------------------------------------
# TLC's DOT dump -> networkx.
# ---------------------------------------------------------------------------

_DOT_STR = r'"((?:[^"\\]|\\.)*)"'
_NODE_RE: Final = re.compile(r"^(-?\d+) \[label=" + _DOT_STR)
_EDGE_RE: Final = re.compile(r"^(-?\d+) -> (-?\d+) \[label=" + _DOT_STR)


def _dot_unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), s)


def read_dot(path: str | Path) -> nx.MultiDiGraph:
    """Read TLC's ``-dump dot,actionlabels`` file into a MultiDiGraph.

    Nodes are the parsed state values (an :class:`Fn` of variables); edge keys and the
    ``action`` attribute are the labels. The initial states have ``init=True``."""
    with paused_gc():
        return _read_dot(path)


def _read_dot(path: str | Path) -> nx.MultiDiGraph:
    nodes: dict[str, State] = {}
    edges: list[tuple[str, str, str]] = []
    init: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line[:1] not in "-0123456789":
                continue
            m = _EDGE_RE.match(line)
            if m is not None:
                edges.append((m.group(1), m.group(2), _dot_unescape(m.group(3))))
                continue
            m = _NODE_RE.match(line)
            if m is not None:
                nodes[m.group(1)] = parse_state(_dot_unescape(m.group(2)))
                if "style = filled" in line[m.end():]:
                    init.add(m.group(1))
    g = nx.MultiDiGraph()
    for fp, st in nodes.items():
        g.add_node(st, init=fp in init)
    for a, b, label in edges:
        if a not in nodes or b not in nodes:
            raise ParseError(f"DOT edge {a} -> {b} names an unknown node")
        g.add_edge(nodes[a], nodes[b], key=label, action=label)
    return g


# ---------------------------------------------------------------------------
# The Python side: abstraction function and BFS.
# ---------------------------------------------------------------------------


@dataclass
class PyGraph:
    graph: nx.MultiDiGraph
    init: State
    parent: dict[State, tuple[State, str]]
    seconds: float


def explore_python(model: Model, factory: LedgerFactory = Ledger, *,
                   max_states: int = 500_000) -> PyGraph:
    """BFS of the Python ledger's reachable graph, de-duplicated by abstract state."""
    with paused_gc():
        return _explore_python(model, factory, max_states)


def _explore_python(model: Model, factory: LedgerFactory, max_states: int) -> PyGraph:
    t0 = time.perf_counter()
    acts = model.actions()
    root = initial_node(model, factory)
    s0 = abstract(model, root)
    g = nx.MultiDiGraph()
    g.add_node(s0, init=True)
    rep: dict[State, PyNode] = {s0: root}
    canon: dict[State, State] = {s0: s0}
    parent: dict[State, tuple[State, str]] = {}
    queue: deque[State] = deque([s0])
    while queue:
        s = queue.popleft()
        node = rep.pop(s)
        for a in acts:
            nxt = node.clone()
            out = apply_action(model, nxt, a)
            if refused(out):
                continue
            t = abstract(model, nxt)
            t = canon.get(t, t)  # one deep comparison; later lookups hit on identity
            if t not in g:
                if g.number_of_nodes() >= max_states:
                    raise RuntimeError(f"more than {max_states} Python states")
                g.add_node(t, init=False)
                canon[t] = t
                rep[t] = nxt
                parent[t] = (s, a.label)
                queue.append(t)
            g.add_edge(s, t, key=a.label, action=a.label)
    return PyGraph(g, s0, parent, time.perf_counter() - t0)


# ---------------------------------------------------------------------------
# TLC side and comparison.
# ---------------------------------------------------------------------------


@dataclass
class TLCGraph:
    graph: nx.MultiDiGraph
    seconds: float
    dot_bytes: int


def explore_tlc(model: Model, workdir: Path | None = None, *, workers: int = 2) -> TLCGraph:
    """Have TLC dump the model's state graph and read it."""
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix=f"conf-{model.name}-")) if workdir is None else workdir
    try:
        mod = model.write_tla(wd)
        dot = wd / f"{model.name}.dot"
        run = require_ok(run_tlc(mod.with_suffix(".cfg"), module=mod.stem, workdir=wd,
                                 workers=workers, name=model.name,
                                 args=["-nowarning", "-dump", "dot,actionlabels", str(dot)]))
        size = dot.stat().st_size
        g = read_dot(dot)
        log.info("TLC %s: %d states, %d edges, %.1fs (DOT %d bytes)", model.name,
                 g.number_of_nodes(), g.number_of_edges(), run.seconds, size)
        return TLCGraph(g, run.seconds, size)
    finally:
        if own:
            shutil.rmtree(wd, ignore_errors=True)


_TLC_CACHE: dict[tuple[str, str], TLCGraph] = {}


def explore_tlc_cached(model: Model) -> TLCGraph:
    """:func:`explore_tlc`, memoised per process on (model, text of the TLA+ inputs)."""
    key = (repr(model), (spec_dir() / "KVLedger.tla").read_text(encoding="utf-8")
           + model.tla_module() + model.tla_cfg())
    if key not in _TLC_CACHE:
        _TLC_CACHE[key] = explore_tlc(model)
    return _TLC_CACHE[key]


def edge_set(g: nx.MultiDiGraph) -> set[tuple[State, str, State]]:
    return {(a, k, b) for a, b, k in g.edges(keys=True)}


def _path_to(parent: Mapping[State, tuple[State, str]], s: State) -> list[str]:
    labels: list[str] = []
    while s in parent:
        s, label = parent[s]
        labels.append(label)
    return labels[::-1]


@dataclass
class Comparison:
    model: str
    py_states: int
    py_edges: int
    tlc_states: int
    tlc_edges: int
    only_py_states: list[State]
    only_tlc_states: list[State]
    only_py_edges: list[tuple[State, str, State]]
    only_tlc_edges: list[tuple[State, str, State]]
    report: str = ""

    @property
    def equal(self) -> bool:
        return not (self.only_py_states or self.only_tlc_states or self.only_py_edges
                    or self.only_tlc_edges)


def compare(model: Model, py: PyGraph, tlc: nx.MultiDiGraph, *, show: int = 3) -> Comparison:
    """Compare state sets and labelled edges. The report explains the first ``show``
    edges that differ *from a state both sides reach* (the root causes), with the input
    path to that state, then the states only one side has."""
    gp = py.graph
    with paused_gc():
        sp = set(gp.nodes)
        tmap = shared_states(gp.nodes, tlc.nodes)  # keyed by TLC's objects
        st = set(tmap.values())
        ep = edge_set(gp)
        et = {(tmap[a], k, tmap[b]) for a, k, b in edge_set(tlc)}
    only_p_s, only_t_s = sp - st, st - sp
    only_p_e, only_t_e = ep - et, et - ep
    cmp = Comparison(model.name, len(sp), len(ep), len(st), len(et),
                     sorted(only_p_s, key=repr), sorted(only_t_s, key=repr),
                     sorted(only_p_e, key=repr), sorted(only_t_e, key=repr))
    if cmp.equal:
        cmp.report = (f"{model.name}: equal ({len(sp)} states, {len(ep)} labelled edges)")
        return cmp
    lines = [f"{model.name}: GRAPHS DIFFER: python {len(sp)} states/{len(ep)} edges, "
             f"TLC {len(st)} states/{len(et)} edges; states only in python {len(only_p_s)}, "
             f"only in TLC {len(only_t_s)}; edges only in python {len(only_p_e)}, "
             f"only in TLC {len(only_t_e)}"]
    # Root causes: a common source state and label whose outcomes differ.
    by_src: dict[tuple[State, str], dict[str, list[State]]] = {}
    for a, k, b in only_p_e:
        if a in st:
            by_src.setdefault((a, k), {}).setdefault("python", []).append(b)
    for a, k, b in only_t_e:
        if a in sp:
            by_src.setdefault((a, k), {}).setdefault("TLC", []).append(b)
    roots = sorted(by_src.items(), key=lambda kv: (len(_path_to(py.parent, kv[0][0])), repr(kv[0])))
    for (src, label), sides in roots[:show]:
        path = _path_to(py.parent, src)
        lines.append("")
        lines.append(f"* from the state reached by [{', '.join(path) or 'Init'}], input {label}:")
        lines.append("  source state:\n    " + describe(src).replace("\n", "\n    "))
        p_dst, t_dst = sides.get("python", []), sides.get("TLC", [])
        if not p_dst:
            lines.append("  python: no such step (refused or leads elsewhere, see TLC)")
        if not t_dst:
            lines.append("  TLC: no such step (the spec does not allow it)")
        for who, dsts in (("python", p_dst), ("TLC", t_dst)):
            for d in dsts:
                lines.append(f"  {who} -> (changes vs source)\n    "
                             + describe(d, src).replace("\n", "\n    "))
        if p_dst and t_dst:
            lines.append("  python vs TLC successor:\n    "
                         + describe(p_dst[0], t_dst[0]).replace("\n", "\n    "))
    for who, states in (("python", cmp.only_py_states), ("TLC", cmp.only_tlc_states)):
        for s in states[:show]:
            lines.append(f"\nstate only in {who}:\n    " + describe(s).replace("\n", "\n    "))
    cmp.report = "\n".join(lines)
    return cmp


@dataclass
class CheckResult:
    comparison: Comparison
    py_seconds: float
    tlc_seconds: float
    tlc_graph: nx.MultiDiGraph
    dot_bytes: int


def check_model(model: Model, factory: LedgerFactory = Ledger, *,
                tlc_graph: TLCGraph | None = None) -> CheckResult:
    """Graph equality for one model (runs TLC unless ``tlc_graph`` is given)."""
    tg = tlc_graph if tlc_graph is not None else explore_tlc(model)
    py = explore_python(model, factory)
    cmp = compare(model, py, tg.graph)
    log.info("%s", cmp.report)
    return CheckResult(cmp, py.seconds, tg.seconds, tg.graph, tg.dot_bytes)


# ---------------------------------------------------------------------------
# CLI helper: python -m kvproto.verify.conformance [--write-tla] [MODEL...]
# ---------------------------------------------------------------------------


def results_table(results: Sequence[CheckResult]) -> str:
    rows = ["| model | states (py / TLC) | edges (py / TLC) | DOT | TLC time | python BFS | equal |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        c = r.comparison
        rows.append(f"| {c.model} | {c.py_states} / {c.tlc_states} | {c.py_edges} / "
                    f"{c.tlc_edges} | {r.dot_bytes / 1e6:.1f} MB | {r.tlc_seconds:.1f} s | "
                    f"{r.py_seconds:.1f} s | {'yes' if c.equal else 'NO'} |")
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvproto.verify.conformance",
                                 description="state-graph equality: Python Ledger vs KVLedger.tla")
    ap.add_argument("models", nargs="*", help=f"models to check (default all: {', '.join(MODELS)})")
    ap.add_argument("--write-tla", action="store_true",
                    help="only (re)write the generated harness modules into the spec's conformance/")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}")
    if args.write_tla:
        for n in names:
            m = MODELS[n]
            (conformance_dir() / f"{m.module_name()}.tla").write_text(m.tla_module(), encoding="utf-8")
            (conformance_dir() / f"{m.module_name()}.cfg").write_text(m.tla_cfg(), encoding="utf-8")
        return 0
    try:
        results = [check_model(MODELS[n]) for n in names]
    except TLCMissing as e:
        log.error("%s", e)
        return 3
    ok = True
    for r in results:
        log.info("%s", r.comparison.report)
        ok = ok and r.comparison.equal
    log.info("\n%s", results_table(results))
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
