"""Deterministic simulator: one P rank, several D engines (each with one or more ranks),
and a faulty network carrying the real encoded bytes.

The simulator is itself a thin adapter: it decodes bytes into ledger/consumer events and
applies their effects; every lifecycle decision stays in ``kvproto.lifecycle``. It checks
the safety invariants after every step and measures stranded block-seconds. Its clock
(``now``) is the machines' time, integer milliseconds; its knobs (``dt``, durations,
``Faults``) are seconds, turned into milliseconds once.

Faults: message loss, duplication, reordering (random delays), delay, D rank crash,
aborts on P and on D, malformed bytes into P's inbox, handshake failures.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from kvproto import port, wire
from kvproto.lifecycle import (
    HELD_STATES,
    Ack,
    BlockPool,
    Config,
    Consumer,
    DEffect,
    Effect,
    Finished,
    Free,
    Ledger,
    PostRead,
    Rejected,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    TransferParams,
    to_ms,
)
from kvproto.verify.oracle import InvariantViolation, ledger_violations, safety_violations

log = logging.getLogger(__name__)

P_NAME = "P0"


@dataclass
class Faults:
    """Probabilities per message or per step; all zero = a perfect network."""

    loss: float = 0.02
    duplicate: float = 0.02
    max_delay: float | None = None  # None: the config's max_delay (the timing assumption)
    crash_rate: float = 0.0004  # per step, per live D rank (it restarts as a new reader)
    restart_after: float = 5.0  # a crashed rank comes back (new identity) after this long
    register_lag: float = 0.3  # fraction of requests whose P registration lags the params
    abort_p_rate: float = 0.02  # per step: abort a random held request on P
    abort_d_rate: float = 0.02  # per step: abort a random request on one D engine
    malformed_rate: float = 0.01  # per step: inject garbage into P's inbox
    handshake_fail: float = 0.05  # per handshake
    sibling_rate: float = 0.15  # fraction of requests with n>1 siblings

    @classmethod
    def none(cls) -> Faults:
        return cls(0, 0, None, 0, 5.0, 0.3, 0, 0, 0, 0, 0.15)


@dataclass(order=True)
class Msg:
    at: int  # ms
    seq: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    data: bytes = field(compare=False)


@dataclass
class Read:
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
    messages: int = 0
    lost: int = 0
    duplicated: int = 0
    crashes: int = 0
    aborts_p: int = 0
    aborts_d: int = 0
    malformed: int = 0
    stranded_block_seconds: float = 0.0
    fenced: int = 0
    violations: list[str] = field(default_factory=list)


class Network:
    """Delivers bytes after a random delay (at most ``max_delay`` ms); may lose or
    duplicate them."""

    def __init__(self, rng: random.Random, faults: Faults, max_delay: int) -> None:
        self.rng = rng
        self.faults = faults
        self.max_delay = max_delay
        self.queue: list[Msg] = []
        self._seq = 0
        self.sent = self.lost = self.duplicated = 0

    def send(self, now: int, src: str, dst: str, data: bytes) -> None:
        self.sent += 1
        if self.rng.random() < self.faults.loss:
            self.lost += 1
            return
        copies = 2 if self.rng.random() < self.faults.duplicate else 1
        self.duplicated += copies - 1
        for _ in range(copies):
            self._seq += 1
            heapq.heappush(self.queue, Msg(now + round(self.rng.uniform(0, self.max_delay)),
                                           self._seq, src, dst, data))

    def due(self, now: int) -> list[Msg]:
        out = []
        while self.queue and self.queue[0].at <= now:
            out.append(heapq.heappop(self.queue))
        return out


class Simulator:
    """One P rank and D engines. ``step()`` advances time by ``dt`` (seconds, whole ms)
    and runs everything due."""

    def __init__(self, seed: int = 0, *, config: Config | None = None,
                 faults: Faults | None = None, capacity: int = 512,
                 engines: tuple[int, ...] = (1, 2, 1), dt: float = 0.1,
                 arrival_rate: float = 2.0, max_queue: float = 20.0,
                 journal: Callable[..., None] | None = None) -> None:
        self.rng = random.Random(seed)
        self.config = (config or Config()).validate()
        self.faults = faults if faults is not None else Faults()
        self.dt_ms = max(1, to_ms(dt))
        self.dt = self.dt_ms / 1000
        self.now = 0  # ms
        self.arrival_rate = arrival_rate  # requests per simulated second
        self.max_queue = max_queue  # D may queue a request this long before pulling it
        self.epoch = self.rng.randrange(1, 1 << 32)
        self.pool = BlockPool(capacity, strict=False)
        self.ledger = Ledger(self.config, self.pool, sink=journal)
        self.gens = [0] * capacity
        max_delay = self.faults.max_delay if self.faults.max_delay is not None \
            else self.config.max_delay
        self.net = Network(self.rng, self.faults, to_ms(max_delay))
        self.ranks: dict[str, Consumer] = {}
        self.engine_ranks: dict[str, list[str]] = {}
        for e, nranks in enumerate(engines):
            names = [f"D{e}.r{k}" for k in range(nranks)]
            self.engine_ranks[f"D{e}"] = names
            for n in names:
                self.ranks[n] = Consumer(n, self.config)
        self.crashed: set[str] = set()
        self.known_peers: set[str] = set()  # D ranks P has handshaken with
        self.agenda: list[tuple[int, int, str, str]] = []  # (time, seq, rank, rid) schedule
        self.handshakes: list[tuple[int, int, str, bool]] = []  # (time, seq, rank, ok)
        self.reads: dict[tuple[str, str], Read] = {}
        self._aseq = 0
        self._next_req = 0
        self.stats = Stats()
        self.violations: list[InvariantViolation] = []  # the records behind stats.violations
        self.holders: dict[int, set[str]] = {}  # handle -> D ranks that may still pull it
        self.p_agenda: list[tuple[int, int, str, tuple[int, ...], str | None, int,
                                  tuple[str, ...]]] = []
        self.restarts: list[tuple[int, str]] = []
        self.incarnation: dict[str, int] = {}

    # -- helpers -----------------------------------------------------------------------
    def _tick_seq(self) -> int:
        self._aseq += 1
        return self._aseq

    def _violation(self, invariant: str, detail: str) -> None:
        v = InvariantViolation(invariant, detail)
        log.error("violation at t=%.3f: %s", self.now / 1000, v)
        self.violations.append(v)
        self.stats.violations.append(f"t={self.now / 1000:.3f} {v}")

    # -- P side (the adapter: decode, feed the ledger, apply effects) ------------------
    def p_receive(self, src: str, data: bytes) -> None:
        self._p_effects(port.p_receive(self.ledger, src, data, self.now,
                                       known=src in self.known_peers, epoch=self.epoch,
                                       max_bytes=self.config.max_message_bytes))

    def deliver(self, m: Msg) -> None:
        """One message arrives: P's go through the port; an ack reaches a live D rank."""
        if m.dst == P_NAME:
            self.p_receive(m.src, m.data)
        elif m.dst not in self.crashed and m.dst in self.ranks:
            try:
                a = wire.decode(m.data, epoch=self.epoch)
            except wire.WireError:
                return
            if a.kind == wire.KIND_ACK:
                self._d_effects(m.dst, self.ranks[m.dst].ack(
                    P_NAME, a.seq, a.term_ms, a.handles, self.now, a.pending))

    def _p_effects(self, effects: list[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, Free):
                self._on_free(eff)
            elif isinstance(eff, Ack):
                for chunk in wire.encode_ack(self.epoch, eff.seq, eff.term, eff.refused,
                                             self.config.max_message_bytes, eff.pending):
                    self.net.send(self.now, P_NAME, eff.reader, chunk)
            elif isinstance(eff, Rejected):
                log.debug("P rejected %s from %s: %s", eff.reason, eff.peer, eff.detail)

    def _on_free(self, eff: Free) -> None:
        # The engine still pins blocks it handed out for a registration that lags: the
        # lifecycle dropped its hold, but those blocks are not reused (nor re-stamped).
        reclaimed = {b for b in eff.reclaimed if not self.pool.pinned(b)}
        for b in reclaimed:
            self.gens[b] += 1  # bump before the block can be reused
        for r in self.reads.values():
            if reclaimed.intersection(r.blocks):
                self._violation("NoFreeUnderRead", f"handle {eff.handle} ({eff.reason}) freed "
                                f"blocks under {r.reader}'s READ of handle {r.handle}")
        self.holders.pop(eff.handle, None)

    def new_request(self, n: int = 1, engine: str | None = None) -> list[str]:
        """Prefill finished on P: register (n siblings sharing blocks), hand params to D."""
        nblocks = self.rng.randint(1, 8)
        alloc = self.pool.allocate(nblocks)
        if alloc is None:
            self.stats.admission_blocked += 1
            return []
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
            params = TransferParams(P_NAME, self.epoch, h, blocks, self.config.ms.initial_lease,
                                    expected=len(ranks), group=group,
                                    generations=tuple(self.gens[b] for b in blocks))
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

    # -- D side -------------------------------------------------------------------------
    def _d_effects(self, rank: str, effects: list[DEffect]) -> None:
        for eff in effects:
            if isinstance(eff, StartHandshake):
                ok = self.rng.random() >= self.faults.handshake_fail
                heapq.heappush(self.handshakes, (self.now + round(self.rng.uniform(10, 500)),
                                                 self._tick_seq(), rank, ok))
            elif isinstance(eff, PostRead):
                gens = tuple(self.gens[b] for b in eff.blocks)
                mrt = self.config.ms.max_read_time
                dur = round(self.rng.uniform(min(10, mrt / 2), mrt))
                self.reads[(rank, eff.request_id)] = Read(rank, eff.request_id, eff.handle,
                                                          eff.blocks, gens, self.now,
                                                          self.now + dur)
            elif isinstance(eff, SendDone):
                self.net.send(self.now, rank, P_NAME,
                              wire.encode_done(self.epoch, eff.handle, eff.expected))
            elif isinstance(eff, SendRelease):
                for chunk in wire.encode_release(self.epoch, (eff.handle,), eff.expected,
                                                 self.config.max_message_bytes):
                    self.net.send(self.now, rank, P_NAME, chunk)
            elif isinstance(eff, SendHeartbeat):
                for chunk in wire.encode_heartbeat(self.epoch, eff.seq, eff.handles,
                                                   eff.expected, self.config.max_message_bytes):
                    self.net.send(self.now, rank, P_NAME, chunk)
            elif isinstance(eff, Finished):
                if eff.state == "done":
                    self.stats.completed += 1
                else:
                    self.stats.failed[eff.reason] = self.stats.failed.get(eff.reason, 0) + 1
                self._drop_holder(rank, eff.request_id)

    def _drop_holder(self, rank: str, rid: str) -> None:
        h = self.ledger.handle_of(rid)
        if h is not None and h in self.holders:
            self.holders[h].discard(rank)

    def _finish_read(self, key: tuple[str, str], r: Read) -> None:
        del self.reads[key]
        if r.reader in self.crashed:
            return
        fenced = any(self.gens[b] != g for b, g in zip(r.blocks, r.gens, strict=True))
        if fenced:
            self.stats.fenced += 1
            self._violation("NoFreeUnderRead", f"fenced READ of handle {r.handle} by "
                            f"{r.reader}: blocks reused")
        c = self.ranks[r.reader]
        # NIXL delivers the READ's notification after the data landed, from the initiator.
        if not fenced:
            self.net.send(self.now, r.reader, P_NAME,
                          wire.encode_done(self.epoch, r.handle,
                                           c.reqs[r.rid].params.expected))
        self._d_effects(r.reader, c.read_result(r.rid, not fenced, self.now, fenced=fenced))

    # -- faults -------------------------------------------------------------------------
    def crash(self, rank: str) -> None:
        """kill -9 of one D rank: it stops sending; its in-flight READs still run out."""
        if rank in self.crashed:
            return
        self.crashed.add(rank)
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
        self.ranks[new] = Consumer(new, self.config)

    def abort_p(self, rid: str) -> None:
        self.stats.aborts_p += 1
        self._p_effects(self.ledger.abort(rid, self.now))

    def abort_d(self, engine: str, rid: str) -> None:
        self.stats.aborts_d += 1
        for rk in self.engine_ranks[engine]:
            if rk not in self.crashed:
                self._d_effects(rk, self.ranks[rk].abort(rid, self.now))

    def inject_malformed(self, data: bytes | None = None) -> None:
        self.stats.malformed += 1
        src = self.rng.choice(sorted(self.known_peers) or ["stranger"])
        if data is None:
            data = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(0, 40)))
            if self.rng.random() < 0.5:  # a valid header with a corrupt body
                data = wire.HEADER.pack(wire.MAGIC, wire.VERSION, self.rng.randint(1, 5),
                                        self.epoch) + data
        self.p_receive(src, data)

    # -- time -----------------------------------------------------------------------------
    def step(self, *, generate: bool = True) -> None:
        self.now += self.dt_ms
        now = self.now
        f = self.faults
        rng = self.rng
        if generate:
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
                if self.ranks[rk].reqs:
                    self.abort_d(e, rng.choice(sorted(self.ranks[rk].reqs)))
            for rk in list(self.ranks):
                if rk not in self.crashed and rng.random() < f.crash_rate:
                    self.crash(rk)
            if rng.random() < f.malformed_rate:
                self.inject_malformed()
        # P registrations due (in order)
        if self.p_agenda:
            due = [a for a in self.p_agenda if a[0] <= now]
            if due:
                self.p_agenda = [a for a in self.p_agenda if a[0] > now]
                for _, h, rid, blocks, group, expected, ranks in due:
                    self.pool.unpin(blocks)
                    self._p_effects(self.ledger.register(h, rid, blocks, now, group=group,
                                                         expected=expected))
                    if self.ledger.state(h) in HELD_STATES:
                        self.holders[h] = {r for r in ranks if r in self.ranks
                                           and r not in self.crashed}
        # crashed ranks restart with a new identity (a new NIXL agent)
        while self.restarts and self.restarts[0][0] <= now:
            _, old = self.restarts.pop(0)
            self._restart(old)
        # handshakes completing
        while self.handshakes and self.handshakes[0][0] <= now:
            _, _, rk, ok = heapq.heappop(self.handshakes)
            if rk in self.crashed:
                continue
            if ok:
                self.known_peers.add(rk)
            self._d_effects(rk, self.ranks[rk].handshake_result(P_NAME, ok, now))
        # admissions and schedules due
        while self.agenda and self.agenda[0][0] <= now:
            _, _, rk, what = heapq.heappop(self.agenda)
            if rk in self.crashed:
                continue
            c = self.ranks[rk]
            if what.startswith("admit\0"):
                _, rid, pj = what.split("\0", 2)
                params = TransferParams.from_dict(json.loads(pj))
                self._d_effects(rk, c.admit(rid, params, now))
                self._aseq += 1
                q = rng.uniform(0, self.max_queue) if rng.random() < 0.3 else rng.uniform(0, 1)
                heapq.heappush(self.agenda, (now + to_ms(q), self._aseq, rk, "sched\0" + rid))
            else:
                rid = what.split("\0", 1)[1]
                if c.state(rid) == "handshaking":  # not ready yet: retry later
                    self._aseq += 1
                    heapq.heappush(self.agenda, (now + 500, self._aseq, rk, what))
                else:
                    self._d_effects(rk, c.schedule(rid, now))
                    if c.state(rid) == "waiting":  # e.g. a sibling's READ in flight: retry
                        self._aseq += 1
                        heapq.heappush(self.agenda, (now + 200, self._aseq, rk, what))
        # READs completing
        for key, r in sorted(self.reads.items(), key=lambda kv: kv[1].end):
            if r.end <= now:
                self._finish_read(key, r)
        # messages
        for m in self.net.due(now):
            self.deliver(m)
        # ticks
        for rk, c in self.ranks.items():
            if rk not in self.crashed:
                self._d_effects(rk, c.tick(now))
        self._p_effects(self.ledger.tick(now))
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

    def drain(self) -> None:
        """Stop new work and let every lease, grace and READ run out."""
        cfg = self.config
        limit = self.now + to_ms(self.max_queue + cfg.lease_horizon + cfg.abort_grace
                                 + cfg.max_read_time + 10 * cfg.max_delay + 10)
        while self.now < limit and (self.ledger.held_requests or self.reads or self.net.queue
                                    or self.agenda or self.p_agenda):
            self.step(generate=False)
        for v in ledger_violations(self.ledger):
            self._violation(v.invariant, v.detail)
        if self.ledger.held_requests or self.pool.held_count:
            self._violation("NoLeak", f"{self.ledger.held_requests} requests / "
                            f"{self.pool.held_count} blocks still held after drain")

    def summary(self) -> dict[str, Any]:
        s = self.stats
        L = self.ledger
        c = L.counters
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
            "messages": self.net.sent, "lost": self.net.lost, "duplicated": self.net.duplicated,
            "crashes": s.crashes, "aborts_p": s.aborts_p, "aborts_d": s.aborts_d,
            "admission_blocked": s.admission_blocked,
            "fenced_reads": s.fenced,
            "blocks_held_at_end": self.pool.held_count,
            "violations": len(s.violations),
        }


# -- CLI ------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number
    from kvproto.lifecycle import MAX_POOL_BLOCKS

    p.add_argument("--seed", type=number(0, 2**63, integer=True), default=1,
                   help="first seed (default 1)")
    p.add_argument("--seeds", type=number(1, 10**6, integer=True), default=4,
                   help="number of seeded runs (default 4)")
    p.add_argument("--duration", type=number(0, 10**7, lo_open=True), default=120.0,
                   help="simulated seconds per run, before draining (default 120)")
    p.add_argument("--capacity", type=number(16, MAX_POOL_BLOCKS, integer=True), default=512,
                   help="P's KV blocks (default 512)")
    p.add_argument("--no-faults", action="store_true", help="a perfect network, no crashes")
    p.add_argument("--journal", metavar="PATH",
                   help="write the first run's P event journal (JSON Lines) here")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")


def simulate_many(seed: int, seeds: int, duration: float, capacity: int, no_faults: bool,
                  journal: str | None = None, progress: IO[str] | None = None) -> dict[str, Any]:
    from kvproto.journal import JournalWriter

    totals: dict[str, Any] = {}
    violations: list[str] = []
    for i in range(seeds):
        s = seed + i
        writer = None
        if journal and i == 0:
            writer = JournalWriter(journal, Config(), capacity, {"source": "simulate", "seed": s})
        t0 = time.perf_counter()
        sim = Simulator(s, faults=Faults.none() if no_faults else Faults(), capacity=capacity,
                        journal=writer.sink if writer else None)

        def prog(now: float, s: int = s, sim: Simulator = sim) -> None:
            if progress is not None:
                print(f"[simulate] seed {s}: t={now:.0f}s held={sim.ledger.held_requests} "
                      f"frees={sum(sim.ledger.frees.values())}", file=progress)

        sim.run(duration, progress=prog)
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
    totals["violation_details"] = violations[:20]
    return totals


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1 or args.duration <= 0 or args.capacity < 16:
        print("kvproto simulate: --seeds >= 1, --duration > 0, --capacity >= 16", file=sys.stderr)
        return 2
    totals = simulate_many(args.seed, args.seeds, args.duration, args.capacity, args.no_faults,
                           args.journal, progress=sys.stderr)
    if args.json:
        print(json.dumps(totals, sort_keys=True))
    else:
        print(f"kvproto simulate: {args.seeds} seeded runs of {args.duration:g}s (+drain)")
        for k in ("requests", "siblings", "completed_reads", "failed", "frees",
                  "stranded_block_seconds", "stale_messages", "late_after_expiry",
                  "duplicates_ignored", "staged", "staged_dropped", "rejected", "messages",
                  "lost", "duplicated", "crashes", "aborts_p", "aborts_d", "admission_blocked",
                  "fenced_reads", "blocks_held_at_end", "violations"):
            print(f"  {k:24s} {totals.get(k)}")
        for v in totals["violation_details"]:
            print(f"  VIOLATION {v}")
        if args.journal:
            print(f"  journal                  {args.journal}")
    return 1 if totals.get("violations") else 0
