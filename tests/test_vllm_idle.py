"""P's idle wait on a real vLLM P engine: while P holds blocks and nothing is due, every
engine step blocks in the connector (no busy loop), and held blocks are still freed when
their lease runs out. Counts steps and waits, never wall-clock time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

LEASE = 6.0


def test_idle_p_waits_instead_of_spinning_and_still_frees(tmp_path: Path) -> None:
    model = str(h.build_tiny_model(tmp_path / "model").path)
    spec, _ = h.pd_specs(model, tmp_path, h.KVPROTO_CONNECTOR,
                         extra_config={"lease": sc.lease_config(LEASE), "idle_wait_ms": 50,
                                       "progress_thread": False})
    (p,) = h.start_engines([spec])
    try:
        pd = h.PD(p, p)
        prompts = {f"held-{i}": pr for i, pr in enumerate(h.make_prompts(2, seed=5))}
        pd.submit_prefills(prompts)
        p.wait(prompts, 120.0)
        # The worker registers a finished prefill at its next step, which a loaded
        # machine may run after the output reached us: wait for it (a hang bound).
        deadline = time.monotonic() + 60.0
        while p.connector_stats().get("held_requests", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        s0 = p.connector_stats()
        assert s0["held_requests"] == 2
        time.sleep(1.0)  # nothing is due: no D, lease far off
        s1 = p.connector_stats()
        steps = s1["worker_steps"] - s0["worker_steps"]
        waits = s1["idle_waits"] - s0["idle_waits"]
        assert steps >= 1
        assert waits >= steps - 2, (steps, waits)  # every step but a stray one blocked
        assert s1["idle_polls"] > s0["idle_polls"]
        # Off: the same engine steps without waiting.
        assert p.connector_call("set_idle_wait_ms", 0, worker=True) == 50
        time.sleep(0.3)
        s2 = p.connector_stats()
        time.sleep(0.3)
        s3 = p.connector_stats()
        assert s3["idle_waits"] == s2["idle_waits"]
        assert s3["worker_steps"] > s2["worker_steps"]
        p.connector_call("set_idle_wait_ms", 50, worker=True)
        deadline = time.monotonic() + LEASE + 30.0  # a hang bound, not a timing assertion
        while p.connector_stats().get("held_requests", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        s4 = p.connector_stats()
        assert s4["held_requests"] == 0
        assert s4.get("frees_expired", 0) == 2
    finally:
        p.close()
