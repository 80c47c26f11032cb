"""``kvproto validate``: TLC checks recorded journals against the spec.

Real simulator journals must be accepted; tampered ones must be rejected at the right
line. All journals of a test go to TLC in one batch (SANY time dominates)."""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvproto.journal import JournalWriter
from kvproto.lifecycle import BlockPool, Config, Ledger
from kvproto.testing.sim import Faults, Simulator
from kvproto.verify import ptrace, trace
from kvproto.verify import validate as va
from kvproto.verify.tlc import MissingDependency as TLCMissing

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Journals.
# ---------------------------------------------------------------------------


def sim_journal(path: Path, seed: int, duration: float, *, faults: bool = True) -> Path:
    cfg = Config()
    with JournalWriter(path, cfg, 256, {"source": "test", "seed": seed}) as w:
        sim = Simulator(seed, config=cfg, faults=Faults() if faults else Faults.none(),
                        capacity=256, journal=w.sink)
        sim.run(duration)
    return path


def scripted_journal(path: Path) -> Path:
    """A short hand-driven journal touching every kind of step: staged early messages, a
    sibling group transferred by two readers, heartbeats (granted, refused, pending), an
    expiry, an abort freed at its deadline, duplicate and invalid registers, rejects."""
    cfg = Config(initial_lease=10.0, lease_extension=8.0, abort_grace=10.0,
                 heartbeat_interval=2.0, max_delay=0.5, max_read_time=2.0, clock_drift=0.1,
                 max_staged_age=6.0)
    with JournalWriter(path, cfg, 16, {"source": "scripted"}) as w:
        L = Ledger(cfg, BlockPool(16), sink=w.sink)
        L.done("dB", 5, 2, 500)  # early: staged
        L.register(1, "a", (0, 1), 1000, group="g", expected=2)
        L.register(2, "b", (0, 2), 1000, group="g", expected=2)
        L.register(3, "c", (3,), 1000)
        L.register(4, "d", (4, 5), 1000, expected=1)
        L.register(4, "d", (4, 5), 1200)  # duplicate handle: rejected
        L.register(9, "z", (99,), 1200)  # invalid block id: rejected
        L.tick(1500)
        L.heartbeat("dA", 1, (1, 2, 3, 5), 2, 2000)  # 5 is pending (staged)
        L.abort("d", 2500)
        L.heartbeat("dA", 2, (4,), 1, 2700)  # refused: aborted
        L.done("dA", 1, 2, 3000)
        L.reject("bad_magic", "dX", "3 bytes", 3100)
        L.done("dB", 1, 2, 3200)  # all done: frees 1 (transferred) and 2 (sibling)
        L.register(5, "e", (6,), 3300, expected=2)  # applies the staged done
        L.release("dA", (5,), 2, 3400)  # all finished: released
        for t in range(4000, 16_000, 1000):
            L.tick(t)  # 3 expires at 11 s, the aborted 4 is freed at 12.5 s -> 13 s
        L.done("dA", 3, 1, 16_000)  # late
    return path


def budget_journal(path: Path) -> Path:
    """Ticks with a work budget of one heap entry (Config.max_tick_work = 1): expiries
    carried over to later ticks, and a late request renewed and one finished before
    their expiry came round."""
    cfg = Config(initial_lease=10.0, lease_extension=8.0, abort_grace=10.0,
                 heartbeat_interval=2.0, max_delay=0.5, max_read_time=2.0, clock_drift=0.1,
                 max_tick_work=1)
    with JournalWriter(path, cfg, 16, {"source": "budget"}) as w:
        L = Ledger(cfg, BlockPool(16), sink=w.sink)
        for h in range(1, 6):
            L.register(h, f"r{h}", (h,), 1000, expected=1)
        L.tick(11_000)  # five due, one expires
        L.heartbeat("dA", 1, (4,), 1, 11_200)  # 4 is past its deadline, still held: renewed
        L.done("dA", 5, 1, 11_300)  # 5 finishes before its late expiry
        for t in range(12_000, 30_000, 1000):
            L.tick(t)
        assert L.frees["expired"] == 4 and L.frees["transferred"] == 1
    return path


def read_lines(p: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in p.read_text().splitlines()]


def write_lines(p: Path, rows: list[dict[str, Any]]) -> Path:
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def first_line(rows: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> int:
    """0-based index into rows (the journal line number is index + 1)."""
    for i, r in enumerate(rows):
        if i and pred(r):
            return i
    raise AssertionError("no such line in the journal")


def frees_of(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in row["effects"] if e["type"] == "free"]


# ---------------------------------------------------------------------------
# Unit tests (no TLC).
# ---------------------------------------------------------------------------


def test_trace_times_are_the_journals_milliseconds(tmp_path: Path) -> None:
    """No scale and no rounding: a tick 1 ms before a deadline is 1 time unit before it
    in the trace, exactly as the ledger saw it."""
    cfg = Config(initial_lease=10.0, lease_extension=8.0, abort_grace=10.0,
                 heartbeat_interval=2.0, max_delay=0.5, max_read_time=2.0, clock_drift=0.1)
    path = tmp_path / "ms.jsonl"
    with JournalWriter(path, cfg, 4, {"source": "ms"}) as w:
        L = Ledger(cfg, BlockPool(4), sink=w.sink)
        L.register(1, "a", (0,), 5, expected=1)
        L.tick(10_004)  # 1 ms before the deadline (10_005)
        L.tick(10_005)
    tr = ptrace.journal_to_trace(path)
    assert [re.search(r"dt \|-> (\d+)", s).group(1) for s in tr.steps] == ["0", "9999", "1"]
    assert "frees |-> <<>>" in tr.steps[1] and '"expired"' in tr.steps[2]
    assert tr.constants["InitialLease"] == "10000"
    assert not hasattr(trace, "choose_scale")


def test_trace_mapping(tmp_path: Path) -> None:
    tr = ptrace.journal_to_trace(scripted_journal(tmp_path / "s.jsonl"))
    assert tr.constants["InitialLease"] == "10000" and tr.constants["LeaseExtension"] == "8000"
    assert '"h1"' in tr.constants["Requests"] and '"h9"' not in tr.constants["Requests"]
    assert tr.constants["Readers"] == '{"dA", "dB"}'
    assert tr.lines[0] == 2 and len(tr.steps) == len(read_lines(tmp_path / "s.jsonl")) - 1
    assert tr.steps[0].startswith('[type |-> "done", dt |-> 0, r |-> "h5"')
    reject = next(s for s in tr.steps if '"stutter"' in s)
    assert "frees |-> <<>>" in reject


def test_bad_input_exit_codes(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kvproto_journal": 1, "config": {}, "capacity": 4}\nnot json\n')
    args = argparse.Namespace(journals=[str(bad)], batch_bytes=va.DEFAULT_BATCH_BYTES, keep=None,
                              timeout=va.DEFAULT_TIMEOUT)
    assert va.run(args) == va.EXIT_BAD_INPUT
    args.journals = [str(tmp_path / "missing.jsonl")]
    assert va.run(args) == va.EXIT_BAD_INPUT


# ---------------------------------------------------------------------------
# TLC.
# ---------------------------------------------------------------------------


def run_validate(paths: list[Path], segment_steps: int = va.DEFAULT_SEGMENT_STEPS
                 ) -> list[va.Verdict]:
    try:
        return va.validate(paths, segment_steps=segment_steps)
    except TLCMissing as e:  # pragma: no cover - depends on the machine
        pytest.skip(str(e))


def test_segments_cover_the_journal_and_restrict_requests(tmp_path: Path) -> None:
    p = sim_journal(tmp_path / "sim.jsonl", 1, 15.0)  # P ticks only when something is due
    whole = ptrace.journal_to_trace(p)
    segs = ptrace.journal_to_traces(p, 40)
    assert len(segs) == -(-len(whole.steps) // 40) > 2
    assert [s for t in segs for s in t.steps] == whole.steps
    assert [t.offset for t in segs] == list(range(0, len(whole.steps), 40))
    # a segment names fewer requests than the whole journal, and chains: its start
    # state is the previous segment's end state wherever their requests are the same
    def count(t: va.Trace) -> int:
        return t.constants["Requests"].count('"h')
    counts = [count(t) for t in segs]
    assert max(counts) <= count(whole) and sum(c < count(whole) for c in counts) >= 2, counts
    assert segs[0].constants["InitL"].count("EXCEPT") == 0  # the empty ledger


@pytest.mark.tlc
@pytest.mark.parametrize("segment_steps", [va.DEFAULT_SEGMENT_STEPS, 7])
def test_accepts_real_journals(tmp_path: Path, segment_steps: int) -> None:
    paths = [sim_journal(tmp_path / f"sim{s}.jsonl", s, 6.0) for s in (1, 2, 3)]
    paths.append(sim_journal(tmp_path / "clean.jsonl", 4, 6.0, faults=False))
    paths.append(scripted_journal(tmp_path / "scripted.jsonl"))
    paths.append(budget_journal(tmp_path / "budget.jsonl"))
    n_frees = sum(len(frees_of(r)) for p in paths for r in read_lines(p)[1:])
    assert n_frees > 20  # the journals exercise the lifecycle, not just ticks
    verdicts = run_validate(paths, segment_steps)
    for v in verdicts:
        log.info("%s", v.describe())
    assert [v.allowed for v in verdicts] == [True] * len(paths), \
        "\n".join(v.describe() for v in verdicts)
    assert [v.steps for v in verdicts] == [len(read_lines(p)) - 1 for p in paths]


def _tamper_extra_free(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """Copy the first transferred free onto an earlier tick while the request is held."""
    i = first_line(rows, lambda r: any(f["reason"] == "transferred" for f in frees_of(r)))
    free = next(f for f in frees_of(rows[i]) if f["reason"] == "transferred")
    h = free["handle"]
    reg = first_line(rows, lambda r: r["event"]["type"] == "register"
                     and r["event"]["handle"] == h)
    j = max(k for k in range(reg + 1, i) if rows[k]["event"]["type"] == "tick")
    rows[j]["effects"].append(dict(free))
    return j, "free of a request the spec does not free"


def _tamper_done_twice(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """Duplicate a done line that freed its request: the same done counted twice."""
    i = first_line(rows, lambda r: r["event"]["type"] == "done" and bool(frees_of(r)))
    rows.insert(i + 1, json.loads(json.dumps(rows[i])))
    return i + 1, "free of a request the spec does not free"


def _tamper_early_expiry(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """Move an expiry free to the tick before: a free before the deadline."""
    i = first_line(rows, lambda r: any(f["reason"] == "expired" for f in frees_of(r)))
    free = next(f for f in frees_of(rows[i]) if f["reason"] == "expired")
    rows[i]["effects"].remove(free)
    j = max(k for k in range(1, i) if rows[k]["event"]["type"] == "tick")
    rows[j]["effects"].append(free)
    return j, "free of a request the spec does not free"


def _tamper_ack(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """An ack that renews an aborted request."""
    i = first_line(rows, lambda r: r["event"]["type"] == "heartbeat"
                   and any(e["type"] == "ack" and e["refused"] for e in r["effects"]))
    for e in rows[i]["effects"]:
        if e["type"] == "ack":
            e["refused"] = []
    return i, "ack refuses a different set"


TAMPERS: dict[str, Callable[[list[dict[str, Any]]], tuple[int, str]]] = {
    "extra_free": _tamper_extra_free,
    "done_counted_twice": _tamper_done_twice,
    "free_before_deadline": _tamper_early_expiry,
    "ack_renews_aborted": _tamper_ack,
}


@pytest.mark.tlc
@pytest.mark.parametrize("segment_steps", [va.DEFAULT_SEGMENT_STEPS, 5])
def test_rejects_tampered_journals(tmp_path: Path, segment_steps: int) -> None:
    base = read_lines(scripted_journal(tmp_path / "scripted.jsonl"))
    sim = read_lines(sim_journal(tmp_path / "sim.jsonl", 1, 6.0))
    paths: list[Path] = []
    expect: list[tuple[int, str]] = []
    for name, tamper in TAMPERS.items():
        for src, rows in (("scripted", base), ("sim", sim)):
            rows = json.loads(json.dumps(rows))
            try:
                idx, why = tamper(rows)
            except (AssertionError, ValueError):
                assert src == "sim", f"{name} must apply to the scripted journal"
                continue  # this simulator run has no such line
            paths.append(write_lines(tmp_path / f"{name}-{src}.jsonl", rows))
            expect.append((idx + 1, why))
    assert len(paths) >= len(TAMPERS) + 2
    verdicts = run_validate(paths, segment_steps)
    for v, (line, why), p in zip(verdicts, expect, paths, strict=True):
        log.info("%s", v.describe())
        assert not v.allowed, f"{p.name} was accepted"
        assert v.line == line, f"{p.name}: reported line {v.line}, tampered line {line}\n" \
            + v.describe()
        assert why in v.why, v.describe()
        assert v.event == json.loads(p.read_text().splitlines()[line - 1])["event"]


@pytest.mark.tlc
def test_segment_must_end_in_the_replayed_state(tmp_path: Path) -> None:
    """The chaining check: a segment whose spec state at its end is not the replayed
    ledger's (here: the end state of another segment) is rejected at its last line."""
    segs = ptrace.journal_to_traces(scripted_journal(tmp_path / "s.jsonl"), 6)
    assert len(segs) >= 3
    good, bad = segs[1], va.Trace(**{**segs[1].__dict__})
    bad.constants = {**good.constants, "EndL": good.constants["InitL"]}
    assert bad.constants["EndL"] != good.constants["EndL"]
    try:
        v_good, v_bad = va.check_batch([good, bad])
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    assert v_good.allowed, v_good.describe()
    assert not v_bad.allowed and v_bad.line == good.lines[-1], v_bad.describe()
    assert "differs from the implementation's" in v_bad.why


@pytest.mark.tlc
def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = scripted_journal(tmp_path / "good.jsonl")
    rows = read_lines(good)
    idx, _ = _tamper_done_twice(rows)
    bad = write_lines(tmp_path / "bad.jsonl", rows)
    args = argparse.Namespace(journals=[str(good), str(bad)], batch_bytes=1, keep=None,
                              timeout=va.DEFAULT_TIMEOUT)
    try:
        code = va.run(args)  # batch_bytes=1: one TLC run per journal
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    out = capsys.readouterr().out
    assert code == va.EXIT_NOT_ALLOWED, out
    assert "good.jsonl: OK" in out
    assert f"bad.jsonl: NOT ALLOWED at line {idx + 1}" in out


@pytest.mark.tlc
def test_batches_side_by_side_keep_each_journals_verdict(tmp_path: Path) -> None:
    good = scripted_journal(tmp_path / "good.jsonl")
    rows = read_lines(good)
    idx, _ = _tamper_done_twice(rows)
    bad = write_lines(tmp_path / "bad.jsonl", rows)
    paths = [good, bad, good, bad]
    try:  # batch_bytes=1: one TLC run per journal, up to three at a time
        side = va.validate(paths, batch_bytes=1, jobs=3, workdir=tmp_path / "side")
        one = va.validate(paths, batch_bytes=1, jobs=1, workdir=tmp_path / "one")
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    assert [v.allowed for v in side] == [True, False, True, False]
    assert [(v.path, v.allowed, v.steps, v.why) for v in side] == \
        [(v.path, v.allowed, v.steps, v.why) for v in one]
    assert (tmp_path / "side" / "batch3").is_dir()  # each run in its own directory
    assert [side[1].line, side[3].line] == [idx + 1, idx + 1]


@pytest.mark.tlc
def test_each_tlc_run_extracts_the_standard_modules_into_its_own_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TLC copies the standard modules out of its jar into java.io.tmpdir and deletes them
    at exit; in a shared /tmp a run ending deletes what a concurrent run is parsing (exit
    150, "Module-Table lookup failure"). Each run must use a directory of its own."""
    import tempfile
    import threading

    from kvproto.verify.models import TLC_MODELS
    from kvproto.verify.tlc import run_tlc

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: set[Path] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.update(tmp_path.glob("kvproto-tlc-*/*/Naturals.tla"))
            done.wait(0.02)

    w = threading.Thread(target=watch)
    w.start()
    m = TLC_MODELS["gate"]
    try:
        res = run_tlc(m.cfg, module=m.module, cfg_text=m.path.read_text(), workers=1)
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    finally:
        done.set()
        w.join()
    assert res.exit_code == 0, res.output[-2000:]
    assert seen and all(p.parent.name == "java-tmp" for p in seen), seen


@pytest.mark.tlc
def test_tlc_timeout_is_a_clear_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = scripted_journal(tmp_path / "good.jsonl")
    args = argparse.Namespace(journals=[str(good)], batch_bytes=va.DEFAULT_BATCH_BYTES,
                              keep=None, timeout=0.05)
    try:
        code = va.run(args)
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    assert code == 4
    assert "kvproto validate: TLC did not finish within 0 s" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# D journals (one decode rank): replayed against D's table, then validated by TLC
# (TraceConsumer.tla; more in tests/test_dconformance.py)
# ---------------------------------------------------------------------------


def d_journal(path: Path) -> Path:
    from kvproto.lifecycle import Consumer, SendHeartbeat, TransferParams

    with JournalWriter(path, Config(), None, {"source": "test_validate"}, reader="d0") as w:
        c = Consumer("d0", Config(), sink=w.sink)
        c.handshake_result("P0", True, 0)
        c.admit("r1", TransferParams("P0", 1, 1, (1,), 30_000, 1), 100)
        c.admit("r2", TransferParams("P0", 1, 2, (2,), 30_000, 1), 100)
        c.admit("r3", TransferParams("P0", 1, 3, (), 30_000, 1), 100)  # bad: a DReject
        hbs = [e for e in c.tick(500) if isinstance(e, SendHeartbeat)]
        c.ack("P0", hbs[0].seq, 20_000, (2,), 700)  # r2 refused: released
        c.schedule("r1", 1000)
        c.read_result("r1", True, 2000, notif_attached=False)
    return path


@pytest.mark.tlc
def test_validate_accepts_a_d_journal_and_rejects_a_tampered_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvproto import cli

    good = d_journal(tmp_path / "d.jsonl")
    assert cli.main(["-q", "validate", str(good)]) == 0
    out = capsys.readouterr().out
    assert "D journal of d0" in out and "follow D_TRANSITIONS" in out and "done:pulled" in out
    assert f"{good}: OK, all 8 steps are allowed by the spec" in out  # TLC, TraceConsumer
    rows = read_lines(good)
    i = first_line(rows, lambda r: r["event"]["type"] == "ack")
    rows[i]["effects"] = []  # hide the release of the refused request
    bad = write_lines(tmp_path / "bad.jsonl", rows)
    assert cli.main(["-q", "validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "do NOT follow" in out and f"line {i + 1}: ack effects differ" in out
    assert f"{bad}: NOT ALLOWED at line {i + 1}" in out
    assert "the spec has an effect here that the journal does not" in out


@pytest.mark.tlc
def test_validate_accepts_version_1_and_version_2_journals(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Version 1 journals (float seconds, committed as written by the version 1 writer)
    are read as milliseconds and accepted like version 2 ones, P and D alike."""
    from kvproto import cli

    fixtures = Path(__file__).resolve().parent / "fixtures"
    v1 = [fixtures / "journal_v1_p.jsonl", fixtures / "journal_v1_d.jsonl"]
    v2 = [scripted_journal(tmp_path / "p2.jsonl"), d_journal(tmp_path / "d2.jsonl")]
    assert [json.loads(p.read_text().splitlines()[0])["kvproto_journal"]
            for p in v1 + v2] == [1, 1, 2, 2]
    try:
        code = cli.main(["-q", "validate", *map(str, v1 + v2)])
    except TLCMissing as e:  # pragma: no cover
        pytest.skip(str(e))
    out = capsys.readouterr().out
    assert code == 0, out
    for p in v1 + v2:
        assert f"{p}: OK, all" in out, out
