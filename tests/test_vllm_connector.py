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
)
from kvproto.vllm.workers import DWorker as _DWorker
from kvproto.vllm.workers import PWorker as _PWorker

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
        self.peer = PeerInfo(a.name, a.epoch, a.host, a.port, a.gate.key)
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

    def prefill(self, rid: str, blocks: list[int], tokens: int, *,
                ready: bool = True) -> dict[str, Any]:
        out = self.ps.finished(rid, blocks, tokens, {"do_remote_decode": True}, ready=ready)
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
        assert pr.p.counters()["held_tokens"] == 12  # the prompt's tokens, held for D
        assert pr.ds.matched_tokens("r1", 12, 4) == (8, True)  # one block is local already
        pr.ds.allocated("r1", [9, 2, 11], local_prefix_blocks=1, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        assert pr.invalid == set()
        for pk, dk in zip(pr.pk, pr.dk, strict=True):  # P's blocks 5, 7 landed in D's 9, 2
            assert torch.equal(dk[9], pk[5]) and torch.equal(dk[2], pk[7])
            assert not dk[11].any() and not dk[3].any()
        assert pr.p.adapter.ledger.frees["transferred"] == 1
        assert pr.p.counters()["held_tokens"] == 0
        # The free bumped the stamps before "r1" was reported, and the mirror follows.
        assert [pr.ps.mirror[b] for b in (3, 5, 7)] == [1, 1, 1]
        assert pr.p.adapter.check_invariants() == []
        stats = pr.d.counters()
        assert stats["reads_ok"] == 1 and stats["fenced_reads"] == 0
    finally:
        pr.close()


def test_a_claim_before_the_register_is_granted_at_the_register() -> None:
    """D can hold P's params before P's worker registers them (the scheduler hands them
    out when the request finishes; the worker registers at its next step), and P answers
    claims between steps (its poller). A claim that arrives first is bound but answered
    only at the register: D does not read before it, so the READ finds the checksums
    the register seals (with checksums on), verifies, and is served."""
    pr = Pair(checksums=True)
    try:
        params = pr.prefill("r1", [3, 5], 8)
        pr.ds.new_request("r1", params)
        admits = pr.ds.drain()
        regs = pr.ps.drain()
        pr.d.apply(admits)  # D admits and claims; P's worker has not registered yet
        end = time.monotonic() + 1.0  # well within the lease: D does not give up
        while time.monotonic() < end:  # P answers between steps, the register to come
            pr.p.poll()
            pr.d.poll()
            time.sleep(0.002)
        # D got no grant: it is still claiming, its claim bound and waiting on P
        assert pr.d.adapter.machine.state(pr.d._parts("r1")[0]) == "claiming"
        # its claim, and each repeat of it (the claim rides D's heartbeats), waited
        assert pr.p.adapter.gate.counters.get("claim_before_register", 0) >= 1
        o = Orders()
        o.registers = regs
        pr.p.apply(o)  # the register: seals the checksums, and grants the claim
        pr.pump(lambda: pr.d.adapter.machine.state(pr.d._parts("r1")[0]) == "waiting")
        assert pr.ds.matched_tokens("r1", 8, 0) == (8, True)
        pr.ds.allocated("r1", [9, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        st = pr.d.counters()
        assert pr.invalid == set() and st["reads_ok"] == 1, st
        assert st["checksum_failures"] == 0 and st["checksum_verified_blocks"] == 2, st
        assert pr.p.adapter.ledger.frees["transferred"] == 1
    finally:
        pr.close()


def _waiting(pr: Pair) -> tuple[Any, int, int]:
    """Request "r1" (two blocks, 8 tokens) prefilled on P and admitted on D until D waits
    to read it: P's ledger, the request's handle and its deadline there."""
    params = pr.prefill("r1", [3, 5], 8)
    pr.ds.new_request("r1", params)
    pr.pump(lambda: pr.d.adapter.machine.state(pr.d._parts("r1")[0]) == "waiting")
    led = pr.p.adapter.ledger
    with pr.p.lock:
        (h,) = led.snapshot()
        return led, h, led.snapshot()[h][4]


@pytest.mark.parametrize("gap_ms", [50.0, 0.0], ids=["poller", "engine_thread_only"])
def test_p_poller_answers_heartbeats_while_the_engine_thread_is_away(gap_ms: float) -> None:
    """P's engine thread stops calling the worker (a long forward pass, a starved engine
    loop) while D keeps stepping with a request it has not read yet. With the poller
    (``poll_gap_ms`` 50), P still answers D's heartbeats: the lease is renewed on both
    sides past D's give-up point, and once P's engine thread is back, D pulls the request
    and P frees it as transferred. With only the engine thread polling
    (``poll_gap_ms`` 0), nothing answers: D gives the request up (``lease_lost``)."""
    pr = Pair(poll_gap_ms=gap_ms)
    try:
        led, h, first = _waiting(pr)
        # D alone steps, past the point where an unrenewed lease can no longer cover a
        # READ: initial term - max_delay - (max_read_time + clock_drift) = 1.7 s
        away_s = 2 * (LEASE["initial_lease"] - LEASE["max_delay"])
        away = time.monotonic() + away_s
        ended: list[str] = []
        while time.monotonic() < away:
            pr.d.apply(Orders())
            pr.d.poll()
            ended += pr.d.take()[2]
            time.sleep(0.005)
        with pr.p.lock:
            renewed = h in led.snapshot() and led.snapshot()[h][4] > first
            polls = pr.p.poller_polls
        if gap_ms == 0:
            assert ended == ["r1"] and not renewed and polls == 0, (ended, renewed)
            # P's engine thread, back, finds its adapter unpolled since before the
            # absence, with a request held: one stall over max_delay, as long as the
            # absence, counted and exported.
            pr.p.poll()
            c = pr.p.counters()
            assert c["poll_stalls"] == 1 and c["poll_stall_s"] >= away_s, (c, away_s)
            return
        assert ended == [] and renewed and polls > 0, (ended, renewed, polls)
        assert pr.ds.matched_tokens("r1", 8, 0) == (8, True)
        pr.ds.allocated("r1", [9, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        assert pr.invalid == set() and led.frees["transferred"] == 1
        assert pr.p.check_invariants() == []
    finally:
        pr.close()


@pytest.mark.parametrize("gap_ms", [50.0, 0.0], ids=["poller", "engine_thread_only"])
def test_d_poller_heartbeats_while_the_engine_thread_is_away(gap_ms: float) -> None:
    """D's engine thread stops calling the worker (a long forward pass, a starved engine
    loop) while it waits to read a request and P keeps stepping. With the poller
    (``poll_gap_ms`` 50), D still heartbeats: P's lease is renewed, and once D's engine
    thread is back it loads the request and P frees it as transferred. With only the
    engine thread polling (``poll_gap_ms`` 0), P hears nothing and expires the lease, and
    D, back, gives the request up (``lease_lost``): it is recomputed."""
    pr = Pair(poll_gap_ms=gap_ms)
    try:
        led, h, first = _waiting(pr)
        # P alone steps, past the initial lease D would have to renew
        away_s = 2 * (LEASE["initial_lease"] - LEASE["max_delay"])
        away = time.monotonic() + away_s
        while time.monotonic() < away:
            pr.p.apply(Orders())
            pr.p.poll()
            sent, stamps = pr.p.take()
            pr.ps.on_stamps(stamps)
            pr.ps.on_finished_sending(sent)
            pr.sent |= sent
            time.sleep(0.005)
        with pr.p.lock:
            renewed = h in led.snapshot() and led.snapshot()[h][4] > first
            expired = led.frees.get("expired", 0)
        polls = pr.d.counters()["poller_polls"]
        if gap_ms == 0:
            assert not renewed and expired == 1 and polls == 0, (renewed, expired, polls)
            ended: list[str] = []
            end = time.monotonic() + 10.0
            while "r1" not in ended and time.monotonic() < end:
                pr.d.apply(Orders())
                pr.d.poll()
                ended += pr.d.take()[2]
                time.sleep(0.005)
            assert ended == ["r1"], ended
            # D's first poll back closed a gap as long as the absence, with r1 waiting.
            c = pr.d.counters()
            assert c["poll_stalls"] == 1 and c["poll_stall_s"] >= away_s, (c, away_s)
            return
        assert renewed and expired == 0 and polls > 0, (renewed, expired, polls)
        assert "r1" not in pr.sent
        assert pr.ds.matched_tokens("r1", 8, 0) == (8, True)
        pr.ds.allocated("r1", [9, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        assert pr.invalid == set() and led.frees["transferred"] == 1
        assert pr.p.check_invariants() == []
    finally:
        pr.close()


def test_p_poller_survives_a_failing_poll_and_counts_it(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A poll that raises inside the poller is counted (``poller_errors``) and logged,
    never kills the thread: once the fault is gone the poller polls again, and the
    engine thread's own steps still move a request through."""
    pr = Pair(poll_gap_ms=5.0)
    try:
        real = pr.p.adapter.poll
        calls = {"n": 0}

        def broken() -> int:
            calls["n"] += 1
            raise RuntimeError("injected poll failure")

        with pr.p.lock:
            monkeypatch.setattr(pr.p.adapter, "poll", broken)
        end = time.monotonic() + 15.0
        while pr.p.counters()["poller_errors"] < 3 and time.monotonic() < end:
            time.sleep(0.01)
        with pr.p.lock:
            monkeypatch.setattr(pr.p.adapter, "poll", real)
            errors, polls = pr.p.poller_errors, pr.p.poller_polls
        assert errors >= 3 and calls["n"] == errors, (errors, calls)
        assert pr.p._poller is not None and pr.p._poller.is_alive()
        while pr.p.counters()["poller_polls"] <= polls and time.monotonic() < end:
            time.sleep(0.01)
        assert pr.p.counters()["poller_polls"] > polls, "the poller stopped polling"
        assert pr.p.counters()["poller_errors"] == errors
        params = pr.prefill("r1", [3, 5], 8)
        pr.ds.new_request("r1", params)
        pr.step()
        assert pr.ds.matched_tokens("r1", 8, 0) == (8, True)
        pr.ds.allocated("r1", [9, 2], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "r1" in pr.recv and "r1" in pr.sent)
        assert pr.p.adapter.ledger.frees["transferred"] == 1
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
        pr.pump(lambda: pr.ds.state("x") == "failed")  # ended before a load: prefill locally
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
        # The blocks are named (nothing computes on them), but a client abort is no
        # failed read and nothing is recomputed.
        assert pr.invalid == {5, 6}
        c = pr.d.counters()
        assert c["reads_failed"] == 0 and c["recomputed_blocks"] == 0
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
                  "handshake_failures": 1, "rejected_bad_params": 4, "poll_stalls": 2,
                  "poll_stall_s": 3.5}, 0)
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
    assert v("kvproto:poll_stalls_total") == 2
    assert v("kvproto:poll_stall_seconds_total") == 3.5


def test_shared_kvproto_metrics_registry() -> None:
    """With ``metrics_port`` the worker halves feed kvproto.metrics (one registry, P and
    D): a fenced read, an expiry and a stall between P's polls show up there."""
    from prometheus_client import generate_latest

    from kvproto.metrics import Metrics, scrape_values

    m = Metrics(labels={"engine": "e1"})
    pr = Pair(metrics=m)
    try:
        params = pr.prefill("late", [4, 6], 8)
        pr.step()
        # P holds "late"; a long call under P's lock keeps both its threads from polling
        with pr.p.lock:
            time.sleep(0.5)
        pr.p.poll()
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
        # at least that one (an overloaded host may add its own)
        assert v("kvproto_poll_stalls_total") >= 1
        assert v("kvproto_poll_stall_seconds_total") >= 0.5
    finally:
        pr.close()


def _connector_over(dw: _DWorker) -> Any:
    """A KVProtoConnector whose worker side is ``dw`` (D only), without a vLLM config:
    enough for the worker hooks that report to vLLM."""
    from kvproto.vllm.connector import KVProtoConnector

    c = object.__new__(KVProtoConnector)
    c.pw, c.dw = None, dw
    c._stamps, c._invalid, c._failed, c._ended = {}, set(), set(), []
    c.groups = []
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
        # Several KV cache groups: vLLM stops the engine on block-level load errors, so
        # a failed load is reported by request only.
        from kvproto.vllm.groups import GroupInfo

        c.groups = [GroupInfo("SlidingWindowSpec", 4, 8, 1), GroupInfo("FullAttentionSpec",
                                                                        4, None, 1)]
        pr.d.apply(Orders(loads=[LoadOrder("ghost2", (4,))]))
        res = c.get_transfer_results(set())
        assert (res.finished_recving, res.failed_recving) == ({"ghost2"}, {"ghost2"})
        assert c.get_block_ids_with_load_errors() == set()
    finally:
        pr.close()


def test_duplicate_detection_keys_on_the_epoch() -> None:
    """Handles restart at 1 when P restarts (new epoch): the same (engine, handle) under
    another epoch is another transfer and is admitted; the same triple twice (n>1
    children sharing params) is pulled once: the scheduler sends the second one to a
    local prefill, so the worker never admits it."""
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
        assert pr.ds.counters.get("shared_handle") == 1
    finally:
        pr.close()


def _step_d(pr: Pair) -> None:
    """One step of D's engine only (P's engine thread is busy elsewhere)."""
    orders = pr.ds.drain()
    pr.d.apply(orders)
    pr.d.poll()
    recv, inv, ended = pr.d.take()
    pr.ds.on_failed(ended)
    pr.recv |= recv
    pr.invalid |= inv


def test_handshake_answered_while_p_engine_thread_is_blocked() -> None:
    """P's listener answers from its own thread: D's handshake completes while P's
    engine thread runs no step at all (a long forward pass); the handshake takes effect
    on P at its next step, and the transfer then goes through. P's poller is off: it
    would apply the handshake between engine steps (that is its job), and this test is
    about the listener alone."""
    from kvproto.lifecycle import PEER_READY

    pr = Pair(handshake_timeout=0.5, handshake_attempts=2, poll_gap_ms=0.0)
    try:
        params = pr.prefill("hs", [2, 3], 8)
        pr.p.apply(Orders(registers=pr.ps.drain()))  # P's last step before it blocks
        pr.ds.new_request("hs", params)
        end = time.monotonic() + 15.0
        engine = pr.p.adapter.name
        while time.monotonic() < end:
            _step_d(pr)
            e = pr.d.adapter.engines.get(engine)
            if e is not None and e.state == PEER_READY:
                break
            time.sleep(0.001)
        e = pr.d.adapter.engines[engine]
        assert e.state == PEER_READY, pr.d.adapter.counters
        assert pr.d.counters()["handshake_failures"] == 0
        assert pr.p.adapter.peers == {}  # nothing changed on P's state off its thread
        pr.step()  # P's engine thread steps again: the handshake takes effect
        assert set(pr.p.adapter.peers) == {pr.d.adapter.name}
        assert pr.p.adapter.counters.get("handshakes") == 1
        assert pr.ds.matched_tokens("hs", 8, 0) == (8, True)
        pr.ds.allocated("hs", [6, 7], local_prefix_blocks=0, num_external_tokens=8)
        pr.pump(lambda: "hs" in pr.recv and "hs" in pr.sent)
        assert pr.invalid == set() and pr.p.adapter.ledger.frees["transferred"] == 1
    finally:
        pr.close()


def test_release_decided_before_the_handshake_reaches_p() -> None:
    """A client abort while the request is queued and params D refuses (a prompt that
    P's blocks do not match), both decided before D's handshake with P completed: the
    releases wait for the handshake and P frees both requests as released, not by
    lease expiry. Under kv_load_failure_policy "fail" the refused request's load fails
    at once (its blocks as load errors, the request as a failed receive)."""
    import threading

    pr = Pair()
    pr.ds = DScheduler(block_size=4, load_failure_policy="fail")
    server = pr.p.adapter.server
    answer = server.handler
    gate = threading.Event()

    def slow(conn: int, payload: bytes, authed: bool) -> tuple[bytes, str]:
        gate.wait(10.0)  # P's answer is late: D's handshake cannot complete before
        return answer(conn, payload, authed)

    server.handler = slow
    try:
        pa = pr.prefill("ab", [2, 3], 8)
        pm = pr.prefill("mm", [4, 5], 8)
        pr.p.apply(Orders(registers=pr.ps.drain()))
        pr.ds.new_request("ab", pa)
        pr.ds.new_request("mm", pm)
        pr.ds.finished("ab")  # the client aborts while "ab" is queued
        assert pr.ds.matched_tokens("mm", 9, 0) == (9, True)  # 9 tokens: not P's 8
        pr.ds.allocated("mm", [8, 9, 10], local_prefix_blocks=0, num_external_tokens=9)
        for _ in range(3):  # admits, the abort and the refusal, during the handshake
            _step_d(pr)
        assert pr.d.adapter.engines[pr.p.adapter.name].state == "handshaking"
        assert pr.recv == {"mm"} and pr.invalid == {8, 9, 10}
        assert pr.d.take_failed() == {"mm"}
        gate.set()
        pr.pump(lambda: {"ab", "mm"} <= pr.sent)
        frees = pr.p.adapter.ledger.frees
        assert frees.get("released") == 2 and not frees.get("expired"), frees
        assert pr.p.adapter.check_invariants() == []
    finally:
        gate.set()
        pr.close()


def test_fail_policy_fails_a_request_ended_before_its_load() -> None:
    """kv_load_failure_policy "fail": the handshake fails (D's cache has another layout),
    so the request ends before any load; it is then failed through vLLM's load-failure
    path (a failed receive and its blocks as load errors), never prefilled locally."""
    pr = Pair(p_layers=2, d_layers=3)
    pr.ds = DScheduler(block_size=4, load_failure_policy="fail")
    try:
        params = pr.prefill("x", [1], 4)
        pr.ds.new_request("x", params)
        pr.pump(lambda: pr.ds.state("x") == "failed")
        assert pr.d.counters()["handshake_failures"] == 1
        assert pr.ds.matched_tokens("x", 4, 0) == (4, True)
        pr.ds.allocated("x", [6], local_prefix_blocks=0, num_external_tokens=4)
        pr.step()
        assert pr.recv == {"x"} and pr.invalid == {6}
        assert pr.d.take_failed() == {"x"}
        assert pr.d.counters()["reads_ok"] == 0
    finally:
        pr.close()


def _two_free_ports() -> int:
    """A port p such that p and p + 1 are free now."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = int(a.getsockname()[1])
            if p >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
                return p
    raise AssertionError("no two consecutive free ports")


def _vllm_config(dp_rank: int, extra: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    ktc = SimpleNamespace(kv_connector_extra_config={"lease": LEASE, **extra},
                          kv_role="kv_both", engine_id=f"dp-{os.getpid()}-{next(_ids)}",
                          kv_load_failure_policy="fail")
    return SimpleNamespace(kv_transfer_config=ktc,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                           data_parallel_index=dp_rank),
                           cache_config=SimpleNamespace(block_size=4))


def test_data_parallel_ranks_bind_port_plus_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two data-parallel ranks of one engine on one host, with a fixed handshake_port
    and metrics_port: rank r binds port + r (both start; each advertises its own). The
    model identity needs a whole VllmConfig (tests/test_vllm_identity.py covers it);
    here it is a fixed map, as for an engine whose revision is pinned."""
    from types import SimpleNamespace

    from kvproto.vllm import identity

    monkeypatch.setattr(identity, "model_identity",
                        lambda *a, **k: {"weights": "pinned:test"})
    from urllib.request import urlopen

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvproto.vllm.connector import KVProtoConnector

    hp, mp = _two_free_ports(), _two_free_ports()
    conns = []
    try:
        for rank in (0, 1):
            c = KVProtoConnector(_vllm_config(rank, {"handshake_port": hp, "metrics_port": mp}),
                                 KVConnectorRole.WORKER, SimpleNamespace(num_blocks=NB))
            conns.append(c)
            c.register_kv_caches({f"layer.{i}": t for i, t in enumerate(caches())})
        ports = []
        for c in conns:
            md = c.get_handshake_metadata()
            assert md is not None
            ports.append(md.port)  # type: ignore[attr-defined]
        assert ports == [hp, hp + 1]
        for rank in (0, 1):
            with urlopen(f"http://127.0.0.1:{mp + rank}/metrics", timeout=5) as r:
                assert b"kvproto_" in r.read()
    finally:
        for c in conns:
            c.shutdown()


def test_held_blocks_never_stall_running_prefills(tmp_path: Any) -> None:
    """vLLM 0.32's own scheduler with KVProtoConnector as P: two requests are held for D
    (nobody reads them) and two long prompts prefill in chunks until the cache is full.
    The scheduler preempts one of the two (vLLM's answer to a full cache) and the other
    finishes its prefill; it does not wait for the held blocks, which only D's reads or
    the lease's end would bring back (spec/VLLM.md, "Held blocks and preemption")."""
    import torch as _torch
    from vllm import EngineArgs, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from kvproto.vllm import harness as h
    from kvproto.vllm.connector import KVProtoConnector, KVProtoHandshakeMetadata

    model = h.build_tiny_model(tmp_path / "model")
    bs, nb = 32, 12  # 11 usable blocks (vLLM keeps one as its null block)
    cfg = EngineArgs(model=str(model.path), skip_tokenizer_init=True, enforce_eager=True,
                     block_size=bs, max_model_len=1024, max_num_seqs=8,
                     max_num_batched_tokens=64, long_prefill_token_threshold=bs,
                     enable_prefix_caching=False, dtype="float32", seed=0,
                     kv_transfer_config=KVTransferConfig(**h.KVPROTO_CONNECTOR)
                     ).create_engine_config()
    cfg.cache_config.num_gpu_blocks = nb
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=32, dtype=_torch.float32)
    kcc = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kcc,
                  structured_output_manager=StructuredOutputManager(cfg), block_size=bs,
                  log_stats=False)
    conn = s.connector
    assert isinstance(conn, KVProtoConnector) and conn.psched is not None
    conn.set_xfer_handshake_metadata({0: KVProtoHandshakeMetadata(
        engine="P", epoch=3, host="127.0.0.1", port=1)})

    def add(rid: str, n: int, max_tokens: int, remote: bool) -> None:
        extra = {"kv_transfer_params": {"do_remote_decode": True}} if remote else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        s.add_request(Request(rid, list(range(3, 3 + n)), sp, None, arrival_time=time.time()))

    def step() -> dict[str, int]:
        """One engine step; the model "samples" a token once a prompt is computed."""
        so = s.schedule()
        ids = list(so.num_scheduled_tokens)
        done = [s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens
                for r in ids]  # vLLM counts the scheduled tokens as computed already
        s.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] if d else [] for d in done]))
        return dict(so.num_scheduled_tokens)

    add("H1", 2 * bs, 1, True)
    add("H2", 2 * bs, 1, True)
    for _ in range(4):
        step()
    assert set(conn.psched.held) == {"H1", "H2"}  # 4 blocks held for a D that never reads
    add("A", 5 * bs, 16, False)
    add("B", 5 * bs, 16, False)
    steps = [step() for _ in range(8)]
    assert all(steps), f"a step scheduled nothing: P stalled on held blocks {steps}"
    assert sum(st.get("A", 0) for st in steps) > 5 * bs, steps  # prefilled, then decoded
    assert s.requests["B"].num_preemptions == 1, steps
    assert set(conn.psched.held) == {"H1", "H2"}  # nobody freed the held blocks meanwhile
