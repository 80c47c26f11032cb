"""Wire format for the lifecycle messages (spec/PROTOCOL.md, "Wire format").

Every message: an 8-byte header ``b"KV" | version u8 | kind u8 | epoch u32 (big endian)``
followed by a kind-specific body of unsigned LEB128 varints. Request handles in a batch
are sorted and delta-encoded, so a heartbeat costs about one or two bytes per request.

Decoding never raises anything but ``WireError``, whose ``reason`` is a short stable
token the adapters count (``truncated``, ``bad_magic``, ``version``, ...). Nothing from
a peer is ever unpickled or evaluated.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any, Final, NamedTuple

from kvproto.errors import RemoteInputError

MAGIC: Final = b"KV"
VERSION: Final = 1
HEADER: Final = struct.Struct(">2sBBI")
HEADER_SIZE: Final = HEADER.size  # 8

KIND_DONE: Final = 1
KIND_RELEASE: Final = 2
KIND_HEARTBEAT: Final = 3
KIND_ACK: Final = 4
# The same ``done`` message for several handles at once (one notification carries the done
# of every request whose stamps one READ fetched). Decodes to a ``done`` Message.
KIND_DONE_BATCH: Final = 5
# P -> D: these handles will never be registered (their prefill aborted or failed after
# the params left): D fails the requests at once. Body as ``release`` without expected.
KIND_NEVER: Final = 6
# D -> P: a consumer presents a handle's capability (P's gate binds the handle to the
# first consumer that does). Body: the handle, then CAPABILITY_WIRE_BYTES raw bytes.
KIND_CLAIM: Final = 7
CAPABILITY_WIRE_BYTES: Final = 16
# P -> D: the gate's answer to a claim: the handle is bound to this consumer (grant), or
# the claim was refused (another consumer owns it, a bad capability, the gate is full).
# Body: the handle.
KIND_GRANT: Final = 8
KIND_CLAIM_REFUSED: Final = 9
KIND_NAMES: Final = {KIND_DONE: "done", KIND_RELEASE: "release", KIND_HEARTBEAT: "heartbeat",
                     KIND_ACK: "ack", KIND_DONE_BATCH: "done", KIND_NEVER: "never",
                     KIND_CLAIM: "claim", KIND_GRANT: "grant",
                     KIND_CLAIM_REFUSED: "claim_refused"}

MAX_HANDLE: Final = (1 << 64) - 1
MAX_EXPECTED: Final = 0xFFFF
MAX_SEQ: Final = 0xFFFFFFFF
MAX_VARINT_BYTES: Final = 10


class WireError(RemoteInputError, ValueError):
    """A message that cannot be decoded. ``reason`` is a stable counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Message(NamedTuple):
    """A decoded message. A named tuple: the hot decoders build one per notification,
    and a tuple is the cheapest immutable record to build."""

    kind: int
    epoch: int
    handles: tuple[int, ...]
    expected: int = 0
    seq: int = 0
    term_ms: int = 0  # ack only: the granted lease term, milliseconds
    pending: tuple[int, ...] = ()  # ack only: handles not registered yet (not renewed)
    capability: str = ""  # claim only: every handle's capability, lowercase hex, in order
    # (``2 * CAPABILITY_WIRE_BYTES`` digits each: ``capabilities`` splits them)

    @property
    def capabilities(self) -> tuple[str, ...]:
        """A claim's capabilities, one per handle, in order."""
        n = 2 * CAPABILITY_WIRE_BYTES
        c = self.capability
        return tuple(c[i:i + n] for i in range(0, len(c), n))

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


# -- varints ------------------------------------------------------------------------


def _put_varint(out: bytearray, v: int) -> None:
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)


def varint_size(v: int) -> int:
    n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


def _get_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    for i in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise WireError("truncated", f"varint runs past the end at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            if i and b == 0:
                raise WireError("malformed_varint", "non-canonical varint (trailing zero byte)")
            return result, pos
        shift += 7
    raise WireError("malformed_varint", f"varint longer than {MAX_VARINT_BYTES} bytes")


def _check_range(name: str, v: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise ValueError(f"{name} must be an int within [0, {hi}], got {v!r}")


def _header(kind: int, epoch: int) -> bytearray:
    _check_range("epoch", epoch, 0xFFFFFFFF)
    return bytearray(HEADER.pack(MAGIC, VERSION, kind, epoch))


def _put_handles(out: bytearray, handles: Sequence[int]) -> None:
    _put_varint(out, len(handles))
    prev = 0
    for i, h in enumerate(handles):
        _put_varint(out, h - prev if i else h)
        prev = h


def _sorted_unique(handles: Iterable[int]) -> list[int]:
    hs = sorted(set(handles))
    for h in hs:
        _check_range("handle", h, MAX_HANDLE)
    return hs


# -- encoders ---------------------------------------------------------------------------


def encode_done_reference(epoch: int, handle: int, expected: int) -> bytes:
    """Reference encoder (the fast ``encode_done`` must match it byte for byte).

    ``done``: this reader's READ of ``handle`` completed. Sent (or attached to the
    READ as its notification) only after the data landed."""
    _check_range("handle", handle, MAX_HANDLE)
    _check_range("expected", expected, MAX_EXPECTED)
    if expected < 1:
        raise ValueError("expected must be >= 1 in done")
    out = _header(KIND_DONE, epoch)
    _put_varint(out, expected)
    _put_varint(out, handle)
    return bytes(out)


def _chunk(hs: Sequence[int], budget: int) -> list[Sequence[int]]:
    """Split sorted handles into runs whose delta encoding fits ``budget`` bytes."""
    if budget < MAX_VARINT_BYTES:
        raise ValueError("max_bytes too small for one handle")
    chunks: list[Sequence[int]] = []
    i = 0
    n = len(hs)
    while True:
        start = i
        used = 0
        prev = 0
        while i < n:
            sz = varint_size(hs[i] - prev if i > start else hs[i])
            if used + sz > budget:
                break
            used += sz
            prev = hs[i]
            i += 1
        chunks.append(hs[start:i])
        if i >= n:
            return chunks


# The header plus the largest prefix fields (seq 5 bytes, expected/term 5) and count (5).
_RESERVE: Final = HEADER_SIZE + 15


def _batched(kind: int, epoch: int, prefixes: Sequence[int],
             handles: Iterable[int], max_bytes: int, *, per_chunk_seq: bool = False) -> list[bytes]:
    hs = _sorted_unique(handles)
    out: list[bytes] = []
    for k, part in enumerate(_chunk(hs, max_bytes - _RESERVE)):
        b = _header(kind, epoch)
        for j, v in enumerate(prefixes):
            _put_varint(b, (v + k) & MAX_SEQ if per_chunk_seq and j == 0 else v)
        _put_handles(b, part)
        out.append(bytes(b))
    return out


def chunk_handles(sorted_handles: Sequence[int], max_bytes: int) -> list[Sequence[int]]:
    """Split sorted handles into runs that each fit one heartbeat/release message of at
    most ``max_bytes``. D chunks its batches with this, so one message = one seq = one
    ack, and a lost message never lets D believe a renewal P did not grant."""
    return _chunk(sorted_handles, max_bytes - _RESERVE)


def encode_heartbeat_reference(epoch: int, seq: int, handles: Iterable[int], expected: int,
                               max_bytes: int) -> list[bytes]:
    """Reference encoder. ``heartbeat``: renew the leases of ``handles``. Chunked so that no message exceeds
    ``max_bytes``; chunk k carries sequence number ``seq + k`` (mod 2**32)."""
    _check_range("seq", seq, MAX_SEQ)
    _check_range("expected", expected, MAX_EXPECTED)
    return _batched(KIND_HEARTBEAT, epoch, (seq, expected), handles, max_bytes,
                    per_chunk_seq=True)


def encode_release(epoch: int, handles: Iterable[int], expected: int,
                   max_bytes: int) -> list[bytes]:
    """``release``: this reader will never pull ``handles``."""
    _check_range("expected", expected, MAX_EXPECTED)
    if expected < 1:
        raise ValueError("expected must be >= 1 in release")
    return _batched(KIND_RELEASE, epoch, (expected,), handles, max_bytes)


def encode_never(epoch: int, handles: Iterable[int], max_bytes: int) -> list[bytes]:
    """``never`` (P -> D): ``handles`` will never be registered."""
    return _batched(KIND_NEVER, epoch, (), handles, max_bytes)


def encode_claim(epoch: int, handle: int, capability: str) -> bytes:
    """``claim`` (D -> P): present ``capability`` (hex, ``2 * CAPABILITY_WIRE_BYTES``
    digits) for ``handle``."""
    return encode_claims(epoch, [(handle, capability)], 1 << 30)[0]


def claim_bytes(capability: str) -> bytes:
    """A capability's wire bytes; ValueError when it is not ``CAPABILITY_WIRE_BYTES``
    bytes of hex."""
    raw = bytes.fromhex(capability)
    if len(raw) != CAPABILITY_WIRE_BYTES:
        raise ValueError(f"a capability is {CAPABILITY_WIRE_BYTES} bytes, got {len(raw)}")
    return raw


def encode_claims(epoch: int, claims: Sequence[tuple[int, str | bytes]],
                  max_bytes: int) -> list[bytes]:
    """``claim`` (D -> P) of several handles at once: (handle, capability) pairs in
    order, chunked so that no message exceeds ``max_bytes`` (each pair is one varint and
    ``CAPABILITY_WIRE_BYTES`` raw bytes). A capability is its hex text or its wire bytes
    (``claim_bytes``, decoded once by the caller). Raises ValueError on a bad capability."""
    out: list[bytes] = []
    b = _header(KIND_CLAIM, epoch)
    head = len(b)
    for h, cap in claims:
        _check_range("handle", h, MAX_HANDLE)
        raw = cap if isinstance(cap, bytes) else claim_bytes(cap)
        if len(raw) != CAPABILITY_WIRE_BYTES:
            raise ValueError(f"a capability is {CAPABILITY_WIRE_BYTES} bytes, got {len(raw)}")
        item = bytearray()
        _put_varint(item, h)
        item += raw
        if len(b) > head and len(b) + len(item) > max_bytes - _RESERVE:
            out.append(bytes(b))
            b = _header(KIND_CLAIM, epoch)
        b += item
    if len(b) > head:
        out.append(bytes(b))
    return out


def encode_grant(epoch: int, handle: int, granted: bool) -> bytes:
    """``grant`` or ``claim_refused`` (P -> D): the gate's answer to a claim of
    ``handle``."""
    return encode_grants(epoch, [handle], granted, 1 << 30)[0]


def encode_grants(epoch: int, handles: Iterable[int], granted: bool,
                  max_bytes: int) -> list[bytes]:
    """``grant`` or ``claim_refused`` (P -> D) of several handles at once (the gate's
    answers to one consumer's claims: a count, then the handles), chunked so that no
    message exceeds ``max_bytes``."""
    return _batched(KIND_GRANT if granted else KIND_CLAIM_REFUSED, epoch, (), handles,
                    max_bytes)


def encode_done_batch_reference(epoch: int, handles: Iterable[int], expected: int,
                                max_bytes: int) -> list[bytes]:
    """Reference encoder (the fast ``encode_done_batch`` must match it byte for byte).

    ``done`` for several handles (kind 5, body as ``release``'s), chunked so that no
    message exceeds ``max_bytes``. One handle is encoded as a plain ``done`` (kind 1)."""
    _check_range("expected", expected, MAX_EXPECTED)
    if expected < 1:
        raise ValueError("expected must be >= 1 in done")
    hs = _sorted_unique(handles)
    if not hs:
        raise ValueError("a done batch names at least one handle")
    if len(hs) == 1:
        return [encode_done(epoch, hs[0], expected)]
    return _batched(KIND_DONE_BATCH, epoch, (expected,), hs, max_bytes)


def encode_ack_reference(epoch: int, seq: int, term: int, refused: Iterable[int],
                         max_bytes: int, pending: Iterable[int] = ()) -> list[bytes]:
    """Reference encoder. ``ack``: answer heartbeat ``seq``; the granted term (an int of
    milliseconds, as the ledger's ``Ack.term``) travels as a u32 duration.
    Two handle lists follow: refused, then pending (not registered yet). Every chunk
    repeats seq and term, so any chunk alone is valid."""
    _check_range("seq", seq, MAX_SEQ)
    term_ms = term
    _check_range("term_ms", term_ms, 0xFFFFFFFF)
    out: list[bytes] = []
    refused_l = _sorted_unique(refused)
    pending_l = _sorted_unique(pending)
    tagged = [(h, 0) for h in refused_l] + [(h, 1) for h in pending_l]
    # Chunk the two lists together (each list stays sorted within a chunk).
    budget = max_bytes - _RESERVE - 5
    i = 0
    while True:
        b = _header(KIND_ACK, epoch)
        _put_varint(b, seq)
        _put_varint(b, term_ms)
        parts: tuple[list[int], list[int]] = ([], [])
        used = 0
        while i < len(tagged):
            h, which = tagged[i]
            lst = parts[which]
            sz = varint_size(h - lst[-1] if lst else h)
            if used + sz > budget:
                break
            used += sz
            lst.append(h)
            i += 1
        _put_handles(b, parts[0])
        _put_handles(b, parts[1])
        out.append(bytes(b))
        if i >= len(tagged):
            return out


# -- decoder -----------------------------------------------------------------------------


def decode_reference(buf: bytes, *, max_bytes: int = 1 << 20,
                     epoch: int | None = None) -> Message:
    """The reference decoder: every kind, every check; the fast ``decode`` hands it
    every message it does not fully recognise. Decode one message or raise WireError.
    ``epoch``, when given, must match."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise WireError("not_bytes", f"expected bytes, got {type(buf).__name__}")
    buf = bytes(buf)
    if len(buf) > max_bytes:
        raise WireError("oversized", f"{len(buf)} bytes > max_message_bytes {max_bytes}")
    if len(buf) < HEADER_SIZE:
        raise WireError("truncated", f"{len(buf)} bytes, header needs {HEADER_SIZE}")
    magic, version, kind, ep = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError("bad_magic", f"magic {magic!r}")
    if version != VERSION:
        raise WireError("version", f"protocol version {version}, this side speaks {VERSION}")
    if epoch is not None and ep != epoch:
        raise WireError("epoch", f"message for P epoch {ep}, current epoch is {epoch}")
    pos = HEADER_SIZE
    seq = term_ms = expected = 0
    pending: tuple[int, ...] = ()
    if kind == KIND_DONE:
        expected, pos = _get_varint(buf, pos)
        h, pos = _get_varint(buf, pos)
        if not 1 <= expected <= MAX_EXPECTED:
            raise WireError("bad_field", f"expected readers {expected} outside [1, {MAX_EXPECTED}]")
        if h > MAX_HANDLE:
            raise WireError("bad_field", "handle above 2**64-1")
        handles: tuple[int, ...] = (h,)
    elif kind in (KIND_RELEASE, KIND_HEARTBEAT, KIND_ACK, KIND_DONE_BATCH, KIND_NEVER):
        if kind == KIND_HEARTBEAT:
            seq, pos = _get_varint(buf, pos)
            expected, pos = _get_varint(buf, pos)
        elif kind == KIND_RELEASE or kind == KIND_DONE_BATCH:
            expected, pos = _get_varint(buf, pos)
        elif kind == KIND_ACK:
            seq, pos = _get_varint(buf, pos)
            term_ms, pos = _get_varint(buf, pos)
            if term_ms > 0xFFFFFFFF:
                raise WireError("bad_field", "term above 2**32-1 ms")
        if seq > MAX_SEQ:
            raise WireError("bad_field", "seq above 2**32-1")
        if expected > MAX_EXPECTED:
            raise WireError("bad_field", f"expected readers {expected} above {MAX_EXPECTED}")
        if kind == KIND_RELEASE and expected < 1:
            raise WireError("bad_field", "expected readers must be >= 1 in release")
        if kind == KIND_DONE_BATCH and expected < 1:
            raise WireError("bad_field", "expected readers must be >= 1 in done")
        hs, pos = _get_handles(buf, pos)
        handles = tuple(hs)
        if kind == KIND_DONE_BATCH:
            if not handles:
                raise WireError("bad_field", "a done batch names no handle")
            kind = KIND_DONE
        if kind == KIND_ACK:
            pend, pos = _get_handles(buf, pos)
            pending = tuple(pend)
    elif kind == KIND_CLAIM:
        hs_c: list[int] = []
        caps: list[str] = []
        while True:  # (handle, capability) pairs to the end: at least one
            h, pos = _get_varint(buf, pos)
            if h > MAX_HANDLE:
                raise WireError("bad_field", "handle above 2**64-1")
            if len(buf) - pos < CAPABILITY_WIRE_BYTES:
                raise WireError("truncated", "claim without its capability")
            hs_c.append(h)
            caps.append(buf[pos:pos + CAPABILITY_WIRE_BYTES].hex())
            pos += CAPABILITY_WIRE_BYTES
            if pos >= len(buf):
                break
        return Message(kind, ep, tuple(hs_c), capability="".join(caps))
    elif kind == KIND_GRANT or kind == KIND_CLAIM_REFUSED:
        hs, pos = _get_handles(buf, pos)
        if not hs:
            raise WireError("bad_field", f"a {KIND_NAMES[kind]} names no handle")
        handles = tuple(hs)
    else:
        raise WireError("unknown_kind", f"message kind {kind}")
    if pos != len(buf):
        raise WireError("trailing_bytes", f"{len(buf) - pos} bytes after the message")
    return Message(kind, ep, handles, expected, seq, term_ms, pending)


def _get_handles(buf: bytes, pos: int) -> tuple[list[int], int]:
    count, pos = _get_varint(buf, pos)
    if count > len(buf) - pos:
        raise WireError("truncated", f"count {count} exceeds the {len(buf) - pos} bytes left")
    hs: list[int] = []
    prev = 0
    for i in range(count):
        d, pos = _get_varint(buf, pos)
        if i and d == 0:
            raise WireError("bad_field", "duplicate handle in batch (zero delta)")
        prev = prev + d if i else d
        if prev > MAX_HANDLE:
            raise WireError("bad_field", "handle above 2**64-1")
        hs.append(prev)
    return hs, pos


# -- fast path -----------------------------------------------------------------------------
#
# ``struct``-based encoders and decoders for the hot messages (done, heartbeat, ack). Each
# recognises the common shapes (one-byte ``expected``, single-byte handle deltas, empty ack
# lists, one chunk) and hands everything else, including every malformed input, to the
# reference codec above: the bytes and the errors are the reference's by construction, and
# tests/test_wire.py checks byte equality and decode equality against it with hypothesis.

_PREFIX: Final = struct.Struct(">2sBB")
_DONE_PREFIX: Final = _PREFIX.pack(MAGIC, VERSION, KIND_DONE)
_HB_PREFIX: Final = _PREFIX.pack(MAGIC, VERSION, KIND_HEARTBEAT)
_ACK_PREFIX: Final = _PREFIX.pack(MAGIC, VERSION, KIND_ACK)
_DONES_PREFIX: Final = _PREFIX.pack(MAGIC, VERSION, KIND_DONE_BATCH)
_HEAD: Final = struct.Struct(">4sI")  # magic, version and kind as one 4-byte field; epoch
_DONE_HEAD: Final = struct.Struct(">4sIB")  # ... and a one-byte ``expected``
_new_message = tuple.__new__


def _varint_bytes(v: int) -> bytes:
    if v < 0x80:
        return bytes((v,))
    out = bytearray()
    _put_varint(out, v)
    return bytes(out)


def encode_done(epoch: int, handle: int, expected: int) -> bytes:
    """``done``: this reader's READ of ``handle`` completed. Sent (or attached to the
    READ as its notification) only after the data landed. Same bytes as
    ``encode_done_reference``."""
    if (type(epoch) is int and type(handle) is int and type(expected) is int
            and 0 <= epoch <= 0xFFFFFFFF and 1 <= expected < 0x80 and 0 <= handle <= MAX_HANDLE):
        return _DONE_HEAD.pack(_DONE_PREFIX, epoch, expected) + _varint_bytes(handle)
    return encode_done_reference(epoch, handle, expected)


def _delta_bytes(hs: list[int]) -> bytes | None:
    """The handle list's body (first handle, then deltas) when every delta fits one byte."""
    n = len(hs)
    if n == 0:
        return b"\x00"
    first = hs[0]
    if type(first) is not int or first < 0 or hs[-1] > MAX_HANDLE:
        return None
    if n == 1:
        return b"\x01" + _varint_bytes(first)
    if not all(type(h) is int for h in hs):
        return None
    deltas = bytes([b - a if b - a < 0x80 else 0 for a, b in pairwise(hs)])
    if 0 in deltas:  # a delta of two bytes or more
        return None
    return _varint_bytes(n) + _varint_bytes(first) + deltas


def encode_heartbeat(epoch: int, seq: int, handles: Iterable[int], expected: int,
                     max_bytes: int) -> list[bytes]:
    """``heartbeat``: renew the leases of ``handles``. Chunked so that no message exceeds
    ``max_bytes``; chunk k carries sequence number ``seq + k`` (mod 2**32). Same bytes as
    ``encode_heartbeat_reference``."""
    if (type(epoch) is int and type(seq) is int and type(expected) is int
            and 0 <= epoch <= 0xFFFFFFFF and 0 <= seq <= MAX_SEQ and 0 <= expected < 0x80
            and max_bytes >= _RESERVE + MAX_VARINT_BYTES):
        try:
            hs = sorted(set(handles))
        except TypeError:
            hs = None
        if hs is not None and len(hs) + MAX_VARINT_BYTES <= max_bytes - _RESERVE:
            body = _delta_bytes(hs)
            if body is not None:
                return [_HEAD.pack(_HB_PREFIX, epoch) + _varint_bytes(seq) + bytes((expected,))
                        + body]
        return encode_heartbeat_reference(epoch, seq, hs if hs is not None else handles,
                                          expected, max_bytes)
    return encode_heartbeat_reference(epoch, seq, handles, expected, max_bytes)


def encode_done_batch(epoch: int, handles: Iterable[int], expected: int,
                      max_bytes: int) -> list[bytes]:
    """``done`` for several handles at once (kind 5; one handle: a plain ``done``),
    chunked so that no message exceeds ``max_bytes``. Same bytes as
    ``encode_done_batch_reference``; the fast path is one chunk of dense handles."""
    if (type(epoch) is int and type(expected) is int and 0 <= epoch <= 0xFFFFFFFF
            and 1 <= expected < 0x80 and max_bytes >= _RESERVE + MAX_VARINT_BYTES):
        try:
            hs = sorted(set(handles))
        except TypeError:
            hs = None
        if hs is not None and len(hs) > 1 and len(hs) + MAX_VARINT_BYTES <= max_bytes - _RESERVE:
            body = _delta_bytes(hs)
            if body is not None:
                return [_HEAD.pack(_DONES_PREFIX, epoch) + bytes((expected,)) + body]
        return encode_done_batch_reference(epoch, hs if hs is not None else handles, expected,
                                           max_bytes)
    return encode_done_batch_reference(epoch, handles, expected, max_bytes)


def encode_ack(epoch: int, seq: int, term: int, refused: Iterable[int],
               max_bytes: int, pending: Iterable[int] = ()) -> list[bytes]:
    """``ack``: answer heartbeat ``seq``; the granted term (an int of milliseconds)
    travels as a u32 duration.
    Two handle lists follow: refused, then pending (not registered yet). Every chunk
    repeats seq and term, so any chunk alone is valid. Same bytes as
    ``encode_ack_reference``; the fast path is the common ack (nothing refused or
    pending)."""
    if (not refused and not pending and type(epoch) is int and type(seq) is int
            and 0 <= epoch <= 0xFFFFFFFF and 0 <= seq <= MAX_SEQ
            and max_bytes >= _RESERVE + 5 + MAX_VARINT_BYTES):
        term_ms = term
        if type(term_ms) is int and 0 <= term_ms <= 0xFFFFFFFF:
            return [_HEAD.pack(_ACK_PREFIX, epoch) + _varint_bytes(seq) + _varint_bytes(term_ms)
                    + b"\x00\x00"]
    return encode_ack_reference(epoch, seq, term, refused, max_bytes, pending=pending)


def _fast_handles(buf: bytes, pos: int, end: int) -> tuple[tuple[int, ...], int] | None:
    """A handle list whose deltas are one byte each (count and first handle may be
    longer), or None for the reference decoder to handle."""
    count, pos = _get_varint(buf, pos)
    if count == 0:
        return (), pos
    first, pos = _get_varint(buf, pos)
    stop = pos + count - 1
    if stop > end or first > MAX_HANDLE:
        return None
    if count == 1:
        return (first,), pos
    rest = buf[pos:stop]
    if not rest.isascii() or 0 in rest:  # a multi-byte delta, or a duplicate handle
        return None
    hs = tuple(accumulate(rest, initial=first))
    if hs[-1] > MAX_HANDLE:
        return None
    return hs, stop


def _decode_fast(buf: bytes, n: int, prefix: bytes, ep: int) -> Message | None:
    if prefix == _DONE_PREFIX:
        expected = buf[8]
        if not 0 < expected < 0x80:
            return None
        # The handle is the rest: a canonical varint, unrolled up to three bytes.
        last = buf[n - 1]
        if last >= 0x80 or (last == 0 and n > 10):
            return None
        if n == 10:
            h = last
        elif n == 11:
            b0 = buf[9]
            if b0 < 0x80:
                return None
            h = (b0 & 0x7F) | last << 7
        elif n == 12:
            b0 = buf[9]
            b1 = buf[10]
            if b0 < 0x80 or b1 < 0x80:
                return None
            h = (b0 & 0x7F) | (b1 & 0x7F) << 7 | last << 14
        else:
            h, pos = _get_varint(buf, 9)
            if pos != n or h > MAX_HANDLE:
                return None
        return _new_message(Message, (KIND_DONE, ep, (h,), expected, 0, 0, (), ""))
    if prefix == _HB_PREFIX:
        seq, pos = _get_varint(buf, 8)
        expected, pos = _get_varint(buf, pos)
        if seq > MAX_SEQ or expected > MAX_EXPECTED:
            return None
        r = _fast_handles(buf, pos, n)
        if r is None or r[1] != n:
            return None
        return _new_message(Message, (KIND_HEARTBEAT, ep, r[0], expected, seq, 0, (), ""))
    if prefix == _DONES_PREFIX:
        expected, pos = _get_varint(buf, 8)
        if not 1 <= expected <= MAX_EXPECTED:
            return None
        r = _fast_handles(buf, pos, n)
        if r is None or r[1] != n or not r[0]:
            return None
        return _new_message(Message, (KIND_DONE, ep, r[0], expected, 0, 0, (), ""))
    if prefix == _ACK_PREFIX:
        seq, pos = _get_varint(buf, 8)
        term_ms, pos = _get_varint(buf, pos)
        if seq > MAX_SEQ or term_ms > 0xFFFFFFFF:
            return None
        if pos == n - 2 and buf[pos] == 0 and buf[pos + 1] == 0:
            return _new_message(Message, (KIND_ACK, ep, (), 0, seq, term_ms, (), ""))
        r = _fast_handles(buf, pos, n)
        if r is None:
            return None
        r2 = _fast_handles(buf, r[1], n)
        if r2 is None or r2[1] != n:
            return None
        return _new_message(Message, (KIND_ACK, ep, r[0], 0, seq, term_ms, r2[0], ""))
    return None


def decode(buf: bytes, *, max_bytes: int = 1 << 20, epoch: int | None = None) -> Message:
    """Decode one message or raise WireError. ``epoch``, when given, must match.

    Done, heartbeat and ack messages of the common shapes take a ``struct`` fast path;
    everything else (release, multi-byte deltas, every malformed input) goes through
    ``decode_reference``, so results and errors are the reference decoder's."""
    if type(buf) is bytes:
        n = len(buf)
        if 10 <= n <= max_bytes:
            prefix, ep = _HEAD.unpack_from(buf)
            if epoch is None or ep == epoch:
                try:
                    m = _decode_fast(buf, n, prefix, ep)
                except WireError:
                    m = None
                if m is not None:
                    return m
    return decode_reference(buf, max_bytes=max_bytes, epoch=epoch)


# -- handshake payload -------------------------------------------------------------------

# 2: D may send done batches (wire kind 5); 3: the model identity (``identity``) travels
# and must match field for field.
HANDSHAKE_VERSION: Final = 3
MAX_HANDSHAKE_BYTES: Final = 1 << 20
# Model identity: at most this many fields, names and values of bounded length.
MAX_IDENTITY_FIELDS: Final = 64
MAX_IDENTITY_NAME: Final = 64
MAX_IDENTITY_VALUE: Final = 512


@dataclass(frozen=True)
class Layout:
    """The KV block layout both sides must agree on before any READ."""

    num_blocks: int
    block_bytes: int
    dtype: str
    tp_rank: int
    tp_size: int

    def check(self) -> None:
        if self.num_blocks < 1 or self.block_bytes < 1:
            raise WireError("bad_layout", "num_blocks and block_bytes must be >= 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise WireError("bad_layout", f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")


@dataclass(frozen=True)
class Handshake:
    """Handshake payload, both directions. JSON, never pickle."""

    engine: str  # the sender's NIXL agent name
    epoch: int
    layout: Layout
    agent_metadata: bytes  # opaque NIXL agent metadata (loaded by add_remote_agent)
    role: str  # "producer" or "consumer"
    extra: dict[str, Any] | None = None  # e.g. memory region descriptors as plain numbers
    version: int = HANDSHAKE_VERSION
    # What gives the KV bytes their meaning (model, weights, geometry, versions), field ->
    # value; both sides must send the same mapping (``check_identity``).
    identity: dict[str, str] | None = None

    def encode(self) -> bytes:
        body = {
            "kvproto": self.version,
            "engine": self.engine,
            "epoch": self.epoch,
            "role": self.role,
            "layout": {
                "num_blocks": self.layout.num_blocks,
                "block_bytes": self.layout.block_bytes,
                "dtype": self.layout.dtype,
                "tp_rank": self.layout.tp_rank,
                "tp_size": self.layout.tp_size,
            },
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
            "extra": self.extra or {},
            "identity": self.identity or {},
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def decode_handshake(buf: bytes) -> Handshake:
    """Parse and validate a handshake payload; raise WireError with a clear reason."""
    if len(buf) > MAX_HANDSHAKE_BYTES:
        raise WireError("oversized", f"handshake of {len(buf)} bytes")
    def no_constants(name: str) -> Any:
        raise ValueError(f"non-finite number {name}")

    try:
        d = json.loads(bytes(buf).decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise WireError("malformed_handshake", f"not JSON: {e}") from None
    except RecursionError:
        raise WireError("malformed_handshake", "JSON nested too deeply") from None
    if not isinstance(d, dict) or "kvproto" not in d:
        raise WireError("malformed_handshake", "not a kvproto handshake object")
    if type(d["kvproto"]) is not int or d["kvproto"] != HANDSHAKE_VERSION:
        old = isinstance(d["kvproto"], int) and d["kvproto"] < HANDSHAKE_VERSION
        raise WireError("version", f"handshake version {d['kvproto']!r}, this side speaks "
                                   f"{HANDSHAKE_VERSION}" + (
                                       " (the peer's kvproto predates the model identity "
                                       "check: upgrade it)" if old else ""))
    try:
        lay = d["layout"]
        if not isinstance(lay, dict):
            raise TypeError("layout must be an object")
        layout = Layout(_hs_int(lay, "num_blocks"), _hs_int(lay, "block_bytes"),
                        _hs_str(lay, "dtype"), _hs_int(lay, "tp_rank"), _hs_int(lay, "tp_size"))
        extra = d.get("extra") or {}
        if not isinstance(extra, dict):
            raise TypeError("extra must be an object")
        meta = d["agent_metadata"]
        if not isinstance(meta, str):
            raise TypeError("agent_metadata must be a base64 string")
        hs = Handshake(engine=_hs_str(d, "engine"), epoch=_hs_int(d, "epoch"), layout=layout,
                       agent_metadata=base64.b64decode(meta, validate=True),
                       role=_hs_str(d, "role"), extra=dict(extra),
                       version=d["kvproto"], identity=_identity(d.get("identity")) or None)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise WireError("malformed_handshake", f"bad field: {e}") from None
    if not 0 <= hs.epoch <= 0xFFFFFFFF:
        raise WireError("malformed_handshake", f"epoch {hs.epoch} outside [0, 2^32)")
    if hs.role not in ("producer", "consumer"):
        raise WireError("malformed_handshake", f"unknown role {hs.role!r}")
    layout.check()
    return hs


def _hs_int(d: dict[str, Any], key: str) -> int:
    """A handshake's integer field: a JSON integer (no float, bool or string is coerced)."""
    v = d[key]
    if type(v) is not int:
        raise TypeError(f"{key} must be an integer, got {str(v)[:40]!r}")
    return v


def _hs_str(d: dict[str, Any], key: str) -> str:
    """A handshake's string field: a JSON string (nothing else is turned into one)."""
    v = d[key]
    if not isinstance(v, str):
        raise TypeError(f"{key} must be a string, got {str(v)[:40]!r}")
    return v


def _identity(v: Any) -> dict[str, str]:
    """A handshake's ``identity``: a bounded mapping of short names to short strings."""
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > MAX_IDENTITY_FIELDS:
        raise WireError("malformed_handshake", "identity must be a mapping of at most "
                                               f"{MAX_IDENTITY_FIELDS} fields")
    for k, x in v.items():
        if not isinstance(x, str) or len(k) > MAX_IDENTITY_NAME or len(x) > MAX_IDENTITY_VALUE:
            raise WireError("malformed_handshake", f"identity field {k[:MAX_IDENTITY_NAME]!r}"
                                                   " must be a short string")
    return dict(v)


def check_identity(local: dict[str, str] | None, remote: dict[str, str] | None,
                   local_side: str = "local", remote_side: str = "remote") -> None:
    """Raise WireError('model_mismatch') naming every field (in name order) whose value
    differs between the two sides or that only one side sends, with both values
    (shortened to 80 characters). Equal mappings (both empty included) pass."""
    mine, theirs = local or {}, remote or {}
    if mine == theirs:
        return

    def show(v: str | None) -> str:
        return "nothing" if v is None else repr(v if len(v) <= 80 else v[:77] + "...")

    diff = [f"{k}: {local_side} has {show(mine.get(k))}, {remote_side} has "
            f"{show(theirs.get(k))}"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    raise WireError("model_mismatch", f"{len(diff)} identity field(s) differ: "
                                      + "; ".join(diff))


def check_peer(hs: Handshake, role: str, layout: Layout, identity: dict[str, str] | None
               ) -> None:
    """What each side checks of its peer's handshake before loading anything: the
    expected ``role``, a compatible layout (``check_layouts``) and the same model identity
    (``check_identity``, field for field). Raises WireError."""
    if hs.role != role:
        raise WireError("malformed_handshake", f"role {hs.role!r}, expected {role}")
    mine, peer = ("D", "P") if role == "producer" else ("P", "D")
    if layout.tp_size != hs.layout.tp_size and identity and hs.identity:
        # Heterogeneous TP: one rank's block holds another number of heads, so block
        # bytes differ. The identity pins what one head's slice holds (head size,
        # layers, KV heads, dtype, block size, kv_layout per head, weights), and both
        # TP sizes must split the model's KV heads (check_tp_pairing).
        check_identity(identity, hs.identity, mine, peer)
        check_tp_pairing(layout.tp_size, hs.layout.tp_size, identity.get("num_kv_heads"))
        if _segment_kind(layout.dtype) != _segment_kind(hs.layout.dtype):
            raise WireError("layout_mismatch", f"local {layout.dtype} vs remote "
                                               f"{hs.layout.dtype}")
        return
    check_layouts(layout, hs.layout)
    check_identity(identity, hs.identity, mine, peer)


def _segment_kind(tag: str) -> tuple[str, str]:
    """A layout's dtype tag (``<dtypes>/<segments>x<bytes per block>``, or a bare dtype)
    without the bytes per block, which differ with the heads a rank holds."""
    dtype, _, shape = tag.partition("/")
    return dtype, shape.split("x")[0]


def check_tp_pairing(local_tp: int, remote_tp: int, kv_heads: str | None) -> None:
    """Raise WireError('model_mismatch') unless both tensor-parallel sizes split the
    model's ``kv_heads`` KV heads (a multiple or a divisor of it each): then every rank of
    one side holds whole heads of the other's (``kvproto.lifecycle.topology``)."""
    try:
        heads = int(kv_heads or "")
    except ValueError:
        raise WireError("model_mismatch", "heterogeneous tensor parallelism needs the "
                                          "model's num_kv_heads in the identity") from None
    for tp in (local_tp, remote_tp):
        if heads < 1 or tp < 1 or (heads % tp and tp % heads):
            raise WireError("model_mismatch", f"tensor_parallel_size {tp} cannot hold "
                                              f"{heads} KV heads")


def check_layouts(local: Layout, remote: Layout) -> None:
    """Raise WireError('layout_mismatch') when blocks cannot be read one to one."""
    if (local.block_bytes, local.dtype) != (remote.block_bytes, remote.dtype):
        raise WireError("layout_mismatch",
                        f"local {local.block_bytes} B/{local.dtype} vs remote "
                        f"{remote.block_bytes} B/{remote.dtype}")
