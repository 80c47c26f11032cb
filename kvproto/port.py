"""The one port per side between wire messages and machine events.

:func:`p_receive` turns one message that arrived at P (the bytes and the peer they came
from) into the ledger event it stands for, feeds the ledger, and returns the effects for
the caller to carry out; :func:`d_receive` does the same for one message that arrived at
a D rank (P's acks, never-registered notices and claim answers) and its ``Consumer``. The P and D drivers
(:mod:`kvproto.nixl.driver_p`, :mod:`kvproto.nixl.driver_d`) receive through them, over
NIXL and in the simulator and the fuzzer alike, so every side decodes, rejects and
dispatches one way: an unknown peer, bytes that do not decode (malformed, truncated,
oversized, another epoch or version), or a message kind the side does not take are
recorded rejections (``Ledger.reject``, ``Consumer.reject``: counted and journaled),
never a crash. Standard library only.

:func:`now_ms` is the adapters' one reading of their clock as the machines' time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvproto.lifecycle import Consumer, DEffect, Ledger, to_ms
from kvproto.lifecycle.gate import Gate, GateEffect
from kvproto.wire import (
    KIND_ACK,
    KIND_CLAIM,
    KIND_CLAIM_REFUSED,
    KIND_DONE,
    KIND_GRANT,
    KIND_HEARTBEAT,
    KIND_NEVER,
    KIND_RELEASE,
    Message,
    WireError,
    decode,
)

log = logging.getLogger(__name__)


def now_ms(clock: Callable[[], float]) -> int:
    """``clock()`` (seconds, e.g. ``time.monotonic``) as the machines' time: whole
    milliseconds (``to_ms``). Every adapter reads its clock through here, once per step,
    and hands the same integer to its machine, its journal and its own timers."""
    return to_ms(clock())


def p_receive(ledger: Ledger | Gate, peer: str, buf: bytes, now: int, *, known: bool, epoch: int,
              max_bytes: int, consumer: str | None = None) -> Sequence[GateEffect]:
    """Feed P's ledger the event one incoming message stands for; return its effects.

    ``ledger``: P's ledger, or P's gate over it (``kvproto.lifecycle.gate.Gate``, which
    refuses heartbeats about never-registered handles). ``known``: whether ``peer``
    completed a handshake with this P; ``epoch``: this P's epoch (messages for another
    incarnation are rejected by the decoder); ``max_bytes``: ``Config.max_message_bytes``;
    ``consumer``: the D engine ``peer`` belongs to (from its handshake), for the gate."""
    if not known:
        return ledger.reject("unknown_peer", peer[:64], f"{len(buf)} bytes", now)
    try:
        msg = decode(buf, max_bytes=max_bytes, epoch=epoch)
    except WireError as e:
        return ledger.reject(e.reason, peer, e.detail, now)
    except Exception as e:  # the decoder should only raise WireError; never crash on input
        log.exception("decoding %d bytes from %s failed", len(buf), peer)
        return ledger.reject("malformed", peer, type(e).__name__, now)
    if isinstance(ledger, Gate):
        return _through_gate(ledger, peer, msg, now, consumer if consumer else peer)
    if msg.kind == KIND_DONE:
        hs = msg.handles
        if len(hs) == 1:
            return ledger.done(peer, hs[0], msg.expected, now)
        return ledger.done_batch(peer, hs, msg.expected, now)  # one done event per handle
    if msg.kind == KIND_HEARTBEAT:
        return ledger.heartbeat(peer, msg.seq, msg.handles, msg.expected, now)
    if msg.kind == KIND_RELEASE:
        return ledger.release(peer, msg.handles, msg.expected, now)
    return ledger.reject("unexpected_kind", peer, msg.kind_name, now)


def _through_gate(gate: Gate, peer: str, msg: Message, now: int,
                  consumer: str) -> Sequence[GateEffect]:
    if msg.kind == KIND_DONE:
        hs = msg.handles
        if len(hs) == 1:
            return gate.done(peer, hs[0], msg.expected, now, consumer)
        return gate.done_batch(peer, hs, msg.expected, now, consumer)  # one event per handle
    if msg.kind == KIND_HEARTBEAT:
        return gate.heartbeat(peer, msg.seq, msg.handles, msg.expected, now, consumer)
    if msg.kind == KIND_RELEASE:
        return gate.release(peer, msg.handles, msg.expected, now, consumer)
    if msg.kind == KIND_CLAIM:
        hs = msg.handles
        if len(hs) == 1:
            return gate.claim(consumer, hs[0], msg.capability, now, peer)
        claimed: list[GateEffect] = []  # a claim batch: one claim event per handle, in order
        for h, cap in zip(hs, msg.capabilities, strict=True):
            claimed += gate.claim(consumer, h, cap, now, peer)
        return claimed
    return gate.reject("unexpected_kind", peer, msg.kind_name, now)


def d_receive(consumer: Consumer, peer: str, buf: bytes, now: int, *, known: bool,
              epoch: int, max_bytes: int) -> list[DEffect]:
    """Feed one D rank's machine the event one incoming message stands for (an ack of
    one of its heartbeats, a never-registered notice, or the gate's answer to a claim);
    return its effects.

    ``known``: whether ``peer`` is a P engine this rank completed a handshake with (and
    still holds); ``epoch``: that engine's epoch (from its handshake: a message of another
    incarnation is rejected by the decoder); ``max_bytes``: ``Config.max_message_bytes``."""
    if not known:
        return consumer.reject("unknown_peer", peer[:64], f"{len(buf)} bytes", now)
    try:
        msg = decode(buf, max_bytes=max_bytes, epoch=epoch)
    except WireError as e:
        return consumer.reject(e.reason, peer, e.detail, now)
    except Exception as e:  # the decoder should only raise WireError; never crash on input
        log.exception("decoding %d bytes from %s failed", len(buf), peer)
        return consumer.reject("malformed", peer, type(e).__name__, now)
    if msg.kind == KIND_NEVER:
        # P will never register these handles: each request of this P not reading fails
        # now (never_registered, recompute) instead of at its lease end.
        out: list[DEffect] = []
        for h in msg.handles:
            rid = consumer.request_id(peer, h)
            if rid is not None:
                out += consumer.never(rid, now)
        return out
    if msg.kind == KIND_GRANT or msg.kind == KIND_CLAIM_REFUSED:
        # P's gate answered this rank's claims: each claiming request may now read, or
        # fails; an answer about a handle this rank does not hold is a counted rejection.
        granted = msg.kind == KIND_GRANT
        answers: list[DEffect] = []
        for h in msg.handles:
            rid = consumer.request_id(peer, h)
            if rid is None:
                answers += consumer.reject("claim_answer_unknown", peer, msg.kind_name, now)
            else:
                answers += consumer.claim_result(rid, granted, now)
        return answers
    if msg.kind != KIND_ACK:
        return consumer.reject("unexpected_kind", peer, msg.kind_name, now)
    return consumer.ack(peer, msg.seq, msg.term_ms, msg.handles, now, msg.pending)
