"""End to end with head-slice READs on a model with 2 KV heads, real vLLM engines (CPU
build), both directions. vLLM's CPU KV tensors are (N, H, block size, 2 x head size).

* P TP 1 -> D TP 2 (heads split on D: rank d holds head d): P's blocks hold both heads,
  each D rank's one; each D rank reads its head of every P block (one NIXL descriptor
  per layer segment and block).
* P TP 2 -> D TP 1 (heads split on P): D's one rank reads both P ranks, one part per P
  rank, each rank's whole blocks landing in its head of D's blocks; served only once
  both parts were read and verified.

Two engines, each running kvproto in both roles: S (TP 1; it first gives the
single-engine reference under other request ids) and T (TP 2). Checks: the greedy
outputs equal the reference token for token in both directions; every D rank pulled
every request (its journal: finished ``pulled``, never recomputed); S's ledger frees each
request as ``transferred`` only after both D ranks were done, and each of T's P ranks
frees each request on the done of its own part; a late D after lease expiry, while P
reuses the blocks, is never served in either direction (each P rank frees those
requests by expiry, D recomputes); every journal passes ``kvproto validate``; last,
T's rank 0 worker is killed while S reads both of T's ranks: every S request ends
within a bound and none is served from one head (the part of the dead rank never
lands, so the request recomputes or fails), 0 wrong.
"""

from __future__ import annotations

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
SPLIT = {f"x{i}": p for i, p in enumerate(h.make_prompts(4, seed=42))}  # P TP 2 -> D TP 1
LATE12 = {f"l{i}": p for i, p in enumerate(h.make_prompts(2, seed=43, lengths=[64, 100]))}
LATE21 = {f"m{i}": p for i, p in enumerate(h.make_prompts(2, seed=44, lengths=[64, 100]))}
KILLP = {f"q{i}": p for i, p in enumerate(h.make_prompts(3, seed=45, lengths=[90, 250, 31]))}
LEASE = sc.TP_LEASE
FREE_TIMEOUT = 8 * LEASE + 30.0  # a hang bound, not a timing assertion


Run = tuple[Path, h.PD, dict[str, list[int]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    wd = tmp_path_factory.mktemp("vllm_tp_slices")
    model = str(h.build_tiny_model(wd / "model", heads=4, kv_heads=2).path)
    s_spec, t_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="S",
                                **sc.kvproto_extras(str(wd), LEASE, tag="S"))
    t_spec.tensor_parallel_size = 2
    [s] = h.start_engines([s_spec], timeout=600)
    try:
        ref = sc.reference_outputs(
            s, {f"ref-{k}": v for k, v in {**PROMPTS, **SPLIT, **LATE12, **LATE21, **KILLP}.items()},
            max_tokens=MAX_TOKENS)
        reference = {k[4:]: v for k, v in ref.items()}
        [t] = h.start_engines([t_spec], timeout=600)  # one at a time on 2 cores
        pd = h.PD(s, t)
        try:
            # first contacts and first decode steps, both directions, until a READ went
            # through on every D rank
            sc.warm_up_pulled(pd, "w12", [wd / "DS.consumer.jsonl", wd / "DS.tp1.consumer.jsonl"])
            sc.warm_up_pulled(h.PD(t, s), "w21", [wd / "PS.consumer.jsonl"])
            yield wd, pd, reference
        finally:
            pd.close()
    except BaseException:
        s.kill()
        raise


def test_p_tp1_to_d_tp2_head_slices_token_for_token(run: Run) -> None:
    """Token for token; both D ranks pull every request (each its head of every block),
    and S's ledger frees each as ``transferred`` only after both D ranks were done
    (``scenarios.pulled_within``: checked on every attempt; each prompt pulled within
    three)."""
    wd, pd, reference = run
    got = sc.pulled_within(pd, PROMPTS, reference,
                           [(wd / "PS.jsonl", [wd / "DS.consumer.jsonl",
                                               wd / "DS.tp1.consumer.jsonl"])],
                           max_tokens=MAX_TOKENS, free_timeout=FREE_TIMEOUT)
    assert got.violations == [], (got.violations, got.given_up)
    assert got.pending == [], (got.pending, got.given_up)


def _part_ends(journal: Path, prefix: str) -> dict[str, dict[str, str]]:
    """How the parts of the requests whose id starts with ``prefix`` ended in a D
    journal: request (the id before "-") -> part (after "#") -> finish reason."""
    out: dict[str, dict[str, str]] = {}
    for rec in sc.journal_records(journal):
        for e in rec.get("effects", ()):
            rid = str(e.get("request_id", ""))
            if e.get("type") == "finished" and rid.startswith(prefix):
                out.setdefault(rid.split("-")[0], {})[rid.partition("#")[2]] = \
                    str(e.get("reason"))
    return out


def test_p_tp2_to_d_tp1_split_heads_reads_both_p_ranks_token_for_token(run: Run) -> None:
    """T (TP 2) prefills, S (TP 1) decodes: S reads each request from both of T's ranks
    (two parts), lands each rank's head in its half of the block, and serves it only
    through its coverage join; never refused. Each of T's P ranks frees each request as
    ``transferred`` only on the done of its own part, which S finished ``pulled``
    (``scenarios.pulled_within``, a route per P rank and part: checked on every attempt;
    a request S gave up runs again, each prompt pulled within three)."""
    wd, pd, reference = run
    t, s = pd.d, pd.p
    ps = wd / "PS.consumer.jsonl"
    before = s.connector_stats()
    got = sc.pulled_within(h.PD(t, s), SPLIT, reference,
                           [(wd / "DS.jsonl", [(ps, "")]), (wd / "DS.tp1.jsonl", [(ps, "p1")])],
                           max_tokens=MAX_TOKENS, free_timeout=FREE_TIMEOUT)
    assert got.violations == [], (got.violations, got.given_up)
    assert got.pending == [] and len(got.pulled) == len(SPLIT), (got.pending, got.given_up)
    after = s.connector_stats()

    def grew(k: str) -> float:
        return float(after.get(k, 0)) - float(before.get(k, 0))

    seen: dict[str, object] = {k: (before.get(k), v) for k, v in after.items()
                               if before.get(k) != v}
    parts = _part_ends(ps, "x")
    seen["d_ends"], seen["given_up"] = parts, got.given_up
    # a join completes once per request whose two parts were pulled, at most once per
    # attempt (exactly once per prompt when no attempt was given up)
    whole = sum(1 for v in parts.values() if len(v) == 2 and set(v.values()) == {"pulled"})
    assert len(got.pulled) <= grew("coverage_complete") <= whole, seen
    assert grew("tp_refused") == 0, seen
    if len(got.attempted) == len(got.pulled):  # no attempt given up: no READ failed
        assert grew("reads_failed") == 0, seen
    for rid in got.pulled:
        assert parts.get(rid) == {"": "pulled", "p1": "pulled"}, (rid, seen)


def _late(pd: h.PD, prompts: dict[str, list[int]], reference: dict[str, list[int]],
          p_journals: list[Path]) -> None:
    """A late D after lease expiry, while P reuses the blocks: nothing wrong is served,
    every P rank freed the requests by expiry and none as transferred."""
    out = sc.late_d(pd, prompts, reference, max_tokens=MAX_TOKENS, tag="late-slices")
    assert out.wrong == [] and out.errors == [], (out.wrong, out.errors)
    assert out.requests == len(prompts), out
    for j in p_journals:
        fr = sc.free_reasons(j)
        assert set(prompts) <= {rid for rid, why in fr.items() if "expired" in why}, \
            (j.name, fr)
        assert not set(prompts) & {rid for rid, why in fr.items() if "transferred" in why}, \
            (j.name, fr)


def test_p_tp1_to_d_tp2_late_d_is_fenced_and_recomputed(run: Run) -> None:
    """Head-slice readers (D TP 2) arriving after P's lease ran out and P reused the
    blocks: refused or fenced on both D ranks, recomputed, 0 wrong."""
    wd, pd, reference = run
    _late(pd, LATE12, reference, [wd / "PS.jsonl"])


def test_p_tp2_to_d_tp1_late_d_is_fenced_and_recomputed(run: Run) -> None:
    """The split-head join (D TP 1 reading both of P's ranks) arriving late: neither
    part is served, the request recomputes, 0 wrong."""
    wd, pd, reference = run
    _late(h.PD(pd.d, pd.p), LATE21, reference, [wd / "DS.jsonl", wd / "DS.tp1.jsonl"])


def test_slice_journals_validate(run: Run) -> None:
    wd = run[0]
    js = [wd / n for n in ("PS.jsonl", "DS.consumer.jsonl", "DS.tp1.consumer.jsonl",
                           "DS.jsonl", "DS.tp1.jsonl", "PS.consumer.jsonl")]
    run_ = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate",
                           *map(str, js)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run_.returncode == 0, run_.stdout + run_.stderr


def test_p_rank_worker_killed_split_heads_are_never_served_half(run: Run) -> None:
    """Last (it breaks T): T (TP 2) prefills, S (TP 1) decodes reading both of T's ranks,
    and T's rank 0 worker is killed while S pulls. Every S request ends within a bound
    (none hangs); a request is served only through the coverage join, so one whose part
    from the dead rank did not land is recomputed or fails, and no answer is wrong."""
    wd, pd, reference = run
    t, s = pd.d, pd.p
    before = s.connector_stats()
    got = sc.p_rank_killed(h.PD(t, s), KILLP, max_tokens=MAX_TOKENS,
                           timeout=FREE_TIMEOUT)  # raises if one has not ended by then
    assert set(got) == set(KILLP)
    after = s.connector_stats()
    seen: dict[str, object] = {k: (before.get(k), v) for k, v in after.items()
                               if before.get(k) != v}
    parts = _part_ends(wd / "PS.consumer.jsonl", "q")
    seen["d_ends"] = parts
    for rid, r in got.items():
        if r.error is None and r.tokens:
            assert r.tokens == reference[rid], (rid, seen)
    # A join completes only with both parts pulled; every other request ended its parts
    # otherwise (the dead rank's part never pulled).
    assert set(parts) == set(KILLP), seen
    grew = float(after.get("coverage_complete", 0)) - float(before.get("coverage_complete", 0))
    whole = sum(1 for v in parts.values() if len(v) == 2 and set(v.values()) == {"pulled"})
    assert grew <= whole, (grew, seen)  # no join completed without both parts
