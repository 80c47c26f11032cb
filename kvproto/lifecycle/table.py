"""The lifecycle vocabulary and both transition tables: state, event and free-reason names
(one name, one thing across the Python, the TLA+ spec and spec/PROTOCOL.md), ``Fx``
effects, ``Transition`` rows, and ``P_TABLE``/``D_TABLE`` built and checked from them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, NamedTuple

from kvproto.errors import UsageError

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
    with P), ``claim`` (present the handle's capability to P's gate and wait for its
    answer), ``read`` (own the sibling group, post the READ), ``renew`` (lease end :=
    max(lease end, heartbeat send time + term - drift)), ``abort_pending`` (remember a
    client abort until the READ ends), ``send_done`` (tell P done, unless the notification
    rode on the READ), ``send_release``, ``disown`` (give up the group's ownership),
    ``quarantine`` (the READ is overdue and still in flight: its local blocks stay out of
    the engine's hands until the transfer ends), ``finish`` (arg: the reason, empty = the
    event's own reason; the request leaves D).
    """

    kind: str
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


P_FX_KINDS: Final = frozenset({"hold", "free", "cascade", "stage", "renew", "refuse", "grace",
                               "count", "reject"})
D_FX_KINDS: Final = frozenset({"track", "handshake", "claim", "read", "renew", "abort_pending",
                               "send_done", "send_release", "disown", "quarantine", "finish"})


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
    claim: bool = field(init=False, default=False)
    read: bool = field(init=False, default=False)
    abort_pending: bool = field(init=False, default=False)
    send_done: bool = field(init=False, default=False)
    send_release: bool = field(init=False, default=False)
    disown: bool = field(init=False, default=False)
    quarantine: bool = field(init=False, default=False)
    # "dst:finish" (the machine's finished-counter key) when the row names the finish.
    finish_key: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for fx in self.effects:
            if fx.kind in seen or fx.kind not in _FX_FIELD:
                raise TableError(f"row {self.key}: bad or repeated effect {fx}")
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
                      "finish", "track", "handshake", "claim", "read", "abort_pending", "send_done",
                      "send_release", "disown", "quarantine")},
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


class TableError(UsageError, ValueError):
    """A transition table that no machine can run (a bad row)."""


class MissingRow(TableError, KeyError):
    """A table has no row for (state, event, guard): a machine met a case its table
    does not cover (a table that is not total, e.g. a hand-made variant), or a row to
    replace does not exist. The message names the machine, state, event and guard. A
    machine that raises it is left mid-step: discard it."""

    def __init__(self, machine: str, state: str, event: str, guard: str) -> None:
        super().__init__(f"no row in {machine}'s transition table for state {state!r}, "
                         f"event {event!r}, guard {guard!r}")
        self.machine = machine
        self.state = state
        self.event = event
        self.guard = guard

    __str__ = Exception.__str__  # the message as written, not KeyError's quoted repr


class _Rows(dict[TableKey, Transition]):
    """A table's rows: a lookup of a missing (state, event, guard) raises ``MissingRow``
    (``dict.__missing__``: the hit path costs what a plain dict costs)."""

    __slots__ = ("machine",)

    def __init__(self, machine: str) -> None:
        super().__init__()
        self.machine = machine

    def __missing__(self, key: TableKey) -> Transition:
        raise MissingRow(self.machine, *key)


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
    if row.read and row.src != WAITING:
        return "only a waiting request (its claim granted, or none needed) reads"
    if row.dst not in (WAITING, HANDSHAKING, CLAIMING, READING, D_DONE, D_FAILED):
        return f"{row.dst!r} is not a D state"
    return None


def make_table(rows: Iterable[Transition], *, machine: str = "P") -> Table:
    """A read-only table keyed by (src, event, guard) for machine "P" or "D". Rows must
    be unique and runnable (``TableError`` says which rule a row breaks)."""
    kinds, check = (P_FX_KINDS, _check_p_row) if machine == "P" else (D_FX_KINDS, _check_d_row)
    table = _Rows(machine)
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
    mutant's table: see ``Ledger.with_rows`` and ``kvproto.testing.mutants``)."""
    new = dict(table)
    machine = "D" if any(k[0] == D_NEW for k in new) else "P"
    for row in rows:
        if row.key not in new:
            raise MissingRow(machine, *row.key)
        new[row.key] = row
    return make_table(new.values(), machine=machine)


P_TABLE: Final[Table] = make_table(P_TRANSITIONS)

# ---------------------------------------------------------------------------
# The decode (D) side: one machine per (request, reader rank).
# ---------------------------------------------------------------------------

WAITING: Final = "waiting"  # admitted (maybe queued behind D's scheduler), P engine known
HANDSHAKING: Final = "handshaking"  # P engine not yet known: handshake in progress
CLAIMING: Final = "claiming"  # capability presented to P's gate: waiting for its grant
READING: Final = "reading"  # a READ is in flight
D_DONE: Final = "done"  # KV is local (pulled, or served from a sibling's prefix)
D_FAILED: Final = "failed"  # gave up: recompute locally; P was told (release) where possible
D_STATES: Final = (WAITING, HANDSHAKING, CLAIMING, READING, D_DONE, D_FAILED)

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
CLAIM_GRANTED: Final = "claim_granted"  # P's gate bound the handle to this consumer
CLAIM_REFUSED: Final = "claim_refused"  # P's gate refused the claim: recompute
NEVER: Final = "never"  # P will never register the handle (wire ``never``)
D_EVENTS: Final = (ADMIT, HANDSHAKE_OK, HANDSHAKE_FAILED, SCHEDULE, READ_OK, READ_FAILED,
                   D_ABORT, ACK, PEER_LOST, D_TICK, CLAIM_GRANTED, CLAIM_REFUSED, NEVER)

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
    _T(D_NEW, ADMIT, "claim", CLAIMING, _fx("track", "claim"), "P engine handshaken; the params carry a capability: present it, read only once P grants it"),
    _T(D_NEW, ADMIT, "lease_short", D_FAILED, _fx("send_release", "finish:lease_short"), "params arrived with too little lease left"),
    _T(HANDSHAKING, HANDSHAKE_OK, "ok", WAITING, "", "P known; heartbeats start"),
    _T(HANDSHAKING, HANDSHAKE_OK, "claim", CLAIMING, "claim", "P known; present the capability, read only once P grants it"),
    _T(CLAIMING, CLAIM_GRANTED, "granted", WAITING, "", "P's gate bound the handle to this consumer: it may read; heartbeats start"),
    _T(CLAIMING, CLAIM_REFUSED, "refused", D_FAILED, "finish:claim_refused", "P's gate refused the claim (another consumer owns the handle, a bad capability, the gate is full): recompute; no release (the handle is not this consumer's)"),
    _T(HANDSHAKING, HANDSHAKE_FAILED, "failed", D_FAILED, "finish", "handshake, version or layout mismatch: recompute"),
    _T(WAITING, SCHEDULE, "lease_covers_read", READING, "read", "own the group, post the READ with the done notification attached"),
    _T(WAITING, SCHEDULE, "lease_short", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_short"), "lease less max READ time and drift does not cover a READ"),
    _T(WAITING, SCHEDULE, "sibling_local", D_DONE, _fx("send_release", "finish:sibling_local"), "a sibling's KV landed: served from prefix, never pulled"),
    _T(WAITING, SCHEDULE, "sibling_in_flight", WAITING, "", "the group's READ is in flight: schedule again later"),
    _T(READING, READ_OK, "ok", D_DONE, _fx("send_done", "finish:pulled"), "data landed (and generations matched)"),
    _T(READING, READ_OK, "abort_pending", D_FAILED, _fx("send_done", "finish:aborted"), "aborted during the READ: P may free now; keeps the group (P heard done)"),
    _T(READING, READ_FAILED, "fenced", D_FAILED, _fx(*_RELEASE_FAIL, "finish:fenced"), "generation stamps changed, or a block's checksum failed: never served"),
    _T(READING, READ_FAILED, "error", D_FAILED, _fx(*_RELEASE_FAIL, "finish:transfer_error"), "transfer error; handle no longer in flight"),
    _T(WAITING, D_ABORT, "idle", D_FAILED, _fx(*_RELEASE_FAIL, "finish:aborted"), "client abort on D before the READ"),
    _T(HANDSHAKING, D_ABORT, "idle", D_FAILED, _fx(*_RELEASE_FAIL, "finish:aborted"), "client abort on D during the handshake"),
    _T(CLAIMING, D_ABORT, "idle", D_FAILED, _fx(*_RELEASE_FAIL, "finish:aborted"), "client abort on D while its claim is unanswered"),
    _T(READING, D_ABORT, "in_flight", READING, "abort_pending", "never release under an in-flight READ: wait for it"),
    _T(WAITING, ACK, "granted", WAITING, "renew", "lease end := heartbeat send time + granted term"),
    _T(READING, ACK, "granted", READING, "renew", "lease end := heartbeat send time + granted term"),
    _T(WAITING, ACK, "refused", D_FAILED, _fx(*_RELEASE_FAIL, "finish:revoked"), "P refused the renewal (aborted, expired or freed): release so an aborted request frees now"),
    _T(READING, ACK, "refused", READING, "", "the READ started under a valid lease; let it finish"),
    _T(WAITING, PEER_LOST, "lost", D_FAILED, "finish:peer_lost", "P disconnected or fell silent (peer_timeout)"),
    _T(HANDSHAKING, PEER_LOST, "lost", D_FAILED, "finish:peer_lost", "P disconnected or fell silent (peer_timeout)"),
    _T(CLAIMING, PEER_LOST, "lost", D_FAILED, "finish:peer_lost", "P disconnected or fell silent (peer_timeout)"),
    _T(READING, PEER_LOST, "in_flight", READING, "", "the READ will report its own failure"),
    _T(WAITING, D_TICK, "lease_lost", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_lost"), "lease can no longer cover a READ and no renewal came"),
    _T(HANDSHAKING, D_TICK, "lease_lost", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_lost"), "lease can no longer cover a READ and no renewal came"),
    _T(CLAIMING, D_TICK, "lease_lost", D_FAILED, _fx(*_RELEASE_FAIL, "finish:lease_lost"), "no grant came while the initial lease could cover a READ (heartbeats start at the grant)"),
    *(_T(s, NEVER, "idle", D_FAILED, "finish:never_registered", "P will never register the handle (its prefill aborted or failed): recompute now; no release (nothing to free)")
      for s in (WAITING, HANDSHAKING, CLAIMING)),
    _T(READING, NEVER, "in_flight", READING, "", "the READ reports its own end (the stamps fence blocks P never registered)"),
    _T(READING, D_TICK, "read_overdue", D_FAILED, _fx("disown", "quarantine", "finish:read_timeout"), "READ in flight past max_read_time + read_grace: fail it, quarantine its local blocks until the transfer ends; no release (the READ may still touch P's blocks)"),
)

D_TABLE: Final[Table] = make_table(D_TRANSITIONS, machine="D")


# ---------------------------------------------------------------------------
