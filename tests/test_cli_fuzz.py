"""No traceback from any CLI input or file.

Hypothesis fuzzes the command line (arguments of every subcommand, with hostile numbers
and strings) and journal files (raw bytes, and mutations of a real journal recorded by
``kvproto simulate``). Commands run in-process through ``kvproto.cli.main`` with their
output captured; every run must end with a documented exit code (0, 1 for a journal that
replays but diverges, 2 for a usage or input error) and print no traceback. A few real
subprocess runs check the same for the reported crashes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto import cli

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

NASTY = ["nan", "NaN", "inf", "-inf", "1e309", "-1", "0", "1e-9", "1e-300", "1e308", "-0",
         "", " ", "abc", "0x10", "1_000", "9" * 400, "\x00", "\udcff", "--", "-", "1.5", "2",
         "30", "0.001", "4294967.296", str(2**63), str(2**64)]
VALUE = st.one_of(st.sampled_from(NASTY), st.text(max_size=12),
                  st.floats(allow_nan=True, allow_infinity=True).map(repr),
                  st.integers(min_value=-(2**70), max_value=2**70).map(str))

# Options of each subcommand that take a value (flags without values come separately).
OPTIONS: dict[str, list[str]] = {
    "check": ["--lease-config", "--initial-lease", "--lease-extension", "--abort-grace",
              "--heartbeat-interval", "--max-delay", "--max-read-time", "--clock-drift",
              "--unit", "--workers", "--timeout"],
    "simulate": ["--seed", "--seeds", "--duration", "--capacity", "--journal"],
    "validate": ["--batch-bytes", "--timeout", "--keep"],
    "fuzz": ["--examples", "--steps", "--seed", "--config", "--mutant", "--out"],
    "demo": ["--seed", "--duration", "--requests", "--rate", "--block-kib", "--p-blocks",
             "--drop", "--dup", "--journal", "--plot", "--device"],
    "diagram": ["--side", "--format"],
}
FLAGS: dict[str, list[str]] = {
    "check": ["--all", "--bugs", "--json", "--raw", "ci", "faults", "nope"],
    "simulate": ["--no-faults", "--json"], "validate": [], "fuzz": ["--no-shrink"],
    "demo": ["--no-kill", "--json"], "diagram": ["--check-docs"],
}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """``kvproto.cli.main(argv)`` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse: --help (0) and usage errors (2)
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def assert_clean(rc: int, err: str, allowed: tuple[int, ...] = (0, 2)) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert "internal error" not in err, err[-3000:]
    assert rc in allowed, (rc, err[-3000:])
    if rc == 2:  # a user's mistake: one clear line
        assert err.strip(), "exit 2 without a message"


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    cmd = draw(st.sampled_from(sorted(OPTIONS)))
    argv = [cmd]
    for _ in range(draw(st.integers(0, 4))):
        if FLAGS[cmd] and draw(st.booleans()):
            argv.append(draw(st.sampled_from(FLAGS[cmd])))
        else:
            argv += [draw(st.sampled_from(OPTIONS[cmd])), draw(VALUE)]
    return argv


@FUZZ
@given(argvs())
def test_fuzzed_arguments_exit_0_or_2_without_a_traceback(argv: list[str]) -> None:
    if argv[0] == "check":
        # Everything up to running TLC: the arguments, the lease file, the quantization.
        rc, _, err = run_main([*argv, "--plan"])
        assert_clean(rc, err)
        return
    # Heavy commands (simulations, NIXL engines, fuzzing, TLC): parse and check the
    # arguments as main does, without running the command.
    out, errb = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errb):
        try:
            args = cli.build_parser().parse_args(argv)
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    assert_clean(rc, errb.getvalue())
    if rc == 0 and argv[0] == "diagram":
        rc, _, err = run_main(argv)
        assert_clean(rc, err, (0, 1, 2))
    elif rc == 0:
        for name in ("duration", "rate", "timeout"):  # what parsed is finite and positive
            v = getattr(args, name, None)
            assert v is None or 0 < v < float("inf")


def test_the_reported_bad_numbers_are_usage_errors() -> None:
    for argv in (["check", "--unit", "nan"], ["check", "--unit", "1e-9"],
                 ["check", "--timeout", "-1"], ["check", "--unit", "inf"],
                 ["check", "--initial-lease", "nan"], ["check", "--workers", "0"],
                 ["simulate", "--duration", "nan"], ["demo", "--drop", "2"],
                 ["validate", "--timeout", "inf", "x.jsonl"]):
        rc, _, err = run_main(argv)
        assert rc == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err


# ---------------------------------------------------------------------------
# Journal files.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_journal(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("fuzzj") / "sim.jsonl"
    rc, _, err = run_main(["-q", "simulate", "--seeds", "1", "--duration", "8",
                           "--json", "--journal", str(path)])
    assert rc == 0, err
    data = path.read_bytes()
    assert data.count(b"\n") > 20
    return data


@contextlib.contextmanager
def journal_file(data: bytes) -> Iterator[str]:
    fd, name = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        yield name
    finally:
        os.unlink(name)


def check_journal(data: bytes) -> None:
    with journal_file(data) as path:
        rc, _, err = run_main(["-q", "replay", path, "--no-effects"])
        assert_clean(rc, err, (0, 1, 2))
        if rc == 2:
            assert path in err and "line " in err, err
            # validate reads the same way: the same input error, before any TLC run.
            rc2, _, err2 = run_main(["-q", "validate", path])
            assert_clean(rc2, err2)
            assert rc2 == 2, err2


@FUZZ
@given(st.binary(max_size=2000))
def test_fuzzed_raw_bytes_journal(data: bytes) -> None:
    check_journal(data)


NASTY_JSON: list[Any] = [None, True, -1, 0, 2**64, 10**30, 1e308, -1e308, 1.5, "", "x" * 300,
                         [], {}, [[[[[[[[[[1]]]]]]]]]], {"type": "tick"}, "\udcff"]


def _mutate_value(obj: Any, path: list[int], value: Any) -> Any:
    """Replace one value somewhere in ``obj`` (chosen by ``path``) with ``value``."""
    if not path or not isinstance(obj, (dict, list)) or not obj:
        return value
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    k = keys[path[0] % len(keys)]
    obj[k] = _mutate_value(obj[k], path[1:], value)
    return obj


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    lines = data.split(b"\n")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["value", "value", "bytes", "flip", "drop", "dup", "swap",
                                   "truncate", "deep", "huge_capacity"]))
        if op == "value":
            try:
                obj = json.loads(lines[i])
            except ValueError:
                continue
            path = draw(st.lists(st.integers(0, 20), max_size=5))
            val = draw(st.sampled_from(NASTY_JSON))
            text = json.dumps(_mutate_value(obj, path, val), ensure_ascii=False,
                              allow_nan=True)
            lines[i] = text.encode("utf-8", errors="surrogatepass")
        elif op == "bytes":
            lines[i] = draw(st.binary(max_size=80))
        elif op == "flip":
            if lines[i]:
                j = draw(st.integers(0, len(lines[i]) - 1))
                b = bytearray(lines[i])
                b[j] = draw(st.integers(0, 255))
                lines[i] = bytes(b)
        elif op == "drop":
            del lines[i]
            if not lines:
                lines = [b""]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines = lines[:i + 1]
            lines[i] = lines[i][:draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        elif op == "deep":
            n = draw(st.sampled_from([9, 100, 5000, 200_000]))
            lines[i] = b"[" * n + b"]" * n
        else:
            header = json.loads(lines[0])
            header["capacity"] = draw(st.sampled_from([2**40, 10**12, 0, -5, 1.5, "many"]))
            lines[0] = json.dumps(header).encode()
    return b"\n".join(lines)


@FUZZ
@given(st.data())
def test_mutated_real_journal(real_journal: bytes, data: st.DataObject) -> None:
    check_journal(data.draw(mutated(real_journal)))


def test_the_real_journal_itself_replays_clean(real_journal: bytes) -> None:
    with journal_file(real_journal) as path:
        rc, _, err = run_main(["-q", "replay", path, "--no-effects"])
    assert rc == 0, err


# ---------------------------------------------------------------------------
# The reported crashes, as real processes.
# ---------------------------------------------------------------------------

HEADER = json.dumps({"kvproto_journal": 1, "config": {}, "capacity": 8, "meta": {}})
CASES = {
    "invalid_utf8": HEADER.encode() + b"\n{\"event\": \xff\xfe}\n",
    "deep_nesting": HEADER.encode() + b"\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "huge_capacity": json.dumps({"kvproto_journal": 1, "config": {},
                                 "capacity": 10**15}).encode() + b"\n",
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["replay", "validate"])
def test_bad_journal_in_a_real_process(tmp_path: Path, case: str, command: str) -> None:
    path = tmp_path / f"{case}.jsonl"
    path.write_bytes(CASES[case])
    proc = subprocess.run([sys.executable, "-m", "kvproto.cli", command, str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "line " in lines[0], proc.stderr


@pytest.mark.parametrize("argv", [["--unit", "nan"], ["--unit", "1e-9"], ["--timeout", "-1"],
                                  ["--lease-config", "BINARY"]])
def test_check_bad_numbers_in_a_real_process(tmp_path: Path, argv: list[str]) -> None:
    binary = tmp_path / "cfg.json"
    binary.write_bytes(b"\x00\xff\xfe\x80{{")
    argv = [str(binary) if a == "BINARY" else a for a in argv]
    proc = subprocess.run([sys.executable, "-m", "kvproto.cli", "check", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_fuzz_run_stopped_by_hand_says_how_far_it_got(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) ends a long ``kvproto fuzz`` run with exit 130, no traceback, and a
    last line that counts the examples and steps run without a failure."""
    import signal
    import time

    # A process started in the background of a non-interactive shell (as CI starts the
    # suite) inherits SIGINT ignored, and Python then never turns it into
    # KeyboardInterrupt; a terminal's Ctrl-C reaches a handled SIGINT, so the child
    # restores Python's handler first.
    start = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from kvproto.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.Popen(
        [sys.executable, "-c", start, "fuzz", "--examples", "1000000", "--seed", "5",
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None
        end = time.monotonic() + 120
        seen = ""
        while "examples (" not in seen and time.monotonic() < end:  # a progress line
            seen = proc.stderr.readline()
        assert "examples (" in seen
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    stopped = [ln for ln in err.splitlines() if ln.startswith("[fuzz] stopped, no check failed: ")]
    assert len(stopped) == 1 and " examples (" in stopped[0] and " steps (" in stopped[0], err
    assert err.strip().splitlines()[-1] == "kvproto: interrupted"
