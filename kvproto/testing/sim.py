"""Deterministic simulator: one P rank, several D engines (each with one or more ranks),
and a faulty network carrying the real encoded bytes.

The simulator runs the production drivers (``kvproto.nixl.driver_p.PDriver``,
``kvproto.nixl.driver_d.DDriver``) over the simulated transports of
:mod:`kvproto.testing.transport`: receiving through the ports, stamp fencing, READ, done
and release batching and the handshake bookkeeping are the drivers' own, and every
lifecycle decision stays in ``kvproto.lifecycle``. What the simulator adds is the
engine (requests arriving, registrations lagging their params, aborts, D's scheduler)
and the faults, and it checks after every step:

* the pool and ledger safety invariants (the oracle's ``safety_violations``);
* *NoFreeUnderRead* -- P reclaims a block under a READ that started less than
  ``max_read_time`` ago, or D starts a READ (within its lease) on blocks P freed since it
  handed them out;
* *ServedIntact* -- every request a D rank serves as pulled holds, in its local blocks,
  exactly the KV P handed out (the drivers' stamp fencing is what keeps this true when a
  READ lands late on reused blocks);

and after the drain the liveness property *NoLeak* (P holds nothing, no live D rank
tracks a request). It measures stranded block-seconds. Its clock (``now``, the world's)
is the machines' time, integer milliseconds; its knobs (``dt``, durations, ``Faults``)
are seconds, turned into milliseconds once.

Faults (``Faults``): message loss, duplication, reordering, delay, handshake failures,
partitions, D rank crashes, READs landing late, stamps changed by reuse, aborts on P and
on D, malformed bytes into P's and D's inboxes, and (with block checksums on,
``--checksums``) data READs landing corrupted with their stamps unchanged. ``kvproto simulate`` draws each seed's
own mix (``Faults.swarm``).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import logging
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar, Final

from kvproto import wire
from kvproto.lifecycle import (
    HELD_STATES,
    BlockPool,
    Config,
    Consumer,
    Effect,
    Free,
    Ledger,
    TransferParams,
    to_ms,
)
from kvproto.nixl.driver_d import Completion, DDriver
from kvproto.nixl.driver_p import PDriver
from kvproto.testing.transport import (
    Faults,
    Msg,
    Network,
    SimDTransport,
    SimPTransport,
    World,
)
from kvproto.verify.oracle import InvariantViolation, ledger_violations, safety_violations

log = logging.getLogger(__name__)

P_NAME = "P0"
LIVENESS: Final = frozenset({"NoLeak"})  # the violations that are liveness failures

# ``kvproto simulate`` exit codes beyond the CLI's own (0 ok, 2 usage): one per kind of
# finding, the first that applies in this order.
EXIT_SAFETY: Final = 1
EXIT_CRASH: Final = 6
EXIT_LIVENESS: Final = 7

__all__ = ["EXIT_CRASH", "EXIT_LIVENESS", "EXIT_SAFETY", "LIVENESS", "P_NAME", "Faults", "Msg",
           "Network", "Read", "Simulator", "Stats", "simulate_many"]


@dataclass
class Read:
    """A READ some D rank has in flight (a view of its driver's)."""

    reader: str
    rid: str
    handle: int
    blocks: tuple[int, ...]
    gens: tuple[int, ...]
    start: int  # ms
    end: int


@dataclass
class Stats:
    requests: int = 0
    siblings: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    admission_blocked: int = 0
    crashes: int = 0
    partitions: int = 0
    aborts_p: int = 0
    aborts_d: int = 0
    malformed: int = 0
    malformed_d: int = 0
    reused: int = 0
    stranded_block_seconds: float = 0.0
    violations: list[str] = field(default_factory=list)


class Simulator:
    """One P rank and D engines. ``step()`` advances time by ``dt`` (seconds, whole ms)
    and runs everything due.

    ``ledger_cls`` and ``driver_cls`` replace the machine of P and the driver of every D
    rank (a mutant, or an observed one)."""

    network_cls: ClassVar[type[Network]] = Network
    world_cls: ClassVar[type[World]] = World

    def __init__(self, seed: int = 0, *, config: Config | None = None,
                 faults: Faults | None = None, capacity: int = 512,
                 engines: tuple[int, ...] = (1, 2, 1), dt: float = 0.1,
                 arrival_rate: float = 2.0, max_queue: float = 20.0,
                 journal: Callable[..., None] | None = None,
                 ledger_cls: type[Ledger] = Ledger,
                 driver_cls: type[DDriver] = DDriver) -> None:
        self.rng = random.Random(seed)
        self.config = (config or Config()).validate()
        self.faults = faults if faults is not None else Faults()
        self.dt_ms = max(1, to_ms(dt))
        self.dt = self.dt_ms / 1000
        self.arrival_rate = arrival_rate  # requests per simulated second
        self.max_queue = max_queue  # D may queue a request this long before pulling it
        self.epoch = self.rng.randrange(1, 1 << 32)
        self.capacity = capacity
        max_delay = self.faults.max_delay if self.faults.max_delay is not None \
            else self.config.max_delay
        self.net = self.network_cls(self.rng, self.faults, to_ms(max_delay))
        self.world = self.world_cls(self.rng, self.faults, self.config, self.net, capacity)
        self.p = PDriver(P_NAME, self.config, SimPTransport(self.world, P_NAME, capacity),
                         num_blocks=capacity, epoch=self.epoch, clock=self._clock,
                         sink=journal, strict_pool=False, observer=self._observe,
                         ledger_cls=ledger_cls)
        self.pool: BlockPool = self.p.pool
        self.ledger: Ledger = self.p.ledger
        self.driver_cls = driver_cls
        self.drivers: dict[str, DDriver] = {}  # live D ranks
        self.dead: dict[str, DDriver] = {}  # crashed ones (their READs still run out)
        self.engine_ranks: dict[str, list[str]] = {}
        for e, nranks in enumerate(engines):
            names = [f"D{e}.r{k}" for k in range(nranks)]
            self.engine_ranks[f"D{e}"] = names
            for n in names:
                self._new_rank(n)
        self.agenda: list[tuple[int, int, str, str]] = []  # (time, seq, rank, what)
        self._aseq = 0
        self._next_req = 0
        self.stats = Stats()
        self.violations: list[InvariantViolation] = []  # the records behind stats.violations
        self.holders: dict[int, set[str]] = {}  # handle -> D ranks that may still pull it
        self.p_agenda: list[tuple[int, int, str, tuple[int, ...], str | None, int,
                                  tuple[str, ...]]] = []
        self.restarts: list[tuple[int, str]] = []
        self.incarnation: dict[str, int] = {}
        # What P handed out per request id: the writes its blocks held and how often
        # each block had been freed (reclaimed while not pinned) by then.
        self.expect: dict[str, tuple[int, ...]] = {}
        self.freed = [0] * capacity
        self.freed_at: dict[str, tuple[int, ...]] = {}
        self._read_seen: set[tuple[str, str]] = set()

    # -- helpers -----------------------------------------------------------------------
    def _clock(self) -> float:
        """The drivers' clock: the world's time in seconds (their ``now_ms`` reads back
        exactly ``now``)."""
        return self.world.now / 1000

    @property
    def now(self) -> int:
        """The world's time, ms."""
        return self.world.now

    @now.setter
    def now(self, t: int) -> None:
        self.world.now = t

    @property
    def ranks(self) -> dict[str, Consumer]:
        """Every live D rank's machine."""
        return {n: d.machine for n, d in self.drivers.items()}

    @property
    def crashed(self) -> set[str]:
        return set(self.dead)

    @property
    def known_peers(self) -> set[str]:
        """The D ranks P has handshaken with."""
        return set(self.p.peers)

    @property
    def reads(self) -> dict[tuple[str, str], Read]:
        """Every READ in flight, of live and crashed ranks."""
        mrt = self.config.ms.max_read_time
        return {(n, rid): Read(n, rid, rd.params.handle, tuple(rd.remote), tuple(rd.gens),
                               rd.started, rd.started + mrt)
                for ds in (self.drivers, self.dead) for n, d in ds.items()
                for rid, rd in d.reads.items()}

    def _tick_seq(self) -> int:
        self._aseq += 1
        return self._aseq

    def _violation(self, invariant: str, detail: str) -> None:
        v = InvariantViolation(invariant, detail)
        log.error("violation at t=%.3f: %s", self.now / 1000, v)
        self.violations.append(v)
        self.stats.violations.append(f"t={self.now / 1000:.3f} {v}")

    def _new_rank(self, name: str) -> DDriver:
        t = SimDTransport(self.world, name, self.capacity, self.p.transport.layout())
        d = self.driver_cls(name, self.config, t, clock=self._clock)
        d.add_engine(P_NAME, "sim", 0)
        self.drivers[name] = d
        return d

    # -- P side: the P driver, and what the engine sees of its effects ------------------
    def p_receive(self, src: str, data: bytes) -> None:
        """Bytes from ``src`` reach P's inbox and P polls (they go through its port)."""
        self.world.inbox.setdefault(P_NAME, []).append((src, data))
        self.p.poll()

    def _p_effects(self, effects: list[Effect]) -> None:
        """The P driver carries out ``effects`` (as if its ledger had produced them)."""
        self.p.execute(effects, self.now)

    def _observe(self, e: Effect, now: int) -> None:
        if isinstance(e, Free):
            self._on_free(e)

    def _on_free(self, eff: Free) -> None:
        # The engine still pins blocks it handed out for a registration that lags: the
        # lifecycle dropped its hold, but those blocks are not reused.
        reclaimed = [b for b in eff.reclaimed if not self.pool.pinned(b)]
        if reclaimed:
            for b in reclaimed:
                self.freed[b] += 1
            mrt = self.config.ms.max_read_time
            gone = set(reclaimed)
            for ds in (self.drivers, self.dead):
                for n, d in ds.items():
                    for rd in d.reads.values():
                        if self.now - rd.started < mrt and gone.intersection(rd.remote):
                            self._violation(
                                "NoFreeUnderRead", f"handle {eff.handle} ({eff.reason}) "
                                f"freed blocks under {n}'s READ of handle "
                                f"{rd.params.handle}, started {(self.now - rd.started) / 1000:.3f}s ago")
            f = self.faults
            if f.reuse and self.rng.random() < f.reuse:
                self.world.write(reclaimed)  # the engine reuses them at once
                self.stats.reused += 1
        self.holders.pop(eff.handle, None)

    def _hand_out(self, h: int, rid: str, blocks: tuple[int, ...], group: str | None,
                  ranks: list[str]) -> TransferParams:
        """P hands D the params of one request: what its blocks hold is remembered."""
        self.expect[rid] = tuple(self.world.content[b] for b in blocks)
        self.freed_at[rid] = tuple(self.freed[b] for b in blocks)
        return TransferParams(P_NAME, self.epoch, h, blocks, self.config.ms.initial_lease,
                              expected=len(ranks), group=group,
                              generations=self.p.stamps(blocks))

    def new_request(self, n: int = 1, engine: str | None = None) -> list[str]:
        """Prefill finished on P: register (n siblings sharing blocks), hand params to D."""
        nblocks = self.rng.randint(1, 8)
        alloc = self.p.allocate(nblocks)
        if alloc is None:
            self.stats.admission_blocked += 1
            return []
        self.world.write(alloc)  # the prefill's KV
        blocks = tuple(alloc)
        # prefix sharing: sometimes reuse a held block from another request
        live = self.ledger.live_handles()
        if live and self.rng.random() < 0.3:
            other = self.ledger.blocks_of(self.rng.choice(live)) or ()
            extra = self.rng.choice(other)
            if extra not in blocks:
                blocks = (*blocks, extra)
        engine = engine or self.rng.choice(list(self.engine_ranks))
        ranks = self.engine_ranks[engine]
        self._next_req += 1
        parent = f"cmpl-{self._next_req}:x,y"  # ids may contain ':' and ','
        group = parent if n > 1 else None
        rids = []
        for i in range(n):
            rid = f"{i}_{parent}" if n > 1 else parent
            h = self.ledger.new_handle()
            # P may not know its readers: announce them from D half of the time.
            expected = len(ranks) if self.rng.random() < 0.5 else 0
            # The early-notification race: P's registration may lag the params it already
            # handed out (scheduler vs worker), so D's messages can arrive first.
            lag = round(self.rng.uniform(0, 1000)) if self.rng.random() < self.faults.register_lag \
                else 0
            self.p_agenda.append((self.now + lag, h, rid, blocks, group, expected, tuple(ranks)))
            # P holds the blocks from the moment it hands out params: one engine pin per
            # sibling until its registration, so they are not handed out meanwhile.
            self.pool.pin(blocks)
            params = self._hand_out(h, rid, blocks, group, ranks)
            delay = round(self.rng.uniform(0, self.net.max_delay))
            for rk in ranks:
                self._aseq += 1
                heapq.heappush(self.agenda, (self.now + delay, self._aseq, rk,
                                             "admit\0" + rid + "\0" + json.dumps(params.to_dict())))
            rids.append(rid)
        self.pool.unpin(alloc)  # the allocation's own pin: the siblings' pins hold them
        self.stats.requests += n
        if n > 1:
            self.stats.siblings += n
        return rids

    def _register(self, h: int, rid: str, blocks: tuple[int, ...], group: str | None,
                  expected: int, ranks: tuple[str, ...]) -> None:
        """P's worker registers a request it handed out (its pin goes to the ledger)."""
        self.p.register(rid, blocks, group=group, expected=expected, handle=h)
        if self.ledger.state(h) in HELD_STATES:
            self.holders[h] = {r for r in ranks if r in self.drivers}

    # -- D side: the D drivers, and what the engine does with their completions ---------
    def _d_poll(self, rank: str) -> None:
        d = self.drivers.get(rank)
        if d is None:
            return
        for c in d.poll():
            self._completed(rank, d, c)
        self._check_reads(rank, d)

    def _check_reads(self, rank: str, d: DDriver) -> None:
        """A READ D starts within its lease must find the blocks P handed out unfreed."""
        for rid, rd in d.reads.items():
            key = (rank, rid)
            if key in self._read_seen:
                continue
            self._read_seen.add(key)
            if d.quarantined(rid):
                # First seen only after D gave up on it (posted long before, overdue,
                # never served): its start was not observed here, so nothing to judge.
                continue
            want = self.freed_at.get(rid)
            if want is not None and tuple(rd.remote) == rd.params.blocks and \
                    tuple(self.freed[b] for b in rd.remote) != want:
                self._violation("NoFreeUnderRead", f"{rank} starts a READ of handle "
                                f"{rd.params.handle} within its lease on blocks freed since "
                                "hand-out")

    def _completed(self, rank: str, d: DDriver, c: Completion) -> None:
        self._read_seen.discard((rank, c.request_id))
        if c.state == "done":
            self.stats.completed += 1
            want = self.expect.get(c.request_id)
            if c.reason == "pulled" and want is not None and c.local_blocks is not None:
                held = self.world.local[rank]
                got = tuple(held[b] for b in c.local_blocks)
                if got != want:
                    self._violation("ServedIntact", f"{rank} served {c.request_id} with "
                                    f"blocks holding writes {got[:4]}, P handed out "
                                    f"{want[:4]}")
        else:
            self.stats.failed[c.reason] = self.stats.failed.get(c.reason, 0) + 1
        self._drop_holder(rank, c.request_id)
        d.free_local(c.request_id)

    def _drop_holder(self, rank: str, rid: str) -> None:
        h = self.ledger.handle_of(rid)
        if h is not None and h in self.holders:
            self.holders[h].discard(rank)

    def deliver(self, m: Msg) -> None:
        """One message arrives in its destination's inbox (read at its next poll)."""
        self.world.deliver(m)

    # -- faults -------------------------------------------------------------------------
    def crash(self, rank: str) -> None:
        """kill -9 of one D rank: it stops; its in-flight READs still run out."""
        d = self.drivers.pop(rank, None)
        if d is None:
            return
        self.dead[rank] = d
        self.world.crash(rank)
        self.stats.crashes += 1
        for rs in self.holders.values():
            rs.discard(rank)
        self.restarts.append((self.now + to_ms(self.faults.restart_after), rank))

    def _restart(self, old: str) -> None:
        base = old.split("#", 1)[0]
        inc = self.incarnation.get(base, 1) + 1
        self.incarnation[base] = inc
        new = f"{base}#{inc}"
        for names in self.engine_ranks.values():
            if old in names:
                names[names.index(old)] = new
        self._new_rank(new)

    def partition(self, rank: str, duration: float) -> None:
        """Cut ``rank`` off P for ``duration`` seconds."""
        self.world.partition(rank, self.now + to_ms(duration))
        self.stats.partitions += 1

    def abort_p(self, rid: str) -> None:
        self.stats.aborts_p += 1
        self.p.abort(rid)

    def abort_d(self, engine: str, rid: str) -> None:
        self.stats.aborts_d += 1
        for rk in self.engine_ranks[engine]:
            d = self.drivers.get(rk)
            if d is not None:
                d.abort(rid)

    def garbage(self, epoch: int) -> bytes:
        data = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(0, 40)))
        if self.rng.random() < 0.5:  # a valid header with a corrupt body
            data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, self.rng.randint(1, 5),
                                    epoch) + data
        return data

    def inject_malformed(self, data: bytes | None = None) -> None:
        """Garbage into P's inbox (from a peer P knows, or a stranger)."""
        self.stats.malformed += 1
        src = self.rng.choice(sorted(self.known_peers) or ["stranger"])
        self.p_receive(src, data if data is not None else self.garbage(self.epoch))

    def inject_malformed_d(self, rank: str, data: bytes | None = None) -> None:
        """Garbage into a D rank's inbox, as if from P (it reaches D's decoder)."""
        self.stats.malformed_d += 1
        data = data if data is not None else self.garbage(self.epoch)
        self.world.inbox.setdefault(rank, []).append((P_NAME, data))

    # -- time -----------------------------------------------------------------------------
    def _generate(self) -> None:
        f = self.faults
        rng = self.rng
        k = 0
        lam = self.arrival_rate * self.dt
        while rng.random() < lam / (k + 1) and k < 4:
            k += 1
            n = rng.randint(2, 4) if rng.random() < f.sibling_rate else 1
            self.new_request(n)
        if rng.random() < f.abort_p_rate:
            live = self.ledger.live_handles()
            if live:
                self.abort_p(self.ledger.request_id(rng.choice(live)) or "")
        if rng.random() < f.abort_d_rate:
            e = rng.choice(list(self.engine_ranks))
            rk = self.engine_ranks[e][0]
            if rk in self.drivers and self.drivers[rk].machine.reqs:
                self.abort_d(e, rng.choice(sorted(self.drivers[rk].machine.reqs)))
        for rk in list(self.drivers):
            if rng.random() < f.crash_rate:
                self.crash(rk)
        if f.partition_rate and rng.random() < f.partition_rate and self.drivers:
            cfg = self.config
            self.partition(rng.choice(sorted(self.drivers)),
                           rng.uniform(cfg.max_delay, cfg.lease_extension))
        if rng.random() < f.malformed_rate:
            self.inject_malformed()
            if self.drivers:
                self.inject_malformed_d(rng.choice(sorted(self.drivers)))

    def _run_agenda(self) -> None:
        """Transfer params reaching D (admit), and D's scheduler wanting them (schedule)."""
        now = self.now
        rng = self.rng
        while self.agenda and self.agenda[0][0] <= now:
            _, _, rk, what = heapq.heappop(self.agenda)
            d = self.drivers.get(rk)
            if d is None:
                continue
            if what.startswith("admit\0"):
                _, rid, pj = what.split("\0", 2)
                d.admit(rid, TransferParams.from_dict(json.loads(pj)))
                self._aseq += 1
                q = rng.uniform(0, self.max_queue) if rng.random() < 0.3 else rng.uniform(0, 1)
                heapq.heappush(self.agenda, (now + to_ms(q), self._aseq, rk, "sched\0" + rid))
            else:
                rid = what.split("\0", 1)[1]
                if d.state(rid) != "new":  # a finished request is never scheduled
                    d.schedule(rid)
                    self._check_reads(rk, d)

    def step(self, *, generate: bool = True) -> None:
        self.now += self.dt_ms
        now = self.now
        if generate:
            self._generate()
        # P registrations due (in order)
        if self.p_agenda:
            due = [a for a in self.p_agenda if a[0] <= now]
            if due:
                self.p_agenda = [a for a in self.p_agenda if a[0] > now]
                for _, h, rid, blocks, group, expected, ranks in due:
                    self._register(h, rid, blocks, group, expected, ranks)
        # crashed ranks restart with a new identity (a new agent)
        while self.restarts and self.restarts[0][0] <= now:
            _, old = self.restarts.pop(0)
            self._restart(old)
        self.world.run_due(now)  # messages, handshake answers, READs landing
        self._run_agenda()
        self.p.poll()
        for rk in list(self.drivers):
            self._d_poll(rk)
        # stranded: held blocks that no live reader will ever pull
        stranded = 0
        for h, rs in self.holders.items():
            if not rs:
                held = self.ledger.blocks_of(h)
                if held is not None:
                    stranded += len(held)
        self.stats.stranded_block_seconds += stranded * self.dt
        self.check_step()

    def check_step(self) -> None:
        """The oracle's safety checks of the pool and the ledger (no full recount: this
        runs every step). A double free is reported once."""
        for v in safety_violations(self.pool, self.ledger, recount=False,
                                   ledger_invariants=False):
            self._violation(v.invariant, v.detail)
        self.pool.violations = 0

    def run(self, duration: float, *, drain: bool = True,
            progress: Callable[[float], None] | None = None) -> Stats:
        steps = round(duration / self.dt)
        for i in range(steps):
            self.step()
            if progress is not None and i % 500 == 0:
                progress(self.now / 1000)
        if drain:
            self.drain()
        return self.stats

    def busy(self) -> bool:
        """Anything held, tracked or on its way."""
        return bool(self.ledger.held_requests or self.world.xfers or self.net.queue
                    or self.agenda or self.p_agenda
                    or any(d.machine.reqs or d.reads for d in self.drivers.values()))

    def drain(self) -> None:
        """Stop new work and let every lease, grace and READ run out."""
        cfg = self.config
        limit = self.now + self.world.late_bound() + to_ms(
            self.max_queue + cfg.lease_horizon + cfg.abort_grace + cfg.peer_timeout
            + 10 * cfg.max_delay + 10)
        while self.now < limit and self.busy():
            self.step(generate=False)
        for v in ledger_violations(self.ledger):
            self._violation(v.invariant, v.detail)
        if self.ledger.held_requests or self.pool.held_count:
            self._violation("NoLeak", f"{self.ledger.held_requests} requests / "
                            f"{self.pool.held_count} blocks still held after drain")
        for n, d in self.drivers.items():
            if d.machine.reqs:
                self._violation("NoLeak", f"D rank {n} still tracks {len(d.machine.reqs)} "
                                "requests after drain")

    def d_counter(self, name: str) -> int:
        """A counter summed over every D driver (live and crashed)."""
        return sum(d.counters.get(name, 0) for ds in (self.drivers, self.dead)
                   for d in ds.values())

    def summary(self) -> dict[str, Any]:
        s = self.stats
        L = self.ledger
        c = L.counters
        rejected_d: dict[str, int] = {}
        for ds in (self.drivers, self.dead):
            for d in ds.values():
                for k, v in d.machine.counters.items():
                    if k.startswith("rejected:"):
                        rejected_d[k[9:]] = rejected_d.get(k[9:], 0) + v
        liveness = sum(1 for v in self.violations if v.invariant in LIVENESS)
        return {
            "requests": s.requests,
            "siblings": s.siblings,
            "completed_reads": s.completed,
            "failed": dict(sorted(s.failed.items())),
            "frees": dict(L.frees),
            "stranded_block_seconds": round(s.stranded_block_seconds, 3),
            "stale_messages": c.get("stale", 0) + c.get("late", 0),
            "late_after_expiry": c.get("late", 0),
            "duplicates_ignored": c.get("duplicate", 0),
            "staged": c.get("staged", 0),
            "staged_dropped": c.get("staged_dropped", 0) + c.get("staged_expired", 0),
            "rejected": {k[9:]: v for k, v in sorted(c.items()) if k.startswith("rejected:")},
            "rejected_d": dict(sorted(rejected_d.items())),
            "messages": self.net.sent, "lost": self.net.lost, "duplicated": self.net.duplicated,
            "delayed": self.net.delayed,
            "crashes": s.crashes, "partitions": s.partitions,
            "aborts_p": s.aborts_p, "aborts_d": s.aborts_d,
            "admission_blocked": s.admission_blocked,
            "fenced_reads": self.d_counter("fenced"),
            "corrupted_reads": self.world.corrupted,
            "checksum_failures": self.d_counter("checksum_failed"),
            "reused": s.reused,
            "blocks_held_at_end": self.pool.held_count,
            "violations": len(s.violations),
            "safety_violations": len(s.violations) - liveness,
            "liveness_failures": liveness,
        }


# -- CLI ------------------------------------------------------------------------------------

FAULT_PROFILES: Final = ("swarm", "fixed", "none")
EPILOG: Final = f"""\
fault profiles (--faults): swarm (default): each seed draws its own fault mix (which
faults are on, and their rates; printed per seed with --json); fixed: the same mix for
every seed (loss, duplication, crashes, aborts, malformed bytes, handshake failures);
none: a perfect network (--no-faults).

exit status: 0 no finding; 2 usage error; else the first that applies of: {EXIT_SAFETY} a
safety violation (NoDoubleFree, Conservation, NoFreeUnderRead, ServedIntact, ...);
{EXIT_CRASH} a crash (the simulated P or D code raised; the seed and the exception are
printed; the other seeds still run); {EXIT_LIVENESS} a liveness failure (NoLeak: blocks
or requests still held after the drain).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number
    from kvproto.lifecycle import MAX_POOL_BLOCKS

    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--seed", type=number(0, 2**63, integer=True), default=1,
                   help="first seed (default 1)")
    p.add_argument("--seeds", type=number(1, 10**6, integer=True), default=4,
                   help="number of seeded runs (default 4)")
    p.add_argument("--duration", type=number(0, 10**7, lo_open=True), default=120.0,
                   help="simulated seconds per run, before draining (default 120)")
    p.add_argument("--capacity", type=number(16, MAX_POOL_BLOCKS, integer=True), default=512,
                   help="P's KV blocks (default 512)")
    p.add_argument("--faults", choices=FAULT_PROFILES, default="swarm",
                   help="fault profile (default swarm: each seed its own mix)")
    p.add_argument("--no-faults", action="store_true",
                   help="a perfect network, no crashes (--faults none)")
    p.add_argument("--checksums", action="store_true",
                   help="block checksums on (Config.checksums), and data READs landing "
                        "corrupted with their stamps unchanged (a fault only checksums catch)")
    p.add_argument("--journal", metavar="PATH",
                   help="write the first run's P event journal (JSON Lines) here")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")


@contextlib.contextmanager
def quiet_drivers(verbose: int) -> Iterator[None]:
    """The drivers log every fault they meet (a fenced READ, a failed handshake...): in a
    simulation that is the point, not news. Below ``-vv`` only their errors are shown."""
    drivers = logging.getLogger("kvproto.nixl")
    level = drivers.level
    if verbose < 2:
        drivers.setLevel(logging.ERROR)
    try:
        yield
    finally:
        drivers.setLevel(level)


def seed_faults(profile: str, seed: int) -> Faults:
    """The fault mix of one seed under ``profile`` (a swarm seed's mix depends only on
    the seed)."""
    if profile == "none":
        return Faults.none()
    if profile == "fixed":
        return Faults()
    return Faults.swarm(random.Random(f"swarm:{seed}"))


def corrupt_rate(profile: str, seed: int) -> float:
    """With block checksums on (``--checksums``), the fraction of data READs landing
    corrupted (``Faults.corrupt``): fixed 5%, swarm drawn log-uniformly within 1-20%
    (from the seed alone), none never."""
    if profile == "none":
        return 0.0
    if profile == "fixed":
        return 0.05
    return 0.01 * 20 ** random.Random(f"corrupt:{seed}").random()


def simulate_many(seed: int, seeds: int, duration: float, capacity: int, no_faults: bool,
                  journal: str | None = None, progress: IO[str] | None = None,
                  faults: str = "fixed", checksums: bool = False) -> dict[str, Any]:
    """Run ``seeds`` seeds; sum their summaries. ``faults``: a profile of
    ``FAULT_PROFILES`` (``no_faults`` forces "none"). A seed whose run raises is a crash:
    recorded (``crashed_seeds``, ``crash_details``), and the next seed runs."""
    from kvproto.journal import JournalWriter

    profile = "none" if no_faults else faults
    config = Config(checksums=checksums)
    totals: dict[str, Any] = {}
    violations: list[str] = []
    crashes: list[str] = []
    mixes: dict[str, dict[str, float | bool]] = {}
    for i in range(seeds):
        s = seed + i
        writer = None
        if journal and i == 0:
            writer = JournalWriter(journal, config, capacity, {"source": "simulate", "seed": s})
        t0 = time.perf_counter()
        f = seed_faults(profile, s)
        if checksums:
            f.corrupt = corrupt_rate(profile, s)
        mixes[str(s)] = f.mix()
        sim = Simulator(s, config=config, faults=f, capacity=capacity,
                        journal=writer.sink if writer else None)

        def prog(now: float, s: int = s, sim: Simulator = sim) -> None:
            if progress is not None:
                print(f"[simulate] seed {s}: t={now:.0f}s held={sim.ledger.held_requests} "
                      f"frees={sum(sim.ledger.frees.values())}", file=progress)

        try:
            sim.run(duration, progress=prog)
        except Exception as e:  # the code under test raised: a crash, reported per seed
            log.debug("seed %d crashed", s, exc_info=True)
            where = traceback.extract_tb(e.__traceback__)[-1]
            crashes.append(f"seed {s}: {type(e).__name__}: {e} "
                           f"({where.filename}:{where.lineno}, t={sim.now / 1000:.3f})")
        finally:
            if writer:
                writer.close()
        summ = sim.summary()
        violations += [f"seed {s}: {v}" for v in sim.stats.violations]
        if progress is not None:
            print(f"[simulate] seed {s}: done in {time.perf_counter() - t0:.1f}s, "
                  f"{summ['requests']} requests, violations {summ['violations']}", file=progress)
        for k, v in summ.items():
            if isinstance(v, dict):
                d = totals.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, (int, float)):
                totals[k] = round(totals.get(k, 0) + v, 3)
    totals["seeds"] = seeds
    totals["faults"] = profile
    totals["fault_mix"] = mixes
    totals["violation_details"] = violations[:20]
    totals["crashed_seeds"] = len(crashes)
    totals["crash_details"] = crashes[:20]
    return totals


def exit_code(totals: dict[str, Any]) -> int:
    """``kvproto simulate``'s exit status for summed summaries (see ``EPILOG``)."""
    if totals.get("safety_violations"):
        return EXIT_SAFETY
    if totals.get("crashed_seeds"):
        return EXIT_CRASH
    if totals.get("liveness_failures"):
        return EXIT_LIVENESS
    return 0


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.duration <= 0 or args.capacity < 16:
        print("kvproto simulate: --seeds >= 1, --duration > 0, --capacity >= 16", file=sys.stderr)
        return 2
    with quiet_drivers(getattr(args, "verbose", 0)):
        totals = simulate_many(args.seed, args.seeds, args.duration, args.capacity,
                               args.no_faults, args.journal, progress=sys.stderr,
                               faults=args.faults, checksums=args.checksums)
    if args.json:
        print(json.dumps(totals, sort_keys=True))
    else:
        print(f"kvproto simulate: {args.seeds} seeded runs of {args.duration:g}s (+drain), "
              f"faults {totals['faults']}")
        for k in ("requests", "siblings", "completed_reads", "failed", "frees",
                  "stranded_block_seconds", "stale_messages", "late_after_expiry",
                  "duplicates_ignored", "staged", "staged_dropped", "rejected", "rejected_d",
                  "messages", "lost", "duplicated", "delayed", "crashes", "partitions",
                  "aborts_p", "aborts_d", "admission_blocked", "fenced_reads",
                  "corrupted_reads", "checksum_failures", "reused",
                  "blocks_held_at_end", "violations", "safety_violations",
                  "liveness_failures", "crashed_seeds"):
            print(f"  {k:24s} {totals.get(k)}")
        for v in totals["violation_details"]:
            print(f"  VIOLATION {v}")
        for c in totals["crash_details"]:
            print(f"  CRASH {c}")
        if args.journal:
            print(f"  journal                  {args.journal}")
    return exit_code(totals)
