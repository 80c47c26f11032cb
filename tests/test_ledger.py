"""P's lifecycle machine (``kvproto.lifecycle.Ledger``), its block pool and its config.

Each test is named after a behaviour users expect and asserts the exact effects, states
and counters, so it fails when that behaviour breaks. The protocol's stories (several
readers, leases, aborts, staging, sibling groups, late and stale messages, rejections,
the pool) are interaction scripts under ``tests/testdata/ledger/`` (run by
``test_interaction.py``); this file holds what a script cannot say: several ledgers,
properties, costs, caps at scale, non-finite times and the configuration.
"""

from __future__ import annotations

import heapq
import types
from dataclasses import replace
from typing import Any

import pytest
from conftest import LedgerFactory, assert_conserved, frees
from hypothesis import given
from hypothesis import strategies as st

from kvproto import lifecycle
from kvproto.lifecycle import (
    LEASED,
    P_TRANSITIONS,
    REGISTERED,
    UNREGISTERED,
    BlockPool,
    Config,
    ConfigError,
    DoubleFree,
    Effect,
    Free,
    Ledger,
    Rejected,
)

# Default config: initial_lease 30, lease_extension 20, abort_grace 30.


# ---------------------------------------------------------------------------
# Several P ranks
# ---------------------------------------------------------------------------


def test_each_p_rank_counts_its_own_readers(make_ledger: LedgerFactory) -> None:
    """Several P ranks, each its own ledger: a done on one rank frees nothing on another."""
    p0, p1 = make_ledger(), make_ledger()
    for p in (p0, p1):
        p.register(1, "req", (0,), 0, expected=2)
    p0.done("d0", 1, 2, 1000)
    assert frees(p0.done("d1", 1, 2, 1000)) == [(1, "transferred")]
    assert p1.state(1) == REGISTERED
    assert p1.pool.held_count == 1


# ---------------------------------------------------------------------------
# Leases: renewed leases never hide expired ones (the upstream sweep bug, vllm #58222)
# ---------------------------------------------------------------------------


def test_expired_leases_behind_many_renewed_ones_all_expire_on_time(
        make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(capacity=256, initial_lease=10.0, lease_extension=100.0,
                         abort_grace=100.0)
    for h in range(1, 101):
        ledger.register(h, f"r{h}", (h,), 0)
    renewed = tuple(range(1, 101, 2))  # every other request, including the first
    ledger.heartbeat("d0", 1, renewed, 1, 1000)
    expired = frees(ledger.tick(10_000))
    assert sorted(h for h, _ in expired) == list(range(2, 101, 2))
    assert {reason for _, reason in expired} == {"expired"}
    assert ledger.held_requests == 50


# ---------------------------------------------------------------------------
# Early messages (staging)
# ---------------------------------------------------------------------------


def test_staged_messages_per_handle_are_bounded(ledger: Ledger) -> None:
    for i in range(lifecycle.MAX_STAGED_MSGS_PER_HANDLE + 3):
        ledger.heartbeat("d0", i, (1,), 1, 0)
    assert ledger.counters["staged"] == lifecycle.MAX_STAGED_MSGS_PER_HANDLE
    assert ledger.counters["staged_dropped"] == 3


# ---------------------------------------------------------------------------
# Block pool
# ---------------------------------------------------------------------------


def test_double_free_raises_in_strict_mode() -> None:
    pool = BlockPool(4)
    pool._hold((1,))
    assert pool._drop((1,)) == (1,)
    with pytest.raises(DoubleFree, match="block 1"):
        pool._drop((1,))
    assert pool.violations == 1


def test_double_free_is_counted_when_not_strict() -> None:
    pool = BlockPool(4, strict=False)
    assert pool._drop((2, 3)) == ()
    assert pool.violations == 2
    assert pool.held_count + pool.free_count == pool.capacity == 4


def test_double_free_is_reported_as_an_invariant_violation(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(strict=False)
    ledger.pool._drop((0,))
    assert ledger.check_invariants() == ["NoDoubleFree: 1 double free(s)"]


_OPS = st.lists(
    st.tuples(st.sampled_from(["register", "done", "release", "heartbeat", "abort", "tick"]),
              st.integers(1, 6), st.sampled_from(["d0", "d1", "d2"]), st.integers(0, 3),
              st.integers(0, 15_000), st.lists(st.integers(0, 11), max_size=4, unique=True),
              st.sampled_from([None, "g1", "g2"])),
    max_size=60)


@given(_OPS)
def test_held_plus_free_equals_capacity_after_every_operation(
        ops: list[tuple[str, int, str, int, int, list[int], str | None]]) -> None:
    """Random interleavings (early, duplicate, stale, aborted, sibling) never break the
    pool: strict pool (a double free raises), all invariants after every step."""
    ledger = Ledger(Config(), BlockPool(12))
    now = 0
    for op, h, reader, expected, dt, blocks, group in ops:
        now += dt
        effects: list[Effect]
        if op == "register":
            effects = ledger.register(h, f"r{h}", blocks, now, group=group, expected=expected)
        elif op == "done":
            effects = ledger.done(reader, h, expected, now)
        elif op == "release":
            effects = ledger.release(reader, (h,), expected, now)
        elif op == "heartbeat":
            effects = ledger.heartbeat(reader, 0, (h, h + 1), expected, now)
        elif op == "abort":
            effects = ledger.abort(f"r{h}", now)
        else:
            effects = ledger.tick(now)
        assert_conserved(ledger)
        for e in effects:
            if isinstance(e, Free) and e.reason in ("expired", "aborted"):
                assert e.deadline <= now, f"{e} freed before its deadline at {now}"
    ledger.tick(now + 1_000_000)
    assert ledger.held_requests == 0
    assert ledger.pool.held_count == 0


# ---------------------------------------------------------------------------
# Bad input: duplicate registers, invalid blocks, time going backwards, caps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [(64,), (-1,), (0, 0), (True,), (1.0,), ()],
                         ids=["too_big", "negative", "twice", "bool", "float", "none"])
def test_invalid_block_ids_are_rejected(ledger: Ledger, blocks: tuple[Any, ...]) -> None:
    effects = ledger.register(1, "req", blocks, 0)
    assert [e.reason for e in effects if isinstance(e, Rejected)] == ["invalid_register"]
    assert ledger.counters["invalid_register"] == 1
    assert ledger.state(1) == UNREGISTERED
    assert ledger.pool.held_count == 0
    # Nothing live: a register without blocks would be a lease on nothing to pull (D
    # refuses such params, and its coverage fails a request with no region).
    assert ledger.live_handles() == [] and ledger.held_requests == 0


def test_next_deadline_is_the_earliest_lease_or_staging_age(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(max_staged_age=5.0)
    assert ledger.next_deadline() is None
    ledger.register(1, "req", (0,), 0)
    assert ledger.next_deadline() == 30_000
    ledger.done("d0", 9, 1, 2000)  # staged
    assert ledger.next_deadline() == 7000
    ledger.tick(7000)
    assert ledger.next_deadline() == 30_000


# ---------------------------------------------------------------------------
# Hot-path cost: tick is O(1) when nothing is due
# ---------------------------------------------------------------------------


class _CountingHeapq:
    """Stands in for the ``heapq`` module inside kvproto.lifecycle and counts calls."""

    def __init__(self) -> None:
        self.pops = 0
        self.pushes = 0

    def heappop(self, heap: list[Any]) -> Any:
        self.pops += 1
        return heapq.heappop(heap)

    def heappush(self, heap: list[Any], item: Any) -> None:
        self.pushes += 1
        heapq.heappush(heap, item)


def test_tick_does_no_heap_work_when_nothing_is_due(make_ledger: LedgerFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = make_ledger(capacity=10_000)
    for h in range(1, 10_001):
        ledger.register(h, f"r{h}", (h - 1,), 0)
    ledger.heartbeat("d0", 1, tuple(range(1, 10_001)), 1, 15_000)  # renew all (lazily)
    counting = _CountingHeapq()
    monkeypatch.setattr(lifecycle.producer, "heapq", types.SimpleNamespace(
        heappop=counting.heappop, heappush=counting.heappush))
    for t in (1000, 10_000, 20_000, 29_900):
        assert ledger.tick(t) == []
    assert (counting.pops, counting.pushes) == (0, 0)


def test_tick_work_is_proportional_to_due_entries(make_ledger: LedgerFactory,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = make_ledger(capacity=10_000)
    for h in range(1, 10_001):
        ledger.register(h, f"r{h}", (h - 1,), 0 if h <= 3 else 10_000)
    counting = _CountingHeapq()
    monkeypatch.setattr(lifecycle.producer, "heapq", types.SimpleNamespace(
        heappop=counting.heappop, heappush=counting.heappush))
    before = ledger.heap_entries
    assert [h for h, _ in frees(ledger.tick(30_000))] == [1, 2, 3]
    # Three entries processed (one bucket: the three share their deadline), none other.
    assert before - ledger.heap_entries == 3 and counting.pops == 1
    assert ledger.heap_entries == ledger.held_requests == 9997


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def test_default_config_is_valid(cfg: Config) -> None:
    assert cfg.validate() is cfg
    assert cfg.lease_horizon == 30.0


def test_config_durations_are_whole_milliseconds_for_the_machines(cfg: Config) -> None:
    assert cfg.ms == (30_000, 20_000, 5000, 30_000, 1000, 5000, 500, 30_000, 20_000, 30_000,
                      5000)
    assert cfg.ms.lease_horizon == 30_000
    # Decimal seconds carry float noise; the conversion removes it (0.1 + 0.2 s is 300 ms).
    assert replace(cfg, clock_drift=0.1 + 0.2).validate().ms.clock_drift == 300
    with pytest.raises(ConfigError, match="whole number of milliseconds"):
        replace(cfg, clock_drift=0.0015).validate()


def test_timing_rules_are_decided_exactly_in_milliseconds() -> None:
    """0.1 + 0.7 is 0.7999999999999999 in floats, so 0.8 > 0.1 + 0.7 would pass in
    seconds; in the machines' milliseconds 800 > 800 does not: the rule is refused."""
    with pytest.raises(ConfigError, match=r"lease_extension \(0.8\) must exceed heartbeat"):
        Config(lease_extension=0.8, heartbeat_interval=0.7, max_delay=0.1, clock_drift=0.0,
               max_read_time=0.1, initial_lease=1.0).validate()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"lease_extension": 6.5}, r"lease_extension \(6.5\) must exceed heartbeat_interval \+ "
                               r"max_delay \+ clock_drift \(6.5\)"),
    ({"heartbeat_interval": 19.0}, r"must exceed heartbeat_interval"),
    ({"max_read_time": 18.0}, r"must exceed max_read_time \+ 2\*max_delay \+ clock_drift"),
    ({"initial_lease": 6.5}, r"initial_lease \(6.5\) must exceed max_read_time"),
    ({"initial_lease": 7.0, "max_read_time": 1.0},
     r"initial_lease \(7.0\) must exceed heartbeat_interval \+ 2\*max_delay \+ clock_drift \(7.5\)"),
    ({"abort_grace": 29.0}, r"abort_grace \(29.0\) must be >= max\(initial_lease, "
                            r"lease_extension\)"),
    ({"initial_lease": "30"}, r"initial_lease must be a number, got '30'"),
    ({"max_staged": True}, r"max_staged must be a number"),
    ({"max_delay": float("nan")}, r"max_delay must be finite"),
    ({"max_staged": 1.5}, r"max_staged must be an integer"),
    ({"max_delay": -1.0}, r"max_delay must be >= 0"),
    ({"clock_drift": -0.1}, r"clock_drift must be >= 0"),
    ({"heartbeat_interval": 0.0}, r"heartbeat_interval must be > 0"),
    ({"max_read_time": -5.0}, r"max_read_time must be > 0"),
    ({"max_tombstones": 0}, r"max_tombstones must be within \[1, "),
    ({"max_staged": 0}, r"max_staged must be within \[1, "),
    ({"max_message_bytes": 63}, r"max_message_bytes must be within \[64, 1048576\], got 63"),
    ({"max_message_bytes": (1 << 20) + 1}, r"max_message_bytes must be within"),
])
def test_invalid_config_is_refused_naming_the_rule(overrides: dict[str, Any],
                                                   message: str) -> None:
    bad = replace(Config(), **overrides)
    with pytest.raises(ConfigError, match=message):
        bad.validate()
    with pytest.raises(ConfigError, match=message):
        Ledger(bad, BlockPool(4))


def test_config_bounds_are_inclusive_where_documented() -> None:
    Config(max_message_bytes=64).validate()
    Config(max_message_bytes=1 << 20).validate()
    Config(abort_grace=30.0).validate()  # == lease horizon is allowed


def test_config_from_dict_refuses_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config keys: colour, lease"):
        Config.from_dict({"lease": 30, "colour": "red"})


@pytest.mark.parametrize(("data", "message"), [
    ({"initial_lease": "30"}, r"initial_lease must be a number"),
    ({"max_staged": None}, r"max_staged must be a number"),
    ({"abort_grace": 1.0}, r"abort_grace \(1.0\) must be >="),
])
def test_config_from_dict_refuses_invalid_values(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_dict(data)


def test_config_from_dict_refuses_a_non_mapping() -> None:
    with pytest.raises(ConfigError, match="config must be a mapping, got list"):
        Config.from_dict([])  # type: ignore[arg-type]


def test_config_round_trips_through_dict(cfg: Config) -> None:
    custom = replace(cfg, initial_lease=40.0, abort_grace=40.0, max_staged=7)
    assert Config.from_dict(custom.to_dict()) == custom
    assert Config.from_dict({"max_staged": 7.0}).max_staged == 7


# ---------------------------------------------------------------------------
# The table is the code: every destination state comes from P_TRANSITIONS
# ---------------------------------------------------------------------------


def test_transition_table_rows_are_unique_and_use_known_names() -> None:
    keys = [(t.src, t.event, t.guard) for t in P_TRANSITIONS]
    assert len(keys) == len(set(keys))
    for t in P_TRANSITIONS:
        assert t.src in lifecycle.P_STATES and t.dst in lifecycle.P_STATES
        assert t.event in lifecycle.P_EVENTS
        assert {fx.kind for fx in t.effects} <= lifecycle.P_FX_KINDS
        if t.free is not None:
            assert t.free in lifecycle.FREE_REASONS
            assert t.dst in lifecycle.TERMINAL_STATES
        else:
            assert t.dst not in lifecycle.TERMINAL_STATES or t.src == t.dst


# -- hardening: bad time, bounded tick, compact heap ------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1500.0, True])
def test_time_that_is_not_an_int_is_refused_counted_and_changes_nothing(ledger: Ledger,
                                                                        bad: Any) -> None:
    ledger.register(1, "req", (0,), 1000, expected=1)
    calls = [lambda: ledger.register(2, "req2", (1,), bad, expected=1),
             lambda: ledger.done("d0", 1, 1, bad),
             lambda: ledger.release("d0", (1,), 1, bad),
             lambda: ledger.heartbeat("d0", 1, (1,), 1, bad),
             lambda: ledger.abort("req", bad),
             lambda: ledger.tick(bad)]
    for call in calls:
        effects = call()
        assert [(type(e), e.reason) for e in effects] == [(Rejected, "bad_time")]
    assert ledger.counters["rejected:bad_time"] == len(calls)
    assert ledger.now == 1000
    assert ledger.state(1) == REGISTERED and ledger.state(2) == UNREGISTERED
    assert ledger.deadline(1) == 31_000
    assert ledger.pool.held_count == 1
    # The lease still runs out: a bad time cannot make the deadline unreachable.
    assert frees(ledger.tick(31_000)) == [(1, "expired")]


def test_bad_time_before_any_event_is_journaled_at_a_finite_time(make_ledger: LedgerFactory
                                                                 ) -> None:
    seen: list[Any] = []
    ledger = make_ledger()
    ledger.sink = lambda ev, effs: seen.append((ev, effs))
    ledger.tick(float("nan"))
    (ev, effs), = seen
    assert ev.reason == "bad_time" and ev.now == 0
    assert effs == [Rejected("bad_time", "", None, "tick at time nan")]


def test_tick_budget_carries_expiries_over_never_early(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(capacity=64, max_tick_work=3)
    for h in range(1, 11):
        ledger.register(h, f"r{h}", (h,), 0, expected=1)
    ledger.register(20, "late", (20,), 5000, expected=1)  # deadline 35: not due at 30
    assert ledger.tick(29_999) == []
    got: list[int] = []
    for step in range(4):
        assert ledger.next_deadline() is not None
        effects = ledger.tick(30_000 + step)
        fr = [e for e in effects if isinstance(e, Free)]
        assert len(fr) <= 3
        assert all(f.deadline <= 30_000 + step for f in fr)  # never early
        got += [f.handle for f in fr]
        if step < 3:  # work left: the next deadline is already past
            due = ledger.next_deadline()
            assert due is not None and due <= 30_000 + step
    assert sorted(got) == list(range(1, 11))
    assert ledger.counters["tick_budget_exhausted"] == 3
    assert ledger.state(20) == REGISTERED
    assert ledger.next_deadline() == 35_000
    assert ledger.check_invariants() == []
    assert_conserved(ledger)


def test_a_carried_over_expiry_can_still_be_renewed_or_finished(make_ledger: LedgerFactory
                                                                ) -> None:
    ledger = make_ledger(max_tick_work=1)
    for h in (1, 2, 3):
        ledger.register(h, f"r{h}", (h,), 0, expected=1)
    assert frees(ledger.tick(30_000)) == [(1, "expired")]
    ledger.heartbeat("d0", 1, (2,), 1, 30_500)  # late, but the lease is still held: renewed
    assert frees(ledger.done("d0", 3, 1, 30_500)) == [(3, "transferred")]
    assert frees(ledger.tick(31_000)) == []  # 2's entry re-inserted (budget 1), 3's dropped
    assert ledger.state(2) == LEASED and ledger.deadline(2) == 50_500
    assert ledger.check_invariants() == []


def test_staging_expiry_is_never_late(make_ledger: LedgerFactory) -> None:
    """Staged entries are bounded by max_staged: their age limit is not subject to the
    tick budget (the spec drops them exactly at MaxStagedAge)."""
    ledger = make_ledger(max_tick_work=1)
    for h in (1, 2, 3):
        ledger.register(h, f"r{h}", (h,), 0, expected=1)
    for h in (11, 12, 13):
        ledger.done("d0", h, 1, 0)  # staged
    ledger.tick(30_000)
    assert ledger.staged_count == 0
    assert ledger.counters["staged_expired"] == 3
    assert ledger.held_requests == 2  # while the expiries are carried over


def test_heap_is_rebuilt_when_dead_entries_outnumber_live_ones(make_ledger: LedgerFactory
                                                               ) -> None:
    ledger = make_ledger(capacity=8)
    held = 0
    for h in range(1, 5001):  # churn: register and transfer at once, never tick
        ledger.register(h, f"r{h}", (h % 8,), h * 1000, expected=1)
        if h % 1000 == 0:
            held += 1  # keep a few held requests
            continue
        ledger.done("d0", h, 1, h * 1000)
        assert ledger.heap_entries <= max(2 * ledger.held_requests, lifecycle.HEAP_SLACK)
    assert ledger.held_requests == held
    assert ledger.counters["heap_rebuilt"] > 10
    assert ledger.check_invariants() == []
    # Aborts push early entries: bounded the same way.
    for h in range(6000, 6400):
        ledger.register(h, f"a{h}", (0,), 6_000_000, expected=1)
        ledger.abort(f"a{h}", 6_000_000)
        ledger.release("d0", (h,), 1, 6_000_000)
        assert ledger.heap_entries <= max(2 * ledger.held_requests, lifecycle.HEAP_SLACK)


@pytest.mark.parametrize("overrides", [
    {"lease_extension": 1e7, "initial_lease": 1e7, "abort_grace": 1e7},  # term > u32 ms
    {"heartbeat_interval": 1e-4},  # finer than the machines' millisecond clock
    {"heartbeat_interval": 1.0005},  # not a whole number of milliseconds
    {"peer_timeout": 20.0001},
    {"max_tick_work": 0},
    {"max_staged": 1 << 25},
])
def test_validate_refuses_what_the_wire_or_the_caps_cannot_carry(overrides: dict[str, Any]
                                                                 ) -> None:
    with pytest.raises(ConfigError):
        replace(Config(), **overrides).validate()
