"""D's lifecycle machine (``kvproto.lifecycle.Consumer``), issue 2 section 2.

Default config: initial term 30 s aged by max_delay 1 s, max_read_time 5 s, clock_drift
0.5 s, heartbeat every 5 s. A READ may start at ``now`` iff ``now + 5.5 <= lease_end``.
"""

from __future__ import annotations

import heapq
import types
from dataclasses import replace
from typing import Any

import pytest
from conftest import ENGINE, EPOCH, ConsumerFactory, finished, params, releases
from hypothesis import given
from hypothesis import strategies as st

from kvproto import lifecycle, wire
from kvproto.lifecycle import (
    D_DONE,
    D_FAILED,
    D_NEW,
    D_TRANSITIONS,
    HANDSHAKING,
    READING,
    WAITING,
    Ack,
    BlockPool,
    Config,
    Consumer,
    DEffect,
    Finished,
    Ledger,
    PostRead,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
)


def ready(c: Consumer, engine: str = ENGINE, now: float = 0.0) -> None:
    """Complete the handshake with ``engine`` so admitted requests go straight to waiting."""
    assert c.handshake_result(engine, True, now) == []


def heartbeats(effects: list[DEffect]) -> list[SendHeartbeat]:
    return [e for e in effects if isinstance(e, SendHeartbeat)]


@pytest.fixture
def consumer(make_consumer: ConsumerFactory) -> Consumer:
    return make_consumer()


# ---------------------------------------------------------------------------
# States: waiting / handshaking / reading / done / failed
# ---------------------------------------------------------------------------


def test_admit_with_unknown_engine_starts_one_handshake(consumer: Consumer) -> None:
    assert consumer.admit("r1", params(1), 0.0) == [StartHandshake(ENGINE)]
    assert consumer.admit("r2", params(2), 0.1) == []  # joins the handshake in progress
    assert consumer.state("r1") == consumer.state("r2") == HANDSHAKING
    assert consumer.handshake_result(ENGINE, True, 0.2) == []
    assert consumer.state("r1") == consumer.state("r2") == WAITING


def test_admit_with_known_engine_goes_to_waiting(consumer: Consumer) -> None:
    ready(consumer)
    assert consumer.admit("r1", params(1), 0.0) == []
    assert consumer.state("r1") == WAITING


def test_pull_lifecycle_waiting_reading_done(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1, blocks=(4, 5), expected=2), 0.0)
    assert consumer.schedule("r1", 1.0) == [PostRead("r1", ENGINE, 1, (4, 5), 2)]
    assert consumer.state("r1") == READING
    # the done notification travels with the READ (NIXL notif_msg): nothing else to send
    assert consumer.read_result("r1", True, 2.0) == [Finished("r1", D_DONE, "pulled")]
    assert consumer.state("r1") == D_NEW  # left the machine
    assert consumer.finished == {"done:pulled": 1}


def test_done_is_sent_only_after_the_read_completed(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    effects = consumer.schedule("r1", 1.0)
    assert not any(isinstance(e, SendDone) for e in effects)
    assert consumer.read_result("r1", True, 2.0, notif_attached=False) == [
        SendDone("r1", ENGINE, 1, 1), Finished("r1", D_DONE, "pulled")]


@pytest.mark.parametrize(("fenced", "reason"), [(False, "transfer_error"), (True, "fenced")])
def test_failed_read_fails_and_releases(consumer: Consumer, fenced: bool, reason: str) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.schedule("r1", 1.0)
    assert consumer.read_result("r1", False, 2.0, fenced=fenced) == [
        SendRelease("r1", ENGINE, 1, 1), Finished("r1", D_FAILED, reason)]


def test_duplicate_admit_is_counted_and_ignored(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    assert consumer.admit("r1", params(2), 0.1) == []
    assert consumer.admit("r2", params(1), 0.1) == []  # same handle from the same engine
    assert consumer.counters["duplicate_admit"] == 2
    assert consumer.state("r2") == D_NEW
    assert consumer.lease_end("r1") == 29.0


def test_events_for_unknown_requests_are_counted(consumer: Consumer) -> None:
    assert consumer.schedule("nope", 0.0) == []
    assert consumer.read_result("nope", True, 0.0) == []
    assert consumer.abort("nope", 0.0) == []
    assert consumer.ack(ENGINE, 1, 20.0, (), 0.0) == []
    assert consumer.counters == {"schedule_not_waiting": 1, "read_result_not_reading": 1,
                                 "abort_unknown": 1, "ack_unknown": 1}


# ---------------------------------------------------------------------------
# A READ starts only when the lease covers it
# ---------------------------------------------------------------------------


def test_initial_term_is_aged_by_max_delay(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1, term=30.0), 10.0)
    assert consumer.lease_end("r1") == 39.0  # 10 + 30 - max_delay 1


def test_read_starts_when_lease_less_read_time_and_drift_covers_it(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)  # lease end 29
    assert consumer.schedule("r1", 23.5) == [PostRead("r1", ENGINE, 1, (0, 1), 1)]


def test_read_refused_when_lease_too_short_fails_and_releases(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)  # lease end 29; 23.6 + 5 + 0.5 > 29
    assert consumer.schedule("r1", 23.6) == [
        SendRelease("r1", ENGINE, 1, 1), Finished("r1", D_FAILED, "lease_short")]


def test_admit_with_too_little_lease_left_fails_and_releases(consumer: Consumer) -> None:
    ready(consumer)
    assert consumer.admit("r1", params(1, term=6.0), 0.0) == [
        SendRelease("r1", ENGINE, 1, 1), Finished("r1", D_FAILED, "lease_short")]


def test_tick_fails_and_releases_a_queued_request_whose_lease_ran_short(
        make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(peer_timeout=60.0)  # P silent, but not yet declared lost
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.tick(0.0)  # heartbeat sent, never acknowledged
    assert finished(consumer.tick(23.5)) == []
    assert consumer.tick(23.6) == [SendRelease("r1", ENGINE, 1, 1),
                                   Finished("r1", D_FAILED, "lease_lost")]


def test_tick_keeps_a_renewed_request(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    (hb,) = heartbeats(consumer.tick(20.0))
    consumer.ack(ENGINE, hb.seq, 20.0, (), 20.4)
    assert finished(consumer.tick(23.6)) == []
    assert consumer.state("r1") == WAITING


# ---------------------------------------------------------------------------
# Leases from acks
# ---------------------------------------------------------------------------


def test_lease_updated_from_ack_send_time_plus_term_less_drift(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)  # lease end 29
    (hb,) = heartbeats(consumer.tick(10.0))
    assert hb == SendHeartbeat(ENGINE, hb.seq, (1,), 1)
    assert consumer.ack(ENGINE, hb.seq, 20.0, (), 12.0) == []
    assert consumer.lease_end("r1") == 29.5  # sent at 10 (not received at 12) + 20 - 0.5


def test_ack_never_shortens_the_lease(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    (hb,) = heartbeats(consumer.tick(1.0))
    consumer.ack(ENGINE, hb.seq, 20.0, (), 1.5)
    assert consumer.lease_end("r1") == 29.0


def test_ack_of_unknown_sequence_is_counted(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    (hb,) = heartbeats(consumer.tick(10.0))
    assert consumer.ack(ENGINE, hb.seq + 1, 20.0, (), 11.0) == []
    consumer.ack(ENGINE, hb.seq, 20.0, (), 11.0)
    assert consumer.ack(ENGINE, hb.seq, 20.0, (), 11.0) == []  # acked twice
    assert consumer.counters["ack_unknown"] == 2


def test_refused_in_ack_fails_a_waiting_request(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.admit("r2", params(2), 0.0)
    (hb,) = heartbeats(consumer.tick(10.0))
    # P refused (aborted, expired or freed): release, so an aborted request frees now
    assert consumer.ack(ENGINE, hb.seq, 20.0, (1,), 10.5) == [
        SendRelease("r1", ENGINE, 1, 1), Finished("r1", D_FAILED, "revoked")]
    assert consumer.state("r2") == WAITING
    assert consumer.lease_end("r2") == 29.5


def test_refused_in_ack_lets_an_in_flight_read_finish(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.schedule("r1", 1.0)
    (hb,) = heartbeats(consumer.tick(10.0))
    assert hb.handles == (1,)  # reading requests are renewed too
    assert consumer.ack(ENGINE, hb.seq, 20.0, (1,), 10.5) == []
    assert consumer.state("r1") == READING
    assert consumer.read_result("r1", True, 11.0) == [Finished("r1", D_DONE, "pulled")]


# ---------------------------------------------------------------------------
# Aborts on D
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("handshaken", [True, False])
def test_abort_before_read_releases_at_once(consumer: Consumer, handshaken: bool) -> None:
    if handshaken:
        ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    assert consumer.abort("r1", 1.0) == [SendRelease("r1", ENGINE, 1, 1),
                                         Finished("r1", D_FAILED, "aborted")]


def test_abort_during_read_never_releases_until_the_read_finishes(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.schedule("r1", 1.0)
    assert consumer.abort("r1", 1.5) == []
    assert consumer.state("r1") == READING
    assert releases(consumer.tick(2.0)) == []
    assert consumer.peer_lost(ENGINE, 2.5) == []  # the READ reports its own failure
    assert consumer.state("r1") == READING
    # the READ landed: its done notification went with it; no release is ever sent
    assert consumer.read_result("r1", True, 3.0) == [Finished("r1", D_FAILED, "aborted")]


def test_abort_during_read_releases_after_the_read_failed(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.schedule("r1", 1.0)
    consumer.abort("r1", 1.5)
    assert consumer.read_result("r1", False, 3.0) == [
        SendRelease("r1", ENGINE, 1, 1), Finished("r1", D_FAILED, "transfer_error")]


# ---------------------------------------------------------------------------
# Heartbeats: every request still to be pulled, per engine, chunked
# ---------------------------------------------------------------------------


def test_heartbeat_includes_queued_and_reading_requests(consumer: Consumer) -> None:
    ready(consumer)
    for h in (3, 1, 2):
        consumer.admit(f"r{h}", params(h), 0.0)
    consumer.schedule("r2", 0.5)  # reading; r1 and r3 still queued behind the scheduler
    assert heartbeats(consumer.tick(1.0)) == [SendHeartbeat(ENGINE, 1, (1, 2, 3), 1)]


def test_heartbeat_skips_requests_still_handshaking(consumer: Consumer) -> None:
    consumer.admit("r1", params(1), 0.0)
    assert heartbeats(consumer.tick(1.0)) == []


def test_heartbeat_is_sent_once_per_interval(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    assert len(heartbeats(consumer.tick(1.0))) == 1
    assert heartbeats(consumer.tick(5.9)) == []
    assert [hb.seq for hb in heartbeats(consumer.tick(6.0))] == [2]


def test_heartbeats_are_batched_per_engine(consumer: Consumer) -> None:
    ready(consumer, "P0")
    ready(consumer, "P1")
    consumer.admit("a", params(1, engine="P0"), 0.0)
    consumer.admit("b", params(2, engine="P0"), 0.0)
    consumer.admit("c", params(1, engine="P1"), 0.0)
    hbs = heartbeats(consumer.tick(1.0))
    assert sorted((hb.engine, hb.handles) for hb in hbs) == [("P0", (1, 2)), ("P1", (1,))]


def test_heartbeats_are_batched_per_expected_reader_count(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("a", params(1, expected=1), 0.0)
    consumer.admit("b", params(2, expected=2), 0.0)
    hbs = heartbeats(consumer.tick(1.0))
    assert sorted((hb.expected, hb.handles) for hb in hbs) == [(1, (1,)), (2, (2,))]


def test_heartbeats_are_chunked_by_the_caller(make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(heartbeat_chunk=2)
    ready(consumer)
    for h in range(1, 6):
        consumer.admit(f"r{h}", params(h), 0.0)
    hbs = heartbeats(consumer.tick(1.0))
    assert [(hb.seq, hb.handles) for hb in hbs] == [(1, (1, 2)), (2, (3, 4)), (3, (5,))]
    # each chunk is acknowledged on its own
    consumer.ack(ENGINE, 2, 40.0, (), 1.5)
    assert [consumer.lease_end(f"r{h}") for h in range(1, 6)] == [29.0, 29.0, 40.5, 40.5, 29.0]
    consumer.ack(ENGINE, 2, 40.0, (), 1.5)
    assert consumer.counters["ack_unknown"] == 1


def test_every_heartbeat_fits_one_wire_message(make_consumer: ConsumerFactory) -> None:
    """One SendHeartbeat = one wire message = one seq = one ack, whatever the caller's
    heartbeat_chunk: D chunks by ``max_message_bytes`` itself."""
    consumer = make_consumer(max_message_bytes=64)
    ready(consumer)
    handles = [1000 + 200 * i for i in range(30)]  # two varint bytes per delta
    for h in handles:
        consumer.admit(f"r{h}", params(h), 0.0)
    hbs = heartbeats(consumer.tick(0.0))
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
        ledger.register(h, f"r{h}", (i,), 0.0, expected=1)
        consumer.admit(f"r{h}", params(h, term=10.0), 0.0)
    first, *lost = heartbeats(consumer.tick(0.0))
    assert lost
    for buf in wire.encode_heartbeat(EPOCH, first.seq, first.handles, first.expected,
                                     config.max_message_bytes):
        m = wire.decode(buf)  # delivered; the other messages are lost
        (ack,) = ledger.heartbeat("d0", m.seq, m.handles, m.expected, 0.1)
        assert isinstance(ack, Ack)
        consumer.ack(ENGINE, ack.seq, ack.term, ack.refused, 0.2, pending=ack.pending)
    assert consumer.lease_end(f"r{first.handles[0]}") == 19.5  # 0 + 20 - drift 0.5
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
    consumer.admit("r1", params(1, term=10.0), 0.0)  # P's registration lags the params
    (hb,) = heartbeats(consumer.tick(0.0))
    (ack,) = ledger.heartbeat("d0", hb.seq, hb.handles, hb.expected, 0.1)
    assert isinstance(ack, Ack) and (ack.refused, ack.pending) == ((), (1,))
    ledger.done("d9", 2, 1, 0.2)  # another early message: staging cap drops handle 1
    assert ledger.counters["staged_dropped"] == 1
    ledger.register(1, "r1", (0,), 0.3, expected=1)
    consumer.ack(ENGINE, ack.seq, ack.term, ack.refused, 0.3, pending=ack.pending)
    assert consumer.lease_end("r1") == 9.0  # pending: the previous estimate stands
    deadline, lease_end = ledger.deadline(1), consumer.lease_end("r1")
    assert deadline is not None and lease_end is not None
    assert lease_end <= deadline  # D may otherwise READ at 12 after P freed at 10.3


# ---------------------------------------------------------------------------
# Handshake failure and lost peers fail only the affected requests
# ---------------------------------------------------------------------------


def test_handshake_failure_fails_only_that_engines_requests(consumer: Consumer) -> None:
    ready(consumer, "P1")
    consumer.admit("a", params(1, engine="P0"), 0.0)
    consumer.admit("b", params(2, engine="P0"), 0.0)
    consumer.admit("c", params(1, engine="P1"), 0.0)
    assert consumer.handshake_result("P0", False, 0.5, reason="version") == [
        Finished("a", D_FAILED, "version"), Finished("b", D_FAILED, "version")]
    assert consumer.state("c") == WAITING
    assert consumer.finished == {"failed:version": 2}


def test_admit_after_failed_handshake_retries_it(consumer: Consumer) -> None:
    consumer.admit("a", params(1), 0.0)
    consumer.handshake_result(ENGINE, False, 0.5)
    assert consumer.admit("b", params(2), 1.0) == [StartHandshake(ENGINE)]


def test_peer_lost_fails_waiting_requests_promptly(consumer: Consumer) -> None:
    ready(consumer, "P0")
    ready(consumer, "P1")
    consumer.admit("a", params(1, engine="P0"), 0.0)
    consumer.admit("b", params(2, engine="P0"), 0.0)
    consumer.admit("c", params(1, engine="P1"), 0.0)
    consumer.schedule("b", 0.5)
    assert consumer.peer_lost("P0", 1.0) == [Finished("a", D_FAILED, "peer_lost")]
    assert consumer.state("b") == READING
    assert consumer.state("c") == WAITING
    # no more heartbeats to the lost engine until it is handshaken again
    assert [hb.engine for hb in heartbeats(consumer.tick(2.0))] == ["P1"]


def test_peer_lost_fails_handshaking_requests(consumer: Consumer) -> None:
    consumer.admit("a", params(1), 0.0)
    assert consumer.peer_lost(ENGINE, 0.5) == [Finished("a", D_FAILED, "peer_lost")]


# ---------------------------------------------------------------------------
# Sibling groups: at most one READ per group
# ---------------------------------------------------------------------------


def test_at_most_one_read_per_sibling_group(consumer: Consumer) -> None:
    ready(consumer)
    for h in (1, 2, 3):
        consumer.admit(f"{h}_p", params(h, group="p"), 0.0)
    assert consumer.schedule("1_p", 1.0) == [PostRead("1_p", ENGINE, 1, (0, 1), 1)]
    assert consumer.read_result("1_p", True, 2.0) == [Finished("1_p", D_DONE, "pulled")]
    for h in (2, 3):
        assert consumer.schedule(f"{h}_p", 3.0) == [
            SendRelease(f"{h}_p", ENGINE, h, 1), Finished(f"{h}_p", D_DONE, "sibling_local")]
    assert consumer.finished == {"done:pulled": 1, "done:sibling_local": 2}


def test_no_second_read_while_a_sibling_is_reading(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("1_p", params(1, group="p"), 0.0)
    consumer.admit("2_p", params(2, group="p"), 0.0)
    consumer.schedule("1_p", 1.0)
    assert not any(isinstance(e, PostRead) for e in consumer.schedule("2_p", 1.5))


def test_sibling_waits_while_the_group_read_is_in_flight(consumer: Consumer) -> None:
    """Regression: a sibling used to finish done/sibling_local while the group's only
    READ was still in flight (and could still fail)."""
    ready(consumer)
    consumer.admit("1_p", params(1, group="p"), 0.0)
    consumer.admit("2_p", params(2, group="p"), 0.0)
    consumer.schedule("1_p", 1.0)
    assert consumer.schedule("2_p", 1.5) == []
    assert consumer.state("2_p") == WAITING
    assert consumer.counters["sibling_in_flight"] == 1
    (hb,) = heartbeats(consumer.tick(2.0))
    assert hb.handles == (1, 2)  # the waiting sibling is still renewed


def test_sibling_reads_itself_when_the_group_read_failed(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("1_p", params(1, group="p"), 0.0)
    consumer.admit("2_p", params(2, group="p"), 0.0)
    consumer.schedule("1_p", 1.0)
    consumer.schedule("2_p", 1.5)
    consumer.read_result("1_p", False, 2.0)
    assert consumer.schedule("2_p", 2.5) == [PostRead("2_p", ENGINE, 2, (0, 1), 1)]


def test_landed_read_aborted_meanwhile_still_serves_the_group(consumer: Consumer) -> None:
    """P was told done (the notification travelled with the READ) and may free the other
    members, so they must not be read again: they are served from the landed prefix."""
    ready(consumer)
    consumer.admit("1_p", params(1, group="p"), 0.0)
    consumer.admit("2_p", params(2, group="p"), 0.0)
    consumer.schedule("1_p", 1.0)
    consumer.abort("1_p", 1.2)
    assert consumer.read_result("1_p", True, 2.0) == [Finished("1_p", D_FAILED, "aborted")]
    assert consumer.schedule("2_p", 2.5) == [
        SendRelease("2_p", ENGINE, 2, 1), Finished("2_p", D_DONE, "sibling_local")]


def test_sibling_groups_are_per_engine(consumer: Consumer) -> None:
    ready(consumer, "P0")
    ready(consumer, "P1")
    consumer.admit("a", params(1, engine="P0", group="g"), 0.0)
    consumer.admit("b", params(1, engine="P1", group="g"), 0.0)
    consumer.schedule("a", 1.0)
    assert consumer.schedule("b", 1.0) == [PostRead("b", "P1", 1, (0, 1), 1)]


def test_failed_group_read_lets_another_sibling_read(consumer: Consumer) -> None:
    ready(consumer)
    consumer.admit("1_p", params(1, group="p"), 0.0)
    consumer.admit("2_p", params(2, group="p"), 0.0)
    consumer.schedule("1_p", 1.0)
    consumer.read_result("1_p", False, 2.0)
    assert consumer.schedule("2_p", 3.0) == [PostRead("2_p", ENGINE, 2, (0, 1), 1)]


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
        consumer.admit(f"r{h}", params(h), 0.0)
    hbs = heartbeats(consumer.tick(0.0))
    assert sorted(h for hb in hbs for h in hb.handles) == list(range(1, 10_001))
    pops = 0
    real_pop = heapq.heappop

    def counting_pop(heap: list[Any]) -> Any:
        nonlocal pops
        pops += 1
        return real_pop(heap)

    monkeypatch.setattr(lifecycle.consumer, "heapq", types.SimpleNamespace(
        heappop=counting_pop, heappush=heapq.heappush))
    for t in (1.0, 2.0, 4.9):
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
        consumer.admit(f"r{h}", params(h, term=8.0), 0.0)  # lease end 7: lost after 1.5
    hbs = heartbeats(consumer.tick(0.0))
    assert [len(hb.handles) for hb in hbs] == [500, 500]
    consumer.ack(ENGINE, hbs[0].seq, 20.0, (), 0.5)  # r1..r500: lease end 19.5
    pops = _count_heap_pops(monkeypatch)
    now, ticks, lost = 2.0, 0, []
    while True:
        before = pops[0]
        out = consumer.tick(now)
        ticks += 1
        assert pops[0] - before <= budget
        lost += [rid for rid, st, why in finished(out) if why == "lease_lost"]
        assert len(finished(out)) <= budget
        if consumer.next_deadline() > now:
            break
        now += 1e-6  # an adapter polls again at once
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
        consumer.admit(f"r{h}", params(h, term=8.0), 0.0)  # lease end 7
    consumer.admit("r4", params(4, term=30.0), 0.0)  # lease end 29
    consumer.tick(0.0)
    assert finished(consumer.tick(4.9)) == [("r1", D_FAILED, "lease_lost")]
    assert consumer.next_deadline() <= 4.9
    assert consumer.state("r2") == WAITING and consumer.state("r3") == WAITING
    out = consumer.tick(5.0)  # one more loss, and the heartbeat is due: it names r3
    assert finished(out) == [("r2", D_FAILED, "lease_lost")]
    (hb,) = heartbeats(out)
    assert sorted(hb.handles) == [3, 4]
    consumer.ack(ENGINE, hb.seq, 20.0, (), 5.2)  # P renewed it: lease end 24.5
    assert [finished(consumer.tick(5.3)) for _ in range(3)] == [[], [], []]
    assert consumer.next_deadline() > 5.3
    assert consumer.state("r3") == WAITING and consumer.state("r4") == WAITING
    assert isinstance(consumer.schedule("r3", 5.4)[0], PostRead)  # 5.4 + 5.5 <= 24.5


def test_an_unbounded_budget_fails_every_lost_lease_in_one_tick(
        make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(max_tick_work=lifecycle.MAX_CAP)
    ready(consumer)
    for h in range(1, 301):
        consumer.admit(f"r{h}", params(h, term=8.0), 0.0)
    consumer.tick(0.0)
    assert len(finished(consumer.tick(2.0))) == 300
    assert consumer.next_deadline() > 2.0
    assert "tick_budget_exhausted" not in consumer.counters


# -- hardening (issue 11): bad time, compact lease heap -------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_time_is_refused_and_counted(consumer: Consumer, bad: float) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 1.0)
    for call in (lambda: consumer.admit("r2", params(2), bad),
                 lambda: consumer.schedule("r1", bad),
                 lambda: consumer.tick(bad),
                 lambda: consumer.abort("r1", bad),
                 lambda: consumer.ack(ENGINE, 1, 20.0, (), bad),
                 lambda: consumer.peer_lost(ENGINE, bad),
                 lambda: consumer.handshake_result(ENGINE, False, bad),
                 lambda: consumer.read_result("r1", True, bad)):
        assert call() == []
    assert consumer.counters["bad_time"] == 8
    assert consumer.now == 1.0
    assert consumer.state("r1") == WAITING and consumer.state("r2") == lifecycle.D_NEW
    # The request still fails when its lease can no longer cover a READ.
    assert finished(consumer.tick(40.0)) == [("r1", "failed", "lease_lost")]


def test_a_stale_time_never_lets_a_read_start_on_a_lease_that_ran_out(consumer: Consumer
                                                                      ) -> None:
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)  # lease end 29 (term 30 - max_delay 1)
    consumer.admit("r2", params(2), 26.0)  # the clock reads 26: 26 + 5 + 0.5 > 29
    effects = consumer.schedule("r1", 1.0)  # a stale reading of the clock
    assert consumer.counters["clock_regression"] == 1
    assert not any(isinstance(e, PostRead) for e in effects)
    assert finished(effects) == [("r1", "failed", "lease_short")]


def test_lease_heap_stays_bounded_under_churn(consumer: Consumer) -> None:
    ready(consumer)
    for h in range(1, 3001):
        consumer.admit(f"r{h}", params(h), float(h))
        consumer.abort(f"r{h}", float(h))
        assert len(consumer._lease_heap) <= max(2 * len(consumer.reqs), lifecycle.HEAP_SLACK)
    assert consumer.reqs == {}
# ---------------------------------------------------------------------------
# Ack silence: Config.peer_timeout drives peer loss (the machine decides, not the adapter)
# ---------------------------------------------------------------------------


def test_ack_silence_for_peer_timeout_loses_the_peer(make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(peer_timeout=8.0)
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    consumer.admit("r2", params(2), 0.0)
    consumer.schedule("r2", 0.5)  # in flight: the READ reports its own fate
    (hb,) = heartbeats(consumer.tick(1.0))
    assert finished(consumer.tick(8.9)) == []  # silent 8.9 s since the handshake: not yet
    out = consumer.tick(9.1)
    assert ("r1", D_FAILED, "peer_lost") in finished(out)
    assert any(isinstance(e, lifecycle.DropPeer) and e.engine == ENGINE for e in out)
    assert releases(out) == []  # peer loss never releases: P expires what D held
    assert consumer.state("r2") == READING
    assert consumer.peer_state(ENGINE) == lifecycle.PEER_UNKNOWN
    assert consumer.ack(ENGINE, hb.seq, 20.0, (), 9.2) == []  # forgotten with the peer


def test_acks_keep_a_slow_but_answering_peer(make_consumer: ConsumerFactory) -> None:
    consumer = make_consumer(peer_timeout=8.0)
    ready(consumer)
    consumer.admit("r1", params(1), 0.0)
    for t in range(0, 40, 5):
        for hb in heartbeats(consumer.tick(float(t))):
            consumer.ack(ENGINE, hb.seq, 20.0, (), t + 2.0)  # max_delay each way
    assert consumer.state("r1") == WAITING
    assert consumer.peer_state(ENGINE) == lifecycle.PEER_READY


def test_peer_timeout_is_a_timing_rule() -> None:
    with pytest.raises(lifecycle.ConfigError, match="peer_timeout"):
        Config(peer_timeout=6.0).validate()  # <= heartbeat_interval + 2*max_delay = 7
    assert any("peer_timeout" in why for _, why in Config().timing_rules())


@given(st.lists(st.tuples(st.sampled_from(["admit", "ack", "tick", "schedule"]),
                          st.floats(0.0, 3.0)), min_size=1, max_size=40))
def test_a_tick_before_next_deadline_changes_nothing(steps: list[tuple[str, float]]) -> None:
    """``next_deadline`` is a lower bound of the tick's work: a tick earlier than it
    returns no effect and leaves every request, peer and deadline as they were (so an
    adapter may skip it, and its journal holds only the ticks that matter); a tick at it
    is what sends the next heartbeat."""
    c = Consumer("d0", Config(initial_lease=6.0, lease_extension=6.0, heartbeat_interval=1.0,
                              max_delay=0.5, max_read_time=1.0, clock_drift=0.25,
                              peer_timeout=3.0, abort_grace=6.0))
    c.handshake_result(ENGINE, True, 0.0)
    now, h = 0.0, 0
    for kind, dt in steps:
        now += dt
        if kind == "admit":
            h += 1
            c.admit(f"r{h}", params(h, term=6.0), now)
        elif kind == "schedule" and h:
            c.schedule(f"r{h}", now)
        elif kind == "ack" and c.outstanding_heartbeats(ENGINE):
            c.ack(ENGINE, c.peers[ENGINE].seq, 6.0, (), now)
        due = c.next_deadline()
        probe = min(now, due - 1e-6) if due > now else None
        if probe is not None and probe >= c.now:
            before = (dict(c.finished), {r: (c.state(r), c.lease_end(r)) for r in c.reqs},
                      c.peer_state(ENGINE), c.outstanding_heartbeats(ENGINE), due)
            assert c.tick(probe) == []
            assert (dict(c.finished), {r: (c.state(r), c.lease_end(r)) for r in c.reqs},
                    c.peer_state(ENGINE), c.outstanding_heartbeats(ENGINE),
                    c.next_deadline()) == before
        if kind == "tick":
            c.tick(max(now, c.now))
    # The heartbeat is due at next_deadline at the latest: a tick there sends it.
    if any(c.state(r) == "waiting" for r in c.reqs) and c.peer_state(ENGINE) == "ready":
        t = max(c.next_deadline(), c.now)
        assert t <= c.now + 1.0
