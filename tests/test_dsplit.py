"""D journals that span a P restart: traced by TLC per P engine (``kvproto.verify.dsplit``).

A D rank whose P engine restarted (a new engine name and epoch) journals events for
several P engines; KVConsumer models one. ``kvproto validate`` splits such a journal into
one trace per P engine, checks each with TLC, and replays the whole journal through D's
table for what the parts share. The journals here come from the real ``Consumer`` driven
through two P restarts (P "Pa" -> "Pb" -> "Pc", handles reused by every incarnation, the
old engine's READs failing or overdue and quarantined while the new one serves)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    PEER_HANDSHAKING,
    PEER_READY,
    READING,
    WAITING,
    Config,
    Consumer,
    SendHeartbeat,
    TransferParams,
)
from kvproto.testing.mutants import D_MUTANTS
from kvproto.verify import dsplit
from kvproto.verify import validate as va
from kvproto.verify.dconformance import check_d_journal
from kvproto.verify.dtrace import d_journal_engine_traces
from kvproto.verify.tlc import MissingDependency as TLCMissing
from kvproto.verify.trace import DEFAULT_SEGMENT_STEPS, Verdict, check_batch

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

ENGINES = (("Pa", 7), ("Pb", 8), ("Pc", 9))


def restart_journal(path: Path, seed: int, *, restarts: tuple[int, ...] = (20_000, 45_000),
                    end: int = 80_000, consumer_cls: type[Consumer] = Consumer) -> Path:
    """One D rank's journal under steady load while its P restarts at ``restarts`` (ms):
    each incarnation a new engine name and epoch, handles from 1 again. After a restart
    the old engine answers nothing: its READs in flight fail, land late, or run past
    their deadline (quarantined until their transfer ends); it is lost by an explicit
    peer loss or by ack silence (drop_peer); meanwhile the new engine is admitted,
    handshaken, heartbeaten and acked in the same ticks."""
    rng = random.Random(seed)
    cfg = Config()
    ms = cfg.ms
    with JournalWriter(path, cfg, None, {"source": "restart", "seed": seed}, reader="d0") as w:
        c = consumer_cls("d0", cfg, sink=w.sink)
        inc = 0  # the live incarnation
        handle = [0] * len(ENGINES)
        rids: list[str] = []
        group_left = 0
        lost: set[str] = set()
        reused = False
        t = 0
        while t < end:
            t += rng.randint(50, 600)
            if inc + 1 < len(ENGINES) and t >= restarts[inc]:
                inc += 1  # P restarted: a new engine name and epoch
            engine, epoch = ENGINES[inc]
            if t < end - 25_000 and rng.random() < 0.45:
                handle[inc] += 1
                h = handle[inc]
                group = None
                if group_left:
                    group, group_left = f"g{inc}-{h - 1}", 0
                elif rng.random() < 0.2:
                    group, group_left = f"g{inc}-{h}", 1
                term = 6_000 if rng.random() < 0.03 else ms.initial_lease
                rid = f"{engine}-r{h}"
                if not reused and inc > 0 and rids and rng.random() < 0.2:
                    old = next((r for r in rids if r.startswith("Pa-")
                                and c.request(r) is None), None)
                    if old is not None:  # a request id the old engine's request had
                        rid, reused = old, True
                rids.append(rid)
                late = rng.randint(1, 80) if rng.random() < 0.05 else 0
                c.admit(rid, TransferParams(engine, epoch, h, (h,), term, 1, group),
                        t - late)
            for e, (name, _) in enumerate(ENGINES[:inc + 1]):
                if c.peer_state(name) == PEER_HANDSHAKING and rng.random() < 0.5:
                    c.handshake_result(name, e == inc or rng.random() < 0.3, t)
            for rid in [r for r in c.reqs]:
                v = c.request(rid)
                if v is None:
                    continue
                alive = v.params.engine == engine
                x = rng.random()
                if v.state == WAITING and x < (0.12 if alive else 0.01):
                    c.schedule(rid, t)
                elif v.state == READING and alive and x < 0.3:
                    if rng.random() < 0.9:
                        c.read_result(rid, True, t, notif_attached=rng.random() < 0.7)
                    else:
                        c.read_result(rid, False, t, fenced=rng.random() < 0.5)
                elif v.state == READING and not alive and x < 0.04:
                    c.read_result(rid, rng.random() < 0.3, t)
                elif x > 0.99:
                    c.abort(rid, t)
            if rng.random() < 0.05:
                for rid in [r for r in rids if c.quarantined(r)]:
                    c.read_result(rid, False, t)  # the transfer of an overdue READ ended
            peer = c.peer(engine)
            if peer is not None and peer.state == PEER_READY:
                for seq, hb in peer.outstanding.items():
                    if t - hb.sent_at > 100 and rng.random() < 0.6:
                        refused = [h for h in hb.handles if rng.random() < 0.05]
                        c.ack(engine, seq, ms.lease_extension, refused, t)
                        break
            for name, _ in ENGINES[:inc]:
                if name not in lost and c.peer_state(name) != "unknown" \
                        and rng.random() < 0.025:
                    lost.add(name)
                    c.peer_lost(name, t)
            if t >= c.next_deadline() or rng.random() < 0.1:
                c.tick(t)
        for t2 in range(end, end + 60_000, 2_500):
            c.tick(t2)
            for rid in [r for r in rids if c.quarantined(r)]:
                c.read_result(rid, False, t2)
    return path


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [dict(json.loads(x)) for x in path.read_text().splitlines()]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _validate(paths: list[Path], segment_steps: int = DEFAULT_SEGMENT_STEPS
              ) -> list[Verdict]:
    try:
        return va.validate(paths, segment_steps=segment_steps)
    except TLCMissing as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))


def test_a_restart_journal_holds_every_engine_at_once(tmp_path: Path) -> None:
    """The generated journal is what the split must handle: three engines, handles
    reused by each, a tick that heartbeats two engines, the old engine lost while the
    new one serves, and the whole journal replays through D's table."""
    path = restart_journal(tmp_path / "r.jsonl", 1)
    rows = rows_of(path)[1:]
    kinds: dict[str, int] = {}
    for r in rows:
        for e in r["effects"]:
            k = e["type"] + (":" + e["reason"] if e["type"] == "finished" else "")
            kinds[k] = kinds.get(k, 0) + 1
    two = [r for r in rows if r["event"]["type"] == "tick"
           and len({e["engine"] for e in r["effects"] if e["type"] == "send_heartbeat"}) > 1]
    assert two, "no tick heartbeats two P engines"
    handles = {(p["engine"], p["handle"]) for r in rows if r["event"]["type"] == "admit"
               for p in [r["event"]["params"]]}
    assert {h for e, h in handles if e == "Pa"} & {h for e, h in handles if e == "Pb"}
    assert kinds.get("finished:pulled", 0) > 20, kinds
    assert kinds.get("finished:peer_lost", 0) + kinds.get("drop_peer", 0) > 0, kinds
    assert check_d_journal(path).allowed
    parts = d_journal_engine_traces(path)
    assert [e for e, _ in parts] == ["Pa", "Pb", "Pc"]
    for e, traces in parts:
        assert all(f"[P engine {e}]" in t.path for t in traces)


@pytest.mark.tlc
@pytest.mark.parametrize(("seed", "segment_steps"), [(1, DEFAULT_SEGMENT_STEPS), (2, 60)])
def test_a_journal_spanning_p_restarts_is_traced_per_engine(tmp_path: Path, seed: int,
                                                            segment_steps: int) -> None:
    path = restart_journal(tmp_path / f"r{seed}.jsonl", seed)
    (v,) = _validate([path], segment_steps)
    assert v.allowed, v.describe()
    assert v.status == "traced" and v.engines == 3, v.describe()
    assert v.steps > len(rows_of(path)) - 1  # every tick is in each engine's trace
    assert "traced per P engine (3 engines" in v.describe()


def _corrupt_cases(rows: list[dict[str, Any]]) -> dict[str, tuple[list[dict[str, Any]], int,
                                                                   str]]:
    """Journals with one engine's part changed: (rows, the line TLC must name, the
    engine whose trace rejects it)."""
    def copy() -> list[dict[str, Any]]:
        return [dict(r) for r in json.loads(json.dumps(rows))]

    out: dict[str, tuple[list[dict[str, Any]], int, str]] = {}
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "read_ok"
             and r["event"]["request_id"].startswith("Pb-")
             and any(e["type"] == "finished" for e in r["effects"]))
    bad = copy()
    for e in bad[i]["effects"]:
        if e["type"] == "finished":
            e["state"] = "failed"  # pulled, reported failed
    out["pb_finished_state"] = (bad, i + 1, "Pb")
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "tick"
             and {e["engine"] for e in r["effects"] if e["type"] == "send_heartbeat"}
             >= {"Pb", "Pc"})
    bad = copy()
    bad[i]["effects"] = [e for e in bad[i]["effects"]
                         if not (e["type"] == "send_heartbeat" and e["engine"] == "Pc")]
    out["pc_heartbeat_left_out"] = (bad, i + 1, "Pc")
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "ack"
             and r["event"]["engine"] == "Pa" and r["event"]["seq"] > 2)
    bad = copy()
    bad.insert(i + 1, copy()[i])  # Pa's ack answered twice: the second renews nothing
    bad[i + 1]["effects"] = [{"type": "finished", "request_id": "Pa-none", "state": "failed",
                              "reason": "revoked"}]
    out["pa_ack_revokes_nothing_live"] = (bad, i + 2, "Pa")
    return out


@pytest.mark.tlc
def test_a_corrupted_engine_part_is_rejected_at_its_line(tmp_path: Path) -> None:
    rows = rows_of(restart_journal(tmp_path / "r.jsonl", 1))
    cases = _corrupt_cases(rows)
    paths = [write_rows(tmp_path / f"bad-{k}.jsonl", bad) for k, (bad, _, _) in cases.items()]
    for (name, (_, line, engine)), v in zip(cases.items(), _validate(paths, 80), strict=True):
        assert not v.allowed and v.status == "invalid", (name, v.describe())
        assert v.line == line, (name, v.describe())
        assert f"[P engine {engine}]" in v.path, (name, v.describe())


def _budget_inputs(path: Path, consumer_cls: type[Consumer]) -> Path:
    """Two P engines (a restart) whose leases are lost at once: 4 leases, a tick budget
    of 2. The real Consumer fails them over two ticks; the unbounded-tick mutant fails
    all 4 in one, 2 per engine: within the budget in each engine's part."""
    cfg = replace(Config(), max_tick_work=2)
    with JournalWriter(path, cfg, None, {"source": "budget2"}, reader="d0") as w:
        c = consumer_cls("d0", cfg, sink=w.sink)
        for e, (name, epoch) in enumerate(ENGINES[:2]):
            c.handshake_result(name, True, e)
            for h in (1, 2):
                c.admit(f"{name}-r{h}", TransferParams(name, epoch, h, (h,), 8_000), 10)
        for t in (1_000, 2_000, 2_001, 2_002, 3_000):
            c.tick(t)
    return path


@pytest.mark.tlc
def test_what_the_parts_share_is_checked_by_the_replay(tmp_path: Path) -> None:
    """Each engine's part is checked alone by TLC, so a tick that fails more leases than
    its budget over all engines passes TLC in each part; the replay of the whole journal
    (TickBounded, and the effects of each whole tick) rejects it."""
    good = _budget_inputs(tmp_path / "good.jsonl", Consumer)
    bad = _budget_inputs(tmp_path / "bad.jsonl", D_MUTANTS["unbounded_tick"].consumer_cls)
    assert [e for e, _ in d_journal_engine_traces(bad)] == ["Pa", "Pb"]
    g, b = _validate([good, bad])
    assert g.allowed and g.status == "traced", g.describe()
    assert not b.allowed and b.status == "invalid", b.describe()
    assert "TickBounded" in b.why, b.describe()
    # TLC alone accepts every part of the mutant's journal
    traces = [t for _, ts in d_journal_engine_traces(bad) for t in ts]
    assert all(v.allowed for v in check_batch(traces))


def test_a_journal_that_cannot_be_split_is_replayed_with_the_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request id admitted for the new engine while the old engine's request of that
    id is live (Consumer ignores it: duplicate_admit) names two engines in one request:
    the journal cannot be split. It is replayed through D's table, and the reason said;
    the same journal with an effect D never had is rejected by the replay."""
    path = tmp_path / "dup.jsonl"
    cfg = Config()
    with JournalWriter(path, cfg, None, {"source": "dup"}, reader="d0") as w:
        c = Consumer("d0", cfg, sink=w.sink)
        c.handshake_result("Pa", True, 0)
        c.admit("r1", TransferParams("Pa", 7, 1, (1,), 30_000), 0)
        c.admit("r1", TransferParams("Pb", 8, 1, (1,), 30_000), 100)
        (hb,) = [e for e in c.tick(200) if isinstance(e, SendHeartbeat)]
        c.ack("Pa", hb.seq, 20_000, (), 300)
        c.schedule("r1", 400)
        c.read_result("r1", True, 500)
    with pytest.raises(dsplit.SplitError, match="admitted for P engine Pb while live"):
        d_journal_engine_traces(path)
    (v,) = va.validate([path])
    assert v.allowed and v.status == "replayed", v.describe()
    assert "admitted for P engine Pb while live for Pa" in v.describe()
    rows = rows_of(path)
    rows[3]["effects"] = [{"type": "start_handshake", "engine": "Pb"}]
    (b,) = va.validate([write_rows(tmp_path / "dup-bad.jsonl", rows)])
    assert not b.allowed and b.status == "invalid", b.describe()
    assert "line 4" in b.why, b.describe()
    from kvproto.cli import main

    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "not traced by TLC: line 4: request id r1 admitted for P engine Pb" in out


def test_an_event_with_an_effect_on_another_engine_is_not_split(tmp_path: Path) -> None:
    rows = rows_of(_budget_inputs(tmp_path / "j.jsonl", Consumer))
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "admit"
             and r["event"]["params"]["engine"] == "Pb")
    rows[i]["effects"] = [{"type": "send_release", "request_id": "Pa-r1", "engine": "Pa",
                           "handle": 1, "expected": 1}]
    path = write_rows(tmp_path / "cross.jsonl", rows)
    with pytest.raises(dsplit.SplitError, match="about P engine Pb has an effect on P engine Pa"):
        d_journal_engine_traces(path)
    (v,) = va.validate([path])
    assert not v.allowed and v.status == "invalid" and v.replayed, v.describe()


@pytest.mark.tlc
def test_cli_validates_a_restart_journal(tmp_path: Path) -> None:
    good = restart_journal(tmp_path / "r.jsonl", 1)
    rows = rows_of(good)
    (bad_rows, line, _) = _corrupt_cases(rows)["pb_finished_state"]
    bad = write_rows(tmp_path / "bad.jsonl", bad_rows)
    for path, rc, text in ((good, 0, "traced per P engine"), (bad, 1, f"at line {line}")):
        proc = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate", str(path)],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode == 3:  # pragma: no cover - CI has Java
            pytest.skip(proc.stderr)
        assert proc.returncode == rc, proc.stdout + proc.stderr
        assert text in proc.stdout, proc.stdout


def test_chaos_reports_each_verdict_status() -> None:
    from kvproto.testing.chaos import JOURNAL_OK, _status

    ok = Verdict("D1.jsonl", True, 10)
    traced = Verdict("D1.jsonl", True, 30, engines=3)
    replayed = Verdict("D1.jsonl", True, 10, replayed="line 4: a cap shared by all P engines")
    bad = Verdict("D1.jsonl", False, 3, line=5, why="an effect the spec does not have")
    assert [_status(v) for v in (ok, traced, replayed)] == ["valid", "traced", "replayed"]
    assert all(_status(v) in JOURNAL_OK for v in (ok, traced, replayed))
    assert _status(bad).startswith("invalid: D1.jsonl: NOT ALLOWED at line 5")
    assert _status(bad) not in JOURNAL_OK
    assert "not traced by TLC: line 4" in replayed.describe()


@pytest.mark.tlc
def test_each_part_runs_on_ds_clock(tmp_path: Path) -> None:
    """Pa's last step is at 0; Pb's admit moves D's clock to 1000; Pa's admit then arrives
    stamped 400 (Consumer keeps its own, earlier time for the lease). Pa's part must put
    that admit at D's clock (1000) with late 600, not at its own time 400 (then its lease
    would end 600 ms early in the spec, and the part's end state would not be the
    Consumer's)."""
    path = tmp_path / "clock.jsonl"
    cfg = Config()
    with JournalWriter(path, cfg, None, {"source": "clock"}, reader="d0") as w:
        c = Consumer("d0", cfg, sink=w.sink)
        c.handshake_result("Pa", True, 0)
        c.handshake_result("Pb", True, 0)
        c.admit("b1", TransferParams("Pb", 8, 1, (1,), 30_000), 1_000)
        c.admit("a1", TransferParams("Pa", 7, 1, (1,), 30_000), 400)
        c.tick(5_000)
        c.tick(23_500)  # a1's lease (400 + 29_000) still covers a READ (from 1000: not)
    rows = rows_of(path)
    assert rows[4]["event"]["now"] == 400
    assert not [e for r in rows[1:] for e in r["effects"] if e["type"] == "finished"]
    (v,) = _validate([path])
    assert v.allowed and v.status == "traced", v.describe()
