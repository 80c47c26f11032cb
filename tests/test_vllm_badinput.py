"""Bad input reaching a real vLLM engine that runs KVProtoConnector: malformed
``kv_transfer_params`` from a client and params naming a P that does not answer are
counted, logged rejections. Under ``kv_load_failure_policy`` "recompute" the requests
prefill locally (the output equals the same engine's plain output); under "fail"
(vLLM 0.32's default) they end with an error. The engines keep serving, and nothing
crashes.

Two engines (one per policy, started together), each in its own process, via
``kvproto.vllm.harness``.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm.sched import PARAMS_KEY

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM: {_SKIP}")]

PROMPTS = h.make_prompts(4, seed=21, lengths=[40, 64, 100, 7])


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, h.Engine]]:
    wd = tmp_path_factory.mktemp("vllm_bad")
    model = str(h.build_tiny_model(wd / "model").path)
    specs = []
    for policy in ("recompute", "fail"):
        cfg = {**h.KVPROTO_CONNECTOR, "kv_load_failure_policy": policy,
               "kv_connector_extra_config": {"handshake_timeout": 0.5,
                                             "handshake_attempts": 2}}
        specs.append(h.EngineSpec(name=f"BAD-{policy}", model=model, kv_transfer_config=cfg,
                                  env=h.engine_env(), log_path=str(Path(wd) / f"{policy}.log")))
    started = h.start_engines(specs)
    try:
        yield dict(zip(("recompute", "fail"), started, strict=True))
    finally:
        for e in started:
            e.close()


@pytest.fixture(scope="module")
def engine(engines: dict[str, h.Engine]) -> h.Engine:
    return engines["recompute"]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _good_shape(engine: str, port: int, n_tokens: int) -> dict[str, Any]:
    blocks = (n_tokens + h.BLOCK_SIZE - 1) // h.BLOCK_SIZE
    return {"do_remote_prefill": True, "do_remote_decode": False,
            PARAMS_KEY: {"engine": engine, "epoch": 1, "handle": 1,
                         "blocks": list(range(blocks)), "generations": [0] * blocks,
                         "initial_term": 30_000, "expected": 1, "group": None,
                         "host": "127.0.0.1", "port": port, "num_tokens": n_tokens}}


def test_malformed_and_unreachable_params_prefill_locally(engine: h.Engine) -> None:
    plain = engine.generate({f"plain{i}": p for i, p in enumerate(PROMPTS)}, max_tokens=6)
    before = engine.connector_stats()
    bad: dict[str, dict[str, Any] | None] = {
        "no_mapping": {"do_remote_prefill": True},
        "junk": {"do_remote_prefill": True, PARAMS_KEY: {"engine": 5, "blocks": "x"}},
        "mismatch": _good_shape("p-a", _closed_port(), 999),  # P's tokens != the prompt's
        "nobody": _good_shape("p-b", _closed_port(), len(PROMPTS[3])),  # nobody answers
    }
    prompts = dict(zip(bad, PROMPTS, strict=True))
    for rid, p in prompts.items():
        engine.submit(rid, p, max_tokens=6, kv_transfer_params=bad[rid])
    out = engine.wait(prompts, 120)
    for i, rid in enumerate(prompts):
        assert out[rid].error is None, out[rid]
        assert out[rid].tokens == plain[f"plain{i}"].tokens, rid
    after = engine.connector_stats()

    def delta(key: str) -> float:
        return float(after.get(key, 0)) - float(before.get(key, 0))

    assert delta("rejected_params") == 3, after  # two malformed, one mismatched
    assert delta("handshake_failures") >= 1, after  # a handshake is per P engine
    # and the engine still serves
    again = engine.generate({"again": PROMPTS[0]}, max_tokens=6)
    assert again["again"].tokens == plain["plain0"].tokens


def test_fail_policy_fails_what_cannot_be_loaded(engines: dict[str, h.Engine]) -> None:
    """kv_load_failure_policy "fail": the same bad params end each request with an error
    (finish reason "error"), none is prefilled locally; plain requests still decode."""
    engine = engines["fail"]
    plain = engine.generate({f"plain{i}": p for i, p in enumerate(PROMPTS)}, max_tokens=6)
    bad: dict[str, dict[str, Any]] = {
        "no_mapping": {"do_remote_prefill": True},
        "junk": {"do_remote_prefill": True, PARAMS_KEY: {"engine": 5, "blocks": "x"}},
        "mismatch": _good_shape("p-c", _closed_port(), 999),
        "nobody": _good_shape("p-d", _closed_port(), len(PROMPTS[3])),
    }
    prompts = dict(zip(bad, PROMPTS, strict=True))
    for rid, p in prompts.items():
        engine.submit(rid, p, max_tokens=6, kv_transfer_params=bad[rid])
    out = engine.wait(prompts, 120)
    for rid in prompts:
        r = out[rid]
        assert r.finish_reasons[:1] == ["error"] or r.error, (rid, r)
        assert r.tokens == [], (rid, r)
    assert engine.connector_stats().get("rejected_params", 0) >= 3
    again = engine.generate({"again": PROMPTS[0]}, max_tokens=6)
    assert again["again"].tokens == plain["plain0"].tokens
