"""One D engine facing a live P and a frozen P, through real vLLM engines (CPU, real
NIXL, tiny random-weight model; nothing mocked).

Upstream (vLLM PR #19823): D's handshakes ran on one thread with a timeout per P rank, so
one P that accepts connections but never answers held up every other P's requests. Here
P1 and P2 prefill, and P2 is then frozen (SIGSTOP of its whole process group: its sockets
stay open, nothing answers). D first gets four requests from P1, the P it already
knows, and holds each load ``HOLD`` seconds before its READ (test-only
``test_delay_load_s``), heartbeating P1 meanwhile; then two from P2, its first contact
with P2, whose handshake attempt waits ``HANDSHAKE_TIMEOUT`` for an answer, longer than
P1's lease. Checked:

* P1's requests are pulled, not recomputed, token for token (D's reads and P1's frees as
  ``transferred``, none expired): the frozen P's handshake holds up nothing else. A D
  whose handshake blocked its engine (checked by making it block) sends P1 no heartbeat
  for longer than P1's lease: P1 expires the requests and D recomputes them;
* P2's requests end on D (their initial lease runs out while the handshake is still
  unanswered: ``lease_lost``) and are recomputed, token for token;
* P2, thawed, frees its two requests by lease (D could not tell it) and serves again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

LEASE = 4.0
HANDSHAKE_TIMEOUT = 6.0  # one attempt outlasts P1's lease: a handshake that blocked D
HOLD = 5.0  # D's test_delay_load_s: D waits this long before each READ, heartbeating
MAX_TOKENS = 6
FROM_P2 = {f"x{i}": p for i, p in enumerate(h.make_prompts(2, seed=51, lengths=[70, 100]))}
FROM_P1 = {f"y{i}": p for i, p in enumerate(h.make_prompts(4, seed=52,
                                                            lengths=[40, 96, 130, 33]))}


class Fleet:
    def __init__(self, p1: h.Engine, p2: h.Engine, d: h.Engine,
                 ref: dict[str, list[int]]) -> None:
        self.p1, self.p2, self.d, self.ref = p1, p2, d, ref


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    wd = tmp_path_factory.mktemp("two_p")
    model = str(h.build_tiny_model(wd / "model").path)
    cfg: dict[str, Any] = {"lease": sc.lease_config(LEASE),
                           "handshake_timeout": HANDSHAKE_TIMEOUT}

    def spec(name: str, role: str) -> h.EngineSpec:
        extra = {**cfg, "role": role}
        if role == "consumer":
            extra["test_delay_load_s"] = HOLD
        ktc = {**h.KVPROTO_CONNECTOR, "kv_connector_extra_config": extra}
        return h.EngineSpec(name=name, model=model, kv_transfer_config=ktc,
                            env=h.engine_env(), log_path=str(wd / f"{name}.log"))

    engines = h.start_engines([spec("P1", "producer"), spec("P2", "producer"),
                               spec("D", "consumer")])
    p1, p2, d = engines
    try:
        ref = sc.reference_outputs(p1, {f"ref-{k}": v for k, v in {**FROM_P1,
                                                                    **FROM_P2}.items()},
                                   max_tokens=MAX_TOKENS)
        h.PD(p1, d).warm_up("w1")  # D knows P1; P2 it has never contacted
        yield Fleet(p1, p2, d, {k[4:]: v for k, v in ref.items()})
    finally:
        for e in engines:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(e.pid, signal.SIGCONT)
            e.close()


def _num(st: dict[str, Any], key: str) -> float:
    v = st.get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def test_a_frozen_p_holds_up_no_other_p(fleet: Fleet) -> None:
    p1, p2, d = fleet.p1, fleet.p2, fleet.d
    via1, via2 = h.PD(p1, d), h.PD(p2, d)
    base1, base2 = int(p1.stats()["free_blocks"]), int(p2.stats()["free_blocks"])
    d0, p10, p20 = d.connector_stats(), p1.connector_stats(), p2.connector_stats()
    params1 = {rid: via1.prefill(rid, pr) for rid, pr in FROM_P1.items()}
    params2 = {rid: via2.prefill(rid, pr) for rid, pr in FROM_P2.items()}
    os.killpg(p2.pid, signal.SIGSTOP)  # sockets open, nothing answers
    try:
        for rid, pr in FROM_P1.items():
            via1.submit_decode(rid, pr, params1[rid], max_tokens=MAX_TOKENS)
        for rid, pr in FROM_P2.items():
            via2.submit_decode(rid, pr, params2[rid], max_tokens=MAX_TOKENS)
        out = d.wait([*FROM_P1, *FROM_P2], 8 * LEASE + 60.0)
    finally:
        os.killpg(p2.pid, signal.SIGCONT)
    for rid in (*FROM_P1, *FROM_P2):
        assert out[rid].error is None and out[rid].tokens == fleet.ref[rid], (rid, out[rid])
    d1 = d.connector_stats()

    def grew(st0: dict[str, Any], st1: dict[str, Any], key: str) -> float:
        return _num(st1, key) - _num(st0, key)

    # P1's requests were pulled, every one of them; P2's were not (D gave them up when
    # its estimate of their initial lease ran out, the handshake still unanswered)
    assert grew(d0, d1, "reads_ok") == len(FROM_P1), d1
    assert grew(d0, d1, "reads_failed") == len(FROM_P2), d1
    ok, _, _ = sc.wait_free(p1, base1, 4 * LEASE + 30.0)
    assert ok, p1.stats()
    p11 = p1.connector_stats()
    assert grew(p10, p11, "frees_transferred") == len(FROM_P1), p11
    assert grew(p10, p11, "frees_expired") == 0, p11
    # P2, thawed: its two requests end by lease (nobody could tell it), and it serves
    ok, _, _ = sc.wait_free(p2, base2, 4 * LEASE + 30.0)
    assert ok, p2.stats()
    p21 = p2.connector_stats()
    assert grew(p20, p21, "frees_expired") == len(FROM_P2), p21
    assert _num(p21, "invariant_violations") == 0, p21
    again = p2.generate({"p2-again": FROM_P2["x0"]}, max_tokens=MAX_TOKENS)
    assert again["p2-again"].tokens == fleet.ref["x0"]

