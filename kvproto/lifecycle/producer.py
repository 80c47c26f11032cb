"""P's machine: the ledger's events and effects, and ``Ledger``, which runs ``P_TABLE``.
"""

from __future__ import annotations

import copy
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from kvproto.errors import UsageError
from kvproto.lifecycle.config import (
    Config,
)
from kvproto.lifecycle.hotpath import FreeFields, register_free
from kvproto.lifecycle.ledgerbatch import done_batch, register_batch
from kvproto.lifecycle.ledgerrecords import _add_reader, _Req, _Staged
from kvproto.lifecycle.ledgerviews import (
    HEAP_HANDLE_MASK,
    HEAP_SHIFT,
    LedgerViews,
)
from kvproto.lifecycle.pool import (
    BlockPool,
)
from kvproto.lifecycle.table import (
    ABORT,
    ABORTED,
    DONE,
    EXPIRED,
    FREE_REASONS,
    HEARTBEAT,
    HELD_STATES,
    NOTIFIED,
    P_TABLE,
    REGISTER,
    REGISTERED,
    RELEASE,
    SIBLING,
    TICK,
    UNREGISTERED,
    Fx,
    Table,
    Transition,
    with_rows,
)

# ---------------------------------------------------------------------------
# Events (inputs) and effects (outputs) of the producer ledger.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    handle: int
    request_id: str
    blocks: tuple[int, ...]
    now: int
    group: str | None = None
    expected: int = 0  # expected readers; 0 = not known yet (announced by D)


@dataclass(frozen=True, slots=True)
class Done:
    reader: str
    handle: int
    expected: int
    now: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    reader: str
    seq: int
    handles: tuple[int, ...]
    expected: int
    now: int


@dataclass(frozen=True, slots=True)
class Release:
    reader: str
    handles: tuple[int, ...]
    expected: int
    now: int


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class Tick:
    now: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Bad input rejected by the adapter before it became an event (malformed bytes,
    unknown peer, oversized message...). Journaled and counted, changes nothing."""

    reason: str
    peer: str
    detail: str
    now: int


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
    deadline: int  # the lease deadline at the time of the free (ms)


@dataclass(frozen=True, slots=True)
class Ack:
    """Effect: answer a heartbeat. Every handle of the batch in neither ``refused`` nor
    ``pending`` was renewed to at least receive-time + ``term``. ``pending`` handles are
    not registered yet (staged): D must keep its previous lease estimate for them."""

    reader: str
    seq: int
    term: int  # milliseconds
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
register_free(Free)  # new_free builds Free: same slots, same order


MAX_STAGED_MSGS_PER_HANDLE: Final = 64
# The deadline entries are rebuilt from the live requests once there are more than twice
# as many as there are live requests (dead entries of requests freed outside a tick, and
# the early entries aborts push) and more than HEAP_SLACK: there are never more than
# max(2 * live, HEAP_SLACK) entries.
HEAP_SLACK: Final = 64
# A machine's clock before its first event: below any time an adapter reads (times are
# integer milliseconds; the hot paths' one check is ``type(now) is int and self.now <= now``).
CLOCK_START: Final = -(1 << 63)


# ---------------------------------------------------------------------------
# The producer ledger.
# ---------------------------------------------------------------------------


# The guard outcomes of a reader's done or release, in the order ``Ledger._FIN`` lists
# their rows.
FIN_GUARDS: Final = ("more_readers", "all_done", "all_finished", "duplicate_reader")
FIN_PLAIN: Final = 0  # a row without effects: only its destination
FIN_FREE: Final = 1  # a row whose effects are free (and maybe cascade): ``_free`` runs it
FIN_GENERIC: Final = 2  # any other row: ``_apply`` runs it
# Looked up in TABLE when met: a row the table lacks (the lookup raises MissingRow), or
# every row of a class with LOOKUP_ROWS (a table wrapper then sees each lookup).
FIN_LOOKUP: Final = 3
Planned = tuple[Transition, int]


def _plan(row: Transition | None, lookup: bool) -> Planned:
    """``row`` and how the hot path runs it (the same effects ``_apply`` would run)."""
    if row is None or lookup:
        return (P_TABLE[(REGISTERED, DONE, "more_readers")], FIN_LOOKUP)  # a stand-in row
    if not row.effects:
        return (row, FIN_PLAIN)
    if row.free is not None and {fx.kind for fx in row.effects} <= {"free", "cascade"}:
        return (row, FIN_FREE)
    return (row, FIN_GENERIC)


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


# The fields Ledger.__init__ sets. ``Ledger.clone`` copies each mutable one by hand and
# shares the others (config, sink, numbers); any other field (a subclass's) is deep-copied.
_LEDGER_SHARED: Final = frozenset({
    "config", "pool", "sink", "_live", "_by_rid", "_group_of", "_released",
    "_pending_group", "_heap", "_due", "_due_at", "_due_pos", "_entries",
    "_last_dl", "_staged", "_tomb", "_tomb_order", "_max_tomb",
    "_groups", "_groups_done", "_next_handle", "now", "counters", "frees", "max_staged_msgs"})


class Ledger(LedgerViews):
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
    sibling-group memory ``max_groups_remembered``, deadline entries max(2 * held,
    ``HEAP_SLACK``); at each cap the oldest entry is dropped and counted.

    Time: integer milliseconds. A ``now`` that is not an int (a float, NaN, inf) is
    refused (a ``Rejected("bad_time")`` effect, counted, nothing changes); a ``now``
    before the ledger's clock is clamped to it (counted
    ``clock_regression``): the event is real, and applying it later than it happened is
    the same as a slower delivery, which never frees anything early.

    Documented hooks (overridden by ``kvproto.testing.mutants`` to re-introduce known bugs):
    ``tally`` (how a reader's report counts) and ``sweep`` (which requests a tick finds
    due; it frees them with ``expire``). Copies: ``clone``.
    """

    TABLE: ClassVar[Table] = P_TABLE
    _ROWS: ClassVar[tuple[Transition, ...]] = ()  # rows replaced by with_rows (pickling)
    # True: done and release look each row up in TABLE when it runs instead of reading
    # it from the rows derived at class creation (slower; for a TABLE wrapper that
    # records which rows run, e.g. the row-coverage tests).
    LOOKUP_ROWS: ClassVar[bool] = False
    # state -> destination, for heartbeat rows that only renew (the hot path), and
    # state -> row for the others; derived from TABLE per class.
    _HB_FAST: ClassVar[dict[str, str]]
    _HB_ROW: ClassVar[dict[str, Transition]]
    # True when the class keeps Ledger.tally (the hook's body then runs inline).
    _OWN_TALLY: ClassVar[bool]
    # (event, state) -> the done/release rows of that held state, indexed by guard outcome
    # (FIN_GUARDS), each with how it runs (FIN_PLAIN ... FIN_LOOKUP); derived
    # from TABLE per class, so the hot path runs the table's rows without building a key.
    _FIN: ClassVar[dict[tuple[str, str], tuple[Planned, ...]]]
    _DONE_FIN: ClassVar[dict[str, tuple[Planned, ...]]]  # _FIN of DONE, by state
    _EXPIRY: ClassVar[dict[str, Planned]]  # state -> its (tick, deadline_passed) row, planned

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._derive()

    @classmethod
    def _derive(cls) -> None:
        t = cls.TABLE
        rows = {s: t[(s, HEARTBEAT, "refuse" if s == ABORTED else "renew")] for s in HELD_STATES}
        cls._HB_ROW = rows
        cls._HB_FAST = {s: r.dst for s, r in rows.items() if r.effects == (Fx("renew"),)}
        cls._OWN_TALLY = cls.tally is Ledger.tally
        cls._FIN = {(ev, s): tuple(_plan(t.get((s, ev, g)), cls.LOOKUP_ROWS)
                                     for g in FIN_GUARDS)
                    for ev in (DONE, RELEASE) for s in HELD_STATES}
        cls._DONE_FIN = {s: cls._FIN[(DONE, s)] for s in HELD_STATES}
        cls._EXPIRY = {s: _plan(t.get((s, TICK, "deadline_passed")), cls.LOOKUP_ROWS)
                       for s in HELD_STATES}

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
        # Invariant: exactly the held requests (state in HELD_STATES), by handle; a handle
        # is never both here and in _tomb. Size: the requests the engine keeps held; each
        # leaves at the latest at its deadline.
        self._live: dict[int, _Req] = {}
        # Invariant: _by_rid[r.rid] == h whenever _live[h] is r (one live holder per
        # request id); an entry whose handle is not live names the tombstone of that
        # request id's latest free (a free leaves the entry in place, so it costs no index
        # write). Size: at most len(_live) + len(_tomb): an entry leaves with its tombstone.
        self._by_rid: dict[str, int] = {}
        # Invariant: handle -> its sibling group, exactly for the held requests registered
        # with one (h is in _groups[g] exactly when _group_of[h] == g). Size: <= len(_live).
        self._group_of: dict[int, str] = {}
        # Invariant: the held requests some reader released (never pulled). Size:
        # <= len(_live).
        self._released: set[int] = set()
        self._pending_group: str | None = None  # the group of the request being registered
        # Deadline entries, bucketed by deadline: _due[t] lists handles (in push order)
        # whose entry is at time t (a bucket of one handle is the handle itself until a
        # second one joins it or a tick reaches it: 64 bytes less per lone request), and
        # _heap is a min-heap of the bucket times (each time once, exactly the keys of
        # _due). The head bucket's first _due_pos entries are already processed when
        # _due_at names its time (a tick that ran out of its budget inside it). Requests
        # registered or renewed in the same millisecond share one bucket, so an entry
        # costs one list slot.
        # Invariant: every held request has an entry at its deadline or earlier (renewals
        # leave it early, tick re-inserts it); entries of freed requests are dropped
        # lazily. Cap: the entries (_entries counts the unprocessed ones) are rebuilt from
        # _live once above max(2 * held, HEAP_SLACK).
        self._heap: list[int] = []
        self._due: dict[int, list[int] | int] = {}
        self._due_at: int | None = None
        self._due_pos = 0
        self._entries = 0
        # The deadline of the latest register: a register in the same millisecond shares
        # its int object (8 bytes per held request instead of an int of its own).
        self._last_dl = CLOCK_START
        # Invariant: handles neither live nor tombstoned when their first message came
        # (messages before register), oldest first; each holds at most max_staged_msgs
        # messages and leaves on register or after max_staged_age. Cap: config.max_staged
        # handles (the oldest dropped, counted staged_dropped).
        self._staged: OrderedDict[int, _Staged] = OrderedDict()
        # handle -> the freed request's record (its terminal state and request id; never
        # changed after the free)
        # Invariant: freed handles, none live; _tomb_order holds the same handles, oldest
        # first (entries leave only by eviction, so the two stay equal). Cap:
        # config.max_tombstones (the oldest evicted, counted tombstone_evicted).
        self._tomb: dict[int, _Req] = {}
        self._tomb_order: deque[int] = deque()
        self._max_tomb = self.config.max_tombstones
        # Invariant: group -> its live members, never an empty set; every member is in
        # _live. Size: at most len(_live) groups.
        self._groups: dict[str, set[int]] = {}  # live members per sibling group
        # Invariant: groups one member of which was transferred, oldest first (a member
        # registered later is freed at once). Cap: config.max_groups_remembered (the
        # oldest evicted, counted group_memory_evicted).
        self._groups_done: OrderedDict[str, None] = OrderedDict()  # transferred groups
        # Invariant: above every handle registered or minted here (new_handle never
        # returns one twice).
        self._next_handle = 1
        self.now = CLOCK_START
        # Invariant: keys from fixed vocabularies (the rows' counters, rejection reasons,
        # the cap counters), so both stay small. frees: one key per FREE_REASONS entry.
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

    def clone(self) -> Ledger:
        """A deep, independent copy (its own pool, requests, heap, staging, tombstones
        and counters), for searches that branch from one state (conformance BFS, trace
        segments). Shared: ``config`` (frozen) and ``sink`` (a callable). Fields a subclass
        adds are deep-copied. O(held + staged + tombstones + pool capacity)."""
        n = object.__new__(type(self))
        mine = self.__dict__
        d = n.__dict__
        for k, v in mine.items():
            d[k] = v if k in _LEDGER_SHARED else copy.deepcopy(v)  # a subclass's own fields
        n.pool = self.pool.clone()
        n._live = {h: r.copy() for h, r in self._live.items()}
        n._by_rid = dict(self._by_rid)
        n._group_of = dict(self._group_of)
        n._released = set(self._released)
        n._heap = list(self._heap)
        n._due = {t: b if isinstance(b, int) else list(b) for t, b in self._due.items()}
        n._staged = OrderedDict((h, st.copy()) for h, st in self._staged.items())
        n._tomb = {h: r.copy() for h, r in self._tomb.items()}
        n._tomb_order = deque(self._tomb_order)
        n._groups = {g: set(m) for g, m in self._groups.items()}
        n._groups_done = OrderedDict(self._groups_done)
        n.counters = dict(self.counters)
        n.frees = dict(self.frees)
        return n

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

    def _clock(self, now: int) -> int | None:
        """The event's time: ``now``, or the ledger's clock when ``now`` is before it
        (clamped, counted); None when ``now`` is not an int (refused)."""
        if type(now) is int and self.now <= now:
            self.now = now
            return now
        if type(now) is not int:
            return None
        # Time never runs backwards inside the machine: a stale clock reading is clamped.
        self._count("clock_regression")
        return self.now

    def _bad_time(self, event: str, now: int) -> list[Effect]:
        """Refuse an event whose time is not an int: counted, journaled as a rejection at
        the ledger's own clock, nothing else changes."""
        t = self.now if self.now != CLOCK_START else 0
        return self.reject("bad_time", "", f"{event} at time {now!r}", t)

    def _maybe_compact(self) -> None:
        """Rebuild the deadline entries once dead entries outnumber live ones (amortized
        O(1) per free: a rebuild costs O(held) and follows at least max(held, HEAP_SLACK)
        frees or aborts since the last one)."""
        n = self._entries
        live = self._live
        if n > 2 * len(live) and n > HEAP_SLACK:
            due: dict[int, list[int] | int] = {}
            for h, r in live.items():
                b = due.get(r.deadline)
                if b is None:
                    due[r.deadline] = h
                elif isinstance(b, int):
                    due[r.deadline] = [b, h]
                else:
                    b.append(h)
            self._due = due
            self._heap[:] = due
            heapq.heapify(self._heap)
            self._due_at = None
            self._due_pos = 0
            self._entries = len(live)
            self._count("heap_rebuilt")

    def _push(self, deadline: int, handle: int) -> None:
        """A deadline entry for ``handle`` at ``deadline``. O(1), O(log buckets) for a
        new bucket."""
        due = self._due
        b = due.get(deadline)
        if b is None:
            due[deadline] = handle  # a bucket of one
            heapq.heappush(self._heap, deadline)
        elif isinstance(b, int):
            due[deadline] = [b, handle]
        else:
            b.append(handle)
        self._entries += 1

    def _emit(self, ev: Event, out: list[Effect]) -> list[Effect]:
        if self.sink is not None:
            self.sink(ev, out)
        return out

    def _step(self, h: int, r: _Req, event: str, guard: str, now: int,
              out: list[Effect]) -> Transition:
        """Run the row (r.state, event, guard) on held (or registering) request ``r``:
        its effects in order, then its destination. Effects that only shape the reply
        (``refuse``, ``stage``, ``reject``) are read from the returned row by the caller."""
        row = self.TABLE[(r.state, event, guard)]
        self._apply(h, r, row, now, out)
        return row

    def _apply(self, h: int, r: _Req, row: Transition, now: int, out: list[Effect]) -> None:
        """Run ``row`` (a row of ``TABLE`` whose source is r's state) on ``r`` (handle
        ``h``): the body of ``_step`` after its lookup."""
        if row.counter is not None:
            c = self.counters
            c[row.counter] = c.get(row.counter, 0) + 1
        if row.hold:
            self._hold(h, r)
        if row.grace:
            dl = now + self.config.ms.abort_grace
            if dl < r.deadline:  # only when abort_grace is below the lease horizon
                r.deadline = dl
                self._push(dl, h)
        if row.renew:
            dl = now + self.config.ms.lease_extension
            if dl > r.deadline:
                r.deadline = dl  # the heap entry is now early; tick re-inserts it lazily
        if row.free is not None:
            group = self._group_of.get(h) if row.cascade else None
            self._free(h, r, row, out)
            if group is not None:
                self._group_transferred(group, out)
        else:
            r.state = row.dst

    def _step_absent(self, state: str, event: str, guard: str, reader: str, handle: int,
                     expected: int, now: int) -> Transition:
        """Run the row for a message about a request that is not held (unregistered,
        expired or freed): count it, or stage it."""
        row = self.TABLE[(state, event, guard)]
        if row.counter is not None:
            self._count(row.counter)
        if row.stage:
            self._stage(event, reader, handle, expected, now)
        return row

    def _hold(self, h: int, r: _Req) -> None:
        self.pool._hold(r.blocks)
        self._live[h] = r
        self._by_rid[r.rid] = h
        group = self._pending_group
        if group is not None:
            self._group_of[h] = group
            self._groups.setdefault(group, set()).add(h)
        self._push(r.deadline, h)

    def _free(self, h: int, r: _Req, row: Transition, out: list[Effect]) -> None:
        """The only place blocks are freed. Moves ``r`` (handle ``h``) to its terminal
        state."""
        reason = row.free
        assert reason is not None
        rid = r.rid
        r.state = row.dst
        del self._live[h]  # _by_rid[rid] stays h: it now names the tombstone
        if self._group_of:
            group = self._group_of.pop(h, None)
            members = self._groups.get(group) if group is not None else None
            if members is not None:
                members.discard(h)
                if not members:
                    del self._groups[group]  # type: ignore[arg-type]
        if self._released:
            self._released.discard(h)
        self._tomb[h] = r
        order = self._tomb_order
        order.append(h)
        if len(order) > self._max_tomb:
            self._evict_tomb()
        blocks = r.blocks
        reclaimed = self.pool._drop(blocks)
        frees = self.frees
        frees[reason] = frees.get(reason, 0) + 1
        fx: Any = FreeFields(h, rid, reason, blocks, reclaimed, r.deadline)
        fx.__class__ = Free  # an ordinary frozen Free, built fast (hotpath.register_free)
        out.append(fx)

    def _evict_tomb(self) -> None:
        """Drop the oldest tombstone (tombstones above ``max_tombstones``), and its request
        id's index entry unless that names a later holder."""
        old = self._tomb_order.popleft()
        old_rid = self._tomb.pop(old).rid
        self._count("tombstone_evicted")
        by_rid = self._by_rid
        if by_rid.get(old_rid) == old:
            del by_rid[old_rid]

    def _stage(self, kind: str, reader: str, handle: int, expected: int, now: int) -> None:
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
    def tally(self, handle: int, event: str, reader: str) -> int:
        """Hook: ``reader`` finished the held request ``handle`` (done or release).
        Return how many readers count as finished now, or -1 when this reader had
        already finished."""
        n = _add_reader(self._live[handle], reader)
        if event == RELEASE and n > 0:
            self._released.add(handle)
        return n

    def sweep(self, now: int, out: list[Effect]) -> None:
        """Hook: run TICK/deadline_passed for every held request whose deadline is <=
        ``now``. Called by ``tick`` only when the earliest deadline bucket is due."""
        heap = self._heap
        live = self._live
        budget = self.config.max_tick_work
        expiry = self._EXPIRY
        while heap and heap[0] <= now:
            t = heap[0]
            bucket = self._due[t]
            if isinstance(bucket, int):
                bucket = self._due[t] = [bucket]
            b = bucket
            pos = self._due_pos if self._due_at == t else 0
            while pos < len(b):  # the bucket may grow (an entry pushed at time t)
                if budget <= 0:
                    # The rest carries over: next_deadline() reports a time already past.
                    self._due_at = t
                    self._due_pos = pos
                    self._count("tick_budget_exhausted")
                    return
                budget -= 1
                h = b[pos]
                pos += 1
                self._entries -= 1
                r = live.get(h)
                if r is None:
                    continue  # freed already: drop the stale entry
                if r.deadline > now:
                    self._push(r.deadline, h)  # renewed: re-insert lazily
                    continue
                row, plan = expiry[r.state]
                if plan == FIN_FREE:
                    group = self._group_of.get(h) if row.cascade and self._group_of else None
                    self._free(h, r, row, out)
                    if group is not None:
                        self._group_transferred(group, out)
                else:
                    self._fin_other(h, r, TICK, "deadline_passed", row, plan, now, out)
            heapq.heappop(heap)
            del self._due[t]
            self._due_at = None
            self._due_pos = 0

    def expire(self, handle: int, now: int, out: list[Effect]) -> None:
        """Run TICK/deadline_passed for the held request ``handle`` (for ``sweep``
        overrides); ``UsageError`` when ``handle`` is not held."""
        r = self._live.get(handle)
        if r is None:
            raise UsageError(f"expire: handle {handle} is not held")
        self._step(handle, r, TICK, "deadline_passed", now, out)

    # -- the machine's internal events ----------------------------------------------------
    def _finish(self, h: int, r: _Req, event: str, reader: str, expected: int, now: int,
                out: list[Effect]) -> None:
        """A reader finished (done or release). Mirrors TLA+ Done / Release."""
        if expected != r.expected:
            self._announce(r, expected)
        if self._OWN_TALLY:
            n = _add_reader(r, reader)  # Ledger.tally's body
            if event == RELEASE and n > 0:
                self._released.add(h)
        else:
            n = self.tally(h, event, reader)
        # The guard, as an index into FIN_GUARDS: duplicate_reader, all_finished,
        # all_done, more_readers.
        g = 3 if n < 0 else (2 if h in self._released else 1) \
            if r.expected and n >= r.expected else 0
        row, plan = self._FIN[(event, r.state)][g]
        if plan == FIN_PLAIN:
            r.state = row.dst  # all that a row without effects does (``_apply``)
        elif plan == FIN_FREE:
            group = self._group_of.get(h) if row.cascade and self._group_of else None
            self._free(h, r, row, out)
            if group is not None:
                self._group_transferred(group, out)
        else:
            self._fin_other(h, r, event, FIN_GUARDS[g], row, plan, now, out)

    def _fin_other(self, h: int, r: _Req, event: str, guard: str, row: Transition, plan: int,
                   now: int, out: list[Effect]) -> None:
        """A done/release row the hot path does not inline: ``_apply`` runs it. A
        ``FIN_LOOKUP`` row is looked up in TABLE first (a row the table lacks raises
        ``MissingRow``: a table that is not total)."""
        if plan == FIN_LOOKUP:
            row = self.TABLE[(r.state, event, guard)]  # raises MissingRow
        self._apply(h, r, row, now, out)

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
            self._step(h, r, SIBLING, guard, self.now, out)

    def _not_live(self, event: str, reader: str, handle: int, expected: int,
                  now: int) -> Transition:
        t = self._tomb.get(handle)
        if t is None:
            return self._step_absent(UNREGISTERED, event, "early", reader, handle, expected, now)
        st = t.state
        return self._step_absent(st, event, "late" if st == EXPIRED else "stale", reader,
                                 handle, expected, now)

    # -- events ------------------------------------------------------------------------
    def register(self, handle: int, request_id: str, blocks: Iterable[int], now: int, *,
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
        elif handle > HEAP_HANDLE_MASK:
            err = f"handle must be below 2**{HEAP_SHIFT} (the wire's range), got {handle!r}"
        elif not isinstance(expected, int) or not 0 <= expected <= 0xFFFF:
            err = f"expected readers must be within [0, 65535], got {expected!r}"
        elif not blocks:  # nothing to pull: D refuses such params, its coverage fails them
            err = "a request must hold at least one block"
        else:
            err = self.pool.check_blocks(blocks)
        if err is not None:
            self._count("invalid_register")
            out.append(Rejected("invalid_register", "", handle if isinstance(handle, int) else None, err))
            return self._emit(ev, out)
        holder = self._live.get(self._by_rid.get(request_id, -1))
        if handle in self._live or handle in self._tomb or holder is not None:
            st = self.state(handle)
            if st == UNREGISTERED and holder is not None:
                st = holder.state  # request id reused while its first holder is live
            row = self._step_absent(st, REGISTER, "duplicate", "", handle, expected, now)
            if row.reject is not None:
                out.append(Rejected(row.reject, "", handle,
                                    f"handle {handle} / request id {request_id!r} already known ({st})"))
            return self._emit(ev, out)
        if handle >= self._next_handle:
            self._next_handle = handle + 1
        dl = now + self.config.ms.initial_lease
        if dl == self._last_dl:
            dl = self._last_dl  # one int object per millisecond of registrations
        else:
            self._last_dl = dl
        r = _Req(request_id, blocks, dl, expected)
        guard = "group_transferred" if group is not None and group in self._groups_done \
            else "fresh"
        self._pending_group = group  # the sibling group _hold files the request under
        try:
            self._step(handle, r, REGISTER, guard, now, out)
        finally:
            self._pending_group = None
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
                    self._step(handle, r, HEARTBEAT, "refuse" if r.state == ABORTED else "renew",
                               t, out)
                else:
                    self._finish(handle, r, kind, reader, exp, now, out)
            if out:
                self._maybe_compact()
        return self._emit(ev, out)

    def done(self, reader: str, handle: int, expected: int, now: int) -> list[Effect]:
        """One reader's READ completed. Mirrors TLA+ ``Done``."""
        if type(now) is int and self.now <= now:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return self._bad_time(DONE, now)
            now = clk
        out: list[Effect] = []
        r = self._live.get(handle)
        if r is None:
            self._not_live(DONE, reader, handle, expected, now)
        elif expected == r.expected and self._OWN_TALLY:
            # _finish's body, inline (_add_reader, the same guard, the same rows of _FIN).
            fin = r.finished
            if fin is None:
                r.finished = reader
                n = 1
            elif isinstance(fin, str):
                if fin == reader:
                    n = -1
                else:
                    r.finished = {fin, reader}
                    n = 2
            elif reader in fin:
                n = -1
            else:
                fin.add(reader)
                n = len(fin)
            g = 3 if n < 0 else (2 if self._released and handle in self._released else 1) \
                if expected and n >= expected else 0
            row, plan = self._DONE_FIN[r.state][g]
            if plan == FIN_PLAIN:
                r.state = row.dst
            elif plan == FIN_FREE:
                group = self._group_of.get(handle) if row.cascade and self._group_of else None
                self._free(handle, r, row, out)
                if group is not None:
                    self._group_transferred(group, out)
                if self._entries > 2 * len(self._live):
                    self._maybe_compact()
            else:
                self._fin_other(handle, r, DONE, FIN_GUARDS[g], row, plan, now, out)
                if out and self._entries > 2 * len(self._live):
                    self._maybe_compact()
        else:
            self._finish(handle, r, DONE, reader, expected, now, out)
            if out and self._entries > 2 * len(self._live):
                self._maybe_compact()
        return self._emit(Done(reader, handle, expected, now), out) if self.sink else out

    def done_batch(self, reader: str, handles: Sequence[int], expected: int, now: int,
                   marks: list[int] | None = None) -> list[Effect]:
        """A done batch (one wire message): exactly ``done`` per handle, in order, in one
        call (``kvproto.lifecycle.ledgerbatch``: what it amortizes)."""
        return done_batch(self, reader, handles, expected, now, marks)

    def release(self, reader: str, handles: Sequence[int], expected: int,
                now: int) -> list[Effect]:
        """A reader will never pull these requests. Mirrors TLA+ ``Release``."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(RELEASE, now)
        now = clk
        out: list[Effect] = []
        for h in handles:
            r = self._live.get(h)
            if r is not None:
                self._finish(h, r, RELEASE, reader, expected, now, out)
            else:
                self._not_live(RELEASE, reader, h, expected, now)
        if out:
            self._maybe_compact()
        return self._emit(Release(reader, tuple(handles), expected, now), out) if self.sink else out

    def heartbeat(self, reader: str, seq: int, handles: Sequence[int], expected: int,
                  now: int) -> list[Effect]:
        """Renew the leases of a batch. Mirrors TLA+ ``Heartbeat``. O(1) per handle.

        Per handle, the row's effects decide the ack: ``refuse`` refuses it, else
        ``renew`` grants it, else (staged: not registered yet) it is listed as pending."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(HEARTBEAT, now)
        now = clk
        ext = self.config.ms.lease_extension
        ext_dl = now + ext
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
                self._step(h, r, HEARTBEAT, row.guard, now, [])
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
        out: list[Effect] = [Ack(reader, seq, ext,
                                 tuple(refused) if refused else (),
                                 tuple(pending) if pending else ())]
        return self._emit(Heartbeat(reader, seq, tuple(handles), expected, now), out) \
            if self.sink else out

    def abort(self, request_id: str, now: int) -> list[Effect]:
        """Client or router abort on P. Mirrors TLA+ ``Abort``. Never frees at once."""
        clk = self._clock(now)
        if clk is None:
            return self._bad_time(ABORT, now)
        now = clk
        out: list[Effect] = []
        h = self._by_rid.get(request_id)
        r = self._live.get(h) if h is not None else None
        if h is None or r is None:
            t = self._tomb.get(h) if h is not None else None
            if t is not None:
                self._step_absent(t.state, ABORT, "stale", "", -1, 0, now)
            else:
                self._step_absent(UNREGISTERED, ABORT, "unknown", "", -1, 0, now)
            return self._emit(Abort(request_id, now), out)
        self._step(h, r, ABORT, "again" if r.state == ABORTED else "hold", now, out)
        self._maybe_compact()
        return self._emit(Abort(request_id, now), out)

    def tick(self, now: int) -> list[Effect]:
        """Time passes. Mirrors TLA+ ``Tick``. O(1) when nothing is due.

        Processes at most ``config.max_tick_work`` due deadline entries (expiries, dead
        entries, lazy re-inserts), earliest deadline first; the rest stays due and
        ``next_deadline()`` reports it (a time already past). Staging entries past
        ``max_staged_age`` are always dropped (at most ``max_staged``, O(1) each).
        Mirrors the spec's Tick with some due requests left for later (``ExpiryMayLag``):
        an expiry may be late, never early."""
        if type(now) is int and self.now <= now:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return self._bad_time(TICK, now)
            now = clk
        out: list[Effect] = []
        heap = self._heap
        if heap and heap[0] <= now:
            self.sweep(now, out)
        staged = self._staged
        if staged:
            limit = now - self.config.ms.max_staged_age
            while staged:  # never late: at most max_staged entries, O(1) each
                st = next(iter(staged.values()))
                if st.since > limit:
                    break
                staged.popitem(last=False)
                self._count("staged_expired")
        if self.sink is not None:
            self.sink(Tick(now), out)
        return out

    def reject(self, reason: str, peer: str, detail: str, now: int) -> list[Effect]:
        """Record an adapter-level rejection (malformed bytes, unknown peer...). A
        ``now`` that is not an int is recorded at the ledger's clock (0 before any event)."""
        clk = self._clock(now)
        now = clk if clk is not None else (self.now if self.now != CLOCK_START else 0)
        self._count("rejected:" + reason)
        return self._emit(Reject(reason, peer, detail, now), [Rejected(reason, peer, None, detail)])


Ledger._derive()
register_batch(Ledger, Free, Done, FIN_PLAIN, FIN_FREE, FIN_GUARDS)


# ---------------------------------------------------------------------------
# The decode side.
# ---------------------------------------------------------------------------
