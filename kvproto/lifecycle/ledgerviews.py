"""Read-only views of P's ``Ledger``: queries, snapshots and the invariant check.

``LedgerViews`` is a base class of ``kvproto.lifecycle.producer.Ledger``: code outside
the lifecycle reads the ledger only through these methods. None of them changes the
machine. O(1) unless stated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Final, NamedTuple, Protocol

from kvproto.lifecycle.config import Config
from kvproto.lifecycle.pool import BlockPool
from kvproto.lifecycle.table import HELD_STATES, UNREGISTERED


def readers(finished: str | set[str] | None) -> frozenset[str]:
    """The readers a held request's ``finished`` field names (None, one name, or a set)."""
    if finished is None:
        return frozenset()
    return frozenset((finished,)) if isinstance(finished, str) else frozenset(finished)


class _Held(Protocol):
    """What the views read of a held request (``ledgerrecords._Req``)."""

    rid: str
    state: str
    blocks: tuple[int, ...]
    deadline: int
    expected: int
    finished: str | set[str] | None


class _Early(Protocol):
    """What the views read of a staged handle (``ledgerrecords._Staged``)."""

    since: int
    msgs: list[tuple[str, str, int, int]]

# Handles are below 2**HEAP_SHIFT, as on the wire (``Ledger.register`` refuses others).
HEAP_SHIFT: Final = 64
HEAP_HANDLE_MASK: Final = (1 << HEAP_SHIFT) - 1


class HeldView(NamedTuple):
    """A read-only view of one held request (``Ledger.held``)."""

    handle: int
    request_id: str
    state: str
    blocks: tuple[int, ...]
    deadline: int
    group: str | None
    expected: int
    finished: frozenset[str]
    released: bool


class StagedView(NamedTuple):
    """A read-only view of one staged handle (``Ledger.staged``): messages that arrived
    before register, as (kind, reader, expected, arrival time), oldest first."""

    handle: int
    since: int
    msgs: tuple[tuple[str, str, int, int], ...]


class LedgerViews:
    """The read-only half of ``Ledger`` (its fields are documented in ``Ledger.__init__``)."""

    config: Config
    pool: BlockPool
    _live: Mapping[int, _Held]
    _by_rid: dict[str, int]
    _group_of: dict[int, str]
    _released: set[int]
    _heap: list[int]
    _due: dict[int, list[int] | int]
    _due_at: int | None
    _due_pos: int
    _entries: int
    _staged: Mapping[int, _Early]
    _tomb: Mapping[int, _Held]
    _groups_done: OrderedDict[str, None]

    def state(self, handle: int) -> str:
        r = self._live.get(handle)
        if r is not None:
            return r.state
        t = self._tomb.get(handle)
        return t.state if t is not None else UNREGISTERED

    def deadline(self, handle: int) -> int | None:
        r = self._live.get(handle)
        return None if r is None else r.deadline

    def handle_of(self, request_id: str) -> int | None:
        """The live handle holding ``request_id``; None when none holds it."""
        h = self._by_rid.get(request_id)
        return h if h is not None and h in self._live else None

    def held(self, handle: int) -> HeldView | None:
        """The held request ``handle`` (None when not held)."""
        r = self._live.get(handle)
        if r is None:
            return None
        return HeldView(handle, r.rid, r.state, r.blocks, r.deadline,
                        self._group_of.get(handle), r.expected, readers(r.finished),
                        handle in self._released)

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
        """Deadline entries not yet processed (live ones plus dead ones not yet dropped)."""
        return self._entries

    def next_deadline(self) -> int | None:
        """Earliest time a tick can change anything (for adapters' sleep). After a tick
        that ran out of its work budget this is a time already past: tick again soon."""
        nxt = self._heap[0] if self._heap else None
        if self._staged:
            s = next(iter(self._staged.values())).since + self.config.ms.max_staged_age
            nxt = s if nxt is None else min(nxt, s)
        return nxt

    def snapshot(self) -> dict[int, tuple[str, int, frozenset[str], bool, int]]:
        """Abstract state of live requests (for conformance checks and tests)."""
        return {h: (r.state, r.expected, readers(r.finished), h in self._released, r.deadline)
                for h, r in self._live.items()}

    # -- read-only views for verification and adapters (code outside the lifecycle reads
    # the ledger only through these). O(1) unless stated.
    def request_id(self, handle: int) -> str | None:
        """The request id of a live or tombstoned handle; None when unknown."""
        r = self._live.get(handle)
        if r is not None:
            return r.rid
        t = self._tomb.get(handle)
        return t.rid if t is not None else None

    def staged_entries(self) -> list[tuple[int, int, tuple[tuple[str, str, int, int], ...]]]:
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
        for h, r in self._live.items():
            if r.state not in HELD_STATES:
                errs.append(f"TypeOK: live request {h} in non-held state {r.state}")
            for b in r.blocks:
                expect[b] += 1
        for b in range(pool.capacity):
            if expect[b] != pool.refcount(b):
                errs.append(f"RefCount: block {b} count {pool.refcount(b)} != holders {expect[b]}")
                break
        entries: dict[int, int] = {}  # handle -> its earliest unprocessed entry's time
        buckets = {t: [b] if isinstance(b, int) else b for t, b in self._due.items()}
        for t, bucket in buckets.items():
            for h in bucket[self._due_pos if t == self._due_at else 0:]:
                entries[h] = min(t, entries.get(h, t))
        missing = [h for h, r in self._live.items() if entries.get(h, r.deadline + 1) > r.deadline]
        if missing:
            errs.append(f"DeadlineHeap: live requests without an entry at or before their "
                        f"deadline: {missing[:5]}")
        if sorted(self._heap) != sorted(self._due) or self._heap[:1] != sorted(self._due)[:1] \
                or sum(map(len, buckets.values())) - (self._due_pos if self._due_at in self._due else 0) \
                != self._entries:
            errs.append("DeadlineHeap: bucket heap, buckets and entry count disagree")
        if len(self._staged) > self.config.max_staged:
            errs.append("StagingBounded: staging above max_staged")
        if len(self._tomb) > self.config.max_tombstones:
            errs.append("TombstonesBounded: tombstones above max_tombstones")
        for h, r in self._live.items():
            if h in self._tomb:
                errs.append(f"TypeOK: handle {h} both live and tombstoned")
            if self._by_rid.get(r.rid) != h:
                errs.append(f"TypeOK: live handle {h} is not its request id's index entry")
        if not self._released <= self._live.keys() or not self._group_of.keys() <= self._live.keys():
            errs.append("TypeOK: released or grouped handles that are not held")
        if len(self._by_rid) > len(self._live) + len(self._tomb):
            errs.append("TypeOK: request-id index above held + tombstones")
        return errs
