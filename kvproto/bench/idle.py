"""``kvproto bench idle``: P's CPU cost while it holds blocks and nothing is due.

One real vLLM P engine (CPU build, tiny random-weight model, KVProtoConnector) in one run:

* ``empty``: P holds nothing (vLLM's loop blocks on its input);
* ``--held`` prefills with ``do_remote_decode`` and no D: P holds their blocks for the
  lease, and vLLM keeps stepping because delayed frees keep ``has_requests`` true;
* alternating ``--rounds`` of ``--interval`` seconds with the connector's idle wait off
  (``idle_wait_ms`` 0: a step every loop turn) and on (``--idle-wait-ms``), in the same
  engine (``set_idle_wait_ms``), so the machine's load hits both alike;
* then the lease runs out: ``expiry_late_ms`` is how long after registration + lease the
  last held request was freed (an upper bound: registration precedes the prefill's result).

NIXL's progress thread (the connector's default) busy-polls about one core in every phase,
``empty`` included; ``--no-progress-thread`` leaves the engine loop's own cost visible.

Reported: P's CPU seconds per idle second in each phase (``cpu_per_s_*``, medians over
rounds), worker steps per second, and ``cpu_ratio_off_on`` (off/on, median of the paired
rounds) and ``cpu_ratio_held_off_empty``. ``--json`` prints one JSON object on stdout.
Exit codes: 0 done, 1 a held request was not freed by lease + 5 s, 2 bad arguments,
3 vLLM/NIXL missing, 4 an engine failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--held", type=int, default=8, help="requests P holds (8)")
    p.add_argument("--interval", type=float, default=3.0, help="seconds per phase (3)")
    p.add_argument("--rounds", type=int, default=2, help="off/on rounds, alternating (2)")
    p.add_argument("--idle-wait-ms", type=float, default=20.0,
                   help="the connector's idle_wait_ms when on (20)")
    p.add_argument("--lease", type=float, default=20.0,
                   help="lease term, seconds; must outlast the rounds (20)")
    p.add_argument("--no-progress-thread", action="store_true",
                   help="run P without NIXL's progress thread, which busy-polls about one "
                        "core whether or not P holds anything; isolates the engine loop")
    p.add_argument("--path", choices=("offline", "server"), default="offline",
                   help="offline: one P engine in this process (the phases above); "
                        "server: `vllm serve` P + D + router per connector, CPU per "
                        "process after requests and while P holds blocks "
                        "(kvproto.bench.idle_serve)")
    p.add_argument("--variants", default="stock,kvproto,kvproto_sleep,kvproto_busy",
                   help="server path: stacks to measure, in order (stock, kvproto, "
                        "kvproto_sleep, kvproto_busy, kvproto_nowait; "
                        "kvproto.bench.idle_serve)")
    p.add_argument("--workdir", help="keep model and engine log here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _phase(p: Any, seconds: float) -> tuple[float, float]:
    """P's CPU seconds per second and worker steps per second over ``seconds``."""
    s0 = float(p.connector_stats().get("worker_steps", 0.0))
    c0, t0 = p.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    c1, t1 = p.cpu_seconds(), time.monotonic()
    s1 = float(p.connector_stats().get("worker_steps", 0.0))
    return (c1 - c0) / (t1 - t0), (s1 - s0) / (t1 - t0)


def _bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    t_start = time.monotonic()
    model = str(h.build_tiny_model(workdir / "model").path)
    spec, _ = h.pd_specs(model, workdir, h.KVPROTO_CONNECTOR,
                         extra_config={"lease": sc.lease_config(args.lease),
                                       "idle_wait_ms": args.idle_wait_ms,
                                       "progress_thread": not args.no_progress_thread})
    (p,) = h.start_engines([spec])
    try:
        pd = h.PD(p, p)
        empty_cpu, empty_steps = _phase(p, args.interval)
        log.info("empty: %.3f CPU s/s, %.0f steps/s", empty_cpu, empty_steps)
        prompts = {f"held-{i}": pr for i, pr in enumerate(h.make_prompts(args.held, seed=5))}
        pd.submit_prefills(prompts)
        p.wait(prompts, 120.0)
        t_held = time.monotonic()
        held = int(p.connector_stats().get("held_requests", 0))
        off: list[tuple[float, float]] = []
        on: list[tuple[float, float]] = []
        for i in range(args.rounds):
            order = (0.0, args.idle_wait_ms) if i % 2 == 0 else (args.idle_wait_ms, 0.0)
            for ms in order:
                p.connector_call("set_idle_wait_ms", ms, worker=True)
                r = _phase(p, args.interval)
                (on if ms else off).append(r)
                log.info("held %d, idle wait %s ms: %.3f CPU s/s, %.0f steps/s", held, ms,
                         *r)
        p.connector_call("set_idle_wait_ms", args.idle_wait_ms, worker=True)
        deadline = t_held + args.lease + 5.0
        while p.connector_stats().get("held_requests", 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = int(p.connector_stats().get("held_requests", 0))
        expiry_late_ms = 1000.0 * (time.monotonic() - t_held - args.lease)
    finally:
        p.close()
    med = statistics.median
    pairs = [a[0] / b[0] for a, b in zip(off, on, strict=True) if b[0] > 0]
    return {
        "held_requests": held,
        "cpu_per_s_empty": round(empty_cpu, 4),
        "cpu_per_s_held_off": round(med(x[0] for x in off), 4),
        "cpu_per_s_held_on": round(med(x[0] for x in on), 4),
        "steps_per_s_empty": round(empty_steps, 1),
        "steps_per_s_held_off": round(med(x[1] for x in off), 1),
        "steps_per_s_held_on": round(med(x[1] for x in on), 1),
        "cpu_ratio_off_on": round(med(pairs), 2) if pairs else None,
        "cpu_ratio_held_off_empty": round(med(x[0] for x in off) / empty_cpu, 2)
        if empty_cpu > 0 else None,
        "held_left_after_lease": left,
        "expiry_late_ms": round(expiry_late_ms, 1),
        "idle_wait_ms": args.idle_wait_ms, "lease_s": args.lease, "interval_s": args.interval,
        "rounds": args.rounds, "progress_thread": not args.no_progress_thread,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "wall_s": round(time.monotonic() - t_start, 1),
    }


def run(args: argparse.Namespace) -> int:

    if args.held < 1 or args.rounds < 1 or not args.interval > 0 \
            or not 0 < args.idle_wait_ms <= 1000:
        print("kvproto bench idle: need --held >= 1, --rounds >= 1, --interval > 0, "
              "0 < --idle-wait-ms <= 1000", file=sys.stderr)
        return 2
    if not args.lease > 2 * args.rounds * args.interval + 2:
        print("kvproto bench idle: --lease must exceed 2 * --rounds * --interval + 2 "
              "(the requests must stay held through the rounds)", file=sys.stderr)
        return 2
    from kvproto.bench.vllm import run_engines_bench

    if args.path == "server":
        from kvproto.bench.idle_serve import VARIANTS, bench

        chosen = [v for v in args.variants.split(",") if v]
        if not chosen or any(v not in VARIANTS for v in chosen):
            print(f"kvproto bench idle: --variants takes {', '.join(VARIANTS)}",
                  file=sys.stderr)
            return 2
        out = run_engines_bench("idle", args, bench)
        if isinstance(out, int):
            return out
        print(json.dumps(out, sort_keys=True) if args.json else
              "\n".join(f"{k:40}{v}" for k, v in sorted(out.items())))
        return 0
    res = run_engines_bench("idle", args, _bench)
    if isinstance(res, int):
        return res
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print("\n".join(f"{k:28}{v}" for k, v in sorted(res.items())))
    return 1 if res["held_left_after_lease"] else 0
