"""The KV-block lifecycle: the one module that can hold or free blocks.

Everything that affects the lifecycle state machines lives here, h11-style:

* ``Config``       -- timing assumptions and caps, validated;
* ``BlockPool``    -- reference-counted KV blocks (held + free = capacity);
* ``P_TRANSITIONS``-- the producer (P) transition table; the code looks up every
  destination state in it, so code and table cannot diverge;
* ``Ledger``       -- P's sans-I/O machine: events in, effects out;
* ``D_TRANSITIONS``/``Consumer`` -- one decode rank's (D) machine.

No sockets, threads or clocks: time is an argument of every event. The TLA+ spec
in ``kvproto/tla/KVLifecycle.tla`` mirrors this module one to one (same state names, same
action names); ``spec/PROTOCOL.md`` is the prose mirror. Each ledger method names
the TLA+ action it mirrors.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Final, NamedTuple

from kvproto.wire import chunk_handles

# ---------------------------------------------------------------------------
# Names. One name, one thing: these strings are the state/event names used in
# the table, the journal, the TLA+ spec and spec/PROTOCOL.md.
# ---------------------------------------------------------------------------

UNREGISTERED: Final = "unregistered"  # pseudo-state: not registered yet (messages are staged)
REGISTERED: Final = "registered"  # held, initial lease, no message from any reader yet
LEASED: Final = "leased"  # held, a reader renewed the lease, no reader finished yet
NOTIFIED: Final = "notified"  # held, some but not all expected readers finished
ABORTED: Final = "aborted"  # held, aborted on P: renewals stop, waits for readers or deadline
EXPIRED: Final = "expired"  # terminal: freed because the lease ran out
FREED: Final = "freed"  # terminal: freed by the protocol (transferred/released/sibling/aborted)

P_STATES: Final = (UNREGISTERED, REGISTERED, LEASED, NOTIFIED, ABORTED, EXPIRED, FREED)
HELD_STATES: Final = frozenset({REGISTERED, LEASED, NOTIFIED, ABORTED})
TERMINAL_STATES: Final = frozenset({EXPIRED, FREED})

# P events (TLA+ actions: Register, Done, Heartbeat, Release, Abort, Tick). "sibling"
# is the internal cascade inside Done/Register that frees the other group members.
REGISTER: Final = "register"
DONE: Final = "done"
HEARTBEAT: Final = "heartbeat"
RELEASE: Final = "release"
ABORT: Final = "abort"
TICK: Final = "tick"
SIBLING: Final = "sibling"
P_EVENTS: Final = (REGISTER, DONE, HEARTBEAT, RELEASE, ABORT, TICK, SIBLING)

# Free reasons.
R_TRANSFERRED: Final = "transferred"
R_EXPIRED: Final = "expired"
R_ABORTED: Final = "aborted"
R_RELEASED: Final = "released"
R_SIBLING: Final = "sibling"
FREE_REASONS: Final = (R_TRANSFERRED, R_EXPIRED, R_ABORTED, R_RELEASED, R_SIBLING)


class Transition(NamedTuple):
    """One row of a transition table."""

    src: str
    event: str
    guard: str  # named guard outcome, computed by the machine
    dst: str
    effect: str  # "" (none), "free:<reason>", "stage", "ack", "count:<counter>", "reject:<reason>"
    doc: str


_T = Transition
_HELD_LIVE = (REGISTERED, LEASED, NOTIFIED)  # held and not aborted

P_TRANSITIONS: Final[tuple[Transition, ...]] = (
    # register -------------------------------------------------------------
    _T(UNREGISTERED, REGISTER, "fresh", REGISTERED, "", "hold blocks, start the initial lease, apply staged messages"),
    _T(UNREGISTERED, REGISTER, "group_transferred", FREED, "free:sibling", "a sibling was already transferred"),
    *(_T(s, REGISTER, "duplicate", s, "reject:duplicate_register", "handle or request id already known")
      for s in (REGISTERED, LEASED, NOTIFIED, ABORTED, EXPIRED, FREED)),
    # done (one reader's READ completed) -------------------------------------
    _T(UNREGISTERED, DONE, "early", UNREGISTERED, "stage", "staged until register"),
    *(_T(s, DONE, "more_readers", NOTIFIED, "", "a new reader finished; others still expected")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "all_done", FREED, "free:transferred", "every expected reader reported done")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "all_finished", FREED, "free:released", "every expected reader finished, some released")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "duplicate_reader", s, "count:duplicate", "the same reader twice never counts twice")
      for s in (REGISTERED, LEASED, NOTIFIED, ABORTED)),
    _T(ABORTED, DONE, "more_readers", ABORTED, "", "a new reader finished; others still expected"),
    _T(ABORTED, DONE, "all_done", FREED, "free:transferred", "every expected reader reported done"),
    _T(ABORTED, DONE, "all_finished", FREED, "free:released", "every expected reader finished, some released"),
    _T(EXPIRED, DONE, "late", EXPIRED, "count:late", "arrived after expiry: a timing assumption was violated"),
    _T(FREED, DONE, "stale", FREED, "count:stale", "arrived after free"),
    # release (a reader will never pull) --------------------------------------
    _T(UNREGISTERED, RELEASE, "early", UNREGISTERED, "stage", "staged until register"),
    *(_T(s, RELEASE, "more_readers", NOTIFIED, "", "a reader will never pull; others still expected")
      for s in _HELD_LIVE),
    *(_T(s, RELEASE, "all_finished", FREED, "free:released", "every expected reader finished, some released")
      for s in _HELD_LIVE),
    *(_T(s, RELEASE, "duplicate_reader", s, "count:duplicate", "the same reader twice never counts twice")
      for s in (REGISTERED, LEASED, NOTIFIED, ABORTED)),
    _T(ABORTED, RELEASE, "more_readers", ABORTED, "", "a reader will never pull; others still expected"),
    _T(ABORTED, RELEASE, "all_finished", FREED, "free:released", "every expected reader finished"),
    _T(EXPIRED, RELEASE, "late", EXPIRED, "count:late", "arrived after expiry"),
    _T(FREED, RELEASE, "stale", FREED, "count:stale", "arrived after free"),
    # heartbeat (lease renewal, per request in the batch) ---------------------
    _T(UNREGISTERED, HEARTBEAT, "early", UNREGISTERED, "stage", "staged until register"),
    _T(REGISTERED, HEARTBEAT, "renew", LEASED, "ack", "deadline := max(deadline, now + extension)"),
    _T(LEASED, HEARTBEAT, "renew", LEASED, "ack", "deadline := max(deadline, now + extension)"),
    _T(NOTIFIED, HEARTBEAT, "renew", NOTIFIED, "ack", "deadline := max(deadline, now + extension)"),
    _T(ABORTED, HEARTBEAT, "refuse", ABORTED, "count:refused", "aborted requests are not renewed; the ack refuses it"),
    _T(EXPIRED, HEARTBEAT, "late", EXPIRED, "count:late", "arrived after expiry; the ack refuses it"),
    _T(FREED, HEARTBEAT, "stale", FREED, "count:stale", "arrived after free; the ack refuses it"),
    # abort (client or router abort on P) ----------------------------------------
    _T(UNREGISTERED, ABORT, "unknown", UNREGISTERED, "count:unknown_request", "not held by the lifecycle: nothing to do"),
    *(_T(s, ABORT, "hold", ABORTED, "", "a READ may be in flight: stop renewals, free on done/release or deadline")
      for s in _HELD_LIVE),
    _T(ABORTED, ABORT, "again", ABORTED, "count:duplicate_abort", "a second abort is a no-op"),
    _T(EXPIRED, ABORT, "stale", EXPIRED, "count:stale", "already freed"),
    _T(FREED, ABORT, "stale", FREED, "count:stale", "already freed"),
    # tick (time passes) --------------------------------------------------------
    *(_T(s, TICK, "deadline_passed", EXPIRED, "free:expired", "the lease ran out")
      for s in _HELD_LIVE),
    _T(ABORTED, TICK, "deadline_passed", FREED, "free:aborted", "abort deadline reached, no reader finished it"),
    # sibling (cascade inside done/register: a group member was transferred) ----
    _T(REGISTERED, SIBLING, "group_transferred", FREED, "free:sibling", "a sibling was transferred; D reads one member per group"),
    _T(LEASED, SIBLING, "group_transferred", FREED, "free:sibling", "a sibling was transferred; D reads one member per group"),
    _T(ABORTED, SIBLING, "group_transferred", FREED, "free:sibling", "a sibling was transferred; D reads one member per group"),
    _T(NOTIFIED, SIBLING, "reader_active", NOTIFIED, "", "a reader reported on this member: it finishes on its own"),
)

P_TABLE: Final[dict[tuple[str, str, str], Transition]] = {}
for _row in P_TRANSITIONS:
    _key = (_row.src, _row.event, _row.guard)
    if _key in P_TABLE:  # pragma: no cover - table construction error
        raise AssertionError(f"duplicate row in P_TRANSITIONS: {_key}")
    P_TABLE[_key] = _row

# Derived views of the table, precomputed for the hot path.
P_FREE_REASON: Final[dict[tuple[str, str, str], str]] = {
    k: r.effect[5:] for k, r in P_TABLE.items() if r.effect.startswith("free:")}
P_COUNTER: Final[dict[tuple[str, str, str], str]] = {
    k: r.effect[6:] for k, r in P_TABLE.items() if r.effect.startswith("count:")}

# ---------------------------------------------------------------------------
# The decode (D) side: one machine per (request, reader rank).
# ---------------------------------------------------------------------------

WAITING: Final = "waiting"  # admitted (maybe queued behind D's scheduler), P engine known
HANDSHAKING: Final = "handshaking"  # P engine not yet known: handshake in progress
READING: Final = "reading"  # a READ is in flight
D_DONE: Final = "done"  # KV is local (pulled, or served from a sibling's prefix)
D_FAILED: Final = "failed"  # gave up: recompute locally; P was told (release) where possible
D_STATES: Final = (WAITING, HANDSHAKING, READING, D_DONE, D_FAILED)

ADMIT: Final = "admit"
HANDSHAKE_OK: Final = "handshake_ok"
HANDSHAKE_FAILED: Final = "handshake_failed"
SCHEDULE: Final = "schedule"
READ_OK: Final = "read_ok"
READ_FAILED: Final = "read_failed"
D_ABORT: Final = "abort"
ACK: Final = "ack"
PEER_LOST: Final = "peer_lost"
D_TICK: Final = "tick"
D_EVENTS: Final = (ADMIT, HANDSHAKE_OK, HANDSHAKE_FAILED, SCHEDULE, READ_OK, READ_FAILED,
                   D_ABORT, ACK, PEER_LOST, D_TICK)

D_NEW: Final = "new"  # pseudo-state before admit

D_TRANSITIONS: Final[tuple[Transition, ...]] = (
    _T(D_NEW, ADMIT, "peer_ready", WAITING, "", "transfer params received; P engine handshaken"),
    _T(D_NEW, ADMIT, "peer_unknown", HANDSHAKING, "handshake", "start (or join) the handshake with P"),
    _T(D_NEW, ADMIT, "lease_short", D_FAILED, "release", "params arrived with too little lease left"),
    _T(HANDSHAKING, HANDSHAKE_OK, "ok", WAITING, "", "P known; heartbeats start"),
    _T(HANDSHAKING, HANDSHAKE_FAILED, "failed", D_FAILED, "", "handshake, version or layout mismatch: recompute"),
    _T(WAITING, SCHEDULE, "lease_covers_read", READING, "read", "post the READ with the done notification attached"),
    _T(WAITING, SCHEDULE, "lease_short", D_FAILED, "release", "lease less max READ time and drift does not cover a READ"),
    _T(WAITING, SCHEDULE, "sibling_local", D_DONE, "release", "a sibling's KV landed: served from prefix, never pulled"),
    _T(WAITING, SCHEDULE, "sibling_in_flight", WAITING, "", "the group's READ is in flight: schedule again later"),
    _T(READING, READ_OK, "ok", D_DONE, "done", "data landed (and generations matched)"),
    _T(READING, READ_OK, "abort_pending", D_FAILED, "done", "aborted during the READ: P may free now"),
    _T(READING, READ_FAILED, "fenced", D_FAILED, "release", "generation stamps changed: never served"),
    _T(READING, READ_FAILED, "error", D_FAILED, "release", "transfer error; handle no longer in flight"),
    _T(WAITING, D_ABORT, "idle", D_FAILED, "release", "client abort on D before the READ"),
    _T(HANDSHAKING, D_ABORT, "idle", D_FAILED, "release", "client abort on D during the handshake"),
    _T(READING, D_ABORT, "in_flight", READING, "", "never release under an in-flight READ: wait for it"),
    _T(WAITING, ACK, "granted", WAITING, "", "lease end := heartbeat send time + granted term"),
    _T(READING, ACK, "granted", READING, "", "lease end := heartbeat send time + granted term"),
    _T(WAITING, ACK, "refused", D_FAILED, "release", "P refused the renewal (aborted, expired or freed): release so an aborted request frees now"),
    _T(READING, ACK, "refused", READING, "", "the READ started under a valid lease; let it finish"),
    _T(WAITING, PEER_LOST, "lost", D_FAILED, "", "P disconnected"),
    _T(HANDSHAKING, PEER_LOST, "lost", D_FAILED, "", "P disconnected"),
    _T(READING, PEER_LOST, "in_flight", READING, "", "the READ will report its own failure"),
    _T(WAITING, D_TICK, "lease_lost", D_FAILED, "release", "lease can no longer cover a READ and no renewal came"),
    _T(HANDSHAKING, D_TICK, "lease_lost", D_FAILED, "release", "lease can no longer cover a READ and no renewal came"),
)

D_TABLE: Final[dict[tuple[str, str, str], Transition]] = {
    (r.src, r.event, r.guard): r for r in D_TRANSITIONS
}


# ---------------------------------------------------------------------------
# Configuration and timing assumptions.
# ---------------------------------------------------------------------------


class ConfigError(ValueError):
    """An invalid configuration. The message says which rule failed and why."""


# What the wire and the adapters can carry (spec/PROTOCOL.md, "Configuration"): the
# adapters feed the ledger whole milliseconds, and a granted term travels in an ack as a
# u32 of milliseconds, so every duration is at least 1 ms (or 0 where 0 is allowed) and
# at most 2**32-1 ms (about 49.7 days).
MIN_DURATION: Final = 0.001
MAX_DURATION: Final = 0xFFFFFFFF / 1000
# Caps on the integer knobs: each sizes a tracking structure, so each has a ceiling.
MAX_CAP: Final = 1 << 24
MIN_MESSAGE_BYTES: Final = 64  # room for the largest header and prefix plus one handle
MAX_MESSAGE_BYTES: Final = 1 << 20
_DURATIONS: Final = ("initial_lease", "lease_extension", "heartbeat_interval", "abort_grace",
                     "max_delay", "max_read_time", "clock_drift", "max_staged_age")


@dataclass(frozen=True)
class Config:
    """Timing assumptions (seconds) and caps. See spec/PROTOCOL.md, "Configuration".

    The lease terms are durations; no timestamp from another host's clock is ever used.
    """

    initial_lease: float = 30.0  # term granted at register
    lease_extension: float = 20.0  # a heartbeat extends the deadline to max(deadline, now + this)
    heartbeat_interval: float = 5.0  # D heartbeats every request it still intends to pull
    abort_grace: float = 30.0  # after abort on P: free no later than now + this (>= lease horizon)
    max_delay: float = 1.0  # bound on message delivery delay (notifications, transfer params)
    max_read_time: float = 5.0  # bound on one READ, post to completion
    clock_drift: float = 0.5  # bound on clock-rate disagreement accumulated over one lease term
    max_staged: int = 4096  # early-message staging entries (handles); oldest dropped at the cap
    max_staged_age: float = 30.0  # staged entries older than this are dropped on tick
    max_tombstones: int = 65536  # freed handles remembered to classify late messages as stale
    max_message_bytes: int = 4096  # cap on one wire message (encode chunks, decode rejects)
    max_groups_remembered: int = 65536  # transferred sibling groups remembered for late members
    max_tick_work: int = 512  # deadline-heap entries one tick may process; the rest carry over

    @property
    def lease_horizon(self) -> float:
        """The longest a deadline can lie in the future: max(initial, extension)."""
        return max(self.initial_lease, self.lease_extension)

    def timing_rules(self) -> list[tuple[bool, str]]:
        """The timing argument's rules (spec/PROTOCOL.md §5), in order: (holds, why it
        must). ``validate`` raises the first that fails; ``kvproto check`` compares them
        before and after turning seconds into model time units."""
        renew_need = self.heartbeat_interval + self.max_delay + self.clock_drift
        read_need = self.max_read_time + 2 * self.max_delay + self.clock_drift
        init_need = self.max_read_time + self.max_delay + self.clock_drift
        first_hb = self.heartbeat_interval + 2 * self.max_delay + self.clock_drift
        return [
            (self.lease_extension > renew_need,
             f"lease_extension ({self.lease_extension}) must exceed heartbeat_interval + "
             f"max_delay + clock_drift ({renew_need}): otherwise a lease can run out between "
             "two heartbeats that both arrive on time"),
            (self.lease_extension > read_need,
             f"lease_extension ({self.lease_extension}) must exceed max_read_time + "
             f"2*max_delay + clock_drift ({read_need}): otherwise no renewed lease can cover a READ"),
            (self.initial_lease > init_need,
             f"initial_lease ({self.initial_lease}) must exceed max_read_time + max_delay + "
             f"clock_drift ({init_need}): otherwise D can never READ on the initial term"),
            (self.initial_lease > first_hb,
             f"initial_lease ({self.initial_lease}) must exceed heartbeat_interval + "
             f"2*max_delay + clock_drift ({first_hb}): otherwise a request D admitted just "
             "after a heartbeat expires on P before its first renewal arrives"),
            (self.abort_grace >= self.lease_horizon,
             f"abort_grace ({self.abort_grace}) must be >= max(initial_lease, lease_extension) "
             f"({self.lease_horizon}): a shorter grace can free blocks under a READ that D "
             "started within its lease (see spec/PROTOCOL.md, 'Abort after finish')"),
        ]

    def validate(self) -> Config:
        """Raise ConfigError naming the first violated rule; return self when valid."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{f.name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise ConfigError(f"{f.name} must be finite, got {v!r}")
            if f.type in ("int",) and int(v) != v:
                raise ConfigError(f"{f.name} must be an integer, got {v!r}")
        for name in ("initial_lease", "lease_extension", "heartbeat_interval", "max_read_time",
                     "max_staged_age"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_delay", "clock_drift", "abort_grace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in _DURATIONS:
            v = getattr(self, name)
            if v and not MIN_DURATION <= v <= MAX_DURATION:
                raise ConfigError(
                    f"{name} must be within [{MIN_DURATION}, {MAX_DURATION}] s (or 0 where 0 is "
                    f"allowed), got {v}: the adapters count whole milliseconds and a term "
                    "travels as a u32 of milliseconds")
        for ok, why in self.timing_rules():
            if not ok:
                raise ConfigError(why)
        for name in ("max_staged", "max_tombstones", "max_groups_remembered", "max_tick_work"):
            v = getattr(self, name)
            if not 1 <= v <= MAX_CAP:
                raise ConfigError(f"{name} must be within [1, {MAX_CAP}], got {v}")
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be within [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}], "
                f"got {self.max_message_bytes}")
        return self

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and validate a config; unknown keys are an error, not silently ignored."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)} (known: {', '.join(known)})")
        kwargs: dict[str, Any] = {}
        for k, v in data.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{k} must be a number, got {v!r}")
            kwargs[k] = int(v) if known[k].type == "int" and float(v).is_integer() else v
        return cls(**kwargs).validate()


# ---------------------------------------------------------------------------
# Block pool.
# ---------------------------------------------------------------------------


class DoubleFree(RuntimeError):
    """A block's reference count would drop below zero."""


MAX_POOL_BLOCKS: Final = 1 << 24  # a pool's capacity cap (its count list is 8 B a block)


class BlockPool:
    """Reference-counted KV blocks. ``held + free == capacity`` at all times.

    A block is *held* while any registered request references it (prefix sharing and
    n>1 siblings share blocks). Only the lifecycle machine calls ``hold``/``drop``.
    Capacity is at most ``MAX_POOL_BLOCKS``.
    """

    __slots__ = ("_avail", "_pins", "_rc", "capacity", "free_count", "held_count", "strict",
                 "violations")

    def __init__(self, capacity: int, *, strict: bool = True) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not 1 <= capacity <= MAX_POOL_BLOCKS:
            raise ValueError(f"capacity must be an int within [1, {MAX_POOL_BLOCKS}], "
                             f"got {capacity!r}")
        self.capacity = capacity
        self._rc = [0] * capacity
        self.held_count = 0
        self.free_count = capacity
        self.strict = strict
        self.violations = 0
        # The engine's allocator (see "allocation" below): blocks neither held nor pinned,
        # oldest first; built by the first allocator call, so a ledger alone pays nothing.
        self._avail: OrderedDict[int, None] | None = None
        self._pins: dict[int, int] = {}  # block -> engine pins (allocated, not yet held)

    def refcount(self, block: int) -> int:
        return self._rc[block]

    def is_free(self, block: int) -> bool:
        return self._rc[block] == 0

    def check_blocks(self, blocks: Sequence[int]) -> str | None:
        """Return an error string when ``blocks`` cannot be held, else None."""
        cap = self.capacity
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < cap:
                return f"block id {b!r} outside [0, {cap})"
        if len(set(blocks)) != len(blocks):
            return "duplicate block ids in one request"
        return None

    def _hold(self, blocks: Sequence[int]) -> None:
        rc = self._rc
        avail = self._avail
        for b in blocks:
            if rc[b] == 0:
                self.held_count += 1
                self.free_count -= 1
                if avail is not None:
                    avail.pop(b, None)
            rc[b] += 1

    def _drop(self, blocks: Sequence[int]) -> list[int]:
        """Decrement; return the blocks whose count reached zero (now reusable)."""
        rc = self._rc
        reclaimed: list[int] = []
        for b in blocks:
            c = rc[b]
            if c <= 0:
                self.violations += 1
                if self.strict:
                    raise DoubleFree(f"block {b} freed with reference count {c}")
                continue
            c -= 1
            rc[b] = c
            if c == 0:
                self.held_count -= 1
                self.free_count += 1
                reclaimed.append(b)
                if self._avail is not None and b not in self._pins:
                    self._avail[b] = None
        return reclaimed

    def recount(self) -> tuple[int, int]:
        """O(capacity) recount of (held, free), for invariant checks."""
        held = sum(1 for c in self._rc if c > 0)
        return held, self.capacity - held

    def free_blocks(self, limit: int | None = None) -> list[int]:
        """Blocks with count zero (O(capacity); for tests and invariant checks)."""
        out = [i for i, c in enumerate(self._rc) if c == 0]
        return out if limit is None else out[:limit]

    # -- allocation: the engine's side (the one allocator; adapters and simulators) -----
    # A block is *allocatable* when no request holds it and the engine has not pinned
    # it. ``allocate`` pins blocks for a prefill; ``pin`` adds pins (siblings, prefix
    # sharing); ``unpin`` drops them at register (the ledger's hold takes over) or when
    # the engine gives blocks back. A block freed by the ledger while pinned is not
    # allocatable until unpinned. O(1) per block (the first call builds the free list
    # in O(capacity)).
    def _free_list(self) -> OrderedDict[int, None]:
        avail = self._avail
        if avail is None:
            pins = self._pins
            avail = self._avail = OrderedDict(
                (b, None) for b, c in enumerate(self._rc) if c == 0 and b not in pins)
        return avail

    @property
    def allocatable(self) -> int:
        """How many blocks ``allocate`` can hand out now."""
        return len(self._free_list())

    def allocatable_blocks(self) -> list[int]:
        """The allocatable blocks, oldest first (O(allocatable))."""
        return list(self._free_list())

    def allocate(self, n: int) -> list[int] | None:
        """Pin and return ``n`` allocatable blocks (oldest freed first), or None."""
        avail = self._free_list()
        if n > len(avail):
            return None
        out = [avail.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            self._pins[b] = 1
        return out

    def pin(self, blocks: Iterable[int]) -> None:
        """One more engine pin on each block (it stops being allocatable)."""
        avail = self._free_list()
        pins = self._pins
        for b in blocks:
            pins[b] = pins.get(b, 0) + 1
            avail.pop(b, None)

    def unpin(self, blocks: Iterable[int]) -> int:
        """Drop one engine pin per block; a block neither pinned nor held becomes
        allocatable again. Returns how many blocks were not pinned (an engine returning
        a block twice: the caller counts it; nothing changes for that block)."""
        avail = self._free_list()
        pins = self._pins
        bad = 0
        for b in blocks:
            c = pins.get(b, 0)
            if c <= 0:
                bad += 1
                continue
            if c == 1:
                del pins[b]
                if self._rc[b] == 0:
                    avail[b] = None
            else:
                pins[b] = c - 1
        return bad

    def pinned(self, block: int) -> bool:
        return block in self._pins


# ---------------------------------------------------------------------------
# Events (inputs) and effects (outputs) of the producer ledger.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    handle: int
    request_id: str
    blocks: tuple[int, ...]
    now: float
    group: str | None = None
    expected: int = 0  # expected readers; 0 = not known yet (announced by D)


@dataclass(frozen=True, slots=True)
class Done:
    reader: str
    handle: int
    expected: int
    now: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    reader: str
    seq: int
    handles: tuple[int, ...]
    expected: int
    now: float


@dataclass(frozen=True, slots=True)
class Release:
    reader: str
    handles: tuple[int, ...]
    expected: int
    now: float


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class Tick:
    now: float


@dataclass(frozen=True, slots=True)
class Reject:
    """Bad input rejected by the adapter before it became an event (malformed bytes,
    unknown peer, oversized message...). Journaled and counted, changes nothing."""

    reason: str
    peer: str
    detail: str
    now: float


Event = Register | Done | Heartbeat | Release | Abort | Tick | Reject


@dataclass(frozen=True, slots=True)
class Free:
    """Effect: the request no longer holds its blocks. ``reclaimed`` are the blocks
    whose reference count reached zero: bump their generation, then reuse them."""

    handle: int
    request_id: str
    reason: str
    blocks: tuple[int, ...]
    reclaimed: tuple[int, ...]
    deadline: float  # the lease deadline at the time of the free


@dataclass(frozen=True, slots=True)
class Ack:
    """Effect: answer a heartbeat. Every handle of the batch in neither ``refused`` nor
    ``pending`` was renewed to at least receive-time + ``term``. ``pending`` handles are
    not registered yet (staged): D must keep its previous lease estimate for them."""

    reader: str
    seq: int
    term: float
    refused: tuple[int, ...]
    pending: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Rejected:
    """Effect: counted, logged rejection of bad or stale input."""

    reason: str
    peer: str
    handle: int | None
    detail: str


Effect = Free | Ack | Rejected


class _Req:
    """A held request. Kept small: memory per held request is a measured figure."""

    __slots__ = ("blocks", "deadline", "expected", "finished", "group", "handle", "released",
                 "rid", "state")

    def __init__(self, handle: int, rid: str, blocks: tuple[int, ...], deadline: float,
                 group: str | None, expected: int) -> None:
        self.handle = handle
        self.rid = rid
        self.blocks = blocks
        self.deadline = deadline
        self.group = group
        self.expected = expected
        self.state: str = REGISTERED
        self.finished: set[str] | None = None  # distinct readers that reported done/release
        self.released = False  # some reader released (never pulled)


class _Staged:
    __slots__ = ("msgs", "since")

    def __init__(self, since: float) -> None:
        self.since = since
        self.msgs: list[tuple[str, str, int, float]] = []  # (kind, reader, expected, arrival)


MAX_STAGED_MSGS_PER_HANDLE: Final = 64
# The deadline heap is rebuilt from the live requests once it holds more than twice as
# many entries as there are live requests (dead entries of requests freed outside a
# tick, and the early entries aborts push) and more than HEAP_SLACK: it never holds more
# than max(2 * live, HEAP_SLACK) entries.
HEAP_SLACK: Final = 64
_INF: Final = math.inf
# A machine's clock before its first event: the lowest finite float, so that the hot
# paths' one check ``self.now <= now < inf`` also refuses -inf (and NaN, which compares
# false).
CLOCK_START: Final = -sys.float_info.max


# ---------------------------------------------------------------------------
# The producer ledger.
# ---------------------------------------------------------------------------


class Ledger:
    """P's lifecycle machine for one P rank: every block hold and free goes through it.

    Costs (n = held requests): done/heartbeat/release/abort O(1) per request; register
    O(blocks); tick O(1) when nothing is due, O(k log n) for k due entries, and at most
    ``max_tick_work`` entries per call: the rest carries over (``next_deadline`` then
    reports a time already past, so adapters tick again at once); an expiry may be late,
    never early. Caps: staging ``max_staged`` handles, tombstones ``max_tombstones``,
    sibling-group memory ``max_groups_remembered``, deadline heap max(2 * held,
    ``HEAP_SLACK``) entries; at each cap the oldest entry is dropped and counted.

    Time: a non-finite ``now`` is refused (a ``Rejected("bad_time")`` effect, counted,
    nothing changes); a ``now`` before the ledger's clock is clamped to it (counted
    ``clock_regression``): the event is real, and applying it later than it happened is
    the same as a slower delivery, which never frees anything early.
    """

    def __init__(self, config: Config, pool: BlockPool, *,
                 sink: Callable[[Event, list[Effect]], None] | None = None) -> None:
        self.config = config.validate()
        self.pool = pool
        self.sink = sink  # journal hook: called with every event and its effects
        self._live: dict[int, _Req] = {}
        self._by_rid: dict[str, int] = {}
        self._heap: list[tuple[float, int]] = []  # (deadline or earlier, handle); lazy
        self._staged: OrderedDict[int, _Staged] = OrderedDict()
        # handle -> (terminal state, request id); request id -> handle, both capped together
        self._tomb: OrderedDict[int, tuple[str, str]] = OrderedDict()
        self._tomb_rid: dict[str, int] = {}
        self._groups: dict[str, set[int]] = {}  # live members per sibling group
        self._groups_done: OrderedDict[str, None] = OrderedDict()  # transferred groups
        self._next_handle = 1
        self.now = CLOCK_START
        self.counters: dict[str, int] = {}
        self.frees: dict[str, int] = dict.fromkeys(FREE_REASONS, 0)
        # Messages staged per early handle (MAX_STAGED_MSGS_PER_HANDLE; the conformance
        # models set their MaxStagedMsgs here instead of changing the constant).
        self.max_staged_msgs = MAX_STAGED_MSGS_PER_HANDLE

    # -- queries ---------------------------------------------------------------
    def new_handle(self) -> int:
        """Mint a fresh handle (monotone, never reused within this ledger)."""
        h = self._next_handle
        self._next_handle = h + 1
        return h

    def state(self, handle: int) -> str:
        r = self._live.get(handle)
        if r is not None:
            return r.state
        t = self._tomb.get(handle)
        return t[0] if t is not None else UNREGISTERED

    def deadline(self, handle: int) -> float | None:
        r = self._live.get(handle)
        return None if r is None else r.deadline

    def handle_of(self, request_id: str) -> int | None:
        return self._by_rid.get(request_id)

    @property
    def held_requests(self) -> int:
        return len(self._live)

    @property
    def staged_count(self) -> int:
        return len(self._staged)

    @property
    def tombstone_count(self) -> int:
        return len(self._tomb)

    def live_handles(self) -> list[int]:
        return list(self._live)

    @property
    def heap_entries(self) -> int:
        """Entries in the deadline heap (live ones plus dead ones not yet dropped)."""
        return len(self._heap)

    def next_deadline(self) -> float | None:
        """Earliest time a tick can change anything (for adapters' sleep). After a tick
        that ran out of its work budget this is a time already past: tick again soon."""
        nxt = self._heap[0][0] if self._heap else None
        if self._staged:
            s = next(iter(self._staged.values())).since + self.config.max_staged_age
            nxt = s if nxt is None else min(nxt, s)
        return nxt

    def snapshot(self) -> dict[int, tuple[str, int, frozenset[str], bool, float]]:
        """Abstract state of live requests (for conformance checks and tests)."""
        return {h: (r.state, r.expected, frozenset(r.finished or ()), r.released, r.deadline)
                for h, r in self._live.items()}

    # -- read-only views (issue 10, branch plumbing): verification and adapters use these
    # instead of private fields. O(1) unless stated.
    def request_id(self, handle: int) -> str | None:
        """The request id of a live or tombstoned handle; None when unknown."""
        r = self._live.get(handle)
        if r is not None:
            return r.rid
        t = self._tomb.get(handle)
        return t[1] if t is not None else None

    def staged_entries(self) -> list[tuple[int, float, tuple[tuple[str, str, int, float], ...]]]:
        """Staged early messages, oldest handle first: ``(handle, since, msgs)``, each
        message ``(kind, reader, expected, arrival)``. O(staged messages)."""
        return [(h, st.since, tuple(st.msgs)) for h, st in self._staged.items()]

    def blocks_of(self, handle: int) -> tuple[int, ...] | None:
        """The blocks a live request holds; None when it is not live."""
        r = self._live.get(handle)
        return None if r is None else r.blocks

    def groups_done(self) -> tuple[str, ...]:
        """The remembered transferred sibling groups, oldest first. O(groups)."""
        return tuple(self._groups_done)
    # -- end of read-only views (plumbing) -----------------------------------------------

    # -- generic entry point -------------------------------------------------------
    def apply(self, ev: Event) -> list[Effect]:
        """Feed one event, return its effects."""
        if isinstance(ev, Heartbeat):
            return self.heartbeat(ev.reader, ev.seq, ev.handles, ev.expected, ev.now)
        if isinstance(ev, Done):
            return self.done(ev.reader, ev.handle, ev.expected, ev.now)
        if isinstance(ev, Tick):
            return self.tick(ev.now)
        if isinstance(ev, Register):
            return self.register(ev.handle, ev.request_id, ev.blocks, ev.now,
                                 group=ev.group, expected=ev.expected)
        if isinstance(ev, Release):
            return self.release(ev.reader, ev.handles, ev.expected, ev.now)
        if isinstance(ev, Abort):
            return self.abort(ev.request_id, ev.now)
        if isinstance(ev, Reject):
            return self.reject(ev.reason, ev.peer, ev.detail, ev.now)
        raise TypeError(f"not a ledger event: {ev!r}")

    # -- internals -------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _clock(self, now: float) -> float | None:
        """The event's time: ``now``, or the ledger's clock when ``now`` is before it
        (clamped, counted); None when ``now`` is not a finite number (refused)."""
        if self.now <= now < _INF:
            self.now = now
            return now
        if not math.isfinite(now):
            return None
        # Time never runs backwards inside the machine: a stale clock reading is clamped.
        self._count("clock_regression")
        return self.now

    def _bad_time(self, event: str, now: float) -> list[Effect]:
        """Refuse an event whose time is not finite: counted, journaled as a rejection at
        the ledger's own clock, nothing else changes."""
        t = self.now if self.now != CLOCK_START else 0.0
        return self.reject("bad_time", "", f"{event} at time {now!r}", t)

    def _maybe_compact(self) -> None:
        """Rebuild the deadline heap once dead entries outnumber live ones (amortized O(1)
        per free: a rebuild costs O(held) and follows at least max(held, HEAP_SLACK) frees or
        aborts since the last one)."""
        n = len(self._heap)
        if n > 2 * len(self._live) and n > HEAP_SLACK:
            self._heap[:] = [(r.deadline, h) for h, r in self._live.items()]  # in place
            heapq.heapify(self._heap)
            self._count("heap_rebuilt")

    def _emit(self, ev: Event, out: list[Effect]) -> list[Effect]:
        if self.sink is not None:
            self.sink(ev, out)
        return out

    def _apply_effect_counter(self, row: Transition) -> None:
        name = P_COUNTER.get((row.src, row.event, row.guard))
        if name is not None:
            c = self.counters
            c[name] = c.get(name, 0) + 1

    def _free(self, r: _Req, row: Transition, out: list[Effect]) -> None:
        """The only place blocks are freed. Moves ``r`` to its terminal state."""
        reason = P_FREE_REASON[(row.src, row.event, row.guard)]
        r.state = row.dst
        del self._live[r.handle]
        if self._by_rid.get(r.rid) == r.handle:
            del self._by_rid[r.rid]
        if r.group is not None:
            members = self._groups.get(r.group)
            if members is not None:
                members.discard(r.handle)
                if not members:
                    del self._groups[r.group]
        tomb = self._tomb
        tomb[r.handle] = (row.dst, r.rid)
        self._tomb_rid[r.rid] = r.handle
        if len(tomb) > self.config.max_tombstones:
            old, (_, old_rid) = tomb.popitem(last=False)
            self._count("tombstone_evicted")
            if self._tomb_rid.get(old_rid) == old:
                del self._tomb_rid[old_rid]
        reclaimed = self.pool._drop(r.blocks)
        self.frees[reason] += 1
        out.append(Free(r.handle, r.rid, reason, r.blocks, tuple(reclaimed), r.deadline))

    def _stage(self, kind: str, reader: str, handle: int, expected: int, now: float) -> None:
        st = self._staged.get(handle)
        if st is None:
            if len(self._staged) >= self.config.max_staged:
                self._staged.popitem(last=False)
                self._count("staged_dropped")
            st = self._staged[handle] = _Staged(now)
        if len(st.msgs) >= self.max_staged_msgs:
            self._count("staged_dropped")
            return
        st.msgs.append((kind, reader, expected, now))
        self._count("staged")

    def _announce(self, r: _Req, expected: int) -> None:
        if expected > r.expected:
            if r.expected:
                self._count("expected_raised")
            r.expected = expected
        elif expected and expected < r.expected:
            self._count("expected_conflict")

    def _finish(self, r: _Req, event: str, reader: str, expected: int, now: float,
                out: list[Effect]) -> None:
        """A reader finished (done or release). Mirrors TLA+ Done / Release."""
        if expected != r.expected:
            self._announce(r, expected)
        fin = r.finished
        if fin is None:
            fin = r.finished = set()
        if reader in fin:
            guard = "duplicate_reader"
        else:
            fin.add(reader)
            if event == RELEASE:
                r.released = True
            if r.expected and len(fin) >= r.expected:
                guard = "all_finished" if r.released else "all_done"
            else:
                guard = "more_readers"
        key = (r.state, event, guard)
        row = P_TABLE[key]
        if key in P_FREE_REASON:
            group = r.group
            self._free(r, row, out)
            if group is not None and guard == "all_done":
                self._group_transferred(group, out)
        else:
            r.state = row.dst
            if guard == "duplicate_reader":
                self._apply_effect_counter(row)

    def _group_transferred(self, group: str, out: list[Effect]) -> None:
        gd = self._groups_done
        if group not in gd:
            gd[group] = None
            if len(gd) > self.config.max_groups_remembered:
                gd.popitem(last=False)
                self._count("group_memory_evicted")
        members = self._groups.get(group)
        if not members:
            return
        for h in sorted(members):
            r = self._live[h]
            guard = "reader_active" if r.state == NOTIFIED else "group_transferred"
            row = P_TABLE[(r.state, SIBLING, guard)]
            if (r.state, SIBLING, guard) in P_FREE_REASON:
                self._free(r, row, out)

    # -- events ------------------------------------------------------------------------
    def register(self, handle: int, request_id: str, blocks: Iterable[int], now: float, *,
                 group: str | None = None, expected: int = 0) -> list[Effect]:
        """Prefill finished: hold ``blocks`` for remote decode. Mirrors TLA+ ``Register``."""
        blocks = tuple(blocks)
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(REGISTER, now)
        now = clk
        ev = Register(handle, request_id, blocks, now, group, expected)
        out: list[Effect] = []
        err = None
        if not isinstance(handle, int) or isinstance(handle, bool) or handle < 0:
            err = f"handle must be a non-negative int, got {handle!r}"
        elif not isinstance(expected, int) or not 0 <= expected <= 0xFFFF:
            err = f"expected readers must be within [0, 65535], got {expected!r}"
        else:
            err = self.pool.check_blocks(blocks)
        if err is not None:
            self._count("invalid_register")
            out.append(Rejected("invalid_register", "", handle if isinstance(handle, int) else None, err))
            return self._emit(ev, out)
        if handle in self._live or handle in self._tomb or request_id in self._by_rid:
            st = self.state(handle)
            if st == UNREGISTERED:  # request id reused while its first holder is live
                st = self._live[self._by_rid[request_id]].state
            row = P_TABLE[(st, REGISTER, "duplicate")]
            self._count("duplicate_register")
            out.append(Rejected(row.effect[7:], "", handle,
                                f"handle {handle} / request id {request_id!r} already known ({st})"))
            return self._emit(ev, out)
        if handle >= self._next_handle:
            self._next_handle = handle + 1
        r = _Req(handle, request_id, blocks, now + self.config.initial_lease, group, expected)
        if group is not None and group in self._groups_done:
            row = P_TABLE[(UNREGISTERED, REGISTER, "group_transferred")]
            self._staged.pop(handle, None)
            # Hold then free in one step, so the pool accounting is uniform.
            self._live[handle] = r
            self._by_rid[request_id] = handle
            self.pool._hold(blocks)
            self._free(r, row, out)
            self._maybe_compact()
            return self._emit(ev, out)
        self.pool._hold(blocks)
        self._live[handle] = r
        self._by_rid[request_id] = handle
        if group is not None:
            self._groups.setdefault(group, set()).add(handle)
        heapq.heappush(self._heap, (r.deadline, handle))
        staged = self._staged.pop(handle, None)
        if staged is not None:
            self._count("staged_applied", len(staged.msgs))
            for kind, reader, exp, t in staged.msgs:
                if r.state not in HELD_STATES:
                    self._count("stale")
                    continue
                if kind == HEARTBEAT:
                    if exp > r.expected:
                        self._announce(r, exp)
                    self._renew(r, t)
                else:
                    self._finish(r, kind, reader, exp, now, out)
            if out:
                self._maybe_compact()
        return self._emit(ev, out)

    def _renew(self, r: _Req, arrival: float) -> bool:
        row = P_TABLE.get((r.state, HEARTBEAT, "renew"))
        if row is None:
            return False
        dl = arrival + self.config.lease_extension
        if dl > r.deadline:
            r.deadline = dl  # the heap entry is now early; tick re-inserts it lazily
        r.state = row.dst
        return True

    def done(self, reader: str, handle: int, expected: int, now: float) -> list[Effect]:
        """One reader's READ completed. Mirrors TLA+ ``Done``."""
        if self.now <= now < _INF:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return self._bad_time(DONE, now)
            now = clk
        out: list[Effect] = []
        r = self._live.get(handle)
        if r is not None:
            self._finish(r, DONE, reader, expected, now, out)
            if out and len(self._heap) > 2 * len(self._live):
                self._maybe_compact()
        else:
            self._not_live(DONE, reader, handle, expected, now, out)
        return self._emit(Done(reader, handle, expected, now), out) if self.sink else out

    def release(self, reader: str, handles: Sequence[int], expected: int,
                now: float) -> list[Effect]:
        """A reader will never pull these requests. Mirrors TLA+ ``Release``."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(RELEASE, now)
        now = clk
        out: list[Effect] = []
        for h in handles:
            r = self._live.get(h)
            if r is not None:
                self._finish(r, RELEASE, reader, expected, now, out)
            else:
                self._not_live(RELEASE, reader, h, expected, now, out)
        if out:
            self._maybe_compact()
        return self._emit(Release(reader, tuple(handles), expected, now), out) if self.sink else out

    def _not_live(self, event: str, reader: str, handle: int, expected: int, now: float,
                  out: list[Effect]) -> str:
        t = self._tomb.get(handle)
        if t is None:
            self._stage(event, reader, handle, expected, now)
            return "early"
        st = t[0]
        row = P_TABLE[(st, event, "late" if st == EXPIRED else "stale")]
        self._apply_effect_counter(row)
        return row.guard

    def heartbeat(self, reader: str, seq: int, handles: Sequence[int], expected: int,
                  now: float) -> list[Effect]:
        """Renew the leases of a batch. Mirrors TLA+ ``Heartbeat``. O(1) per handle."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(HEARTBEAT, now)
        now = clk
        ext_dl = now + self.config.lease_extension
        live = self._live
        refused: list[int] | None = None
        pending: list[int] | None = None
        for h in handles:
            r = live.get(h)
            if r is not None:
                st = r.state
                if st is REGISTERED or st is LEASED:
                    if expected > r.expected:
                        self._announce(r, expected)
                    if ext_dl > r.deadline:
                        r.deadline = ext_dl
                    r.state = LEASED
                    continue
                if st is NOTIFIED:
                    if expected > r.expected:
                        self._announce(r, expected)
                    if ext_dl > r.deadline:
                        r.deadline = ext_dl
                    continue
                self._count("refused")  # aborted: not renewed
            elif self._not_live(HEARTBEAT, reader, h, expected, now, []) == "early":
                # Staged: not renewed yet. It may also be a long-freed handle whose
                # tombstone was evicted, so it must not count as granted.
                if pending is None:
                    pending = []
                pending.append(h)
                continue
            if refused is None:
                refused = []
            refused.append(h)
        out: list[Effect] = [Ack(reader, seq, self.config.lease_extension,
                                 tuple(refused) if refused else (),
                                 tuple(pending) if pending else ())]
        return self._emit(Heartbeat(reader, seq, tuple(handles), expected, now), out) \
            if self.sink else out

    def abort(self, request_id: str, now: float) -> list[Effect]:
        """Client or router abort on P. Mirrors TLA+ ``Abort``. Never frees at once."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(ABORT, now)
        now = clk
        out: list[Effect] = []
        h = self._by_rid.get(request_id)
        r = self._live.get(h) if h is not None else None
        if r is None:
            th = self._tomb_rid.get(request_id)
            t = self._tomb.get(th) if th is not None else None
            key = (t[0], ABORT, "stale") if t is not None else (UNREGISTERED, ABORT, "unknown")
            self._apply_effect_counter(P_TABLE[key])
            return self._emit(Abort(request_id, now), out)
        guard = "again" if r.state == ABORTED else "hold"
        row = P_TABLE[(r.state, ABORT, guard)]
        if guard == "hold":
            dl = now + self.config.abort_grace
            if dl < r.deadline:  # only when abort_grace is below the lease horizon
                r.deadline = dl
                heapq.heappush(self._heap, (dl, r.handle))
                self._maybe_compact()
        r.state = row.dst
        self._apply_effect_counter(row)
        return self._emit(Abort(request_id, now), out)

    def tick(self, now: float) -> list[Effect]:
        """Time passes. Mirrors TLA+ ``Tick``. O(1) when nothing is due.

        Processes at most ``config.max_tick_work`` due heap entries (expiries, dead
        entries, lazy re-inserts), earliest deadline first; the rest stays due and
        ``next_deadline()`` reports it (a time already past). Staging entries past
        ``max_staged_age`` are always dropped (at most ``max_staged``, O(1) each).
        Mirrors the spec's Tick with some due requests left for later (``ExpiryMayLag``):
        an expiry may be late, never early."""
        if self.now <= now < _INF:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return self._bad_time(TICK, now)
            now = clk
        out: list[Effect] = []
        heap = self._heap
        if heap and heap[0][0] <= now:
            live = self._live
            budget = self.config.max_tick_work
            while heap and heap[0][0] <= now:
                if budget <= 0:
                    self._count("tick_budget_exhausted")
                    break
                budget -= 1
                _, h = heapq.heappop(heap)
                r = live.get(h)
                if r is None:
                    continue  # freed already: drop the stale entry
                if r.deadline > now:
                    heapq.heappush(heap, (r.deadline, h))  # renewed since: re-insert lazily
                    continue
                self._free(r, P_TABLE[(r.state, TICK, "deadline_passed")], out)
        staged = self._staged
        if staged:
            limit = now - self.config.max_staged_age
            while staged:  # never late: at most max_staged entries, O(1) each
                st = next(iter(staged.values()))
                if st.since > limit:
                    break
                staged.popitem(last=False)
                self._count("staged_expired")
        if self.sink is not None:
            self.sink(Tick(now), out)
        return out

    def reject(self, reason: str, peer: str, detail: str, now: float) -> list[Effect]:
        """Record an adapter-level rejection (malformed bytes, unknown peer...). A
        non-finite ``now`` is recorded at the ledger's clock (0 before any event)."""
        clk = self._clock(now)
        now = clk if clk is not None else (self.now if self.now != CLOCK_START else 0.0)
        self._count("rejected:" + reason)
        return self._emit(Reject(reason, peer, detail, now), [Rejected(reason, peer, None, detail)])

    # -- invariants (O(n); tests, replay and simulators) ----------------------------------
    def check_invariants(self) -> list[str]:
        """Return violated invariants (empty when all hold)."""
        errs: list[str] = []
        pool = self.pool
        held, free = pool.recount()
        if held != pool.held_count or free != pool.free_count or held + free != pool.capacity:
            errs.append(f"Conservation: held {pool.held_count}/{held} + free {pool.free_count}/{free}"
                        f" != capacity {pool.capacity}")
        if pool.violations:
            errs.append(f"NoDoubleFree: {pool.violations} double free(s)")
        expect = [0] * pool.capacity
        for r in self._live.values():
            if r.state not in HELD_STATES:
                errs.append(f"TypeOK: live request {r.handle} in non-held state {r.state}")
            for b in r.blocks:
                expect[b] += 1
        for b in range(pool.capacity):
            if expect[b] != pool.refcount(b):
                errs.append(f"RefCount: block {b} count {pool.refcount(b)} != holders {expect[b]}")
                break
        heap_handles = {h for _, h in self._heap}
        missing = [h for h in self._live if h not in heap_handles]
        if missing:
            errs.append(f"DeadlineHeap: live requests without a heap entry: {missing[:5]}")
        if len(self._staged) > self.config.max_staged:
            errs.append("StagingBounded: staging above max_staged")
        if len(self._tomb) > self.config.max_tombstones:
            errs.append("TombstonesBounded: tombstones above max_tombstones")
        for h in self._live:
            if h in self._tomb:
                errs.append(f"TypeOK: handle {h} both live and tombstoned")
        return errs


# ---------------------------------------------------------------------------
# The decode side.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferParams:
    """What P hands D (through the router) for one request."""

    engine: str  # P engine/rank name (NIXL agent name)
    epoch: int  # P incarnation; messages carry it so a restarted P rejects old ones
    handle: int
    blocks: tuple[int, ...]
    initial_term: float  # a duration, never a timestamp
    expected: int = 1  # readers that will pull this request from this P rank
    group: str | None = None
    generations: tuple[int, ...] = ()  # fail-closed reads (see the NIXL adapter)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = list(self.blocks)
        d["generations"] = list(self.generations)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferParams:
        return cls(engine=str(d["engine"]), epoch=int(d["epoch"]), handle=int(d["handle"]),
                   blocks=tuple(int(b) for b in d["blocks"]),
                   initial_term=float(d["initial_term"]), expected=int(d.get("expected", 1)),
                   group=d.get("group"), generations=tuple(int(g) for g in d.get("generations", ())))


# D effects.
@dataclass(frozen=True, slots=True)
class StartHandshake:
    engine: str


@dataclass(frozen=True, slots=True)
class PostRead:
    request_id: str
    engine: str
    handle: int
    blocks: tuple[int, ...]
    expected: int


@dataclass(frozen=True, slots=True)
class SendDone:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(frozen=True, slots=True)
class SendRelease:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(frozen=True, slots=True)
class SendHeartbeat:
    engine: str
    seq: int
    handles: tuple[int, ...]
    expected: int


@dataclass(frozen=True, slots=True)
class Finished:
    """The request left the machine: ``state`` is done or failed, with a reason."""

    request_id: str
    state: str
    reason: str


DEffect = StartHandshake | PostRead | SendDone | SendRelease | SendHeartbeat | Finished


class _DReq:
    __slots__ = ("abort_pending", "lease_end", "params", "rid", "state")

    def __init__(self, rid: str, params: TransferParams, lease_end: float) -> None:
        self.rid = rid
        self.params = params
        self.lease_end = lease_end
        self.state = D_NEW
        self.abort_pending = False


@dataclass
class _HbSent:
    sent_at: float
    handles: tuple[int, ...]


@dataclass
class _Peer:
    ready: bool = False
    handshaking: bool = False
    seq: int = 0
    outstanding: OrderedDict[int, _HbSent] = field(default_factory=OrderedDict)
    reqs: dict[int, _DReq] = field(default_factory=dict)  # handle -> request


# Per peer: heartbeat messages awaiting their ack. Entries older than one lease extension
# are pruned (such an ack could not extend anything); beyond the cap the oldest are
# forgotten and their acks ignored (D keeps its smaller estimate: safe).
MAX_OUTSTANDING_HEARTBEATS: Final = 4096


def _prune_outstanding(peer: _Peer, older_than: float) -> None:
    out = peer.outstanding
    while out:
        first = next(iter(out.values()))
        if first.sent_at >= older_than:
            break
        out.popitem(last=False)


class Consumer:
    """One decode rank's machine over its requests. Sans-I/O: effects out.

    The rank is one *reader*: P counts it once per request however often it reports.
    Invariants it maintains: a READ starts only when the lease, less ``max_read_time``
    and ``clock_drift``, covers it; ``release`` is never sent while a READ is in flight;
    at most one member of a sibling group is ever read. Costs: every event O(1) except
    the periodic heartbeat (O(n) per ``heartbeat_interval``, it must name every request)
    and peer-level events (O(requests of that peer)); tick is O(1) when nothing is due.
    The lease heap holds at most max(2 * requests, ``HEAP_SLACK``) entries (rebuilt beyond).

    Time: a non-finite ``now`` is refused (counted ``bad_time``, no effect, nothing
    changes). A ``now`` before the rank's clock is counted (``clock_regression``); admit
    keeps it (the earlier arrival gives the shorter, safe lease estimate), every other
    event uses the rank's clock (a READ must fit the lease at the latest time seen).
    """

    def __init__(self, reader: str, config: Config, *,
                 heartbeat_chunk: int | None = None) -> None:
        """``heartbeat_chunk`` optionally caps the handles per heartbeat further; every
        SendHeartbeat always fits one wire message of ``config.max_message_bytes``, so
        that one ack answers exactly the handles of one message."""
        self.reader = reader
        self.config = config.validate()
        self.reqs: dict[str, _DReq] = {}
        self.peers: dict[str, _Peer] = {}
        self._group_owner: dict[tuple[str, str], str] = {}  # (engine, group) -> rid read
        self._lease_heap: list[tuple[float, str]] = []  # (lease_end, rid); lazy
        self._next_hb = -math.inf
        self.now = CLOCK_START
        self.heartbeat_chunk = heartbeat_chunk
        self.counters: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _clock(self, now: float) -> float | None:
        """The time to decide with: max(clock, now); None for a non-finite ``now``."""
        if self.now <= now < _INF:
            self.now = now
            return now
        if not math.isfinite(now):
            self._count("bad_time")
            return None
        self._count("clock_regression")
        return self.now

    def state(self, rid: str) -> str:
        r = self.reqs.get(rid)
        return D_NEW if r is None else r.state

    def lease_end(self, rid: str) -> float | None:
        r = self.reqs.get(rid)
        return None if r is None else r.lease_end

    def _go(self, r: _DReq, event: str, guard: str) -> Transition:
        row = D_TABLE[(r.state, event, guard)]
        r.state = row.dst
        return row

    def _finish(self, r: _DReq, reason: str, out: list[DEffect]) -> None:
        del self.reqs[r.rid]
        n = len(self._lease_heap)
        if n > 2 * len(self.reqs) and n > HEAP_SLACK:
            # In place: tick iterates this very list.
            self._lease_heap[:] = [(q.lease_end, q.rid) for q in self.reqs.values()
                                   if q.state in (WAITING, HANDSHAKING)]
            heapq.heapify(self._lease_heap)
        p = r.params
        peer = self.peers.get(p.engine)
        if peer is not None and peer.reqs.get(p.handle) is r:
            del peer.reqs[p.handle]
        if p.group is not None and r.state == D_FAILED and reason != "aborted" \
                and self._group_owner.get((p.engine, p.group)) == r.rid:
            # Only a READ that did not land gives up the group: a landed READ (even one
            # aborted meanwhile) told P "done", and P may free the other members.
            del self._group_owner[(p.engine, p.group)]
        key = f"{r.state}:{reason}"
        self.finished[key] = self.finished.get(key, 0) + 1
        out.append(Finished(r.rid, r.state, reason))

    def _release(self, r: _DReq, reason: str, out: list[DEffect]) -> None:
        p = r.params
        out.append(SendRelease(r.rid, p.engine, p.handle, p.expected))
        self._finish(r, reason, out)

    def _read_fits(self, lease_end: float, now: float) -> bool:
        return now + self.config.max_read_time + self.config.clock_drift <= lease_end

    def admit(self, rid: str, params: TransferParams, now: float) -> list[DEffect]:
        """Transfer params received. The initial term is aged by ``max_delay``."""
        if self._clock(now) is None:
            return []
        out: list[DEffect] = []
        peer = self.peers.get(params.engine)
        if peer is None:  # not setdefault: that would build a _Peer on every admit
            peer = self.peers[params.engine] = _Peer()
        if rid in self.reqs or params.handle in peer.reqs:
            self._count("duplicate_admit")
            return out
        lease_end = now + params.initial_term - self.config.max_delay
        r = _DReq(rid, params, lease_end)
        self.reqs[rid] = r
        peer.reqs[params.handle] = r
        if not self._read_fits(lease_end, now):
            self._go(r, ADMIT, "lease_short")
            self._release(r, "lease_short", out)
            return out
        heapq.heappush(self._lease_heap, (lease_end, rid))
        if peer.ready:
            self._go(r, ADMIT, "peer_ready")
        else:
            self._go(r, ADMIT, "peer_unknown")
            if not peer.handshaking:
                peer.handshaking = True
                out.append(StartHandshake(params.engine))
        return out

    def handshake_result(self, engine: str, ok: bool, now: float,
                         reason: str = "handshake") -> list[DEffect]:
        """The handshake with ``engine`` finished (ok) or failed (``reason``)."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.setdefault(engine, _Peer())
        peer.handshaking = False
        peer.ready = ok
        for r in [r for r in peer.reqs.values() if r.state == HANDSHAKING]:
            if ok:
                self._go(r, HANDSHAKE_OK, "ok")
            else:
                self._go(r, HANDSHAKE_FAILED, "failed")
                self._finish(r, reason, out)
        return out

    def schedule(self, rid: str, now: float) -> list[DEffect]:
        """D's scheduler wants this request's KV now."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None or r.state != WAITING:
            self._count("schedule_not_waiting")
            return out
        p = r.params
        if p.group is not None:
            owner = self._group_owner.get((p.engine, p.group))
            if owner is not None and owner != rid and owner in self.reqs:
                # The owner's READ has not landed yet (if it fails, this member may
                # become the owner): not done, not read; the scheduler retries later.
                self._go(r, SCHEDULE, "sibling_in_flight")
                self._count("sibling_in_flight")
                return out
            if owner is not None and owner != rid:
                self._go(r, SCHEDULE, "sibling_local")
                out.append(SendRelease(rid, p.engine, p.handle, p.expected))
                self._finish(r, "sibling_local", out)
                return out
        if not self._read_fits(r.lease_end, now):
            self._go(r, SCHEDULE, "lease_short")
            self._release(r, "lease_short", out)
            return out
        if p.group is not None:
            self._group_owner[(p.engine, p.group)] = rid
        self._go(r, SCHEDULE, "lease_covers_read")
        out.append(PostRead(rid, p.engine, p.handle, p.blocks, p.expected))
        return out

    def read_result(self, rid: str, ok: bool, now: float, *, fenced: bool = False,
                    notif_attached: bool = True) -> list[DEffect]:
        """The READ finished (``ok``), failed, or its generations changed (``fenced``).

        With ``notif_attached`` the done notification travelled with the READ (NIXL's
        notif_msg); otherwise the machine emits SendDone.
        """
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None or r.state != READING:
            self._count("read_result_not_reading")
            return out
        p = r.params
        if ok and not fenced:
            pending = r.abort_pending
            self._go(r, READ_OK, "abort_pending" if pending else "ok")
            if not notif_attached:
                out.append(SendDone(rid, p.engine, p.handle, p.expected))
            self._finish(r, "aborted" if pending else "pulled", out)
        else:
            self._go(r, READ_FAILED, "fenced" if fenced else "error")
            # The READ is no longer in flight, so release is safe; P counts this
            # reader once even if the READ's own notification also arrives.
            self._release(r, "fenced" if fenced else "transfer_error", out)
        return out

    def abort(self, rid: str, now: float) -> list[DEffect]:
        """Client abort on D. Never releases under an in-flight READ."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None:
            self._count("abort_unknown")
            return out
        if r.state == READING:
            self._go(r, D_ABORT, "in_flight")
            r.abort_pending = True
            return out
        self._go(r, D_ABORT, "idle")
        self._release(r, "aborted", out)
        return out

    def ack(self, engine: str, seq: int, term: float, refused: Sequence[int],
            now: float, pending: Sequence[int] = ()) -> list[DEffect]:
        """P answered heartbeat ``seq``: lease end := send time + term - drift, except for
        ``refused`` handles (P will not renew them) and ``pending`` ones (P has not
        registered them yet: the previous estimate stands)."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.get(engine)
        sent = peer.outstanding.pop(seq, None) if peer is not None else None
        if peer is None or sent is None:
            self._count("ack_unknown")
            return out
        refused_set = set(refused)
        pending_set = set(pending)
        lease_end = sent.sent_at + term - self.config.clock_drift
        for h in sent.handles:
            r = peer.reqs.get(h)
            if r is None or r.state not in (WAITING, READING) or h in pending_set:
                continue
            if h in refused_set:
                if self._go(r, ACK, "refused").dst == D_FAILED:
                    self._release(r, "revoked", out)
            else:
                self._go(r, ACK, "granted")
                if lease_end > r.lease_end:
                    r.lease_end = lease_end
        return out

    def peer_lost(self, engine: str, now: float) -> list[DEffect]:
        """P disconnected (or crashed): fail everything not in flight, promptly."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.get(engine)
        if peer is None:
            return out
        peer.ready = False
        peer.handshaking = False
        peer.outstanding.clear()
        for r in list(peer.reqs.values()):
            if r.state == READING:
                self._go(r, PEER_LOST, "in_flight")
            elif r.state in (WAITING, HANDSHAKING):
                self._go(r, PEER_LOST, "lost")
                self._finish(r, "peer_lost", out)
        return out

    def tick(self, now: float) -> list[DEffect]:
        """Heartbeat every request still to be pulled (queued ones too), per P engine;
        fail requests whose lease can no longer cover a READ."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        cfg = self.config
        margin = cfg.max_read_time + cfg.clock_drift
        heap = self._lease_heap
        while heap and heap[0][0] - margin < now:
            _, rid = heapq.heappop(heap)
            r = self.reqs.get(rid)
            if r is None or r.state not in (WAITING, HANDSHAKING):
                continue
            if self._read_fits(r.lease_end, now):
                heapq.heappush(heap, (r.lease_end, rid))  # renewed since: re-insert
                continue
            self._go(r, D_TICK, "lease_lost")
            self._release(r, "lease_lost", out)
        if now >= self._next_hb:
            self._next_hb = now + cfg.heartbeat_interval
            cap = self.heartbeat_chunk or 1 << 30
            for engine, peer in self.peers.items():
                _prune_outstanding(peer, now - cfg.lease_extension)
                if not peer.ready or not peer.reqs:
                    continue
                by_expected: dict[int, list[int]] = {}
                for h, r in peer.reqs.items():
                    if r.state == WAITING or r.state == READING:
                        by_expected.setdefault(r.params.expected, []).append(h)
                for expected, handles in by_expected.items():
                    handles.sort()
                    for run in chunk_handles(handles, cfg.max_message_bytes):
                        for i in range(0, len(run), cap):
                            part = tuple(run[i:i + cap])
                            peer.seq = (peer.seq + 1) & 0xFFFFFFFF
                            peer.outstanding[peer.seq] = _HbSent(now, part)
                            if len(peer.outstanding) > MAX_OUTSTANDING_HEARTBEATS:
                                peer.outstanding.popitem(last=False)
                                self._count("heartbeat_memory_evicted")
                            out.append(SendHeartbeat(engine, peer.seq, part, expected))
        return out


def mermaid(transitions: Sequence[Transition] = P_TRANSITIONS, *, title: str = "") -> str:
    """Render a transition table as a Mermaid state diagram (generated, never drawn)."""
    lines = ["stateDiagram-v2"]
    if title:
        lines.insert(0, f"%% {title}")
    seen: set[tuple[str, str, str]] = set()
    for t in transitions:
        if t.src == t.dst and not t.effect.startswith(("free", "ack")):
            continue  # self-loops that only count are documented in the table, not drawn
        label = f"{t.event} [{t.guard}]" + (f" / {t.effect}" if t.effect else "")
        key = (t.src, t.dst, label)
        if key in seen:
            continue
        seen.add(key)
        src = "[*]" if t.src in (UNREGISTERED, D_NEW) else t.src
        lines.append(f"    {src} --> {t.dst}: {label}")
    for term in (EXPIRED, FREED, D_DONE, D_FAILED):
        if any(t.dst == term for t in transitions):
            lines.append(f"    {term} --> [*]")
    return "\n".join(lines) + "\n"


def markdown_table(transitions: Sequence[Transition]) -> str:
    rows = ["| state | event | guard | next state | effect | note |",
            "| --- | --- | --- | --- | --- | --- |"]
    for t in transitions:
        rows.append(f"| {t.src} | {t.event} | {t.guard} | {t.dst} | {t.effect or '-'} | {t.doc} |")
    return "\n".join(rows) + "\n"
