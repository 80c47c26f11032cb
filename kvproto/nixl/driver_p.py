"""P's driver: the transport-free half of P's adapter (see :mod:`kvproto.nixl.driver`).

It owns the block allocator (``BlockPool``) and the ``Ledger``, and makes no lifecycle
decision: every hold and free is the ledger's. Incoming notifications go through P's
one port (``kvproto.port.p_receive``). What it does with effects:

* ``Free``     -> ``transport.bump`` the stamps of every ``reclaimed`` block before the
  blocks can be reused (a READ that raced the free then sees a changed stamp and fails
  closed);
* ``Ack``      -> encode (chunked to ``max_message_bytes``) and send to the reader;
* ``Rejected`` -> counted and logged.

With ``Config.checksums`` every register first seals its blocks' checksums
(``transport.seal``) and P's handshake says so (``extra["checksums"]``).

Bad input (unknown peer, malformed bytes, wrong epoch or version, oversized) goes to
``Ledger.reject`` and never raises into the engine.

Handshakes change nothing until the claim is checked (``on_handshake``): the role, the
layout and the model identity (``wire.check_peer``), and the agent name read out of the
peer's metadata, which must be the claimed name before anything is loaded; a peer
already known is replaced only when its old handshake connection has closed (a restarted
D) or the new claim is authenticated; with a shared secret every handshake must be
authenticated (the transport verifies the HMAC), else it is refused, counted, journaled
(``reject handshake_<reason>``) and logged.

When the transport serves handshakes on a thread of its own (``PTransport.threaded``: it
answers while the engine thread is busy in a long forward pass, which would otherwise
outlast D's handshake budget), that thread runs only the checks that depend on the
request and on data fixed at start-up (decoding, role, version, layout, identity,
authentication, the agent name in the metadata), answers from P's handshake payload
prepared at start-up, and queues the outcome; ``poll`` (the engine thread) then does
everything that changes state: the peer table, the loaded peers, and the ledger's
records of refusals. A claim refused only there (a live peer has the name, or the
metadata cannot be loaded) has its connection closed, which D notices as a lost peer.
The ledger and the driver's state are touched by the engine thread only.

Standard library only (the transport holds the NIXL and torch parts).
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

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
from kvproto.lifecycle.gate import ClaimAnswer, Gate, NeverNotice
from kvproto.nixl.checksum import CHECKSUMS_KEY
from kvproto.nixl.driver import Accept, PeerError, PTransport, Refuse
from kvproto.port import now_ms, p_receive
from kvproto.wire import (
    HANDSHAKE_VERSION,
    Handshake,
    WireError,
    check_peer,
    decode_handshake,
    encode_ack,
    encode_grants,
    encode_never,
)

if TYPE_CHECKING:
    from kvproto.metrics import Metrics

log = logging.getLogger(__name__)

# Handshake outcomes the listener thread may queue for the engine thread; beyond it a
# handshake is refused as "busy" (D retries) and a closed channel goes uncounted.
MAX_HANDSHAKE_QUEUE = 4096

Clock = Callable[[], float]  # seconds (time.monotonic); the ledger sees it as int ms
# Fault hook for incoming notifications: (peer, bytes) -> the messages to deliver
# (``[]`` drops, ``[m, m]`` duplicates). Tests and the demo only.
InHook = Callable[[str, bytes], list[bytes]]
# Observer of every applied ledger effect, with the time in ms (demo statistics).
EffectObserver = Callable[[Effect, int], None]


class PDriver:
    """One P rank over a transport: allocator + ledger + handshake bookkeeping. Call
    ``poll`` often."""

    def __init__(self, name: str, config: Config, transport: PTransport, *, num_blocks: int,
                 epoch: int | None = None, clock: Clock = time.monotonic,
                 sink: Callable[[Event, list[Effect]], None] | None = None,
                 fault_hook: InHook | None = None, strict_pool: bool = True,
                 observer: EffectObserver | None = None, metrics: Metrics | None = None,
                 handshake_secret: bytes | None = None,
                 identity: Mapping[str, str] | None = None,
                 ledger_cls: type[Ledger] = Ledger) -> None:
        """``handshake_secret``: when set, every handshake must be authenticated (the
        transport verifies the MAC and says so). ``identity``: the model identity
        (``kvproto.vllm.identity``) sent in the handshake; a D whose identity differs in
        any field is refused (``model_mismatch``). ``ledger_cls``: the machine (a
        subclass in tests: a mutant, or one observed by the fuzzer's oracle)."""
        self.name = name
        self.identity = dict(identity or {})
        self.config = config.validate()
        self.clock = clock
        self.epoch = epoch if epoch is not None else random.SystemRandom().randrange(1, 1 << 31)
        self.transport = transport
        self.pool = BlockPool(num_blocks, strict=strict_pool)
        self.ledger = ledger_cls(config, self.pool, sink=sink)
        # P's gate over the ledger: readiness on register, never-registered notices. Its
        # capability key is drawn here (the lifecycle never draws randomness).
        self.gate = Gate(self.ledger, secrets.token_bytes(32), name, self.epoch)
        self.fault_hook = fault_hook
        self.observer = observer
        self.handshake_version = HANDSHAKE_VERSION  # test hook: speak another version
        self.handshake_secret = handshake_secret
        self.peers: dict[str, Handshake] = {}
        self._peer_conn: dict[str, int] = {}  # peer -> the connection of its handshake
        self.counters: dict[str, int] = {}
        self.metrics: Metrics | None = metrics
        self._reg_at: dict[int, int] = {}  # handle -> registration time, ms (metrics only)
        # The gate's claim answers of one poll, per (D rank, granted): one message each.
        self._grants: dict[tuple[str, bool], list[int]] = {}
        if self.metrics is not None:
            pool, ledger = self.pool, self.ledger
            self.metrics.track_holdings(lambda: pool.held_count, lambda: ledger.held_requests)
        # Listener thread -> engine thread: (conn, accepted handshake | None, authed,
        # (reason, peer, detail) of a refusal | None); a closed channel is (-1, None,
        # False, ("", peer, "")). At most MAX_HANDSHAKE_QUEUE entries; poll empties it.
        self._hs_queue: deque[tuple[int, Handshake | None, bool,
                                    tuple[str, str, str] | None]] = deque()
        self._hs_ok = self.handshake_payload().encode()  # fixed at start-up
        if transport.threaded:
            transport.attach(self._answer_handshake, self._queue_channel_closed)
        else:
            transport.attach(self.on_handshake, self._on_channel_closed)

    # -- helpers ---------------------------------------------------------------------
    def _now(self) -> int:
        """The clock in whole milliseconds (``now_ms``): the ledger's time, which the
        journal records and ``kvproto validate`` hands TLC unchanged."""
        return now_ms(self.clock)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    @property
    def free_blocks(self) -> int:
        """Blocks the engine can allocate now (the pool's allocator)."""
        return self.pool.allocatable

    def handshake_payload(self) -> Handshake:
        t = self.transport
        extra = t.extra()
        if self.config.checksums:  # D refuses a P that does not checksum when it must verify
            extra = {**extra, CHECKSUMS_KEY: True}
        return Handshake(engine=self.name, epoch=self.epoch, layout=t.layout(),
                         agent_metadata=t.metadata, role="producer", extra=extra,
                         version=self.handshake_version, identity=self.identity)

    def stamps(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """The generation stamps ``blocks`` carry now (what D's READ must find)."""
        return self.transport.stamps(blocks)

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
                 expected: int = 0, handle: int | None = None,
                 ready: bool = True) -> TransferParams | None:
        """Hand ``blocks`` to the lifecycle; return D's transfer params, or None if the
        gate or the ledger rejected or immediately freed the request. ``handle``: one
        minted elsewhere for this ledger (e.g. by an engine's scheduler process).
        ``ready``: the readiness mark, the writes that fill ``blocks`` completed (the
        engine's last forward pass and save for the request); without it the gate
        refuses the register (counted)."""
        now = self._now()
        if handle is None:
            handle = self.ledger.new_handle()
        gens = self.transport.stamps(blocks)
        if self.config.checksums:  # before the ledger holds them: D may read at once
            self.transport.seal(blocks)
        if self.metrics is not None:
            self._reg_at[handle] = now
        effects = self.gate.register(handle, request_id, blocks, now, ready=ready,
                                     group=group, expected=expected)
        self.execute(effects, now)
        rejected = any(isinstance(e, Rejected) for e in effects)
        if not rejected:  # the ledger's hold replaces the engine's pins
            self.pool.unpin([b for b in blocks if self.pool.pinned(b)])
        else:
            # The engine may reuse these blocks now, and transfer params for them may
            # already exist (an engine's scheduler snapshots stamps before the register
            # reaches the ledger): bump their stamps so that no such params ever match.
            cap = self.pool.capacity
            self.fence([b for b in blocks if isinstance(b, int) and 0 <= b < cap])
            # A register is one-shot (the engine frees the blocks when it returns None):
            # params handed out for this handle are for a request never registered.
            if isinstance(handle, int) and not isinstance(handle, bool) and handle >= 0:
                self.abandon(handle)
        if rejected or any(isinstance(e, Free) for e in effects):
            self._reg_at.pop(handle, None)
            return None
        return TransferParams(engine=self.name, epoch=self.epoch, handle=handle,
                              blocks=tuple(blocks), initial_term=self.config.ms.initial_lease,
                              expected=max(1, expected), group=group, generations=gens,
                              capability=self.gate.capability(handle))

    def fence(self, blocks: Sequence[int]) -> None:
        """Bump the generation stamps of ``blocks``: every READ whose params carry the old
        stamps fails its stamp check from now on (fail closed)."""
        if blocks:
            self.transport.bump(blocks)

    def abandon(self, handle: int) -> None:
        """Transfer params for ``handle`` were handed out, but it will never be
        registered (its prefill aborted or failed, or its register was refused): the
        gate says so, and D hears it at once (wire ``never``)."""
        self.execute(self.gate.abandon(handle), self._now())

    def abort(self, request_id: str) -> None:
        now = self._now()
        self.execute(self.ledger.abort(request_id, now), now)

    # -- the step loop ---------------------------------------------------------------------
    def poll(self) -> int:
        """One non-blocking step: handshakes, notifications, tick. Returns messages handled."""
        now = self._now()
        t = self.transport
        t.serve(now)
        n = 0
        try:
            notifs = t.receive()
        except Exception as e:
            self._count("notif_poll_error")
            log.warning("receiving notifications failed: %s", type(e).__name__)
            notifs = []
        if self._hs_queue:
            # After fetching the messages: a D that sent one had its handshake answered,
            # so its handshake is in the queue by now and is applied before its message.
            self._apply_handshakes(now)
        hook = self.fault_hook
        for peer, m in notifs:
            for m2 in (hook(peer, m) if hook is not None else (m,)):
                n += 1
                self._on_message(peer, m2, now)
        self._flush_grants()
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

    def _tick(self, now: int, due: int | None) -> None:
        if self.metrics is None:
            self.execute(self.ledger.tick(now), now)
            return
        t0 = time.perf_counter()
        effects = self.ledger.tick(now)
        self.metrics.tick(time.perf_counter() - t0,
                          max(0, now - due) / 1000 if due is not None else 0.0)
        self.execute(effects, now)

    def _on_message(self, peer: str, buf: bytes, now: int) -> None:
        hs = self.peers.get(peer)
        c = hs.extra.get("consumer") if hs is not None and hs.extra else None
        self.execute(p_receive(self.gate, peer, buf, now, known=hs is not None,
                               epoch=self.epoch, max_bytes=self.config.max_message_bytes,
                               consumer=c[:64] if isinstance(c, str) and c else None), now)

    def execute(self, effects: Sequence[Effect | NeverNotice | ClaimAnswer], now: int) -> None:
        """Carry out the ledger's (and the gate's) effects, in order."""
        m = self.metrics
        for e in effects:
            if isinstance(e, NeverNotice):
                self._send_never(e)
                continue
            if isinstance(e, ClaimAnswer):
                self._send_grant(e)
                continue
            if isinstance(e, Free):
                if e.reclaimed:
                    # Bump BEFORE the blocks can be reused: a READ racing this free then
                    # reads a changed stamp and fails closed. (The pool's allocator
                    # already lists them; nothing allocates between the ledger's step
                    # and this loop: one thread.)
                    self.transport.bump(e.reclaimed)
                self.gate.forget((e.handle,))  # every free (expiry too) drops its binding
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

    def _send_never(self, e: NeverNotice) -> None:
        # The bound consumer is a D engine: tell each of its ranks that shook hands here
        # (a rank whose name is the consumer's too), else every known D peer.
        to = sorted(self.peers) if e.consumer is None else \
            [p for p, hs in self.peers.items()
             if p == e.consumer or (hs.extra or {}).get("consumer") == e.consumer]
        for peer in to:
            for buf in encode_never(self.epoch, (e.handle,), self.config.max_message_bytes):
                if self.transport.send(peer, buf) is not None:
                    self._count("send_error")
                    continue
                self._count("never_sent")

    def _send_grant(self, e: ClaimAnswer) -> None:
        """Batched: the gate's answers of one poll go out in one message per D rank and
        kind (``_flush_grants``, at the end of the poll that read the claims)."""
        self._grants.setdefault((e.peer, e.granted), []).append(e.handle)

    def _flush_grants(self) -> None:
        if not self._grants:
            return
        pending, self._grants = self._grants, {}
        mb = self.config.max_message_bytes
        for (peer, granted), handles in pending.items():
            for buf in encode_grants(self.epoch, handles, granted, mb):
                if self.transport.send(peer, buf) is not None:
                    self._count("send_error")
                    break
            else:
                self._count("grants_sent" if granted else "claims_refused", len(handles))

    def _send_ack(self, a: Ack) -> None:
        for buf in encode_ack(self.epoch, a.seq, a.term, a.refused, self.config.max_message_bytes,
                              pending=a.pending):
            err = self.transport.send(a.reader, buf)
            if err is not None:
                self._count("send_error")
                log.info("ack to %s failed: %s", a.reader, err)
                return
            self._count("acks_sent")

    # -- handshakes ----------------------------------------------------------------------
    def _refuse(self, reason: str, peer: str, detail: str, now: int) -> Refuse:
        """Refuse a handshake: counted, journaled (``handshake_<reason>``), logged."""
        self._count("handshake_refused")
        if reason == "unauthenticated":
            self._count("handshake_unauthenticated")
        self.execute(self.ledger.reject("handshake_" + reason, peer[:64], detail, now), now)
        log.warning("handshake refused (%s) from %r: %s", reason, peer[:64], detail)
        return Refuse(reason, detail)

    def _check_handshake(self, payload: bytes, authed: bool
                         ) -> Handshake | tuple[str, str, str]:
        """The checks that depend only on the request and on data fixed at start-up
        (safe on the listener thread): the handshake, or a refusal (reason, claimed
        peer, detail). Nothing is loaded for a handshake that is malformed,
        unauthenticated (when a secret is set) or names another agent in its metadata
        than it claims."""
        t = self.transport
        try:
            hs = decode_handshake(payload)
            if self.handshake_version != HANDSHAKE_VERSION:  # test hook
                raise WireError("version", f"this side speaks {self.handshake_version}")
            check_peer(hs, "consumer", t.layout(), self.identity)  # role, layout, identity
        except WireError as e:
            return e.reason, "", e.detail
        if self.handshake_secret is not None and not authed:
            return "unauthenticated", hs.engine, "no valid HMAC under the shared secret"
        md_name = t.metadata_name(hs.agent_metadata)
        if md_name is None:
            return "metadata", hs.engine, "agent metadata of an unknown shape"
        if md_name != hs.engine:
            return "wrong_name", hs.engine, f"metadata names {md_name[:64]!r}"
        return hs

    def on_handshake(self, conn: int, payload: bytes, authed: bool = False) -> Accept | Refuse:
        """The handshake handler on the engine thread: check the claim completely before
        changing any state."""
        now = self._now()
        hs = self._check_handshake(payload, authed)
        if isinstance(hs, tuple):
            return self._refuse(*hs, now)
        refused = self._accept_handshake(conn, hs, authed, now)
        if refused is not None:
            return refused
        return Accept(self._hs_ok, hs.engine)

    def _answer_handshake(self, conn: int, payload: bytes, authed: bool = False
                          ) -> Accept | Refuse:
        """The handshake handler on the listener's own thread: check, answer from the
        payload fixed at start-up, and queue the rest for the engine thread (``poll``)."""
        if len(self._hs_queue) >= MAX_HANDSHAKE_QUEUE:
            return Refuse("busy", "too many handshakes queued; retry")
        hs = self._check_handshake(payload, authed)
        if isinstance(hs, tuple):
            self._hs_queue.append((conn, None, authed, hs))
            return Refuse(hs[0], hs[2])
        self._hs_queue.append((conn, hs, authed, None))
        return Accept(self._hs_ok, hs.engine)

    def _queue_channel_closed(self, peer: str) -> None:
        if len(self._hs_queue) < MAX_HANDSHAKE_QUEUE:
            self._hs_queue.append((-1, None, False, ("", peer, "")))

    def _apply_handshakes(self, now: int) -> None:
        """Engine thread: apply what the listener thread answered and saw."""
        q = self._hs_queue
        while q:
            conn, hs, authed, refused = q.popleft()
            if refused is not None:
                if conn < 0:
                    self._on_channel_closed(refused[1])
                else:
                    self._refuse(*refused, now)
            elif hs is not None and self._accept_handshake(conn, hs, authed, now) is not None:
                self.transport.drop_conn(conn)  # answered "ok" already: D sees it close

    def _accept_handshake(self, conn: int, hs: Handshake, authed: bool, now: int
                          ) -> Refuse | None:
        """Load a checked claim (engine thread): None when accepted, else the refusal.
        A peer already known is replaced only when its old handshake connection has
        closed (a restarted D) or the new claim is authenticated."""
        t = self.transport
        old = self.peers.get(hs.engine)
        if old is not None and old.agent_metadata == hs.agent_metadata:
            # A retry of the same peer: nothing to reload. The live connection stays the
            # peer's (a copy of its metadata proves nothing about who sent it).
            old_conn = self._peer_conn.get(hs.engine)
            if old_conn is not None and t.conn_open(old_conn) and not authed:
                conn = old_conn
        elif old is not None:
            old_conn = self._peer_conn.get(hs.engine)
            if not authed and old_conn is not None and t.conn_open(old_conn):
                # Its handshake connection is up: the named peer is alive, so this claim
                # is someone else's (or a restarted peer whose old process has not been
                # noticed dead yet: it retries). Never unload a live peer on a claim.
                return self._refuse("name_in_use", hs.engine, "a live peer has this name",
                                    now)
            # A restarted D (its old connection closed), or an authenticated claim.
            t.unload_peer(hs.engine)
            del self.peers[hs.engine]
            self._peer_conn.pop(hs.engine, None)
        if old is None or hs.engine not in self.peers:
            try:
                name = t.load_peer(hs.agent_metadata)
            except Exception as e:
                why = e.detail if isinstance(e, PeerError) else type(e).__name__
                self._count("handshake_metadata_error")
                log.warning("loading metadata of %s failed: %s", hs.engine[:64], why)
                return Refuse("metadata", why)
            if name != hs.engine:  # pragma: no cover - the name was read out above
                t.unload_peer(name)
                return self._refuse("wrong_name", hs.engine, f"loaded {name[:64]!r}", now)
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
        self.transport.close()
