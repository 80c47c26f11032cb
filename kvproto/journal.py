"""The event journal (flight recorder) of both machines: writer and defensive reader.

Format (spec/PROTOCOL.md, "Journal"): JSON Lines. Line 1 is a header
``{"kvproto_journal": 2, "config": {...}, "capacity": N, "meta": {...}}`` for P's ledger,
or ``{"kvproto_journal": 2, "side": "D", "reader": "d0", "config": {...}, "meta": {...}}``
for one D rank's ``Consumer``; every further line is one input event of that machine and
the effects it produced::

    {"n": 7, "event": {"type": "done", "reader": "d0", "handle": 3, "expected": 2,
     "now": 12500}, "effects": [{"type": "free", "handle": 3, ...}]}

Times (``now``, a free's ``deadline``, an ack's ``term``, the params' ``initial_term``)
are integer milliseconds, as the machines see them; the header's config keeps the user's
seconds. Version 1 journals (times in float seconds) are still read: each time is turned
into milliseconds at read time, and must be a whole number of them.

``kvproto replay`` (:mod:`kvproto.verify.replay`) feeds the events to a fresh machine of
the journal's side and compares effects line by line.

Reading is defensive (the file may come from anywhere): lines are read as bytes, at most
``MAX_LINE_BYTES`` each, must be UTF-8 JSON nested at most ``MAX_JSON_DEPTH`` deep with
no NaN/Infinity, and the header's capacity is at most ``MAX_CAPACITY`` blocks. Anything
else is a ``JournalError`` naming the line: never a traceback, never a huge allocation.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import IO, Any, Final

from kvproto.errors import UsageError
from kvproto.lifecycle import (
    MAX_POOL_BLOCKS,
    Abort,
    Ack,
    Admit,
    ClaimGranted,
    ClaimRefused,
    Config,
    ConfigError,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    Done,
    DReject,
    DRejected,
    DropPeer,
    DTick,
    Effect,
    Event,
    Finished,
    Free,
    HandshakeFailed,
    HandshakeOk,
    Heartbeat,
    NeverRegistered,
    PeerLost,
    PostRead,
    Quarantined,
    ReadFailed,
    ReadOk,
    Register,
    Reject,
    Rejected,
    Release,
    Schedule,
    SendClaim,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    Tick,
    TransferParams,
    Unquarantined,
    is_whole_ms,
    to_ms,
)

log = logging.getLogger(__name__)

JOURNAL_VERSION: Final = 2  # written; READ_VERSIONS are read
READ_VERSIONS: Final = (1, 2)  # 1: times in float seconds, 2: in integer milliseconds
# Version 1 time fields, turned into milliseconds when read: of events and effects, and
# of the transfer params an admit carries.
_V1_TIMES: Final = ("now", "term", "deadline")
MAX_LINE_BYTES: Final = 16 << 20  # a heartbeat of a 1 MiB message is about 8 MiB of JSON
MAX_JSON_DEPTH: Final = 8  # the format needs 4 (line, effects list, effect, blocks list)
MAX_CAPACITY: Final = MAX_POOL_BLOCKS  # blocks in the header (BlockPool's own cap)

_EVENT_TYPES: Final[dict[str, type]] = {
    "register": Register, "done": Done, "heartbeat": Heartbeat, "release": Release,
    "abort": Abort, "tick": Tick, "reject": Reject,
}
_EFFECT_TYPES: Final[dict[str, type]] = {"free": Free, "ack": Ack, "rejected": Rejected}
# D (one decode rank): the event names of D_TRANSITIONS; effects in snake case.
_D_EVENT_TYPES: Final[dict[str, type]] = {
    "admit": Admit, "handshake_ok": HandshakeOk, "handshake_failed": HandshakeFailed,
    "schedule": Schedule, "read_ok": ReadOk, "read_failed": ReadFailed, "abort": DAbort,
    "ack": DAck, "peer_lost": PeerLost, "tick": DTick, "reject": DReject,
    "claim_granted": ClaimGranted, "claim_refused": ClaimRefused, "never": NeverRegistered,
}
_D_EFFECT_TYPES: Final[dict[str, type]] = {
    "start_handshake": StartHandshake, "post_read": PostRead, "send_done": SendDone,
    "send_release": SendRelease, "send_heartbeat": SendHeartbeat, "finished": Finished,
    "drop_peer": DropPeer, "rejected": DRejected, "quarantined": Quarantined,
    "unquarantined": Unquarantined, "send_claim": SendClaim,
}
_TYPE_OF: Final = {v: k for table in (_EVENT_TYPES, _EFFECT_TYPES, _D_EVENT_TYPES,
                                      _D_EFFECT_TYPES) for k, v in table.items()}
SIDES: Final = ("P", "D")


class JournalError(UsageError, ValueError):
    """A journal line that cannot be read. ``line`` is 1-based."""

    def __init__(self, line: int, msg: str) -> None:
        super().__init__(f"line {line}: {msg}")
        self.line = line


def to_json(obj: Event | Effect | DEvent | DEffect) -> dict[str, Any]:
    d: dict[str, Any] = {"type": _TYPE_OF[type(obj)]}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, TransferParams):
            v = v.to_dict()
        d[f.name] = list(v) if isinstance(v, tuple) else v
    return d


def _check_type(name: str, v: Any, annotation: str) -> Any:
    """Check a JSON value against a dataclass field annotation (as written in lifecycle)."""
    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    def is_num(x: Any) -> bool:
        return (is_int(x) or isinstance(x, float)) and math.isfinite(x)

    ok: bool
    if annotation == "int":
        ok = is_int(v)
    elif annotation == "float":
        ok = is_num(v)
    elif annotation == "str":
        ok = isinstance(v, str)
    elif annotation == "str | None":
        ok = v is None or isinstance(v, str)
    elif annotation == "int | None":
        ok = v is None or is_int(v)
    elif annotation == "bool":
        ok = isinstance(v, bool)
    elif annotation == "TransferParams":
        try:
            v = TransferParams.from_dict(v) if isinstance(v, dict) else None
        except (KeyError, TypeError, ValueError):
            v = None
        ok = v is not None
    elif annotation == "tuple[int, ...]":
        ok = isinstance(v, list) and all(is_int(x) for x in v)
        v = tuple(v) if ok else v
    else:  # pragma: no cover - a new field type must be added here
        raise ValueError(f"field {name!r} has an unsupported type {annotation}")
    if not ok:
        raise ValueError(f"field {name!r} must be {annotation}, got {v!r}")
    return v


def _from_json(d: Any, table: dict[str, type], what: str) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object")
    cls = table.get(d.get("type", ""))
    if cls is None:
        raise ValueError(f"unknown {what} type {d.get('type')!r}")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in d:
            if f.default is not f.default_factory:  # has a default
                continue
            raise ValueError(f"{what} {d['type']!r} lacks field {f.name!r}")
        kwargs[f.name] = _check_type(f.name, d[f.name], str(f.type))
    extra = set(d) - {"type"} - {f.name for f in fields(cls)}
    if extra:
        raise ValueError(f"{what} {d['type']!r} has unknown fields {sorted(extra)}")
    return cls(**kwargs)


def _check_now(d: Any) -> None:
    if isinstance(d, dict) and "now" in d:
        now = d["now"]
        if isinstance(now, bool) or not isinstance(now, int):
            raise ValueError(f"event time must be an int of milliseconds, got {now!r}")


def event_from_json(d: Any) -> Event:
    _check_now(d)
    ev: Event = _from_json(d, _EVENT_TYPES, "event")
    return ev


def effect_from_json(d: Any) -> Effect:
    eff: Effect = _from_json(d, _EFFECT_TYPES, "effect")
    return eff


def d_event_from_json(d: Any) -> DEvent:
    _check_now(d)
    ev: DEvent = _from_json(d, _D_EVENT_TYPES, "event")
    return ev


def d_effect_from_json(d: Any) -> DEffect:
    eff: DEffect = _from_json(d, _D_EFFECT_TYPES, "effect")
    return eff


def journal_side(header: dict[str, Any]) -> str:
    """"P" (a ledger's journal) or "D" (one decode rank's)."""
    side = header.get("side", "P")
    if side not in SIDES:
        raise JournalError(1, f"header side must be one of {', '.join(SIDES)}, got {side!r}")
    if side == "D" and not isinstance(header.get("reader"), str):
        raise JournalError(1, "a D journal's header names its reader (a string)")
    return str(side)


class JournalWriter:
    """Records every event of one machine and its effects. Pass ``writer.sink`` to
    ``Ledger`` (P: give the pool's ``capacity``) or to ``Consumer`` (D: give ``reader``
    and no capacity).

    The core stays sans-I/O: the machine only calls the sink; this class does the writing.
    ``flush_every`` bounds what a crash can lose (lines are flushed in batches).
    """

    def __init__(self, path: str | Path | IO[str], config: Config, capacity: int | None = None,
                 meta: dict[str, Any] | None = None, *, flush_every: int = 256,
                 reader: str | None = None) -> None:
        if (capacity is None) == (reader is None):
            raise ValueError("a journal is P's (capacity) or one D rank's (reader), not both")
        if isinstance(path, (str, Path)):
            self._f: IO[str] = open(path, "w", encoding="utf-8")
            self._own = True
        else:
            self._f = path
            self._own = False
        self._n = 0
        self._flush_every = max(1, flush_every)
        header: dict[str, Any] = {"kvproto_journal": JOURNAL_VERSION,
                                  "config": config.to_dict(), "meta": meta or {}}
        if reader is not None:
            header.update(side="D", reader=reader)
        else:
            header["capacity"] = capacity
        self._f.write(json.dumps(header, sort_keys=True) + "\n")

    def sink(self, event: Event | DEvent, effects: list[Effect] | list[DEffect]) -> None:
        self._n += 1
        line = {"n": self._n, "event": to_json(event), "effects": [to_json(e) for e in effects]}
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        if self._n % self._flush_every == 0:
            self._f.flush()

    @property
    def events(self) -> int:
        return self._n

    def close(self) -> None:
        self._f.flush()
        if self._own:
            self._f.close()

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def journal_lines(f: IO[bytes]) -> Iterator[bytes]:
    """The lines of a binary file, each at most ``MAX_LINE_BYTES`` (a longer one raises
    JournalError without reading it all into memory)."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise JournalError(lineno, f"line longer than {MAX_LINE_BYTES} bytes")
        yield raw


_JSON_STRING: Final = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")


def _json_depth(raw: bytes) -> int:
    """Nesting depth of a JSON text (brackets outside strings); O(len), at C speed
    except for the brackets themselves."""
    depth = best = 0
    for c in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        if c in b"[{":
            depth += 1
            best = max(best, depth)
        else:
            depth -= 1
    return best


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (JSON has no NaN or Infinity)")


def parse_line(raw: str | bytes, lineno: int, what: str = "") -> Any:
    """One journal line as JSON, within the limits; JournalError naming the line if not."""
    if isinstance(raw, str):
        b = raw.encode("utf-8", errors="surrogatepass")
    else:
        b = bytes(raw)
    if len(b) > MAX_LINE_BYTES:
        raise JournalError(lineno, f"{what}longer than {MAX_LINE_BYTES} bytes")
    try:
        text = b.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JournalError(lineno, f"{what}not UTF-8 (byte {e.start}: {b[e.start:e.start + 1]!r})"
                           ) from None
    if b.count(b"[") + b.count(b"{") > MAX_JSON_DEPTH and _json_depth(b) > MAX_JSON_DEPTH:
        raise JournalError(lineno, f"{what}JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise JournalError(lineno, f"{what}JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, too many digits, NaN/Infinity
        raise JournalError(lineno, f"{what}not JSON: {e}") from None


def header_capacity(header: dict[str, Any]) -> int:
    """The header's block capacity, checked against ``MAX_CAPACITY``."""
    capacity = header.get("capacity")
    if isinstance(capacity, bool) or not isinstance(capacity, int) \
            or not 1 <= capacity <= MAX_CAPACITY:
        raise JournalError(1, f"header capacity must be an int within [1, {MAX_CAPACITY}], "
                              f"got {str(capacity)[:40]}")
    return capacity


def header_config(header: dict[str, Any]) -> Config:
    try:
        return Config.from_dict(header.get("config", {}))
    except (ConfigError, TypeError, ValueError, OverflowError) as e:
        raise JournalError(1, f"invalid config in header: {e}") from None


def read_journal_objects(lines: Iterable[str] | Iterable[bytes] | IO[str] | IO[bytes]
                         ) -> tuple[dict[str, Any], Iterator[tuple[int, dict[str, Any]]]]:
    """The header and a lazy iterator of (line, JSON object) for the other lines."""
    it: Iterator[str | bytes] = iter(lines)
    try:
        first = next(it)
    except StopIteration:
        raise JournalError(1, "empty journal (no header line)") from None
    header = parse_line(first, 1, "header is ")
    version = header.get("kvproto_journal") if isinstance(header, dict) else None
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise JournalError(1, "not a kvproto journal header (version "
                              f"{' or '.join(map(str, READ_VERSIONS))})")

    def body() -> Iterator[tuple[int, dict[str, Any]]]:
        for lineno, raw in enumerate(it, start=2):
            if not raw.strip():
                continue
            d = parse_line(raw, lineno)
            if not isinstance(d, dict) or "event" not in d:
                raise JournalError(lineno, "line must be an object with an 'event'")
            if version == 1:
                _v1_to_ms(lineno, d)
            yield lineno, d

    return header, body()


def _v1_ms(lineno: int, what: str, v: Any) -> Any:
    """A version 1 time (float seconds) as integer milliseconds; a value that is not a
    number is left for the field check to report."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    if not math.isfinite(v) or not is_whole_ms(v):
        raise JournalError(lineno, f"version 1 {what} {v!r} s is not a whole number of "
                                   "milliseconds (times are read as integer milliseconds)")
    return to_ms(v)


def _v1_to_ms(lineno: int, d: dict[str, Any]) -> None:
    """Turn a version 1 line's times (seconds) into version 2's (milliseconds), in place."""
    objs = [d["event"], *(d.get("effects") or [])] if isinstance(d.get("effects", []), list) \
        else [d["event"]]
    for o in objs:
        if not isinstance(o, dict):
            continue
        for k in _V1_TIMES:
            if k in o:
                o[k] = _v1_ms(lineno, f"{o.get('type')} {k}", o[k])
        p = o.get("params")
        if isinstance(p, dict) and "initial_term" in p:
            p["initial_term"] = _v1_ms(lineno, "initial_term", p["initial_term"])


def read_journal(lines: Iterable[str] | Iterable[bytes] | IO[str] | IO[bytes]
                 ) -> tuple[dict[str, Any], Iterator[tuple[int, Any, list[Any]]]]:
    """Parse the header eagerly and return it with a lazy iterator of (line, event,
    effects): ledger events and effects for a P journal, Consumer ones for a D journal.
    Lines may be str or bytes (bytes are checked to be UTF-8)."""
    header, objs = read_journal_objects(lines)
    side = journal_side(header)

    def body() -> Iterator[tuple[int, Any, list[Any]]]:
        for lineno, d in objs:
            yield lineno, *decode_row(lineno, d, side)

    return header, body()


def decode_row(lineno: int, d: dict[str, Any], side: str = "P") -> tuple[Any, list[Any]]:
    """The event and effects of one parsed journal line of a P (ledger) or D (Consumer)
    journal (JournalError if malformed)."""
    parse_ev: Any = event_from_json if side == "P" else d_event_from_json
    parse_eff: Any = effect_from_json if side == "P" else d_effect_from_json
    try:
        ev = parse_ev(d["event"])
        effects = d.get("effects", [])
        if not isinstance(effects, list):
            raise ValueError("'effects' must be a list")
        effs = [parse_eff(e) for e in effects]
    except (ValueError, TypeError, OverflowError) as e:
        raise JournalError(lineno, str(e)[:500]) from None
    return ev, effs
