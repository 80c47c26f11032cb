"""Known upstream lifecycle bugs, re-introduced into copies of the P machine.

Each mutant is a ``Ledger`` subclass that overrides one method; ``kvproto.lifecycle`` is
never modified. ``tests/test_mutants.py`` shows that the stateful fuzzer
(``kvproto.fuzz``) catches every one of them within the CI budget, with the invariant
named in ``Mutant.caught_by``; ``kvproto fuzz --mutant NAME`` fuzzes one by hand.

* ``count_messages`` -- counts done/release *messages* instead of distinct readers: a
  duplicated ``done`` from one reader frees the request while another reader's READ is in
  flight, or before that reader, still within its lease, starts it (NoFreeUnderRead).
* ``abort_frees_now`` -- an abort after prefill finished frees the blocks at once instead
  of holding them until the readers finish or the abort grace ends: the READ D started
  under its lease reads freed blocks (NoFreeUnderRead; the abort itself is also a
  transition no row of ``P_TRANSITIONS`` allows, LegalTransition).
* ``no_staging`` -- drops notifications that arrive before ``register`` instead of
  staging them: a request whose readers all reported stays held until its lease ends
  (PromptFree).
* ``stopping_sweep`` -- the expiry sweep walks requests in registration order and stops
  at the first one whose lease has not run out, so a renewed lease hides expired ones
  behind it (ExpiredFreed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvproto.lifecycle import (
    ABORTED,
    P_TABLE,
    RELEASE,
    TICK,
    Abort,
    Effect,
    Ledger,
    Tick,
    _Req,
)


class CountMessagesLedger(Ledger):
    """Mutant (a): a reader that reports twice counts twice."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._reports: dict[int, int] = {}

    def _finish(self, r: _Req, event: str, reader: str, expected: int, now: float,
                out: list[Effect]) -> None:
        self._announce(r, expected)
        fin = r.finished
        if fin is None:
            fin = r.finished = set()
        fin.add(reader)
        n = self._reports[r.handle] = self._reports.get(r.handle, 0) + 1  # BUG: messages
        if event == RELEASE:
            r.released = True
        if r.expected and n >= r.expected:
            guard = "all_finished" if r.released else "all_done"
        else:
            guard = "more_readers"
        row = P_TABLE[(r.state, event, guard)]
        if row.effect.startswith("free:"):
            group = r.group
            self._free(r, row, out)
            if group is not None and guard == "all_done":
                self._group_transferred(group, out)
        else:
            r.state = row.dst


class AbortFreesNowLedger(Ledger):
    """Mutant (b): abort of a held request frees it immediately (reason ``aborted``)."""

    def abort(self, request_id: str, now: float) -> list[Effect]:
        h = self._by_rid.get(request_id)
        r = self._live.get(h) if h is not None else None
        if r is None or r.state == ABORTED:
            return super().abort(request_id, now)
        clk = self._clock(now)
        if clk is None:
            return self._bad_time("abort", now)
        now = clk
        out: list[Effect] = []
        r.state = ABORTED
        # BUG: free now, with the effect the table gives an abort whose grace ran out.
        self._free(r, P_TABLE[(ABORTED, TICK, "deadline_passed")], out)
        return self._emit(Abort(request_id, now), out)


class NoStagingLedger(Ledger):
    """Mutant (c): early notifications (before ``register``) are dropped, not staged."""

    def _stage(self, kind: str, reader: str, handle: int, expected: int, now: float) -> None:
        self._count("staged_dropped")  # BUG: nothing is kept for register to apply


class StoppingSweepLedger(Ledger):
    """Mutant (d): expiry scans a registration-ordered list and stops at the first
    request whose deadline has not passed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._order: deque[int] = deque()

    def register(self, handle: int, request_id: str, blocks: Iterable[int], now: float, *,
                 group: str | None = None, expected: int = 0) -> list[Effect]:
        out = super().register(handle, request_id, blocks, now, group=group, expected=expected)
        if handle in self._live and (not self._order or self._order[-1] != handle):
            self._order.append(handle)
        return out

    def tick(self, now: float) -> list[Effect]:
        clk = self._clock(now)
        if clk is None:
            return self._bad_time("tick", now)
        now = clk
        out: list[Effect] = []
        order = self._order
        while order:
            r = self._live.get(order[0])
            if r is None:
                order.popleft()
                continue
            if r.deadline > now:
                break  # BUG: the entries behind a renewed lease are never looked at
            order.popleft()
            self._free(r, P_TABLE[(r.state, TICK, "deadline_passed")], out)
        staged = self._staged
        limit = now - self.config.max_staged_age
        while staged and next(iter(staged.values())).since <= limit:
            staged.popitem(last=False)
            self._count("staged_expired")
        if self.sink is not None:
            self.sink(Tick(now), out)
        return out


@dataclass(frozen=True)
class Mutant:
    name: str
    ledger_cls: type[Ledger]
    bug: str
    caught_by: frozenset[str]  # invariants whose failure counts as catching it


MUTANTS: dict[str, Mutant] = {m.name: m for m in (
    Mutant("count_messages", CountMessagesLedger,
           "counts done/release messages instead of distinct readers",
           frozenset({"NoFreeUnderRead"})),
    Mutant("abort_frees_now", AbortFreesNowLedger,
           "frees at once on an abort after prefill finished",
           frozenset({"NoFreeUnderRead", "LegalTransition"})),
    Mutant("no_staging", NoStagingLedger,
           "drops notifications that arrive before register",
           frozenset({"PromptFree"})),
    Mutant("stopping_sweep", StoppingSweepLedger,
           "expiry sweep stops at the first unexpired entry (renewals hide expired leases)",
           frozenset({"ExpiredFreed"})),
)}
