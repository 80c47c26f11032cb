"""D's driver: the transport-free half of one decode rank's adapter (one reader; see
:mod:`kvproto.nixl.driver`). It feeds the ``Consumer`` the events that I/O stands for and
executes its effects; no lifecycle decision is made here.

Effects and what they become:

* ``StartHandshake`` -> a non-blocking handshake with that P engine (its own attempt,
  deadline, retries with exponential backoff), so one dead P never delays another;
* ``SendClaim``      -> the wire ``claim`` of the handle's capability; P's gate answers
  (``grant`` or ``claim_refused``, through the port) and the request reads only once
  granted;
* ``PostRead``       -> a block-granular READ of the data. READs queued for the same P
  engine between two ``poll`` calls are posted as one transfer; when it completes, one
  READ fetches the generation stamps of every request whose data landed, and they are
  compared with ``TransferParams.generations``: any difference -> ``fenced``, the data
  is never served (fail closed); with ``Config.checksums`` the same stamp READ fetches
  the checksums P sealed at register, and a block whose landed data does not match
  its checksum makes the READ ``corrupt`` (the machine fences it, never served);
* ``SendDone``       -> collected, and sent right after the stamps that verified them as
  one ``done`` batch per P engine (wire kind 5; a lone one as a plain ``done``), so P
  hears ``done`` only after the data and the stamps landed;
* ``SendRelease``/``SendHeartbeat`` -> encoded and sent (releases batched per step, held
  while their P engine's handshake runs: one handle per request, for a bounded time;
  heartbeats chunked by the machine so that each fits ``max_message_bytes``);
* ``Finished``       -> a ``Completion`` for the engine;
* ``Quarantined``    -> the request's overdue READ still runs: its Completion (failed,
  ``read_timeout``) goes out as usual, but its local blocks stay held (``free_local`` is
  a no-op for it) until ``Unquarantined`` (the transfer ended), which frees them and
  lists the request in ``take_unquarantined``: the engine never gets back blocks a
  transfer may still write;
* ``DropPeer``       -> the machine declared the P engine lost (ack silence for
  ``Config.peer_timeout``): its connection is closed;
* ``DRejected``      -> counted and logged (bad bytes ``kvproto.port.d_receive`` refused).

Incoming notifications go through D's one port (``kvproto.port.d_receive``). A transfer
still in progress is never released. Transfer errors, ``DISCONNECT`` and the handshake
channel closing become ``peer_lost``.

Not re-entrant: effects are queued and executed after the machine call that produced
them returned; an effect whose execution feeds the machine again (a failed handshake, a
READ that cannot be posted) queues that call's effects behind the others.

Standard library only (the transport holds the NIXL and torch parts).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from kvproto.lifecycle import (
    CLAIMING,
    D_DONE,
    D_NEW,
    HANDSHAKING,
    PEER_HANDSHAKING,
    PEER_READY,
    PEER_UNKNOWN,
    WAITING,
    Config,
    Consumer,
    DEffect,
    DEvent,
    DRejected,
    DropPeer,
    Finished,
    PostRead,
    Quarantined,
    SendClaim,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    TransferParams,
    Unquarantined,
    to_ms,
)
from kvproto.nixl.channel import parse_refusal
from kvproto.nixl.checksum import CHECKSUMS_KEY, mismatches
from kvproto.nixl.dreads import MAX_READ_DESCS, MAX_STAMP_DESCS
from kvproto.nixl.dreads import Read as _Read
from kvproto.nixl.dreads import ReadBatch as _ReadBatch
from kvproto.nixl.dreads import StampBatch as _StampBatch
from kvproto.nixl.dreads import batch_blocks as _blocks
from kvproto.nixl.dreads import chunks as _chunks
from kvproto.nixl.driver import DISCONNECT, DONE, NOT_FOUND, PROC, DTransport, PeerError
from kvproto.port import d_receive, now_ms
from kvproto.wire import (
    HANDSHAKE_VERSION,
    Handshake,
    WireError,
    check_peer,
    claim_bytes,
    decode_handshake,
    encode_claims,
    encode_done_batch,
    encode_heartbeat,
    encode_release,
)

if TYPE_CHECKING:
    from kvproto.metrics import Metrics

log = logging.getLogger(__name__)

Clock = Callable[[], float]  # seconds (time.monotonic); the machine sees it as int ms
# Outgoing fault hook: (kind, engine, bytes) -> messages to send. Tests and the demo only.
OutHook = Callable[[str, str, bytes], list[bytes]]
# Test hook called with the request id at a READ phase ("before_post", "before_gen").
PhaseHook = Callable[[str, str], None]

_SENT = {k: ("sent:" + k, "sent_bytes:" + k) for k in ("done", "release", "heartbeat")}
# Machine states in which a schedule intent is kept and retried by ``poll``.
_RETRY = frozenset((WAITING, HANDSHAKING, CLAIMING, D_NEW))
WANT_RESCAN_MS = 10  # the longest a request that may read waits for poll to notice it

# Refusals/decoding failures that retrying cannot fix.
_FINAL = {"version": "version_mismatch", "layout_mismatch": "layout_mismatch",
          "model_mismatch": "model_mismatch",
          "malformed_handshake": "handshake_malformed", "bad_layout": "layout_mismatch",
          "wrong_name": "handshake_wrong_peer", "unauthenticated": "handshake_unauthenticated"}


class Completion(NamedTuple):
    """A request left the machine. For ``done`` the KV is in ``local_blocks`` of this
    rank's cache until ``free_local`` is called. (A named tuple: one is built per
    request on D's hot path.)"""

    request_id: str
    state: str
    reason: str
    local_blocks: tuple[int, ...] | None
    nbytes: int = 0
    read_seconds: float = 0.0


class _Engine:
    """One P engine as this rank knows it (the transport keeps its connection and
    remote handles)."""

    __slots__ = (
        "attempt",
        "connecting",
        "deadline",
        "epoch",
        "host",
        "name",
        "next_check",
        "next_try",
        "num_blocks",
        "port",
        "state",
    )

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.state = PEER_UNKNOWN  # one of lifecycle.PEER_STATES
        self.connecting = False  # a handshake attempt is in progress
        self.attempt = 0
        self.deadline = self.next_try = self.next_check = 0  # ms, as every time here
        self.epoch = 0
        self.num_blocks = 0  # P's blocks (from its handshake's layout)


class DDriver:
    """One D rank over a transport. Call ``poll`` from the step loop; it never blocks."""

    # Effect type -> the method that executes it (filled in below the class).
    _run: ClassVar[dict[type, Callable[[Any, Any, int], None]]]

    def __init__(self, name: str, config: Config, transport: DTransport, *,
                 clock: Clock = time.monotonic, handshake_timeout: float = 2.0,
                 handshake_attempts: int = 4, backoff: float = 0.1,
                 peer_timeout: float | None = None, fault_hook: OutHook | None = None,
                 phase_hook: PhaseHook | None = None, metrics: Metrics | None = None,
                 identity: Mapping[str, str] | None = None,
                 sink: Callable[[DEvent, list[DEffect]], None] | None = None) -> None:
        """``identity``: the model identity sent in the handshake (as on P: a P engine
        whose identity differs is refused, ``model_mismatch``). ``sink`` receives every
        machine event and its effects (a D journal: ``JournalWriter(..., reader=name).sink``)."""
        self.name = name
        # This rank's consumer (its D engine): P's gate binds a handle to the first
        # consumer that presents its capability; the ranks of one engine share it.
        self.consumer_id = name
        self.identity = dict(identity or {})
        if peer_timeout is not None:  # kept for callers: the machine reads the config
            config = replace(config, peer_timeout=peer_timeout)
        self.config = config.validate()
        self.clock = clock
        self.transport = transport
        # The machine chunks heartbeats so that each one (one seq) is one wire message.
        self.machine = Consumer(name, self.config, sink=sink)
        self.handshake_timeout = handshake_timeout
        self.handshake_attempts = handshake_attempts
        self.backoff = backoff
        self._effects: deque[tuple[DEffect, int]] = deque()  # queued, not yet executed
        self._draining = False
        self.fault_hook = fault_hook
        self.phase_hook = phase_hook
        self.handshake_version = HANDSHAKE_VERSION  # test hook
        self.engines: dict[str, _Engine] = {}
        self.params: dict[str, TransferParams] = {}
        self.reads: dict[str, _Read] = {}  # every READ not finished yet
        self._post_queue: dict[str, list[_Read]] = {}  # engine -> READs to post at poll
        self._polling: list[_ReadBatch] = []  # data READs posted and still in progress
        self._stamp_queue: dict[str, list[_Read]] = {}  # engine -> data landed, no stamps yet
        self._batches: list[_StampBatch] = []  # stamp READs in progress
        self._want: dict[str, None] = {}  # schedule intents (ordered)
        self._plans: dict[str, list[int]] = {}  # rid -> engine-chosen local blocks
        self._plan_index: dict[str, list[int]] = {}  # rid -> P's blocks they take (by index)
        self._free_local: deque[int] = deque(range(transport.num_blocks))
        self._held_local: dict[str, list[int]] = {}
        self._releases: dict[tuple[str, int, int], list[int]] = {}
        self._dones: dict[tuple[str, int, int], list[int]] = {}  # SendDone, batched
        # SendClaim, batched per (engine, epoch): one claim message per P engine and poll
        self._claims: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
        self._want_dirty = False  # an event since the last rescan of _want
        self._want_scan_at = 0  # ms of the last rescan
        self._out: list[Completion] = []
        self._done_info: dict[str, tuple[int, float]] = {}
        # Requests whose local blocks the machine quarantined; and those whose quarantine
        # ended since the last take_unquarantined. Size: Consumer.stuck_reads (and the
        # quarantines ended between two engine steps).
        self._quarantine: set[str] = set()
        self._unquarantined: list[str] = []
        self.counters: dict[str, int] = {}
        self._rng = random.Random(hash(name) & 0xFFFF)
        self._closed = False
        self.metrics: Metrics | None = metrics
        if self.metrics is not None:
            reads = self.reads
            self.metrics.track_in_flight(lambda: len(reads))
            machine = self.machine
            self.metrics.track_stuck_reads(lambda: machine.stuck_reads)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- the engine's side ------------------------------------------------------------
    def add_engine(self, name: str, host: str, port: int) -> None:
        """Where P engine ``name`` answers handshakes (from the router / discovery)."""
        e = self.engines.get(name)
        if e is None:
            self.engines[name] = _Engine(name, host, port)
        elif (e.host, e.port) != (host, port):
            e.host, e.port = host, port

    def admit(self, rid: str, params: TransferParams) -> None:
        now = now_ms(self.clock)
        if rid not in self.params and rid not in self.machine.reqs:
            self.params[rid] = params
        self._apply(self.machine.admit(rid, params, now), now)

    def schedule(self, rid: str, local_blocks: Sequence[int] | None = None,
                 remote_index: Sequence[int] | None = None) -> None:
        """D's scheduler wants this KV. Applied as soon as the request is waiting.

        ``local_blocks``: where the READ lands (the engine's allocator chose them); when
        fewer than P's blocks, the engine holds the prefix already and only the last
        ``len(local_blocks)`` are read, or, with ``remote_index``, the params' blocks at
        those indices (one per local block: several KV cache groups). Without
        ``local_blocks`` this driver allocates them."""
        machine = self.machine
        st = machine.state(rid)
        if local_blocks is not None and st != D_NEW:
            self._plans[rid] = list(local_blocks)
            if remote_index is not None:
                self._plan_index[rid] = list(remote_index)
        if st == WAITING:
            now = now_ms(self.clock)
            self._apply(machine.schedule(rid, now), now)
            st = machine.state(rid)
        if st in _RETRY:
            # Retried by poll: after the handshake, the claim's grant, or while a
            # sibling's READ is in flight.
            self._want[rid] = None
            self._want_dirty = True

    def abort(self, rid: str) -> None:
        now = now_ms(self.clock)
        self._want.pop(rid, None)
        self._apply(self.machine.abort(rid, now), now)

    def free_local(self, rid: str) -> None:
        """The engine is done with a completed request's local blocks. A no-op while
        they are quarantined (they are freed when the transfer ends)."""
        self._plan_index.pop(rid, None)
        if rid in self._quarantine:
            return
        if self._plans.pop(rid, None) is not None:
            self._held_local.pop(rid, None)  # the engine's blocks, not this free list
            return
        for b in self._held_local.pop(rid, []):
            self._free_local.append(b)

    def state(self, rid: str) -> str:
        return self.machine.state(rid)

    # -- step loop ---------------------------------------------------------------------
    def poll(self) -> list[Completion]:
        now = now_ms(self.clock)
        reads_before = len(self.reads)
        for e in list(self.engines.values()):
            if e.state == PEER_HANDSHAKING:
                self._progress_handshake(e, now)
                if e.state != PEER_HANDSHAKING:
                    self._want_dirty = True
            elif e.state == PEER_READY:
                self._check_peer(e, now)
        self._poll_reads(now)
        self._poll_notifs(now)
        if now >= self.machine.next_deadline():  # else the tick would change nothing
            self._apply(self.machine.tick(now), now)
            self._want_dirty = True
        if len(self.reads) != reads_before:  # a READ ended: a sibling may read now
            self._want_dirty = True
        # Requests waiting for a handshake, a grant or a sibling's READ move only on
        # such events: rescan them then, and at least every WANT_RESCAN_MS (a bound on
        # any move this misses), not on every poll (O(waiting) each).
        if self._want and (self._want_dirty or now - self._want_scan_at >= WANT_RESCAN_MS):
            self._want_dirty = False
            self._want_scan_at = now
            self._schedule_ready(now)
        if self._post_queue:  # READs scheduled during this poll
            self._post_queued(now)
        self.flush()
        self._reap()
        out, self._out = self._out, []
        return out

    def _schedule_ready(self, now: int) -> None:
        for rid in list(self._want):
            st = self.machine.state(rid)
            if st == WAITING:
                self._apply(self.machine.schedule(rid, now), now)
                if self.machine.state(rid) != WAITING:  # else: a sibling is in flight
                    self._want.pop(rid, None)
            elif st not in _RETRY:
                del self._want[rid]

    # -- effects -----------------------------------------------------------------------
    def _apply(self, effects: Sequence[DEffect], now: int) -> None:
        """Execute a machine call's effects in order, unless already executing: then
        queue them behind the others (an effect that feeds the machine again only adds
        to the queue, so this driver is never re-entered)."""
        if not effects:
            return
        if self._draining:
            self._effects.extend((eff, now) for eff in effects)
            return
        self._draining = True
        run = self._run
        try:
            for eff in effects:
                run[type(eff)](self, eff, now)
            q = self._effects
            while q:
                eff, t = q.popleft()
                run[type(eff)](self, eff, t)
        finally:
            self._draining = False

    def _batch(self, into: dict[tuple[str, int, int], list[int]],
               eff: SendRelease | SendDone) -> None:
        """Collect a release or done for its (engine, epoch, expected) batch."""
        p = self.params.get(eff.request_id)
        epoch = p.epoch if p is not None else self._epoch_of(eff.engine)
        into.setdefault((eff.engine, epoch, eff.expected), []).append(eff.handle)

    def _x_release(self, eff: SendRelease, now: int) -> None:
        self._batch(self._releases, eff)

    def _x_done(self, eff: SendDone, now: int) -> None:
        """Batched: every SendDone of one step goes out in one done batch per P engine
        (``_flush_dones``, right after the stamps that verified them)."""
        self._batch(self._dones, eff)

    def _flush_dones(self) -> None:
        if not self._dones:
            return
        pending, self._dones = self._dones, {}
        mb = self.config.max_message_bytes
        for (engine, epoch, expected), handles in pending.items():
            for m in encode_done_batch(epoch, handles, expected, mb):  # one: a plain done
                if not self._send("done", engine, m):
                    break

    def _x_drop_peer(self, eff: DropPeer, now: int) -> None:
        e = self.engines.get(eff.engine)
        if e is not None and e.state == PEER_READY:
            log.warning("%s: lost P engine %s: %s", self.name, eff.engine, eff.reason)
            self._count("peer_lost")
            self._disconnect(e)

    def _x_rejected(self, eff: DRejected, now: int) -> None:
        self._count("rejected:" + eff.reason)
        if self.metrics is not None:
            self.metrics.rejected(eff.reason)
        log.info("%s: rejected %s from %r: %s", self.name, eff.reason, eff.peer[:64],
                 eff.detail)

    def _epoch_of(self, engine: str) -> int:
        e = self.engines.get(engine)
        return e.epoch if e is not None else 0

    def _finished(self, f: Finished, now: int = 0) -> None:
        rid = f.request_id
        p = self.params.pop(rid, None)
        if self._want:
            self._want.pop(rid, None)
        info = self._done_info.pop(rid, None)
        nbytes, secs = (0, 0.0) if info is None else info
        m = self.metrics
        if m is not None:
            m.read_finished(f"{f.state}:{f.reason}", nbytes)
            if f.state != D_DONE and f.reason != "aborted" and p is not None:
                m.recomputed(len(p.blocks))  # the engine must prefill these again
        if f.state == D_DONE:
            local = tuple(self._held_local.get(rid, ()))
            self._out.append(Completion(rid, f.state, f.reason, local, nbytes, secs))
        else:
            self.free_local(rid)
            self._out.append(Completion(rid, f.state, f.reason, None, nbytes, secs))

    def _x_quarantined(self, eff: Quarantined, now: int) -> None:
        self._count("quarantined")
        log.warning("%s: READ of %s overdue (max_read_time + read_grace): request failed, "
                    "its local blocks quarantined until the transfer ends",
                    self.name, eff.request_id)
        self._quarantine.add(eff.request_id)

    def _x_unquarantined(self, eff: Unquarantined, now: int) -> None:
        rid = eff.request_id
        self._quarantine.discard(rid)
        self._done_info.pop(rid, None)
        self._count("unquarantined")
        self.free_local(rid)
        self._unquarantined.append(rid)

    def quarantined(self, rid: str) -> bool:
        """Whether ``rid``'s local blocks are quarantined (its overdue READ still runs)."""
        return rid in self._quarantine

    @property
    def local_blocks_free(self) -> int:
        """Local blocks this driver may allocate (for READs without engine-chosen ones)."""
        return len(self._free_local)

    def take_unquarantined(self) -> list[str]:
        """The requests whose quarantine ended since the last call (their local blocks
        are free again)."""
        out, self._unquarantined = self._unquarantined, []
        return out

    def _send(self, kind: str, engine: str, buf: bytes) -> bool:
        bufs = self.fault_hook(kind, engine, buf) if self.fault_hook else [buf]
        c = self.counters
        sent = _SENT.get(kind) or ("sent:" + kind, "sent_bytes:" + kind)
        for b in bufs:
            err = self.transport.send(engine, b)
            if err is not None:
                self._count("send_error")
                log.info("%s to %s failed: %s", kind, engine, err)
                if err in (NOT_FOUND, DISCONNECT):
                    self._lose(engine, now_ms(self.clock), "send failed: " + err)
                return False
            c[sent[0]] = c.get(sent[0], 0) + 1
            c[sent[1]] = c.get(sent[1], 0) + len(b)
        return True

    def _send_heartbeat(self, hb: SendHeartbeat, now: int = 0) -> None:
        e = self.engines.get(hb.engine)
        if e is None or e.state != PEER_READY:
            return
        msgs = encode_heartbeat(e.epoch, hb.seq, hb.handles, hb.expected,
                                self.config.max_message_bytes)
        if len(msgs) != 1:  # pragma: no cover - the chunk size makes this impossible
            log.error("heartbeat seq %d needed %d messages", hb.seq, len(msgs))
        for m in msgs:
            if not self._send("heartbeat", hb.engine, m):
                return
        if self.metrics is not None:
            self.metrics.heartbeat(len(hb.handles))

    def _x_claim(self, eff: SendClaim, now: int) -> None:
        """Present the handle's capability to P's gate (the machine waits in ``claiming``
        for the answer; an answer that never comes is bounded by the lease check).
        Batched: every claim of one poll goes out in one claim message per P engine
        (``_flush_claims``). A capability that cannot be encoded is P's bad params:
        counted, and the claim is refused locally (recompute)."""
        e = self.engines.get(eff.engine)
        p = self.params.get(eff.request_id)
        epoch = p.epoch if p is not None else self._epoch_of(eff.engine)
        if e is None or e.state != PEER_READY:
            return  # the peer is gone: its loss fails the request
        try:
            raw = claim_bytes(eff.capability)  # decoded once: the claim message carries it
        except ValueError:
            self._count("bad_capability")
            self._apply(self.machine.claim_result(eff.request_id, False, now), now)
            return
        self._claims.setdefault((eff.engine, epoch), []).append((eff.handle, raw))

    def flush(self) -> None:
        """Send the claims, dones and releases queued since the last poll (an abort made
        between polls), so that they do not wait for the next engine step."""
        self._flush_claims()
        self._flush_dones()
        self._flush_releases()

    def _flush_claims(self) -> None:
        if not self._claims:
            return
        pending, self._claims = self._claims, {}
        for (engine, epoch), claims in pending.items():
            e = self.engines.get(engine)
            if e is None or e.state != PEER_READY:
                continue  # the peer is gone: its loss fails the requests
            for m in encode_claims(epoch, claims, self.config.max_message_bytes):
                if not self._send("claim", engine, m):
                    break

    def _flush_releases(self) -> None:
        if not self._releases:
            return
        pending, self._releases = self._releases, {}
        for (engine, epoch, expected), handles in pending.items():
            e = self.engines.get(engine)
            if e is not None and e.state == PEER_HANDSHAKING:  # sent once it completes
                self._releases[(engine, epoch, expected)] = handles
            elif e is not None and e.state == PEER_READY:  # else nobody to tell: P expires
                for m in encode_release(epoch, handles, expected, self.config.max_message_bytes):
                    self._send("release", engine, m)

    # -- handshakes ----------------------------------------------------------------------
    def _payload(self) -> bytes:
        t = self.transport
        return Handshake(engine=self.name, epoch=0, layout=t.layout(),
                         agent_metadata=t.metadata, role="consumer",
                         extra={"consumer": self.consumer_id},
                         version=self.handshake_version, identity=self.identity).encode()

    def _x_handshake(self, eff: StartHandshake, now: int) -> None:
        self._start_handshake(eff.engine, now)

    def _start_handshake(self, engine: str, now: int) -> None:
        e = self.engines.get(engine)
        if e is None:
            self._apply(self.machine.handshake_result(engine, False, now, "unknown_engine"), now)
            return
        if e.state == PEER_READY:
            self._apply(self.machine.handshake_result(engine, True, now), now)
            return
        if e.state == PEER_HANDSHAKING:
            return
        e.state = PEER_HANDSHAKING
        e.attempt = 0
        e.next_try = now
        self._progress_handshake(e, now)

    def _progress_handshake(self, e: _Engine, now: int) -> None:
        t = self.transport
        if not e.connecting:
            if now < e.next_try:
                return
            t.connect(e.name, e.host, e.port, self._payload())
            e.connecting = True
            e.deadline = now + to_ms(self.handshake_timeout)
        r = t.poll_connect(e.name)
        if r is None:
            if now > e.deadline:
                self._retry(e, now, "handshake_timeout", "no reply before the deadline")
            return
        status, payload = r
        if status == "error":
            self._retry(e, now, "unreachable", str(payload))
            return
        assert isinstance(payload, bytes)
        if status == "refused":
            reason, detail = parse_refusal(payload)
            if reason in _FINAL:
                self._fail_handshake(e, now, _FINAL[reason], f"refused by P: {detail}")
            else:
                self._retry(e, now, "handshake_refused", f"{reason}: {detail}")
            return
        try:
            hs = decode_handshake(payload)
            check_peer(hs, "producer", t.layout(), self.identity)  # role, layout, identity
            if hs.engine != e.name:
                raise WireError("wrong_name", f"expected {e.name!r}, got {hs.engine!r}")
        except WireError as ex:
            self._fail_handshake(e, now, _FINAL.get(ex.reason, "handshake_malformed"), ex.detail)
            return
        if self.config.checksums and not (hs.extra or {}).get(CHECKSUMS_KEY):
            self._fail_handshake(e, now, "checksums_unsupported",
                                 "this D verifies block checksums; P does not compute them")
            return
        try:
            t.load_peer(e.name, hs)
        except PeerError as ex:
            if ex.final:
                self._fail_handshake(e, now, ex.reason, ex.detail)
            else:
                self._retry(e, now, ex.reason, ex.detail)
            return
        e.state = PEER_READY  # the transport keeps the connection: its close is a loss
        e.connecting = False
        e.epoch = hs.epoch
        e.num_blocks = hs.layout.num_blocks
        e.attempt = 0
        self._count("handshakes")
        log.info("%s: handshake with %s ok (epoch %d)", self.name, e.name, hs.epoch)
        self._apply(self.machine.handshake_result(e.name, True, now), now)

    def _hangup(self, e: _Engine) -> None:
        self.transport.hangup(e.name)
        e.connecting = False

    def _retry(self, e: _Engine, now: int, reason: str, detail: str) -> None:
        self._hangup(e)
        e.attempt += 1
        self._count("handshake_retry")
        if e.attempt >= self.handshake_attempts:
            self._fail_handshake(e, now, reason, detail)
            return
        delay = self.backoff * (2 ** (e.attempt - 1)) * (0.5 + self._rng.random())
        e.next_try = now + to_ms(delay)
        log.info("%s: handshake with %s: %s (%s); retry %d in %.2fs", self.name, e.name, reason,
                 detail, e.attempt, delay)

    def _fail_handshake(self, e: _Engine, now: int, reason: str, detail: str) -> None:
        self._hangup(e)
        e.state = PEER_UNKNOWN
        self._count("handshake_failed:" + reason)
        if self.metrics is not None:
            self.metrics.handshake_failed(reason)
        log.warning("%s: handshake with %s failed: %s (%s)", self.name, e.name, reason, detail)
        self._apply(self.machine.handshake_result(e.name, False, now, reason), now)

    # -- peer liveness ---------------------------------------------------------------------
    def _check_peer(self, e: _Engine, now: int) -> None:
        if now < e.next_check:
            return
        e.next_check = now + 20  # a syscall per engine, at most 50 times a second
        if not self.transport.alive(e.name):
            self._lose(e.name, now, "handshake channel closed")

    def _disconnect(self, e: _Engine) -> None:
        e.state = PEER_UNKNOWN
        e.connecting = False
        self.transport.drop(e.name)

    def _lose(self, engine: str, now: int, why: str) -> None:
        e = self.engines.get(engine)
        if e is None or e.state != PEER_READY:
            return
        log.warning("%s: lost P engine %s: %s", self.name, engine, why)
        self._count("peer_lost")
        self._disconnect(e)
        self._apply(self.machine.peer_lost(engine, now), now)

    def _reap(self) -> None:
        """Let the transport release handles no READ uses any more."""
        t = self.transport
        if t.stale():
            t.reap({r.engine for r in self.reads.values()},
                   [n for n, e in self.engines.items() if e.state == PEER_UNKNOWN])

    # -- reads -----------------------------------------------------------------------------
    #
    # A READ is two phases, each one transfer per P engine and step. ``PostRead`` queues
    # the request; the next ``poll`` posts every queued request of one P engine as one
    # data READ (at most ``MAX_READ_DESCS`` descriptors per transfer). When it lands its
    # requests join the engine's stamp queue, and the same ``poll`` fetches the
    # generation stamps of every queued request with one READ (at most
    # ``MAX_STAMP_DESCS`` stamps per READ). Once they landed and were compared, the
    # machine's ``done`` for every verified request leaves as one done batch; a fenced
    # request sends ``release`` instead. So P hears ``done`` only after the data and the
    # stamps landed and matched, every stamp is read after its data (fail closed: a stamp
    # that changed means the blocks were freed, and the data is never served), and a
    # transfer that fails fails every request in it (each is released and recomputed).
    def _post_read(self, pr: PostRead, now: int) -> None:
        rid = pr.request_id
        p = self.params.get(rid)
        e = self.engines.get(pr.engine)
        blocks = pr.blocks
        nblocks = len(blocks)
        plan = self._plans.get(rid)
        index = self._plan_index.get(rid)
        why = ""
        if p is None or e is None or e.state != PEER_READY:
            why = "engine not ready"
        elif p.epoch != e.epoch:
            why = f"params for epoch {p.epoch}, engine is at {e.epoch}"
        elif nblocks and (min(blocks) < 0 or max(blocks) >= e.num_blocks):
            why = "block id outside P's layout"
        elif len(p.generations) != nblocks:
            why = "params carry no generation per block"
        elif plan is not None and not 0 < len(plan) <= nblocks:
            why = f"{len(plan)} local blocks for {nblocks} remote ones"
        elif index is not None and (plan is None or len(index) != len(plan)
                                    or min(index) < 0 or max(index) >= nblocks):
            why = "remote block index does not match the local blocks"
        elif plan is not None and (min(plan) < 0 or max(plan) >= self.transport.num_blocks):
            why = "local block id outside this cache"
        elif plan is None and nblocks > len(self._free_local):
            why = "no local blocks free"
        if why:
            self._count("read_refused")
            log.warning("%s: cannot read %s: %s", self.name, rid, why)
            self._apply(self.machine.read_result(rid, False, now), now)
            return
        assert p is not None
        if plan is not None and index is not None:
            rd = _Read(rid, p, plan, now, [blocks[i] for i in index],
                       [p.generations[i] for i in index])
            local = plan
        elif plan is not None:
            local, skip = plan, nblocks - len(plan)
            rd = _Read(rid, p, local, now, blocks[skip:], p.generations[skip:])
        else:
            free = self._free_local
            local = [free.popleft()] if nblocks == 1 else [free.popleft() for _ in blocks]
            rd = _Read(rid, p, local, now)
        self._held_local[rid] = local
        self.reads[rid] = rd
        q = self._post_queue.get(pr.engine)
        if q is None:
            self._post_queue[pr.engine] = [rd]
        else:
            q.append(rd)

    def _post_queued(self, now: int) -> None:
        """Post the queued READs: one transfer per P engine (and ``MAX_READ_DESCS``)."""
        queued, self._post_queue = self._post_queue, {}
        for engine, rds in queued.items():
            if self.phase_hook is not None:
                for rd in rds:
                    self.phase_hook("before_post", rd.rid)
            e, rds = self._on_live_engine(engine, rds, now)
            if e is None:
                continue
            for part in _chunks(rds, MAX_READ_DESCS):
                self._post_batch(e.name, part, now, stamps=False)

    def _on_live_engine(self, engine: str, rds: list[_Read], now: int
                        ) -> tuple[_Engine | None, list[_Read]]:
        """The READs of ``rds`` that may go to ``engine`` now (it is ready, and at their
        params' epoch); the others fail (``peer_gone``: P was lost or restarted)."""
        e = self.engines.get(engine)
        if e is None or e.state != PEER_READY:
            self._batch_failed(rds, "error:peer_gone", now)
            return None, []
        if any(rd.params.epoch != e.epoch for rd in rds):  # P restarted meanwhile
            self._batch_failed([rd for rd in rds if rd.params.epoch != e.epoch],
                               "error:peer_gone", now)
            rds = [rd for rd in rds if rd.params.epoch == e.epoch]
        return e, rds

    def _post_batch(self, engine: str, rds: list[_Read], now: int, *, stamps: bool) -> None:
        """Post one data READ (or, with ``stamps``, one stamp READ) of ``rds``."""
        local, remote = _blocks(rds)
        if stamps and self.config.checksums:  # the checksums come with the stamps
            x, st = self.transport.post_read(engine, local, remote, stamps=True, sums=True)
        else:
            x, st = self.transport.post_read(engine, local, remote, stamps=stamps)
        if x is None:
            self._batch_failed(rds, st, now)
            return
        if stamps:
            sb = _StampBatch(rds, local, x)
            self._count("stamp_reads")
            self._count("stamp_requests", len(rds))
            if st == DONE:
                self._stamps_landed(sb, now)
            elif st == PROC:
                self._batches.append(sb)
            else:
                self.transport.release(x)
                self._batch_failed(rds, st, now)
            return
        b = _ReadBatch(rds, x)
        self._count("data_reads")
        if st == DONE:
            self._data_landed(b, now)
        elif st == PROC:
            self._polling.append(b)
        else:
            self.transport.release(x)
            self._batch_failed(rds, st, now)

    def _poll_reads(self, now: int) -> None:
        if self._post_queue:
            self._post_queued(now)
        t = self.transport
        if self._batches:
            for sb in list(self._batches):
                st = t.poll(sb.xfer)
                if st == PROC:
                    self._warn_slow(sb.reads[0], now)
                    continue
                self._batches.remove(sb)
                if st == DONE:
                    self._stamps_landed(sb, now)
                else:
                    t.release(sb.xfer)
                    self._batch_failed(sb.reads, st, now)
        if self._polling:
            polling, self._polling = self._polling, []
            for b in polling:
                st = t.poll(b.xfer)
                if st == PROC:
                    self._warn_slow(b.reads[0], now)
                    self._polling.append(b)
                elif st == DONE:
                    self._data_landed(b, now)
                else:
                    t.release(b.xfer)
                    self._batch_failed(b.reads, st, now)
        if self._stamp_queue:
            self._post_stamps(now)

    def _warn_slow(self, rd: _Read, now: int) -> None:
        if not rd.warned and now - rd.started > self.config.ms.max_read_time:
            rd.warned = True
            self._count("read_over_max_read_time")
            log.warning("%s: READ of %s exceeds max_read_time; still polling (handle kept)",
                        self.name, rd.rid)

    def _data_landed(self, b: _ReadBatch, now: int) -> None:
        """The data READ landed: release it and queue its requests for their stamp READ."""
        self.transport.release(b.xfer)
        bb = self.transport.block_bytes
        hook = self.phase_hook
        rds = b.reads
        if self._quarantine:
            # A quarantined request failed already: its transfer ended, no stamp READ.
            gone = [rd.rid for rd in rds if rd.rid in self._quarantine]
            for rid in gone:
                self.reads.pop(rid, None)
                self._apply(self.machine.read_result(rid, False, now), now)
            rds = [rd for rd in rds if rd.rid not in gone]
            if not rds:
                return
        for rd in rds:
            rd.nbytes += len(rd.local) * bb
            if hook is not None:
                hook("before_gen", rd.rid)
        engine = rds[0].engine
        q = self._stamp_queue.get(engine)
        if q is None:
            self._stamp_queue[engine] = list(rds)
        else:
            q += rds

    def _post_stamps(self, now: int) -> None:
        queued, self._stamp_queue = self._stamp_queue, {}
        for engine, rds in queued.items():
            e, rds = self._on_live_engine(engine, rds, now)
            if e is None:
                continue
            for part in _chunks(rds, MAX_STAMP_DESCS):
                self._post_batch(engine, part, now, stamps=True)

    def _fenced(self, want: Sequence[int], got: Sequence[int]) -> bool:
        """Stamp fencing: the data of a READ is served only when every stamp read after
        it is the one the params carry (a changed stamp means P freed the blocks)."""
        return tuple(got) != tuple(want)

    def _corrupt(self, want: Sequence[int], got: Sequence[int]) -> list[int]:
        """Checksum verification (``Config.checksums``): the positions where the checksum
        of the landed data (``got``) differs from the one P sealed at register."""
        return mismatches(want, got)

    def _stamps_landed(self, b: _StampBatch, now: int) -> None:
        """Compare every request's stamps with its params (fail closed) and finish it."""
        t = self.transport
        t.release(b.xfer)
        got = t.landed_stamps(b.local, b.reads[0].engine)  # the engine's slot set
        rds = b.reads
        reads = self.reads
        machine = self.machine
        done_info = self._done_info
        effects: list[DEffect] = []  # every request's, executed once the loop is done
        verify = self.config.checksums
        if verify:  # the whole batch at once: the sums fetched, and the landed data's
            sums_want = t.landed_sums(b.local)
            sums_got = t.block_sums(b.local, rds[0].params.engine)
            self._count("checksum_verified", len(b.local))
        off = 0
        for rd in rds:
            gens = rd.gens
            n = len(gens)
            fenced = self._fenced(gens, got[off:off + n])
            bad = self._corrupt(sums_want[off:off + n], sums_got[off:off + n]) \
                if verify and not fenced else None
            off += n
            del reads[rd.rid]
            if fenced:
                self._count("fenced")
                if self.metrics is not None:
                    self.metrics.fenced()
                log.warning("%s: %s fenced: generations %s != expected %s", self.name, rd.rid,
                            got[off - n:off - n + 4], list(gens[:4]))
            elif bad:
                self._count("checksum_failed")
                if self.metrics is not None:
                    self.metrics.checksum_failed()
                log.warning("%s: %s fenced: checksum of %d block(s) failed (first: remote "
                            "block %d)", self.name, rd.rid, len(bad), rd.remote[bad[0]])
            else:
                done_info[rd.rid] = (rd.nbytes, (now - rd.started) / 1000)
            # A landed READ's SendDone joins the done batch sent below.
            effects += machine.read_result(rd.rid, True, now, fenced=fenced,
                                           notif_attached=False, corrupt=bool(bad))
        self._apply(effects, now)
        self._flush_dones()

    def _batch_failed(self, rds: list[_Read], why: str, now: int) -> None:
        """Every READ in ``rds`` failed (one transfer, or its engine is gone)."""
        if not rds:
            return
        self._count("read_error:" + why, len(rds))
        log.warning("%s: READ of %s%s failed: %s", self.name, rds[0].rid,
                    f" and {len(rds) - 1} more" if len(rds) > 1 else "", why)
        for rd in rds:
            self.reads.pop(rd.rid, None)
            self._apply(self.machine.read_result(rd.rid, False, now), now)
        if why == DISCONNECT:
            self._lose(rds[0].engine, now, "READ reported REMOTE_DISCONNECT")

    # -- notifications (acks), through D's port ---------------------------------------------
    def _poll_notifs(self, now: int) -> None:
        try:
            notifs = self.transport.receive()
        except Exception as ex:
            self._count("notif_poll_error")
            log.warning("receiving notifications failed: %s", type(ex).__name__)
            return
        machine = self.machine
        mb = self.config.max_message_bytes
        if notifs:  # a grant, a refusal or a never may move a waiting request
            self._want_dirty = True
        for name, m in notifs:
            e = self.engines.get(name)
            known = e is not None and e.state == PEER_READY
            self._apply(d_receive(machine, name, m, now, known=known,
                                  epoch=e.epoch if e is not None and known else 0,
                                  max_bytes=mb), now)

    # -- teardown --------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.reads)

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for in-flight READs, then release everything."""
        if self._closed:
            return
        end = time.monotonic() + timeout
        while self.reads and time.monotonic() < end:
            self.poll()
            time.sleep(0.001)
        self._closed = True
        for e in self.engines.values():
            self._hangup(e)
        self.transport.close()


# Effect type -> what executes it (one dict look-up per effect on D's hot path).
DDriver._run = {
    StartHandshake: DDriver._x_handshake,
    SendClaim: DDriver._x_claim,
    PostRead: DDriver._post_read,
    SendHeartbeat: DDriver._send_heartbeat,
    SendRelease: DDriver._x_release,
    SendDone: DDriver._x_done,
    Finished: DDriver._finished,
    DropPeer: DDriver._x_drop_peer,
    DRejected: DDriver._x_rejected,
    Quarantined: DDriver._x_quarantined,
    Unquarantined: DDriver._x_unquarantined,
}
