"""A D journal that talks to several P engines, split into one TLC trace per P engine.

KVConsumer models one D rank facing one P engine. A D rank whose P restarted (a new
engine name and epoch: vLLM gives every engine start a new id) has journaled events for
several P engines. Its ``Consumer`` is, per P engine, a copy of KVConsumer's machine:

* every request's state, lease, abort mark, READ deadline, quarantine and ended-load
  memory belong to the P engine of its params (``(engine, epoch, handle)``); every peer
  field (handshake, heartbeat sequence numbers, heartbeats awaiting an ack, ack silence)
  is keyed by the engine; group owners by (engine, group);
* every event but ``tick`` and ``reject`` names one engine (an admit by its params, a
  handshake result, ack or peer loss by its engine, a schedule, READ result or abort by
  the admission of its request) and touches only that engine's part.

So the journal projected on one engine (that engine's events, every tick with only the
effects on that engine, every reject as a stuttering step) is a behaviour of KVConsumer,
and :func:`split_rows` computes the projections. What the engines share is carried or
checked elsewhere: D's clock (each projected step moves time by the ms since the
engine's previous step on D's clock, which every event moves), the heartbeat schedule
(moved only by ticks, which every projection holds), and the tick's work budget (each
projection fails a subset of what the whole tick failed; the whole tick's bound,
TickBounded, is checked by the replay, :mod:`kvproto.verify.replay`, with the other
invariants over the whole journal).

A journal outside these assumptions cannot be split (:class:`SplitError`, with the
reason; ``kvproto validate`` then replays it through D's table instead): an event about
one engine with an effect on another, a request id admitted for one engine while live
for another, a cap shared by all engines reached (the peer table, the landed-group or
ended-load memory: one engine's event would change another's part).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvproto.lifecycle import (
    Admit,
    ClaimGranted,
    ClaimRefused,
    Consumer,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    DropPeer,
    Finished,
    HandshakeFailed,
    HandshakeOk,
    NeverRegistered,
    PeerLost,
    PostRead,
    Quarantined,
    ReadFailed,
    ReadOk,
    Schedule,
    SendClaim,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    Unquarantined,
)
from kvproto.lifecycle.config import Config
from kvproto.verify.trace import TraceError

Row = tuple[int, DEvent, list[DEffect]]

# Counters of D's caps shared by all P engines: reaching one lets an event of one engine
# change another engine's part (forget its idle peer, a landed group, an ended load).
SHARED_CAPS: Final = ("peer_memory_evicted", "peer_table_full", "group_memory_evicted",
                      "ended_memory_evicted")


class SplitError(TraceError):
    """The journal talks to several P engines and cannot be cut into one KVConsumer
    behaviour per engine (the reason says why); it is replayed through D's table."""


@dataclass
class Projection:
    """One P engine's part of a D journal: ``rows`` maps a row's index in the journal to
    the recorded effects that concern this engine (rows absent are other engines')."""

    engine: str
    rows: dict[int, list[DEffect]]


def event_engine(ev: DEvent) -> str | None:
    """The engine an event names by itself (None: a tick, a reject, or an event naming
    a request)."""
    if isinstance(ev, Admit):
        return ev.params.engine
    if isinstance(ev, (HandshakeOk, HandshakeFailed, DAck, PeerLost)):
        return ev.engine
    return None


def journal_engines(rows: Sequence[Row]) -> list[str]:
    """The P engines a journal's events name, in order of first appearance."""
    seen: dict[str, None] = {}
    for _, ev, _ in rows:
        e = event_engine(ev)
        if e is not None:
            seen.setdefault(e)
    return list(seen)


def _effect_engine(eff: DEffect, engine_of: dict[str, str], c: Consumer) -> str | None:
    if isinstance(eff, (StartHandshake, PostRead, SendClaim, SendDone, SendRelease,
                        SendHeartbeat, DropPeer, Quarantined, Unquarantined)):
        return eff.engine
    if isinstance(eff, Finished):
        r = c.request(eff.request_id)
        return r.params.engine if r is not None else engine_of.get(eff.request_id)
    return None  # DRejected: no engine


def split_rows(reader: str, config: Config, rows: Sequence[Row]) -> list[Projection]:
    """Project a D journal on each P engine it names (replaying it through ``Consumer``
    to learn each request's engine). Raises SplitError when it cannot be split."""
    engines = journal_engines(rows)
    proj = {e: Projection(e, {}) for e in engines}
    c = Consumer(reader, config)
    engine_of: dict[str, str] = {}  # request id -> the engine of its latest admission
    for i, (lineno, ev, effs) in enumerate(rows):
        own: str | None = event_engine(ev)
        if isinstance(ev, (Schedule, ReadOk, ReadFailed, DAbort, ClaimGranted, ClaimRefused,
                           NeverRegistered)):
            r = c.request(ev.request_id)
            own = r.params.engine if r is not None else engine_of.get(ev.request_id)
        if isinstance(ev, Admit):
            live = c.request(ev.request_id)
            if live is not None and live.params.engine != own:
                raise SplitError(f"line {lineno}: request id {ev.request_id} admitted for P "
                                 f"engine {own} while live for {live.params.engine}")
        per: dict[str | None, list[DEffect]] = {}
        for eff in effs:
            e = _effect_engine(eff, engine_of, c)
            if isinstance(eff, Finished) and e is None and own is not None:
                e = own  # a load refused before the table (second pull)
            if e is not None and e not in proj:
                raise SplitError(f"line {lineno}: an effect on P engine {e}, which no event "
                                 "of the journal names")
            if own is not None and e is not None and e != own:
                raise SplitError(f"line {lineno}: an event about P engine {own} has an "
                                 f"effect on P engine {e} ({type(eff).__name__})")
            per.setdefault(e, []).append(eff)
        unowned = per.get(None, [])
        if own is None:  # a tick, a reject, or an event on a request never admitted
            for e, p in proj.items():
                p.rows[i] = per.get(e, []) + unowned
        else:
            proj[own].rows[i] = effs
        before = {k: c.counters.get(k, 0) for k in SHARED_CAPS}
        c.apply(ev)
        if isinstance(ev, Admit) and c.request(ev.request_id) is not None:
            engine_of[ev.request_id] = ev.params.engine
        hit = [k for k in SHARED_CAPS if c.counters.get(k, 0) > before[k]]
        if hit:
            raise SplitError(f"line {lineno}: a cap shared by all P engines was reached "
                             f"({', '.join(hit)}): KVConsumer models one engine's part")
    return list(proj.values())


def describe_split(projections: Sequence[Projection]) -> str:
    return ", ".join(f"{p.engine} ({len(p.rows)} steps)" for p in projections)
