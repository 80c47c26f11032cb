"""`kvproto bench ledger` prints the documented figures. Behaviour only: no timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvproto import cli
from kvproto.bench.ledger import (
    BLOCKS,
    OwningReference,
    ScanReference,
    _FloorReq,
    bench_churn,
    bench_d_floor,
    bench_d_lease_loss,
    bench_heartbeat_bytes,
    bench_mass_expiry,
    bench_memory,
)
from kvproto.lifecycle import Config, Consumer, TransferParams


def test_bench_ledger_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-q", "bench", "ledger", "--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in ("events_per_s", "tick_us", "scan_tick_us", "bytes_per_request",
                "heartbeat_bytes_per_id", "worst_tick_ms_1e5", "worst_tick_ms_1e6",
                "unbounded_tick_ms_1e5", "heap_entries_over_live", "peak_heap_entries_churn",
                "peak_heap_entries_no_compaction", "tick_budget", "d_worst_tick_ms_1e5",
                "d_worst_tick_ms_1e6", "d_unbounded_tick_ms_1e5", "d_unbounded_tick_ms_1e6",
                "d_tick_ratio_1e5", "d_tick_ratio_1e6", "d_loss_ticks_1e5", "gate_cost_ratio",
                "gate_cost_ratio_register", "gate_cost_ratio_heartbeat", "gate_cost_ratio_done",
                "owning_reference_events_per_s", "owning_reference_ratio",
                "owning_reference_cpu_ratio", "events_ratio_owning", "d_floor_us", "d_over_floor"):
        assert key in res, key
    assert res["d_loss_ticks_1e5"] > 1  # the budget spread the losses over several ticks
    assert set(res["tick_us"]) == set(res["scan_tick_us"]) == {"1000", "10000"}
    assert res["events_per_s"] > 0 and res["bytes_per_request"] > 0


def test_heartbeat_wire_bytes_per_id_beat_the_upstream_string_format() -> None:
    hb = bench_heartbeat_bytes(inflight=2000, window=20_000)
    assert hb["heartbeat_bytes_per_id"] <= 12
    assert hb["upstream_heartbeat_bytes_per_id"] > 30


def test_memory_figure_counts_ledger_structures() -> None:
    mem = bench_memory(2000)
    # A held request costs its record, index entries and heap entry: well above zero,
    # and (documented target) within 400 bytes.
    assert 100 < mem["bytes_per_request"] <= 400


def test_scan_reference_is_a_faithful_baseline() -> None:
    ref = ScanReference(lease=10.0, extension=5.0)
    ref.register("a", 0.0)
    ref.register("b", 0.0)
    ref.heartbeat(["a"], 8.0)
    assert ref.tick(10.0) == ["b"]
    assert ref.tick(13.0) == ["a"]


@pytest.mark.parametrize("repeat", ["0", "-3", "x", "1e3"])
def test_bench_ledger_refuses_a_bad_repeat(repeat: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # argparse's usage error: exit 2, one line
        cli.main(["bench", "ledger", "--repeat", repeat])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--repeat" in err and "Traceback" not in err


@pytest.mark.parametrize("claim", [True, False], ids=["claim", "no_claim"])
def test_d_floor_returns_the_effects_d_returns_for_the_same_events(claim: bool) -> None:
    """``d_floor_us`` is a floor only if the inline loops do D's work: every event's
    effects equal the machine's for the same requests, batches and times (1,100
    requests: three batches)."""
    n = 1100
    floor: list[list[object]] = []
    bench_d_floor(n, claim=claim, collect=floor)
    c = Consumer("d0", Config())
    c.handshake_result("P0", True, 0)
    params = [TransferParams("P0", 1, h, BLOCKS, 30_000, capability="ab" * 16 if claim else "")
              for h in range(n)]
    machine: list[list[object]] = []
    for i in range(0, n, 512):
        part, now = range(i, min(n, i + 512)), 1 + i // 512
        machine += [c.admit(f"r{k}", params[k], now) for k in part]
        if claim:
            machine += [c.claim_result(f"r{k}", True, now) for k in part]
        machine += [c.schedule(f"r{k}", now) for k in part]
        machine += [c.read_result(f"r{k}", True, now, notif_attached=False) for k in part]
    assert len(floor) == len(machine) == (4 if claim else 3) * n
    assert floor == machine
    assert not c.reqs and c.finished == {"done:pulled": n}
    # The floor's request record has the slots of the one D keeps.
    c.admit("x", TransferParams("P0", 1, n, BLOCKS, 30_000), n)
    assert sorted(_FloorReq.__slots__) == sorted(type(c.reqs["x"]).__slots__)


def test_bench_ledger_d_only_reports_d_its_floor_and_a_baseline_tree(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--d-only --no-claim`` with this very tree as the baseline: the three events, the
    floor, the baseline's figures and the halving figure are all there."""
    tree = str(Path(__file__).resolve().parents[1])
    assert cli.main(["-q", "bench", "ledger", "--d-only", "--no-claim", "--quick",
                     "--baseline", tree]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["events"] == 3 and "d_claim_granted_us" not in res
    assert "baseline_d_claim_granted_us" not in res
    for key in ("d_admit_us", "d_schedule_us", "d_read_ok_us", "d_event_us", "d_floor_us",
                "d_over_floor", "baseline_d_event_us", "d_event_speedup",
                "baseline_half_over_floor"):
        assert res[key] > 0, key
    assert res["d_over_floor"] == pytest.approx(res["d_event_us"] / res["d_floor_us"], rel=0.01)


def test_bench_ledger_refuses_a_baseline_tree_it_cannot_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "kvproto").mkdir()
    (tmp_path / "kvproto" / "__init__.py").write_text("")  # no lifecycle package
    assert cli.main(["bench", "ledger", "--d-only", "--quick", "--baseline",
                     str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot run on that tree" in err and "Traceback" not in err
    assert cli.main(["bench", "ledger", "--no-claim", "--quick"]) == 2
    assert "--no-claim needs --d-only" in capsys.readouterr().err


def test_owning_reference_frees_each_request_once_on_its_last_done() -> None:
    """The owning baseline does the block work the ledger does for the same events: a
    request's blocks are released on its ``expected``-th done only, once, and the counts
    of blocks other requests still hold stay up."""
    ref = OwningReference(lease=10.0, extension=5.0, capacity=8)
    ref.register_blocks("a", BLOCKS, 0.0)
    ref.register_blocks("b", (4, 5), 0.0)
    ref.register_blocks("c", (0, 6), 0.0)
    assert ref.rc[:7] == [2, 1, 1, 1, 1, 1, 1]
    assert not ref.done("a", 2) and ref.freed == [] and ref.rc[0] == 2
    assert ref.done("a", 2) and ref.freed == [("a", BLOCKS)]
    assert ref.rc[:7] == [1, 0, 0, 0, 1, 1, 1]  # c still holds block 0
    assert ref.done("b", 1) and ref.freed[-1] == ("b", (4, 5)) and ref.rc[4:6] == [0, 0]
    assert "a" not in ref.deadlines and "a" not in ref.blocks and ref.tick(11.0) == ["c"]


def test_bench_wire_json_puts_decode_and_ledger_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-q", "bench", "wire", "--requests", "600", "--repeat", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for k in ("decode_done_us", "decode_done_reference_us", "ledger_done_us",
              "decode_heartbeat_us_per_id", "ledger_heartbeat_us_per_id",
              "done_decode_over_ledger", "heartbeat_decode_over_ledger",
              "encode_done_us", "encode_done_reference_us", "decode_done_batch_us_per_id",
              "encode_done_batch_us_per_id", "done_batch_decode_over_ledger"):
        assert r[k] > 0, k
    assert r["done_decode_over_ledger"] == pytest.approx(r["decode_done_us"] / r["ledger_done_us"],
                                                         rel=0.05, abs=0.002)
    assert r["requests"] == 600


def test_bench_wire_refuses_bad_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "wire", "--repeat", "0"]) == 2
    assert "--repeat" in capsys.readouterr().err


def test_mass_expiry_is_spread_over_ticks_by_the_budget() -> None:
    bounded = bench_mass_expiry(3000, 100)
    unbounded = bench_mass_expiry(3000, None)
    # 3000 due entries (1500 expire, 1500 are re-inserted) at 100 per tick.
    assert bounded["ticks"] == 30 and unbounded["ticks"] == 1
    assert bounded["lag_ms"] > 0 == unbounded["lag_ms"]


def test_d_lease_loss_is_spread_over_ticks_by_the_budget() -> None:
    bounded = bench_d_lease_loss(3000, 100)
    unbounded = bench_d_lease_loss(3000, None)
    # 3000 due entries (1500 lost, 1500 re-inserted) at 100 per tick.
    assert bounded["ticks"] == 30 and unbounded["ticks"] == 1
    assert bounded["lag_ms"] > 0 == unbounded["lag_ms"]


def test_churn_keeps_the_heap_compact_and_the_old_heap_would_not() -> None:
    held = bench_churn(20_000, 1000)
    assert held["entries_over_live"] <= 2 and held["rebuilds"] > 0
    assert bench_churn(5000, 0)["peak_heap_entries"] <= 64
    assert bench_churn(5000, 0, compact=False)["peak_heap_entries"] > 4000


def test_bench_fingerprint_compares_with_a_whole_read_and_cleans_up(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    assert cli.main(["-q", "bench", "fingerprint", "--gib", "0.02", "--files", "2",
                     "--dir", str(d), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["files"] == 3 and r["bytes"] >= 0.02 * (1 << 30)
    assert 0 < r["fingerprint_bytes_read"] < r["bytes"] // 100
    assert {"fingerprint_cold_s", "read_whole_cold_s", "ratio_cold", "fingerprint_warm_s",
            "read_whole_warm_s", "ratio_warm"} <= set(r)
    assert r["fingerprint"].startswith("sha256:")
    assert list(d.iterdir()) == []  # the checkpoint is deleted
    assert cli.main(["bench", "fingerprint", "--files", "0"]) == 2
