"""Stateful fuzzing of the real P and D machines and drivers through the simulator's
faulty network.

Three layers, all reusable by the tests (``tests/test_fuzz.py``, ``tests/test_mutants.py``)
and by ``kvproto fuzz``:

* ``FuzzSim`` -- a ``Simulator`` subclass in which *nothing* is random: every choice the
  simulator would take from its RNG (which message to deliver, drop or duplicate, when a
  READ transfer lands or fails, whether a handshake reaches P, when D admits transfer
  params...) is an explicit method the fuzzer calls. P and every D rank run the
  production drivers (``PDriver``, ``DDriver``) over the simulated transports, so stamp
  fencing, READ/done/release batching and the handshake bookkeeping are fuzzed with the
  machines. The timing assumptions are enforced, not sampled: a message not delivered,
  dropped or duplicated by ``sent + max_delay`` is delivered then, a READ transfer lands
  by its bound (a data and a stamp transfer fit ``max_read_time``) unless the fuzzer
  made it late (``slow_read``, ``slow_burst``: outside the assumption, where only the
  stamps protect the data), and so do transfer params (``max_delay`` after hand-out) and lagging P
  registrations. The engine overwrites every freed block at once. Under ``checksums`` a
  data READ may land corrupted, stamps unchanged (``corrupt_read``). NoFreeUnderRead is
  checked twice: a free of blocks under a READ started less than ``max_read_time`` ago,
  and a READ that D starts within its lease on blocks freed since P handed them out;
  ServedIntact: every request D serves holds the KV P handed out.
* the oracle -- ``kvproto.verify.oracle.Oracle``, the one oracle of the project, fed
  by ``observed_ledger_class`` (any ``Ledger`` class: the real one, or a mutant from
  ``kvproto.testing.mutants``): around every P event, each request's state change must be a row
  of ``P_TRANSITIONS`` for that event (with the matching ``free:`` effect), plus
  *PromptFree* and *ExpiredFreed* (see that module). The names are re-exported here.
* ``LifecycleMachine`` -- the hypothesis ``RuleBasedStateMachine``: rules for every
  event and fault, invariants after every step, a no-leak teardown. Rules that would do
  nothing in the current state are disabled by a precondition (hypothesis picks uniformly
  among enabled rules), and ``progress``/``drain`` run bursts of natural steps, so deep
  interleavings (D reporting before a lagging registration, a duplicated ``done`` while
  another reader's READ is in flight, a renewed lease next to an unrenewed one) are
  reached within the CI budget (``ci_settings``; see BENCHMARKS.md for the rates).

Invariant names used in failure messages (the mutant tests match on them):
``NoDoubleFree``, ``Conservation``, ``NoFreeUnderRead``, ``ServedIntact``,
``StagingBounded``, ``TombstonesBounded``, ``LegalTransition``, ``LedgerInvariants``,
``PromptFree``, ``ExpiredFreed``, ``NoLeak``.
"""

from __future__ import annotations

import io
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvproto import wire
from kvproto.lifecycle import (
    TERMINAL_STATES,
    UNREGISTERED,
    Config,
    Ledger,
    TransferParams,
    to_ms,
)
from kvproto.nixl.driver_d import DDriver
from kvproto.testing.sim import P_NAME, Simulator
from kvproto.testing.transport import NEVER, Faults, FuzzNetwork, FuzzWorld, Msg, SimXfer
from kvproto.verify.oracle import INVARIANTS as ORACLE_INVARIANTS
from kvproto.verify.oracle import (
    InvariantViolation,
    ObservedLedger,
    Oracle,
    ledger_violations,
    observed_ledger_class,
    safety_violations,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Configurations the fuzzer runs under. Small caps so staging/tombstone/group caps are
# hit; one config where the extension exceeds the initial term.
# ---------------------------------------------------------------------------

CONFIGS: Final[dict[str, Config]] = {
    "default": Config().validate(),
    "tight": Config(initial_lease=8.0, lease_extension=6.0, heartbeat_interval=2.0,
                    abort_grace=8.0, max_delay=0.5, max_read_time=2.0, clock_drift=0.1,
                    max_staged=2, max_staged_age=3.0, max_tombstones=3,
                    max_groups_remembered=2).validate(),
    "long_extension": Config(initial_lease=6.0, lease_extension=10.0, heartbeat_interval=2.0,
                             abort_grace=10.0, max_delay=0.5, max_read_time=2.0,
                             clock_drift=0.1, max_staged=1, max_staged_age=2.0,
                             max_tombstones=2, max_groups_remembered=1).validate(),
    # Block checksums on: the only config in which READs may land corrupted.
    "checksums": Config(checksums=True).validate(),
    # D waits long for a READ (no read_timeout before P's lease can lapse under it): a
    # late READ lands on freed and reused blocks, and the stamp fence alone keeps it out.
    "patient_d": Config(read_grace=120.0).validate(),
}

INVARIANTS: Final = ORACLE_INVARIANTS - {"SpecStep"}
"""Every name an ``InvariantViolation`` raised by the fuzzer can carry."""

ENGINES: Final = (1, 2)  # D0 has one rank, D1 two (two readers per request)
CAPACITY: Final = 24


# ---------------------------------------------------------------------------
# The simulator, with every random choice made explicit.
# ---------------------------------------------------------------------------


@dataclass
class PendingRegister:
    deadline: int  # ms
    handle: int
    rid: str
    blocks: tuple[int, ...]
    group: str | None
    expected: int
    ranks: tuple[str, ...]


@dataclass
class PendingAdmit:
    deadline: int  # ms
    rank: str
    rid: str
    params: TransferParams


class FuzzSim(Simulator):
    """The simulator with explicit choices (see the module docstring). P and every D rank
    run the production drivers; D ranks are polled after every action on them (and, while
    time passes with D ticking, at least every heartbeat interval)."""

    network_cls = FuzzNetwork
    world_cls = FuzzWorld
    net: FuzzNetwork
    world: FuzzWorld
    ledger: ObservedLedger

    def __init__(self, config: Config, *, ledger_cls: type[Ledger] = Ledger,
                 driver_cls: type[DDriver] = DDriver, capacity: int = CAPACITY,
                 engines: tuple[int, ...] = ENGINES, sink: Callable[..., None] | None = None,
                 register_lag: float = 1.0) -> None:
        faults = Faults.none()
        faults.reuse = 1.0  # the engine overwrites every freed block at once
        super().__init__(0, config=config, faults=faults, capacity=capacity, engines=engines,
                         journal=sink, ledger_cls=observed_ledger_class(ledger_cls),
                         driver_cls=driver_cls)
        self.oracle = Oracle(self.config)
        self.ledger.oracle = self.oracle
        self.register_lag = to_ms(register_lag)  # ms
        self.pending_regs: list[PendingRegister] = []
        self.pending_admits: list[PendingAdmit] = []

    # -- queries ----------------------------------------------------------------------------
    def live_ranks(self) -> list[str]:
        return [r for names in self.engine_ranks.values() for r in names if r in self.drivers]

    @property
    def pending_hs(self) -> list[str]:
        """Ranks whose handshake request waits for the fuzzer's answer."""
        return [a.rank for a in sorted(self.world.attempts.values(), key=lambda a: a.seq)
                if a.result is None]

    def waiting(self) -> list[tuple[str, str]]:
        return [(rk, rid) for rk in self.live_ranks()
                for rid, r in sorted(self.drivers[rk].machine.reqs.items())
                if r.state == "waiting"]

    def xfers(self) -> list[SimXfer]:
        """The READs in flight, in posting order."""
        return sorted(self.world.xfers, key=lambda x: x.seq)

    def d_requests(self) -> list[tuple[str, str]]:
        return [(rk, rid) for rk in self.live_ranks()
                for rid in sorted(self.drivers[rk].machine.reqs)]

    def busy(self) -> bool:
        """Anything in flight: held or staged on P, tracked on D, or on its way."""
        return bool(self.ledger.held_requests or self.ledger.staged_count or self.world.xfers
                    or self.net.queue or self.pending_regs or self.pending_admits
                    or self.pending_hs or any(self.drivers[rk].machine.reqs or
                                              self.drivers[rk].reads
                                              for rk in self.live_ranks()))

    def known_handles(self) -> list[tuple[int, str]]:
        """(handle, request id) of every registration the ledger still remembers (live or
        tombstoned): after its tombstone is evicted a handle cannot be told from a fresh
        one (documented; handles are never reused)."""
        return [(h, rid) for h, rid in sorted(self.oracle.registered.items())
                if self.ledger.state(h) != UNREGISTERED]

    # -- P side --------------------------------------------------------------------------
    def hand_out(self, blocks: tuple[int, ...], engine: str, n: int, expected_known: bool,
                 register_now: bool, on_time_mask: int = 0) -> list[str]:
        """Prefill finished: P hands transfer params to D (admitted within max_delay) and
        registers now or, if not ``register_now``, within ``register_lag`` (except sibling
        ``i`` when bit ``i`` of ``on_time_mask`` is set: it registers now)."""
        ranks = tuple(self.engine_ranks[engine])
        self._next_req += 1
        parent = f"req{self._next_req}"
        group = parent if n > 1 else None
        self.world.write([b for b in blocks if self.pool.refcount(b) == 0])  # the prefill
        rids: list[str] = []
        for i in range(n):
            rid = f"{i}_{parent}" if n > 1 else parent
            h = self.ledger.new_handle()
            pr = PendingRegister(self.now + self.register_lag, h, rid, blocks, group,
                                 len(ranks) if expected_known else 0, ranks)
            params = self._hand_out(h, rid, blocks, group, list(ranks))
            for rk in ranks:
                self.pending_admits.append(PendingAdmit(self.now + self.config.ms.max_delay,
                                                        rk, rid, params))
            # The engine pins the blocks from hand-out to registration (a pool pin per
            # sibling).
            self.pool.pin(blocks)
            if register_now or (on_time_mask >> i) & 1:
                self._register_pending(pr)
            else:
                self.pending_regs.append(pr)
            rids.append(rid)
        self.stats.requests += n
        if n > 1:
            self.stats.siblings += n
        return rids

    def _register_pending(self, pr: PendingRegister) -> None:
        self._register(pr.handle, pr.rid, pr.blocks, pr.group, pr.expected, pr.ranks)

    def register_pending(self, i: int) -> None:
        self._register_pending(self.pending_regs.pop(i))

    def free_for_new(self) -> list[int]:
        return self.pool.allocatable_blocks()

    # -- D side --------------------------------------------------------------------------
    def d_poll(self, rank: str) -> None:
        """D rank ``rank`` runs one step of its driver (a no-op once it crashed)."""
        self._d_poll(rank)

    def admit(self, i: int) -> None:
        pa = self.pending_admits.pop(i)
        d = self.drivers.get(pa.rank)
        if d is None:
            return
        d.admit(pa.rid, pa.params)
        self.d_poll(pa.rank)

    def drop_admit(self, i: int) -> None:
        """The router lost the params: this rank never learns of the request."""
        self.pending_admits.pop(i)

    def handshake(self, i: int, ok: bool) -> None:
        rk = self.pending_hs[i]
        self.world.decide(rk, ok)
        self.d_poll(rk)

    def schedule(self, rank: str, rid: str) -> None:
        d = self.drivers.get(rank)
        if d is None:
            return
        d.schedule(rid)
        self.d_poll(rank)

    def complete_read(self, i: int, ok: bool) -> None:
        """READ transfer ``i`` (of ``xfers()``) lands now (``ok``) or fails."""
        x = self.xfers()[i]
        self.world.land(x, ok)
        self.d_poll(x.rank)

    def slow_read(self, i: int) -> None:
        """READ transfer ``i`` (of ``xfers()``) will land late, past ``max_read_time``."""
        self.world.slow(self.xfers()[i])

    def deliver(self, m: Msg) -> None:
        """One message arrives and its destination polls."""
        self.world.deliver(m)
        if m.dst == P_NAME:
            self.p.poll()
        else:
            self.d_poll(m.dst)

    def d_tick(self, rank: str) -> None:
        self.d_poll(rank)

    def abort_d(self, engine: str, rid: str) -> None:
        super().abort_d(engine, rid)
        for rk in self.engine_ranks[engine]:
            self.d_poll(rk)

    def progress_items(self, *, schedule: bool = True) -> int:
        return len(self.pending_admits) + len(self.pending_hs) + \
            (len(self.waiting()) if schedule else 0) + len(self.world.xfers) + \
            len(self.net.queue)

    def progress(self, i: int, *, schedule: bool = True) -> None:
        """Item ``i`` (modulo their number) of: admissions, handshakes (ok), schedules
        (unless not ``schedule``: D's scheduler pulls nothing new), READ transfers landing
        (ok), deliveries."""
        n = self.progress_items(schedule=schedule)
        if not n:
            return
        i %= n
        if i < len(self.pending_admits):
            self.admit(i)
            return
        i -= len(self.pending_admits)
        hs = self.pending_hs
        if i < len(hs):
            self.handshake(i, True)
            return
        i -= len(hs)
        w = self.waiting() if schedule else []
        if i < len(w):
            self.schedule(*w[i])
            return
        i -= len(w)
        if i < len(self.world.xfers):
            self.complete_read(i, True)
            return
        i -= len(self.world.xfers)
        self.deliver(self.net.take(i))

    # -- time ----------------------------------------------------------------------------
    def _next_forced(self) -> int:
        times = [NEVER]
        if self.net.queue:
            times.append(self.net.queue[0].at)
        times.extend(x.end for x in self.world.xfers)
        times.extend(p.deadline for p in self.pending_admits)
        times.extend(p.deadline for p in self.pending_regs)
        times.extend(t for t, _ in self.restarts)
        return min(times)

    def _run_forced(self, d_ticks: bool) -> None:
        now = self.now
        for pr in [p for p in self.pending_regs if p.deadline <= now]:
            self.pending_regs.remove(pr)
            self._register_pending(pr)
        while self.restarts and self.restarts[0][0] <= now:
            _, old = self.restarts.pop(0)
            self._restart(old)
        for pa in [p for p in self.pending_admits if p.deadline <= now]:
            self.pending_admits.remove(pa)
            d = self.drivers.get(pa.rank)
            if d is not None:
                d.admit(pa.rid, pa.params)
        self.world.run_due(now)  # messages into the inboxes, READs landing
        self.p.poll()
        if d_ticks:
            for rk in self.live_ranks():
                self.d_poll(rk)

    def advance(self, dt: int, *, d_ticks: bool = True) -> None:
        """Let ``dt`` milliseconds pass. Events the timing assumptions force (deliveries,
        READ landings, admissions, registrations, restarts) happen at their forced times;
        with ``d_ticks`` every D rank polls then and at least every heartbeat interval,
        without it the D ranks are stalled (they read their inboxes later)."""
        target = self.now + max(0, dt)
        while True:
            nxt = self._next_forced()
            if d_ticks:
                nxt = min(nxt, self.now + self.config.ms.heartbeat_interval)
            if nxt > target:
                break
            self.now = max(self.now, nxt)
            self._run_forced(d_ticks)
        self.now = target
        self._run_forced(d_ticks)

    def settle(self) -> None:
        """End of a run: resolve everything D still has, then let every lease, grace and
        staging age run out."""
        cfg = self.config.ms
        for _ in range(64):
            while self.pending_hs:
                self.handshake(0, True)
            while self.pending_regs:
                self.register_pending(0)
            while self.pending_admits:
                self.admit(0)
            for rk, rid in self.waiting():
                self.schedule(rk, rid)
            if not (self.d_requests() or self.world.xfers or self.net.queue or self.pending_hs
                    or self.pending_admits):
                break
            self.advance(cfg.max_read_time // 2 + cfg.max_delay)
        horizon = max(cfg.lease_horizon, cfg.abort_grace) + cfg.max_staged_age + \
            cfg.max_read_time + 4 * cfg.max_delay + 1000
        self.advance(horizon)


# ---------------------------------------------------------------------------
# The hypothesis state machine.
# ---------------------------------------------------------------------------

_IDX = st.integers(min_value=0, max_value=255)


class FuzzCounters:
    """Global progress counters (examples started, state-machine steps run) and what the
    examples exercised, summed at each teardown: ``coverage`` counts P transitions
    (``"register: unregistered -> registered"``), faults (``"fault:lost"``...), D
    outcomes (``"d:done"``, ``"d:failed:..."``), and the counters of the ledger
    (``"p:..."``), of the D drivers (``"driver:..."``) and of the P driver
    (``"pdriver:..."``)."""

    examples = 0
    steps = 0
    progress: Callable[[], None] | None = None
    coverage: ClassVar[Counter[str]] = Counter()

    @classmethod
    def reset(cls) -> None:
        cls.examples = cls.steps = 0
        cls.coverage = Counter()


class LifecycleMachine(RuleBasedStateMachine):
    """Drives the real P ledger and D consumers (or a mutant ledger) through FuzzSim.

    Parameterise with ``machine_class(ledger_cls, ...)``.
    """

    LEDGER_CLS: ClassVar[type[Ledger]] = Ledger
    DRIVER_CLS: ClassVar[type[DDriver]] = DDriver
    CONFIG_NAMES: ClassVar[tuple[str, ...]] = tuple(CONFIGS)
    JOURNAL: ClassVar[bool] = False
    DISABLED: ClassVar[frozenset[str]] = frozenset()  # invariants not checked
    last_journal: ClassVar[io.StringIO | None] = None
    _JOURNAL_OWNER: ClassVar[type[LifecycleMachine] | None] = None  # set by run_fuzz(seed=)

    def __init__(self) -> None:
        super().__init__()
        FuzzCounters.examples += 1
        self.sim = self._make(CONFIGS[self.CONFIG_NAMES[0]])

    def _make(self, config: Config) -> FuzzSim:
        sink = None
        if self.JOURNAL:
            from kvproto.journal import JournalWriter

            buf = io.StringIO()
            writer = JournalWriter(buf, config, CAPACITY,
                                   {"source": "fuzz", "ledger": self.LEDGER_CLS.__name__})
            owner = type(self)._JOURNAL_OWNER or type(self)
            owner.last_journal = buf
            sink = writer.sink
        return FuzzSim(config, ledger_cls=self.LEDGER_CLS, driver_cls=self.DRIVER_CLS,
                       sink=sink)

    @initialize(name=st.sampled_from(list(CONFIGS)))
    def choose_config(self, name: str) -> None:
        if name in self.CONFIG_NAMES:
            self.sim = self._make(CONFIGS[name])

    # -- helpers ----------------------------------------------------------------------
    @property
    def cfg(self) -> Config:
        return self.sim.config

    # -- P: register ---------------------------------------------------------------------
    @rule(engine=st.sampled_from([f"D{i}" for i in range(len(ENGINES))]),
          nblocks=st.integers(1, 4), start=_IDX, siblings=st.sampled_from([1, 1, 2, 3]),
          expected_known=st.booleans(), register_now=st.booleans(), share=st.booleans(),
          share_idx=_IDX, on_time_mask=st.integers(0, 7))
    def register(self, engine: str, nblocks: int, start: int, siblings: int,
                 expected_known: bool, register_now: bool, share: bool, share_idx: int,
                 on_time_mask: int) -> None:
        """Hand out params and register (shared blocks, sibling groups, expected readers
        known at once or announced by D later, registration lagging the params)."""
        sim = self.sim
        free = sim.free_for_new()
        if len(free) < nblocks:
            return
        k = start % len(free)
        blocks = tuple((free[k:] + free[:k])[:nblocks])
        live = sim.ledger.live_handles()
        if share and live:  # prefix sharing with a held request
            other = sim.ledger.blocks_of(live[share_idx % len(live)]) or ()
            extra = other[share_idx % len(other)]
            if extra not in blocks:
                blocks = (*blocks, extra)
        sim.hand_out(blocks, engine, siblings, expected_known, register_now, on_time_mask)

    # Rules that would do nothing in the current state have a precondition, so that the
    # steps go to rules that do something (hypothesis picks uniformly among the enabled).
    @precondition(lambda self: bool(self.sim.oracle.registered))
    @rule(i=_IDX, same_rid=st.booleans())
    def register_duplicate(self, i: int, same_rid: bool) -> None:
        """An adapter bug: register a known handle (or a known request id under a fresh
        handle). The table says: rejected, nothing changes."""
        sim = self.sim
        known = sim.known_handles()
        if not known:
            return
        h, rid = known[i % len(known)]
        free = sim.free_for_new()
        blocks = tuple(free[:1])
        if same_rid:
            sim._p_effects(sim.ledger.register(sim.ledger.new_handle(), rid, blocks, sim.now))
        else:
            sim._p_effects(sim.ledger.register(h, f"dup-{rid}", blocks, sim.now))

    @precondition(lambda self: bool(self.sim.pending_regs))
    @rule(i=_IDX)
    def register_late(self, i: int) -> None:
        self.sim.register_pending(i % len(self.sim.pending_regs))

    @precondition(lambda self: bool(self.sim.oracle.registered or self.sim.pending_regs))
    @rule(i=_IDX, known=st.booleans())
    def abort_p(self, i: int, known: bool) -> None:
        rids = sorted(self.sim.oracle.registered.values())
        if known and rids:
            self.sim.abort_p(rids[i % len(rids)])
        else:
            self.sim.abort_p(f"unknown-{i}")

    # -- D -------------------------------------------------------------------------------
    @precondition(lambda self: self.sim.progress_items() > 0)
    @rule(picks=st.lists(_IDX, min_size=1, max_size=8))
    def progress(self, picks: list[int]) -> None:
        """A burst of natural steps, one per pick, each of any one item: admit params, a
        successful handshake, schedule a waiting request, complete a READ, deliver a
        message. No time passes. (Each also has its own rule with the faulty
        alternatives; this one keeps long happy paths -- and D running ahead of a lagging
        registration -- likely within a few rule steps.) The safety checks run after
        every sub-step."""
        for i in picks:
            if not self.sim.progress_items():
                break
            self.sim.progress(i)
            self.check_safety()

    @precondition(lambda self: self.sim.progress_items() > 0)
    @rule(i=_IDX, schedule=st.booleans())
    def drain(self, i: int, schedule: bool) -> None:
        """Natural steps until nothing is left that needs no time to pass (at most 64):
        with a registration lagging, D admits, reads and reports before P registers --
        the early-notification race. Without ``schedule`` D's scheduler pulls nothing new
        (admitted requests stay queued, heartbeated as time passes). The safety checks
        run after every sub-step."""
        for k in range(64):
            if not self.sim.progress_items(schedule=schedule):
                break
            self.sim.progress(i + k, schedule=schedule)
            self.check_safety()

    @precondition(lambda self: bool(self.sim.pending_admits))
    @rule(i=_IDX)
    def admit(self, i: int) -> None:
        self.sim.admit(i % len(self.sim.pending_admits))

    @precondition(lambda self: bool(self.sim.pending_hs))
    @rule(i=_IDX, ok=st.booleans())
    def handshake(self, i: int, ok: bool) -> None:
        self.sim.handshake(i % len(self.sim.pending_hs), ok)

    @precondition(lambda self: bool(self.sim.waiting()))
    @rule(i=_IDX)
    def schedule(self, i: int) -> None:
        w = self.sim.waiting()
        self.sim.schedule(*w[i % len(w)])

    @precondition(lambda self: bool(self.sim.world.xfers))
    @rule(i=_IDX, ok=st.sampled_from([True, True, False]))
    def complete_read(self, i: int, ok: bool) -> None:
        """A READ transfer (data or stamps) lands, or fails."""
        self.sim.complete_read(i % len(self.sim.world.xfers), ok)

    @precondition(lambda self: bool(self.sim.world.xfers))
    @rule(i=_IDX, stall=st.booleans())
    def slow_read(self, i: int, stall: bool) -> None:
        """A READ transfer will land late, past max_read_time (outside the timing
        assumption): P may free and reuse its blocks meanwhile; the stamps must fence it.
        With ``stall`` the D ranks hang with it (no heartbeat) until P's leases ran out."""
        self.sim.slow_read(i % len(self.sim.world.xfers))
        if stall:
            ms = self.cfg.ms
            self.sim.advance(ms.lease_horizon + ms.max_read_time + 2 * ms.max_delay,
                             d_ticks=False)

    @precondition(lambda self: self.cfg.checksums)
    @rule(i=_IDX)
    def corrupt_read(self, i: int) -> None:
        """A data READ (one in flight, else the next posted) will land with a block's
        bytes changed, stamps unchanged (a NIC or backend fault): only the block
        checksums can fence it."""
        data = [x for x in self.sim.xfers() if not x.stamps]
        if data:
            data[i % len(data)].corrupt = True
        else:
            self.sim.world.corrupt_next += 1

    @precondition(lambda self: bool(self.sim.d_requests()))
    @rule(i=_IDX)
    def abort_d(self, i: int) -> None:
        reqs = self.sim.d_requests()
        rk, rid = reqs[i % len(reqs)]
        engine = rk.split(".", 1)[0]
        self.sim.abort_d(engine, rid)

    @precondition(lambda self: self.sim.busy())
    @rule(i=_IDX)
    def d_tick(self, i: int) -> None:
        ranks = self.sim.live_ranks()
        if ranks:
            self.sim.d_tick(ranks[i % len(ranks)])

    @precondition(lambda self: self.sim.busy() and len(self.sim.live_ranks()) > 0)
    @rule(i=_IDX)
    def crash_d(self, i: int) -> None:
        ranks = self.sim.live_ranks()
        self.sim.crash(ranks[i % len(ranks)])

    # -- time ----------------------------------------------------------------------------
    @precondition(lambda self: self.sim.busy())
    @rule(frac=st.sampled_from([0.0, 0.01, 0.1, 0.25, 0.5, 1.0, 1.5, 3.0]),
          d_ticks=st.booleans())
    def advance(self, frac: float, d_ticks: bool) -> None:
        """Tick by an arbitrary amount: a fraction of the shortest lease term."""
        ms = self.cfg.ms
        self.sim.advance(round(frac * min(ms.initial_lease, ms.lease_extension)),
                         d_ticks=d_ticks)

    @precondition(lambda self: self.sim.busy())
    @rule(dt=st.floats(min_value=0.0, max_value=2.0, allow_nan=False))
    def advance_by_delay(self, dt: float) -> None:
        """Let up to two message delays pass (no D tick)."""
        self.sim.advance(round(dt * self.cfg.ms.max_delay), d_ticks=False)

    @precondition(lambda self: self.sim.ledger.next_deadline() is not None)
    @rule(offset=st.sampled_from([-1, 0, 1]))
    def advance_to_deadline(self, offset: int) -> None:
        """Land exactly on (or one ms around) P's next deadline: boundary conditions."""
        nd = self.sim.ledger.next_deadline()
        assert nd is not None
        self.sim.advance(max(0, nd + offset - self.sim.now), d_ticks=False)

    # -- network faults ----------------------------------------------------------------
    @precondition(lambda self: bool(self.sim.net.queue))
    @rule(i=_IDX)
    def deliver(self, i: int) -> None:
        """Deliver any pending message now (any order: reordering)."""
        q = self.sim.net
        self.sim.deliver(q.take(i % len(q.queue)))

    @precondition(lambda self: bool(self.sim.net.queue))
    @rule(i=_IDX)
    def drop(self, i: int) -> None:
        q = self.sim.net
        q.take(i % len(q.queue))
        q.lost += 1

    @precondition(lambda self: bool(self.sim.net.queue))
    @rule(i=_IDX)
    def duplicate(self, i: int) -> None:
        q = self.sim.net
        q.duplicate(i % len(q.queue))

    @precondition(lambda self: self.sim.busy())
    @rule(n=st.integers(min_value=1, max_value=6))
    def duplicate_burst(self, n: int) -> None:
        """The next ``n`` messages sent (by anyone) are each delivered twice."""
        self.sim.net.dup_next = n

    @precondition(lambda self: self.sim.busy())
    @rule(n=st.integers(min_value=1, max_value=3))
    def loss_burst(self, n: int) -> None:
        """The next ``n`` messages sent (by anyone) are lost."""
        self.sim.net.drop_next = n

    @precondition(lambda self: self.sim.busy())
    @rule(n=st.integers(min_value=1, max_value=3))
    def slow_burst(self, n: int) -> None:
        """The next ``n`` READ transfers posted (by any rank) land late, past
        max_read_time: a stalled link."""
        self.sim.world.slow_next = n

    @precondition(lambda self: bool(self.sim.pending_admits))
    @rule(i=_IDX)
    def drop_params(self, i: int) -> None:
        self.sim.drop_admit(i % len(self.sim.pending_admits))

    @precondition(lambda self: self.sim.busy())
    @rule(kind=st.sampled_from(["random", "header", "truncated", "epoch"]),
          data=st.binary(max_size=24), src_idx=_IDX, to_d=st.booleans())
    def malformed(self, kind: str, data: bytes, src_idx: int, to_d: bool) -> None:
        """Bad bytes into P's inbox, or (``to_d``) into a D rank's as if from P: each
        side's port must reject them (counted, journaled) and change nothing."""
        sim = self.sim
        if kind == "header":
            data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, 1 + src_idx % 5, sim.epoch) + data
        elif kind == "truncated" and sim.net.queue:
            m = sim.net.queue[src_idx % len(sim.net.queue)]
            data = m.data[: max(0, len(m.data) - 1 - len(data) % 4)]
        elif kind == "epoch":
            data = wire.encode_done((sim.epoch + 1 + src_idx) & 0xFFFFFFFF, 1 + src_idx, 1)
        try:
            wire.decode(data, max_bytes=sim.config.max_message_bytes, epoch=sim.epoch)
        except wire.WireError:
            ranks = sim.live_ranks()
            if to_d and ranks:
                rk = ranks[src_idx % len(ranks)]
                sim.inject_malformed_d(rk, data)
                sim.d_poll(rk)
                return
            # Mostly from a peer P knows (so the bytes reach the decoder), sometimes from
            # a stranger.
            peers = sorted(sim.known_peers)
            src = peers[src_idx % len(peers)] if peers and src_idx % 4 else "stranger"
            sim.stats.malformed += 1
            sim.p_receive(src, data)
        # else: the bytes happen to be a valid message; injecting it would forge a report

    # -- invariants ------------------------------------------------------------------------
    def _raise_first(self) -> None:
        sim = self.sim
        for v in (*sim.violations, *sim.oracle.violations):
            if v.invariant not in self.DISABLED:
                raise v

    @invariant()
    def safety(self) -> None:
        FuzzCounters.steps += 1
        if FuzzCounters.progress is not None:
            FuzzCounters.progress()
        self.check_safety()

    def check_safety(self) -> None:
        """The safety invariants (and any violation the oracle or the simulator recorded)."""
        sim = self.sim
        first = safety_violations(sim.pool, sim.ledger, ledger_invariants=False)
        if first:
            raise first[0]
        self._raise_first()
        for v in ledger_violations(sim.ledger):
            raise v

    def _record_coverage(self) -> None:
        sim = self.sim
        cov = FuzzCounters.coverage
        for (src, event, dst), n in sim.oracle.transitions.items():
            cov[f"{event}: {src} -> {dst}"] += n
        st_ = sim.stats
        for name, n in (("lost", sim.net.lost), ("duplicated", sim.net.duplicated),
                        ("crashes", st_.crashes), ("aborts_p", st_.aborts_p),
                        ("aborts_d", st_.aborts_d), ("malformed", st_.malformed),
                        ("malformed_d", st_.malformed_d), ("siblings", st_.siblings),
                        ("reused", st_.reused)):
            cov[f"fault:{name}"] += n
        cov["d:done"] += st_.completed
        for reason, n in st_.failed.items():
            cov[f"d:failed:{reason}"] += n
        for name, n in sim.ledger.counters.items():
            cov[f"p:{name}"] += n
        for ds in (sim.drivers, sim.dead):
            for d in ds.values():
                for name, n in d.counters.items():
                    cov[f"driver:{name}"] += n
        for name, n in sim.p.counters.items():
            cov[f"pdriver:{name}"] += n

    def teardown(self) -> None:
        sim = self.sim
        self._raise_first()
        sim.settle()
        self._record_coverage()
        self._raise_first()
        L = sim.ledger
        leaks: list[str] = []
        if sim.pool.held_count or L.held_requests:
            leaks.append(f"{L.held_requests} requests / {sim.pool.held_count} blocks held")
        if L.staged_count:
            leaks.append(f"{L.staged_count} staged entries")
        for h in sim.oracle.registered:
            s = sim.oracle.state(L, h)
            if s not in TERMINAL_STATES:
                leaks.append(f"handle {h} in {s}")
        for rk, rid in sim.d_requests():
            leaks.append(f"D {rk} still tracks {rid} ({sim.drivers[rk].state(rid)})")
        if sim.world.xfers or sim.net.queue:
            leaks.append(f"{len(sim.world.xfers)} READs / {len(sim.net.queue)} messages "
                         "pending")
        for v in ledger_violations(L):
            raise v
        if leaks:
            raise InvariantViolation("NoLeak", "after settling: " + "; ".join(leaks[:8]))


def machine_class(ledger_cls: type[Ledger] = Ledger, *,
                  configs: Sequence[str] | None = None, journal: bool = False,
                  disabled: Iterable[str] = (),
                  driver_cls: type[DDriver] = DDriver) -> type[LifecycleMachine]:
    """A ``LifecycleMachine`` subclass over ``ledger_cls`` (a mutant, or the real one) and
    the D driver ``driver_cls`` (likewise), fuzzing under ``configs`` (names in
    ``CONFIGS``), with the ``disabled`` oracle invariants not checked (to show which other
    check catches a mutant)."""
    names = tuple(configs) if configs else tuple(CONFIGS)
    for n in names:
        if n not in CONFIGS:
            raise ValueError(f"unknown fuzz config {n!r} (known: {', '.join(CONFIGS)})")
    attrs: dict[str, Any] = {"LEDGER_CLS": ledger_cls, "DRIVER_CLS": driver_cls,
                             "CONFIG_NAMES": names, "JOURNAL": journal,
                             "DISABLED": frozenset(disabled)}
    suffix = "" if driver_cls is DDriver else "_" + driver_cls.__name__
    return type(f"LifecycleMachine_{ledger_cls.__name__}{suffix}", (LifecycleMachine,), attrs)


# ---------------------------------------------------------------------------
# Budgets.
# ---------------------------------------------------------------------------

CI_EXAMPLES: Final = 1000
CI_STEPS: Final = 40


def ci_settings(max_examples: int = CI_EXAMPLES, steps: int = CI_STEPS) -> settings:
    """Deterministic, database-free settings for CI (derandomized). No explain phase: it
    traces every line while shrinking, which made shrinking a failure take minutes."""
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                    derandomize=True, database=None, print_blob=False,
                    report_multiple_bugs=False,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target,
                            Phase.shrink],
                    suppress_health_check=list(HealthCheck))


def run_fuzz(machine: type[LifecycleMachine], stg: settings, seed: int | None = None) -> None:
    """Run ``machine`` under ``stg``; raise on the first (shrunk) failure.

    With ``seed`` the run is reproducible (hypothesis ``@seed``, set on a fresh subclass so
    ``machine`` itself is untouched); the example-database key stays the machine's name,
    so failures saved for one ledger are replayed only for that ledger. The journal of
    the last example run (with ``JOURNAL``: the failing one, after a failure) is in
    ``machine.last_journal``."""
    factory: type[LifecycleMachine] = machine
    if seed is not None:
        factory = type(machine.__name__, (machine,), {"_JOURNAL_OWNER": machine})
        hypothesis_seed(seed)(factory)
    run_state_machine_as_test(factory, settings=stg)


# ---------------------------------------------------------------------------
# CLI: kvproto fuzz
# ---------------------------------------------------------------------------


__all__ = [
    "CONFIGS",
    "INVARIANTS",
    "FuzzSim",
    "InvariantViolation",
    "LifecycleMachine",
    "ObservedLedger",
    "Oracle",
    "ci_settings",
    "machine_class",
    "observed_ledger_class",
    "run_fuzz",
]
