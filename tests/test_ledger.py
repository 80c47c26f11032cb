"""P's lifecycle machine (``kvproto.lifecycle.Ledger``), its block pool and its config.

Each test is named after a behaviour users expect (issue 2, section 1) and asserts the
exact effects, states and counters, so it fails when that behaviour breaks.
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
    ABORTED,
    EXPIRED,
    FREED,
    LEASED,
    NOTIFIED,
    P_TRANSITIONS,
    REGISTERED,
    UNREGISTERED,
    Ack,
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
# Multiple readers (heterogeneous TP fan-in, several P ranks)
# ---------------------------------------------------------------------------


def test_blocks_freed_only_when_every_expected_reader_reported_done(ledger: Ledger) -> None:
    assert ledger.register(1, "req", (0, 1), 0, expected=3) == []
    assert ledger.done("d0", 1, 3, 1000) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.done("d1", 1, 3, 2000) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.pool.held_count == 2
    effects = ledger.done("d2", 1, 3, 3000)
    assert effects == [Free(1, "req", "transferred", (0, 1), (0, 1), 30_000)]
    assert ledger.state(1) == FREED
    assert ledger.pool.held_count == 0
    assert ledger.frees["transferred"] == 1


def test_duplicated_done_from_one_reader_never_counts_twice(ledger: Ledger) -> None:
    """The vLLM message-counting bug: two notifications from d0 must not free blocks
    that d1 is still pulling."""
    ledger.register(1, "req", (0,), 0, expected=2)
    assert ledger.done("d0", 1, 2, 1000) == []
    assert ledger.done("d0", 1, 2, 1100) == []
    assert ledger.done("d0", 1, 2, 1200) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.pool.refcount(0) == 1
    assert ledger.counters["duplicate"] == 2
    assert frees(ledger.done("d1", 1, 2, 2000)) == [(1, "transferred")]


def test_duplicated_release_from_one_reader_never_counts_twice(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=2)
    assert ledger.release("d0", (1,), 2, 1000) == []
    assert ledger.release("d0", (1,), 2, 1500) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.counters["duplicate"] == 1
    assert frees(ledger.done("d1", 1, 2, 2000)) == [(1, "released")]


def test_done_and_release_from_the_same_reader_count_once(ledger: Ledger) -> None:
    """A failed READ sends release and its notification may still arrive: one reader."""
    ledger.register(1, "req", (0,), 0, expected=2)
    ledger.release("d0", (1,), 2, 1000)
    assert ledger.done("d0", 1, 2, 1100) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.counters["duplicate"] == 1


def test_every_reader_released_frees_with_reason_released(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=2)
    assert ledger.release("d0", (1,), 2, 1000) == []
    assert frees(ledger.release("d1", (1,), 2, 2000)) == [(1, "released")]


def test_each_p_rank_counts_its_own_readers(make_ledger: LedgerFactory) -> None:
    """Several P ranks, each its own ledger: a done on one rank frees nothing on another."""
    p0, p1 = make_ledger(), make_ledger()
    for p in (p0, p1):
        p.register(1, "req", (0,), 0, expected=2)
    p0.done("d0", 1, 2, 1000)
    assert frees(p0.done("d1", 1, 2, 1000)) == [(1, "transferred")]
    assert p1.state(1) == REGISTERED
    assert p1.pool.held_count == 1


def test_readers_announced_late_by_done(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)  # P does not know its readers yet
    assert ledger.done("d0", 1, 2, 1000) == []
    assert ledger.snapshot()[1][1] == 2
    assert frees(ledger.done("d1", 1, 2, 2000)) == [(1, "transferred")]


def test_readers_announced_late_by_heartbeat(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    ledger.heartbeat("d0", 1, (1,), 2, 1000)
    assert ledger.snapshot()[1][1] == 2
    assert ledger.done("d0", 1, 2, 2000) == []
    assert frees(ledger.done("d1", 1, 2, 3000)) == [(1, "transferred")]


def test_readers_announced_late_by_release(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    assert ledger.release("d0", (1,), 2, 1000) == []
    assert ledger.snapshot()[1][1] == 2
    assert frees(ledger.done("d1", 1, 2, 2000)) == [(1, "released")]


def test_announced_readers_max_wins(ledger: Ledger) -> None:
    """A smaller announcement never lowers the count (it is counted as a conflict)."""
    ledger.register(1, "req", (0,), 0, expected=2)
    ledger.heartbeat("d0", 1, (1,), 3, 1000)
    assert ledger.snapshot()[1][1] == 3
    assert ledger.counters["expected_raised"] == 1
    ledger.done("d0", 1, 1, 2000)
    assert ledger.counters["expected_conflict"] == 1
    assert ledger.done("d1", 1, 2, 2000) == []
    assert ledger.state(1) == NOTIFIED
    assert frees(ledger.done("d2", 1, 3, 3000)) == [(1, "transferred")]


def test_register_without_readers_never_frees_on_done_without_count(ledger: Ledger) -> None:
    """expected 0 means unknown: a done carrying no count cannot free anything."""
    ledger.register(1, "req", (0,), 0)
    assert ledger.done("d0", 1, 0, 1000) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.pool.held_count == 1


# ---------------------------------------------------------------------------
# Leases
# ---------------------------------------------------------------------------


def test_register_starts_the_initial_lease(ledger: Ledger, cfg: Config) -> None:
    ledger.register(1, "req", (0,), 5000)
    assert ledger.state(1) == REGISTERED
    assert ledger.deadline(1) == 5000 + cfg.ms.initial_lease


def test_heartbeat_extends_lease_to_now_plus_extension(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)  # deadline 30
    effects = ledger.heartbeat("d0", 9, (1,), 1, 15_000)
    assert effects == [Ack("d0", 9, 20_000, ())]
    assert ledger.deadline(1) == 35_000
    assert ledger.state(1) == LEASED


def test_heartbeat_never_shortens_the_lease(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)  # deadline 30 > 5 + 20
    assert ledger.heartbeat("d0", 1, (1,), 1, 5000) == [Ack("d0", 1, 20_000, ())]
    assert ledger.deadline(1) == 30_000
    ledger.heartbeat("d0", 2, (1,), 1, 20_000)
    assert ledger.deadline(1) == 40_000
    ledger.heartbeat("d0", 3, (1,), 1, 19_000)  # late clock reading: clamped, not shortened
    assert ledger.deadline(1) == 40_000


def test_heartbeat_renews_a_notified_request(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=2)
    ledger.done("d0", 1, 2, 1000)
    ledger.heartbeat("d1", 1, (1,), 2, 25_000)
    assert ledger.state(1) == NOTIFIED
    assert ledger.deadline(1) == 45_000


def test_tick_frees_expired_exactly_when_the_deadline_passes(ledger: Ledger) -> None:
    ledger.register(1, "req", (0, 1), 0)
    assert ledger.tick(29_999) == []
    assert ledger.state(1) == REGISTERED
    assert ledger.tick(30_000) == [Free(1, "req", "expired", (0, 1), (0, 1), 30_000)]
    assert ledger.state(1) == EXPIRED
    assert ledger.pool.held_count == 0
    assert ledger.frees["expired"] == 1
    assert ledger.tick(100_000) == []


def test_tick_respects_a_renewed_deadline(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    ledger.heartbeat("d0", 1, (1,), 1, 25_000)  # deadline 45
    assert ledger.tick(30_000) == []
    assert ledger.tick(44_900) == []
    assert frees(ledger.tick(45_000)) == [(1, "expired")]


def test_tick_never_frees_a_renewed_lease_before_its_new_deadline(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    ledger.heartbeat("d0", 1, (1,), 1, 10_001)  # renewed just past the initial deadline
    deadline = ledger.deadline(1)
    assert deadline == 30_001
    assert ledger.tick(30_000) == []  # the initial deadline's heap entry comes due here
    assert ledger.state(1) == LEASED
    assert frees(ledger.tick(deadline)) == [(1, "expired")]


@pytest.mark.parametrize("kind", ["heartbeat", "done", "release"])
def test_message_after_expiry_is_late_and_never_resurrects(ledger: Ledger, kind: str) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    assert frees(ledger.tick(30_000)) == [(1, "expired")]
    if kind == "heartbeat":
        assert ledger.heartbeat("d0", 1, (1,), 1, 31_000) == [Ack("d0", 1, 20_000, (1,))]
    elif kind == "done":
        assert ledger.done("d0", 1, 1, 31_000) == []
    else:
        assert ledger.release("d0", (1,), 1, 31_000) == []
    assert ledger.counters["late"] == 1
    assert ledger.state(1) == EXPIRED
    assert ledger.held_requests == 0
    assert ledger.pool.held_count == 0
    assert ledger.frees == {"transferred": 0, "expired": 1, "aborted": 0, "released": 0,
                            "sibling": 0}
    assert ledger.tick(100_000) == []


@pytest.mark.parametrize("kind", ["heartbeat", "done", "release"])
def test_message_after_free_is_stale_and_never_frees_again(ledger: Ledger, kind: str) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    assert frees(ledger.done("d0", 1, 1, 1000)) == [(1, "transferred")]
    if kind == "heartbeat":
        assert ledger.heartbeat("d1", 4, (1,), 1, 2000) == [Ack("d1", 4, 20_000, (1,))]
    elif kind == "done":
        assert ledger.done("d1", 1, 1, 2000) == []
    else:
        assert ledger.release("d1", (1,), 1, 2000) == []
    assert ledger.counters["stale"] == 1
    assert ledger.state(1) == FREED
    assert ledger.pool.held_count == 0
    assert sum(ledger.frees.values()) == 1
    assert ledger.tick(100_000) == []


def test_abort_after_free_is_counted_and_changes_nothing(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    ledger.done("d0", 1, 1, 1000)
    assert ledger.abort("req", 2000) == []
    assert ledger.counters["stale"] == 1
    assert "unknown_request" not in ledger.counters
    assert ledger.state(1) == FREED
    assert sum(ledger.frees.values()) == 1
    assert ledger.tick(100_000) == []


def test_abort_after_expiry_is_counted_stale_as_the_table_says(ledger: Ledger) -> None:
    """Regression: the (expired|freed, abort, stale) rows were unreachable because the
    request-id map was cleared on free; tombstones now remember request ids."""
    ledger.register(1, "req", (0,), 0)
    ledger.tick(30_000)
    assert ledger.abort("req", 31_000) == []
    assert ledger.counters.get("stale") == 1


# ---------------------------------------------------------------------------
# Renewed leases never hide expired ones (the upstream sweep bug, vllm #58222)
# ---------------------------------------------------------------------------


def test_renewed_lease_never_hides_an_expired_one(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(initial_lease=10.0, lease_extension=100.0, abort_grace=100.0)
    ledger.register(1, "A", (0,), 0)  # deadline 10
    ledger.register(2, "B", (1,), 1000)  # deadline 11
    ledger.heartbeat("d0", 1, (1,), 1, 5000)  # A renewed far: deadline 105
    assert ledger.tick(5000) == []
    # A's old deadline (10) is still first in line when B's (11) passes
    assert frees(ledger.tick(11_000)) == [(2, "expired")]
    assert ledger.state(1) == LEASED
    assert ledger.tick(104_900) == []
    assert frees(ledger.tick(105_000)) == [(1, "expired")]


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
# Abort after finish
# ---------------------------------------------------------------------------


def test_abort_of_held_request_does_not_free_at_once(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    assert ledger.abort("req", 5000) == []
    assert ledger.state(1) == ABORTED
    assert ledger.pool.refcount(0) == 1
    assert ledger.deadline(1) == 30_000


def test_abort_stops_renewals_and_the_ack_refuses_them(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    ledger.register(2, "other", (1,), 0)
    ledger.abort("req", 5000)
    assert ledger.heartbeat("d0", 3, (1, 2), 1, 20_000) == [Ack("d0", 3, 20_000, (1,))]
    assert ledger.counters["refused"] == 1
    assert ledger.deadline(1) == 30_000  # not renewed
    assert ledger.deadline(2) == 40_000
    assert ledger.state(1) == ABORTED


def test_aborted_request_frees_on_done(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=2)
    ledger.abort("req", 1000)
    assert ledger.done("d0", 1, 2, 2000) == []
    assert ledger.state(1) == ABORTED
    assert frees(ledger.done("d1", 1, 2, 3000)) == [(1, "transferred")]


def test_aborted_request_frees_on_release_of_every_reader(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=2)
    ledger.abort("req", 1000)
    assert ledger.release("d0", (1,), 2, 2000) == []
    assert frees(ledger.release("d1", (1,), 2, 3000)) == [(1, "released")]


def test_aborted_request_frees_at_the_deadline_with_reason_aborted(ledger: Ledger) -> None:
    ledger.register(1, "req", (0, 1), 0)
    ledger.heartbeat("d0", 1, (1,), 1, 15_000)  # deadline 35
    ledger.abort("req", 16_000)
    assert ledger.tick(34_900) == []
    assert ledger.tick(35_000) == [Free(1, "req", "aborted", (0, 1), (0, 1), 35_000)]
    assert ledger.state(1) == FREED
    assert ledger.frees["aborted"] == 1


def test_second_abort_is_a_noop(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    ledger.abort("req", 1000)
    before = ledger.snapshot()
    assert ledger.abort("req", 2000) == []
    assert ledger.snapshot() == before
    assert ledger.counters["duplicate_abort"] == 1
    assert frees(ledger.tick(30_000)) == [(1, "aborted")]


def test_abort_of_unknown_request_id_is_counted_never_a_keyerror(ledger: Ledger) -> None:
    assert ledger.abort("never-registered", 1000) == []
    assert ledger.counters["unknown_request"] == 1
    assert ledger.held_requests == 0


def test_abort_racing_completion_done_first(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    assert frees(ledger.done("d0", 1, 1, 1000)) == [(1, "transferred")]
    assert ledger.abort("req", 1000) == []
    assert ledger.counters["stale"] == 1
    assert sum(ledger.frees.values()) == 1
    assert_conserved(ledger)


def test_abort_racing_completion_abort_first(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    assert ledger.abort("req", 1000) == []
    assert frees(ledger.done("d0", 1, 1, 1000)) == [(1, "transferred")]
    assert ledger.tick(100_000) == []
    assert sum(ledger.frees.values()) == 1
    assert_conserved(ledger)


def test_abort_before_registration_falls_back_to_the_lease(ledger: Ledger) -> None:
    """Abort racing prefill completion (vllm #25562): never a KeyError, never a leak."""
    assert ledger.abort("req", 0) == []
    assert ledger.register(1, "req", (0,), 500) == []
    assert frees(ledger.tick(30_500)) == [(1, "expired")]


# ---------------------------------------------------------------------------
# Early messages (staging)
# ---------------------------------------------------------------------------


def test_early_done_is_staged_and_applied_at_registration(ledger: Ledger) -> None:
    assert ledger.done("d0", 1, 1, 0) == []
    assert ledger.staged_count == 1
    assert ledger.state(1) == UNREGISTERED
    effects = ledger.register(1, "req", (0,), 500, expected=1)
    assert frees(effects) == [(1, "transferred")]
    assert ledger.staged_count == 0
    assert ledger.counters["staged_applied"] == 1


def test_early_release_is_staged_and_applied_at_registration(ledger: Ledger) -> None:
    ledger.release("d0", (1,), 1, 0)
    assert frees(ledger.register(1, "req", (0,), 500, expected=1)) == [(1, "released")]


def test_early_heartbeat_is_staged_neither_granted_nor_refused(ledger: Ledger) -> None:
    assert ledger.heartbeat("d0", 1, (1,), 1, 0) == [Ack("d0", 1, 20_000, (), (1,))]
    assert ledger.staged_count == 1
    ledger.register(1, "req", (0,), 15_000)
    assert ledger.state(1) == LEASED
    assert ledger.deadline(1) == 45_000  # max(15 + 30, 0 + 20) s


def test_staged_heartbeat_renews_from_its_arrival_time(make_ledger: LedgerFactory) -> None:
    """Applied at registration as if it had been applied when it arrived: D computes its
    lease from the heartbeat's send time, so P grants arrival + extension, no more."""
    ledger = make_ledger(initial_lease=10.0, lease_extension=20.0, abort_grace=20.0)
    ledger.heartbeat("d0", 1, (1,), 1, 2000)
    ledger.register(1, "req", (0,), 5000)
    assert ledger.deadline(1) == 22_000  # max(5 + 10, 2 + 20) s
    assert ledger.state(1) == LEASED


def test_early_done_announces_readers_at_registration(ledger: Ledger) -> None:
    ledger.done("d0", 1, 2, 0)
    assert ledger.register(1, "req", (0,), 500) == []
    assert ledger.state(1) == NOTIFIED
    assert ledger.snapshot()[1][1] == 2
    assert frees(ledger.done("d1", 1, 2, 1000)) == [(1, "transferred")]


def test_early_heartbeat_announces_readers_at_registration(ledger: Ledger) -> None:
    """Regression: a staged heartbeat's reader count was dropped at registration."""
    ledger.heartbeat("d0", 1, (1,), 2, 0)
    ledger.register(1, "req", (0,), 500)
    assert ledger.snapshot()[1][1] == 2


def test_staging_bounded_by_count_drops_oldest_and_falls_back_to_lease(
        make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(max_staged=2)
    ledger.done("d0", 1, 1, 0)
    ledger.done("d0", 2, 1, 100)
    ledger.done("d0", 3, 1, 200)  # at the cap: handle 1's entry is dropped
    assert ledger.staged_count == 2
    assert ledger.counters["staged_dropped"] == 1
    assert ledger.register(1, "r1", (0,), 1000, expected=1) == []
    assert ledger.state(1) == REGISTERED
    assert frees(ledger.register(2, "r2", (1,), 1000, expected=1)) == [(2, "transferred")]
    assert ledger.tick(30_900) == []
    assert frees(ledger.tick(31_000)) == [(1, "expired")]


def test_staging_bounded_by_age_dropped_on_tick(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(max_staged_age=5.0)
    ledger.done("d0", 1, 1, 0)
    ledger.tick(4900)
    assert ledger.staged_count == 1
    ledger.tick(5000)
    assert ledger.staged_count == 0
    assert ledger.counters["staged_expired"] == 1
    assert ledger.register(1, "req", (0,), 6000, expected=1) == []
    assert ledger.state(1) == REGISTERED
    assert frees(ledger.tick(36_000)) == [(1, "expired")]


def test_staged_messages_per_handle_are_bounded(ledger: Ledger) -> None:
    for i in range(lifecycle.MAX_STAGED_MSGS_PER_HANDLE + 3):
        ledger.heartbeat("d0", i, (1,), 1, 0)
    assert ledger.counters["staged"] == lifecycle.MAX_STAGED_MSGS_PER_HANDLE
    assert ledger.counters["staged_dropped"] == 3


# ---------------------------------------------------------------------------
# Sibling groups (parallel sampling, n > 1)
# ---------------------------------------------------------------------------


def test_transferred_member_frees_every_registered_sibling(ledger: Ledger) -> None:
    for h in (1, 2, 3):
        ledger.register(h, f"{h}_parent", (0, 1, 9 + h), 0, group="parent", expected=1)
    assert ledger.pool.refcount(0) == 3
    effects = ledger.done("d0", 2, 1, 1000)
    assert frees(effects) == [(2, "transferred"), (1, "sibling"), (3, "sibling")]
    assert ledger.pool.held_count == 0
    assert ledger.frees["sibling"] == 2
    # the shared blocks are reclaimed exactly once, by the last holder
    reclaimed = [b for e in effects if isinstance(e, Free) for b in e.reclaimed]
    assert sorted(reclaimed) == [0, 1, 10, 11, 12]


def test_sibling_registered_after_transfer_is_freed_at_registration(ledger: Ledger) -> None:
    ledger.register(1, "0_p", (0,), 0, group="p", expected=1)
    ledger.done("d0", 1, 1, 1000)
    effects = ledger.register(2, "1_p", (0, 1), 2000, group="p", expected=1)
    assert effects == [Free(2, "1_p", "sibling", (0, 1), (0, 1), 32_000)]
    assert ledger.state(2) == FREED
    assert_conserved(ledger)


def test_sibling_cascade_spares_a_member_a_reader_reported_on(ledger: Ledger) -> None:
    ledger.register(1, "0_p", (0,), 0, group="p", expected=2)
    ledger.register(2, "1_p", (1,), 0, group="p", expected=2)
    ledger.done("d0", 2, 2, 1000)  # d0 pulled member 2; d1 still pulling it
    ledger.done("d0", 1, 2, 1000)
    assert frees(ledger.done("d1", 1, 2, 2000)) == [(1, "transferred")]
    assert ledger.state(2) == NOTIFIED
    assert ledger.pool.refcount(1) == 1
    assert frees(ledger.done("d1", 2, 2, 3000)) == [(2, "transferred")]


def test_sibling_cascade_frees_an_aborted_member(ledger: Ledger) -> None:
    ledger.register(1, "0_p", (0,), 0, group="p", expected=1)
    ledger.register(2, "1_p", (1,), 0, group="p", expected=1)
    ledger.abort("1_p", 500)
    assert frees(ledger.done("d0", 1, 1, 1000)) == [(1, "transferred"), (2, "sibling")]


def test_released_member_does_not_free_its_siblings(ledger: Ledger) -> None:
    ledger.register(1, "0_p", (0,), 0, group="p", expected=1)
    ledger.register(2, "1_p", (1,), 0, group="p", expected=1)
    assert frees(ledger.release("d0", (1,), 1, 1000)) == [(1, "released")]
    assert ledger.state(2) == REGISTERED


def test_other_groups_are_untouched_by_a_transfer(ledger: Ledger) -> None:
    ledger.register(1, "0_p", (0,), 0, group="p", expected=1)
    ledger.register(2, "0_q", (1,), 0, group="q", expected=1)
    assert frees(ledger.done("d0", 1, 1, 1000)) == [(1, "transferred")]
    assert ledger.state(2) == REGISTERED


# ---------------------------------------------------------------------------
# Block pool
# ---------------------------------------------------------------------------


def test_shared_blocks_are_refcounted(ledger: Ledger) -> None:
    ledger.register(1, "a", (0, 1), 0, expected=1)
    ledger.register(2, "b", (1, 2), 0, expected=1)
    assert [ledger.pool.refcount(b) for b in (0, 1, 2)] == [1, 2, 1]
    assert ledger.pool.held_count == 3
    assert ledger.done("d0", 1, 1, 1000) == [Free(1, "a", "transferred", (0, 1), (0,), 30_000)]
    assert ledger.pool.refcount(1) == 1
    assert not ledger.pool.is_free(1)
    assert ledger.done("d0", 2, 1, 1000) == [Free(2, "b", "transferred", (1, 2), (1, 2), 30_000)]
    assert ledger.pool.held_count == 0


def test_double_free_raises_in_strict_mode() -> None:
    pool = BlockPool(4)
    pool._hold((1,))
    assert pool._drop((1,)) == [1]
    with pytest.raises(DoubleFree, match="block 1"):
        pool._drop((1,))
    assert pool.violations == 1


def test_double_free_is_counted_when_not_strict() -> None:
    pool = BlockPool(4, strict=False)
    assert pool._drop((2, 3)) == []
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


def test_duplicate_register_same_handle_is_a_counted_rejection(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    before = (ledger.snapshot(), ledger.pool.held_count, ledger.pool.refcount(0))
    effects = ledger.register(1, "other", (0, 1), 1000)
    assert len(effects) == 1 and isinstance(effects[0], Rejected)
    assert (effects[0].reason, effects[0].handle) == ("duplicate_register", 1)
    assert ledger.counters["duplicate_register"] == 1
    assert (ledger.snapshot(), ledger.pool.held_count, ledger.pool.refcount(0)) == before
    assert ledger.handle_of("other") is None


def test_duplicate_live_request_id_is_a_counted_rejection(ledger: Ledger) -> None:
    """sglang #40125: a duplicate client-supplied id crashed the scheduler."""
    ledger.register(1, "dup", (0,), 0)
    effects = ledger.register(2, "dup", (1,), 1000)
    assert [(e.reason, e.handle) for e in effects if isinstance(e, Rejected)] == [
        ("duplicate_register", 2)]
    assert ledger.state(2) == UNREGISTERED
    assert ledger.handle_of("dup") == 1
    assert ledger.pool.held_count == 1
    assert ledger.counters["duplicate_register"] == 1


def test_register_of_a_freed_handle_is_rejected(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    ledger.done("d0", 1, 1, 1000)
    effects = ledger.register(1, "req", (0,), 2000)
    assert [e.reason for e in effects if isinstance(e, Rejected)] == ["duplicate_register"]
    assert ledger.state(1) == FREED
    assert ledger.pool.held_count == 0


def test_request_id_may_be_reused_after_free(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0, expected=1)
    ledger.done("d0", 1, 1, 1000)
    assert ledger.register(2, "req", (0,), 2000) == []
    assert ledger.handle_of("req") == 2


@pytest.mark.parametrize("blocks", [(64,), (-1,), (0, 0), (True,), (1.0,)])
def test_invalid_block_ids_are_rejected(ledger: Ledger, blocks: tuple[Any, ...]) -> None:
    effects = ledger.register(1, "req", blocks, 0)
    assert [e.reason for e in effects if isinstance(e, Rejected)] == ["invalid_register"]
    assert ledger.counters["invalid_register"] == 1
    assert ledger.state(1) == UNREGISTERED
    assert ledger.pool.held_count == 0


@pytest.mark.parametrize(("handle", "expected"), [(-1, 0), (1, -1), (1, 70000)])
def test_invalid_handle_or_reader_count_is_rejected(ledger: Ledger, handle: int,
                                                    expected: int) -> None:
    effects = ledger.register(handle, "req", (0,), 0, expected=expected)
    assert [e.reason for e in effects if isinstance(e, Rejected)] == ["invalid_register"]
    assert ledger.pool.held_count == 0


def test_time_going_backwards_is_clamped_and_counted(ledger: Ledger) -> None:
    ledger.tick(10_000)
    ledger.register(1, "req", (0,), 5000)  # a stale clock reading
    assert ledger.counters["clock_regression"] == 1
    assert ledger.now == 10_000
    assert ledger.deadline(1) == 40_000  # 10 s + initial, not 5 s + initial
    ledger.heartbeat("d0", 1, (1,), 1, 3000)
    assert ledger.counters["clock_regression"] == 2
    assert ledger.deadline(1) == 40_000
    assert ledger.tick(39_000) == []


def test_tombstone_cap_evicts_oldest_and_counts(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(max_tombstones=2)
    for h in (1, 2, 3):
        ledger.register(h, f"r{h}", (h,), 0, expected=1)
        ledger.done("d0", h, 1, 1000)
    assert ledger.tombstone_count == 2
    assert ledger.counters["tombstone_evicted"] == 1
    assert ledger.state(1) == UNREGISTERED  # forgotten
    assert (ledger.state(2), ledger.state(3)) == (FREED, FREED)
    ledger.done("d1", 3, 1, 2000)
    assert ledger.counters["stale"] == 1


def test_next_deadline_is_the_earliest_lease_or_staging_age(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger(max_staged_age=5.0)
    assert ledger.next_deadline() is None
    ledger.register(1, "req", (0,), 0)
    assert ledger.next_deadline() == 30_000
    ledger.done("d0", 9, 1, 2000)  # staged
    assert ledger.next_deadline() == 7000
    ledger.tick(7000)
    assert ledger.next_deadline() == 30_000


def test_adapter_rejection_is_counted_and_changes_nothing(ledger: Ledger) -> None:
    ledger.register(1, "req", (0,), 0)
    before = ledger.snapshot()
    assert ledger.reject("bad_magic", "d0", "b'XX'", 1000) == [
        Rejected("bad_magic", "d0", None, "b'XX'")]
    assert ledger.counters["rejected:bad_magic"] == 1
    assert ledger.snapshot() == before


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
    assert [h for h, _ in frees(ledger.tick(30_000))] == [1, 2, 3]
    assert counting.pops == 3


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def test_default_config_is_valid(cfg: Config) -> None:
    assert cfg.validate() is cfg
    assert cfg.lease_horizon == 30.0


def test_config_durations_are_whole_milliseconds_for_the_machines(cfg: Config) -> None:
    assert cfg.ms == (30_000, 20_000, 5000, 30_000, 1000, 5000, 500, 30_000, 20_000, 30_000)
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


# -- hardening (issue 11): bad time, bounded tick, compact heap ------------------------------


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
