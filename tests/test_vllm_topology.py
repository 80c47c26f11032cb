"""The connector's tensor-parallel plumbing without engines: per-rank options, per-rank
stamp mirrors, the per-rank params P hands out and D validates (client input), and the
pairing each D rank pulls with (equal TP sizes pair rank r with rank r; a plan that needs
head slices is refused before any READ)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvproto.lifecycle import TransferParams
from kvproto.vllm.sched import AdmitOrder, ConnectorOptions, ParamsError, RemoteParams
from kvproto.vllm.topology import (
    RankMirrors,
    RankPeer,
    TopologyUnsupported,
    d_params,
    encode_ranks,
    for_tp_rank,
    parse_ranks,
    rank_admit,
)

BLOCKS = (3, 5, 7)


def _base() -> RemoteParams:
    tp = TransferParams(engine="p0", epoch=11, handle=9, blocks=BLOCKS, initial_term=3000,
                        expected=1, group=None, generations=(0, 0, 0))
    return RemoteParams(tp, "h", 4000, 96)


def _ranks(p_tp: int = 2, heads: int = 1) -> dict[str, object]:
    m = RankMirrors(8)
    m.on_stamps({1: {5: 4}, 0: {3: 2}})
    m.on_stamps({1: {5: 3}})  # never lowered
    peers = {r: RankPeer(f"p{r}", 10 + r, "h", 4000 + r) for r in range(p_tp)}
    return encode_ranks(peers, m, BLOCKS, heads, [2])


def test_each_p_rank_has_its_own_mirror_and_params() -> None:
    d = _ranks()
    rp = parse_ranks(d, _base())
    assert rp is not None and rp.p_tp == 2 and rp.kv_heads == 1 and rp.layers == (2,)
    assert [r.params.generations for r in rp.ranks] == [(2, 0, 0), (0, 4, 0)]
    assert [(r.params.engine, r.params.epoch, r.port) for r in rp.ranks] == \
        [("p0", 10, 4000), ("p1", 11, 4001)]
    assert all(r.params.handle == 9 and r.params.blocks == BLOCKS for r in rp.ranks)


def test_equal_tp_pairs_rank_r_with_rank_r() -> None:
    rp = parse_ranks(_ranks(), _base())
    assert d_params(_base(), rp, 0, 2, 1).params.engine == "p0"
    assert d_params(_base(), rp, 1, 2, 1).params.engine == "p1"
    ad = rank_admit(AdmitOrder("r", _base().params, "h", 4000, _ranks()), 1, 2, 1)
    assert ad.params.engine == "p1" and ad.port == 4001 and ad.params.generations == (0, 4, 0)
    # P at TP 1 and D at TP 1: the plain params, as before
    assert d_params(_base(), None, 0, 1, 1) == _base()


def test_head_slice_plans_are_refused_before_any_read() -> None:
    with pytest.raises(TopologyUnsupported):  # P TP 2 -> D TP 1, heads split on P
        d_params(_base(), parse_ranks(_ranks(heads=2), _base()), 0, 1, 2)
    with pytest.raises(TopologyUnsupported):  # P TP 1 -> D TP 2, heads split on D
        d_params(_base(), None, 0, 2, 2)
    with pytest.raises(ParamsError):  # another model's head count
        d_params(_base(), parse_ranks(_ranks(), _base()), 0, 2, 2)


def test_replicated_heads_pair_unequal_tp_sizes_whole_block() -> None:
    """One KV head: every rank of either engine holds it whole, so blocks pair one to
    one across TP sizes. P TP 2 -> D TP 1 reads P rank 0 (with the capability minted
    for rank 0's params); P TP 1 -> D TP 2: both D ranks read P's only rank."""
    cap = replace(_base().params, capability="ab", epoch=10)
    base = RemoteParams(cap, "h", 4000, 96)
    out = d_params(base, parse_ranks(_ranks(), base), 0, 1, 1)
    assert out.params.engine == "p0" and out.params.capability == "ab"
    assert out.params.generations == (2, 0, 0)
    for d in (0, 1):
        assert d_params(base, None, d, 2, 1) == base


def test_every_p_rank_mints_the_capability_of_its_own_gate() -> None:
    """One consumer per handle at every P rank: each rank's entry carries the capability
    of the handle under that rank's gate key (engine and epoch bound in), so D rank r
    claims at the P rank it reads and that rank binds the handle; a rank without a key
    (or a params without a handle) carries none."""
    from kvproto.lifecycle.gate import capability

    keys = [bytes([r + 1]) * 32 for r in range(2)]
    peers = {r: RankPeer(f"p{r}", 10 + r, "h", 4000 + r, keys[r]) for r in range(2)}
    d = encode_ranks(peers, RankMirrors(8), BLOCKS, 1, [2], handle=9)
    rp = parse_ranks(d, _base())
    assert rp is not None
    want = [capability(keys[r], f"p{r}", 10 + r, 9) for r in range(2)]
    assert [r.params.capability for r in rp.ranks] == want and want[0] != want[1]
    assert d_params(_base(), rp, 1, 2, 1).params.capability == want[1]
    assert all(e["capability"] == "" for e in encode_ranks(peers, RankMirrors(8), BLOCKS, 1,
                                                           [2])["ranks"])
    bad = {**d, "ranks": [{**d["ranks"][0], "capability": "XYZ"}, d["ranks"][1]]}
    with pytest.raises(ParamsError, match="capability"):
        parse_ranks(bad, _base())


@pytest.mark.parametrize("bad", [
    "x", {"p_tp": 2}, {**_ranks(), "p_tp": 3}, {**_ranks(), "kv_heads": 0},
    {**_ranks(), "layers": []}, {**_ranks(), "ranks": [{"engine": "p0"}, {}]},
    {**_ranks(), "ranks": [{"engine": "p0", "host": "h", "port": 1, "epoch": 1,
                            "generations": [1]}] * 2},
    {**_ranks(p_tp=2, heads=3)},
])
def test_bad_rank_params_are_a_clear_rejection(bad: object) -> None:
    with pytest.raises(ParamsError):
        parse_ranks(bad, _base())


def test_tp_rank_options_shift_ports_and_journals() -> None:
    o = ConnectorOptions.parse({"handshake_port": 5000, "journal": "/j/P.jsonl"}, "kv_both")
    assert for_tp_rank(o, 0, 2, 0) is o
    r1 = for_tp_rank(o, 1, 2, 0)
    assert r1.handshake_port == 5001 and r1.journal == "/j/P.tp1.jsonl"
    dp1 = for_tp_rank(o.for_dp_rank(1), 1, 2, 1)  # DP rank 1, TP rank 1 of 2: port + 3
    assert dp1.handshake_port == 5003
    with pytest.raises(ValueError, match="65535"):
        for_tp_rank(ConnectorOptions.parse({"handshake_port": 65535}, "kv_both"), 1, 2, 0)
