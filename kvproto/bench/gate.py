"""The cost of P's gate (readiness and capability checks) on P's intake.

One workload, run with and without the gate in the same process: register ``n``
requests (expected 2), heartbeat every one in batches, then two readers' done for each.
With the gate, every register carries its readiness mark and goes through
``Gate.register``; each request's consumer presents its capability once
(``Gate.claim``: a MAC and a binding), and every heartbeat and done goes through the
gate's intake with the consumer (``Gate.heartbeat``/``Gate.done``: the binding check),
as P's port runs them. The figures are ratios of the two times (best of ``repeat``
rounds, the two alternating), so the machine's speed cancels out; times are thread CPU
time (on a loaded machine wall time also counts other processes).
"""

from __future__ import annotations

import gc
import time

from kvproto.lifecycle import BlockPool, Config, Ledger
from kvproto.lifecycle.gate import Gate

BLOCKS = (1, 2, 3, 4)
KEY = b"bench-gate-key-0123456789abcdef!"
PHASES = ("register", "claim", "heartbeat", "done")


def _run(n: int, batch: int, gated: bool) -> tuple[float, ...]:
    cfg = Config(max_tombstones=max(1024, n), max_staged=4096)
    L = Ledger(cfg, BlockPool(64))
    g = Gate(L, KEY, "P0", 1)
    caps = [g.capability(h) for h in range(1, n + 1)]
    hs = list(range(1, n + 1))
    now = 1000
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        if gated:
            for h in hs:
                g.register(h, f"r{h}", BLOCKS, 0, ready=True, expected=2)
        else:
            for h in hs:
                L.register(h, f"r{h}", BLOCKS, 0, expected=2)
        t1 = time.thread_time()
        if gated:
            for h in hs:
                g.claim("D0", h, caps[h - 1], now)
        t2 = time.thread_time()
        if gated:
            for i in range(0, n, batch):
                g.heartbeat("d0", i, hs[i:i + batch], 2, now, "D0")
        else:
            for i in range(0, n, batch):
                L.heartbeat("d0", i, hs[i:i + batch], 2, now)
        t3 = time.thread_time()
        if gated:
            for reader in ("d0", "d1"):
                for h in hs:
                    g.done(reader, h, 2, now, "D0")
        else:
            for reader in ("d0", "d1"):
                for h in hs:
                    L.done(reader, h, 2, now)
        t4 = time.thread_time()
    finally:
        gc.enable()
    assert L.held_requests == 0 and len(g) == 0
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3)


def bench_gate(n: int = 100_000, batch: int = 512, repeat: int = 3) -> dict[str, float]:
    """Events per second with and without the gate, and their ratios (>= 1: the gate's
    cost). Events: n registers, n heartbeat ids, 2n dones (plus n claims, gated only)."""
    runs_p: list[tuple[float, ...]] = []
    runs_g: list[tuple[float, ...]] = []
    for _ in range(repeat):  # alternating, so a change in the machine's load hits both
        runs_p.append(_run(n, batch, False))
        runs_g.append(_run(n, batch, True))
    plain = min(sum(r) for r in runs_p)
    gated = min(sum(r) for r in runs_g)
    events = 4 * n
    best_p = [min(r[i] for r in runs_p) for i in range(len(PHASES))]
    best_g = [min(r[i] for r in runs_g) for i in range(len(PHASES))]
    out: dict[str, float] = {
        "gate_events": events, "plain_events_per_s": round(events / plain),
        "gated_events_per_s": round(events / gated),
        "gate_cost_ratio": round(gated / plain, 2),
        "gate_claim_us": round(best_g[1] / n * 1e6, 2)}
    for i, phase in enumerate(PHASES):
        if phase != "claim":
            out[f"gate_cost_ratio_{phase}"] = round(best_g[i] / best_p[i], 2)
    return out


if __name__ == "__main__":  # pragma: no cover
    import json
    print(json.dumps(bench_gate()))
