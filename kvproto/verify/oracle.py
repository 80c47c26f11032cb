"""The TLC state graph as an oracle for single steps of the Python ledger.

:class:`Oracle` answers "what may the spec do from this abstract state under this
input?" from a graph TLC dumped for a :class:`~kvproto.verify.models.GraphModel`
(:func:`kvproto.verify.conformance.explore_tlc`), and judges one concrete Python step
(:meth:`Oracle.check_step`); :func:`run` drives a fresh ledger through a sequence of
inputs and returns the first disagreement (the hypothesis tests use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx

from kvproto.lifecycle import Effect, Ledger
from kvproto.verify.conformance import (
    LedgerFactory,
    abstract,
    apply_action,
    describe,
    initial_node,
    refused,
)
from kvproto.verify.models import GraphModel
from kvproto.verify.tlc import State


@dataclass
class Oracle:
    """Answers 'what may the spec do from this state under this input?'."""

    model: GraphModel
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


def run(model: GraphModel, oracle: Oracle, labels: Sequence[str],
        factory: LedgerFactory = Ledger, stats: dict[str, int] | None = None) -> str | None:
    """Drive one concrete ledger (no snapshots, no de-duplication) through ``labels``;
    return the first disagreement with the spec, or None. ``stats`` counts steps that
    changed the abstract state, left it unchanged, or were refused (Rejected)."""
    acts = {a.label: a for a in model.actions()}
    node = initial_node(model, factory)
    before = abstract(model, node)
    for i, label in enumerate(labels):
        effects = apply_action(model, node, acts[label])
        after = abstract(model, node)
        why = oracle.check_step(before, label, after, effects)
        if why is not None:
            return f"step {i + 1} of {list(labels[:i + 1])}: {why}"
        errs = node.ledger.check_invariants()
        if errs:
            return f"step {i + 1}: python invariants broken: {errs}"
        if stats is not None:
            kind = "rejected" if refused(effects) else "changed" if after != before else "unchanged"
            stats[kind] = stats.get(kind, 0) + 1
        before = after
    return None
