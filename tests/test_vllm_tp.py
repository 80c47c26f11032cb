"""End to end with tensor parallelism: KVProtoConnector in real vLLM engines (CPU build,
multiprocess executor over gloo), on a model with one KV head (fewer KV heads than ranks:
vLLM replicates it on every rank, so every rank of either engine holds the same head and
blocks pair one to one across TP sizes; each D rank reads it once).

Three engines serve every test of the module: E (TP 1, kvproto as P and D), P (TP 2) and
D (TP 2), started one at a time. E first gives the single-engine reference (plain
requests, no transfer params: its connector does nothing for them). Checks:

* P TP 2 -> D TP 2: D's greedy outputs equal the reference token for token; a late D
  after lease expiry is fenced or refused and recomputed (0 wrong);
* P TP 2 -> D TP 1 (P -> E): token for token; E reads P rank 0 only and reports every
  load complete through its coverage machine; P rank 1's blocks, which no D rank reads,
  expire and are counted ``orphan`` on D;
* P TP 1 -> D TP 2 (E -> engine P, which runs kvproto's D side too, so that each D
  journal talks to one P engine): token for token; both D ranks pull E's one rank, and
  E's ledger frees each request as ``transferred`` only after two distinct readers are
  done (the reader count comes from the TP ratio, announced by D);
* client aborts at TP 2 -> TP 2: on D before its READ (every D rank releases to its P
  rank, which frees as ``released``, never by lease), on D during its READ (each P rank
  frees the request once) and on P after its prefill (each P rank frees it once, by
  lease); D then still decodes token for token;
* every rank's journal (P's and D's ranks as P and as D, E as P and as D) passes
  ``kvproto validate``;
* one D rank's worker is killed while D pulls: P gets every block back within the
  lease bound and frees each request once per rank, and whatever D still answers is the
  reference;
* last, engine P's rank 0 worker is killed while a fresh D (TP 2) and E pull from it
  (P TP 2 -> D TP 2 and -> D TP 1) and while it pulls from E (E TP 1 -> D TP 2): every
  request of the fresh D and of E ends within a bound, none hangs, and whatever they
  answer is the reference; E gets every block back within the lease bound, each request
  freed once.

Plans that need head slices (more KV heads than the smaller TP size) are refused per
request before any READ (tests/test_vllm_topology.py, tests/test_vllm_dcover.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

MAX_TOKENS = 8
P_KV_BYTES = 8 << 20
COR = {f"c{i}": p for i, p in enumerate(h.make_prompts(8, seed=21))}
LATE = {f"late{i}": p for i, p in enumerate(h.make_prompts(2, seed=22, lengths=[64, 100]))}
KILL = {f"k{i}": p for i, p in enumerate(h.make_prompts(3, seed=23, lengths=[90, 250, 31]))}
H21 = {f"a{i}": p for i, p in enumerate(h.make_prompts(4, seed=24))}
H12 = {f"b{i}": p for i, p in enumerate(h.make_prompts(4, seed=25))}
KILLP = {f"q{i}": p for i, p in enumerate(h.make_prompts(3, seed=26, lengths=[90, 250, 31]))}
KILLD = {f"v{i}": p for i, p in enumerate(h.make_prompts(3, seed=28, lengths=[120, 60, 200]))}
KILL2 = {f"u{i}": p for i, p in enumerate(h.make_prompts(3, seed=29, lengths=[150, 40, 96]))}
ABORT = {f"x{i}": p for i, p in enumerate(h.make_prompts(4, seed=27, lengths=[70, 200, 45, 120]))}
ALL = {**COR, **LATE, **KILL, **H21, **H12, **KILLP, **ABORT, **KILLD, **KILL2}
LEASE = sc.TP_LEASE
FREE_TIMEOUT = 8 * LEASE + 30.0  # a hang bound, not a timing assertion


class Pair:
    def __init__(self, pd: h.PD, e: h.Engine, ref: dict[str, list[int]],
                 journals: list[Path], d_spec: Callable[[str], h.EngineSpec]) -> None:
        self.pd, self.e, self.ref, self.journals = pd, e, ref, journals
        self.d_spec = d_spec  # a D engine like D under another tag (journals, log)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    wd = tmp_path_factory.mktemp("vllm_tp")
    model = str(h.build_tiny_model(wd / "model", heads=4, kv_heads=1).path)

    def specs(tag: str) -> tuple[h.EngineSpec, h.EngineSpec]:
        kw = sc.kvproto_extras(str(wd), LEASE, tag=tag)
        # D only reads: nobody reads its blocks, so its producer side needs no NIXL
        # progress thread (NIXL's busy loop would take a core from the engines here)
        kw["d_extra"] = {**kw.get("d_extra", {}), "progress_thread": False}
        p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag=tag,
                                    p_kv_bytes=P_KV_BYTES, **kw)
        p_spec.tensor_parallel_size = d_spec.tensor_parallel_size = 2
        # TP workers forked from their engine process: no fresh torch/vLLM import per
        # worker. tests/test_vllm_tp_slices.py keeps vLLM's spawned workers (the
        # production path).
        p_spec.worker_start = d_spec.worker_start = "fork"
        return p_spec, d_spec

    p_spec, d_spec = specs("1")
    e_spec, _ = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="E",
                           **sc.kvproto_extras(str(wd), LEASE, tag="E"))
    e_spec.name = "E"
    started: list[h.Engine] = []
    try:
        for spec in (e_spec, p_spec, d_spec):  # one at a time: 7 processes on 2 cores
            [eng] = h.start_engines([spec], timeout=600)
            started.append(eng)
            if spec is e_spec:  # under other request ids: E serves these prompts later
                ref = sc.reference_outputs(eng, {f"ref-{k}": v for k, v in ALL.items()},
                                           max_tokens=MAX_TOKENS)
                reference = {k[4:]: v for k, v in ref.items()}
    except BaseException:
        for eng in started:
            eng.kill()
        raise
    e, p, d = started
    pd = h.PD(p, d)
    try:
        # first contacts and first decode steps of every pair the tests use (engine P is
        # also E's D)
        for tag, link, d_journals in (
                ("w22", pd, ["D1.consumer.jsonl", "D1.tp1.consumer.jsonl"]),
                ("w21", h.PD(p, e), ["PE.consumer.jsonl"]),
                ("w12", h.PD(e, p), ["P1.consumer.jsonl", "P1.tp1.consumer.jsonl"])):
            sc.warm_up_pulled(link, tag, [wd / j for j in d_journals])
        yield Pair(pd, e, reference, [wd / "P1.jsonl", wd / "P1.tp1.jsonl",
                                      wd / "D1.consumer.jsonl", wd / "D1.tp1.consumer.jsonl",
                                      wd / "PE.jsonl", wd / "PE.consumer.jsonl",
                                      wd / "P1.consumer.jsonl", wd / "P1.tp1.consumer.jsonl"],
                   lambda tag: specs(tag)[1])
    finally:
        pd.close()
        e.close()


def _rank_journals(pair: Pair) -> list[Path]:
    """P's two rank journals (its ledgers' own record, read with
    ``scenarios.free_reasons``: with TP > 1 the worker-side connectors live in vLLM's
    worker processes)."""
    return pair.journals[:2]


def test_tp2_to_tp2_token_for_token(pair: Pair) -> None:
    """Token for token, pulled, not recomputed: every P rank frees every request as
    transferred, each on the done of its own D rank (checked on every attempt)."""
    j = pair.journals
    _pulled_within(pair, pair.pd, COR, [(j[0], [j[2]]), (j[1], [j[3]])])


def _pulled_within(pair: Pair, link: h.PD, prompts: dict[str, list[int]],
                   routes: list[tuple[Path, list[Path]]]) -> None:
    """``scenarios.pulled_within``: safety on every attempt; each prompt pulled on every
    route (a P rank's journal, the journals of the D ranks that read it) within three."""
    got = sc.pulled_within(link, prompts, pair.ref, routes, max_tokens=MAX_TOKENS,
                           free_timeout=FREE_TIMEOUT)
    assert got.violations == [], (got.violations, got.given_up)
    assert got.pending == [], (got.pending, got.given_up)


def test_tp2_late_d_is_fenced_and_recomputed(pair: Pair) -> None:
    out = sc.late_d(pair.pd, LATE, pair.ref, max_tokens=MAX_TOKENS)
    assert out.wrong == [] and out.errors == [], (out.wrong, out.errors)
    for j in _rank_journals(pair):  # each P rank expired them: nothing was pulled
        fr = sc.free_reasons(j)
        expired = {rid for rid, why in fr.items() if "expired" in why}
        pulled = {rid for rid, why in fr.items() if "transferred" in why}
        assert set(LATE) <= expired and not set(LATE) & pulled, (j.name, fr)


def test_tp2_to_tp1_reads_one_p_rank_and_counts_the_orphan(pair: Pair) -> None:
    """P TP 2 -> D TP 1 (E): E reads P rank 0's blocks whole (the one KV head), and
    reports each load complete only through its coverage machine; P rank 1's blocks are
    read by no D rank: E counts them ``orphan`` and releases them once the request
    ended, so P rank 1 frees them as ``released``, never by lease expiry and never as
    ``transferred`` (checked on every attempt; a prompt E gave up runs again)."""
    p, e = pair.pd.p, pair.e
    j = pair.journals
    before = e.connector_stats()
    got = sc.pulled_within(h.PD(p, e), H21, pair.ref, [(j[0], [j[5]])],
                           max_tokens=MAX_TOKENS, free_timeout=FREE_TIMEOUT, orphans=[j[1]])
    assert got.violations == [], (got.violations, got.given_up)
    assert got.pending == [] and len(got.pulled) == len(H21), (got.pending, got.given_up)
    after = e.connector_stats()

    def grew(k: str) -> float:
        return float(after.get(k, 0)) - float(before.get(k, 0))

    seen: dict[str, object] = {k: (before.get(k), v) for k, v in after.items()
                               if before.get(k) != v}
    seen["given_up"] = got.given_up
    # one complete load and one orphan per pulled request; at most one per attempt
    # (exactly one per prompt when no attempt was given up)
    for k in ("coverage_complete", "orphan"):
        assert len(got.pulled) <= grew(k) <= len(got.attempted), (k, seen)
    assert grew("tp_refused") == 0, seen
    if len(got.attempted) == len(got.pulled):  # no attempt given up: no READ failed
        assert grew("reads_failed") == 0, seen


def test_tp1_to_tp2_frees_after_both_d_ranks(pair: Pair) -> None:
    """P TP 1 (E) -> D TP 2 (engine P, which runs kvproto's D side too: every D journal
    then talks to one P engine, as TLC's KVConsumer models it): both D ranks read E's one
    rank; E's ledger frees each request as transferred only after two distinct readers
    were done (checked on every attempt)."""
    _pulled_within(pair, h.PD(pair.e, pair.pd.p), H12,
                   [(pair.journals[4], pair.journals[6:8])])


def _freed_as(pair: Pair, rid: str) -> list[list[str]]:
    """Per P rank, the reasons its ledger freed ``rid`` for (one entry per free)."""
    return [sorted(sc.free_reasons(j).get(rid, [])) for j in _rank_journals(pair)]


def test_tp2_client_aborts_free_every_p_rank_once(pair: Pair) -> None:
    """Client aborts at TP 2 -> TP 2, in three phases. On D before its READ (D's loop
    paused, so the admit and the abort reach both D ranks in one step): every D rank
    releases to its P rank, and each P rank frees the request as ``released``, not by
    its lease. On D during its READ (aborted right after the step that issued it):
    each P rank frees it exactly once. On P after its prefill (the request never goes
    to D): each P rank frees it exactly once, by lease. Then D still decodes token for
    token and P's pool is back where it was, not one block more."""
    p, d = pair.pd.p, pair.pd.d
    baseline = int(p.stats()["free_blocks"])
    # before the READ
    res = pair.pd.prefill("x0", ABORT["x0"])
    d.pause(1.0)
    pair.pd.submit_decode("x0", ABORT["x0"], res, max_tokens=MAX_TOKENS)
    d.abort(["x0"])
    assert d.wait(["x0"], 60)["x0"].error == "aborted"
    # during the READ
    res = pair.pd.prefill("x1", ABORT["x1"])
    d.abort_on("x1", "WAITING_FOR_REMOTE_KVS")
    pair.pd.submit_decode("x1", ABORT["x1"], res, max_tokens=MAX_TOKENS)
    assert d.wait(["x1"], 60)["x1"].error == "aborted", \
        "the READ finished before the abort could land"
    # on P, after the prefill
    pair.pd.prefill("x2", ABORT["x2"])
    assert baseline - int(p.stats()["free_blocks"]) > 0, "P holds x2's blocks for D"
    p.abort(["x2"], core=True)
    ok, _, _ = sc.wait_free(p, baseline, FREE_TIMEOUT)
    assert ok, "P did not get the aborted requests' blocks back"
    assert int(p.stats()["free_blocks"]) == baseline, "more free blocks than before"
    freed = {rid: _freed_as(pair, rid) for rid in ("x0", "x1", "x2")}
    assert freed["x0"] == [["released"], ["released"]], freed
    for rid in ("x1", "x2"):
        assert [len(r) for r in freed[rid]] == [1, 1], freed
    # vLLM ignores an abort of a request whose output already finished: the lease ends it
    assert all(r[0] in ("expired", "aborted") for r in freed["x2"]), freed
    # D still serves: pulled, token for token
    j = pair.journals
    _pulled_within(pair, pair.pd, {"x3": ABORT["x3"]}, [(j[0], [j[2]]), (j[1], [j[3]])])


def _admitted(journal: Path) -> set[str]:
    """Requests (ids before "-") a D journal admitted so far."""
    return {rid.split("-")[0] for rec in sc.journal_records(journal)
            if (rid := rec.get("event", {}).get("request_id")) is not None
            and rec["event"].get("type") == "admit"}


def test_every_rank_journal_validates(pair: Pair) -> None:
    present = [str(j) for j in pair.journals if j.exists() and j.stat().st_size > 0]
    assert len(present) == len(pair.journals), (present, pair.journals)
    run = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate", *present],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stdout + run.stderr


def test_d_rank_worker_killed_p_reclaims_within_lease(pair: Pair) -> None:
    """Next to last (it breaks D): D rank 1's worker is killed while D pulls. Every P rank gets
    its blocks back within the lease bound (done, or expiry of what D can no longer
    renew), each request freed once per P rank; no answer D still gives is wrong."""
    p = pair.pd.p
    baseline = int(p.stats()["free_blocks"])
    res = {rid: pair.pd.prefill(rid, pr) for rid, pr in KILL.items()}
    assert baseline - int(p.stats()["free_blocks"]) > 0  # P holds them for D
    victim = sc.worker_pid(pair.pd.d.pid, "Worker_TP1", pair.pd.d.spec.log_path)
    for rid, pr in KILL.items():
        pair.pd.submit_decode(rid, pr, res[rid], max_tokens=MAX_TOKENS)
    os.kill(victim, signal.SIGKILL)
    ok, _, _ = sc.wait_free(p, baseline, FREE_TIMEOUT)
    assert ok, "P did not get its blocks back after a D rank died"
    assert int(p.stats()["free_blocks"]) == baseline  # and not one block more
    for j in _rank_journals(pair):
        fr = sc.free_reasons(j)
        for rid in KILL:
            assert len(fr.get(rid, [])) == 1, (j.name, rid, fr)
    for rid, r in pair.pd.d.results.items():
        if rid in KILL and r.error is None and r.tokens:
            assert r.tokens == pair.ref[rid], rid


def test_p_rank_worker_killed_every_d_request_ends(pair: Pair) -> None:
    """Last (it breaks engine P): engine P's rank 0 worker is killed while requests run
    on three routes. A fresh D (TP 2; the previous test broke the first) pulls from P
    (P TP 2 -> D TP 2): its rank 0 reads the dead rank, its rank 1 a rank that lives on
    until engine P goes down, so a request may be read on one D rank and not the other;
    every D request ends within a bound and none is wrong (a load counts only when every
    D rank read its part). E pulls from P rank 0 (P TP 2 -> D TP 1): every E request
    ends within a bound (E loses the peer: the request recomputes or fails per policy),
    none hangs, and no answer is wrong. Engine P's dead worker is also one of the two D
    ranks claiming from E (E TP 1 -> D TP 2): E gets every block back within the lease
    bound (the surviving reader's done cannot free them alone) and frees each request
    once; no answer engine P still gave is wrong."""
    p, e = pair.pd.p, pair.e
    [d2] = h.start_engines([pair.d_spec("2")], timeout=600)
    try:
        wd = pair.journals[0].parent
        d2_journals = [wd / "D2.consumer.jsonl", wd / "D2.tp1.consumer.jsonl"]
        sc.warm_up_pulled(h.PD(p, d2), "w22k", d2_journals)
        to_d2 = h.PD(p, d2)
        params2 = {rid: to_d2.prefill(rid, pr) for rid, pr in KILL2.items()}
        to_p = h.PD(e, p)
        e_baseline = int(e.stats()["free_blocks"])
        params = {rid: to_p.prefill(rid, pr) for rid, pr in KILLD.items()}
        assert e_baseline - int(e.stats()["free_blocks"]) > 0  # E holds them for engine P

        def three_routes() -> None:
            """Right before the kill: both D ranks of engine P admit KILLD and claim
            them from E, which is paused, so that the kill finds them claiming, not yet
            read; then the fresh D gets KILL2, last, so that the kill finds its loads
            starting."""
            e.pause(4.0)
            for rid, pr in KILLD.items():
                to_p.submit_decode(rid, pr, params[rid], max_tokens=MAX_TOKENS)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and not all(
                    set(KILLD) <= _admitted(j) for j in pair.journals[6:8]):
                time.sleep(0.05)
            for rid, pr in KILL2.items():
                to_d2.submit_decode(rid, pr, params2[rid], max_tokens=MAX_TOKENS)

        got = sc.p_rank_killed(h.PD(p, e), KILLP, max_tokens=MAX_TOKENS,
                               timeout=FREE_TIMEOUT, before_kill=three_routes)
        assert set(got) == set(KILLP)  # p_rank_killed raises if one has not ended by then
        for rid, r in got.items():
            if r.error is None and r.tokens:
                assert r.tokens == pair.ref[rid], rid
        ended = d2.wait(KILL2, timeout=FREE_TIMEOUT)  # raises if one hangs
        for rid, r in ended.items():
            if r.error is None and r.tokens:
                assert r.tokens == pair.ref[rid], (rid, sc.d_finished(d2_journals[0]),
                                                   sc.d_finished(d2_journals[1]))
        assert d2.alive(), "D went down with P"
        ok, _, _ = sc.wait_free(e, e_baseline, FREE_TIMEOUT)
        assert ok, "E did not get its blocks back after a D rank of engine P died"
        assert int(e.stats()["free_blocks"]) == e_baseline  # and not one block more
        freed = sc.free_reasons(pair.journals[4])
        assert {rid: len(freed.get(rid, [])) for rid in KILLD} == dict.fromkeys(KILLD, 1), \
            freed
        for rid in KILLD:
            at_p = p.results.get(rid)
            if at_p is not None and at_p.error is None and at_p.tokens:
                assert at_p.tokens == pair.ref[rid], rid
    finally:
        d2.close()
