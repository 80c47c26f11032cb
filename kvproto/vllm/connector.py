"""``KVProtoConnector``: kvproto's lifecycle as a vLLM 0.32 KV connector (no vLLM patch).

Load it with ``kv_transfer_config={"kv_connector": "KVProtoConnector",
"kv_connector_module_path": "kvproto.vllm.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {...}}`` (keys: ``kvproto.vllm.sched.EXTRA_KEYS``).

Design (spec/VLLM.md has the hook-by-hook table)
================================================

vLLM builds two instances: the SCHEDULER-side one in the engine-core process and one
WORKER-side instance per GPU/CPU worker (possibly another process). They talk only through
vLLM's channels: connector metadata (scheduler -> worker, every step), the worker's
``KVConnectorOutput`` (``finished_sending``/``finished_recving``, invalid block ids and
``KVConnectorWorkerMetadata``, worker -> scheduler, every step) and, once at start-up, the
worker's handshake metadata.

Where the machines live: in the WORKER. P's ``Ledger`` (inside ``ProducerAdapter``) and
D's ``Consumer`` (inside ``ConsumerAdapter``) sit next to the NIXL agent that owns the
registered KV tensors, receives the notifications and posts the READs, so every lifecycle
event and effect is handled where its I/O happens, and the adapters are reused as they are.
The scheduler side makes no lifecycle decision; it mints handles, snapshots stamps and
forwards orders.

P (prefill engine)
  * ``request_finished`` (scheduler) runs synchronously and must return D's transfer
    params. It mints the handle (a counter; the worker's ledger accepts handles minted
    elsewhere), takes the engine name, epoch and handshake address from the worker's
    handshake metadata, and snapshots each block's generation from a *mirror* of the
    worker's stamps. It returns ``delay_free=True`` and queues a register order.
  * The worker registers the blocks with the ``Ledger`` at the start of the next step.
    Early heartbeats/done from D are staged by the ledger, so the order is safe.
  * Every ``Free`` effect (transferred, released, expired, aborted, sibling) first bumps
    the generation stamp of each reclaimed block in the registered stamp tensor (the
    adapter does this synchronously, in the worker), THEN the request id is reported in
    ``finished_sending`` from ``get_finished`` -- only then does vLLM free the blocks for
    reuse. The worker also reports the new stamps as worker metadata; vLLM hands that to
    ``update_connector_output`` before it processes ``finished_sending`` of the same
    step, so the mirror is updated before any block can be reallocated.
  * P's NIXL agent runs its progress thread (``progress_thread``): over UCX without RDMA
    a READ needs the target to make progress, and P's engine stops stepping when it
    holds nothing (a late D's READ of freed blocks would otherwise never complete).
  * The engine keeps stepping while any block is held: a request whose free is delayed
    stays in vLLM's request table, and ``Scheduler.has_requests`` (via
    ``has_finished_requests``) keeps the loop running with empty steps; each step calls
    the worker (``kv_connector_no_forward``), which polls the adapter (handshakes,
    notifications, acks, expiry ticks).
  * Idle wait: a step that only exists because blocks are held (the scheduler scheduled
    nothing and ordered nothing, and the worker has no D work) waits in ``get_finished``
    up to ``idle_wait_ms``, polling the adapter every ``IDLE_SLICE`` seconds, and ends
    early on any message handled or free decided, and never later than the ledger's next
    deadline. So an expiry is freed at most one slice late, a done at most one slice
    after it arrives, D's READs never wait on it (NIXL's progress thread serves them),
    and a client request arriving meanwhile is scheduled at most ``idle_wait_ms`` later.
  * The handshake listener answers from a thread of its own, so a long forward pass does
    not outlast D's handshake budget; the handshakes take effect on the engine thread at
    its next poll (``ProducerAdapter(handshake_thread=True)``).
  * ``has_pending_block_frees`` is false: held blocks come back at D's pace (a read or
    the lease's end), so vLLM preempts a running request rather than wait for them.
  * Data-parallel rank r binds a fixed ``handshake_port``/``metrics_port`` as port + r.

Why P is fail-closed. Claim: if D's stamp READ (posted after its data READ completed)
returns the generations of the transfer params, the data D read is the data the request
held. (1) While the ledger holds block b, vLLM holds it too (the request's free is
delayed), so b's contents cannot change. (2) vLLM can reuse b only after every holder
released it; the ledger's last holder releasing b is a ``Free`` with b reclaimed, whose
bump is written to the stamp tensor before the request id is reported (same worker
thread, same step), i.e. before vLLM can reallocate b. So every change of b's contents
after registration is preceded by a bump. (3) The mirror only takes values the worker
reported, so the snapshot g given to D is at most the stamp at registration time; if it
is lower, D never sees g (stamps only grow): fenced. If equal, a matching stamp READ
after the data READ means no bump happened before the stamp READ, hence no reuse before
it, hence none during the data READ. A stale mirror can only fence (recompute) a good
read, never pass a bad one. Restarted P: a new random epoch; D refuses params whose
epoch differs from the one P's handshake announced.

D (decode engine)
  * ``on_new_request`` validates the client's ``kv_transfer_params`` (bad ones are a
    counted, logged rejection) and orders an admit; the
    worker's ``Consumer`` admits it on the next step, so heartbeats start while the
    request is still queued. Handshakes are non-blocking (own socket, deadline, backoff
    per P engine), so one dead P never delays another.
  * ``get_num_new_matched_tokens`` answers the prompt's tokens as an async load;
    ``update_state_after_alloc`` orders a load into the newly allocated blocks (a suffix
    of P's blocks when D's prefix cache supplied the rest). The worker READs the data,
    then the stamps (one READ each per P engine and step), compares them, and sends the
    verified requests' ``done`` as one done batch.
  * Every ordered load ends in ``finished_recving``. A failed or fenced READ also names
    the request in ``failed_recving`` and its local blocks in
    ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"`` vLLM
    recomputes it, with "fail" (vLLM 0.32's default) the request fails with an error.
    The bad data is never computed on.
  * A READ past ``max_read_time + read_grace`` (the machine's ``read_timeout``, its local
    blocks quarantined): the blocks are load errors at once, the request joins
    ``finished_recving``/``failed_recving`` only when the transfer ended, so vLLM never
    lends them while the transfer may write them (spec/VLLM.md, "Quarantine").
  * Requests whose KV cannot be loaded before any load order (params rejected, P's
    tokens not the prompt's, or ended by the machine: lease lost while queued, handshake
    failed, P lost; the worker reports those as metadata) follow the same policy: under
    "recompute" ``get_num_new_matched_tokens`` answers 0 and vLLM prefills locally;
    under "fail" it answers an asynchronous load that fails at once. P dead: the
    handshake fails, the channel closes or acks stop, so every request ends within the
    handshake/lease bounds.
  * A client abort (``request_finished`` on D) orders an abort: release when no READ is
    in flight, otherwise after it (vLLM keeps the blocks until ``finished_recving``). A
    release decided while D's handshake with P still runs is sent once it completes.
  * D's n>1 children carry the same params (one handle): the first pulls, the others
    prefill locally (or hit D's prefix cache), under either policy.

Model identity: ``register_kv_caches`` (after vLLM loaded the weights) computes this
worker's identity once (``kvproto.vllm.identity``: architecture, configuration, weights
fingerprint or ``model_revision``, dtype, KV geometry and layout, cache groups, parallel
layout, speculative decoding, versions); P's and D's adapters send it in the handshake and
refuse a peer whose identity differs in any field before any READ (``model_mismatch``,
counted and logged with the fields). Its requests then end like any failed handshake.

Bounds: every per-request structure (scheduler and worker) holds only requests vLLM itself
holds and is emptied when vLLM finishes them; the D worker's memory of requests ended
before a load order is capped (``MAX_ENDED``); per-step buffers are emptied every step.

Limits of this version: tensor parallel size 1 on both sides (expected readers per P rank
is configurable and decided by the ledger); one KV cache group (no hybrid allocator).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvproto.lifecycle import D_DONE, UNREGISTERED, Effect, Free
from kvproto.port import now_ms
from kvproto.vllm.sched import (
    ConnectorOptions,
    DScheduler,
    Orders,
    PeerInfo,
    PScheduler,
)

if TYPE_CHECKING:
    from kvproto.journal import JournalWriter
    from kvproto.metrics import Exporter, Metrics
    from kvproto.nixl.consumer import Completion, ConsumerAdapter
    from kvproto.nixl.producer import ProducerAdapter

log = logging.getLogger(__name__)


def _share_vllm_logging() -> None:
    """Route kvproto's log records (connector and NIXL adapters) to vLLM's handlers, so
    they appear in the engine's log; only when kvproto has none of its own."""
    kv, vl = logging.getLogger("kvproto"), logging.getLogger("vllm")
    if not kv.handlers and vl.handlers:
        for h in vl.handlers:
            kv.addHandler(h)
        kv.setLevel(logging.INFO)
        kv.propagate = False


STATS_INTERVAL = 0.5  # seconds between connector-stats deltas
IDLE_SLICE = 0.002  # seconds between adapter polls inside one idle wait
MAX_ENDED = 65536  # D worker: requests ended before their load order, remembered (oldest dropped)


# ---------------------------------------------------------------------------
# Data carried by vLLM between the two sides.
# ---------------------------------------------------------------------------


@dataclass
class KVProtoMetadata(KVConnectorMetadata):
    """Scheduler -> worker, every step."""

    orders: Orders = field(default_factory=Orders)
    idle: bool = False  # nothing scheduled and nothing ordered this step


@dataclass
class KVProtoWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step that has something to say."""

    stamps: dict[int, int] = field(default_factory=dict)  # P: block -> new generation
    ended: list[str] = field(default_factory=list)  # D: ended before a load order

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVProtoWorkerMetadata):
            return self
        stamps = dict(self.stamps)
        for b, g in other.stamps.items():
            if g > stamps.get(b, -1):
                stamps[b] = g
        return KVProtoWorkerMetadata(stamps, [*self.ended, *other.ended])


@dataclass
class KVProtoHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once: what the transfer params must name."""

    engine: str = ""
    epoch: int = 0
    host: str = ""
    port: int = 0


# ---------------------------------------------------------------------------
# Stats and Prometheus.
# ---------------------------------------------------------------------------

# Stat keys (KVProtoStats.data): frees_<reason>, stranded_block_seconds, fenced_reads,
# recomputed_blocks, handshake_failures, model_mismatches, rejected_params,
# rejected_messages, reads_ok, reads_failed, stale_stamp_snapshots.


@dataclass
class KVProtoStats(KVConnectorStats):
    """Counters over one interval; aggregation sums them."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        out = dict(self.data)
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
        return KVProtoStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.data.items()
                if isinstance(v, (int, float))}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Delta:
    """Turns cumulative counters into per-interval deltas."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, now: dict[str, float]) -> KVProtoStats | None:
        out: dict[str, float] = {}
        for k, v in now.items():
            d = v - self._last.get(k, 0)
            if d:
                out[k] = d
        self._last = dict(now)
        return KVProtoStats(data=out) if out else None


class KVProtoPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters for the stat keys above (kept small so it can move onto the
    shared adapter metric definitions)."""

    NAMES: ClassVar[dict[str, tuple[str, str]]] = {
        "frees": ("kvproto:frees", "P: blocks-holding requests freed, by reason"),
        "stranded_block_seconds": ("kvproto:stranded_block_seconds",
                                   "P: block-seconds held by requests freed by expiry/abort"),
        "fenced_reads": ("kvproto:fenced_reads", "D: READs whose stamps changed (never served)"),
        "recomputed_blocks": ("kvproto:recomputed_blocks", "D: blocks reported as load errors"),
        "handshake_failures": ("kvproto:handshake_failures", "D: handshakes that failed"),
        "model_mismatches": ("kvproto:model_mismatches",
                             "handshakes refused: the peer's model identity differs"),
        "rejected": ("kvproto:rejected", "bad input rejected (params, messages)"),
    }

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._m: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in self.NAMES.items():
            extra = ["reason"] if key in ("frees", "rejected") else []
            c = self._counter_cls(name=name, documentation=doc, labelnames=labelnames + extra)
            self._m[key] = {i: c for i in per_engine_labelvalues}
        self._labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._labels.get(engine_idx, [])
        for k, v in transfer_stats_data.items():
            if not isinstance(v, (int, float)) or v <= 0:
                continue
            if k.startswith("frees_"):
                self._m["frees"][engine_idx].labels(*labels, k[6:]).inc(v)
            elif k.startswith("rejected_"):
                self._m["rejected"][engine_idx].labels(*labels, k[9:]).inc(v)
            elif k in self._m:
                self._m[k][engine_idx].labels(*labels).inc(v)


# ---------------------------------------------------------------------------
# Worker side: P and D.
# ---------------------------------------------------------------------------


def consumer_journal_path(journal: str) -> str:
    """Where a D worker writes its Consumer journal, given the ``journal`` option."""
    p = Path(journal)
    return str(p.with_name(p.stem + ".consumer" + (p.suffix or ".jsonl")))


class _PWorker:
    """P's worker half: the ProducerAdapter (agent, stamps, ledger, handshake listener)."""

    def __init__(self, opts: ConnectorOptions, name: str, tensors: list[torch.Tensor],
                 num_blocks: int, port: int, metrics: Metrics | None = None,
                 identity: dict[str, str] | None = None) -> None:
        from kvproto.nixl.producer import ProducerAdapter

        self.writer: JournalWriter | None = None
        if opts.journal:
            from kvproto.journal import JournalWriter

            self.writer = JournalWriter(opts.journal, opts.config, num_blocks,
                                        meta={"engine": name, "source": "kvproto.vllm"},
                                        flush_every=opts.journal_flush_every)
        self.finished_sending: set[str] = set()
        self.stamps: dict[int, int] = {}
        self._reg_at: dict[int, tuple[int, int]] = {}  # handle -> (ms, blocks)
        self.stranded = 0.0
        self.adapter: ProducerAdapter = ProducerAdapter(
            name, opts.config, num_blocks=num_blocks, block_bytes=1,
            sink=self.writer.sink if self.writer is not None else None,
            host=opts.handshake_host, port=port, strict_pool=False,
            observer=self._observe, kv_tensors=tensors, progress_thread=opts.progress_thread,
            metrics=metrics, identity=identity, handshake_thread=True)
        self._gen = self.adapter.region.gen
        self.idle_wait_s = opts.idle_wait_ms / 1000.0
        self.steps = 0  # worker steps (get_finished calls)
        self.idle_waits = 0  # of those, steps that waited
        self.idle_polls = 0  # adapter polls made inside idle waits

    def _observe(self, e: Effect, now: int) -> None:
        if isinstance(e, Free):
            # The adapter bumped the reclaimed blocks' stamps before calling us.
            self.finished_sending.add(e.request_id)
            if e.reclaimed:
                gens = self._gen[list(e.reclaimed)].tolist()
                for b, g in zip(e.reclaimed, gens, strict=True):
                    self.stamps[b] = int(g)
            t = self._reg_at.pop(e.handle, None)
            if t is not None and e.reason in ("expired", "aborted"):
                self.stranded += (now - t[0]) / 1000 * t[1]

    def apply(self, orders: Orders) -> None:
        a = self.adapter
        for o in orders.registers:
            tp = a.register(o.request_id, list(o.blocks), group=o.group, expected=o.expected,
                            handle=o.handle)
            if a.ledger.state(o.handle) == UNREGISTERED:
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
            self._reg_at.setdefault(o.handle, (now_ms(a.clock), len(o.blocks)))
            if tp is not None and tp.generations != o.generations:
                # The scheduler's snapshot lagged a bump: D's stamp check will fence it.
                a._count("stale_stamp_snapshot")

    def poll(self) -> None:
        self.adapter.poll()

    def idle_wait(self) -> None:
        """Wait up to ``idle_wait_s``, polling every ``IDLE_SLICE``; return as soon as a
        poll handled a message or decided a free, and never after the ledger's next
        deadline (so an expiry is late by at most one slice)."""
        if self.idle_wait_s <= 0 or self.finished_sending or self.stamps:
            return
        a = self.adapter
        end = a.clock() + self.idle_wait_s
        self.idle_waits += 1
        while True:
            due = a.ledger.next_deadline()
            stop = end if due is None else min(end, due)
            left = stop - a.clock()
            if left <= 0:
                return
            time.sleep(min(IDLE_SLICE, left))
            self.idle_polls += 1
            if a.poll() or self.finished_sending or self.stamps:
                return

    def take(self) -> tuple[set[str], dict[int, int]]:
        out, self.finished_sending = self.finished_sending, set()
        st, self.stamps = self.stamps, {}
        return out, st

    def counters(self) -> dict[str, float]:
        led = self.adapter.ledger
        c: dict[str, float] = {f"frees_{r}": float(n) for r, n in led.frees.items()}
        c["stranded_block_seconds"] = self.stranded
        for k, n in [*led.counters.items(), *self.adapter.counters.items()]:
            if k.startswith("rejected:"):
                key = "rejected_" + k[9:]
                c[key] = c.get(key, 0.0) + n
        c["stale_stamp_snapshots"] = float(self.adapter.counters.get("stale_stamp_snapshot", 0))
        ac = self.adapter.counters
        c["handshake_failures"] = float(ac.get("handshake_refused", 0)
                                        + ac.get("handshake_metadata_error", 0))
        c["model_mismatches"] = float(ac.get("rejected:handshake_model_mismatch", 0))
        c["worker_steps"] = float(self.steps)
        c["idle_waits"] = float(self.idle_waits)
        c["idle_polls"] = float(self.idle_polls)
        c["held_requests"] = float(led.held_requests)
        c["held_blocks"] = float(led.pool.held_count)
        return c

    def close(self) -> None:
        self.adapter.close()
        if self.writer is not None:
            self.writer.close()


class _DWorker:
    """D's worker half: the ConsumerAdapter (agent, stamps landing area, Consumer)."""

    def __init__(self, opts: ConnectorOptions, name: str, tensors: list[torch.Tensor],
                 num_blocks: int, metrics: Metrics | None = None,
                 identity: dict[str, str] | None = None, fail: bool = False) -> None:
        from kvproto.nixl.consumer import ConsumerAdapter

        self.opts = opts
        self.outcome = "failing it (kv_load_failure_policy fail)" if fail \
            else "prefilling locally"
        hook = None
        if opts.test_read_stall_s > 0:
            stall = opts.test_read_stall_s

            def hook(phase: str, rid: str) -> None:
                if phase == "before_gen":
                    log.warning("kvproto TEST HOOK: stalling %s for %.1fs", rid, stall)
                    time.sleep(stall)
        # D's own journal (the Consumer's events and effects) beside P's: with ``journal``
        # = X.jsonl it is X.consumer.jsonl; ``kvproto validate`` and ``replay`` take both.
        self.writer: JournalWriter | None = None
        if opts.journal:
            from kvproto.journal import JournalWriter

            self.writer = JournalWriter(consumer_journal_path(opts.journal), opts.config,
                                        meta={"engine": name, "source": "kvproto.vllm"},
                                        flush_every=opts.journal_flush_every, reader=name)
        self.adapter: ConsumerAdapter = ConsumerAdapter(
            name, opts.config, num_blocks=num_blocks, block_bytes=1,
            handshake_timeout=opts.handshake_timeout,
            handshake_attempts=opts.handshake_attempts, phase_hook=hook, kv_tensors=tensors,
            metrics=metrics, sink=self.writer.sink if self.writer is not None else None,
            identity=identity)
        self.adapter.transport.hold_reads_s = opts.test_hold_read_s
        self.loads: dict[str, tuple[int, ...]] = {}  # ordered, awaiting completion
        # Loads whose READ went overdue while its transfer runs: rid -> local blocks, kept
        # out of finished_recving (vLLM holds the blocks) until the transfer ends.
        # Size: the adapter's quarantined requests (Consumer.stuck_reads).
        self.quarantined: dict[str, tuple[int, ...]] = {}
        # Admitted and not finished: request id -> (P engine, epoch, handle), and those
        # keys. The epoch belongs to the key: a restarted P mints handles from 1 again.
        self.admitted: dict[str, tuple[str, int, int]] = {}
        self.handles: set[tuple[str, int, int]] = set()
        self.delayed: list[tuple[float, str]] = []  # test hook: (due, rid)
        self.ended: OrderedDict[str, None] = OrderedDict()  # ended before a load order
        self.ended_report: list[str] = []
        self.ended_before_load = 0
        self.finished_recving: set[str] = set()
        self.failed: set[str] = set()  # of finished_recving: the loads that failed
        self.invalid: set[int] = set()
        self.stats: dict[str, float] = {"recomputed_blocks": 0.0, "reads_ok": 0.0,
                                        "reads_failed": 0.0}

    def apply(self, orders: Orders) -> None:
        a = self.adapter
        for ad in orders.admits:
            key = (ad.params.engine, ad.params.epoch, ad.params.handle)
            if ad.request_id in self.admitted or key in self.handles:
                # The same handle twice (e.g. D's n>1 children share P's params): one
                # pulls, the others prefill locally.
                self._ended(ad.request_id)
                continue
            self.admitted[ad.request_id] = key
            self.handles.add(key)
            a.add_engine(ad.params.engine, ad.host, ad.port)
            a.admit(ad.request_id, ad.params)
        for ld in orders.loads:
            rid = ld.request_id
            if ld.fail or rid in self.ended or a.state(rid) == "new" or not ld.local_blocks:
                self.ended.pop(rid, None)
                a.abort(rid)  # releases to P if the machine still holds it
                a.free_local(rid)
                self._complete(rid, ld.local_blocks, ok=False)
                continue
            self.loads[rid] = ld.local_blocks
            if self.opts.test_delay_load_s > 0:
                self.delayed.append((time.monotonic() + self.opts.test_delay_load_s, rid))
            else:
                a.schedule(rid, ld.local_blocks)
        for rid in orders.aborts:
            self.ended.pop(rid, None)
            a.abort(rid)
        self._drain(a.poll())

    def poll(self) -> None:
        if self.delayed:
            now = time.monotonic()
            due = [rid for t, rid in self.delayed if t <= now]
            self.delayed = [(t, rid) for t, rid in self.delayed if t > now]
            for rid in due:
                local = self.loads.get(rid)
                if local is not None:
                    self.adapter.schedule(rid, local)
        self._drain(self.adapter.poll())

    @property
    def busy(self) -> bool:
        """Requests admitted, loading, delayed or quarantined: poll every step."""
        return bool(self.admitted or self.loads or self.delayed or self.quarantined)

    def _ended(self, rid: str) -> None:
        self.ended_before_load += 1
        self.ended[rid] = None
        self.ended_report.append(rid)
        if len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)

    def _drain(self, completions: Iterable[Completion]) -> None:
        for rid in self.adapter.take_unquarantined():
            local = self.quarantined.pop(rid, None)
            if local is not None:  # its blocks were reported invalid at the deadline
                self.finished_recving.add(rid)
                self.failed.add(rid)
        for c in completions:
            key = self.admitted.pop(c.request_id, None)
            if key is not None:
                self.handles.discard(key)
            local = self.loads.pop(c.request_id, None)
            self.adapter.free_local(c.request_id)
            if local is None:
                if c.reason != "aborted":
                    log.warning("kvproto: remote KV of %s cannot be loaded (%s: %s); %s",
                                c.request_id, c.state, c.reason, self.outcome)
                self._ended(c.request_id)
                continue
            if self.adapter.quarantined(c.request_id):
                self._quarantine(c.request_id, local)
                continue
            ok = c.state == D_DONE and c.reason == "pulled"
            # A client abort (vLLM already ended the request) is no failed read: its
            # blocks are still named, so nothing computes on them, but it is not counted
            # as a read failure or as blocks to recompute.
            aborted = c.reason == "aborted"
            self._complete(c.request_id, local, ok=ok, counted=not aborted)
            if not ok and not aborted:
                log.warning("kvproto: remote KV of %s not served (%s: %s); %d blocks "
                            "reported for recompute", c.request_id, c.state, c.reason,
                            len(local))

    def _quarantine(self, rid: str, local: tuple[int, ...]) -> None:
        """The load's READ is overdue and its transfer still runs. Its blocks are
        reported as load errors now (vLLM fails the request under "fail", or marks it
        for recompute under "recompute") but the request is kept out of
        ``finished_recving`` until the transfer ends: while a request waits for remote
        KV, or was finished before its receive finished, vLLM neither frees nor reuses
        its blocks."""
        self.quarantined[rid] = local
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
        else:
            self.failed.add(rid)
            if counted:
                self.stats["reads_failed"] += 1
                self.stats["recomputed_blocks"] += len(local)
            self.invalid.update(local)

    def take(self) -> tuple[set[str], set[int], list[str]]:
        fr, self.finished_recving = self.finished_recving, set()
        inv, self.invalid = self.invalid, set()
        er, self.ended_report = self.ended_report, []
        return fr, inv, er

    def take_failed(self) -> set[str]:
        """The failed loads among the requests ``take`` reported (taken together)."""
        out, self.failed = self.failed, set()
        return out

    def counters(self) -> dict[str, float]:
        c = dict(self.stats)
        ac = self.adapter.counters
        c["fenced_reads"] = float(ac.get("fenced", 0))
        c["ended_before_load"] = float(self.ended_before_load)
        c["read_refused"] = float(ac.get("read_refused", 0))
        c["peer_lost"] = float(ac.get("peer_lost", 0))
        c["stuck_reads"] = float(len(self.quarantined))
        c["read_timeouts"] = float(ac.get("quarantined", 0))
        c["second_pulls"] = float(self.adapter.machine.counters.get("second_pull", 0))
        c["handshake_failures"] = float(sum(n for k, n in ac.items()
                                            if k.startswith("handshake_failed:")))
        c["model_mismatches"] = float(ac.get("handshake_failed:model_mismatch", 0))
        for k, n in ac.items():
            if k.startswith("rejected:"):
                c["rejected_" + k[9:]] = c.get("rejected_" + k[9:], 0.0) + n
        return c

    def close(self) -> None:
        self.adapter.close()
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------------
# The connector.
# ---------------------------------------------------------------------------


class KVProtoConnector(KVConnectorBase_V1):
    """kvproto's fail-closed P/D lifecycle as a vLLM KV connector (see module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
                 ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_logging()
        ktc = vllm_config.kv_transfer_config
        pc = vllm_config.parallel_config
        # Each data-parallel rank is an engine of its own: fixed ports become port + rank.
        self.dp_rank = int(getattr(pc, "data_parallel_index", 0) or 0)
        self.opts = ConnectorOptions.parse(ktc.kv_connector_extra_config, ktc.kv_role
                                           ).for_dp_rank(self.dp_rank)
        self.load_failure_policy = str(getattr(ktc, "kv_load_failure_policy", "fail"))
        tp = pc.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"kvproto: tensor_parallel_size {tp} is not supported by this "
                             "version of KVProtoConnector (use 1)")
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        self.psched: PScheduler | None = None
        self.dsched: DScheduler | None = None
        self.pw: _PWorker | None = None
        self.dw: _DWorker | None = None
        self._delta = _Delta()
        self._next_stats = 0.0
        self._exporter: Exporter | None = None
        # Worker: this step's outputs, handed to vLLM by the hooks below.
        self._stamps: dict[int, int] = {}
        self._invalid: set[int] = set()
        self._failed: set[str] = set()
        self._ended: list[str] = []
        if role == KVConnectorRole.SCHEDULER:
            if self.opts.producer:
                self.psched = PScheduler(self.opts, self.num_blocks)
            if self.opts.consumer:
                self.dsched = DScheduler(self.block_size, self.load_failure_policy)
        log.info("kvproto connector (%s, %s) for engine %s, data-parallel rank %d, "
                 "kv_load_failure_policy %s", role.name.lower(), self.opts.role,
                 self.engine_id, self.dp_rank, self.load_failure_policy)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        num_blocks = self.num_blocks
        log.info("kvproto: registering %d KV tensors (%s, %s), %d blocks", len(tensors),
                 tuple(tensors[0].shape) if tensors else (), tensors[0].dtype if tensors else "",
                 num_blocks)
        from kvproto.nixl.agent import quiet_nixl_logging

        quiet_nixl_logging()
        metrics: Metrics | None = None
        if self.opts.metrics_port is not None:  # kvproto's own registry, P and D
            from kvproto.metrics import Metrics, serve

            metrics = Metrics(labels={"engine": self.engine_id})
        identity = self._identity(tensors, num_blocks)
        if self.opts.producer:
            self.pw = _PWorker(self.opts, f"kvproto-p-{self.engine_id}", tensors, num_blocks,
                               self.opts.handshake_port, metrics, identity)
        if self.opts.consumer:
            self.dw = _DWorker(self.opts, f"kvproto-d-{self.engine_id}", tensors, num_blocks,
                               metrics, identity, fail=self.load_failure_policy == "fail")
        if metrics is not None and self.opts.metrics_port is not None:
            self._exporter = serve(metrics, self.opts.metrics_port)
            log.info("kvproto: metrics on %s", self._exporter.url)

    def _identity(self, tensors: list[torch.Tensor], num_blocks: int) -> dict[str, str]:
        """This worker's model identity, computed once here: register_kv_caches runs after
        vLLM loaded the weights, so the fingerprint is of the files this engine loaded (a
        checkpoint replaced in place afterwards does not change it)."""
        from kvproto.vllm.identity import FingerprintError, model_identity

        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = int(get_tensor_model_parallel_rank())
        except Exception:  # no distributed state (a bare worker): one rank
            rank = 0
        try:
            ident = model_identity(self._vllm_config, self._kv_cache_config, tensors,
                                   num_blocks, tp_rank=rank, pinned=self.opts.model_revision)
        except FingerprintError as e:
            raise ValueError(f"kvproto: cannot identify the model's weights ({e})") from None
        log.info("kvproto: model identity %s", ident)
        return ident

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.pw is None:
            return None
        a = self.pw.adapter
        return KVProtoHandshakeMetadata(engine=a.name, epoch=a.epoch, host=a.host, port=a.port)

    def _orders(self) -> Orders:
        meta = self._connector_metadata
        return meta.orders if isinstance(meta, KVProtoMetadata) else Orders()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        orders = self._orders()
        if self.pw is not None:
            self.pw.apply(orders)
            self.pw.poll()
        if self.dw is not None:
            self.dw.apply(orders)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and asynchronous (finished_recving)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # D pulls: P's KV stays in place in vLLM's blocks

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] | None = None
        recving: set[str] | None = None
        if self.pw is not None:
            self.pw.steps += 1
            self.pw.poll()
            meta = self._connector_metadata
            if isinstance(meta, KVProtoMetadata) and meta.idle and \
                    (self.dw is None or not self.dw.busy):
                self.pw.idle_wait()
            s, stamps = self.pw.take()
            self._stamps.update(stamps)
            sending = s or None
        if self.dw is not None:
            self.dw.poll()
            r, inv, ended = self.dw.take()
            self._invalid |= inv
            self._failed |= self.dw.take_failed()
            self._ended += ended
            recving = r or None
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` plus the failed loads by request: vLLM then recomputes them
        from scratch or fails them (``kv_load_failure_policy``), whatever their blocks."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed = self._failed, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._stamps and not self._ended:
            return None
        meta = KVProtoWorkerMetadata(self._stamps, self._ended)
        self._stamps, self._ended = {}, []
        return meta

    def kvproto_stats(self, invariants: bool = True) -> dict[str, float]:
        """This side's cumulative counters (stat keys above; the worker side adds
        ``invariant_violations`` of P's ledger and allocator, an O(blocks) check)."""
        c: dict[str, float] = {}
        if self.role == KVConnectorRole.WORKER:
            if self.pw is not None:
                c.update(self.pw.counters())
                if invariants:
                    c["invariant_violations"] = float(len(self.pw.adapter.check_invariants()))
            if self.dw is not None:
                for k, v in self.dw.counters().items():
                    c[k] = c.get(k, 0.0) + v
        else:
            for s in (self.psched, self.dsched):
                if s is not None:
                    for k, n in s.counters.items():
                        key = k if k.startswith("rejected") else "sched_" + k
                        c[key] = c.get(key, 0.0) + n
        return c

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Called every step: deltas at most every STATS_INTERVAL (counters are cumulative,
        # so nothing is lost in between), and no O(blocks) invariant check.
        now = time.monotonic()
        if now < self._next_stats:
            return None
        self._next_stats = now + STATS_INTERVAL
        c = self.kvproto_stats(invariants=False)
        c.pop("held_requests", None)  # levels, not counters
        c.pop("held_blocks", None)
        return self._delta.take(c)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KVProtoStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KVProtoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for w in (self.pw, self.dw):
            if w is not None:
                try:
                    w.close()
                except Exception as e:  # pragma: no cover - teardown
                    log.debug("kvproto shutdown: %s", e)
        self.pw = self.dw = None
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None

    # -- scheduler side ------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        m = metadata.get(0)
        if self.psched is not None and isinstance(m, KVProtoHandshakeMetadata) and m.engine:
            self.psched.set_peer(PeerInfo(m.engine, m.epoch, m.host, m.port))
            log.info("kvproto: P worker %s (epoch %d) handshakes at %s:%d", m.engine, m.epoch,
                     m.host, m.port)

    def on_new_request(self, request: Any) -> None:
        if self.dsched is not None:
            self.dsched.new_request(request.request_id, request.kv_transfer_params)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if self.dsched is None:
            return 0, False
        return self.dsched.matched_tokens(request.request_id, int(request.num_prompt_tokens),
                                          num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        if self.dsched is None or self.dsched.state(request.request_id) is None:
            return
        group = blocks.blocks[0] if blocks.blocks else []
        unhashed = [b.block_id for b in group if b.block_hash is None and not b.is_null]
        prefix = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        self.dsched.allocated(request.request_id, unhashed, prefix, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        orders = self.dsched.drain() if self.dsched is not None else Orders()
        if self.psched is not None:
            orders.registers = self.psched.drain()
        idle = not orders and not int(getattr(scheduler_output,
                                              "total_num_scheduled_tokens", 0) or 0)
        return KVProtoMetadata(orders, idle)

    def set_idle_wait_ms(self, ms: float) -> float:
        """Worker side: change ``idle_wait_ms`` at run time (0: off); returns the old
        value (benchmarks compare both in one engine)."""
        if self.pw is None:
            return 0.0
        old = self.pw.idle_wait_s * 1000.0
        self.pw.idle_wait_s = max(0.0, min(1000.0, float(ms))) / 1000.0
        return old

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVProtoWorkerMetadata):
            if self.psched is not None and meta.stamps:
                self.psched.on_stamps(meta.stamps)
            if self.dsched is not None and meta.ended:
                self.dsched.on_failed(meta.ended)
        if self.psched is not None and connector_output.finished_sending:
            self.psched.on_finished_sending(connector_output.finished_sending)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        if self.dsched is not None and self.dsched.state(rid) is not None:
            self.dsched.finished(rid)
            return False, None
        params = request.kv_transfer_params
        if self.psched is None or not isinstance(params, dict) \
                or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted before its prefill finished: nothing to hand out
        out = self.psched.finished(rid, list(block_ids), int(request.num_computed_tokens),
                                   params)
        return (out is not None), out

    def has_pending_block_frees(self) -> bool:
        # False: a held request's blocks come back when D pulls them or the lease ends,
        # at D's pace, not soon; waiting for them would stall P's running prefills for up
        # to a lease, where preempting one (vLLM's answer to a full cache) lets the others
        # go on. Preemption never touches held blocks: held requests are finished.
        return False
