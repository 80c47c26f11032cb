"""``kvproto bench wire``: the wire codec's hot messages against the ledger's handling.

What P does per notification is decode it, then feed the ledger. This benchmark measures
both in the same run, on the same messages, so that their ratio is meaningful:

* ``done``: decode (fast path and the reference decoder) against ``Ledger.done`` (the
  same two-reader sequence as ``kvproto bench ledger``: the first ``done`` notifies, the
  second frees);
* ``heartbeat``: decode per request id of a 512-id batch against ``Ledger.heartbeat``
  per id;
* ``done batch``: decode per request id of a 400-id done batch (what D's NIXL adapter
  sends per P engine and step) against ``Ledger.done``;
* ``ack`` decode, and ``done``/``done batch``/``heartbeat``/``ack`` encoding (fast and
  reference).

Each figure is the best of several repeats (microseconds per message or per id).
Figures, not tests; the codec's equivalence with the reference is tested in
tests/test_wire.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvproto import wire
from kvproto.lifecycle import BlockPool, Config, Ledger

EPOCH = 0x5EED
BATCH = 512
DONE_BATCH = 400  # the done batch of one step: bench transfer's 4 KiB round


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def _per_item(loop: Callable[[], int], repeat: int) -> float:
    """Best-of-``repeat`` microseconds per item; ``loop`` returns how many it did."""

    def once() -> float:
        t0 = time.perf_counter()
        k = loop()
        return (time.perf_counter() - t0) / k * 1e6

    return _best(once, repeat)


def _ledger(n: int) -> tuple[Ledger, list[int]]:
    L = Ledger(Config(max_tombstones=max(1024, n), max_staged=4096), BlockPool(64))
    hs = []
    for i in range(n):
        h = L.new_handle()
        L.register(h, f"r{i}", (i % 64,), 0, expected=2)
        hs.append(h)
    return L, hs


def run_all(n: int = 50_000, repeat: int = 5) -> dict[str, Any]:
    _, handles = _ledger(n)  # realistic handles: what a ledger hands out
    dones = [wire.encode_done(EPOCH, h, 2) for h in handles]
    hbs = [m for i in range(0, n, BATCH)
           for m in wire.encode_heartbeat(EPOCH, i, handles[i:i + BATCH], 2, 1 << 16)]
    done_batches = [m for i in range(0, n, DONE_BATCH)
                    for m in wire.encode_done_batch(EPOCH, handles[i:i + DONE_BATCH], 2, 4096)]
    acks = [m for i in range(n // 100)
            for m in wire.encode_ack(EPOCH, i, 20_000, (), 1 << 16)]
    decode, ref = wire.decode, wire.decode_reference

    def dec_done(f: Callable[..., wire.Message] = decode) -> int:
        for b in dones:
            f(b, max_bytes=4096, epoch=EPOCH)
        return len(dones)

    def dec_hb(f: Callable[..., wire.Message] = decode) -> int:
        for b in hbs:
            f(b, max_bytes=1 << 16, epoch=EPOCH)
        return n

    def dec_dones(f: Callable[..., wire.Message] = decode) -> int:
        for b in done_batches:
            f(b, max_bytes=4096, epoch=EPOCH)
        return n

    def dec_ack(f: Callable[..., wire.Message] = decode) -> int:
        for b in acks:
            f(b, max_bytes=4096, epoch=EPOCH)
        return len(acks)

    def enc_done(f: Callable[[int, int, int], bytes] = wire.encode_done) -> int:
        for h in handles:
            f(EPOCH, h, 2)
        return n

    def enc_hb(f: Callable[..., list[bytes]] = wire.encode_heartbeat) -> int:
        for i in range(0, n, BATCH):
            f(EPOCH, i, handles[i:i + BATCH], 2, 1 << 16)
        return n

    def enc_dones(f: Callable[..., list[bytes]] = wire.encode_done_batch) -> int:
        for i in range(0, n, DONE_BATCH):
            f(EPOCH, handles[i:i + DONE_BATCH], 2, 4096)
        return n

    def enc_ack(f: Callable[..., list[bytes]] = wire.encode_ack) -> int:
        for i in range(n // 100):
            f(EPOCH, i, 20_000, (), 4096)
        return n // 100

    def ledger_done() -> float:
        L, hs = _ledger(n)
        gc.collect()
        t0 = time.perf_counter()
        for h in hs:
            L.done("d0", h, 2, 1000)
        for h in hs:
            L.done("d1", h, 2, 1000)
        dt = time.perf_counter() - t0
        assert L.held_requests == 0
        return dt / (2 * n) * 1e6

    def ledger_hb() -> float:
        L, hs = _ledger(n)
        gc.collect()
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            L.heartbeat("d0", i, hs[i:i + BATCH], 2, 1000)
        return (time.perf_counter() - t0) / n * 1e6

    gc.disable()
    try:
        res = {
            "decode_done_us": _per_item(dec_done, repeat),
            "decode_done_reference_us": _per_item(lambda: dec_done(ref), repeat),
            "ledger_done_us": _best(ledger_done, repeat),
            "decode_done_batch_us_per_id": _per_item(dec_dones, repeat),
            "decode_done_batch_reference_us_per_id": _per_item(lambda: dec_dones(ref), repeat),
            "decode_heartbeat_us_per_id": _per_item(dec_hb, repeat),
            "decode_heartbeat_reference_us_per_id": _per_item(lambda: dec_hb(ref), repeat),
            "ledger_heartbeat_us_per_id": _best(ledger_hb, repeat),
            "decode_ack_us": _per_item(dec_ack, repeat),
            "decode_ack_reference_us": _per_item(lambda: dec_ack(ref), repeat),
            "encode_done_us": _per_item(enc_done, repeat),
            "encode_done_reference_us": _per_item(
                lambda: enc_done(wire.encode_done_reference), repeat),
            "encode_done_batch_us_per_id": _per_item(enc_dones, repeat),
            "encode_done_batch_reference_us_per_id": _per_item(
                lambda: enc_dones(wire.encode_done_batch_reference), repeat),
            "encode_heartbeat_us_per_id": _per_item(enc_hb, repeat),
            "encode_heartbeat_reference_us_per_id": _per_item(
                lambda: enc_hb(wire.encode_heartbeat_reference), repeat),
            "encode_ack_us": _per_item(enc_ack, repeat),
            "encode_ack_reference_us": _per_item(
                lambda: enc_ack(wire.encode_ack_reference), repeat),
        }
    finally:
        gc.enable()
    out: dict[str, Any] = {k: round(v, 3) for k, v in res.items()}
    out["done_decode_over_ledger"] = round(res["decode_done_us"] / res["ledger_done_us"], 3)
    out["done_batch_decode_over_ledger"] = round(
        res["decode_done_batch_us_per_id"] / res["ledger_done_us"], 3)
    out["heartbeat_decode_over_ledger"] = round(
        res["decode_heartbeat_us_per_id"] / res["ledger_heartbeat_us_per_id"], 3)
    out["done_decode_speedup_vs_reference"] = round(
        res["decode_done_reference_us"] / res["decode_done_us"], 2)
    out["requests"] = n
    out["python"] = sys.version.split()[0]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=50_000,
                   help="messages (and held requests) per measurement (50000)")
    p.add_argument("--repeat", type=int, default=5, help="repeats; the best is kept (5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.repeat < 1:
        print("kvproto bench wire: --requests and --repeat must be >= 1", file=sys.stderr)
        return 2
    r = run_all(args.requests, args.repeat)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    print("kvproto bench wire (us per message or per request id; best of "
          f"{args.repeat}; one core)")
    print("                       decode   reference decoder   ledger handling   decode/ledger")
    print(f"  done            {r['decode_done_us']:>11.3f} {r['decode_done_reference_us']:>19.3f}"
          f" {r['ledger_done_us']:>17.3f} {r['done_decode_over_ledger']:>15.3f}")
    print(f"  done batch (/id){r['decode_done_batch_us_per_id']:>11.3f}"
          f" {r['decode_done_batch_reference_us_per_id']:>19.3f}"
          f" {r['ledger_done_us']:>17.3f} {r['done_batch_decode_over_ledger']:>15.3f}")
    print(f"  heartbeat (/id) {r['decode_heartbeat_us_per_id']:>11.3f}"
          f" {r['decode_heartbeat_reference_us_per_id']:>19.3f}"
          f" {r['ledger_heartbeat_us_per_id']:>17.3f} {r['heartbeat_decode_over_ledger']:>15.3f}")
    print(f"  ack             {r['decode_ack_us']:>11.3f} {r['decode_ack_reference_us']:>19.3f}")
    print("                       encode   reference encoder")
    print(f"  done            {r['encode_done_us']:>11.3f} {r['encode_done_reference_us']:>19.3f}")
    print(f"  done batch (/id){r['encode_done_batch_us_per_id']:>11.3f}"
          f" {r['encode_done_batch_reference_us_per_id']:>19.3f}")
    print(f"  heartbeat (/id) {r['encode_heartbeat_us_per_id']:>11.3f}"
          f" {r['encode_heartbeat_reference_us_per_id']:>19.3f}")
    print(f"  ack             {r['encode_ack_us']:>11.3f} {r['encode_ack_reference_us']:>19.3f}")
    return 0
