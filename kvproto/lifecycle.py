"""The KV-block lifecycle: the one module that can hold or free blocks.

Everything that affects the lifecycle state machines lives here, h11-style:

* ``Config``       -- timing assumptions and caps, validated;
* ``BlockPool``    -- reference-counted KV blocks (held + free = capacity);
* ``P_TRANSITIONS``-- the producer (P) transition table. Each row is (state, event,
  guard) -> destination and effects (``Fx`` values: ``free:<reason>``, ``renew``...);
* ``Ledger``       -- P's sans-I/O machine: events in, effects out. Every event computes a
  named guard and runs its row in ``_step``: the table *is* the code, so a changed row
  changes behaviour (``Ledger.with_rows`` builds such a variant; ``kvproto.mutants``);
* ``D_TRANSITIONS``/``Consumer`` -- one decode rank's (D) machine, run the same way, with
  its own event classes (``Admit`` ... ``DTick``), ``apply`` and journal sink;
  ``PEER_STATES`` is the one vocabulary for D's view of a P engine.

No sockets, threads or clocks: time is an argument of every event. The TLA+ spec
in ``kvproto/tla/KVLifecycle.tla`` mirrors this module one to one (same state names; actions
named after the events, see its header), with ``kvproto/tla/KVLedger.tla`` and
``kvproto/tla/KVConsumer.tla`` for each machine alone; ``spec/PROTOCOL.md`` is the prose mirror.
Each ledger method names the TLA+ action it mirrors. Code outside this module reads the
machines through their public views (``state``, ``held``, ``staged``,
``groups_transferred``, ``peer_state``, ``group_owner``...), never their private fields.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, ClassVar, Final, NamedTuple

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


class Fx(NamedTuple):
    """One effect of a table row: a kind and, for some kinds, an argument.

    P kinds: ``hold`` (hold the blocks, start the initial lease, apply staged messages),
    ``free`` (arg: the free reason; the only way blocks are freed), ``cascade`` (after a
    transfer: free the group's other members), ``stage`` (keep an early message until
    register), ``renew`` (deadline := max(deadline, now + lease_extension); the ack grants
    it), ``refuse`` (the ack refuses it), ``grace`` (deadline := min(deadline, now +
    abort_grace)), ``count`` (arg: a counter), ``reject`` (arg: the rejection reason).

    D kinds: ``track`` (watch the lease end), ``handshake`` (start or join the handshake
    with P), ``read`` (own the sibling group, post the READ), ``renew`` (lease end :=
    max(lease end, heartbeat send time + term - drift)), ``abort_pending`` (remember a
    client abort until the READ ends), ``send_done`` (tell P done, unless the notification
    rode on the READ), ``send_release``, ``disown`` (give up the group's ownership),
    ``finish`` (arg: the reason, empty = the event's own reason; the request leaves D).
    """

    kind: str
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


P_FX_KINDS: Final = frozenset({"hold", "free", "cascade", "stage", "renew", "refuse", "grace",
                               "count", "reject"})
D_FX_KINDS: Final = frozenset({"track", "handshake", "read", "renew", "abort_pending",
                               "send_done", "send_release", "disown", "finish"})


@dataclass(frozen=True, slots=True)
class Transition:
    """One row of a transition table: in ``src``, on ``event`` with guard outcome
    ``guard`` (computed by the machine), go to ``dst`` and run ``effects`` in order.

    The fields after ``doc`` are derived from ``effects`` when the row is built (at
    import), so that the machines run the table without parsing anything on the hot path.
    """

    src: str
    event: str
    guard: str  # named guard outcome, computed by the machine
    dst: str
    effects: tuple[Fx, ...]
    doc: str
    free: str | None = field(init=False, default=None)  # free reason
    counter: str | None = field(init=False, default=None)
    reject: str | None = field(init=False, default=None)
    finish: str | None = field(init=False, default=None)  # "" = the event's reason
    hold: bool = field(init=False, default=False)
    cascade: bool = field(init=False, default=False)
    stage: bool = field(init=False, default=False)
    renew: bool = field(init=False, default=False)
    refuse: bool = field(init=False, default=False)
    grace: bool = field(init=False, default=False)
    track: bool = field(init=False, default=False)
    handshake: bool = field(init=False, default=False)
    read: bool = field(init=False, default=False)
    abort_pending: bool = field(init=False, default=False)
    send_done: bool = field(init=False, default=False)
    send_release: bool = field(init=False, default=False)
    disown: bool = field(init=False, default=False)
    # "dst:finish" (the machine's finished-counter key) when the row names the finish.
    finish_key: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for fx in self.effects:
            if fx.kind in seen or fx.kind not in _FX_FIELD:
                raise ValueError(f"row {self.key}: bad or repeated effect {fx}")
            seen.add(fx.kind)
            name = _FX_FIELD[fx.kind]
            object.__setattr__(self, name, fx.arg if name in _FX_WITH_ARG else True)
        if self.finish:
            object.__setattr__(self, "finish_key", f"{self.dst}:{self.finish}")

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.src, self.event, self.guard)

    @property
    def effect(self) -> str:
        """The effects as one label (diagrams and tables): ``free:sibling, cascade``."""
        return ", ".join(str(fx) for fx in self.effects)

    def _replace(self, **changes: Any) -> Transition:
        """A copy with some fields changed (derived fields are recomputed)."""
        return replace(self, **changes)


_FX_FIELD: Final[dict[str, str]] = {
    **{k: k for k in ("hold", "free", "cascade", "stage", "renew", "refuse", "grace", "reject",
                      "finish", "track", "handshake", "read", "abort_pending", "send_done",
                      "send_release", "disown")},
    "count": "counter",
}
_FX_WITH_ARG: Final = frozenset({"free", "counter", "reject", "finish"})


def _fx(*specs: str) -> tuple[Fx, ...]:
    """Effects from their labels, e.g. ``_fx("free:sibling", "cascade")``."""
    out = []
    for s in specs:
        kind, _, arg = s.partition(":")
        out.append(Fx(kind, arg))
    return tuple(out)


def _T(src: str, event: str, guard: str, dst: str, effects: tuple[Fx, ...] | str,
       doc: str) -> Transition:
    return Transition(src, event, guard, dst,
                      _fx(effects) if isinstance(effects, str) and effects else
                      effects if isinstance(effects, tuple) else (), doc)


_HELD_LIVE = (REGISTERED, LEASED, NOTIFIED)  # held and not aborted

P_TRANSITIONS: Final[tuple[Transition, ...]] = (
    # register -------------------------------------------------------------
    _T(UNREGISTERED, REGISTER, "fresh", REGISTERED, "hold", "hold blocks, start the initial lease, apply staged messages"),
    _T(UNREGISTERED, REGISTER, "group_transferred", FREED, _fx("hold", "free:sibling"), "a sibling was already transferred"),
    *(_T(s, REGISTER, "duplicate", s, _fx("count:duplicate_register", "reject:duplicate_register"),
         "handle or request id already known")
      for s in (REGISTERED, LEASED, NOTIFIED, ABORTED, EXPIRED, FREED)),
    # done (one reader's READ completed) -------------------------------------
    _T(UNREGISTERED, DONE, "early", UNREGISTERED, "stage", "staged until register"),
    *(_T(s, DONE, "more_readers", NOTIFIED, "", "a new reader finished; others still expected")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "all_done", FREED, _fx("free:transferred", "cascade"), "every expected reader reported done")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "all_finished", FREED, "free:released", "every expected reader finished, some released")
      for s in _HELD_LIVE),
    *(_T(s, DONE, "duplicate_reader", s, "count:duplicate", "the same reader twice never counts twice")
      for s in (REGISTERED, LEASED, NOTIFIED, ABORTED)),
    _T(ABORTED, DONE, "more_readers", ABORTED, "", "a new reader finished; others still expected"),
    _T(ABORTED, DONE, "all_done", FREED, _fx("free:transferred", "cascade"), "every expected reader reported done"),
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
    _T(UNREGISTERED, HEARTBEAT, "early", UNREGISTERED, "stage", "staged until register; the ack lists it as pending"),
    _T(REGISTERED, HEARTBEAT, "renew", LEASED, "renew", "deadline := max(deadline, now + extension)"),
    _T(LEASED, HEARTBEAT, "renew", LEASED, "renew", "deadline := max(deadline, now + extension)"),
    _T(NOTIFIED, HEARTBEAT, "renew", NOTIFIED, "renew", "deadline := max(deadline, now + extension)"),
    _T(ABORTED, HEARTBEAT, "refuse", ABORTED, _fx("count:refused", "refuse"), "aborted requests are not renewed; the ack refuses it"),
    _T(EXPIRED, HEARTBEAT, "late", EXPIRED, _fx("count:late", "refuse"), "arrived after expiry; the ack refuses it"),
    _T(FREED, HEARTBEAT, "stale", FREED, _fx("count:stale", "refuse"), "arrived after free; the ack refuses it"),
    # abort (client or router abort on P) ----------------------------------------
    _T(UNREGISTERED, ABORT, "unknown", UNREGISTERED, "count:unknown_request", "not held by the lifecycle: nothing to do"),
    *(_T(s, ABORT, "hold", ABORTED, "grace", "a READ may be in flight: stop renewals, free on done/release or deadline")
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

TableKey = tuple[str, str, str]
Table = Mapping[TableKey, Transition]


class TableError(ValueError):
    """A transition table that no machine can run (a bad row)."""


def _check_p_row(row: Transition) -> str | None:
    absent = (row.src in (UNREGISTERED, EXPIRED, FREED) and row.event != REGISTER) \
        or row.guard == "duplicate"
    if absent and row.dst != row.src:
        return "a message about a request that is not held cannot move it"
    if absent and (row.free is not None or row.hold or row.renew or row.grace or row.cascade):
        return "a request that is not held has nothing to hold, free or renew"
    if (row.free is not None) != (row.dst in TERMINAL_STATES and row.src != row.dst):
        return "exactly the rows that enter a terminal state free (free:<reason>)"
    if row.cascade and row.free is None:
        return "cascade follows a free"
    if not absent and row.dst not in HELD_STATES | TERMINAL_STATES:
        return f"{row.dst!r} is not a state a held request can enter"
    if row.stage and not absent:
        return "only messages about unregistered requests are staged"
    return None


def _check_d_row(row: Transition) -> str | None:
    if row.src in (D_DONE, D_FAILED) or row.dst == D_NEW:
        return "done and failed are final; nothing returns to new"
    if (row.finish is not None) != (row.dst in (D_DONE, D_FAILED)):
        return "exactly the rows that enter done or failed finish the request"
    if row.dst not in (WAITING, HANDSHAKING, READING, D_DONE, D_FAILED):
        return f"{row.dst!r} is not a D state"
    return None


def make_table(rows: Iterable[Transition], *, machine: str = "P") -> Table:
    """A read-only table keyed by (src, event, guard) for machine "P" or "D". Rows must
    be unique and runnable (``TableError`` says which rule a row breaks)."""
    kinds, check = (P_FX_KINDS, _check_p_row) if machine == "P" else (D_FX_KINDS, _check_d_row)
    table: dict[TableKey, Transition] = {}
    for row in rows:
        if row.key in table:
            raise TableError(f"duplicate row in transition table: {row.key}")
        bad = [str(fx) for fx in row.effects if fx.kind not in kinds]
        if bad:
            raise TableError(f"row {row.key}: effects {bad} do not belong to machine {machine}")
        why = check(row)
        if why is not None:
            raise TableError(f"row {row.key} -> {row.dst} / {row.effect or '-'}: {why}")
        table[row.key] = row
    return MappingProxyType(table)


def with_rows(table: Table, *rows: Transition) -> Table:
    """A copy of ``table`` in which ``rows`` replace the rows with the same key (a
    mutant's table: see ``Ledger.with_rows`` and ``kvproto.mutants``)."""
    new = dict(table)
    for row in rows:
        if row.key not in new:
            raise KeyError(f"no row {row.key} to replace")
        new[row.key] = row
    machine = "D" if any(k[0] == D_NEW for k in new) else "P"
    return make_table(new.values(), machine=machine)


P_TABLE: Final[Table] = make_table(P_TRANSITIONS)

# ---------------------------------------------------------------------------
# The decode (D) side: one machine per (request, reader rank).
# ---------------------------------------------------------------------------

WAITING: Final = "waiting"  # admitted (maybe queued behind D's scheduler), P engine known
HANDSHAKING: Final = "handshaking"  # P engine not yet known: handshake in progress
READING: Final = "reading"  # a READ is in flight
D_DONE: Final = "done"  # KV is local (pulled, or served from a sibling's prefix)
D_FAILED: Final = "failed"  # gave up: recompute locally; P was told (release) where possible
D_STATES: Final = (WAITING, HANDSHAKING, READING, D_DONE, D_FAILED)

# D events. TLA+ action names (tla/KVLifecycle.tla) are these names in CamelCase, with a
# "D" prefix where P already uses the bare name (DAbort, DAck, DTick); the Python event
# classes below carry the same names.
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

# Peer (P engine) states as D sees them: one vocabulary for the machine, the adapter and
# the TLA+ spec (variable ``peer``).
PEER_UNKNOWN: Final = "unknown"  # no handshake yet, or it failed, or the peer was lost
PEER_HANDSHAKING: Final = "handshaking"
PEER_READY: Final = "ready"
PEER_STATES: Final = (PEER_UNKNOWN, PEER_HANDSHAKING, PEER_READY)

_RELEASE_FAIL = ("send_release", "disown")  # give up: tell P, give up the group

D_TRANSITIONS: Final[tuple[Transition, ...]] = (
    _T(D_NEW, ADMIT, "peer_ready", WAITING, "track", "transfer params received; P engine handshaken"),
    _T(D_NEW, ADMIT, "peer_unknown", HANDSHAKING, _fx("track", "handshake"), "start (or join) the handshake with P"),
    _T(D_NEW, ADMIT, "lease_short", D_FAILED, _fx("send_release", "finish:lease_short"), "params arrived with too little lease left"),
    _T(HANDSHAKING, HANDSHAKE_OK, "ok", WAITING, "", "P known; heartbeats start"),
    _T(HANDSHAKING, HANDSHAKE_FAILED, "failed", D_FAILED, "finish", "handshake, version or layout mismatch: recompute"),
    _T(WAITING, SCHEDULE, "lease_covers_read", READING, "read", "own the group, post the READ with the done notification attached"),
    _T(WAITING, SCHEDULE, "lease_short", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_short"), "lease less max READ time and drift does not cover a READ"),
    _T(WAITING, SCHEDULE, "sibling_local", D_DONE, _fx("send_release", "finish:sibling_local"), "a sibling's KV landed: served from prefix, never pulled"),
    _T(WAITING, SCHEDULE, "sibling_in_flight", WAITING, "", "the group's READ is in flight: schedule again later"),
    _T(READING, READ_OK, "ok", D_DONE, _fx("send_done", "finish:pulled"), "data landed (and generations matched)"),
    _T(READING, READ_OK, "abort_pending", D_FAILED, _fx("send_done", "finish:aborted"), "aborted during the READ: P may free now; keeps the group (P heard done)"),
    _T(READING, READ_FAILED, "fenced", D_FAILED, _fx(*_RELEASE_FAIL, "finish:fenced"), "generation stamps changed: never served"),
    _T(READING, READ_FAILED, "error", D_FAILED, _fx(*_RELEASE_FAIL, "finish:transfer_error"), "transfer error; handle no longer in flight"),
    _T(WAITING, D_ABORT, "idle", D_FAILED, _fx(*_RELEASE_FAIL, "finish:aborted"), "client abort on D before the READ"),
    _T(HANDSHAKING, D_ABORT, "idle", D_FAILED, _fx(*_RELEASE_FAIL, "finish:aborted"), "client abort on D during the handshake"),
    _T(READING, D_ABORT, "in_flight", READING, "abort_pending", "never release under an in-flight READ: wait for it"),
    _T(WAITING, ACK, "granted", WAITING, "renew", "lease end := heartbeat send time + granted term"),
    _T(READING, ACK, "granted", READING, "renew", "lease end := heartbeat send time + granted term"),
    _T(WAITING, ACK, "refused", D_FAILED, _fx(*_RELEASE_FAIL, "finish:revoked"), "P refused the renewal (aborted, expired or freed): release so an aborted request frees now"),
    _T(READING, ACK, "refused", READING, "", "the READ started under a valid lease; let it finish"),
    _T(WAITING, PEER_LOST, "lost", D_FAILED, "finish:peer_lost", "P disconnected or fell silent (peer_timeout)"),
    _T(HANDSHAKING, PEER_LOST, "lost", D_FAILED, "finish:peer_lost", "P disconnected or fell silent (peer_timeout)"),
    _T(READING, PEER_LOST, "in_flight", READING, "", "the READ will report its own failure"),
    _T(WAITING, D_TICK, "lease_lost", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_lost"), "lease can no longer cover a READ and no renewal came"),
    _T(HANDSHAKING, D_TICK, "lease_lost", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_lost"), "lease can no longer cover a READ and no renewal came"),
)

D_TABLE: Final[Table] = make_table(D_TRANSITIONS, machine="D")


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
    peer_timeout: float = 20.0  # D: a P engine that leaves heartbeats unanswered this long is lost

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
        peer_need = self.heartbeat_interval + 2 * self.max_delay
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
            (self.peer_timeout > peer_need,
             f"peer_timeout ({self.peer_timeout}) must exceed heartbeat_interval + "
             f"2*max_delay ({peer_need}): otherwise D declares a P engine that answers every "
             "heartbeat on time lost (and fails its requests)"),
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
                     "max_staged_age", "peer_timeout"):
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
        self.state: str = UNREGISTERED  # the register step moves it
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


class HeldView(NamedTuple):
    """A read-only view of one held request (``Ledger.held``)."""

    handle: int
    request_id: str
    state: str
    blocks: tuple[int, ...]
    deadline: float
    group: str | None
    expected: int
    finished: frozenset[str]
    released: bool


class StagedView(NamedTuple):
    """A read-only view of one staged handle (``Ledger.staged``): messages that arrived
    before register, as (kind, reader, expected, arrival time), oldest first."""

    handle: int
    since: float
    msgs: tuple[tuple[str, str, int, float], ...]


# Ledger subclasses made by Ledger.with_rows, so that one (base, rows, name) is one class
# (unpickling finds it again). Mutants and tests only; cleared beyond the cap.
_LEDGER_CLASSES: dict[tuple[type, tuple[Transition, ...], str], type] = {}
MAX_LEDGER_CLASSES: Final = 256


def _ledger_class(base: type[Ledger], rows: tuple[Transition, ...], name: str) -> type[Ledger]:
    key = (base, rows, name)
    cls = _LEDGER_CLASSES.get(key)
    if cls is None:
        if len(_LEDGER_CLASSES) >= MAX_LEDGER_CLASSES:
            _LEDGER_CLASSES.clear()
        cls = _LEDGER_CLASSES[key] = type(name, (base,), {
            "TABLE": with_rows(base.TABLE, *rows), "_ROWS": rows, "__module__": base.__module__})
    assert issubclass(cls, Ledger)
    return cls


def _remake_ledger(base: type[Ledger], rows: tuple[Transition, ...], name: str) -> Ledger:
    cls = _ledger_class(base, rows, name)
    obj: Ledger = cls.__new__(cls)
    return obj


class Ledger:
    """P's lifecycle machine for one P rank: every block hold and free goes through it.

    The machine runs ``TABLE`` (``P_TRANSITIONS`` by default): every event computes a
    named guard, looks up (state, event, guard) and runs the row (``_step``): its
    effects, then its destination. A subclass may replace rows (``with_rows``); the
    derived per-state views the hot paths use are rebuilt for each subclass.

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

    Documented hooks (overridden by ``kvproto.mutants`` to re-introduce known bugs):
    ``_tally`` (how a reader's report counts) and ``_sweep`` (which requests a tick
    finds due).
    """

    TABLE: ClassVar[Table] = P_TABLE
    _ROWS: ClassVar[tuple[Transition, ...]] = ()  # rows replaced by with_rows (pickling)
    # state -> destination, for heartbeat rows that only renew (the hot path), and
    # state -> row for the others; derived from TABLE per class.
    _HB_FAST: ClassVar[dict[str, str]]
    _HB_ROW: ClassVar[dict[str, Transition]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._derive()

    @classmethod
    def _derive(cls) -> None:
        t = cls.TABLE
        rows = {s: t[(s, HEARTBEAT, "refuse" if s == ABORTED else "renew")] for s in HELD_STATES}
        cls._HB_ROW = rows
        cls._HB_FAST = {s: r.dst for s, r in rows.items() if r.effects == (Fx("renew"),)}

    @classmethod
    def with_rows(cls, *rows: Transition, name: str | None = None) -> type[Ledger]:
        """A subclass whose table has ``rows`` in place of the rows with the same key
        (mutants and mutation tests). Instances pickle like any ledger."""
        return _ledger_class(cls, tuple(rows), name or f"{cls.__name__}WithRows")

    def __reduce_ex__(self, protocol: Any) -> Any:
        cls = type(self)
        if "_ROWS" in cls.__dict__ and cls._ROWS:
            return (_remake_ledger, (cls.__bases__[0], cls._ROWS, cls.__name__),
                    self.__dict__)
        return super().__reduce_ex__(protocol)

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

    # -- queries (read-only views) -------------------------------------------------------
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

    def held(self, handle: int) -> HeldView | None:
        """The held request ``handle`` (None when not held)."""
        r = self._live.get(handle)
        if r is None:
            return None
        return HeldView(r.handle, r.rid, r.state, r.blocks, r.deadline, r.group, r.expected,
                        frozenset(r.finished or ()), r.released)

    def staged(self) -> list[StagedView]:
        """Staged handles, oldest first (O(staged))."""
        return [StagedView(h, st.since, tuple(st.msgs)) for h, st in self._staged.items()]

    def groups_transferred(self) -> tuple[str, ...]:
        """Sibling groups remembered as transferred, oldest first (O(groups))."""
        return tuple(self._groups_done)

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

    # -- the step: one table row --------------------------------------------------------
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

    def _step(self, r: _Req, event: str, guard: str, now: float,
              out: list[Effect]) -> Transition:
        """Run the row (r.state, event, guard) on held (or registering) request ``r``:
        its effects in order, then its destination. Effects that only shape the reply
        (``refuse``, ``stage``, ``reject``) are read from the returned row by the caller."""
        row = self.TABLE[(r.state, event, guard)]
        if row.counter is not None:
            c = self.counters
            c[row.counter] = c.get(row.counter, 0) + 1
        if row.hold:
            self._hold(r)
        if row.grace:
            dl = now + self.config.abort_grace
            if dl < r.deadline:  # only when abort_grace is below the lease horizon
                r.deadline = dl
                heapq.heappush(self._heap, (dl, r.handle))
        if row.renew:
            dl = now + self.config.lease_extension
            if dl > r.deadline:
                r.deadline = dl  # the heap entry is now early; tick re-inserts it lazily
        if row.free is not None:
            group = r.group
            self._free(r, row, out)
            if row.cascade and group is not None:
                self._group_transferred(group, out)
        else:
            r.state = row.dst
        return row

    def _step_absent(self, state: str, event: str, guard: str, reader: str, handle: int,
                     expected: int, now: float) -> Transition:
        """Run the row for a message about a request that is not held (unregistered,
        expired or freed): count it, or stage it."""
        row = self.TABLE[(state, event, guard)]
        if row.counter is not None:
            self._count(row.counter)
        if row.stage:
            self._stage(event, reader, handle, expected, now)
        return row

    def _hold(self, r: _Req) -> None:
        self.pool._hold(r.blocks)
        self._live[r.handle] = r
        self._by_rid[r.rid] = r.handle
        if r.group is not None:
            self._groups.setdefault(r.group, set()).add(r.handle)
        heapq.heappush(self._heap, (r.deadline, r.handle))

    def _free(self, r: _Req, row: Transition, out: list[Effect]) -> None:
        """The only place blocks are freed. Moves ``r`` to its terminal state."""
        reason = row.free
        assert reason is not None
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
        self.frees[reason] = self.frees.get(reason, 0) + 1
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

    # -- hooks -----------------------------------------------------------------------------
    def _tally(self, r: _Req, event: str, reader: str) -> int:
        """Hook: ``reader`` finished ``r`` (done or release). Return how many readers
        count as finished now, or -1 when this reader had already finished."""
        fin = r.finished
        if fin is None:
            fin = r.finished = set()
        if reader in fin:
            return -1
        fin.add(reader)
        if event == RELEASE:
            r.released = True
        return len(fin)

    def _sweep(self, now: float, out: list[Effect]) -> None:
        """Hook: run TICK/deadline_passed for every held request whose deadline is <=
        ``now``. Called by ``tick`` only when the earliest heap entry is due."""
        heap = self._heap
        live = self._live
        budget = self.config.max_tick_work
        while heap and heap[0][0] <= now:
            if budget <= 0:
                # The rest carries over: next_deadline() reports a time already past.
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
            self._step(r, TICK, "deadline_passed", now, out)

    def _expire(self, handle: int, now: float, out: list[Effect]) -> None:
        """Run TICK/deadline_passed for the held request ``handle`` (for ``_sweep``
        overrides)."""
        self._step(self._live[handle], TICK, "deadline_passed", now, out)

    # -- the machine's internal events ----------------------------------------------------
    def _finish(self, r: _Req, event: str, reader: str, expected: int, now: float,
                out: list[Effect]) -> None:
        """A reader finished (done or release). Mirrors TLA+ Done / Release."""
        if expected != r.expected:
            self._announce(r, expected)
        n = self._tally(r, event, reader)
        if n < 0:
            guard = "duplicate_reader"
        elif r.expected and n >= r.expected:
            guard = "all_finished" if r.released else "all_done"
        else:
            guard = "more_readers"
        self._step(r, event, guard, now, out)

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
            r = self._live.get(h)
            if r is None:
                continue  # freed by an earlier member's cascade
            guard = "reader_active" if r.state == NOTIFIED else "group_transferred"
            self._step(r, SIBLING, guard, self.now, out)

    def _not_live(self, event: str, reader: str, handle: int, expected: int,
                  now: float) -> Transition:
        t = self._tomb.get(handle)
        if t is None:
            return self._step_absent(UNREGISTERED, event, "early", reader, handle, expected, now)
        st = t[0]
        return self._step_absent(st, event, "late" if st == EXPIRED else "stale", reader,
                                 handle, expected, now)

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
            row = self._step_absent(st, REGISTER, "duplicate", "", handle, expected, now)
            if row.reject is not None:
                out.append(Rejected(row.reject, "", handle,
                                    f"handle {handle} / request id {request_id!r} already known ({st})"))
            return self._emit(ev, out)
        if handle >= self._next_handle:
            self._next_handle = handle + 1
        r = _Req(handle, request_id, blocks, now + self.config.initial_lease, group, expected)
        guard = "group_transferred" if group is not None and group in self._groups_done \
            else "fresh"
        self._step(r, REGISTER, guard, now, out)
        staged = self._staged.pop(handle, None)
        if staged is not None:
            if r.state not in HELD_STATES:
                return self._emit(ev, out)  # freed at once (group transferred): dropped
            self._count("staged_applied", len(staged.msgs))
            for kind, reader, exp, t in staged.msgs:
                if r.state not in HELD_STATES:
                    self._count("stale")
                    continue
                if kind == HEARTBEAT:
                    if exp > r.expected:
                        self._announce(r, exp)
                    self._step(r, HEARTBEAT, "refuse" if r.state == ABORTED else "renew", t, out)
                else:
                    self._finish(r, kind, reader, exp, now, out)
            if out:
                self._maybe_compact()
        return self._emit(ev, out)

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
            self._not_live(DONE, reader, handle, expected, now)
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
                self._not_live(RELEASE, reader, h, expected, now)
        if out:
            self._maybe_compact()
        return self._emit(Release(reader, tuple(handles), expected, now), out) if self.sink else out

    def heartbeat(self, reader: str, seq: int, handles: Sequence[int], expected: int,
                  now: float) -> list[Effect]:
        """Renew the leases of a batch. Mirrors TLA+ ``Heartbeat``. O(1) per handle.

        Per handle, the row's effects decide the ack: ``refuse`` refuses it, else
        ``renew`` grants it, else (staged: not registered yet) it is listed as pending."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(HEARTBEAT, now)
        now = clk
        ext_dl = now + self.config.lease_extension
        live = self._live
        fast = self._HB_FAST.get
        refused: list[int] | None = None
        pending: list[int] | None = None
        for h in handles:
            r = live.get(h)
            if r is not None:
                dst = fast(r.state)
                if dst is not None:  # a row whose only effect is renew: inlined
                    if expected > r.expected:
                        self._announce(r, expected)
                    if ext_dl > r.deadline:
                        r.deadline = ext_dl
                    r.state = dst
                    continue
                row = self._HB_ROW[r.state]
                if row.renew and expected > r.expected:
                    self._announce(r, expected)
                self._step(r, HEARTBEAT, row.guard, now, [])
            else:
                row = self._not_live(HEARTBEAT, reader, h, expected, now)
            if row.refuse:
                if refused is None:
                    refused = []
                refused.append(h)
            elif not row.renew:
                # Staged: not renewed yet. It may also be a long-freed handle whose
                # tombstone was evicted, so it must not count as granted.
                if pending is None:
                    pending = []
                pending.append(h)
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
            if t is not None:
                self._step_absent(t[0], ABORT, "stale", "", -1, 0, now)
            else:
                self._step_absent(UNREGISTERED, ABORT, "unknown", "", -1, 0, now)
            return self._emit(Abort(request_id, now), out)
        self._step(r, ABORT, "again" if r.state == ABORTED else "hold", now, out)
        self._maybe_compact()
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
            self._sweep(now, out)
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


Ledger._derive()


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


# D effects. Values: compared and hashed by their fields, and never changed once built
# (nothing in kvproto assigns to one). Not ``frozen``: a frozen dataclass costs about 4x
# as much to build (0.66 us vs 0.16 us for PostRead, measured), and D builds three of
# these per request on its hot path.
@dataclass(slots=True, unsafe_hash=True)
class StartHandshake:
    engine: str


@dataclass(slots=True, unsafe_hash=True)
class PostRead:
    request_id: str
    engine: str
    handle: int
    blocks: tuple[int, ...]
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendDone:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendRelease:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendHeartbeat:
    engine: str
    seq: int
    handles: tuple[int, ...]
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class Finished:
    """The request left the machine: ``state`` is done or failed, with a reason."""

    request_id: str
    state: str
    reason: str


@dataclass(slots=True, unsafe_hash=True)
class DropPeer:
    """Effect: the machine declared ``engine`` lost (no ack for ``peer_timeout`` while
    heartbeats were outstanding): close its connection; its requests were failed."""

    engine: str
    reason: str


DEffect = StartHandshake | PostRead | SendDone | SendRelease | SendHeartbeat | Finished | DropPeer


# D events (inputs of ``Consumer.apply``; the journal of a D rank records them).
@dataclass(frozen=True, slots=True)
class Admit:
    request_id: str
    params: TransferParams
    now: float


@dataclass(frozen=True, slots=True)
class HandshakeOk:
    engine: str
    now: float


@dataclass(frozen=True, slots=True)
class HandshakeFailed:
    engine: str
    reason: str
    now: float


@dataclass(frozen=True, slots=True)
class Schedule:
    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class ReadOk:
    request_id: str
    now: float
    notif_attached: bool = True  # the done notification travelled with the READ


@dataclass(frozen=True, slots=True)
class ReadFailed:
    request_id: str
    now: float
    fenced: bool = False  # the data landed but its generation stamps changed


@dataclass(frozen=True, slots=True)
class DAbort:
    """Client abort on D."""

    request_id: str
    now: float


@dataclass(frozen=True, slots=True)
class DAck:
    """P's ack of heartbeat ``seq`` arrived (see the P effect ``Ack``)."""

    engine: str
    seq: int
    term: float
    refused: tuple[int, ...]
    now: float
    pending: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The adapter lost P engine ``engine`` (disconnect, channel closed)."""

    engine: str
    now: float


@dataclass(frozen=True, slots=True)
class DTick:
    now: float


DEvent = (Admit | HandshakeOk | HandshakeFailed | Schedule | ReadOk | ReadFailed | DAbort
          | DAck | PeerLost | DTick)


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
    state: str = PEER_UNKNOWN  # one of PEER_STATES
    seq: int = 0
    last_heard: float = -math.inf  # handshake or last ack from this peer
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
    """One decode rank's machine over its requests. Sans-I/O: events in, effects out.

    The rank is one *reader*: P counts it once per request however often it reports.
    Every event computes a named guard per request and runs the row (state, event,
    guard) of ``TABLE`` (``D_TRANSITIONS``) in ``_step``: destination and effects.
    Invariants it maintains: a READ starts only when the lease, less ``max_read_time``
    and ``clock_drift``, covers it; ``release`` is never sent while a READ is in flight;
    at most one member of a sibling group is ever read. A peer that leaves heartbeats
    unanswered for ``peer_timeout`` is lost (``DropPeer``). Costs: every event O(1)
    except the periodic heartbeat (O(n) per ``heartbeat_interval``, it must name every
    request) and peer-level events (O(requests of that peer)); tick is O(peers) when
    nothing is due.

    The lease heap holds at most max(2 * requests, ``HEAP_SLACK``) entries (rebuilt beyond).

    Time: a non-finite ``now`` is refused (counted ``bad_time``, no effect, nothing
    changes). A ``now`` before the rank's clock is counted (``clock_regression``); admit
    keeps it (the earlier arrival gives the shorter, safe lease estimate), every other
    event uses the rank's clock (a READ must fit the lease at the latest time seen).
    """

    TABLE: ClassVar[Table] = D_TABLE

    def __init__(self, reader: str, config: Config, *,
                 heartbeat_chunk: int | None = None,
                 sink: Callable[[DEvent, list[DEffect]], None] | None = None) -> None:
        """``heartbeat_chunk`` optionally caps the handles per heartbeat further; every
        SendHeartbeat always fits one wire message of ``config.max_message_bytes``, so
        that one ack answers exactly the handles of one message. ``sink`` (the journal)
        is called with every event and its effects."""
        self.reader = reader
        self.config = config.validate()
        self.sink = sink
        self.reqs: dict[str, _DReq] = {}
        self.peers: dict[str, _Peer] = {}
        self._group_owner: dict[tuple[str, str], str] = {}  # (engine, group) -> rid read
        self._lease_heap: list[tuple[float, str]] = []  # (lease_end, rid); lazy
        self._next_hb = -math.inf
        self.now = CLOCK_START
        self.heartbeat_chunk = heartbeat_chunk
        self.counters: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    @classmethod
    def with_rows(cls, *rows: Transition) -> type[Consumer]:
        """A subclass whose table has ``rows`` in place of the rows with the same key."""
        return type(f"{cls.__name__}WithRows", (cls,), {"TABLE": with_rows(cls.TABLE, *rows)})

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

    # -- read-only views -------------------------------------------------------------------
    def state(self, rid: str) -> str:
        r = self.reqs.get(rid)
        return D_NEW if r is None else r.state

    def lease_end(self, rid: str) -> float | None:
        r = self.reqs.get(rid)
        return None if r is None else r.lease_end

    def peer_state(self, engine: str) -> str:
        """``engine``'s state as D sees it: one of PEER_STATES."""
        p = self.peers.get(engine)
        return PEER_UNKNOWN if p is None else p.state

    def abort_pending(self, rid: str) -> bool:
        r = self.reqs.get(rid)
        return r is not None and r.abort_pending

    def group_owner(self, engine: str, group: str) -> str | None:
        """The request of ``group`` (from ``engine``) this rank read or is reading."""
        return self._group_owner.get((engine, group))

    def outstanding_heartbeats(self, engine: str) -> int:
        p = self.peers.get(engine)
        return 0 if p is None else len(p.outstanding)

    def next_deadline(self) -> float:
        """The earliest time at which ``tick`` can have something to do: the next
        heartbeat, a lease that may no longer cover a READ, a peer that may have gone
        silent. A tick before it changes nothing but the clock, so an adapter may tick
        only once ``now >= next_deadline()`` (as P's adapter does with the ledger's):
        its journal then holds the ticks that matter, and every journaled tick is one
        the machine itself found due. O(peers)."""
        t = self._next_hb
        heap = self._lease_heap
        if heap:
            cfg = self.config
            t = min(t, heap[0][0] - cfg.max_read_time - cfg.clock_drift)
        pt = self.config.peer_timeout
        for peer in self.peers.values():
            if peer.state == PEER_READY and peer.outstanding:
                first = next(iter(peer.outstanding.values())).sent_at
                t = min(t, max(peer.last_heard, first) + pt)
        return t

    # -- the step: one table row --------------------------------------------------------
    def _step(self, r: _DReq, event: str, guard: str, out: list[DEffect], *,
              reason: str = "", lease_end: float = -math.inf,
              notif_attached: bool = True) -> Transition:
        """Run the row (r.state, event, guard): destination, then effects in order.
        ``reason`` names the finish when the row leaves it to the event; ``lease_end``
        is what ``renew`` offers; ``notif_attached`` says whether ``send_done`` is due."""
        row = self.TABLE[(r.state, event, guard)]
        r.state = row.dst
        p = r.params
        if row.track:
            heapq.heappush(self._lease_heap, (r.lease_end, r.rid))
        if row.handshake:
            hs_peer = self.peers[p.engine]
            if hs_peer.state == PEER_UNKNOWN:
                hs_peer.state = PEER_HANDSHAKING
                out.append(StartHandshake(p.engine))
        if row.read:
            if p.group is not None:
                self._group_owner[(p.engine, p.group)] = r.rid
            out.append(PostRead(r.rid, p.engine, p.handle, p.blocks, p.expected))
        if row.abort_pending:
            r.abort_pending = True
        if row.renew and lease_end > r.lease_end:
            r.lease_end = lease_end
        if row.send_done and not notif_attached:
            out.append(SendDone(r.rid, p.engine, p.handle, p.expected))
        if row.send_release:
            out.append(SendRelease(r.rid, p.engine, p.handle, p.expected))
        if row.disown and p.group is not None \
                and self._group_owner.get((p.engine, p.group)) == r.rid:
            del self._group_owner[(p.engine, p.group)]
        if row.finish is not None:
            why = row.finish or reason
            del self.reqs[r.rid]
            n = len(self._lease_heap)
            if n > 2 * len(self.reqs) and n > HEAP_SLACK:
                # Compact in place (tick may be iterating this very list).
                self._lease_heap[:] = [(q.lease_end, q.rid) for q in self.reqs.values()
                                       if q.state in (WAITING, HANDSHAKING)]
                heapq.heapify(self._lease_heap)
            peer = self.peers.get(p.engine)
            if peer is not None and peer.reqs.get(p.handle) is r:
                del peer.reqs[p.handle]
            key = row.finish_key or f"{r.state}:{why}"
            self.finished[key] = self.finished.get(key, 0) + 1
            out.append(Finished(r.rid, r.state, why))
        return row

    def _read_fits(self, lease_end: float, now: float) -> bool:
        return now + self.config.max_read_time + self.config.clock_drift <= lease_end

    def _emit(self, ev: DEvent, out: list[DEffect]) -> list[DEffect]:
        if self.sink is not None:
            self.sink(ev, out)
        return out

    # -- generic entry point -------------------------------------------------------------
    def apply(self, ev: DEvent) -> list[DEffect]:
        """Feed one event, return its effects."""
        if isinstance(ev, DTick):
            return self.tick(ev.now)
        if isinstance(ev, DAck):
            return self.ack(ev.engine, ev.seq, ev.term, ev.refused, ev.now, ev.pending)
        if isinstance(ev, Schedule):
            return self.schedule(ev.request_id, ev.now)
        if isinstance(ev, ReadOk):
            return self.read_result(ev.request_id, True, ev.now,
                                    notif_attached=ev.notif_attached)
        if isinstance(ev, ReadFailed):
            return self.read_result(ev.request_id, False, ev.now, fenced=ev.fenced)
        if isinstance(ev, Admit):
            return self.admit(ev.request_id, ev.params, ev.now)
        if isinstance(ev, HandshakeOk):
            return self.handshake_result(ev.engine, True, ev.now)
        if isinstance(ev, HandshakeFailed):
            return self.handshake_result(ev.engine, False, ev.now, ev.reason)
        if isinstance(ev, DAbort):
            return self.abort(ev.request_id, ev.now)
        if isinstance(ev, PeerLost):
            return self.peer_lost(ev.engine, ev.now)
        raise TypeError(f"not a consumer event: {ev!r}")

    # -- events ------------------------------------------------------------------------------
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
            return self._emit(Admit(rid, params, now), out)
        lease_end = now + params.initial_term - self.config.max_delay
        r = _DReq(rid, params, lease_end)
        self.reqs[rid] = r
        peer.reqs[params.handle] = r
        if not self._read_fits(lease_end, now):
            guard = "lease_short"
        elif peer.state == PEER_READY:
            guard = "peer_ready"
        else:
            guard = "peer_unknown"
        self._step(r, ADMIT, guard, out)
        return self._emit(Admit(rid, params, now), out) if self.sink else out

    def handshake_result(self, engine: str, ok: bool, now: float,
                         reason: str = "handshake") -> list[DEffect]:
        """The handshake with ``engine`` finished (ok) or failed (``reason``)."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.setdefault(engine, _Peer())
        peer.state = PEER_READY if ok else PEER_UNKNOWN
        if ok:
            peer.last_heard = now
        for r in [r for r in peer.reqs.values() if r.state == HANDSHAKING]:
            if ok:
                self._step(r, HANDSHAKE_OK, "ok", out)
            else:
                self._step(r, HANDSHAKE_FAILED, "failed", out, reason=reason)
        return self._emit(HandshakeOk(engine, now) if ok else HandshakeFailed(engine, reason, now),
                          out)

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
            return self._emit(Schedule(rid, now), out)
        p = r.params
        guard = ""
        if p.group is not None:
            owner = self._group_owner.get((p.engine, p.group))
            if owner is not None and owner != rid and owner in self.reqs:
                # The owner's READ has not landed yet (if it fails, this member may
                # become the owner): not done, not read; the scheduler retries later.
                guard = "sibling_in_flight"
                self._count("sibling_in_flight")
            elif owner is not None and owner != rid:
                guard = "sibling_local"
        if not guard:
            guard = "lease_covers_read" if self._read_fits(r.lease_end, now) else "lease_short"
        self._step(r, SCHEDULE, guard, out)
        return self._emit(Schedule(rid, now), out) if self.sink else out

    def read_result(self, rid: str, ok: bool, now: float, *, fenced: bool = False,
                    notif_attached: bool = True) -> list[DEffect]:
        """The READ finished (``ok``), failed, or its generations changed (``fenced``).

        With ``notif_attached`` the adapter carried the done itself (e.g. as the READ's
        NIXL notification); otherwise the machine emits SendDone (the NIXL adapter
        batches those per P engine and step).
        """
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        landed = ok and not fenced
        r = self.reqs.get(rid)
        if r is None or r.state != READING:
            self._count("read_result_not_reading")
        elif landed:
            self._step(r, READ_OK, "abort_pending" if r.abort_pending else "ok", out,
                       notif_attached=notif_attached)
        else:
            # The READ is no longer in flight, so release is safe; P counts this
            # reader once even if the READ's own notification also arrives.
            self._step(r, READ_FAILED, "fenced" if fenced else "error", out)
        if self.sink is None:
            return out
        ev: DEvent = ReadOk(rid, now, notif_attached) if landed else ReadFailed(rid, now, fenced)
        return self._emit(ev, out)

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
        elif r.state == READING:
            self._step(r, D_ABORT, "in_flight", out)
        else:
            self._step(r, D_ABORT, "idle", out)
        return self._emit(DAbort(rid, now), out)

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
        ev = DAck(engine, seq, term, tuple(refused), now, tuple(pending))
        peer = self.peers.get(engine)
        if peer is not None and peer.state == PEER_READY:
            peer.last_heard = now
        sent = peer.outstanding.pop(seq, None) if peer is not None else None
        if peer is None or sent is None:
            self._count("ack_unknown")
            return self._emit(ev, out)
        refused_set = set(refused)
        pending_set = set(pending)
        lease_end = sent.sent_at + term - self.config.clock_drift
        for h in sent.handles:
            r = peer.reqs.get(h)
            if r is None or r.state not in (WAITING, READING) or h in pending_set:
                continue
            if h in refused_set:
                self._step(r, ACK, "refused", out)
            else:
                self._step(r, ACK, "granted", out, lease_end=lease_end)
        return self._emit(ev, out)

    def _lose_peer(self, peer: _Peer, out: list[DEffect]) -> None:
        peer.state = PEER_UNKNOWN
        peer.outstanding.clear()
        for r in list(peer.reqs.values()):
            if r.state == READING:
                self._step(r, PEER_LOST, "in_flight", out)
            elif r.state in (WAITING, HANDSHAKING):
                self._step(r, PEER_LOST, "lost", out)

    def peer_lost(self, engine: str, now: float) -> list[DEffect]:
        """P disconnected (or crashed): fail everything not in flight, promptly."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.get(engine)
        if peer is not None:
            self._lose_peer(peer, out)
        return self._emit(PeerLost(engine, now), out)

    def tick(self, now: float) -> list[DEffect]:
        """Heartbeat every request still to be pulled (queued ones too), per P engine;
        fail requests whose lease can no longer cover a READ; lose peers that left
        heartbeats unanswered for ``peer_timeout``."""
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
            self._step(r, D_TICK, "lease_lost", out)
        silent_before = now - cfg.peer_timeout
        for engine, peer in self.peers.items():
            # Silent: nothing heard for peer_timeout, and a heartbeat P had that long
            # to answer is still unanswered.
            if peer.state == PEER_READY and peer.outstanding \
                    and peer.last_heard < silent_before \
                    and next(iter(peer.outstanding.values())).sent_at < silent_before:
                self._count("peer_silent")
                self._lose_peer(peer, out)
                out.append(DropPeer(engine, f"no ack for {now - peer.last_heard:.3f}s"))
        if now >= self._next_hb:
            self._next_hb = now + cfg.heartbeat_interval
            cap = self.heartbeat_chunk or 1 << 30
            for engine, peer in self.peers.items():
                _prune_outstanding(peer, now - cfg.lease_extension)
                if peer.state != PEER_READY or not peer.reqs:
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
        return self._emit(DTick(now), out)


def mermaid(transitions: Sequence[Transition] = P_TRANSITIONS, *, title: str = "") -> str:
    """Render a transition table as a Mermaid state diagram (generated, never drawn)."""
    lines = ["stateDiagram-v2"]
    if title:
        lines.insert(0, f"%% {title}")
    seen: set[tuple[str, str, str]] = set()
    for t in transitions:
        if t.src == t.dst and t.free is None and not t.renew:
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
