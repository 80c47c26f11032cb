"""The machines' public read-only views and copies: ``Ledger.clone``, ``Consumer.clone``,
``BlockPool.clone`` (deep and independent: a copy shares nothing that changes), and the
views verification reads (``Consumer.peer``, ``request``, ``request_id``,
``next_heartbeat_at``, ``heap_entries``), plus the public hooks mutants override."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import pytest
from conftest import ENGINE, ConsumerFactory, LedgerFactory, params

from kvproto import lifecycle
from kvproto.errors import UsageError
from kvproto.lifecycle import (
    ABORTED,
    CLOCK_START,
    LEASED,
    NOTIFIED,
    PEER_READY,
    REGISTERED,
    BlockPool,
    Config,
    Consumer,
    DRequestView,
    Effect,
    HeartbeatView,
    Ledger,
    SendHeartbeat,
)
from kvproto.lifecycle.dstep import SealedSteps, step_functions
from kvproto.testing.mutants import MUTANTS


def mutable_parts(obj: object) -> dict[int, object]:
    """Every mutable object reachable from ``obj`` (containers and objects that are not
    frozen dataclasses), by id. Functions, classes, the frozen ``Config`` and sealed step
    tables (which refuse every change, see ``test_step_tables_are_sealed``) are values."""
    out: dict[int, object] = {}
    seen: set[int] = set()
    stack: list[object] = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, type)) \
                or callable(o) or (isinstance(o, SealedSteps) and o.sealed):
            continue
        seen.add(id(o))
        if isinstance(o, (tuple, frozenset)):
            stack.extend(o)
        elif isinstance(o, dict):
            out[id(o)] = o
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, set, deque)):
            out[id(o)] = o
            stack.extend(o)
        elif dataclasses.is_dataclass(o) and o.__dataclass_params__.frozen:  # type: ignore[union-attr]
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
        else:
            out[id(o)] = o
            stack.extend(getattr(o, "__dict__", {}).values())
            for klass in type(o).__mro__:
                for slot in getattr(klass, "__slots__", ()):
                    if hasattr(o, slot):
                        stack.append(getattr(o, slot))
    return out


def assert_shares_nothing_mutable(a: object, b: object) -> None:
    pa, pb = mutable_parts(a), mutable_parts(b)
    assert len(pa) >= 3  # the walk reached the structures
    shared = [type(pa[i]).__name__ for i in pa.keys() & pb.keys()]
    assert shared == [], f"the copy shares {shared}"


def ledger_view(L: Ledger, handles: range) -> Any:
    return ([(h, L.state(h), L.held(h), L.request_id(h)) for h in handles], L.staged(),
            L.groups_done(), [L.pool.refcount(b) for b in range(L.pool.capacity)],
            L.pool.allocatable_blocks(), dict(L.counters), dict(L.frees), L.next_deadline(),
            L.heap_entries, L.tombstone_count, L.now)


def busy_ledger(make_ledger: LedgerFactory) -> Ledger:
    """A ledger with held, notified, aborted, staged, freed and grouped requests."""
    L = make_ledger(capacity=16, max_tombstones=4)
    L.pool.allocate(2)
    L.register(1, "r1", (0, 1), 0, group="g", expected=2)
    L.register(2, "r2", (1, 2), 0, group="g", expected=2)
    L.register(3, "r3", (3,), 0, expected=2)
    L.register(4, "r4", (4,), 0, expected=1)
    L.heartbeat("d0", 1, (1, 3, 9), 2, 1000)
    L.done("d0", 3, 2, 2000)
    L.abort("r4", 2000)
    L.done("d1", 7, 1, 2000)  # staged: not registered yet
    L.register(5, "r5", (5,), 2000, expected=1)
    L.done("d0", 5, 1, 3000)  # freed: tombstoned
    assert [L.state(h) for h in range(1, 6)] == [LEASED, REGISTERED, NOTIFIED, ABORTED, "freed"]
    return L


def test_a_ledger_clone_is_equal_and_independent(make_ledger: LedgerFactory) -> None:
    L = busy_ledger(make_ledger)
    before = ledger_view(L, range(1, 10))
    C = L.clone()
    assert type(C) is Ledger and C.config is L.config
    assert ledger_view(C, range(1, 10)) == before
    assert_shares_nothing_mutable(L, C)
    # Driving the clone leaves the original as it was, and the other way round.
    C.done("d0", 1, 2, 4000)
    C.done("d1", 1, 2, 4000)  # frees 1 and its sibling 2
    C.register(7, "r7", (7,), 4000, expected=1)  # applies the staged done
    C.tick(100_000)
    assert ledger_view(L, range(1, 10)) == before
    assert C.held_requests == 0 and L.held_requests == 4
    L.tick(100_000)
    assert C.check_invariants() == [] and L.check_invariants() == []


def test_a_clone_keeps_a_subclass_its_table_and_its_own_fields(
        make_ledger: LedgerFactory) -> None:
    cls = MUTANTS["count_messages"].ledger_cls
    L = cls(Config(), BlockPool(8))
    L.register(1, "r1", (0,), 0, expected=2)
    L.done("d0", 1, 2, 1000)
    C = L.clone()
    assert type(C) is cls
    assert_shares_nothing_mutable(L, C)
    # The mutant's own report count was copied: a second report from the same reader frees.
    assert [type(e).__name__ for e in C.done("d0", 1, 2, 2000)] == ["Free"]
    assert L.state(1) == NOTIFIED
    rows = Ledger.with_rows(*MUTANTS["abort_frees_now"].ledger_cls.TABLE.values())
    R = rows(Config(), BlockPool(4)).clone()
    assert type(R) is rows and R.TABLE is rows.TABLE


def test_a_pool_clone_is_independent() -> None:
    pool = BlockPool(8)
    got = pool.allocate(3)
    assert got is not None
    copy = pool.clone()
    assert copy.allocate(5) is not None and copy.allocatable == 0
    assert pool.allocatable == 5 and pool.pinned(got[0]) and copy.pinned(got[0])
    assert_shares_nothing_mutable(pool, copy)


def busy_consumer(make_consumer: ConsumerFactory) -> Consumer:
    c = make_consumer()
    c.handshake_result(ENGINE, True, 0)
    c.admit("r1", params(1, group="g", expected=2), 0)
    c.admit("r2", params(2, group="g", expected=2), 0)
    c.admit("r3", params(3), 0)
    c.admit("r9", params(9, engine="P1"), 0)  # handshaking with P1
    c.schedule("r1", 1000)  # reading: owns group g
    c.abort("r3", 1000)
    c.tick(2000)  # heartbeats r1, r2 to P0
    return c


def consumer_view(c: Consumer) -> Any:
    rids = ("r1", "r2", "r3", "r9", "r4")
    return ([c.request(r) for r in rids], c.peer(ENGINE), c.peer("P1"),
            c.group_owner(ENGINE, "g"), c.next_heartbeat_at, c.heap_entries,
            c.next_deadline(), dict(c.counters), dict(c.finished), c.now)


def test_a_consumer_clone_is_equal_and_independent(make_consumer: ConsumerFactory) -> None:
    c = busy_consumer(make_consumer)
    before = consumer_view(c)
    d = c.clone()
    assert type(d) is Consumer and d.config is c.config
    assert consumer_view(d) == before
    assert_shares_nothing_mutable(c, d)
    d.read_result("r1", True, 3000)
    d.schedule("r2", 3000)  # served from its sibling's prefix
    d.admit("r4", params(4), 3000)
    d.peer_lost("P1", 3000)
    d.tick(30_000)
    assert consumer_view(c) == before
    assert c.request("r1") is not None and d.request("r1") is None


def test_the_consumer_views_show_requests_peers_and_heartbeats(
        make_consumer: ConsumerFactory) -> None:
    c = make_consumer()
    assert c.peer(ENGINE) is None and c.request("r1") is None
    assert c.next_heartbeat_at == CLOCK_START and c.heap_entries == 0
    c.handshake_result(ENGINE, True, 0)
    p1 = params(1, term=30_000, group="g")
    c.admit("r1", p1, 0)
    assert c.request("r1") == DRequestView("r1", "waiting", p1, 29_000, False)
    assert c.request_id(ENGINE, 1) == "r1" and c.request_id(ENGINE, 2) is None
    assert c.request_id("P9", 1) is None
    assert c.heap_entries == 1
    out = c.tick(1000)
    hb = next(e for e in out if isinstance(e, SendHeartbeat))
    assert c.next_heartbeat_at == 1000 + c.config.ms.heartbeat_interval
    peer = c.peer(ENGINE)
    assert peer is not None and peer.state == PEER_READY and peer.seq == hb.seq
    assert peer.last_heard == 0
    assert dict(peer.outstanding) == {hb.seq: HeartbeatView(hb.seq, 1000, (1,))}
    with pytest.raises(TypeError):
        peer.outstanding[99] = HeartbeatView(99, 1000, ())  # type: ignore[index]
    c.ack(ENGINE, hb.seq, 40_000, (), 2000)  # lease end := sent 1 + 40 - drift
    peer = c.peer(ENGINE)
    assert peer is not None and dict(peer.outstanding) == {} and peer.last_heard == 2000
    req = c.request("r1")
    assert req is not None and req.lease_end == 1000 + 40_000 - c.config.ms.clock_drift
    c.schedule("r1", 3000)
    c.abort("r1", 3000)
    assert c.request("r1") == DRequestView("r1", "reading", p1, req.lease_end, True)
    assert c.group_owner(ENGINE, "g") == "r1"


def test_sweep_and_tally_are_public_hooks(make_ledger: LedgerFactory) -> None:
    calls: list[tuple[Any, ...]] = []

    class Watching(Ledger):
        def tally(self, handle: int, event: str, reader: str) -> int:
            n = super().tally(handle, event, reader)
            calls.append(("tally", handle, event, reader, n))
            return n

        def sweep(self, now: int, out: list[Effect]) -> None:
            calls.append(("sweep", now))
            super().sweep(now, out)

    L = Watching(Config(), BlockPool(4))
    L.register(1, "r1", (0,), 0, expected=2)
    L.done("d0", 1, 2, 1000)
    L.done("d0", 1, 2, 1000)
    L.tick(10_000)  # nothing due: the sweep is not called
    L.tick(31_000)
    assert calls == [("tally", 1, "done", "d0", 1), ("tally", 1, "done", "d0", -1),
                     ("sweep", 31_000)]
    assert L.state(1) == lifecycle.EXPIRED


def test_expire_refuses_a_request_that_is_not_held(make_ledger: LedgerFactory) -> None:
    L = make_ledger()
    out: list[Effect] = []
    with pytest.raises(UsageError, match="handle 1 is not held"):
        L.expire(1, 0, out)
    L.register(1, "r1", (0,), 0)
    L.expire(1, 30_000, out)
    assert [(type(e).__name__, e.reason) for e in out] == [("Free", "expired")]  # type: ignore[union-attr]


def test_step_tables_are_sealed() -> None:
    """Consumers and their clones share D's compiled step tables; that is sound only
    because no one can change them."""
    from kvproto.lifecycle.table import D_TABLE

    steps = step_functions(D_TABLE)
    key = next(iter(steps))
    guards = steps.by_guard(key[0], key[1])
    for table in (steps, guards):
        assert table.sealed and len(table) >= 1
        _refuses_every_change(table, next(iter(table)))
    assert len(steps) == len(D_TABLE)


def _refuses_every_change(t: SealedSteps, k: object) -> None:
    for name, args in (("__setitem__", (k, None)), ("pop", (k,)), ("__delitem__", (k,)),
                       ("clear", ()), ("update", ({},)), ("popitem", ()),
                       ("setdefault", (k, None))):
        with pytest.raises(TypeError, match="sealed"):
            getattr(t, name)(*args)
