"""End to end with head-slice READs: P TP 1 -> D TP 2 on a model with 2 KV heads (split
on D: rank d holds head d), real vLLM engines (CPU build). vLLM's CPU KV tensors are (N,
H, block size, 2 x head size): P's blocks hold both heads, each D rank's one; each D rank
reads its head of every P block (one NIXL descriptor per layer segment and block).

Two engines: S (TP 1, kvproto as P; it first gives the single-engine reference under
other request ids) and T (TP 2, kvproto as D). Checks: T's greedy outputs equal the
reference token for token; each D rank pulled every request (its journal: finished
``pulled``, never recomputed); S's ledger frees each request as ``transferred`` only
after both D ranks were done; every journal passes ``kvproto validate``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

MAX_TOKENS = 8
PROMPTS = {f"s{i}": p for i, p in enumerate(h.make_prompts(6, seed=41))}
FREE_TIMEOUT = 8 * sc.LEASE + 30.0  # a hang bound, not a timing assertion


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, sc.Outcome, int]]:
    wd = tmp_path_factory.mktemp("vllm_tp_slices")
    model = str(h.build_tiny_model(wd / "model", heads=4, kv_heads=2).path)
    s_spec, t_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="S",
                                **sc.kvproto_extras(str(wd), tag="S"))
    t_spec.tensor_parallel_size = 2
    [s] = h.start_engines([s_spec], timeout=600)
    try:
        ref = sc.reference_outputs(s, {f"ref-{k}": v for k, v in PROMPTS.items()},
                                   max_tokens=MAX_TOKENS)
        reference = {k[4:]: v for k, v in ref.items()}
        [t] = h.start_engines([t_spec], timeout=600)  # one at a time on 2 cores
        pd = h.PD(s, t)
        try:
            baseline = int(s.stats()["free_blocks"])
            out = sc.correctness(pd, PROMPTS, reference, max_tokens=MAX_TOKENS)
            ok, _, _ = sc.wait_free(s, baseline, FREE_TIMEOUT)
            yield wd, out, int(ok)
        finally:
            pd.close()
    except BaseException:
        s.kill()
        raise


def _effects(journal: Path) -> Iterator[dict[str, object]]:
    for line in journal.read_text().splitlines()[1:]:
        rec = json.loads(line)
        yield {"event": rec.get("event", {}), "effects": rec.get("effects", [])}


def test_p_tp1_to_d_tp2_head_slices_token_for_token(
        run: tuple[Path, sc.Outcome, int]) -> None:
    wd, out, freed = run
    assert out.errors == [] and out.wrong == [], (out.errors, out.wrong)
    assert out.requests == len(PROMPTS) and out.tokens == len(PROMPTS) * MAX_TOKENS
    assert freed, "S did not free its blocks"
    for name in ("DS.consumer.jsonl", "DS.tp1.consumer.jsonl"):
        pulled = {str(e["request_id"]).split("-")[0] for rec in _effects(wd / name)
                  for e in rec["effects"]  # type: ignore[attr-defined]
                  if e.get("type") == "finished" and e.get("reason") == "pulled"}
        assert set(PROMPTS) <= pulled, (name, pulled)
    readers: dict[int, set[str]] = {}
    transferred = set()
    for rec in _effects(wd / "PS.jsonl"):
        ev = rec["event"]
        assert isinstance(ev, dict)
        if ev.get("type") == "done":
            readers.setdefault(int(ev["handle"]), set()).add(str(ev["reader"]))
        for e in rec["effects"]:  # type: ignore[attr-defined]
            if e.get("type") == "free":
                assert e["reason"] == "transferred", e
                assert len(readers.get(int(e["handle"]), ())) == 2, (e, readers)
                transferred.add(str(e["request_id"]).split("-")[0])
    assert set(PROMPTS) <= transferred


def test_slice_journals_validate(run: tuple[Path, sc.Outcome, int]) -> None:
    wd = run[0]
    js = [wd / n for n in ("PS.jsonl", "DS.consumer.jsonl", "DS.tp1.consumer.jsonl")]
    run_ = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate",
                           *map(str, js)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run_.returncode == 0, run_.stdout + run_.stderr
