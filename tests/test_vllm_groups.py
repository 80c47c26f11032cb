"""KV cache groups (vLLM's hybrid allocator) and block sizes in the kvproto connector:
which groups are accepted (state-space refused at start-up with one line), how P's
per-group lists travel in the params, which of D's blocks a READ fills, the refusal of a
P with another block size (counted; recompute or fail, never served), and two groups
moved over real NIXL by the worker halves into the right positions.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from kvproto.vllm.groups import (
    HIT,
    NEW,
    NULL,
    GroupsError,
    describe,
    plan_load,
    split_p_blocks,
)
from kvproto.vllm.sched import (
    PARAMS_KEY,
    ConnectorOptions,
    DScheduler,
    LoadOrder,
    ParamsError,
    PeerInfo,
    PScheduler,
    parse_remote_params,
)

# --------------------------------------------------------------------------- groups.py


def _split(lists: tuple[list[int], ...]) -> tuple[list[int], list[list[int]]]:
    out = split_p_blocks(lists)
    assert not isinstance(out, str), out
    return out


def _plan(layout: list[list[int]], d: list[list[tuple[int, int]]]
          ) -> tuple[list[int], list[int]]:
    out = plan_load(layout, d)
    assert not isinstance(out, str), out
    return out


def test_split_p_blocks_drops_leading_nulls_per_group() -> None:
    flat, layout = _split(([0, 0, 7, 8], [3, 4, 5, 6]))
    assert flat == [7, 8, 3, 4, 5, 6]
    assert layout == [[2, 2], [0, 4]]
    assert split_p_blocks(([1, 2],)) == ([1, 2], [[0, 2]])


@pytest.mark.parametrize("lists, why", [
    (([5, 0, 6],), "null block after a real one"),
    (([5, 6], [6, 7]), "listed twice"),
    ((), "0 KV cache groups"),
])
def test_split_p_blocks_refuses_odd_lists(lists: tuple[list[int], ...], why: str) -> None:
    out = split_p_blocks(lists)
    assert isinstance(out, str) and why in out


def test_plan_load_reads_each_new_block_from_the_same_position() -> None:
    # P: sliding group kept positions 2..3 (blocks 7, 8), full group 0..3 (3, 4, 5, 6).
    layout = [[2, 2], [0, 4]]
    # D: a local hit of position 0 in the full group; the sliding group's first two
    # positions are null; D's list may run past P's (its own tokens).
    d = [[(0, NULL), (0, NULL), (20, NEW), (21, NEW)],
         [(30, HIT), (31, NEW), (32, NEW), (33, NEW), (34, NEW)]]
    local, index = _plan(layout, d)
    assert local == [20, 21, 31, 32, 33]
    # params blocks: [7, 8, 3, 4, 5, 6]
    assert [[7, 8, 3, 4, 5, 6][i] for i in index] == [7, 8, 4, 5, 6]


def test_plan_load_refuses_what_p_no_longer_holds() -> None:
    # D wants position 1 of the sliding group; P kept positions 2..3 only.
    out = plan_load([[2, 2], [0, 4]], [[(0, NULL), (9, NEW), (10, NEW), (11, NEW)],
                                       [(1, NEW), (2, NEW), (3, NEW), (4, NEW)]])
    assert isinstance(out, str) and "position 1" in out
    out = plan_load([[0, 4]], [[(1, NEW)], [(2, NEW)]])
    assert isinstance(out, str) and "1 KV cache groups, D 2" in out
    out = plan_load([[0, 4]], [[(1, NEW), (2, NEW)]])
    assert isinstance(out, str) and "covers 4" in out


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return types.SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec([f"layers.{i}.attn"], s) for i, s in enumerate(specs)])


def test_describe_accepts_attention_groups_and_refuses_state_space_in_one_line() -> None:
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    kw: dict[str, Any] = {"block_size": 32, "num_kv_heads": 2, "head_size": 16,
                          "dtype": torch.float32}
    full, sw = FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=64, **kw)
    got = describe(_config(sw, full))
    assert [(g.kind, g.block_size, g.window) for g in got] == [
        ("SlidingWindowSpec", 32, 64), ("FullAttentionSpec", 32, None)]
    mamba = MambaSpec(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(GroupsError) as e:
        describe(_config(full, mamba))
    assert "\n" not in str(e.value) and "MambaSpec" in str(e.value)
    assert describe(None) == []
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    host = types.SimpleNamespace(kv_cache_groups=[
        KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], sw, host_resident=True)])
    with pytest.raises(GroupsError, match="default groups only"):
        describe(host)


# --------------------------------------------------------------------------- params


def _params(blocks: list[int], **extra: Any) -> dict[str, Any]:
    d = {"engine": "P", "epoch": 1, "handle": 1, "blocks": blocks,
         "generations": [0] * len(blocks), "initial_term": 30000, "expected": 1,
         "group": None, "host": "127.0.0.1", "port": 5600, "num_tokens": 10, **extra}
    return {"do_remote_prefill": True, PARAMS_KEY: d}


def test_params_carry_groups_and_block_size() -> None:
    rp = parse_remote_params(_params([7, 8, 3, 4, 5], groups=[[1, 2], [0, 3]], block_size=4))
    assert rp.layout == ((1, 2), (0, 3)) and rp.block_size == 4
    assert rp.groups() == [[1, 2], [0, 3]]
    legacy = parse_remote_params(_params([1, 2, 3]))
    assert legacy.layout is None and legacy.block_size is None
    assert legacy.groups() == [[0, 3]]
    for bad in ([[0, 2]], [[0, 3, 1]], "x", [[0, -1], [0, 4]], [[True, 3]]):
        with pytest.raises(ParamsError):
            parse_remote_params(_params([1, 2, 3], groups=bad))
    with pytest.raises(ParamsError):
        parse_remote_params(_params([1, 2, 3], block_size=0))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_another_block_size_is_refused_counted_and_never_loaded(policy: str) -> None:
    ds = DScheduler(block_size=8, load_failure_policy=policy)
    ds.new_request("r", _params([1, 2, 3], block_size=4))
    assert ds.counters == {"rejected_block_size": 1}
    assert not ds.drain()  # no admit: no handshake, no READ
    if policy == "recompute":
        assert ds.matched_tokens("r", 10, 0) == (0, False)  # prefilled on D
        assert ds.state("r") is None
    else:  # an asynchronous load that fails at once: vLLM ends it with an error
        assert ds.matched_tokens("r", 10, 0) == (10, True)
        ds.allocated("r", [5, 6], local_prefix_blocks=0, num_external_tokens=10)
        assert ds.drain().loads == [LoadOrder("r", (5, 6), fail=True)]


def test_group_count_mismatch_is_refused() -> None:
    ds = DScheduler(block_size=4, group_block_sizes=[4, 4])
    ds.new_request("r", _params([1, 2, 3]))
    assert ds.counters == {"rejected_groups": 1}
    assert not ds.drain()


def test_two_groups_load_order_names_p_blocks_by_index() -> None:
    ds = DScheduler(block_size=4, group_block_sizes=[4, 4])
    # 10 tokens: 3 positions per group; the sliding group kept positions 1..2.
    ds.new_request("r", _params([7, 8, 3, 4, 5], groups=[[1, 2], [0, 3]], block_size=4))
    assert len(ds.drain().admits) == 1
    assert ds.matched_tokens("r", 10, 0) == (10, True)
    # D's prefix cache holds position 0 of the full group: P's blocks 0, 1, 3, 4.
    ds.allocated_groups("r", [[(0, NULL), (20, NEW), (21, NEW)],
                              [(30, HIT), (31, NEW), (32, NEW)]], 6)
    assert ds.drain().loads == [LoadOrder("r", (20, 21, 31, 32), remote=(0, 1, 3, 4))]
    # Every position new: all of P's blocks in order, named as a plain suffix.
    ds.new_request("t", _params([7, 8, 3, 4, 5], groups=[[1, 2], [0, 3]], block_size=4,
                                handle=3))
    assert ds.matched_tokens("t", 10, 0) == (10, True)
    ds.allocated_groups("t", [[(0, NULL), (40, NEW), (41, NEW)],
                              [(42, NEW), (43, NEW), (44, NEW)]], 10)
    assert ds.drain().loads == [LoadOrder("t", (40, 41, 42, 43, 44))]
    # P kept fewer positions than the prompt needs: refused as bad params.
    ds.new_request("s", _params([7, 3, 4, 5], groups=[[1, 1], [0, 3]], block_size=4,
                                handle=2))
    assert ds.matched_tokens("s", 10, 0) == (0, False)
    assert ds.counters["rejected_params"] == 1


def test_p_holds_every_groups_real_blocks_and_refuses_odd_lists() -> None:
    ps = PScheduler(ConnectorOptions.parse({}, "kv_both"), 16)
    ps.set_peer(PeerInfo("P", 1, "127.0.0.1", 5600))
    out = ps.finished_groups("r", ([0, 0, 9], [3, 4, 5]), 12, {"do_remote_decode": True}, 4)
    assert out is not None
    assert out[PARAMS_KEY]["blocks"] == [9, 3, 4, 5]
    assert out[PARAMS_KEY]["groups"] == [[2, 1], [0, 3]]
    assert out[PARAMS_KEY]["block_size"] == 4
    (reg,) = ps.drain()
    assert reg.blocks == (9, 3, 4, 5)  # the ledger holds (and stamps) all of them
    rp = parse_remote_params(out)
    assert rp.groups() == [[2, 1], [0, 3]] and rp.block_size == 4
    assert ps.finished_groups("s", ([9, 0, 10],), 12, {"do_remote_decode": True}, 4) is None
    assert ps.counters == {"bad_blocks": 1} and not ps.drain()


# --------------------------------------------------------------------------- over NIXL


def test_worker_halves_move_two_groups_into_their_positions() -> None:
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm")
    import torch
    from test_vllm_connector import NB, SHAPE, Pair

    pr = Pair()
    try:
        # vLLM's hybrid layout: each tensor is shared by one layer of each group; the
        # connector gets every layer's name, several naming one tensor.
        pr.ds = DScheduler(block_size=4, group_block_sizes=[4, 4])
        flat, layout = _split(([0, 9, 10], [3, 5, 7]))
        params = pr.ps.finished("g", flat, 12, {"do_remote_decode": True},
                                {"block_size": 4, "groups": layout}, ready=True)
        assert params is not None
        pr.ds.new_request("g", params)
        pr.step()
        assert pr.ds.matched_tokens("g", 12, 0) == (12, True)
        # D: a prefix hit at position 0 of the full group; sliding position 0 null.
        pr.ds.allocated_groups("g", [[(0, NULL), (12, NEW), (13, NEW)],
                                     [(1, HIT), (14, NEW), (15, NEW)]], 8)
        pr.pump(lambda: "g" in pr.recv and "g" in pr.sent)
        assert pr.invalid == set()
        for pk, dk in zip(pr.pk, pr.dk, strict=True):
            for p_b, d_b in ((9, 12), (10, 13), (5, 14), (7, 15)):
                assert torch.equal(dk[d_b], pk[p_b])
            assert not dk[1].any() and not dk[11].any()  # the hit and others untouched
        # The ledger held and stamped every group's real blocks, and freed them all.
        assert [pr.ps.mirror[b] for b in (9, 10, 3, 5, 7)] == [1] * 5
        assert pr.p.adapter.ledger.frees["transferred"] == 1
        assert pr.d.counters()["read_blocks"] == 4
        assert SHAPE[0] == NB
    finally:
        pr.close()
