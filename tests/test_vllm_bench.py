"""``kvproto bench vllm``: the report builder and the argument checks (no engines started;
the benchmark itself runs real engines for minutes and is run by hand, see BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from kvproto import cli
from kvproto.bench.vllm import (
    ConnectorRun,
    add_arguments,
    build_report,
    format_report,
    refusal_note,
    refused_in_log,
    topologies,
)


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


@pytest.mark.parametrize("argv", [["--p-tp", "0"], ["--d-tp", "1,x"], ["--p-tp", "9"],
                                  ["--d-tp", ""], ["--path", "nope"], ["--late", "-1"],
                                  ["--kill", "-1"]])
def test_new_flags_usage_errors_exit_2(argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc: int | str | None
    try:
        rc = cli.main(["bench", "vllm", *argv])
    except SystemExit as e:   # argparse's own errors (one line: the CLI's Parser)
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvproto bench vllm:"), err


def test_flags_parse_into_topologies() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--path", "server", "--p-tp", "1,2", "--d-tp", "2,1,2"])
    assert args.path == "server"
    assert topologies(args.p_tp, args.d_tp) == [(1, 2), (1, 1), (2, 2), (2, 1)]
    default = ap.parse_args([])
    assert default.path == "offline" and topologies(default.p_tp, default.d_tp) == [(1, 1)]
    with pytest.raises(ValueError, match="--d-tp"):
        topologies("1", "0")


def test_refused_and_failed_topologies_are_reported_not_raised() -> None:
    assert refusal_note(ConnectorRun(), 2, 1) is None
    note = refusal_note(ConnectorRun(refused=3), 2, 1)
    assert note is not None and "P TP 2 -> D TP 1" in note and "3 request" in note
    ok = build_report({"stock": _run(0, 0, [100.0]), "kvproto": _run(0, 0, [110.0])},
                      meta={"p_tp": 1, "d_tp": 1, "path": "offline"})
    k = _run(0, 0, [80.0])
    k.refused = 64
    hetero = build_report({"stock": ConnectorRun(failed="engines failed to start: boom"),
                           "kvproto": k},
                          meta={"p_tp": 2, "d_tp": 1, "kvproto_refused": note})
    assert hetero["kvproto"]["refused_requests"] == 64
    assert hetero["stock"]["failed"].endswith("boom") and hetero["throughput_ratio"] is None
    text = format_report({"topologies": [ok, hetero], "model": "llama"})
    assert "P TP 1 -> D TP 1" in text and "P TP 2 -> D TP 1" in text, text
    assert note in text and "stock: engines failed to start: boom" in text, text
    assert "1.1" in text   # the first topology's ratio
    json.dumps({"topologies": [ok, hetero]})


def test_server_client_reads_streamed_token_ids_and_errors() -> None:
    """The server path's client against a fake OpenAI server (aiohttp, this process):
    token ids from every event, the first token's time, an HTTP error and an error
    event each counted as an error."""
    aiohttp = pytest.importorskip("aiohttp")
    pytest.importorskip("httpx")
    import asyncio

    from aiohttp import web

    from kvproto.bench.vllm_serve import _round
    from kvproto.vllm.harness import free_port

    seen: list[dict[str, object]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        prompt = body["prompt"]
        if prompt == [9]:
            return web.json_response({"error": {"message": "bad"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if prompt == [8]:
            await resp.write(b'data: {"error": {"message": "decode server gone"}}\n\n')
        else:
            for t in prompt:
                ev = {"choices": [{"text": f" w{t}", "token_ids": [t, t + 1]}]}
                await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            answers, t0 = await _round(f"http://127.0.0.1:{port}",
                                       {"a": [5, 7], "b": [9], "c": [8]}, 4)
        finally:
            await runner.cleanup()
        assert answers["a"].tokens == [5, 6, 7, 8] and not answers["a"].error
        assert answers["a"].t_first is not None and answers["a"].t_first >= t0
        assert answers["b"].error.startswith("HTTP 400") and answers["b"].tokens == []
        assert answers["c"].error == "decode server gone"
        assert all(b["stream"] is True and b["temperature"] == 0.0
                   and b["return_token_ids"] is True and b["max_tokens"] == 4 for b in seen)

    assert aiohttp is not None
    asyncio.run(run())


def test_refusals_are_counted_from_ds_log(tmp_path: pathlib.Path) -> None:
    """One count per request D's worker ended before any READ, with the first reason;
    warm-up requests, other lines and a missing log count nothing."""
    d_log = tmp_path / "D.log"
    d_log.write_text(
        "INFO engine started\n"
        "WARNING kvproto: request r0-1: P TP 2 -> D TP 1: head slices; recompute\n"
        "WARNING kvproto: request r0-2: P TP 2 -> D TP 1: head slices; recompute\n"
        "WARNING kvproto: request r0-2: P TP 2 -> D TP 1: head slices; recompute\n"
        "WARNING kvproto: request kvproto-warm-r0-0: P TP 2 -> D TP 1: head slices; x\n"
        "INFO kvproto: request r0-3 pulled\n")
    assert refused_in_log(d_log) == (2, "P TP 2 -> D TP 1: head slices")
    assert refused_in_log(tmp_path / "none.log") == (0, "")
    run = ConnectorRun(refused=2)
    note = refusal_note(run, 2, 1, "P TP 2 -> D TP 1: head slices")
    assert note is not None and "(P TP 2 -> D TP 1: head slices)" in note
