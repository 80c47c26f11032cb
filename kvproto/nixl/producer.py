"""The P adapter: NIXL I/O in, ``Ledger`` events; ``Ledger`` effects out, NIXL calls.

It owns P's agent, the registered KV cache and its generation stamps, the block
allocator and the handshake listener. It makes no lifecycle decision: every hold and
free is the ledger's. What it does with effects:

* ``Free``     -> bump the generation of every ``reclaimed`` block, *then* return the
  block to the allocator (a READ that raced the free then sees a changed stamp);
* ``Ack``      -> encode (chunked to ``max_message_bytes``) and ``send_notif`` to the reader;
* ``Rejected`` -> counted and logged.

Bad input (unknown peer, malformed bytes, wrong epoch or version, oversized) goes to
``Ledger.reject`` and never raises into the engine.

Handshakes change nothing until the claim is checked: the agent name is read out of the
NIXL metadata and must be the claimed name before anything is loaded; a peer already
known is replaced only when its old handshake connection has closed (a restarted D) or
the new claim is authenticated; with a shared secret (``handshake_secret=``, or the
``KVPROTO_HANDSHAKE_SECRET`` environment variable) every handshake must carry a valid
HMAC (``kvproto.nixl.channel``), else it is refused, counted and logged.

With ``handshake_thread`` the listener runs on a thread of its own and answers while the
engine thread is busy (a long forward pass would otherwise outlast D's handshake
budget). That thread runs only the checks that depend on the request and on data fixed
at start-up (decoding, role, version, layout, authentication, the agent name in the
metadata), answers from P's handshake payload prepared at start-up, and queues the
outcome; ``poll`` (the engine thread) then does everything that changes state: the
peer table, NIXL's remote agents, and the ledger's records of refusals. A claim refused
only there (a live peer has the name, or NIXL cannot load the metadata) has its
connection closed, which D notices as a lost peer. The ledger and the adapter's state
are touched by the engine thread only.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvproto.lifecycle import (
    Ack,
    BlockPool,
    Config,
    Effect,
    Event,
    Free,
    Ledger,
    Rejected,
    TransferParams,
)
from kvproto.nixl.agent import KVRegion, error_name, make_agent, metadata_agent_name
from kvproto.nixl.channel import ST_OK, Server, frame, refusal, secret_from_env
from kvproto.port import p_receive
from kvproto.wire import (
    HANDSHAKE_VERSION,
    Handshake,
    WireError,
    check_peer,
    decode_handshake,
    encode_ack,
)

if TYPE_CHECKING:
    from kvproto.metrics import Exporter, Metrics

log = logging.getLogger(__name__)

TIME_DECIMALS = 3  # the times fed to the ledger are whole milliseconds
# Handshake outcomes the listener thread may queue for the engine thread; beyond it a
# handshake is refused as "busy" (D retries) and a closed channel goes uncounted.
MAX_HANDSHAKE_QUEUE = 4096

Clock = Callable[[], float]
# Fault hook for incoming notifications: (peer, bytes) -> the messages to deliver
# (``[]`` drops, ``[m, m]`` duplicates). Tests and the demo only.
InHook = Callable[[str, bytes], list[bytes]]
# Observer of every applied ledger effect, with the time (demo statistics).
EffectObserver = Callable[[Effect, float], None]


class ProducerAdapter:
    """One P rank: agent + KV cache + ledger + handshake listener. Call ``poll`` often."""

    def __init__(self, name: str, config: Config, *, num_blocks: int, block_bytes: int,
                 device: str = "cpu", epoch: int | None = None, clock: Clock = time.monotonic,
                 sink: Callable[[Event, list[Effect]], None] | None = None,
                 tp_rank: int = 0, tp_size: int = 1, host: str = "127.0.0.1", port: int = 0,
                 fault_hook: InHook | None = None, strict_pool: bool = True,
                 observer: EffectObserver | None = None,
                 progress_thread: bool = False, metrics: Metrics | None = None,
                 metrics_port: int | None = None,
                 kv_tensors: Sequence[torch.Tensor] | None = None,
                 handshake_secret: bytes | None = None,
                 identity: Mapping[str, str] | None = None,
                 handshake_thread: bool = False) -> None:
        """With ``kv_tensors`` the KV cache is the engine's own (registered in place, see
        ``KVRegion``) and so is the block allocator: reclaimed blocks get their stamps
        bumped, and the engine learns of each ``Free`` through ``observer`` (called after
        the bump) instead of this adapter's free list.
        ``handshake_secret``: require authenticated handshakes (HMAC-SHA256 under this
        shared secret); default: ``KVPROTO_HANDSHAKE_SECRET`` when set, else none.
        ``identity``: the model identity (``kvproto.vllm.identity``) sent in the handshake;
        a D whose identity differs in any field is refused (``model_mismatch``).
        ``handshake_thread``: serve the handshake listener from a thread of its own (see
        the module docstring)."""
        self.name = name
        self.identity = dict(identity or {})
        self.config = config.validate()
        self.clock = clock
        self.epoch = epoch if epoch is not None else random.SystemRandom().randrange(1, 1 << 31)
        self.agent = make_agent(name, progress_thread=progress_thread)
        self.region = KVRegion(self.agent, num_blocks, block_bytes, device=device,
                               tensors=kv_tensors)
        self.external_allocator = bool(kv_tensors)
        self._gen_view = None if self.region.gen.is_cuda else self.region.gen.numpy()
        self.pool = BlockPool(num_blocks, strict=strict_pool)
        self.ledger = Ledger(config, self.pool, sink=sink)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.fault_hook = fault_hook
        self.observer = observer
        self.handshake_version = HANDSHAKE_VERSION  # test hook: speak another version
        self.peers: dict[str, Handshake] = {}
        self._peer_conn: dict[str, int] = {}  # peer -> the connection of its handshake
        self.counters: dict[str, int] = {}
        self._metadata: bytes = self.agent.get_agent_metadata()
        self.handshake_secret = handshake_secret if handshake_secret is not None \
            else secret_from_env()
        # Listener thread -> engine thread: (conn, accepted handshake | None, authed,
        # (reason, peer, detail) of a refusal | None); a closed channel is (-1, None,
        # False, ("", peer, "")). At most MAX_HANDSHAKE_QUEUE entries; poll empties it.
        self._hs_queue: deque[tuple[int, Handshake | None, bool,
                                    tuple[str, str, str] | None]] = deque()
        self._hs_ok = frame(ST_OK, self.handshake_payload().encode())  # fixed at start-up
        if handshake_thread:
            self.server = Server(self._answer_handshake, host=host, port=port,
                                 on_close=self._queue_channel_closed,
                                 secret=self.handshake_secret, threaded=True)
        else:
            self.server = Server(self._on_handshake, host=host, port=port,
                                 on_close=self._on_channel_closed,
                                 secret=self.handshake_secret)
        self.host = self.server.host
        self.port = self.server.port
        self._closed = False
        # Prometheus (opt-in): pass ``metrics`` to share a registry, ``metrics_port`` (0:
        # any free port) to serve it on 127.0.0.1; ``metrics_port`` is then the chosen one.
        self.metrics: Metrics | None = metrics
        self._reg_at: dict[int, float] = {}  # handle -> registration time (metrics only)
        self._exporter: Exporter | None = None
        self.metrics_port: int | None = None
        if metrics_port is not None and self.metrics is None:
            from kvproto.metrics import Metrics

            self.metrics = Metrics(labels={"role": "P", "engine": name})
        if self.metrics is not None:
            pool, ledger = self.pool, self.ledger
            self.metrics.track_holdings(lambda: pool.held_count, lambda: ledger.held_requests)
        if metrics_port is not None:
            from kvproto.metrics import serve

            assert self.metrics is not None
            self._exporter = serve(self.metrics, metrics_port)
            self.metrics_port = self._exporter.port
            log.info("%s: metrics on %s", name, self._exporter.url)

    # -- helpers ---------------------------------------------------------------------
    def _now(self) -> float:
        """The clock in whole milliseconds: every time the ledger sees (and the journal
        records) then maps to a TLA+ integer in ``kvproto validate``, which rejects times
        finer than a microsecond; milliseconds keep TLC's 32-bit integers from
        overflowing for weeks of run time."""
        return round(self.clock(), TIME_DECIMALS)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    @property
    def free_blocks(self) -> int:
        """Blocks the engine can allocate now (the pool's allocator)."""
        return self.pool.allocatable

    def handshake_payload(self) -> Handshake:
        return Handshake(engine=self.name, epoch=self.epoch,
                         layout=self.region.layout(self.tp_rank, self.tp_size),
                         agent_metadata=self._metadata, role="producer",
                         extra=self.region.extra(), version=self.handshake_version,
                         identity=self.identity)

    # -- the engine's side: allocate, fill, register, abort -----------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks for a prefill, or None when not enough are free. The
        blocks stay pinned to the engine until ``register`` hands them to the ledger (or
        ``give_back`` returns them)."""
        return self.pool.allocate(n)

    def give_back(self, blocks: Iterable[int]) -> None:
        """Return blocks the engine allocated but never registered (or that a rejected
        register did not hold)."""
        pool = self.pool
        for b in blocks:
            if pool.pinned(b):
                pool.unpin((b,))
            elif pool.refcount(b) == 0:
                self._count("double_free")
                log.error("block %d returned to the allocator twice", b)

    def register(self, request_id: str, blocks: Sequence[int], *, group: str | None = None,
                 expected: int = 0, handle: int | None = None) -> TransferParams | None:
        """Hand ``blocks`` (already filled) to the lifecycle; return D's transfer params,
        or None if the ledger rejected or immediately freed the request. ``handle``: one
        minted elsewhere for this ledger (e.g. by an engine's scheduler process)."""
        now = self._now()
        if handle is None:
            handle = self.ledger.new_handle()
        gv = self._gen_view
        if gv is not None:
            if len(blocks) <= 8:  # scalar reads: numpy fancy indexing costs ~7 us
                gens = tuple([int(gv[b]) for b in blocks])
            else:
                gens = tuple(gv[list(blocks)].tolist())
        else:  # pragma: no cover - VRAM only
            gens = tuple(int(g) for g in self.region.gen[list(blocks)].tolist()) if blocks else ()
        if self.metrics is not None:
            self._reg_at[handle] = now
        effects = self.ledger.register(handle, request_id, blocks, now, group=group,
                                       expected=expected)
        self._apply(effects, now)
        rejected = any(isinstance(e, Rejected) for e in effects)
        if not rejected:  # the ledger's hold replaces the engine's pins
            self.pool.unpin([b for b in blocks if self.pool.pinned(b)])
        else:
            # The engine may reuse these blocks now, and transfer params for them may
            # already exist (an engine's scheduler snapshots stamps before the register
            # reaches the ledger): bump their stamps so that no such params ever match.
            cap = self.pool.capacity
            self.fence([b for b in blocks if isinstance(b, int) and 0 <= b < cap])
        if rejected or any(isinstance(e, Free) for e in effects):
            self._reg_at.pop(handle, None)
            return None
        return TransferParams(engine=self.name, epoch=self.epoch, handle=handle,
                              blocks=tuple(blocks), initial_term=self.config.initial_lease,
                              expected=max(1, expected), group=group, generations=gens)

    def fence(self, blocks: Sequence[int]) -> None:
        """Bump the generation stamps of ``blocks``: every READ whose params carry the old
        stamps fails its stamp check from now on (fail closed)."""
        if not blocks:
            return
        gv = self._gen_view
        if gv is not None:
            for b in blocks:
                gv[b] += 1
        else:  # pragma: no cover - VRAM only
            idx = torch.tensor(list(blocks), dtype=torch.int64, device=self.region.gen.device)
            self.region.gen[idx] += 1
            torch.cuda.synchronize(self.region.gen.device)

    def abort(self, request_id: str) -> None:
        now = self._now()
        self._apply(self.ledger.abort(request_id, now), now)

    # -- the step loop ---------------------------------------------------------------------
    def poll(self) -> int:
        """One non-blocking step: handshakes, notifications, tick. Returns messages handled."""
        now = self._now()
        self.server.poll(now)
        n = 0
        try:
            notifs: dict[str, list[bytes]] = self.agent.get_new_notifs()
        except Exception as e:
            self._count("notif_poll_error")
            log.warning("get_new_notifs failed: %s", error_name(e))
            notifs = {}
        if self._hs_queue:
            # After fetching the messages: a D that sent one had its handshake answered,
            # so its handshake is in the queue by now and is applied before its message.
            self._apply_handshakes(now)
        for peer, msgs in notifs.items():
            peer_s = peer.decode(errors="replace") if isinstance(peer, bytes) else str(peer)
            for m in msgs:
                for m2 in (self.fault_hook(peer_s, m) if self.fault_hook else [m]):
                    n += 1
                    self._on_message(peer_s, m2, now)
        # Tick only when the ledger says something can be due (an expiry or a staged
        # message's age limit); other events carry the time anyway. This keeps the
        # journal to the events that matter instead of one tick per poll.
        due = self.ledger.next_deadline()
        if due is not None and now >= due:
            self._tick(now, due)
        return n

    def tick(self) -> None:
        """Only let time pass (no I/O): expiries and staging cleanup."""
        now = self._now()
        self._tick(now, self.ledger.next_deadline())

    def _tick(self, now: float, due: float | None) -> None:
        if self.metrics is None:
            self._apply(self.ledger.tick(now), now)
            return
        t0 = time.perf_counter()
        effects = self.ledger.tick(now)
        self.metrics.tick(time.perf_counter() - t0,
                          max(0.0, now - due) if due is not None else 0.0)
        self._apply(effects, now)

    def _on_message(self, peer: str, buf: bytes, now: float) -> None:
        self._apply(p_receive(self.ledger, peer, buf, now, known=peer in self.peers,
                              epoch=self.epoch, max_bytes=self.config.max_message_bytes), now)

    def _apply(self, effects: list[Effect], now: float) -> None:
        m = self.metrics
        for e in effects:
            if isinstance(e, Free):
                if e.reclaimed:
                    # Bump BEFORE the blocks can be reused: a READ racing this free then
                    # reads a changed stamp and fails closed.
                    gv = self._gen_view
                    if gv is not None:
                        if len(e.reclaimed) <= 8:  # numpy fancy indexing costs ~7 us
                            for b in e.reclaimed:
                                gv[b] += 1
                        else:
                            gv[list(e.reclaimed)] += 1
                    else:  # pragma: no cover - VRAM only
                        idx = torch.tensor(e.reclaimed, dtype=torch.int64,
                                           device=self.region.gen.device)
                        self.region.gen[idx] += 1
                        torch.cuda.synchronize(self.region.gen.device)
                    # (The pool's allocator already lists them; nothing allocates
                    # between the ledger's step and this loop: one thread.)
                log.debug("free %s (%s): %d blocks reclaimed", e.request_id, e.reason,
                          len(e.reclaimed))
                if m is not None:
                    m.p_effect(e, now, self._reg_at.pop(e.handle, None))
            elif isinstance(e, Ack):
                self._send_ack(e)
                if m is not None:
                    m.p_effect(e, now)
            elif isinstance(e, Rejected):
                self._count("rejected:" + e.reason)
                if m is not None:
                    m.p_effect(e, now)
                log.info("rejected %s from %r: %s", e.reason, e.peer, e.detail)
            if self.observer is not None:
                self.observer(e, now)

    def _send_ack(self, a: Ack) -> None:
        for buf in encode_ack(self.epoch, a.seq, a.term, a.refused, self.config.max_message_bytes,
                              pending=a.pending):
            try:
                self.agent.send_notif(a.reader, buf)
                self._count("acks_sent")
            except Exception as e:
                self._count("send_error")
                log.info("ack to %s failed: %s", a.reader, error_name(e))
                return

    # -- handshakes ----------------------------------------------------------------------
    def _refuse_handshake(self, reason: str, peer: str, detail: str, now: float) -> bytes:
        """Refuse a handshake: counted, journaled (``handshake_<reason>``), logged."""
        self._count("handshake_refused")
        if reason == "unauthenticated":
            self._count("handshake_unauthenticated")
        self._apply(self.ledger.reject("handshake_" + reason, peer[:64], detail, now), now)
        log.warning("handshake refused (%s) from %r: %s", reason, peer[:64], detail)
        return refusal(reason, detail)

    def _check_handshake(self, payload: bytes, authed: bool
                         ) -> Handshake | tuple[str, str, str]:
        """The checks that depend only on the request and on data fixed at start-up
        (safe on the listener thread): the handshake, or a refusal (reason, claimed
        peer, detail). Nothing is loaded for a handshake that is malformed,
        unauthenticated (when a secret is set) or names another agent in its metadata
        than it claims."""
        try:
            hs = decode_handshake(payload)
            if self.handshake_version != HANDSHAKE_VERSION:  # test hook
                raise WireError("version", f"this side speaks {self.handshake_version}")
            layout = self.region.layout(self.tp_rank, self.tp_size)
            check_peer(hs, "consumer", layout, self.identity)  # role, layout, model identity
        except WireError as e:
            return e.reason, "", e.detail
        if self.handshake_secret is not None and not authed:
            return "unauthenticated", hs.engine, "no valid HMAC under the shared secret"
        md_name = metadata_agent_name(hs.agent_metadata)
        if md_name is None:
            return "metadata", hs.engine, "agent metadata of an unknown shape"
        if md_name != hs.engine:
            return "wrong_name", hs.engine, f"metadata names {md_name[:64]!r}"
        return hs

    def _on_handshake(self, conn: int, payload: bytes, authed: bool = False
                      ) -> tuple[bytes, str]:
        """The listener's handler on the engine thread: check the claim completely
        before changing any state."""
        now = self._now()
        hs = self._check_handshake(payload, authed)
        if isinstance(hs, tuple):
            return self._refuse_handshake(*hs, now), ""
        refused = self._accept_handshake(conn, hs, authed, now)
        if refused is not None:
            return refused, ""
        return self._hs_ok, hs.engine

    def _answer_handshake(self, conn: int, payload: bytes, authed: bool = False
                          ) -> tuple[bytes, str]:
        """The listener's handler on its own thread: check, answer from the payload
        fixed at start-up, and queue the rest for the engine thread (``poll``)."""
        if len(self._hs_queue) >= MAX_HANDSHAKE_QUEUE:
            return refusal("busy", "too many handshakes queued; retry"), ""
        hs = self._check_handshake(payload, authed)
        if isinstance(hs, tuple):
            self._hs_queue.append((conn, None, authed, hs))
            return refusal(hs[0], hs[2]), ""
        self._hs_queue.append((conn, hs, authed, None))
        return self._hs_ok, hs.engine

    def _queue_channel_closed(self, peer: str) -> None:
        if len(self._hs_queue) < MAX_HANDSHAKE_QUEUE:
            self._hs_queue.append((-1, None, False, ("", peer, "")))

    def _apply_handshakes(self, now: float) -> None:
        """Engine thread: apply what the listener thread answered and saw."""
        q = self._hs_queue
        while q:
            conn, hs, authed, refused = q.popleft()
            if refused is not None:
                if conn < 0:
                    self._on_channel_closed(refused[1])
                else:
                    self._refuse_handshake(*refused, now)
            elif hs is not None and self._accept_handshake(conn, hs, authed, now) is not None:
                self.server.drop(conn)  # answered "ok" already: D sees its channel close

    def _accept_handshake(self, conn: int, hs: Handshake, authed: bool, now: float
                          ) -> bytes | None:
        """Load a checked claim (engine thread): None when accepted, else the refusal.
        A peer already known is replaced only when its old handshake connection has
        closed (a restarted D) or the new claim is authenticated."""
        old = self.peers.get(hs.engine)
        if old is not None and old.agent_metadata == hs.agent_metadata:
            # A retry of the same peer: nothing to reload. The live connection stays the
            # peer's (a copy of its metadata proves nothing about who sent it).
            old_conn = self._peer_conn.get(hs.engine)
            if old_conn is not None and self.server.is_open(old_conn) and not authed:
                conn = old_conn
        elif old is not None:
            old_conn = self._peer_conn.get(hs.engine)
            if not authed and old_conn is not None and self.server.is_open(old_conn):
                # Its handshake connection is up: the named peer is alive, so this claim
                # is someone else's (or a restarted peer whose old process has not been
                # noticed dead yet: it retries). Never unload a live peer on a claim.
                return self._refuse_handshake("name_in_use", hs.engine,
                                              "a live peer has this name", now)
            try:  # a restarted D (its old connection closed), or an authenticated claim
                self.agent.remove_remote_agent(hs.engine)
            except Exception as e:
                log.debug("remove_remote_agent(%s): %s", hs.engine, error_name(e))
            del self.peers[hs.engine]
            self._peer_conn.pop(hs.engine, None)
        if old is None or hs.engine not in self.peers:
            try:
                name = self.agent.add_remote_agent(hs.agent_metadata)
                name_s = name.decode() if isinstance(name, bytes) else str(name)
            except Exception as e:
                self._count("handshake_metadata_error")
                log.warning("loading metadata of %s failed: %s", hs.engine[:64], error_name(e))
                return refusal("metadata", error_name(e))
            if name_s != hs.engine:  # pragma: no cover - the name was read out above
                try:
                    self.agent.remove_remote_agent(name_s)
                except Exception as e:
                    log.debug("remove_remote_agent(%s): %s", name_s[:64], error_name(e))
                return self._refuse_handshake("wrong_name", hs.engine,
                                              f"NIXL loaded {name_s[:64]!r}", now)
        self.peers[hs.engine] = hs
        self._peer_conn[hs.engine] = conn
        self._count("handshakes")
        log.info("handshake with %s (epoch %d) ok%s", hs.engine, hs.epoch,
                 " (authenticated)" if authed else "")
        return None

    def _on_channel_closed(self, peer: str) -> None:
        # Informational only: P never frees on a peer's disappearance; leases do.
        self._count("channel_closed")
        log.info("handshake channel of %s closed", peer)

    def check_invariants(self) -> list[str]:
        errs = self.ledger.check_invariants()
        held = self.pool.held_count
        if held + self.pool.allocatable > self.pool.capacity:
            errs.append("Allocator: free list and held blocks overlap")
        return errs

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.server.close()
        self.region.close()
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
