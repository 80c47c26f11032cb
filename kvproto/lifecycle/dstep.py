"""D's table run two ways: interpreted (``table_step``: one function reads a row's effect
flags) and compiled (``compile_row``: one function per row, holding only that row's
effects). ``Consumer`` runs the compiled steps; ``step_functions(table, compiled=False)``
gives the interpreted ones, and tests/test_dstep.py checks that both produce the same
states, effects and journal on random event sequences.

The row stays the authority: a compiled step is generated from the row's own fields
(``Transition.track``, ``.read``, ``.finish``, ...), from one fixed snippet per effect kind,
in the order ``table_step`` runs them; nothing of a row's text is formatted into code
(its destination and finish names are bound as constants). A table with changed rows
(``Consumer.with_rows``, the mutants) gets its own compiled steps.

A step function: ``fn(c, r, out, reason, lease_end, notif_attached)`` with ``c`` the
Consumer (typed ``Any`` here: consumer.py imports this module), ``r`` its request, ``out`` the effects list; it returns the row it ran.
``reason`` names the finish when the row leaves it to the event; ``lease_end`` is what
``renew`` offers; ``notif_attached`` says whether ``send_done`` is due.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Final

from kvproto.lifecycle.dvocab import (
    Finished,
    PostRead,
    SendClaim,
    SendDone,
    SendRelease,
    StartHandshake,
)
from kvproto.lifecycle.producer import HEAP_SLACK
from kvproto.lifecycle.table import (
    CLAIMING,
    HANDSHAKING,
    PEER_HANDSHAKING,
    PEER_UNKNOWN,
    WAITING,
    MissingRow,
    Table,
    TableKey,
    Transition,
)

StepFn = Callable[..., Transition]

# The states in which a request's lease estimate is checked by tick (no READ in flight,
# not finished): every one of them may still have to read.
IDLE: Final = frozenset((WAITING, HANDSHAKING, CLAIMING))


def table_step(row: Transition, c: Any, r: Any, out: list[Any], reason: str,
               lease_end: int, notif_attached: bool) -> Transition:
    """Run ``row`` for request ``r`` by reading its effect flags: destination, then
    effects in order."""
    r.state = row.dst
    p = r.params
    if row.track:
        heapq.heappush(c._lease_heap, (r.lease_end, r.rid))
    if row.handshake:
        hs_peer = c.peers[p.engine]
        if hs_peer.state == PEER_UNKNOWN:
            hs_peer.state = PEER_HANDSHAKING
            out.append(StartHandshake(p.engine))
    if row.claim:
        out.append(SendClaim(r.rid, p.engine, p.handle, p.capability))
    if row.read:
        ms = c.config.ms
        c._rg.posted(r.rid, c.now + ms.max_read_time + ms.read_grace)
        if p.group is not None:
            c._group_owner[(p.engine, p.group)] = r.rid
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
            and c._group_owner.get((p.engine, p.group)) == r.rid:
        del c._group_owner[(p.engine, p.group)]
    if row.quarantine:
        out.append(c._rg.quarantine(r.rid, p.engine, p.handle))
    if row.finish is not None:
        why = row.finish or reason
        c._finish(r, p)
        key = row.finish_key or f"{r.state}:{why}"
        c.finished[key] = c.finished.get(key, 0) + 1
        out.append(Finished(r.rid, r.state, why))
    return row


# One snippet per effect kind, in table_step's order; each is the same code as there.
_HEAD = ("def step(c, r, out, reason, lease_end, notif_attached):\n"
         "    r.state = DST\n"
         "    p = r.params\n")
_SNIPPETS: Final[tuple[tuple[str, str], ...]] = (
    ("track", "    heappush(c._lease_heap, (r.lease_end, r.rid))\n"),
    ("handshake", "    hs_peer = c.peers[p.engine]\n"
                  "    if hs_peer.state == PEER_UNKNOWN:\n"
                  "        hs_peer.state = PEER_HANDSHAKING\n"
                  "        out.append(StartHandshake(p.engine))\n"),
    ("claim", "    out.append(SendClaim(r.rid, p.engine, p.handle, p.capability))\n"),
    ("read", "    rg = c._rg\n"  # ReadGuard.posted, inline; _read_span: max_read_time + read_grace
             "    due = c.now + c._read_span\n"
             "    rg._due[r.rid] = due\n"
             "    heappush(rg._heap, (due, r.rid))\n"
             "    if p.group is not None:\n"
             "        c._group_owner[(p.engine, p.group)] = r.rid\n"
             "    out.append(PostRead(r.rid, p.engine, p.handle, p.blocks, p.expected))\n"),
    ("abort_pending", "    r.abort_pending = True\n"),
    ("renew", "    if lease_end > r.lease_end:\n"
              "        r.lease_end = lease_end\n"),
    ("send_done", "    if not notif_attached:\n"
                  "        out.append(SendDone(r.rid, p.engine, p.handle, p.expected))\n"),
    ("send_release", "    out.append(SendRelease(r.rid, p.engine, p.handle, p.expected))\n"),
    ("disown", "    if p.group is not None and c._group_owner.get((p.engine, p.group)) == r.rid:\n"
               "        del c._group_owner[(p.engine, p.group)]\n"),
    ("quarantine", "    out.append(c._rg.quarantine(r.rid, p.engine, p.handle))\n"),
)
# The finish: Consumer._finish inline, then the count and Finished. WHY is the row's
# finish reason ("" = the event's), KEY its counter key.
_FINISH = ("    rid = r.rid\n"
           "    reqs = c.reqs\n"
           "    del reqs[rid]\n"
           "    rg = c._rg\n"
           "    rg._due.pop(rid, None)\n"  # ReadGuard.ended_read
           "    ended = rg.ended\n"  # ReadGuard.finished
           "    ended[(p.engine, p.epoch, p.handle)] = None\n"
           "    if len(ended) > rg.max_ended:\n"
           "        ended.popitem(last=False)\n"
           "        c._count('ended_memory_evicted')\n"
           "    heap = c._lease_heap\n"
           "    n = len(heap)\n"
           "    if n > 2 * len(reqs) and n > HEAP_SLACK:\n"
           "        c._compact_lease_heap()\n"
           "    peer = c.peers.get(p.engine)\n"
           "    if peer is not None and peer.reqs.get(p.handle) is r:\n"
           "        del peer.reqs[p.handle]\n")
_FINISH_FIXED = (_FINISH +
                 "    c.finished[KEY] = c.finished.get(KEY, 0) + 1\n"
                 "    out.append(Finished(r.rid, DST, WHY))\n")
_FINISH_REASON = (_FINISH +
                  "    key = DST + ':' + reason\n"
                  "    c.finished[key] = c.finished.get(key, 0) + 1\n"
                  "    out.append(Finished(r.rid, DST, reason))\n")

_NAMES: Final = {"heappush": heapq.heappush, "StartHandshake": StartHandshake,
                 "SendClaim": SendClaim, "PostRead": PostRead, "SendDone": SendDone,
                 "SendRelease": SendRelease, "Finished": Finished,
                 "PEER_UNKNOWN": PEER_UNKNOWN, "PEER_HANDSHAKING": PEER_HANDSHAKING,
                 "HEAP_SLACK": HEAP_SLACK}


def compile_row(row: Transition) -> StepFn:
    """The step function of ``row``: only its effects, its names bound as constants."""
    src = _HEAD + "".join(code for kind, code in _SNIPPETS if getattr(row, kind))
    if row.finish is not None:
        if row.finish:
            src += _FINISH_FIXED
        else:
            src += _FINISH_REASON
    src += "    return ROW\n"
    ns: dict[str, Any] = dict(_NAMES, DST=row.dst, ROW=row, WHY=row.finish,
                              KEY=row.finish_key or f"{row.dst}:{row.finish}")
    exec(compile(src, f"<D row {row.src}/{row.event}/{row.guard}>", "exec"), ns)
    fn: StepFn = ns["step"]
    return fn


class SealedSteps(dict[Any, StepFn]):
    """A dict of step functions that refuses every change once ``seal`` ran: compiled
    once per table and shared by every ``Consumer`` (and its clones) as a value."""

    __slots__ = ("sealed",)

    def __init__(self) -> None:
        super().__init__()
        self.sealed = False

    def seal(self) -> None:
        self.sealed = True

    def _refuse(self, *_: Any, **__: Any) -> Any:
        if self.sealed:
            raise TypeError(f"{type(self).__name__} is sealed: step tables never change")
        return None

    def __setitem__(self, key: Any, value: StepFn) -> None:
        self._refuse()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._refuse()
        super().__delitem__(key)

    def update(self, *a: Any, **kw: Any) -> None:
        self._refuse()
        super().update(*a, **kw)

    def pop(self, *a: Any) -> Any:
        self._refuse()
        return super().pop(*a)

    def popitem(self) -> tuple[Any, StepFn]:
        self._refuse()
        return super().popitem()

    def clear(self) -> None:
        self._refuse()
        super().clear()

    def setdefault(self, *a: Any) -> Any:
        self._refuse()
        return super().setdefault(*a)


class _Steps(SealedSteps):
    """A table's step functions: a missing (state, event, guard) raises ``MissingRow``.
    Built whole by ``step_functions`` (every (src, event)'s ``GuardSteps`` included),
    then sealed."""

    __slots__ = ("_by_guard", "machine")

    def __init__(self, machine: str) -> None:
        super().__init__()
        self.machine = machine
        self._by_guard: dict[tuple[str, str], GuardSteps] = {}

    def __missing__(self, key: TableKey) -> StepFn:
        raise MissingRow(self.machine, *key)

    def _build_guards(self) -> None:
        for (s, e, g), fn in self.items():
            got = self._by_guard.get((s, e))
            if got is None:
                got = self._by_guard[(s, e)] = GuardSteps(self.machine, s, e)
            got[g] = fn
        for got in self._by_guard.values():
            got.seal()

    def by_guard(self, src: str, event: str) -> GuardSteps:
        """The step functions of the rows (src, event, *), by guard (a hot event whose
        source state is fixed looks its row up without building a key); a pair with no
        row gives an empty ``GuardSteps`` whose lookups raise ``MissingRow``."""
        got = self._by_guard.get((src, event))
        if got is None:
            got = GuardSteps(self.machine, src, event)
            got.seal()
        return got


class GuardSteps(SealedSteps):
    """The step functions of one (src, event) by guard; a missing guard raises
    ``MissingRow``."""

    __slots__ = ("event", "machine", "src")

    def __init__(self, machine: str, src: str, event: str) -> None:
        super().__init__()
        self.machine = machine
        self.src = src
        self.event = event

    def __missing__(self, guard: str) -> StepFn:
        raise MissingRow(self.machine, self.src, self.event, guard)


def _interpreted(row: Transition) -> StepFn:
    def step(c: Any, r: Any, out: list[Any], reason: str, lease_end: int,
             notif_attached: bool) -> Transition:
        return table_step(row, c, r, out, reason, lease_end, notif_attached)
    return step


# Step functions per table, compiled once per (table, mode). Size: one entry per D table
# built (D_TABLE and the few ``with_rows`` tables of tests and mutants), both modes.
_CACHE: dict[tuple[int, bool], tuple[Table, _Steps]] = {}


def step_functions(table: Table, *, compiled: bool = True) -> _Steps:
    """Every row of ``table`` as a step function (compiled, or ``table_step`` per row)."""
    hit = _CACHE.get((id(table), compiled))
    if hit is not None and hit[0] is table:
        return hit[1]
    steps = _Steps("D")
    for key, row in table.items():
        steps[key] = compile_row(row) if compiled else _interpreted(row)
    steps._build_guards()
    steps.seal()
    _CACHE[(id(table), compiled)] = (table, steps)
    return steps
