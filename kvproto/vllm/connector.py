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
  * The workers' poller: when the engine thread has not polled the adapter for
    ``poll_gap_ms`` (a long forward pass, an engine loop short of CPU), a worker thread
    polls it, so that P answers heartbeats, claims and dones and runs its expiries, and
    D (while it has requests in flight) heartbeats, claims and posts ordered READs,
    between steps; one lock per worker keeps its adapter single-threaded (``PWorker``,
    ``DWorker``).
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
    ``update_state_after_alloc`` orders a load into the newly allocated blocks (in each
    KV cache group, the positions after what D's prefix cache supplied). The worker READs the data,
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

KV cache groups (vLLM's hybrid allocator, ``SupportsHMA``): all groups share one block
pool, so the ledger holds and stamps the real blocks of every group, and the params carry
each group's layout; D reads each of its new blocks from the same position of the same
group on P (``kvproto.vllm.groups``, spec/VLLM.md §7). Non-attention (state-space) groups
are refused at start-up.

Tensor parallelism (``kvproto.vllm.topology``): one agent and machine per worker rank;
the params carry every P rank (``RANKS_KEY``); equal TP sizes pair rank r with rank r;
unequal ones pair whole blocks when every rank holds the same heads (KV heads replicated
on both sides), and else read head slices: of P's blocks (P TP 1 -> D TP 2), or several
P ranks' blocks into one D block, one part per P rank (P TP 2 -> D TP 1). A D rank
reports a load complete only when its coverage machine saw every region of the request's
map (every part) read and verified (``kvproto.vllm.dcover``).

Limits of this version: head slices need block checksums off (else refused per request,
and released at P); TP > 1 with
several KV cache groups is refused at start-up; equal block sizes on P and D (a request
from a P of another block size is refused, counted, and recomputes or fails per policy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvproto.lifecycle.topology import heads_of
from kvproto.vllm import groups as kvgroups
from kvproto.vllm.dcover import RankReads, covered_layers, heads_outermost
from kvproto.vllm.sched import (
    PARAMS_KEY,
    ConnectorOptions,
    DScheduler,
    Orders,
    PeerInfo,
    PScheduler,
)
from kvproto.vllm.topology import (
    RANKS_KEY,
    RankMirrors,
    RankPeer,
    encode_ranks,
    for_tp_rank,
    tp_rank,
)
from kvproto.vllm.workers import DWorker, PWorker

if TYPE_CHECKING:
    from kvproto.metrics import Exporter, Metrics

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

    stamps: dict[int, int] = field(default_factory=dict)  # P rank 0: block -> generation
    ended: list[str] = field(default_factory=list)  # D: ended before a load order
    rank_stamps: dict[int, dict[int, int]] = field(default_factory=dict)  # P, per TP rank

    def _ranks(self, other: KVProtoWorkerMetadata) -> dict[int, dict[int, int]]:
        out = {r: dict(st) for r, st in self.rank_stamps.items()}
        for r, st in other.rank_stamps.items():
            mine = out.setdefault(r, {})
            for b, g in st.items():
                mine[b] = max(g, mine.get(b, -1))
        return out

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVProtoWorkerMetadata):
            return self
        stamps = dict(self.stamps)
        for b, g in other.stamps.items():
            if g > stamps.get(b, -1):
                stamps[b] = g
        return KVProtoWorkerMetadata(stamps, [*self.ended, *other.ended], self._ranks(other))


@dataclass
class KVProtoHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once: what the transfer params must name."""

    engine: str = ""
    epoch: int = 0
    host: str = ""
    port: int = 0
    cap_key: str = ""  # hex: the worker gate's capability key (this engine only)


# ---------------------------------------------------------------------------
# Stats and Prometheus.
# ---------------------------------------------------------------------------

# Stat keys (KVProtoStats.data): frees_<reason>, stranded_block_seconds, fenced_reads,
# checksum_failures, recomputed_blocks, handshake_failures, model_mismatches,
# rejected_params, rejected_messages, reads_ok, reads_failed, stale_stamp_snapshots,
# claims_before_register (P), claims_retried (D), poll_stalls and poll_stall_s (both:
# gaps between adapter polls over max_delay with work pending, and their seconds);
# tensor parallelism (kvproto.vllm.dcover): tp_refused, orphan, coverage_complete,
# coverage_short, coverage_missing_regions, coverage_coverage_full.


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
        "checksum_failures": ("kvproto:checksum_failures",
                              "D: READs with a block whose checksum failed (never served)"),
        "recomputed_blocks": ("kvproto:recomputed_blocks", "D: blocks reported as load errors"),
        "handshake_failures": ("kvproto:handshake_failures", "D: handshakes that failed"),
        "model_mismatches": ("kvproto:model_mismatches",
                             "handshakes refused: the peer's model identity differs"),
        "rejected": ("kvproto:rejected", "bad input rejected (params, messages)"),
        "orphan": ("kvproto:orphan", "D: parts of requests on P ranks no D rank reads "
                                     "(P frees them by lease expiry)"),
        "tp_refused": ("kvproto:tp_refused", "D: requests whose TP pairing this version "
                                             "cannot pull (recomputed or failed)"),
        "coverage_short": ("kvproto:coverage_short", "D: verified READs that missed a region "
                                                     "of the request's map (never served)"),
        "poll_stalls": ("kvproto:poll_stalls", "adapter polls more than max_delay after the "
                        "one before, with work pending (engine thread and poller stalled)"),
        "poll_stall_s": ("kvproto:poll_stall_seconds", "total length of those gaps"),
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


class KVProtoConnector(KVConnectorBase_V1, SupportsHMA):
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
        # Tensor parallelism: one agent and machine per worker rank (kvproto.vllm.topology).
        self.tp_size, self.tp_rank = int(pc.tensor_parallel_size), 0
        mc = getattr(vllm_config, "model_config", None)
        self.kv_heads = int(mc.get_total_num_kv_heads()) if mc is not None else 1
        self._rank_peers: dict[int, RankPeer] = {}
        self._mirrors = RankMirrors(int(kv_cache_config.num_blocks)
                                    if kv_cache_config is not None else 0)
        self.engine_id = str(ktc.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else 0
        try:
            self.groups = kvgroups.describe(kv_cache_config)
        except kvgroups.GroupsError as e:
            raise ValueError(str(e)) from None
        if self.tp_size > 1 and len(self.groups) > 1:
            raise ValueError(f"kvproto: tensor parallel size {self.tp_size} with "
                             f"{len(self.groups)} KV cache groups is not supported yet "
                             "(one group at TP > 1)")
        self.psched: PScheduler | None = None
        self.dsched: DScheduler | None = None
        self.pw: PWorker | None = None
        self.dw: DWorker | None = None
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
                self.dsched = DScheduler(self.block_size, self.load_failure_policy,
                                         [g.block_size for g in self.groups] or None,
                                         max_delay_ms=self.opts.config.ms.max_delay)
        log.info("kvproto connector (%s, %s) for engine %s, data-parallel rank %d, "
                 "kv_load_failure_policy %s, KV cache groups %s", role.name.lower(),
                 self.opts.role, self.engine_id, self.dp_rank, self.load_failure_policy,
                 [(g.kind, g.window) for g in self.groups])

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
        self.tp_rank = tp_rank()
        self.opts = for_tp_rank(self.opts, self.tp_rank, self.tp_size, self.dp_rank)
        sfx = f"-tp{self.tp_rank}" if self.tp_size > 1 else ""
        if self.opts.producer:
            self.pw = PWorker(self.opts, f"kvproto-p-{self.engine_id}{sfx}", tensors,
                               num_blocks, self.opts.handshake_port, metrics, identity,
                               tp=(self.tp_rank, self.tp_size))
        if self.opts.consumer:
            self.dw = DWorker(self.opts, f"kvproto-d-{self.engine_id}{sfx}", tensors,
                               num_blocks, metrics, identity,
                               fail=self.load_failure_policy == "fail",
                               tp=(self.tp_rank, self.tp_size))
            # P's gate binds a handle to one consumer: the D engine, all of whose TP ranks
            # may read one P rank (P TP 1 -> D TP 2 with a replicated KV head).
            self.dw.adapter.consumer_id = f"kvproto-d-{self.engine_id}" + (
                f"-dp{self.dp_rank}" if self.dp_rank else "")
            groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or ()
            self.dw.reads = RankReads(
                self.tp_rank, self.tp_size, self.kv_heads,
                covered_layers(list(kv_caches), [list(g.layer_names) for g in groups]),
                self._layers(), slices=not self.opts.config.checksums and heads_outermost(
                    tensors, num_blocks, len(heads_of(0, self.tp_size, self.kv_heads))))
        if metrics is not None and self.opts.metrics_port is not None:
            self._exporter = serve(metrics, self.opts.metrics_port)
            log.info("kvproto: metrics on %s", self._exporter.url)

    def _identity(self, tensors: list[torch.Tensor], num_blocks: int) -> dict[str, str]:
        """This worker's model identity, computed once here: register_kv_caches runs after
        vLLM loaded the weights, so the fingerprint is of the files this engine loaded (a
        checkpoint replaced in place afterwards does not change it)."""
        from kvproto.vllm.identity import FingerprintError, model_identity

        try:
            ident = model_identity(self._vllm_config, self._kv_cache_config, tensors,
                                   num_blocks, pinned=self.opts.model_revision)
        except FingerprintError as e:
            raise ValueError(f"kvproto: cannot identify the model's weights ({e})") from None
        log.info("kvproto: model identity %s", ident)
        return ident

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.pw is None:
            return None
        a = self.pw.adapter
        return KVProtoHandshakeMetadata(engine=a.name, epoch=a.epoch, host=a.host, port=a.port,
                                        cap_key=a.gate.key.hex())

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
            r, inv, ended, failed = self.dw.take_all()
            self._invalid |= inv
            self._failed |= failed
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
        # vLLM takes block-level load errors from one KV cache group only (it stops the
        # engine otherwise); with several, the failed requests (failed_recving) carry
        # the failure, and vLLM recomputes or fails them whole.
        out, self._invalid = self._invalid, set()
        return out if len(self.groups) <= 1 else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._stamps and not self._ended:
            return None
        meta = KVProtoWorkerMetadata(self._stamps if self.tp_rank == 0 else {}, self._ended,
                                     {self.tp_rank: self._stamps} if self._stamps else {})
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
                    c["invariant_violations"] = float(len(self.pw.check_invariants()))
            if self.dw is not None:
                for k, v in self.dw.counters().items():
                    c[k] = c.get(k, 0.0) + v
        else:
            c["kv_cache_groups"] = float(len(self.groups))
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
        c.pop("held_tokens", None)
        c.pop("kv_cache_groups", None)
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
        self._rank_peers = {r: RankPeer(m.engine, m.epoch, m.host, m.port,
                                        bytes.fromhex(m.cap_key or ""))
                            for r, m in metadata.items()
                            if isinstance(m, KVProtoHandshakeMetadata) and m.engine}
        m = metadata.get(0)
        if self.psched is not None and isinstance(m, KVProtoHandshakeMetadata) and m.engine:
            self.psched.set_peer(PeerInfo(m.engine, m.epoch, m.host, m.port,
                                          bytes.fromhex(m.cap_key or "")))
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
        self.dsched.allocated_groups(request.request_id, kvgroups.d_view(blocks),
                                     num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # A load fills the request's own blocks in every group.
        return tuple(range(len(self.groups)))

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
            self._mirrors.on_stamps(meta.rank_stamps)
            if self.dsched is not None and meta.ended:
                self.dsched.on_failed(meta.ended)
        if self.psched is not None and connector_output.finished_sending:
            self.psched.on_finished_sending(connector_output.finished_sending)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (list(block_ids),))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
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
        if self.tp_size > 1 and len(self._rank_peers) != self.tp_size:
            log.error("kvproto: P request %s finished before every rank's handshake "
                      "metadata arrived; served without remote decode", rid)
            return False, None
        # Readiness: this runs after the output of the request's last forward pass was
        # processed; the KV stays in place (no save to wait for), so the writes are
        # complete once every prompt token was computed.
        ready = int(request.num_computed_tokens) >= int(request.num_prompt_tokens)
        out = self.psched.finished_groups(rid, block_ids, int(request.num_computed_tokens),
                                          params, self.block_size, ready=ready)
        if out is not None and len(self._rank_peers) == self.tp_size \
                and len(block_ids) == 1:
            # The region map's axes travel at every TP size (D ranks of another TP size
            # pair by them), for one KV cache group (several are refused at start-up at
            # TP > 1; at TP 1 D takes the map's axes from its own groups, which the
            # handshake's identity pins equal to P's).
            handle = (out.get(PARAMS_KEY) or {}).get("handle")
            out[RANKS_KEY] = encode_ranks(self._rank_peers, self._mirrors, list(block_ids[0]),
                                          self.kv_heads, self._layers(),
                                          handle if isinstance(handle, int) else None)
        return (out is not None), out

    def _layers(self) -> list[int]:
        """Layers per KV cache group (the region map's axes)."""
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or ()
        return [max(1, len(g.layer_names)) for g in groups] or [1]

    def reset_cache(self) -> bool:
        """vLLM's connector cache reset (``reset_prefix_cache(reset_connector=True)``,
        a pause or sleep that clears caches): True, nothing to drop. The connector keeps
        no KV of its own; blocks P holds for D are the engine's, named by requests D may
        be reading, and never drop for a reset: they keep vLLM's own prefix-cache reset
        failing (used blocks) until D's done, its release or the lease frees them, and a
        retry after that succeeds."""
        return True

    def has_pending_block_frees(self) -> bool:
        # False: a held request's blocks come back when D pulls them or the lease ends,
        # at D's pace, not soon; waiting for them would stall P's running prefills for up
        # to a lease, where preempting one (vLLM's answer to a full cache) lets the others
        # go on. Preemption never touches held blocks: held requests are finished.
        return False
