"""``Ledger.done_batch`` and ``Gate.done_batch`` against ``done`` per handle.

Two machines get the same random sequence of events; one applies each done batch with
``done`` per handle, the other with ``done_batch``. Their effects, journals (one record
per handle), counters, free counters, every view of their state and their block pools
must stay equal, on the real table and on every ledger mutant of
``kvproto.testing.mutants`` (the batch must run a mutant's rows and hooks as ``done``
does, so that the checks that catch it still see it).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.lifecycle import BlockPool, Config, Done, Effect, Event, Free, Ledger
from kvproto.lifecycle.gate import Gate
from kvproto.testing.mutants import MUTANTS

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

HANDLES = 6
BLOCKS = 12
READERS = ("d0", "d1", "d2")

# The step in ms before each event: mostly forward (the batch's own path), sometimes back
# (a clock regression, clamped and counted per handle) or a float (refused per handle).
time_st = st.one_of(st.integers(0, 60), st.integers(0, 60), st.integers(0, 60),
                    st.just(-5), st.just(0.5))
op_st = st.one_of(
    st.tuples(st.just("register"), st.integers(0, HANDLES), st.integers(0, 5),
              st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=3),
              st.sampled_from([None, None, "g0", "g1"]), st.sampled_from([1, 1, 2, 2, 0, 3])),
    st.tuples(st.just("done"), st.sampled_from(READERS),
              st.lists(st.integers(0, HANDLES + 2), min_size=0, max_size=8),
              st.sampled_from([1, 1, 2, 2, 0, 3])),
    st.tuples(st.just("done"), st.sampled_from(READERS),
              st.lists(st.integers(0, HANDLES + 2), min_size=2, max_size=8),
              st.sampled_from([1, 1, 2])),
    st.tuples(st.just("heartbeat"), st.sampled_from(READERS),
              st.lists(st.integers(0, HANDLES + 2), max_size=4), st.integers(0, 3)),
    st.tuples(st.just("release"), st.sampled_from(READERS),
              st.lists(st.integers(0, HANDLES + 2), max_size=3), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 5)),
    st.tuples(st.just("tick"),),
)


def _new(cls: type[Ledger], journal: list[tuple[Event, list[Effect]]]) -> Ledger:
    cfg = Config(max_tombstones=3, max_staged=4, initial_lease=0.3, lease_extension=0.2,
                 abort_grace=0.3, heartbeat_interval=0.05, max_delay=0.01,
                 max_read_time=0.05, clock_drift=0.01, max_staged_age=0.3, max_tick_work=3)
    return cls(cfg, BlockPool(BLOCKS, strict=False),
               sink=lambda ev, fx: journal.append((ev, list(fx))))


def _state(L: Ledger) -> dict[str, Any]:
    return {
        "snapshot": L.snapshot(), "staged": L.staged_entries(), "done": L.groups_done(),
        "counters": dict(L.counters), "frees": dict(L.frees), "now": L.now,
        "held": [L.held(h) for h in range(HANDLES + 3)],
        "states": [L.state(h) for h in range(HANDLES + 3)],
        "rids": [L.request_id(h) for h in range(HANDLES + 3)],
        "by_rid": [L.handle_of(f"r{i}") for i in range(6)],
        "tombs": L.tombstone_count, "entries": L.heap_entries,
        "next": L.next_deadline(), "refs": [L.pool.refcount(b) for b in range(BLOCKS)],
        "free_blocks": L.pool.free_blocks(), "invariants": L.check_invariants(),
    }


def _run(L: Ledger, op: tuple[Any, ...], now: Any, batched: bool) -> list[Effect]:
    kind = op[0]
    if kind == "register":
        _, h, rid, blocks, group, exp = op
        return L.register(h, f"r{rid}", blocks, now, group=group, expected=exp)
    if kind == "done":
        _, reader, hs, exp = op
        if batched:
            return L.done_batch(reader, hs, exp, now)
        out: list[Effect] = []
        for h in hs:
            out += L.done(reader, h, exp, now)
        return out
    if kind == "heartbeat":
        return L.heartbeat(op[1], 0, op[2], op[3], now)
    if kind == "release":
        return L.release(op[1], op[2], op[3], now)
    if kind == "abort":
        return L.abort(f"r{op[1]}", now)
    return L.tick(now)


def _outcome(L: Ledger, op: tuple[Any, ...], now: Any, batched: bool) -> Any:
    """The effects, or the error a row raised (a mutant's table need not be total)."""
    try:
        return _run(L, op, now, batched)
    except Exception as e:
        return (type(e), str(e))


def _compare(cls: type[Ledger], ops: list[tuple[tuple[Any, ...], Any]], grouped: bool) -> None:
    ja: list[tuple[Event, list[Effect]]] = []
    jb: list[tuple[Event, list[Effect]]] = []
    a, b = _new(cls, ja), _new(cls, jb)
    for L in (a, b):  # held requests to start with, so that batches free often
        for h in range(HANDLES):
            L.register(h, f"r{h}", (2 * h, 2 * h + 1), 0, group=("g0" if grouped and h % 3 == 0 else None),
                       expected=1 + h % 2)
    t = 0
    for op, step in ops:
        if isinstance(step, float):
            now: Any = t + step
        else:
            now = t + step
            t = max(t, now)
        ea, eb = _outcome(a, op, now, False), _outcome(b, op, now, True)
        assert ea == eb, op
        assert ja == jb, op
        assert _state(a) == _state(b), op


ops_st = st.lists(st.tuples(op_st, time_st), min_size=20, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_st, st.booleans())
def test_done_batch_runs_the_same_rows_as_done_per_handle(ops: list[Any], grouped: bool) -> None:
    _compare(Ledger, ops, grouped)


@pytest.mark.parametrize("name", sorted(MUTANTS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, grouped=st.booleans())
def test_done_batch_runs_a_mutants_rows_and_hooks_as_done_does(name: str, ops: list[Any],
                                                               grouped: bool) -> None:
    _compare(MUTANTS[name].ledger_cls, ops, grouped)


def test_a_batch_with_a_duplicate_a_foreign_reader_and_an_unknown_handle() -> None:
    """One batch: the first done of 1, a second done of 1 by the same reader
    (duplicate), an unknown handle (staged), then 2 freed by its second reader."""
    j: list[tuple[Event, list[Effect]]] = []
    L = _new(Ledger, j)
    L.register(1, "r1", (0,), 0, expected=2)
    L.register(2, "r2", (1, 2), 0, expected=2)
    L.done("d1", 2, 2, 0)
    j.clear()
    out = L.done_batch("d0", [1, 1, 9, 2], 2, 5)
    assert [e.handle for e in out if isinstance(e, Free)] == [2]
    assert [ev for ev, _ in j] == [Done("d0", h, 2, 5) for h in (1, 1, 9, 2)]
    assert [len(fx) for _, fx in j] == [0, 0, 0, 1]
    assert L.counters["duplicate"] == 1 and L.counters["staged"] == 1
    assert L.frees["transferred"] == 1 and L.check_invariants() == []


def _gate(journal: list[tuple[Event, list[Effect]]]) -> Gate:
    g = Gate(_new(Ledger, journal), b"k" * 32, "P", 1)
    for h in range(HANDLES):
        g.register(h, f"r{h}", (2 * h,), 0, ready=True, group=("g0" if h % 2 else None),
                   expected=1)
    return g


gate_op_st = st.one_of(
    st.tuples(st.just("register"), st.integers(0, HANDLES), st.integers(0, 5),
              st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=2),
              st.sampled_from([None, "g0"]), st.integers(1, 2)),
    st.tuples(st.just("claim"), st.sampled_from(["A", "B"]), st.integers(0, HANDLES)),
    st.tuples(st.just("done"), st.sampled_from(READERS), st.sampled_from(["A", "B"]),
              st.lists(st.integers(0, HANDLES + 2), max_size=6), st.integers(1, 2)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(gate_op_st, min_size=15, max_size=40))
def test_gate_done_batch_forgets_and_refuses_as_done_per_handle(ops: list[Any]) -> None:
    ja: list[tuple[Event, list[Effect]]] = []
    jb: list[tuple[Event, list[Effect]]] = []
    ga, gb = _gate(ja), _gate(jb)
    for now, op in enumerate(ops):
        res: list[Any] = []
        for g, batched in ((ga, False), (gb, True)):
            if op[0] == "register":
                _, h, rid, blocks, group, exp = op
                res.append(g.register(h, f"r{rid}", blocks, now, ready=True, group=group,
                                      expected=exp))
            elif op[0] == "claim":
                _, consumer, h = op
                res.append(g.claim(consumer, h, g.capability(h), now))
            else:
                _, reader, consumer, hs, exp = op
                if batched:
                    res.append(g.done_batch(reader, hs, exp, now, consumer))
                else:
                    out: list[Any] = []
                    for h in hs:
                        out += g.done(reader, h, exp, now, consumer)
                    res.append(out)
        assert res[0] == res[1], op
        assert ja == jb, op
        assert _state(ga.ledger) == _state(gb.ledger), op
        assert [ga.consumer(h) for h in range(HANDLES + 3)] == \
            [gb.consumer(h) for h in range(HANDLES + 3)], op
