"""``kvproto bench vllm``: the report builder and the argument checks (no engines started;
the benchmark itself runs real engines for minutes and is run by hand, see BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

from kvproto import cli
from kvproto.bench.vllm import ConnectorRun, build_report, format_report


def _run(wrong: int, late_wrong: int, tok_s: list[float], cpu: float = 1.0) -> ConnectorRun:
    return ConnectorRun(requests=64, wrong=wrong, errors=0, late_requests=4,
                        late_wrong=late_wrong, round_tok_s=tok_s, ttft_ms=[10.0, 30.0],
                        stranded_block_seconds=12.345, seconds_to_free=2.0,
                        round_cpu_ms_per_tok=[cpu, cpu * 2])


def test_report_has_the_issue_keys_and_ratio() -> None:
    rep = build_report({"stock": _run(0, 4, [100.0, 200.0, 300.0]),
                        "kvproto": _run(0, 0, [99.0, 190.0, 330.0], cpu=1.25)},
                       meta={"wall_s": 1.0})
    for name in ("stock", "kvproto"):
        e = rep[name]
        assert set(e) >= {"requests", "wrong_outputs", "throughput_tok_s", "ttft_ms_mean",
                          "stranded_block_seconds"}
        assert e["requests"] == 68 and e["ttft_ms_mean"] == 20.0
        assert e["stranded_block_seconds"] == 12.35
    assert rep["stock"]["wrong_outputs"] == 4 and rep["stock"]["late_d"]["wrong_outputs"] == 4
    assert rep["kvproto"]["wrong_outputs"] == 0
    assert rep["stock"]["throughput_tok_s"] == 200.0 and rep["kvproto"]["throughput_tok_s"] == 190.0
    assert rep["throughput_ratio_of_medians"] == 0.95
    assert rep["throughput_ratio"] == 0.99   # median of the paired 0.99, 0.95, 1.1
    assert rep["wall_s"] == 1.0
    assert rep["stock"]["cpu_ms_per_token"] == 1.5 and rep["cpu_efficiency_ratio"] == 0.8
    json.dumps(rep)   # one JSON object
    text = format_report(rep)
    assert "wrong_outputs" in text and "0.99" in text


def test_report_without_a_baseline_has_no_ratio() -> None:
    rep = build_report({"kvproto": _run(1, 0, [50.0])})
    assert rep["throughput_ratio"] is None and rep["kvproto"]["wrong_outputs"] == 1


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--connectors", "nope"],
                                  ["--lease", "5", "--late-delay", "4"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "vllm", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvproto bench vllm:")
