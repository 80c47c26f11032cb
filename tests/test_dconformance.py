"""D-side conformance.

* The Python ``Consumer`` and the TLA+ D machine (``tla/KVConsumer.tla``) have the same
  state graph on a small model (TLC), and a changed row of ``D_TRANSITIONS`` breaks it.
* The journals of the simulator's D ranks follow D's transition table
  (``kvproto.verify.dconformance``, what ``kvproto validate`` does with a D journal). The
  real NIXL run's D journal is checked in ``tests/test_nixl_procs.py`` (a silent P lost
  after ``peer_timeout``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
from conftest import budget_d_journal

from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    ACK,
    D_ABORT,
    D_FAILED,
    D_TABLE,
    PEER_LOST,
    READ_FAILED,
    READING,
    WAITING,
    Consumer,
    Fx,
)
from kvproto.testing.mutants import D_MUTANTS
from kvproto.testing.sim import Faults, Simulator
from kvproto.verify import dconformance as dc
from kvproto.verify import dtrace
from kvproto.verify import validate as va
from kvproto.verify.dconformance import check_d_journal, is_d_journal
from kvproto.verify.tlc import MissingDependency as TLCMissing

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)


def sim_d_journals(tmp_path: Path, seed: int, duration: float = 40.0) -> list[Path]:
    sim = Simulator(seed, faults=Faults())  # the default faults: loss, crashes, aborts...
    writers: list[JournalWriter] = []
    paths: list[Path] = []
    for name, rank in sim.ranks.items():
        p = tmp_path / f"{seed}-{name}.jsonl"
        w = JournalWriter(p, sim.config, None, {"source": "sim", "seed": seed}, reader=name)
        rank.sink = w.sink
        writers.append(w)
        paths.append(p)
    sim.run(duration)
    for w in writers:
        w.close()
    return paths


def test_simulator_d_journals_follow_the_d_table(tmp_path: Path) -> None:
    finished: dict[str, int] = {}
    events = 0
    for seed in (1, 2):
        for p in sim_d_journals(tmp_path, seed):
            assert is_d_journal(p)
            v = check_d_journal(p)
            assert v.allowed, v.describe()
            events += v.events
            for k, n in v.finished.items():
                finished[k] = finished.get(k, 0) + n
    assert events > 1000
    assert finished.get("done:pulled", 0) > 10  # real traffic, not an idle run
    assert len(finished) >= 3, finished  # several ways of leaving the machine


def test_a_d_journal_whose_effects_were_changed_is_rejected(tmp_path: Path) -> None:
    path = max(sim_d_journals(tmp_path, 3, 20.0), key=lambda p: p.stat().st_size)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if i and any(
        e["type"] == "post_read" for e in r["effects"]))
    for e in rows[i]["effects"]:
        if e["type"] == "post_read":
            e["blocks"] = [b + 1 for b in e["blocks"]]  # D would read the wrong blocks
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = check_d_journal(path)
    assert not v.allowed
    assert any(f"line {i + 1}:" in p for p in v.problems), v.describe()


# ---------------------------------------------------------------------------
# State-graph equality: Consumer vs tla/KVConsumer.tla (TLC)
# ---------------------------------------------------------------------------


_GRAPHS: dict[str, nx.MultiDiGraph] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_graphs() -> Iterator[None]:
    """The graphs (millions of objects) are not kept past this module: every later
    collection of the test process would scan them."""
    yield
    _GRAPHS.clear()


def tlc_graph(name: str) -> nx.MultiDiGraph:
    """TLC's graph of a D model, once per test session."""
    if name not in _GRAPHS:
        try:
            _GRAPHS[name] = dc.explore_tlc_d(dc.D_MODELS[name])
        except TLCMissing as e:  # pragma: no cover - CI has Java
            pytest.skip(str(e))
    return _GRAPHS[name]


@pytest.mark.tlc
def test_consumer_and_the_tla_d_machine_have_the_same_graph() -> None:
    m = dc.D_MODELS["group2"]
    tlc = tlc_graph("group2")
    c = dc.compare_d(dc.explore_python_d(m), tlc)
    assert c.tlc_states > 3000 and tlc.number_of_edges() > 5 * c.tlc_states
    assert c.equal, c.report()
    # heartbeats, acks (granted, refused, unknown) and ack silence are all in the graph
    labels = {k.split("_")[0] for _, _, k in tlc.edges(keys=True)}
    assert {"DAck", "DAckUnknown", "DTick", "PeerLost"} <= labels, labels
    effs = {e["k"] for s in tlc.nodes for e in s["eff"]}
    assert {"heartbeat", "drop_peer", "release"} <= effs, effs
    whys = {e["why"] for s in tlc.nodes for e in s["eff"]}
    assert {"revoked", "peer_lost", "lease_lost", "sibling_local"} <= whys, whys


@pytest.mark.tlc
@pytest.mark.parametrize(("model", "key", "change"), [
    ("group2_noack", (READING, READ_FAILED, "error"),
     {"effects": (Fx("send_release"), Fx("finish", "transfer_error"))}),
    ("group2_noack", (WAITING, PEER_LOST, "lost"),
     {"effects": (Fx("send_release"), Fx("finish", "peer_lost"))}),
    ("group2_noack", (READING, D_ABORT, "in_flight"), {"effects": ()}),
    ("solo", (WAITING, ACK, "refused"), {"effects": (Fx("disown"), Fx("finish", "revoked"))}),
    ("solo", (READING, ACK, "refused"), {"dst": D_FAILED, "effects": (Fx("finish", "revoked"),)}),
], ids=["read_failed_keeps_group", "peer_lost_releases", "abort_in_flight_forgotten",
        "refused_ack_does_not_release", "refused_ack_drops_a_read"])
def test_a_changed_d_row_breaks_graph_equality(model: str, key: tuple[str, str, str],
                                               change: dict[str, Any]) -> None:
    tlc = tlc_graph(model)
    m = dc.D_MODELS[model]
    assert dc.compare_d(dc.explore_python_d(m), tlc).equal  # the unchanged table agrees (small)
    mutant = Consumer.with_rows(replace(D_TABLE[key], **change))
    c = dc.compare_d(dc.explore_python_d(m, mutant), tlc)
    assert not c.equal
    assert c.only_py, "the changed row must show as a Python-only edge"
    assert "GRAPHS DIFFER" in c.report()


# ---------------------------------------------------------------------------
# TLC trace validation of D journals (tla/conformance/TraceConsumer.tla)
# ---------------------------------------------------------------------------


def _validate(paths: list[Path], segment_steps: int = va.DEFAULT_SEGMENT_STEPS
              ) -> list[va.Verdict]:
    try:
        return va.validate(paths, segment_steps=segment_steps)
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))


@pytest.mark.tlc
@pytest.mark.parametrize("segment_steps", [va.DEFAULT_SEGMENT_STEPS, 37])
def test_simulator_d_journals_validate_under_tlc(tmp_path: Path, segment_steps: int) -> None:
    paths = sim_d_journals(tmp_path, 1) + sim_d_journals(tmp_path, 2, 20.0)
    kinds: dict[str, int] = {}
    for p in paths:
        for line in p.read_text().splitlines()[1:]:
            row = json.loads(line)
            for k in [row["event"]["type"]] + [e["type"] for e in row["effects"]]:
                kinds[k] = kinds.get(k, 0) + 1
    # acks, heartbeats and refusals are really in these journals
    assert kinds.get("ack", 0) > 20 and kinds.get("send_heartbeat", 0) > 20, kinds
    verdicts = _validate(paths, segment_steps)
    assert all(v.allowed for v in verdicts), [v.describe() for v in verdicts if not v.allowed]
    assert sum(v.steps for v in verdicts) > 1000  # D ticks only when something is due


def _tampered(rows: list[dict[str, Any]]) -> dict[str, tuple[list[dict[str, Any]], int]]:
    """Journals the spec does not allow, each with the 1-based line TLC must name."""
    def first(pred: Any) -> int:
        return next(i for i, r in enumerate(rows) if i and pred(r))

    def copy() -> list[dict[str, Any]]:
        return json.loads(json.dumps(rows))

    out: dict[str, tuple[list[dict[str, Any]], int]] = {}
    i = first(lambda r: r["event"]["type"] == "read_ok")
    bad = copy()
    bad.insert(i + 1, copy()[i])  # the same READ lands again, after the request finished
    out["read_ok_after_finish"] = (bad, i + 2)
    i = first(lambda r: r["event"]["type"] == "ack" and any(
        e["type"] == "send_release" for e in r["effects"]))
    bad = copy()
    bad[i]["effects"] = [e for e in bad[i]["effects"] if e["type"] != "send_release"]
    out["refused_ack_without_release"] = (bad, i + 1)
    i = first(lambda r: r["event"]["type"] == "ack" and not r["effects"]
              and not r["event"]["refused"] and r["event"]["seq"] > 1)
    seq = rows[i]["event"]["seq"]
    k = first(lambda r: any(e["type"] == "send_heartbeat" and e["seq"] == seq
                            for e in r["effects"]))
    h = next(e for e in rows[k]["effects"] if e["type"] == "send_heartbeat")["handles"][0]
    rid = next(r["event"]["request_id"] for r in rows[1:] if r["event"]["type"] == "admit"
               and r["event"]["params"]["handle"] == h)
    bad = copy()
    bad[i]["effects"] = [{"type": "send_release", "request_id": rid, "engine": "P0",
                          "handle": h, "expected": 1},
                         {"type": "finished", "request_id": rid, "state": "failed",
                          "reason": "revoked"}]
    out["granted_ack_revokes"] = (bad, i + 1)
    i = first(lambda r: any(e["type"] == "send_heartbeat" for e in r["effects"]))
    bad = copy()
    bad[i]["effects"] = [e for e in bad[i]["effects"] if e["type"] != "send_heartbeat"]
    out["heartbeat_left_out"] = (bad, i + 1)
    i = first(lambda r: any(e["type"] == "finished" and e["reason"] == "pulled"
                            for e in r["effects"]))
    bad = copy()
    for e in bad[i]["effects"]:
        if e["type"] == "finished":
            e["state"] = "failed"  # pulled, but reported failed
    out["finished_state_changed"] = (bad, i + 1)
    return out


@pytest.mark.tlc
@pytest.mark.parametrize("segment_steps", [va.DEFAULT_SEGMENT_STEPS, 25])
def test_tampered_d_journals_are_rejected_by_tlc_at_their_line(tmp_path: Path,
                                                               segment_steps: int) -> None:
    src = max(sim_d_journals(tmp_path, 1), key=lambda p: p.read_text().count('"revoked"'))
    rows = [json.loads(x) for x in src.read_text().splitlines()]
    cases = _tampered(rows)
    paths = []
    for name, (bad, _) in cases.items():
        p = tmp_path / f"bad-{name}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in bad))
        paths.append(p)
    for (name, (_, line)), v in zip(cases.items(), _validate(paths, segment_steps),
                                    strict=True):
        assert not v.allowed, (name, v.describe())
        assert v.line == line, (name, v.describe())


@pytest.mark.tlc
def test_a_d_segment_must_end_in_the_replayed_state(tmp_path: Path) -> None:
    """The chaining check: a segment whose replayed end state (EndC) is not where the
    spec's steps lead is rejected at its last step."""
    path = sim_d_journals(tmp_path, 1, 10.0)[0]
    traces = dtrace.d_journal_to_traces(path, 50)
    tr = next(t for t in traces if 'peer |-> "ready"' in t.constants["EndC"])
    tr.constants["EndC"] = tr.constants["EndC"].replace('peer |-> "ready"', 'peer |-> "unknown"')
    try:
        verdicts = va.check_batch([tr])
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert not verdicts[0].allowed
    assert verdicts[0].line == tr.lines[-1]
    assert "differs from the implementation's" in verdicts[0].why


@pytest.mark.tlc
@pytest.mark.parametrize("segment_steps", [va.DEFAULT_SEGMENT_STEPS, 4])
def test_partial_ticks_validate_and_an_unbounded_or_early_loss_does_not(
        tmp_path: Path, segment_steps: int) -> None:
    """A journal whose ticks ran out of their work budget (lost leases failed over several
    ticks, one renewed and one scheduled while late) is a behaviour of the spec
    (DTickLagOp). The unbounded-tick mutant's journal is rejected at its first tick that
    fails more leases than max_tick_work, and a lease loss moved to a tick at which the
    lease still covered a READ is rejected at that tick."""
    good = budget_d_journal(tmp_path / "budget.jsonl")
    mutant = budget_d_journal(tmp_path / "mutant.jsonl", D_MUTANTS["unbounded_tick"].consumer_cls)
    rows = [json.loads(x) for x in good.read_text().splitlines()]
    lost = next(i for i, r in enumerate(rows) if i and any(
        e["type"] == "finished" and e["request_id"] == "r1" for e in r["effects"]))
    early = max(i for i in range(1, lost) if rows[i]["event"]["type"] == "tick")
    moved = [e for e in rows[lost]["effects"] if e.get("request_id") == "r1"]
    rows[lost]["effects"] = [e for e in rows[lost]["effects"] if e not in moved]
    rows[early]["effects"] = moved + rows[early]["effects"]
    tampered = tmp_path / "early.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g, m, t = _validate([good, mutant, tampered], segment_steps)
    assert g.allowed, g.describe()
    assert not m.allowed and m.line == 15, m.describe()
    assert "more leases than its work budget" in m.why
    assert not t.allowed and t.line == early + 1, t.describe()
    assert "an effect the spec does not have" in t.why


def test_a_d_journal_with_two_p_engines_is_outside_the_spec(tmp_path: Path) -> None:
    path = sim_d_journals(tmp_path, 1, 10.0)[0]
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "admit")
    rows[i]["event"]["params"]["engine"] = "P9"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(va.TraceError, match="2 P engines"):
        dtrace.d_journal_to_traces(path)
