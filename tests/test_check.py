"""``kvproto check``: TLC on the spec's models, the buggy models, and users' lease numbers.

Unit tests (no Java) cover the lease-number quantization, config loading, the CLI's
exit codes and the trace reader. The ``tlc`` tests run TLC: the CI model passes, every
buggy model fails with the property it is meant to break (a checker that cannot fail
proves nothing), and the lease check tells safe numbers from unsafe ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvproto.cli import main
from kvproto.lifecycle import Config
from kvproto.verify import check, tlc

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

# ---------------------------------------------------------------------------
# Lease numbers -> model time units.
# ---------------------------------------------------------------------------


def test_quantize_rounds_terms_down_and_delays_up() -> None:
    cfg = Config(initial_lease=7.0, lease_extension=5.5, abort_grace=7.9, heartbeat_interval=1.2,
                 max_delay=0.1, max_read_time=2.0, clock_drift=0.0)
    q = check.quantize(cfg, 2.0)
    assert q.units["InitialLease"] == 3 and q.units["LeaseExtension"] == 2
    assert q.units["AbortGrace"] == 3
    assert q.units["HeartbeatInterval"] == 1 and q.units["MaxDelay"] == 1
    assert q.units["MaxReadTime"] == 1 and q.units["ClockDrift"] == 0
    assert not q.exact
    assert check.quantize(Config(initial_lease=4, lease_extension=4, abort_grace=4,
                                 heartbeat_interval=2, max_delay=0, max_read_time=2,
                                 clock_drift=0), 2.0).exact


@pytest.mark.parametrize("cfg", [
    Config(),
    Config(initial_lease=10, lease_extension=8, heartbeat_interval=2, abort_grace=10,
           max_delay=0.5, max_read_time=3, clock_drift=0.25),
    Config(initial_lease=30, lease_extension=20, heartbeat_interval=5, abort_grace=10),
    Config(initial_lease=30, lease_extension=6, heartbeat_interval=5, abort_grace=30),
])
def test_choose_unit_keeps_every_timing_rule(cfg: Config) -> None:
    """The default unit never turns a safe config unsafe or the reverse, and keeps the
    model small."""
    q = check.quantize(cfg, check.choose_unit(cfg))
    assert check._rules(cfg, q) == check._rules(cfg)
    assert max(q.units["InitialLease"], q.units["LeaseExtension"], q.units["AbortGrace"]) \
        <= 4 * check.MAX_UNITS


def test_lease_cfg_text_substitutes_every_constant() -> None:
    q = check.quantize(Config(), check.choose_unit(Config()))
    text = check.lease_cfg_text(q)
    for const, v in q.units.items():
        assert f"    {const} = {v}\n" in text
    # The files hold what --lease-config computes for the default Config.
    assert text == check.MODELS["lease"].path.read_text()
    live = check.lease_cfg_text(check.live_quantize(Config()), "lease_live")
    assert live == check.MODELS["lease_live"].path.read_text()


def test_live_quantize_keeps_terms_positive() -> None:
    q = check.live_quantize(Config(initial_lease=100, lease_extension=10, abort_grace=100,
                                   heartbeat_interval=2, max_delay=0, max_read_time=1,
                                   clock_drift=0))
    assert q.units["InitialLease"] == 3 and q.units["LeaseExtension"] >= 1
    assert q.units["AbortGrace"] == 3


def test_load_lease_config_reads_json_toml_and_flags(tmp_path: Path) -> None:
    j = tmp_path / "lease.json"
    j.write_text(json.dumps({"initial_lease": 12, "lease_extension": 9}))
    c = check.load_lease_config(str(j), {"heartbeat_interval": 3.0})
    assert (c.initial_lease, c.lease_extension, c.heartbeat_interval) == (12, 9, 3.0)
    assert c.max_read_time == Config().max_read_time  # the rest keeps its default
    t = tmp_path / "lease.toml"
    t.write_text("initial_lease = 12\nabort_grace = 12\n")
    assert check.load_lease_config(str(t), {}).abort_grace == 12


@pytest.mark.parametrize("text, why", [
    ('{"initial_lease": 30, "lease_extention": 20}', "unknown config keys: lease_extention"),
    ('{"initial_lease": "30"}', "must be a finite number"),
    ('{"max_delay": -1}', "must be >= 0"),
    ('{"lease_extension": 0}', "must be > 0"),
    ("[1, 2]", "expected an object"),
    ("{not json", "not valid JSON"),
])
def test_load_lease_config_refuses_bad_files(tmp_path: Path, text: str, why: str) -> None:
    p = tmp_path / "lease.json"
    p.write_text(text)
    with pytest.raises(check.LeaseConfigError, match=why):
        check.load_lease_config(str(p), {})


# ---------------------------------------------------------------------------
# CLI without TLC.
# ---------------------------------------------------------------------------


def test_list_names_every_model_and_its_expectation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    for m in check.MODELS.values():
        assert m.name in out and m.cfg in out
        assert m.path.is_file(), m.path
    assert "must fail: NoFreeUnderRead" in out


@pytest.mark.parametrize("argv", [
    ["check", "--model", "ci", "--plan"],
    ["check", "ci", "--plan"],
])
def test_model_option_is_the_positional_model(argv: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``kvproto check --model ci`` checks what ``check ci`` does."""
    assert main(argv) == check.EXIT_OK
    assert capsys.readouterr().out.strip() == "would check ci (kvproto/tla/MC_ci.cfg)"


def test_model_option_repeats_and_dedups(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "ci", "--model", "live", "--model", "ci", "--plan"]) == check.EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[2] for ln in lines] == ["ci", "live"]


@pytest.mark.parametrize("argv", [
    ["check", "no_such_model"],
    ["check", "--model", "no_such_model"],
    ["check", "--model", "ci", "--lease-extension", "3"],
    ["check", "--lease-config", "/nonexistent/lease.json"],
    ["check", "ci", "--lease-extension", "3"],
    ["check", "--workers", "0"],
    ["check", "--initial-lease", "-1"],
    ["check", "--depth", "5", "ci"],
    ["check", "--seed", "1", "ci"],
    ["check", "--simulate", "0", "ci"],
    ["check", "--simulate", "10", "--initial-lease", "30"],
    ["check", "--simulate", "10", "live"],
    ["check", "--simulate", "10", "full", "bug_drop_early"],
])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(argv)
    except SystemExit as e:  # bad numbers are refused by the argument parser itself
        rc = e.code if isinstance(e.code, int) else -1
    assert rc == check.EXIT_USAGE
    err = capsys.readouterr().err
    assert "kvproto check:" in err and len(err.strip().splitlines()) == 1


def test_missing_java_exits_3(monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(tlc.ENV_JAVA, "/nonexistent/java")
    assert main(["-q", "check", "bug_count_messages"]) == check.EXIT_NO_JAVA
    assert "java not found" in capsys.readouterr().err


def test_missing_jar_exits_5(monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(tlc.ENV_JAR, "/nonexistent/tla2tools.jar")
    assert main(["-q", "check", "ci"]) == check.EXIT_NO_JAR
    assert "TLC jar not found" in capsys.readouterr().err


TRACE = """\
Error: Invariant NoFreeUnderRead is violated.
Error: The behavior up to this point is:
State 1: <Initial predicate>
/\\ pstate = [r1 |-> "registered"]
/\\ msgs = {}

State 2: <Receive line 3, col 1 to line 4, col 2 of module KVLifecycle>
/\\ pstate = [r1 |-> "freed"]
/\\ msgs = { [k |-> "done", rs |-> {"r1"}, d |-> "d1", age |-> 0, x |-> 0,
     ref |-> {}] }

2 states generated, 2 distinct states found, 0 states left on queue.
"""


def test_trace_reader_and_renderer() -> None:
    states = tlc.parse_trace(TRACE)
    assert [s.action for s in states] == ["Initial predicate", "Receive"]
    assert states[1].values["pstate"] == tlc.mk_fn({"r1": "freed"})
    (m,) = states[1].values["msgs"]  # type: ignore[misc]
    assert isinstance(m, tlc.Fn) and m["k"] == "done" and m["rs"] == frozenset({"r1"})
    text = tlc.render_trace(states)
    assert "pstate[r1]: registered -> freed" in text


def test_judge_tells_expected_from_unexpected() -> None:
    bug = check.MODELS["bug_count_messages"]
    ok = tlc.TlcResult("x", 0, "ok", distinct=10, depth=3)
    viol = tlc.TlcResult("x", 12, "violation", violated="NoFreeUnderRead", kind="invariant")
    other = tlc.TlcResult("x", 12, "violation", violated="Conservation", kind="invariant")
    assert check.judge(bug, viol, "").as_expected
    assert not check.judge(bug, ok, "").as_expected  # a bug the checker misses fails
    assert not check.judge(bug, other, "").as_expected
    assert check.judge(check.MODELS["ci"], ok, "").as_expected
    assert not check.judge(check.MODELS["ci"], viol, "").as_expected
    live = tlc.TlcResult("x", 13, "violation", violated="Temporal properties", kind="liveness")
    assert check.violated_name(live, "PROPERTY ReportedIsFreed\n") == "ReportedIsFreed"
    assert check.violated_name(live, "PROPERTY A B\n") == "Temporal properties"
    # The outcome (and so the JSON verdict) names the property, not TLC's generic phrase.
    drop = check.judge(check.MODELS["bug_drop_early"], live, "PROPERTY ReportedIsFreed\n")
    assert drop.as_expected and drop.violated == "ReportedIsFreed"
    assert check._outcome_json(drop)["violated"] == "ReportedIsFreed"
    assert check.judge(bug, viol, "").violated == "NoFreeUnderRead"
    assert check.judge(check.MODELS["ci"], ok, "").violated is None


# ---------------------------------------------------------------------------
# TLC.
# ---------------------------------------------------------------------------


def _tlc_or_skip() -> None:
    try:
        tlc.find_java()
        tlc.find_jar()
    except tlc.MissingDependency as e:  # pragma: no cover - depends on the machine
        pytest.skip(str(e))


@pytest.mark.tlc
def test_tlc_crash_is_reported_with_exit_4(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    broken = check.Model("broken", "MC_broken.cfg", "a config naming an undefined operator")
    monkeypatch.setitem(check.MODELS, "broken", broken)
    monkeypatch.setattr(check.Model, "path", property(lambda self: Path("/dev/null")))
    res = check.check_model(broken, cfg_text="INIT NoSuchInit\nNEXT Next\n")
    assert res.result.result == "error" and not res.as_expected
    assert "TLC exit code" in res.summary


@pytest.mark.tlc
@pytest.mark.parametrize("name", [m.name for m in check.MODELS.values() if m.expect])
def test_buggy_model_is_caught(name: str) -> None:
    """Each deliberately broken model must fail, with the property it breaks."""
    _tlc_or_skip()
    model = check.MODELS[name]
    o = check.check_model(model)
    assert o.result.result == "violation", o.summary
    assert o.as_expected, o.summary
    assert len(o.result.trace) >= 2  # a counterexample to read
    text = tlc.render_trace(o.result.trace)
    assert "Initial state" in text


@pytest.mark.tlc
@pytest.mark.parametrize("name", ["ci", "live", "faults"])
def test_model_passes(name: str) -> None:
    _tlc_or_skip()
    o = check.check_model(check.MODELS[name])
    assert o.result.result == "ok", o.summary + "\n" + tlc.render_trace(o.result.trace)
    assert o.result.distinct is not None and o.result.distinct > 100  # something was explored


@pytest.mark.tlc
def test_simulation_runs_the_model_too_large_to_exhaust(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--simulate`` on ``full`` (every fault with fan-in; no exhaustive run finishes on
    one machine): random behaviours, every invariant checked, a verdict that says it is
    not exhaustive, and the JSON names the simulation."""
    _tlc_or_skip()
    assert main(["-q", "check", "--simulate", "100", "--workers", "1", "--seed", "3",
                 "--json", "full"]) == check.EXIT_OK
    res = json.loads(capsys.readouterr().out)
    assert res["result"] == "ok" and res["as_expected"], res["summary"]
    assert res["simulation"] == {"behaviours": 100, "depth": 100, "seed": 3, "workers": 1}
    assert res["generated"] > 100  # states checked: more than one per behaviour
    assert "not exhaustive" in res["summary"]


@pytest.mark.tlc
@pytest.mark.parametrize("flag, seed", [("BugAbortFreesNow", 0), ("BugCountMessages", 2)])
def test_simulation_finds_a_bug_in_the_full_model(flag: str, seed: int) -> None:
    """The simulation can fail: ``full`` with one of its bug switches on breaks
    ``NoFreeUnderRead`` within its random behaviours (seed fixed, one worker), with a
    counterexample."""
    _tlc_or_skip()
    model = check.MODELS["full"]
    text = model.path.read_text()
    assert f"{flag} = FALSE" in text
    o = check.check_model(model, cfg_text=text.replace(f"{flag} = FALSE", f"{flag} = TRUE"),
                          workers=1, simulation=check.Simulation(100_000, 100, seed, 1))
    assert o.result.result == "violation" and o.violated == "NoFreeUnderRead", o.summary
    assert not o.as_expected and len(o.result.trace) >= 2


@pytest.mark.tlc
def test_simulation_of_the_bug_models_skips_the_temporal_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    assert main(["check", "--simulate", "300", "--workers", "1", "--bugs"]) == check.EXIT_OK
    cap = capsys.readouterr()
    temporal = [m.name for m in check.MODELS.values()
                if m.expect and check._properties(m.path.read_text())]
    assert temporal and all(n in cap.err.splitlines()[0] for n in temporal)
    for m in check.MODELS.values():
        if m.expect and m.name not in temporal:
            assert f"{m.name}: ok: the expected violation of {m.expect} was found" in cap.out


@pytest.mark.tlc
def test_cli_bugs_prints_counterexamples(capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    assert main(["-q", "check", "bug_abort_frees_now"]) == check.EXIT_OK  # expected: caught
    out = capsys.readouterr().out
    assert "expected violation of NoFreeUnderRead was found" in out
    assert "Abort" in out and "[Ledger.abort]" in out


@pytest.mark.tlc
def test_lease_check_accepts_the_default_config(capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    assert main(["check", "--json", "--lease-extension", "20"]) == check.EXIT_OK
    res = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["model"], r["result"]) for r in res] == [("lease", "ok"), ("lease_live", "ok")]
    assert res[0]["distinct"] > 1000  # the user's numbers, not a toy model


@pytest.mark.tlc
@pytest.mark.parametrize("overrides, broken", [
    # an abort grace shorter than the lease D holds: P frees under a READ D started in time
    ({"abort_grace": 10.0}, "NoFreeUnderRead"),
    # an extension that does not outlast a heartbeat period: live readers lose their lease
    ({"lease_extension": 5.0, "heartbeat_interval": 5.0, "max_delay": 0.0,
      "clock_drift": 0.0, "max_read_time": 2.5}, "RenewalKeepsLease"),
])
def test_lease_check_finds_unsafe_numbers(tmp_path: Path, overrides: dict[str, float],
                                          broken: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    p = tmp_path / "lease.json"
    p.write_text(json.dumps({**Config().to_dict(), **overrides}))
    cfg = replace(Config(), **overrides)
    with pytest.raises(Exception, match="must"):
        cfg.validate()  # kvproto itself would refuse these numbers, for this reason
    assert main(["check", "--lease-config", str(p)]) == check.EXIT_VIOLATION
    out = capsys.readouterr().out
    assert "would refuse these numbers" in out
    assert f"VIOLATION of {broken}" in out
    assert "counterexample" in out


@pytest.mark.tlc
def test_json_goes_to_stdout_and_progress_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    _tlc_or_skip()
    assert main(["check", "--json", "bug_abort_frees_now"]) == check.EXIT_OK
    cap = capsys.readouterr()
    (line,) = cap.out.splitlines()  # one JSON object per model, nothing else
    res = json.loads(line)
    assert res["as_expected"] and res["violated"] == "NoFreeUnderRead"
    assert res["trace"] and res["trace"][0]["action"] == "Initial predicate"
    assert "checking bug_abort_frees_now" in cap.err


@pytest.mark.tlc
def test_json_verdict_names_the_liveness_property(capsys: pytest.CaptureFixture[str]) -> None:
    """bug_drop_early breaks a temporal property; TLC's output does not name it, the cfg
    does, and the JSON verdict must carry that name."""
    _tlc_or_skip()
    assert main(["-q", "check", "--json", "bug_drop_early"]) == check.EXIT_OK
    res = json.loads(capsys.readouterr().out)
    assert res["kind"] == "liveness" and res["as_expected"]
    assert res["violated"] == "ReportedIsFreed"


# ---------------------------------------------------------------------------
# The safety models' VIEW (KVLifecycle.SafetyView) drops only history.
# ---------------------------------------------------------------------------

# Variables the view reads through an operator that keeps what a step can still read,
# and the one it leaves out (read only by a liveness property).
VIEW_OPERATORS = {"pstate": "EndedPState", "dst": "EndedDst", "owner": "LiveOwner",
                  "peer": "LivePeer", "groupsDone": "LiveGroupsDone", "hsSlow": "LiveHsSlow"}
VIEW_LEFT_OUT = {"reported"}


def _tla_variables(text: str) -> list[str]:
    decl = re.search(r"^VARIABLES\b(.*?)(?=^\S)", text, re.S | re.M)
    assert decl, "no VARIABLES block"
    body = re.sub(r"\\\*[^\n]*", "", decl.group(1))
    return re.findall(r"[A-Za-z]\w*", body)


def _safety_view_names(text: str) -> set[str]:
    m = re.search(r"^SafetyView ==\s*<<(.*?)>>\s*$", text, re.S | re.M)
    assert m, "no SafetyView"
    return {x.strip() for x in m.group(1).split(",")}


def test_safety_view_names_every_variable() -> None:
    """A variable added to the spec must reach the safety models' VIEW (raw, or through
    an operator that drops only its history): a variable the view forgets would merge
    states with different futures and hide bugs."""
    text = (tlc.spec_dir() / "KVLifecycle.tla").read_text()
    variables = _tla_variables(text)
    assert {"pstate", "dst", "msgs", "hsSlow", "reported"} <= set(variables)
    names = _safety_view_names(text)
    for v in variables:
        if v in VIEW_LEFT_OUT:
            assert v not in names
        else:
            assert VIEW_OPERATORS.get(v, v) in names, f"{v} is missing from SafetyView"
    assert len(names) == len(variables) - len(VIEW_LEFT_OUT)


# A small model in which every part the view drops varies: two requests in one sibling
# group (r2 registered late: groups transferred before it registers), one reader that
# starts without a handshake and may crash (hsSlow, a crashed reader's peer), one lost
# message (hsSlow no longer read), expiry and frees, done and failed pairs.
VIEW_MODEL = """\
CONSTANTS
    Requests = {"r1", "r2"}
    Readers = {d1}
    Blocks = {1, 2, 3}
    NoGroup = "none"
    BlocksOf <- MCBlocksOf
    GroupOf <- MCGroupOf
    RegExpected <- MCRegExpected
    ReadersOf <- MCReadersOf
    InitialLease = 3
    LeaseExtension = 3
    AbortGrace = 3
    HeartbeatInterval = 2
    MaxDelay = 0
    MaxReadTime = 2
    ClockDrift = 0
    MaxStaged = 2
    MaxStagedMsgs = 4
    MaxStagedAge = 3
    MaxLoss = 1
    MaxDup = 0
    MaxCrashes = 1
    MaxPAborts = 0
    MaxDAborts = 0
    MaxReadErrors = 0
    MaxHsFail = 1
    MaxPeerLost = 0
    PeerReadyAtStart = FALSE
    EarlyRequests = {"r2"}
    ExpiryMayLag = TRUE
    BugCountMessages = FALSE
    BugDropEarly = FALSE
    BugAbortFreesNow = FALSE
INIT Init
NEXT Next
INVARIANT TypeOK NoDoubleFree Conservation NoFreeUnderRead StagingBounded StaleIsHarmless RenewalKeepsLease
"""

_TERMINAL = {"expired", "freed"}
_ENDED = _TERMINAL | {"done", "failed"}


def _safety_view(state: tlc.Fn) -> tuple[object, ...]:
    """KVLifecycle.SafetyView of a dumped state, for MC.tla (one sibling group holding
    every request, every request pulled by every reader)."""
    s: Any = state
    crashed, dst, pstate = s["crashed"], s["dst"], s["pstate"]

    def ended(v: object) -> object:
        return "ended" if v in _ENDED else v

    def alive(d: object) -> bool:
        return d not in crashed

    hs = frozenset() if s["nLoss"] else frozenset(
        p for p in s["hsSlow"] if alive(p[1]) and pstate[p[0]] not in _TERMINAL
        and dst[p] in {"handshaking", "waiting", "reading"})
    owner = tuple((d, g, s["owner"][d][g] if any(dst[p] not in _ENDED for p in dst.keys()
                                                  if p[1] == d) else "none")
                  for d in s["owner"].keys() for g in s["owner"][d].keys())
    peer = tuple((d, s["peer"][d] if alive(d) else "unknown") for d in s["peer"].keys())
    unregistered = any(pstate[r] == "unregistered" for r in pstate.keys())
    groups_done = frozenset(g for g in s["groupsDone"] if unregistered)
    rest = tuple((k, s[k]) for k in s.keys()
                 if k not in VIEW_LEFT_OUT and k not in VIEW_OPERATORS)
    return (rest, hs, owner, peer, groups_done,
            tuple((r, ended(pstate[r])) for r in pstate.keys()),
            tuple((p, ended(dst[p])) for p in dst.keys()))


@pytest.mark.tlc
def test_safety_view_explores_every_reachable_view(tmp_path: Path) -> None:
    """The view is exact: TLC with VIEW SafetyView explores as many states as there are
    distinct views among all the states reachable without it. A view that merged states
    with different futures would cut some reachable views off (fewer with VIEW)."""
    _tlc_or_skip()
    dump = tmp_path / "states"
    full = tlc.require_ok(tlc.run_tlc("MC_view.cfg", cfg_text=VIEW_MODEL, workers=1,
                                      args=["-nowarning", "-dump", str(dump)]))
    blocks = re.split(r"^State \d+:\n", (tmp_path / "states.dump").read_text(), flags=re.M)
    states = [tlc.parse_state(b) for b in blocks[1:]]
    assert len(states) == full.distinct
    views = {_safety_view(s) for s in states}
    viewed = tlc.require_ok(tlc.run_tlc("MC_view.cfg", cfg_text=VIEW_MODEL + "VIEW SafetyView\n",
                                        workers=1))
    assert viewed.distinct == len(views)
    assert viewed.distinct < full.distinct // 2  # the history it drops is most of the states


@pytest.mark.tlc
@pytest.mark.parametrize("name", [m.name for m in check.MODELS.values()
                                  if m.expect and m.module == "MC"
                                  and "PROPERTY" not in m.path.read_text()])
def test_buggy_safety_model_is_caught_under_the_view(name: str) -> None:
    """The view hides no bug: each safety bug model of KVLifecycle (root module MC, where
    SafetyView lives) still fails, with the property it breaks, when TLC merges states by
    SafetyView."""
    _tlc_or_skip()
    model = check.MODELS[name]
    text = model.path.read_text()
    assert "VIEW" not in text
    o = check.check_model(model, cfg_text=text + "\nVIEW SafetyView\n")
    assert o.result.result == "violation" and o.as_expected, o.summary


def test_tlc_workers_env_sets_the_default_and_bad_values_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(tlc.ENV_WORKERS, "3")
    assert tlc.default_workers() == 3
    monkeypatch.delenv(tlc.ENV_WORKERS)
    assert 1 <= tlc.default_workers() <= 8
    for bad in ("0", "-1", "two", "", "1.5"):
        monkeypatch.setenv(tlc.ENV_WORKERS, bad)
        with pytest.raises(tlc.WorkersEnvError, match="KVPROTO_TLC_WORKERS"):
            tlc.default_workers()
        assert main(["check", "ci"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "KVPROTO_TLC_WORKERS" in err[0], err
    # an explicit --workers wins over the environment
    assert main(["check", "ci", "--workers", "1", "--plan"]) == 0
