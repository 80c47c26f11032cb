"""``kvproto bench ledger``: the lifecycle hot path against a scanning reference.

Figures, not tests. Everything is measured in one run on this machine, and the speed
figures are also reported as ratios against a baseline measured in the same run:

* ``events_per_s``: done and heartbeat events (one event per request id) on one core,
  10^5 held, the dones in batches of ``done_batch`` handles (``Ledger.done_batch``, as
  P's port applies a wire done batch); ``reference_events_per_s`` the same events on
  ``ScanReference`` (the upstream shape), and ``events_ratio`` their ratio; best of
  ``repeat`` rounds each, the two alternating, also in thread CPU time
  (``events_cpu_ratio``); ``*_per_call`` (``events_ratio_per_call``,
  ``event_cpu_us_per_call``, ``done_per_call_per_s``...): the same round with one
  ``Ledger.done`` call per handle; ``owning_reference_events_per_s``: the same events on
  ``OwningReference``, the reference plus the block release it leaves to its caller (drop
  each block's reference count, report the freed request), ``owning_reference_ratio``
  (``owning_reference_cpu_ratio``) its speed over the reference's (what the block
  release alone costs the upstream shape), and ``events_ratio_owning`` the ledger's speed
  over the owning reference's;
* ``d_event_us``: D's machine alone, thread CPU microseconds per event over the four
  events on every request's path: admit (params with a capability), claim granted,
  schedule and read_result (``d_admit_us``, ``d_claim_granted_us``, ``d_schedule_us``,
  ``d_read_ok_us``), 5 * 10^4 requests, best of ``repeat`` rounds (``--d-only``: these
  alone, with their baseline); ``d_floor_us`` the same four events' data work alone
  (``bench_d_floor``: the record, index and heap entries, deadlines, effects and ended
  memory D's rows must build, inline with no call or dispatch), and ``d_over_floor``
  (``d_event_us`` over it): how far D's machine is above the work it cannot skip;
* with ``--baseline TREE``: the event figures of the kvproto tree at TREE (the previous
  tree) measured by this same bench code in a subprocess, alternating with this tree's
  rounds, as ``baseline_*``, and ``d_event_speedup`` / ``events_speedup`` (baseline cost
  over this tree's; ``events_speedup_per_call``: against this tree's one-call-per-done
  round);
* ``tick_us``: cost of one ``tick`` with n held requests, none due;
  ``scan_tick_us``: the same for the reference that scans every held request each tick
  (the upstream approach);
* ``bytes_per_request``: tracemalloc bytes per held request, excluding its block-id list
  and its request-id string (both owned by the engine, shared by reference);
* ``heartbeat_bytes_per_id``: wire bytes per request id in a heartbeat, against the
  upstream ``"HB:" + ",".join(ids)`` string format;
* ``worst_tick_ms_1e5`` / ``worst_tick_ms_1e6``: the longest single ``tick`` while 10^5
  (10^6) leases run out at the same instant (half of them renewed just before, so their
  heap entries are re-inserted lazily), at the default ``max_tick_work``; against
  ``unbounded_tick_ms_*``, the one tick that does all of it (no budget), in the same run;
  ``expiry_ticks_*`` ticks to drain them and ``expiry_lag_ms_*`` how late the last
  expiry came (ticks back to back, 1 ms apart); tick times are thread CPU time
  (``worst_tick_wall_ms_*``: wall time, which also counts other processes' load);
* ``d_worst_tick_ms_1e5`` / ``d_worst_tick_ms_1e6``: the same for D, the longest single
  ``Consumer.tick`` while 10^5 (10^6) waiting requests lose their lease at the same
  instant (half of them renewed by an ack, so their heap entries are re-inserted
  lazily), at the default ``max_tick_work``; against ``d_unbounded_tick_ms_*``, the one
  tick that fails them all (no budget), in the same run, and their ratio
  ``d_tick_ratio_*`` (unbounded over bounded); ``d_loss_ticks_*`` ticks to fail them all
  and ``d_loss_lag_ms_*`` how late the last loss came (ticks back to back);
* ``heap_entries_over_live``: the deadline heap's largest size over the held requests
  under churn (10^4 held, requests registered and transferred at 10^5/s, aborts);
  ``peak_heap_entries_churn``: its largest size under the same churn with nothing held
  (against ``peak_heap_entries_no_compaction``, the heap that is never rebuilt).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvproto import wire
from kvproto.lifecycle import (
    MAX_CAP,
    BlockPool,
    Config,
    Consumer,
    Finished,
    Free,
    Ledger,
    SendHeartbeat,
    TransferParams,
)

BLOCKS: tuple[int, ...] = (0, 1, 2, 3)  # shared by every request: not per-request memory


class ScanReference:
    """The upstream shape: a dict of deadlines scanned in full on every tick."""

    def __init__(self, lease: float, extension: float) -> None:
        self.lease = lease
        self.extension = extension
        self.deadlines: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def register(self, rid: str, now: float) -> None:
        self.deadlines[rid] = now + self.lease

    def heartbeat(self, rids: list[str], now: float) -> None:
        ext = now + self.extension
        d = self.deadlines
        for r in rids:
            if r in d and ext > d[r]:
                d[r] = ext

    def done(self, rid: str, expected: int) -> bool:
        c = self.counts.get(rid, 0) + 1
        if c >= expected:
            self.counts.pop(rid, None)
            self.deadlines.pop(rid, None)
            return True
        self.counts[rid] = c
        return False

    def tick(self, now: float) -> list[str]:
        expired = [r for r, dl in self.deadlines.items() if dl <= now]
        for r in expired:
            del self.deadlines[r]
        return expired


class OwningReference(ScanReference):
    """``ScanReference`` plus the work it leaves to its caller and the ledger does itself:
    on the last done, drop the request's blocks' reference counts and report the request
    and its blocks as freed (``freed``). Nothing else of the ledger (no reader identity,
    state, tombstone, effect object, clock check or journal hook): what owning the blocks
    adds to the upstream shape, written in the reference's own plain style."""

    def __init__(self, lease: float, extension: float, capacity: int = 64) -> None:
        super().__init__(lease, extension)
        self.rc = [0] * capacity
        self.blocks: dict[str, tuple[int, ...]] = {}
        self.freed: list[tuple[str, tuple[int, ...]]] = []

    def register_blocks(self, rid: str, blocks: tuple[int, ...], now: float) -> None:
        self.register(rid, now)
        self.blocks[rid] = blocks
        rc = self.rc
        for b in blocks:
            rc[b] += 1

    def done(self, rid: str, expected: int) -> bool:
        c = self.counts.get(rid, 0) + 1
        if c >= expected:
            self.counts.pop(rid, None)
            self.deadlines.pop(rid, None)
            blocks = self.blocks.pop(rid)
            rc = self.rc
            for b in blocks:
                rc[b] -= 1
            self.freed.append((rid, blocks))
            return True
        self.counts[rid] = c
        return False


def _ledger(n: int, capacity: int = 64) -> tuple[Ledger, list[int]]:
    cfg = Config(max_tombstones=max(1024, n), max_staged=4096)
    pool = BlockPool(capacity)
    L = Ledger(cfg, pool)
    hs = []
    for i in range(n):
        h = L.new_handle()
        L.register(h, f"r{i}", BLOCKS, 0, expected=2)
        hs.append(h)
    return L, hs


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


# Handles per done batch in the events round: a D sends the dones of the requests one
# coalesced READ fetched as one message, which P's port hands to ``Ledger.done_batch``.
DONE_BATCH = 32


def _events_once(n: int, batch: int,
                 done_batch: int | None = None) -> tuple[float, float, float, float]:
    """One round on the ledger: (heartbeat wall s, done wall s, heartbeat CPU s, done CPU s).
    ``done_batch``: the dones in batches of that many handles (``Ledger.done_batch``,
    what P's port calls for a wire done batch), else one ``done`` call per handle (also
    when the ledger has no ``done_batch``: a baseline tree)."""
    L, hs = _ledger(n)
    gc.collect()
    gc.disable()
    try:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        now = 1000  # ms
        for i in range(0, n, batch):
            L.heartbeat("d0", i, hs[i:i + batch], 2, now)
        t_hb = time.perf_counter() - t0
        c_hb = time.thread_time() - c0
        c0 = time.thread_time()
        t0 = time.perf_counter()
        if done_batch and hasattr(L, "done_batch"):
            for reader in ("d0", "d1"):
                for i in range(0, n, done_batch):
                    L.done_batch(reader, hs[i:i + done_batch], 2, now)
        else:
            for h in hs:
                L.done("d0", h, 2, now)
            for h in hs:
                L.done("d1", h, 2, now)
        t_done = time.perf_counter() - t0
        c_done = time.thread_time() - c0
    finally:
        gc.enable()
    assert L.held_requests == 0 and L.pool.held_count == 0
    return t_hb, t_done, c_hb, c_done


def _reference_once(n: int, batch: int, *, owning: bool = False) -> tuple[float, float]:
    """The same events on ScanReference, or with ``owning`` on OwningReference (its
    requests hold ``BLOCKS``): (wall s, CPU s)."""
    ref = OwningReference(30.0, 20.0) if owning else ScanReference(30.0, 20.0)
    rids = [f"r{i}" for i in range(n)]
    for r in rids:
        if isinstance(ref, OwningReference):
            ref.register_blocks(r, BLOCKS, 0.0)
        else:
            ref.register(r, 0.0)
    gc.collect()
    gc.disable()
    try:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            ref.heartbeat(rids[i:i + batch], 1.0)
        for r in rids:
            ref.done(r, 2)
        for r in rids:
            ref.done(r, 2)
        return time.perf_counter() - t0, time.thread_time() - c0
    finally:
        gc.enable()
        if isinstance(ref, OwningReference):
            assert len(ref.freed) == n and not any(ref.rc)


def bench_events(n: int = 100_000, batch: int = 512, repeat: int = 1) -> dict[str, float]:
    """Heartbeats for every held request, then two distinct readers' done for each; the
    same events on the scanning reference. Best of ``repeat`` rounds, alternating."""
    t_hb = t_done = c_hb = c_done = t_ref = c_ref = float("inf")
    t1_hb = t1_done = c1_hb = c1_done = float("inf")  # dones one call per handle
    t_own = c_own = float("inf")
    for _ in range(max(1, repeat)):
        a, b, c, d = _events_once(n, batch, DONE_BATCH)
        t_hb, t_done, c_hb, c_done = min(t_hb, a), min(t_done, b), min(c_hb, c), min(c_done, d)
        e, f = _reference_once(n, batch)
        t_ref, c_ref = min(t_ref, e), min(c_ref, f)
        e, f = _reference_once(n, batch, owning=True)
        t_own, c_own = min(t_own, e), min(c_own, f)
        a, b, c, d = _events_once(n, batch)
        t1_hb, t1_done, c1_hb, c1_done = min(t1_hb, a), min(t1_done, b), min(c1_hb, c), \
            min(c1_done, d)
    events = 3 * n
    return {
        "done_batch": DONE_BATCH,
        "done_per_call_per_s": 2 * n / t1_done,
        "events_per_call_per_s": events / (t1_hb + t1_done),
        "events_ratio_per_call": t_ref / (t1_hb + t1_done),
        "events_cpu_ratio_per_call": c_ref / (c1_hb + c1_done),
        "event_cpu_us_per_call": (c1_hb + c1_done) / events * 1e6,
        "events_per_s": events / (t_hb + t_done),
        "heartbeat_ids_per_s": n / t_hb,
        "done_per_s": 2 * n / t_done,
        "reference_events_per_s": events / t_ref,
        "events_ratio": t_ref / (t_hb + t_done),
        "events_cpu_ratio": c_ref / (c_hb + c_done),
        "event_cpu_us": (c_hb + c_done) / events * 1e6,
        "reference_event_cpu_us": c_ref / events * 1e6,
        "owning_reference_events_per_s": events / t_own,
        "owning_reference_ratio": t_ref / t_own,
        "owning_reference_cpu_ratio": c_ref / c_own,
        "events_ratio_owning": t_own / (t_hb + t_done),
    }


def _d_requests(n: int, claim: bool) -> tuple[list[TransferParams], list[str]]:
    """The D benches' n requests of one P engine: params (with a capability when
    ``claim``; without, no ``capability`` argument at all, so a tree older than the claim
    builds them too) and request ids."""
    if claim:
        params = [TransferParams("P0", 1, h, BLOCKS, 30_000, capability="ab" * 16)
                  for h in range(n)]
    else:
        params = [TransferParams("P0", 1, h, BLOCKS, 30_000) for h in range(n)]
    return params, [f"r{h}" for h in range(n)]


def bench_d_events(n: int = 50_000, repeat: int = 1, claim: bool = True) -> dict[str, float]:
    """D's machine alone: n requests of one ready P engine, each admitted with a
    capability (so claiming), granted, scheduled and read (the done sent by the
    machine: ``notif_attached=False``): the four events on every request's path, in
    batches of 512 (at most 512 in flight). Thread CPU microseconds per event, best of
    ``repeat`` rounds. ``claim=False``: params without a capability (a P without the
    gate), so the three events admit, schedule and read ok (no ``d_claim_granted_us``);
    a tree older than the claim runs these too."""
    phases = 4 if claim else 3
    best = [float("inf")] * phases
    for _ in range(max(1, repeat)):
        c = Consumer("d0", Config())
        c.handshake_result("P0", True, 0)
        params, rids = _d_requests(n, claim)
        spent = [0.0] * phases
        gc.collect()
        gc.disable()
        try:
            for i in range(0, n, 512):
                part = range(i, min(n, i + 512))
                now = 1 + i // 512
                t = [time.thread_time()]
                for k in part:
                    c.admit(rids[k], params[k], now)
                t.append(time.thread_time())
                if claim:
                    for k in part:
                        c.claim_result(rids[k], True, now)
                    t.append(time.thread_time())
                for k in part:
                    c.schedule(rids[k], now)
                t.append(time.thread_time())
                for k in part:
                    c.read_result(rids[k], True, now, notif_attached=False)
                t.append(time.thread_time())
                for j in range(phases):
                    spent[j] += t[j + 1] - t[j]
        finally:
            gc.enable()
        assert not c.reqs and c.finished.get("done:pulled") == n
        best = [min(b, x) for b, x in zip(best, spent, strict=True)]
    us = [b / n * 1e6 for b in best]
    out = {"d_admit_us": us[0], "d_schedule_us": us[-2], "d_read_ok_us": us[-1],
           "d_event_us": sum(us) / phases}
    if claim:
        out["d_claim_granted_us"] = us[1]
    return out


class _FloorReq:
    """D's request record as the machine builds it (``consumer._DReq``'s slots and
    constructor), for ``bench_d_floor``."""

    __slots__ = ("abort_pending", "lease_end", "params", "rid", "state")

    def __init__(self, rid: str, params: TransferParams, lease_end: int) -> None:
        self.rid = rid
        self.params = params
        self.lease_end = lease_end
        self.state = "new"
        self.abort_pending = False


def bench_d_floor(n: int = 50_000, repeat: int = 1, claim: bool = True,
                  collect: list[list[Any]] | None = None) -> dict[str, float]:
    """The floor under ``bench_d_events``: the same four events on the same requests, with
    only the data work D's rows must do per request, written inline as one loop per
    event with every name hoisted: no method call, table row, guard, clock check or
    journal hook. What stays is what the rows ``admit/claim``, ``claim_granted/granted``,
    ``schedule/lease_covers_read`` and ``read_ok/ok`` do: the request record (``_FloorReq``,
    the slots and constructor of D's own) and its two index entries, the lease-heap entry and its compaction check,
    the READ deadline and its heap entry, the effects D must return (``SendClaim``,
    ``PostRead``, ``SendDone``, ``Finished``), the ended-load memory, the finish count.
    ``claim=False``: the three events of params without a capability (``admit/peer_ready``
    makes the request waiting, with no effect). With ``collect`` every event's effect list is appended to it (tests compare them with
    the machine's); the branch that checks it is the only work the machine lacks.
    Thread CPU microseconds per event, best of ``repeat`` rounds: ``d_floor_us``.
    """
    from kvproto.lifecycle.dstep import IDLE
    from kvproto.lifecycle.dvocab import PostRead, SendClaim, SendDone
    from kvproto.lifecycle.producer import HEAP_SLACK
    from kvproto.lifecycle.quarantine import MAX_ENDED
    from kvproto.lifecycle.table import CLAIMING, D_DONE, READING, WAITING

    ms = Config().ms
    fit = ms.max_read_time + ms.clock_drift
    span = ms.max_read_time + ms.read_grace
    max_delay = ms.max_delay
    params, rids = _d_requests(n, claim)
    phases = 4 if claim else 3
    best = [float("inf")] * phases
    heappush = heapq.heappush
    for _ in range(max(1, repeat)):
        reqs: dict[str, Any] = {}
        peer_reqs: dict[int, Any] = {}
        lease_heap: list[tuple[int, str]] = []
        due: dict[str, int] = {}
        read_heap: list[tuple[int, str]] = []
        ended: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        finished: dict[str, int] = {}
        spent = [0.0] * phases
        gc.collect()
        gc.disable()
        try:
            for i in range(0, n, 512):
                part = range(i, min(n, i + 512))
                now = 1 + i // 512
                t = [time.thread_time()]
                for k in part:
                    rid = rids[k]
                    p = params[k]
                    if rid in reqs or p.handle in peer_reqs \
                            or (p.engine, p.epoch, p.handle) in ended:
                        raise AssertionError(rid)
                    le = now + p.initial_term - max_delay
                    r = _FloorReq(rid, p, le)
                    reqs[rid] = r
                    peer_reqs[p.handle] = r
                    if now + fit > le:
                        raise AssertionError(rid)
                    heappush(lease_heap, (le, rid))
                    if claim:
                        r.state = CLAIMING
                        out: list[Any] = [SendClaim(rid, p.engine, p.handle, p.capability)]
                    else:
                        r.state = WAITING
                        out = []
                    if collect is not None:
                        collect.append(out)
                t.append(time.thread_time())
                if claim:
                    for k in part:
                        r = reqs[rids[k]]
                        r.state = WAITING
                        out = []
                        if collect is not None:
                            collect.append(out)
                    t.append(time.thread_time())
                for k in part:
                    rid = rids[k]
                    r = reqs[rid]
                    p = r.params
                    if now + fit > r.lease_end:
                        raise AssertionError(rid)
                    r.state = READING
                    d = now + span
                    due[rid] = d
                    heappush(read_heap, (d, rid))
                    out = [PostRead(rid, p.engine, p.handle, p.blocks, p.expected)]
                    if collect is not None:
                        collect.append(out)
                t.append(time.thread_time())
                for k in part:
                    rid = rids[k]
                    r = reqs[rid]
                    p = r.params
                    r.state = D_DONE
                    out = [SendDone(rid, p.engine, p.handle, p.expected)]
                    del reqs[rid]
                    due.pop(rid, None)
                    ended[(p.engine, p.epoch, p.handle)] = None
                    if len(ended) > MAX_ENDED:
                        ended.popitem(last=False)
                    h = len(lease_heap)
                    if h > 2 * len(reqs) and h > HEAP_SLACK:
                        lease_heap[:] = [(q.lease_end, q.rid) for q in reqs.values()
                                         if q.state in IDLE]
                        heapq.heapify(lease_heap)
                    if peer_reqs.get(p.handle) is r:
                        del peer_reqs[p.handle]
                    finished["done:pulled"] = finished.get("done:pulled", 0) + 1
                    out.append(Finished(rid, D_DONE, "pulled"))
                    if collect is not None:
                        collect.append(out)
                t.append(time.thread_time())
                for j in range(phases):
                    spent[j] += t[j + 1] - t[j]
        finally:
            gc.enable()
        assert not reqs and finished.get("done:pulled") == n
        best = [min(b, x) for b, x in zip(best, spent, strict=True)]
    return {"d_floor_us": sum(best) / (phases * n) * 1e6}


_BASELINE_CODE = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("kvproto_bench_ledger_copy", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
out = m.bench_events(int(sys.argv[2]), repeat=int(sys.argv[3])) if int(sys.argv[2]) else {}
out.update(m.bench_d_events(int(sys.argv[4]), repeat=int(sys.argv[3]),
                            claim=sys.argv[5] == "1"))
# Every kvproto module measured must be the tree's own: an installed (editable) kvproto
# can supply a module the tree lacks, which would mix the two trees silently.
root = os.path.join(os.getcwd(), "kvproto") + os.sep
alien = sorted(n for n, mod in list(sys.modules.items()) if n.split(".")[0] == "kvproto"
               and getattr(mod, "__file__", None)
               and not os.path.abspath(mod.__file__).startswith(root))
if alien:
    sys.exit(f"ImportError: modules not from the tree: {', '.join(alien[:5])}")
print(json.dumps(out))
"""


def bench_baseline(tree: str, n: int, d_n: int, repeat: int,
                   claim: bool = True) -> dict[str, float]:
    """This file's event benches run on the kvproto tree at ``tree`` (a checkout of the
    previous tree: its ``kvproto`` package first on the path), in a subprocess."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    res = subprocess.run([sys.executable, "-c", _BASELINE_CODE, os.path.abspath(__file__),
                          str(n), str(repeat), str(d_n), "1" if claim else "0"], env=env, cwd=os.path.abspath(tree),
                         capture_output=True, text=True, check=False, timeout=1800)
    if res.returncode != 0:
        from kvproto.errors import UsageError  # here: the file also runs on a baseline tree

        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        hint = (" (a tree older than the claim: add --no-claim)"
                if claim and "capability" in last else "")
        raise UsageError(f"--baseline {tree}: this bench cannot run on that tree: "
                         f"{last}{hint}")
    out: dict[str, float] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def bench_tick(ns: list[int]) -> tuple[dict[str, float], dict[str, float]]:
    tick_us: dict[str, float] = {}
    scan_us: dict[str, float] = {}
    for n in ns:
        L, _ = _ledger(n)
        iters = 20000

        def run_ledger(L: Ledger = L, iters: int = iters) -> float:
            t0 = time.perf_counter()
            for k in range(iters):
                L.tick(1000 + k)  # ms: 20 s at most, below the 30 s lease
            return (time.perf_counter() - t0) / iters * 1e6

        tick_us[str(n)] = round(_best(run_ledger, 3), 3)
        assert L.held_requests == n  # nothing expired
        del L
        ref = ScanReference(30.0, 20.0)
        for i in range(n):
            ref.register(f"r{i}", 0.0)
        iters_ref = max(3, min(2000, 2_000_000 // n))

        def run_ref(ref: ScanReference = ref, iters: int = iters_ref) -> float:
            t0 = time.perf_counter()
            for k in range(iters):
                ref.tick(1.0 + k * 1e-6)
            return (time.perf_counter() - t0) / iters * 1e6

        scan_us[str(n)] = round(_best(run_ref, 2), 3)
        del ref
        gc.collect()
    return tick_us, scan_us


def bench_memory(n: int) -> dict[str, float]:
    """tracemalloc bytes per held request (block list and request-id string excluded)."""
    cfg = Config(max_tombstones=1024)
    rids = [f"cmpl-{uuid.UUID(int=i)}-0" for i in range(n)]  # engine-owned strings
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = BlockPool(64)
    L = Ledger(cfg, pool)
    for i in range(n):
        L.register(L.new_handle(), rids[i], BLOCKS, 0, expected=2)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert L.held_requests == n
    return {"bytes_per_request": round(used / n, 1), "held_requests": n,
            "total_mib": round(used / 2**20, 1)}


def bench_heartbeat_bytes(inflight: int = 10_000, window: int = 100_000,
                          max_bytes: int = 4096) -> dict[str, float]:
    rng = random.Random(7)
    base = 10_000_000
    handles = sorted(rng.sample(range(base, base + window), inflight))
    msgs = wire.encode_heartbeat(1234, 1, handles, 2, max_bytes)
    ours = sum(len(m) for m in msgs) / inflight
    ids = [f"cmpl-{uuid.UUID(int=rng.getrandbits(128))}-0" for _ in range(inflight)]
    upstream = len(("HB:" + ",".join(ids)).encode()) / inflight
    return {"heartbeat_bytes_per_id": round(ours, 3), "upstream_heartbeat_bytes_per_id":
            round(upstream, 1), "heartbeat_messages": len(msgs)}


def bench_mass_expiry(n: int, budget: int | None) -> dict[str, float]:
    """n leases run out at t=30; half were renewed at t=10 (deadline 30 on the heap,
    40 in the request: a lazy re-insert). Ticks back to back (1 ms apart, the clock's
    resolution, as an engine step loop that sees ``next_deadline()`` in the past would)
    until every due entry is processed. GC is off while ticking (a full collection over 10^6 objects is the
    runtime's pause, not the tick's work). The worst tick is measured in thread CPU time
    (the tick's own work; wall time also counts other processes on a loaded machine),
    and in wall time."""
    cfg = Config(max_tick_work=MAX_CAP if budget is None else budget)  # default caps
    L = Ledger(cfg, BlockPool(64))
    hs = [L.new_handle() for _ in range(n)]
    for i, h in enumerate(hs):
        L.register(h, f"r{i}", BLOCKS, 0, expected=1)
    half = hs[: n // 2]
    for i in range(0, len(half), 512):
        L.heartbeat("d0", i, half[i:i + 512], 1, 10_000)  # deadline 30 s -> 30 s (no change)
    for i in range(0, len(half), 512):
        L.heartbeat("d0", i, half[i:i + 512], 1, 20_000)  # deadline -> 40 s: re-insert at 30
    gc.collect()
    gc.disable()
    worst = worst_wall = 0.0
    ticks = 0
    freed = 0
    now = 30_000  # ms
    try:
        while True:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = L.tick(now)
            dt = time.perf_counter() - t0
            worst = max(worst, time.thread_time() - c0)
            worst_wall = max(worst_wall, dt)
            ticks += 1
            freed += sum(1 for e in out if isinstance(e, Free))
            nxt = L.next_deadline()
            if nxt is None or nxt > now:
                break
            now += 1
    finally:
        gc.enable()
    assert freed == n - len(half) and L.held_requests == len(half)
    return {"worst_tick_ms": round(worst * 1e3, 3), "worst_tick_wall_ms": round(worst_wall * 1e3, 3),
            "ticks": ticks, "lag_ms": now - 30_000}


def bench_d_lease_loss(n: int, budget: int | None) -> dict[str, float]:
    """n waiting requests of one P engine lose their lease at once. Each is admitted at
    t=0 with an initial term of 8 s (lease end 7 s: it can no longer cover a READ once
    7 - max_read_time - clock_drift = 1.5 s have passed); the first half is named by the
    heartbeat of t=0 and renewed by its ack (lease end 19.5 s, heap entry still at 7 s: a
    lazy re-insert). Ticks from t=2 s back to back (1 ms apart, as P's mass-expiry bench
    ticks, for an adapter that sees ``next_deadline()`` in the past) until no loss is due; no heartbeat falls due
    meanwhile (the next is at 5 s), so the ticks measure the lease check alone. GC off
    while ticking; the worst tick in thread CPU time and in wall time."""
    c = Consumer("d0", Config(max_tick_work=MAX_CAP if budget is None else budget))
    c.handshake_result("P0", True, 0)
    half = n // 2

    def admit(lo: int, hi: int) -> None:
        for h in range(lo, hi):
            c.admit(f"r{h}", TransferParams("P0", 1, h, BLOCKS, 8000), 0)

    admit(0, half)
    for e in c.tick(0):
        if isinstance(e, SendHeartbeat):
            c.ack("P0", e.seq, 20_000, (), 0)
    admit(half, n)
    gc.collect()
    gc.disable()
    worst = worst_wall = 0.0
    ticks = lost = 0
    now = 2000  # ms
    try:
        while True:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = c.tick(now)
            dt = time.perf_counter() - t0
            worst = max(worst, time.thread_time() - c0)
            worst_wall = max(worst_wall, dt)
            ticks += 1
            lost += sum(1 for e in out if isinstance(e, Finished))
            if c.next_deadline() > now:
                break
            now += 1
    finally:
        gc.enable()
    assert lost == n - half and len(c.reqs) == half
    return {"worst_tick_ms": round(worst * 1e3, 3), "worst_tick_wall_ms": round(worst_wall * 1e3, 3),
            "ticks": ticks, "lag_ms": now - 2000}


def bench_churn(n: int, held: int, *, compact: bool = True) -> dict[str, float]:
    """Churn at 10^5 requests/s (simulated time): each request registered and
    transferred at once, every 10th one aborted first (an abort pushes an early heap
    entry); ``held`` long-lived requests stay held throughout."""
    L = Ledger(Config(max_tombstones=1024), BlockPool(64))
    if not compact:
        L._maybe_compact = lambda: None  # type: ignore[method-assign]  # a heap never rebuilt
    now = 0  # ms
    for i in range(held):
        L.register(L.new_handle(), f"held{i}", BLOCKS, now, expected=1)
        L.heartbeat("d0", i, (i + 1,), 1, now)
    peak = 0
    ratio = 0.0
    for i in range(n):
        now = i // 100  # 100 requests per ms
        h = L.new_handle()
        rid = f"c{i}"
        L.register(h, rid, BLOCKS, now, expected=1)
        if i % 10 == 0:
            L.abort(rid, now)
        L.done("d0", h, 1, now)
        if i % 97 == 0:
            e = L.heap_entries
            peak = max(peak, e)
            if L.held_requests:
                ratio = max(ratio, e / L.held_requests)
            nxt = L.next_deadline()
            if nxt is not None and nxt <= now:
                L.tick(now)
    assert L.held_requests == held
    return {"peak_heap_entries": peak, "entries_over_live": round(ratio, 3),
            "rebuilds": L.counters.get("heap_rebuilt", 0)}


def run_d_only(quick: bool = False, progress: Callable[[str], None] | None = None,
               baseline: str | None = None, repeat: int = 5,
               claim: bool = True) -> dict[str, Any]:
    """D's event figures alone (``bench_d_events``) and their floor (``bench_d_floor``),
    alternating with the baseline tree's; ``claim=False``: the three events without a
    capability. With a baseline, ``baseline_half_over_floor`` is half the baseline's cost
    per event over this tree's floor: below 1, halving the baseline's cost needs less
    than the data work the events must do."""
    say = progress or (lambda s: None)
    d_n = 5_000 if quick else 50_000
    rounds = 1 if quick else repeat
    ev: dict[str, float] = {}
    base: dict[str, float] = {}
    for _ in range(2 if baseline else 1):
        if baseline:
            say(f"baseline tree {baseline}: D events")
            for k, v in bench_baseline(baseline, 0, d_n, rounds, claim=claim).items():
                base[k] = min(base[k], v) if k in base else v
        say("D events, and their floor")
        got = {**bench_d_events(d_n, repeat=rounds, claim=claim),
               **bench_d_floor(d_n, repeat=rounds, claim=claim)}
        for k, v in got.items():
            ev[k] = min(ev[k], v) if k in ev else v
    ev["d_over_floor"] = ev["d_event_us"] / ev["d_floor_us"]
    out: dict[str, Any] = {k: round(v, 3) for k, v in ev.items()}
    if base:
        out.update({f"baseline_{k}": round(v, 3) for k, v in base.items()})
        out["d_event_speedup"] = round(base["d_event_us"] / ev["d_event_us"], 3)
        out["baseline_half_over_floor"] = round(base["d_event_us"] / 2 / ev["d_floor_us"], 3)
    out["events"] = 4 if claim else 3
    return out


def run_all(quick: bool = False, progress: Callable[[str], None] | None = None,
            baseline: str | None = None, repeat: int = 5) -> dict[str, Any]:
    say = progress or (lambda s: None)
    ns = [1000, 10_000] if quick else [1000, 10_000, 100_000, 1_000_000]
    ev_n = 10_000 if quick else 100_000
    d_n = 5_000 if quick else 50_000
    rounds = 1 if quick else repeat
    ev: dict[str, float] = {}
    base: dict[str, float] = {}
    for _ in range(2 if baseline else 1):  # alternate with the baseline tree
        if baseline:
            say(f"baseline tree {baseline}: events and D events")
            for k, v in bench_baseline(baseline, ev_n, d_n, rounds).items():
                better = max if k.endswith(("_per_s", "_ratio")) else min
                base[k] = better(base[k], v) if k in base else v
        say(f"events: heartbeat + done on {ev_n} held requests; D events")
        got = {**bench_events(ev_n, repeat=rounds), **bench_d_events(d_n, repeat=rounds),
               **bench_d_floor(d_n, repeat=rounds)}
        for k, v in got.items():
            better = max if k.endswith(("_per_s", "_ratio")) else min
            ev[k] = better(ev[k], v) if k in ev else v
    ev["d_over_floor"] = ev["d_event_us"] / ev["d_floor_us"]
    if base:
        ev.update({f"baseline_{k}": v for k, v in base.items()})
        ev["d_event_speedup"] = base["d_event_us"] / ev["d_event_us"]
        if "event_cpu_us" in base:
            ev["events_speedup"] = base["event_cpu_us"] / ev["event_cpu_us"]
            ev["events_speedup_per_call"] = base.get("event_cpu_us_per_call",
                                                     base["event_cpu_us"]) / ev["event_cpu_us_per_call"]
    say("tick: none due, n = " + ", ".join(map(str, ns)))
    tick_us, scan_us = bench_tick(ns)
    mem_n = 10_000 if quick else 1_000_000
    say(f"memory: {mem_n} held requests under tracemalloc")
    mem = bench_memory(mem_n)
    say("heartbeat wire bytes")
    hb = bench_heartbeat_bytes()
    expiry: dict[str, Any] = {"tick_budget": Config().max_tick_work}
    for label, n in (("1e5", 10_000 if quick else 100_000), ("1e6", 20_000 if quick else 1_000_000)):
        say(f"mass expiry: {n} leases at once, default budget and unbounded")
        b = bench_mass_expiry(n, Config().max_tick_work)
        u = bench_mass_expiry(n, None)
        expiry[f"worst_tick_ms_{label}"] = b["worst_tick_ms"]
        expiry[f"worst_tick_wall_ms_{label}"] = b["worst_tick_wall_ms"]
        expiry[f"expiry_ticks_{label}"] = b["ticks"]
        expiry[f"expiry_lag_ms_{label}"] = b["lag_ms"]
        expiry[f"unbounded_tick_ms_{label}"] = u["worst_tick_ms"]
        gc.collect()
        say(f"D lease loss: {n} leases at once, default budget and unbounded")
        b = bench_d_lease_loss(n, Config().max_tick_work)
        gc.collect()
        u = bench_d_lease_loss(n, None)
        expiry[f"d_worst_tick_ms_{label}"] = b["worst_tick_ms"]
        expiry[f"d_worst_tick_wall_ms_{label}"] = b["worst_tick_wall_ms"]
        expiry[f"d_loss_ticks_{label}"] = b["ticks"]
        expiry[f"d_loss_lag_ms_{label}"] = b["lag_ms"]
        expiry[f"d_unbounded_tick_ms_{label}"] = u["worst_tick_ms"]
        expiry[f"d_tick_ratio_{label}"] = round(u["worst_tick_ms"] / max(b["worst_tick_ms"], 1e-3), 1)
        gc.collect()
    churn_n = 100_000 if quick else 1_000_000
    say(f"churn: {churn_n} requests at 10^5/s, 10^4 held / nothing held / no compaction")
    held = bench_churn(churn_n, 10_000)
    none = bench_churn(churn_n, 0)
    old = bench_churn(churn_n // 4, 0, compact=False)
    expiry.update({
        "heap_entries_over_live": held["entries_over_live"],
        "peak_heap_entries_churn": none["peak_heap_entries"],
        "peak_heap_entries_no_compaction": old["peak_heap_entries"],
        "churn_requests": churn_n, "no_compaction_requests": churn_n // 4,
    })
    from kvproto.bench.gate import bench_gate  # here: a baseline tree may lack it

    say("gate: the same events with and without readiness and capability checks")
    gate = bench_gate(10_000 if quick else 100_000)
    key = "100000" if "100000" in tick_us else max(tick_us, key=int)
    out: dict[str, Any] = {
        **gate,
        **{k: round(v) if k.endswith("_per_s") else round(v, 3) for k, v in ev.items()},
        "tick_us": tick_us,
        "scan_tick_us": scan_us,
        "tick_speedup_vs_scan": {n: round(scan_us[n] / tick_us[n], 1) for n in tick_us},
        "tick_flatness": round(tick_us[max(tick_us, key=int)] / tick_us[min(tick_us, key=int)], 2),
        "speedup_at": key,
        **mem,
        **hb,
        **expiry,
        "python": sys.version.split()[0],
    }
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number

    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="small sizes (for smoke tests)")
    p.add_argument("--baseline", metavar="TREE",
                   help="also run the event benches on the kvproto tree at TREE (the previous "
                        "tree), alternating with this one, and print the speedups")
    p.add_argument("--d-only", action="store_true",
                   help="only D's event figures (with --baseline: and the baseline's)")
    p.add_argument("--no-claim", action="store_true",
                   help="with --d-only: admit without a capability, so the three events "
                        "admit, schedule and read ok (a baseline tree older than the claim "
                        "runs these too)")
    p.add_argument("--repeat", type=number(1, 1000, integer=True), default=5,
                   help="rounds of the event benches, 1-1000; the best is kept (default 5)")


def run(args: argparse.Namespace) -> int:
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "kvproto")):
        print(f"kvproto bench ledger: --baseline {args.baseline}: no kvproto package there",
              file=sys.stderr)
        return 2
    if args.no_claim and not args.d_only:
        print("kvproto bench ledger: --no-claim needs --d-only", file=sys.stderr)
        return 2
    say = lambda s: print(f"[bench ledger] {s}", file=sys.stderr)  # noqa: E731
    if args.d_only:
        res = run_d_only(args.quick, progress=say, baseline=args.baseline,
                         repeat=args.repeat, claim=not args.no_claim)
        print(json.dumps(res, sort_keys=True))
        return 0
    res = run_all(args.quick, progress=say, baseline=args.baseline, repeat=args.repeat)
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    print("kvproto bench ledger (one core; ratios against a baseline in the same run)")
    print(f"  events/s (done + heartbeat ids)   {res['events_per_s']:>12,}   target >= 500,000")
    print(f"    heartbeat ids/s                 {res['heartbeat_ids_per_s']:>12,}")
    print(f"    done/s                          {res['done_per_s']:>12,}")
    print(f"    scanning reference events/s     {res['reference_events_per_s']:>12,}")
    print(f"    ratio to the reference          {res['events_ratio']:>12}   target >= 0.9 "
          f"(CPU time: {res['events_cpu_ratio']}; dones in batches of {res['done_batch']})")
    print(f"    the same, one done call per handle {res['events_ratio_per_call']:>9}   "
          f"(CPU time: {res['events_cpu_ratio_per_call']}; done/s {res['done_per_call_per_s']:,})")
    print(f"    reference that frees its blocks {res['owning_reference_ratio']:>12}   "
          f"of the reference (CPU time: {res['owning_reference_cpu_ratio']}); the ledger is "
          f"{res['events_ratio_owning']} of it")
    print(f"  D events, CPU us per event        {res['d_event_us']:>12}   admit "
          f"{res['d_admit_us']}, claim granted {res['d_claim_granted_us']}, schedule {res['d_schedule_us']}, read ok {res['d_read_ok_us']}")
    print(f"    floor: the same data work inline {res['d_floor_us']:>11}   D costs "
          f"{res['d_over_floor']}x its floor")
    if "baseline_d_event_us" in res:
        print(f"    baseline tree: D us per event   {res['baseline_d_event_us']:>12}   "
              f"speedup {res['d_event_speedup']:.2f}x")
        if "events_speedup" in res:
            print(f"    baseline tree: P us per event   {res['baseline_event_cpu_us']:>12}   "
                  f"speedup {res['events_speedup']:.2f}x (this tree "
                  f"{res['event_cpu_us']})")
    print("  tick, none due (us):      n    kvproto    scan-ref   speedup")
    for n in res["tick_us"]:
        print(f"                    {int(n):>10,} {res['tick_us'][n]:>10.3f} "
              f"{res['scan_tick_us'][n]:>11.1f} {res['tick_speedup_vs_scan'][n]:>8.1f}x")
    print(f"  tick flatness (largest n / smallest n)  {res['tick_flatness']}x   target ~1")
    print(f"  bytes per held request            {res['bytes_per_request']:>12}   target <= 200 "
          f"({res['held_requests']:,} held: {res['total_mib']} MiB)")
    print(f"  heartbeat bytes per id            {res['heartbeat_bytes_per_id']:>12}   target <= 12 "
          f"(upstream string format: {res['upstream_heartbeat_bytes_per_id']})")
    print(f"  gate (readiness + capability) cost  {res['gate_cost_ratio']:>10}x   "
          f"register {res['gate_cost_ratio_register']}x, heartbeat "
          f"{res['gate_cost_ratio_heartbeat']}x, done {res['gate_cost_ratio_done']}x, "
          f"claim (MAC + bind) {res['gate_claim_us']} us per request")
    print(f"  worst tick, mass expiry (CPU ms)  budget {res['tick_budget']}   unbounded")
    for label in ("1e5", "1e6"):
        print(f"    {label} leases at once          {res[f'worst_tick_ms_{label}']:>12.3f} "
              f"{res[f'unbounded_tick_ms_{label}']:>11.1f}   target <= 5 "
              f"({res[f'expiry_ticks_{label}']} ticks, last expiry "
              f"{res[f'expiry_lag_ms_{label}']} ms late)")
    print(f"  D worst tick, mass lease loss (CPU ms)  budget {res['tick_budget']}   unbounded")
    for label in ("1e5", "1e6"):
        print(f"    {label} leases at once          {res[f'd_worst_tick_ms_{label}']:>12.3f} "
              f"{res[f'd_unbounded_tick_ms_{label}']:>11.1f}   {res[f'd_tick_ratio_{label}']}x "
              f"({res[f'd_loss_ticks_{label}']} ticks, last loss "
              f"{res[f'd_loss_lag_ms_{label}']} ms late)")
    print(f"  heap entries / held under churn   {res['heap_entries_over_live']:>12}   target <= 2")
    print(f"  peak heap entries, nothing held   {res['peak_heap_entries_churn']:>12,}   "
          f"never rebuilt: {res['peak_heap_entries_no_compaction']:,} "
          f"after {res['no_compaction_requests']:,} requests")
    return 0
