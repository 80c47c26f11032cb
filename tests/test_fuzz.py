"""Stateful fuzzing of P, D and the network with hypothesis.

* The CI-profile run of ``kvproto.testing.fuzz.LifecycleMachine`` over the real ``Ledger`` finds
  nothing: every rule (register with shared blocks, several readers and sibling groups;
  admit/handshake/read/done/heartbeat/release; aborts on P and D; ticks; loss,
  duplication, reordering, delay; D crashes; malformed bytes) runs, the invariants hold
  after every step, and every example's teardown lets every lease and grace run out and
  finds no leak. The run also has to *exercise* each of those events (coverage counts),
  so a rule that silently stopped doing anything fails the test.
* The teardown's leak check is shown to catch a ledger that never expires anything.
* ``kvproto fuzz --examples N --seed S``: progress, exit 0 on the real ledger; with
  ``--mutant`` exit 1, the failing example saved (hypothesis database, its steps, and a
  P journal that ``kvproto replay`` reports as divergent).

The mutant-catching tests are in ``tests/test_mutants.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvproto.cli import main
from kvproto.lifecycle import (
    ABORT,
    DONE,
    FREED,
    HEARTBEAT,
    REGISTER,
    RELEASE,
    SIBLING,
    TERMINAL_STATES,
    TICK,
    Effect,
    Ledger,
)
from kvproto.testing import fuzz

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

# ---------------------------------------------------------------------------
# The CI profile over the real ledger
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ci_coverage() -> dict[str, int]:
    """Run the CI profile once over the real ledger; what it exercised."""
    fuzz.FuzzCounters.reset()
    fuzz.run_fuzz(fuzz.machine_class(Ledger), fuzz.ci_settings())
    cov = dict(fuzz.FuzzCounters.coverage)
    cov["examples"] = fuzz.FuzzCounters.examples
    cov["steps"] = fuzz.FuzzCounters.steps
    return cov


def test_ci_profile_on_the_real_ledger_finds_nothing(ci_coverage: dict[str, int]) -> None:
    # run_fuzz raised nothing: no invariant failed after any step, no teardown leaked.
    assert ci_coverage["examples"] >= fuzz.CI_EXAMPLES
    assert ci_coverage["steps"] >= 10 * fuzz.CI_EXAMPLES


@pytest.mark.parametrize("event", [REGISTER, DONE, RELEASE, HEARTBEAT, ABORT, TICK, SIBLING])
def test_ci_profile_exercises_every_p_event(ci_coverage: dict[str, int], event: str) -> None:
    changed = {k: n for k, n in ci_coverage.items()
               if k.startswith(f"{event}: ") and k.split(": ", 1)[1].split(" -> ")[0]
               != k.split(" -> ")[1]}
    assert changed, f"no {event} changed a request's state in the CI run"


@pytest.mark.parametrize("fault", ["lost", "duplicated", "crashes", "aborts_p", "aborts_d",
                                   "malformed", "siblings"])
def test_ci_profile_injects_every_fault(ci_coverage: dict[str, int], fault: str) -> None:
    assert ci_coverage.get(f"fault:{fault}", 0) > 0


def test_ci_profile_reaches_every_terminal_state_and_staging(
        ci_coverage: dict[str, int]) -> None:
    reached = {k.rsplit(" -> ", 1)[1] for k in ci_coverage if " -> " in k}
    assert set(TERMINAL_STATES) <= reached
    # Early notifications were staged and applied at register; malformed bytes reached
    # the decoder (not only rejected as from an unknown peer); D read and finished.
    assert ci_coverage.get("p:staged", 0) > 0
    assert ci_coverage.get("p:staged_applied", 0) > 0
    assert any(k.startswith("p:rejected:") and k != "p:rejected:unknown_peer"
               for k in ci_coverage)
    assert ci_coverage.get("d:done", 0) > 0


def test_ci_profile_runs_the_production_drivers(ci_coverage: dict[str, int]) -> None:
    """P and D run the drivers of the NIXL adapters: READs and stamp READs were posted and
    batched, late READs on reused blocks were fenced, D's port rejected bad bytes."""
    for name in ("data_reads", "stamp_reads", "fenced", "sent:done", "sent:heartbeat",
                 "sent:release", "handshakes"):
        assert ci_coverage.get(f"driver:{name}", 0) > 0, name
    for name in ("acks_sent", "handshakes", "rejected:unknown_peer"):
        assert ci_coverage.get(f"pdriver:{name}", 0) > 0, name
    assert any(k.startswith("driver:rejected:") for k in ci_coverage)
    assert ci_coverage.get("d:failed:fenced", 0) > 0
    assert ci_coverage.get("fault:malformed_d", 0) > 0 and ci_coverage.get("fault:reused", 0) > 0


# ---------------------------------------------------------------------------
# Teardown: no leaks, and the check bites
# ---------------------------------------------------------------------------


class NeverExpiresLedger(Ledger):
    """A broken ledger: time passes, but the expiry sweep (hook ``sweep``) frees nothing."""

    def sweep(self, now: int, out: list[Effect]) -> None:
        return None


def _orphan_a_request(machine: fuzz.LifecycleMachine) -> None:
    """Register a request on D0 whose transfer params the router loses: only P's lease
    can free it."""
    machine.register(engine="D0", nblocks=3, start=0, siblings=1, expected_known=True,
                     register_now=True, share=False, share_idx=0, on_time_mask=0)
    machine.drop_params(i=0)
    machine.check_safety()


def test_teardown_runs_every_lease_out_and_finds_everything_free() -> None:
    m = fuzz.machine_class(Ledger)()
    _orphan_a_request(m)
    sim = m.sim
    assert sim.pool.held_count == 3 and sim.ledger.held_requests == 1
    m.teardown()
    assert sim.pool.free_count == sim.pool.capacity and sim.pool.held_count == 0
    assert sim.ledger.held_requests == 0 and sim.ledger.staged_count == 0
    assert [sim.oracle.state(sim.ledger, h) for h in sim.oracle.registered] == ["expired"]


def test_teardown_reports_a_leak_when_nothing_expires() -> None:
    # With ExpiredFreed disabled, only the teardown's leak check can see it.
    m = fuzz.machine_class(NeverExpiresLedger, disabled={"ExpiredFreed"})()
    _orphan_a_request(m)
    with pytest.raises(fuzz.InvariantViolation) as info:
        m.teardown()
    assert info.value.invariant == "NoLeak"
    assert "1 requests / 3 blocks held" in info.value.detail


def test_expired_freed_catches_it_first_when_enabled() -> None:
    m = fuzz.machine_class(NeverExpiresLedger)()
    _orphan_a_request(m)
    with pytest.raises(fuzz.InvariantViolation) as info:
        m.teardown()
    assert info.value.invariant == "ExpiredFreed"


def test_a_done_request_is_freed_promptly() -> None:
    """The happy path through the rules: params, handshake, READ, done delivered."""
    m = fuzz.machine_class(Ledger)()
    m.register(engine="D1", nblocks=2, start=0, siblings=1, expected_known=True,
               register_now=True, share=False, share_idx=0, on_time_mask=0)
    for _ in range(4):
        if m.sim.progress_items():
            m.progress(picks=[0] * 8)
    assert [m.sim.oracle.state(m.sim.ledger, h) for h in m.sim.oracle.registered] == [FREED]
    assert m.sim.pool.held_count == 0 and m.sim.stats.completed == 2
    m.teardown()


# ---------------------------------------------------------------------------
# kvproto fuzz
# ---------------------------------------------------------------------------


def _last_json(out: str) -> dict[str, object]:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out
    result: dict[str, object] = json.loads(lines[-1])
    return result


def test_cli_fuzz_real_ledger_shows_progress_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["fuzz", "--examples", "40", "--seed", "3", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    assert "[fuzz] Ledger: up to 40 examples" in err
    assert re.search(r"\[fuzz\] done: \d+ examples \([\d.]+/s\), \d+ steps", err)
    res = _last_json(out)
    assert res["ok"] is True and res["ledger"] == "Ledger"
    assert isinstance(res["examples"], int) and res["examples"] >= 40
    assert isinstance(res["steps_per_s"], float) and res["steps_per_s"] > 0
    assert not list(tmp_path.glob("failing-*"))


def test_cli_fuzz_mutant_exits_1_and_saves_a_replayable_failure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--examples", "200", "--seed", "0", "--mutant", "abort_frees_now",
            "--out", str(tmp_path)]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    res = _last_json(out)
    assert res["ok"] is False and res["ledger"] == "AbortFreesNowLedger"
    assert res["invariant"] in {"NoFreeUnderRead", "LegalTransition"}
    assert "kvproto fuzz: FAILED" in err and "state.abort_p(" in err
    # The hypothesis example database holds the failing example...
    db = tmp_path / "hypothesis-db"
    assert db.is_dir() and any(p.is_file() for p in db.rglob("*"))
    # ...its steps are saved...
    steps = (tmp_path / "failing-seed0.txt").read_text(encoding="utf-8")
    assert steps.startswith(f"{res['invariant']}: ") and "state.abort_p(" in steps
    # ...and the P journal of that example, which replay reports as not what the real
    # machine does.
    journal = tmp_path / "failing-seed0.jsonl"
    assert str(journal) == res["journal"]
    header = json.loads(journal.read_text(encoding="utf-8").splitlines()[0])
    assert header["meta"]["ledger"].endswith("AbortFreesNowLedger")
    assert main(["-q", "replay", str(journal)]) == 1
    rerr = capsys.readouterr().err
    assert "DIVERGED" in rerr or "VIOLATION" in rerr

    # A rerun with the same --out replays the saved example first: caught at once.
    assert main([*argv[:2], "1", *argv[3:]]) == 1
    out2, _ = capsys.readouterr()
    res2 = _last_json(out2)
    assert res2["ok"] is False and res2["invariant"] == res["invariant"]


def test_cli_fuzz_journal_of_the_real_ledger_replays_clean(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The journal the fuzzer records is faithful: for the real ledger it replays."""
    machine = fuzz.machine_class(Ledger, journal=True)
    lines: list[str] = []
    for seed in range(1, 9):  # the last example of a short run may have no P event
        fuzz.run_fuzz(machine, fuzz.ci_settings(max_examples=5), seed=seed)
        assert machine.last_journal is not None
        lines = machine.last_journal.getvalue().splitlines()
        if len(lines) > 1:
            break
    assert len(lines) > 1
    path = tmp_path / "ok.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["-q", "replay", str(path)]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv", [
    ["--examples", "0"],
    ["--steps", "0"],
    ["--mutant", "no_such_mutant"],
])
def test_cli_fuzz_usage_errors_exit_2(argv: list[str], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["fuzz", *argv, "--out", str(tmp_path)])
    except SystemExit as e:  # numbers out of range are refused by the argument parser
        rc = e.code if isinstance(e.code, int) else -1
    assert rc == 2
    err = capsys.readouterr().err
    assert "kvproto fuzz:" in err and len(err.strip().splitlines()) == 1
