"""``kvproto chaos``: a seeded fault campaign on a real vLLM P/D pair (CPU).

Steady load runs through P and D (KVProtoConnector on both) for a given number of
minutes while faults are injected at random moments. One seed gives three independent
streams (:class:`Streams`): the faults (each one's kind and the wait before it), their
targets, and the load. So a seed always draws the same faults in the same order, however
many requests the machine serves between them (``faults_planned`` in the summary):

* ``kill_p`` / ``kill_d``: SIGKILL of the P or D engine, then a restart (a new epoch);
* ``stop_p`` / ``stop_d``: SIGSTOP longer than the lease, then SIGCONT;
* ``late_d``: the router holds P's transfer params longer than the lease while P reuses
  its blocks for other requests, then sends them to D;
* ``abort_p`` / ``abort_d``: a client abort on P before its prefill returns, or on D
  while its READ is in flight or while it decodes;
* notification faults on every D engine (dropped, duplicated, delayed and reordered
  done, release and heartbeat messages), through the adapters' test-only shim
  (``kvproto.nixl.faults``), counted by the D connector.

Every output is checked token for token against a single engine without a connector.
The verdict is clean when: no output differs from the reference (a request may end in an
error or be recomputed; it may never be served wrong KV), P has every block back within
``reclaim_timeout`` after the last fault, no engine died other than by an injected kill,
and every journal the engines wrote is a behaviour of the TLA+ spec (``kvproto
validate``: a D journal spanning P restarts is traced per P engine, ``traced``; skipped,
and said so, without Java/TLC).

Exit codes: 0 clean; 1 a violation (wrong output, stranded blocks, an engine crash, an
invalid journal); 2 bad arguments; 3 vLLM (or TLC for the journals) missing; 4 an engine
failed to start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvproto.errors import UsageError

log = logging.getLogger(__name__)

FAULTS = ("kill_p", "kill_d", "stop_p", "stop_d", "late_d", "abort_p", "abort_d")
# Notification fault rates on D (per message): the shim's setting.
NOTIFY_FAULTS = {"drop": 0.05, "dup": 0.05, "delay": 0.05}
REQUEST_TIMEOUT_S = 90.0     # a request not finished by then counts as hung
MAX_TIMELINE = 100_000       # samples kept for the plot (older ones are thinned)
MAX_PLANNED = 10_000         # fault kinds listed in the summary (the count goes on)
# Journal verdicts that are clean (kvproto.verify.trace.Verdict.status): allowed by TLC,
# traced by TLC per P engine (a D journal spanning P restarts) and replayed whole, replayed
# with every invariant (a D journal that cannot be split per P engine), or not checked on
# request (--no-validate).
JOURNAL_OK = ("valid", "traced", "replayed", "skipped")


@dataclass
class Campaign:
    """What a campaign did and found."""

    seed: int
    minutes: float
    connector: str = "kvproto"
    requests: int = 0
    finished: int = 0
    errors: int = 0
    aborted: int = 0
    lost: int = 0                      # in flight on an engine that was killed
    hung: int = 0
    wrong: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    notify_faults: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    invariant_violations: int = 0      # P's ledger and allocator, checked while running
    all_reclaimed: bool = False
    reclaim_s: float = 0.0
    stranded_block_s: float = 0.0
    journals: dict[str, str] = field(default_factory=dict)  # path -> verdict
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, P held blocks)
    marks: list[tuple[float, str]] = field(default_factory=list)     # (t, fault)
    planned: list[str] = field(default_factory=list)  # kinds drawn, in order (capped)
    planned_total: int = 0
    wall_s: float = 0.0

    @property
    def clean(self) -> bool:
        return (not self.wrong and self.all_reclaimed and not self.crashes and not self.hung
                and not self.invariant_violations
                and all(v in JOURNAL_OK for v in self.journals.values()))

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, "minutes": self.minutes, "connector": self.connector,
                "requests": self.requests,
                "finished": self.finished, "errors": self.errors, "aborted": self.aborted,
                "lost": self.lost, "hung": self.hung, "wrong_outputs": len(self.wrong),
                "wrong_ids": self.wrong[:20],
                "faults_injected": dict(sorted(self.faults.items())),
                "faults_planned": list(self.planned),
                "faults_planned_total": self.planned_total,
                "notification_faults": dict(sorted(self.notify_faults.items())),
                "engine_crashes": self.crashes, "all_reclaimed": self.all_reclaimed,
                "invariant_violations": self.invariant_violations,
                "reclaim_s": round(self.reclaim_s, 2),
                "stranded_block_seconds": round(self.stranded_block_s, 1),
                "journals": self.journals, "clean": self.clean, "wall_s": round(self.wall_s, 1)}


class Streams:
    """A campaign's seeded random streams, independent of each other: ``faults`` draws
    each fault's kind and the wait before it (:meth:`next_fault`), ``targets`` the request
    or phase a fault hits, ``load`` the prompts submitted. A draw on one never moves
    another, so the fault sequence of a seed does not depend on the load the machine
    sustains; what a fault finds to hit (and so a substitution such as ``late_d`` for a
    ``stop_p`` while an engine is stopped) still does."""

    def __init__(self, seed: int) -> None:
        self.faults = random.Random(f"kvproto-chaos/faults/{seed}")
        self.targets = random.Random(f"kvproto-chaos/targets/{seed}")
        self.load = random.Random(f"kvproto-chaos/load/{seed}")

    def next_fault(self, mean_s: float) -> tuple[float, str]:
        """The next fault: (seconds to wait before it, its kind)."""
        return self.faults.expovariate(1.0 / mean_s), self.faults.choice(FAULTS)


class _Side:
    """One engine role (P or D) across its restarts: the running engine and its spec."""

    def __init__(self, role: str, model: str, workdir: Path, connector: dict[str, Any],
                 extra: dict[str, Any]) -> None:
        self.role = role
        self.model = model
        self.workdir = workdir
        self.connector = connector
        self.extra = extra
        self.incarnation = 0
        self.engine: Any = None
        self.stopped_until = 0.0
        self.killed = False
        self.stats: dict[int, dict[str, Any]] = {}   # incarnation -> last connector stats
        self.stats_t = 0.0

    def snapshot(self, force: bool = False) -> None:
        """Keep the running engine's connector counters (a killed engine cannot be asked
        afterwards, so they are read every few seconds)."""
        if self.stopped or not self.engine.alive() or \
                (not force and time.monotonic() - self.stats_t < 5.0):
            return
        self.stats_t = time.monotonic()
        with contextlib.suppress(Exception):
            self.stats[self.incarnation] = self.engine.connector_stats()

    def spec(self) -> Any:
        from kvproto.vllm import harness as h

        self.incarnation += 1
        tag = f"{self.role}{self.incarnation}"
        cfg = dict(self.connector)
        ec = dict(self.extra)
        seed = ec.pop("_seed", 0)
        if cfg["kv_connector"] == "KVProtoConnector":
            ec["journal"] = str(self.workdir / f"{tag}.jsonl")
            if self.role == "D":
                ec["test_faults"] = dict(NOTIFY_FAULTS, seed=seed + self.incarnation)
        cfg["kv_connector_extra_config"] = ec
        return h.EngineSpec(name=tag, model=self.model, kv_transfer_config=cfg,
                            env=h.engine_env(), kv_cache_memory_bytes=16 << 20,
                            log_path=str(self.workdir / f"{tag}.log"),
                            stall_dump_s=0.0)  # SIGSTOP is one of the faults

    def start(self) -> Any:
        from kvproto.vllm import harness as h

        self.engine = h.Engine(self.spec())
        self.stopped_until = 0.0
        return self.engine

    @property
    def stopped(self) -> bool:
        return time.monotonic() < self.stopped_until

    def sigstop(self, seconds: float) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.engine.pid, signal.SIGSTOP)
        self.stopped_until = time.monotonic() + seconds

    def resume_if_due(self) -> None:
        if self.stopped_until and not self.stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.engine.pid, signal.SIGCONT)
            self.stopped_until = 0.0


@dataclass
class _Req:
    rid: str
    key: str                  # prompt key in the reference
    prompt: list[int]
    submitted: float
    stage: str = "P"          # P, held (late D), D, done
    p_inc: int = 0
    d_inc: int = 0
    hold_until: float = 0.0
    params: Any = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number

    p.add_argument("--minutes", type=number(0, 24 * 60, lo_open=True), default=3.0,
                   help="how long to inject faults under load (default 3)")
    p.add_argument("--seed", type=number(0, 2**31, integer=True), default=0,
                   help="seed of the fault, target and load streams: one seed draws the "
                   "same faults in the same order whatever the load (default 0)")
    p.add_argument("--lease", type=number(1, 60), default=3.0,
                   help="lease in seconds on both engines (default 3)")
    p.add_argument("--concurrency", type=number(1, 64, integer=True), default=4,
                   help="requests in flight (default 4)")
    p.add_argument("--max-tokens", type=number(1, 64, integer=True), default=6,
                   help="tokens decoded per request (default 6)")
    p.add_argument("--fault-every", type=number(1, 3600), default=12.0,
                   help="mean seconds between faults (default 12)")
    p.add_argument("--workdir", help="keep engines' logs, journals and the plot here "
                   "(default: a temporary folder, removed)")
    p.add_argument("--plot", help="write P's held blocks over time, faults marked, to this "
                   "PNG (needs matplotlib; default: <workdir>/chaos.png with --workdir)")
    p.add_argument("--connector", choices=("kvproto", "stock"), default="kvproto",
                   help="the connector under test (stock: vLLM's NixlConnector, without "
                   "journals or notification faults; default kvproto)")
    p.add_argument("--progress-delay-us", type=number(0, 100_000, integer=True), default=None,
                   help="kvproto: microseconds NIXL's progress thread sleeps between its "
                   "passes on both engines (0: NIXL's busy loop, about one core per engine; "
                   "default: the connector's own default)")
    p.add_argument("--no-validate", action="store_true",
                   help="skip TLC validation of the journals")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvproto.vllm.harness import HarnessError, vllm_available

    if args.connector == "stock" and getattr(args, "progress_delay_us", None) is not None:
        raise UsageError("--progress-delay-us is a kvproto connector option; "
                         "--connector stock has none")
    missing = vllm_available()
    if missing:
        print(f"kvproto chaos: {missing}", file=sys.stderr)
        return 3
    try:
        if args.workdir:
            wd = Path(args.workdir)
            wd.mkdir(parents=True, exist_ok=True)
            camp = campaign(args, wd)
        else:
            with tempfile.TemporaryDirectory(prefix="kvproto-chaos-") as tmp:
                camp = campaign(args, Path(tmp))
    except HarnessError as e:
        print(f"kvproto chaos: {e}", file=sys.stderr)
        return 4
    res = camp.summary()
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        print(format_summary(res))
    if any(v == "missing" for v in camp.journals.values()):
        return 3
    return 0 if camp.clean else 1


def format_summary(res: dict[str, Any]) -> str:
    rows = [("requests", res["requests"]), ("finished (checked)", res["finished"]),
            ("ended in error", res["errors"]), ("aborted by the client", res["aborted"]),
            ("lost with a killed engine", res["lost"]), ("hung", res["hung"]),
            ("wrong outputs", res["wrong_outputs"])]
    planned = res.get("faults_planned", [])
    shown = " ".join(planned[:12]) + (" ..." if len(planned) > 12 else "")
    rows += [("faults planned", f"{res.get('faults_planned_total', len(planned))}: "
              f"{shown or 'none'}")]
    rows += [(f"fault {k}", v) for k, v in res["faults_injected"].items()]
    rows += [(f"notification {k}", v) for k, v in res["notification_faults"].items()]
    rows += [("engine crashes", len(res["engine_crashes"])),
             ("invariant violations (P)", res["invariant_violations"]),
             ("all P blocks reclaimed", res["all_reclaimed"]),
             ("reclaimed after (s)", res["reclaim_s"]),
             ("stranded block-seconds", res["stranded_block_seconds"])]
    bad = [p for p, v in res["journals"].items() if v not in JOURNAL_OK]
    rows += [("journals valid", f"{len(res['journals']) - len(bad)}/{len(res['journals'])}"),
             ("verdict", "CLEAN" if res["clean"] else "VIOLATION")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def campaign(args: argparse.Namespace, workdir: Path) -> Campaign:
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    rng = Streams(int(args.seed))
    camp = Campaign(seed=int(args.seed), minutes=float(args.minutes),
                    connector=getattr(args, "connector", "kvproto"))
    t0 = time.monotonic()
    model = str(h.build_tiny_model(workdir / "model", seed=args.seed).path)
    pool = {f"q{i}": p for i, p in enumerate(h.make_prompts(
        32, seed=1000 + int(args.seed), lengths=[40, 64, 100, 150, 33, 90]))}
    if getattr(args, "connector", "kvproto") == "stock":
        connector = h.STOCK_CONNECTOR
        extra: dict[str, Any] = dict(sc.stock_extras(float(args.lease))["extra_config"])
    else:
        connector = h.KVPROTO_CONNECTOR
        extra = {"lease": sc.lease_config(float(args.lease))}
        if getattr(args, "progress_delay_us", None) is not None:
            extra["progress_delay_us"] = int(args.progress_delay_us)
    p_side = _Side("P", model, workdir, connector, extra)
    d_side = _Side("D", model, workdir, connector, dict(extra, _seed=args.seed))
    ref_spec = h.EngineSpec("REF", model, env=h.engine_env(), log_path=str(workdir / "REF.log"))
    log.info("chaos: starting the reference, P and D")
    ref, p, d = h.start_engines([ref_spec, p_side.spec(), d_side.spec()])
    p_side.engine, d_side.engine = p, d
    try:
        reference = sc.reference_outputs(ref, pool, max_tokens=args.max_tokens)
        ref.close()
        baseline = int(p.stats()["free_blocks"])
        _drive(args, rng, camp, pool, reference, p_side, d_side, baseline, t0)
        _reclaim(args, camp, p_side, baseline)
        for side in (p_side, d_side):
            side.snapshot(force=True)
    finally:
        for side in (d_side, p_side):
            if side.engine is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(side.engine.pid, signal.SIGCONT)
                side.engine.close()
    for st in d_side.stats.values():
        for k, v in st.items():
            if k.startswith("test_faults_") and isinstance(v, (int, float)):
                camp.notify_faults[k[len("test_faults_"):]] += int(v)
    camp.invariant_violations = int(max((st.get("invariant_violations", 0)
                                         for st in p_side.stats.values()), default=0))
    camp.wall_s = time.monotonic() - t0
    _validate(args, camp, workdir)
    plot = args.plot or (str(workdir / "chaos.png") if args.workdir else None)
    if plot:
        _plot(camp, plot)
    return camp


def _drive(args: argparse.Namespace, rng: Streams, camp: Campaign,
           pool: dict[str, list[int]], reference: dict[str, list[int]],
           p_side: _Side, d_side: _Side, baseline: int, t0: float) -> None:
    """Steady load with faults until the campaign's time is up, then drain."""
    from kvproto.vllm import scenarios as sc

    lease_s = float(args.lease)
    end = time.monotonic() + 60.0 * float(args.minutes)
    wait, kind = rng.next_fault(args.fault_every)
    next_fault = time.monotonic() + wait
    live: dict[str, _Req] = {}
    seq = 0
    last_report = 0.0
    while True:
        now = time.monotonic()
        running = now < end
        for side in (p_side, d_side):
            side.resume_if_due()
        # keep the load steady
        while running and len(live) < args.concurrency:
            key = rng.load.choice(sorted(pool))
            seq += 1
            r = _Req(f"c{seq}", key, pool[key], now, p_inc=p_side.incarnation)
            if not p_side.stopped:
                p_side.engine.submit(r.rid, r.prompt, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True})
            else:
                r.stage = "Pq"    # submitted once P runs again
            live[r.rid] = r
            camp.requests += 1
        if running and now >= next_fault:
            camp.planned_total += 1
            if len(camp.planned) < MAX_PLANNED:
                camp.planned.append(kind)
            _inject(kind, rng.targets, camp, live, p_side, d_side, lease_s, t0)
            wait, kind = rng.next_fault(args.fault_every)
            next_fault = now + wait
        _pump(camp, live, reference, p_side, d_side, args)
        if not p_side.stopped and now - (camp.timeline[-1][0] + t0 if camp.timeline else 0) > 0.5:
            with contextlib.suppress(Exception):
                held = baseline - int(p_side.engine.stats(timeout=5.0)["free_blocks"])
                _sample(camp, time.monotonic() - t0, held)
        if now - last_report > 10.0:
            last_report = now
            print(f"[chaos] {now - t0:5.0f}s requests {camp.requests} finished "
                  f"{camp.finished} errors {camp.errors} lost {camp.lost} wrong "
                  f"{len(camp.wrong)} faults {sum(camp.faults.values())}", file=sys.stderr,
                  flush=True)
        if not running and not live:
            break
        if not running and now > end + REQUEST_TIMEOUT_S + 4 * lease_s:
            for r in live.values():
                camp.hung += 1
                log.error("chaos: request %s hung in stage %s", r.rid, r.stage)
            break
        # churn P while a late D's params are held, so its blocks get reused
        if any(r.stage == "held" for r in live.values()) and not p_side.stopped:
            with contextlib.suppress(Exception):
                total = int(p_side.engine.info.get("total_blocks", 0)) or 64
                sc.churn(p_side.engine, blocks=total, tag=f"churn{seq}-{rng.load.random():.6f}")
        time.sleep(0.02)


def _pump(camp: Campaign, live: dict[str, _Req], reference: dict[str, list[int]],
          p_side: _Side, d_side: _Side, args: argparse.Namespace) -> None:
    now = time.monotonic()
    for side in (p_side, d_side):
        if side.engine.alive() and not side.stopped:
            with contextlib.suppress(Exception):
                side.engine.poll(0)
            side.snapshot()
        elif not side.engine.alive():
            # died without an injected kill: a crash; restart to keep the campaign going
            camp.crashes.append(f"{side.role}{side.incarnation}")
            log.error("chaos: %s%d died without an injected fault (see %s)", side.role,
                      side.incarnation, side.engine.spec.log_path)
            _lose(camp, live, side)
            side.start().wait_ready(600.0)
    for rid, r in list(live.items()):
        if r.stage == "Pq" and not p_side.stopped:
            p_side.engine.submit(rid, r.prompt, max_tokens=1,
                                 kv_transfer_params={"do_remote_decode": True})
            r.stage = "P"
        elif r.stage == "P" and rid in p_side.engine.results:
            res = p_side.engine.results.pop(rid)
            if res.error or not res.kv_transfer_params:
                camp.errors += 1
                del live[rid]
                continue
            r.params = res.kv_transfer_params
            r.stage = "D" if r.hold_until == 0.0 else "held"
            if r.stage == "D":
                _to_d(r, d_side, args)
        elif r.stage == "held" and now >= r.hold_until:
            r.stage = "D"
            _to_d(r, d_side, args)
        elif r.stage == "D" and rid in d_side.engine.results:
            res = d_side.engine.results.pop(rid)
            del live[rid]
            reason = res.finish_reasons[0] if res.finish_reasons else None
            if reason == "abort":
                camp.aborted += 1
            elif res.error or reason == "error" or not res.token_ids:
                camp.errors += 1
            else:
                camp.finished += 1
                if any(t != reference[r.key] for t in res.token_ids):
                    camp.wrong.append(rid)
                    log.error("chaos: WRONG output for %s (%s)", rid, r.key)
        elif now - r.submitted > REQUEST_TIMEOUT_S + r.hold_until and r.stage != "held":
            camp.hung += 1
            log.error("chaos: request %s hung in stage %s", rid, r.stage)
            del live[rid]


def _lose(camp: Campaign, live: dict[str, _Req], side: _Side) -> None:
    """A dead engine loses what it held: P its prefills, D its decodes."""
    stages = ("P", "Pq") if side.role == "P" else ("D",)
    for rid, r in list(live.items()):
        if r.stage in stages:
            camp.lost += 1
            del live[rid]


def _to_d(r: _Req, d_side: _Side, args: argparse.Namespace) -> None:
    r.d_inc = d_side.incarnation
    d_side.engine.submit(r.rid, r.prompt, max_tokens=args.max_tokens,
                         kv_transfer_params=r.params)


def _inject(kind: str, rng: random.Random, camp: Campaign, live: dict[str, _Req],
            p_side: _Side, d_side: _Side, lease_s: float, t0: float) -> None:
    """Inject the planned fault ``kind``, its target drawn from ``rng``; a kind with
    nothing to hit becomes another (``stop_*`` while an engine is stopped: ``late_d``;
    ``late_d`` with no prefill pending: ``abort_p``) or is skipped (not counted)."""
    now = time.monotonic()
    t_mark = now - t0
    if kind in ("stop_p", "stop_d") and (p_side.stopped or d_side.stopped):
        kind = "late_d"
    if kind == "kill_p" or kind == "kill_d":
        side = p_side if kind == "kill_p" else d_side
        side.snapshot(force=True)
        side.engine.kill()
        _lose(camp, live, side)
        log.warning("chaos: %s (incarnation %d); restarting", kind, side.incarnation)
        side.start().wait_ready(600.0)
    elif kind in ("stop_p", "stop_d"):
        side = p_side if kind == "stop_p" else d_side
        side.sigstop(lease_s * 1.5)
    elif kind == "late_d":
        pending = [r for r in live.values() if r.stage in ("P", "Pq")]
        if not pending:
            kind = "abort_p"
        else:
            r = rng.choice(pending)
            r.hold_until = now + lease_s * 2.5
    if kind == "abort_p":
        pending = [r for r in live.values() if r.stage == "P"]
        if pending and not p_side.stopped:
            r = rng.choice(pending)
            p_side.engine.abort([r.rid])
            del live[r.rid]
            camp.aborted += 1
        else:
            return
    elif kind == "abort_d":
        target = [r for r in live.values() if r.stage in ("P", "held")]
        if not target or d_side.stopped:
            return
        r = rng.choice(target)
        d_side.engine.abort_on(r.rid, rng.choice(["WAITING_FOR_REMOTE_KVS", "RUNNING"]))
    camp.faults[kind] += 1
    camp.marks.append((t_mark, kind))
    log.info("chaos: injected %s", kind)


def _sample(camp: Campaign, t: float, held: int) -> None:
    camp.timeline.append((t, held))
    if len(camp.timeline) > MAX_TIMELINE:
        camp.timeline = camp.timeline[::2]


def _reclaim(args: argparse.Namespace, camp: Campaign, p_side: _Side, baseline: int) -> None:
    """After the last fault: P must have every block back within the lease plus slack."""
    from kvproto.vllm import scenarios as sc

    for side in (p_side,):
        side.stopped_until = min(side.stopped_until, time.monotonic())
        side.resume_if_due()
    timeout = 6 * float(args.lease) + 30.0
    t = time.monotonic()
    ok, stranded, samples = sc.wait_free(p_side.engine, baseline, timeout)
    camp.all_reclaimed = ok
    camp.reclaim_s = time.monotonic() - t
    camp.stranded_block_s = stranded
    if not ok:
        log.error("chaos: P still holds %d blocks %.0f s after the last fault",
                  baseline - samples[-1][1], timeout)


def _complete_lines(path: Path) -> Path:
    """A journal cut by SIGKILL may end in a torn line; validate its complete prefix
    (a prefix of a behaviour is a behaviour)."""
    raw = path.read_bytes()
    if raw.endswith(b"\n") or b"\n" not in raw:
        return path
    cut = path.with_suffix(".complete.jsonl")
    cut.write_bytes(raw[:raw.rfind(b"\n") + 1])
    return cut


def _validate(args: argparse.Namespace, camp: Campaign, workdir: Path) -> None:
    paths = sorted(p for p in workdir.glob("[PD][0-9]*.jsonl")
                   if ".complete." not in p.name and p.stat().st_size > 0)
    if args.no_validate:
        camp.journals = {str(p.name): "skipped" for p in paths}
        return
    from kvproto.errors import KVProtoError
    from kvproto.verify.tlc import MissingDependency
    from kvproto.verify.validate import validate

    usable = [_complete_lines(p) for p in paths]
    log.info("chaos: validating %d journals with TLC", len(usable))
    try:
        verdicts = validate(usable, workdir=workdir / "tlc")
    except MissingDependency as e:
        camp.journals = {str(p.name): "missing" for p in paths}
        log.error("chaos: cannot validate journals: %s", e)
        return
    except KVProtoError:
        # One journal cannot be traced as a whole: judge each on its own.
        for i, (p, u) in enumerate(zip(paths, usable, strict=True)):
            camp.journals[p.name] = _validate_one(u, workdir / f"tlc{i}")
        return
    for p, v in zip(paths, verdicts, strict=True):
        camp.journals[p.name] = _status(v)


def _status(v: Any) -> str:
    """A journal's verdict for the summary (``Verdict.status``; the reason when not
    clean, or why TLC could not trace it)."""
    if not v.allowed:
        return f"invalid: {v.describe()}"[:300]
    if v.status == "replayed":
        log.warning("chaos: %s", v.describe())
    return str(v.status)


def _validate_one(path: Path, tlc_dir: Path) -> str:
    """One journal's verdict, when another journal of the campaign is bad input."""
    from kvproto.errors import KVProtoError
    from kvproto.verify.validate import validate

    try:
        v = validate([path], workdir=tlc_dir)[0]
    except KVProtoError as e:
        return f"invalid: {e}"[:300]
    return _status(v)


def _plot(camp: Campaign, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("chaos: matplotlib missing; no plot written")
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    if camp.timeline:
        ts, held = zip(*camp.timeline, strict=True)
        ax.step(ts, held, where="post", label="P blocks in use (held for D, or running)")
    colors = dict(zip(FAULTS, ("red", "purple", "orange", "brown", "green", "gray", "olive"),
                      strict=True))
    seen: set[str] = set()
    for t, kind in camp.marks:
        ax.axvline(t, color=colors.get(kind, "black"), alpha=0.6, lw=1,
                   label=None if kind in seen else kind)
        seen.add(kind)
    ax.set_xlabel("seconds")
    ax.set_ylabel("P blocks in use")
    ax.set_title(f"kvproto chaos ({camp.connector}, seed {camp.seed}): "
                 f"{len(camp.wrong)} wrong outputs, "
                 f"all reclaimed: {camp.all_reclaimed}")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    log.info("chaos: plot written to %s", path)


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via kvproto CLI
    from kvproto.cli import main as cli_main

    return cli_main(["chaos", *(argv or [])])
