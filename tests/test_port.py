"""P's one port (``kvproto.port.p_receive``): a wire message in, the ledger event it
stands for. A done batch (wire kind 5) is the same ``done`` for several handles: each
handle is one ``done`` event, in order, and a bad batch is one counted rejection."""

from __future__ import annotations

from conftest import LedgerFactory

from kvproto import wire
from kvproto.lifecycle import FREED, Free, Ledger, Rejected
from kvproto.port import now_ms, p_receive

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


def test_now_ms_reads_a_seconds_clock_as_whole_milliseconds() -> None:
    """The adapters' one clock reading: seconds in, the machines' int ms out."""
    assert now_ms(lambda: 12.3456) == 12_346
    assert now_ms(lambda: 0.1 + 0.2) == 300  # float noise gone
    assert type(now_ms(lambda: 5.0)) is int
