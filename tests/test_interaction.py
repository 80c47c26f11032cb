"""Interaction scripts: the protocol's stories under ``tests/testdata/ledger`` (P) and
``tests/testdata/consumer`` (D), each command's output compared with the expected one
(format: ``kvproto.testing.script``). ``pytest tests/test_interaction.py --rewrite``
writes the actual outputs in place; review the diff before committing it.

The tests below the script runs check the runner itself: a wrong expectation fails, a
malformed line names its file and line, and a rewrite repairs a script.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproto.testing import script

TESTDATA = Path(__file__).resolve().parent / "testdata"
SCRIPTS = sorted(TESTDATA.glob("*/*.txt"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_script(path: Path, request: pytest.FixtureRequest) -> None:
    script.check_file(path, rewrite=bool(request.config.getoption("--rewrite")))


def test_scripts_exist_for_both_machines_and_use_every_command() -> None:
    used: dict[str, set[str]] = {m: set() for m in script.DRIVERS}
    for path in SCRIPTS:
        machine = script.machine_of(path)
        assert machine in script.DRIVERS, f"{path}: not under ledger/ or consumer/"
        s = script.parse(path.read_text(encoding="utf-8"), str(path), machine)
        used[machine] |= {b.name for b in s.blocks}
    for machine, driver in script.DRIVERS.items():
        missing = sorted((set(driver.COMMANDS) | {"config"}) - used[machine])
        assert not missing, f"{machine} commands no script uses: {missing}"


# ---------------------------------------------------------------------------
# The runner itself
# ---------------------------------------------------------------------------

GOOD = """\
# two readers
register 1 req blocks=0,1 expected=2 t=0
----
h1: unregistered -> registered deadline=30000 expected=2

done d0 1 expected=2 t=1000
----
h1: registered -> notified finished=d0

done d1 1 expected=2 t=2000
----
free h1 req transferred blocks=0,1 reclaimed=0,1 deadline=30000
h1: notified -> freed
"""


def test_a_script_with_the_right_outputs_passes() -> None:
    result = script.run_text(GOOD, "ledger", "good.txt")
    assert result.ok
    assert result.rewritten() == GOOD


def test_a_wrong_expected_output_fails_naming_the_line_with_a_diff(tmp_path: Path) -> None:
    wrong = GOOD.replace("reason", "").replace("h1: registered -> notified finished=d0",
                                                "h1: registered -> notified finished=d1")
    path = tmp_path / "ledger" / "wrong.txt"
    path.parent.mkdir()
    path.write_text(wrong, encoding="utf-8")
    with pytest.raises(AssertionError) as err:
        script.check_file(path)
    msg = str(err.value)
    assert f"{path}:6: output of 'done d0 1 expected=2 t=1000' differs" in msg
    assert "-h1: registered -> notified finished=d1" in msg
    assert "+h1: registered -> notified finished=d0" in msg


def test_a_missing_output_line_fails() -> None:
    result = script.run_text(GOOD.replace("h1: notified -> freed\n", ""), "ledger")
    assert [b.line for b, _ in result.mismatches] == [10]


def test_an_extra_output_line_fails() -> None:
    result = script.run_text(GOOD + "count stale +1\n", "ledger")
    assert [b.line for b, _ in result.mismatches] == [10]


def test_rewrite_fills_in_the_outputs_and_keeps_comments(tmp_path: Path) -> None:
    bare = "\n".join(line for line in GOOD.splitlines()
                     if line.startswith(("#", "register", "done", "----")) or not line)
    path = tmp_path / "ledger" / "bare.txt"
    path.parent.mkdir()
    path.write_text(bare + "\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        script.check_file(path)
    script.check_file(path, rewrite=True)
    assert path.read_text(encoding="utf-8") == GOOD
    script.check_file(path)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("register 1 req t=0\n----\n", 1, "register: missing argument 'blocks'"),
    ("\n# c\nregister 1 req blocks=0 t=soon\n----\n", 3, "register: t='soon' is not an integer of milliseconds"),
    ("done d0 1\n----\nok\n\ndone d0 1 colour=red\n----\n", 5, "done: unknown argument 'colour'"),
    ("done d0 1 2\n----\n", 1, "done: unexpected argument '2'"),
    ("done d0 1\nok\n", 1, "the command 'done d0 1' must be followed by a '----' line"),
    ("done d0 1", 1, "must be followed by a '----' line"),
    ("----\nok\n", 1, "'----' without a command before it"),
    ("admit r1 1\n----\n", 1, "unknown command 'admit' for the ledger"),
    ("config lease=3\n----\n", 1, "config: unknown key 'lease'"),
    ("config initial_lease=soon\n----\n", 1, "config: initial_lease='soon' is not a number"),
    ("abort 'req\n----\n", 1, "cannot split"),
    ("release d0 1,x\n----\n", 1, "release: h='1,x' is not comma-separated integers"),
])
def test_a_malformed_line_names_the_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(script.ScriptError) as err:
        script.parse(text, "p/ledger/bad.txt", "ledger")
    assert str(err.value).startswith(f"p/ledger/bad.txt:{line}: ")
    assert message in str(err.value)


def test_an_invalid_config_names_the_line_and_the_rule() -> None:
    text = "tick 0\n----\nok\n\nconfig abort_grace=1\n----\nok\n"
    with pytest.raises(script.ScriptError, match=r"^x.txt:5: config: abort_grace \(1\) must be >="):
        script.run_text(text, "ledger", "x.txt")


def test_a_consumer_flag_must_be_true_or_false() -> None:
    with pytest.raises(script.ScriptError, match=r"^c.txt:1: read_failed: fenced='yes' is not true or false"):
        script.parse("read_failed r1 fenced=yes\n----\n", "c.txt", "consumer")


def test_an_unknown_machine_is_refused() -> None:
    with pytest.raises(script.ScriptError, match="unknown machine 'router'"):
        script.parse("tick 0\n----\nok\n", "router/x.txt", "router")


def test_script_time_is_integer_milliseconds() -> None:
    """One helper turns script milliseconds into the machines' time; rendering inverts it."""
    ledger = script.LedgerDriver()
    assert ledger.run("register", {"h": 1, "rid": "r", "blocks": (0,), "group": None,
                                   "expected": 1, "t": 1500}) == [
        "h1: unregistered -> registered deadline=31500 expected=1"]
    assert ledger.ledger.now == script.machine_time(1500)
    assert ledger.run("tick", {"t": 31499}) == ["ok"]
    assert ledger.run("tick", {"t": 31500})[0].startswith("free h1 r expired")


def test_describe_renders_every_effect_kind_on_one_line() -> None:
    from kvproto.lifecycle import (
        Ack,
        DropPeer,
        Finished,
        Free,
        PostRead,
        Rejected,
        SendDone,
        SendHeartbeat,
        SendRelease,
        StartHandshake,
    )
    effects: list[object] = [
        Free(1, "r", "expired", (0, 1), (1,), 30_000), Ack("d0", 2, 20_000, (3,), (4,)),
        Rejected("bad_magic", "d0", None, "b'XX' at 0"), StartHandshake("P0"),
        PostRead("r", "P0", 1, (4,), 2), SendDone("r", "P0", 1, 2), SendRelease("r", "P0", 1, 2),
        SendHeartbeat("P0", 3, (1, 2), 1), Finished("r", "done", "pulled"),
        DropPeer("P0", "no ack for 8.000s")]
    assert script.describe(effects).splitlines() == [
        "free h1 r expired blocks=0,1 reclaimed=1 deadline=30000",
        "ack d0 seq=2 term=20000 refused=3 pending=4",
        "rejected bad_magic peer=d0 detail=\"b'XX' at 0\"",
        "start_handshake P0",
        "post_read r P0 h1 blocks=4 expected=2",
        "send_done r P0 h1 expected=2",
        "send_release r P0 h1 expected=2",
        "send_heartbeat P0 seq=3 h=1,2 expected=1",
        "finished r done pulled",
        "drop_peer P0 reason=\"no ack for 8.000s\"",
    ]
    with pytest.raises(TypeError):
        script.describe(object())


@pytest.mark.parametrize(("mutant", "story"), [
    ("count_messages", "readers"),
    ("abort_frees_now", "abort"),
    ("no_staging", "staging"),
    ("stopping_sweep", "leases"),
])
def test_the_scripts_catch_every_known_upstream_bug(mutant: str, story: str) -> None:
    """Each mutant of ``kvproto.testing.mutants`` re-introduces a known upstream bug: the
    script that tells the story the bug breaks no longer matches."""
    from kvproto.testing.mutants import MUTANTS

    result = script.run_file(TESTDATA / "ledger" / f"{story}.txt", MUTANTS[mutant].ledger_cls)
    assert not result.ok


def test_the_consumer_scripts_catch_a_release_under_an_in_flight_read() -> None:
    """A D that releases at once on an abort during its READ (P would free under the READ):
    the abort story no longer matches."""
    from kvproto.lifecycle import D_ABORT, D_FAILED, READING, Consumer, Fx, Transition

    mutant = Consumer.with_rows(Transition(
        READING, D_ABORT, "in_flight", D_FAILED,
        (Fx("send_release"), Fx("disown"), Fx("finish", "aborted")), "bug: release now"))
    result = script.run_file(TESTDATA / "consumer" / "abort.txt", mutant)
    assert [b.text for b, _ in result.mismatches][:1] == ["abort r1 t=1500"]
