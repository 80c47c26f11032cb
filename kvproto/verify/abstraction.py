"""The abstraction function from a Python ledger to a TLA+ state of KVLedger.tla, and the
Python side of a graph model: a node (ledger, model time, ghost free counts), its initial
value, one input applied to it, and a rendering of states as TLA+ conjuncts.

Shared by graph equality (:mod:`kvproto.verify.conformance`) and the oracle
(:mod:`kvproto.verify.oracle`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from kvproto.lifecycle import (
    DONE,
    HEARTBEAT,
    RELEASE,
    BlockPool,
    Config,
    Effect,
    Free,
    Ledger,
)
from kvproto.verify.models import UNIT_MS, Action, GraphModel
from kvproto.verify.tlc import (
    Fn,
    State,
    Value,
    mk_fn,
    render,
)

log = logging.getLogger(__name__)


LedgerFactory: TypeAlias = Callable[[Config, BlockPool], Ledger]


@dataclass
class PyNode:
    """A concrete Python ledger at model time ``now`` (units; the ledger's clock is
    ``now * UNIT_MS`` ms), plus the ghost free counts."""

    ledger: Ledger
    now: int
    nfree: dict[str, int]

    def clone(self) -> PyNode:
        return PyNode(self.ledger.clone(), self.now, dict(self.nfree))


def units(ms: int, what: str) -> int:
    """A duration of the machines' (ms) in model time units; it must be whole units."""
    u, rem = divmod(ms, UNIT_MS)
    if rem:
        raise ValueError(f"{what} of {ms} ms is not a whole number of model time units")
    return u


def abstract(model: GraphModel, node: PyNode) -> State:
    """The abstraction function (KVLedger.tla's header): Python ledger -> TLA+ state.

    pstate[r] = Ledger.state(h); expected/finished/released from snapshot() (0/{}/FALSE
    when not live); deadline[r] = snapshot deadline - now (relative); reports[r] =
    |finished[r]|; rc[b+1] = pool.refcount(b); stagedQ = the handles of
    staged_entries() as names; staged[r] = its msgs as [kind, reader, exp, age] (age =
    now - arrival for heartbeats, 0 otherwise); stagedAge[r] = now - its since;
    groupsDone = set(groups_done()); nfree[r] = the ghost count of Free effects for r.
    Times in model units (``units``)."""
    L, now = node.ledger, node.now * UNIT_MS
    snap = L.snapshot()
    staged_all = {h: (since, msgs) for h, since, msgs in L.staged_entries()}
    cols: dict[str, list[tuple[Value, Value]]] = {
        v: [] for v in ("pstate", "expected", "finished", "released", "deadline", "reports",
                        "staged", "stagedAge", "nfree")}
    for r in sorted(model.requests):
        h = model.handle(r)
        cols["pstate"].append((r, L.state(h)))
        s = snap.get(h)
        if s is not None:
            _st, exp, fin, rel, dl = s
            vals: tuple[Value, ...] = (exp, fin, rel, units(dl - now, f"deadline of {r}"),
                                       len(fin))
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
                Fn((("age", units(now - t, "age") if k == HEARTBEAT else 0), ("exp", e),
                    ("kind", k), ("reader", d_)))
                for k, d_, e, t in stg[1])))
            cols["stagedAge"].append((r, units(now - stg[0], "staged age")))
        cols["nfree"].append((r, node.nfree[r]))
    name_of = {model.handle(r): r for r in model.requests}
    state: dict[str, Value] = {var: Fn(tuple(items)) for var, items in cols.items()}
    state["rc"] = tuple(L.pool.refcount(b) for b in range(model.capacity))
    state["stagedQ"] = tuple(name_of[h] for h in staged_all)
    state["groupsDone"] = frozenset(L.groups_done())
    return Fn(tuple(sorted(state.items())))


def initial_node(model: GraphModel, factory: LedgerFactory = Ledger) -> PyNode:
    ledger = factory(model.config(), BlockPool(model.capacity, strict=False))
    ledger.max_staged_msgs = model.max_staged_msgs
    return PyNode(ledger, 0, dict.fromkeys(model.requests, 0))


def apply_action(model: GraphModel, node: PyNode, a: Action) -> list[Effect]:
    """Feed one input to the (already cloned) node's ledger; update time and ghost."""
    L, now = node.ledger, node.now * UNIT_MS
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
        out = L.tick(node.now * UNIT_MS)
    else:  # pragma: no cover
        raise ValueError(a.kind)
    names = {model.handle(r): r for r in model.requests}
    for e in out:
        if isinstance(e, Free):
            node.nfree[names[e.handle]] += 1
    return out


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
