"""The cost of P's gate (readiness and capability checks) on the ledger's hot path.

One workload, run with and without the gate in the same process: register ``n``
requests (expected 2), heartbeat every one in batches, then two readers' done for each.
With the gate every register carries its readiness mark and every message first
presents its consumer and capability (``Gate.present``): the first presentation of a
handle checks the HMAC and binds; the others find the binding. The figure is the ratio
of the two times (best of ``repeat``), so the machine's speed cancels out.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from kvproto.lifecycle import BlockPool, Config, Ledger
from kvproto.lifecycle.gate import Gate

BLOCKS = (1, 2, 3, 4)
KEY = b"bench-gate-key-0123456789abcdef!"


def _run(n: int, batch: int, gated: bool) -> tuple[float, float, float]:
    cfg = Config(max_tombstones=max(1024, n), max_staged=4096)
    L = Ledger(cfg, BlockPool(64))
    g = Gate(L, KEY, "P0", 1) if gated else None
    caps = [g.capability(h) for h in range(1, n + 1)] if g is not None else []
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        if g is not None:
            for h in range(1, n + 1):
                g.register(h, f"r{h}", BLOCKS, 0, ready=True, expected=2)
        else:
            for h in range(1, n + 1):
                L.register(h, f"r{h}", BLOCKS, 0, expected=2)
        t1 = time.perf_counter()
        now = 1000
        hs = list(range(1, n + 1))
        out: list[Any] = []
        for i in range(0, n, batch):
            chunk = hs[i:i + batch]
            if g is not None:
                chunk = [h for h in chunk if g.present("D0", h, caps[h - 1], out)]
            L.heartbeat("d0", i, chunk, 2, now)
        t2 = time.perf_counter()
        for reader in ("d0", "d1"):
            for h in hs:
                if g is None or g.present("D0", h, caps[h - 1], out):
                    L.done(reader, h, 2, now)
        t3 = time.perf_counter()
    finally:
        gc.enable()
    assert L.held_requests == 0 and not out
    return (t1 - t0, t2 - t1, t3 - t2)


def bench_gate(n: int = 100_000, batch: int = 512, repeat: int = 3) -> dict[str, float]:
    """Events per second with and without the gate, and their ratio (>= 1: the gate's
    cost). Events: n registers + n heartbeat ids + 2n dones."""
    runs_p = [_run(n, batch, False) for _ in range(repeat)]
    runs_g = [_run(n, batch, True) for _ in range(repeat)]
    plain = min(sum(r) for r in runs_p)
    gated = min(sum(r) for r in runs_g)
    events = 4 * n
    out = {"gate_events": events, "plain_events_per_s": round(events / plain),
           "gated_events_per_s": round(events / gated),
           "gate_cost_ratio": round(gated / plain, 2)}
    for i, phase in enumerate(("register", "heartbeat", "done")):
        out[f"gate_cost_ratio_{phase}"] = round(min(r[i] for r in runs_g) /
                                                min(r[i] for r in runs_p), 2)
    return out


if __name__ == "__main__":  # pragma: no cover
    import json
    print(json.dumps(bench_gate()))
