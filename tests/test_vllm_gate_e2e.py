"""P's gate through real vLLM engines (CPU, a tiny random-weight model): readiness under
chunked prefill, and a router retry with stale params.

* Chunked prefill: P runs with a small ``max_num_batched_tokens``, so each long prompt is
  prefilled in several forward passes. The connector registers once, after the last
  one (its readiness mark: every prompt token computed); D's output is compared token
  for token with a single engine's, and P's gate refused no register.
* Retry with stale params: after D was served and P freed the blocks, the router sends
  the same params again under a new request id. D is refused (P's ack) or fenced (the
  stamps changed), never served: it recomputes locally, and its output still matches
  the single engine's token for token.

P and D run with vLLM's one-way roles, as vLLM's disaggregation examples start them:
``kv_role`` ``kv_producer`` on P and ``kv_consumer`` on D (the connector takes its role
from it: P only holds and serves, D only pulls).

Engines are started under the machine-wide engine lock (``/work/wt/engines``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(h.vllm_available() is not None,
                                 reason=str(h.vllm_available()))]

MAX_TOKENS = 6
CHUNK = 64  # max_num_batched_tokens on P: a 300-token prompt takes 5 forward passes
LONG = {f"long{i}": p for i, p in enumerate(h.make_prompts(3, seed=21, lengths=[300, 200, 130]))}
RETRY = {"r0": h.make_prompts(1, seed=22, lengths=[160])[0]}


class Engines:
    def __init__(self, pd: h.PD, ref: dict[str, list[int]]) -> None:
        self.pd = pd
        self.ref = ref


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    wd = tmp_path_factory.mktemp("vllm_gate")
    model = str(h.build_tiny_model(wd / "model").path)
    kw: dict[str, Any] = sc.kvproto_extras(str(wd), 2 * sc.LEASE, tag="g")  # first contacts under load
    p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="g", **kw)
    for spec, role in ((p_spec, "kv_producer"), (d_spec, "kv_consumer")):
        spec.kv_transfer_config = {**(spec.kv_transfer_config or {}), "kv_role": role}
    p_spec.max_num_batched_tokens = CHUNK
    p_spec.max_num_seqs = 4
    ref_spec = h.EngineSpec("REFg", model, env=h.engine_env(), log_path=str(wd / "REFg.log"))
    ref, p, d = h.start_engines([ref_spec, p_spec, d_spec])
    pd = h.PD(p, d)
    try:
        reference = sc.reference_outputs(ref, {**LONG, **RETRY}, max_tokens=MAX_TOKENS)
        ref.close()
        pd.warm_up("w")  # first contact and D's first decode steps
        yield Engines(pd, reference)
    finally:
        ref.kill()
        pd.close()


def _num(stats: dict[str, Any], key: str) -> float:
    v = stats.get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def test_chunked_prefill_registers_after_the_last_chunk(engines: Engines) -> None:
    pd = engines.pd
    out = pd.run(LONG, max_tokens=MAX_TOKENS)
    for rid in LONG:
        assert out[rid].error is None, out[rid].error
        assert out[rid].tokens == engines.ref[rid], rid
    ps = pd.p.connector_stats()
    ds = pd.d.connector_stats()
    assert _num(ps, "rejected_unready_register") == 0, ps
    assert _num(ds, "reads_ok") >= len(LONG), ds  # D pulled P's KV, did not recompute
    assert _num(ds, "fenced_reads") == 0, ds
    # one-way roles: P's connector has no D half, D's no P half
    assert "reads_ok" not in ps and "held_blocks" not in ds, (sorted(ps), sorted(ds))


def test_retry_with_stale_params_is_refused_or_fenced_never_served(engines: Engines) -> None:
    pd = engines.pd
    rid, prompt = next(iter(RETRY.items()))
    base = int(pd.p.stats()["free_blocks"])
    p_res = pd.prefill(rid, prompt)
    pd.submit_decode(rid, prompt, p_res, max_tokens=MAX_TOKENS)
    first = pd.d.wait([rid], 120.0)[rid]
    assert first.error is None and first.tokens == engines.ref[rid]
    ok, _, _ = sc.wait_free(pd.p, base, 60.0, others=[pd.d])
    assert ok  # P freed the blocks (and bumped their stamps)
    ds0 = pd.d.connector_stats()
    # The router retries: the same params, a new request id, after P freed the blocks.
    pd.submit_decode(rid + "-retry", prompt, p_res, max_tokens=MAX_TOKENS)
    again = pd.d.wait([rid + "-retry"], 120.0)[rid + "-retry"]
    ds1 = pd.d.connector_stats()
    assert again.error is None, again.error
    assert again.tokens == engines.ref[rid]  # recomputed locally: still the right answer
    served = _num(ds1, "reads_ok") - _num(ds0, "reads_ok")
    fenced = _num(ds1, "fenced_reads") - _num(ds0, "fenced_reads")
    failed = _num(ds1, "reads_failed") - _num(ds0, "reads_failed")
    ended = _num(ds1, "ended_before_load") - _num(ds0, "ended_before_load")
    assert served == 0, (ds0, ds1)  # never served from P's (reused) blocks
    assert fenced + failed + ended >= 1, (ds0, ds1)  # refused or fenced
