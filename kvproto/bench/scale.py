"""``kvproto bench scale``: many requests in flight through real vLLM engines (CPU build,
tiny random-weight model, real NIXL), one P with one D and one P with several D, for the
stock NixlConnector and for KVProtoConnector in one run.

Per connector, one P engine and ``--decoders`` D engines start and run two topologies on
the same engines, one after the other. Once started, every thread of each engine is pinned
to one core (P on the last core, D *i* on core *i* mod cores) with ``sched_setaffinity``:
``VLLM_CPU_OMP_THREADS_BIND`` binds threads only in vLLM's multiprocess executor, which the
harness's in-process engines do not use, and the stock connector moves its engine's main
thread to the last core on CPU (``--no-pin`` keeps what the engines set themselves).

* ``pair``: every request goes to D0 (one P, one D);
* ``fanout``: request *j* goes to D(*j* mod ``--decoders``) (one P, several D).

The connectors run one after the other, each on fresh engines; ``--rounds N`` repeats
that with the order alternating (stock first in even rounds), and the figures are merged
over the rounds (:func:`merge`). In each topology the router submits all ``--requests``
prefills to P at once (``max_tokens`` 1,
``do_remote_decode``) and sends each to its D as soon as P returns it, with P's transfer
params unchanged. Every ``--abandon-every``-th request is abandoned: the router sends it
to its D and aborts it there at once (a client that leaves while its request waits at D).

Figures, per connector and topology:

* ``throughput_tok_s``: D's generated tokens over the phase's wall time (P's first submit
  to D's last token); ``throughput_ratio`` is kvproto/stock per topology, the median of
  the per-round ratios;
* ``ttft_ms_p50`` / ``ttft_ms_p99``: D's first token minus P's submit, per request;
* ``peak_held_blocks``: the most KV blocks P held at once for finished requests (requests
  its scheduler keeps after their prefill, for a remote reader), sampled every
  ``--sample`` seconds;
* ``stranded_block_seconds``: for each request *r*, let *end(r)* be the time its D
  reported it finished (its last token, or an error) or the router abandoned it. Between
  two consecutive samples at *t0* < *t1*, every request that P still holds at *t1* and
  with *end(r)* < *t1* adds ``blocks(r) * (t1 - max(t0, end(r)))``. The sum runs until P
  holds nothing (``reclaimed``) or the phase's drain bound passes. It is the KV memory P
  keeps for requests nobody will read any more; sampling makes it exact to within one
  ``--sample`` interval per request;
* ``wrong_outputs``: outputs that differ, token for token, from a single engine with no
  connector (greedy, same prompts); abandoned requests are not compared; ``errors``:
  requests that ended without output.

kvproto's journals (each engine's ledger and Consumer journal) are checked with ``kvproto
validate`` after the engines shut down (``journals_valid``; ``--no-validate`` skips it).
Progress goes to stderr; ``--json`` prints one JSON object on stdout. Exit codes: 0 done,
1 kvproto served a wrong output, left blocks held or wrote an invalid journal, 2 bad
arguments, 3 vLLM/NIXL missing, 4 an engine failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvproto.vllm.harness import Engine, EngineSpec

log = logging.getLogger(__name__)

CONNECTORS = ("stock", "kvproto")
TOPOLOGIES = ("pair", "fanout")
LENGTHS = (32, 7, 64, 40, 20, 33)   # prompt lengths, cycled: 1-2 blocks of 32 tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=1000,
                   help="requests in flight per topology (1000)")
    p.add_argument("--decoders", type=int, default=3, help="D engines of the fan-out (3)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens decoded per request (4)")
    p.add_argument("--abandon-every", type=int, default=20,
                   help="abandon every Nth request at its D (20; 0: none)")
    p.add_argument("--lease", type=float, default=30.0,
                   help="lease term of both connectors, seconds (30)")
    p.add_argument("--sample", type=float, default=0.2,
                   help="seconds between samples of P's held blocks (0.2)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="bound on one topology's run, seconds (1800)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds; each starts fresh engines for each connector, the order "
                        "alternating (stock first in even rounds), so that drifting load "
                        "hits both alike (1)")
    p.add_argument("--connectors", default="stock,kvproto",
                   help="comma-separated subset of stock,kvproto (default both)")
    p.add_argument("--no-pin", action="store_true",
                   help="leave thread affinities as the engines set them (the stock "
                        "connector puts its engines' main threads on the last core; "
                        "kvproto's stay on every core) instead of one core per engine")
    p.add_argument("--no-validate", action="store_true",
                   help="skip kvproto validate on kvproto's journals")
    p.add_argument("--workdir", help="keep model, engine logs and journals here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ---------------------------------------------------------------------------- figures


@dataclass
class Stranded:
    """P's held blocks sampled over time: the peak and the stranded block-seconds
    (module docstring). ``end`` maps a request to the time its D finished or it was
    abandoned; requests not yet ended are held legitimately."""

    peak: int = 0
    block_seconds: float = 0.0
    abandoned_block_seconds: float = 0.0   # the part due to abandoned requests
    samples: int = 0
    last_t: float | None = None

    def add(self, t: float, held: Mapping[str, int], end: Mapping[str, float],
            abandoned: Container[str] = ()) -> None:
        self.samples += 1
        self.peak = max(self.peak, sum(held.values()))
        t0 = self.last_t
        self.last_t = t
        if t0 is None:
            return
        for rid, blocks in held.items():
            e = end.get(rid)
            if e is not None and e < t:
                bs = blocks * (t - max(t0, e))
                self.block_seconds += bs
                if rid in abandoned:
                    self.abandoned_block_seconds += bs


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))
    return float(s[int(k)])


@dataclass
class Phase:
    """What one topology of one connector produced."""

    requests: int = 0
    abandoned: int = 0
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    stranded: Stranded = field(default_factory=Stranded)
    reclaimed: bool = False
    held_left: int = 0
    seconds_to_reclaim: float = 0.0
    loadavg_1m: float = 0.0

    def report(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "abandoned": self.abandoned,
            "wrong_outputs": len(self.wrong), "errors": len(self.errors),
            "tokens": self.tokens, "wall_s": round(self.wall_s, 2),
            "throughput_tok_s": round(self.tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "ttft_ms_p50": round(percentile(self.ttft_ms, 50), 1),
            "ttft_ms_p99": round(percentile(self.ttft_ms, 99), 1),
            "peak_held_blocks": self.stranded.peak,
            "stranded_block_seconds": round(self.stranded.block_seconds, 2),
            "stranded_block_seconds_abandoned":
                round(self.stranded.abandoned_block_seconds, 2),
            "reclaimed": self.reclaimed, "held_blocks_left": self.held_left,
            "seconds_to_reclaim": round(self.seconds_to_reclaim, 2),
            "held_samples": self.stranded.samples, "loadavg_1m": self.loadavg_1m,
        }


def merge(rounds: Sequence[Phase]) -> dict[str, Any]:
    """One topology of one connector over its rounds: counts summed, throughput and
    stranded block-seconds the median of the rounds (each round's value listed too),
    TTFT percentiles over every request of every round, the peak the highest."""
    reps = [ph.report() for ph in rounds]
    out = dict(reps[0])
    for key in ("requests", "abandoned", "wrong_outputs", "errors", "tokens",
                "held_blocks_left", "held_samples"):
        out[key] = sum(r[key] for r in reps)
    for key in ("throughput_tok_s", "stranded_block_seconds",
                "stranded_block_seconds_abandoned", "wall_s"):
        out[key] = round(statistics.median(r[key] for r in reps), 2)
    ttft = [t for ph in rounds for t in ph.ttft_ms]
    out["ttft_ms_p50"] = round(percentile(ttft, 50), 1)
    out["ttft_ms_p99"] = round(percentile(ttft, 99), 1)
    out["peak_held_blocks"] = max(r["peak_held_blocks"] for r in reps)
    out["reclaimed"] = all(r["reclaimed"] for r in reps)
    out["seconds_to_reclaim"] = max(r["seconds_to_reclaim"] for r in reps)
    out["loadavg_1m"] = [r["loadavg_1m"] for r in reps]
    out["rounds_throughput_tok_s"] = [r["throughput_tok_s"] for r in reps]
    out["rounds_stranded_block_seconds"] = [r["stranded_block_seconds"] for r in reps]
    return out


def build_report(phases: Mapping[str, Mapping[str, Sequence[Phase]]], *,
                 meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One entry per connector (one per topology inside, :func:`merge` of its rounds)
    and ``throughput_ratio``: kvproto/stock per topology, the median of the per-round
    ratios (None without both)."""
    out: dict[str, Any] = {name: {t: merge(rs) for t, rs in tops.items() if rs}
                           for name, tops in phases.items()}
    ratio: dict[str, float | None] = {}
    for t in TOPOLOGIES:
        s = phases.get("stock", {}).get(t, [])
        k = phases.get("kvproto", {}).get(t, [])
        pairs = [b.report()["throughput_tok_s"] / a.report()["throughput_tok_s"]
                 for a, b in zip(s, k, strict=False) if a.report()["throughput_tok_s"] > 0]
        ratio[t] = round(statistics.median(pairs), 4) if pairs else None
    out["throughput_ratio"] = ratio
    out.update(meta or {})
    return out


def format_report(res: Mapping[str, Any]) -> str:
    cols = [(n, t) for n in CONNECTORS if n in res for t in TOPOLOGIES if t in res[n]]
    lines = [f"{'':24}" + "".join(f"{n + ' ' + t:>16}" for n, t in cols)]
    for key in ("requests", "abandoned", "wrong_outputs", "errors", "throughput_tok_s",
                "ttft_ms_p50", "ttft_ms_p99", "peak_held_blocks", "stranded_block_seconds",
                "reclaimed"):
        lines.append(f"{key:24}" + "".join(f"{res[n][t][key]!s:>16}" for n, t in cols))
    lines.append(f"throughput_ratio (kvproto/stock): {res.get('throughput_ratio')}; "
                 f"journals_valid: {res.get('journals_valid')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- driving


def scale_specs(model: str, workdir: Path, name: str, decoders: int, lease: float,
                round_: int = 0) -> list[EngineSpec]:
    """P and ``decoders`` D engines for connector ``name`` (stock or kvproto; kvproto's
    over ``harness.CONNECTOR_DEFAULTS``, as ``pd_specs`` gives them); kvproto's
    engines journal to ``<workdir>/P-kvproto-r<round_>.jsonl`` and
    ``D<i>-kvproto-r<round_>.jsonl`` (D's Consumer journal beside each,
    ``.consumer.jsonl``)."""
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    if name == "stock":
        base, extra = h.STOCK_CONNECTOR, sc.stock_extras(lease)["extra_config"]
    else:
        base, extra = h.KVPROTO_CONNECTOR, {**h.CONNECTOR_DEFAULTS,
                                            "lease": sc.lease_config(lease)}
    specs = []
    for i, role in enumerate(["P", *(f"D{j}" for j in range(decoders))]):
        ec = dict(extra)
        if name == "kvproto":
            ec["journal"] = str(workdir / f"{role}-{name}-r{round_}.jsonl")
        specs.append(h.EngineSpec(
            name=f"{role}-{name}", model=model,
            kv_transfer_config={**base, "kv_connector_extra_config": ec},
            env=h.engine_env(),
            kv_cache_memory_bytes=(64 << 20) if i == 0 else (32 << 20),
            max_num_seqs=128 if i == 0 else 64,
            log_path=str(workdir / f"{role}-{name}-r{round_}.log")))
    return specs


def journals(workdir: Path, decoders: int, round_: int = 0) -> list[Path]:
    """Every journal the kvproto engines of :func:`scale_specs` write: each engine (role
    ``kv_both``) writes its ledger journal and its Consumer journal beside it; P's ledger
    journal and each D's Consumer journal carry the traffic, the others only their
    header and warm-up."""
    from kvproto.vllm.workers import consumer_journal_path

    out = []
    for role in ["P", *(f"D{j}" for j in range(decoders))]:
        own = workdir / f"{role}-kvproto-r{round_}.jsonl"
        out += [own, Path(consumer_journal_path(str(own)))]
    return out


def validate(paths: Sequence[Path], timeout: float = 1800.0) -> tuple[bool, str]:
    """``kvproto validate`` on ``paths`` in a child process: (passed, a summary: the
    journals it passed and their steps, or its last line when it failed)."""
    present = [str(p) for p in paths if p.exists() and p.stat().st_size > 0]
    if len(present) != len(paths):
        return False, f"journals missing or empty: {sorted(set(map(str, paths)) - set(present))}"
    run = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate", *present],
                         capture_output=True, text=True, timeout=timeout, check=False)
    lines = (run.stdout + run.stderr).strip().splitlines()
    oks = [m for m in (re.search(r": OK, all (\d+) steps", ln) for ln in lines) if m]
    if run.returncode == 0:
        return True, f"{len(oks)} journals OK, {sum(int(m[1]) for m in oks)} steps"
    return False, lines[-1] if lines else f"exit {run.returncode}"


def drive(p: Engine, ds: Sequence[Engine], prompts: Mapping[str, Sequence[int]],
          reference: Mapping[str, list[int]], *, max_tokens: int, abandon_every: int = 0,
          sample: float = 0.2, drain: float = 60.0, timeout: float = 1800.0) -> Phase:
    """All ``prompts`` through P and then D ``ds[j % len(ds)]``, all in flight at once;
    every ``abandon_every``-th request is aborted at its D right after it is sent there.
    Samples P's held blocks every ``sample`` seconds until every request ended, then
    until P holds nothing (at most ``drain`` seconds more)."""
    from kvproto.vllm.harness import HarnessError

    ph = Phase(requests=len(prompts))
    rids = list(prompts)
    target = {rid: ds[j % len(ds)] for j, rid in enumerate(rids)}
    abandon = {rid for j, rid in enumerate(rids)
               if abandon_every and j % abandon_every == abandon_every - 1}
    baseline = int(p.stats()["free_blocks"])
    end: dict[str, float] = {}      # P's internal id -> time D finished or router gave up
    gone: set[str] = set()          # P's internal ids of the abandoned requests
    internal: dict[str, str] = {}   # rid -> P's internal id
    routed: set[str] = set()
    seen_p = len(p.results)
    seen_d = {id(d): len(d.results) for d in ds}
    t0 = time.time()
    for rid in rids:
        p.submit(rid, prompts[rid], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    deadline = time.monotonic() + timeout
    next_sample = 0.0
    while len(end) < len(rids):
        if time.monotonic() > deadline:
            raise HarnessError(f"scale: {len(rids) - len(end)} of {len(rids)} requests "
                               f"unfinished after {timeout:.0f} s")
        p.poll(0.01)
        new_p = list(p.results)[seen_p:]
        seen_p += len(new_p)
        for rid in new_p:
            if rid not in prompts or rid in routed:
                continue
            r = p.results[rid]
            routed.add(rid)
            internal[rid] = r.internal_id
            if r.error or not r.kv_transfer_params:
                ph.errors.append(rid)
                end[r.internal_id] = time.time()
                continue
            d = target[rid]
            d.submit(rid, prompts[rid], max_tokens=max_tokens,
                     kv_transfer_params=r.kv_transfer_params)
            if rid in abandon:
                d.abort([rid])
                end[r.internal_id] = time.time()
                gone.add(r.internal_id)
                ph.abandoned += 1
        for d in ds:
            d.poll(0)
            new = list(d.results)[seen_d[id(d)]:]
            seen_d[id(d)] += len(new)
            for rid in new:
                if rid in internal and rid not in abandon:
                    end[internal[rid]] = d.results[rid].finish_t
        if time.monotonic() >= next_sample:
            next_sample = time.monotonic() + sample
            ph.stranded.add(time.time(), p.held(), end, gone)
    t_done = time.time()
    for rid in rids:
        if rid in abandon or rid in ph.errors:
            continue
        r = target[rid].results[rid]
        if r.error or not r.token_ids or (r.finish_reasons and r.finish_reasons[0] in
                                          ("error", "abort")):
            ph.errors.append(rid)
            continue
        ph.tokens += len(r.tokens)
        if r.tokens != list(reference[rid]):
            ph.wrong.append(rid)
        if r.first_token_t is not None:
            ph.ttft_ms.append((r.first_token_t - p.results[rid].submit_t) * 1000.0)
    finish = [target[rid].results[rid].finish_t for rid in rids
              if rid not in abandon and rid in target[rid].results]
    ph.wall_s = (max(finish) if finish else t_done) - t0
    # Drain: every request ended; P must give every block back.
    drain_end = time.monotonic() + drain
    while True:
        held = p.held()
        now = time.time()
        ph.stranded.add(now, held, end, gone)
        free = int(p.stats()["free_blocks"])
        if not held and free >= baseline:
            ph.reclaimed = True
            break
        if time.monotonic() > drain_end:
            ph.held_left = sum(held.values())
            break
        for d in ds:
            d.poll(0)
        time.sleep(sample)
    ph.seconds_to_reclaim = max(0.0, time.time() - t_done)
    ph.loadavg_1m = round(os.getloadavg()[0], 2)
    return ph


def engine_core(index: int) -> int:
    """The core engine ``index`` (0: P, i + 1: D i) is bound to by :func:`scale_specs`."""
    cores = os.cpu_count() or 1
    return cores - 1 if index == 0 else (index - 1) % cores


def repin(pid: int, core: int) -> int:
    """Pin every thread of process ``pid`` to ``core``; the number of threads pinned
    (threads that exit meanwhile are skipped)."""
    n = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {core})
            n += 1
        except OSError:
            continue
    return n


def pin(engines: Sequence[Engine]) -> None:
    """One core per engine (``engines[0]`` is P), every thread; nothing on one core."""
    if (os.cpu_count() or 1) > 1:
        for i, e in enumerate(engines):
            repin(e.pid, engine_core(i))


def main_thread_cores(pid: int) -> list[int]:
    """The cores an engine's main thread (the one that steps the engine) may run on, as
    the engine left them after start-up (the stock connector re-pins it on CPU)."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


def prompts_for(count: int, tag: str, seed: int = 11) -> dict[str, list[int]]:
    from kvproto.vllm.harness import make_prompts

    return {f"{tag}-{j}": pr for j, pr in
            enumerate(make_prompts(count, seed=seed, lengths=list(LENGTHS)))}


def warm_up(p: Engine, ds: Sequence[Engine], tag: str, max_tokens: int) -> None:
    """Two requests through each D (handshakes, first-use costs); not counted."""
    from kvproto.vllm.harness import PD

    for i, d in enumerate(ds):
        PD(p, d).warm_up(f"{tag}-warm{i}", max_tokens=max_tokens)


def _bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from kvproto.vllm import harness as h
    from kvproto.vllm import scenarios as sc

    t_start = time.monotonic()
    model = str(h.build_tiny_model(workdir / "model").path)
    base = prompts_for(args.requests, "q")
    names = tuple(n for n in CONNECTORS if n in args.connectors.split(","))
    log.info("reference outputs of %d prompts (one engine, no connector)", len(base))
    (ref,) = h.start_engines([h.EngineSpec("REF", model, env=h.engine_env(),
                                           max_num_seqs=128,
                                           log_path=str(workdir / "REF.log"))])
    try:
        reference = sc.reference_outputs(ref, base, max_tokens=args.max_tokens,
                                         timeout=args.timeout)
    finally:
        ref.close()
    phases: dict[str, dict[str, list[Phase]]] = {n: {t: [] for t in TOPOLOGIES}
                                                 for n in names}
    affinity: dict[str, dict[str, list[int]]] = {}
    order = [(r, n) for r in range(args.rounds)
             for n in (names if r % 2 == 0 else names[::-1])]
    for rnd, name in order:
        specs = scale_specs(model, workdir, name, args.decoders, args.lease, rnd)
        log.info("round %d, %s: starting P and %d D engines", rnd, name, args.decoders)
        engines = h.start_engines(specs)
        try:
            p, ds = engines[0], engines[1:]
            if not args.no_pin:
                pin(engines)
            warm_up(p, ds, name, args.max_tokens)
            affinity[name] = {e.spec.name: main_thread_cores(e.pid) for e in engines}
            log.info("%s: cores of each engine's main thread: %s", name, affinity[name])
            for top, use in (("pair", ds[:1]), ("fanout", ds)):
                tag = f"{name}-{top}"
                prompts = {f"{tag}-{k}": v for k, v in base.items()}
                ref_t = {f"{tag}-{k}": v for k, v in reference.items()}
                ph = drive(p, use, prompts, ref_t, max_tokens=args.max_tokens,
                           abandon_every=args.abandon_every, sample=args.sample,
                           drain=args.lease + 30.0, timeout=args.timeout)
                phases[name][top].append(ph)
                log.info("round %d, %s %s: %s", rnd, name, top, ph.report())
        finally:
            for e in engines:
                e.close()
    meta: dict[str, Any] = {
        "workload": {"requests": args.requests, "decoders": args.decoders,
                     "max_tokens": args.max_tokens, "abandon_every": args.abandon_every,
                     "lease_s": args.lease, "sample_s": args.sample, "pinned": not args.no_pin,
                     "rounds": args.rounds,
                     "prompt_lengths": list(LENGTHS)},
        "journals_valid": None, "cpu_count": os.cpu_count(), "main_thread_cores": affinity,
        "loadavg_1m": round(os.getloadavg()[0], 2)}
    if "kvproto" in names and not args.no_validate:
        ok, last = validate([j for r in range(args.rounds)
                             for j in journals(workdir, args.decoders, r)])
        meta["journals_valid"] = ok
        meta["validate"] = last
        log.info("kvproto validate: %s (%s)", ok, last)
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    return build_report(phases, meta=meta)


def run(args: argparse.Namespace) -> int:
    bad = None
    if min(args.requests, args.decoders, args.max_tokens, args.rounds) < 1:
        bad = "--requests, --decoders, --max-tokens and --rounds must be >= 1"
    elif args.abandon_every < 0 or args.abandon_every == 1:
        bad = "--abandon-every must be 0 (none) or >= 2"
    elif not args.lease > 0 or not args.sample > 0 or not args.timeout > 0:
        bad = "--lease, --sample and --timeout must be > 0"
    else:
        chosen = [c for c in args.connectors.split(",") if c]
        if not chosen or any(c not in CONNECTORS for c in chosen):
            bad = f"--connectors must name some of {','.join(CONNECTORS)}"
    if bad:
        print(f"kvproto bench scale: {bad}", file=sys.stderr)
        return 2
    from kvproto.bench.vllm import run_engines_bench

    res = run_engines_bench("scale", args, _bench)
    if isinstance(res, int):
        return res
    print(json.dumps(res, sort_keys=True) if args.json else format_report(res))
    k = res.get("kvproto")
    if k and (any(k[t]["wrong_outputs"] or not k[t]["reclaimed"] for t in k)
              or res.get("journals_valid") is False):
        return 1
    return 0
