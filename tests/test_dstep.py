"""D's compiled steps (lifecycle/dstep.py) against the interpreted table path: on random
event sequences, a Consumer running compiled steps and one running ``table_step`` per row
reach the same state, return the same effects and write the same journal."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto import journal
from kvproto.lifecycle import D_TABLE, Config
from kvproto.lifecycle.consumer import (
    Admit,
    ClaimGranted,
    ClaimRefused,
    Consumer,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    DReject,
    DTick,
    HandshakeFailed,
    HandshakeOk,
    NeverRegistered,
    PeerLost,
    ReadFailed,
    ReadOk,
    Schedule,
    TransferParams,
)
from kvproto.lifecycle.dstep import compile_row, step_functions
from kvproto.lifecycle.table import MissingRow
from kvproto.testing.mutants import ReadBeforeGrantConsumer

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

ENGINES = ("P0", "P1")
RIDS = tuple(f"r{i}" for i in range(4))
CFG = Config()


class TableConsumer(Consumer):
    """The reference: every row run by ``table_step`` (reads the row's effect flags)."""

    COMPILED: ClassVar[bool] = False


def _params(draw: Any, i: int) -> TransferParams:
    engine = draw(st.sampled_from(ENGINES[:1] * 3 + ENGINES))
    handle = draw(st.integers(0, 7))
    group = draw(st.sampled_from((None, None, "g0", "g1")))
    cap = draw(st.sampled_from(("", "ab" * 16)))
    term = draw(st.sampled_from((30_000, 500, 12_000)))
    return TransferParams(engine, 1, handle, (i, i + 1), term, draw(st.integers(1, 2)),
                          group, (), cap)


@st.composite
def events(draw: Any) -> list[DEvent]:
    out: list[DEvent] = []
    now = 0
    for i in range(draw(st.integers(1, 60))):
        now += draw(st.sampled_from((0, 0, 1, 5, 700, 4000, -3)))
        rid = draw(st.sampled_from(RIDS))
        engine = draw(st.sampled_from(ENGINES[:1] * 3 + ENGINES))
        kind = draw(st.integers(0, 16))
        ev: DEvent
        if kind <= 2:
            ev = Admit(rid, _params(draw, i), now)
        elif kind <= 4:
            ev = HandshakeOk(engine, now) if draw(st.integers(0, 4)) \
                else HandshakeFailed(engine, "handshake", now)
        elif kind == 5:
            ev = ClaimGranted(rid, now) if draw(st.integers(0, 3)) else ClaimRefused(rid, now)
        elif kind <= 8:
            ev = Schedule(rid, now)
        elif kind <= 10:
            ev = ReadOk(rid, now, draw(st.booleans())) if draw(st.integers(0, 3)) \
                else ReadFailed(rid, now, draw(st.booleans()))
        elif kind == 11:
            ev = DAbort(rid, now)
        elif kind == 12:
            ev = DAck(engine, draw(st.integers(1, 4)), 30_000,
                      tuple(draw(st.lists(st.integers(0, 7), max_size=2))), now,
                      tuple(draw(st.lists(st.integers(0, 7), max_size=1))))
        elif kind == 13:
            ev = DTick(now)
        elif kind == 14:
            ev = PeerLost(engine, now)
        elif kind == 15:
            ev = NeverRegistered(rid, now)
        else:
            ev = DReject("bad_message", engine, "x", now)
        out.append(ev)
    return out


def _state(c: Consumer) -> dict[str, Any]:
    """Everything observable of a consumer through its public views."""
    return {
        "reqs": {rid: c.request(rid) for rid in RIDS},
        "peers": {e: None if (p := c.peer(e)) is None else
                  (p.state, p.seq, p.last_heard, dict(p.outstanding)) for e in ENGINES},
        "groups": {(e, g): c.group_owner(e, g) for e in ENGINES for g in ("g0", "g1")},
        "handles": {(e, h): c.request_id(e, h) for e in ENGINES for h in range(8)},
        "deadlines": {rid: c.read_deadline(rid) for rid in RIDS},
        "quarantined": {rid: c.quarantined(rid) for rid in RIDS},
        "counters": dict(c.counters), "finished": dict(c.finished), "now": c.now,
        "heap": c.heap_entries, "next": c.next_deadline(), "stuck": c.stuck_reads,
    }


def _pair() -> tuple[Consumer, Consumer, list[Any], list[Any]]:
    ja: list[Any] = []
    jb: list[Any] = []

    def sink(j: list[Any]) -> Any:
        def put(ev: DEvent, fx: list[DEffect]) -> None:
            j.append((journal.to_json(ev), [journal.to_json(f) for f in fx]))
        return put

    a = Consumer("d0", CFG, sink=sink(ja), max_landed_groups=2, max_ended=3)
    b = TableConsumer("d0", CFG, sink=sink(jb), max_landed_groups=2, max_ended=3)
    return a, b, ja, jb


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events())
def test_compiled_steps_equal_table_steps(evs: list[DEvent]) -> None:
    a, b, ja, jb = _pair()
    for ev in evs:
        fa = a.apply(ev)
        fb = b.apply(ev)
        assert fa == fb, ev
        assert _state(a) == _state(b), ev
        for f in fa:
            REACHED.add(type(f).__name__ + ":" + getattr(f, "reason", ""))
    assert ja == jb
    assert len(ja) == len(evs)


# Effects (Finished by reason) the random sequences reached, checked below: the
# comparison is only as good as the rows the sequences run.
REACHED: set[str] = set()


def test_sequences_reach_the_rows() -> None:
    if not REACHED:
        pytest.skip("run with test_compiled_steps_equal_table_steps")
    for name in ("PostRead:", "SendClaim:", "SendDone:", "SendRelease:", "StartHandshake:",
                 "Finished:pulled", "Finished:fenced", "Finished:aborted",
                 "Finished:lease_lost", "Finished:claim_refused"):
        assert name in REACHED, (name, sorted(REACHED))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events())
def test_no_sink_same_effects(evs: list[DEvent]) -> None:
    """Without a sink (the hot events' early return) the effects are those with one."""
    a = Consumer("d0", CFG, max_landed_groups=2, max_ended=3)
    b = _pair()[1]  # the table path, with a sink
    for ev in evs:
        assert a.apply(ev) == b.apply(ev), ev
    assert _state(a) == _state(b)


def test_every_row_compiles_and_interprets() -> None:
    compiled = step_functions(D_TABLE)
    table = step_functions(D_TABLE, compiled=False)
    assert set(compiled) == set(table) == set(D_TABLE)
    for key, row in D_TABLE.items():
        assert compiled[key] is not table[key]
        assert compile_row(row).__code__.co_filename.startswith("<D row ")


def test_missing_row_raises() -> None:
    steps = step_functions(D_TABLE)
    with pytest.raises(MissingRow):
        steps[("reading", "admit", "nope")]
    with pytest.raises(MissingRow):
        steps.by_guard("waiting", "schedule")["nope"]


def test_changed_rows_are_compiled_from_the_changed_table() -> None:
    """A mutant's rows (``with_rows``) run in its compiled steps: the ReadBeforeGrant
    mutant reads without a claim under both paths alike."""
    mutant = ReadBeforeGrantConsumer
    c = mutant("d0", CFG)
    ref = type("Ref", (mutant,), {"COMPILED": False})("d0", CFG)
    p = TransferParams("P0", 1, 1, (0,), 30_000, capability="ab" * 16)
    for m in (c, ref):
        m.handshake_result("P0", True, 0)
        assert m.admit("r", p, 1) == []  # no SendClaim: the changed row
        assert m.state("r") == "waiting"
    assert c.schedule("r", 2) == ref.schedule("r", 2)
    assert Consumer("d0", CFG).admit("r", p, 1) != []  # the unchanged table claims
