"""The chaos campaign: its notification fault shim, its verdict, and one seeded campaign on
real vLLM engines (``kvproto chaos --minutes 3``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvproto.nixl.faults import MAX_HELD, FaultConfigError, FaultRates, NotificationFaults
from kvproto.testing.chaos import FAULTS, Campaign, Streams, format_summary
from kvproto.vllm import harness as h


def _send_many(shim: NotificationFaults, n: int, engine: str = "P") -> list[bytes]:
    out: list[bytes] = []
    for i in range(n):
        out += shim("done", engine, i.to_bytes(4, "big"))
    return out


def test_faults_off_passes_everything_in_order() -> None:
    shim = NotificationFaults(FaultRates(seed=3))
    assert _send_many(shim, 100) == [i.to_bytes(4, "big") for i in range(100)]
    assert shim.counts["passed"] == 100


def test_faults_seeded_and_counted() -> None:
    rates = FaultRates(seed=7, drop=0.2, dup=0.2, delay=0.2)
    a, b = NotificationFaults(rates), NotificationFaults(rates)
    out_a, out_b = _send_many(a, 2000), _send_many(b, 2000)
    assert out_a == out_b                                  # one seed, one behaviour
    c = a.counts
    assert c["drop"] > 0 and c["dup"] > 0 and c["delay"] > 0
    sent = [int.from_bytes(x, "big") for x in out_a]
    # what was sent: every message not dropped, duplicates twice, minus those still held
    held = sum(len(q) for q in a._held.values())
    assert len(sent) == 2000 - c["drop"] + c["dup"] - held
    assert sent != sorted(sent)                            # delayed ones were reordered
    assert len(set(sent)) == 2000 - c["drop"] - held


def test_faults_hold_is_capped() -> None:
    shim = NotificationFaults(FaultRates(seed=1, delay=1.0))
    n = MAX_HELD + 10
    out = _send_many(shim, n)
    # the first MAX_HELD are held; the next one meets the cap and goes out with all of
    # them; the rest are held again
    assert shim.counts["held_cap"] == 1
    assert shim.counts["delay"] == n - 1
    assert len(out) == MAX_HELD + 1
    assert max(len(q) for q in shim._held.values()) <= MAX_HELD


@pytest.mark.parametrize("raw, msg", [
    ({"drop": 1.5}, "drop must be a probability"),
    ({"dup": -0.1}, "dup must be a probability"),
    ({"drop": 0.6, "dup": 0.6}, "at most 1"),
    ({"lose": 0.1}, "unknown keys"),
    ({"seed": "x"}, "seed must be"),
    ({"delay": True}, "delay must be"),
])
def test_fault_config_errors(raw: dict[str, object], msg: str) -> None:
    with pytest.raises(FaultConfigError, match=msg):
        FaultRates.parse(raw)


def test_connector_option_rejects_bad_faults() -> None:
    from kvproto.vllm.sched import ConnectorOptions

    with pytest.raises(ValueError, match="kvproto: test_faults: drop"):
        ConnectorOptions.parse({"test_faults": {"drop": 2}})
    opts = ConnectorOptions.parse({"test_faults": {"seed": 4, "dup": 0.1}})
    assert opts.test_faults == {"seed": 4, "dup": 0.1}
    assert ConnectorOptions.parse({}).test_faults is None


def test_verdict_flags_each_violation() -> None:
    ok = Campaign(seed=0, minutes=1.0, requests=5, finished=5, all_reclaimed=True,
                  journals={"P1.jsonl": "valid"})
    assert ok.clean
    for broken in (dict(wrong=["c1"]), dict(all_reclaimed=False), dict(crashes=["D1"]),
                   dict(hung=1), dict(journals={"P1.jsonl": "invalid: step 3"})):
        c = Campaign(seed=0, minutes=1.0, requests=5, finished=5, all_reclaimed=True,
                     journals={"P1.jsonl": "valid"})
        for k, v in broken.items():
            setattr(c, k, v)
        assert not c.clean, broken
        assert "VIOLATION" in format_summary(c.summary())
    assert "CLEAN" in format_summary(ok.summary())
    many = Campaign(seed=0, minutes=1.0, planned=["kill_p"] * 20, planned_total=25)
    row = [ln for ln in format_summary(many.summary()).splitlines()
           if ln.startswith("faults planned")]
    assert len(row) == 1 and row[0].split(None, 2)[2] == \
        f"25: {' '.join(['kill_p'] * 12)} ...", row
    replayed = Campaign(seed=0, minutes=1.0, requests=5, finished=5, all_reclaimed=True,
                        journals={"P1.jsonl": "valid", "D1.consumer.jsonl": "replayed",
                                  "D2.consumer.jsonl": "traced"})
    assert replayed.clean


def test_fault_stream_does_not_follow_the_load() -> None:
    """One seed, one fault sequence: draws on the load and target streams (a busier or
    idler machine submits more or fewer requests between faults) never move it."""
    quiet, busy = Streams(7), Streams(7)
    plan_quiet: list[tuple[float, str]] = []
    plan_busy: list[tuple[float, str]] = []
    for i in range(40):
        for _ in range(i % 3):
            quiet.load.choice("abc")
        for _ in range(50 + i):
            busy.load.choice("abc")
            busy.targets.random()
        plan_quiet.append(quiet.next_fault(12.0))
        plan_busy.append(busy.next_fault(12.0))
    assert plan_quiet == plan_busy
    assert {k for _, k in plan_quiet} == set(FAULTS)
    other = Streams(8)
    assert [other.next_fault(12.0) for _ in range(40)] != plan_quiet


@pytest.mark.parametrize("argv", [["--minutes", "0"], ["--concurrency", "x"],
                                  ["--seed", "-1"], ["--lease", "nan"]])
def test_cli_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvproto.cli import main

    with pytest.raises(SystemExit) as info:
        main(["chaos", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


def test_cli_progress_delay_with_the_stock_connector_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvproto.cli import main

    assert main(["chaos", "--connector", "stock", "--progress-delay-us", "50"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--progress-delay-us" in err[0] and "stock" in err[0]


@pytest.mark.vllm
def test_chaos_campaign_real_engines(tmp_path: Path) -> None:
    """Three minutes of seeded faults on a real P/D pair: 0 wrong outputs, every P block
    back after the last fault, no engine crash, every journal valid (TLC)."""
    from kvproto.vllm.harness import vllm_available

    missing = vllm_available()
    if missing:
        pytest.skip(missing)
    seed = int(os.environ.get("KVPROTO_CHAOS_SEED", "11"))
    # NIXL's progress threads sleep between passes, as in every engine test of the suite
    # (tests/conftest.py): their busy loops would take both cores of this machine for the
    # whole campaign
    delay = str(h.CONNECTOR_DEFAULTS.get("progress_delay_us", 0))
    proc = subprocess.run(
        [sys.executable, "-m", "kvproto.cli", "chaos", "--minutes", "3", "--seed", str(seed),
         "--progress-delay-us", delay, "--workdir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=1800)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    detail = json.dumps(res, indent=1) + proc.stderr[-2000:]
    assert res["requests"] > 0 and res["finished"] > 0, detail
    assert sum(res["faults_injected"].values()) > 0, detail
    # the faults drawn are the seed's own sequence, whatever the load was
    streams = Streams(seed)
    planned = res["faults_planned"]
    assert planned == [streams.next_fault(12.0)[1] for _ in planned], detail
    assert res["faults_planned_total"] == len(planned), detail
    assert sum(res["faults_injected"].values()) <= len(planned), detail
    assert sum(res["notification_faults"].values()) > 0, detail
    assert res["wrong_outputs"] == 0, detail
    assert res["all_reclaimed"] is True, detail
    assert res["engine_crashes"] == [] and res["hung"] == 0, detail
    # every journal allowed by TLC; a D journal spanning a P restart (TLC's KVConsumer
    # models one P engine) traced per P engine and replayed whole
    assert res["journals"] and all(v in ("valid", "traced")
                                   for v in res["journals"].values()), detail
    assert any(v == "valid" for v in res["journals"].values()), detail
    assert proc.returncode == 0, detail
    assert (tmp_path / "chaos.png").stat().st_size > 0
