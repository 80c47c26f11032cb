"""D-side conformance: one decode rank's journal checked against D's transition table.

A D journal (``JournalWriter(..., reader=name)`` on a ``Consumer``'s sink: the simulator,
``kvproto demo``, the NIXL tests) is replayed through a fresh ``Consumer`` (which runs
``D_TRANSITIONS``, the table ``tla/KVLifecycle.tla``'s D actions mirror name for name):
every recorded effect must be the table's, and D's promises to P must hold (no release
while a READ is in flight). ``kvproto validate`` sends D journals here.

State-graph equality: ``tla/KVConsumer.tla`` is D's machine alone (as ``KVLedger.tla``
is P's). For each small ``DModel`` TLC dumps its reachable graph, the Python
``Consumer`` is explored by BFS over the same inputs through the abstraction function
of KVConsumer.tla's header, and both graphs must have the same labelled edges (effects
included: they are part of the state, as the last step's ``eff``). Heartbeats (sent by
D's tick every unit), P's acks of any outstanding heartbeat (granted or refused, and acks
of no outstanding heartbeat) and ack silence are in the models.

TLC trace validation of D journals (``tla/conformance/TraceConsumer.tla``) is in
``kvproto.verify.dtrace``; ``kvproto validate`` runs it after the replay above.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import networkx as nx

from kvproto.journal import (
    MAX_LINE_BYTES,
    JournalError,
    journal_lines,
    journal_side,
    parse_line,
    read_journal_objects,
)
from kvproto.lifecycle import (
    Config,
    Consumer,
    DEffect,
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
)
from kvproto.verify.conformance import read_dot
from kvproto.verify.models import UNIT_MS
from kvproto.verify.replay import replay
from kvproto.verify.tlc import (
    Fn,
    TlcResult,
    Value,
    mk_fn,
    paused_gc,
    render,
    require_ok,
    run_tlc,
    shared_states,
    spec_dir,
)


@dataclass
class DVerdict:
    """The outcome for one D journal."""

    path: str
    reader: str
    events: int
    allowed: bool
    finished: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = (f"{self.path}: D journal of {self.reader}: {self.events} events "
                f"{'follow' if self.allowed else 'do NOT follow'} D_TRANSITIONS "
                f"(finished {self.finished})")
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def is_d_journal(path: str | Path) -> bool:
    """True when ``path``'s header says it is one D rank's journal (False for P's, or
    when the header cannot be read: the caller reports that)."""
    try:
        with open(path, "rb") as f:
            header = parse_line(f.readline(MAX_LINE_BYTES + 1), 1, "header is ")
        return isinstance(header, dict) and journal_side(header) == "D"
    except (OSError, ValueError, JournalError):
        return False


def check_d_journal(path: str | Path) -> DVerdict:
    """Replay a D journal through ``Consumer``; raises JournalError on unreadable input."""
    with open(path, "rb") as f:
        header, _ = read_journal_objects(journal_lines(f))
        f.seek(0)
        res = replay(journal_lines(f))
    return DVerdict(str(path), str(header.get("reader")), res.events, res.ok, res.frees,
                    [*(f"DIVERGED {d}" for d in res.divergences),
                     *(f"VIOLATION {v}" for v in res.violations)])


# ---------------------------------------------------------------------------
# State-graph equality: Consumer (Python) vs tla/KVConsumer.tla (TLC), small models.
# ---------------------------------------------------------------------------

ENGINE: Final = "P0"
READMIT: Final = "+"  # the request id of a model's second load of request r is r + READMIT


@dataclass(frozen=True)
class DAction:
    label: str  # the TLA+ operator name of the generated action
    kind: str  # admit | schedule | abort | read_ok | read_failed | handshake_ok | ...
    request: str = ""
    flag: bool = False  # read_ok: notification attached; read_failed: fenced; claim: granted
    age: int = 0  # ack: the acknowledged heartbeat was sent this many units ago
    refused: tuple[str, ...] = ()  # ack: the requests P refuses to renew


@dataclass(frozen=True)
class DModel:
    """A small D model, the same for TLC and the Python BFS. Times in model units (one
    is ``UNIT_MS`` of the Consumer's milliseconds: its Config takes them as seconds)."""

    name: str
    requests: tuple[str, ...]
    group_of: Mapping[str, str | None]
    term_of: Mapping[str, int]  # TransferParams.initial_term per request
    max_delay: int = 0
    max_read_time: int = 1
    clock_drift: int = 0
    lease_extension: int = 2  # what P's acks grant; heartbeats older than this are forgotten
    peer_timeout: int = 2  # ack silence after which the peer is lost
    read_grace: int = 1  # a READ is overdue max_read_time + read_grace after its post
    acks: bool = True  # ack actions: of every outstanding heartbeat, with each refused set
    refusals: tuple[tuple[str, ...], ...] | None = None  # None: every subset of requests
    caps: tuple[str, ...] = ()  # requests whose params carry a capability (they claim)
    doc: str = ""

    def config(self) -> Config:
        longest = max(self.term_of.values()) + 10
        return Config(initial_lease=float(longest), lease_extension=float(self.lease_extension),
                      abort_grace=float(longest), heartbeat_interval=1.0,
                      max_delay=float(self.max_delay), max_read_time=float(self.max_read_time),
                      clock_drift=float(self.clock_drift),
                      peer_timeout=float(self.peer_timeout),
                      read_grace=float(self.read_grace)).validate()

    def params(self, r: str) -> TransferParams:
        return TransferParams(ENGINE, 1, self.handle(r), (self.handle(r),),
                              self.term_of[r] * UNIT_MS, 1, self.group_of[r],
                              capability="ab" * 16 if r in self.caps else "")

    def handle(self, r: str) -> int:
        return self.requests.index(r) + 1

    def ack_refusals(self) -> list[tuple[str, ...]]:
        """The refused sets the model's acks carry: every subset of the requests."""
        if self.refusals is not None:
            return list(self.refusals)
        rs = self.requests
        return [tuple(r for k, r in enumerate(rs) if mask >> k & 1) for mask in range(1 << len(rs))]

    def actions(self) -> list[DAction]:
        acts: list[DAction] = []
        for r in self.requests:
            acts += [DAction(f"Admit_{r}", "admit", r), DAction(f"Schedule_{r}", "schedule", r),
                     DAction(f"DAbort_{r}", "abort", r), DAction(f"Readmit_{r}", "readmit", r),
                     DAction(f"Never_{r}", "never", r)]
            if r in self.caps:
                acts += [DAction(f"{'ClaimGranted' if b else 'ClaimRefused'}_{r}", "claim", r, b)
                         for b in (True, False)]
            for b in (True, False):
                acts.append(DAction(f"ReadOk_{r}_{str(b).upper()}", "read_ok", r, b))
                acts.append(DAction(f"ReadFailed_{r}_{str(b).upper()}", "read_failed", r, b))
                acts.append(DAction(f"ReadEnd_{r}_{str(b).upper()}", "read_end", r, b))
        if self.acks:
            # an ack of the heartbeat sent `age` units ago, refusing `refused`
            for age in range(self.lease_extension + 1):
                for ref in self.ack_refusals():
                    acts.append(DAction(f"DAck_a{age}_{'_'.join(ref) or 'none'}", "ack",
                                        age=age, refused=ref))
            acts.append(DAction("DAckUnknown_", "ack_unknown"))
        acts += [DAction("HandshakeOk_", "handshake_ok"),
                 DAction("HandshakeFailed_", "handshake_failed"),
                 DAction("PeerLost_", "peer_lost"), DAction("DTick_", "tick")]
        return acts

    def module_name(self) -> str:
        return f"MC_dconf_{self.name}"

    def tla_module(self) -> str:
        def tfun(m: Mapping[str, Any], conv: Any) -> str:
            return "[r \\in Requests |-> CASE " + " [] ".join(
                f'r = "{r}" -> {conv(m[r])}' for r in self.requests) + "]"

        lines = [f"---- MODULE {self.module_name()} ----",
                 f"(* GENERATED by kvproto.verify.dconformance from DModel {self.name!r}. *)",
                 "EXTENDS KVConsumer",
                 f"CGroupOf == {tfun(self.group_of, lambda g: render(g or 'none'))}",
                 f"CTermOf == {tfun(self.term_of, str)}",
                 "CExpOf == [r \\in Requests |-> 1]",
                 f"CCapOf == {tfun({r: r in self.caps for r in self.requests}, lambda b: str(b).upper())}"]
        for a in self.actions():
            if a.kind in ("admit", "schedule", "abort", "readmit", "never"):
                op = {"admit": "Admit", "schedule": "Schedule", "abort": "DAbort",
                      "readmit": "Readmit", "never": "Never"}[a.kind]
                lines.append(f'{a.label} == {op}("{a.request}") /\\ TRUE')
            elif a.kind == "claim":
                op = "ClaimGranted" if a.flag else "ClaimRefused"
                lines.append(f'{a.label} == {op}("{a.request}") /\\ TRUE')
            elif a.kind in ("read_ok", "read_failed", "read_end"):
                op = {"read_ok": "ReadOk", "read_failed": "ReadFailed",
                      "read_end": "ReadEnd"}[a.kind]
                lines.append(f'{a.label} == {op}("{a.request}", {str(a.flag).upper()}) /\\ TRUE')
            elif a.kind == "ack":
                ref = "{" + ", ".join(render(r) for r in a.refused) + "}"
                lines.append(f"{a.label} == \\E h \\in hbs : h.age = {a.age} /\\ DAck(h, {ref})")
            else:
                op = {"handshake_ok": "HandshakeOk", "handshake_failed": "HandshakeFailed",
                      "peer_lost": "PeerLost", "tick": "DTick", "ack_unknown": "DAckUnknown"}[a.kind]
                lines.append(f"{a.label} == {op} /\\ TRUE")
        lines.append("ConfNext ==")
        lines += [f"    \\/ {a.label}" for a in self.actions()]
        lines.append("====")
        return "\n".join(lines) + "\n"

    def tla_cfg(self, bug: str = "none") -> str:
        return "\n".join([
            "CONSTANTS",
            f"    Requests = {{{', '.join(render(r) for r in self.requests)}}}",
            '    NoGroup = "none"',
            "    GroupOf <- CGroupOf",
            "    TermOf <- CTermOf",
            "    ExpOf <- CExpOf",
            "    CapOf <- CCapOf",
            "    HeartbeatInterval = 1",
            f"    LeaseExtension = {self.lease_extension}",
            f"    PeerTimeout = {self.peer_timeout}",
            f"    MaxDelay = {self.max_delay}",
            f"    MaxReadTime = {self.max_read_time}",
            f"    ClockDrift = {self.clock_drift}",
            f"    ReadGrace = {self.read_grace}",
            f'    DBug = "{bug}"',
            "INIT Init",
            "NEXT ConfNext",
            "INVARIANT TypeOK OneReadPerGroup NoReleaseUnderRead HbOnlyWhenReady",
            "INVARIANT NoQuarantinedReuse NoSecondPull ReadOnlyGranted",
            "",
        ])


D_MODELS: Final[dict[str, DModel]] = {m.name: m for m in (
    DModel("group2", ("r1", "r2"), {"r1": "g", "r2": "g"}, {"r1": 3, "r2": 3},
           refusals=((), ("r1",)),
           doc="two siblings of one group: one is read, the other served locally; "
               "heartbeats, acks that grant or refuse r1, ack silence"),
    DModel("group2_noack", ("r1", "r2"), {"r1": "g", "r2": "g"}, {"r1": 3, "r2": 3},
           acks=False, doc="group2 without acks (heartbeats and ack silence only): small"),
    DModel("solo", ("r1",), {"r1": None}, {"r1": 3}, caps=("r1",),
           doc="one request whose params carry a capability: its claim granted or "
               "refused, never registered, heartbeats, every ack, ack silence: small"),
    DModel("mixed3", ("r1", "r2", "r3"), {"r1": "g", "r2": "g", "r3": None},
           {"r1": 3, "r2": 2, "r3": 1}, max_read_time=1,
           doc="a group of two and a request whose term is too short to read"),
)}


@dataclass
class _DNode:
    c: Consumer
    now: int
    gone: dict[str, tuple[str, ...]]  # rid -> (state,) once it left the machine
    pulls: dict[str, int] = field(default_factory=dict)  # rid -> READs posted
    granted: set[str] = field(default_factory=set)  # ghost: claims P granted


def _effects(out: Sequence[DEffect]) -> frozenset[Value]:
    recs: list[Value] = []
    for e in out:
        if isinstance(e, StartHandshake):
            recs.append(mk_fn({"k": "handshake", "r": "", "why": ""}))
        elif isinstance(e, PostRead):
            recs.append(mk_fn({"k": "read", "r": e.request_id, "why": ""}))
        elif isinstance(e, SendClaim):
            recs.append(mk_fn({"k": "claim", "r": e.request_id, "why": ""}))
        elif isinstance(e, Quarantined):
            recs.append(mk_fn({"k": "quarantine", "r": e.request_id, "why": ""}))
        elif isinstance(e, Unquarantined):
            recs.append(mk_fn({"k": "unquarantine", "r": e.request_id, "why": ""}))
        elif isinstance(e, SendDone):
            recs.append(mk_fn({"k": "done", "r": e.request_id, "why": ""}))
        elif isinstance(e, SendRelease):
            recs.append(mk_fn({"k": "release", "r": e.request_id, "why": ""}))
        elif isinstance(e, Finished):  # a second load's id is its first one's + READMIT
            recs.append(mk_fn({"k": "finish", "r": e.request_id.removesuffix(READMIT),
                               "why": e.reason}))
        elif isinstance(e, DropPeer):
            recs.append(mk_fn({"k": "drop_peer", "r": "", "why": ""}))
        elif isinstance(e, SendHeartbeat):
            recs.append(mk_fn({"k": "heartbeat", "r": "", "why": ""}))
    return frozenset(recs)


def _abstract(m: DModel, n: _DNode, eff: frozenset[Value]) -> Fn:
    """The abstraction function of KVConsumer.tla's header."""
    c = n.c
    now = n.now * UNIT_MS
    dst: dict[str, Value] = {}
    lease: dict[str, Value] = {}
    pend: dict[str, Value] = {}
    rdl: dict[str, Value] = {}
    pulls: dict[str, Value] = {}
    quar: set[str] = set()
    inflight: set[str] = set()
    for r in m.requests:
        st = n.gone[r][0] if r in n.gone else c.state(r)
        dst[r] = st
        le = c.lease_end(r)
        lease[r] = (le - now) // UNIT_MS \
            if le is not None and st in ("waiting", "handshaking", "claiming") else 0
        pend[r] = c.abort_pending(r)
        rd = c.read_deadline(r)
        rdl[r] = (rd - now) // UNIT_MS if rd is not None else 0
        pulls[r] = n.pulls.get(r, 0)
        if c.quarantined(r):
            quar.add(r)
        if st == "reading" or c.quarantined(r):
            inflight.add(r)
    groups = sorted({g for g in m.group_of.values() if g is not None})
    owner = {g: c.group_owner(ENGINE, g) or "none" for g in groups}
    peer = c.peer(ENGINE)
    ready = peer is not None and peer.state == "ready"
    hbs = frozenset(
        mk_fn({"seq": 0, "rs": frozenset(m.requests[h - 1] for h in sent.handles),
               "age": (now - sent.sent_at) // UNIT_MS})
        for sent in (peer.outstanding.values() if peer is not None else ()))
    heard = min((now - peer.last_heard) // UNIT_MS, m.peer_timeout + 1) \
        if peer is not None and ready else 0
    hb_wait = max(0, c.next_heartbeat_at - now) // UNIT_MS
    state = mk_fn({"dst": mk_fn(dst), "dlease": mk_fn(lease), "abortPending": mk_fn(pend),
                   "owner": mk_fn(owner), "peer": c.peer_state(ENGINE), "hbs": hbs,
                   "hbWait": int(hb_wait), "heard": int(heard), "eff": eff,
                   "rdl": mk_fn(rdl), "quar": frozenset(quar), "inflight": frozenset(inflight),
                   "pulls": mk_fn(pulls),
                   "mayRead": frozenset(r for r in m.requests
                                        if r not in m.caps or r in n.granted)})
    assert isinstance(state, Fn)
    return state


def _enabled(m: DModel, s: Fn, a: DAction) -> bool:
    """The TLA+ action's enabling condition, read off the abstract state."""
    dst = s["dst"]
    peer = s["peer"]
    assert isinstance(dst, Fn)
    if a.kind == "admit":
        return dst[a.request] == "new"
    if a.kind == "schedule":
        return dst[a.request] == "waiting"
    if a.kind == "abort":
        pend = s["abortPending"]
        assert isinstance(pend, Fn)
        return dst[a.request] in ("handshaking", "claiming", "waiting", "reading") \
            and not pend[a.request]
    if a.kind in ("read_ok", "read_failed"):
        return dst[a.request] == "reading"
    if a.kind == "read_end":
        quar = s["quar"]
        assert isinstance(quar, frozenset)
        return a.request in quar
    if a.kind == "readmit":
        return dst[a.request] in ("done", "failed")
    if a.kind == "claim":
        return dst[a.request] == "claiming"
    if a.kind == "never":
        return dst[a.request] in ("handshaking", "claiming", "waiting", "reading")
    if a.kind in ("handshake_ok", "handshake_failed"):
        return peer == "handshaking"
    if a.kind == "peer_lost":
        return peer != "unknown"
    if a.kind == "ack":
        hbs = s["hbs"]
        assert isinstance(hbs, frozenset)
        return any(isinstance(h, Fn) and h["age"] == a.age for h in hbs)
    return True  # tick, ack_unknown


def _apply(m: DModel, n: _DNode, a: DAction) -> list[DEffect]:
    c, r = n.c, a.request
    if a.kind == "tick":
        n.now += 1
    now = n.now * UNIT_MS
    if a.kind == "admit":
        out = c.admit(r, m.params(r), now)
    elif a.kind == "schedule":
        out = c.schedule(r, now)
    elif a.kind == "abort":
        out = c.abort(r, now)
    elif a.kind == "read_ok":
        out = c.read_result(r, True, now, notif_attached=a.flag)
    elif a.kind == "read_failed":
        out = c.read_result(r, a.flag, now, fenced=a.flag)
    elif a.kind == "read_end":
        out = c.read_result(r, a.flag, now)
    elif a.kind == "readmit":
        out = c.admit(r + READMIT, m.params(r), now)
    elif a.kind == "claim":
        if a.flag and c.state(r) == "claiming":
            n.granted.add(r)
        out = c.claim_result(r, a.flag, now)
    elif a.kind == "never":
        out = c.never(r, now)
    elif a.kind == "handshake_ok":
        out = c.handshake_result(ENGINE, True, now)
    elif a.kind == "handshake_failed":
        out = c.handshake_result(ENGINE, False, now)
    elif a.kind == "peer_lost":
        out = c.peer_lost(ENGINE, now)
    elif a.kind == "ack":
        peer = c.peer(ENGINE)
        assert peer is not None
        seq = next(k for k, sent in peer.outstanding.items()
                   if now - sent.sent_at == a.age * UNIT_MS)
        out = c.ack(ENGINE, seq, m.lease_extension * UNIT_MS,
                    tuple(m.handle(r) for r in a.refused), now)
    elif a.kind == "ack_unknown":
        out = c.ack(ENGINE, 0xFFFFFFFF, m.lease_extension * UNIT_MS, (), now)
    else:
        out = c.tick(now)
    for e in out:
        if isinstance(e, Finished) and not e.request_id.endswith(READMIT):
            n.gone[e.request_id] = (e.state,)
        elif isinstance(e, PostRead):
            n.pulls[e.request_id] = n.pulls.get(e.request_id, 0) + 1
    return out


def explore_python_d(m: DModel, cls: type[Consumer] = Consumer, *,
                     max_states: int = 200_000) -> nx.MultiDiGraph:
    """BFS of the Python Consumer's graph over the model's inputs, by abstract state."""
    with paused_gc():
        return _explore_python_d(m, cls, max_states)


def _explore_python_d(m: DModel, cls: type[Consumer], max_states: int) -> nx.MultiDiGraph:
    root = _DNode(cls("d0", m.config()), 0, {})
    s0 = _abstract(m, root, frozenset())
    g = nx.MultiDiGraph()
    g.add_node(s0, init=True)
    rep = {s0: root}
    canon: dict[Fn, Fn] = {s0: s0}
    queue: deque[Fn] = deque([s0])
    acts = m.actions()
    while queue:
        s = queue.popleft()
        base = rep.pop(s)
        for a in acts:
            if not _enabled(m, s, a):
                continue
            n = _DNode(base.c.clone(), base.now, dict(base.gone), dict(base.pulls),
                       set(base.granted))
            t = _abstract(m, n, _effects(_apply(m, n, a)))
            t = canon.get(t, t)  # one deep comparison; later lookups hit on identity
            if t not in g:
                if g.number_of_nodes() >= max_states:
                    raise RuntimeError(f"more than {max_states} Python states")
                g.add_node(t, init=False)
                canon[t] = t
                rep[t] = n
                queue.append(t)
            g.add_edge(s, t, key=a.label, action=a.label)
    return g


def explore_tlc_d(m: DModel, workdir: Path | None = None) -> nx.MultiDiGraph:
    """TLC's dump of KVConsumer.tla's graph for the model."""
    wd = Path(tempfile.mkdtemp(prefix=f"dconf-{m.name}-")) if workdir is None else workdir
    try:
        wd.mkdir(parents=True, exist_ok=True)
        shutil.copy(spec_dir() / "KVConsumer.tla", wd / "KVConsumer.tla")
        mod = wd / f"{m.module_name()}.tla"
        mod.write_text(m.tla_module(), encoding="utf-8")
        (wd / f"{m.module_name()}.cfg").write_text(m.tla_cfg(), encoding="utf-8")
        dot = wd / f"{m.name}.dot"
        require_ok(run_tlc(mod.with_suffix(".cfg"), module=mod.stem, workdir=wd, name=m.name,
                           args=["-nowarning", "-dump", "dot,actionlabels", str(dot)]))
        return read_dot(dot)
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)


# KVConsumer's DBug mutants and the invariant TLC must find broken for each.
D_BUGS: Final[dict[str, str]] = {"early_release": "NoQuarantinedReuse",
                                 "second_pull": "NoSecondPull",
                                 "read_before_grant": "ReadOnlyGranted"}


def check_d_bug(m: DModel, bug: str) -> TlcResult:
    """TLC on the model with KVConsumer's mutant ``bug`` (``D_BUGS``; "none": the spec)."""
    return run_tlc(f"{m.module_name()}.cfg", module=m.module_name(),
                   cfg_text=m.tla_cfg(bug), extra_modules={m.module_name(): m.tla_module()},
                   name=f"{m.name}-{bug}")


@dataclass
class DComparison:
    py_states: int
    tlc_states: int
    only_py: list[tuple[Fn, str, Fn]]
    only_tlc: list[tuple[Fn, str, Fn]]

    @property
    def equal(self) -> bool:
        return not self.only_py and not self.only_tlc

    def report(self, show: int = 3) -> str:
        lines = [f"python {self.py_states} states, TLC {self.tlc_states} states: "
                 + ("EQUAL" if self.equal else "GRAPHS DIFFER")]
        for what, edges in (("only in Python", self.only_py), ("only in TLC", self.only_tlc)):
            for a, k, b in edges[:show]:
                lines.append(f"  {what}: {k}\n    from {render(a)}\n    to   {render(b)}")
        return "\n".join(lines)


def compare_d(py: nx.MultiDiGraph, tlc: nx.MultiDiGraph) -> DComparison:
    """Labelled edges only one side has (TLC's states mapped onto the Python graph's)."""
    with paused_gc():
        tmap = shared_states(py.nodes, tlc.nodes)
        pe = {(a, k, b) for a, b, k in py.edges(keys=True)}
        te = {(tmap[a], k, tmap[b]) for a, b, k in tlc.edges(keys=True)}
    key = lambda e: (e[1], repr(e[0]), repr(e[2]))  # noqa: E731 - a sort key
    return DComparison(py.number_of_nodes(), tlc.number_of_nodes(),
                       sorted(pe - te, key=key), sorted(te - pe, key=key))
