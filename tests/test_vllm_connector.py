"""The kvproto vLLM connector's worker halves (``_PWorker``, ``_DWorker``) over real NIXL
agents, with KV tensors laid out like vLLM's (one tensor per layer, blocks first),
driven together with the scheduler halves as vLLM would (no engine): transfer, suffix
reads, fencing reported as load errors, bad orders, abort, stats, worker metadata and
Prometheus counters. Needs nixl and vLLM (the connector module imports vLLM).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvproto.vllm.sched import (
    ConnectorOptions,
    DScheduler,
    LoadOrder,
    Orders,
    PeerInfo,
    PScheduler,
)

pytest.importorskip("nixl._api")
pytest.importorskip("vllm")
from kvproto.vllm.connector import (
    KVProtoStats,
    KVProtoWorkerMetadata,
    _DWorker,
    _PWorker,
)

pytestmark = pytest.mark.nixl

LEASE = {"initial_lease": 3.0, "lease_extension": 2.0, "heartbeat_interval": 0.3,
         "abort_grace": 3.0, "max_delay": 0.2, "max_read_time": 1.0, "clock_drift": 0.1}
_ids = itertools.count()


def opts(**kw: Any) -> ConnectorOptions:
    return ConnectorOptions.parse({"lease": LEASE, **kw}, "kv_both")


NB = 16  # blocks
SHAPE = (NB, 2, 4, 8)  # like vLLM's CPU cache: (blocks, kv heads, block size, 2 * head dim)


def caches(n_layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(SHAPE, dtype=torch.float16) for _ in range(n_layers)]


class Pair:
    def __init__(self, p_layers: int = 2, d_layers: int = 2, metrics: Any = None,
                 **kw: Any) -> None:
        o = opts(**kw)
        n = next(_ids)
        self.pk, self.dk = caches(p_layers), caches(d_layers)
        for t in self.pk:
            t.normal_()
        self.p = _PWorker(o, f"P-{os.getpid()}-{n}", self.pk, NB, 0, metrics)
        self.d = _DWorker(o, f"D-{os.getpid()}-{n}", self.dk, NB, metrics)
        a = self.p.adapter
        self.peer = PeerInfo(a.name, a.epoch, a.host, a.port)
        self.ps = PScheduler(o, NB)
        self.ps.set_peer(self.peer)
        self.ds = DScheduler(block_size=4)
        self.sent: set[str] = set()
        self.recv: set[str] = set()
        self.invalid: set[int] = set()

    def step(self) -> None:
        """One engine step on both sides: orders down, outputs up."""
        orders = self.ds.drain()
        orders.registers = self.ps.drain()
        self.p.apply(orders)
        self.p.poll()
        self.d.apply(orders)
        self.d.poll()
        sent, stamps = self.p.take()
        self.ps.on_stamps(stamps)  # before the frees, as vLLM orders them
        self.ps.on_finished_sending(sent)
        self.sent |= sent
        recv, inv, ended = self.d.take()
        self.ds.on_failed(ended)
        self.recv |= recv
        self.invalid |= inv

    def pump(self, until: Callable[[], bool], timeout: float = 15.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            if until():
                return
            time.sleep(0.001)
        raise AssertionError(f"not reached in {timeout}s: sent {self.sent} recv {self.recv}")

    def prefill(self, rid: str, blocks: list[int], tokens: int) -> dict[str, Any]:
        out = self.ps.finished(rid, blocks, tokens, {"do_remote_decode": True})
        assert out is not None
        return out

    def close(self) -> None:
        self.d.close()
        self.p.close()


def test_worker_halves_pull_a_suffix_into_engine_blocks_and_free_on_done() -> None:
    pr = Pair()
    try:
        params = pr.prefill("r1", [3, 5, 7], 12)
        pr.ds.new_request("r1", params)
        pr.step()  # admit (heartbeats start, handshake) and register
        assert pr.p.adapter.check_invariants() == []  # holding, with vLLM's allocator
        assert pr.ds.matched_tokens("r1", 12, 4) == (8, True)  # one block is local already
        pr.ds.allocated("r1", [9, 2, 11], local_prefix_blocks=1, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        assert pr.invalid == set()
        for pk, dk in zip(pr.pk, pr.dk, strict=True):  # P's blocks 5, 7 landed in D's 9, 2
            assert torch.equal(dk[9], pk[5]) and torch.equal(dk[2], pk[7])
            assert not dk[11].any() and not dk[3].any()
        assert pr.p.adapter.ledger.frees["transferred"] == 1
        # The free bumped the stamps before "r1" was reported, and the mirror follows.
        assert [pr.ps.mirror[b] for b in (3, 5, 7)] == [1, 1, 1]
        assert pr.p.adapter.check_invariants() == []
        stats = pr.d.counters()
        assert stats["reads_ok"] == 1 and stats["fenced_reads"] == 0
    finally:
        pr.close()


def test_stale_read_is_fenced_and_reported_for_recompute() -> None:
    """D arrives after P's lease ran out and the blocks were freed: fail closed."""
    pr = Pair()
    try:
        params = pr.prefill("late", [4, 6], 8)
        pr.step()  # P registers
        pr.p.adapter.clock = lambda: time.monotonic() + 10.0  # the lease is long gone
        pr.p.poll()
        pr.step()
        assert "late" in pr.sent and pr.p.adapter.ledger.frees["expired"] == 1
        for t in pr.pk:  # vLLM reuses the blocks for another prompt
            t[4].fill_(7.0)
            t[6].fill_(7.0)
        pr.ds.new_request("late", params)
        pr.step()
        assert pr.ds.matched_tokens("late", 8, 0) == (8, True)
        pr.ds.allocated("late", [1, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "late" in pr.recv)
        assert pr.invalid == {1, 2}  # recomputed by vLLM, never served
        c = pr.d.counters()
        assert c["fenced_reads"] == 1 and c["recomputed_blocks"] == 2 and c["reads_ok"] == 0
        assert pr.p.counters()["frees_expired"] == 1
        assert pr.p.counters()["stranded_block_seconds"] > 0
    finally:
        pr.close()


def test_bad_orders_and_layout_mismatch_end_cleanly() -> None:
    pr = Pair(p_layers=2, d_layers=3)  # D's cache has another layout: the handshake fails
    try:
        params = pr.prefill("x", [1], 4)
        pr.ds.new_request("x", params)
        pr.pump(lambda: pr.ds.state("x") == "local")  # ended before a load: prefill locally
        assert pr.ds.matched_tokens("x", 4, 0) == (0, False)
        assert pr.d.counters()["handshake_failures"] == 1
        # A load order for a request the worker never admitted completes at once, failed.
        pr.d.apply(Orders(loads=[LoadOrder("ghost", (3,))]))
        recv, inv, _ = pr.d.take()
        assert (recv, inv) == ({"ghost"}, {3})
    finally:
        pr.close()


def test_client_abort_on_d_before_the_read_releases_to_p() -> None:
    pr = Pair(test_delay_load_s=30.0)  # the READ would start much later
    try:
        params = pr.prefill("ab", [2, 3], 8)
        pr.ds.new_request("ab", params)
        pr.step()
        pr.ds.matched_tokens("ab", 8, 0)
        pr.ds.allocated("ab", [5, 6], local_prefix_blocks=0, num_external_tokens=8)
        pr.step()
        pr.ds.finished("ab")  # the client aborts while vLLM waits for the load
        pr.pump(lambda: "ab" in pr.recv and "ab" in pr.sent)
        assert pr.p.adapter.ledger.frees["released"] == 1
        assert pr.p.adapter.check_invariants() == []
    finally:
        pr.close()


def test_worker_metadata_and_stats_aggregate() -> None:
    a = KVProtoWorkerMetadata({1: 2, 3: 1}, ["x"])
    b = KVProtoWorkerMetadata({1: 1, 4: 5}, ["y"])
    m = a.aggregate(b)
    assert isinstance(m, KVProtoWorkerMetadata)
    assert (m.stamps, m.ended) == ({1: 2, 3: 1, 4: 5}, ["x", "y"])
    s = KVProtoStats(data={"fenced_reads": 1, "frees_expired": 2}).aggregate(
        KVProtoStats(data={"fenced_reads": 2}))
    assert s.reduce() == {"fenced_reads": 3, "frees_expired": 2} and not s.is_empty()


def test_prometheus_counters_by_reason() -> None:
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    from kvproto.vllm.connector import KVProtoConnector

    prom = KVProtoConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), {Gauge: Gauge, Counter: Counter,
                                                   Histogram: Histogram},
        ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom is not None
    prom.observe({"frees_expired": 2, "frees_transferred": 5, "fenced_reads": 1,
                  "stranded_block_seconds": 1.5, "recomputed_blocks": 3,
                  "handshake_failures": 1, "rejected_bad_params": 4}, 0)
    prom.observe({"frees_expired": 1}, 0)

    def v(name: str, **labels: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})

    assert v("kvproto:frees_total", reason="expired") == 3
    assert v("kvproto:frees_total", reason="transferred") == 5
    assert v("kvproto:fenced_reads_total") == 1
    assert v("kvproto:stranded_block_seconds_total") == 1.5
    assert v("kvproto:recomputed_blocks_total") == 3
    assert v("kvproto:handshake_failures_total") == 1
    assert v("kvproto:rejected_total", reason="bad_params") == 4


def test_shared_kvproto_metrics_registry() -> None:
    """With ``metrics_port`` the worker halves feed kvproto.metrics (one registry, P and
    D): a fenced read and an expiry show up there."""
    from prometheus_client import generate_latest

    from kvproto.metrics import Metrics, scrape_values

    m = Metrics(labels={"engine": "e1"})
    pr = Pair(metrics=m)
    try:
        params = pr.prefill("late", [4, 6], 8)
        pr.step()
        pr.p.adapter.clock = lambda: time.monotonic() + 10.0
        pr.step()
        pr.ds.new_request("late", params)
        pr.step()
        pr.ds.matched_tokens("late", 8, 0)
        pr.ds.allocated("late", [1, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "late" in pr.recv)
        vals = scrape_values(generate_latest(m.registry).decode())

        def v(name: str, **labels: str) -> float:
            key = (name, tuple(sorted({"engine": "e1", **labels}.items())))
            return vals.get(key, 0.0)

        assert v("kvproto_fenced_reads_total") == 1
        assert v("kvproto_frees_total", reason="expired") == 1
    finally:
        pr.close()


def _connector_over(dw: _DWorker) -> Any:
    """A KVProtoConnector whose worker side is ``dw`` (D only), without a vLLM config:
    enough for the worker hooks that report to vLLM."""
    from kvproto.vllm.connector import KVProtoConnector

    c = object.__new__(KVProtoConnector)
    c.pw, c.dw = None, dw
    c._stamps, c._invalid, c._failed, c._ended = {}, set(), set(), []
    return c


def test_rejected_register_bumps_stamps_so_its_params_never_match() -> None:
    """P's ledger rejects a register after the scheduler already handed D the params:
    vLLM frees and reuses the blocks, and D's READ with those params must be fenced
    (the rejected register bumped the stamps, and the mirror learned them)."""
    from dataclasses import replace

    pr = Pair()
    try:
        params = pr.prefill("rj", [4, 6], 8)
        (order,) = pr.ps._orders
        pr.ps._orders = [replace(order, expected=0x10000)]  # out of range: rejected
        pr.step()
        assert "rj" in pr.sent, "a rejected register returns the blocks to vLLM"
        assert pr.p.adapter.counters.get("register_rejected") == 1
        assert [pr.ps.mirror[b] for b in (4, 6)] == [1, 1]  # bumped, and reported
        for t in pr.pk:  # vLLM reuses the blocks for another prompt
            t[4].fill_(7.0)
            t[6].fill_(7.0)
        pr.ds.new_request("rj", params)
        pr.step()
        assert pr.ds.matched_tokens("rj", 8, 0) == (8, True)
        pr.ds.allocated("rj", [1, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "rj" in pr.recv)
        assert pr.invalid == {1, 2}, "D served blocks that P had already reused"
        assert pr.d.counters()["reads_ok"] == 0
        # Params minted after the bump snapshot the new stamps and pull normally.
        params2 = pr.prefill("ok", [4, 6], 8)
        pr.ds.new_request("ok", params2)
        pr.step()
        pr.ds.matched_tokens("ok", 8, 0)
        pr.ds.allocated("ok", [3, 5], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "ok" in pr.recv and "ok" in pr.sent)
        assert pr.invalid == {1, 2} and torch.equal(pr.dk[0][3], pr.pk[0][4])
    finally:
        pr.close()


def test_load_with_no_local_blocks_is_reported_failed() -> None:
    """vLLM parked a request for a load, but no block the READ could land in was
    allocated: the load must be reported failed (failed_recving), so that vLLM never
    computes on blocks nothing was written to."""
    pr = Pair()
    try:
        params = pr.prefill("nb", [1, 2], 8)
        pr.ds.new_request("nb", params)
        pr.step()
        assert pr.ds.matched_tokens("nb", 8, 0) == (8, True)
        pr.ds.allocated("nb", [], local_prefix_blocks=0, num_external_tokens=8)
        orders = pr.ds.drain()
        assert [ld.local_blocks for ld in orders.loads] == [()]
        pr.d.apply(orders)
        c = _connector_over(pr.d)
        res = c.get_transfer_results(set())
        assert res.finished_recving == {"nb"} and res.failed_recving == {"nb"}
        assert c.get_block_ids_with_load_errors() == set()  # nothing to name by block
        # An ordinary fenced load is reported by request as well as by block.
        pr.d.apply(Orders(loads=[LoadOrder("ghost", (3,))]))
        res = c.get_transfer_results(set())
        assert (res.finished_recving, res.failed_recving) == ({"ghost"}, {"ghost"})
        assert c.get_block_ids_with_load_errors() == {3}
    finally:
        pr.close()


def test_duplicate_detection_keys_on_the_epoch() -> None:
    """Handles restart at 1 when P restarts (new epoch): the same (engine, handle) under
    another epoch is another transfer and is admitted; the same triple twice (n>1
    children sharing params) is pulled once."""
    import copy

    pr = Pair()
    try:
        params = pr.prefill("a", [1], 4)
        restarted = copy.deepcopy(params)
        restarted["kvproto"]["epoch"] = params["kvproto"]["epoch"] + 1
        pr.ds.new_request("a", params)
        pr.ds.new_request("b", restarted)
        pr.ds.new_request("c", copy.deepcopy(params))
        pr.d.apply(pr.ds.drain())
        assert set(pr.d.admitted) == {"a", "b"}
        assert list(pr.d.ended) == ["c"]
    finally:
        pr.close()
