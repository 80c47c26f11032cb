"""Block checksums (``Config.checksums``, PROTOCOL.md §5.1): the function, the option,
the machine's rule (a READ whose checksum failed takes the fenced path), the simulator
and its mutant, and real NIXL agents in separate processes where one byte of P's memory
changes after register with its stamps unchanged."""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import signal
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvproto.lifecycle import (
    D_FAILED,
    READ_FAILED,
    Config,
    ConfigError,
    Consumer,
    Finished,
    PostRead,
    SendDone,
    SendRelease,
    TransferParams,
)
from kvproto.lifecycle.table import D_TRANSITIONS
from kvproto.nixl import checksum
from kvproto.testing.mutants import DRIVER_MUTANTS, NoChecksumDriver
from kvproto.testing.sim import Simulator, simulate_many
from kvproto.testing.transport import Faults
from kvproto.vllm.sched import ConnectorOptions

ON = Config(checksums=True)


# -- the function ------------------------------------------------------------------------

def test_block_sum_is_crc32_chained_over_the_segments_in_place() -> None:
    buf = bytearray(os.urandom(3000))
    arr = (ctypes.c_char * len(buf)).from_buffer(buf)
    addr = ctypes.addressof(arr)
    whole = checksum.block_sum([(addr, 3000)])
    assert whole == zlib.crc32(bytes(buf))
    assert checksum.block_sum([(addr, 1000), (addr + 1000, 2000)]) == whole  # chained
    buf[1234] ^= 0x01  # one bit, in place: the same address now sums differently
    assert checksum.block_sum([(addr, 3000)]) != whole


def test_wsum32_is_the_weighted_word_sum_chained_over_segments() -> None:
    import torch

    nb, bb = 6, 96
    kv = torch.randint(0, 256, (nb, bb), dtype=torch.uint8)
    addr = kv.data_ptr()
    want = [checksum.wsum32_reference(bytes(kv[b].tolist())) for b in range(nb)]
    assert checksum.region_sums(addr, bb, [], range(nb), "wsum32") == want
    assert checksum.region_sums(addr, bb, [], [4, 1], "wsum32") == [want[4], want[1]]
    # The same bytes as two segments of each block (40 + 56 bytes): the word positions
    # continue across them, so the sum is the whole block's.
    segs = [(addr, bb, 40), (addr + 40, bb, 56)]
    assert checksum.region_sums(addr, bb, segs, range(nb), "wsum32") == want


def test_wsum32_pads_a_short_segment_and_sees_every_single_byte_change() -> None:
    import torch

    kv = torch.randint(0, 256, (2, 30), dtype=torch.uint8)  # 30: not whole words
    before = checksum.region_sums(kv.data_ptr(), 30, [], [0, 1], "wsum32")
    assert before[0] == checksum.wsum32_reference(bytes(kv[0].tolist()))
    for i in range(30):  # every position, the worst change of each byte: still seen
        kv[0, i] ^= 0xFF
        assert checksum.region_sums(kv.data_ptr(), 30, [], [0], "wsum32") != [before[0]]
        kv[0, i] ^= 0xFF
    swapped = kv[1].clone()
    swapped[0:4], swapped[4:8] = kv[1][4:8].clone(), kv[1][0:4].clone()
    if not torch.equal(swapped, kv[1]):  # two different words swapped: a plain sum is blind
        got = checksum.region_sums(swapped.data_ptr(), 30, [], [0], "wsum32")
        assert got != [before[1]]


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs CUDA")
def test_wsum32_on_the_device_is_the_definition() -> None:
    import torch

    nb, bb = 5, 4096 + 12
    kv = torch.randint(0, 256, (nb, bb), dtype=torch.uint8, device="cuda")
    host = kv.cpu()
    want = [checksum.wsum32_reference(bytes(host[b].tolist())) for b in range(nb)]
    got = checksum.region_sums(kv.data_ptr(), bb, [], [3, 0, 4], "wsum32", kv.device)
    assert got == [want[3], want[0], want[4]]
    # Split in two segments (1,000 + the rest): the same sums as the host computes.
    segs = [(kv.data_ptr(), bb, 1000), (kv.data_ptr() + 1000, bb, bb - 1000)]
    hsegs = [(host.data_ptr(), bb, 1000), (host.data_ptr() + 1000, bb, bb - 1000)]
    on_host = checksum.region_sums(host.data_ptr(), bb, hsegs, range(nb), "wsum32")
    assert on_host == want
    assert checksum.region_sums(kv.data_ptr(), bb, segs, range(nb), "wsum32", kv.device) == want
    kv[2, 77] ^= 0x10
    assert checksum.region_sums(kv.data_ptr(), bb, [], [2], "wsum32", kv.device) != [want[2]]


def test_the_function_follows_the_memory_and_d_refuses_what_it_cannot_compute() -> None:
    assert checksum.algorithm_for("DRAM") == "crc32" == checksum.ALGORITHM
    assert checksum.algorithm_for("VRAM") == "wsum32"
    assert checksum.can_verify("crc32", "DRAM") and checksum.can_verify("wsum32", "DRAM")
    assert checksum.can_verify("wsum32", "VRAM")
    assert not checksum.can_verify("crc32", "VRAM")  # no CRC kernel on the device
    assert not checksum.can_verify("md5", "DRAM") and not checksum.can_verify(True, "DRAM")
    with pytest.raises(ValueError, match="unknown checksum function"):
        checksum.region_sums(0, 8, [], [0], "md5")


def test_block_parts_contiguous_and_segmented() -> None:
    assert checksum.block_parts(1000, 64, [], 3) == [(1000 + 3 * 64, 64)]
    segs = [(10_000, 128, 32), (50_000, 128, 32)]
    assert checksum.block_parts(0, 64, segs, 2) == [(10_256, 32), (50_256, 32)]


def test_mismatches_fail_closed_on_length() -> None:
    assert checksum.mismatches([1, 2, 3], [1, 2, 3]) == []
    assert checksum.mismatches([1, 2, 3], [1, 9, 3]) == [1]
    assert checksum.mismatches([1, 2], [1, 2, 3]) == [0, 1, 2]


def test_speeds_names_every_candidate() -> None:
    got = checksum.speeds(1 << 16, seconds=0.01)
    assert set(checksum.CANDIDATES) <= set(got) and all(v > 0 for v in got.values())


# -- the option ---------------------------------------------------------------------------

def test_config_option_is_off_by_default_and_a_bool() -> None:
    assert Config().checksums is False
    assert Config.from_dict({"checksums": True}).checksums is True
    assert Config.from_dict(Config(checksums=True).to_dict()) == ON
    with pytest.raises(ConfigError, match="checksums must be true or false"):
        Config.from_dict({"checksums": 1})
    with pytest.raises(ConfigError, match="checksums must be true or false"):
        Config(checksums="yes").validate()  # type: ignore[arg-type]


def test_a_lease_config_file_may_carry_the_flag(tmp_path: Path) -> None:
    """``kvproto check --lease-config`` reads journal-header configs too: the flag is
    accepted (it has no timing meaning) and must be a bool."""
    from kvproto.verify.check import LeaseConfigError, load_lease_config

    f = tmp_path / "lease.json"
    f.write_text(json.dumps({"checksums": True, "initial_lease": 30}))
    assert load_lease_config(str(f), {}).checksums is True
    f.write_text(json.dumps({"checksums": 1}))
    with pytest.raises(LeaseConfigError, match="checksums must be true or false"):
        load_lease_config(str(f), {})


def test_connector_option() -> None:
    assert ConnectorOptions.parse({}).config.checksums is False
    assert ConnectorOptions.parse({"checksums": True}).config.checksums is True
    assert ConnectorOptions.parse({"lease": {"checksums": True}}).config.checksums is True
    with pytest.raises(ValueError, match="checksums must be true or false"):
        ConnectorOptions.parse({"checksums": "on"})


# -- the machine's rule ------------------------------------------------------------------

def _reading(c: Consumer, rid: str = "r") -> None:
    p = TransferParams("P", 7, 1, (0, 1), 30_000, 1, None, (0, 0))
    c.admit(rid, p, 0)
    c.handshake_result("P", True, 1)
    out = c.schedule(rid, 2)
    assert any(isinstance(e, PostRead) for e in out), out


def test_a_corrupt_read_takes_the_fenced_row_never_done() -> None:
    c = Consumer("D", ON)
    _reading(c)
    out = c.read_result("r", True, 5, corrupt=True, notif_attached=False)
    fin = [e for e in out if isinstance(e, Finished)]
    assert [(f.state, f.reason) for f in fin] == [(D_FAILED, "fenced")]
    assert any(isinstance(e, SendRelease) for e in out)
    assert not any(isinstance(e, SendDone) for e in out)  # never reported as pulled
    assert c.counters["checksum_failed"] == 1
    rows = [t for t in D_TRANSITIONS if t.event == READ_FAILED and t.guard == "fenced"]
    assert rows and "checksum" in rows[0].doc


def test_an_intact_read_is_done() -> None:
    c = Consumer("D", ON)
    _reading(c)
    out = c.read_result("r", True, 5, corrupt=False, notif_attached=False)
    assert [(f.state, f.reason) for f in out if isinstance(f, Finished)] == [("done", "pulled")]
    assert "checksum_failed" not in c.counters


# -- the simulator: the production drivers, corrupted landings, the mutant -----------------

@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.getLogger("kvproto.nixl").setLevel(logging.ERROR)
    yield
    logging.getLogger("kvproto.nixl").setLevel(logging.NOTSET)


def test_simulator_fences_every_corrupted_read_with_checksums_on() -> None:
    corrupted = failures = 0
    for seed in range(3):
        sim = Simulator(seed, config=ON, faults=Faults(corrupt=0.05))
        sim.run(30)
        assert sim.stats.violations == []
        corrupted += sim.world.corrupted
        failures += sim.d_counter("checksum_failed")
    # A corrupted READ is fenced unless its stamps fenced it first (or its rank crashed).
    assert corrupted > 0 and 0 < failures <= corrupted


def test_without_checksums_a_corrupted_read_is_served() -> None:
    """The fault is real: with checksums off the same corruption reaches the engine."""
    sim = Simulator(2, config=Config(), faults=Faults(corrupt=0.05))
    sim.run(30)
    assert sim.world.corrupted > 0
    assert any("ServedIntact" in v for v in sim.stats.violations)


def test_the_no_checksum_mutant_is_caught_by_served_intact() -> None:
    assert DRIVER_MUTANTS["no_checksum"].driver_cls is NoChecksumDriver
    sim = Simulator(2, config=ON, faults=Faults(corrupt=0.05),
                    driver_cls=NoChecksumDriver)
    sim.run(30)
    assert any("ServedIntact" in v for v in sim.stats.violations), sim.stats.violations


def test_simulate_many_with_checksums_reports_the_counts() -> None:
    t = simulate_many(1, 2, 20.0, 256, False, faults="swarm", checksums=True)
    assert t["safety_violations"] == 0 and t["crashed_seeds"] == 0
    assert t["corrupted_reads"] > 0 and t["checksum_failures"] > 0
    assert all("corrupt" in mix for mix in t["fault_mix"].values())


# -- real NIXL agents: P in its own process, one byte of its memory changed after register --

NIXL_CFG = Config(initial_lease=2.5, lease_extension=2.0, heartbeat_interval=0.3,
                  abort_grace=2.5, max_delay=0.2, max_read_time=1.0, clock_drift=0.1)
BB = 8192
_ids = itertools.count()


class _P:
    """``kvproto.nixl.procs.producer_main`` in a process of its own."""

    def __init__(self, cfg: Config, device: str = "cpu") -> None:
        from kvproto.nixl.procs import mp_context, producer_main

        ctx = mp_context()
        self.name = f"P-{os.getpid()}-{next(_ids)}"
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, daemon=True,
                                args=(child, self.name, cfg.to_dict(), 8, BB, {"device": device}))
        self.proc.start()
        child.close()
        _, self.host, self.port, _ = self.recv("ready")

    def recv(self, kind: str, timeout: float = 30.0) -> tuple[Any, ...]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.conn.poll(0.05):
                m: tuple[Any, ...] = self.conn.recv()
                if m[0] == kind:
                    return m
            elif not self.proc.is_alive():
                raise AssertionError(f"P exited ({self.proc.exitcode})")
        raise AssertionError(f"no {kind!r} from P within {timeout}s")

    def register(self, rid: str, n: int) -> TransferParams:
        self.conn.send(("register", rid, n, None, 0, rid, None))
        pd = self.recv("registered")[2]
        assert pd is not None
        return TransferParams.from_dict(pd)

    def stats(self) -> dict[str, Any]:
        self.conn.send(("stats",))
        return self.recv("stats")[1]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(10)
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)


def _pull(p: _P, cfg: Config, reqs: list[tuple[str, TransferParams]],
          device: str = "cpu") -> tuple[Any, list[Any]]:
    from kvproto.nixl.consumer import ConsumerAdapter

    d = ConsumerAdapter(f"D-{os.getpid()}-{next(_ids)}", cfg, num_blocks=8, block_bytes=BB,
                        device=device)
    d.add_engine(p.name, p.host, p.port)
    for rid, params in reqs:
        d.admit(rid, params)
        d.schedule(rid)
    out: list[Any] = []
    end = time.monotonic() + 30
    while len(out) < len(reqs) and time.monotonic() < end:
        out += d.poll()
        time.sleep(0.001)
    return d, out


def _served_intact(d: Any, c: Any, key: str) -> bool:
    import torch

    from kvproto.nixl.agent import fill_pattern

    dev = d.region.kv.device
    return all(torch.equal(d.region.kv[lb], fill_pattern(key, i, BB, dev))
               for i, lb in enumerate(c.local_blocks))


@pytest.fixture
def nixl() -> None:
    pytest.importorskip("nixl._api")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch comes with the nixl extra
        return False
    return bool(torch.cuda.is_available())


NEEDS_CUDA = pytest.mark.skipif(not _cuda(), reason="VRAM variant needs CUDA")
# (P's memory, D's memory): the function is P's (crc32 in DRAM, wsum32 in VRAM).
PAIRS = [("cpu", "cpu"), pytest.param("cuda", "cuda", marks=NEEDS_CUDA),
         pytest.param("cuda", "cpu", marks=NEEDS_CUDA)]


@pytest.mark.nixl
@pytest.mark.usefixtures("nixl")
@pytest.mark.parametrize(("p_dev", "d_dev"), PAIRS)
def test_nixl_a_byte_changed_in_p_memory_after_register_is_fenced_never_served(
        p_dev: str, d_dev: str) -> None:
    cfg = replace(NIXL_CFG, checksums=True)
    p = _P(cfg, p_dev)
    d = None
    try:
        good = p.register("good", 2)
        bad = p.register("bad", 3)
        p.conn.send(("flip", bad.blocks[1], 4321))  # a NIC/backend fault: stamps unchanged
        d, comps = _pull(p, cfg, [("good", good), ("bad", bad)], d_dev)
        got = {c.request_id: c for c in comps}
        assert (got["good"].state, got["good"].reason) == ("done", "pulled")
        assert _served_intact(d, got["good"], "good")
        assert (got["bad"].state, got["bad"].reason) == ("failed", "fenced")
        assert got["bad"].local_blocks is None  # never visible to the engine
        assert d.counters.get("checksum_failed") == 1 and not d.counters.get("fenced")
        assert d.machine.counters.get("checksum_failed") == 1
        end = time.monotonic() + 10  # P frees both: one done, one release
        while time.monotonic() < end and p.stats()["held"]:
            time.sleep(0.05)
        s = p.stats()
        assert s["held"] == 0 and s["frees"].get("transferred") == 1
        assert s["frees"].get("released") == 1 and s["violations"] == 0
    finally:
        if d is not None:
            d.close(1.0)
        p.stop()


@pytest.mark.nixl
@pytest.mark.usefixtures("nixl")
@pytest.mark.parametrize(("p_dev", "d_dev"), PAIRS[:2])
def test_nixl_without_checksums_the_same_byte_is_served(p_dev: str, d_dev: str) -> None:
    """The fault is real: the stamps alone cannot see it."""
    p = _P(NIXL_CFG, p_dev)
    d = None
    try:
        bad = p.register("bad", 3)
        p.conn.send(("flip", bad.blocks[1], 4321))
        d, comps = _pull(p, NIXL_CFG, [("bad", bad)], d_dev)
        assert [(c.state, c.reason) for c in comps] == [("done", "pulled")]
        assert not _served_intact(d, comps[0], "bad")
    finally:
        if d is not None:
            d.close(1.0)
        p.stop()


@pytest.mark.nixl
@pytest.mark.usefixtures("nixl")
def test_nixl_a_verifying_d_refuses_a_p_without_checksums() -> None:
    p = _P(NIXL_CFG)
    d = None
    try:
        params = p.register("r", 1)
        d, comps = _pull(p, replace(NIXL_CFG, checksums=True), [("r", params)])
        assert [(c.state, c.reason) for c in comps] == [("failed", "checksums_unsupported")]
        assert d.counters.get("handshake_failed:checksums_unsupported", 0) >= 1
    finally:
        if d is not None:
            d.close(1.0)
        p.stop()


@pytest.mark.nixl
@pytest.mark.usefixtures("nixl")
@NEEDS_CUDA
def test_nixl_a_d_in_vram_refuses_a_p_sealing_crc32_in_dram() -> None:
    """CRC-32 has no device kernel here: such a D cannot verify, so it never reads."""
    cfg = replace(NIXL_CFG, checksums=True)
    p = _P(cfg, "cpu")
    d = None
    try:
        params = p.register("r", 1)
        d, comps = _pull(p, cfg, [("r", params)], "cuda")
        assert [(c.state, c.reason) for c in comps] == [("failed", "checksums_unsupported")]
        assert d.counters.get("handshake_failed:checksums_unsupported", 0) >= 1
        assert not d.counters.get("checksum_verified")
    finally:
        if d is not None:
            d.close(1.0)
        p.stop()


@pytest.mark.tlc
def test_a_d_journal_with_a_checksum_fence_validates_under_tlc(tmp_path: Path) -> None:
    """A READ fenced by its checksums is journaled as the stamp fence's event
    (``read_failed fenced``): the spec allows it without an action of its own."""
    from kvproto.journal import JournalWriter
    from kvproto.verify.tlc import MissingDependency
    from kvproto.verify.validate import validate

    path = tmp_path / "D.jsonl"
    w = JournalWriter(path, ON, reader="D")
    c = Consumer("D", ON, sink=w.sink)
    for rid, h in (("bad", 1), ("good", 2)):
        c.admit(rid, TransferParams("P", 7, h, (h,), 30_000, 1, None, (0,)), 0)
    c.handshake_result("P", True, 1)
    c.schedule("bad", 2)
    c.schedule("good", 2)
    c.read_result("bad", True, 5, corrupt=True, notif_attached=False)
    c.read_result("good", True, 6, notif_attached=False)
    w.close()
    rows = [json.loads(ln) for ln in path.read_text().splitlines()[1:]]
    assert rows[-2]["event"] == {"type": "read_failed", "request_id": "bad", "now": 5,
                                 "fenced": True}
    try:
        verdicts = validate([path])
    except MissingDependency as e:  # pragma: no cover - depends on the machine
        pytest.skip(str(e))
    assert [v.allowed for v in verdicts] == [True], verdicts[0].describe()


@pytest.mark.nixl
@pytest.mark.usefixtures("nixl")
def test_bench_transfer_checksum_json(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvproto bench transfer --checksum --json`` on a tiny workload: the ratios with
    against without checksums, each candidate's speed, and no checksum failure."""
    import argparse
    import math

    from kvproto.bench import transfer as bench

    args = argparse.Namespace(block_kib=16, blocks_per_request=2, requests=2, rounds=1,
                              small_requests=10, in_flight=100, json=True, device="cpu",
                              checksum=True)
    assert bench.run(args) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in ("ratio", "ratio_4k", "register_ratio"):
        assert isinstance(res[k], float) and math.isfinite(res[k]) and res[k] > 0, k
    assert res["algorithm"] == "crc32" and set(checksum.CANDIDATES) <= set(res["cpu_gbps"])
    assert res["big"]["checksum_failures"] == res["small"]["checksum_failures"] == 0
    assert res["big"]["verified_blocks"] > 0
