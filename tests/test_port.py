"""Each side's one port (``kvproto.port``): a wire message in, the machine event it stands
for. On P (``p_receive``) a done batch (wire kind 5) is the same ``done`` for several
handles: each handle is one ``done`` event, in order, and a bad batch is one counted
rejection. On D (``d_receive``) an ack renews; bad bytes are counted, journaled
rejections that change nothing, and such a journal replays and validates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import LedgerFactory

from kvproto import wire
from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    FREED,
    Config,
    Consumer,
    DEffect,
    DRejected,
    Free,
    Ledger,
    Rejected,
    SendHeartbeat,
    TransferParams,
)
from kvproto.port import d_receive, now_ms, p_receive
from kvproto.verify.replay import replay

EPOCH = 9


def receive(ledger: Ledger, buf: bytes, now: int = 1000, peer: str = "D0") -> list[object]:
    return list(p_receive(ledger, peer, buf, now, known=True, epoch=EPOCH,
                          max_bytes=ledger.config.max_message_bytes))


def test_done_batch_frees_every_named_request_as_transferred(
        make_ledger: LedgerFactory) -> None:
    ledger = make_ledger()
    for h in (1, 2, 3):
        ledger.register(h, f"r{h}", (2 * h, 2 * h + 1), 0)
    ledger.register(4, "r4", (20,), 0)
    [buf] = wire.encode_done_batch(EPOCH, [3, 1, 2], 1, 4096)
    assert buf[3] == wire.KIND_DONE_BATCH
    effects = receive(ledger, buf)
    freed = [e for e in effects if isinstance(e, Free)]
    assert [(f.handle, f.reason) for f in freed] == [(1, "transferred"), (2, "transferred"),
                                                     (3, "transferred")]
    assert all(ledger.state(h) == FREED for h in (1, 2, 3))
    assert ledger.state(4) != FREED  # not named: still held
    assert ledger.frees["transferred"] == 3


def test_done_batch_counts_each_handle_like_a_done(make_ledger: LedgerFactory) -> None:
    """An unknown handle inside a batch is early (staged) like a lone done for it, and
    does not stop the others; the same batch twice frees nothing twice."""
    ledger = make_ledger()
    ledger.register(1, "r1", (0,), 0)
    [buf] = wire.encode_done_batch(EPOCH, [1, 77], 1, 4096)
    receive(ledger, buf)
    assert ledger.state(1) == FREED and ledger.frees["transferred"] == 1
    before = dict(ledger.counters)
    receive(ledger, buf)  # duplicated notification
    assert ledger.frees["transferred"] == 1
    assert sum(ledger.counters.values()) > sum(before.values())  # counted, not acted on
    assert ledger.check_invariants() == []


def test_bad_done_batch_is_one_rejection_and_frees_nothing(make_ledger: LedgerFactory) -> None:
    ledger = make_ledger()
    ledger.register(1, "r1", (0,), 0)
    [good] = wire.encode_done_batch(EPOCH, [1, 2], 1, 4096)
    bads = (good[:-1], good + b"\x01", good[:8] + b"\x00\x00",
            wire.encode_done_batch(EPOCH + 1, [1, 2], 1, 4096)[0])
    for bad in bads:
        effects = receive(ledger, bad)
        assert len(effects) == 1 and isinstance(effects[0], Rejected), effects
    assert ledger.state(1) != FREED
    assert sum(v for k, v in ledger.counters.items() if k.startswith("rejected:")) == len(bads)


# ---------------------------------------------------------------------------
# D's one port (kvproto.port.d_receive): P's acks in, Consumer events; bad bytes are
# counted and journaled rejections (Consumer.reject) that change nothing.
# ---------------------------------------------------------------------------


def _d_run(tmp: Path) -> tuple[Path, Consumer, list[list[DEffect]]]:
    """A D rank that admits two requests, heartbeats, and receives one good ack and one
    of each kind of bad bytes; its journal at ``tmp``."""
    cfg = Config()
    outs: list[list[DEffect]] = []
    with JournalWriter(tmp, cfg, reader="d0") as w:
        c = Consumer("d0", cfg, sink=w.sink)
        c.handshake_result("P0", True, 0)
        for h in (1, 2):
            c.admit(f"r{h}", TransferParams("P0", EPOCH, h, (h,), cfg.ms.initial_lease), 0)
        hb = [e for e in c.tick(1000) if isinstance(e, SendHeartbeat)]
        assert len(hb) == 1

        def d(buf: bytes, now: int, peer: str = "P0", known: bool = True) -> None:
            outs.append(d_receive(c, peer, buf, now, known=known, epoch=EPOCH,
                                  max_bytes=cfg.max_message_bytes))

        [ack] = wire.encode_ack(EPOCH, hb[0].seq, 40_000, [], 4096)
        d(ack, 1500)  # good: renews both
        d(ack[:-1], 2000)  # truncated
        d(wire.encode_ack(EPOCH + 1, hb[0].seq, 5000, [], 4096)[0], 2100)  # another epoch
        d(b"\x00" * (cfg.max_message_bytes + 1), 2200)  # oversized
        d(wire.encode_done(EPOCH, 1, 1), 2300)  # a kind D does not take
        d(ack, 2400, peer="stranger", known=False)  # nobody D shook hands with
        # A time that is not an int: recorded at the rank's clock.
        d(ack[:-1], float("nan"))  # type: ignore[arg-type]
    return tmp, c, outs


def test_d_receive_counts_and_journals_every_rejection(tmp_path: Path) -> None:
    path, c, outs = _d_run(tmp_path / "d.jsonl")
    good, *bad = outs
    assert not any(isinstance(e, DRejected) for e in good)
    assert c.lease_end("r1") == 1000 + 40_000 - Config().ms.clock_drift
    assert [type(e) for o in bad for e in o] == [DRejected] * len(bad)
    reasons = [o[0].reason for o in bad]
    assert reasons == ["truncated", "epoch", "oversized", "unexpected_kind", "unknown_peer",
                       "truncated"]
    counted = {k: v for k, v in c.counters.items() if k.startswith("rejected:")}
    assert sum(counted.values()) == len(bad)
    # Nothing changed but the clock: both requests still wait, no release, no finish.
    assert [c.state(r) for r in ("r1", "r2")] == ["waiting", "waiting"]
    rows = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    rejects = [r for r in rows if r["event"]["type"] == "reject"]
    assert [r["event"]["reason"] for r in rejects] == reasons
    assert all(r["effects"] == [{"type": "rejected", "reason": r["event"]["reason"],
                                 "peer": r["event"]["peer"], "detail": r["event"]["detail"]}]
               for r in rejects)
    assert rejects[-1]["event"]["now"] == 2400  # the NaN was recorded at the rank's clock


def test_a_d_journal_with_rejections_replays(tmp_path: Path) -> None:
    path, _, _ = _d_run(tmp_path / "d.jsonl")
    res = replay(path.read_text().splitlines())
    assert res.ok and res.side == "D", (res.divergences, res.violations)
    assert res.events == len(path.read_text().splitlines()) - 1


def test_a_tampered_d_reject_does_not_replay(tmp_path: Path) -> None:
    """A reject that (in the journal) changed something is caught: the check bites."""
    path, _, _ = _d_run(tmp_path / "d.jsonl")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "reject")
    rows[i]["effects"].append({"type": "send_release", "request_id": "r1", "engine": "P0",
                               "handle": 1, "expected": 1})
    res = replay([json.dumps(r) for r in rows])
    assert not res.ok and f"line {i + 1}:" in res.divergences[0]


@pytest.mark.tlc
def test_a_d_journal_with_rejections_validates_under_tlc(tmp_path: Path) -> None:
    """TraceConsumer takes a reject as a stuttering step; the same journal with a reject
    that recorded an effect is refused at that line."""
    from kvproto.verify import validate as va
    from kvproto.verify.tlc import MissingDependency

    path, _, _ = _d_run(tmp_path / "d.jsonl")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if i and r["event"]["type"] == "reject")
    rows[i]["effects"].append({"type": "send_release", "request_id": "r1", "engine": "P0",
                               "handle": 1, "expected": 1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        ok, refused = va.validate([path, bad])
    except MissingDependency as e:  # pragma: no cover - CI has Java
        pytest.skip(str(e))
    assert ok.allowed, ok.describe()
    assert not refused.allowed and refused.line == i + 1, refused.describe()


def test_now_ms_reads_a_seconds_clock_as_whole_milliseconds() -> None:
    """The adapters' one clock reading: seconds in, the machines' int ms out."""
    assert now_ms(lambda: 12.3456) == 12_346
    assert now_ms(lambda: 0.1 + 0.2) == 300  # float noise gone
    assert type(now_ms(lambda: 5.0)) is int
