"""Tensor-parallel pairing (``Topology``) and D's coverage machine (``Coverage``): the
rank/head plans of the matrix, fail-closed verdicts, the fuzzer's oracle, the mutant
``drop_region`` caught three ways (fuzzer, graph equality with KVCoverage.tla, TLC's
``bug_drop_region`` model), and the Python/TLA+ graph equality itself."""

from __future__ import annotations

import pytest

from kvproto.errors import UsageError
from kvproto.lifecycle.coverage import (
    C_TABLE,
    C_TRANSITIONS,
    COMPLETE,
    INCOMPLETE,
    MAX_REGIONS,
    CancelParts,
    Coverage,
    CoverageDone,
    Region,
    region_map,
)
from kvproto.lifecycle.topology import Source, Topology, TopologyError, heads_of
from kvproto.testing import cfuzz
from kvproto.testing.mutants import COVERAGE_MUTANTS

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

# -- topology ------------------------------------------------------------------------

@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "plans", "readers", "orphans"), [
    # same size: D rank r reads P rank r
    (2, 2, 2, [[Source(0, 0, 0, 1)], [Source(1, 0, 0, 1)]], [1, 1], ()),
    # P TP 2 -> D TP 1: D reads both P ranks' slices into its two heads
    (2, 1, 2, [[Source(0, 0, 0, 1), Source(1, 0, 1, 1)]], [1, 1], ()),
    # P TP 1 -> D TP 2: each D rank reads its own head of the one P rank: 2 readers
    (1, 2, 2, [[Source(0, 0, 0, 1)], [Source(0, 1, 0, 1)]], [2], ()),
    # one KV head, replicated on P's two ranks, read once by D TP 1: P rank 1 orphan
    (2, 1, 1, [[Source(0, 0, 0, 1)]], [1, 0], (1,)),
    # one KV head, both D ranks need it: P TP 1 has two readers
    (1, 2, 1, [[Source(0, 0, 0, 1)], [Source(0, 0, 0, 1)]], [2], ()),
    # replicated on both sides: D ranks spread over the replicas
    (2, 2, 1, [[Source(0, 0, 0, 1)], [Source(1, 0, 0, 1)]], [1, 1], ()),
    (4, 2, 8, [[Source(0, 0, 0, 2), Source(1, 0, 2, 2)],
               [Source(2, 0, 0, 2), Source(3, 0, 2, 2)]], [1, 1, 1, 1], ()),
])
def test_topology_plans(p_tp: int, d_tp: int, heads: int, plans: list[list[Source]],
                        readers: list[int], orphans: tuple[int, ...]) -> None:
    t = Topology(p_tp, d_tp, heads)
    assert [list(t.sources(d)) for d in range(d_tp)] == plans
    assert [t.readers(p) for p in range(p_tp)] == readers
    assert t.orphans() == orphans


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("p_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("d_tp", [1, 2, 4, 8])
def test_every_d_rank_reads_each_of_its_heads_once_from_a_holder(
        heads: int, p_tp: int, d_tp: int) -> None:
    if (heads % p_tp and p_tp % heads) or (heads % d_tp and d_tp % heads):
        with pytest.raises(TopologyError):
            Topology(p_tp, d_tp, heads)
        return
    t = Topology(p_tp, d_tp, heads)
    for d in range(d_tp):
        got: list[int] = []
        for s in t.sources(d):
            p_heads = heads_of(s.p_rank, p_tp, heads)
            assert s.p_head + s.heads <= len(p_heads)
            got += list(p_heads[s.p_head:s.p_head + s.heads])
            assert [got[i] for i in range(s.d_head, s.d_head + s.heads)] == \
                list(p_heads[s.p_head:s.p_head + s.heads])
        assert got == list(heads_of(d, d_tp, heads))  # each head once, in D's order
    assert sum(t.readers(p) for p in range(p_tp)) == sum(len(t.sources(d))
                                                         for d in range(d_tp))


def test_topology_refuses_bad_sizes() -> None:
    for args in ((3, 1, 2), (1, 3, 2), (0, 1, 1), (1, 1, 0), (2048, 1, 1)):
        with pytest.raises(TopologyError):
            Topology(*args)
    with pytest.raises(TopologyError):
        Topology(1, 2, 2).sources(2)
    with pytest.raises(TopologyError):
        Topology(1, 2, 2).readers(1)


# -- the machine ---------------------------------------------------------------------

def _map(p_tp: int = 2, d_tp: int = 1, heads: int = 2, layers: tuple[int, ...] = (2,)
         ) -> dict[int, frozenset[Region]]:
    return region_map(Topology(p_tp, d_tp, heads), 0, list(layers))


def test_region_map_is_p_rank_x_layer_x_group() -> None:
    m = _map(layers=(2, 1))
    assert set(m) == {0, 1}
    assert m[1] == {Region(1, 0, 0), Region(1, 1, 0), Region(1, 0, 1)}
    with pytest.raises(UsageError):
        _map(layers=())
    with pytest.raises(UsageError):
        _map(layers=(MAX_REGIONS,))


def test_complete_only_when_every_region_was_read() -> None:
    c, m = Coverage(), _map()
    assert c.expect("r", m) == []
    assert c.part_read("r", 0, m[0]) == []
    assert c.state("r") == "covering" and c.pending("r") == (1,)
    [done] = c.part_read("r", 1, m[1])
    assert done == CoverageDone("r", True, "complete", m[0] | m[1], frozenset())
    assert c.state("r") == COMPLETE and c.read("r") == m[0] | m[1]


def test_a_short_part_fails_closed_and_cancels_the_others() -> None:
    c, m = Coverage(), _map()
    c.expect("r", m)
    short = set(m[0]) - {Region(0, 1, 0)}
    out = c.part_read("r", 0, short)
    assert out[0] == CancelParts("r", (1,))
    assert isinstance(out[1], CoverageDone) and not out[1].ok and out[1].reason == "short"
    assert Region(0, 1, 0) in out[1].missing
    assert c.state("r") == INCOMPLETE
    assert c.part_read("r", 1, m[1]) == []  # the cancelled part landing later: stale
    assert c.state("r") == INCOMPLETE and c.counters["stale_part"] == 1


def test_a_failed_part_fails_closed_even_after_the_others_were_read() -> None:
    c, m = Coverage(), _map()
    c.expect("r", m)
    c.part_read("r", 1, m[1])
    [done] = c.part_failed("r", 0)
    assert not done.ok and done.reason == "part_failed" and done.read == m[1]


def test_duplicates_unknown_parts_and_caps_change_nothing_or_fail_closed() -> None:
    c, m = Coverage(max_requests=1), _map()
    c.expect("r", m)
    c.part_read("r", 0, m[0])
    assert c.part_read("r", 0, m[0]) == [] and c.counters["duplicate_part"] == 1
    assert c.part_read("r", 7, ()) == [] and c.counters["unknown_part"] == 1
    assert c.part_failed("r", 7) == [] and c.state("r") == "covering"
    [full] = c.expect("s", m)
    assert not full.ok and full.reason == "coverage_full"
    with pytest.raises(UsageError):
        c.expect("r", m)
    c.forget("r")
    c.forget("s")
    [nothing] = c.expect("t", {})
    assert not nothing.ok and nothing.reason == "no_regions"
    assert c.part_read("x", 0, ()) == [] and c.counters["unknown_request"] == 1
    with pytest.raises(UsageError):
        Coverage().expect("y", {0: {Region(1, 0, 0)}})


def test_every_table_row_is_reachable_and_keys_are_unique() -> None:
    assert len(C_TABLE) == len(C_TRANSITIONS)
    for row in C_TRANSITIONS:
        assert all(fx.partition(":")[0] in {"track", "record", "cancel", "finish", "count"}
                   for fx in row.effects), row


# -- fuzzing and the mutant ----------------------------------------------------------

def test_fuzzer_finds_nothing_in_the_real_machine() -> None:
    assert cfuzz.fuzz(2000) is None


@pytest.mark.parametrize("name", ["drop_region", "one_part"])
def test_fuzzer_catches_the_coverage_mutants(name: str) -> None:
    m = COVERAGE_MUTANTS[name]
    assert set(vars(m.coverage_cls)) - {"__module__", "__doc__", "__qualname__",
                                        "__annotations__", "__firstlineno__",
                                        "__static_attributes__"} == {"part_guard"}
    assert cfuzz.fuzz(2000, m.coverage_cls) in m.caught_by


@pytest.mark.tlc
def test_coverage_graph_equals_tla_and_the_mutant_does_not() -> None:
    from kvproto.verify.cconformance import compare

    assert compare().equal
    bad = compare(COVERAGE_MUTANTS["drop_region"].coverage_cls)
    assert bad.only_py and not bad.equal


@pytest.mark.tlc
def test_tlc_checks_coverage_and_catches_drop_region() -> None:
    from kvproto.verify.check import check_model
    from kvproto.verify.models import TLC_MODELS

    ok = check_model(TLC_MODELS["coverage"], workers=1)
    assert ok.as_expected and ok.result.result == "ok", ok.summary
    for name in ("bug_drop_region", "bug_one_part"):
        bug = check_model(TLC_MODELS[name], workers=1)
        assert bug.as_expected and bug.violated == "Coverage", (name, bug.summary)
