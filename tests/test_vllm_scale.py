"""``kvproto bench scale`` scaled down: one P with one D and one P with two D (the same
real vLLM engines, KVProtoConnector), a dozen requests in flight, some abandoned at
their D. Asserts behaviour only: every output equals the single engine's, P gets every
block back, every journal passes ``kvproto validate``. Never wall-clock time.

The figures' arithmetic (stranded block-seconds, percentiles, the report) is tested
without engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproto import cli
from kvproto.bench import scale
from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()

LEASE = 10.0
REQUESTS = 12
DECODERS = 2


# ---------------------------------------------------------------------------- no engines


def test_stranded_counts_only_blocks_held_after_their_request_ended() -> None:
    st = scale.Stranded()
    st.add(10.0, {"a": 2, "b": 3}, {})                # first sample: nothing to integrate
    st.add(11.0, {"a": 2, "b": 3}, {"a": 10.5})       # a ended mid-interval: 2 * 0.5
    assert st.block_seconds == pytest.approx(1.0)
    st.add(13.0, {"a": 2, "b": 3}, {"a": 10.5})       # a a whole interval: 2 * 2
    assert st.block_seconds == pytest.approx(5.0)
    st.add(14.0, {"b": 3}, {"a": 10.5, "b": 14.0})    # a freed; b ends at the sample
    assert st.block_seconds == pytest.approx(5.0)
    st.add(15.0, {}, {"a": 10.5, "b": 14.0})          # b freed before the sample
    assert st.block_seconds == pytest.approx(5.0)
    assert st.peak == 5 and st.samples == 5
    assert st.abandoned_block_seconds == 0.0
    ab = scale.Stranded()
    ab.add(0.0, {"a": 1, "b": 1}, {})
    ab.add(2.0, {"a": 1, "b": 1}, {"a": 1.0, "b": 0.0}, {"b"})
    assert ab.block_seconds == pytest.approx(3.0) and ab.abandoned_block_seconds == 2.0


def test_percentile_nearest_rank() -> None:
    vals = [float(v) for v in range(1, 101)]
    assert scale.percentile(vals, 50) == 50.0
    assert scale.percentile(vals, 99) == 99.0
    assert scale.percentile([7.0], 99) == 7.0
    assert scale.percentile([], 50) == 0.0


def test_report_ratio_per_topology() -> None:
    def ph(tokens: int, wall: float) -> scale.Phase:
        p = scale.Phase(requests=10, tokens=tokens, wall_s=wall, ttft_ms=[1.0, 2.0, 30.0],
                        reclaimed=True)
        p.stranded.add(0.0, {"x": 4}, {})
        return p

    rep = scale.build_report({"stock": {"pair": [ph(100, 10.0)], "fanout": [ph(100, 5.0)]},
                              "kvproto": {"pair": [ph(100, 5.0)], "fanout": [ph(100, 5.0)]}},
                             meta={"journals_valid": True})
    assert rep["throughput_ratio"] == {"pair": 2.0, "fanout": 1.0}
    k = rep["kvproto"]["pair"]
    assert k["throughput_tok_s"] == 20.0 and k["ttft_ms_p50"] == 2.0
    assert k["ttft_ms_p99"] == 30.0 and k["peak_held_blocks"] == 4
    text = scale.format_report(rep)
    assert "stranded_block_seconds" in text and "kvproto fanout" in text
    alone = scale.build_report({"kvproto": {"pair": [ph(1, 1.0)]}})
    assert alone["throughput_ratio"] == {"pair": None, "fanout": None}


def test_rounds_merge_and_paired_ratio() -> None:
    def ph(tok_s: float, stranded: float, peak: int, ttft: float) -> scale.Phase:
        p = scale.Phase(requests=10, abandoned=1, tokens=int(tok_s), wall_s=1.0,
                        ttft_ms=[ttft], reclaimed=True)
        p.stranded.add(0.0, {"x": peak}, {})
        p.stranded.add(1.0, {"x": peak}, {"x": 1.0 - stranded / peak})
        return p

    stock = [ph(100, 1.0, 4, 10.0), ph(200, 3.0, 8, 20.0), ph(400, 2.0, 2, 30.0)]
    kv = [ph(110, 0.0, 4, 5.0), ph(180, 1.0, 4, 6.0), ph(480, 0.0, 4, 7.0)]
    kv[1].reclaimed = False
    rep = scale.build_report({"stock": {"pair": stock}, "kvproto": {"pair": kv}})
    s = rep["stock"]["pair"]
    assert s["requests"] == 30 and s["abandoned"] == 3 and s["tokens"] == 700
    assert s["throughput_tok_s"] == 200.0 and s["rounds_throughput_tok_s"] == [100, 200, 400]
    assert s["stranded_block_seconds"] == 2.0 and s["peak_held_blocks"] == 8
    assert s["ttft_ms_p50"] == 20.0 and s["ttft_ms_p99"] == 30.0 and s["reclaimed"]
    assert rep["kvproto"]["pair"]["reclaimed"] is False
    assert rep["throughput_ratio"]["pair"] == 1.1   # median of 1.1, 0.9, 1.2
    assert rep["throughput_ratio"]["fanout"] is None


def test_repin_moves_every_thread_of_a_process() -> None:
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert scale.repin(child.pid, 0) >= 1
        assert scale.main_thread_cores(child.pid) == [0]
    finally:
        child.kill()
        child.wait()
    assert scale.repin(child.pid, 0) == 0 and scale.main_thread_cores(child.pid) == []
    assert scale.engine_core(0) == (os.cpu_count() or 1) - 1 and scale.engine_core(1) == 0


def test_scale_specs_give_kvproto_engines_the_connector_defaults(tmp_path: Path) -> None:
    """kvproto's engines get ``harness.CONNECTOR_DEFAULTS`` under their own options, as
    ``pd_specs`` gives them (the suite sets a sleeping NIXL progress thread there);
    the stock connector's do not."""
    assert h.CONNECTOR_DEFAULTS.get("progress_delay_us") == 50  # tests/conftest.py
    for spec in scale.scale_specs("m", tmp_path, "kvproto", 2, 3.0):
        ec = spec.kv_transfer_config["kv_connector_extra_config"]
        assert ec["progress_delay_us"] == 50 and "lease" in ec and "journal" in ec
    for spec in scale.scale_specs("m", tmp_path, "stock", 2, 3.0):
        assert "progress_delay_us" not in spec.kv_transfer_config["kv_connector_extra_config"]


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--abandon-every", "1"],
                                  ["--connectors", "nope"], ["--sample", "0"],
                                  ["--rounds", "0"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "scale", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvproto bench scale:")


# ---------------------------------------------------------------------------- real engines


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")
def test_one_p_many_d_scaled_down(tmp_path: Path) -> None:
    model = str(h.build_tiny_model(tmp_path / "model").path)
    prompts = scale.prompts_for(REQUESTS, "q")
    specs = [h.EngineSpec("REF", model, env=h.engine_env(), log_path=str(tmp_path / "REF.log")),
             *scale.scale_specs(model, tmp_path, "kvproto", DECODERS, LEASE)]
    engines = h.start_engines(specs)
    try:
        ref, p, ds = engines[0], engines[1], engines[2:]
        reference = sc.reference_outputs(ref, prompts, max_tokens=4)
        ref.close()
        scale.pin(engines[1:])
        scale.warm_up(p, ds, "t", 4)
        phases = {}
        for top, use in (("pair", ds[:1]), ("fanout", ds)):
            tagged = {f"{top}-{k}": v for k, v in prompts.items()}
            ref_t = {f"{top}-{k}": v for k, v in reference.items()}
            phases[top] = scale.drive(p, use, tagged, ref_t, max_tokens=4, abandon_every=6,
                                      sample=0.1, drain=LEASE + 30.0, timeout=600.0)
        for top, ph in phases.items():
            assert ph.requests == REQUESTS and ph.abandoned == REQUESTS // 6, top
            assert ph.wrong == [], (top, ph.wrong)
            assert ph.errors == [], (top, ph.errors)
            assert ph.tokens == 4 * (REQUESTS - ph.abandoned), top
            assert ph.reclaimed and ph.held_left == 0, (top, ph.report())
            assert ph.stranded.peak > 0 and ph.stranded.samples >= 2, top
        # every D served some of the fan-out's requests
        for i, d in enumerate(ds):
            assert any(r.startswith("fanout-") for r in d.results), i
        st = p.connector_stats()
        assert st.get("held_requests", 0) == 0 and st.get("invariant_violations", 0) == 0
    finally:
        for e in engines:
            e.close()
    ok, last = scale.validate(scale.journals(tmp_path, DECODERS))
    assert ok, last


def test_engine_spec_refuses_an_unknown_worker_start() -> None:
    assert h.EngineSpec("F", "/m", worker_start="fork").worker_start == "fork"
    assert h.EngineSpec("S", "/m").worker_start == "spawn"  # vLLM's own on CPU
    with pytest.raises(h.HarnessError, match="worker_start='forkserver'"):
        h.EngineSpec("X", "/m", worker_start="forkserver")


def test_an_unmarked_test_cannot_start_an_engine_or_a_server(tmp_path: Path) -> None:
    """This test carries no `vllm` marker: starting an engine or `vllm serve` servers
    from it fails before any process starts, naming the test."""
    from conftest import UNMARKED, UnmarkedEngineTest

    from kvproto.testing import serve as sv

    assert UNMARKED and UNMARKED[0].endswith(
        "test_an_unmarked_test_cannot_start_an_engine_or_a_server")
    before = list(h.STARTED)
    with pytest.raises(UnmarkedEngineTest, match="not marked vllm"):
        h.Engine(h.EngineSpec("X", "/nonexistent", env={}))
    assert h.STARTED == before
    procs = sv.HasProcs()
    procs.procs = []
    with pytest.raises(UnmarkedEngineTest, match="starts `vllm serve` servers"):
        procs.start(tmp_path, [], 1.0)


@pytest.mark.vllm
def test_a_marked_test_may_start_engines() -> None:
    from conftest import UNMARKED

    assert UNMARKED == []
