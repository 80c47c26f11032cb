"""End to end: KVProtoConnector inside real vLLM engines.

Real vLLM engines (the CPU build), each in its own process, real NIXL (UCX over loopback),
a tiny LlamaForCausalLM with random real weights written locally; nothing mocked. The
router (this process) sends token-id prompts to P, hands P's ``kv_transfer_params`` to D
unchanged, and compares D's greedy outputs with a single engine that has no connector.

Engine start-up is the cost (about 18 s each on 2 cores), so one P/D pair serves the
correctness, late-D, abort, cache-reset and n>1 tests (in this order), and only the fault
tests start fresh engines (something gets killed there). Every engine process is killed at
the end of its fixture, pass or fail (``harness.kill_all`` also runs at exit).

``KVPROTO_E2E_CONNECTOR=stock`` runs the same module against vLLM's stock NixlConnector
(to check the harness itself; the late-D test then shows stock serving wrong KV).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

CONNECTOR = os.environ.get("KVPROTO_E2E_CONNECTOR", "kvproto")
STOCK = CONNECTOR == "stock"
MAX_TOKENS = 8
SAMPLE_SEED = 7
P_KV_BYTES = 8 << 20        # P: 128 blocks of 32 tokens, so that churn reuses all of them
FREE_TIMEOUT = 8 * sc.LEASE + 20.0   # a hang bound, not a timing assertion

# Prompts (token ids). Correctness: 16 prompts cycling one block, a partial block, whole
# blocks and many blocks plus a partial last one.
COR = {f"c{i}": p for i, p in enumerate(h.make_prompts(16, seed=11))}
LATE = {f"late{i}": p for i, p in enumerate(h.make_prompts(4, seed=12, lengths=[64, 100, 160, 96]))}
ABORT = {f"ab{i}": p for i, p in enumerate(h.make_prompts(4, seed=13, lengths=[96, 40, 200, 64]))}
NGEN = {f"n{i}": p for i, p in enumerate(h.make_prompts(2, seed=14, lengths=[70, 128]))}
AFTER = {f"after{i}": p for i, p in enumerate(h.make_prompts(4, seed=15, lengths=[33, 300]))}
KILL = {f"k{i}": p for i, p in enumerate(h.make_prompts(4, seed=16, lengths=[90, 64, 250, 31]))}
RESET = {f"rc{i}": p for i, p in enumerate(h.make_prompts(2, seed=17, lengths=[120, 70]))}
ALL = {**COR, **LATE, **ABORT, **NGEN, **AFTER, **KILL, **RESET}


def _pd_kwargs(journal_dir: Path, tag: str) -> dict[str, Any]:
    if STOCK:
        return {"connector": h.STOCK_CONNECTOR, **sc.stock_extras()}
    return {"connector": h.KVPROTO_CONNECTOR, **sc.kvproto_extras(str(journal_dir), tag=tag)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_e2e")


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    return str(h.build_tiny_model(workdir / "model").path)


class Pair:
    """The long-lived P/D pair, the reference outputs, and P's idle free-block count."""

    def __init__(self, pd: h.PD, reference: dict[str, list[int]], journals: list[Path]):
        self.pd = pd
        self.ref = reference
        self.journals = journals
        self.sampled: dict[str, list[list[int]]] = {}
        self.baseline = int(pd.p.stats()["free_blocks"])

    def p_back_to_baseline(self) -> tuple[bool, float]:
        ok, _, samples = sc.wait_free(self.pd.p, self.baseline, FREE_TIMEOUT,
                                      others=[self.pd.d])
        st = self.pd.p.stats()
        # never more free blocks than the idle pool: a double free would show here
        assert int(st["free_blocks"]) <= self.baseline, st
        return ok, samples[-1][0] - samples[0][0]


@pytest.fixture(scope="module")
def pair(model: str, workdir: Path) -> Iterator[Pair]:
    kw = _pd_kwargs(workdir, "1")
    connector = kw.pop("connector")
    p_spec, d_spec = h.pd_specs(model, workdir, connector, tag="1", p_kv_bytes=P_KV_BYTES,
                                prefix_caching=True, **kw)
    ref_spec = h.EngineSpec("REF", model, env=h.engine_env(), log_path=str(workdir / "REF.log"))
    ref, p, d = h.start_engines([ref_spec, p_spec, d_spec])
    pd = h.PD(p, d)
    try:
        reference = sc.reference_outputs(ref, ALL, max_tokens=MAX_TOKENS)
        # n=2 on D needs sampling (vLLM refuses n>1 greedy): seeded, so the single engine
        # gives the completions D must reproduce from P's KV
        sampled = ref.generate({f"{k}-s": v for k, v in NGEN.items()}, max_tokens=MAX_TOKENS,
                               n=2, temperature=1.0, seed=SAMPLE_SEED)
        ref.close()
        pr = Pair(pd, reference, [workdir / "P1.jsonl", workdir / "D1.jsonl"])
        pr.sampled = {k[:-2]: r.token_ids for k, r in sampled.items()}
        yield pr
    finally:
        ref.kill()
        pd.close()


def _counters(e: h.Engine) -> dict[str, Any]:
    return {} if STOCK else e.connector_stats()


def _num(stats: dict[str, Any], key: str) -> float:
    v = stats.get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _frees(stats: dict[str, Any]) -> dict[str, float]:
    """Frees by reason: a ``frees`` mapping, or flat ``frees_<reason>`` counters."""
    f = stats.get("frees")
    out = {str(k): float(v) for k, v in f.items()} if isinstance(f, dict) else {}
    for k, v in stats.items():
        if k.startswith("frees_") and isinstance(v, (int, float)):
            out[k[len("frees_"):]] = out.get(k[len("frees_"):], 0.0) + float(v)
    return out


def _validate(journals: list[Path], *, need_consumer: bool = False) -> None:
    """``kvproto validate`` on the P journals and the D (Consumer) journals beside them."""
    from kvproto.vllm.workers import consumer_journal_path

    consumer = [Path(consumer_journal_path(str(j))) for j in journals]
    present = [str(j) for j in journals + consumer if j.exists() and j.stat().st_size > 0]
    assert present, f"no journal written among {journals}"
    if need_consumer:
        assert any(str(c) in present for c in consumer), f"no D journal among {consumer}"
    run = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate", *present],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stdout + run.stderr


# ---------------------------------------------------------------------------- one pair


def test_correctness_many_in_flight(pair: Pair) -> None:
    """16 prompts of varied lengths, all in flight at once: D's greedy outputs equal the
    single engine token for token, and P gets every block back."""
    out = sc.correctness(pair.pd, COR, pair.ref, max_tokens=MAX_TOKENS)
    assert out.errors == [] and out.wrong == [], (out.errors, out.wrong)
    assert out.requests == len(COR) and out.tokens == len(COR) * MAX_TOKENS
    ok, _ = pair.p_back_to_baseline()
    assert ok, "P did not get its blocks back after D read them"
    if not STOCK:
        st = _counters(pair.pd.p)
        assert _num(st, "invariant_violations") == 0, st
        assert _frees(st).get("transferred", 0) >= len(COR), st


@pytest.mark.xfail(STOCK, reason="stock NixlConnector fails open (upstream #52234)",
                   strict=True)
def test_late_d_lease_expired_blocks_reused(pair: Pair) -> None:
    """D arrives 10 s after a 3 s lease while P reuses every block: the stale read is
    refused and recomputed; D's outputs still equal the reference (0 wrong tokens)."""
    before = _counters(pair.pd.d)
    before_p = _frees(_counters(pair.pd.p))
    out = sc.late_d(pair.pd, LATE, pair.ref, max_tokens=MAX_TOKENS)
    assert out.wrong == [], f"wrong KV served for {out.wrong}"
    assert out.errors == [], out.errors
    if not STOCK:
        after = _counters(pair.pd.d)

        def delta(key: str) -> float:
            return _num(after, key) - _num(before, key)

        # no READ of these requests was accepted: each was fenced (stamps), refused by P
        # (lease gone) or ended before its load, and recomputed on D
        assert delta("reads_ok") == 0, (before, after)
        refused = delta("fenced_reads") + delta("reads_failed") + sum(
            delta(k) for k in after if any(w in k for w in ("refus", "lost", "ended")))
        assert refused >= 1, (before, after)
        expired = _frees(_counters(pair.pd.p)).get("expired", 0) - before_p.get("expired", 0)
        assert expired >= len(LATE)
    ok, _ = pair.p_back_to_baseline()
    assert ok


def test_abort_on_d_before_read(pair: Pair) -> None:
    """A client abort on D while the request is still queued (D's loop paused): no read,
    D releases, P frees the blocks (released, not left to expire) and nothing twice."""
    rid = "ab0"
    before = _frees(_counters(pair.pd.p))
    res = pair.pd.prefill(rid, ABORT[rid])
    pair.pd.d.pause(1.0)
    pair.pd.submit_decode(rid, ABORT[rid], res, max_tokens=MAX_TOKENS)
    pair.pd.d.abort([rid])
    r = pair.pd.d.wait([rid], 60)[rid]
    assert r.error == "aborted"
    ok, _ = pair.p_back_to_baseline()
    assert ok
    if not STOCK:
        after = _frees(_counters(pair.pd.p))
        assert after.get("released", 0) - before.get("released", 0) == 1, (before, after)
        assert after.get("expired", 0) == before.get("expired", 0)


def test_abort_on_d_during_read(pair: Pair) -> None:
    """Abort on D right after the step that issued its READ (status
    WAITING_FOR_REMOTE_KVS): P's blocks come back once, D keeps serving."""
    rid = "ab1"
    res = pair.pd.prefill(rid, ABORT[rid])
    pair.pd.d.abort_on(rid, "WAITING_FOR_REMOTE_KVS")
    pair.pd.submit_decode(rid, ABORT[rid], res, max_tokens=MAX_TOKENS)
    r = pair.pd.d.wait([rid], 60)[rid]
    assert r.error == "aborted", "the READ finished before the abort could land"
    ok, _ = pair.p_back_to_baseline()
    assert ok
    # D is still healthy: the next request decodes correctly
    out = pair.pd.run({"ab2": ABORT["ab2"]}, max_tokens=MAX_TOKENS)
    assert out["ab2"].tokens == pair.ref["ab2"]
    ok, _ = pair.p_back_to_baseline()
    assert ok


def test_abort_on_p_after_prefill(pair: Pair) -> None:
    """The client aborts on P after its prefill finished and never goes to D: P frees the
    blocks by lease expiry, once."""
    rid = "ab3"
    before = _frees(_counters(pair.pd.p))
    pair.pd.prefill(rid, ABORT[rid])
    held = pair.baseline - int(pair.pd.p.stats()["free_blocks"])
    assert held >= 1, "P should hold the prefilled blocks for D"
    pair.pd.p.abort([rid], core=True)
    ok, _ = pair.p_back_to_baseline()
    assert ok
    if not STOCK:
        after = _frees(_counters(pair.pd.p))
        gone = sum(after.values()) - sum(before.values())
        assert gone == 1, (before, after)


def test_cache_resets_and_a_clearing_pause_while_p_holds_blocks(pair: Pair) -> None:
    """vLLM's own cache operations on P while it holds a request's blocks for D: a
    prefix-cache reset, one that also preempts running requests and resets the
    connector, and a pause that aborts and clears the caches (what a weight update or
    ``sleep(level>=1)`` runs). Each refuses (False, or vLLM's RuntimeError: used
    blocks), the engine stays up, P keeps every held block, and D then pulls them token
    for token; once they are freed a reset succeeds, and a prompt run again after it
    (P's prefix cache empty) is still served right."""
    p, d = pair.pd.p, pair.pd.d
    rid = "rc0"
    res = pair.pd.prefill(rid, RESET[rid])
    held = pair.baseline - int(p.stats()["free_blocks"])
    assert held >= 1, "P should hold the prefilled blocks for D"
    assert p.core_call("reset_prefix_cache") is False
    with pytest.raises(h.HarnessError, match="Failed to reset KV cache"):
        p.core_call("reset_prefix_cache", reset_running_requests=True, reset_connector=True)
    try:
        with pytest.raises(h.HarnessError, match="Failed to reset KV cache"):
            p.core_call("pause_scheduler", mode="abort", clear_cache=True)
    finally:
        p.core_call("resume_scheduler")
    assert p.alive() and p.core_call("is_scheduler_paused") is False
    assert pair.baseline - int(p.stats()["free_blocks"]) == held, "a reset freed held blocks"
    pair.pd.submit_decode(rid, RESET[rid], res, max_tokens=MAX_TOKENS)
    r = d.wait([rid], 60)[rid]
    assert r.error is None and r.token_ids == [pair.ref[rid]], (r.error, r.token_ids)
    ok, _ = pair.p_back_to_baseline()
    assert ok
    assert p.core_call("reset_prefix_cache", reset_connector=True) is True
    out = sc.correctness(pair.pd, {"rc1": RESET["rc0"]}, {"rc1": pair.ref["rc0"]},
                         max_tokens=MAX_TOKENS)
    assert out.errors == [] and out.wrong == [], (out.errors, out.wrong)
    ok, _ = pair.p_back_to_baseline()
    assert ok


def test_n_greater_than_one(pair: Pair) -> None:
    """n=2 on P (two sibling prefills) and n=2 on D (two children sharing P's params):
    D's completions equal the single engine's (greedy n=1, and seeded sampling n=2), and
    every sibling's blocks come back to P exactly once, freed by the protocol when D
    read one member of its group (``transferred`` and ``sibling``), none left to its
    lease: siblings that only a lease frees pin P's cache (upstream PR #43509)."""
    before = _frees(_counters(pair.pd.p))
    for rid, prompt in NGEN.items():
        res = pair.pd.prefill(rid, prompt, n=2)
        assert res.kv_transfer_params, res
        pair.pd.submit_decode(rid, prompt, res, max_tokens=MAX_TOKENS)
        res2 = pair.pd.prefill(rid + "-s", prompt, n=2)
        pair.pd.submit_decode(rid + "-s", prompt, res2, max_tokens=MAX_TOKENS, n=2,
                              temperature=1.0, seed=SAMPLE_SEED)
    out = pair.pd.d.wait([*NGEN, *(f"{k}-s" for k in NGEN)], 120)
    for rid in NGEN:
        assert out[rid].tokens == pair.ref[rid], rid
        assert out[rid + "-s"].token_ids == pair.sampled[rid], rid
    ok, _ = pair.p_back_to_baseline()
    assert ok
    if not STOCK:
        st = _counters(pair.pd.p)
        assert _num(st, "invariant_violations") == 0
        after = _frees(st)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        groups = 2 * len(NGEN)  # one n=2 prefill per prompt for each of the two decodes
        # each group: one member transferred (D read it), the other freed as its sibling
        assert delta.get("expired", 0) == 0, delta
        assert delta.get("transferred", 0) == groups, delta
        assert delta.get("sibling", 0) == groups, delta
        assert sum(delta.values()) == 2 * groups, delta


def test_pair_journals_validate(pair: Pair) -> None:
    """Last on this pair: shut it down cleanly and check both journals with
    ``kvproto validate``."""
    assert pair.pd.p.alive() and pair.pd.d.alive()
    st = pair.pd.p.stats()
    assert int(st["free_blocks"]) == pair.baseline and st["scheduler_requests"] == 0
    if not STOCK:
        for e in (pair.pd.p, pair.pd.d):
            c = _counters(e)
            assert "invariant_violations" in c and "held_blocks" in c, (e.spec.name, c)
            assert _num(c, "invariant_violations") == 0, (e.spec.name, c)
            assert _num(c, "held_blocks") == 0, (e.spec.name, c)
    pair.pd.close()
    if STOCK:
        pytest.skip("the stock connector writes no journal")
    _validate(pair.journals, need_consumer=True)


# ---------------------------------------------------------------------------- faults


def test_faults_d_killed_then_p_killed(pair: Pair, model: str, workdir: Path) -> None:
    """Fresh engines P2, D2, D3. (1) D2 is killed -9 while it holds requests it has not
    read: P2 frees every held block by lease expiry and keeps serving (a P2 -> D3 batch
    decodes correctly). (2) P2 is killed -9 with requests routed to D3 not yet read: D3's
    requests end (recomputed to the reference, or failed with a clear error), no hang;
    D3 still serves local requests. The journals written pass ``kvproto validate``.
    The reference comes from the module's single engine (started with the first pair)."""
    reference = pair.ref
    pair.pd.close()   # done with the first pair (no-op when already closed)
    kw = _pd_kwargs(workdir, "2")
    connector = kw.pop("connector")
    p_spec, d_spec = h.pd_specs(model, workdir, connector, tag="2", p_kv_bytes=P_KV_BYTES,
                                prefix_caching=True, **kw)
    kw3 = _pd_kwargs(workdir, "3")
    kw3.pop("connector")
    _, d3_spec = h.pd_specs(model, workdir, connector, tag="3", prefix_caching=True, **kw3)
    engines = h.start_engines([p_spec, d_spec, d3_spec])
    p2, d2, d3 = engines
    try:
        # (1) D killed
        out = sc.d_killed(h.PD(p2, d2), KILL, timeout=FREE_TIMEOUT)
        assert not d2.alive()
        assert out.extra["held_at_kill"] >= len(KILL), out.extra
        assert out.extra["freed"], f"P kept blocks after D died: {out.extra}"
        if not STOCK:
            assert _frees(_counters(p2)).get("expired", 0) >= len(KILL)
        pd3 = h.PD(p2, d3)
        res = pd3.run(AFTER, max_tokens=MAX_TOKENS)
        assert {k: r.tokens for k, r in res.items()} == {k: reference[k] for k in AFTER}
        # (2) P killed with D3's reads pending. P2 frees the AFTER batch when D3's done
        # notifications arrive, which may be a step after D3 returned the outputs.
        back, _, _ = sc.wait_free(p2, out.extra["baseline"], FREE_TIMEOUT)
        assert back, "P2 kept blocks of a batch D3 had pulled"
        base = int(p2.stats()["free_blocks"])
        assert base == out.extra["baseline"]
        pd3.submit_prefills(KILL)
        p_res = p2.wait(KILL, 120)
        d3.pause(2.0)
        for rid, prompt in KILL.items():
            pd3.submit_decode(rid, prompt, p_res[rid], max_tokens=MAX_TOKENS)
        p2.kill()
        ended = d3.wait(KILL, 120)          # raises on a hang
        for rid, r in ended.items():
            if r.error is None and r.finish_reasons and r.finish_reasons[0] != "error":
                assert r.tokens == reference[rid], f"{rid}: wrong tokens after P died"
            else:
                assert r.finish_reasons[:1] == ["error"] or r.error, r
        loc = d3.generate({"local": KILL["k0"]}, max_tokens=MAX_TOKENS)
        assert loc["local"].tokens == reference["k0"]
        d3.close()
    finally:
        for e in engines:
            e.close()
    if not STOCK:
        _validate([workdir / "P2.jsonl", workdir / "D3.jsonl"])


def test_spawned_engine_answers_as_the_forked_ones(pair: Pair, model: str, workdir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's engines fork from the harness's fork server (torch and vLLM imported
    once); one started the other way (a fresh interpreter) gives the reference's tokens."""
    monkeypatch.setenv(h.ENGINE_START_ENV, "spawn")
    items = dict(list(COR.items())[:2])
    with h.start_engines([h.EngineSpec("SPAWN", model, env=h.engine_env(),
                                       log_path=str(workdir / "SPAWN.log"))])[0] as eng:
        out = eng.generate(items, max_tokens=MAX_TOKENS)
    assert {k: r.tokens for k, r in out.items()} == {k: pair.ref[k] for k in items}


def test_a_burst_of_submits_while_outputs_go_unread_does_not_deadlock(model: str,
                                                                     workdir: Path) -> None:
    """The harness pipe, both ways full at once: the parent submits a burst, does not read
    while the engine answers all of it (more output than a pipe buffer holds), then
    submits a second burst. An engine that blocked sending its outputs would stop
    reading, and the parent's second burst would then block forever."""
    burst = 600  # each message is one socket buffer entry: far more than a buffer holds
    prompts = h.make_prompts(2 * burst, seed=17, lengths=[8])
    items = {f"burst{i}": p for i, p in enumerate(prompts)}
    keys = list(items)
    with h.start_engines([h.EngineSpec("BURST", model, env=h.engine_env(),
                                       log_path=str(workdir / "BURST.log"))])[0] as eng:
        def first() -> None:
            for k in keys[:burst]:
                eng.submit(k, items[k], max_tokens=1)

        def second() -> None:
            for k in keys[burst:]:
                eng.submit(k, items[k], max_tokens=1)

        first()
        # the engine answers the first burst, unread: wait until what waits in the pipe
        # stops growing (all answered, or the engine's sending side is blocked)
        sizes = [-1]
        deadline = time.monotonic() + 90.0
        while time.monotonic() < deadline and (len(sizes) < 4 or len(set(sizes[-4:])) > 1
                                               or sizes[-1] <= 0):
            time.sleep(0.5)
            sizes.append(eng.unread_bytes())
        # the answers wait unread: far fewer bytes than 600 answers, so the engine's
        # sending side is blocked on the full pipe (its kernel buffer counts each
        # message's overhead, and fills at about 40 KB of these small messages)
        assert 16 * 1024 < sizes[-1] < burst * 200, sizes
        t = threading.Thread(target=second, daemon=True)
        t.start()
        t.join(120.0)
        if t.is_alive():
            eng.kill()  # a clean close would block on the full pipe too
            pytest.fail("the second burst's submits blocked: the pipe deadlocked")
        out = eng.wait(keys, timeout=300.0)
    assert len(out) == 2 * burst and all(len(r.tokens) == 1 and r.error is None
                                         for r in out.values())


def test_engine_start_method_and_ports_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(h.ENGINE_START_ENV, "fork")
    with pytest.raises(h.HarnessError, match="KVPROTO_ENGINE_START='fork'"):
        h.Engine(h.EngineSpec("X", "/nonexistent", env={}))
    # test ports: distinct, and outside the kernel's ephemeral range (any process's
    # bind(0) or outgoing connection may take a port from that range before its engine
    # binds it)
    lo, hi = h._ephemeral_range()
    ports = [h.free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(not lo - 32 <= p <= hi for p in ports), (lo, hi, ports)


def test_no_stray_engine_processes() -> None:
    """Last: every engine process this module started is gone (closed or killed)."""
    assert h.STARTED, "no engine was started"
    assert h.stray_engines() == []
