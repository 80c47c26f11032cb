"""The worker halves of the vLLM connector: P's ``PWorker`` (the ProducerAdapter: agent,
stamps, ledger) and D's ``DWorker`` (the ConsumerAdapter: agent, stamps landing area,
Consumer), each driven by the orders ``kvproto.vllm.sched`` builds on the scheduler side.
They execute orders and report outcomes; every decision about blocks is the lifecycle
machines' (``kvproto.lifecycle``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvproto.lifecycle import D_DONE, UNREGISTERED, Effect, Free
from kvproto.port import now_ms
from kvproto.vllm.dcover import RankReads
from kvproto.vllm.sched import (
    AdmitOrder,
    ConnectorOptions,
    Orders,
    ParamsError,
)
from kvproto.vllm.topology import TopologyUnsupported

if TYPE_CHECKING:
    from kvproto.journal import JournalWriter
    from kvproto.metrics import Metrics
    from kvproto.nixl.consumer import Completion, ConsumerAdapter
    from kvproto.nixl.producer import ProducerAdapter


log = logging.getLogger("kvproto.vllm.connector")

IDLE_SLICE = 0.002  # seconds between adapter polls inside one idle wait
MAX_ENDED = 65536  # D worker: requests ended before their load order, remembered (oldest dropped)


def consumer_journal_path(journal: str) -> str:
    """Where a D worker writes its Consumer journal, given the ``journal`` option."""
    p = Path(journal)
    return str(p.with_name(p.stem + ".consumer" + (p.suffix or ".jsonl")))


def part_rid(rid: str, p_rank: int, index: int) -> str:
    """The Consumer entry of part ``index`` (P rank ``p_rank``) of request ``rid``: the
    request id itself for its first part (one-part requests keep their id)."""
    return rid if index == 0 else f"{rid}#p{p_rank}"


def orphan_rid(rid: str, engine: str) -> str:
    """The Consumer entry that releases orphaned P rank ``engine`` of ``rid``."""
    return f"{rid}#o:{engine}"


class Join:
    """One admitted request on a D rank: its parts' Consumer entries (entry -> P rank)
    still running, its orphans' entries, the coverage outcome once known (None: parts
    pending), whether a part was aborted, the parts quarantined, and whether it ended
    before its load order."""

    __slots__ = ("aborted", "ended", "orphans", "parts", "quarantined", "result")

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self.orphans: list[str] = []
        self.result: bool | None = None
        self.aborted = False
        self.quarantined: set[str] = set()
        self.ended = False


class PollGaps:
    """The gaps between one worker's adapter polls. The lifecycle's timing assumes that a
    message is handled within ``max_delay`` of its sending (``kvproto.lifecycle.config``);
    a worker with work pending whose adapter went unpolled for longer broke that
    assumption: its engine thread and its poller both stalled (a host short of CPU, a
    long call under the worker's lock). Leases ran on meanwhile, so requests may have lost
    theirs and been recomputed; nothing unsafe follows (stamps fence every READ). A gap
    counts when the worker had work at the poll that opened it. O(1) per poll."""

    __slots__ = ("_watch", "last", "limit", "longest", "stalled_s", "stalls")

    def __init__(self, limit_s: float, now: float) -> None:
        self.limit = limit_s
        self.stalls = 0  # gaps longer than limit, with work pending
        self.stalled_s = 0.0  # their total length
        self.longest = 0.0  # the longest of them
        self.last = now  # the last poll (monotonic seconds), either thread
        self._watch = False

    def polled(self, now: float, watch: bool) -> float | None:
        """One poll at ``now`` (monotonic seconds); ``watch``: whether the worker has work
        now, so that the gap this poll opens counts. The gap this poll closed, when it
        was a stall; else None."""
        gap = now - self.last
        self.last = now
        counts = self._watch
        self._watch = watch
        if not counts or gap <= self.limit:
            return None
        self.stalls += 1
        self.stalled_s += gap
        self.longest = max(self.longest, gap)
        return gap


class _Polled:
    """The poller both worker halves run (``poll_gap_ms`` > 0): a thread that polls the
    adapter whenever no thread has for ``poll_gap_ms`` (a long forward pass, an engine
    loop waiting for CPU), so heartbeats, claims, grants and dones still move and the
    machines' timers still fire between engine steps. ``lock`` serializes every call
    into the adapter and every read or write of the worker's state and outputs, so the
    lifecycle machine and the adapter stay single-threaded; it is held for one poll,
    never across a sleep. What a poll decides reaches vLLM at the engine thread's next
    ``take``. A poll that raises is counted (``poller_errors``), logged at the 1st, 2nd,
    4th, 8th... error, and the poller goes on."""

    role = "?"

    metrics: Metrics | None = None

    def _init_poller(self, gap_ms: float, name: str, max_delay_s: float) -> None:
        self.lock = threading.Lock()
        self.gaps = PollGaps(max_delay_s, time.monotonic())
        self.poller_polls = 0  # adapter polls the poller made between engine polls
        self.poller_errors = 0  # poller polls that raised (the poller goes on)
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if gap_ms > 0:
            self._poller = threading.Thread(target=self._poll_between_steps,
                                            args=(gap_ms / 1000.0,),
                                            name=f"kvproto-poller-{name}", daemon=True)
            self._poller.start()

    def _poll_locked(self) -> int:
        """One adapter poll, the lock held by the caller; the messages it handled."""
        raise NotImplementedError

    def _poller_due(self) -> bool:
        """Whether the poller should poll now (the lock held)."""
        return True

    def _has_work(self) -> bool:
        """Whether a gap until the next adapter poll would leave work waiting (the lock
        held)."""
        return True

    def _note_poll(self) -> None:
        """Record an adapter poll (the lock held): a gap over ``max_delay`` since the one
        before, with work pending, is counted (``poll_stalls``) and logged at the 1st, 2nd,
        4th, 8th... such gap."""
        gap = self.gaps.polled(time.monotonic(), self._has_work())
        if gap is None:
            return
        if self.metrics is not None:
            self.metrics.poll_stall(gap)
        n = self.gaps.stalls
        if n & (n - 1) == 0:
            log.warning("kvproto: %s: no adapter poll for %.1f s with work pending, over "
                        "max_delay (%.3f s): the engine thread and the poller both stalled "
                        "(a host short of CPU?); leases ran on meanwhile (%d such gaps so "
                        "far)", self.role, gap, self.gaps.limit, n)

    def _poll_between_steps(self, gap: float) -> None:
        """The poller: every ``gap`` seconds, poll the adapter unless some thread polled
        it less than ``gap`` ago. Each poll does the bounded work of one engine poll."""
        while not self._stop.wait(gap):
            if time.monotonic() - self.gaps.last < gap:
                continue
            with self.lock:
                if self._stop.is_set():
                    return
                if not self._poller_due():
                    continue
                try:
                    self._poll_locked()
                except Exception:
                    # Counted each time; logged at the 1st, 2nd, 4th, 8th... so that a
                    # fault that persists cannot flood the log every poll_gap_ms.
                    self.poller_errors += 1
                    n = self.poller_errors
                    if n & (n - 1) == 0:
                        log.exception("kvproto: %s poller: poll failed (%d so far)",
                                      self.role, n)
                    self._note_poll()  # it polled, if only to fail
                self.poller_polls += 1

    def _stop_poller(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5.0)


class PWorker(_Polled):
    """P's worker half: the ProducerAdapter (agent, stamps, ledger, handshake listener).

    Two threads drive it: the engine thread (vLLM's hooks: ``apply``, ``poll``,
    ``idle_wait``, ``take``, ``counters``) and the poller (``poll_gap_ms`` > 0), which
    polls the adapter whenever the engine thread has not for ``poll_gap_ms``: during a
    long forward pass, or while the engine loop waits for CPU, P still answers
    heartbeats, claims and dones and runs its expiries. ``lock`` serializes every call
    into the adapter and every read or write of this worker's outputs
    (``finished_sending``, ``stamps``), so the ledger and the adapter stay
    single-threaded. A free the poller decides reaches vLLM at the engine thread's next
    ``take``: vLLM keeps the blocks until then, and their stamps were bumped at the
    free, so a READ of them in between is fenced.
    """

    role = "P"

    def __init__(self, opts: ConnectorOptions, name: str, tensors: list[torch.Tensor],
                 num_blocks: int, port: int, metrics: Metrics | None = None,
                 identity: dict[str, str] | None = None, tp: tuple[int, int] = (0, 1)
                 ) -> None:
        """``tp``: (TP rank, TP size), in the handshake's layout."""
        from kvproto.nixl.producer import ProducerAdapter

        self.writer: JournalWriter | None = None
        if opts.journal:
            from kvproto.journal import JournalWriter

            self.writer = JournalWriter(opts.journal, opts.config, num_blocks,
                                        meta={"engine": name, "source": "kvproto.vllm"},
                                        flush_every=opts.journal_flush_every)
        self.metrics = metrics
        self.finished_sending: set[str] = set()
        self.stamps: dict[int, int] = {}
        # handle -> (ms, blocks, tokens) of every request the ledger holds; size: the
        # ledger's held requests (an entry leaves at the request's Free)
        self._reg_at: dict[int, tuple[int, int, int]] = {}
        self.held_tokens = 0  # prompt tokens whose KV the ledger holds now
        self.stranded = 0.0
        self.adapter: ProducerAdapter = ProducerAdapter(
            name, opts.config, num_blocks=num_blocks, block_bytes=1,
            sink=self.writer.sink if self.writer is not None else None,
            host=opts.handshake_host, port=port, strict_pool=False,
            observer=self._observe, kv_tensors=tensors, progress_thread=opts.progress_thread,
            progress_delay_us=opts.progress_delay_us,
            metrics=metrics, identity=identity, handshake_thread=True, tp_rank=tp[0],
            tp_size=tp[1])
        self._gen = self.adapter.region.gen
        if metrics is not None:
            metrics.track_tokens(lambda: self.held_tokens)
        self.idle_wait_s = opts.idle_wait_ms / 1000.0
        self.steps = 0  # worker steps (get_finished calls)
        self.idle_waits = 0  # of those, steps that waited
        self.idle_polls = 0  # adapter polls made inside idle waits
        self._init_poller(opts.poll_gap_ms, name, opts.config.max_delay)

    def _poll_locked(self) -> int:
        handled = self.adapter.poll()
        self._note_poll()
        return handled

    def _has_work(self) -> bool:
        # Held requests wait on P's answers; with the poller on, P polls every
        # poll_gap_ms even when it holds nothing, so any longer gap is a stall.
        return self._poller is not None or bool(self._reg_at)

    def _observe(self, e: Effect, now: int) -> None:
        if isinstance(e, Free):
            # The adapter bumped the reclaimed blocks' stamps before calling us.
            self.finished_sending.add(e.request_id)
            if e.reclaimed:
                gens = self._gen[list(e.reclaimed)].tolist()
                for b, g in zip(e.reclaimed, gens, strict=True):
                    self.stamps[b] = int(g)
            t = self._reg_at.pop(e.handle, None)
            if t is not None:
                self.held_tokens -= t[2]
                if e.reason in ("expired", "aborted"):
                    self.stranded += (now - t[0]) / 1000 * t[1]

    def apply(self, orders: Orders) -> None:
        with self.lock:
            self._apply(orders)

    def _apply(self, orders: Orders) -> None:
        a = self.adapter
        for o in orders.registers:
            # Recorded before the register: a register can free at once (dones staged
            # before it), and the Free's observer then removes the entry.
            new = o.handle not in self._reg_at
            if new:
                self._reg_at[o.handle] = (now_ms(a.clock), len(o.blocks), o.tokens)
                self.held_tokens += o.tokens
            tp = a.register(o.request_id, list(o.blocks), group=o.group, expected=o.expected,
                            handle=o.handle, ready=o.ready)
            if a.ledger.state(o.handle) == UNREGISTERED:
                if new and self._reg_at.pop(o.handle, None) is not None:
                    self.held_tokens -= o.tokens
                # Rejected: the ledger holds nothing, so vLLM may free the blocks now. The
                # adapter bumped their stamps (D may already hold params for them); the
                # mirror learns the new stamps before vLLM frees the blocks.
                a._count("register_rejected")
                log.error("kvproto: register of %s rejected; blocks returned", o.request_id)
                valid = [b for b in o.blocks if 0 <= b < len(self._gen)]
                for b, g in zip(valid, self._gen[valid].tolist(), strict=True):
                    self.stamps[b] = int(g)
                self.finished_sending.add(o.request_id)
                continue
            if tp is not None and tp.generations != o.generations:
                # The scheduler's snapshot lagged a bump: D's stamp check will fence it.
                a._count("stale_stamp_snapshot")

    def poll(self) -> None:
        with self.lock:
            self._poll_locked()

    def idle_wait(self) -> None:
        """Wait up to ``idle_wait_s``, polling every ``IDLE_SLICE``; return as soon as a
        poll handled a message or decided a free (the poller's too), and never after the
        ledger's next deadline (so an expiry is late by at most one slice). The lock is
        held for each poll, never across a sleep."""
        a = self.adapter
        with self.lock:
            if self.idle_wait_s <= 0 or self.finished_sending or self.stamps:
                return
            end = a.clock() + self.idle_wait_s
            self.idle_waits += 1
        while True:
            with self.lock:
                due = a.ledger.next_deadline()  # whole milliseconds, like the adapter's now
                stop = end if due is None else min(end, due / 1000.0)
            left = stop - a.clock()
            if left <= 0:
                return
            time.sleep(min(IDLE_SLICE, left))
            with self.lock:
                self.idle_polls += 1
                if self._poll_locked() or self.finished_sending or self.stamps:
                    return

    def take(self) -> tuple[set[str], dict[int, int]]:
        with self.lock:
            out, self.finished_sending = self.finished_sending, set()
            st, self.stamps = self.stamps, {}
        return out, st

    def counters(self) -> dict[str, float]:
        with self.lock:
            return self._counters()

    def check_invariants(self) -> list[str]:
        with self.lock:
            return list(self.adapter.check_invariants())

    def _counters(self) -> dict[str, float]:
        led = self.adapter.ledger
        c: dict[str, float] = {f"frees_{r}": float(n) for r, n in led.frees.items()}
        c["stranded_block_seconds"] = self.stranded
        for k, n in [*led.counters.items(), *self.adapter.counters.items()]:
            if k.startswith("rejected:"):
                key = "rejected_" + k[9:]
                c[key] = c.get(key, 0.0) + n
        c["stale_stamp_snapshots"] = float(self.adapter.counters.get("stale_stamp_snapshot", 0))
        # claims that reached P before the register of their handle (answered at it)
        c["claims_before_register"] = float(
            self.adapter.gate.counters.get("claim_before_register", 0))
        ac = self.adapter.counters
        c["handshake_failures"] = float(ac.get("handshake_refused", 0)
                                        + ac.get("handshake_metadata_error", 0))
        c["model_mismatches"] = float(ac.get("rejected:handshake_model_mismatch", 0))
        c["worker_steps"] = float(self.steps)
        c["idle_waits"] = float(self.idle_waits)
        c["poll_stalls"] = float(self.gaps.stalls)
        c["poll_stall_s"] = round(self.gaps.stalled_s, 3)
        c["idle_polls"] = float(self.idle_polls)
        c["poller_polls"] = float(self.poller_polls)
        c["poller_errors"] = float(self.poller_errors)
        c["held_requests"] = float(led.held_requests)
        c["held_blocks"] = float(led.pool.held_count)
        c["held_tokens"] = float(self.held_tokens)
        return c

    def close(self) -> None:
        self._stop_poller()
        with self.lock:
            self.adapter.close()
            if self.writer is not None:
                self.writer.close()


class DWorker(_Polled):
    """D's worker half: the ConsumerAdapter (agent, stamps landing area, Consumer).

    Driven like ``PWorker``: the engine thread (``apply``, ``poll``, ``take``) and the
    poller (``poll_gap_ms`` > 0), which polls while the engine thread has not for
    ``poll_gap_ms`` and D has work (``busy``): during a long forward pass, or while the
    engine loop waits for CPU, D still heartbeats the requests it waits for, sends its
    claims, posts the READs of loads already ordered, and reports what completed at the
    engine thread's next ``take``. ``lock`` serializes all of it (``_Polled``)."""

    role = "D"

    def __init__(self, opts: ConnectorOptions, name: str, tensors: list[torch.Tensor],
                 num_blocks: int, metrics: Metrics | None = None,
                 identity: dict[str, str] | None = None, fail: bool = False,
                 tp: tuple[int, int] = (0, 1)) -> None:
        """``tp``: (TP rank, TP size), in the handshake's layout."""
        from kvproto.nixl.consumer import ConsumerAdapter

        self.opts = opts
        self.metrics = metrics
        self.outcome = "failing it (kv_load_failure_policy fail)" if fail \
            else "prefilling locally"
        hook = None
        stalls = {"before_gen": opts.test_read_stall_s, "before_post": opts.test_stall_post_s}
        if any(v > 0 for v in stalls.values()):

            def hook(phase: str, rid: str) -> None:
                stall = stalls.get(phase, 0.0)
                if stall > 0:
                    log.warning("kvproto TEST HOOK: stalling %s %s for %.1fs", rid, phase,
                                stall)
                    time.sleep(stall)
        # D's own journal (the Consumer's events and effects) beside P's: with ``journal``
        # = X.jsonl it is X.consumer.jsonl; ``kvproto validate`` and ``replay`` take both.
        self.writer: JournalWriter | None = None
        if opts.journal:
            from kvproto.journal import JournalWriter

            self.writer = JournalWriter(consumer_journal_path(opts.journal), opts.config,
                                        meta={"engine": name, "source": "kvproto.vllm"},
                                        flush_every=opts.journal_flush_every, reader=name)
        from kvproto.nixl.faults import from_options

        self.faults = from_options(opts.test_faults)
        if self.faults is not None:
            log.warning("kvproto TEST SHIM: faults on D's notifications %s", opts.test_faults)
        self.adapter: ConsumerAdapter = ConsumerAdapter(
            name, opts.config, num_blocks=num_blocks, block_bytes=1,
            handshake_timeout=opts.handshake_timeout,
            handshake_attempts=opts.handshake_attempts, phase_hook=hook, kv_tensors=tensors,
            metrics=metrics, sink=self.writer.sink if self.writer is not None else None,
            identity=identity, fault_hook=self.faults, tp_rank=tp[0], tp_size=tp[1])
        self.adapter.transport.hold_reads_s = opts.test_hold_read_s
        # This rank's reading plan and coverage join (set by the connector once it knows
        # the rank, the model's KV heads and the layers it registered).
        self.reads = RankReads(0, 1, 1, {(0, 0)}, (1,))
        self.loads: dict[str, tuple[int, ...]] = {}  # ordered, awaiting completion
        # Loads whose READ went overdue while its transfer runs: rid -> local blocks, kept
        # out of finished_recving (vLLM holds the blocks) until the transfer ends.
        # Size: the adapter's quarantined requests (Consumer.stuck_reads).
        self.quarantined: dict[str, tuple[int, ...]] = {}
        # Admitted and not finished: request id -> (P engine, epoch, handle), and those
        # keys. The epoch belongs to the key: a restarted P mints handles from 1 again.
        self.admitted: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self.handles: set[tuple[str, int, int]] = set()
        # Admitted requests' joins (rid -> its parts' entries), and each entry's request
        # (part or orphan entry -> rid). Size: the admitted requests and their parts
        # (at most one part per P rank). Quarantined parts: entry -> rid, and the parts a
        # quarantined request waits for (rid -> entries).
        self.joins: dict[str, Join] = {}
        self.owner: dict[str, str] = {}
        self.qparts: dict[str, str] = {}
        self.qwait: dict[str, set[str]] = {}
        self.delayed: list[tuple[float, str, tuple[int, ...] | None]] = []  # test hook
        self.ended: OrderedDict[str, None] = OrderedDict()  # ended before a load order
        self.ended_report: list[str] = []
        self.ended_before_load = 0
        self.finished_recving: set[str] = set()
        self.failed: set[str] = set()  # of finished_recving: the loads that failed
        self.invalid: set[int] = set()
        self.stats: dict[str, float] = {"recomputed_blocks": 0.0, "reads_ok": 0.0,
                                        "reads_failed": 0.0, "read_blocks": 0.0}
        self._init_poller(opts.poll_gap_ms, name, opts.config.max_delay)

    def apply(self, orders: Orders) -> None:
        with self.lock:
            self._apply(orders)

    def _apply(self, orders: Orders) -> None:
        a = self.adapter
        for ad in orders.admits:
            rid = ad.request_id
            if ad.delay_ms is not None and self.metrics is not None:
                self.metrics.params_delay(ad.delay_ms / 1000, ad.late)
            try:
                plan = self.reads.plan(ad)
            except (TopologyUnsupported, ParamsError) as e:
                log.warning("kvproto: request %s: %s; %s", rid, e, self.outcome)
                self.stats["tp_refused"] = self.stats.get("tp_refused", 0.0) + 1
                if isinstance(e, TopologyUnsupported):
                    self._release_refused(ad)
                self._ended(rid)
                continue
            keys = tuple((pt.order.params.engine, pt.order.params.epoch,
                          pt.order.params.handle) for pt in plan.parts)
            if rid in self.admitted or any(k in self.handles for k in keys):
                # The same handle twice (e.g. D's n>1 children share P's params): one
                # pulls, the others prefill locally.
                self._ended(rid)
                continue
            if not self.reads.expect(rid, plan.need):
                log.warning("kvproto: request %s: coverage cannot track it; %s",
                            rid, self.outcome)
                self._ended(rid)
                continue
            self.admitted[rid] = keys
            self.handles.update(keys)
            j = self.joins[rid] = Join()
            t = a.transport
            for pt in plan.parts:
                prid = part_rid(rid, pt.p_rank, pt.stamps)
                j.parts[prid] = pt.p_rank
                self.owner[prid] = rid
                engine = pt.order.params.engine
                # How the engine's blocks are read: set before its handshake loads them.
                if pt.remote is not None:
                    t.slices[engine] = pt.remote
                if pt.local is not None:
                    t.local_slices[engine] = pt.local
                if pt.stamps:
                    t.stamp_set[engine] = pt.stamps
                a.add_engine(engine, pt.order.host, pt.order.port)
                a.admit(prid, pt.order.params)
            for o in plan.orphans:
                orid = orphan_rid(rid, o.params.engine)
                j.orphans.append(orid)
                self.owner[orid] = rid
                a.add_engine(o.params.engine, o.host, o.port)
                a.admit(orid, o.params)
        for ld in orders.loads:
            rid = ld.request_id
            jl = self.joins.get(rid)
            if ld.fail or rid in self.ended or jl is None or not ld.local_blocks \
                    or any(a.state(prid) == "new" for prid in jl.parts):
                self.ended.pop(rid, None)
                for prid in self._parts(rid):
                    a.abort(prid)  # releases to P if the machine still holds it
                    a.free_local(prid)
                self._close(rid)  # and releases its orphaned P ranks
                self.reads.drop(rid)
                self._complete(rid, ld.local_blocks, ok=False)
                continue
            self.loads[rid] = ld.local_blocks
            if self.opts.test_delay_load_s > 0:
                self.delayed.append((time.monotonic() + self.opts.test_delay_load_s, rid,
                                     ld.remote))
            else:
                for prid in jl.parts:
                    a.schedule(prid, ld.local_blocks, ld.remote)
        for rid in orders.aborts:
            self.ended.pop(rid, None)
            for prid in self._parts(rid):  # its orphans are released once they ended
                a.abort(prid)
        self._drain(a.poll())

    def _release_refused(self, ad: AdmitOrder) -> None:
        """A request refused per request with valid params: tell the P ranks this rank
        would have read (and, on rank 0, the orphaned ones) that it never will. Each
        goes through a Consumer entry admitted and aborted at once: the machine sends
        ``release`` (held while the P rank's handshake runs; lost, and P frees by lease
        expiry, if that handshake fails). The entries' completions are not reported."""
        a = self.adapter
        for o in self.reads.refused_releases(ad):
            erid = f"{ad.request_id}#r:{o.params.engine}"
            if a.state(erid) != "new":
                continue
            a.add_engine(o.params.engine, o.host, o.port)
            a.admit(erid, o.params)
            a.abort(erid)
            self.stats["tp_refused_released"] = self.stats.get("tp_refused_released",
                                                               0.0) + 1

    def _parts(self, rid: str) -> list[str]:
        """The Consumer entries of ``rid``'s running parts (``rid`` itself when it was
        never admitted)."""
        j = self.joins.get(rid)
        return list(j.parts) if j is not None else [rid]

    def _close(self, rid: str) -> None:
        """``rid``'s parts all ended: forget its join, and release its orphaned P ranks
        (abort: their entries send ``release``; P frees as ``released``)."""
        j = self.joins.pop(rid, None)
        keys = self.admitted.pop(rid, ())
        self.handles.difference_update(keys)
        if j is None:
            return
        for prid in j.parts:
            self.owner.pop(prid, None)
        for orid in j.orphans:
            if self.owner.pop(orid, None) is not None:
                self.adapter.abort(orid)

    def poll(self) -> None:
        with self.lock:
            self._poll_locked()

    def _poller_due(self) -> bool:
        return self._busy()

    def _has_work(self) -> bool:
        return self._busy()

    def _poll_locked(self) -> int:
        if self.delayed:
            now = time.monotonic()
            due = [(rid, ix) for t, rid, ix in self.delayed if t <= now]
            self.delayed = [d for d in self.delayed if d[0] > now]
            for rid, ix in due:
                local = self.loads.get(rid)
                j = self.joins.get(rid)
                if local is not None and j is not None:
                    for prid in j.parts:
                        self.adapter.schedule(prid, local, ix)
        completions = self.adapter.poll()
        self._note_poll()
        self._drain(completions)
        # what draining decided (an orphan's release, a failed part's siblings aborted)
        # leaves now: an idle engine may not step, and so not poll, for a long time
        self.adapter.flush()
        return len(completions)

    @property
    def busy(self) -> bool:
        """Requests admitted, loading, delayed or quarantined: poll every step."""
        with self.lock:
            return self._busy()

    def _busy(self) -> bool:
        return bool(self.admitted or self.loads or self.delayed or self.quarantined
                    or self.owner)

    def _ended(self, rid: str) -> None:
        self.ended_before_load += 1
        self.ended[rid] = None
        self.ended_report.append(rid)
        if len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)

    def _drain(self, completions: Iterable[Completion]) -> None:
        for prid in self.adapter.take_unquarantined():
            rid = self.qparts.pop(prid, None)
            if rid is None:
                continue
            j = self.joins.get(rid)
            if j is not None:
                j.quarantined.discard(prid)
                continue
            waiting = self.qwait.get(rid)
            if waiting is not None:
                waiting.discard(prid)
                if waiting:
                    continue
                del self.qwait[rid]
            local = self.quarantined.pop(rid, None)
            if local is not None:  # its blocks were reported invalid at the deadline
                self.finished_recving.add(rid)
                self.failed.add(rid)
        for c in completions:
            prid = c.request_id
            self.adapter.free_local(prid)
            rid = self.owner.get(prid)
            j = self.joins.get(rid) if rid is not None else None
            if rid is None or j is None or prid not in j.parts:
                continue  # an orphan's entry ended, or a request already closed
            p_rank = j.parts.pop(prid)
            del self.owner[prid]
            if self.adapter.quarantined(prid):
                j.quarantined.add(prid)
                self.qparts[prid] = rid
            j.aborted |= c.reason == "aborted"
            local = self.loads.get(rid)
            if local is None:  # ended before its load order: the others cannot serve it
                if not j.ended:
                    j.ended = True
                    self.reads.drop(rid)
                    for other in j.parts:
                        self.adapter.abort(other)
                    if c.reason != "aborted":
                        log.warning("kvproto: remote KV of %s cannot be loaded (%s: %s); "
                                    "%s", rid, c.state, c.reason, self.outcome)
                    self._ended(rid)
                if not j.parts:
                    self._close(rid)
                continue
            if j.result is None:
                pulled = c.state == D_DONE and c.reason == "pulled" \
                    and prid not in j.quarantined
                # Fail closed on coverage: served only when every part's READ landed
                # and verified every region of the request's map on this rank.
                res, cancel = self.reads.finish_part(rid, p_rank, pulled)
                j.result = res
                if cancel:
                    for other, p in j.parts.items():
                        if p in cancel:
                            self.adapter.abort(other)
                if pulled and res is False:
                    log.warning("kvproto: READ of %s verified but incomplete (coverage: "
                                "regions missing); %d blocks reported for recompute",
                                rid, len(local))
                elif res is False and c.reason != "aborted":
                    log.warning("kvproto: remote KV of %s not served (part %s, %s: %s); "
                                "%d blocks reported for recompute", rid, prid, c.state,
                                c.reason, len(local))
            if j.parts:
                continue  # another part's READ may still land in these blocks
            self._close(rid)
            self.loads.pop(rid, None)
            if j.quarantined:
                self._quarantine(rid, local, set(j.quarantined))
                continue
            # A client abort (vLLM already ended the request) is no failed read: its
            # blocks are still named, so nothing computes on them, but it is not counted
            # as a read failure or as blocks to recompute.
            ok = j.result is True
            self._complete(rid, local, ok=ok, counted=not (j.aborted and not ok))

    def _quarantine(self, rid: str, local: tuple[int, ...], parts: set[str]) -> None:
        """The load's READ is overdue and its transfer still runs. Its blocks are
        reported as load errors now (vLLM fails the request under "fail", or marks it
        for recompute under "recompute") but the request is kept out of
        ``finished_recving`` until the transfer ends: while a request waits for remote
        KV, or was finished before its receive finished, vLLM neither frees nor reuses
        its blocks."""
        self.quarantined[rid] = local
        self.qwait[rid] = parts  # the quarantined parts whose transfer still runs
        self.invalid.update(local)
        self.stats["reads_failed"] += 1
        self.stats["recomputed_blocks"] += len(local)
        log.warning("kvproto: READ of %s overdue; %d local blocks quarantined until the "
                    "transfer ends; %s", rid, len(local), self.outcome)

    def _complete(self, rid: str, local: tuple[int, ...], ok: bool,
                  counted: bool = True) -> None:
        self.finished_recving.add(rid)
        if ok:
            self.stats["reads_ok"] += 1
            self.stats["read_blocks"] += len(local)
        else:
            self.failed.add(rid)
            if counted:
                self.stats["reads_failed"] += 1
                self.stats["recomputed_blocks"] += len(local)
            self.invalid.update(local)

    def take(self) -> tuple[set[str], set[int], list[str]]:
        """Finished receives, the blocks to report as load errors, and the requests
        ended before their load order, each taken once."""
        with self.lock:
            fr, self.finished_recving = self.finished_recving, set()
            inv, self.invalid = self.invalid, set()
            er, self.ended_report = self.ended_report, []
        return fr, inv, er

    def take_failed(self) -> set[str]:
        """The failed loads among the requests ``take`` reported (taken together)."""
        with self.lock:
            out, self.failed = self.failed, set()
        return out

    def take_all(self) -> tuple[set[str], set[int], list[str], set[str]]:
        """``take`` and ``take_failed`` under one lock: a failed load is reported in the
        same step as its finished receive, whatever the poller completes meanwhile."""
        with self.lock:
            fr, self.finished_recving = self.finished_recving, set()
            inv, self.invalid = self.invalid, set()
            er, self.ended_report = self.ended_report, []
            failed, self.failed = self.failed, set()
        return fr, inv, er, failed

    def counters(self) -> dict[str, float]:
        with self.lock:
            return self._counters()

    def _counters(self) -> dict[str, float]:
        c = dict(self.stats)
        c["poller_polls"] = float(self.poller_polls)
        c["poller_errors"] = float(self.poller_errors)
        c["poll_stalls"] = float(self.gaps.stalls)
        c["poll_stall_s"] = round(self.gaps.stalled_s, 3)
        c.update(self.reads.counters)
        ac = self.adapter.counters
        c["fenced_reads"] = float(ac.get("fenced", 0))
        c["checksum_failures"] = float(ac.get("checksum_failed", 0))
        c["checksum_verified_blocks"] = float(ac.get("checksum_verified", 0))
        c["ended_before_load"] = float(self.ended_before_load)
        c["read_refused"] = float(ac.get("read_refused", 0))
        c["peer_lost"] = float(ac.get("peer_lost", 0))
        c["stuck_reads"] = float(len(self.quarantined))
        c["read_timeouts"] = float(ac.get("quarantined", 0))
        mc = self.adapter.machine.counters
        c["second_pulls"] = float(mc.get("second_pull", 0))
        c["claims_retried"] = float(mc.get("claims_retried", 0))
        c["handshake_failures"] = float(sum(n for k, n in ac.items()
                                            if k.startswith("handshake_failed:")))
        c["model_mismatches"] = float(ac.get("handshake_failed:model_mismatch", 0))
        if self.faults is not None:
            for k, n in self.faults.counts.items():
                c["test_faults_" + k] = float(n)
        for k, n in ac.items():
            if k.startswith("rejected:"):
                c["rejected_" + k[9:]] = c.get("rejected_" + k[9:], 0.0) + n
        return c

    def close(self) -> None:
        self._stop_poller()
        with self.lock:
            self.adapter.close()
            if self.writer is not None:
                self.writer.close()


# ---------------------------------------------------------------------------
# The connector.
# ---------------------------------------------------------------------------
