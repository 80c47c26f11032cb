"""End to end with tensor parallelism: KVProtoConnector in real vLLM engines (CPU build,
multiprocess executor over gloo), P TP 2 -> D TP 2, on a model with one KV head (fewer KV
heads than ranks: vLLM replicates it, each D rank reads it once, from its own P rank).

One P/D pair serves every test of the module; the single-engine reference (TP 1) runs
first and is closed before the pair starts. Checks: D's greedy outputs equal the
reference token for token; a late D after lease expiry is fenced or refused and
recomputed (0 wrong); every rank's journal (P rank 0 and 1, D rank 0 and 1) passes
``kvproto validate``; last, one D rank's worker is killed while D pulls: P gets every block
back within the lease bound and frees each request once per rank, and whatever D still
answers is the reference.

Heterogeneous TP (P TP 2 -> D TP 1, P TP 1 -> D TP 2) needs head-slice READs, which this
version does not post: ``kvproto.vllm.topology.d_params`` refuses such a plan before any
READ (tests/test_vllm_topology.py covers it without engines).
"""

from __future__ import annotations

import json
import os
import signal
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
P_KV_BYTES = 8 << 20
COR = {f"c{i}": p for i, p in enumerate(h.make_prompts(8, seed=21))}
LATE = {f"late{i}": p for i, p in enumerate(h.make_prompts(2, seed=22, lengths=[64, 100]))}
KILL = {f"k{i}": p for i, p in enumerate(h.make_prompts(3, seed=23, lengths=[90, 250, 31]))}
ALL = {**COR, **LATE, **KILL}
FREE_TIMEOUT = 8 * sc.LEASE + 30.0  # a hang bound, not a timing assertion


class Pair:
    def __init__(self, pd: h.PD, ref: dict[str, list[int]], journals: list[Path]) -> None:
        self.pd, self.ref, self.journals = pd, ref, journals


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    wd = tmp_path_factory.mktemp("vllm_tp")
    model = str(h.build_tiny_model(wd / "model", heads=4, kv_heads=1).path)
    ref_spec = h.EngineSpec("REF", model, env=h.engine_env(), log_path=str(wd / "REF.log"))
    [ref] = h.start_engines([ref_spec])
    try:
        reference = sc.reference_outputs(ref, ALL, max_tokens=MAX_TOKENS)
    finally:
        ref.close()
    kw = sc.kvproto_extras(str(wd), tag="1")
    p_spec, d_spec = h.pd_specs(model, wd, h.KVPROTO_CONNECTOR, tag="1",
                                p_kv_bytes=P_KV_BYTES, **kw)
    p_spec.tensor_parallel_size = d_spec.tensor_parallel_size = 2
    [p] = h.start_engines([p_spec], timeout=600)  # one at a time: 6 processes on 2 cores
    try:
        [d] = h.start_engines([d_spec], timeout=600)
    except BaseException:
        p.kill()
        raise
    pd = h.PD(p, d)
    try:
        yield Pair(pd, reference, [wd / "P1.jsonl", wd / "P1.tp1.jsonl",
                                   wd / "D1.consumer.jsonl", wd / "D1.tp1.consumer.jsonl"])
    finally:
        pd.close()


def _frees(journal: Path) -> dict[str, set[str]]:
    """Request ids freed per reason in one P rank's journal (its ledger's own record:
    with TP > 1 the worker-side connectors live in vLLM's worker processes)."""
    out: dict[str, set[str]] = {}
    for line in journal.read_text().splitlines()[1:]:
        rec = json.loads(line)
        for e in rec.get("effects", ()):
            if e.get("type") == "free":
                out.setdefault(e["reason"], set()).add(e["request_id"])
    return out


def _rank_journals(pair: Pair) -> list[Path]:
    return [j for j in pair.journals if j.name.startswith("P")]


def test_tp2_to_tp2_token_for_token(pair: Pair) -> None:
    out = sc.correctness(pair.pd, COR, pair.ref, max_tokens=MAX_TOKENS)
    assert out.errors == [] and out.wrong == [], (out.errors, out.wrong)
    assert out.requests == len(COR) and out.tokens == len(COR) * MAX_TOKENS
    # pulled, not recomputed: every P rank freed every request as transferred, each on
    # the done of its own D rank
    for j in _rank_journals(pair):
        done = {rid.split("-")[0] for rid in _frees(j).get("transferred", set())}
        assert set(COR) <= done, (j.name, sorted(done))


def test_tp2_late_d_is_fenced_and_recomputed(pair: Pair) -> None:
    out = sc.late_d(pair.pd, LATE, pair.ref, max_tokens=MAX_TOKENS)
    assert out.wrong == [] and out.errors == [], (out.wrong, out.errors)
    for j in _rank_journals(pair):  # each P rank expired them: nothing was pulled
        fr = _frees(j)
        expired = {rid.split("-")[0] for rid in fr.get("expired", set())}
        pulled = {rid.split("-")[0] for rid in fr.get("transferred", set())}
        assert set(LATE) <= expired and not set(LATE) & pulled, (j.name, fr)


def test_every_rank_journal_validates(pair: Pair) -> None:
    present = [str(j) for j in pair.journals if j.exists() and j.stat().st_size > 0]
    assert len(present) == 4, (present, pair.journals)
    run = subprocess.run([sys.executable, "-m", "kvproto.cli", "validate", *present],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stdout + run.stderr


def _worker(engine_pid: int, name: str) -> int:
    """The pid of the engine's worker process named ``name`` (vLLM's VLLM::<name>)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat[1]) == engine_pid and name in cmd:
            return int(d.name)
    raise AssertionError(f"no {name} under engine {engine_pid}")


def test_d_rank_worker_killed_p_reclaims_within_lease(pair: Pair) -> None:
    """Last (it breaks D): D rank 1's worker is killed while D pulls. Every P rank gets
    its blocks back within the lease bound (done, or expiry of what D can no longer
    renew), each request freed once per P rank; no answer D still gives is wrong."""
    p = pair.pd.p
    baseline = int(p.stats()["free_blocks"])
    res = {rid: pair.pd.prefill(rid, pr) for rid, pr in KILL.items()}
    assert baseline - int(p.stats()["free_blocks"]) > 0  # P holds them for D
    victim = _worker(pair.pd.d.pid, "Worker_TP1")
    for rid, pr in KILL.items():
        pair.pd.submit_decode(rid, pr, res[rid], max_tokens=MAX_TOKENS)
    os.kill(victim, signal.SIGKILL)
    ok, _, _ = sc.wait_free(p, baseline, FREE_TIMEOUT)
    assert ok, "P did not get its blocks back after a D rank died"
    assert int(p.stats()["free_blocks"]) == baseline  # and not one block more
    for j in _rank_journals(pair):
        fr = _frees(j)
        for rid in KILL:
            n = sum(1 for ids in fr.values() for x in ids if x.split("-")[0] == rid)
            assert n == 1, (j.name, rid, fr)
    for rid, r in pair.pd.d.results.items():
        if rid in KILL and r.error is None and r.tokens:
            assert r.tokens == pair.ref[rid], rid
