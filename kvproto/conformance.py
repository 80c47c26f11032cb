r"""Conformance between the Python P machine (``kvproto.lifecycle.Ledger``) and the TLA+
ledger spec (``tla/KVLedger.tla``): state-graph equality and the TLC graph as an oracle.

How it works (spec/CONFORMANCE.md has the full story):

* A :class:`Model` is one small bounded configuration (requests, readers, shared blocks,
  sibling groups, lease terms in discrete time units, staging caps). It generates a TLA+
  harness module ``MC_conf_<name>.tla`` that EXTENDS ``tla/KVLedger.tla`` and has one
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
import contextlib
import io
import logging
import pickle
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeAlias

import networkx as nx

from kvproto import lifecycle
from kvproto.lifecycle import (
    DONE,
    HEARTBEAT,
    RELEASE,
    BlockPool,
    Config,
    Effect,
    Free,
    Ledger,
    Rejected,
)
from kvproto.tlc import MissingDependency, find_jar, find_java

log = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parent.parent
TLA_DIR: Final = REPO / "tla"
CONF_DIR: Final = TLA_DIR / "conformance"


# ---------------------------------------------------------------------------
# TLC values, as printed by TLC, parsed into hashable Python values.
# ---------------------------------------------------------------------------


class Fn:
    """A TLA+ function or record whose domain is not 1..n, as sorted (key, value) pairs.

    Records ``[a |-> 1]`` and functions ``("a" :> 1)`` with the same graph are equal,
    as in TLA+. Functions with domain 1..n are normalised to tuples (sequences).
    Immutable; the hash is cached (states are dictionary keys of large graphs)."""

    __slots__ = ("_hash", "items")

    def __init__(self, items: tuple[tuple[Value, Value], ...]) -> None:
        self.items = items
        self._hash = hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Fn):
            return NotImplemented
        return self._hash == other._hash and self.items == other.items

    def __getitem__(self, key: Value) -> Value:
        for k, v in self.items:
            if k == key:
                return v
        raise KeyError(key)

    def get(self, key: Value, default: Value | None = None) -> Value | None:
        for k, v in self.items:
            if k == key:
                return v
        return default

    def keys(self) -> list[Value]:
        return [k for k, _ in self.items]

    def __repr__(self) -> str:
        if all(isinstance(k, str) and k.isidentifier() for k, _ in self.items):
            return "[" + ", ".join(f"{k} |-> {render(v)}" for k, v in self.items) + "]"
        return "(" + " @@ ".join(f"{render(k)} :> {render(v)}" for k, v in self.items) + ")"


@dataclass(frozen=True, slots=True)
class ModelValue:
    name: str

    def __repr__(self) -> str:
        return self.name


Value: TypeAlias = int | bool | str | tuple["Value", ...] | frozenset["Value"] | Fn | ModelValue


def _sort_key(v: Value) -> tuple[int, str]:
    return (0 if isinstance(v, int) else 1, repr(v))


def mk_fn(pairs: Mapping[Any, Value] | Sequence[tuple[Value, Value]]) -> Value:
    """Normalise a function: domain 1..n becomes a tuple, otherwise an :class:`Fn`."""
    items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
    n = len(items)
    if not n:
        return ()
    k0 = items[0][0]
    if isinstance(k0, int) and not isinstance(k0, bool) \
            and all(type(k) is int for k, _ in items) \
            and sorted(k for k, _ in items) == list(range(1, n + 1)):  # type: ignore[type-var]
        return tuple(v for _, v in sorted(items, key=lambda kv: kv[0]))
    try:
        items.sort(key=lambda kv: kv[0])  # type: ignore[arg-type,return-value]
    except TypeError:  # mixed key types
        items.sort(key=lambda kv: _sort_key(kv[0]))
    return Fn(tuple(items))


def render(v: Value) -> str:
    """TLA+ notation of a value (for reports)."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple):
        return "<<" + ", ".join(render(x) for x in v) + ">>"
    if isinstance(v, frozenset):
        return "{" + ", ".join(render(x) for x in sorted(v, key=_sort_key)) + "}"
    return repr(v)


class ParseError(ValueError):
    pass


_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<int>-?\d+)|(?P<op><<|>>|\|->|:>|@@|/\\|[\[\]{}(),=])'
                    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*))", re.S)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise ParseError(f"cannot tokenise TLC value at {text[pos:pos + 40]!r}")
            kind = m.lastgroup
            assert kind is not None
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "")

    def take(self, want: str | None = None) -> tuple[str, str]:
        t = self.peek()
        if want is not None and t[1] != want:
            raise ParseError(f"expected {want!r}, got {t[1]!r} (token {self.i})")
        self.i += 1
        return t

    def value(self) -> Value:
        kind, tok = self.take()
        if kind == "str":
            return re.sub(r"\\(.)", r"\1", tok[1:-1])
        if kind == "int":
            return int(tok)
        if kind == "id":
            if tok == "TRUE":
                return True
            if tok == "FALSE":
                return False
            return ModelValue(tok)
        if tok == "<<":
            items = self._list(">>")
            return tuple(items)
        if tok == "{":
            return frozenset(self._list("}"))
        if tok == "[":
            pairs: list[tuple[Value, Value]] = []
            while self.peek()[1] != "]":
                k = self.take()
                self.take("|->")
                pairs.append((k[1], self.value()))
                if self.peek()[1] == ",":
                    self.take()
            self.take("]")
            return mk_fn(pairs)
        if tok == "(":
            pairs = []
            while True:
                key = self.value()
                self.take(":>")
                pairs.append((key, self.value()))
                if self.peek()[1] == "@@":
                    self.take()
                    continue
                self.take(")")
                return mk_fn(pairs)
        raise ParseError(f"unexpected token {tok!r}")

    def _list(self, close: str) -> list[Value]:
        out: list[Value] = []
        while self.peek()[1] != close:
            out.append(self.value())
            if self.peek()[1] == ",":
                self.take()
        self.take(close)
        return out


def parse_value(text: str) -> Value:
    """Parse one TLC value (``[a |-> {1, 2}, b |-> <<"x">>]``...)."""
    p = _Parser(text)
    v = p.value()
    if p.peek()[0] != "eof":
        raise ParseError(f"trailing input after value: {p.peek()[1]!r}")
    return v


State: TypeAlias = Fn  # variable name -> value


def parse_state(text: str) -> State:
    """Parse a TLC state ``/\\ x = 1 /\\ y = {}`` into an :class:`Fn` of its variables."""
    p = _Parser(text)
    pairs: list[tuple[Value, Value]] = []
    while p.peek()[0] != "eof":
        if p.peek()[1] == "/\\":
            p.take()
        name = p.take()[1]
        p.take("=")
        pairs.append((name, p.value()))
    st = mk_fn(pairs)
    assert isinstance(st, Fn)
    return st


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
# Running TLC (a minimal private runner; kvproto/tlc.py was not available when this
# module was written).
# ---------------------------------------------------------------------------


# The runtime lookup (java, tla2tools.jar) is kvproto.tlc's; TLCMissing is its error.
TLCMissing = MissingDependency


class TLCError(RuntimeError):
    """TLC exited with an unexpected code or reported a parse/semantic error."""

    def __init__(self, msg: str, output: str = "") -> None:
        super().__init__(msg)
        self.output = output


@dataclass
class TLCRun:
    returncode: int
    output: str
    seconds: float


def run_tlc(module: Path, cfg: Path, *, extra: Sequence[str] = (), workers: int = 2,
            timeout: float = 600.0, ok_codes: Sequence[int] = (0,)) -> TLCRun:
    """Run TLC on ``module`` with ``cfg`` (a unique -metadir in module's directory)."""
    jar, java = find_jar(), find_java()
    metadir = tempfile.mkdtemp(prefix="meta-", dir=module.parent)
    cmd = [java, "-XX:+UseParallelGC", "-Xss16m", "-cp", str(jar), "tlc2.TLC",
           "-workers", str(workers), "-metadir", metadir, "-cleanup", "-nowarning",
           "-config", cfg.name, *extra, module.name]
    log.debug("running %s", " ".join(cmd))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=module.parent, capture_output=True, text=True,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise TLCError(f"TLC did not finish within {timeout:.0f} s on {module.name} "
                       "(a long journal: validate it in parts, or raise the timeout)", out) from e
    finally:
        shutil.rmtree(metadir, ignore_errors=True)
    dt = time.perf_counter() - t0
    out = p.stdout + p.stderr
    if p.returncode not in ok_codes or "*** Errors" in out or "Semantic errors" in out:
        raise TLCError(f"TLC exited with {p.returncode} on {module.name}", out)
    return TLCRun(p.returncode, out, dt)


# ---------------------------------------------------------------------------
# Models and the generated harness.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """One input instance: ``label`` is the TLA+ operator name of the generated action."""

    label: str
    kind: str  # register | done | heartbeat | release | abort | tick
    request: str = ""
    reader: str = ""
    expected: int = 0


@dataclass(frozen=True)
class Model:
    """A small bounded model, the same for TLC and for the Python BFS.

    Time is in discrete units (Python time = TLA+ units). Blocks are 1..n in TLA+ and
    0..n-1 in Python. Handles are 1..len(requests) in Python, request names in TLA+."""

    name: str
    requests: tuple[str, ...]
    readers: tuple[str, ...]
    blocks_of: Mapping[str, tuple[int, ...]]
    group_of: Mapping[str, str | None]
    reg_expected: Mapping[str, int]
    expected_values: tuple[int, ...] = (0, 2)  # expected readers announced by done/release
    hb_expected: tuple[int, ...] | None = None  # ... by heartbeat (None: expected_values)
    initial_lease: int = 1
    lease_extension: int = 2
    abort_grace: int = 2
    max_staged: int = 1
    max_staged_msgs: int = 1
    max_staged_age: int = 2
    doc: str = ""

    @property
    def capacity(self) -> int:
        return max(b for bs in self.blocks_of.values() for b in bs)

    def handle(self, r: str) -> int:
        return self.requests.index(r) + 1

    def config(self) -> Config:
        """The Python Config with the same terms (timing checks satisfied with tiny
        heartbeat/READ bounds; they do not affect the ledger)."""
        return Config(initial_lease=float(self.initial_lease),
                      lease_extension=float(self.lease_extension),
                      abort_grace=float(self.abort_grace), heartbeat_interval=0.01,
                      max_delay=0.0, max_read_time=0.01, clock_drift=0.0,
                      max_staged=self.max_staged, max_staged_age=float(self.max_staged_age),
                      max_tombstones=len(self.requests) + 1,
                      max_groups_remembered=len(self.requests) + 1).validate()

    def actions(self) -> list[Action]:
        acts: list[Action] = []
        for r in self.requests:
            acts.append(Action(f"Register_{r}", "register", r))
            acts.append(Action(f"Abort_{r}", "abort", r))
            for d in self.readers:
                for kind in ("done", "heartbeat", "release"):
                    values = self.expected_values if kind != "heartbeat" or \
                        self.hb_expected is None else self.hb_expected
                    for e in values:
                        acts.append(Action(f"{kind.capitalize()}_{r}_{d}_{e}", kind, r, d, e))
        acts.append(Action("Tick_", "tick"))
        return acts

    # -- TLA+ -----------------------------------------------------------------------
    def module_name(self) -> str:
        return f"MC_conf_{self.name}"

    def tla_module(self) -> str:
        def tset(xs: Sequence[Any]) -> str:
            return "{" + ", ".join(render(x) for x in xs) + "}"

        def tfun(m: Mapping[str, Any], conv: Callable[[Any], str]) -> str:
            return "[r \\in Requests |-> CASE " + " [] ".join(
                f'r = "{r}" -> {conv(m[r])}' for r in self.requests) + "]"

        lines = [f"---- MODULE {self.module_name()} ----",
                 f"(* GENERATED by kvproto.conformance from Model {self.name!r}: do not edit. *)",
                 f"(* {self.doc} *)" if self.doc else "",
                 "EXTENDS KVLedger",
                 f"CBlocksOf == {tfun(self.blocks_of, tset)}",
                 f"CGroupOf == {tfun(self.group_of, lambda g: render(g or 'none'))}",
                 f"CRegExpected == {tfun(self.reg_expected, str)}"]
        for a in self.actions():
            # The conjunction makes this zero-arity operator the leaf TLC names the
            # edge after (a bare alias would be labelled with KVLedger's "Write").
            if a.kind == "tick":
                lines.append(f"{a.label} == Tick /\\ TRUE")
            elif a.kind in ("register", "abort"):
                lines.append(f'{a.label} == {a.kind.capitalize()}("{a.request}") /\\ TRUE')
            else:
                lines.append(f'{a.label} == {a.kind.capitalize()}("{a.request}", '
                             f'"{a.reader}", {a.expected}) /\\ TRUE')
        lines.append("ConfNext ==")
        lines += [f"    \\/ {a.label}" for a in self.actions()]
        lines.append("====")
        return "\n".join(x for x in lines if x) + "\n"

    def tla_cfg(self) -> str:
        return "\n".join([
            "CONSTANTS",
            f"    Requests = {{{', '.join(render(r) for r in self.requests)}}}",
            f"    Readers = {{{', '.join(render(d) for d in self.readers)}}}",
            f"    Blocks = {{{', '.join(str(b) for b in range(1, self.capacity + 1))}}}",
            '    NoGroup = "none"',
            "    BlocksOf <- CBlocksOf",
            "    GroupOf <- CGroupOf",
            "    RegExpected <- CRegExpected",
            f"    InitialLease = {self.initial_lease}",
            f"    LeaseExtension = {self.lease_extension}",
            f"    AbortGrace = {self.abort_grace}",
            f"    MaxStaged = {self.max_staged}",
            f"    MaxStagedMsgs = {self.max_staged_msgs}",
            f"    MaxStagedAge = {self.max_staged_age}",
            f"    LedgerMaxExpected = {max(self.expected_values + (self.hb_expected or ()))}",
            "    BugCountMessages = FALSE",
            "    BugDropEarly = FALSE",
            "    BugAbortFreesNow = FALSE",
            "INIT LedgerInit",
            "NEXT ConfNext",
            "INVARIANT LedgerTypeOK NoDoubleFree Conservation StagingBounded",
            "",
        ])

    def write_tla(self, directory: Path) -> Path:
        """Write the harness files TLC needs into ``directory``; return the module path."""
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(TLA_DIR / "KVLedger.tla", directory / "KVLedger.tla")
        mod = directory / f"{self.module_name()}.tla"
        mod.write_text(self.tla_module(), encoding="utf-8")
        (directory / f"{self.module_name()}.cfg").write_text(self.tla_cfg(), encoding="utf-8")
        return mod


# The CI models. Sizes and times are recorded in tla/conformance/RESULTS.md.
MODELS: Final[dict[str, Model]] = {m.name: m for m in (
    Model("group2x2", ("r1", "r2"), ("d1", "d2"),
          {"r1": (1, 2), "r2": (1, 3)}, {"r1": "g1", "r2": "g1"}, {"r1": 0, "r2": 0},
          expected_values=(0, 2), hb_expected=(0,), max_staged=1, max_staged_msgs=1,
          doc="2 requests x 2 readers, one sibling group, a shared block, readers announced "
              "by done/release"),
    Model("solo2x2", ("r1", "r2"), ("d1", "d2"),
          {"r1": (1, 2), "r2": (2,)}, {"r1": None, "r2": None}, {"r1": 2, "r2": 1},
          expected_values=(0,), max_staged=1, max_staged_msgs=2, initial_lease=2,
          lease_extension=2, abort_grace=2, max_staged_age=2,
          doc="no group, expected readers known at register, 2 staged messages per handle"),
    Model("announce1x2", ("r1",), ("d1", "d2"),
          {"r1": (1,)}, {"r1": None}, {"r1": 0},
          expected_values=(0, 1, 2), max_staged=1, max_staged_msgs=2, initial_lease=1,
          lease_extension=2, abort_grace=2, max_staged_age=2,
          doc="1 request x 2 readers, expected readers announced (and raised) by every input, "
              "early messages staged"),
)}


# ---------------------------------------------------------------------------
# The Python side: abstraction function and BFS.
# ---------------------------------------------------------------------------


LedgerFactory: TypeAlias = Callable[[Config, BlockPool], Ledger]


@contextlib.contextmanager
def staged_msgs_cap(n: int) -> Iterator[None]:
    """Temporarily set lifecycle.MAX_STAGED_MSGS_PER_HANDLE (the model's MaxStagedMsgs)."""
    old = lifecycle.MAX_STAGED_MSGS_PER_HANDLE
    lifecycle.MAX_STAGED_MSGS_PER_HANDLE = n  # type: ignore[misc]
    try:
        yield
    finally:
        lifecycle.MAX_STAGED_MSGS_PER_HANDLE = old  # type: ignore[misc]


@dataclass
class PyNode:
    """A concrete Python ledger at model time ``now``, plus the ghost free counts."""

    ledger: Ledger
    now: int
    nfree: dict[str, int]

    def clone(self) -> PyNode:
        return PyNode(thaw(freeze(self.ledger)), self.now, dict(self.nfree))


_CANON: Final[dict[str, str]] = {s: s for s in (*lifecycle.P_STATES, *lifecycle.P_EVENTS)}


class _Pickler(pickle.Pickler):
    """Pickles the lifecycle's state/event names by reference. Ledger.heartbeat compares
    states by identity (``st is REGISTERED``) and unpickled strings are new objects, so a
    plain pickle round trip yields a ledger that refuses every heartbeat."""

    def persistent_id(self, obj: Any) -> str | None:
        if type(obj) is str and _CANON.get(obj) is obj:
            return obj
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _CANON[pid]


def freeze(ledger: Ledger) -> bytes:
    """A snapshot of a ledger, cheap to :func:`thaw` many times."""
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(ledger)
    return buf.getvalue()


def thaw(blob: bytes) -> Ledger:
    L: Ledger = _Unpickler(io.BytesIO(blob)).load()
    return L


def abstract(model: Model, node: PyNode) -> State:
    """The abstraction function (KVLedger.tla's header): Python ledger -> TLA+ state.

    pstate[r] = Ledger.state(h); expected/finished/released from snapshot() (0/{}/FALSE
    when not live); deadline[r] = snapshot deadline - now (relative); reports[r] =
    |finished[r]|; rc[b+1] = pool.refcount(b); stagedQ = list(_staged) as names;
    staged[r] = _staged[h].msgs as [kind, reader, exp, age] (age = now - arrival for
    heartbeats, 0 otherwise); stagedAge[r] = now - _staged[h].since; groupsDone =
    set(_groups_done); nfree[r] = the ghost count of Free effects for r."""
    L, now = node.ledger, node.now
    snap = L.snapshot()
    staged_all = L._staged
    cols: dict[str, list[tuple[Value, Value]]] = {
        v: [] for v in ("pstate", "expected", "finished", "released", "deadline", "reports",
                        "staged", "stagedAge", "nfree")}
    for r in sorted(model.requests):
        h = model.handle(r)
        cols["pstate"].append((r, L.state(h)))
        s = snap.get(h)
        if s is not None:
            _st, exp, fin, rel, dl = s
            d = dl - now
            if d != int(d):
                raise ValueError(f"non-integral relative deadline {d} for {r}")
            vals: tuple[Value, ...] = (exp, fin, rel, int(d), len(fin))
        else:
            vals = (0, frozenset(), False, 0, 0)
        for var, v in zip(("expected", "finished", "released", "deadline", "reports"), vals,
                          strict=True):
            cols[var].append((r, v))
        stg = staged_all.get(h)
        if stg is None:
            cols["staged"].append((r, ()))
            cols["stagedAge"].append((r, 0))
        else:
            cols["staged"].append((r, tuple(
                Fn((("age", int(now - t) if k == HEARTBEAT else 0), ("exp", e), ("kind", k),
                    ("reader", d_)))
                for k, d_, e, t in stg.msgs)))
            cols["stagedAge"].append((r, int(now - stg.since)))
        cols["nfree"].append((r, node.nfree[r]))
    name_of = {model.handle(r): r for r in model.requests}
    state: dict[str, Value] = {var: Fn(tuple(items)) for var, items in cols.items()}
    state["rc"] = tuple(L.pool.refcount(b) for b in range(model.capacity))
    state["stagedQ"] = tuple(name_of[h] for h in staged_all)
    state["groupsDone"] = frozenset(L._groups_done)
    return Fn(tuple(sorted(state.items())))


def initial_node(model: Model, factory: LedgerFactory = Ledger) -> PyNode:
    ledger = factory(model.config(), BlockPool(model.capacity, strict=False))
    return PyNode(ledger, 0, dict.fromkeys(model.requests, 0))


def apply_action(model: Model, node: PyNode, a: Action) -> list[Effect]:
    """Feed one input to the (already cloned) node's ledger; update time and ghost."""
    L, now = node.ledger, float(node.now)
    h = model.handle(a.request) if a.request else 0
    if a.kind == "register":
        g = model.group_of[a.request]
        out = L.register(h, a.request, tuple(b - 1 for b in model.blocks_of[a.request]), now,
                         group=g, expected=model.reg_expected[a.request])
    elif a.kind == DONE:
        out = L.done(a.reader, h, a.expected, now)
    elif a.kind == HEARTBEAT:
        out = L.heartbeat(a.reader, 0, (h,), a.expected, now)
    elif a.kind == RELEASE:
        out = L.release(a.reader, (h,), a.expected, now)
    elif a.kind == "abort":
        out = L.abort(a.request, now)
    elif a.kind == "tick":
        node.now += 1
        out = L.tick(float(node.now))
    else:  # pragma: no cover
        raise ValueError(a.kind)
    names = {model.handle(r): r for r in model.requests}
    for e in out:
        if isinstance(e, Free):
            node.nfree[names[e.handle]] += 1
    return out


def refused(effects: Sequence[Effect]) -> bool:
    """Python refuses an input (the spec has no successor) iff it answers Rejected."""
    return any(isinstance(e, Rejected) for e in effects)


@dataclass
class PyGraph:
    graph: nx.MultiDiGraph
    init: State
    parent: dict[State, tuple[State, str]]
    seconds: float


def explore_python(model: Model, factory: LedgerFactory = Ledger, *,
                   max_states: int = 500_000) -> PyGraph:
    """BFS of the Python ledger's reachable graph, de-duplicated by abstract state."""
    t0 = time.perf_counter()
    acts = model.actions()
    with staged_msgs_cap(model.max_staged_msgs):
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
            blob = freeze(node.ledger)
            for a in acts:
                nxt = PyNode(thaw(blob), node.now, dict(node.nfree))
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
        run = run_tlc(mod, mod.with_suffix(".cfg"), workers=workers,
                      extra=["-dump", "dot,actionlabels", str(dot)])
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
    key = (repr(model), (TLA_DIR / "KVLedger.tla").read_text(encoding="utf-8")
           + model.tla_module() + model.tla_cfg())
    if key not in _TLC_CACHE:
        _TLC_CACHE[key] = explore_tlc(model)
    return _TLC_CACHE[key]


def edge_set(g: nx.MultiDiGraph) -> set[tuple[State, str, State]]:
    return {(a, k, b) for a, b, k in g.edges(keys=True)}


def describe(state: State, base: State | None = None) -> str:
    """Render a state as TLA+ conjuncts; with ``base``, only the variables that differ."""
    out = []
    for var, val in state.items:
        if base is not None and base.get(var) == val:
            continue
        shown = val
        if isinstance(val, Fn) and base is not None and isinstance(base.get(var), Fn):
            other = base.get(var)
            assert isinstance(other, Fn)
            shown = mk_fn([(k, v) for k, v in val.items if other.get(k) != v])
            out.append(f"/\\ {var} = ... {render(shown)} ...")
            continue
        out.append(f"/\\ {var} = {render(shown)}")
    return "\n".join(out) if out else "(no difference)"


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
    canon = {s: s for s in gp.nodes}  # share objects: equality then short-cuts on identity
    sp = set(gp.nodes)
    tmap = {s: canon.get(s, s) for s in tlc.nodes}  # keyed by TLC's objects: identity hits
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
# The TLC graph as an oracle for single steps (used by the hypothesis test).
# ---------------------------------------------------------------------------


@dataclass
class Oracle:
    """Answers 'what may the spec do from this state under this input?'."""

    model: Model
    graph: nx.MultiDiGraph
    _succ: dict[tuple[State, str], set[State]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for a, b, k in self.graph.edges(keys=True):
            self._succ.setdefault((a, k), set()).add(b)

    def successors(self, state: State, label: str) -> set[State]:
        return self._succ.get((state, label), set())

    def check_step(self, before: State, label: str, after: State,
                   effects: Sequence[Effect]) -> str | None:
        """None when the Python step agrees with the spec, else an explanation."""
        if before not in self.graph:
            return "source state is not reachable in the spec:\n" + describe(before)
        succ = self.successors(before, label)
        if refused(effects):
            if after != before:
                return f"{label}: refused (Rejected effect) but the state changed"
            if succ - {before}:
                return (f"{label}: python refused, but the spec allows a step to\n"
                        + "\n".join(describe(s, before) for s in succ))
            return None
        if after not in succ:
            why = "changed nothing" if after == before else "stepped"
            spec = ("the spec has no step" if not succ else "the spec steps to (changes):\n"
                    + "\n".join(describe(s, before) for s in succ))
            return (f"{label}: python {why} (changes: {describe(after, before)}); {spec}")
        if after == before and succ - {before}:
            return f"{label}: python refused silently, the spec has another successor"
        return None


# ---------------------------------------------------------------------------
# CLI helper: python -m kvproto.conformance [--write-tla] [MODEL...]
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
    ap = argparse.ArgumentParser(prog="python -m kvproto.conformance",
                                 description="state-graph equality: Python Ledger vs KVLedger.tla")
    ap.add_argument("models", nargs="*", help=f"models to check (default all: {', '.join(MODELS)})")
    ap.add_argument("--write-tla", action="store_true",
                    help="only (re)write the generated harness modules into tla/conformance/")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}")
    if args.write_tla:
        for n in names:
            m = MODELS[n]
            (CONF_DIR / f"{m.module_name()}.tla").write_text(m.tla_module(), encoding="utf-8")
            (CONF_DIR / f"{m.module_name()}.cfg").write_text(m.tla_cfg(), encoding="utf-8")
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
