"""Known upstream lifecycle bugs, re-introduced into the P machine.

Each mutant is a ``Ledger`` subclass that either replaces rows of the transition table
(``Ledger.with_rows``) or overrides one documented public hook (``tally``, ``sweep``);
none copies or reads the ledger's internals, and ``kvproto.lifecycle`` is never modified.
``tests/test_mutants.py`` shows that the stateful fuzzer (``kvproto.testing.fuzz``) catches every
one of them within the CI budget, with the invariant named in ``Mutant.caught_by``;
``kvproto fuzz --mutant NAME`` fuzzes one by hand.

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

D mutants (``D_MUTANTS``, ``Consumer`` subclasses that replace table rows or override a
documented hook: ``sweep_leases``, ``refuses_load``), caught by D journal validation
(``kvproto validate D_JOURNAL``):

* ``unbounded_tick`` -- D's lease check ignores its work budget (``max_tick_work``) and
  fails every lost lease in one tick: 10^5 requests losing their lease at once stall the
  rank for one long step. Caught by the replay's ``TickBounded`` check and by TLC's trace
  validation (TraceConsumer: a tick failed more leases than its work budget).
* ``early_release`` -- the read_overdue row without ``quarantine``: an overdue READ's
  request leaves and its local blocks go back to the engine while the transfer may still
  write them. Caught by the replay's ``NoQuarantinedReuse``, by TLC's trace validation
  (an effect the spec does not have) and by graph equality (tests/test_quarantine.py);
  KVConsumer's ``DBug = "early_release"`` breaks ``NoQuarantinedReuse`` under TLC.
* ``second_pull`` -- ``refuses_load`` never refuses: a load of a request that ended on D
  is read again. Caught by the replay's ``NoSecondPull``; KVConsumer's
  ``DBug = "second_pull"`` breaks ``NoSecondPull`` under TLC.
* ``read_before_grant`` -- the admit/claim and handshake_ok/claim rows go straight to
  ``waiting`` without the ``claim`` effect: D reads a handle whose claim P's gate has
  not granted (it may be bound to another consumer: a router retry, a hedge). Caught by
  the replay's ``ReadOnlyGranted``, by graph equality and TLC's trace validation (an
  effect the spec does not have); KVConsumer's ``DBug = "read_before_grant"`` breaks
  ``ReadOnlyGranted`` and KVGate's ``BugReadBeforeGrant`` breaks ``NoFreeUnderRead``
  (per claimant) under TLC (model ``bug_read_before_grant``).

Two coverage mutants (``COVERAGE_MUTANTS``, a ``Coverage`` subclass overriding its
documented hook ``part_guard``). ``drop_region`` -- a part whose READ missed one of its
regions (one layer of one P rank) still counts as read, so D reports the request complete
with a region never read (Coverage). Caught by the coverage fuzzer
(``kvproto.testing.cfuzz``), by the coverage graph equality and by TLC (model
``bug_drop_region``). ``one_part`` -- a part read and verified completes the request
while other parts (P ranks) are pending: a P TP 2 -> D TP 1 request with split heads is
served after one P rank's READ, the other rank's heads never read (Coverage). Caught by
the coverage fuzzer, by TLC (model ``bug_one_part``), by the join tests (``tests/test_vllm_dcover.py``) and by the NIXL
test where the second part is fenced (``tests/test_nixl_split.py``).

P's gate (``kvproto.lifecycle.gate``) has its own mutants, ``GATE_MUTANTS`` in
``kvproto.testing.gatefuzz`` (``skip_binding``, ``register_unready``,
``skip_capability``, ``grant_before_register``, ``no_never_notice``), caught by hypothesis
there (``tests/test_gate.py``) and, all but ``grant_before_register``, by TLC (the
``bug_skip_binding``, ``bug_register_unready``, ``bug_skip_capability`` and
``bug_no_never_notice`` models).

Driver mutants (``DRIVER_MUTANTS``) are bugs of D's driver, which the simulator and the
fuzzer run as production code does: ``no_fencing`` never compares the stamps a READ
fetched after its data, so a READ that lands late on blocks P freed and reused is served
(ServedIntact); ``no_checksum`` never compares the block checksums (``Config.checksums``),
so a READ corrupted in flight with its stamps unchanged is served (ServedIntact).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvproto.lifecycle import (
    ABORT,
    ADMIT,
    D_NEW,
    D_TABLE,
    D_TICK,
    DONE,
    FREED,
    HANDSHAKE_OK,
    HANDSHAKING,
    HEARTBEAT,
    MAX_CAP,
    P_TABLE,
    READING,
    RELEASE,
    UNREGISTERED,
    WAITING,
    Consumer,
    DEffect,
    Effect,
    Fx,
    Ledger,
    TransferParams,
)
from kvproto.lifecycle.coverage import Coverage, Region
from kvproto.nixl.driver_d import DDriver

_HELD_LIVE = ("registered", "leased", "notified")


class CountMessagesLedger(Ledger):
    """Mutant (a): a reader that reports twice counts twice (hook ``tally``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._reports: dict[int, int] = {}

    def tally(self, handle: int, event: str, reader: str) -> int:
        super().tally(handle, event, reader)  # the reader set itself stays right
        n = self._reports[handle] = self._reports.get(handle, 0) + 1
        return n  # BUG: messages, not distinct readers; a duplicate is never noticed


# Mutant (b): table rows (held, abort, hold) go straight to freed with the abort's free.
AbortFreesNowLedger = Ledger.with_rows(
    *(replace(P_TABLE[(s, ABORT, "hold")], dst=FREED, effects=(Fx("free", "aborted"),))
      for s in _HELD_LIVE),
    name="AbortFreesNowLedger")

# Mutant (c): table rows (unregistered, done/release/heartbeat, early) drop the message.
NoStagingLedger = Ledger.with_rows(
    *(replace(P_TABLE[(UNREGISTERED, ev, "early")], effects=(Fx("count", "staged_dropped"),))
      for ev in (DONE, RELEASE, HEARTBEAT)),
    name="NoStagingLedger")


class StoppingSweepLedger(Ledger):
    """Mutant (d): expiry (hook ``sweep``) scans a registration-ordered list and stops
    at the first request whose deadline has not passed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._order: deque[int] = deque()

    def register(self, handle: int, request_id: str, blocks: Iterable[int], now: int, *,
                 group: str | None = None, expected: int = 0) -> list[Effect]:
        out = super().register(handle, request_id, blocks, now, group=group, expected=expected)
        if self.held(handle) is not None and (not self._order or self._order[-1] != handle):
            self._order.append(handle)
        return out

    def sweep(self, now: int, out: list[Effect]) -> None:
        order = self._order
        while order:
            dl = self.deadline(order[0])
            if dl is None:
                order.popleft()
                continue
            if dl > now:
                break  # BUG: the entries behind a renewed lease are never looked at
            self.expire(order.popleft(), now, out)


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


class UnboundedTickConsumer(Consumer):
    """D mutant: the lease check (hook ``sweep_leases``) has no work budget."""

    def sweep_leases(self, now: int, out: list[DEffect], budget: int | None = None) -> None:
        super().sweep_leases(now, out, budget=MAX_CAP)  # BUG: ignores max_tick_work


_OVERDUE = D_TABLE[(READING, D_TICK, "read_overdue")]
# D mutant: an overdue READ's request leaves without quarantine, so its local blocks go
# back to the engine while the transfer may still write them (row change only).
EarlyReleaseConsumer = Consumer.with_rows(
    replace(_OVERDUE, effects=tuple(f for f in _OVERDUE.effects if f.kind != "quarantine")))


# D mutant: a request whose params carry a capability waits (and reads) without
# presenting it and without P's grant (row change only).
ReadBeforeGrantConsumer = Consumer.with_rows(
    replace(D_TABLE[(D_NEW, ADMIT, "claim")], dst=WAITING, effects=(Fx("track"),)),
    replace(D_TABLE[(HANDSHAKING, HANDSHAKE_OK, "claim")], dst=WAITING, effects=()))


class ForgetsEndedConsumer(Consumer):
    """D mutant: the no-second-pull check (hook ``refuses_load``) never refuses."""

    def refuses_load(self, params: TransferParams) -> bool:
        return False  # BUG: a load that ended here is pulled again


@dataclass(frozen=True)
class DMutant:
    name: str
    consumer_cls: type[Consumer]
    bug: str
    caught_by: frozenset[str]  # checks of D journal validation that catch it


D_MUTANTS: dict[str, DMutant] = {m.name: m for m in (
    DMutant("unbounded_tick", UnboundedTickConsumer,
            "D's tick fails every lost lease at once, ignoring max_tick_work",
            frozenset({"TickBounded"})),
    DMutant("early_release", EarlyReleaseConsumer,
            "an overdue READ's local blocks go back to the engine at once (no quarantine)",
            frozenset({"NoQuarantinedReuse"})),
    DMutant("second_pull", ForgetsEndedConsumer,
            "a load of a request that already ended on D is pulled again",
            frozenset({"NoSecondPull"})),
    DMutant("read_before_grant", ReadBeforeGrantConsumer,
            "D reads a handle whose claim P's gate has not granted",
            frozenset({"ReadOnlyGranted"})),
)}


# ---------------------------------------------------------------------------
# Driver mutants: bugs of D's driver (the adapter's half that the simulator and the
# fuzzer run), each overriding one documented hook of ``DDriver``.
# ---------------------------------------------------------------------------


class NoFencingDriver(DDriver):
    """Driver mutant: serves a READ whatever stamps land after it (hook ``_fenced``), so
    a READ that lands late, on blocks P freed and reused meanwhile, is served."""

    def _fenced(self, want: Sequence[int], got: Sequence[int]) -> bool:
        return False  # BUG: the stamps are fetched and never compared


class NoChecksumDriver(DDriver):
    """Driver mutant: never verifies block checksums (hook ``_corrupt``), so with
    ``Config.checksums`` on, a READ that lands corrupted with its stamps unchanged is
    served."""

    def _corrupt(self, want: Sequence[int], got: Sequence[int]) -> list[int]:
        return []  # BUG: the checksums are fetched and never compared


@dataclass(frozen=True)
class DriverMutant:
    name: str
    driver_cls: type[DDriver]
    bug: str
    caught_by: frozenset[str]


DRIVER_MUTANTS: dict[str, DriverMutant] = {m.name: m for m in (
    DriverMutant("no_fencing", NoFencingDriver,
                 "skips the stamp comparison: late READs on reused blocks are served",
                 frozenset({"ServedIntact"})),
    DriverMutant("no_checksum", NoChecksumDriver,
                 "skips the checksum verification: a READ corrupted in flight, stamps "
                 "unchanged, is served", frozenset({"ServedIntact"})),
)}


# ---------------------------------------------------------------------------
# Coverage mutant: D's coverage machine, hook ``part_guard``.
# ---------------------------------------------------------------------------


class DropRegionCoverage(Coverage):
    """Coverage mutant: the part's check forgets its last region (hook ``part_guard``),
    as a READ plan that drops one layer's descriptors and still calls the part read."""

    def part_guard(self, need: Mapping[int, frozenset[Region]], part: int,
                   got: frozenset[Region], read: frozenset[Region], pending: int) -> str:
        mine = need[part]
        kept = mine - {max(mine)} if len(mine) > 1 else mine
        if not kept <= got:  # BUG: the last region of the part is never checked
            return "short"
        return "more_parts" if pending else "all_read"


class OnePartCoverage(Coverage):
    """Coverage mutant: a part read and verified completes the request although other
    parts are pending (hook ``part_guard``), as a join that serves a split request (P
    TP 2 -> D TP 1 with split heads) after one P rank's READ."""

    def part_guard(self, need: Mapping[int, frozenset[Region]], part: int,
                   got: frozenset[Region], read: frozenset[Region], pending: int) -> str:
        if not need[part] <= got:
            return "short"
        return "all_read"  # BUG: the pending parts are not waited for


@dataclass(frozen=True)
class CoverageMutant:
    name: str
    coverage_cls: type[Coverage]
    bug: str
    caught_by: frozenset[str]


COVERAGE_MUTANTS: dict[str, CoverageMutant] = {m.name: m for m in (
    CoverageMutant("drop_region", DropRegionCoverage,
                   "a part whose READ missed one region counts as read: complete with a "
                   "region never read", frozenset({"Coverage"})),
    CoverageMutant("one_part", OnePartCoverage,
                   "a request read from several P ranks completes once one part was "
                   "read: served with the other parts' heads never read",
                   frozenset({"Coverage"})),
)}
