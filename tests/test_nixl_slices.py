"""Head-slice READs through real NIXL (in-process adapters), as P TP 1 -> D TP 2 with
split KV heads needs them: P's KV tensors hold 2 heads per block in vLLM's CPU layout (N,
H, block size, 2 x head size), each D rank's hold 1; D rank d reads head d of every block
(one descriptor per segment and block, as for whole blocks), lands exactly those bytes,
and P's ledger frees the request as transferred only after both distinct readers are
done (their messages announce 2 readers, the TP ratio). A wrong slice lands the other
head's bytes and the test sees it."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("nixl")

import torch

from kvproto.lifecycle.topology import Topology
from kvproto.nixl.agent import RemoteRegion
from kvproto.nixl.consumer import Completion, ConsumerAdapter
from kvproto.nixl.producer import ProducerAdapter
from tests.test_nixl import CFG, pump, uniq

pytestmark = pytest.mark.nixl

NB, BS, HS2 = 16, 4, 8  # blocks, tokens per block, 2 x head size
IDENT = {"num_kv_heads": "2", "weights": "test"}


def test_head_slice_descriptors_cut_each_segment() -> None:
    r = RemoteRegion(1, 2, 0, "DRAM", NB, 512, ((1000, 4096, 256), (9000, 4096, 256)))
    s = r.head_slice(2, 1, 1)
    assert s.segments == ((1128, 4096, 128), (9128, 4096, 128)) and s.block_bytes == 256
    assert len(s.block_index([3, 5])) == len(r.block_index([3, 5]))  # same descriptor count
    for bad in ((2, 2, 1), (2, 0, 3), (3, 0, 1)):
        with pytest.raises(ValueError):
            r.head_slice(*bad)


def test_a_peer_region_is_read_without_coercion() -> None:
    from kvproto.wire import Layout

    lay = Layout(NB, 512, "f", 0, 1)
    good = {"kv_addr": 4096, "gen_addr": 8192, "dev_id": 0, "mem": "DRAM",
            "segments": [[4096, 1024, 256], [70000, 1024, 256]]}
    r = RemoteRegion.from_extra(good, lay)
    assert (r.kv_addr, r.gen_addr, r.mem, r.segments) == (
        4096, 8192, "DRAM", ((4096, 1024, 256), (70000, 1024, 256)))
    for change in ({"kv_addr": "4096"}, {"kv_addr": 4096.0}, {"gen_addr": True},
                   {"kv_addr": 1 << 64}, {"dev_id": -1}, {"mem": 0}, {"mem": "HBM"},
                   {"segments": [[4096.0, 1024, 256], [70000, 1024, 256]]},
                   {"segments": "4096"}, {"segments": [[4096, 1024]]}, {"kv_addr": None}):
        with pytest.raises(ValueError):
            RemoteRegion.from_extra({**good, **change}, lay)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="VRAM variant needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_p_tp1_to_d_tp2_reads_each_ranks_head_and_frees_after_both(device: str) -> None:
    top = Topology(1, 2, 2)
    assert [top.sources(d)[0].p_head for d in (0, 1)] == [0, 1] and top.readers(0) == 2
    p_kv = [torch.randn(NB, 2, BS, HS2, device=device) for _ in range(2)]  # two layers
    d_kv = [[torch.zeros(NB, 1, BS, HS2, device=device) for _ in range(2)] for _ in range(2)]
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=NB, block_bytes=1, kv_tensors=p_kv,
                        identity=IDENT, strict_pool=False)
    ds = [ConsumerAdapter(uniq(f"D{d}"), CFG, num_blocks=NB, block_bytes=1,
                          kv_tensors=d_kv[d], tp_rank=d, tp_size=2, identity=IDENT)
          for d in (0, 1)]
    try:
        blocks = [2, 7, 9]
        params = p.register("r1", blocks, expected=1)
        assert params is not None
        comps: list[Completion] = []
        for d, dd in enumerate(ds):
            src = top.sources(d)[0]
            dd.transport.slices[p.name] = (top.local_heads("P"), src.p_head, src.heads)
            dd.consumer_id = "D-engine"  # both ranks: one consumer for P's gate
            dd.add_engine(p.name, p.host, p.port)
        local = [(1, 4, 5), (10, 11, 3)]
        two = replace(params, expected=2)  # D's plan: readers(0) of Topology(1, 2, 2)
        ds[0].admit("r1", two)
        ds[0].schedule("r1", local[0])
        pump(p, [ds[0]], lambda: bool(comps), sink=comps)
        assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
        def first_done() -> bool:
            v = p.ledger.held(params.handle)
            return v is not None and len(v.finished) == 1

        pump(p, [ds[0]], first_done)
        held = p.ledger.held(params.handle)
        assert held is not None and held.expected == 2  # announced by D: the TP ratio
        assert p.pool.held_count == 3  # one reader of two: P still holds the blocks
        comps.clear()
        ds[1].admit("r1", two)
        ds[1].schedule("r1", local[1])
        pump(p, [ds[1]], lambda: bool(comps), sink=comps)
        assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
        pump(p, ds, lambda: p.pool.held_count == 0)
        assert p.ledger.frees.get("transferred") == 1
        for d in (0, 1):
            for layer in range(2):
                for pb, lb in zip(blocks, local[d], strict=True):
                    got, want = d_kv[d][layer][lb, 0], p_kv[layer][pb, d]
                    assert torch.equal(got, want), (d, layer, pb)
                    assert not torch.equal(got, p_kv[layer][pb, 1 - d])
    finally:
        for dd in ds:
            dd.close(timeout=1.0)
        p.close()
