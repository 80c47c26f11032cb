"""P TP 2 -> D TP 1 through real NIXL (in-process adapters) and D's worker join
(``kvproto.vllm.workers.DWorker``), as a real engine pair runs it.

* Split heads (2 KV heads, one per P rank): D's one rank reads both P ranks, one part
  per rank (its own claim, READ, stamp READ into the part's own stamp slots, done), P
  rank r's whole blocks landing in head r of D's blocks (local descriptor slices, vLLM's
  CPU layout (N, H, block size, 2 x head size)); served only once both parts were read
  and verified; each P rank frees on its own done.
* One part fenced (P rank 1 bumped its stamps): the whole request fails (never served,
  its blocks reported invalid) although the other part landed and verified; P rank 0
  frees as transferred, P rank 1 as released. The coverage mutant ``one_part`` serves
  it: caught.
* A replicated head (1 KV head): D reads P rank 0; P rank 1 (an orphan) is released
  once the request ended on D, and frees as ``released`` well before its lease.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("nixl")

import torch

from kvproto.lifecycle import TransferParams
from kvproto.lifecycle.coverage import Coverage
from kvproto.nixl.producer import ProducerAdapter
from kvproto.testing.mutants import COVERAGE_MUTANTS
from kvproto.vllm.dcover import RankReads
from kvproto.vllm.sched import AdmitOrder, ConnectorOptions, LoadOrder, Orders
from kvproto.vllm.workers import DWorker
from tests.test_nixl import CFG, uniq

pytestmark = pytest.mark.nixl

NB, BS, HS2, LAYERS = 16, 4, 8, 2  # blocks, tokens per block, 2 x head size, layers
BLOCKS, LOCAL = [2, 7, 9], (1, 4, 5)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="VRAM variant needs CUDA"))]


class Pair:
    """Two P ranks (ProducerAdapters, TP 2) and one D worker (TP 1)."""

    def __init__(self, device: str, kv_heads: int,
                 coverage: Coverage | None = None, slices: bool = True) -> None:
        ident = {"num_kv_heads": str(kv_heads), "weights": "test"}
        p_heads = max(kv_heads // 2, 1)
        self.p_kv = [[torch.randn(NB, p_heads, BS, HS2, device=device) for _ in range(LAYERS)]
                     for _ in range(2)]
        self.d_kv = [torch.zeros(NB, kv_heads, BS, HS2, device=device) for _ in range(LAYERS)]
        self.ps = [ProducerAdapter(uniq(f"P{r}"), CFG, num_blocks=NB, block_bytes=1,
                                   kv_tensors=self.p_kv[r], identity=ident, strict_pool=False,
                                   tp_rank=r, tp_size=2) for r in range(2)]
        self.dw = DWorker(ConnectorOptions(config=CFG), uniq("D"), self.d_kv, NB,
                          identity=ident)
        self.dw.reads = RankReads(0, 1, kv_heads, {(i, 0) for i in range(LAYERS)}, (LAYERS,),
                                  coverage=coverage, slices=slices)
        self.polled = [True, True]  # which P ranks pump() polls

    def admit(self, rid: str, kv_heads: int, load: bool = True) -> list[TransferParams]:
        params: list[TransferParams] = []
        for p in self.ps:
            tp = p.register(rid, BLOCKS, expected=1,
                            handle=params[0].handle if params else None)
            assert tp is not None
            params.append(tp)
        ranks: dict[str, Any] = {
            "p_tp": 2, "kv_heads": kv_heads, "layers": [LAYERS],
            "ranks": [{"engine": p.name, "epoch": tp.epoch, "host": p.host, "port": p.port,
                       "generations": list(tp.generations), "capability": tp.capability}
                      for p, tp in zip(self.ps, params, strict=True)]}
        self.dw.apply(Orders(admits=[AdmitOrder(rid, params[0], self.ps[0].host,
                                                self.ps[0].port, ranks)],
                             loads=[LoadOrder(rid, LOCAL)] if load else []))
        return params

    def pump(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for p, on in zip(self.ps, self.polled, strict=True):
                if on:
                    p.poll()
            self.dw.poll()
            if until():
                return
            time.sleep(0.0005)
        raise AssertionError(f"condition not reached in {timeout}s: "
                             f"{self.dw.counters()} {[p.ledger.frees for p in self.ps]}")

    def finish(self, rid: str) -> tuple[bool, set[int]]:
        """Pump until D reported ``rid``; (served, blocks reported invalid)."""
        got: set[str] = set()
        invalid: set[int] = set()
        failed: set[str] = set()

        def reported() -> bool:
            fr, inv, _ = self.dw.take()
            got.update(fr)
            invalid.update(inv)
            failed.update(self.dw.take_failed())
            return rid in got

        self.pump(reported)
        return rid not in failed, invalid

    def close(self) -> None:
        self.dw.close()
        for p in self.ps:
            p.close()


def frees(p: ProducerAdapter) -> dict[str, int]:
    """P's frees by reason (nonzero ones)."""
    return {k: n for k, n in p.ledger.frees.items() if n}


def _part_ended(pair: Pair, prid: str, rid: str) -> Callable[[], bool]:
    def ended() -> bool:
        j = pair.dw.joins.get(rid)
        return j is None or prid not in j.parts
    return ended


@pytest.mark.parametrize("device", DEVICES)
def test_split_heads_both_p_ranks_land_in_their_heads(device: str) -> None:
    pair = Pair(device, kv_heads=2)
    try:
        pair.admit("r1", 2)
        served, invalid = pair.finish("r1")
        assert served and not invalid, pair.dw.counters()
        pair.pump(lambda: all(p.pool.held_count == 0 for p in pair.ps))
        assert [frees(p) for p in pair.ps] == [{"transferred": 1}] * 2
        for layer in range(LAYERS):
            for pb, lb in zip(BLOCKS, LOCAL, strict=True):
                for r in (0, 1):  # P rank r's one head is D's head r
                    assert torch.equal(pair.d_kv[layer][lb, r], pair.p_kv[r][layer][pb, 0])
        c = pair.dw.counters()
        assert c["coverage_complete"] == 1 and c["reads_ok"] == 1 and c["fenced_reads"] == 0
        # each part's stamp READ landed in its own slot set: part 1's set exists
        assert set(pair.dw.adapter.transport.stamp_set.values()) == {1}
    finally:
        pair.close()


def _fence_second_part(device: str, coverage: Coverage | None) -> tuple[Pair, bool, set[int]]:
    """P rank 0's part is read first (P rank 1 not polled: its handshake waits); then P
    rank 1 bumps the request's stamps (as if it had freed and reused the blocks) and its
    part is read: fenced."""
    pair = Pair(device, kv_heads=2, coverage=coverage)
    pair.polled = [True, False]
    pair.admit("r1", 2)
    pair.pump(_part_ended(pair, "r1", "r1"))  # part 0 ("r1" itself) ended
    pair.ps[1].transport.bump(BLOCKS)
    pair.polled = [True, True]
    served, invalid = pair.finish("r1")
    return pair, served, invalid


@pytest.mark.parametrize("device", DEVICES)
def test_one_fenced_part_fails_the_whole_request(device: str) -> None:
    pair, served, invalid = _fence_second_part(device, None)
    try:
        assert not served and invalid == set(LOCAL), pair.dw.counters()
        c = pair.dw.counters()
        assert c["fenced_reads"] == 1 and c.get("coverage_complete", 0) == 0
        assert c["reads_failed"] == 1 and c["reads_ok"] == 0
        pair.pump(lambda: all(p.pool.held_count == 0 for p in pair.ps))
        assert frees(pair.ps[0]) == {"transferred": 1}  # its part did land
        assert frees(pair.ps[1]) == {"released": 1}  # fenced: D released it
    finally:
        pair.close()


def test_one_part_mutant_serves_a_fenced_part_and_is_caught() -> None:
    pair, served, _ = _fence_second_part("cpu", COVERAGE_MUTANTS["one_part"].coverage_cls())
    try:
        assert served  # the mutant served KV whose second half was fenced: caught
        assert pair.dw.counters()["fenced_reads"] == 1
    finally:
        pair.close()


@pytest.mark.parametrize("device", DEVICES)
def test_orphan_p_rank_is_released_once_the_request_ended(device: str) -> None:
    """One KV head replicated on both P ranks: D reads P rank 0 only; P rank 1's blocks
    are released (freed ``released``, never ``expired``) once the request ended on D."""
    pair = Pair(device, kv_heads=1)
    try:
        pair.admit("r1", 1)
        served, _ = pair.finish("r1")
        assert served
        pair.pump(lambda: all(p.pool.held_count == 0 for p in pair.ps), timeout=2.0)
        assert frees(pair.ps[0]) == {"transferred": 1}
        assert frees(pair.ps[1]) == {"released": 1}  # not expired
        assert pair.dw.counters()["orphan"] == 1
        for layer in range(LAYERS):
            for pb, lb in zip(BLOCKS, LOCAL, strict=True):
                assert torch.equal(pair.d_kv[layer][lb], pair.p_kv[0][layer][pb])
    finally:
        pair.close()



def test_refused_request_is_released_at_every_p_rank_it_names() -> None:
    """D cannot cut head slices (its KV layout or checksums forbid them): the split
    request is refused before any READ (``tp_refused``, reported ended so vLLM
    recomputes), and each P rank it would have read hears a release and frees as
    ``released``, not by lease expiry."""
    pair = Pair("cpu", kv_heads=2, slices=False)
    try:
        pair.admit("r1", 2, load=False)
        _, _, ended = pair.dw.take()
        assert ended == ["r1"]
        pair.pump(lambda: all(p.pool.held_count == 0 for p in pair.ps), timeout=2.0)
        assert [frees(p) for p in pair.ps] == [{"released": 1}] * 2
        c = pair.dw.counters()
        assert c["tp_refused"] == 1 and c["tp_refused_released"] == 2
        assert c["reads_ok"] == 0 and c["fenced_reads"] == 0
    finally:
        pair.close()
