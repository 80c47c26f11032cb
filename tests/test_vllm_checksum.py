"""Block checksums (``"checksums": true`` in ``kv_connector_extra_config``) inside real
vLLM engines: P seals every block it registers, D verifies every block it read before
vLLM sees it, and D's greedy outputs still equal a single engine's token for token.

Real vLLM engines (the CPU build) in their own processes, real NIXL, a tiny Llama with
random real weights written locally; nothing mocked. The negative side (a byte changed
with the stamps unchanged is fenced, never served) runs on real NIXL agents in
``tests/test_checksum.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

MAX_TOKENS = 8
PROMPTS = {f"s{i}": p for i, p in enumerate(h.make_prompts(8, seed=21))}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[h.PD, dict[str, Any]]]:
    wd = tmp_path_factory.mktemp("vllm_checksum")
    model = str(h.build_tiny_model(wd / "model").path)
    kw = sc.kvproto_extras(None)
    kw["extra_config"] = {**kw["extra_config"], "checksums": True}
    p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="c", **kw)
    ref_spec = h.EngineSpec("REFc", model, env=h.engine_env(), log_path=str(wd / "REFc.log"))
    ref, p, d = h.start_engines([ref_spec, p_spec, d_spec])
    pd = h.PD(p, d)
    try:
        reference = sc.reference_outputs(ref, PROMPTS, max_tokens=MAX_TOKENS)
        ref.close()
        yield pd, reference
    finally:
        ref.kill()
        pd.close()


def test_checksums_on_outputs_equal_the_single_engine(
        engines: tuple[h.PD, dict[str, Any]]) -> None:
    pd, reference = engines
    out = sc.correctness(pd, PROMPTS, reference, max_tokens=MAX_TOKENS)
    assert out.errors == [] and out.wrong == [], (out.errors, out.wrong)
    assert out.requests == len(PROMPTS) and out.tokens == len(PROMPTS) * MAX_TOKENS
    st = pd.d.connector_stats()
    # Every block D served was verified (at least one per prompt), and none failed.
    assert float(st.get("checksum_verified_blocks", 0)) >= len(PROMPTS), st
    assert float(st.get("checksum_failures", -1)) == 0, st
    assert float(st.get("fenced_reads", -1)) == 0, st
