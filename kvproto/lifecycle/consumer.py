"""D's machine: ``TransferParams``, D's events and effects, and ``Consumer``, which runs
``D_TABLE``.
"""

from __future__ import annotations

import copy
import heapq
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Final, NamedTuple

from kvproto.lifecycle.config import (
    Config,
    ConfigError,
)
from kvproto.lifecycle.dstep import IDLE, step_functions
from kvproto.lifecycle.dvocab import (  # re-exported: D's vocabulary
    Admit,
    ClaimGranted,
    ClaimRefused,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    DReject,
    DRejected,
    DropPeer,
    DTick,
    Finished,
    HandshakeFailed,
    HandshakeOk,
    NeverRegistered,
    PeerLost,
    PostRead,
    ReadFailed,
    ReadOk,
    Schedule,
    SendClaim,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    TransferParams,
)
from kvproto.lifecycle.producer import (
    CLOCK_START,
    HEAP_SLACK,
)
from kvproto.lifecycle.quarantine import MAX_ENDED, ReadGuard
from kvproto.lifecycle.table import (
    ACK,
    ADMIT,
    CLAIM_GRANTED,
    CLAIM_REFUSED,
    CLAIMING,
    D_ABORT,
    D_FAILED,
    D_NEW,
    D_TABLE,
    D_TICK,
    HANDSHAKE_FAILED,
    HANDSHAKE_OK,
    HANDSHAKING,
    NEVER,
    PEER_HANDSHAKING,
    PEER_LOST,
    PEER_READY,
    PEER_UNKNOWN,
    READ_FAILED,
    READ_OK,
    READING,
    SCHEDULE,
    WAITING,
    Table,
    Transition,
    with_rows,
)
from kvproto.wire import chunk_handles

__all__ = [
    "MAX_LANDED_GROUPS",
    "MAX_OUTSTANDING_HEARTBEATS",
    "MAX_PEERS",
    "Admit",
    "ClaimGranted",
    "ClaimRefused",
    "Consumer",
    "DAbort",
    "DAck",
    "DEffect",
    "DEvent",
    "DReject",
    "DRejected",
    "DRequestView",
    "DTick",
    "DropPeer",
    "Finished",
    "HandshakeFailed",
    "HandshakeOk",
    "HeartbeatView",
    "NeverRegistered",
    "PeerLost",
    "PeerView",
    "PostRead",
    "ReadFailed",
    "ReadOk",
    "Schedule",
    "SendClaim",
    "SendDone",
    "SendHeartbeat",
    "SendRelease",
    "StartHandshake",
    "TransferParams",
]



# The states in which a request's lease estimate is checked by tick (no READ in flight,
# not finished): every one of them may still have to read.
_IDLE: Final = IDLE


class _DReq:
    __slots__ = ("abort_pending", "lease_end", "params", "rid", "state")

    def __init__(self, rid: str, params: TransferParams, lease_end: int) -> None:
        self.rid = rid
        self.params = params
        self.lease_end = lease_end
        self.state = D_NEW
        self.abort_pending = False

    def copy(self) -> _DReq:
        """An independent copy (``Consumer.clone``)."""
        q = _DReq(self.rid, self.params, self.lease_end)
        q.state = self.state
        q.abort_pending = self.abort_pending
        return q


@dataclass(frozen=True)
class _HbSent:
    sent_at: int
    handles: tuple[int, ...]


@dataclass
class _Peer:
    state: str = PEER_UNKNOWN  # one of PEER_STATES
    seq: int = 0
    last_heard: int = CLOCK_START  # handshake or last ack from this peer
    # Invariant: seq -> heartbeat sent to this peer and not yet acked, oldest first; on
    # each heartbeat tick those older than lease_extension are pruned. Cap:
    # MAX_OUTSTANDING_HEARTBEATS (the oldest forgotten, counted heartbeat_memory_evicted).
    outstanding: OrderedDict[int, _HbSent] = field(default_factory=OrderedDict)
    # Invariant: handle -> request, exactly the Consumer.reqs entries from this engine.
    reqs: dict[int, _DReq] = field(default_factory=dict)  # handle -> request


# Per peer: heartbeat messages awaiting their ack. Entries older than one lease extension
# are pruned (such an ack could not extend anything); beyond the cap the oldest are
# forgotten and their acks ignored (D keeps its smaller estimate: safe).
MAX_OUTSTANDING_HEARTBEATS: Final = 4096

# P engines D remembers (``Consumer.peers``). At the cap, an admit naming an engine not in
# the table first forgets every idle peer (no requests, no outstanding heartbeats, no
# handshake in progress; counted peer_memory_evicted): a later admit naming it starts a
# new handshake, which the adapter answers at once for an engine it is still connected
# to. When no peer is idle, the admit is refused before it enters the table: the request
# finishes failed with reason ``peer_table_full`` (counted; nothing else changes, P frees
# it by lease expiry) and is recomputed.
MAX_PEERS: Final = 4096
# Landed sibling groups one D rank remembers (``Consumer._groups_landed``) by default. A
# rank's own cap, not P's ``max_groups_remembered``: a P that forgets groups early costs
# late members their lease, a D that forgets early sends a second READ of a group whose
# other members P may have freed already (fenced by the stamps, never served, but outside
# the one-READ-per-group promise), so D keeps many more.
MAX_LANDED_GROUPS: Final = 1 << 16


class DRequestView(NamedTuple):
    """A read-only view of one request on D (``Consumer.request``)."""

    request_id: str
    state: str
    params: TransferParams
    lease_end: int
    abort_pending: bool


class HeartbeatView(NamedTuple):
    """A heartbeat message awaiting its ack (``PeerView.outstanding``)."""

    seq: int
    sent_at: int
    handles: tuple[int, ...]


class PeerView(NamedTuple):
    """A read-only view of one P engine as D sees it (``Consumer.peer``)."""

    engine: str
    state: str  # one of PEER_STATES
    seq: int  # the last heartbeat sequence number sent
    last_heard: int  # handshake or last ack; CLOCK_START before either
    outstanding: Mapping[int, HeartbeatView]  # seq -> heartbeat awaiting its ack, oldest first


# The fields Consumer.__init__ sets. ``Consumer.clone`` copies each mutable one by hand and
# shares the others (config, sink, numbers); any other field (a subclass's) is deep-copied.
_CONSUMER_SHARED: Final = frozenset({
    "reader", "config", "sink", "max_landed_groups", "reqs", "peers", "_group_owner",
    "_groups_landed", "_lease_heap", "_next_hb", "_rg", "_steps", "_plain_refuses", "_admit_steps",
    "_schedule_steps", "_read_ok_steps", "_granted", "_fit_margin", "_read_span", "_max_delay",
    "now", "heartbeat_chunk", "counters", "finished"})


def _prune_outstanding(peer: _Peer, older_than: int) -> None:
    out = peer.outstanding
    while out:
        first = next(iter(out.values()))
        if first.sent_at >= older_than:
            break
        out.popitem(last=False)


class Consumer:
    """One decode rank's machine over its requests. Sans-I/O: events in, effects out.

    The rank is one *reader*: P counts it once per request however often it reports.
    Every event computes a named guard per request and runs the row (state, event,
    guard) of ``TABLE`` (``D_TRANSITIONS``) in ``_step``: destination and effects.
    Invariants it maintains: a READ starts only when the lease, less ``max_read_time``
    and ``clock_drift``, covers it; ``release`` is never sent while a READ is in flight;
    at most one member of a sibling group is ever read. A peer that leaves heartbeats
    unanswered for ``peer_timeout`` is lost (``DropPeer``). Costs: every event O(1)
    except the periodic heartbeat (O(n) per ``heartbeat_interval``, it must name every
    request) and peer-level events (O(requests of that peer)); tick is O(peers) when
    nothing is due, and its lease check does at most ``config.max_tick_work`` lease-heap
    entries per call (the rest carries over: ``next_deadline`` then reports a time
    already past, so adapters tick again at once); a lease loss may be late, never early.

    The lease heap holds at most max(2 * requests, ``HEAP_SLACK``) entries (rebuilt beyond).

    Time: integer milliseconds. A ``now`` that is not an int is refused (counted
    ``bad_time``, no effect, nothing changes). A ``now`` before the rank's clock is counted (``clock_regression``); admit
    keeps it (the earlier arrival gives the shorter, safe lease estimate), every other
    event uses the rank's clock (a READ must fit the lease at the latest time seen).

    Documented hooks (overridden by ``kvproto.testing.mutants``): ``sweep_leases`` (the
    lease check of ``tick`` and its work budget), ``sweep_reads`` (the READ deadlines),
    ``refuses_load`` (the no-second-pull check).
    """

    TABLE: ClassVar[Table] = D_TABLE
    # Run TABLE's rows as compiled step functions (lifecycle/dstep.py); False: through
    # the interpreted ``table_step`` (the reference the compiled steps are tested against).
    COMPILED: ClassVar[bool] = True

    def __init__(self, reader: str, config: Config, *,
                 heartbeat_chunk: int | None = None,
                 max_landed_groups: int = MAX_LANDED_GROUPS,
                 max_ended: int = MAX_ENDED,
                 sink: Callable[[DEvent, list[DEffect]], None] | None = None) -> None:
        """``heartbeat_chunk`` optionally caps the handles per heartbeat further; every
        SendHeartbeat always fits one wire message of ``config.max_message_bytes``, so
        that one ack answers exactly the handles of one message. ``sink`` (the journal)
        is called with every event and its effects. ``max_landed_groups``: the landed
        sibling groups remembered (``MAX_LANDED_GROUPS``); ``max_ended``: the ended loads
        remembered to refuse a second pull (``quarantine.MAX_ENDED``)."""
        if max_landed_groups < 1:
            raise ConfigError(f"max_landed_groups must be >= 1, got {max_landed_groups}")
        # READ deadlines, the quarantine of overdue READs, ended loads (quarantine.py).
        self._rg = ReadGuard(max_ended)
        self.max_landed_groups = max_landed_groups
        self.reader = reader
        self.config = config.validate()
        # TABLE's rows as step functions (shared by every Consumer of this table).
        self._steps = step_functions(type(self).TABLE, compiled=type(self).COMPILED)
        # The hook refuses_load is this class's own: admit runs its check inline.
        self._plain_refuses = type(self).refuses_load is Consumer.refuses_load
        steps = self._steps
        self._admit_steps = steps.by_guard(D_NEW, ADMIT)
        self._schedule_steps = steps.by_guard(WAITING, SCHEDULE)
        self._read_ok_steps = steps.by_guard(READING, READ_OK)
        self._granted = steps[(CLAIMING, CLAIM_GRANTED, "granted")]
        ms = self.config.ms
        # Sums of the (frozen) config the hot events use: a READ must fit the lease with
        # _fit_margin to spare; it is overdue _read_span after it is posted.
        self._fit_margin = ms.max_read_time + ms.clock_drift
        self._read_span = ms.max_read_time + ms.read_grace
        self._max_delay = ms.max_delay
        self.sink = sink
        # Invariant: exactly the requests admitted and not finished (waiting, handshaking
        # or reading), by request id; each is also peers[its engine].reqs[its handle].
        # Size: the requests D holds params for; each leaves when it finishes.
        self.reqs: dict[str, _DReq] = {}
        # Invariant: every P engine an admit or a handshake result named and not since
        # forgotten, oldest first (a lost peer goes back to unknown); every engine of a
        # request in reqs, of an outstanding heartbeat or of a handshake in progress is
        # here. Cap: MAX_PEERS; at the cap idle peers are forgotten, and with none idle an
        # admit naming a new engine is refused (finished failed: peer_table_full).
        self.peers: dict[str, _Peer] = {}
        # Invariant: (engine, group) -> the one request of the group this rank read or is
        # reading: set when its READ is posted, removed when that request gives the group
        # up (disown). An entry stays after a READ that landed (later siblings are served
        # from it: sibling_local). An entry whose READ is in flight (its owner is in reqs)
        # is never forgotten: it is what keeps a group to one READ at a time.
        # Cap: max_landed_groups landed entries (plus one per READ in flight);
        # beyond it the oldest landed entry is forgotten (counted group_memory_evicted).
        # A sibling scheduled after its group was forgotten reads itself: a second READ
        # of the group. P may have freed that member already (the sibling cascade of
        # the transferred member); its renewal is then refused (revoked), and a READ
        # posted before the refusal arrives targets freed blocks, which the adapter
        # bumps before any reuse, so the stamp check fences it (fenced: recomputed);
        # unreused blocks still hold the group's prompt KV. Never wrong KV served.
        self._group_owner: dict[tuple[str, str], str] = {}  # (engine, group) -> rid read
        # Invariant: exactly the keys of _group_owner whose owner's READ landed (the
        # owner is no longer in reqs), in landing order. Cap: max_landed_groups.
        self._groups_landed: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Invariant: every waiting, handshaking or claiming request has an entry at its lease end or
        # earlier (renewals leave it early, tick re-inserts it); other entries are dropped
        # lazily. Cap: rebuilt once above max(2 * requests, HEAP_SLACK) at a finish.
        self._lease_heap: list[tuple[int, str]] = []  # (lease_end, rid); lazy
        # Invariant: the time the next tick sends heartbeats: heartbeat_interval after the
        # last tick that sent them (CLOCK_START before the first).
        self._next_hb = CLOCK_START
        self.now = CLOCK_START
        self.heartbeat_chunk = heartbeat_chunk
        # Invariant: keys from fixed vocabularies (counter names; "state:reason" with the
        # rows' and events' reasons), so both stay small.
        self.counters: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    @classmethod
    def with_rows(cls, *rows: Transition) -> type[Consumer]:
        """A subclass whose table has ``rows`` in place of the rows with the same key."""
        return type(f"{cls.__name__}WithRows", (cls,), {"TABLE": with_rows(cls.TABLE, *rows)})

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _clock(self, now: int) -> int | None:
        """The time to decide with: max(clock, now); None for a ``now`` that is not an int."""
        if type(now) is int and self.now <= now:
            self.now = now
            return now
        if type(now) is not int:
            self._count("bad_time")
            return None
        self._count("clock_regression")
        return self.now

    # -- read-only views -------------------------------------------------------------------
    def state(self, rid: str) -> str:
        r = self.reqs.get(rid)
        return D_NEW if r is None else r.state

    def lease_end(self, rid: str) -> int | None:
        r = self.reqs.get(rid)
        return None if r is None else r.lease_end

    def peer_state(self, engine: str) -> str:
        """``engine``'s state as D sees it: one of PEER_STATES."""
        p = self.peers.get(engine)
        return PEER_UNKNOWN if p is None else p.state

    def abort_pending(self, rid: str) -> bool:
        r = self.reqs.get(rid)
        return r is not None and r.abort_pending

    def group_owner(self, engine: str, group: str) -> str | None:
        """The request of ``group`` (from ``engine``) this rank read or is reading."""
        return self._group_owner.get((engine, group))

    def outstanding_heartbeats(self, engine: str) -> int:
        p = self.peers.get(engine)
        return 0 if p is None else len(p.outstanding)

    def request(self, rid: str) -> DRequestView | None:
        """The request ``rid`` while it is on D (None before admit and once finished)."""
        r = self.reqs.get(rid)
        if r is None:
            return None
        return DRequestView(r.rid, r.state, r.params, r.lease_end, r.abort_pending)

    def request_id(self, engine: str, handle: int) -> str | None:
        """The request on D that P engine ``engine``'s ``handle`` names, if any."""
        p = self.peers.get(engine)
        r = None if p is None else p.reqs.get(handle)
        return None if r is None else r.rid

    def peer(self, engine: str) -> PeerView | None:
        """P engine ``engine`` as D sees it (None when never named). O(outstanding
        heartbeats)."""
        p = self.peers.get(engine)
        if p is None:
            return None
        return PeerView(engine, p.state, p.seq, p.last_heard,
                        MappingProxyType({seq: HeartbeatView(seq, hb.sent_at, hb.handles)
                                          for seq, hb in p.outstanding.items()}))

    @property
    def next_heartbeat_at(self) -> int:
        """When the next tick sends heartbeats (CLOCK_START before the first tick)."""
        return self._next_hb

    @property
    def heap_entries(self) -> int:
        """Entries in the lease heap (live ones plus dead ones not yet dropped)."""
        return len(self._lease_heap)

    def clone(self) -> Consumer:
        """A deep, independent copy (requests, peers, outstanding heartbeats, group
        owners, lease heap, counters), for searches that branch from one state
        (conformance BFS, trace segments). Shared: ``config`` (frozen), ``sink`` (a
        callable) and the immutable ``TransferParams``. Fields a subclass adds are
        deep-copied. O(requests + peers + outstanding heartbeats)."""
        n = object.__new__(type(self))
        d = n.__dict__
        for k, v in self.__dict__.items():
            d[k] = v if k in _CONSUMER_SHARED else copy.deepcopy(v)  # a subclass's own fields
        copies = {id(r): r.copy() for r in self.reqs.values()}
        n.reqs = {rid: copies[id(r)] for rid, r in self.reqs.items()}
        # Sent heartbeat records are frozen: the copies share them.
        n.peers = {e: _Peer(p.state, p.seq, p.last_heard, OrderedDict(p.outstanding),
                            {h: copies[id(r)] for h, r in p.reqs.items()})
                   for e, p in self.peers.items()}
        n._group_owner = dict(self._group_owner)
        n._groups_landed = OrderedDict(self._groups_landed)
        n._lease_heap = list(self._lease_heap)
        n._rg = self._rg.copy()
        n.counters = dict(self.counters)
        n.finished = dict(self.finished)
        return n

    def next_deadline(self) -> int:
        """The earliest time at which ``tick`` can have something to do: the next
        heartbeat, a lease that may no longer cover a READ, a peer that may have gone
        silent. A tick before it changes nothing but the clock, so an adapter may tick
        only once ``now >= next_deadline()`` (as P's adapter does with the ledger's):
        its journal then holds the ticks that matter, and every journaled tick is one
        the machine itself found due. After a tick that ran out of its work budget
        (``max_tick_work``) this is a time already past: tick again at once. O(peers)."""
        t = self._next_hb
        heap = self._lease_heap
        if heap:
            ms = self.config.ms
            t = min(t, heap[0][0] - ms.max_read_time - ms.clock_drift)
        due = self._rg.next_due()
        if due is not None:
            t = min(t, due + 1)
        pt = self.config.ms.peer_timeout
        for peer in self.peers.values():
            if peer.state == PEER_READY and peer.outstanding:
                first = next(iter(peer.outstanding.values())).sent_at
                t = min(t, max(peer.last_heard, first) + pt)
        return t

    # -- the step: one table row --------------------------------------------------------
    def _step(self, r: _DReq, event: str, guard: str, out: list[DEffect], *,
              reason: str = "", lease_end: int = CLOCK_START,
              notif_attached: bool = True) -> Transition:
        """Run the row (r.state, event, guard) of ``TABLE``: destination, then effects in
        order (its step function, lifecycle/dstep.py). ``reason`` names the finish when
        the row leaves it to the event; ``lease_end`` is what ``renew`` offers;
        ``notif_attached`` says whether ``send_done`` is due."""
        return self._steps[(r.state, event, guard)](self, r, out, reason, lease_end,
                                                   notif_attached)

    def _finish(self, r: _DReq, p: TransferParams) -> None:
        """``r`` leaves D (a row's ``finish``): out of reqs and its peer's table, its load
        remembered as ended, the lease heap compacted when mostly dead."""
        del self.reqs[r.rid]
        rg = self._rg
        rg.ended_read(r.rid)
        if rg.finished((p.engine, p.epoch, p.handle)):
            self._count("ended_memory_evicted")
        n = len(self._lease_heap)
        if n > 2 * len(self.reqs) and n > HEAP_SLACK:
            self._compact_lease_heap()
        peer = self.peers.get(p.engine)
        if peer is not None and peer.reqs.get(p.handle) is r:
            del peer.reqs[p.handle]

    def _compact_lease_heap(self) -> None:
        """Rebuild the lease heap from the idle requests, in place (tick may be iterating
        this very list). O(requests)."""
        self._lease_heap[:] = [(q.lease_end, q.rid) for q in self.reqs.values()
                               if q.state in _IDLE]
        heapq.heapify(self._lease_heap)

    def _room_for_peer(self) -> bool:
        """Whether one more peer fits MAX_PEERS, after forgetting every idle peer (no
        requests, no outstanding heartbeats, no handshake in progress) when at the cap.
        O(1) below the cap; O(MAX_PEERS) at it."""
        peers = self.peers
        if len(peers) < MAX_PEERS:
            return True
        for engine in [e for e, p in peers.items() if not p.reqs and not p.outstanding
                       and p.state != PEER_HANDSHAKING]:
            del peers[engine]
            self._count("peer_memory_evicted")
        return len(peers) < MAX_PEERS

    def _group_landed(self, r: _DReq) -> None:
        """``r``'s READ landed: its group entry (if it owns one) joins the landed FIFO;
        beyond max_landed_groups the oldest landed entry is forgotten. O(1)."""
        p = r.params
        if p.group is None:
            return
        key = (p.engine, p.group)
        if self._group_owner.get(key) != r.rid:
            return
        landed = self._groups_landed
        landed[key] = None
        if len(landed) > self.max_landed_groups:
            old, _ = landed.popitem(last=False)
            del self._group_owner[old]
            self._count("group_memory_evicted")

    def _read_fits(self, lease_end: int, now: int) -> bool:
        return now + self._fit_margin <= lease_end

    def _emit(self, ev: DEvent, out: list[DEffect]) -> list[DEffect]:
        if self.sink is not None:
            self.sink(ev, out)
        return out

    # -- generic entry point -------------------------------------------------------------
    def apply(self, ev: DEvent) -> list[DEffect]:
        """Feed one event, return its effects."""
        if isinstance(ev, DTick):
            return self.tick(ev.now)
        if isinstance(ev, DAck):
            return self.ack(ev.engine, ev.seq, ev.term, ev.refused, ev.now, ev.pending)
        if isinstance(ev, Schedule):
            return self.schedule(ev.request_id, ev.now)
        if isinstance(ev, ReadOk):
            return self.read_result(ev.request_id, True, ev.now,
                                    notif_attached=ev.notif_attached)
        if isinstance(ev, ReadFailed):
            return self.read_result(ev.request_id, False, ev.now, fenced=ev.fenced)
        if isinstance(ev, Admit):
            return self.admit(ev.request_id, ev.params, ev.now)
        if isinstance(ev, HandshakeOk):
            return self.handshake_result(ev.engine, True, ev.now)
        if isinstance(ev, HandshakeFailed):
            return self.handshake_result(ev.engine, False, ev.now, ev.reason)
        if isinstance(ev, DAbort):
            return self.abort(ev.request_id, ev.now)
        if isinstance(ev, PeerLost):
            return self.peer_lost(ev.engine, ev.now)
        if isinstance(ev, DReject):
            return self.reject(ev.reason, ev.peer, ev.detail, ev.now)
        if isinstance(ev, ClaimGranted):
            return self.claim_result(ev.request_id, True, ev.now)
        if isinstance(ev, ClaimRefused):
            return self.claim_result(ev.request_id, False, ev.now)
        if isinstance(ev, NeverRegistered):
            return self.never(ev.request_id, ev.now)
        raise TypeError(f"not a consumer event: {ev!r}")

    # -- events ------------------------------------------------------------------------------
    def admit(self, rid: str, params: TransferParams, now: int) -> list[DEffect]:
        """Transfer params received. The initial term is aged by ``max_delay``."""
        if type(now) is int and self.now <= now:
            self.now = now
        elif self._clock(now) is None:
            return []
        if not params.blocks:
            # Params naming no block are bad input (P registers no such request): refused
            # before the table as a DReject, so the request never becomes D's and a
            # replay of the journal counts it the same way; the caller recomputes it.
            return [*self.reject("bad_params", params.engine, "params name no block", now),
                    Finished(rid, D_FAILED, "bad_params")]
        out: list[DEffect] = []
        reqs = self.reqs
        known = rid in reqs
        if not known and (
                (params.engine, params.epoch, params.handle) in self._rg.ended
                if self._plain_refuses else self.refuses_load(params)):
            # No second pull: refused before the table, like peer_table_full.
            self._count("second_pull")
            key = f"{D_FAILED}:second_pull"
            self.finished[key] = self.finished.get(key, 0) + 1
            out.append(Finished(rid, D_FAILED, "second_pull"))
            return self._emit(Admit(rid, params, now), out)
        peer = self.peers.get(params.engine)
        if peer is None:  # not setdefault: that would build a _Peer on every admit
            if rid in self.reqs:
                self._count("duplicate_admit")
                return self._emit(Admit(rid, params, now), out)
            if not self._room_for_peer():
                # Refused before the table: the request never becomes D's (no state,
                # nothing sent: P frees it by lease expiry) and is recomputed.
                self._count("peer_table_full")
                key = f"{D_FAILED}:peer_table_full"
                self.finished[key] = self.finished.get(key, 0) + 1
                out.append(Finished(rid, D_FAILED, "peer_table_full"))
                return self._emit(Admit(rid, params, now), out)
            peer = self.peers[params.engine] = _Peer()
        if known or params.handle in peer.reqs:
            self._count("duplicate_admit")
            return self._emit(Admit(rid, params, now), out)
        lease_end = now + params.initial_term - self._max_delay
        r = _DReq(rid, params, lease_end)
        reqs[rid] = r
        peer.reqs[params.handle] = r
        if now + self._fit_margin > lease_end:  # not _read_fits
            guard = "lease_short"
        elif peer.state == PEER_READY:
            guard = "claim" if params.capability else "peer_ready"
        else:
            guard = "peer_unknown"
        self._admit_steps[guard](self, r, out, "", CLOCK_START, True)
        return self._emit(Admit(rid, params, now), out) if self.sink else out

    def handshake_result(self, engine: str, ok: bool, now: int,
                         reason: str = "handshake") -> list[DEffect]:
        """The handshake with ``engine`` finished (ok) or failed (``reason``)."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.get(engine)
        if peer is None:
            if not self._room_for_peer():  # an engine with no requests: nothing to decide
                self._count("peer_table_full")
                return self._emit(HandshakeOk(engine, now) if ok
                                  else HandshakeFailed(engine, reason, now), out)
            peer = self.peers[engine] = _Peer()
        peer.state = PEER_READY if ok else PEER_UNKNOWN
        if ok:
            peer.last_heard = now
        for r in [r for r in peer.reqs.values() if r.state == HANDSHAKING]:
            if ok:
                self._step(r, HANDSHAKE_OK, "claim" if r.params.capability else "ok", out)
            else:
                self._step(r, HANDSHAKE_FAILED, "failed", out, reason=reason)
        return self._emit(HandshakeOk(engine, now) if ok else HandshakeFailed(engine, reason, now),
                          out)

    def schedule(self, rid: str, now: int) -> list[DEffect]:
        """D's scheduler wants this request's KV now."""
        if type(now) is int and self.now <= now:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return []
            now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None or r.state != WAITING:
            self._count("schedule_not_waiting")
            return self._emit(Schedule(rid, now), out)
        p = r.params
        guard = ""
        if p.group is not None:
            owner = self._group_owner.get((p.engine, p.group))
            if owner is not None and owner != rid and owner in self.reqs:
                # The owner's READ has not landed yet (if it fails, this member may
                # become the owner): not done, not read; the scheduler retries later.
                guard = "sibling_in_flight"
                self._count("sibling_in_flight")
            elif owner is not None and owner != rid:
                guard = "sibling_local"
        if not guard:  # _read_fits
            guard = "lease_covers_read" if now + self._fit_margin <= r.lease_end \
                else "lease_short"
        self._schedule_steps[guard](self, r, out, "", CLOCK_START, True)
        return self._emit(Schedule(rid, now), out) if self.sink else out

    def read_result(self, rid: str, ok: bool, now: int, *, fenced: bool = False,
                    notif_attached: bool = True, corrupt: bool = False) -> list[DEffect]:
        """The READ finished (``ok``), failed, or its generations changed (``fenced``).

        ``corrupt``: the data landed with its stamps unchanged, but a block's checksum
        differs from the one P computed at register (``Config.checksums``). Such a READ
        takes the fenced path (``read_failed``/``fenced``): never served, the reader
        releases, the engine recomputes; counted as ``checksum_failed``.

        With ``notif_attached`` the adapter carried the done itself (e.g. as the READ's
        NIXL notification); otherwise the machine emits SendDone (the NIXL adapter
        batches those per P engine and step).
        """
        if type(now) is int and self.now <= now:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return []
            now = clk
        out: list[DEffect] = []
        if corrupt:  # a block whose checksum failed is never visible: fence the READ
            self._count("checksum_failed")
            fenced = True
        landed = ok and not fenced
        r = self.reqs.get(rid)
        if r is None or r.state != READING:
            q = self._rg.release(rid) if r is None else None
            if q is None:
                self._count("read_result_not_reading")
            else:  # the transfer of an overdue READ ended: its blocks may go back
                self._count("quarantine_ended")
                out.append(q)
        elif landed:
            self._read_ok_steps["abort_pending" if r.abort_pending else "ok"](
                self, r, out, "", CLOCK_START, notif_attached)
            if r.params.group is not None:
                self._group_landed(r)
        else:
            # The READ is no longer in flight, so release is safe; P counts this
            # reader once even if the READ's own notification also arrives.
            self._step(r, READ_FAILED, "fenced" if fenced else "error", out)
        if self.sink is None:
            return out
        ev: DEvent = ReadOk(rid, now, notif_attached) if landed else ReadFailed(rid, now, fenced)
        return self._emit(ev, out)

    def abort(self, rid: str, now: int) -> list[DEffect]:
        """Client abort on D. Never releases under an in-flight READ."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None:
            self._count("abort_unknown")
        elif r.state == READING:
            self._step(r, D_ABORT, "in_flight", out)
        else:
            self._step(r, D_ABORT, "idle", out)
        return self._emit(DAbort(rid, now), out)

    def ack(self, engine: str, seq: int, term: int, refused: Sequence[int],
            now: int, pending: Sequence[int] = ()) -> list[DEffect]:
        """P answered heartbeat ``seq``: lease end := send time + term - drift, except for
        ``refused`` handles (P will not renew them) and ``pending`` ones (P has not
        registered them yet: the previous estimate stands)."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        ev = DAck(engine, seq, term, tuple(refused), now, tuple(pending))
        peer = self.peers.get(engine)
        if peer is not None and peer.state == PEER_READY:
            peer.last_heard = now
        sent = peer.outstanding.pop(seq, None) if peer is not None else None
        if peer is None or sent is None:
            self._count("ack_unknown")
            return self._emit(ev, out)
        refused_set = set(refused)
        pending_set = set(pending)
        lease_end = sent.sent_at + term - self.config.ms.clock_drift
        for h in sent.handles:
            r = peer.reqs.get(h)
            if r is None or r.state not in (WAITING, READING) or h in pending_set:
                continue
            if h in refused_set:
                self._step(r, ACK, "refused", out)
            else:
                self._step(r, ACK, "granted", out, lease_end=lease_end)
        return self._emit(ev, out)

    def claim_result(self, rid: str, granted: bool, now: int) -> list[DEffect]:
        """P's gate answered this consumer's claim of ``rid``'s handle: granted (the
        request may read) or refused (recompute; nothing is sent to P). An answer for a
        request not claiming is counted (``claim_answer_unexpected``) and changes
        nothing."""
        if type(now) is int and self.now <= now:
            self.now = now
        else:
            clk = self._clock(now)
            if clk is None:
                return []
            now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None or r.state != CLAIMING:
            self._count("claim_answer_unexpected")
        elif granted:
            self._granted(self, r, out, "", CLOCK_START, True)
        else:
            self._count("claim_refused")
            self._step(r, CLAIM_REFUSED, "refused", out)
        if self.sink is None:
            return out
        return self._emit(ClaimGranted(rid, now) if granted else ClaimRefused(rid, now), out)

    def never(self, rid: str, now: int) -> list[DEffect]:
        """P will never register ``rid``'s handle: a request not reading fails now
        (``never_registered``); a READ in flight reports its own end."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        r = self.reqs.get(rid)
        if r is None:
            self._count("never_unknown")
        else:
            self._step(r, NEVER, "in_flight" if r.state == READING else "idle", out)
        return self._emit(NeverRegistered(rid, now), out)

    def _lose_peer(self, peer: _Peer, out: list[DEffect]) -> None:
        peer.state = PEER_UNKNOWN
        peer.outstanding.clear()
        for r in list(peer.reqs.values()):
            if r.state == READING:
                self._step(r, PEER_LOST, "in_flight", out)
            elif r.state in _IDLE:
                self._step(r, PEER_LOST, "lost", out)

    def peer_lost(self, engine: str, now: int) -> list[DEffect]:
        """P disconnected (or crashed): fail everything not in flight, promptly."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        peer = self.peers.get(engine)
        if peer is not None:
            self._lose_peer(peer, out)
        return self._emit(PeerLost(engine, now), out)

    def sweep_leases(self, now: int, out: list[DEffect], budget: int | None = None) -> None:
        """Hook: run D_TICK/lease_lost for idle requests whose lease can no longer cover
        a READ, earliest lease end first, doing at most ``budget`` (default
        ``config.max_tick_work``) lease-heap entries (losses, entries of requests gone since, lazy re-inserts of renewed
        ones). What is left stays due: such a request stays waiting or handshaking (a
        heartbeat still names it, an ack may renew it, a schedule fails it) and a later
        tick fails it; ``next_deadline()`` reports a time already past."""
        ms = self.config.ms
        margin = ms.max_read_time + ms.clock_drift
        heap = self._lease_heap
        if budget is None:
            budget = self.config.max_tick_work
        while heap and heap[0][0] - margin < now:
            if budget <= 0:
                self._count("tick_budget_exhausted")
                break
            budget -= 1
            _, rid = heapq.heappop(heap)
            r = self.reqs.get(rid)
            if r is None or r.state not in _IDLE:
                continue
            if self._read_fits(r.lease_end, now):
                heapq.heappush(heap, (r.lease_end, rid))  # renewed since: re-insert
                continue
            self._step(r, D_TICK, "lease_lost", out)

    def sweep_reads(self, now: int, out: list[DEffect], budget: int | None = None) -> None:
        """Hook: D_TICK/read_overdue for READs past their deadline, earliest first, at
        most ``budget`` (default ``config.max_tick_work``) heap entries; the rest stay
        reading and due (failed late, never early). See lifecycle/quarantine.py."""
        rids, _ = self._rg.overdue(now, budget or self.config.max_tick_work)
        for rid in rids:
            self._count("read_timeout")
            self._step(self.reqs[rid], D_TICK, "read_overdue", out)

    def refuses_load(self, params: TransferParams) -> bool:
        """Hook: whether an admit of ``params`` is a second pull (its load ended here)."""
        return self._rg.refuses((params.engine, params.epoch, params.handle))

    @property
    def stuck_reads(self) -> int:
        """Overdue READs whose transfer has not ended (their local blocks quarantined)."""
        return len(self._rg.quarantined)

    def quarantined(self, rid: str) -> bool:
        return rid in self._rg.quarantined

    def read_deadline(self, rid: str) -> int | None:
        return self._rg.deadline(rid)

    def tick(self, now: int) -> list[DEffect]:
        """Heartbeat every request still to be pulled (queued ones too), per P engine,
        and re-present the claim of every request still claiming a heartbeat_interval
        after its admit (effect claim);
        fail requests whose lease can no longer cover a READ (at most
        ``config.max_tick_work`` lease-heap entries per call, see ``sweep_leases``);
        lose peers that left heartbeats unanswered for ``peer_timeout``. Mirrors
        KVConsumer's ``DTickLagOp``: a lease loss may be late, never early."""
        clk = self._clock(now)
        if clk is None:
            return []
        now = clk
        out: list[DEffect] = []
        cfg = self.config
        ms = cfg.ms
        heap = self._lease_heap
        if heap and heap[0][0] - ms.max_read_time - ms.clock_drift < now:
            self.sweep_leases(now, out)
        due = self._rg.next_due()
        if due is not None and due < now:
            self.sweep_reads(now, out)
        silent_before = now - ms.peer_timeout
        for engine, peer in self.peers.items():
            # Silent: nothing heard for peer_timeout, and a heartbeat P had that long
            # to answer is still unanswered.
            if peer.state == PEER_READY and peer.outstanding \
                    and peer.last_heard < silent_before \
                    and next(iter(peer.outstanding.values())).sent_at < silent_before:
                self._count("peer_silent")
                self._lose_peer(peer, out)
                out.append(DropPeer(engine, f"no ack for {now - peer.last_heard} ms"))
        if now >= self._next_hb:
            self._next_hb = now + ms.heartbeat_interval
            cap = self.heartbeat_chunk or 1 << 30
            reclaim_after = self._max_delay + ms.heartbeat_interval
            for engine, peer in self.peers.items():
                _prune_outstanding(peer, now - ms.lease_extension)
                if peer.state != PEER_READY or not peer.reqs:
                    continue
                by_expected: dict[int, list[int]] = {}
                for h, r in peer.reqs.items():
                    if r.state == WAITING or r.state == READING:
                        by_expected.setdefault(r.params.expected, []).append(h)
                    elif r.state == CLAIMING and \
                            r.lease_end - now <= r.params.initial_term - reclaim_after:
                        # The claim rides the heartbeat: re-presented at each round once
                        # the request has waited heartbeat_interval since its admit
                        # (its lease ran down that far), so a lost claim or grant costs
                        # about one interval, not the transfer, and a claim answered
                        # within an interval is not repeated. P's gate answers a repeat
                        # as the first (a second answer is counted here as
                        # claim_answer_unexpected and changes nothing).
                        p = r.params
                        out.append(SendClaim(r.rid, engine, p.handle, p.capability))
                        self._count("claims_retried")
                for expected, handles in by_expected.items():
                    handles.sort()
                    for run in chunk_handles(handles, cfg.max_message_bytes):
                        for i in range(0, len(run), cap):
                            part = tuple(run[i:i + cap])
                            peer.seq = (peer.seq + 1) & 0xFFFFFFFF
                            peer.outstanding[peer.seq] = _HbSent(now, part)
                            if len(peer.outstanding) > MAX_OUTSTANDING_HEARTBEATS:
                                peer.outstanding.popitem(last=False)
                                self._count("heartbeat_memory_evicted")
                            out.append(SendHeartbeat(engine, peer.seq, part, expected))
        return self._emit(DTick(now), out)

    def reject(self, reason: str, peer: str, detail: str, now: int) -> list[DEffect]:
        """Record a rejection of bad remote input (``kvproto.port.d_receive``): counted
        (``rejected:<reason>``), journaled, and nothing else changes. A ``now`` that is
        not an int is recorded at the rank's clock (0 before any event)."""
        clk = self._clock(now)
        now = clk if clk is not None else (self.now if self.now != CLOCK_START else 0)
        self._count("rejected:" + reason)
        return self._emit(DReject(reason, peer, detail, now), [DRejected(reason, peer, detail)])
