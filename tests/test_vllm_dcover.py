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
        ad, part, need = rr.plan(_admit("r", p_tp))
        assert part == (d if p_tp == d_tp else 0)
        assert ad.params.engine == f"p{part}"
        assert ad.params.expected == readers  # from the TP ratio, not a knob
        assert set(need) == {part} and need[part] == {Region(part, i, 0) for i in range(2)}
        assert rr.counters.get("orphan", 0) == (orphan if d == 0 else 0)


def test_split_heads_p_tp1_to_d_tp2_read_head_slices() -> None:
    """P TP 1 -> D TP 2 with 2 KV heads: D rank d reads head d of P's blocks (a slice),
    and both D ranks announce 2 readers; without slice support it is refused."""
    for d in (0, 1):
        rr = RankReads(d, 2, 2, {(0, 0), (1, 0)}, (2,), slices=True)
        ad, part, _ = rr.plan(_admit("r", 1, heads=2))
        assert part == 0 and ad.params.expected == 2
        assert rr.slice_of["p0"] == (2, d, 1)
    with pytest.raises(TopologyUnsupported):  # heads not outermost, or checksums on
        _reads(1, 2, heads=2).plan(_admit("r", None))


def test_plans_needing_several_p_ranks_and_bad_maps_are_refused() -> None:
    with pytest.raises(TopologyUnsupported):  # P TP 2 -> D TP 1, heads split on P
        RankReads(0, 1, 2, {(0, 0)}, (1,), slices=True).plan(_admit("r", 2, heads=2))
    with pytest.raises(ParamsError):  # P's KV heads differ from D's
        _reads(0, 2, heads=2).plan(_admit("r", 2, heads=1))


def _served(rr: RankReads, rid: str, ad: AdmitOrder, pulled: bool = True) -> bool:
    _, part, need = rr.plan(ad)
    assert rr.expect(rid, part, need)
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
    _, part, need = rr.plan(_admit("a", 1))
    assert rr.expect("a", part, need)
    _, part, need = rr.plan(_admit("b", 1))
    assert not rr.expect("b", part, need)
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
    _, part, need = rr.plan(_admit("r", None))
    assert len(need[part]) == 5 and rr.expect("r", part, need) and rr.finish("r", True)
    rr2 = RankReads(0, 1, 1, covered_layers([*groups[0], "b.0", "b.1"], groups), (2, 3))
    _, part, need = rr2.plan(_admit("r", None))
    assert rr2.expect("r", part, need) and not rr2.finish("r", True)  # b.2 never read
