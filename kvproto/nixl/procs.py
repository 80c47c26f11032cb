"""P and D engine processes for the demo and the cross-process tests.

Each process owns one adapter and runs its step loop; a ``multiprocessing`` pipe to the
parent (the "router") carries commands in and reports out, as plain tuples and dicts
(no pickled objects from NIXL peers: the pipe is our own parent). Started from a
``forkserver`` that has imported torch but never nixl (``mp_context``), so that no
NIXL/UCX state is inherited across ``fork`` while each engine skips torch's import
(measured: three engines ready in 1.7 s instead of 12 s on the loaded 2-core VM).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import random
import time
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from kvproto.lifecycle import Config, Effect, Free, TransferParams
from kvproto.port import now_ms

log = logging.getLogger(__name__)

Msg = tuple[Any, ...]

# Imported once by the fork server. Never nixl: its UCX state must not cross a fork.
_PRELOAD = ["torch", "numpy", "kvproto.lifecycle", "kvproto.wire"]


def mp_context() -> ForkServerContext | SpawnContext:
    """The context engine processes start from: a fork server with torch preloaded
    (``spawn`` where there is no fork server). The server is shared by every user in
    this process and exits with it."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _setup_logging(level: int) -> None:
    import torch

    # Several engine processes share few CPUs: torch's intra-op thread pools would spin
    # against each other (measured: a 64 KiB pattern fill went from 0.7 ms to 140 ms).
    torch.set_num_threads(1)
    logging.basicConfig(level=level, format=f"%(levelname)s [{os.getpid()}] %(name)s: %(message)s")
    from kvproto.nixl.agent import quiet_nixl_logging

    quiet_nixl_logging()  # NIXL logs every agent creation at INFO to stdout otherwise


def _metrics_port(opts: dict[str, Any]) -> int | None:
    """``opts["metrics_port"]``: serve Prometheus metrics on 127.0.0.1 (0: any free port);
    absent or None: no exporter. The chosen port is reported as ("metrics", name, port)
    right after "ready"."""
    v = opts.get("metrics_port")
    return None if v is None else int(v)


def _fault_rng_hook(drop: float, dup: float, seed: int, stats: dict[str, int]) -> Any:
    rng = random.Random(seed)

    def hook(peer: str, buf: bytes) -> list[bytes]:
        x = rng.random()
        if x < drop:
            stats["dropped"] = stats.get("dropped", 0) + 1
            return []
        if x < drop + dup:
            stats["duplicated"] = stats.get("duplicated", 0) + 1
            return [buf, buf]
        return [buf]

    return hook


def producer_main(conn: Connection, name: str, config: dict[str, Any], num_blocks: int,
                  block_bytes: int, opts: dict[str, Any]) -> None:
    """A P engine. Commands: register, register_group, abort, overwrite, flip, stats,
    pause, stop."""
    _setup_logging(int(opts.get("log_level", logging.WARNING)))
    import torch

    from kvproto.nixl.agent import default_device, fill_pattern
    from kvproto.nixl.producer import ProducerAdapter

    cfg = Config.from_dict(config)
    faults: dict[str, int] = {}
    hook = None
    if opts.get("drop") or opts.get("dup"):
        hook = _fault_rng_hook(float(opts.get("drop", 0)), float(opts.get("dup", 0)),
                               int(opts.get("seed", 0)), faults)
    writer = None
    if opts.get("journal"):
        from kvproto.journal import JournalWriter

        writer = JournalWriter(str(opts["journal"]), cfg, num_blocks,
                               meta={"engine": name, "source": "kvproto demo"})
    reg_at: dict[int, tuple[int, int]] = {}  # handle -> (ms, blocks)
    stats: dict[str, float] = {"stranded_block_seconds": 0.0}

    def observe(e: Effect, now: int) -> None:
        if isinstance(e, Free):
            t = reg_at.pop(e.handle, None)
            if t is not None and e.reason in ("expired", "aborted"):
                stats["stranded_block_seconds"] += (now - t[0]) / 1000 * t[1]

    device = str(opts.get("device") or default_device())
    p = ProducerAdapter(name, cfg, num_blocks=num_blocks, block_bytes=block_bytes,
                        device=device, fault_hook=hook,
                        sink=writer.sink if writer is not None else None,
                        strict_pool=False, observer=observe,
                        epoch=opts.get("epoch"),
                        progress_thread=bool(opts.get("progress_thread", False)),
                        metrics_port=_metrics_port(opts),
                        handshake_secret=opts.get("handshake_secret"))
    idle_sleep = float(opts.get("idle_sleep", 0.0005))
    if opts.get("handshake_version"):
        p.handshake_version = int(opts["handshake_version"])
    conn.send(("ready", p.host, p.port, p.epoch))
    if p.metrics_port is not None:
        conn.send(("metrics", name, p.metrics_port))
    stop = False
    try:
        while not stop:
            busy = p.poll()
            for _ in range(8):
                if not conn.poll(0):
                    break
                cmd = conn.recv()
                op = cmd[0]
                if op == "register":
                    _, rid, nblocks, group, expected, key, shared = cmd
                    reply: Any = None
                    blocks = shared if shared else p.allocate(nblocks)
                    if blocks is not None:
                        if not shared:
                            for i, b in enumerate(blocks):
                                p.region.kv[b] = fill_pattern(key, i, block_bytes, device)
                        params = p.register(rid, blocks, group=group, expected=expected)
                        if params is None:
                            if not shared:
                                p.give_back(blocks)
                        else:
                            reg_at[params.handle] = (now_ms(p.clock), len(blocks))
                            reply = params.to_dict()
                    conn.send(("registered", rid, reply))
                elif op == "register_group":  # n>1 siblings sharing one prefill's blocks
                    _, rids, nblocks, group, key = cmd
                    results: list[tuple[str, Any]] = []
                    blocks = p.allocate(nblocks)
                    if blocks is not None:
                        for i, b in enumerate(blocks):
                            p.region.kv[b] = fill_pattern(key, i, block_bytes, device)
                    for rid in rids:
                        params = None
                        if blocks is not None:
                            params = p.register(rid, blocks, group=group, expected=1)
                        if params is not None:
                            reg_at[params.handle] = (now_ms(p.clock), len(blocks or ()))
                        results.append((rid, params.to_dict() if params is not None else None))
                    if blocks is not None and p.pool.refcount(blocks[0]) == 0:
                        p.give_back(blocks)  # no member was held
                    conn.send(("registered_group", results))
                elif op == "abort":
                    p.abort(cmd[1])
                elif op == "overwrite":  # tests: scribble over blocks (simulates reuse)
                    for b in cmd[1]:
                        p.region.kv[b] = fill_pattern(cmd[2], b, block_bytes, device)
                elif op == "flip":  # tests: invert one byte of a block, stamps unchanged
                    _, b, i = cmd
                    p.region.kv[b, i] = p.region.kv[b, i] ^ 0xFF
                    if p.region.kv.is_cuda:  # landed before any READ that follows
                        torch.cuda.synchronize(p.region.kv.device)
                elif op == "stats":
                    conn.send(("stats", {
                        "held": p.pool.held_count, "free": p.free_blocks,
                        "capacity": p.pool.capacity, "held_requests": p.ledger.held_requests,
                        "frees": dict(p.ledger.frees), "ledger": dict(p.ledger.counters),
                        "adapter": dict(p.counters), "violations": p.pool.violations,
                        "invariants": p.check_invariants(), "faults": dict(faults),
                        "stranded_block_seconds": stats["stranded_block_seconds"],
                        "peers": sorted(p.peers), "metrics_port": p.metrics_port,
                        "t": time.monotonic()}))
                elif op == "pause":  # benchmarks/tests: stop polling for a while
                    time.sleep(float(cmd[1]))
                elif op == "stop":
                    stop = True
            if not busy:
                time.sleep(idle_sleep)
    finally:
        if writer is not None:
            writer.close()
        p.close()
        conn.send(("stopped",))


def consumer_main(conn: Connection, name: str, config: dict[str, Any], num_blocks: int,
                  block_bytes: int, engines: dict[str, tuple[str, int]],
                  opts: dict[str, Any]) -> None:
    """A D rank. Commands: admit, abort, stats, stop. Reports completions (verified)."""
    _setup_logging(int(opts.get("log_level", logging.WARNING)))
    import torch

    from kvproto.nixl.agent import default_device, fill_pattern
    from kvproto.nixl.consumer import ConsumerAdapter

    cfg = Config.from_dict(config)
    stall = opts.get("stall")  # tests: "before_gen" -> report, block until told to resume

    def phase(ph: str, rid: str) -> None:
        if stall == ph:
            conn.send(("stalled", rid))
            while not conn.poll(0.05):
                pass  # not polling NIXL: the READ sequence cannot progress from our side

    device = str(opts.get("device") or default_device())
    d = ConsumerAdapter(name, cfg, num_blocks=num_blocks, block_bytes=block_bytes,
                        device=device, phase_hook=phase if stall else None,
                        tp_rank=int(opts.get("tp_rank", 0)), tp_size=int(opts.get("tp_size", 1)),
                        metrics_port=_metrics_port(opts),
                        handshake_secret=opts.get("handshake_secret"))
    if opts.get("handshake_version"):
        d.handshake_version = int(opts["handshake_version"])
    if opts.get("consumer"):  # the D engine this rank belongs to (P's gate binds to it)
        d.consumer_id = str(opts["consumer"])
    for eng, (host, port) in engines.items():
        d.add_engine(eng, host, port)
    keys: dict[str, str] = {}
    sched_at: dict[str, float] = {}
    conn.send(("ready", name))
    if d.metrics_port is not None:
        conn.send(("metrics", name, d.metrics_port))
    stop = False
    try:
        while not stop:
            comps = d.poll()
            now = time.monotonic()
            for rid in [r for r, t in sched_at.items() if t <= now]:
                del sched_at[rid]
                d.schedule(rid)
            for c in comps:
                corrupted = 0
                if c.state == "done" and c.local_blocks is not None:
                    key = keys.get(c.request_id, c.request_id)
                    for i, lb in enumerate(c.local_blocks):
                        want = fill_pattern(key, i, block_bytes, device)
                        if not bool(torch.equal(d.region.kv[lb], want)):
                            corrupted += 1
                    d.free_local(c.request_id)
                keys.pop(c.request_id, None)
                conn.send(("completion", name, c.request_id, c.state, c.reason, c.nbytes,
                           c.read_seconds, corrupted))
            for _ in range(16):
                if not conn.poll(0):
                    break
                cmd = conn.recv()
                op = cmd[0]
                if op == "admit":
                    _, rid, pd, key, delay = cmd
                    keys[rid] = key
                    d.admit(rid, TransferParams.from_dict(pd))
                    if delay is not None:
                        sched_at[rid] = time.monotonic() + float(delay)
                elif op == "add_engine":  # the router learned where a P answers handshakes
                    d.add_engine(cmd[1], cmd[2], int(cmd[3]))
                elif op == "abort":
                    sched_at.pop(cmd[1], None)
                    d.abort(cmd[1])
                elif op == "send_raw":  # tests: a live peer sends arbitrary bytes
                    try:
                        d.agent.send_notif(cmd[1], cmd[2])
                    except Exception as e:
                        log.info("send_raw: %s", e)
                elif op == "stats":
                    conn.send(("stats", {"counters": dict(d.counters),
                                         "finished": dict(d.machine.finished),
                                         "machine": dict(d.machine.counters),
                                         "in_flight": d.in_flight, "name": name,
                                         "metrics_port": d.metrics_port}))
                elif op == "stop":
                    stop = True
            time.sleep(0.001 if not comps and not d.in_flight else 0.0001)
    finally:
        d.close(timeout=2.0)
        try:
            conn.send(("stopped",))
        except (BrokenPipeError, OSError):
            pass
