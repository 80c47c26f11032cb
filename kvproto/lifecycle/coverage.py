"""Coverage: a D rank reports a request complete only when it read every region it needs.

With tensor parallelism a D rank's KV for one request comes from one or more P ranks
(``kvproto.lifecycle.topology``); each P rank is a *part*, read by its own ``Consumer``
entry (admit, READ, stamp check, done to that P rank's ledger). A **region** is one
``(P rank, layer, KV cache group)``. The **region map** of a request on D rank d is the
set of regions it needs: for every P rank of ``Topology.sources(d)``, every layer of every
KV cache group (``region_map``), computed on D from what the transfer params describe
(the P ranks and their layer counts per group) and D's own rank.

``Coverage`` is the machine that joins the parts, one per D rank, one entry per request,
run from the table ``C_TRANSITIONS`` like the P and D machines:

* ``expect`` -- the region map, parts and their regions (guard ``regions``: track;
  ``nothing_needed``: a map with no region cannot prove anything, incomplete; ``full``: at
  the cap ``max_requests``, incomplete, counted ``coverage_full``);
* ``part_read`` -- a part's READ completed and its stamps matched; it carries the regions
  that READ transferred and verified. Guard ``short``: they miss one of the part's
  regions (incomplete, the other parts cancelled); ``more_parts``: recorded, others
  pending; ``all_read``: recorded, and every region of the map is read: complete;
  ``unknown_part``/``duplicate``: counted, nothing changes;
* ``part_failed`` -- a part ended any other way (fenced, transfer error, lease lost,
  revoked, peer lost, aborted): incomplete, the other parts cancelled.

Fail closed: only ``all_read`` reaches ``complete``, and its guard is computed from the
regions recorded, never from a count of messages; ``complete`` and ``incomplete`` are
terminal. The invariant ``Coverage`` (``tla/KVCoverage.tla``) is: a request reported
complete has every region of its map recorded as read. ``Complete`` names the regions
read (D's report of what was read); ``Incomplete`` names the ones missing.

Cost: ``expect`` O(regions), ``part_read`` O(regions of the part), the rest O(1). Caps:
``max_requests`` entries, tracked or ended and not yet forgotten (vLLM forgets every
request it finishes; at the cap ``expect`` fails the request closed) and
``MAX_REGIONS`` regions per request (a larger map is refused as ``too_many_regions``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from kvproto.errors import UsageError
from kvproto.lifecycle.topology import Topology

MAX_REGIONS: Final = 1 << 16  # regions of one request (P ranks x layers x groups)
MAX_COVERAGE_REQUESTS: Final = 1 << 20  # default cap of tracked requests per D rank


class Region(NamedTuple):
    """One piece of a request's KV: a P rank's slice of one layer of one cache group."""

    p_rank: int
    layer: int
    group: int


def region_map(topology: Topology, d_rank: int, layers_per_group: Sequence[int]
               ) -> dict[int, frozenset[Region]]:
    """The regions D rank ``d_rank`` needs, by part (P rank): every layer of every group
    of each P rank it reads. Raises UsageError on a bad layer count or too many regions."""
    if not layers_per_group or any(n < 1 for n in layers_per_group):
        raise UsageError(f"layers per KV cache group must be >= 1: {list(layers_per_group)}")
    srcs = topology.sources(d_rank)
    if len(srcs) * sum(layers_per_group) > MAX_REGIONS:
        raise UsageError(f"more than {MAX_REGIONS} regions per request")
    return {s.p_rank: frozenset(Region(s.p_rank, layer, g)
                                for g, n in enumerate(layers_per_group) for layer in range(n))
            for s in srcs}


# States (``new`` is the pseudo-state before ``expect``).
C_NEW: Final = "new"
COVERING: Final = "covering"  # some part not read yet
COMPLETE: Final = "complete"  # every region read and verified (terminal)
INCOMPLETE: Final = "incomplete"  # some region cannot be read: recompute (terminal)
C_STATES: Final = (COVERING, COMPLETE, INCOMPLETE)

# Events.
EXPECT: Final = "expect"
PART_READ: Final = "part_read"
PART_FAILED: Final = "part_failed"
C_EVENTS: Final = (EXPECT, PART_READ, PART_FAILED)


class CRow(NamedTuple):
    """One row of the coverage table: in ``src``, on ``event`` with guard ``guard``, go
    to ``dst``; effects: ``track``, ``record`` (add the part's regions to what was read),
    ``cancel`` (stop the other parts), ``finish:<reason>``, ``count:<counter>``."""

    src: str
    event: str
    guard: str
    dst: str
    effects: tuple[str, ...]
    doc: str


C_TRANSITIONS: Final[tuple[CRow, ...]] = (
    CRow(C_NEW, EXPECT, "regions", COVERING, ("track",), "the region map arrived"),
    CRow(C_NEW, EXPECT, "nothing_needed", INCOMPLETE, ("finish:no_regions",), "a map with no region proves nothing"),
    CRow(C_NEW, EXPECT, "full", INCOMPLETE, ("count:coverage_full", "finish:coverage_full"), "at the cap: fail closed"),
    CRow(COVERING, PART_READ, "more_parts", COVERING, ("record",), "a part read and verified; others pending"),
    CRow(COVERING, PART_READ, "all_read", COMPLETE, ("record", "finish:complete"), "every region of the map read and verified"),
    CRow(COVERING, PART_READ, "short", INCOMPLETE, ("cancel", "finish:short"), "the part's READ missed one of its regions"),
    CRow(COVERING, PART_READ, "duplicate", COVERING, ("count:duplicate_part",), "a part reported twice counts once"),
    CRow(COVERING, PART_READ, "unknown_part", COVERING, ("count:unknown_part",), "a part not in the map"),
    CRow(COVERING, PART_FAILED, "failed", INCOMPLETE, ("cancel", "finish:part_failed"), "a part cannot be read: the request cannot be complete"),
    CRow(COVERING, PART_FAILED, "unknown_part", COVERING, ("count:unknown_part",), "a part not in the map"),
    CRow(COMPLETE, PART_READ, "stale", COMPLETE, ("count:stale_part",), "the request already ended"),
    CRow(COMPLETE, PART_FAILED, "stale", COMPLETE, ("count:stale_part",), "the request already ended"),
    CRow(INCOMPLETE, PART_READ, "stale", INCOMPLETE, ("count:stale_part",), "the request already ended"),
    CRow(INCOMPLETE, PART_FAILED, "stale", INCOMPLETE, ("count:stale_part",), "the request already ended"),
)
C_TABLE: Final[Mapping[tuple[str, str, str], CRow]] = {
    (r.src, r.event, r.guard): r for r in C_TRANSITIONS}


@dataclass(frozen=True, slots=True)
class CoverageDone:
    """The request left the machine: ``ok`` (complete) with the regions ``read``, or
    not, with ``reason`` and the regions ``missing``."""

    rid: str
    ok: bool
    reason: str
    read: frozenset[Region]
    missing: frozenset[Region]


@dataclass(frozen=True, slots=True)
class CancelParts:
    """Stop the parts of ``rid`` still pending (abort them: each releases its P rank)."""

    rid: str
    parts: tuple[int, ...]


CEffect = CoverageDone | CancelParts


class _Entry:
    __slots__ = ("need", "pending", "read", "state")

    def __init__(self, need: dict[int, frozenset[Region]]) -> None:
        self.state = C_NEW
        self.need = need
        self.read: set[Region] = set()
        self.pending = set(need)


class Coverage:
    """One D rank's coverage machine (see the module docstring)."""

    table: Mapping[tuple[str, str, str], CRow] = C_TABLE

    def __init__(self, max_requests: int = MAX_COVERAGE_REQUESTS) -> None:
        if max_requests < 1:
            raise UsageError("max_requests must be >= 1")
        self.max_requests = max_requests
        self._reqs: dict[str, _Entry] = {}
        # ended, not yet forgotten: rid -> (final state, regions read)
        self._ended: dict[str, tuple[str, frozenset[Region]]] = {}
        self.counters: dict[str, int] = {}

    # -- views ------------------------------------------------------------------------
    def state(self, rid: str) -> str:
        e = self._reqs.get(rid)
        if e is not None:
            return e.state
        end = self._ended.get(rid)
        return end[0] if end is not None else C_NEW

    def read(self, rid: str) -> frozenset[Region]:
        """The regions recorded as read and verified (kept once the request ended)."""
        e = self._reqs.get(rid)
        if e is not None:
            return frozenset(e.read)
        end = self._ended.get(rid)
        return end[1] if end is not None else frozenset()

    def pending(self, rid: str) -> tuple[int, ...]:
        e = self._reqs.get(rid)
        return tuple(sorted(e.pending)) if e is not None else ()

    def clone(self) -> Coverage:
        """An independent copy (model checking and fuzzing explore from it)."""
        c = type(self)(self.max_requests)
        for rid, e in self._reqs.items():
            n = _Entry(dict(e.need))
            n.state, n.read, n.pending = e.state, set(e.read), set(e.pending)
            c._reqs[rid] = n
        c._ended = dict(self._ended)
        c.counters = dict(self.counters)
        return c

    def __len__(self) -> int:
        return len(self._reqs)

    # -- the machine ------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def part_guard(self, need: Mapping[int, frozenset[Region]], part: int,
                   got: frozenset[Region], read: frozenset[Region], pending: int) -> str:
        """Guard of ``part_read`` for a pending part: ``short`` when ``got`` (what its READ
        verified) misses one of the part's regions, else ``more_parts`` while ``pending``
        parts remain, else ``all_read`` when ``read`` (every region recorded, this part's
        included) holds every region of the map. A documented hook: the mutant
        ``drop_region`` overrides it."""
        if not need[part] <= got:
            return "short"
        if pending:
            return "more_parts"
        return "all_read" if all(rs <= read for rs in need.values()) else "short"

    def _step(self, rid: str, e: _Entry | None, event: str, guard: str,
              regions: frozenset[Region] = frozenset()) -> list[CEffect]:
        src = e.state if e is not None else self.state(rid)
        row = self.table[(src, event, guard)]
        out: list[CEffect] = []
        for fx in row.effects:
            kind, _, arg = fx.partition(":")
            if kind == "count":
                self._count(arg)
            elif kind == "record" and e is not None:
                e.read |= regions
            elif kind == "cancel" and e is not None and e.pending:
                out.append(CancelParts(rid, tuple(sorted(e.pending))))
            elif kind == "finish":
                ok = row.dst == COMPLETE
                read = frozenset(e.read) if e is not None else frozenset()
                need = frozenset().union(*e.need.values()) if e is not None else frozenset()
                out.append(CoverageDone(rid, ok, arg, read, need - read))
                self._count(f"{row.dst}:{arg}")
        if row.dst in (COMPLETE, INCOMPLETE) and src not in (COMPLETE, INCOMPLETE):
            self._reqs.pop(rid, None)
            self._ended[rid] = (row.dst, frozenset(e.read) if e is not None else frozenset())
        elif e is not None:
            e.state = row.dst
        return out

    def expect(self, rid: str, need: Mapping[int, Iterable[Region]]) -> list[CEffect]:
        """Event ``expect``: the region map of ``rid`` (part -> its regions). A second
        map for a tracked request is a usage error."""
        if rid in self._reqs or rid in self._ended:
            raise UsageError(f"coverage of {rid!r} already expected")
        parts = {int(p): frozenset(rs) for p, rs in need.items()}
        if sum(len(rs) for rs in parts.values()) > MAX_REGIONS:
            raise UsageError(f"more than {MAX_REGIONS} regions per request")
        for p, rs in parts.items():
            if any(r.p_rank != p for r in rs):
                raise UsageError(f"part {p} of {rid!r} names another P rank's region")
        if len(self._reqs) + len(self._ended) >= self.max_requests:
            return self._step(rid, None, EXPECT, "full")
        if not parts or not any(parts.values()):
            return self._step(rid, None, EXPECT, "nothing_needed")
        e = _Entry({p: rs for p, rs in parts.items() if rs})
        self._reqs[rid] = e
        return self._step(rid, e, EXPECT, "regions")

    def part_read(self, rid: str, part: int, regions: Iterable[Region]) -> list[CEffect]:
        """Event ``part_read``: part ``part``'s READ landed and its stamps matched; it
        transferred and verified ``regions``."""
        e = self._reqs.get(rid)
        if e is None:
            if rid not in self._ended:
                self._count("unknown_request")
                return []
            return self._step(rid, None, PART_READ, "stale")
        got = frozenset(regions)
        if part not in e.need:
            return self._step(rid, e, PART_READ, "unknown_part")
        if part not in e.pending:
            return self._step(rid, e, PART_READ, "duplicate")
        e.pending.discard(part)
        mine = got & e.need[part]
        guard = self.part_guard(e.need, part, got, frozenset(e.read | mine), len(e.pending))
        return self._step(rid, e, PART_READ, guard, mine)

    def part_failed(self, rid: str, part: int) -> list[CEffect]:
        """Event ``part_failed``: part ``part`` ended without a verified READ."""
        e = self._reqs.get(rid)
        if e is None:
            if rid not in self._ended:
                self._count("unknown_request")
                return []
            return self._step(rid, None, PART_FAILED, "stale")
        if part not in e.need:
            return self._step(rid, e, PART_FAILED, "unknown_part")
        e.pending.discard(part)
        return self._step(rid, e, PART_FAILED, "failed")

    def forget(self, rid: str) -> None:
        """vLLM finished the request: drop what is left of it (a tracked one is dropped
        as it is; its parts are the Consumer's to end)."""
        self._reqs.pop(rid, None)
        self._ended.pop(rid, None)
