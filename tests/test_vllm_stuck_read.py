"""A READ that does not complete, and a second pull, through real vLLM engines (CPU, real
NIXL, tiny random-weight model; nothing mocked). D's transport holds each data READ "in
progress" for ``HOLD`` seconds (test-only ``test_hold_read_s``), past D's max_read_time +
read_grace. D fails the load at the deadline (its blocks are reported as load errors), keeps
the request's blocks out of vLLM's hands until the transfer ended (stuck_reads is 1 in the
meantime), then vLLM recomputes it ("recompute" policy): the output equals D's own local
generation of the prompt. P is never told done or release for it and frees by lease. A
second load with the same transfer params is refused (second_pull) and recomputed.

A second D engine with kv_load_failure_policy "fail" (the same P, started together) shows
the other path: the overdue READ ends its request with an error (no tokens, no hang),
its blocks stay quarantined until the transfer ended and then go back (no block lost),
P frees by lease, and the engine still serves plain requests."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

HOLD = 8.0  # seconds a data READ stays "in progress"; D's deadline is 1.0 + 1.0 s
D_DEADLINE = 2.0  # D's max_read_time + read_grace (the engines' lease config below)
LEASE = 10.0
MAX_TOKENS = 6
PROMPTS = {f"s{i}": p for i, p in enumerate(h.make_prompts(2, seed=21, lengths=[96, 40]))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stuck_read")


@pytest.fixture(scope="module")
def engines(workdir: Path) -> Iterator[tuple[h.PD, h.PD]]:
    """P with two D engines, one per kv_load_failure_policy ("recompute", "fail"),
    started together; each D's READs hang for HOLD seconds."""
    wd = workdir
    model = str(h.build_tiny_model(wd / "model").path)
    # A lease long enough that a first handshake on a loaded machine still fits it.
    kw = sc.kvproto_extras(str(wd), LEASE, tag="s")
    d_lease = {**sc.lease_config(LEASE), "max_read_time": D_DEADLINE / 2,
               "read_grace": D_DEADLINE / 2}
    kw["d_extra"] = {**kw["d_extra"], "lease": d_lease, "test_hold_read_s": HOLD}
    p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="s", **kw)
    ktc = dict(d_spec.kv_transfer_config or {})
    ktc["kv_load_failure_policy"] = "fail"
    ktc["kv_connector_extra_config"] = {**ktc["kv_connector_extra_config"],
                                        "journal": str(wd / "Dsf.jsonl")}
    f_spec = dataclasses.replace(d_spec, name="Dsf", kv_transfer_config=ktc,
                                 log_path=str(wd / "Dsf.log"))
    p, d, f = h.start_engines([p_spec, d_spec, f_spec])
    try:
        yield h.PD(p, d), h.PD(p, f)
    finally:
        for e in (f, d, p):
            e.close()


@pytest.fixture(scope="module")
def pd(engines: tuple[h.PD, h.PD]) -> h.PD:
    return engines[0]


def test_fail_policy_ends_a_stuck_read_with_an_error_and_loses_no_block(
        engines: tuple[h.PD, h.PD]) -> None:
    pf = engines[1]
    plain = pf.d.generate({"f-plain": PROMPTS["s1"]}, max_tokens=MAX_TOKENS)
    p_base = int(pf.p.stats()["free_blocks"])
    d_base = int(pf.d.stats()["free_blocks"])
    res = pf.prefill("f0", PROMPTS["s0"])
    pf.submit_decode("f0", PROMPTS["s0"], res, max_tokens=MAX_TOKENS)
    end = time.monotonic() + 60.0
    while _stat(pf.d, "stuck_reads") < 1:
        assert time.monotonic() < end, pf.d.connector_stats()
        # "fail" ends the request at its READ's deadline, in the step that quarantines
        # the blocks, and the stat may show the quarantine a poll after the result
        # arrived; the request must never end before that deadline (max_read_time +
        # read_grace after the READ was posted, which is after the submit).
        r0 = pf.d.results.get("f0")
        assert r0 is None or r0.finish_t - r0.submit_t >= D_DEADLINE, \
            f"finished {r0.finish_t - r0.submit_t:.2f} s after its submit, before its READ " \
            "went overdue"
        pf.d.poll(0.2)
    out = pf.d.wait(["f0"], 120)["f0"]
    assert out.finish_t - out.submit_t >= D_DEADLINE, out
    # "fail": the request ends with an error, never with tokens from blocks not read
    assert out.finish_reasons[:1] == ["error"] or out.error, out
    assert out.tokens == [], out
    # the quarantine ends with the transfer, and the blocks go back to the engine
    ok, _, _ = sc.wait_free(pf.d, d_base, HOLD + 60.0)
    assert ok and _stat(pf.d, "stuck_reads") == 0, (pf.d.stats(), pf.d.connector_stats())
    assert _stat(pf.d, "read_timeouts") >= 1, pf.d.connector_stats()
    ok, _, _ = sc.wait_free(pf.p, p_base, 4 * LEASE + 20.0)  # P frees by lease
    assert ok, pf.p.stats()
    again = pf.d.generate({"f-again": PROMPTS["s1"]}, max_tokens=MAX_TOKENS)
    assert again["f-again"].tokens == plain["f-plain"].tokens


def _stat(e: h.Engine, key: str) -> float:
    v = e.connector_stats().get(key, 0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def test_a_read_that_does_not_complete_is_quarantined_then_recomputed(pd: h.PD,
                                                                      workdir: Path) -> None:
    ref = pd.d.generate({f"{k}-local": v for k, v in PROMPTS.items()}, max_tokens=MAX_TOKENS)
    baseline = int(pd.p.stats()["free_blocks"])
    rid = "s0"
    res = pd.prefill(rid, PROMPTS[rid])
    pd.submit_decode(rid, PROMPTS[rid], res, max_tokens=MAX_TOKENS)
    # The READ goes overdue and stays quarantined while the transfer "runs".
    end = time.monotonic() + 60.0
    while _stat(pd.d, "stuck_reads") < 1:
        assert time.monotonic() < end, pd.d.connector_stats()
        assert rid not in pd.d.results, "finished before its READ went overdue"
        pd.d.poll(0.2)
    out = pd.d.wait([rid], 120)[rid]
    assert out.error is None, out
    assert out.token_ids[0] == ref[f"{rid}-local"].tokens, "wrong tokens after recompute"
    st = pd.d.connector_stats()
    assert _stat(pd.d, "stuck_reads") == 0 and _stat(pd.d, "read_timeouts") >= 1, st
    # P frees r's blocks by lease (no done, no release reached it for this request).
    ok, _, _ = sc.wait_free(pd.p, baseline, 4 * LEASE + 20.0)
    assert ok, pd.p.stats()

    # A second load of the same params: refused on D, recomputed locally.
    pd.submit_decode("s0-again", PROMPTS[rid], res, max_tokens=MAX_TOKENS)
    again = pd.d.wait(["s0-again"], 120)["s0-again"]
    assert again.error is None and again.token_ids[0] == ref[f"{rid}-local"].tokens
    assert _stat(pd.d, "second_pulls") == 1, pd.d.connector_stats()

    # D's journal (read_timeout, quarantine, second_pull) and P's validate under TLC.
    pd.close()
    from kvproto.verify import validate as va
    from kvproto.verify.tlc import MissingDependency

    try:
        verdicts = va.validate([workdir / "Ds.consumer.jsonl", workdir / "Ps.jsonl"])
    except MissingDependency as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert verdicts and all(v.allowed for v in verdicts), [v.describe() for v in verdicts]
