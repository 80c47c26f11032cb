"""A done batch on P's ledger in one call: ``Ledger.done_batch``.

A D rank sends its dones coalesced (one wire message, several handles); P's port hands
the whole batch to the ledger. The batch runs exactly what ``Ledger.done`` runs once per
handle, in order: the same guard per handle, the same row of ``TABLE`` (read from the
same derived ``_DONE_FIN`` plans), the same effects in the same order, one journal
record per handle (the sink is called after each handle with that handle's effects, as
``done`` calls it) and the same counters. What it saves is per-call work: one method
call, one clock check and one effect list per batch, the ledger's fields read once, and
the per-reason free counter bumped once per batch (no caller can read it in between:
the sink sees it up to date, it is settled even when a row raises).

A ledger whose class overrides ``done``, ``_free`` or ``tally``, or looks rows up
(``LOOKUP_ROWS``), and a time the clock check would not take as it is (not an int, or
before the ledger's clock), run ``done`` per handle instead: then nothing can differ.
Rows other than a plain row and a plain free (a cascade to a sibling group, a generic
row) run through the ledger's own methods, as in ``done``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvproto.lifecycle.hotpath import FreeFields
from kvproto.lifecycle.table import DONE

# ``L`` below is a ``producer.Ledger`` and effects are its ``Effect``s: typed ``Any`` here
# because producer imports this module (``Ledger.done_batch`` has the real types).


class _Kit(NamedTuple):
    """What the batch needs of ``producer`` (which imports this module):
    ``register_batch`` sets it once ``producer.Ledger`` exists."""

    ledger: Any  # producer.Ledger
    free: type  # producer.Free
    done: Any  # producer.Done
    fin_plain: int
    fin_free: int
    fin_guards: tuple[str, ...]


_kit: _Kit | None = None


def register_batch(ledger: type, free: type, done: Any, fin_plain: int,
                   fin_free: int, fin_guards: tuple[str, ...]) -> None:
    """Called by ``producer`` once: its base ledger class, effect and event classes and
    the plan constants of ``Ledger._DONE_FIN``."""
    global _kit
    _kit = _Kit(ledger, free, done, fin_plain, fin_free, fin_guards)


def done_batch(L: Any, reader: str, handles: Sequence[int], expected: int, now: int,
               marks: list[int] | None = None) -> list[Any]:
    """``reader``'s done for each of ``handles`` in order: the effects of
    ``L.done(reader, h, expected, now)`` for each ``h``, concatenated. ``marks``: when
    given, ``len(effects)`` after each handle is appended to it (where each handle's
    effects end, for a caller that acts per handle)."""
    p = _kit
    assert p is not None, "producer registers the batch when it is imported"
    if not handles:
        return []  # no event at all: not even the clock moves
    cls = type(L)
    if (cls.done is not p.ledger.done or cls._free is not p.ledger._free
            or not cls._OWN_TALLY or cls.LOOKUP_ROWS or type(now) is not int or now < L.now):
        out: list[Any] = []
        for h in handles:
            out += L.done(reader, h, expected, now)
            if marks is not None:
                marks.append(len(out))
        return out
    L.now = now
    out = []
    live = L._live
    get = live.get
    fins = L._DONE_FIN
    released = L._released
    group_of = L._group_of
    tomb = L._tomb
    order = L._tomb_order
    max_tomb = L._max_tomb
    drop = L.pool._drop
    sink = L.sink
    free_cls = p.free
    fin_plain, fin_free = p.fin_plain, p.fin_free
    freed: dict[str, int] = {}  # per-reason frees not yet added to L.frees
    try:
        for h in handles:
            start = len(out)
            r = get(h)
            if r is None:
                L._not_live(DONE, reader, h, expected, now)
            elif expected != r.expected:
                L._finish(h, r, DONE, reader, expected, now, out)
                if len(out) > start and L._entries > 2 * len(live):
                    L._maybe_compact()
            else:
                # Ledger.done's inline body: _add_reader, the guard, the row of _DONE_FIN.
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
                g = 3 if n < 0 else (2 if released and h in released else 1) \
                    if expected and n >= expected else 0
                row, plan = fins[r.state][g]
                if plan == fin_plain:
                    r.state = row.dst
                elif plan == fin_free:
                    group = group_of.get(h) if row.cascade and group_of else None
                    if group is not None or group_of:
                        L._free(h, r, row, out)  # a sibling group: the ledger's own free
                        if group is not None:
                            L._group_transferred(group, out)
                    else:
                        # Ledger._free's body for a request of no group, the per-reason
                        # counter kept in ``freed``.
                        reason = row.free
                        assert reason is not None
                        r.state = row.dst
                        del live[h]  # _by_rid[rid] stays h: it now names the tombstone
                        if released:
                            released.discard(h)
                        tomb[h] = r
                        order.append(h)
                        if len(order) > max_tomb:
                            L._evict_tomb()
                        blocks = r.blocks
                        reclaimed = drop(blocks)
                        freed[reason] = freed.get(reason, 0) + 1
                        fx: Any = FreeFields(h, r.rid, reason, blocks, reclaimed, r.deadline)
                        fx.__class__ = free_cls  # a frozen Free (hotpath.register_free)
                        out.append(fx)
                    if L._entries > 2 * len(live):
                        L._maybe_compact()
                else:
                    L._fin_other(h, r, DONE, p.fin_guards[g], row, plan, now, out)
                    if len(out) > start and L._entries > 2 * len(live):
                        L._maybe_compact()
            if marks is not None:
                marks.append(len(out))
            if sink is not None:
                if freed:
                    _settle(L, freed)
                sink(p.done(reader, h, expected, now), out[start:])
    finally:
        if freed:
            _settle(L, freed)
    return out


def _settle(L: Any, freed: dict[str, int]) -> None:
    """Add the batch's pending per-reason frees to ``L.frees`` and clear them."""
    frees = L.frees
    for reason, k in freed.items():
        frees[reason] = frees.get(reason, 0) + k
    freed.clear()
