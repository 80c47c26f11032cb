"""The wire codec (``kvproto.wire``).

Round trips for every kind, compactness (handles only, small heartbeats), chunking under
``max_message_bytes``, and a decoder that rejects every malformed input with a stable
``WireError.reason`` and never raises anything else.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.testing.sim import Faults, Network, Simulator
from kvproto.wire import (
    HEADER,
    KIND_ACK,
    KIND_DONE,
    KIND_HEARTBEAT,
    KIND_RELEASE,
    MAGIC,
    MAX_EXPECTED,
    MAX_HANDLE,
    MAX_SEQ,
    VERSION,
    Handshake,
    Layout,
    Message,
    WireError,
)

EPOCH = 0xC0FFEE

epochs = st.integers(0, 0xFFFFFFFF)
handles_st = st.integers(0, MAX_HANDLE)
handle_sets = st.lists(handles_st, max_size=300)
expecteds = st.integers(1, MAX_EXPECTED)
seqs = st.integers(0, MAX_SEQ)
max_bytes_st = st.integers(64, 4096)


def reason_of(buf: bytes, **kwargs: Any) -> str:
    """Decode ``buf`` expecting a WireError; return its reason."""
    with pytest.raises(WireError) as info:
        wire.decode(buf, **kwargs)
    return info.value.reason


def header(kind: int, epoch: int = EPOCH, *, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, kind, epoch)


def sample_messages() -> list[bytes]:
    """One valid message of every kind, with multi-byte varints in them."""
    return [
        wire.encode_done(EPOCH, 300, 2),
        *wire.encode_heartbeat(EPOCH, 70000, [1, 2, 200, 100000], 3, 4096),
        *wire.encode_release(EPOCH, [5, 1 << 40], 1, 4096),
        *wire.encode_done_batch(EPOCH, [7, 300, 1 << 40], 2, 4096),
        *wire.encode_ack(EPOCH, 12, 20_000, [7, 9000], 4096, pending=[3, 300]),
        *wire.encode_heartbeat(EPOCH, 1, [], 1, 4096),
        *wire.encode_never(EPOCH, [4, 1 << 40], 4096),
        wire.encode_claim(EPOCH, 1 << 40, "0123456789abcdef" * 2),
    ]


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@given(epochs, handles_st, expecteds)
def test_done_round_trips(epoch: int, handle: int, expected: int) -> None:
    buf = wire.encode_done(epoch, handle, expected)
    assert wire.decode(buf, epoch=epoch) == Message(KIND_DONE, epoch, (handle,), expected)


@given(epochs, seqs, handle_sets, st.integers(0, MAX_EXPECTED), max_bytes_st)
def test_heartbeat_round_trips_in_chunks_within_max_bytes(
        epoch: int, seq: int, handles: list[int], expected: int, max_bytes: int) -> None:
    chunks = wire.encode_heartbeat(epoch, seq, handles, expected, max_bytes)
    got: list[int] = []
    for k, buf in enumerate(chunks):
        assert len(buf) <= max_bytes
        m = wire.decode(buf, max_bytes=max_bytes, epoch=epoch)
        assert (m.kind, m.epoch, m.expected) == (KIND_HEARTBEAT, epoch, expected)
        assert m.seq == (seq + k) & MAX_SEQ  # chunk k carries seq + k
        got.extend(m.handles)
    assert got == sorted(set(handles))


@given(epochs, handle_sets, expecteds, max_bytes_st)
def test_release_round_trips_in_chunks_within_max_bytes(
        epoch: int, handles: list[int], expected: int, max_bytes: int) -> None:
    chunks = wire.encode_release(epoch, handles, expected, max_bytes)
    got: list[int] = []
    for buf in chunks:
        assert len(buf) <= max_bytes
        m = wire.decode(buf, max_bytes=max_bytes, epoch=epoch)
        assert (m.kind, m.expected) == (KIND_RELEASE, expected)
        got.extend(m.handles)
    assert got == sorted(set(handles))


@given(epochs, st.lists(handles_st, min_size=1, max_size=300), expecteds, max_bytes_st)
def test_done_batch_round_trips_in_chunks_within_max_bytes(
        epoch: int, handles: list[int], expected: int, max_bytes: int) -> None:
    """A done batch decodes to ``done`` messages (the same message as kind 1) naming every
    handle once; one handle is a plain done, byte for byte."""
    chunks = wire.encode_done_batch(epoch, handles, expected, max_bytes)
    got: list[int] = []
    for buf in chunks:
        assert len(buf) <= max_bytes
        m = wire.decode(buf, max_bytes=max_bytes, epoch=epoch)
        assert m == wire.decode_reference(buf, max_bytes=max_bytes, epoch=epoch)
        assert (m.kind, m.kind_name, m.expected) == (KIND_DONE, "done", expected)
        got.extend(m.handles)
    assert got == sorted(set(handles))
    if len(set(handles)) == 1:
        assert chunks == [wire.encode_done(epoch, handles[0], expected)]
    else:
        assert all(buf[3] == wire.KIND_DONE_BATCH for buf in chunks)


def test_done_batch_refuses_nothing_to_say_and_bad_expected() -> None:
    with pytest.raises(ValueError):
        wire.encode_done_batch(EPOCH, [], 1, 4096)
    with pytest.raises(ValueError):
        wire.encode_done_batch(EPOCH, [1, 2], 0, 4096)
    kind5 = wire.KIND_DONE_BATCH
    assert reason_of(header(kind5) + b"\x01\x00") == "bad_field"  # no handle
    assert reason_of(header(kind5) + b"\x00\x02\x01\x01") == "bad_field"  # expected 0
    assert reason_of(header(kind5) + b"\x01\x02\x05\x00") == "bad_field"  # duplicate
    assert reason_of(header(kind5) + b"\x01\x03\x05\x01") == "truncated"


@given(epochs, seqs, st.integers(0, 4_000_000), handle_sets, handle_sets, max_bytes_st)
def test_ack_round_trips_in_chunks_within_max_bytes(
        epoch: int, seq: int, term_ms: int, refused: list[int], pending: list[int],
        max_bytes: int) -> None:
    chunks = wire.encode_ack(epoch, seq, term_ms, refused, max_bytes, pending=pending)
    got_refused: list[int] = []
    got_pending: list[int] = []
    for buf in chunks:
        assert len(buf) <= max_bytes
        m = wire.decode(buf, max_bytes=max_bytes, epoch=epoch)
        assert (m.kind, m.seq) == (KIND_ACK, seq)  # every chunk alone is a valid ack
        assert m.term_ms == term_ms  # the term travels as a duration in ms, unchanged
        got_refused.extend(m.handles)
        got_pending.extend(m.pending)
    assert got_refused == sorted(set(refused))
    assert got_pending == sorted(set(pending))


def test_ack_term_travels_as_milliseconds() -> None:
    (buf,) = wire.encode_ack(EPOCH, 5, 20_000, [], 4096)
    m = wire.decode(buf)
    assert (m.term_ms, m.handles, m.pending) == (20_000, (), ())


@pytest.mark.parametrize(("call", "message"), [
    (lambda: wire.encode_done(EPOCH, -1, 1), "handle"),
    (lambda: wire.encode_done(EPOCH, MAX_HANDLE + 1, 1), "handle"),
    (lambda: wire.encode_done(EPOCH, 1, 0), "expected"),
    (lambda: wire.encode_done(1 << 32, 1, 1), "epoch"),
    (lambda: wire.encode_release(EPOCH, [1], 0, 4096), "expected"),
    (lambda: wire.encode_heartbeat(EPOCH, MAX_SEQ + 1, [1], 1, 4096), "seq"),
    (lambda: wire.encode_heartbeat(EPOCH, 1, [True], 1, 4096), "handle"),
    (lambda: wire.encode_heartbeat(EPOCH, 1, [1], 1, 20), "max_bytes"),
])
def test_encoders_refuse_out_of_range_fields(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------
# Compactness: handles only, small heartbeats
# ---------------------------------------------------------------------------


def test_heartbeat_costs_at_most_12_bytes_per_request() -> None:
    """Realistic handle sets: a monotone handle counter, in-flight requests a sparse
    subset of the last few thousand handles, plus a large offset (a long-running P)."""
    rng = random.Random(4)
    for n, window, base in ((1, 1, 7), (64, 1000, 10**6), (1000, 5000, 10**9),
                            (1000, 200_000, 10**12)):
        handles = rng.sample(range(base, base + window), n)
        chunks = wire.encode_heartbeat(EPOCH, 1, handles, 2, 4096)
        total = sum(len(c) for c in chunks)
        per_id = total / n if n > 1 else total - wire.HEADER_SIZE
        assert per_id <= 12, f"{per_id:.1f} bytes per id for {n} handles in {window}"


def test_dense_heartbeat_costs_about_one_byte_per_request() -> None:
    handles = range(10**6, 10**6 + 1000)
    (buf,) = wire.encode_heartbeat(EPOCH, 1, handles, 1, 4096)
    assert len(buf) <= 1000 + 24


def test_request_ids_never_appear_on_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator carries real encoded bytes; its request ids contain ':' and ','
    and must never be sent: P hands D compact handles instead."""
    sent: list[bytes] = []
    original = Network.send

    def record(self: Network, now: float, src: str, dst: str, data: bytes) -> None:
        sent.append(data)
        original(self, now, src, dst, data)

    monkeypatch.setattr(Network, "send", record)
    sim = Simulator(3, faults=Faults(malformed_rate=0.0), capacity=128)
    rids: list[str] = []
    original_new = sim.new_request

    def new_request(n: int = 1, engine: str | None = None) -> list[str]:
        out = original_new(n, engine)
        rids.extend(out)
        return out

    monkeypatch.setattr(sim, "new_request", new_request)
    sim.run(20.0)
    assert len(rids) > 10 and len(sent) > 10
    blob = b"\n".join(sent)
    assert b"cmpl-" not in blob
    for rid in rids:
        assert rid.encode() not in blob


# ---------------------------------------------------------------------------
# Malformed input: WireError with a stable reason, nothing else
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("buf", sample_messages())
def test_truncation_at_every_byte_is_rejected(buf: bytes) -> None:
    assert wire.decode(buf).epoch == EPOCH
    for i in range(len(buf)):
        assert reason_of(buf[:i]) == "truncated", f"cut at byte {i} of {buf.hex()}"


def test_bad_magic_is_rejected() -> None:
    assert reason_of(header(KIND_DONE, magic=b"XX") + b"\x01\x01") == "bad_magic"


def test_wrong_version_is_rejected() -> None:
    assert reason_of(header(KIND_DONE, version=VERSION + 1) + b"\x01\x01") == "version"


@pytest.mark.parametrize("kind", [0, 10, 255])
def test_unknown_kind_is_rejected(kind: int) -> None:
    assert reason_of(header(kind) + b"\x01\x01") == "unknown_kind"


@pytest.mark.parametrize("buf", sample_messages())
def test_trailing_bytes_are_rejected(buf: bytes) -> None:
    # A claim is (handle, capability) pairs to its end: a stray byte is a cut pair.
    want = "truncated" if wire.decode(buf).kind == wire.KIND_CLAIM else "trailing_bytes"
    assert reason_of(buf + b"\x00") == want


def test_non_canonical_varint_is_rejected() -> None:
    assert reason_of(header(KIND_DONE) + b"\x81\x00\x01") == "malformed_varint"


def test_overlong_varint_is_rejected() -> None:
    assert reason_of(header(KIND_DONE) + b"\x81" * 10 + b"\x01" + b"\x01") == "malformed_varint"


def test_zero_delta_duplicate_handle_is_rejected() -> None:
    # heartbeat: seq 1, expected 1, count 2, handle 5, delta 0
    assert reason_of(header(KIND_HEARTBEAT) + bytes([1, 1, 2, 5, 0])) == "bad_field"


@pytest.mark.parametrize(("body", "kind"), [
    (bytes([0, 1]), KIND_DONE),  # expected readers 0
    (bytes([0, 0]), KIND_RELEASE),  # expected readers 0
    (b"\xff\xff\xff\xff\x7f" + bytes([1, 0]), KIND_HEARTBEAT),  # seq above 2**32-1
    (bytes([1]) + b"\xff\xff\xff\xff\x7f" + bytes([0, 0]), KIND_ACK),  # term above 2**32-1
    (bytes([1]) + b"\xff" * 9 + b"\x7f", KIND_DONE),  # handle above 2**64-1
])
def test_out_of_range_fields_are_rejected(body: bytes, kind: int) -> None:
    assert reason_of(header(kind) + body) == "bad_field"


def test_count_larger_than_the_message_is_rejected() -> None:
    assert reason_of(header(KIND_RELEASE) + bytes([1, 100, 1])) == "truncated"


def test_oversized_message_is_rejected() -> None:
    (buf,) = wire.encode_heartbeat(EPOCH, 1, range(100), 1, 4096)
    assert reason_of(buf, max_bytes=len(buf) - 1) == "oversized"
    assert wire.decode(buf, max_bytes=len(buf)).handles == tuple(range(100))


def test_wrong_epoch_is_rejected() -> None:
    buf = wire.encode_done(EPOCH, 1, 1)
    assert reason_of(buf, epoch=EPOCH + 1) == "epoch"


def test_non_bytes_input_is_rejected() -> None:
    assert reason_of("KV" * 8) == "not_bytes"  # type: ignore[arg-type]


_REASONS = {"truncated", "bad_magic", "version", "epoch", "unknown_kind", "trailing_bytes",
            "malformed_varint", "bad_field", "oversized", "not_bytes"}


@given(st.binary(max_size=200))
def test_fuzzed_bytes_raise_only_wire_error(buf: bytes) -> None:
    try:
        wire.decode(buf, max_bytes=128, epoch=EPOCH)
    except WireError as e:
        assert e.reason in _REASONS
        assert str(e).startswith(e.reason + ": ")


@given(st.integers(0, 6), st.binary(max_size=120))
def test_fuzzed_bodies_behind_a_valid_header_raise_only_wire_error(kind: int,
                                                                   body: bytes) -> None:
    try:
        m = wire.decode(header(kind) + body, max_bytes=4096)
    except WireError as e:
        assert e.reason in _REASONS
    else:
        assert m.kind == kind and m.epoch == EPOCH
        assert all(0 <= h <= MAX_HANDLE for h in m.handles)
        assert list(m.handles) == sorted(set(m.handles))


# ---------------------------------------------------------------------------
# The fast path against the reference codec (byte equality, same decode results)
# ---------------------------------------------------------------------------

# Handles as a ledger hands them out (small, dense: the fast shapes) and anywhere in range.
dense_handles = st.lists(st.integers(0, 5000), max_size=300)
any_handles = st.one_of(dense_handles, handle_sets,
                        st.lists(st.integers(0, 2000), min_size=120, max_size=600))


def outcome(f: Any, *args: Any, **kwargs: Any) -> Any:
    """``f``'s result, or the type and message of what it raised."""
    try:
        return f(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return (type(e).__name__, getattr(e, "reason", None), str(e))


@given(epochs, st.one_of(st.integers(0, 300), handles_st, st.integers(-2, 1 << 65)),
       st.one_of(st.integers(1, 200), expecteds, st.integers(-1, 1 << 17)))
def test_fast_encode_done_is_byte_identical(epoch: int, handle: int, expected: int) -> None:
    assert (outcome(wire.encode_done, epoch, handle, expected)
            == outcome(wire.encode_done_reference, epoch, handle, expected))


@given(st.one_of(epochs, st.just(1 << 32)), st.one_of(seqs, st.just(MAX_SEQ + 1)), any_handles,
       st.integers(0, MAX_EXPECTED + 1), st.integers(16, 4096))
def test_fast_encode_heartbeat_is_byte_identical(epoch: int, seq: int, handles: list[int],
                                                 expected: int, max_bytes: int) -> None:
    assert (outcome(wire.encode_heartbeat, epoch, seq, handles, expected, max_bytes)
            == outcome(wire.encode_heartbeat_reference, epoch, seq, handles, expected, max_bytes))


@given(st.one_of(epochs, st.just(1 << 32)), any_handles, st.integers(-1, 300),
       st.sampled_from([64, 4096, 1 << 16]))
def test_fast_encode_done_batch_is_byte_identical(epoch: int, handles: list[int],
                                                  expected: int, max_bytes: int) -> None:
    assert outcome(wire.encode_done_batch, epoch, handles, expected, max_bytes) == \
        outcome(wire.encode_done_batch_reference, epoch, handles, expected, max_bytes)


def test_fast_encoders_refuse_what_the_reference_refuses() -> None:
    for args in [(EPOCH, 1, [True], 1, 4096), (EPOCH, 1, [1, -1], 1, 4096),
                 (EPOCH, 1, [1, MAX_HANDLE + 1], 1, 4096), (EPOCH, True, [1], 1, 4096)]:
        assert (outcome(wire.encode_heartbeat, *args)
                == outcome(wire.encode_heartbeat_reference, *args))
        assert outcome(wire.encode_heartbeat, *args)[0] == "ValueError"
    assert outcome(wire.encode_done, EPOCH, True, 1) == outcome(wire.encode_done_reference,
                                                                EPOCH, True, 1)


@given(epochs, seqs, st.one_of(st.integers(0, 5_000_000), st.sampled_from([-1, 2**32, 20.0])),
       st.one_of(st.just([]), dense_handles), st.one_of(st.just([]), dense_handles),
       st.integers(32, 4096))
def test_fast_encode_ack_is_byte_identical(epoch: int, seq: int, term: Any,
                                           refused: list[int], pending: list[int],
                                           max_bytes: int) -> None:
    assert (outcome(wire.encode_ack, epoch, seq, term, refused, max_bytes, pending=pending)
            == outcome(wire.encode_ack_reference, epoch, seq, term, refused, max_bytes,
                       pending=pending))


@st.composite
def wire_messages(draw: st.DrawFn) -> bytes:
    """A valid message of any kind (reference encoders), sometimes mutated."""
    epoch = draw(st.sampled_from([EPOCH, 0, 0xFFFFFFFF]))
    kind = draw(st.sampled_from(["done", "hb", "ack", "release", "dones"]))
    if kind == "done":
        buf = wire.encode_done_reference(epoch, draw(st.one_of(st.integers(0, 1 << 21),
                                                               handles_st)), draw(expecteds))
    elif kind == "hb":
        buf = wire.encode_heartbeat_reference(epoch, draw(seqs), draw(any_handles),
                                              draw(st.integers(0, MAX_EXPECTED)), 1 << 16)[0]
    elif kind == "ack":
        buf = wire.encode_ack_reference(epoch, draw(seqs), draw(st.integers(0, 10**6)),
                                        draw(dense_handles), 1 << 16,
                                        pending=draw(dense_handles))[0]
    elif kind == "dones":
        hs = draw(st.lists(st.one_of(st.integers(0, 300), handles_st), min_size=2, max_size=40,
                           unique=True))
        buf = wire.encode_done_batch(epoch, hs, draw(expecteds), 1 << 16)[0]
    else:
        buf = wire.encode_release(epoch, draw(any_handles), draw(expecteds), 1 << 16)[0]
    how = draw(st.sampled_from(["as_is", "as_is", "flip", "cut", "append"]))
    if how == "flip" and buf:
        i = draw(st.integers(0, len(buf) - 1))
        buf = buf[:i] + bytes([buf[i] ^ draw(st.integers(1, 255))]) + buf[i + 1:]
    elif how == "cut":
        buf = buf[:draw(st.integers(0, len(buf)))]
    elif how == "append":
        buf = buf + draw(st.binary(min_size=1, max_size=4))
    return buf


@settings(max_examples=400)
@given(wire_messages(), st.sampled_from([None, EPOCH]), st.sampled_from([1 << 16, 12, 4096]))
def test_fast_decode_agrees_with_the_reference(buf: bytes, epoch: int | None,
                                               max_bytes: int) -> None:
    got = outcome(wire.decode, buf, max_bytes=max_bytes, epoch=epoch)
    assert got == outcome(wire.decode_reference, buf, max_bytes=max_bytes, epoch=epoch)
    if isinstance(got, Message):
        assert type(got) is Message and got.kind_name in ("done", "heartbeat", "ack", "release")


def test_fast_decode_takes_the_fast_path_for_hot_messages() -> None:
    """The hot shapes decode without the reference decoder (it is not consulted)."""
    hot = [wire.encode_done(EPOCH, 123456, 2), wire.encode_done(EPOCH, 5, 1),
           *wire.encode_done_batch(EPOCH, range(7000, 7400), 1, 4096),
           *wire.encode_heartbeat(EPOCH, 9, range(1000, 1300), 2, 4096),
           *wire.encode_ack(EPOCH, 9, 20_000, (), 4096),
           *wire.encode_ack(EPOCH, 9, 20_000, [4, 6], 4096, pending=[300])]
    expect = [wire.decode_reference(b) for b in hot]
    real = wire.decode_reference
    try:
        def refuse(*a: Any, **k: Any) -> wire.Message:
            raise AssertionError("reference decoder used")
        wire.decode_reference = refuse  # type: ignore[assignment]
        assert [wire.decode(b, epoch=EPOCH) for b in hot] == expect
    finally:
        wire.decode_reference = real  # type: ignore[assignment]


# ---------------------------------------------------------------------------
# Handshake payload
# ---------------------------------------------------------------------------


LAYOUT = Layout(num_blocks=1024, block_bytes=65536, dtype="bfloat16", tp_rank=1, tp_size=2)


def handshake_dict(**changes: Any) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(Handshake("P0", 3, LAYOUT, b"\x00meta\xff", "producer").encode())
    d.update(changes)
    return d


def decode_reason(d: Any) -> str:
    with pytest.raises(WireError) as info:
        wire.decode_handshake(json.dumps(d).encode())
    return info.value.reason


@settings(max_examples=60)
@given(st.text(max_size=20), epochs, st.binary(max_size=64),
       st.sampled_from(["producer", "consumer"]),
       st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
def test_handshake_round_trips(engine: str, epoch: int, meta: bytes, role: str,
                               extra: dict[str, int]) -> None:
    hs = Handshake(engine, epoch, LAYOUT, meta, role, extra)
    assert wire.decode_handshake(hs.encode()) == hs


def test_handshake_version_mismatch_is_rejected() -> None:
    assert decode_reason(handshake_dict(kvproto=wire.HANDSHAKE_VERSION + 1)) == "version"
    assert decode_reason(handshake_dict(kvproto=1)) == "version"  # before done batches
    assert decode_reason(handshake_dict(kvproto=float(wire.HANDSHAKE_VERSION))) == "version"


@pytest.mark.parametrize("buf", [b"{", b"\xff\xfe", b"", b"null", b"[1, 2]", b'{"engine": "x"}'])
def test_malformed_handshake_json_is_rejected(buf: bytes) -> None:
    with pytest.raises(WireError) as info:
        wire.decode_handshake(buf)
    assert info.value.reason == "malformed_handshake"


@pytest.mark.parametrize("changes", [
    {"layout": "flat"}, {"layout": {"num_blocks": 1}}, {"agent_metadata": "not base64!"},
    {"epoch": "three"}, {"role": "router"}, {"extra": [1, 2, 3]},
    # No value is coerced: a number written as a string or float, a bool for a number,
    # a non-string name, an epoch outside the wire's u32.
    {"epoch": "3"}, {"epoch": 3.0}, {"epoch": True}, {"epoch": -1}, {"epoch": 1 << 32},
    {"engine": 7}, {"engine": None}, {"role": ["producer"]}, {"agent_metadata": 5},
    {"layout": {**json.loads(Handshake("P0", 3, LAYOUT, b"", "producer").encode())["layout"],
                "num_blocks": 1024.5}},
    {"layout": {**json.loads(Handshake("P0", 3, LAYOUT, b"", "producer").encode())["layout"],
                "tp_size": "2"}},
    {"layout": {**json.loads(Handshake("P0", 3, LAYOUT, b"", "producer").encode())["layout"],
                "dtype": 16}},
])
def test_handshake_with_bad_fields_is_rejected(changes: dict[str, Any]) -> None:
    assert decode_reason(handshake_dict(**changes)) == "malformed_handshake"


@pytest.mark.parametrize("layout", [
    {"num_blocks": 0, "block_bytes": 1, "dtype": "f", "tp_rank": 0, "tp_size": 1},
    {"num_blocks": 1, "block_bytes": 1, "dtype": "f", "tp_rank": 2, "tp_size": 2},
])
def test_handshake_with_impossible_layout_is_rejected(layout: dict[str, Any]) -> None:
    assert decode_reason(handshake_dict(layout=layout)) == "bad_layout"


def test_oversized_handshake_is_rejected() -> None:
    with pytest.raises(WireError) as info:
        wire.decode_handshake(b" " * (wire.MAX_HANDSHAKE_BYTES + 1))
    assert info.value.reason == "oversized"


@pytest.mark.parametrize("remote", [
    Layout(1024, 32768, "bfloat16", 0, 2),
    Layout(1024, 65536, "float16", 0, 2),
])
def test_layout_mismatch_is_rejected(remote: Layout) -> None:
    with pytest.raises(WireError) as info:
        wire.check_layouts(LAYOUT, remote)
    assert info.value.reason == "layout_mismatch"


def test_compatible_layouts_are_accepted() -> None:
    wire.check_layouts(LAYOUT, Layout(4096, 65536, "bfloat16", 0, 4))  # no exception


_json_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(
    allow_nan=True, allow_infinity=False)
_json = st.recursive(_json_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=10)


@given(st.fixed_dictionaries({}, optional={
    "kvproto": st.sampled_from([1, 1.0, 2, "1", None]), "engine": _json, "epoch": _json,
    "role": st.sampled_from(["producer", "consumer", 7]), "agent_metadata": _json,
    "extra": _json, "layout": _json | st.fixed_dictionaries({}, optional={
        k: _json | st.integers(-2, 4) for k in ("num_blocks", "block_bytes", "dtype",
                                                "tp_rank", "tp_size")})}))
def test_fuzzed_handshake_objects_raise_only_wire_error(d: dict[str, Any]) -> None:
    """Finite JSON values only: non-finite numbers have their own test below."""
    try:
        wire.decode_handshake(json.dumps(d).encode())
    except WireError:
        pass


@given(st.binary(max_size=200))
def test_fuzzed_handshake_bytes_raise_only_wire_error(buf: bytes) -> None:
    try:
        wire.decode_handshake(buf)
    except WireError:
        pass


def test_handshake_with_non_finite_number_is_rejected() -> None:
    """Regression: int(inf) raised OverflowError out of decode_handshake."""
    d = handshake_dict()
    d["layout"]["num_blocks"] = float("inf")
    buf = json.dumps(d).encode()  # {"num_blocks": Infinity}
    with pytest.raises(WireError):
        wire.decode_handshake(buf)


def test_deeply_nested_handshake_is_rejected() -> None:
    """Regression: json.loads raised RecursionError out of decode_handshake."""
    with pytest.raises(WireError):
        wire.decode_handshake(b"[" * 100_000)


def test_handshake_agent_metadata_is_base64_in_json() -> None:
    d = handshake_dict()
    assert base64.b64decode(d["agent_metadata"]) == b"\x00meta\xff"
    assert d["kvproto"] == wire.HANDSHAKE_VERSION


IDENT = {"weights": "sha256:aa", "dtype": "bfloat16", "num_layers": "2"}


@settings(max_examples=60)
@given(st.dictionaries(st.text(max_size=wire.MAX_IDENTITY_NAME),
                       st.text(max_size=wire.MAX_IDENTITY_VALUE), min_size=1, max_size=5))
def test_handshake_identity_round_trips(identity: dict[str, str]) -> None:
    hs = Handshake("P0", 3, LAYOUT, b"m", "producer", {}, identity=identity)
    assert wire.decode_handshake(hs.encode()) == hs


@pytest.mark.parametrize("identity", [
    [1, 2], "x", {"weights": 3}, {"weights": None}, {"w": "v" * (wire.MAX_IDENTITY_VALUE + 1)},
    {"k" * (wire.MAX_IDENTITY_NAME + 1): "v"},
    {f"f{i}": "v" for i in range(wire.MAX_IDENTITY_FIELDS + 1)},
])
def test_handshake_with_bad_identity_is_rejected(identity: Any) -> None:
    assert decode_reason(handshake_dict(identity=identity)) == "malformed_handshake"


def test_old_handshake_version_is_refused_with_a_clear_reason() -> None:
    with pytest.raises(WireError) as info:
        wire.decode_handshake(json.dumps(handshake_dict(kvproto=2)).encode())
    assert info.value.reason == "version"
    assert "predates the model identity" in info.value.detail


def test_identity_mismatch_names_every_differing_field() -> None:
    wire.check_identity(IDENT, dict(IDENT))  # equal: no exception
    wire.check_identity(None, {})
    other = {**IDENT, "weights": "sha256:bb", "extra": "x"}
    del other["dtype"]
    with pytest.raises(WireError) as info:
        wire.check_identity(IDENT, other, "D", "P")
    assert info.value.reason == "model_mismatch"
    d = info.value.detail
    assert "3 identity field(s) differ" in d
    assert "weights: D has 'sha256:aa', P has 'sha256:bb'" in d
    assert "dtype: D has 'bfloat16', P has nothing" in d
    assert "extra: D has nothing, P has 'x'" in d
    assert "num_layers" not in d
    with pytest.raises(WireError):  # a side that sends no identity matches no side that does
        wire.check_identity({}, IDENT)


def test_check_peer_checks_role_layout_and_identity() -> None:
    hs = Handshake("P0", 3, LAYOUT, b"m", "producer", {}, identity=IDENT)
    wire.check_peer(hs, "producer", LAYOUT, IDENT)
    for role, layout, ident, reason in [
            ("consumer", LAYOUT, IDENT, "malformed_handshake"),
            ("producer", Layout(1024, 32768, "bfloat16", 0, 2), IDENT, "layout_mismatch"),
            ("producer", LAYOUT, {**IDENT, "weights": "revision:v2"}, "model_mismatch")]:
        with pytest.raises(WireError) as info:
            wire.check_peer(hs, role, layout, ident)
        assert info.value.reason == reason
    with pytest.raises(WireError) as info:
        wire.check_peer(hs, "producer", LAYOUT, {**IDENT, "weights": "revision:v2"})
    assert "weights: D has 'revision:v2', P has 'sha256:aa'" in info.value.detail


def test_check_peer_at_unequal_tp_compares_segment_kinds_not_rank_bytes() -> None:
    """At unequal TP sizes a rank's block holds another number of heads: the segments'
    bytes per block differ and pass; their dtype and count must still agree."""
    ident = {**IDENT, "num_kv_heads": "2"}
    p = Layout(1024, 16384, "float32/2x8192", 0, 1)  # P TP 1: 2 heads per block
    hs = Handshake("P0", 3, p, b"m", "producer", {}, identity=ident)
    wire.check_peer(hs, "producer", Layout(1024, 8192, "float32/2x4096", 1, 2), ident)
    for bad in ("float16/2x4096", "float32/3x4096"):
        with pytest.raises(WireError) as info:
            wire.check_peer(hs, "producer", Layout(1024, 8192, bad, 1, 2), ident)
        assert info.value.reason == "layout_mismatch"


def test_grant_and_claim_refused_roundtrip() -> None:
    from kvproto.wire import KIND_CLAIM_REFUSED, KIND_GRANT, decode, encode_grant

    g = decode(encode_grant(7, 300, True), epoch=7)
    assert (g.kind, g.handles, g.kind_name) == (KIND_GRANT, (300,), "grant")
    r = decode(encode_grant(7, 5, False), epoch=7)
    assert (r.kind, r.handles, r.kind_name) == (KIND_CLAIM_REFUSED, (5,), "claim_refused")
    assert reason_of(encode_grant(7, 5, True) + b"\x00") == "trailing_bytes"
    assert reason_of(encode_grant(7, 5, True)[:-1]) == "truncated"


def test_claims_and_answers_batch_and_chunk() -> None:
    from kvproto.wire import KIND_CLAIM, KIND_GRANT, decode, encode_claims, encode_grants

    caps = [f"{i:032x}" for i in range(1, 41)]
    claims = [(1000 + i, c) for i, c in enumerate(caps)]
    one = encode_claims(7, claims, 4096)
    assert len(one) == 1
    m = decode(one[0], epoch=7)
    assert (m.kind, m.handles, m.capabilities) == (KIND_CLAIM, tuple(h for h, _ in claims),
                                                   tuple(caps))
    parts = encode_claims(7, claims, 128)  # small messages: chunked, order kept
    assert len(parts) > 1 and all(len(b) <= 128 for b in parts)
    got = [(h, c) for b in parts for h, c in zip(decode(b).handles, decode(b).capabilities,
                                                  strict=True)]
    assert got == claims
    with pytest.raises(ValueError):
        encode_claims(7, [(1, "ab")], 4096)  # not a capability: never sent
    g = encode_grants(7, [9, 3, 5], True, 4096)
    assert [decode(b).handles for b in g] == [(3, 5, 9)] and decode(g[0]).kind == KIND_GRANT
    assert reason_of(bytes(g[0][:-2]) + b"\x00") in ("truncated", "bad_field")
