"""P's gate through the worker halves of the vLLM connector over real NIXL (no engine):
a register without the readiness mark is refused and counted, and D, which already holds
the params, fails the request in one round trip (its heartbeat's ack refuses the
never-registered handle), long before the lease would end. Also the wire ``never``
message and D's port."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvproto.lifecycle import (
    Config,
    Consumer,
    Finished,
    SendRelease,
    TransferParams,
)
from kvproto.port import d_receive
from kvproto.wire import KIND_NEVER, decode, encode_never
from tests.test_vllm_connector import Pair


def test_never_message_roundtrips() -> None:
    bufs = encode_never(7, [5, 3, 9], 1 << 16)
    assert len(bufs) == 1
    m = decode(bufs[0], epoch=7)
    assert m.kind == KIND_NEVER and m.handles == (3, 5, 9) and m.kind_name == "never"


def test_d_fails_a_waiting_request_at_once_on_never() -> None:
    c = Consumer("D", Config())
    c.handshake_result("P", True, 0)
    tp = TransferParams(engine="P", epoch=7, handle=4, blocks=(1,), initial_term=30_000)
    c.admit("r4", tp, 0)
    assert c.state("r4") == "waiting"
    out = d_receive(c, "P", encode_never(7, [4, 99], 1 << 16)[0], 5, known=True, epoch=7,
                    max_bytes=1 << 16)
    assert [(e.request_id, e.state, e.reason) for e in out if isinstance(e, Finished)] == \
        [("r4", "failed", "never_registered")]
    assert not any(isinstance(e, SendRelease) for e in out)  # nothing to free on P
    assert c.finished == {"failed:never_registered": 1}
    # an unknown peer's never is a counted rejection that touches nothing
    tp5 = TransferParams(engine="P", epoch=7, handle=5, blocks=(2,), initial_term=30_000)
    c.admit("r5", tp5, 7)
    out = d_receive(c, "Q", encode_never(1, [5], 1 << 16)[0], 8, known=False, epoch=1,
                    max_bytes=1 << 16)
    assert c.state("r5") == "waiting" and not any(isinstance(e, Finished) for e in out)


def test_unready_register_is_refused_and_d_fails_in_one_round_trip() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from kvproto.metrics import Metrics, scrape_values

    m = Metrics(labels={"engine": "g1"})
    pr = Pair(metrics=m)
    try:
        params = pr.prefill("u1", [3, 5], 8, ready=False)
        pr.ds.new_request("u1", params)
        pr.step()  # P: the gate refuses the register; D: admit, handshake
        led = pr.p.adapter.ledger
        assert led.held_requests == 0
        assert led.counters.get("rejected:unready_register") == 1
        assert pr.p.adapter.gate.counters.get("unready_register") == 1
        assert "u1" in pr.sent  # the blocks go back to vLLM at once
        assert led.pool.held_count == 0
        d = pr.d.adapter
        pr.pump(lambda: d.machine.request("u1") is None and "u1" not in d.params,
                timeout=10.0)
        # D's claim was answered with a never notice (never_registered) or refused
        # (claim_refused): not at its lease end (lease_lost, which is what happens
        # without the gate)
        fin = d.machine.finished
        assert fin.get("failed:never_registered", 0) + fin.get("failed:claim_refused", 0) \
            == 1, fin
        assert pr.p.adapter.gate.counters.get("never_registered", 0) >= 1
        # the outcome is a label of D's reads counter, never a generic abort
        vals = scrape_values(generate_latest(m.registry).decode())
        outcomes = {dict(k[1]).get("outcome"): v for k, v in vals.items()
                    if k[0] == "kvproto_reads_total" and v}
        assert set(outcomes) <= {"failed:never_registered", "failed:claim_refused"}, outcomes
        assert sum(outcomes.values()) == 1 and "failed:aborted" not in outcomes
    finally:
        pr.close()


def test_ready_register_still_pulls() -> None:
    pr = Pair()
    try:
        params = pr.prefill("k1", [3, 5, 7], 12, ready=True)
        pr.ds.new_request("k1", params)
        pr.step()
        pr.ds.matched_tokens("k1", 12, 4)
        pr.ds.allocated("k1", [9, 2, 11], local_prefix_blocks=1, num_external_tokens=8)
        pr.pump(lambda: "k1" in pr.recv and "k1" in pr.sent)
        assert pr.invalid == set()
        assert pr.p.adapter.gate.counters.get("unready_register", 0) == 0
    finally:
        pr.close()


def test_a_second_consumer_of_the_same_params_is_refused_never_served() -> None:
    """A router retry: a second D engine gets the same params while the first one holds
    the binding. Its claim and heartbeats are refused (counted), it fails the request at
    once and recomputes; the first D pulls and P frees once, on the first D's done."""
    from kvproto.vllm.sched import DScheduler
    from kvproto.vllm.workers import DWorker as _DWorker
    from tests.test_vllm_connector import LEASE, NB, caches, opts

    # A long lease: on a loaded machine only P's refusal, never a lease end, fails D2.
    lease = {**LEASE, "initial_lease": 30.0, "lease_extension": 20.0, "abort_grace": 30.0}
    pr = Pair(lease=lease)
    d2 = _DWorker(opts(lease=lease), f"D2-{id(pr)}", caches(), NB, None)
    ds2 = DScheduler(block_size=4)
    try:
        params = pr.prefill("x", [3, 5, 7], 12)
        pr.ds.new_request("x", params)
        pr.step()
        gate = pr.p.adapter.gate
        handle = params["kvproto"]["handle"]
        pr.pump(lambda: gate.consumer(handle) is not None)  # D1 claimed (at admit)
        assert gate.consumer(handle) == pr.d.adapter.consumer_id
        # the retry reaches D2 with the same (now someone else's) params
        ds2.new_request("x-retry", params)
        m2 = d2.adapter.machine

        def d2_step() -> None:
            o = ds2.drain()
            d2.apply(o)
            d2.poll()
            _, _, ended = d2.take()
            ds2.on_failed(ended)

        end = time.monotonic() + 60.0  # a hang bound, not a timing assertion
        while time.monotonic() < end and not m2.finished:
            d2_step()
            pr.step()
            time.sleep(0.001)
        assert m2.request("x-retry") is None, "D2 still waits on a handle bound to D1"
        # D2's claim is refused: it never reads (it waited for the grant) and recomputes
        assert m2.finished.get("failed:claim_refused", 0) == 1, m2.finished
        assert gate.counters.get("foreign_consumer", 0) >= 1, gate.counters
        assert pr.p.adapter.ledger.counters.get("rejected:foreign_consumer", 0) >= 1
        assert d2.counters().get("reads_ok", 0) == 0  # never served
        # D1 still pulls, and P frees once, on D1's done
        pr.ds.matched_tokens("x", 12, 4)
        pr.ds.allocated("x", [9, 2, 11], local_prefix_blocks=1, num_external_tokens=8)
        pr.pump(lambda: "x" in pr.recv and "x" in pr.sent)
        assert pr.invalid == set()
        assert pr.p.adapter.ledger.frees["transferred"] == 1
        assert pr.p.adapter.check_invariants() == []
    finally:
        d2.close()
        pr.close()


def test_an_expiry_drops_the_binding_too() -> None:
    """Bindings leave with their blocks on every free, expiry included, so the gate's
    records stay bounded by the held requests."""
    pr = Pair()
    try:
        a = pr.p.adapter
        assert a.register("e1", [3, 5], handle=50, ready=True) is not None
        a.gate.claim("Dx", 50, a.gate.capability(50), a._now())
        assert a.gate.consumer(50) == "Dx"
        end = time.monotonic() + 30.0
        while a.ledger.state(50) != "expired" and time.monotonic() < end:
            time.sleep(0.05)
            a.tick()  # nobody heartbeats: the lease runs out
        assert a.ledger.frees["expired"] == 1
        assert a.gate.consumer(50) is None and len(a.gate) == 0
    finally:
        pr.close()
