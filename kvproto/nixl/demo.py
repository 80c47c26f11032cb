"""``kvproto demo``: real NIXL transfers between OS processes on loopback, with faults.

Processes (``procs.mp_context``): one P engine; D engine ``A`` (one rank), D engine
``B`` (two ranks reading every request: fan-in 2) and D engine ``C`` (one rank, killed
with SIGKILL mid-run). This process is the router: it drives a seeded workload, hands
each P transfer params to the D ranks, injects client aborts on P and on D, sends n>1
sibling groups, and collects reports. P drops and duplicates incoming notifications
through its adapter fault hook. Every block is filled with a pattern derived from
(request, block) and D verifies every block it is served.

Exit 0 only when the run is clean: no double free, no corrupted block served, every P
block reclaimed at the end, ledger invariants hold, every request reached an outcome
and no process died except the one killed on purpose.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from kvproto.lifecycle import Config

log = logging.getLogger(__name__)

DEMO_CONFIG = Config(initial_lease=4.0, lease_extension=3.0, heartbeat_interval=0.5,
                     abort_grace=4.0, max_delay=0.25, max_read_time=1.5, clock_drift=0.1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number

    p.add_argument("--seed", type=number(0, 2**63, integer=True), default=1,
                   help="workload and fault seed (default 1)")
    p.add_argument("--duration", type=number(0, 86400, lo_open=True), default=15.0,
                   help="seconds of workload before draining (default 15)")
    p.add_argument("--requests", type=number(0, 10**9, integer=True), default=0,
                   help="stop after this many requests (default: as many as the duration allows)")
    p.add_argument("--rate", type=number(0, 10**6, lo_open=True), default=30.0,
                   help="request arrivals per second (30)")
    p.add_argument("--block-kib", type=number(1, 1 << 20, integer=True), default=64,
                   help="KV block size in KiB (64)")
    p.add_argument("--p-blocks", type=number(16, 1 << 24, integer=True), default=1024,
                   help="P's KV blocks (1024)")
    p.add_argument("--drop", type=number(0, 1), default=0.01,
                   help="probability P drops an incoming notification (0.01)")
    p.add_argument("--dup", type=number(0, 1), default=0.02,
                   help="probability P duplicates an incoming notification (0.02)")
    p.add_argument("--no-kill", action="store_true", help="do not kill -9 the D engine C")
    p.add_argument("--journal", metavar="PATH", help="P's event journal (default: a temp dir)")
    p.add_argument("--plot", metavar="FILE.png", help="draw held blocks over time, faults marked")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="KV memory: cuda (VRAM) when present, else cpu (DRAM)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve P's Prometheus metrics on 127.0.0.1:PORT while the demo runs "
                        "(0: any free port; the D ranks get free ports too); the URLs are "
                        "printed and go in the report")
    p.add_argument("--json", action="store_true", help="also print the report as one JSON object")


@dataclass
class Req:
    rid: str
    engine: str  # D engine: A, B or C
    ranks: tuple[str, ...]
    nblocks: int
    key: str
    group: str | None = None
    t_sent: float = 0.0
    params: dict[str, Any] | None = None
    results: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # rank -> (state, reason, corrupted)
    outcome: str = ""  # "" while open


@dataclass
class Proc:
    name: str
    proc: BaseProcess
    conn: Connection
    alive: bool = True
    killed: bool = False


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.cfg = DEMO_CONFIG
        self.block_bytes = args.block_kib * 1024
        from kvproto.nixl.procs import mp_context

        self.ctx = mp_context()
        self.procs: dict[str, Proc] = {}
        self.reqs: dict[str, Req] = {}
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, int]] = []
        self.faults: list[tuple[float, str]] = []
        self.bytes_moved = 0
        self.read_seconds = 0.0
        self.corrupted = 0
        self.p_stats: dict[str, Any] = {}
        self.d_stats: dict[str, dict[str, Any]] = {}
        self.pending_aborts: list[tuple[float, str, str]] = []  # (t, "P"|rank, rid)
        self.not_admitted = Counter[str]()
        self.unexpected_deaths: list[str] = []
        self.metrics_urls: dict[str, str] = {}  # process name -> Prometheus endpoint
        device = args.device
        if device == "auto":
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        jdir = None
        if not args.journal:
            jdir = tempfile.mkdtemp(prefix="kvproto-demo-")
        self.journal = args.journal or os.path.join(jdir or ".", "journal.jsonl")

    # -- processes ----------------------------------------------------------------------
    def _spawn(self, name: str, target: Any, *a: Any) -> Proc:
        parent, child = self.ctx.Pipe()
        pr = self.ctx.Process(target=target, args=(child, *a), name=name, daemon=True)
        pr.start()
        child.close()
        p = Proc(name, pr, parent)
        self.procs[name] = p
        return p

    def _expect(self, p: Proc, kind: str, timeout: float = 60.0) -> tuple[Any, ...]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if p.conn.poll(0.05):
                m: tuple[Any, ...] = p.conn.recv()
                if m[0] == kind:
                    return m
                self._on_msg(p, m)
            elif not p.proc.is_alive():
                raise RuntimeError(f"{p.name} exited with {p.proc.exitcode} during startup")
        raise RuntimeError(f"{p.name}: no {kind!r} within {timeout}s")

    def start(self) -> None:
        from kvproto.nixl.procs import consumer_main, producer_main

        tag = f"{os.getpid()}-{self.args.seed}"
        pname = f"demo-P-{tag}"
        self.pname = pname
        mport = getattr(self.args, "metrics_port", None)
        popts = {"drop": self.args.drop, "dup": self.args.dup, "seed": self.args.seed,
                 "journal": self.journal, "device": self.device, "metrics_port": mport}
        p = self._spawn("P", producer_main, pname, self.cfg.to_dict(), self.args.p_blocks,
                        self.block_bytes, popts)
        self.engines = {"A": ("A",), "B": ("B0", "B1"), "C": ("C",)}
        for eng, ranks in self.engines.items():  # started in parallel with P
            for i, rank in enumerate(ranks):
                self._spawn(rank, consumer_main, f"demo-D{rank}-{tag}", self.cfg.to_dict(),
                            512, self.block_bytes, {},
                            {"device": self.device, "tp_rank": i, "tp_size": len(ranks),
                             "metrics_port": None if mport is None else 0,
                             "consumer": f"demo-D{eng}-{tag}"})
        _, host, port, epoch = self._expect(p, "ready")
        for eng_ranks in self.engines.values():
            for rank in eng_ranks:
                self._expect(self.procs[rank], "ready")
                self.procs[rank].conn.send(("add_engine", pname, host, port))
        print(f"kvproto demo: P {pname} (epoch {epoch}) on {host}:{port}; D engines "
              f"A (1 rank), B (2 ranks, fan-in 2), C (1 rank, killed mid-run); "
              f"device {self.device}; seed {self.args.seed}", flush=True)
        if mport is not None:
            end = time.monotonic() + 10
            while len(self.metrics_urls) < len(self.procs) and time.monotonic() < end:
                self._poll(0.05)
            for name in sorted(self.metrics_urls, key=lambda n: (n != "P", n)):
                print(f"metrics: {name} {self.metrics_urls[name]}", flush=True)

    # -- messages ---------------------------------------------------------------------------
    def _on_msg(self, p: Proc, m: tuple[Any, ...]) -> None:
        kind = m[0]
        if kind == "registered":
            self._on_registered(m[1], m[2])
        elif kind == "registered_group":
            for rid, pd in m[1]:
                self._on_registered(rid, pd)
        elif kind == "completion":
            _, _dname, rid, state, reason, nbytes, secs, corrupted = m
            r = self.reqs.get(rid)
            if r is None:
                return
            r.results[p.name] = (state, reason, corrupted)
            if state == "done":
                self.bytes_moved += nbytes
                self.read_seconds += secs
                self.corrupted += corrupted
            self._settle(r)
        elif kind == "metrics":
            self.metrics_urls[p.name] = f"http://127.0.0.1:{int(m[2])}/metrics"
        elif kind == "stats":
            if p.name == "P":
                self.p_stats = m[1]
                self.samples.append((self.now(), int(m[1]["held"])))
            else:
                self.d_stats[p.name] = m[1]

    def _on_registered(self, rid: str, pd: dict[str, Any] | None) -> None:
        r = self.reqs[rid]
        if pd is None:
            r.outcome = "not_admitted:p_full"
            self.not_admitted["p_full"] += 1
            return
        r.params = pd
        live = [rk for rk in r.ranks if self.procs[rk].alive]
        if len(live) < len(r.ranks):
            r.outcome = "failed:d_killed"
            return
        roll = self.rng.random()
        # D's scheduler: most requests soon, some queued for a while (heartbeats hold them).
        delay = self.rng.uniform(0.0, 0.3) if roll < 0.85 else self.rng.uniform(1.0, 5.0)
        for rk in r.ranks:
            self.procs[rk].conn.send(("admit", rid, pd, r.key, delay))
        x = self.rng.random()
        if x < 0.04:
            self.pending_aborts.append((self.now() + self.rng.uniform(0, 0.5), "P", rid))
        elif x < 0.08:
            self.pending_aborts.append((self.now() + self.rng.uniform(0, delay + 0.2),
                                        self.rng.choice(r.ranks), rid))

    def _settle(self, r: Req) -> None:
        if r.outcome or len(r.results) < len(r.ranks):
            return
        reasons = [reason for (_s, reason, _c) in r.results.values()]
        if all(s == "done" for (s, _r, _c) in r.results.values()):
            r.outcome = "completed:" + ("sibling_local" if reasons[0] == "sibling_local"
                                        else "pulled")
        else:
            bad = next(reason for (s, reason, _c) in r.results.values() if s != "done")
            r.outcome = "failed:" + bad

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- workload ------------------------------------------------------------------------------
    def _new_requests(self, n: int) -> None:
        rng = self.rng
        c_alive = self.procs["C"].alive
        x = rng.random()
        nb = rng.randint(1, 16)
        if x < 0.12:  # an n>1 sibling group on engine A: D pulls one member
            k = rng.randint(2, 3)
            group = f"g{n}"
            rids = [f"r{n}.{j}" for j in range(k)]
            for rid in rids:
                self.reqs[rid] = Req(rid, "A", ("A",), nb, group, group, self.now())
            self.procs["P"].conn.send(("register_group", rids, nb, group, group))
            return
        if x < 0.45:
            eng = "B"
        elif x < 0.65 and c_alive:
            eng = "C"
        else:
            eng = "A"
        rid = f"r{n}"
        ranks = self.engines[eng]
        self.reqs[rid] = Req(rid, eng, ranks, nb, rid, None, self.now())
        self.procs["P"].conn.send(("register", rid, nb, None, len(ranks), rid, None))

    def _kill_c(self) -> None:
        c = self.procs["C"]
        if c.proc.pid is not None and c.proc.is_alive():
            os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.join(5)
        c.alive = False
        c.killed = True
        self.faults.append((self.now(), "kill -9 D engine C"))
        print(f"[{self.now():6.1f}s] fault: kill -9 of D engine C (pid {c.proc.pid})", flush=True)
        for r in self.reqs.values():
            if r.engine == "C" and not r.outcome:
                r.outcome = "failed:d_killed"

    def _poll(self, timeout: float) -> None:
        conns = {p.conn: p for p in self.procs.values() if p.alive}
        for c in wait(list(conns), timeout=timeout):
            p = conns[c]  # type: ignore[index]
            try:
                while p.conn.poll(0):
                    self._on_msg(p, p.conn.recv())
            except (EOFError, OSError):
                p.alive = False
                if not p.killed:
                    self.unexpected_deaths.append(p.name)
                    print(f"[{self.now():6.1f}s] process {p.name} died unexpectedly", flush=True)
        for p in self.procs.values():
            if p.alive and not p.proc.is_alive():
                p.alive = False
                if not p.killed:
                    self.unexpected_deaths.append(p.name)

    def _ask_stats(self) -> None:
        for p in self.procs.values():
            if p.alive:
                try:
                    p.conn.send(("stats",))
                except (BrokenPipeError, OSError):
                    pass

    def _progress(self) -> None:
        oc = Counter(r.outcome.split(":")[0] for r in self.reqs.values())
        held = self.p_stats.get("held", "?")
        print(f"[{self.now():6.1f}s] requests {len(self.reqs):5d}  completed {oc['completed']:5d}"
              f"  failed {oc['failed']:4d}  open {oc['']:4d}  P held blocks {held!s:>5}"
              f"  moved {self.bytes_moved / 1e9:6.2f} GB", flush=True)

    def run(self) -> dict[str, Any]:
        a = self.args
        t_start = time.monotonic()
        self.start()
        print(f"engines up in {time.monotonic() - t_start:.1f}s", flush=True)
        self.t0 = time.monotonic()
        n = 0
        next_arrival = 0.0
        kill_at = None if a.no_kill else a.duration * 0.4
        next_stats = 0.0
        next_progress = 2.0
        while self.now() < a.duration and (not a.requests or n < a.requests):
            t = self.now()
            while next_arrival <= t and (not a.requests or n < a.requests):
                self._new_requests(n)
                n += 1
                next_arrival += self.rng.expovariate(a.rate)
            if kill_at is not None and t >= kill_at:
                kill_at = None
                self._kill_c()
            self._fire_aborts(t)
            if t >= next_stats:
                next_stats = t + 0.2
                self._ask_stats()
            if t >= next_progress:
                next_progress = t + 2.0
                self._progress()
            self._poll(0.005)
        if kill_at is not None:  # the arrivals ended first (--requests): kill C now
            self._kill_c()
        t_end = self.now()
        self.faults.append((t_end, "workload ends; draining"))
        print(f"[{t_end:6.1f}s] workload done ({n} requests); draining", flush=True)
        drain_limit = self.cfg.abort_grace + self.cfg.lease_horizon + 10.0
        while self.now() - t_end < drain_limit:
            self._fire_aborts(self.now())
            if self.now() >= next_stats:
                next_stats = self.now() + 0.2
                self._ask_stats()
            if self.now() >= next_progress:
                next_progress = self.now() + 2.0
                self._progress()
            self._poll(0.01)
            open_reqs = [r for r in self.reqs.values() if not r.outcome]
            if not open_reqs and not self.pending_aborts and self.p_stats.get("held") == 0 \
                    and self.p_stats.get("t", 0) > 0 and self.samples \
                    and self.samples[-1][0] > t_end:
                break
        self._progress()
        return self.finish(n, t_end)

    def _fire_aborts(self, t: float) -> None:
        keep = []
        for at, who, rid in self.pending_aborts:
            if at > t:
                keep.append((at, who, rid))
                continue
            p = self.procs[who]
            if p.alive:
                p.conn.send(("abort", rid))
                self.faults.append((t, f"abort on {'P' if who == 'P' else 'D'}"))
        self.pending_aborts = keep

    def finish(self, n: int, t_end: float) -> dict[str, Any]:
        # Final stats from everyone still alive, then an orderly stop.
        self._ask_stats()
        end = time.monotonic() + 5
        want = {p.name for p in self.procs.values() if p.alive}
        got: set[str] = set()
        while got < want and time.monotonic() < end:
            conns = {p.conn: p for p in self.procs.values() if p.alive}
            for c in wait(list(conns), timeout=0.1):
                p = conns[c]  # type: ignore[index]
                try:
                    m = p.conn.recv()
                except (EOFError, OSError):
                    p.alive = False
                    continue
                self._on_msg(p, m)
                if m[0] == "stats":
                    got.add(p.name)
        t_stop = time.monotonic()
        self.stop()
        log.info("engines stopped in %.1fs", time.monotonic() - t_stop)
        ps = self.p_stats
        open_reqs = [r.rid for r in self.reqs.values() if not r.outcome]
        outcomes = Counter(r.outcome for r in self.reqs.values() if r.outcome)
        completed = sum(v for k, v in outcomes.items() if k.startswith("completed"))
        failed = {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith("failed")}
        ledger = ps.get("ledger", {})
        stale = {k: v for k, v in ledger.items()
                 if k in ("stale", "late", "duplicate", "refused", "staged_expired")}
        rejected = {k: v for k, v in ledger.items() if k.startswith("rejected:")}
        double_frees = int(ps.get("violations", -1)) + int(ps.get("adapter", {}).get("double_free", 0))
        reclaimed = ps.get("held") == 0 and ps.get("free") == ps.get("capacity")
        wall = max(t_end, 1e-9)
        report = {
            "seed": self.args.seed, "duration_s": round(t_end, 2), "requests": len(self.reqs),
            "completed": completed, "completed_detail": {k.split(":", 1)[1]: v for k, v in outcomes.items()
                                                          if k.startswith("completed")},
            "failed": failed, "not_admitted": dict(self.not_admitted), "open": len(open_reqs),
            "bytes_moved": self.bytes_moved,
            "gbps_aggregate": self.bytes_moved / wall / 1e9,
            "gbps_per_read": (self.bytes_moved / self.read_seconds / 1e9) if self.read_seconds else 0.0,
            "frees": ps.get("frees", {}),
            "stranded_block_seconds": round(float(ps.get("stranded_block_seconds", 0.0)), 2),
            "stale_messages": sum(stale.values()), "stale_detail": stale,
            "rejected": rejected,
            "notification_faults": ps.get("faults", {}),
            "double_frees": double_frees, "corrupted_blocks_served": self.corrupted,
            "fenced": sum(d.get("counters", {}).get("fenced", 0) for d in self.d_stats.values()),
            "all_p_blocks_reclaimed": bool(reclaimed),
            "p_invariants": ps.get("invariants", ["no final stats from P"]),
            "unexpected_deaths": self.unexpected_deaths,
            "journal": self.journal,
            "metrics": dict(self.metrics_urls),
        }
        clean = (double_frees == 0 and self.corrupted == 0 and reclaimed and not open_reqs
                 and not report["p_invariants"] and not self.unexpected_deaths and completed > 0)
        report["clean"] = clean
        return report

    def stop(self) -> None:
        # D ranks first, then P (so no D sees its P vanish during an orderly stop).
        order = sorted(self.procs.values(), key=lambda p: p.name == "P")
        for p in order:
            if p.name == "P":
                for q in order:
                    if q.name != "P":
                        q.proc.join(10)
            if p.alive:
                try:
                    p.conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
        for p in order:
            p.proc.join(10)
            if p.proc.is_alive() and p.proc.pid is not None:
                os.kill(p.proc.pid, signal.SIGKILL)
                p.proc.join(5)
            p.alive = False

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        if self.samples:
            xs, ys = zip(*self.samples, strict=True)
            ax.plot(xs, ys, lw=1.2, label="P blocks held")
        marks = {"abort on P": ("tab:orange", 0.96), "abort on D": ("tab:green", 0.92)}
        labelled: set[str] = set()
        for t, what in self.faults:
            if what in marks:
                color, y = marks[what]
                ax.plot([t], [y], transform=ax.get_xaxis_transform(), marker="v", ms=5,
                        color=color, ls="none", label=None if what in labelled else what)
                labelled.add(what)
            else:
                ax.axvline(t, color="tab:red" if "kill" in what else "grey", ls="--", lw=1)
                ax.text(t, 0.5, " " + what, rotation=90, va="center", fontsize=8,
                        transform=ax.get_xaxis_transform())
        ax.set_xlabel("seconds")
        ax.set_ylabel("blocks held on P")
        ax.set_title(f"kvproto demo (seed {self.args.seed}): held KV blocks, faults marked")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def print_report(r: dict[str, Any]) -> None:
    def line(k: str, v: Any) -> None:
        print(f"  {k:<32} {v}")

    print("\nkvproto demo report")
    line("seed / workload seconds", f"{r['seed']} / {r['duration_s']}")
    line("requests", r["requests"])
    line("completed", f"{r['completed']} {r['completed_detail']}")
    line("failed (by reason)", f"{sum(r['failed'].values())} {r['failed']}")
    if r["not_admitted"]:
        line("not admitted", r["not_admitted"])
    line("bytes moved", f"{r['bytes_moved'] / 1e9:.3f} GB")
    line("GB/s (aggregate / per READ)", f"{r['gbps_aggregate']:.3f} / {r['gbps_per_read']:.3f}")
    line("frees by reason", r["frees"])
    line("stranded block-seconds", r["stranded_block_seconds"])
    line("stale messages", f"{r['stale_messages']} {r['stale_detail']}")
    line("rejected messages", r["rejected"])
    line("notification faults injected", r["notification_faults"])
    line("fenced reads (never served)", r["fenced"])
    line("double frees", r["double_frees"])
    line("corrupted blocks served", r["corrupted_blocks_served"])
    line("all P blocks reclaimed at end", "yes" if r["all_p_blocks_reclaimed"] else "NO")
    line("P ledger invariants", "ok" if not r["p_invariants"] else r["p_invariants"])
    if r["unexpected_deaths"]:
        line("unexpected process deaths", r["unexpected_deaths"])
    if r["open"]:
        line("requests without an outcome", r["open"])
    line("event journal", r["journal"])
    if r.get("metrics"):
        line("metrics (served while running)", r["metrics"].get("P", ""))
        for name, url in sorted(r["metrics"].items()):
            if name != "P":
                line(f"  D rank {name}", url)
    print(f"  result: {'CLEAN' if r['clean'] else 'NOT CLEAN'}")


def run(args: argparse.Namespace) -> int:
    from kvproto.nixl.agent import nixl_available, quiet_nixl_logging

    if not nixl_available():
        print("kvproto demo: needs the [nixl] extra (the nixl package is not importable): "
              "pip install 'kvproto[nixl]'", file=sys.stderr)
        return 3
    quiet_nixl_logging()
    port = getattr(args, "metrics_port", None)
    if port is not None:
        import socket

        if not 0 <= port <= 65535:
            print(f"kvproto demo: --metrics-port {port} is not a TCP port (0-65535)",
                  file=sys.stderr)
            return 2
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                print(f"kvproto demo: cannot serve metrics on 127.0.0.1:{port}: {e.strerror}",
                      file=sys.stderr)
                return 2
    demo = Demo(args)
    try:
        report = demo.run()
    except BaseException:
        demo.stop()
        raise
    print_report(report)
    if args.plot:
        demo.plot(args.plot)
        print(f"  plot written to {args.plot}")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0 if report["clean"] else 1
