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
from kvproto.verify import dconformance as dc
from kvproto.verify import validate as va
from kvproto.verify.dconformance import check_d_journal
from kvproto.verify.tlc import MissingDependency as TLCMissing

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


def _journal(path: Path) -> Path:
    cfg = Config()
    w = JournalWriter(str(path), cfg, reader="D0")
    c = Consumer("D0", cfg, sink=w.sink)
    p1 = TransferParams("P0", 7, 1, (0, 1), 30_000, 1, "g", (0, 0))
    p2 = TransferParams("P0", 7, 2, (2,), 30_000, 1, "g", (0,))
    c.handshake_result("P0", True, 0)
    c.admit("r1", p1, 0)
    c.admit("r2", p2, 0)
    c.schedule("r1", 1000)
    for t in range(2000, 14_000, 1000):
        c.tick(t)
    assert c.quarantined("r1") and c.stuck_reads == 1
    assert c.state("r2") == "waiting"
    c.schedule("r2", 14_001)  # the group was given up: r2 reads itself
    c.read_result("r1", False, 15_000)  # the stuck transfer ends: quarantine lifted
    assert c.stuck_reads == 0
    c.read_result("r2", True, 15_001, notif_attached=False)
    out = c.admit("r1-retry", p1, 16_000)  # no second pull
    assert [(f.state, f.reason) for f in out if isinstance(f, Finished)] == [("failed", "second_pull")]
    c.tick(17_000)
    w.close()
    return path


def test_a_d_journal_with_a_quarantine_and_a_second_pull_replays(tmp_path: Path) -> None:
    v = check_d_journal(_journal(tmp_path / "q.jsonl"))
    assert v.allowed, v.describe()
    assert v.finished.get("failed:read_timeout") == 1, v.finished
    assert v.finished.get("failed:second_pull") == 1, v.finished


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
