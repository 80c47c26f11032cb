"""D reads only after P's gate granted its claim, and a never-registered notice fails a
request with its own reason. Machine rows, the read_before_grant mutant caught by the
journal replay (ReadOnlyGranted), by hypothesis, by graph equality and by TLC (KVConsumer's
DBug and KVGate's bug model), and a D journal with claims that validates under TLC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    Config,
    Consumer,
    Finished,
    PostRead,
    SendClaim,
    SendHeartbeat,
    SendRelease,
    TransferParams,
)
from kvproto.testing.mutants import D_MUTANTS
from kvproto.verify import dconformance as dc
from kvproto.verify import validate as va
from kvproto.verify.dconformance import check_d_journal
from kvproto.verify.tlc import MissingDependency as TLCMissing

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

CAP = "ab" * 16
MUTANT = D_MUTANTS["read_before_grant"]


def _params(handle: int, cap: str = CAP, term: int = 30_000) -> TransferParams:
    return TransferParams("P0", 7, handle, (handle,), term, 1, None, (0,), capability=cap)


def _finished(out: list[Any]) -> list[tuple[str, str, str]]:
    return [(f.request_id, f.state, f.reason) for f in out if isinstance(f, Finished)]


def test_a_request_with_a_capability_reads_only_after_the_grant() -> None:
    c = Consumer("D0", Config())
    c.handshake_result("P0", True, 0)
    out = c.admit("r1", _params(1), 0)
    assert out == [SendClaim("r1", "P0", 1, CAP)] and c.state("r1") == "claiming"
    assert c.schedule("r1", 1) == [] and c.state("r1") == "claiming"  # no READ yet
    assert c.counters["schedule_not_waiting"] == 1
    out = c.tick(1000)
    hb = [e for e in out if isinstance(e, SendHeartbeat)]
    assert not hb  # a claiming request is not heartbeated: its initial lease bounds it
    # claimed 1 s ago: not yet repeated (a repeat waits a heartbeat_interval after admit)
    assert not any(isinstance(e, SendClaim) for e in out)
    assert c.claim_result("r1", True, 1001) == [] and c.state("r1") == "waiting"
    out = c.schedule("r1", 1002)
    assert [type(e) for e in out] == [PostRead] and c.state("r1") == "reading"
    # a second answer changes nothing (counted)
    assert c.claim_result("r1", True, 1003) == []
    assert c.counters["claim_answer_unexpected"] == 1


def test_an_unanswered_claim_is_presented_again_at_each_heartbeat() -> None:
    """A lost claim (or grant) costs about one heartbeat interval, not the transfer: each
    heartbeat round re-presents the claim of each request still claiming that was
    admitted at least heartbeat_interval ago (never the round right after a fresh
    claim); once granted, no more claims, heartbeats instead. A consumer without the
    retry loses the request once its initial lease can no longer cover a READ."""
    cfg = Config()
    hb = cfg.ms.heartbeat_interval

    def run(c: Consumer) -> tuple[int, list[Any]]:
        c.handshake_result("P0", True, 0)
        c.tick(0)  # the first heartbeat round is due at once: nothing to name yet
        assert c.admit("r1", _params(1), 1) == [SendClaim("r1", "P0", 1, CAP)]
        claims = 0
        t = 1
        out: list[Any] = []
        # the first claim and its first repeat are lost; the second repeat is answered
        while c.state("r1") == "claiming" and t < 40_000:
            t = min(t + hb, max(t + 1, c.next_deadline()))
            out = c.tick(t)
            sent = [e for e in out if isinstance(e, SendClaim)]
            assert sent in ([], [SendClaim("r1", "P0", 1, CAP)]), out
            assert not sent or t - 1 >= hb, (t, sent)  # never within an interval of admit
            claims += len(sent)
            if claims == 2 and sent:
                c.claim_result("r1", True, t + 1)
        return t, out

    c = Consumer("D0", cfg)
    t, _ = run(c)
    assert c.state("r1") == "waiting" and c.counters["claims_retried"] == 2
    out = c.tick(t + hb)
    assert not any(isinstance(e, SendClaim) for e in out)  # granted: no more claims
    assert any(isinstance(e, SendHeartbeat) and e.handles == (1,) for e in out)
    assert [type(e) for e in c.schedule("r1", t + hb + 1)] == [PostRead]

    class NoRetry(Consumer):
        def tick(self, now: int) -> list[Any]:
            return [e for e in super().tick(now) if not isinstance(e, SendClaim)]

    c = NoRetry("D0", cfg)
    _, out = run(c)
    assert _finished(out) == [("r1", "failed", "lease_lost")]


def test_params_without_a_capability_do_not_claim() -> None:
    c = Consumer("D0", Config())
    c.handshake_result("P0", True, 0)
    assert c.admit("r1", _params(1, cap=""), 0) == [] and c.state("r1") == "waiting"
    # the same for a request admitted before the handshake
    c2 = Consumer("D0", Config())
    c2.admit("r1", _params(1, cap=""), 0)
    c2.admit("r2", _params(2), 0)
    out = c2.handshake_result("P0", True, 5)
    assert out == [SendClaim("r2", "P0", 2, CAP)]
    assert (c2.state("r1"), c2.state("r2")) == ("waiting", "claiming")


def test_a_refused_claim_fails_without_a_release() -> None:
    c = Consumer("D0", Config())
    c.handshake_result("P0", True, 0)
    c.admit("r1", _params(1), 0)
    out = c.claim_result("r1", False, 5)
    assert _finished(out) == [("r1", "failed", "claim_refused")]
    assert not any(isinstance(e, SendRelease) for e in out)
    assert c.finished == {"failed:claim_refused": 1} and c.counters["claim_refused"] == 1


def test_a_grant_that_never_comes_is_bounded_by_the_lease() -> None:
    cfg = Config()
    c = Consumer("D0", cfg)
    c.handshake_result("P0", True, 0)
    c.admit("r1", _params(1, term=10_000), 0)
    lost = 10_000 - cfg.ms.max_delay - cfg.ms.max_read_time - cfg.ms.clock_drift
    t = 0
    out: list[Any] = []
    while c.state("r1") == "claiming" and t < 20_000:
        t = max(t + 500, c.next_deadline())
        out = c.tick(t)
    assert _finished(out) == [("r1", "failed", "lease_lost")]
    assert t >= lost  # never early
    assert any(isinstance(e, SendRelease) for e in out)


@pytest.mark.parametrize("state", ["waiting", "claiming", "handshaking"])
def test_never_fails_an_idle_request_with_its_own_reason(state: str) -> None:
    c = Consumer("D0", Config())
    if state != "handshaking":
        c.handshake_result("P0", True, 0)
    c.admit("r1", _params(1, cap=CAP if state == "claiming" else ""), 0)
    assert c.state("r1") == state
    out = c.never("r1", 5)
    assert _finished(out) == [("r1", "failed", "never_registered")]
    assert not any(isinstance(e, SendRelease) for e in out)
    assert c.finished == {"failed:never_registered": 1}


def test_never_lets_a_read_in_flight_report_its_own_end() -> None:
    c = Consumer("D0", Config())
    c.handshake_result("P0", True, 0)
    c.admit("r1", _params(1, cap=""), 0)
    c.schedule("r1", 1)
    assert c.never("r1", 2) == [] and c.state("r1") == "reading"
    assert c.never("nobody", 3) == [] and c.counters["never_unknown"] == 1


# ---------------------------------------------------------------------------
# The mutant: caught by the journal replay, hypothesis, graph equality and TLC.
# ---------------------------------------------------------------------------

OPS = ("admit", "admit_plain", "handshake", "schedule", "grant", "refuse", "never", "tick",
       "read_ok")


def _run(ops: list[tuple[str, int]], cls: type[Consumer], path: Path) -> list[str]:
    """Run ``ops`` on a journaled ``cls`` and replay the journal: its violations."""
    cfg = Config()
    w = JournalWriter(str(path), cfg, reader="D0")
    c = cls("D0", cfg, sink=w.sink)
    now = 0
    for op, i in ops:
        now += 100
        rid = f"r{i}"
        if op == "admit":
            c.admit(rid, _params(i), now)
        elif op == "admit_plain":
            c.admit(rid, _params(i, cap=""), now)
        elif op == "handshake":
            c.handshake_result("P0", True, now)
        elif op == "schedule":
            c.schedule(rid, now)
        elif op == "grant":
            c.claim_result(rid, True, now)
        elif op == "refuse":
            c.claim_result(rid, False, now)
        elif op == "never":
            c.never(rid, now)
        elif op == "read_ok":
            c.read_result(rid, True, now)
        else:
            now += 2000
            c.tick(now)
    w.close()
    return [p for p in check_d_journal(path).problems if p.startswith("VIOLATION")]


_OPS = st.lists(st.tuples(st.sampled_from(OPS), st.integers(1, 3)), max_size=20)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=_OPS)
def test_the_real_consumer_never_reads_before_a_grant(tmp_path_factory: Any,
                                                      ops: list[tuple[str, int]]) -> None:
    path = tmp_path_factory.mktemp("claim") / "d.jsonl"
    assert _run(ops, Consumer, path) == []


def test_hypothesis_catches_the_read_before_grant_mutant(tmp_path: Path) -> None:
    found: list[str] = []

    @settings(max_examples=500, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ops=_OPS)
    def prop(ops: list[tuple[str, int]]) -> None:
        bad = _run(ops, MUTANT.consumer_cls, tmp_path / "m.jsonl")
        if bad:
            found.extend(bad)
        assert not bad

    with pytest.raises(AssertionError):
        prop()
    assert found and all(any(k in p for k in MUTANT.caught_by) for p in found), found


def _claims_journal(path: Path, cls: type[Consumer] = Consumer) -> Path:
    """A granted claim that reads, a refused one, a never notice while claiming, one
    admitted before the handshake, and a grant that never comes (lease_lost)."""
    cfg = Config()
    w = JournalWriter(str(path), cfg, reader="D0")
    c = cls("D0", cfg, sink=w.sink)
    c.admit("r0", _params(9), 0)  # before the handshake: claims at handshake_ok
    c.handshake_result("P0", True, 10)
    c.admit("r1", _params(1), 20)
    c.admit("r2", _params(2), 30)
    c.admit("r3", _params(3), 40)
    c.admit("r4", _params(4, term=9000), 50)
    c.claim_result("r0", True, 60)
    c.claim_result("r1", True, 70)
    c.schedule("r1", 80)
    c.claim_result("r2", False, 90)
    c.never("r3", 100)
    c.read_result("r1", True, 500, notif_attached=False)
    for t in range(1000, 9000, 1000):
        c.tick(t)
    c.schedule("r0", 9001)
    c.read_result("r0", True, 9002, notif_attached=False)
    w.close()
    return path


def test_a_journal_with_claims_replays_and_the_mutants_does_not(tmp_path: Path) -> None:
    ok = check_d_journal(_claims_journal(tmp_path / "ok.jsonl"))
    assert ok.allowed, ok.problems
    assert ok.finished == {"done:pulled": 2, "failed:claim_refused": 1,
                           "failed:never_registered": 1, "failed:lease_lost": 1}, ok.finished
    bad = check_d_journal(_claims_journal(tmp_path / "bad.jsonl", MUTANT.consumer_cls))
    assert not bad.allowed
    assert any("ReadOnlyGranted" in p for p in bad.problems), bad.problems


@pytest.mark.tlc
def test_a_journal_with_claims_validates_under_tlc_and_the_mutants_does_not(
        tmp_path: Path) -> None:
    try:
        good = va.validate([_claims_journal(tmp_path / "ok.jsonl")])
        bad = va.validate([_claims_journal(tmp_path / "bad.jsonl", MUTANT.consumer_cls)])
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert good and all(v.allowed for v in good), [v.describe() for v in good]
    assert bad and not all(v.allowed for v in bad)


@pytest.mark.tlc
def test_tlc_catches_read_before_grant_and_graph_equality_breaks() -> None:
    m = dc.D_MODELS["solo"]
    try:
        res = dc.check_d_bug(m, "read_before_grant")
        tlc = dc.explore_tlc_d(m)
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert res.result == "violation" and res.violated == "ReadOnlyGranted", res.output[-2000:]
    assert dc.compare_d(dc.explore_python_d(m), tlc).equal
    c = dc.compare_d(dc.explore_python_d(m, MUTANT.consumer_cls), tlc)
    assert not c.equal and c.only_py
    # the model reaches every claim row: granted, refused, never while claiming
    whys = {e["why"] for s in tlc.nodes for e in s["eff"]}
    assert {"claim_refused", "never_registered"} <= whys, whys
    assert any(e["k"] == "claim" for s in tlc.nodes for e in s["eff"])


# ---------------------------------------------------------------------------
# The wire round trip through both ports: P's gate answers a claim, D's port feeds it.
# ---------------------------------------------------------------------------


def test_the_gate_answers_claims_and_d_reads_only_after_the_grant() -> None:
    from kvproto.lifecycle import BlockPool, Ledger
    from kvproto.lifecycle.gate import ClaimAnswer, Gate
    from kvproto.port import d_receive, p_receive
    from kvproto.wire import encode_claim, encode_grant

    cfg = Config()
    gate = Gate(Ledger(cfg, BlockPool(8)), b"k" * 32, "P0", 7)
    cap = gate.capability(1)
    d1, d2 = Consumer("D1", cfg), Consumer("D2", cfg)
    for i, d in enumerate((d1, d2)):
        d.handshake_result("P0", True, 0)
        assert d.admit(f"r{i}", _params(1, cap=cap), 0) == [SendClaim(f"r{i}", "P0", 1, cap)]
    # D1 claims before P's worker registered the handle (D can hold the params first):
    # bound, but answered only at the register, so D never reads blocks the ledger does
    # not hold (nor before the readiness mark and the checksums of the register)
    out = p_receive(gate, "D1", encode_claim(7, 1, cap), 1, known=True, epoch=7,
                    max_bytes=1 << 16, consumer="D1")
    assert out == [] and gate.consumer(1) == "D1"
    assert gate.counters["claim_before_register"] == 1
    out2 = p_receive(gate, "D2", encode_claim(7, 1, cap), 2, known=True, epoch=7,
                     max_bytes=1 << 16, consumer="D2")
    assert ClaimAnswer("D2", 1, False) in out2 and gate.counters["foreign_consumer"] == 1
    # the consumer's second D rank (P TP 1 -> D TP 2: both ranks read P's one rank)
    out_b = p_receive(gate, "D1b", encode_claim(7, 1, cap), 2, known=True, epoch=7,
                      max_bytes=1 << 16, consumer="D1")
    assert out_b == [] and gate.counters["claim_before_register"] == 2
    reg = gate.register(1, "r", [0, 1], 2, ready=True, expected=1)
    assert reg == [ClaimAnswer("D1", 1, True), ClaimAnswer("D1b", 1, True)], reg
    assert gate.register(2, "s", [2], 2, ready=True, expected=1) == []  # nothing owed
    # a claim of a registered handle is answered at once
    out3 = p_receive(gate, "D1", encode_claim(7, 2, gate.capability(2)), 2, known=True,
                     epoch=7, max_bytes=1 << 16, consumer="D1")
    assert out3 == [ClaimAnswer("D1", 2, True)], out3
    # D's ports: D1 may read now, D2 fails without reading or releasing
    got = d_receive(d1, "P0", encode_grant(7, 1, True), 3, known=True, epoch=7,
                    max_bytes=1 << 16)
    assert got == [] and d1.state("r0") == "waiting"
    assert [type(e) for e in d1.schedule("r0", 4)] == [PostRead]
    got = d_receive(d2, "P0", encode_grant(7, 1, False), 3, known=True, epoch=7,
                    max_bytes=1 << 16)
    assert _finished(got) == [("r1", "failed", "claim_refused")]
    assert not any(isinstance(e, (SendRelease, PostRead)) for e in got)
    # an answer about a handle D no longer holds is a counted rejection
    d_receive(d2, "P0", encode_grant(7, 1, True), 5, known=True, epoch=7, max_bytes=1 << 16)
    assert d2.counters["rejected:claim_answer_unknown"] == 1
    # a D -> P kind sent to D, or a P -> D kind sent to P, is an unexpected kind
    p_receive(gate, "D1", encode_grant(7, 1, True), 6, known=True, epoch=7,
              max_bytes=1 << 16, consumer="D1")
    assert gate.ledger.counters["rejected:unexpected_kind"] == 1
