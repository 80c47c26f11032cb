"""D's reading plan and coverage join per rank (``kvproto.vllm.dcover``), without
engines: which P rank a D rank reads, the expected reader count from the TP ratio, the
orphan count, and fail-closed completion: a verified READ that does not cover every
region of the request's map is not served. The coverage mutant ``drop_region`` serves
such a request, and the same check catches it."""

from __future__ import annotations

import pytest

from kvproto.lifecycle import TransferParams
from kvproto.lifecycle.coverage import Coverage, Region
from kvproto.testing.mutants import COVERAGE_MUTANTS
from kvproto.vllm.dcover import RankReads, covered_layers
from kvproto.vllm.sched import AdmitOrder, ParamsError
from kvproto.vllm.topology import RankMirrors, RankPeer, TopologyUnsupported, encode_ranks

BLOCKS = (3, 5)


def _params(expected: int = 1) -> TransferParams:
    return TransferParams(engine="p0", epoch=7, handle=4, blocks=BLOCKS, initial_term=3000,
                          expected=expected, generations=(0, 0))


def _admit(rid: str, p_tp: int | None, heads: int = 1, layers: int = 2) -> AdmitOrder:
    ranks = None
    if p_tp is not None:
        peers = {r: RankPeer(f"p{r}", 7 + r, "h", 4000 + r) for r in range(p_tp)}
        ranks = encode_ranks(peers, RankMirrors(8), BLOCKS, heads, [layers])
    return AdmitOrder(rid, _params(), "h", 4000, ranks)


def _reads(d_rank: int, d_tp: int, heads: int = 1, layers: int = 2,
           coverage: Coverage | None = None) -> RankReads:
    return RankReads(d_rank, d_tp, heads, {(i, 0) for i in range(layers)}, (layers,),
                     coverage=coverage)


def test_covered_layers_follow_group_layer_names() -> None:
    groups = [["m.0.attn", "m.1.attn", "m.2.attn"]]
    assert covered_layers(["m.0.attn", "m.2.attn"], groups) == {(0, 0), (2, 0)}
    assert covered_layers(["a", "b"], []) == {(0, 0), (1, 0)}


@pytest.mark.parametrize(("p_tp", "d_tp", "readers", "orphan"), [
    (1, 1, 1, 0), (2, 2, 1, 0), (1, 2, 2, 0), (2, 1, 1, 1)])
def test_plan_pairs_ranks_and_derives_readers_from_the_tp_ratio(
        p_tp: int, d_tp: int, readers: int, orphan: int) -> None:
    for d in range(d_tp):
        rr = _reads(d, d_tp)
        plan = rr.plan(_admit("r", p_tp))
        [pt] = plan.parts
        part, ad, need = pt.p_rank, pt.order, plan.need
        assert part == (d if p_tp == d_tp else 0)
        assert ad.params.engine == f"p{part}"
        assert [o.params.engine for o in plan.orphans] == (["p1"] if orphan and d == 0
                                                           else [])
        assert ad.params.expected == readers  # from the TP ratio, not a knob
        assert set(need) == {part} and need[part] == {Region(part, i, 0) for i in range(2)}
        assert rr.counters.get("orphan", 0) == (orphan if d == 0 else 0)


def test_split_heads_p_tp1_to_d_tp2_read_head_slices() -> None:
    """P TP 1 -> D TP 2 with 2 KV heads: D rank d reads head d of P's blocks (a slice),
    and both D ranks announce 2 readers; without slice support it is refused."""
    for d in (0, 1):
        rr = RankReads(d, 2, 2, {(0, 0), (1, 0)}, (2,), slices=True)
        [pt] = rr.plan(_admit("r", 1, heads=2)).parts
        assert pt.p_rank == 0 and pt.order.params.expected == 2
        assert rr.slice_of["p0"] == ((2, d, 1), None, 0)
    with pytest.raises(TopologyUnsupported):  # heads not outermost, or checksums on
        _reads(1, 2, heads=2).plan(_admit("r", None))


def test_split_heads_p_tp2_to_d_tp1_read_both_p_ranks_into_local_slices() -> None:
    """P TP 2 -> D TP 1 with 2 KV heads: D reads both P ranks (two parts, each with its
    own rank's params, expected 1, and its own stamp slot set), whole P blocks landing
    in head 0 and head 1 of D's block; the map has both parts. Without slice support
    the plan is refused."""
    rr = RankReads(0, 1, 2, {(0, 0)}, (1,), slices=True)
    plan = rr.plan(_admit("r", 2, heads=2, layers=1))
    assert [(pt.p_rank, pt.order.params.engine, pt.remote, pt.local, pt.stamps)
            for pt in plan.parts] == [(0, "p0", None, (2, 0, 1), 0),
                                      (1, "p1", None, (2, 1, 1), 1)]
    assert all(pt.order.params.expected == 1 for pt in plan.parts) and not plan.orphans
    assert set(plan.need) == {0, 1}
    assert rr.slice_of == {"p0": (None, (2, 0, 1), 0), "p1": (None, (2, 1, 1), 1)}
    with pytest.raises(TopologyUnsupported):  # heads not outermost, or checksums on
        RankReads(0, 1, 2, {(0, 0)}, (1,)).plan(_admit("r", 2, heads=2))
    with pytest.raises(ParamsError):  # P's KV heads differ from D's
        _reads(0, 2, heads=2).plan(_admit("r", 2, heads=1))


def _join(rr: RankReads, rid: str, outcomes: list[tuple[int, bool]]
          ) -> list[tuple[bool | None, tuple[int, ...]]]:
    plan = rr.plan(_admit(rid, 2, heads=2, layers=1))
    assert rr.expect(rid, plan.need)
    return [rr.finish_part(rid, p, ok) for p, ok in outcomes]


def test_split_request_is_complete_only_when_every_part_was_read() -> None:
    """The join: one part read is not enough (pending), both make it complete; a failed
    (fenced) part makes it incomplete whatever the order, and cancels the other part."""
    rr = RankReads(0, 1, 2, {(0, 0)}, (1,), slices=True)
    assert _join(rr, "a", [(0, True), (1, True)]) == [(None, ()), (True, ())]
    assert _join(rr, "b", [(0, True), (1, False)]) == [(None, ()), (False, ())]
    assert _join(rr, "c", [(1, False), (0, True)]) == [(False, (0,)), (False, ())]
    assert rr.counters["coverage_complete"] == 1 and len(rr) == 0


def test_one_part_mutant_completes_after_one_part_and_is_caught() -> None:
    """The coverage mutant ``one_part`` reports a split request complete once one part
    was read; the join check above fails it."""
    rr = RankReads(0, 1, 2, {(0, 0)}, (1,), slices=True,
                   coverage=COVERAGE_MUTANTS["one_part"].coverage_cls())
    assert _join(rr, "a", [(0, True), (1, False)])[0] == (True, ())  # served: caught


def _served(rr: RankReads, rid: str, ad: AdmitOrder, pulled: bool = True) -> bool:
    assert rr.expect(rid, rr.plan(ad).need)
    return rr.finish(rid, pulled)


def test_complete_only_when_every_region_was_read() -> None:
    rr = _reads(0, 2)
    assert _served(rr, "ok", _admit("ok", 2))
    assert not _served(rr, "failed", _admit("failed", 2), pulled=False)
    # P's map names 3 layers; this rank registered (and so READs) only 2: never served
    assert not _served(rr, "short", _admit("short", 2, layers=3))
    # a short part records nothing: the whole map of this rank is reported missing
    assert rr.counters["coverage_short"] == 1 and rr.counters["coverage_missing_regions"] == 3
    assert rr.counters["coverage_complete"] == 1
    assert len(rr) == 0 and len(rr.cov) == 0  # nothing kept once each request ended


def test_drop_region_mutant_serves_a_missing_region_and_is_caught() -> None:
    """The check that fails the mutant: a READ that misses one region of the map must
    not be reported complete."""
    def serves_missing(cov: Coverage) -> bool:
        rr = _reads(0, 1, coverage=cov)
        return _served(rr, "short", _admit("short", 1, layers=3))

    assert not serves_missing(Coverage())
    [mutant] = [m for m in COVERAGE_MUTANTS.values() if m.name == "drop_region"]
    assert serves_missing(mutant.coverage_cls())  # the mutant serves it: caught


def test_coverage_cap_fails_closed() -> None:
    rr = _reads(0, 1, coverage=Coverage(max_requests=1))
    assert rr.expect("a", rr.plan(_admit("a", 1)).need)
    assert not rr.expect("b", rr.plan(_admit("b", 1)).need)
    assert rr.counters["coverage_coverage_full"] == 1
    assert rr.finish("b", True) is False  # never tracked: not complete
    rr.drop("a")
    assert len(rr) == 0


def test_several_groups_at_tp1_take_the_map_from_d_own_groups() -> None:
    """P at TP 1 with several KV cache groups sends no map axes: D's own groups give
    them (the handshake's identity pins them equal to P's); every layer of every group
    that D registered is covered."""
    groups = [["a.0", "a.1"], ["b.0", "b.1", "b.2"]]
    rr = RankReads(0, 1, 1, covered_layers([*groups[0], *groups[1]], groups), (2, 3))
    need = rr.plan(_admit("r", None)).need
    assert len(need[0]) == 5 and rr.expect("r", need) and rr.finish("r", True)
    rr2 = RankReads(0, 1, 1, covered_layers([*groups[0], "b.0", "b.1"], groups), (2, 3))
    need = rr2.plan(_admit("r", None)).need
    assert rr2.expect("r", need) and not rr2.finish("r", True)  # b.2 never read


def test_refused_plans_name_the_p_ranks_to_release_and_bad_params_none() -> None:
    """A plan refused with valid params (no slices here) names every P rank this rank
    would have read, with the TP ratio's reader count; params that fail validation (P's
    KV heads differ) name none: a release must name a P rank D can trust."""
    rr = RankReads(0, 1, 2, {(0, 0)}, (1,))
    ad = _admit("r", 2, heads=2, layers=1)
    with pytest.raises(TopologyUnsupported):
        rr.plan(ad)
    assert [(o.params.engine, o.params.expected) for o in rr.refused_releases(ad)] == \
        [("p0", 1), ("p1", 1)]
    rr2 = RankReads(1, 2, 2, {(0, 0)}, (1,))  # P TP 1 -> D TP 2: rank 1 of 2 readers
    assert [(o.params.engine, o.params.expected)
            for o in rr2.refused_releases(_admit("r", None))] == [("p0", 2)]
    bad = _admit("r", 2, heads=1, layers=1)
    with pytest.raises(ParamsError):
        rr.plan(bad)
    assert rr.refused_releases(bad) == ()
