"""``kvproto bench vllm``: the same P/D workload through the stock NixlConnector and through
KVProtoConnector, in one run, on real vLLM engines (CPU build) over real NIXL.

Per connector: a P/D pair (separate processes) runs

* throughput rounds (after one uncounted warm-up): ``--prompts`` prompts of varied lengths, all in flight, ``--max-tokens``
  greedy tokens each; the rounds alternate between the two pairs so that both see the same
  machine load, and each round's throughput is D's generated tokens over the round's wall
  time (P's first submit to D's last token); TTFT is D's first token minus P's submit;
* the late-D scenario: P prefills, the router holds the transfer params ``--late-delay``
  seconds (longer than the ``--lease``) while P runs other requests over all its blocks,
  then D decodes. A fail-open connector decodes from reused blocks (upstream #52234);
* D killed -9 while it holds unread requests: P's blocks held above its idle baseline,
  integrated over time until P has them all back (``stranded_block_seconds``).

``--p-tp``/``--d-tp`` take comma-separated tensor parallel sizes: every (P, D) pair is
one topology, run in turn with both connectors against the same single-engine reference
(TP 1). A pair whose engines do not start is reported (``failed``) and the run goes on;
requests kvproto's D ends before any READ (a topology it does not serve) are counted
(``refused_requests``) and explained (``kvproto_refused``). ``--late 0``/``--kill 0``
skip those scenarios. ``--path server`` runs the throughput rounds over HTTP instead:
``vllm serve`` P and D behind the project's router (``kvproto.bench.vllm_serve``).

Every D output is compared token for token with a single engine that has no connector
(``wrong_outputs``). ``cpu_efficiency_ratio`` (stock/kvproto CPU time of P and D per
generated token, medians over rounds) is the figure other load on the machine disturbs
least. Progress goes to stderr; ``--json`` prints one JSON object on stdout:
``stock``, ``kvproto`` (``requests``, ``wrong_outputs``, ``errors``, ``throughput_tok_s``,
``ttft_ms_mean``, ``stranded_block_seconds``, ...) and ``throughput_ratio``
(kvproto/stock, median of the per-round ratios); with several topologies,
``{"topologies": [one such object per topology, with p_tp and d_tp]}``. Exit codes:
0 done, 1 kvproto served a wrong output, 2 bad arguments, 3 vLLM/NIXL missing, 4 the
reference engine failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
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
    topologies,
    topology_tag,
)

__all__ = ["CONNECTORS", "ConnectorRun", "Workload", "add_arguments", "build_report",
           "format_report", "refusal_note", "refused_in_log", "run", "topologies"]

log = logging.getLogger(__name__)

IDLE_S = 5.0   # seconds both pairs sit idle while their CPU use is measured
MODELS = ("llama", "hybrid")
PATHS = ("offline", "server")
HYBRID_WINDOW = 64  # tokens: the hybrid model's sliding window


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, default=32, help="prompts per throughput round (32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per prompt (32)")
    p.add_argument("--rounds", type=int, default=5,
                   help="throughput rounds per connector, alternating (5)")
    p.add_argument("--late", type=int, default=4,
                   help="requests in the late-D scenario (4; 0: no late-D scenario)")
    p.add_argument("--late-delay", type=float, default=10.0,
                   help="seconds D is late, > --lease (10)")
    p.add_argument("--lease", type=float, default=3.0, help="lease term, seconds (3)")
    p.add_argument("--kill", type=int, default=4,
                   help="requests held when D is killed (4; 0: no D-killed scenario)")
    p.add_argument("--connectors", default="stock,kvproto",
                   help="comma-separated subset of stock,kvproto (default both)")
    p.add_argument("--model", choices=MODELS, default="llama",
                   help="llama: one KV cache group; hybrid: layers alternating sliding-window "
                        f"({HYBRID_WINDOW} tokens) and full attention, two KV cache groups "
                        "under vLLM's hybrid allocator (default llama)")
    p.add_argument("--path", choices=PATHS, default="offline",
                   help="offline: engines driven through vLLM's LLM engine API, the harness "
                        "routing between them; server: `vllm serve` P and D per connector "
                        "with the project's router (examples/pd_router.py) in front, "
                        "requests over HTTP (default offline)")
    p.add_argument("--server-bind", choices=("cores", "none"), default="cores",
                   help="server path, TP 1: cores: P's threads on the last core, D's on the "
                        "first (as the serve tests run them); none: no binding and one "
                        "OpenMP thread per engine, as the offline path runs them (cores)")
    p.add_argument("--p-tp", default="1", metavar="N[,N...]",
                   help="P's tensor parallel sizes (1); every pair of --p-tp and --d-tp is "
                        "one topology, each run in turn with both connectors")
    p.add_argument("--d-tp", default="1", metavar="M[,M...]",
                   help="D's tensor parallel sizes (1)")
    p.add_argument("--workdir", help="keep model, engine logs and journals here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _extras(name: str, workdir: Path, lease: float, tag: str = "-bench") -> dict[str, Any]:
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    if name == "stock":
        return {"connector": h.STOCK_CONNECTOR, **sc.stock_extras(lease)}
    return {"connector": h.KVPROTO_CONNECTOR,
            **sc.kvproto_extras(str(workdir), lease, tag=tag)}


def workload(args: argparse.Namespace, workdir: Path, *, tokenizer: bool = False) -> Workload:
    """The model (written locally), the prompts, and the single-engine reference (TP 1,
    no connector; closed before any pair starts)."""
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    if args.model == "hybrid":
        tiny = h.build_tiny_model(workdir / "model-hybrid", layers=4,
                                  sliding_window=HYBRID_WINDOW)
    else:
        tiny = h.build_tiny_model(workdir / "model")
    if tokenizer:
        h.write_word_tokenizer(tiny.path, vocab=tiny.vocab)
    model = str(tiny.path)
    rounds = [{f"r{i}-{j}": p for j, p in enumerate(h.make_prompts(args.prompts, seed=100 + i))}
              for i in range(args.rounds)]
    late = {f"late-{j}": p for j, p in
            enumerate(h.make_prompts(args.late, seed=7, lengths=[64, 100, 160, 96]))}
    kill = {f"kill-{j}": p for j, p in
            enumerate(h.make_prompts(args.kill, seed=8, lengths=[90, 64, 250, 31]))}
    wl = Workload(model, rounds, late, kill)
    everything: dict[str, list[int]] = {}
    for r in rounds:
        everything.update(r)
    everything.update(late)
    log.info("reference outputs (one engine, no connector)")
    [ref] = h.start_engines([h.EngineSpec("REF", model, env=h.engine_env(),
                                          log_path=str(workdir / "REF.log"))])
    try:
        wl.reference = sc.reference_outputs(ref, everything, max_tokens=args.max_tokens)
    finally:
        ref.close()
    return wl


def _start_pair(args: argparse.Namespace, workdir: Path, model: str, name: str, p_tp: int,
                d_tp: int) -> Any:
    from kvproto.vllm import harness as h

    tag = f"-{name}{topology_tag(p_tp, d_tp)}"
    kw = _extras(name, workdir, args.lease, tag)
    connector = kw.pop("connector")
    p_spec, d_spec = h.pd_specs(model, workdir, connector, tag=tag, p_kv_bytes=16 << 20,
                                **kw)
    p_spec.tensor_parallel_size, d_spec.tensor_parallel_size = p_tp, d_tp
    if p_tp == d_tp == 1:
        p, d = h.start_engines([p_spec, d_spec])
        return h.PD(p, d)
    # one at a time: a TP engine is a process per rank on a small machine
    [p] = h.start_engines([p_spec], timeout=600)
    try:
        [d] = h.start_engines([d_spec], timeout=600)
    except BaseException:
        p.kill()
        raise
    return h.PD(p, d)


def _bench_topology(args: argparse.Namespace, workdir: Path, wl: Workload, p_tp: int,
                    d_tp: int) -> dict[str, Any]:
    from kvproto.vllm import scenarios as sc
    from kvproto.vllm.harness import HarnessError

    t_start = time.monotonic()
    names = tuple(n for n in CONNECTORS if n in args.connectors.split(","))
    runs = {name: ConnectorRun() for name in names}
    pairs: dict[str, Any] = {}
    why = ""
    try:
        for name in names:
            log.info("P TP %d -> D TP %d: starting the %s pair", p_tp, d_tp, name)
            try:
                pairs[name] = _start_pair(args, workdir, wl.model, name, p_tp, d_tp)
            except HarnessError as e:
                runs[name].failed = f"engines failed to start: {one_line(e)}"
                log.warning("%s: %s", name, runs[name].failed)
        live = [n for n in names if n in pairs]
        log.info("engines ready after %.0f s", time.monotonic() - t_start)
        for name in live:   # warm-up (first-use costs in both engines), not counted
            warm = {f"{name}-{WARM}{k}": v for k, v in list(wl.rounds[0].items())[:4]}
            pairs[name].run(warm, max_tokens=2)
        # idle cost: CPU the pairs use while holding nothing and serving nothing
        idle0 = {n: pairs[n].p.cpu_seconds() + pairs[n].d.cpu_seconds() for n in live}
        t_idle = time.monotonic()
        time.sleep(IDLE_S)
        for n in live:
            used = pairs[n].p.cpu_seconds() + pairs[n].d.cpu_seconds() - idle0[n]
            runs[n].idle_cpu_pct = 100.0 * used / (time.monotonic() - t_idle)
            log.info("%s: idle P+D use %.1f%% of a core", n, runs[n].idle_cpu_pct)
        for i, prompts in enumerate(wl.rounds):
            order = live if i % 2 == 0 else live[::-1]
            for name in order:
                tagged = {f"{name}-{k}": v for k, v in prompts.items()}
                ref_t = {f"{name}-{k}": v for k, v in wl.reference.items() if k in prompts}
                out = sc.correctness(pairs[name], tagged, ref_t, max_tokens=args.max_tokens)
                run = runs[name]
                run.requests += out.requests
                run.wrong += len(out.wrong)
                run.errors += len(out.errors)
                run.ttft_ms += out.ttft_ms
                run.round_tok_s.append(out.throughput_tok_s)
                if out.tokens:
                    run.round_cpu_ms_per_tok.append(1000.0 * out.extra["cpu_s"] / out.tokens)
                log.info("round %d %s: %.0f tok/s, %d wrong, %d errors", i, name,
                         out.throughput_tok_s, len(out.wrong), len(out.errors))
        for name in live if wl.late else ():
            tagged = {f"{name}-{k}": v for k, v in wl.late.items()}
            ref_t = {f"{name}-{k}": wl.reference[k] for k in wl.late}
            log.info("%s: late D (%.0f s late, lease %.0f s, P churning)", name,
                     args.late_delay, args.lease)
            out = sc.late_d(pairs[name], tagged, ref_t, max_tokens=args.max_tokens,
                            delay=args.late_delay, tag=name)
            runs[name].late_requests = out.requests
            runs[name].late_wrong = len(out.wrong)
            runs[name].late_errors = len(out.errors)
            log.info("%s: late D: %d of %d wrong, %d errors", name, len(out.wrong),
                     out.requests, len(out.errors))
        for name in live:
            pd = pairs[name]
            if name == "kvproto":
                for side, eng in (("P", pd.p), ("D", pd.d)):
                    try:
                        runs[name].counters[side] = {
                            k: v for k, v in eng.connector_stats().items()
                            if isinstance(v, (int, float)) and v}
                    except HarnessError as e:   # worker connectors in rank processes
                        log.info("kvproto: %s's connector counters unavailable: %s", side,
                                 one_line(e))
                d_log = Path(workdir / f"D-{name}{topology_tag(p_tp, d_tp)}.log")
                runs[name].refused, why = refused_in_log(d_log)
                runs[name].refused = max(runs[name].refused, int(
                    runs[name].counters.get("D", {}).get("tp_refused", 0)))
            if not wl.kill:
                continue
            log.info("%s: D killed with %d unread requests", name, len(wl.kill))
            out = sc.d_killed(pd, {f"{name}-{k}": v for k, v in wl.kill.items()},
                              timeout=max(60.0, 10 * args.lease))
            runs[name].stranded_block_seconds = float(out.extra["stranded_block_seconds"])
            runs[name].stranded_freed = bool(out.extra["freed"])
            runs[name].seconds_to_free = float(out.extra["seconds_to_free"])
            log.info("%s: %.1f stranded block-seconds, all freed: %s", name,
                     runs[name].stranded_block_seconds, out.extra["freed"])
    finally:
        for pd in pairs.values():
            pd.close()
    meta: dict[str, Any] = {"path": "offline", "p_tp": p_tp, "d_tp": d_tp,
                            "wall_s": round(time.monotonic() - t_start, 1)}
    if "kvproto" in runs:
        note = refusal_note(runs["kvproto"], p_tp, d_tp, why)
        if note:
            meta["kvproto_refused"] = note
    rep = build_report(runs, meta=meta)
    skipped = (() if wl.late else ("late_d",)) + (() if wl.kill else (
        "stranded_block_seconds", "stranded_all_freed", "seconds_to_free_after_d_kill"))
    if p_tp > 1 or d_tp > 1:
        # an engine's CPU time is its own process's: at TP > 1 the ranks' worker
        # processes are missing from it, so the CPU figures would mislead
        skipped += ("idle_cpu_pct", "cpu_ms_per_token")
        rep.pop("cpu_efficiency_ratio", None)
    for name in runs:   # a figure that was not measured is left out, not a zero
        for key in skipped:
            rep[name].pop(key, None)
    return rep


def _bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    server = args.path == "server"
    wl = workload(args, workdir, tokenizer=server)
    reports = []
    for p_tp, d_tp in topologies(args.p_tp, args.d_tp):
        if server:
            from kvproto.bench.vllm_serve import bench_topology
            reports.append(bench_topology(args, workdir, wl, p_tp, d_tp))
        else:
            reports.append(_bench_topology(args, workdir, wl, p_tp, d_tp))
    meta = {"model": args.model,
            "workload": {"prompts_per_round": args.prompts, "rounds": args.rounds,
                         "max_tokens": args.max_tokens, "late_requests": args.late,
                         "late_delay_s": args.late_delay, "lease_s": args.lease,
                         "kill_requests": args.kill},
            "cpu_count": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
            "wall_s": round(time.monotonic() - t_start, 1)}
    if len(reports) == 1:
        return {**reports[0], **meta}
    return {"topologies": reports, **meta}


def run_engines_bench(name: str, args: argparse.Namespace,
                      bench: Callable[[argparse.Namespace, Path], dict[str, Any]]
                      ) -> dict[str, Any] | int:
    """Run ``bench(args, workdir)`` for ``kvproto bench NAME``: in ``--workdir`` when given,
    else in a temporary folder. Its figures, or the exit code to return (3: vLLM missing,
    4: an engine failed), with one line on stderr saying why."""
    from kvproto.vllm.harness import HarnessError, vllm_available

    missing = vllm_available()
    if missing:
        print(f"kvproto bench {name}: {missing}", file=sys.stderr)
        return 3
    try:
        if args.workdir:
            wd = Path(args.workdir)
            wd.mkdir(parents=True, exist_ok=True)
            return bench(args, wd)
        with tempfile.TemporaryDirectory(prefix=f"kvproto-bench-{name}-") as tmp:
            return bench(args, Path(tmp))
    except HarnessError as e:
        print(f"kvproto bench {name}: {e}", file=sys.stderr)
        return 4

def run(args: argparse.Namespace) -> int:
    for key, lo in (("prompts", 1), ("max_tokens", 1), ("rounds", 1), ("late", 0),
                    ("kill", 0)):
        if getattr(args, key) < lo:
            print(f"kvproto bench vllm: --{key.replace('_', '-')} must be >= {lo}",
                  file=sys.stderr)
            return 2
    chosen = [c for c in args.connectors.split(",") if c]
    if not chosen or any(c not in CONNECTORS for c in chosen):
        print(f"kvproto bench vllm: --connectors must name some of {','.join(CONNECTORS)}",
              file=sys.stderr)
        return 2
    if not args.lease > 0 or not args.late_delay > args.lease:
        print("kvproto bench vllm: need --lease > 0 and --late-delay > --lease", file=sys.stderr)
        return 2
    try:
        topologies(args.p_tp, args.d_tp)
    except ValueError as e:
        print(f"kvproto bench vllm: {e}", file=sys.stderr)
        return 2
    res = run_engines_bench("vllm", args, _bench)
    if isinstance(res, int):
        return res
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(format_report(res))
    reports = res.get("topologies", [res])
    return 1 if any(r.get("kvproto", {}).get("wrong_outputs") for r in reports) else 0


ROWS = ("requests", "wrong_outputs", "errors", "throughput_tok_s", "ttft_ms_mean",
        "stranded_block_seconds", "pulled_requests", "refused_requests")


def format_report(res: dict[str, Any]) -> str:
    """The report as text: one table per topology."""
    if "topologies" in res:
        return "\n\n".join(format_report({**t, "model": res.get("model")})
                            for t in res["topologies"])
    names = [n for n in CONNECTORS if n in res]
    head = f"model: {res.get('model', 'llama')}"
    if "p_tp" in res:
        head += f", P TP {res['p_tp']} -> D TP {res.get('d_tp')}"
    if res.get("path") == "server":
        head += " (server)"
    lines = [head, " " * 24 + "".join(f"{n:>14}" for n in names)]
    for key in ROWS:
        if any(key in res[n] for n in names):
            lines.append(f"{key:24}" + "".join(f"{res[n].get(key, '-')!s:>14}"
                                               for n in names))
    if any("late_d" in res[n] for n in names):
        lines.append(f"{'late D wrong outputs':24}" + "".join(
            f"{res[n].get('late_d', {}).get('wrong_outputs', '-')!s:>14}" for n in names))
    for n in names:
        if res[n].get("failed"):
            lines.append(f"{n}: {res[n]['failed']}")
    if res.get("kvproto_refused"):
        lines.append(str(res["kvproto_refused"]))
    lines.append(f"throughput_ratio (kvproto/stock, median of paired rounds): "
                 f"{res.get('throughput_ratio')} (ratio of medians: "
                 f"{res.get('throughput_ratio_of_medians')}; CPU per token, "
                 f"stock/kvproto: {res.get('cpu_efficiency_ratio')})")
    return "\n".join(lines)
