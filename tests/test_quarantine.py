"""D's bounded reads (quarantine of an overdue READ's local blocks) and no second pull:
the spec's invariants catch their mutants (TLC), a changed read_overdue row breaks graph
equality, and a D journal with both validates (replay and TLC). Machine scenarios:
tests/testdata/consumer/quarantine.txt."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    D_TABLE,
    READING,
    Config,
    ConfigError,
    Consumer,
    Finished,
    TransferParams,
)
from kvproto.lifecycle.table import D_TICK
from kvproto.testing.mutants import D_MUTANTS
from kvproto.verify import dconformance as dc
from kvproto.verify import validate as va
from kvproto.verify.dconformance import check_d_journal
from kvproto.verify.tlc import MissingDependency as TLCMissing

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

OVERDUE = (READING, D_TICK, "read_overdue")


@pytest.mark.tlc
@pytest.mark.parametrize("bug", sorted(dc.D_BUGS))
def test_tlc_catches_each_d_bug_with_its_invariant(bug: str) -> None:
    m = dc.D_MODELS["solo"]
    try:
        res = dc.check_d_bug(m, bug)
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert res.result == "violation", res.output[-2000:]
    assert res.violated == dc.D_BUGS[bug], (res.violated, res.output[-2000:])


@pytest.mark.tlc
def test_the_spec_without_a_bug_holds_both_invariants() -> None:
    try:
        res = dc.check_d_bug(dc.D_MODELS["solo"], "none")
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert res.ok, res.output[-2000:]


@pytest.mark.tlc
def test_a_read_overdue_row_without_quarantine_breaks_graph_equality() -> None:
    m = dc.D_MODELS["solo"]
    try:
        tlc = dc.explore_tlc_d(m)
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert dc.compare_d(dc.explore_python_d(m), tlc).equal
    row = D_TABLE[OVERDUE]
    mutant = Consumer.with_rows(replace(row, effects=tuple(f for f in row.effects
                                                           if f.kind != "quarantine")))
    c = dc.compare_d(dc.explore_python_d(m, mutant), tlc)
    assert not c.equal and c.only_py


def _journal(path: Path, consumer_cls: type[Consumer] = Consumer) -> Path:
    """An overdue READ of a group's owner (quarantined, the group given up), its sibling
    reading itself, the stuck transfer ending, and a second load of the owner's handle.
    ``consumer_cls`` may be a mutant (``D_MUTANTS``)."""
    cfg = Config()
    w = JournalWriter(str(path), cfg, reader="D0")
    c = consumer_cls("D0", cfg, sink=w.sink)
    p1 = TransferParams("P0", 7, 1, (0, 1), 30_000, 1, "g", (0, 0))
    p2 = TransferParams("P0", 7, 2, (2,), 30_000, 1, "g", (0,))
    c.handshake_result("P0", True, 0)
    c.admit("r1", p1, 0)
    c.admit("r2", p2, 0)
    c.schedule("r1", 1000)
    for t in range(2000, 14_000, 1000):
        c.tick(t)
    c.schedule("r2", 14_001)  # the group was given up: r2 reads itself
    c.read_result("r1", False, 15_000)  # the stuck transfer ends: quarantine lifted
    c.read_result("r2", True, 15_001, notif_attached=False)
    c.admit("r1-retry", p1, 16_000)  # no second pull
    c.schedule("r1-retry", 16_001)
    p3 = TransferParams("P0", 7, 3, (3,), 30_000, 1, None, (0,))
    c.admit("r3", p3, 16_002)
    c.schedule("r3", 16_003)
    c.read_result("r3", True, 16_004, notif_attached=False)
    c.admit("r3-retry", p3, 16_005)  # no second pull of a pulled one either
    c.schedule("r3-retry", 16_006)
    c.tick(17_000)
    w.close()
    return path


def test_the_machine_quarantines_and_refuses_a_second_pull(tmp_path: Path) -> None:
    cfg = Config()
    c = Consumer("D0", cfg)
    p1 = TransferParams("P0", 7, 1, (0, 1), 30_000, 1, None, (0, 0))
    c.handshake_result("P0", True, 0)
    c.admit("r1", p1, 0)
    c.schedule("r1", 1000)
    assert c.read_deadline("r1") == 1000 + cfg.ms.max_read_time + cfg.ms.read_grace
    assert c.next_deadline() <= 11_001
    assert c.tick(11_000) == [] or c.state("r1") == "reading"
    out = c.tick(11_001)
    assert c.quarantined("r1") and c.stuck_reads == 1
    assert not [e for e in out if type(e).__name__ == "SendRelease"], out
    assert [(f.state, f.reason) for f in out if isinstance(f, Finished)] == \
        [("failed", "read_timeout")]
    c.read_result("r1", True, 12_000)
    assert c.stuck_reads == 0 and c.counters["quarantine_ended"] == 1
    out = c.admit("r1-retry", p1, 13_000)
    assert [(f.state, f.reason) for f in out if isinstance(f, Finished)] == \
        [("failed", "second_pull")]
    assert c.counters["second_pull"] == 1 and c.state("r1-retry") == "new"


@pytest.mark.parametrize("name", ["early_release", "second_pull"])
def test_d_journal_replay_catches_the_mutant(tmp_path: Path, name: str) -> None:
    m = D_MUTANTS[name]
    bad = check_d_journal(_journal(tmp_path / f"{name}.jsonl", m.consumer_cls))
    assert not bad.allowed
    caught = [p for p in bad.problems if p.startswith("VIOLATION")]
    assert caught and all(any(c in p for c in m.caught_by) for p in caught), bad.problems


@pytest.mark.tlc
def test_tlc_trace_validation_rejects_the_early_release_journal(tmp_path: Path) -> None:
    path = _journal(tmp_path / "early.jsonl", D_MUTANTS["early_release"].consumer_cls)
    try:
        verdicts = va.validate([path])
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert verdicts and not all(v.allowed for v in verdicts)


def test_a_d_journal_with_a_quarantine_and_a_second_pull_replays(tmp_path: Path) -> None:
    v = check_d_journal(_journal(tmp_path / "q.jsonl"))
    assert v.allowed, v.describe()
    assert v.finished.get("failed:read_timeout") == 1, v.finished
    assert v.finished.get("failed:second_pull") == 2, v.finished


@pytest.mark.tlc
def test_a_d_journal_with_a_quarantine_and_a_second_pull_validates_under_tlc(
        tmp_path: Path) -> None:
    path = _journal(tmp_path / "q.jsonl")
    try:
        verdicts = va.validate([path])
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert verdicts and all(v.allowed for v in verdicts), [v.describe() for v in verdicts]


def test_read_grace_is_validated() -> None:
    with pytest.raises(ConfigError, match="read_grace"):
        Config(read_grace=-1.0).validate()
    with pytest.raises(ConfigError, match="read_grace"):
        Config(read_grace=0.0005).validate()
    assert Config(read_grace=0.0).validate().ms.read_grace == 0


def test_the_ended_memory_is_capped(tmp_path: Path) -> None:
    c = Consumer("D0", Config(), max_ended=2)
    c.handshake_result("P0", True, 0)
    for h in (1, 2, 3):
        p = TransferParams("P0", 7, h, (h,), 30_000, 1, None, (0,))
        c.admit(f"r{h}", p, 0)
        c.abort(f"r{h}", 0)
    assert c.counters.get("ended_memory_evicted") == 1
    # the oldest (handle 1) was forgotten: admitted again (P refuses or the stamps fence)
    out = c.admit("again1", TransferParams("P0", 7, 1, (1,), 30_000, 1, None, (0,)), 1)
    assert c.state("again1") == "waiting", out
    out = c.admit("again3", TransferParams("P0", 7, 3, (3,), 30_000, 1, None, (0,)), 1)
    assert [f.reason for f in out if isinstance(f, Finished)] == ["second_pull"]


def test_the_d_invariants_are_named_alike_in_the_three_mirrors() -> None:
    """NoQuarantinedReuse and NoSecondPull: defined in KVConsumer.tla, checked by the D
    graph models' cfg, listed in PROTOCOL.md §9 and TLA.md §3; the row, its effect and
    the finish reasons are the Python table's."""
    import re

    root = Path(__file__).resolve().parents[1]
    tla = (root / "tla" / "KVConsumer.tla").read_text(encoding="utf-8")
    cfg = dc.D_MODELS["solo"].tla_cfg()
    for name in dc.D_BUGS.values():
        assert re.search(rf"^{name} ==", tla, re.M), name
        assert name in cfg, name
        for doc in ("PROTOCOL.md", "TLA.md"):
            text = (root / "spec" / doc).read_text(encoding="utf-8")
            assert re.search(rf"^\| `{name}` \|", text, re.M), (doc, name)
    row = D_TABLE[OVERDUE]
    assert {f.kind for f in row.effects} == {"disown", "quarantine", "finish"}
    for word in ('"read_timeout"', '"quarantine"', '"second_pull"', '"unquarantine"'):
        assert word in tla, word
