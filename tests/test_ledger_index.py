"""The ledger's request-id index, tombstones and deadline buckets at their edges.

A free leaves the request id's index entry in place (it then names the tombstone); a
later holder of the same request id takes the entry over, and evicting the older
tombstone must not drop it. Deadline entries are bucketed by time: a tick that runs out
of its work budget inside a bucket resumes where it stopped, in push order.
"""

from __future__ import annotations

from kvproto import lifecycle
from kvproto.lifecycle import BlockPool, Config, Free, Ledger


def frees(out: list[lifecycle.Effect]) -> list[int]:
    return [e.handle for e in out if isinstance(e, Free)]


def test_an_abort_after_the_free_is_stale_and_a_reused_request_id_is_held_anew() -> None:
    L = Ledger(Config(max_tombstones=2), BlockPool(8))
    L.register(1, "r", (0,), 0, expected=1)
    assert frees(L.done("d0", 1, 1, 10)) == [1]
    assert L.handle_of("r") is None and L.request_id(1) == "r"
    L.abort("r", 20)
    assert L.counters["stale"] == 1 and "unknown_request" not in L.counters
    stale = L.counters["stale"]
    # The same request id again (a new holder): held, found by its id, abortable.
    assert L.register(2, "r", (1,), 30, expected=1) == []
    assert L.handle_of("r") == 2 and L.held(2) is not None
    L.abort("r", 40)
    assert L.state(2) == lifecycle.ABORTED and L.counters["stale"] == stale
    assert L.check_invariants() == []
    # Two more frees evict the tombstone of handle 1: the entry of handle 2 stays.
    L.register(3, "x", (2,), 50, expected=1)
    L.register(4, "y", (3,), 50, expected=1)
    assert frees(L.done("d0", 3, 1, 60)) == [3]
    assert frees(L.done("d0", 4, 1, 60)) == [4]
    assert L.counters["tombstone_evicted"] == 1 and L.state(1) == lifecycle.UNREGISTERED
    assert L.handle_of("r") == 2 and L.check_invariants() == []
    # Once handle 2 is freed and its tombstone evicted too, the request id is unknown.
    L.tick(40 + L.config.ms.abort_grace)
    assert L.held(2) is None and L.request_id(2) == "r"
    L.register(5, "z", (4,), 70_000, expected=1)
    L.done("d0", 5, 1, 70_000)
    L.register(6, "w", (5,), 70_000, expected=1)
    L.done("d0", 6, 1, 70_000)
    assert L.request_id(2) is None and L.handle_of("r") is None
    L.abort("r", 70_000)
    assert L.counters["unknown_request"] == 1
    assert L.check_invariants() == []


def test_a_duplicate_register_of_a_live_request_id_is_refused_and_changes_nothing() -> None:
    L = Ledger(Config(), BlockPool(8))
    L.register(1, "r", (0,), 0, expected=1)
    before = L.snapshot()
    out = L.register(2, "r", (1,), 0, expected=1)
    assert L.held(2) is None and L.handle_of("r") == 1 and L.snapshot() == before
    assert all(not isinstance(e, Free) for e in out)
    assert L.pool.refcount(1) == 0 and L.check_invariants() == []


def test_a_budgeted_tick_resumes_inside_a_deadline_bucket_in_push_order() -> None:
    L = Ledger(Config(max_tick_work=3), BlockPool(16))
    for h in (5, 3, 9, 1, 7, 2, 8, 4, 6, 10):  # one bucket: all at t=0 + initial lease
        L.register(h, f"r{h}", (h,), 0, expected=1)
    L.heartbeat("d0", 1, (9, 1), 1, 15_000)  # renewed: re-inserted lazily when met
    due = L.config.ms.initial_lease
    assert L.next_deadline() == due and L.heap_entries == 10
    seen: list[list[int]] = []
    now = due
    while True:
        seen.append(frees(L.tick(now)))
        assert L.check_invariants() == []
        nxt = L.next_deadline()
        if nxt is None or nxt > now:
            break
        now += 1
    # Three entries per tick, in push order; the renewed 9 and 1 use budget too.
    assert seen == [[5, 3], [7, 2], [8, 4, 6], [10]]
    assert L.held_requests == 2 and L.heap_entries == 2
    assert L.counters["tick_budget_exhausted"] == 3
    assert L.next_deadline() == 15_000 + L.config.ms.lease_extension


def test_the_rebuilt_entries_keep_every_held_request_due_at_its_deadline() -> None:
    L = Ledger(Config(), BlockPool(4096))
    for h in range(1, 1001):
        L.register(h, f"r{h}", (h,), h // 100)  # deadlines over 11 ms
    for h in range(1, 1001):
        if h % 2 or h % 8 == 4:
            L.done("d0", h, 1, 100)  # 625 freed: dead entries until the rebuild
    assert L.counters["heap_rebuilt"] >= 1 and L.held_requests == 375
    for h in range(2, 1001, 4):
        L.abort(f"r{h}", 200)  # early entries
    assert L.heap_entries <= max(2 * L.held_requests, lifecycle.HEAP_SLACK)
    assert L.check_invariants() == []
    deadlines: dict[int, int] = {}
    for h in L.live_handles():
        d = L.deadline(h)
        assert d is not None
        deadlines[h] = d
    assert len(deadlines) == 375 and len(set(deadlines.values())) > 2
    for t in sorted(set(deadlines.values())):
        out = L.tick(t)
        assert sorted(frees(out)) == sorted(h for h, d in deadlines.items() if d == t)
        assert L.check_invariants() == []
    assert L.held_requests == 0 and L.heap_entries == 0 and L.next_deadline() is None


def test_lone_and_shared_deadlines_expire_in_order_one_entry_per_tick() -> None:
    L = Ledger(Config(max_tick_work=1), BlockPool(16))
    times = {1: 0, 2: 1, 3: 1, 4: 3, 5: 7}  # lone buckets (1, 4, 5) and a shared one
    for h, t in times.items():
        L.register(h, f"r{h}", (h,), t, expected=1)
    assert L.check_invariants() == [] and L.heap_entries == 5
    lease = L.config.ms.initial_lease
    order: list[int] = []
    now = lease
    while L.held_requests:
        out = frees(L.tick(now))
        assert len(out) <= 1 and L.check_invariants() == []
        assert all(times[h] + lease <= now for h in out)  # never early
        order += out
        now += 1
    assert order == [1, 2, 3, 4, 5] and L.heap_entries == 0
