"""In-process NIXL tests: a P adapter and D adapters (separate agents) in one process."""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvproto.lifecycle import Config, TransferParams
from kvproto.wire import HANDSHAKE_VERSION, encode_heartbeat

nixl_api = pytest.importorskip("nixl._api")

from kvproto.nixl.agent import fill_pattern, make_agent  # noqa: E402
from kvproto.nixl.consumer import Completion, ConsumerAdapter  # noqa: E402
from kvproto.nixl.producer import ProducerAdapter  # noqa: E402

pytestmark = pytest.mark.nixl

CFG = Config(initial_lease=3.0, lease_extension=2.0, heartbeat_interval=0.3, abort_grace=3.0,
             max_delay=0.2, max_read_time=1.0, clock_drift=0.1)
BB = 4096
_ids = itertools.count()


def uniq(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


class FakeClock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="VRAM variant needs CUDA"))]


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ProducerAdapter, ConsumerAdapter]]:
    device = getattr(request, "param", "cpu")
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=32, block_bytes=BB, device=device,
                        clock=FakeClock())
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=32, block_bytes=BB, device=device)
    d.add_engine(p.name, p.host, p.port)
    yield p, d
    d.close(timeout=1.0)
    p.close()


def pump(p: ProducerAdapter, ds: list[ConsumerAdapter], until: Callable[[], bool],
         timeout: float = 10.0, sink: list[Completion] | None = None) -> list[Completion]:
    out: list[Completion] = [] if sink is None else sink
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        p.poll()
        for d in ds:
            out += d.poll()
        if until():
            return out
        time.sleep(0.0005)
    raise AssertionError(f"condition not reached in {timeout}s; completions {out}")


def prefill(p: ProducerAdapter, rid: str, n: int, *, group: str | None = None,
            expected: int = 0) -> TransferParams:
    blocks = p.allocate(n)
    assert blocks is not None
    for i, b in enumerate(blocks):
        p.region.kv[b] = fill_pattern(rid, i, BB, p.region.device)
    params = p.register(rid, blocks, group=group, expected=expected)
    assert params is not None
    return params


def verified(d: ConsumerAdapter, c: Completion, key: str) -> bool:
    assert c.local_blocks is not None
    return all(torch.equal(d.region.kv[lb], fill_pattern(key, i, BB, d.region.device))
               for i, lb in enumerate(c.local_blocks))


@pytest.mark.parametrize("pair", DEVICES, indirect=True)
def test_transfer_verifies_and_frees(pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, d = pair
    params = prefill(p, "r1", 5)
    gens_before = p.region.gen[list(params.blocks)].clone()
    d.admit("r1", params)
    d.schedule("r1")
    comps = pump(p, [d], lambda: p.pool.held_count == 0)
    comps += pump(p, [d], lambda: bool(comps))
    assert [(c.request_id, c.state, c.reason) for c in comps] == [("r1", "done", "pulled")]
    assert verified(d, comps[0], "r1")
    assert comps[0].nbytes == 5 * BB
    assert p.ledger.frees["transferred"] == 1
    # The free bumped every reclaimed block's generation before returning it.
    assert bool((p.region.gen[list(params.blocks)] == gens_before + 1).all())
    assert p.free_blocks == 32
    assert p.check_invariants() == []


def test_fenced_when_freed_and_reused_before_the_read(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    """The race upstream serves silently: P frees (lease deliberately too short for the
    real hold) and reuses the blocks for another prompt while D is about to READ."""
    p, d = pair
    params = prefill(p, "victim", 4)
    clock = p.clock
    assert isinstance(clock, FakeClock)

    def hook(phase: str, rid: str) -> None:
        if phase == "before_post":
            clock.offset += CFG.initial_lease + 1  # timing assumptions violated
            p.tick()  # the lease expired -> Free -> generations bumped
            assert p.ledger.frees["expired"] == 1
            reused = p.allocate(32)  # the freed blocks are handed to another prompt
            assert reused is not None and set(params.blocks) <= set(reused)
            for b in params.blocks:
                p.region.kv[b] = fill_pattern("intruder", b, BB, p.region.device)

    d.phase_hook = hook
    d.admit("victim", params)
    d.schedule("victim")
    comps = pump(p, [d], lambda: bool(d.reads) is False and bool(d.counters.get("fenced")))
    comps = pump(p, [d], lambda: bool(comps), sink=comps)
    assert [(c.state, c.reason, c.local_blocks) for c in comps] == [("failed", "fenced", None)]
    assert d.counters["fenced"] == 1
    assert p.pool.violations == 0 and p.check_invariants() == []


def test_fenced_when_freed_between_data_and_stamp_reads(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, d = pair
    params = prefill(p, "slow", 3)
    clock = p.clock
    assert isinstance(clock, FakeClock)
    seen: dict[str, bool] = {}

    def hook(phase: str, rid: str) -> None:
        if phase == "before_gen":  # the data READ finished "slowly": past the lease
            clock.offset += CFG.initial_lease + 1
            p.tick()
            seen["freed"] = p.ledger.frees["expired"] == 1

    d.phase_hook = hook
    d.admit("slow", params)
    d.schedule("slow")
    comps = pump(p, [d], lambda: bool(d.counters.get("fenced")))
    assert seen == {"freed": True}
    assert [(c.state, c.reason) for c in comps] == [("failed", "fenced")]
    assert p.check_invariants() == []
    assert p.pool.violations == 0


def test_fenced_race_data_is_really_corrupt(pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    """Same race, checking the bytes D landed: they are the intruder's, and were not served."""
    p, d = pair
    params = prefill(p, "v2", 2)
    clock = p.clock
    assert isinstance(clock, FakeClock)
    landed: list[list[int]] = []

    def hook(phase: str, rid: str) -> None:
        if phase == "before_post":
            clock.offset += CFG.initial_lease + 1
            p.tick()
            for b in params.blocks:
                p.region.kv[b] = fill_pattern("intruder", b, BB, p.region.device)
        if phase == "before_gen":
            landed.append(list(d.reads[rid].local))

    d.phase_hook = hook
    d.admit("v2", params)
    d.schedule("v2")
    comps = pump(p, [d], lambda: bool(d.counters.get("fenced")))
    assert landed and all(
        torch.equal(d.region.kv[lb], fill_pattern("intruder", pb, BB, d.region.device))
        for lb, pb in zip(landed[0], params.blocks, strict=True))
    assert [(c.state, c.reason) for c in comps] == [("failed", "fenced")]


def test_one_stamp_read_for_many_requests_fences_only_the_changed_one(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    """Requests whose data landed together share one stamp READ. A stamp that changed
    between the data READ and the stamp READ (P freed and reused those blocks) fences
    that request alone: its data is not served and it sends no done; the others complete
    with verified data and P frees them as transferred."""
    p, d = pair
    params = [prefill(p, f"b{i}", 2 + i) for i in range(3)]
    d.admit("b0", params[0])
    pump(p, [d], lambda: d.engines[p.name].state == "ready")

    def hook(phase: str, rid: str) -> None:
        if phase == "before_gen" and rid == "b1":  # P reuses b1's blocks meanwhile
            p.region.gen[list(params[1].blocks)] += 1

    d.phase_hook = hook
    for i, pr in enumerate(params):
        if i:
            d.admit(f"b{i}", pr)
        d.schedule(f"b{i}")
    # The three READs were queued for the same P engine: D's next poll posts them as one
    # data READ, so they land together and share one stamp READ.
    comps = pump(p, [d], lambda: not d.reads and p.pool.held_count == 0)
    comps = pump(p, [d], lambda: len(comps) == 3, sink=comps)
    got = {c.request_id: (c.state, c.reason) for c in comps}
    assert got == {"b0": ("done", "pulled"), "b1": ("failed", "fenced"),
                   "b2": ("done", "pulled")}
    assert all(verified(d, c, c.request_id) for c in comps if c.state == "done")
    assert d.counters["fenced"] == 1
    assert d.counters["stamp_requests"] == 3
    assert d.counters["stamp_reads"] == 1
    assert d.counters["data_reads"] == 1
    # b0's and b2's done left as one done batch once their stamps matched; b1 sent a
    # release instead.
    assert d.counters.get("sent:done", 0) == 1 and d.counters.get("sent:release", 0) == 1
    assert p.ledger.frees["transferred"] == 2 and p.ledger.frees["released"] == 1
    assert p.check_invariants() == []


def test_malformed_notification_from_live_peer(pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, d = pair
    params = prefill(p, "held", 2)
    d.admit("held", params)  # handshake, never scheduled
    pump(p, [d], lambda: p.name in d.engines and d.engines[p.name].state == "ready")
    for junk in (b"garbage-garbage", b"KV\x09\x01\x00\x00\x00\x00", b"", b"\x00" * 9000):
        d.agent.send_notif(p.name, junk)
    # A valid message for the wrong P epoch is rejected too.
    d.agent.send_notif(p.name, encode_heartbeat(params.epoch ^ 1, 1, [params.handle], 1,
                                                4096)[0])
    pump(p, [d], lambda: sum(v for k, v in p.ledger.counters.items()
                             if k.startswith("rejected:")) >= 5)
    rej = {k: v for k, v in p.ledger.counters.items() if k.startswith("rejected:")}
    assert rej.get("rejected:bad_magic", 0) >= 1
    assert rej.get("rejected:version", 0) == 1
    assert rej.get("rejected:oversized", 0) == 1
    assert rej.get("rejected:epoch", 0) == 1
    assert sum(p.ledger.frees.values()) == 0
    assert p.ledger.state(params.handle) in ("registered", "leased")
    assert p.check_invariants() == []


def test_unknown_peer_rejected(pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, _d = pair
    params = prefill(p, "r", 1)
    stranger = make_agent(uniq("X"))
    stranger.add_remote_agent(p.agent.get_agent_metadata())
    from kvproto.wire import encode_done
    stranger.send_notif(p.name, encode_done(p.epoch, params.handle, 1))
    # Agents run without a progress thread: the stranger's send leaves when it polls.
    pump(p, [], lambda: bool(stranger.get_new_notifs() or True)
         and p.ledger.counters.get("rejected:unknown_peer", 0) == 1)
    assert sum(p.ledger.frees.values()) == 0  # a stranger's done frees nothing


@pytest.mark.parametrize("side", ["consumer", "producer"])
def test_version_mismatch_fails_requests(pair: tuple[ProducerAdapter, ConsumerAdapter],
                                         side: str) -> None:
    p, d = pair
    if side == "consumer":
        d.handshake_version = HANDSHAKE_VERSION + 1
    else:
        p.handshake_version = HANDSHAKE_VERSION + 1
    params = prefill(p, "vm", 1)
    d.admit("vm", params)
    d.schedule("vm")
    comps = pump(p, [d], lambda: bool(d.counters.get("handshake_failed:version_mismatch")))
    comps = pump(p, [d], lambda: bool(comps), sink=comps)
    assert [(c.state, c.reason) for c in comps] == [("failed", "version_mismatch")]
    assert d.counters.get("handshake_retry", 0) == 0  # never retried, never proceeded


def test_layout_mismatch_fails_requests() -> None:
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=8, block_bytes=BB)
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=8, block_bytes=2 * BB)
    try:
        d.add_engine(p.name, p.host, p.port)
        params = prefill(p, "lm", 1)
        d.admit("lm", params)
        comps = pump(p, [d], lambda: bool(d.counters.get("handshake_failed:layout_mismatch")))
        comps = pump(p, [d], lambda: bool(comps), sink=comps)
        assert [(c.state, c.reason) for c in comps] == [("failed", "layout_mismatch")]
        assert p.counters.get("handshake_refused") == 1
    finally:
        d.close(1.0)
        p.close()


@pytest.mark.parametrize("checked_by", ["P", "D"])
def test_model_identity_mismatch_fails_requests_before_any_read(
        checked_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """P and D send different model identities (other weights): the handshake is refused
    before any READ, counted on both sides, logged with the field that differed, and the
    request fails with ``model_mismatch``. With ``checked_by="D"`` P skips its own check
    (an older or lenient P): D's check of P's reply refuses it alike."""
    if checked_by == "D":
        import kvproto.nixl.driver_p as producer_mod  # P's handshake checks live there
        from kvproto import wire

        def no_identity(hs: object, role: str, layout: object, identity: object) -> None:
            wire.check_peer(hs, role, layout, getattr(hs, "identity", None))  # type: ignore[arg-type]

        monkeypatch.setattr(producer_mod, "check_peer", no_identity)
    same = {"architecture": "LlamaForCausalLM", "dtype": "bfloat16"}
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=8, block_bytes=BB,
                        identity={**same, "weights": "sha256:aaaa"})
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=8, block_bytes=BB,
                        identity={**same, "weights": "sha256:bbbb"})
    try:
        d.add_engine(p.name, p.host, p.port)
        params = prefill(p, "mm", 1)
        d.admit("mm", params)
        d.schedule("mm")
        comps = pump(p, [d], lambda: bool(d.counters.get("handshake_failed:model_mismatch")))
        comps = pump(p, [d], lambda: bool(comps), sink=comps)
        assert [(c.state, c.reason) for c in comps] == [("failed", "model_mismatch")]
        assert d.counters.get("handshake_retry", 0) == 0  # final: never retried
        assert d.counters.get("data_reads", 0) == 0 and d.counters.get("stamp_reads", 0) == 0
        refused_by_p = 1 if checked_by == "P" else 0
        assert p.counters.get("rejected:handshake_model_mismatch", 0) == refused_by_p
        assert p.ledger.counters.get("rejected:handshake_model_mismatch", 0) == refused_by_p
    finally:
        d.close(1.0)
        p.close()


def test_model_identity_mismatch_is_logged_with_the_field(
        caplog: pytest.LogCaptureFixture) -> None:
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=8, block_bytes=BB,
                        identity={"weights": "sha256:aaaa", "dtype": "bfloat16"})
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=8, block_bytes=BB,
                        identity={"weights": "sha256:bbbb", "dtype": "bfloat16"})
    try:
        d.add_engine(p.name, p.host, p.port)
        d.admit("lg", prefill(p, "lg", 1))
        with caplog.at_level("WARNING", logger="kvproto.nixl"):
            pump(p, [d], lambda: bool(d.counters.get("handshake_failed:model_mismatch")))
        lines = [r.getMessage() for r in caplog.records if "model_mismatch" in r.getMessage()]
        assert any("weights: P has 'sha256:aaaa', D has 'sha256:bbbb'" in m for m in lines), lines
        assert not any("dtype" in m for m in lines)
        # Same identity: the handshake passes.
        d2 = ConsumerAdapter(uniq("D"), CFG, num_blocks=8, block_bytes=BB,
                             identity=dict(p.identity))
        try:
            d2.add_engine(p.name, p.host, p.port)
            d2.admit("ok", prefill(p, "ok", 1))
            d2.schedule("ok")
            comps = pump(p, [d2], lambda: bool(d2.counters.get("handshakes")))
            comps = pump(p, [d2], lambda: bool(comps), sink=comps)
            assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
        finally:
            d2.close(1.0)
    finally:
        d.close(1.0)
        p.close()


def test_fan_in_two_readers_and_siblings() -> None:
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=32, block_bytes=BB)
    d0 = ConsumerAdapter(uniq("D0"), CFG, num_blocks=32, block_bytes=BB, tp_rank=0, tp_size=2)
    d1 = ConsumerAdapter(uniq("D1"), CFG, num_blocks=32, block_bytes=BB, tp_rank=1, tp_size=2)
    try:
        for d in (d0, d1):
            d.add_engine(p.name, p.host, p.port)
            # two TP ranks of one D engine: one consumer for P's gate (both claims granted)
            d.consumer_id = "D-engine"
        fan = prefill(p, "fan", 3, expected=2)
        # n=3 siblings sharing the same prompt blocks; D reads one member only.
        blocks = p.allocate(2)
        assert blocks is not None
        for i, b in enumerate(blocks):
            p.region.kv[b] = fill_pattern("grp", i, BB)
        sibs = [p.register(f"s{k}", blocks, group="grp") for k in range(3)]
        assert all(s is not None for s in sibs)
        for d in (d0, d1):
            d.admit("fan", fan)
            d.schedule("fan")
        for k, s in enumerate(sibs):
            assert s is not None
            d0.admit(f"s{k}", s)
            d0.schedule(f"s{k}")
        comps = pump(p, [d0, d1], lambda: p.pool.held_count == 0)
        comps = pump(p, [d0, d1], lambda: len(comps) >= 5, sink=comps)
        got = sorted((c.request_id, c.reason) for c in comps)
        assert got.count(("fan", "pulled")) == 2
        sib = [c for c in comps if c.request_id.startswith("s")]
        assert sorted(c.reason for c in sib) == ["pulled", "sibling_local", "sibling_local"]
        assert all(verified(d0, c, "grp") for c in sib if c.reason == "pulled")
        assert p.ledger.frees["transferred"] == 2  # fan + the pulled sibling
        assert p.ledger.frees["sibling"] + p.ledger.frees["released"] == 2
        assert p.free_blocks == 32 and p.pool.violations == 0
        assert p.check_invariants() == []
    finally:
        for d in (d0, d1):
            d.close(1.0)
        p.close()


def test_heartbeats_keep_queued_request_alive_and_are_chunked() -> None:
    small = Config(initial_lease=1.5, lease_extension=1.5, heartbeat_interval=0.2,
                   abort_grace=1.5, max_delay=0.1, max_read_time=0.5, clock_drift=0.1,
                   max_message_bytes=64)
    p = ProducerAdapter(uniq("P"), small, num_blocks=64, block_bytes=BB)
    sizes: list[int] = []

    def spy(kind: str, engine: str, buf: bytes) -> list[bytes]:
        if kind == "heartbeat":
            sizes.append(len(buf))
        return [buf]

    d = ConsumerAdapter(uniq("D"), small, num_blocks=64, block_bytes=BB, fault_hook=spy)
    try:
        d.add_engine(p.name, p.host, p.port)
        params = [prefill(p, f"q{i}", 1) for i in range(20)]
        for i, pr in enumerate(params):
            d.admit(f"q{i}", pr)
        t_end = time.monotonic() + 2 * small.initial_lease  # well past the initial lease
        pump(p, [d], lambda: time.monotonic() > t_end, timeout=10)
        assert sum(p.ledger.frees.values()) == 0  # renewed, not expired
        assert sizes and max(sizes) <= 64  # every heartbeat fits the cap
        assert len(sizes) >= 5  # 20 handles need several chunks per round
        for i in range(20):
            d.schedule(f"q{i}")
        comps = pump(p, [d], lambda: p.pool.held_count == 0)
        comps = pump(p, [d], lambda: len(comps) == 20, sink=comps)
        assert {c.reason for c in comps} == {"pulled"}
    finally:
        d.close(1.0)
        p.close()


@pytest.mark.parametrize("retry", [True, False], ids=["retry", "no_retry"])
def test_a_lost_claim_is_presented_again_and_the_request_pulled(retry: bool) -> None:
    """D's first claim is lost on the wire (nothing else is): D re-presents it with its
    next heartbeat round, P's gate grants it, and the request is pulled and freed as
    transferred. The ``no_retry`` case is the mutant (the tick's repeated claims
    dropped): the request is lost once its initial lease can no longer cover a READ,
    released, and P frees it as released."""
    dropped: list[int] = []

    def lose_first_claim(kind: str, engine: str, buf: bytes) -> list[bytes]:
        if kind == "claim" and not dropped:
            dropped.append(len(buf))
            return []
        return [buf]

    p = ProducerAdapter(uniq("P"), CFG, num_blocks=32, block_bytes=BB)
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=32, block_bytes=BB,
                        fault_hook=lose_first_claim)
    if not retry:
        tick = d.machine.tick

        def no_retry(now: int) -> list[Any]:
            return [e for e in tick(now) if type(e).__name__ != "SendClaim"]
        d.machine.tick = no_retry  # type: ignore[method-assign]
    try:
        d.add_engine(p.name, p.host, p.port)
        params = prefill(p, "r1", 3)
        assert params.capability  # the request is claimed
        d.admit("r1", params)
        d.schedule("r1")
        comps = pump(p, [d], lambda: p.pool.held_count == 0, timeout=3 * CFG.initial_lease)
        comps = pump(p, [d], lambda: bool(comps), sink=comps)
        assert dropped, "the first claim was sent (and lost)"
        got = [(c.request_id, c.state, c.reason) for c in comps]
        if retry:
            assert got == [("r1", "done", "pulled")]
            assert verified(d, comps[0], "r1")
            assert p.ledger.frees["transferred"] == 1
            assert d.machine.counters["claims_retried"] >= 1
        else:
            assert got == [("r1", "failed", "lease_lost")]
            assert p.ledger.frees["released"] == 1
    finally:
        d.close(1.0)
        p.close()


def test_clock_epochs_and_rates_differ_between_p_and_d() -> None:
    """P and D on hosts whose clocks share nothing: P's monotonic epoch is 10^7 s ahead,
    D's starts near 42 s and runs 0.3% fast (within ``clock_drift`` over a lease). Only
    durations cross the wire, so no lease expires on arrival (upstream: different
    perf_counter epochs did that): a request D keeps waiting for twice the initial lease
    is renewed and then pulled, and one whose D goes silent is expired by P's own clock
    after its initial lease, not before."""
    t0 = time.monotonic()

    def p_clock() -> float:
        return time.monotonic() + 1.0e7

    def d_clock() -> float:
        return 42.0 + (time.monotonic() - t0) * 1.003

    p = ProducerAdapter(uniq("P"), CFG, num_blocks=32, block_bytes=BB, clock=p_clock)
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=32, block_bytes=BB, clock=d_clock)
    silent = ConsumerAdapter(uniq("D"), CFG, num_blocks=32, block_bytes=BB, clock=d_clock)
    try:
        d.add_engine(p.name, p.host, p.port)
        silent.add_engine(p.name, p.host, p.port)
        kept = prefill(p, "kept", 3)
        left = prefill(p, "left", 2)
        registered = time.monotonic()
        d.admit("kept", kept)
        silent.admit("left", left)
        silent.poll()  # one poll: its handshake starts, then it never polls again
        half = registered + CFG.initial_lease / 2
        pump(p, [d], lambda: time.monotonic() > half, timeout=10)
        assert sum(p.ledger.frees.values()) == 0, p.ledger.frees  # nothing on arrival
        t_end = registered + 2 * CFG.initial_lease
        pump(p, [d], lambda: time.monotonic() > t_end, timeout=10)
        assert p.ledger.frees.get("expired", 0) == 1, p.ledger.frees  # "left" only
        d.schedule("kept")
        comps = pump(p, [d], lambda: p.pool.held_count == 0)
        comps = pump(p, [d], lambda: bool(comps), sink=comps)
        assert [(c.request_id, c.reason) for c in comps] == [("kept", "pulled")]
        assert verified(d, comps[0], "kept")
        assert {k: n for k, n in p.ledger.frees.items() if n} == \
            {"expired": 1, "transferred": 1}, p.ledger.frees
        assert p.check_invariants() == []
    finally:
        silent.close(1.0)
        d.close(1.0)
        p.close()


def test_dead_producer_does_not_delay_other_handshakes() -> None:
    """A P that accepts the connection but never answers must not hold up a live P."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted, never answered
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=8, block_bytes=BB)
    d = ConsumerAdapter(uniq("D"), CFG, num_blocks=8, block_bytes=BB, handshake_timeout=1.0,
                        handshake_attempts=2, backoff=0.05)
    try:
        d.add_engine("deadP", "127.0.0.1", silent.getsockname()[1])
        d.add_engine(p.name, p.host, p.port)
        dead = TransferParams(engine="deadP", epoch=1, handle=1, blocks=(0,), initial_term=30_000,
                              generations=(0,))
        d.admit("to-dead", dead)  # its handshake starts first
        d.schedule("to-dead")
        live = prefill(p, "to-live", 1)
        d.admit("to-live", live)
        d.schedule("to-live")
        comps = pump(p, [d], lambda: len(comps) == 2, sink=(comps := []))
        order = [(c.request_id, c.reason) for c in comps]
        assert order[0] == ("to-live", "pulled")
        assert ("to-dead", "handshake_timeout") in order
    finally:
        d.close(1.0)
        p.close()
        silent.close()


def test_producer_abort_waits_for_reader_then_frees(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, d = pair
    params = prefill(p, "ab", 2)
    d.admit("ab", params)
    p.abort("ab")
    assert p.ledger.state(params.handle) == "aborted"
    d.schedule("ab")
    comps = pump(p, [d], lambda: p.pool.held_count == 0)
    comps = pump(p, [d], lambda: bool(comps), sink=comps)
    assert p.ledger.frees["transferred"] + p.ledger.frees["released"] == 1
    assert p.ledger.frees["aborted"] == 0 and p.pool.violations == 0


def test_consumer_abort_before_read_releases(pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    p, d = pair
    params = prefill(p, "da", 2)
    d.admit("da", params)
    pump(p, [d], lambda: d.state("da") == "waiting")
    d.abort("da")
    comps = pump(p, [d], lambda: p.pool.held_count == 0)
    comps = pump(p, [d], lambda: bool(comps), sink=comps)
    assert [(c.state, c.reason) for c in comps] == [("failed", "aborted")]
    assert p.ledger.frees["released"] == 1


def _recv_nb(s: socket.socket, buf: bytearray) -> bool:
    """Read what is there; True once the peer closed the connection."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
            buf += data
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def test_garbage_on_the_handshake_channel_is_refused_and_p_keeps_serving(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    from kvproto.nixl.channel import (
        FRAME,
        NONCE_BYTES,
        ST_CHALLENGE,
        ST_OK,
        ST_REFUSED,
        frame,
        parse_refusal,
    )
    from kvproto.wire import MAX_HANDSHAKE_BYTES

    p, d = pair
    payloads = {
        "not_json": frame(ST_OK, b"\xff\xfe not a handshake"),
        "oversized": FRAME.pack(MAX_HANDSHAKE_BYTES + 1, ST_OK),
        "bad_status": FRAME.pack(3, 9) + b"abc",
        "handler_raises": frame(ST_OK, b"{}"),
    }
    challenge = FRAME.size + NONCE_BYTES  # P speaks first: a fresh challenge
    handler = p.server.handler
    socks: dict[str, socket.socket] = {}
    bufs: dict[str, bytearray] = {}
    closed: dict[str, bool] = {}
    try:
        for name, data in payloads.items():
            if name == "handler_raises":
                def boom(conn: int, payload: bytes, authed: bool) -> tuple[bytes, str]:
                    raise RuntimeError("bug in the handler")
                p.server.handler = boom
            s = socket.create_connection((p.host, p.port), timeout=5)
            s.sendall(data)
            s.setblocking(False)
            socks[name], bufs[name], closed[name] = s, bytearray(), False

            def settled(name: str = name) -> bool:
                closed[name] = closed[name] or _recv_nb(socks[name], bufs[name])
                return closed[name] or len(bufs[name]) >= challenge + FRAME.size
            pump(p, [], settled)
            if bufs[name]:  # a connection dropped at once may not even get the challenge
                n, st = FRAME.unpack_from(bufs[name], 0)
                assert (n, st) == (NONCE_BYTES, ST_CHALLENGE)
                del bufs[name][:challenge]
        p.server.handler = handler
        n, st = FRAME.unpack_from(bufs["not_json"], 0)
        pump(p, [], lambda: _recv_nb(socks["not_json"], bufs["not_json"]) or
             len(bufs["not_json"]) >= FRAME.size + n)
        assert st == ST_REFUSED
        assert parse_refusal(bytes(bufs["not_json"][FRAME.size:FRAME.size + n]))[0] == \
            "malformed_handshake"
        for name in ("oversized", "bad_status", "handler_raises"):
            assert closed[name] and not bufs[name], name  # dropped without an answer
        assert p.counters.get("handshake_refused") == 1
        assert p.ledger.counters.get("rejected:handshake_malformed_handshake") == 1
    finally:
        p.server.handler = handler
        for s in socks.values():
            s.close()
    # P still serves a well-behaved D.
    params = prefill(p, "after", 2)
    d.admit("after", params)
    d.schedule("after")
    comps = pump(p, [d], lambda: p.pool.held_count == 0)
    comps = pump(p, [d], lambda: bool(comps), sink=comps)
    assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
    assert verified(d, comps[0], "after")


def test_restarted_d_with_the_same_name_handshakes_again_once_its_old_channel_closed(
        pair: tuple[ProducerAdapter, ConsumerAdapter]) -> None:
    """A claim on a known name is accepted only when the old peer's connection is gone:
    the restarted D is served; nothing was unloaded while the old one lived."""
    p, d = pair
    params = prefill(p, "one", 2)
    d.admit("one", params)
    d.schedule("one")
    comps = pump(p, [d], lambda: d.state("one") == "new")
    assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
    name = d.name
    d.close(timeout=1.0)  # the D process "dies": its agent and handshake channel go
    pump(p, [], lambda: not any(p.server.is_open(c) for c in p._peer_conn.values()))
    d2 = ConsumerAdapter(name, CFG, num_blocks=32, block_bytes=BB)
    try:
        d2.add_engine(p.name, p.host, p.port)
        params = prefill(p, "two", 2)
        d2.admit("two", params)
        d2.schedule("two")
        comps = pump(p, [d2], lambda: d2.state("two") == "new")
        assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
        assert verified(d2, comps[0], "two")
        assert p.counters.get("handshakes") == 2
        assert p.counters.get("handshake_refused", 0) == 0
    finally:
        d2.close(timeout=1.0)


def test_close_ends_the_progress_thread_without_the_cyclic_gc() -> None:
    """An adapter's objects form reference cycles, so only the cyclic GC would free its
    agent; its progress thread (a busy loop) must end at close, not minutes later."""
    import gc

    def threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    enabled = gc.isenabled()
    gc.disable()
    try:
        for progress in (True, False):
            before = threads()
            p = ProducerAdapter(f"P-close-{os.getpid()}-{progress}", Config(), num_blocks=4,
                                block_bytes=64, progress_thread=progress)
            started = threads() - before
            assert started or not progress, "the agent started no thread"
            p.close()
            deadline = time.monotonic() + 5.0  # a hang bound
            while threads() & started and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not threads() & started, (progress, started, threads())
    finally:
        if enabled:
            gc.enable()
