"""``BlockPool``: reference-counted KV blocks (``held + free == capacity`` always).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Final

from kvproto.errors import UsageError
from kvproto.lifecycle.config import ConfigError

# ---------------------------------------------------------------------------
# Block pool.
# ---------------------------------------------------------------------------


class DoubleFree(UsageError, RuntimeError):
    """A block's reference count would drop below zero (only a caller that drops blocks
    outside the ledger can cause it)."""


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
            raise ConfigError(f"capacity must be an int within [1, {MAX_POOL_BLOCKS}], "
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

    def clone(self) -> BlockPool:
        """A deep, independent copy (counts, pins and free list). O(capacity)."""
        n = object.__new__(type(self))
        n.capacity = self.capacity
        n._rc = list(self._rc)
        n.held_count = self.held_count
        n.free_count = self.free_count
        n.strict = self.strict
        n.violations = self.violations
        n._avail = None if self._avail is None else OrderedDict(self._avail)
        n._pins = dict(self._pins)
        return n

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

    def _drop(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """Decrement; return the blocks whose count reached zero (now reusable), in the
        order of ``blocks`` (``blocks`` itself when every one of them did)."""
        rc = self._rc
        reclaimed: list[int] | None = None
        for b in blocks:
            c = rc[b] - 1
            if c > 0:  # another holder keeps it
                rc[b] = c
            elif c == 0:  # the last holder let go
                rc[b] = 0
                if reclaimed is None:
                    reclaimed = [b]
                else:
                    reclaimed.append(b)
            else:
                self.violations += 1
                if self.strict:
                    self._reclaimed(reclaimed)  # the counts stay exact for what was dropped
                    raise DoubleFree(f"block {b} freed with reference count {c + 1}")
        if reclaimed is None:
            return ()
        n = len(reclaimed)
        self.held_count -= n
        self.free_count += n
        if self._avail is not None:
            self._reclaimed_avail(reclaimed)
        return blocks if n == len(blocks) else tuple(reclaimed)

    def _reclaimed(self, blocks: list[int] | None) -> None:
        """Count ``blocks`` (their reference counts just reached zero) as free."""
        if not blocks:
            return
        n = len(blocks)
        self.held_count -= n
        self.free_count += n
        if self._avail is not None:
            self._reclaimed_avail(blocks)

    def _reclaimed_avail(self, blocks: list[int]) -> None:
        """``blocks`` just became free: the unpinned ones become allocatable."""
        avail = self._avail
        assert avail is not None
        pins = self._pins
        for b in blocks:
            if b not in pins:
                avail[b] = None

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
