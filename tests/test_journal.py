"""Event journal and ``kvproto replay``.

A journal written by the simulator replays clean; any tampering (a changed effect, a
dropped line, an inserted double free) exits 1 naming the line; unreadable lines exit 2
with their line number; an invalid config in the header is refused.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvproto.cli import main
from kvproto.journal import JournalError, JournalWriter, read_journal, to_json
from kvproto.lifecycle import Ack, Admit, BlockPool, Config, DAck, Free, Ledger, Tick
from kvproto.verify.replay import replay

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="module")
def sim_journal(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Lines of a journal recorded by ``kvproto simulate`` (one seed, 30 s, with faults)."""
    path = tmp_path_factory.mktemp("journal") / "sim.jsonl"
    assert main(["-q", "simulate", "--seeds", "1", "--duration", "30", "--json",
                 "--journal", str(path)]) == 0
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) > 100
    return lines


def run_replay(tmp_path: Path, lines: list[str], capsys: pytest.CaptureFixture[str],
               *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc = main(["-q", "replay", str(path), *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def line_of(lines: list[str], pred: Any) -> int:
    """0-based index of the first body line whose parsed object satisfies ``pred``."""
    for i, raw in enumerate(lines[1:], start=1):
        if pred(json.loads(raw)):
            return i
    raise AssertionError("no such line in the journal")


def has_free(d: dict[str, Any], event_type: str | None = None) -> bool:
    return any(e["type"] == "free" for e in d["effects"]) and (
        event_type is None or d["event"]["type"] == event_type)


def first_diverged_line(err: str) -> int:
    m = re.search(r"DIVERGED line (\d+):", err)
    assert m is not None, err
    return int(m.group(1))


# ---------------------------------------------------------------------------
# Clean replay
# ---------------------------------------------------------------------------


def test_simulator_journal_replays_clean(sim_journal: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_replay(tmp_path, sim_journal, capsys)
    assert rc == 0, err
    assert f"{len(sim_journal) - 1} events replayed" in err
    assert err.rstrip().endswith("ok")
    # the replayed effects are printed as JSON Lines, equal to the recorded ones
    recorded = [e for raw in sim_journal[1:] for e in json.loads(raw)["effects"]]
    printed = [json.loads(x) for x in out.splitlines()]
    assert printed == recorded


def test_replay_no_effects_prints_only_the_verdict(sim_journal: list[str], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_replay(tmp_path, sim_journal, capsys, "--no-effects")
    assert (rc, out) == (0, "")
    assert "ok" in err


def test_journal_writer_records_every_event_and_effect() -> None:
    buf = io.StringIO()
    writer = JournalWriter(buf, Config(), 8, {"source": "test"})
    ledger = Ledger(Config(), BlockPool(8), sink=writer.sink)
    ledger.register(1, "a:b,c", (0, 1), 0, expected=1)
    ledger.heartbeat("d0", 1, (1, 2), 1, 1000)
    ledger.abort("a:b,c", 2000)
    effects = ledger.done("d0", 1, 1, 3000)
    ledger.tick(4000)
    writer.close()
    assert writer.events == 5
    lines = buf.getvalue().splitlines()
    header = json.loads(lines[0])
    assert header["kvproto_journal"] == 2 and header["capacity"] == 8
    assert header["config"] == Config().to_dict() and header["meta"] == {"source": "test"}
    body = [json.loads(x) for x in lines[1:]]
    assert [d["n"] for d in body] == [1, 2, 3, 4, 5]
    assert [d["event"]["type"] for d in body] == ["register", "heartbeat", "abort", "done",
                                                 "tick"]
    assert body[3]["effects"] == [to_json(e) for e in effects]
    assert isinstance(effects[0], Free)
    result = replay(io.StringIO(buf.getvalue()))
    assert result.ok and result.events == 5
    assert result.frees == {"transferred": 1}


def test_read_journal_yields_line_numbers_events_and_effects() -> None:
    buf = io.StringIO()
    writer = JournalWriter(buf, Config(), 4)
    ledger = Ledger(Config(), BlockPool(4), sink=writer.sink)
    ledger.register(1, "r", (0,), 0, expected=1)
    ledger.done("d0", 1, 1, 1000)
    header, body = read_journal(io.StringIO(buf.getvalue()))
    rows = list(body)
    assert header["capacity"] == 4
    assert [(n, type(ev).__name__, [type(e).__name__ for e in effs]) for n, ev, effs in rows] \
        == [(2, "Register", []), (3, "Done", ["Free"])]


# ---------------------------------------------------------------------------
# Tampered journals: exit 1, naming the line
# ---------------------------------------------------------------------------


def test_changed_effect_is_reported_with_its_line(sim_journal: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(sim_journal)
    i = line_of(lines, lambda d: has_free(d, "done") and any(
        e["type"] == "free" and e["reclaimed"] for e in d["effects"]))
    d = json.loads(lines[i])
    free = next(e for e in d["effects"] if e["type"] == "free" and e["reclaimed"])
    free["reclaimed"] = []  # claim the blocks were not reclaimed
    lines[i] = json.dumps(d)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert first_diverged_line(err) == i + 1
    assert f"DIVERGED line {i + 1}: done effects differ" in err
    assert "FAILED" in err


def test_changed_free_reason_to_an_early_expiry_is_a_violation(
        sim_journal: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A recorded expiry before the lease deadline is a free under a possible READ."""
    lines = list(sim_journal)
    i = line_of(lines, lambda d: has_free(d, "done"))
    d = json.loads(lines[i])
    d["effects"][0]["reason"] = "expired"
    lines[i] = json.dumps(d)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert f"VIOLATION line {i + 1}: NoFreeUnderRead: recorded free" in err
    assert first_diverged_line(err) == i + 1


def test_dropped_line_is_reported(sim_journal: list[str], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(sim_journal)
    # drop the registration of a request that is later freed
    i = line_of(lines, lambda d: d["event"]["type"] == "register" and not d["effects"]
                and d["event"]["group"] is None)
    handle = json.loads(lines[i])["event"]["handle"]
    j = line_of(lines, lambda d: any(e["type"] == "free" and e["handle"] == handle
                                     for e in d["effects"]))
    del lines[i]
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert i <= first_diverged_line(err) <= j  # at the latest where its free was recorded


def test_inserted_double_free_is_reported_with_its_line(
        sim_journal: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(sim_journal)
    i = line_of(lines, lambda d: has_free(d, "done"))
    lines.insert(i + 1, lines[i])  # the same done, recorded as freeing the blocks again
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert first_diverged_line(err) == i + 2
    assert f"DIVERGED line {i + 2}: done effects differ" in err


def test_inserted_double_free_by_tick_is_reported(
        sim_journal: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(sim_journal)
    i = line_of(lines, lambda d: has_free(d))
    d = json.loads(lines[i])
    tick = {"n": 0, "event": {"type": "tick", "now": d["event"]["now"]},
            "effects": [e for e in d["effects"] if e["type"] == "free"]}
    lines.insert(i + 1, json.dumps(tick))
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert f"DIVERGED line {i + 2}: tick effects differ" in err


# ---------------------------------------------------------------------------
# Unreadable journals: exit 2 with the line number
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("bad", "message"), [
    ("not json", r"line 5: not JSON: Expecting value"),
    ('{"n": 4}', r"line 5: line must be an object with an 'event'"),
    ('{"event": {"type": "teleport", "now": 1}}', r"line 5: unknown event type 'teleport'"),
    ('{"event": {"type": "tick"}}', r"line 5: event 'tick' lacks field 'now'"),
    ('{"event": {"type": "tick", "now": 1, "colour": 2}}', r"line 5: .*unknown fields"),
    ('{"event": {"type": "tick", "now": "soon"}}', r"line 5: event time must be an int"),
    ('{"event": {"type": "tick", "now": 1e999}}', r"line 5: event time must be an int"),
    ('{"event": {"type": "tick", "now": 1500.0}}', r"line 5: event time must be an int"),
    ('{"event": {"type": "tick", "now": 1}, "effects": [{"type": "ack", "reader": "d0", '
     '"seq": 1, "term": 20.0, "refused": []}]}', r"line 5: field 'term' must be int"),
    ('{"event": {"type": "tick", "now": 1}, "effects": [{"type": "boom"}]}',
     r"line 5: unknown effect type 'boom'"),
])
def test_malformed_line_is_reported_with_its_line_number(
        sim_journal: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        bad: str, message: str) -> None:
    lines = list(sim_journal)
    lines[4] = bad
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 2
    assert re.search(message, err), err


def test_wrongly_typed_field_is_a_malformed_line(
        sim_journal: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a wrongly typed field made the machine raise during replay (exit 1)."""
    lines = list(sim_journal)
    lines[4] = json.dumps({"event": {"type": "heartbeat", "reader": "d0", "seq": 1,
                                     "handles": 5, "expected": 1, "now": 350},
                           "effects": []})
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 2
    assert "line 5" in err


def test_blank_lines_are_skipped(sim_journal: list[str], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(sim_journal)
    lines.insert(3, "   ")
    rc, _, _ = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 0


@pytest.mark.parametrize(("header", "message"), [
    (None, r"line 1: empty journal"),
    ("{", r"line 1: header is not JSON"),
    ('{"kvproto_journal": 99}', r"line 1: not a kvproto journal"),
    ('{"kvproto_journal": 1, "config": {}, "capacity": 0}', r"line 1: header capacity"),
])
def test_bad_header_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               header: str | None, message: str) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text("" if header is None else header + "\n", encoding="utf-8")
    assert main(["-q", "replay", str(path)]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(("config", "message"), [
    ({"lease_extension": 6.0}, r"lease_extension \(6.0\) must exceed heartbeat_interval"),
    ({"abort_grace": 1.0}, r"abort_grace \(1.0\) must be >="),
    ({"lease_time": 30}, r"unknown config keys: lease_time"),
    ({"initial_lease": "30"}, r"initial_lease must be a number"),
])
def test_invalid_config_in_header_is_refused(sim_journal: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             config: dict[str, Any], message: str) -> None:
    lines = list(sim_journal)
    header = json.loads(lines[0])
    header["config"].update(config)
    lines[0] = json.dumps(header)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 2
    assert "line 1: invalid config in header" in err
    assert re.search(message, err), err


def test_missing_journal_file_is_a_usage_error(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-q", "replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err


def test_replay_raises_journal_error_for_unreadable_input() -> None:
    with pytest.raises(JournalError) as info:
        replay(io.StringIO('{"kvproto_journal": 1, "config": {}, "capacity": 4}\nxx\n'))
    assert info.value.line == 2


# ---------------------------------------------------------------------------
# D journals (one decode rank's Consumer)
# ---------------------------------------------------------------------------


def d_journal() -> list[str]:
    """A D rank's journal written through Consumer's sink: handshake, a pulled request,
    a renewed one, an aborted one, a refused renewal."""
    from kvproto.lifecycle import Consumer, SendHeartbeat, TransferParams

    buf = io.StringIO()
    writer = JournalWriter(buf, Config(), None, {"source": "test"}, reader="d0")
    c = Consumer("d0", Config(), sink=writer.sink)
    c.admit("r1", TransferParams("P0", 1, 1, (1, 2), 30_000, 1, "g"), 0)
    c.handshake_result("P0", True, 100)
    c.admit("r2", TransferParams("P0", 1, 2, (3,), 30_000, 1, "g"), 200)
    c.admit("r3", TransferParams("P0", 1, 3, (4,), 30_000, 2), 200)
    c.admit("r4", TransferParams("P0", 1, 4, (5,), 30_000, 1), 200)
    c.schedule("r1", 1000)
    hbs = [e for e in c.tick(1500) if isinstance(e, SendHeartbeat)]
    for hb in hbs:
        c.ack("P0", hb.seq, 20_000, (4,) if 4 in hb.handles else (), 1700)
    c.read_result("r1", True, 2000, notif_attached=False)
    c.schedule("r2", 2100)
    c.abort("r3", 2200)
    c.tick(40_000)
    writer.close()
    return buf.getvalue().splitlines()


def test_d_journal_replays_clean_with_its_finishes(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lines = d_journal()
    header = json.loads(lines[0])
    assert header["side"] == "D" and header["reader"] == "d0" and "capacity" not in header
    types = [json.loads(x)["event"]["type"] for x in lines[1:]]
    assert {"admit", "handshake_ok", "schedule", "tick", "ack", "read_ok", "abort"} <= set(types)
    rc, out, err = run_replay(tmp_path, lines, capsys)
    assert rc == 0, err
    assert "ok" in err and "finished" in err and "done:pulled" in err
    assert "done:sibling_local" in err and "failed:revoked" in err and "failed:aborted" in err
    assert '"type":"send_done"' in out  # replayed effects are printed


def test_tampered_d_journal_diverges_at_its_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    lines = d_journal()
    i = line_of(lines, lambda d: d["event"]["type"] == "read_ok")
    d = json.loads(lines[i])
    d["event"]["notif_attached"] = True  # then D would not have sent done itself
    lines[i] = json.dumps(d)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 1
    assert f"line {i + 1}: read_ok effects differ" in err


def test_d_journal_header_must_name_its_reader(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    lines = d_journal()
    h = json.loads(lines[0])
    del h["reader"]
    lines[0] = json.dumps(h)
    rc, _, err = run_replay(tmp_path, lines, capsys)
    assert rc == 2 and "names its reader" in err


# ---------------------------------------------------------------------------
# Version 1 journals (times in float seconds) are still read, as milliseconds
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["journal_v1_p.jsonl", "journal_v1_d.jsonl"])
def test_version_1_journal_replays_clean(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Committed journals written by the version 1 writer (float seconds)."""
    path = FIXTURES / name
    assert json.loads(path.read_text(encoding="utf-8").splitlines()[0])["kvproto_journal"] == 1
    assert main(["-q", "replay", str(path), "--no-effects"]) == 0, capsys.readouterr().err


def test_version_1_times_are_read_as_integer_milliseconds() -> None:
    with open(FIXTURES / "journal_v1_p.jsonl", "rb") as f:
        _, rows = read_journal(f)
        got = list(rows)
    assert all(type(ev.now) is int for _, ev, _ in got)
    assert isinstance(got[0][1], Tick) and got[0][1].now == 100  # 0.1 s
    acks = [e for _, _, effs in got for e in effs if isinstance(e, Ack)]
    assert acks and {a.term for a in acks} == {20_000}  # 20.0 s
    frees = [e for _, _, effs in got for e in effs if isinstance(e, Free)]
    assert frees and all(type(e.deadline) is int for e in frees)
    with open(FIXTURES / "journal_v1_d.jsonl", "rb") as f:
        _, d_rows = read_journal(f)
        d_got = list(d_rows)
    admit = d_got[0][1]
    assert isinstance(admit, Admit) and admit.params.initial_term == 30_000 and admit.now == 0
    dack = next(ev for _, ev, _ in d_got if isinstance(ev, DAck))
    assert (dack.term, dack.now) == (20_000, 1700)


@pytest.mark.parametrize(("field", "value"), [("now", 0.0015), ("deadline", 30.0005)])
def test_version_1_time_that_is_not_whole_milliseconds_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: float) -> None:
    lines = (FIXTURES / "journal_v1_p.jsonl").read_text(encoding="utf-8").splitlines()
    i = line_of(lines, lambda d: has_free(d))
    d = json.loads(lines[i])
    if field == "now":
        d["event"]["now"] = value
    else:
        next(e for e in d["effects"] if e["type"] == "free")["deadline"] = value
    lines[i] = json.dumps(d)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 2
    assert f"line {i + 1}: version 1" in err and "not a whole number of milliseconds" in err


def test_version_2_refuses_float_times_that_version_1_accepts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = (FIXTURES / "journal_v1_d.jsonl").read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    header["kvproto_journal"] = 2
    lines[0] = json.dumps(header)
    rc, _, err = run_replay(tmp_path, lines, capsys, "--no-effects")
    assert rc == 2 and "line 2:" in err
