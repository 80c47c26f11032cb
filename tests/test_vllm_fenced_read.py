"""A READ that lands on reused blocks, through real vLLM engines (CPU, real NIXL, tiny
random-weight model; nothing mocked).

D's engine thread stalls just before it posts each data READ (test-only
``test_stall_post_s``), after P granted its claim: a slow D. Stalled, D sends no
heartbeat, so P's lease runs out and P frees the request's blocks; the test then runs
other prompts over every block P has, so the blocks hold another prompt's KV when D's
READ lands in them. The READ is real and its bytes are wrong: only the stamps stand
between them and D's output. Checked on two D engines, one per
``kv_load_failure_policy``, both with prefix caching on:

* "recompute": the READ is fenced (``fenced_reads``), nothing is counted as read, and
  D's output equals the single-engine reference, token for token;
* "fail": the request ends with an error and no token;
* no poisoning (upstream: blocks of a failed or fenced READ become visible to later
  prefix-cache lookups): afterwards each D serves the same prompt, and a prompt sharing
  its prefix, as plain requests; a prefix hit on the fenced blocks would decode another
  prompt's KV, and the outputs equal the reference;
* P frees each request once, by lease, and its pool is back where it was.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

LEASE = 3.0
STALL = 20.0  # D's stall before each data READ: P's lease plus a churn of P's pool fit in it
MAX_TOKENS = 6
P_KV_BYTES = 8 << 20  # a small pool: the churn overwrites every block of it quickly
PROMPTS = dict(zip(("r0", "f0"), h.make_prompts(2, seed=41, lengths=[130, 130]),
                   strict=True))
# prompts sharing the first 96 tokens of PROMPTS'
SHARED = {f"{k}-shared": [*v[:96], *h.make_prompts(1, seed=42 + i, lengths=[40])[0]]
          for i, (k, v) in enumerate(PROMPTS.items())}


class Fleet:
    def __init__(self, p: h.Engine, d_rec: h.Engine, d_fail: h.Engine,
                 ref: dict[str, list[int]]) -> None:
        self.p, self.d_rec, self.d_fail, self.ref = p, d_rec, d_fail, ref


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    wd = tmp_path_factory.mktemp("fenced_read")
    model = str(h.build_tiny_model(wd / "model").path)
    kw = sc.kvproto_extras(str(wd), LEASE, tag="f")
    # D's READ deadline (max_read_time + read_grace) runs from when D queued the READ,
    # before the stall: a grace longer than the stall keeps the READ from going overdue
    # (quarantined, read_timeout) before it lands, the case under test being the landing
    d_lease = {**sc.lease_config(LEASE), "read_grace": STALL + 60.0}
    kw["d_extra"] = {**kw["d_extra"], "lease": d_lease, "test_stall_post_s": STALL}
    p_spec, d_rec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="f",
                               p_kv_bytes=P_KV_BYTES, **kw)
    d_rec.prefix_caching = True
    _, d_fail = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="ff",
                           **sc.kvproto_extras(str(wd), LEASE, tag="ff"))
    ktc = dict(d_fail.kv_transfer_config or {})
    ktc["kv_load_failure_policy"] = "fail"
    ktc["kv_connector_extra_config"] = {**ktc["kv_connector_extra_config"], "lease": d_lease,
                                        "test_stall_post_s": STALL}
    d_fail.kv_transfer_config = ktc
    d_fail.prefix_caching = True
    p, dr, df = h.start_engines([p_spec, d_rec, d_fail])
    try:
        # the reference from P (plain requests: its connector does nothing for them),
        # never from D, whose prefix cache must not hold these prompts before the READ
        ref = sc.reference_outputs(p, {f"ref-{k}": v for k, v in {**PROMPTS, **SHARED}.items()},
                                   max_tokens=MAX_TOKENS)
        yield Fleet(p, dr, df, {k[4:]: v for k, v in ref.items()})
    finally:
        for e in (df, dr, p):
            e.close()


def _num(st: dict[str, object], key: str) -> float:
    v = st.get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def test_a_read_landing_on_reused_blocks_is_fenced_and_poisons_nothing(fleet: Fleet) -> None:
    p = fleet.p
    baseline = int(p.stats()["free_blocks"])
    total = int(p.info.get("total_blocks", 0))
    before = {e.spec.name: e.connector_stats() for e in (fleet.d_rec, fleet.d_fail)}
    before_p = p.connector_stats()
    t0 = time.monotonic()
    for rid, d in (("r0", fleet.d_rec), ("f0", fleet.d_fail)):
        res = h.PD(p, d).prefill(rid, PROMPTS[rid])
        h.PD(p, d).submit_decode(rid, PROMPTS[rid], res, max_tokens=MAX_TOKENS)
    # Both Ds stall before their READs; P's leases run out and P frees the blocks.
    freed, _, _ = sc.wait_free(p, baseline, 4 * LEASE + 10.0)
    assert freed, "P did not expire the stalled requests' leases"
    sc.churn(p, blocks=total, tag="fenced")  # every block of P now holds other KV
    assert time.monotonic() - t0 < STALL - 2.0, \
        "the churn ended too close to the READs' post: the scenario proves nothing"
    out = {rid: d.wait([rid], STALL + 120.0)[rid]
           for rid, d in (("r0", fleet.d_rec), ("f0", fleet.d_fail))}
    after = {e.spec.name: e.connector_stats() for e in (fleet.d_rec, fleet.d_fail)}

    def grew(e: h.Engine, key: str) -> float:
        return _num(after[e.spec.name], key) - _num(before[e.spec.name], key)

    # recompute: fenced, never served, recomputed token for token
    assert out["r0"].error is None and out["r0"].tokens == fleet.ref["r0"], out["r0"]
    # fail: an error, no token
    assert out["f0"].tokens == [] and (out["f0"].error
                                       or out["f0"].finish_reasons[:1] == ["error"]), out["f0"]
    for d in (fleet.d_rec, fleet.d_fail):
        assert grew(d, "fenced_reads") >= 1, (d.spec.name, after[d.spec.name])
        assert grew(d, "reads_ok") == 0 and grew(d, "read_blocks") == 0, after[d.spec.name]
        # the stall held D's worker lock with the READ pending: seen as a poll gap
        assert grew(d, "poll_stalls") >= 1 and grew(d, "poll_stall_s") >= STALL, \
            after[d.spec.name]
    # P: each request freed once, by its lease; the pool is whole again
    ok, _, _ = sc.wait_free(p, baseline, 4 * LEASE + 30.0)
    assert ok and int(p.stats()["free_blocks"]) == baseline, p.stats()
    after_p = p.connector_stats()
    frees = {k: _num(after_p, k) - _num(before_p, k) for k in after_p
             if k.startswith("frees_")}
    assert frees.get("frees_expired", 0) == 2 and sum(frees.values()) == 2, frees
    assert _num(after_p, "invariant_violations") == 0, after_p

    # No poisoning: the same prompts, and prompts sharing their first 96 tokens, as
    # plain requests on each D (its prefix cache is on).
    for rid, d in (("r0", fleet.d_rec), ("f0", fleet.d_fail)):
        got = d.generate({f"{rid}-plain": PROMPTS[rid], f"{rid}-shared": SHARED[f"{rid}-shared"]},
                         max_tokens=MAX_TOKENS)
        assert got[f"{rid}-plain"].tokens == fleet.ref[rid], (d.spec.name, got)
        assert got[f"{rid}-shared"].tokens == fleet.ref[f"{rid}-shared"], (d.spec.name, got)
