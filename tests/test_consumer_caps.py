"""D's tracking structures at their caps: the group-owner memory
(``max_landed_groups`` landed groups, ``MAX_LANDED_GROUPS`` by default) and the peer table (``MAX_PEERS``).

Times are ints of milliseconds; default config (a READ fits the initial term at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import ENGINE, ConsumerFactory, assert_conserved, finished, params, releases

from kvproto.lifecycle import (
    BlockPool,
    Config,
    DEffect,
    Ledger,
    PostRead,
    StartHandshake,
)
from kvproto.lifecycle import consumer as consumer_module


def reads(effects: Sequence[DEffect]) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, PostRead)]


def handshakes(effects: Sequence[DEffect]) -> list[str]:
    return [e.engine for e in effects if isinstance(e, StartHandshake)]


# ---------------------------------------------------------------------------
# Group-owner memory: max_landed_groups landed groups
# ---------------------------------------------------------------------------


def test_group_memory_stays_at_the_cap_under_churn(make_consumer: ConsumerFactory) -> None:
    cap, n = 8, 100
    c = consumer_module.Consumer("d0", Config(), max_landed_groups=cap)
    c.handshake_result(ENGINE, True, 0)
    for i in range(n):
        c.admit(f"a{i}", params(2 * i, group=f"g{i}"), 0)
        assert reads(c.schedule(f"a{i}", 0)) == [f"a{i}"]
        c.read_result(f"a{i}", True, 0)
        remembered = [g for g in range(i + 1) if c.group_owner(ENGINE, f"g{g}") is not None]
        assert len(remembered) == min(i + 1, cap)
    # Oldest forgotten first: the newest cap groups are the ones remembered.
    assert [g for g in range(n) if c.group_owner(ENGINE, f"g{g}")] == list(range(n - cap, n))
    assert c.counters["group_memory_evicted"] == n - cap
    # A sibling of a remembered group is still served from the landed READ.
    c.admit(f"b{n - 1}", params(2 * n - 1, group=f"g{n - 1}"), 0)
    out = c.schedule(f"b{n - 1}", 0)
    assert reads(out) == [] and finished(out) == [(f"b{n - 1}", "done", "sibling_local")]


def test_an_owner_whose_read_is_in_flight_is_never_forgotten(
        make_consumer: ConsumerFactory) -> None:
    cap = 2
    c = consumer_module.Consumer("d0", Config(), max_landed_groups=cap)
    c.handshake_result(ENGINE, True, 0)
    for i in range(5):  # five READs in flight, more than the cap
        c.admit(f"f{i}", params(100 + i, group=f"f{i}"), 0)
        assert reads(c.schedule(f"f{i}", 0)) == [f"f{i}"]
    for i in range(20):  # churn landed groups past the cap
        c.admit(f"l{i}", params(200 + i, group=f"l{i}"), 0)
        c.schedule(f"l{i}", 0)
        c.read_result(f"l{i}", True, 0)
    assert c.counters["group_memory_evicted"] == 20 - cap
    for i in range(5):
        assert c.group_owner(ENGINE, f"f{i}") == f"f{i}"
        # At most one READ per group: a sibling waits for the owner's READ.
        c.admit(f"s{i}", params(300 + i, group=f"f{i}"), 0)
        assert reads(c.schedule(f"s{i}", 0)) == []
        assert c.state(f"s{i}") == "waiting"
    # Landing them makes them ordinary landed entries, subject to the cap.
    for i in range(5):
        c.read_result(f"f{i}", True, 0)
    assert [i for i in range(5) if c.group_owner(ENGINE, f"f{i}")] == [3, 4]


def test_a_late_sibling_after_eviction_reads_itself_and_is_fenced_if_p_freed_it() -> None:
    """The second READ of a forgotten group targets blocks P freed by the sibling cascade;
    P reclaimed them (the adapter bumps their stamps before reuse), so the READ is fenced
    and the request recomputes; P counts the release as stale, frees nothing twice."""
    cfg = Config(max_groups_remembered=1)
    ledger = Ledger(cfg, BlockPool(16))
    c = consumer_module.Consumer("d0", cfg, max_landed_groups=1)
    c.handshake_result(ENGINE, True, 0)
    ledger.register(1, "a", (0, 1), 0, group="g", expected=1)
    ledger.register(2, "b", (2, 3), 0, group="g", expected=1)
    c.admit("a", params(1, group="g", blocks=(0, 1)), 0)
    c.admit("b", params(2, group="g", blocks=(2, 3)), 0)
    assert reads(c.schedule("a", 0)) == ["a"]
    c.read_result("a", True, 10)
    out = ledger.done("d0", 1, 1, 10)
    sib = [f for f in out if getattr(f, "reason", "") == "sibling"]
    assert [(f.handle, f.reclaimed) for f in sib] == [(2, (2, 3))]  # type: ignore[attr-defined]
    # Another group lands: "g" (landed) is forgotten.
    c.admit("x", params(9, group="h"), 10)
    c.schedule("x", 10)
    c.read_result("x", True, 20)
    assert c.group_owner(ENGINE, "g") is None
    # The late sibling reads itself (not sibling_local: D no longer knows g landed)...
    assert reads(c.schedule("b", 20)) == ["b"]
    # ...its blocks were reclaimed, so the stamp check fails: fenced, released, recomputed.
    out2 = c.read_result("b", False, 30, fenced=True)
    assert finished(out2) == [("b", "failed", "fenced")] and releases(out2) == ["b"]
    ledger.release("d0", [2], 1, 30)
    assert ledger.counters.get("stale", 0) >= 1
    assert_conserved(ledger)


def test_a_late_sibling_reads_itself_under_its_lease_when_p_forgot_the_group_too() -> None:
    """When P's group memory forgot the group as well, the late member is held under its
    own lease: its READ is an ordinary one and lands."""
    cfg = Config(max_groups_remembered=1)
    ledger = Ledger(cfg, BlockPool(16))
    c = consumer_module.Consumer("d0", cfg, max_landed_groups=1)
    c.handshake_result(ENGINE, True, 0)
    ledger.register(1, "a", (0, 1), 0, group="g", expected=1)
    c.admit("a", params(1, group="g", blocks=(0, 1)), 0)
    c.schedule("a", 0)
    c.read_result("a", True, 10)
    ledger.done("d0", 1, 1, 10)
    ledger.register(3, "x", (4, 5), 10, group="h", expected=1)
    c.admit("x", params(3, group="h", blocks=(4, 5)), 10)
    c.schedule("x", 10)
    c.read_result("x", True, 20)
    ledger.done("d0", 3, 1, 20)
    assert "g" not in ledger.groups_done() and c.group_owner(ENGINE, "g") is None
    ledger.register(2, "b", (2, 3), 20, group="g", expected=1)  # late member: held
    assert ledger.state(2) != "freed"
    c.admit("b", params(2, group="g", blocks=(2, 3)), 20)
    assert reads(c.schedule("b", 20)) == ["b"]
    assert finished(c.read_result("b", True, 30)) == [("b", "done", "pulled")]
    ledger.done("d0", 2, 1, 30)
    assert ledger.state(2) == "freed"
    assert_conserved(ledger)


# ---------------------------------------------------------------------------
# Peer table: MAX_PEERS
# ---------------------------------------------------------------------------


@pytest.fixture
def small_peer_table(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(consumer_module, "MAX_PEERS", 4)
    return 4


def test_idle_peers_are_forgotten_at_the_cap(make_consumer: ConsumerFactory,
                                             small_peer_table: int) -> None:
    c = make_consumer()
    for i in range(50):  # engines named once; each request finishes (client abort)
        e = f"p{i}"
        assert handshakes(c.admit(f"r{i}", params(i, engine=e), 0)) == [e]
        c.handshake_result(e, True, 0)
        c.abort(f"r{i}", 0)
        assert len(c.peers) <= small_peer_table
    # At the cap every idle peer is forgotten at once (amortized O(1) per admit).
    assert c.counters["peer_memory_evicted"] + len(c.peers) == 50
    assert c.peer("p0") is None and c.peer("p49") is not None
    # A forgotten engine named again: a new handshake (the adapter answers it at once).
    out = c.admit("again", params(1000, engine="p0"), 0)
    assert handshakes(out) == ["p0"] and c.state("again") == "handshaking"


def test_an_admit_naming_a_new_engine_is_refused_when_every_peer_is_live(
        make_consumer: ConsumerFactory, small_peer_table: int) -> None:
    c = make_consumer()
    for i in range(small_peer_table):
        e = f"p{i}"
        c.admit(f"r{i}", params(i, engine=e), 0)
        c.handshake_result(e, True, 0)
    out = c.admit("new", params(99, engine="q"), 0)
    assert finished(out) == [("new", "failed", "peer_table_full")]
    assert handshakes(out) == [] and releases(out) == []
    assert c.request("new") is None and c.peer("q") is None
    assert c.counters["peer_table_full"] == 1 and c.finished["failed:peer_table_full"] == 1
    assert len(c.peers) == small_peer_table
    assert all(c.state(f"r{i}") == "waiting" for i in range(small_peer_table))
    # An admit naming a known engine is unaffected.
    c.admit("known", params(100, engine="p0"), 0)
    assert c.state("known") == "waiting"
    # Once one peer is idle, the new engine fits.
    c.abort("r3", 0)
    assert handshakes(c.admit("new2", params(101, engine="q"), 0)) == ["q"]
    assert c.peer("p3") is None and c.counters["peer_memory_evicted"] == 1


def test_a_peer_mid_handshake_or_with_heartbeats_outstanding_is_not_forgotten(
        make_consumer: ConsumerFactory, small_peer_table: int) -> None:
    c = make_consumer()
    c.admit("h", params(1, engine="hs"), 0)  # handshake in progress
    c.abort("h", 0)  # no request left, handshake still in progress
    c.admit("w", params(2, engine="hb"), 0)
    c.handshake_result("hb", True, 0)
    assert c.tick(0)  # heartbeat sent for w
    c.abort("w", 0)  # no request left, one heartbeat outstanding
    for i in range(2):
        c.admit(f"i{i}", params(10 + i, engine=f"idle{i}"), 0)
        c.handshake_result(f"idle{i}", True, 0)
        c.abort(f"i{i}", 0)
    assert len(c.peers) == small_peer_table
    c.admit("n", params(20, engine="n"), 0)
    assert c.counters["peer_memory_evicted"] == 2
    assert c.peer_state("hs") == "handshaking" and c.outstanding_heartbeats("hb") == 1
    assert c.peer("idle0") is None and c.peer("idle1") is None
