"""End to end: real vLLM engines serving two checkpoints of one architecture and shape
(random weights A and B, byte-identical configuration) never pair. D refuses P's
handshake on the ``weights`` field of the model identity before any READ, counts and
logs it, and recomputes: its outputs equal the single-engine outputs of its own model.

Three engine starts: P on a directory holding A (then replaced in place by B, as a
rolling update would: new files renamed over the old ones), D2 on another directory
holding B (case "two paths"), and D1 started on P's directory after the replacement
(case "same path"). The reference outputs of each model come from the engines
themselves, as single engines: plain requests without transfer params. P, whose
handshake D refused, is never told that D will not read: it frees each request once, by
its lease.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvproto.vllm import harness as h
from kvproto.vllm import scenarios as sc

_SKIP = h.vllm_available()
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(_SKIP is not None, reason=f"vLLM e2e: {_SKIP}")]

MAX_TOKENS = 8
PROMPTS = {f"m{i}": p for i, p in enumerate(h.make_prompts(4, seed=31,
                                                            lengths=[40, 64, 100, 150]))}


def _replace_in_place(src: Path, dst: Path) -> None:
    """Copy every file of ``src`` over the file of the same name in ``dst``: written
    beside it, then renamed over it (a running engine keeps the file it opened)."""
    for f in src.iterdir():
        tmp = dst / f".{f.name}.new"
        shutil.copyfile(f, tmp)
        os.replace(tmp, dst / f.name)


class Fleet:
    def __init__(self, p: h.Engine, d_paths: h.Engine, d_inplace: h.Engine, wd: Path,
                 ref_a: dict[str, list[int]], ref_b: dict[str, list[int]]) -> None:
        self.p, self.d_paths, self.d_inplace, self.wd = p, d_paths, d_inplace, wd
        self.ref_a, self.ref_b = ref_a, ref_b


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    wd = tmp_path_factory.mktemp("vllm_identity")
    a = h.build_tiny_model(wd / "a", seed=0).path
    b = h.build_tiny_model(wd / "b", seed=1).path
    shutil.copyfile(a / "config.json", b / "config.json")  # the weights differ, nothing else
    live = wd / "live"
    shutil.copytree(a, live)
    cfg: dict[str, Any] = {"lease": sc.lease_config(), "handshake_timeout": 1.0}

    def spec(name: str, model: Path, role: str) -> h.EngineSpec:
        ktc = {**h.KVPROTO_CONNECTOR, "kv_connector_extra_config": {**cfg, "role": role}}
        return h.EngineSpec(name=name, model=str(model), kv_transfer_config=ktc,
                            env=h.engine_env(), log_path=str(wd / f"{name}.log"))

    engines: list[h.Engine] = []
    try:
        engines += h.start_engines([spec("P", live, "producer"), spec("D2", b, "consumer")])
        _replace_in_place(b, live)  # the rolling update, while P runs A
        engines += h.start_engines([spec("D1", live, "consumer")])
        p, d2, d1 = engines
        ref_a = sc.reference_outputs(p, {f"{k}-a": v for k, v in PROMPTS.items()},
                                     max_tokens=MAX_TOKENS)
        ref_b = sc.reference_outputs(d2, {f"{k}-b": v for k, v in PROMPTS.items()},
                                     max_tokens=MAX_TOKENS)
        ref_b1 = sc.reference_outputs(d1, {f"{k}-b1": v for k, v in PROMPTS.items()},
                                      max_tokens=MAX_TOKENS)
        assert [ref_b[f"{k}-b"] for k in PROMPTS] == [ref_b1[f"{k}-b1"] for k in PROMPTS], \
            "D1 and D2 load the same weights B"
        yield Fleet(p, d2, d1, wd, {k: ref_a[f"{k}-a"] for k in PROMPTS},
                    {k: ref_b[f"{k}-b"] for k in PROMPTS})
    finally:
        for e in engines:
            e.close()


def _check_refused(fleet: Fleet, d: h.Engine, tag: str) -> None:
    prompts = {f"{k}-{tag}": v for k, v in PROMPTS.items()}
    baseline = int(fleet.p.stats()["free_blocks"])
    before_d, before_p = d.connector_stats(), fleet.p.connector_stats()
    res = h.PD(fleet.p, d).run(prompts, max_tokens=MAX_TOKENS)
    # D never handshook, so it cannot release: P frees each request by its lease, once
    ok, _, _ = sc.wait_free(fleet.p, baseline, 4 * sc.LEASE + 30.0)
    assert ok and int(fleet.p.stats()["free_blocks"]) == baseline, fleet.p.stats()
    after_d, after_p = d.connector_stats(), fleet.p.connector_stats()
    for k in PROMPTS:
        r = res[f"{k}-{tag}"]
        assert r.error is None and r.tokens == fleet.ref_b[k], \
            f"{k}: D's output is not its own model's (decoded on P's KV?)"

    def delta(st0: dict[str, Any], st1: dict[str, Any], key: str) -> float:
        return float(st1.get(key, 0)) - float(st0.get(key, 0))

    assert delta(before_d, after_d, "model_mismatches") >= 1, after_d
    assert delta(before_d, after_d, "reads_ok") == 0, after_d
    assert delta(before_p, after_p, "model_mismatches") >= 1, after_p
    frees = {k: delta(before_p, after_p, k) for k in after_p if k.startswith("frees_")}
    assert frees.get("frees_expired") == len(PROMPTS), frees
    assert sum(frees.values()) == len(PROMPTS), frees
    log = Path(d.spec.log_path or "").read_text(errors="replace")
    line = next((x for x in log.splitlines() if "model_mismatch" in x), "")
    assert "1 identity field(s) differ: weights: P has 'sha256:" in line, line


def test_different_weights_at_two_paths_are_refused(fleet: Fleet) -> None:
    assert fleet.ref_a != fleet.ref_b, "the two checkpoints must decode differently"
    _check_refused(fleet, fleet.d_paths, "paths")


def test_weights_replaced_in_place_are_refused(fleet: Fleet) -> None:
    _check_refused(fleet, fleet.d_inplace, "inplace")


def test_no_stray_engine_processes(fleet: Fleet) -> None:
    for e in (fleet.d_inplace, fleet.d_paths, fleet.p):
        e.close()
    assert h.stray_engines() == []
