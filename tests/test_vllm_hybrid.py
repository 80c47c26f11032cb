"""End to end: KV cache groups (vLLM's hybrid allocator), prefix caching on both engines,
and a P/D block-size mismatch, on real vLLM engines (CPU build) with real NIXL.

The model is a tiny random-weight Llama written locally whose layers alternate between
sliding-window attention (64 tokens) and full attention, named in its config's
``layer_types`` (Gemma-3 style; vLLM's CPU attention backend supports sliding windows).
With KVProtoConnector declaring ``SupportsHMA`` vLLM keeps its hybrid allocator on and
gives the model two KV cache groups; the tests read that count from the connector.

One reference engine (no connector), one P and one D, prefix caching on in all three,
serve the module (in order: correctness, D's partial prefix hit, P's shared prefix);
the block-size test starts one more D with 64-token blocks against the same P.
"""

from __future__ import annotations

import copy
import random
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

WINDOW = 64
BS = h.BLOCK_SIZE
MAX_TOKENS = 8
VOCAB = 1024


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# Correctness: shorter than the window, a window, and several windows (the sliding group
# then drops its first blocks on P and D).
COR = {f"c{i}": _prompt(100 + i, n) for i, n in enumerate([37, 64, 96, 129, 200, 300])}
# D's partial prefix hit: X, then X2 = X's 6 full blocks and 60 more tokens.
X = _prompt(200, 6 * BS)
X2 = X + _prompt(201, 60)
# P's shared prefix: A, B, C and E share Y's first 4 blocks.
Y = _prompt(300, 4 * BS)
SHARED = {"A": Y + _prompt(301, 32), "B": Y + _prompt(302, 70), "C": Y + _prompt(303, 50),
          "E": Y + _prompt(304, 40)}
# Block sizes: P 32, D 64.
RATIO = {f"r{i}": _prompt(400 + i, n) for i, n in enumerate([50, 130, 260])}
BAD = _prompt(500, 200)
ALL = {**COR, "X": X, "X2": X2, **SHARED, **RATIO, "bad": BAD}
WAIT = 120.0  # a hang bound, not a timing assertion


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _grew(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The worker counters that changed (a failed assertion's explanation)."""
    return {k: _num(after, k) - _num(before, k) for k in after
            if _num(after, k) != _num(before, k)}


class Trio:
    def __init__(self, ref: dict[str, list[int]], pd: h.PD, model: str, workdir: Path,
                 connector: dict[str, Any]) -> None:
        self.ref = ref
        self.pd = pd
        self.model = model
        self.workdir = workdir
        self.connector = connector

    def worker(self, e: h.Engine) -> dict[str, Any]:
        out = e.connector_call("kvproto_stats", worker=True)
        assert isinstance(out, dict), out
        return out

    def sched(self, e: h.Engine) -> dict[str, Any]:
        out = e.connector_call("kvproto_stats", worker=False)
        assert isinstance(out, dict), out
        return out

    def decode(self, rid: str, prompt: list[int], p_result: h.Result) -> list[int]:
        self.pd.submit_decode(rid, prompt, p_result, max_tokens=MAX_TOKENS)
        r = self.pd.d.wait([rid], WAIT)[rid]
        assert r.error is None, r.error
        return r.tokens

    def wait_worker(self, e: h.Engine, key: str, at_least: float) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT
        while True:
            st = self.worker(e)
            if _num(st, key) >= at_least or time.monotonic() > deadline:
                return st
            time.sleep(0.1)


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    wd = tmp_path_factory.mktemp("vllm_hybrid")
    model = str(h.build_tiny_model(wd / "model", layers=4, sliding_window=WINDOW).path)
    # The default lease (30 s): P holds A, B and C while D pulls them one after another.
    p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="h")
    ref_spec = h.EngineSpec("REFh", model, env=h.engine_env(), log_path=str(wd / "REFh.log"))
    for s in (p_spec, d_spec, ref_spec):
        s.prefix_caching = True
    ref, p, d = h.start_engines([ref_spec, p_spec, d_spec])
    pd = h.PD(p, d)
    try:
        reference = sc.reference_outputs(ref, ALL, max_tokens=MAX_TOKENS)
        ref.close()
        pd.warm_up("w")  # first contact and D's first decode steps
        yield Trio(reference, pd, model, wd, h.KVPROTO_CONNECTOR)
    finally:
        ref.kill()
        pd.close()


def test_hybrid_model_token_for_token_with_two_groups(trio: Trio) -> None:
    pd = trio.pd
    # vLLM ran the model with its hybrid allocator: two KV cache groups on both sides.
    assert _num(trio.sched(pd.p), "kv_cache_groups") == 2
    assert _num(trio.sched(pd.d), "kv_cache_groups") == 2
    before = trio.worker(pd.d)
    p_res = {rid: pd.prefill(rid, prompt) for rid, prompt in COR.items()}
    for rid, r in p_res.items():
        params = (r.kv_transfer_params or {})["kvproto"]
        groups = params["groups"]
        assert len(groups) == 2, params
        n = (len(COR[rid]) + BS - 1) // BS
        # group 0 (sliding window) kept only its window's blocks; group 1 all of them
        skip = max(0, len(COR[rid]) - WINDOW + 1) // BS
        assert groups == [[skip, n - skip], [0, n]], (rid, groups)
        assert len(params["blocks"]) == 2 * n - skip
    wrong = {rid: (toks, trio.ref[rid]) for rid in COR
             if (toks := trio.decode(rid, COR[rid], p_res[rid])) != trio.ref[rid]}
    assert not wrong, wrong
    after = trio.worker(pd.d)
    assert _num(after, "reads_ok") - _num(before, "reads_ok") == len(COR), _grew(before, after)
    assert _num(after, "fenced_reads") == _num(before, "fenced_reads")
    read = _num(after, "read_blocks") - _num(before, "read_blocks")
    assert read == sum(len((r.kv_transfer_params or {})["kvproto"]["blocks"])
                       for r in p_res.values())


def test_a_failed_load_recomputes_the_request_whole(trio: Trio) -> None:
    """vLLM refuses block-level load errors with several KV cache groups (it stops the
    engine); the connector reports the failed request instead, and vLLM recomputes it.
    The failure: params claiming P kept one block fewer of the sliding group than D
    needs (client input, refused by D's plan before any READ)."""
    pd = trio.pd
    r = pd.prefill("bad", BAD)
    params = copy.deepcopy(r.kv_transfer_params)
    assert params is not None
    kp = params["kvproto"]
    skip, count = kp["groups"][0]
    assert skip > 0 and count > 1
    kp["groups"][0] = [skip + 1, count - 1]
    del kp["blocks"][0], kp["generations"][0]
    s0, w0 = trio.sched(pd.d), trio.worker(pd.d)
    pd.d.submit("bad", BAD, max_tokens=MAX_TOKENS, kv_transfer_params=params)
    out = pd.d.wait(["bad"], WAIT)["bad"]
    assert out.error is None and out.tokens == trio.ref["bad"], out
    s1, w1 = trio.sched(pd.d), trio.worker(pd.d)
    assert _num(s1, "sched_alloc_mismatch") == _num(s0, "sched_alloc_mismatch") + 1
    assert _num(w1, "reads_failed") == _num(w0, "reads_failed") + 1
    assert _num(w1, "reads_ok") == _num(w0, "reads_ok")


def test_d_partial_prefix_hit_reads_only_the_missing_suffix(trio: Trio) -> None:
    pd = trio.pd
    # D computes X itself (no P): its prefix cache then holds X's blocks in both groups
    # as a plain engine's would.
    pd.d.submit("X", X, max_tokens=MAX_TOKENS)
    assert pd.d.wait(["X"], WAIT)["X"].tokens == trio.ref["X"]
    before = trio.worker(pd.d)
    r2 = pd.prefill("X2", X2)
    params = r2.kv_transfer_params["kvproto"]  # type: ignore[index]
    n = (len(X2) + BS - 1) // BS
    skip = (len(X2) - WINDOW + 1) // BS
    assert params["groups"] == [[skip, n - skip], [0, n]]
    assert trio.decode("X2", X2, r2) == trio.ref["X2"]
    after = trio.worker(pd.d)
    assert _num(after, "reads_ok") - _num(before, "reads_ok") == 1, _grew(before, after)
    read = _num(after, "read_blocks") - _num(before, "read_blocks")
    # D's prefix cache supplied the first h block positions of both groups (vLLM picks
    # h; at most X's 6 blocks): D read only the positions after them, in both groups.
    fits = [hit for hit in range(1, len(X) // BS + 1)
            if read == (n - hit) + (n - max(skip, hit))]
    assert fits, (read, params["groups"])


def test_p_frees_a_shared_prefix_block_only_with_its_last_holder(trio: Trio) -> None:
    pd = trio.pd
    # The earlier tests' requests were all pulled: P holds nothing once their dones land.
    deadline = time.monotonic() + WAIT
    while _num(w0 := trio.worker(pd.p), "held_blocks") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _num(w0, "held_blocks") == 0, w0
    fenced0 = _num(trio.worker(pd.d), "fenced_reads")
    ra = pd.prefill("A", SHARED["A"])
    rb = pd.prefill("B", SHARED["B"])
    pa, pb = (r.kv_transfer_params["kvproto"] for r in (ra, rb))  # type: ignore[index]
    ga = dict(zip(pa["blocks"], pa["generations"], strict=True))
    gb = dict(zip(pb["blocks"], pb["generations"], strict=True))
    shared = set(ga) & set(gb)
    # P's prefix cache gave B A's blocks for Y while A is held: both hold them.
    assert len(shared) >= len(Y) // BS, (pa, pb)
    assert all(ga[b] == gb[b] for b in shared)
    held_ab = len(set(ga) | set(gb))
    # P's worker registers B at its next step after B's prefill returned.
    assert _num(trio.wait_worker(pd.p, "held_blocks", held_ab), "held_blocks") == held_ab
    # D pulls A: P frees A's own blocks, keeps the shared ones (B holds them).
    assert trio.decode("A", SHARED["A"], ra) == trio.ref["A"]
    done = _num(w0, "frees_transferred") + 1
    w1 = trio.wait_worker(pd.p, "frees_transferred", done)
    assert _num(w1, "frees_transferred") == done
    assert _num(w1, "held_blocks") - _num(w0, "held_blocks") == len(gb)
    # A third holder now sees the shared blocks' stamps unchanged: no bump yet.
    rc = pd.prefill("C", SHARED["C"])
    pc = rc.kv_transfer_params["kvproto"]  # type: ignore[index]
    gc = dict(zip(pc["blocks"], pc["generations"], strict=True))
    assert shared <= set(gc)
    assert all(gc[b] == ga[b] for b in shared)
    # B and C read the shared blocks intact (a bump would fence them).
    assert trio.decode("B", SHARED["B"], rb) == trio.ref["B"]
    assert trio.decode("C", SHARED["C"], rc) == trio.ref["C"]
    assert _num(trio.worker(pd.d), "fenced_reads") == fenced0
    w2 = trio.wait_worker(pd.p, "frees_transferred", done + 2)
    assert _num(w2, "held_blocks") == _num(w0, "held_blocks")
    # The last holder let go: the shared blocks' stamps moved, once.
    re_ = pd.prefill("E", SHARED["E"])
    pe = re_.kv_transfer_params["kvproto"]  # type: ignore[index]
    ge = dict(zip(pe["blocks"], pe["generations"], strict=True))
    assert shared <= set(ge)
    assert all(ge[b] > ga[b] for b in shared), (ga, ge)
    assert trio.decode("E", SHARED["E"], re_) == trio.ref["E"]
    assert _num(trio.worker(pd.p), "invariant_violations") == 0


def test_block_size_ratio_is_refused_and_recomputed(trio: Trio) -> None:
    pd = trio.pd
    wd = trio.workdir
    _, d64 = h.pd_specs(trio.model, wd, trio.connector, tag="64")
    d64.block_size = 2 * BS
    d64.prefix_caching = True
    (d,) = h.start_engines([d64])
    try:
        pair = h.PD(pd.p, d)
        p0 = trio.worker(pd.p)
        for rid, prompt in RATIO.items():
            r = pd.prefill(rid, prompt)
            assert r.kv_transfer_params["kvproto"]["block_size"] == BS  # type: ignore[index]
            pair.submit_decode(rid, prompt, r, max_tokens=MAX_TOKENS)
            out = d.wait([rid], WAIT)[rid]
            # Refused before any READ and prefilled on D (policy recompute): the
            # reference's tokens, never P's blocks read into 64-token blocks.
            assert out.error is None and out.tokens == trio.ref[rid], (rid, out)
        st = d.connector_call("kvproto_stats", worker=False)
        assert isinstance(st, dict)
        assert _num(st, "rejected_block_size") == len(RATIO), st
        wst = d.connector_call("kvproto_stats", worker=True)
        assert isinstance(wst, dict)
        assert _num(wst, "reads_ok") == 0 and _num(wst, "read_blocks") == 0, wst
        log = Path(d64.log_path or "").read_text()
        assert "P's block size is 32 tokens, D's 64" in log
        # refused before any admit (no handshake): P frees each by its lease, once
        p1 = trio.wait_worker(pd.p, "frees_expired", _num(p0, "frees_expired") + len(RATIO))
        frees = {k: _num(p1, k) - _num(p0, k) for k in p1 if k.startswith("frees_")}
        assert frees.get("frees_expired") == len(RATIO) and \
            sum(frees.values()) == len(RATIO), frees
    finally:
        d.close()
