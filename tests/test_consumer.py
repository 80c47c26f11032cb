"""D's lifecycle machine (``kvproto.lifecycle.Consumer``).

The protocol's stories (admit, handshake, READ, done, release on failure, acks granted
and refused, aborts, heartbeats, lost peers, sibling groups) are interaction scripts under
``tests/testdata/consumer/`` (run by ``test_interaction.py``); this file holds what a
script cannot say: D against a real ledger and the wire, costs, non-finite times,
properties.

Default config: initial term 30 s aged by max_delay 1 s, max_read_time 5 s, clock_drift
0.5 s, heartbeat every 5 s. A READ may start at ``now`` iff ``now + 5.5 <= lease_end``.
Times are ints of milliseconds (the durations above are the Config's seconds).
"""

from __future__ import annotations

import heapq
import types
from dataclasses import replace
from typing import Any

import pytest
from conftest import ENGINE, EPOCH, ConsumerFactory, finished, params
from hypothesis import given
from hypothesis import strategies as st

from kvproto import lifecycle, wire
from kvproto.lifecycle import (
    D_FAILED,
    D_TRANSITIONS,
    WAITING,
    Ack,
    BlockPool,
    Config,
    Consumer,
    DEffect,
    Ledger,
    PostRead,
    SendHeartbeat,
)


def ready(c: Consumer, engine: str = ENGINE, now: int = 0) -> None:
    """Complete the handshake with ``engine`` so admitted requests go straight to waiting."""
    assert c.handshake_result(engine, True, now) == []


def heartbeats(effects: list[DEffect]) -> list[SendHeartbeat]:
    return [e for e in effects if isinstance(e, SendHeartbeat)]


@pytest.fixture
def consumer(make_consumer: ConsumerFactory) -> Consumer:
    return make_consumer()


# ---------------------------------------------------------------------------
# Heartbeats: every request still to be pulled, per engine, chunked
# ---------------------------------------------------------------------------


def test_every_heartbeat_fits_one_wire_message(make_consumer: ConsumerFactory) -> None:
    """One SendHeartbeat = one wire message = one seq = one ack, whatever the caller's
    heartbeat_chunk: D chunks by ``max_message_bytes`` itself."""
    consumer = make_consumer(max_message_bytes=64)
    ready(consumer)
    handles = [1000 + 200 * i for i in range(30)]  # two varint bytes per delta
    for h in handles:
        consumer.admit(f"r{h}", params(h), 0)
    hbs = heartbeats(consumer.tick(0))
    assert len(hbs) >= 2
    assert [hb.seq for hb in hbs] == list(range(1, len(hbs) + 1))
    assert sorted(h for hb in hbs for h in hb.handles) == handles
    for hb in hbs:
        (buf,) = wire.encode_heartbeat(EPOCH, hb.seq, hb.handles, hb.expected, 64)
        assert len(buf) <= 64


def test_lost_heartbeat_message_never_lets_d_believe_an_unrenewed_lease(
        make_consumer: ConsumerFactory) -> None:
    """Regression: one SendHeartbeat used to need several wire chunks numbered seq, seq+1,
    ...; the ack of the first chunk renewed (in D's belief) the handles of a lost one."""
    overrides: dict[str, Any] = {"initial_lease": 10.0, "lease_extension": 20.0,
                                 "abort_grace": 20.0, "max_message_bytes": 64}
    config = replace(Config(), **overrides)
    consumer = make_consumer(**overrides)
    ledger = Ledger(config, BlockPool(64))
    ready(consumer)
    handles = [1000 + 200 * i for i in range(30)]
    for i, h in enumerate(handles):
        ledger.register(h, f"r{h}", (i,), 0, expected=1)
        consumer.admit(f"r{h}", params(h, term=10_000), 0)
    first, *lost = heartbeats(consumer.tick(0))
    assert lost
    for buf in wire.encode_heartbeat(EPOCH, first.seq, first.handles, first.expected,
                                     config.max_message_bytes):
        m = wire.decode(buf)  # delivered; the other messages are lost
        (ack,) = ledger.heartbeat("d0", m.seq, m.handles, m.expected, 100)
        assert isinstance(ack, Ack)
        consumer.ack(ENGINE, ack.seq, ack.term, ack.refused, 200, pending=ack.pending)
    assert consumer.lease_end(f"r{first.handles[0]}") == 19_500  # 0 + 20 s - drift 0.5 s
    for hb in lost:
        for h in hb.handles:
            deadline = ledger.deadline(h)
            lease_end = consumer.lease_end(f"r{h}")
            assert deadline is not None and lease_end is not None
            assert lease_end <= deadline, f"D believes {lease_end} for {h}, P {deadline}"


def test_staged_heartbeat_never_lets_d_believe_an_unrenewed_lease(
        make_consumer: ConsumerFactory) -> None:
    """A heartbeat P staged (not registered yet) is acked as pending, not granted: if the
    staged entry is then dropped, D's estimate must still not outlive P's deadline."""
    overrides: dict[str, Any] = {"initial_lease": 10.0, "lease_extension": 20.0,
                                 "abort_grace": 20.0, "max_staged": 1}
    consumer = make_consumer(**overrides)
    ledger = Ledger(replace(Config(), **overrides), BlockPool(8))
    ready(consumer)
    consumer.admit("r1", params(1, term=10_000), 0)  # P's registration lags the params
    (hb,) = heartbeats(consumer.tick(0))
    (ack,) = ledger.heartbeat("d0", hb.seq, hb.handles, hb.expected, 100)
    assert isinstance(ack, Ack) and (ack.refused, ack.pending) == ((), (1,))
    ledger.done("d9", 2, 1, 200)  # another early message: staging cap drops handle 1
    assert ledger.counters["staged_dropped"] == 1
    ledger.register(1, "r1", (0,), 300, expected=1)
    consumer.ack(ENGINE, ack.seq, ack.term, ack.refused, 300, pending=ack.pending)
    assert consumer.lease_end("r1") == 9000  # pending: the previous estimate stands
    deadline, lease_end = ledger.deadline(1), consumer.lease_end("r1")
    assert deadline is not None and lease_end is not None
    assert lease_end <= deadline  # D may otherwise READ at 12 after P freed at 10.3


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


def test_consumer_table_rows_are_unique() -> None:
    keys = [(t.src, t.event, t.guard) for t in D_TRANSITIONS]
    assert len(keys) == len(set(keys))


# ---------------------------------------------------------------------------
# Hot-path cost on D: tick between heartbeats does no heap work when nothing is due
# ---------------------------------------------------------------------------


def test_consumer_tick_does_no_heap_work_when_nothing_is_due(
        consumer: Consumer, monkeypatch: pytest.MonkeyPatch) -> None:
    ready(consumer)
    for h in range(1, 10_001):
        consumer.admit(f"r{h}", params(h), 0)
    hbs = heartbeats(consumer.tick(0))
    assert sorted(h for hb in hbs for h in hb.handles) == list(range(1, 10_001))
    pops = 0
    real_pop = heapq.heappop

    def counting_pop(heap: list[Any]) -> Any:
        nonlocal pops
        pops += 1
        return real_pop(heap)

    monkeypatch.setattr(lifecycle.consumer, "heapq", types.SimpleNamespace(
        heappop=counting_pop, heappush=heapq.heappush))
    for t in (1000, 2000, 4900):
        assert consumer.tick(t) == []
    assert pops == 0


def _count_heap_pops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the lease-heap entries D's tick processes (its work units): one per pop."""
    pops = [0]
    real_pop = heapq.heappop

    def counting_pop(heap: list[Any]) -> Any:
        pops[0] += 1
        return real_pop(heap)

    monkeypatch.setattr(lifecycle.consumer, "heapq", types.SimpleNamespace(
        heappop=counting_pop, heappush=heapq.heappush, heapify=heapq.heapify))
    return pops


def test_tick_budget_bounds_lease_heap_work_and_carries_losses_over(
        make_consumer: ConsumerFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 leases lost at once, 500 of them renewed (their heap entries surface and are
    re-inserted lazily): every tick processes at most max_tick_work heap entries, fails
    no request whose lease still covers a READ, and until the backlog is done
    next_deadline() says now."""
    budget = 16
    consumer = make_consumer(max_tick_work=budget, heartbeat_chunk=500)
    ready(consumer)
    for h in range(1, 1001):
        consumer.admit(f"r{h}", params(h, term=8000), 0)  # lease end 7000: lost after 1500
    hbs = heartbeats(consumer.tick(0))
    assert [len(hb.handles) for hb in hbs] == [500, 500]
    consumer.ack(ENGINE, hbs[0].seq, 20_000, (), 500)  # r1..r500: lease end 19_500
    pops = _count_heap_pops(monkeypatch)
    now, ticks, lost = 2000, 0, []
    while True:
        before = pops[0]
        out = consumer.tick(now)
        ticks += 1
        assert pops[0] - before <= budget
        lost += [rid for rid, st, why in finished(out) if why == "lease_lost"]
        assert len(finished(out)) <= budget
        if consumer.next_deadline() > now:
            break
    assert sorted(lost) == sorted(f"r{h}" for h in range(501, 1001))
    assert all(consumer.state(f"r{h}") == WAITING for h in range(1, 501))
    assert pops[0] == 1000 and ticks == 1000 // budget + 1  # 500 losses + 500 re-inserts
    assert consumer.counters["tick_budget_exhausted"] == ticks - 1


def test_a_late_lease_loss_is_still_a_waiting_request(make_consumer: ConsumerFactory) -> None:
    """A request whose loss the budget carried over stays waiting: the next heartbeat
    names it, an ack may renew it (then no tick fails it), a schedule fails it; a later
    tick fails the rest. Never early: a lease that covers a READ is never failed."""
    consumer = make_consumer(max_tick_work=1)
    ready(consumer)
    for h in (1, 2, 3):
        consumer.admit(f"r{h}", params(h, term=8000), 0)  # lease end 7000
    consumer.admit("r4", params(4, term=30_000), 0)  # lease end 29_000
    consumer.tick(0)
    assert finished(consumer.tick(4900)) == [("r1", D_FAILED, "lease_lost")]
    assert consumer.next_deadline() <= 4900
    assert consumer.state("r2") == WAITING and consumer.state("r3") == WAITING
    out = consumer.tick(5000)  # one more loss, and the heartbeat is due: it names r3
    assert finished(out) == [("r2", D_FAILED, "lease_lost")]
    (hb,) = heartbeats(out)
    assert sorted(hb.handles) == [3, 4]
    consumer.ack(ENGINE, hb.seq, 20_000, (), 5200)  # P renewed it: lease end 24_500
    assert [finished(consumer.tick(5300)) for _ in range(3)] == [[], [], []]
    assert consumer.next_deadline() > 5300
    assert consumer.state("r3") == WAITING and consumer.state("r4") == WAITING
    assert isinstance(consumer.schedule("r3", 5400)[0], PostRead)  # 5400 + 5500 <= 24_500


def test_an_unbounded_budget_fails_every_lost_lease_in_one_tick(
        make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(max_tick_work=lifecycle.MAX_CAP)
    ready(consumer)
    for h in range(1, 301):
        consumer.admit(f"r{h}", params(h, term=8000), 0)
    consumer.tick(0)
    assert len(finished(consumer.tick(2000))) == 300
    assert consumer.next_deadline() > 2000
    assert "tick_budget_exhausted" not in consumer.counters


# -- hardening: bad time, compact lease heap -------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1500.0, True])
def test_time_that_is_not_an_int_is_refused_and_counted(consumer: Consumer, bad: Any) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 1000)
    for call in (lambda: consumer.admit("r2", params(2), bad),
                 lambda: consumer.schedule("r1", bad),
                 lambda: consumer.tick(bad),
                 lambda: consumer.abort("r1", bad),
                 lambda: consumer.ack(ENGINE, 1, 20_000, (), bad),
                 lambda: consumer.peer_lost(ENGINE, bad),
                 lambda: consumer.handshake_result(ENGINE, False, bad),
                 lambda: consumer.read_result("r1", True, bad)):
        assert call() == []
    assert consumer.counters["bad_time"] == 8
    assert consumer.now == 1000
    assert consumer.state("r1") == WAITING and consumer.state("r2") == lifecycle.D_NEW
    # The request still fails when its lease can no longer cover a READ.
    assert finished(consumer.tick(40_000)) == [("r1", "failed", "lease_lost")]


def test_lease_heap_stays_bounded_under_churn(consumer: Consumer) -> None:
    ready(consumer)
    for h in range(1, 3001):
        consumer.admit(f"r{h}", params(h), h * 1000)
        consumer.abort(f"r{h}", h * 1000)
        assert consumer.heap_entries <= max(2 * len(consumer.reqs), lifecycle.HEAP_SLACK)
    assert consumer.reqs == {}
# ---------------------------------------------------------------------------
# Ack silence: Config.peer_timeout drives peer loss (the machine decides, not the adapter)
# ---------------------------------------------------------------------------


def test_peer_timeout_is_a_timing_rule() -> None:
    with pytest.raises(lifecycle.ConfigError, match="peer_timeout"):
        Config(peer_timeout=6.0).validate()  # <= heartbeat_interval + 2*max_delay = 7
    assert any("peer_timeout" in why for _, why in Config().timing_rules())


@given(st.lists(st.tuples(st.sampled_from(["admit", "ack", "tick", "schedule"]),
                          st.integers(0, 3000), st.booleans()), min_size=1, max_size=40))
def test_a_tick_before_next_deadline_changes_nothing(
        steps: list[tuple[str, int, bool]]) -> None:
    """``next_deadline`` is a lower bound of the tick's work: a tick earlier than it --
    at any time before it, down to the last millisecond before it -- returns no effect
    and leaves every request, peer and deadline as they were (so an adapter may skip it,
    and its journal holds only the ticks that matter); a tick at it is what sends the
    next heartbeat."""
    c = Consumer("d0", Config(initial_lease=6.0, lease_extension=6.0, heartbeat_interval=1.0,
                              max_delay=0.5, max_read_time=1.0, clock_drift=0.25,
                              peer_timeout=3.0, abort_grace=6.0))
    c.handshake_result(ENGINE, True, 0)
    now, h = 0, 0
    for kind, dt, to_edge in steps:
        now += dt
        if kind == "admit":
            h += 1
            c.admit(f"r{h}", params(h, term=6000), now)
        elif kind == "schedule" and h:
            c.schedule(f"r{h}", now)
        elif kind == "ack" and c.outstanding_heartbeats(ENGINE):
            c.ack(ENGINE, c.peers[ENGINE].seq, 6000, (), now)
        due = c.next_deadline()
        probe = (due - 1 if to_edge else now) if due > now else None  # 1 ms before: the edge
        if probe is not None and probe >= c.now:
            before = (dict(c.finished), {r: (c.state(r), c.lease_end(r)) for r in c.reqs},
                      c.peer_state(ENGINE), c.outstanding_heartbeats(ENGINE), due)
            assert c.tick(probe) == []
            assert (dict(c.finished), {r: (c.state(r), c.lease_end(r)) for r in c.reqs},
                    c.peer_state(ENGINE), c.outstanding_heartbeats(ENGINE),
                    c.next_deadline()) == before
            now = max(now, probe)
        if kind == "tick":
            c.tick(max(now, c.now))
    # The heartbeat is due at next_deadline at the latest: a tick there sends it.
    if any(c.state(r) == "waiting" for r in c.reqs) and c.peer_state(ENGINE) == "ready":
        t = max(c.next_deadline(), c.now)
        assert t <= c.now + 1000


# ---------------------------------------------------------------------------
# Bad params: refused before the table
# ---------------------------------------------------------------------------


def test_params_naming_no_block_are_refused_before_the_table(consumer: Consumer) -> None:
    from kvproto.lifecycle import DRejected

    ready(consumer)
    out = consumer.admit("bad", params(7, blocks=()), 100)
    assert finished(out) == [("bad", D_FAILED, "bad_params")]
    assert [(e.reason, e.peer) for e in out if isinstance(e, DRejected)] == [
        ("bad_params", ENGINE)]
    assert not [e for e in out if isinstance(e, PostRead)]
    assert consumer.request("bad") is None and consumer.counters["rejected:bad_params"] == 1
    assert 7 not in consumer.peers[ENGINE].reqs
    # The same request id with good params is then D's as usual.
    out = consumer.admit("bad", params(7), 200)
    assert consumer.state("bad") == WAITING and finished(out) == []


_GOOD = {"engine": "P0", "epoch": 1, "handle": 5, "blocks": [3, 4], "initial_term": 30_000,
         "expected": 2, "group": None, "generations": [0, 1], "capability": ""}


@pytest.mark.parametrize("field,value,words", [
    ("engine", "", "engine"), ("engine", 3, "engine"),
    ("blocks", [], "at least one block"), ("blocks", "12", "blocks"),
    ("blocks", [1.0], "blocks"), ("blocks", [True], "blocks"), ("blocks", [-1], "blocks"),
    ("generations", [0], "one per block"), ("generations", ["0", "1"], "generations"),
    ("epoch", -1, "epoch"), ("epoch", 1.5, "epoch"), ("handle", "5", "handle"),
    ("handle", None, "handle"), ("expected", 0, "expected"), ("expected", True, "expected"),
    ("initial_term", -5, "duration"), ("initial_term", 30.0, "duration"),
    ("group", 4, "group"), ("capability", 7, "capability"),
])
def test_transfer_params_from_dict_refuses_each_bad_field(field: str, value: Any,
                                                         words: str) -> None:
    from kvproto.lifecycle import TransferParams

    assert TransferParams.from_dict(dict(_GOOD)).to_dict() == _GOOD  # the good one decodes
    with pytest.raises(ValueError, match=words):
        TransferParams.from_dict({**_GOOD, field: value})
    with pytest.raises(ValueError, match="mapping"):
        TransferParams.from_dict([_GOOD])  # type: ignore[arg-type]
