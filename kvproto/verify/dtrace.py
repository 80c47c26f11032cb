"""TLC trace validation of one D rank's journal (``kvproto validate D_JOURNAL``).

A D journal (``JournalWriter(..., reader=name).sink`` on a ``Consumer``) becomes TLA+
traces checked by ``tla/conformance/TraceConsumer.tla`` over ``tla/KVConsumer.tla``: every
step applies KVConsumer's operator for the event and the recorded effects must be the
spec's. The traces run through the same batches and TLC runner as P journals
(``kvproto.verify.validate.check_batch``).

Mapping (TraceConsumer.tla's header): each admission D created a machine for is a
request ``q<k>``; a request id or handle that names no live admission names ``"-"``, a
request never admitted (events on it are no-ops, effects naming it are the journal's
own); times, terms and durations are the journal's integer milliseconds (one TLA+ time
unit). Long journals are cut into
segments chained through the journal replayed by the Python ``Consumer`` (the
abstraction function of KVConsumer.tla's header), so TLC's time grows linearly.

Assumptions (outside them the journal is refused as bad input): one P engine per trace
(KVConsumer models one: a journal that names several, its P restarted, is traced per
engine, each trace the engine's part split off by ``kvproto.verify.dsplit``), and no
more than ``MAX_OUTSTANDING_HEARTBEATS`` heartbeats awaiting an ack (D forgets the oldest
beyond, which the spec does not model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvproto.journal import decode_row, header_config, journal_lines, read_journal_objects
from kvproto.lifecycle import (
    MAX_OUTSTANDING_HEARTBEATS,
    PEER_READY,
    Admit,
    ClaimGranted,
    ClaimRefused,
    Consumer,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    DReject,
    DropPeer,
    DTick,
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
from kvproto.verify.dsplit import Projection, event_engine, journal_engines, split_rows
from kvproto.verify.tlc import render
from kvproto.verify.trace import (
    DEFAULT_SEGMENT_STEPS,
    TLC_INT_MAX,
    Trace,
    TraceError,
)

# KVConsumer's variables (the trace module works on a record of them).
D_VARS: Final = ("dst", "dlease", "abortPending", "owner", "peer", "hbs", "hbWait", "heard",
                 "eff", "rdl", "quar", "inflight", "pulls", "mayRead")
NOBODY: Final = "-"  # a request never admitted: what an unknown id or handle names


def _s(x: str) -> str:
    return render(x)


def _set(xs: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(set(xs))) + "}"


def _fn(items: Sequence[tuple[str, str]]) -> str:
    """A function literal over exactly the keys of ``items`` (TLC's :> and @@)."""
    if not items:
        return "<<>>"
    return "(" + " @@ ".join(f"{k} :> {v}" for k, v in items) + ")"


@dataclass
class _Adm:
    """One admission: a request of the spec."""

    name: str
    rid: str
    handle: int
    group: str | None
    term: int
    expected: int
    cap: bool = False  # its params carry a capability (it claims before it reads)


class _Names:
    """Request ids and handles -> the spec's request names, kept beside the replay."""

    def __init__(self) -> None:
        self.adm: dict[str, _Adm] = {}  # name -> admission
        self.by_rid: dict[str, str] = {}  # rid -> latest name
        self.by_handle: dict[int, str] = {}  # handle -> latest name
        self.final: dict[str, str] = {}  # name -> state of its Finished effect
        self.pulls: dict[str, int] = {}  # name -> READs posted
        self.granted: set[str] = set()  # names whose claim P granted (ghost mayRead)

    def live(self, c: Consumer, rid: str) -> str:
        n = self.by_rid.get(rid)
        return n if n is not None and rid in c.reqs and n not in self.final else NOBODY

    def handle(self, h: int) -> str:
        return self.by_handle.get(h, NOBODY)

    def admit(self, c: Consumer, ev: Admit, engine: str) -> str:
        """The name an admit event names: the live admission of its id or handle, or a
        new one when Consumer will create a machine for it."""
        if ev.request_id in c.reqs:
            return self.live(c, ev.request_id)
        holder = c.request_id(engine, ev.params.handle)
        if holder is not None:
            return self.by_rid.get(holder, NOBODY)
        name = f"q{len(self.adm) + 1}"
        p = ev.params
        self.adm[name] = _Adm(name, ev.request_id, p.handle, p.group, p.initial_term, p.expected,
                              bool(p.capability))
        self.by_rid[ev.request_id] = name
        self.by_handle[p.handle] = name
        return name


class _DTraceBuilder:
    def __init__(self, path: str, header: dict[str, Any],
                 rows: list[tuple[int, DEvent, list[DEffect]]], raw: dict[int, Any],
                 part: Projection | None = None) -> None:
        """``part``: trace only this P engine's part of a journal that names several
        (``kvproto.verify.dsplit``); None: the journal must name at most one."""
        self.path = path
        self.cfg = header_config(header)
        self.reader = str(header.get("reader"))
        self.rows = rows
        self.raw = raw
        self.part = part
        engines = {e for _, ev, _ in rows if (e := event_engine(ev)) is not None}
        if len(engines) > 1 and part is None:
            raise TraceError(f"the journal talks to {len(engines)} P engines "
                             f"({', '.join(sorted(engines))}): KVConsumer models one")
        self.engine = part.engine if part is not None else next(iter(engines), "P")
        ms = self.cfg.ms
        durations = [ms.max_delay, ms.max_read_time, ms.clock_drift, ms.heartbeat_interval,
                     ms.lease_extension, ms.peer_timeout]
        for _, ev, _ in rows:
            if isinstance(ev, Admit):
                durations.append(ev.params.initial_term)
            elif isinstance(ev, DAck):
                durations.append(ev.term)
        if any(abs(v) > TLC_INT_MAX for v in durations):
            raise TraceError("a duration or term overflows TLC's integers in milliseconds")
        groups = {ev.params.group for _, ev, _ in rows
                  if isinstance(ev, Admit) and ev.params.group is not None}
        self.no_group = "nogroup"
        while self.no_group in groups:
            self.no_group += "_"

    # -- the abstraction function of KVConsumer.tla's header ---------------------------
    def record(self, c: Consumer, names: _Names, reqs: Sequence[str],
               final: dict[str, str], pulls_of: dict[str, int], now: int,
               granted: set[str]) -> str:
        """KVConsumer's record of ``c`` (this engine's part) at time ``now``; ``granted``:
        the names whose claim P granted (the ghost ``mayRead``)."""
        cfg = self.cfg
        dst: list[tuple[str, str]] = []
        dlease: list[tuple[str, str]] = []
        pend: list[tuple[str, str]] = []
        rdl: list[tuple[str, str]] = []
        pulls: list[tuple[str, str]] = []
        quar: list[str] = []
        inflight: list[str] = []
        for n in reqs:
            a = names.adm.get(n)
            st = "new"
            le = 0
            rd = 0
            ap = False
            if a is not None:
                if n in final:
                    st = final[n]
                else:
                    st = c.state(a.rid)
                    end = c.lease_end(a.rid)
                    if st in ("waiting", "handshaking", "claiming") and end is not None:
                        le = end - now
                    ap = c.abort_pending(a.rid)
                    due = c.read_deadline(a.rid)
                    rd = due - now if due is not None else 0
                if c.quarantined(a.rid) and names.by_rid.get(a.rid) == n:
                    quar.append(_s(n))
                if st == "reading" or _s(n) in quar:
                    inflight.append(_s(n))
            dst.append((_s(n), _s(st)))
            dlease.append((_s(n), str(le)))
            pend.append((_s(n), "TRUE" if ap else "FALSE"))
            rdl.append((_s(n), str(rd)))
            pulls.append((_s(n), str(pulls_of.get(n, 0))))
        owners = []
        for g in sorted({a.group for n in reqs if (a := names.adm.get(n)) is not None
                         and a.group is not None}):
            o = c.group_owner(self.engine, g)
            owners.append((_s(g), _s(names.by_rid.get(o, NOBODY) if o is not None else "none")))
        peer = c.peer(self.engine)
        keep = set(reqs)
        hbs: list[str] = []
        heard = 0
        if peer is not None:
            for seq, sent in peer.outstanding.items():
                rs = {names.handle(h) for h in sent.handles} & keep
                hbs.append(f"[seq |-> {seq}, rs |-> {_set(_s(q) for q in rs)}, "
                           f"age |-> {now - sent.sent_at}]")
            if peer.state == PEER_READY:
                # Never heard (last_heard is CLOCK_START): as silent as can be, pt + 1.
                pt = cfg.ms.peer_timeout
                heard = min(now - peer.last_heard, pt + 1)
        hb_wait = max(0, c.next_heartbeat_at - now)  # 0 before the first heartbeat (CLOCK_START)
        fields = {
            "dst": _fn(dst), "dlease": _fn(dlease), "abortPending": _fn(pend),
            "owner": _fn(owners) if owners else "[x \\in {} |-> \"none\"]",
            "peer": _s(c.peer_state(self.engine)),
            "hbs": "{" + ", ".join(hbs) + "}", "hbWait": str(hb_wait), "heard": str(heard),
            "eff": "{}", "rdl": _fn(rdl), "quar": _set(quar), "inflight": _set(inflight),
            "pulls": _fn(pulls),
            "mayRead": _set(_s(n) for n in reqs
                            if (a_ := names.adm.get(n)) is None or not a_.cap or n in granted),
        }
        return "[" + ", ".join(f"{k} |-> {fields[k]}" for k in D_VARS) + "]"

    # -- steps ---------------------------------------------------------------------------
    def step(self, c: Consumer, names: _Names, ev: DEvent, effs: list[DEffect],
             dt: int, late: int) -> tuple[str, list[str]]:
        """The TLA+ step record and the names the event touches (before applying it)."""
        f: dict[str, str] = {"type": "", "dt": str(dt), "late": str(late), "r": _s(NOBODY),
                             "flag": "FALSE", "why": '""', "seq": "0", "term": "0",
                             "ref": "{}", "pen": "{}"}
        touched: list[str] = []
        if isinstance(ev, Admit) and any(isinstance(e, Finished) and e.reason == "second_pull"
                                         and e.request_id == ev.request_id for e in effs):
            # A second load of a request that ended: the spec's Readmit of that request.
            r = names.handle(ev.params.handle)
            f.update(type='"readmit"', r=_s(r))
            fx = f'[k |-> "finish", r |-> {_s(r)}, why |-> "second_pull"]'
            # fin stays empty: the second load fails, the request it names keeps its state.
            f.update(eff="{" + fx + "}", fin="{}", hb="{}")
            return "[" + ", ".join(f"{k} |-> {v}" for k, v in f.items()) + "]", [r]
        if isinstance(ev, Admit):
            r = names.admit(c, ev, self.engine)
            f.update(type='"admit"', r=_s(r))
            touched.append(r)
        elif isinstance(ev, HandshakeOk):
            f.update(type='"handshake_ok"')
        elif isinstance(ev, HandshakeFailed):
            f.update(type='"handshake_failed"', why=_s(ev.reason))
        elif isinstance(ev, (Schedule, ReadOk, ReadFailed, DAbort)):
            typ = {Schedule: "schedule", ReadOk: "read_ok", ReadFailed: "read_failed",
                   DAbort: "abort"}[type(ev)]
            r = names.live(c, ev.request_id)
            if r == NOBODY and c.quarantined(ev.request_id):  # its transfer's end
                r = names.by_rid.get(ev.request_id, NOBODY)
            flag = ev.notif_attached if isinstance(ev, ReadOk) else \
                ev.fenced if isinstance(ev, ReadFailed) else False
            f.update(type=_s(typ), r=_s(r), flag="TRUE" if flag else "FALSE")
        elif isinstance(ev, (ClaimGranted, ClaimRefused)):
            f.update(type='"claim"', r=_s(names.live(c, ev.request_id)),
                     flag="TRUE" if isinstance(ev, ClaimGranted) else "FALSE")
        elif isinstance(ev, NeverRegistered):
            f.update(type='"never"', r=_s(names.live(c, ev.request_id)))
        elif isinstance(ev, DAck):
            f.update(type='"ack"', seq=str(ev.seq), term=str(ev.term),
                     ref=_set(_s(names.handle(h)) for h in ev.refused),
                     pen=_set(_s(names.handle(h)) for h in ev.pending))
        elif isinstance(ev, PeerLost):
            f.update(type='"peer_lost"')
        elif isinstance(ev, DTick):
            f.update(type='"tick"')
        elif isinstance(ev, DReject):
            f.update(type='"reject"')  # a stuttering step (its DRejected maps to no record)
        else:  # pragma: no cover - decode_row only yields D events
            raise TraceError(f"not a D event: {ev!r}")
        eff: list[str] = []
        fin: list[str] = []
        hb: list[str] = []
        new = touched[0] if touched else None

        def who(rid: str) -> str:
            n = names.live(c, rid)
            if n == NOBODY and new is not None and names.adm[new].rid == rid:
                return new
            return n

        for e in effs:
            if isinstance(e, StartHandshake):
                eff.append('[k |-> "handshake", r |-> "", why |-> ""]')
            elif isinstance(e, PostRead):
                eff.append(f'[k |-> "read", r |-> {_s(who(e.request_id))}, why |-> ""]')
            elif isinstance(e, SendClaim):
                eff.append(f'[k |-> "claim", r |-> {_s(who(e.request_id))}, why |-> ""]')
            elif isinstance(e, SendDone):
                eff.append(f'[k |-> "done", r |-> {_s(who(e.request_id))}, why |-> ""]')
            elif isinstance(e, SendRelease):
                eff.append(f'[k |-> "release", r |-> {_s(who(e.request_id))}, why |-> ""]')
            elif isinstance(e, Finished):
                n = who(e.request_id)
                eff.append(f'[k |-> "finish", r |-> {_s(n)}, why |-> {_s(e.reason)}]')
                fin.append(f"[r |-> {_s(n)}, st |-> {_s(e.state)}]")
            elif isinstance(e, SendHeartbeat):
                eff.append('[k |-> "heartbeat", r |-> "", why |-> ""]')
                rs = _set(_s(names.handle(h)) for h in e.handles)
                hb.append(f"[seq |-> {e.seq}, rs |-> {rs}, e |-> {e.expected}]")
            elif isinstance(e, DropPeer):
                eff.append('[k |-> "drop_peer", r |-> "", why |-> ""]')
            elif isinstance(e, Quarantined):
                eff.append(f'[k |-> "quarantine", r |-> {_s(who(e.request_id))}, why |-> ""]')
            elif isinstance(e, Unquarantined):
                q = names.by_rid.get(e.request_id, NOBODY)
                eff.append(f'[k |-> "unquarantine", r |-> {_s(q)}, why |-> ""]')
        f["eff"] = "{" + ", ".join(sorted(set(eff))) + "}"
        f["fin"] = "{" + ", ".join(sorted(set(fin))) + "}"
        f["hb"] = "{" + ", ".join(sorted(set(hb))) + "}"
        return "[" + ", ".join(f"{k} |-> {v}" for k, v in f.items()) + "]", touched

    def traces(self, segment_steps: int) -> list[Trace]:
        """The journal (or this engine's part of it) as traces of ``segment_steps``
        steps each (0: one), chained through the replayed Consumer.

        Every row is replayed; only this engine's rows become steps, with the effects
        that concern it. Time is D's clock (the latest event time, as Consumer keeps
        it), which every row moves: a step's dt is the time since this engine's previous
        step on that clock, and an admit behind the clock carries ``late``."""
        rows = self.rows
        keep = None if self.part is None else self.part.rows
        seg = max(1, len(rows) if segment_steps <= 0 else segment_steps)
        last = len(rows) - 1 if keep is None else max(keep, default=-1)
        c = Consumer(self.reader, self.cfg)
        names = _Names()
        engine_of: dict[str, str] = {}  # request id -> the engine of its latest admission
        out: list[Trace] = []
        clock = rows[0][1].now if rows else 0  # D's clock: the latest event time so far
        at = clock  # the spec's time: D's clock at this engine's latest step
        fixed = {
            "NoGroup": _s(self.no_group),
            "MaxDelay": str(self.cfg.ms.max_delay),
            "MaxReadTime": str(self.cfg.ms.max_read_time),
            "ClockDrift": str(self.cfg.ms.clock_drift),
            "HeartbeatInterval": str(self.cfg.ms.heartbeat_interval),
            "LeaseExtension": str(self.cfg.ms.lease_extension),
            "PeerTimeout": str(self.cfg.ms.peer_timeout),
            "ReadGrace": str(self.cfg.ms.read_grace),
            "DBug": '"none"',
            "TickWork": str(self.cfg.max_tick_work),
        }

        class _Seg:
            """A segment being built: its start (a copy of the replay) and its steps."""

            def __init__(self, offset: int) -> None:
                live = [nm for rid in c.reqs if (nm := names.live(c, rid)) != NOBODY]
                self.start_names = set(live)
                # The states at the start, for every name the segment may meet, are
                # taken after the fact (admissions are named as the segment runs).
                self.snapshot = c.clone()
                self.start_at = at
                self.final = dict(names.final)
                self.pulls = dict(names.pulls)
                self.granted = set(names.granted)
                self.offset = offset
                self.steps: list[str] = []
                self.lines: list[int] = []
                self.admitted: list[str] = []

        def close(sg: _Seg) -> None:
            reqs = set(sg.start_names) | set(sg.admitted)
            groups = {a.group for nm in reqs if (a := names.adm.get(nm)) and a.group}
            # the other members of their groups: a finished owner decides sibling_local
            reqs |= {nm for nm, a in names.adm.items() if a.group in groups}
            reqs.add(NOBODY)
            order = sorted(reqs, key=lambda x: (len(x), x))
            start = self.record(sg.snapshot, names, order, sg.final, sg.pulls, sg.start_at,
                                sg.granted)
            end = self.record(c, names, order, names.final, names.pulls, at, names.granted)
            constants = {
                **fixed,
                "Requests": _set(_s(x) for x in order),
                "GroupOf": _fn([(_s(x), _s(a.group if (a := names.adm.get(x)) and a.group
                                            else self.no_group)) for x in order]),
                "TermOf": _fn([(_s(x), str(a.term) if (a := names.adm.get(x))
                                else "0") for x in order]),
                "ExpOf": _fn([(_s(x), str(a.expected) if (a := names.adm.get(x)) else "0")
                              for x in order]),
                "CapOf": _fn([(_s(x), "TRUE" if (a := names.adm.get(x)) and a.cap else "FALSE")
                              for x in order]),
                "StartC": start,
                "EndC": end,
            }
            out.append(Trace(self.path, constants, sg.steps, sg.lines,
                             [self.raw.get(k, {}) for k in sg.lines], sg.offset,
                             module="TraceConsumer", spec_vars=D_VARS,
                             files=("KVConsumer.tla", "conformance/TraceConsumer.tla")))

        cur = _Seg(0)
        done = 0  # steps in the segments closed so far
        for i, (lineno, ev, effs) in enumerate(rows[:last + 1]):
            t = ev.now
            late = 0
            if t >= clock:
                clock = t
            else:
                late = clock - t
            mine = effs if keep is None else keep.get(i)
            if mine is not None:
                dt, at = clock - at, clock
                if dt > TLC_INT_MAX:
                    raise TraceError(f"line {lineno}: time step of {dt} ms overflows TLC "
                                     "integers")
                if isinstance(ev, DTick) and c.outstanding_heartbeats(self.engine) \
                        >= MAX_OUTSTANDING_HEARTBEATS:
                    raise TraceError(f"line {lineno}: more than {MAX_OUTSTANDING_HEARTBEATS} "
                                     "heartbeats await an ack: outside the spec's assumptions")
                text, touched = self.step(c, names, ev, mine, dt, late)
                if isinstance(ev, ClaimGranted) and c.state(ev.request_id) == "claiming":
                    gn = names.live(c, ev.request_id)
                    if gn != NOBODY:
                        names.granted.add(gn)
                cur.steps.append(text)
                cur.lines.append(lineno)
                cur.admitted += [t_ for t_ in touched if t_ not in cur.start_names]
            for e in c.apply(ev):
                if not isinstance(e, (PostRead, Finished)):
                    continue
                if keep is not None:  # another engine's request may reuse an id of ours
                    eng = ev.params.engine if isinstance(ev, Admit) \
                        and ev.request_id == e.request_id else engine_of.get(e.request_id)
                    if eng != self.engine:
                        continue
                if isinstance(e, PostRead) and e.request_id in names.by_rid:
                    pn = names.by_rid[e.request_id]
                    names.pulls[pn] = names.pulls.get(pn, 0) + 1
                if isinstance(e, Finished):
                    gone = names.by_rid.get(e.request_id)
                    if gone is not None:
                        names.final[gone] = e.state
            if isinstance(ev, Admit) and ev.request_id in c.reqs:
                engine_of[ev.request_id] = ev.params.engine
            if len(cur.steps) == seg:
                close(cur)
                done += seg
                cur = _Seg(done)
        if cur.steps or not out:
            close(cur)
        return out


def _read(path: str | Path) -> tuple[dict[str, Any], list[tuple[int, DEvent, list[DEffect]]],
                                   dict[int, Any]]:
    with open(path, "rb") as f:
        header, objs = read_journal_objects(journal_lines(f))
        raw: dict[int, Any] = {}
        rows: list[tuple[int, DEvent, list[DEffect]]] = []
        for lineno, d in objs:
            raw[lineno] = d["event"]
            ev, effs = decode_row(lineno, d, "D")
            rows.append((lineno, ev, effs))
    return header, rows, raw


def d_journal_to_traces(path: str | Path,
                        segment_steps: int = DEFAULT_SEGMENT_STEPS) -> list[Trace]:
    """Read a D journal that names at most one P engine and cut it into TraceConsumer
    traces of ``segment_steps`` steps (0: one trace). Raises JournalError / TraceError."""
    header, rows, raw = _read(path)
    return _DTraceBuilder(str(path), header, rows, raw).traces(segment_steps)


def d_journal_engine_traces(path: str | Path, segment_steps: int = DEFAULT_SEGMENT_STEPS
                            ) -> list[tuple[str, list[Trace]]]:
    """A D journal's traces per P engine: one entry for a journal that names at most one,
    else one per engine, its part split off by ``kvproto.verify.dsplit`` (each trace's
    path names the engine). Raises JournalError / TraceError (SplitError: the journal
    names several engines and cannot be split)."""
    header, rows, raw = _read(path)
    if len(journal_engines(rows)) <= 1:
        b = _DTraceBuilder(str(path), header, rows, raw)
        return [(b.engine, b.traces(segment_steps))]
    out: list[tuple[str, list[Trace]]] = []
    for part in split_rows(str(header.get("reader")), header_config(header), rows):
        b = _DTraceBuilder(f"{path} [P engine {part.engine}]", header, rows, raw, part)
        out.append((part.engine, b.traces(segment_steps)))
    return out
