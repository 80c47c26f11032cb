"""P/D scenarios over real engines, shared by the end-to-end tests and ``bench vllm``.

Each scenario drives a running :class:`~kvproto.vllm.harness.PD` pair through the router
and returns what happened (outputs compared with the single-engine reference, timings,
P's free-block counts); the tests assert on it and the benchmark reports it. Nothing here
decides anything about blocks: the engines and their connector do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvproto.vllm.harness import BLOCK_SIZE, PD, Engine, HarnessError, Result, make_prompts

log = logging.getLogger(__name__)

# The lease used by the fault scenarios (seconds); D is LATE_D_DELAY late in late_d.
LEASE = 3.0
# The lease of the TP modules: TP engines step slowly on 2 cores (7 processes); under
# the full suite's load a request's prefill-to-READ path has taken over 6 s there.
TP_LEASE = 4 * LEASE
LATE_D_DELAY = 10.0


def lease_config(lease: float = LEASE) -> dict[str, float]:
    """Lifecycle ``Config`` fields for a short lease, valid under ``Config.timing_rules``
    (seconds, each a whole number of milliseconds)."""
    return {k: round(v, 3) for k, v in (
        ("initial_lease", lease), ("lease_extension", lease), ("heartbeat_interval", lease / 6),
        ("abort_grace", lease), ("max_delay", lease / 12), ("max_read_time", lease / 3),
        ("clock_drift", lease / 30))}


def kvproto_extras(journal_dir: str | None, lease: float = LEASE, *, tag: str = ""
                   ) -> dict[str, Any]:
    """``pd_specs`` keyword arguments for KVProtoConnector: the short lease on both
    engines (``kv_connector_extra_config["lease"]``) and one journal per engine
    (``journal``: ``<journal_dir>/P<tag>.jsonl`` and ``D<tag>.jsonl``)."""
    out: dict[str, Any] = {"extra_config": {"lease": lease_config(lease)}}
    if journal_dir is not None:
        out["p_extra"] = {"journal": f"{journal_dir}/P{tag}.jsonl"}
        out["d_extra"] = {"journal": f"{journal_dir}/D{tag}.jsonl"}
    return out


def stock_extras(lease: float = LEASE) -> dict[str, Any]:
    """``pd_specs`` keyword arguments for the stock NixlConnector: its lease in whole
    seconds (it heartbeats every lease/6)."""
    return {"extra_config": {"kv_lease_duration": max(1, round(lease))}}


@dataclass
class Outcome:
    """What one scenario produced."""

    requests: int = 0
    wrong: list[str] = field(default_factory=list)       # outputs that differ from the reference
    errors: list[str] = field(default_factory=list)      # requests that ended with an error
    tokens: int = 0
    wall_s: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput_tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def compare(results: dict[str, Result], reference: dict[str, list[int]],
            out: Outcome) -> None:
    """Count each finished request as right (equal to the reference token for token),
    wrong, or an error (ended without output; never counted as right)."""
    for rid, r in results.items():
        out.requests += 1
        if r.error or (r.finish_reasons and r.finish_reasons[0] in ("error", "abort")):
            out.errors.append(rid)
            continue
        for toks in r.token_ids:
            out.tokens += len(toks)
        if any(toks != reference[rid] for toks in r.token_ids) or not r.token_ids:
            out.wrong.append(rid)


def reference_outputs(ref: Engine, prompts: Mapping[str, Sequence[int]], *,
                      max_tokens: int, timeout: float = 300.0) -> dict[str, list[int]]:
    """Greedy outputs of the single engine (no connector) for every prompt."""
    res = ref.generate(prompts, max_tokens=max_tokens, timeout=timeout)
    bad = [rid for rid, r in res.items() if r.error or len(r.tokens) != max_tokens]
    if bad:
        raise HarnessError(f"reference engine failed on {bad[:5]}")
    return {rid: r.tokens for rid, r in res.items()}


def correctness(pd: PD, prompts: Mapping[str, Sequence[int]], reference: dict[str, list[int]],
                *, max_tokens: int) -> Outcome:
    """All prompts through P then D, several in flight at once. ``extra["cpu_s"]``: CPU
    time P and D used meanwhile (a figure that other load on the machine disturbs less
    than wall time)."""
    out = Outcome()
    cpu0 = pd.p.cpu_seconds() + pd.d.cpu_seconds()
    t0 = time.time()
    results = pd.run(prompts, max_tokens=max_tokens)
    out.wall_s = max(r.finish_t for r in results.values()) - t0
    out.extra["cpu_s"] = pd.p.cpu_seconds() + pd.d.cpu_seconds() - cpu0
    compare(results, reference, out)
    for rid, r in results.items():
        p = pd.p.results[rid]
        if r.first_token_t is not None:
            out.ttft_ms.append((r.first_token_t - p.submit_t) * 1000.0)
    out.results = results
    return out


def churn(p: Engine, *, blocks: int, tag: str, vocab: int = 1024, seed: int = 99,
          timeout: float = 120.0) -> None:
    """Plain (local) requests on P covering ``blocks`` KV blocks in total, so that every
    free block of P is allocated and overwritten at least once."""
    per = 8 * BLOCK_SIZE
    count = max(1, -(-blocks * BLOCK_SIZE // per))
    prompts = make_prompts(count, vocab=vocab, seed=seed, lengths=[per])
    items = {f"{tag}-churn{i}": pr for i, pr in enumerate(prompts)}
    p.generate(items, max_tokens=1, timeout=timeout)


def late_d(pd: PD, prompts: Mapping[str, Sequence[int]], reference: dict[str, list[int]], *,
           max_tokens: int, delay: float = LATE_D_DELAY, tag: str = "late",
           free_timeout: float = 120.0) -> Outcome:
    """P prefills; the router holds the transfer params ``delay`` seconds (longer than the
    lease) and meanwhile, once P has freed those blocks (lease expired: P's free-block
    count is back at its idle baseline), runs other requests over all of P's blocks; then
    D gets the params. A connector that fails closed refuses the stale read and
    recomputes; one that fails open decodes from whatever now sits in those blocks.
    ``extra``: ``expired_after_s`` (prefill done to P's blocks back), ``churn_passes``."""
    out = Outcome()
    baseline = int(pd.p.stats()["free_blocks"])
    t0 = time.time()
    pd.submit_prefills(prompts)
    p_res = pd.p.wait(prompts, 120.0)
    t_pref = time.time()
    freed, _, samples = wait_free(pd.p, baseline, free_timeout)
    if not freed:
        raise HarnessError(f"late_d: P still holds {baseline - samples[-1][1]} blocks "
                           f"{free_timeout:.0f} s after the prefills")
    total = int(pd.p.info.get("total_blocks", 0))
    passes = 0
    while passes < 1 or time.time() - t_pref < delay:
        churn(pd.p, blocks=total, tag=f"{tag}{passes}")
        passes += 1
        time.sleep(min(0.5, max(0.0, delay - (time.time() - t_pref))))
    for rid, prompt in prompts.items():
        pd.submit_decode(rid, prompt, p_res[rid], max_tokens=max_tokens)
    results = pd.d.wait(prompts, 180.0)
    out.wall_s = time.time() - t0
    compare(results, reference, out)
    out.results = results
    out.extra = {"expired_after_s": samples[-1][0] - t_pref, "churn_passes": passes,
                 "late_s": time.time() - t_pref}
    return out


def journal_records(journal: Path) -> list[dict[str, Any]]:
    """A journal's records after its header (each flushed per line)."""
    return [json.loads(line) for line in journal.read_text().splitlines()[1:] if line]


def _base_id(rid: object) -> str:
    """The id a scenario gave a request: the engine's request id before its first "-"."""
    return str(rid).split("-")[0]


def free_reasons(journal: Path) -> dict[str, list[str]]:
    """A P journal's frees: per request (its id before "-"), the reason of each free."""
    out: dict[str, list[str]] = {}
    for rec in journal_records(journal):
        for e in rec.get("effects", ()):
            if e.get("type") == "free":
                out.setdefault(_base_id(e["request_id"]), []).append(str(e["reason"]))
    return out


def done_readers(journal: Path) -> dict[str, set[str]]:
    """A P journal's dones: per request (its id before "-"), the distinct readers whose
    done its ledger took."""
    rid_of: dict[int, str] = {}
    out: dict[str, set[str]] = {}
    for rec in journal_records(journal):
        ev = rec.get("event", {})
        if ev.get("type") == "register":
            rid_of[int(ev["handle"])] = _base_id(ev["request_id"])
        elif ev.get("type") == "done" and int(ev.get("handle", -1)) in rid_of:
            out.setdefault(rid_of[int(ev["handle"])], set()).add(str(ev["reader"]))
    return out


def d_finished(journal: Path, part: str | None = None) -> dict[str, set[str]]:
    """A D (consumer) journal's finishes: per reason, the requests (ids before "-").
    ``part``: only the loads of that part of a request read from several P ranks (the
    id's suffix after "#"; "" for the part without one), else every load."""
    out: dict[str, set[str]] = {}
    for rec in journal_records(journal):
        for e in rec.get("effects", ()):
            if e.get("type") == "finished" and (
                    part is None or str(e["request_id"]).partition("#")[2] == part):
                out.setdefault(str(e["reason"]), set()).add(_base_id(e["request_id"]))
    return out


# A D rank's journal on a route: the path, or (path, part) where that D rank reads a
# request in parts, one per P rank (head slices): the part read from the route's P rank.
DJournal = Path | tuple[Path, str]


def _d_finished_of(dj: DJournal) -> tuple[str, dict[str, set[str]]]:
    if isinstance(dj, tuple):
        return f"{dj[0].name}#{dj[1]}", d_finished(dj[0], dj[1])
    return dj.name, d_finished(dj)


@dataclass
class Pulled:
    """What :func:`pulled_within` saw. ``violations``: safety rules broken (must stay
    empty); ``pending``: prompts not pulled on every route in the attempts allowed;
    ``given_up``: (P journal, request id, P's free reason, D journal -> its finishes)
    of each request some D rank gave up; ``outcomes``: each attempt's
    :func:`correctness` outcome; ``attempted``: every request id run, in order;
    ``pulled``: those pulled on every route (with their orphans released)."""

    violations: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    given_up: list[tuple[str, str, str, dict[str, list[str]]]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    attempted: list[str] = field(default_factory=list)
    pulled: list[str] = field(default_factory=list)


def route_verdict(ids: Iterable[str], p_journal: Path, d_journals: Sequence[DJournal],
                  into: Pulled) -> set[str]:
    """The requests ``ids`` on one route (a P rank's journal, the journals of the D ranks
    that read that P rank): returns those pulled; adds broken rules to
    ``into.violations`` and requests some D rank gave up to ``into.given_up``. Rules: P
    frees each request once; ``transferred`` only with the dones of as many distinct
    readers as ``d_journals`` and each of those D ranks finished it ``pulled``; otherwise
    ``released`` or ``expired``, and then some D rank did not pull it. A D journal may
    name the part of each request that D rank reads from this P rank (:data:`DJournal`)."""
    reasons, readers = free_reasons(p_journal), done_readers(p_journal)
    named = [_d_finished_of(j) for j in d_journals]
    ends = [kinds for _, kinds in named]
    pulled: set[str] = set()
    for i in ids:
        got = reasons.get(i, [])
        pulled_by = [i in kinds.get("pulled", set()) for kinds in ends]
        who = sorted(readers.get(i, set()))
        if len(got) != 1:
            into.violations.append(f"{p_journal.name}: {i} freed {len(got)} times: {got}")
        elif got == ["transferred"]:
            if len(who) == len(d_journals) and all(pulled_by):
                pulled.add(i)
            else:
                into.violations.append(f"{p_journal.name}: {i} freed transferred with "
                                       f"readers {who}, pulled by {pulled_by}")
        elif got[0] not in ("released", "expired") or all(pulled_by):
            into.violations.append(f"{p_journal.name}: {i} freed {got[0]}, pulled by "
                                   f"{pulled_by}")
        else:
            how = {name: sorted(r for r, ids_ in kinds.items() if i in ids_)
                   for name, kinds in named}
            into.given_up.append((p_journal.name, i, got[0], how))
    return pulled


def orphan_verdict(ids: Iterable[str], p_journal: Path, into: Pulled) -> set[str]:
    """The requests ``ids`` on a P rank no D rank reads (its blocks hold a replicated KV
    head another P rank serves): returns those D released there. Rules: P frees each
    request once, and never ``transferred`` (nobody read those blocks, so nobody may
    report them done). ``expired`` is not broken safety but a release that came too
    late (D gave the request up, or a stall outlasted the lease): added to
    ``into.given_up`` for another attempt."""
    reasons = free_reasons(p_journal)
    released: set[str] = set()
    for i in ids:
        got = reasons.get(i, [])
        if len(got) != 1 or got[0] not in ("released", "expired"):
            into.violations.append(f"{p_journal.name} (read by no D rank): {i} freed {got}")
        elif got[0] == "released":
            released.add(i)
        else:
            into.given_up.append((p_journal.name, i, got[0], {}))
    return released


def pulled_within(pd: PD, prompts: Mapping[str, Sequence[int]],
                  reference: Mapping[str, list[int]],
                  routes: Sequence[tuple[Path, Sequence[DJournal]]],
                  *, max_tokens: int, free_timeout: float, attempts: int = 3,
                  orphans: Sequence[Path] = ()) -> Pulled:
    """Run ``prompts`` through ``pd`` (:func:`correctness`) until each was pulled on every
    route, at most ``attempts`` times; a route is one P rank's journal and the journals
    of the D ranks that read that P rank. Prompt ids must not contain "-".

    Checked on every attempt (``violations``): no wrong output and no error; P's free
    blocks back at their count before the attempt; each P rank frees each request once:
    as ``transferred`` only with the dones of as many distinct readers as the route has
    D ranks, each of which finished it ``pulled``; otherwise as ``released`` or
    ``expired``, and then some D rank of the route did not pull it (it gave the request
    up, and the engine recomputed it). A prompt some D rank gave up is tried again under
    the id ``<prompt>t<attempt>``: on a CPU-starved host a stall of every thread can
    outlast a claim's answer or a lease (liveness, not safety). ``orphans``: journals of
    P ranks no D rank reads (:func:`orphan_verdict`); a request counts as pulled only
    once D released it on each of them."""
    bad = [k for k in prompts if "-" in k]
    if bad:
        raise ValueError(f"pulled_within: prompt ids must not contain '-': {bad[:5]}")
    res = Pulled()
    pending = {k: prompts[k] for k in prompts}
    for attempt in range(attempts):
        ids = {(f"{k}t{attempt}" if attempt else k): k for k in pending}
        baseline = int(pd.p.stats()["free_blocks"])
        out = correctness(pd, {i: pending[k] for i, k in ids.items()},
                          {i: reference[k] for i, k in ids.items()}, max_tokens=max_tokens)
        res.outcomes.append(out)
        res.attempted.extend(ids)
        if out.wrong or out.errors or out.requests != len(ids):
            res.violations.append(f"attempt {attempt}: wrong {out.wrong}, errors "
                                  f"{out.errors}, {out.requests} of {len(ids)} ended")
        if not wait_free(pd.p, baseline, free_timeout)[0]:
            res.violations.append(f"attempt {attempt}: {pd.p.spec.name} did not free its "
                                  f"blocks within {free_timeout:.0f} s")
        if res.violations:
            break
        done = set(ids)
        for pj, djs in routes:
            done &= route_verdict(ids, pj, djs, res)
        for pj in orphans:
            done &= orphan_verdict(ids, pj, res)
        if res.violations:
            break
        for i in sorted(done):
            del pending[ids[i]]
            res.pulled.append(i)
        if not pending:
            break
        log.warning("%s -> %s attempt %d: given up by a D rank so far %s; P's poll stalls "
                    "%s", pd.p.spec.name, pd.d.spec.name, attempt, res.given_up,
                    poll_stalls(pd.p))
    res.pending = sorted(pending)
    return res


def poll_stalls(engine: Engine) -> float | None:
    """The gaps between the adapter polls of ``engine``'s worker side over ``max_delay``
    so far (``poll_stalls``); None where this harness cannot ask: a TP engine's worker
    side runs in its worker processes (each logs its own gaps), or the call failed."""
    if int(getattr(engine.spec, "tensor_parallel_size", 1) or 1) > 1:
        return None
    try:
        return float(engine.connector_stats().get("poll_stalls", 0))
    except HarnessError:
        return None


def warm_up_pulled(pd: PD, tag: str, d_journals: Sequence[Path], *, rounds: int = 4) -> int:
    """``PD.warm_up`` until one round's requests were all pulled on every D rank: each
    D journal in ``d_journals`` ended some ``pulled`` and none otherwise but ``aborted``
    (the part of a P rank that this D rank does not read, released as an orphan). A
    pair is warm only once a READ went through, not when its first requests were
    recomputed (a first contact that outlasted the lease: the handshake, the first
    claims and grants each wait for an engine step on both sides). Returns the rounds
    used; ``HarnessError`` after ``rounds`` rounds without a pull."""
    seen: dict[str, set[str]] = {}
    for i in range(1, rounds + 1):
        rid = f"{tag}r{i}"  # the round's requests: "<rid>-0", "<rid>-1", ...
        pd.warm_up(rid)
        seen = {j.name: {why for why, ids in d_finished(j).items() if rid in ids}
                if j.exists() else set() for j in d_journals}
        if all("pulled" in r and r <= {"pulled", "aborted"} for r in seen.values()):
            return i
        stalls = {e.spec.name: poll_stalls(e) for e in (pd.p, pd.d)}
        log.warning("warm-up round %d of %s not pulled everywhere: %s (gaps between "
                    "adapter polls over max_delay so far, per engine: %s)", i, tag, seen,
                    stalls)
    raise HarnessError(f"{tag}: no warm-up round pulled on every D rank in {rounds}: {seen}")


def wait_free(p: Engine, baseline: int, timeout: float, *, others: Sequence[Engine] = (),
              interval: float = 0.1) -> tuple[bool, float, list[tuple[float, int]]]:
    """Sample P's free-block count until it is back at ``baseline`` (or ``timeout``).
    Returns (reached, block-seconds held above baseline while waiting, samples)."""
    samples: list[tuple[float, int]] = []
    held_s = 0.0
    t_prev = time.time()
    deadline = time.monotonic() + timeout
    while True:
        st = p.stats()
        now = float(st["time"])
        free = int(st["free_blocks"])
        if samples:
            held_s += max(0, baseline - samples[-1][1]) * (now - t_prev)
        samples.append((now, free))
        t_prev = now
        if free >= baseline:
            return True, held_s, samples
        if time.monotonic() > deadline:
            return False, held_s, samples
        for e in others:
            if e.alive():
                e.poll(0)
        time.sleep(interval)


def worker_pid(engine_pid: int, name: str, log_path: str | None = None) -> int:
    """The pid of the child of ``engine_pid`` that is vLLM's worker ``name``
    (``Worker_TP0``, ...), for tests that kill one rank; ``HarnessError`` when there is
    none (Linux ``/proc``). A spawned worker names itself in its command line
    (``VLLM::Worker_TP0``); a forked one (``EngineSpec.worker_start``) keeps its
    parent's, so it is found by the ``(Worker_TP0 pid=N)`` prefix vLLM writes on its log
    lines in ``log_path`` (the engine's log), N checked to be a child of the engine."""
    children: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat[1]) == engine_pid:
            children[int(d.name)] = cmd
    for pid, cmd in children.items():
        if name in cmd:
            return pid
    if log_path is not None:
        try:
            text = Path(log_path).read_text(errors="replace")
        except OSError:
            text = ""
        for m in reversed(re.findall(rf"\({re.escape(name)} pid=(\d+)\)", text)):
            if int(m) in children:
                return int(m)
    raise HarnessError(f"no {name} under engine {engine_pid}")


def p_rank_killed(pd: PD, prompts: Mapping[str, Sequence[int]], *, max_tokens: int,
                  timeout: float, rank: int = 0,
                  before_kill: Callable[[], None] | None = None) -> dict[str, Result]:
    """P prefills ``prompts``; D gets them, and P's rank ``rank`` worker is killed -9
    while D pulls (``before_kill`` runs right before the kill, after D got them).
    Returns D's results once every request ended (``HarnessError`` if one has not after
    ``timeout`` seconds: a hang)."""
    params = {rid: pd.prefill(rid, pr) for rid, pr in prompts.items()}
    victim = worker_pid(pd.p.pid, f"Worker_TP{rank}", pd.p.spec.log_path)
    for rid, pr in prompts.items():
        pd.submit_decode(rid, pr, params[rid], max_tokens=max_tokens)
    if before_kill is not None:
        before_kill()
    os.kill(victim, signal.SIGKILL)
    return pd.d.wait(prompts, timeout=timeout)


def d_killed(pd: PD, prompts: Mapping[str, Sequence[int]], *, timeout: float) -> Outcome:
    """P prefills; D gets the requests while its step loop is paused (no READ yet) and is
    then killed -9. Measures P's stranded block-seconds until every block is free again
    (``extra``: stranded_block_seconds, freed, baseline)."""
    out = Outcome()
    baseline = int(pd.p.stats()["free_blocks"])
    pd.submit_prefills(prompts)
    p_res = pd.p.wait(prompts, 120.0)
    pd.d.pause(60.0)
    for rid, prompt in prompts.items():
        pd.submit_decode(rid, prompt, p_res[rid], max_tokens=4)
    time.sleep(0.5)   # D admits them (its connector sees the requests) before it dies
    held_at_kill = baseline - int(pd.p.stats()["free_blocks"])
    pd.d.kill()
    freed, stranded, samples = wait_free(pd.p, baseline, timeout)
    out.requests = len(prompts)
    out.extra = {"stranded_block_seconds": stranded, "freed": freed, "baseline": baseline,
                 "held_at_kill": held_at_kill,
                 "seconds_to_free": samples[-1][0] - samples[0][0] if samples else 0.0}
    return out
