"""D's bounded reads and its memory of ended loads: the state behind the D_TICK/read_overdue
row, the quarantine of an overdue READ's local blocks, and the refusal of a second pull.
Sans-I/O, integer milliseconds; ``Consumer`` owns one ``ReadGuard`` and calls it from its
events (spec/PROTOCOL.md, "Bounded reads" and "No second pull").

Bounded reads. A READ posted at t is overdue once the clock passes t + max_read_time +
read_grace. D's tick then runs the row READING/D_TICK/read_overdue for it: the request
leaves D failed (``read_timeout``: the engine recomputes it or fails it, per its policy),
gives up its sibling group (a sibling must not be served from blocks that never landed),
sends P nothing (no release while the READ may still touch P's blocks; P frees by lease
expiry), and its local (destination) blocks are *quarantined*: the ``Quarantined`` effect
tells the adapter to keep them out of the engine's hands. Only the transfer's own end -- a
read result (landed, failed, or released by the transport) for the quarantined request --
ends the quarantine (``Unquarantined``): before that the transfer may still write them.
Promise (TLA+ ``NoQuarantinedReuse``): a READ the transport has not reported ended
belongs to a request that is reading or quarantined, never to one whose blocks went back.

No second pull. The (P engine, epoch, handle) of every request that finished on D is
remembered; a later admit naming one is refused before the table (``second_pull``,
counted; the request finishes failed and is recomputed locally; nothing is sent to P,
whose blocks for it are freed or will be by its lease).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from kvproto.lifecycle.config import ConfigError

# Ended loads one D rank remembers (``ReadGuard.ended``) by default. At the cap the oldest
# is forgotten (counted ended_memory_evicted). A second load of a forgotten handle is
# admitted and may READ: P freed that handle when the first load reported done, failed or
# released (or its lease ran out), so P refuses its renewal (revoked: recomputed) and a
# READ posted before the refusal arrives lands on blocks P bumped before any reuse, so
# the stamp check fences it (recomputed). Never wrong KV served; the cap only bounds how
# long D refuses without a round trip.
MAX_ENDED: Final = 1 << 16

EndedKey = tuple[str, int, int]  # (P engine, epoch, handle)


@dataclass(slots=True, unsafe_hash=True)
class Quarantined:
    """Effect: the overdue READ of ``request_id`` is still in flight: keep its local
    blocks from the engine (do not free or reuse them) until ``Unquarantined``."""

    request_id: str
    engine: str
    handle: int


@dataclass(slots=True, unsafe_hash=True)
class Unquarantined:
    """Effect: the quarantined READ of ``request_id`` ended (landed, failed, or released
    by the transport): its local blocks may go back to the engine."""

    request_id: str
    engine: str
    handle: int


class ReadGuard:
    """READ deadlines, the quarantine and the ended-load memory of one D rank.

    Costs: ``posted``, ``ended_read``, ``quarantine``, ``release``, ``finished`` and
    ``refuses`` O(1) (amortized: a heap push or an OrderedDict update); ``overdue`` pops at
    most ``budget`` heap entries, O(budget log n).
    """

    __slots__ = ("_due", "_heap", "ended", "max_ended", "quarantined")

    def __init__(self, max_ended: int = MAX_ENDED) -> None:
        if max_ended < 1:
            raise ConfigError(f"max_ended must be >= 1, got {max_ended}")
        self.max_ended = max_ended
        # Invariant: rid -> the deadline of its READ, exactly the requests in reading.
        # Size: READs in flight.
        self._due: dict[str, int] = {}
        # Invariant: an entry (deadline, rid) for every key of _due; entries of READs that
        # ended since are dropped when they come due. Size: READs posted within the last
        # max_read_time + read_grace, plus those a tick's budget left (each entry is pushed
        # once per READ and popped once).
        self._heap: list[tuple[int, str]] = []
        # Invariant: rid -> (engine, handle) of every request that left D read_timeout and
        # whose READ the transport has not reported ended. Size: bounded by the engine's
        # local blocks (each entry holds at least one of them and the engine cannot lend
        # more than it has); the gauge ``stuck_reads`` reports it.
        self.quarantined: dict[str, tuple[str, int]] = {}
        # Invariant: (engine, epoch, handle) of the requests that finished on D, oldest
        # first. Cap: max_ended; at the cap the oldest is forgotten (see MAX_ENDED).
        self.ended: OrderedDict[EndedKey, None] = OrderedDict()

    def copy(self) -> ReadGuard:
        """An independent copy (``Consumer.clone``)."""
        n = ReadGuard(self.max_ended)
        n._due = dict(self._due)
        n._heap = list(self._heap)
        n.quarantined = dict(self.quarantined)
        n.ended = OrderedDict(self.ended)
        return n

    # -- bounded reads ---------------------------------------------------------------------
    def posted(self, rid: str, deadline: int) -> None:
        """``rid``'s READ was posted; it is overdue once the clock passes ``deadline``."""
        self._due[rid] = deadline
        heapq.heappush(self._heap, (deadline, rid))

    def ended_read(self, rid: str) -> None:
        """``rid`` left reading (its READ ended, or it finished)."""
        self._due.pop(rid, None)

    def deadline(self, rid: str) -> int | None:
        """When ``rid``'s READ becomes overdue (None when it is not reading)."""
        return self._due.get(rid)

    def next_due(self) -> int | None:
        """The earliest READ deadline in the heap (maybe of a READ that ended since)."""
        return self._heap[0][0] if self._heap else None

    def overdue(self, now: int, budget: int) -> tuple[list[str], int]:
        """The reading requests whose deadline passed (deadline < now), earliest first,
        popping at most ``budget`` heap entries; and the budget left. Entries of READs
        that ended are dropped on the way (they count against the budget)."""
        heap = self._heap
        due = self._due
        out: list[str] = []
        while heap and heap[0][0] < now and budget > 0:
            budget -= 1
            d, rid = heapq.heappop(heap)
            if due.get(rid) == d:
                out.append(rid)
        return out, budget

    # -- quarantine ------------------------------------------------------------------------
    def quarantine(self, rid: str, engine: str, handle: int) -> Quarantined:
        self.quarantined[rid] = (engine, handle)
        return Quarantined(rid, engine, handle)

    def release(self, rid: str) -> Unquarantined | None:
        """The transport reported ``rid``'s READ ended: end its quarantine, if any."""
        q = self.quarantined.pop(rid, None)
        return None if q is None else Unquarantined(rid, q[0], q[1])

    # -- ended loads -----------------------------------------------------------------------
    def finished(self, key: EndedKey) -> bool:
        """Remember an ended load; True when the cap made it forget the oldest."""
        ended = self.ended
        ended[key] = None
        if len(ended) > self.max_ended:
            ended.popitem(last=False)
            return True
        return False

    def refuses(self, key: EndedKey) -> bool:
        """Whether a load of ``key`` is a second pull (its first one ended on D)."""
        return key in self.ended
