"""A READ that does not complete, through real NIXL (in-process P and D adapters): D
fails the request at max_read_time + read_grace, keeps its local blocks quarantined
(never lent again) until the transfer ends, never tells P done or release, and P frees
by lease. The transport's test-only hold keeps the data READ "in progress"."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

pytest.importorskip("nixl")

from kvproto.lifecycle import Config
from kvproto.nixl.consumer import Completion, ConsumerAdapter
from kvproto.nixl.producer import ProducerAdapter
from tests.test_nixl import BB, CFG, FakeClock, prefill, pump, uniq

pytestmark = pytest.mark.nixl


def test_an_overdue_read_fails_and_its_blocks_stay_quarantined_until_the_transfer_ends(
        ) -> None:
    clock = FakeClock()
    p = ProducerAdapter(uniq("P"), CFG, num_blocks=32, block_bytes=BB, clock=clock)
    dcfg: Config = replace(CFG, read_grace=0.3)
    d = ConsumerAdapter(uniq("D"), dcfg, num_blocks=32, block_bytes=BB)
    try:
        d.add_engine(p.name, p.host, p.port)
        d.transport.hold_reads_s = 3.0  # deadline: 1.0 + 0.3 s after the post
        params = prefill(p, "r1", 4)
        d.admit("r1", params)
        d.schedule("r1")
        t0 = time.monotonic()
        comps: list[Completion] = []
        pump(p, [d], lambda: bool(comps), sink=comps, timeout=10.0)
        waited = time.monotonic() - t0
        assert [(c.request_id, c.state, c.reason) for c in comps] == \
            [("r1", "failed", "read_timeout")]
        assert waited >= 1.3, waited  # never early
        assert d.machine.stuck_reads == 1 and d.quarantined("r1")
        assert d.counters.get("quarantined") == 1
        # The engine returns the request's blocks: a no-op while quarantined.
        d.free_local("r1")
        assert d.local_blocks_free == 32 - 4
        assert p.pool.held_count == 4  # nothing told P: it still holds r1 (lease)
        ended: list[str] = []

        def unquarantined() -> bool:
            ended.extend(d.take_unquarantined())
            return bool(ended)

        pump(p, [d], unquarantined, timeout=10.0)
        assert ended == ["r1"]
        assert d.machine.stuck_reads == 0 and not d.quarantined("r1")
        assert d.local_blocks_free == 32
        assert d.machine.counters.get("quarantine_ended") == 1
        # P was never told done or release: its lease frees r1.
        clock.offset += 10.0
        pump(p, [d], lambda: p.pool.held_count == 0, timeout=10.0)
        assert p.ledger.frees.get("expired") == 1 and not p.ledger.frees.get("transferred")
        # No second pull of the same handle.
        d.admit("r1-again", params)
        again = pump(p, [d], lambda: True, timeout=1.0)
        assert [(c.request_id, c.reason) for c in again] == [("r1-again", "second_pull")]
    finally:
        d.close(timeout=1.0)
        p.close()
