"""The one oracle: what the Python P machine may do at each step, and the checks around it.

:class:`Oracle` judges one P event at a time (:meth:`Oracle.check_step`, given a
:class:`Step`) and records what it finds as :class:`InvariantViolation` records. Its
expected behaviour comes from two sources:

* **the P transition table, always.** The oracle keeps a small, spec-level model of what
  P was told (which readers reported per request, early reports included, kept under the
  documented staging policy; the expected-reader count announced so far) and checks, for
  every event, that each request's state change is a row of ``P_TRANSITIONS`` for that
  event (with the matching ``free:`` effect) -- *LegalTransition* -- plus two
  liveness-style properties the real machine guarantees: *PromptFree* (a request all of
  whose expected readers have reported is freed by that very event) and *ExpiredFreed*
  (after a tick at ``now`` no held request has a deadline ``<= now``).
* **TLC's state graph, optionally.** Built with :meth:`Oracle.from_graph` from a graph TLC
  dumped for a :class:`~kvproto.verify.models.GraphModel`
  (:func:`kvproto.verify.conformance.explore_tlc`), the oracle also answers "what may the
  spec do from this abstract state under this input?": a step that carries the model
  action's label and the abstract states around it must be an edge of that graph, and an
  input Python refuses must have no successor there -- *SpecStep*.

Who feeds it: :class:`ObservedLedger` (in front of any ledger class, the real one or a
mutant) hands every public event to the oracle; the stateful fuzzer and its simulator
(``kvproto.testing.fuzz``) and the mutant tests use it that way. :func:`run` drives a fresh
ledger through a sequence of graph-model inputs and checks both sources at each step
(the hypothesis conformance tests, ``tests/test_conformance.py``).

:func:`safety_violations` is the one place the pool and ledger safety checks
(*NoDoubleFree*, *Conservation*, *StagingBounded*, *TombstonesBounded*,
*LedgerInvariants*) are written; the simulator and the fuzzer both call it.

The table path needs only the standard library (``kvproto fuzz`` runs without
networkx); the graph path imports :mod:`kvproto.verify.abstraction` when it is used.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast

from kvproto.errors import KVProtoError
from kvproto.lifecycle import (
    ABORT,
    ABORTED,
    DONE,
    EXPIRED,
    FREED,
    HEARTBEAT,
    HELD_STATES,
    LEASED,
    NOTIFIED,
    P_TRANSITIONS,
    REGISTER,
    REGISTERED,
    RELEASE,
    SIBLING,
    TERMINAL_STATES,
    TICK,
    UNREGISTERED,
    Ack,
    BlockPool,
    Config,
    Effect,
    Free,
    Ledger,
    Rejected,
)

if TYPE_CHECKING:
    import networkx as nx

    from kvproto.verify.abstraction import LedgerFactory
    from kvproto.verify.models import Action, GraphModel
    from kvproto.verify.tlc import State

log = logging.getLogger(__name__)

REJECT: Final = "reject"  # Ledger.reject: malformed input, changes no state

INVARIANTS: Final = frozenset({
    "NoDoubleFree", "Conservation", "NoFreeUnderRead", "StagingBounded", "TombstonesBounded",
    "LegalTransition", "LedgerInvariants", "PromptFree", "ExpiredFreed", "NoLeak",
    "ServedIntact", "SpecStep"})
"""Every name an :class:`InvariantViolation` can carry (``SpecStep``: only with a TLC
graph; ``NoFreeUnderRead``, ``ServedIntact`` and ``NoLeak``: raised by the simulator and
the fuzzer)."""


class InvariantViolation(KVProtoError, AssertionError):
    """The one violation record: ``invariant`` is the check's name (one of
    :data:`INVARIANTS`), ``detail`` says what happened."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


# ---------------------------------------------------------------------------
# Legality of P transitions: which (src, dst, free reason) each event may produce.
# ---------------------------------------------------------------------------

Move = tuple[str, str | None]  # (destination, free reason or None)


def _row_steps(src: str, event: str) -> set[Move]:
    out: set[Move] = set()
    for t in P_TRANSITIONS:
        if t.src == src and t.event == event:
            out.add((t.dst, t.free))
    return out


def _register_paths() -> set[Move]:
    """Where one ``register`` event can take an unregistered handle: the register row,
    then any sequence of staged done/release/heartbeat rows applied in the same event."""
    out: set[Move] = set()
    seen: set[Move] = set()
    todo = list(_row_steps(UNREGISTERED, REGISTER))
    while todo:
        step = todo.pop()
        if step in seen:
            continue
        seen.add(step)
        out.add(step)
        dst, _ = step
        if dst in HELD_STATES:
            for ev in (DONE, RELEASE, HEARTBEAT):
                todo.extend(_row_steps(dst, ev))
    return out


_REGISTER_PATHS: Final = _register_paths()


def _allowed(event: str, src: str, dst: str, reason: str | None) -> bool:
    if event == REGISTER and src == UNREGISTERED:
        return (dst, reason) in _REGISTER_PATHS or (dst == UNREGISTERED and reason is None)
    return (dst, reason) in _row_steps(src, event)


def refused(effects: Sequence[Effect]) -> bool:
    """Python refuses an input (the spec has no successor) iff it answers Rejected."""
    return any(isinstance(e, Rejected) for e in effects)


# ---------------------------------------------------------------------------
# One step, as the oracle judges it.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One P event and what came of it.

    ``pre`` is :meth:`Oracle.pre` taken just before the event; ``handles`` are the
    handles the event names (register: the one handle; abort: the request's handle if
    P knows it). ``label``, ``before`` and ``after`` are the graph path's: the model
    action's TLA+ label and the abstract states around the step (KVLedger's abstraction
    function, :func:`kvproto.verify.abstraction.abstract`); without them, or without a
    graph, only the table is consulted."""

    event: str  # register | done | release | heartbeat | abort | tick | reject
    pre: Mapping[int, str]
    effects: Sequence[Effect]
    now: int
    handles: Sequence[int] = ()
    reader: str = ""
    expected: int = 0
    request: str = ""
    group: str | None = None
    label: str | None = None
    before: State | None = None
    after: State | None = None


@dataclass
class _StagedModel:
    since: int
    msgs: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, reader, expected)


class _SpecGraph:
    """TLC's graph of one GraphModel, indexed by (state, action label)."""

    def __init__(self, model: GraphModel, graph: nx.MultiDiGraph) -> None:
        self.model = model
        self.graph = graph
        self.succ: dict[tuple[State, str], set[State]] = {}
        for a, b, k in graph.edges(keys=True):
            self.succ.setdefault((a, k), set()).add(b)


class Oracle:
    """Judges P's steps against the transition table and, optionally, TLC's graph;
    records violations in ``violations`` (it never raises inside the ledger).

    The table model is deliberately small and spec-level: which readers P has been told
    about per request (including early reports, kept under the documented staging
    policy: the oldest handle is dropped at ``max_staged``, at most the ledger's
    ``max_staged_msgs`` messages per handle, entries older than ``max_staged_age``
    dropped on tick), and the expected-reader count announced so far. It follows one
    ledger: use :meth:`fresh` for the next one.

    ``prompt_free`` turns the PromptFree check on (the default). It is a property of the
    protocol's own inputs, where every message of a reader carries the same expected
    count (``TransferParams.expected``); under arbitrary inputs (the graph path) it does
    not hold, and the spec agrees: a reader's *duplicate* ``done`` that is the first to
    announce the expected count is counted as a duplicate (``duplicate_reader``), so a
    request whose readers have all reported stays held until its deadline (KVLedger's
    ``Finish``, the same in Python). :meth:`from_graph` turns it off."""

    def __init__(self, config: Config, *, spec: _SpecGraph | None = None,
                 prompt_free: bool = True) -> None:
        self.config = config
        self.spec = spec
        self.prompt_free = prompt_free
        self.violations: list[InvariantViolation] = []
        self.terminal: dict[int, str] = {}  # handles known terminal (survives tombstone eviction)
        self.reported: dict[int, set[str]] = {}  # live handle -> readers that reported
        self.expected: dict[int, int] = {}  # live handle -> expected readers announced
        self.staged: OrderedDict[int, _StagedModel] = OrderedDict()
        self.registered: dict[int, str] = {}  # handle -> request id (every valid register)
        self.groups: dict[int, str | None] = {}
        self.raw: dict[int, str] = {}  # the ledger's state of the named handles, pre-event
        self.events = 0
        self.transitions: dict[tuple[str, str, str], int] = {}  # (src, event, dst) coverage
        self._max_msgs = 0

    @classmethod
    def from_graph(cls, model: GraphModel, graph: nx.MultiDiGraph) -> Oracle:
        """An oracle that also checks every labelled step against TLC's ``graph`` of
        ``model`` (the graph is indexed once; :meth:`fresh` shares the index)."""
        return cls(model.config(), spec=_SpecGraph(model, graph), prompt_free=False)

    def fresh(self) -> Oracle:
        """A new oracle with the same configuration and graph, for a new ledger."""
        return Oracle(self.config, spec=self.spec, prompt_free=self.prompt_free)

    @property
    def graph(self) -> nx.MultiDiGraph | None:
        return None if self.spec is None else self.spec.graph

    def successors(self, state: State, label: str) -> set[State]:
        """The spec's successors of ``state`` under the action ``label`` (graph path)."""
        if self.spec is None:
            raise ValueError("this oracle has no TLC graph (use Oracle.from_graph)")
        return self.spec.succ.get((state, label), set())

    def fail(self, invariant: str, detail: str) -> None:
        log.debug("oracle: %s: %s", invariant, detail)
        self.violations.append(InvariantViolation(invariant, detail))

    # -- states ---------------------------------------------------------------------
    def state(self, ledger: Ledger, h: int) -> str:
        s = ledger.state(h)
        if s == UNREGISTERED and h in self.terminal:
            return self.terminal[h]  # its tombstone was evicted at the cap
        return s

    def pre(self, ledger: Ledger, touched: Iterable[int]) -> dict[int, str]:
        """States before an event: every live handle and the ones the event names. The
        ledger's own view of the named ones (evicted tombstones look unregistered to it)
        is kept in ``self.raw``."""
        states = {h: v[0] for h, v in ledger.snapshot().items()}
        self.raw = {}
        for h in touched:
            self.raw[h] = ledger.state(h)
            if h not in states:
                states[h] = self.state(ledger, h)
        return states

    # -- the one check-step API -----------------------------------------------------------
    def check_step(self, ledger: Ledger, step: Step) -> list[InvariantViolation]:
        """Judge one P event of ``ledger`` (already applied): the table checks always,
        the graph check when this oracle has a graph and ``step`` has a label. Returns
        the violations this step found (they are also appended to ``violations``)."""
        n0 = len(self.violations)
        self._max_msgs = ledger.max_staged_msgs
        ev, pre = step.event, dict(step.pre)
        if ev == REGISTER:
            self._on_register(ledger, pre, step)
        elif ev in (DONE, RELEASE, HEARTBEAT):
            self._on_message(ledger, pre, step)
        elif ev == ABORT:
            self._post(ledger, ABORT, pre, step.handles, step.effects)
        elif ev == TICK:
            self._on_tick(ledger, pre, step.now, step.effects)
        elif ev == REJECT:
            self._post(ledger, REJECT, pre, (), step.effects)
        else:
            raise ValueError(f"unknown P event {ev!r}")
        if self.spec is not None and step.label is not None:
            self._check_spec(step)
        return self.violations[n0:]

    # -- the graph ----------------------------------------------------------------------
    def _check_spec(self, step: Step) -> None:
        from kvproto.verify.abstraction import describe

        before, after, label = step.before, step.after, cast(str, step.label)
        if before is None or after is None:
            raise ValueError("a labelled step needs the abstract states before and after")
        assert self.spec is not None
        if before not in self.spec.graph:
            self.fail("SpecStep", "source state is not reachable in the spec:\n"
                      + describe(before))
            return
        succ = self.successors(before, label)
        if refused(step.effects):
            if after != before:
                self.fail("SpecStep", f"{label}: refused (Rejected effect) but the state "
                          "changed")
            elif succ - {before}:
                self.fail("SpecStep", f"{label}: python refused, but the spec allows a step "
                          "to\n" + "\n".join(describe(s, before) for s in succ))
            return
        if after not in succ:
            why = "changed nothing" if after == before else "stepped"
            spec = ("the spec has no step" if not succ else "the spec steps to (changes):\n"
                    + "\n".join(describe(s, before) for s in succ))
            self.fail("SpecStep", f"{label}: python {why} (changes: "
                      f"{describe(after, before)}); {spec}")
        elif after == before and succ - {before}:
            self.fail("SpecStep", f"{label}: python refused silently, the spec has another "
                      "successor")

    # -- the table model ------------------------------------------------------------------
    def _stage(self, kind: str, reader: str, h: int, expected: int, now: int) -> None:
        st_ = self.staged.get(h)
        if st_ is None:
            if len(self.staged) >= self.config.max_staged:
                self.staged.popitem(last=False)
            st_ = self.staged[h] = _StagedModel(now)
        if len(st_.msgs) < self._max_msgs:
            st_.msgs.append((kind, reader, expected))

    def _report(self, h: int, reader: str, expected: int) -> None:
        self.reported.setdefault(h, set()).add(reader)
        if expected > self.expected.get(h, 0):
            self.expected[h] = expected

    def _model_event(self, kind: str, reader: str, handles: Sequence[int], expected: int,
                     pre: dict[int, str], now: int) -> None:
        for h in handles:
            s = pre[h]
            if self.raw.get(h) == UNREGISTERED:  # unknown to the ledger: staged
                self._stage(kind, reader, h, expected, now)
            elif s in HELD_STATES and kind != HEARTBEAT:
                self._report(h, reader, expected)
            elif kind == HEARTBEAT and s in (REGISTERED, LEASED, NOTIFIED) \
                    and expected > self.expected.get(h, 0):
                self.expected[h] = expected

    # -- the table checks -------------------------------------------------------------------
    def _post(self, ledger: Ledger, event: str, pre: dict[int, str], targets: Sequence[int],
              out: Sequence[Effect]) -> None:
        self.events += 1
        frees: dict[int, str] = {}
        for eff in out:
            if isinstance(eff, Free):
                if eff.handle in frees:
                    self.fail("NoDoubleFree", f"{event}: handle {eff.handle} freed twice in one event")
                frees[eff.handle] = eff.reason
        rejected = refused(out)
        post = {h: self.state(ledger, h) for h in pre}
        for h, why in frees.items():
            if post.get(h) == UNREGISTERED:  # freed, then its tombstone evicted at the cap
                post[h] = EXPIRED if why == "expired" else FREED
        for h in frees:
            if h not in pre:
                self.fail("LegalTransition", f"{event}: Free of handle {h} that was not held "
                          f"before the event (state {self.state(ledger, h)})")
        target_set = set(targets)
        cascade_src = {h for h in targets if frees.get(h) == "transferred"} \
            if event in (DONE, REGISTER) else set()
        cascade_groups = {self.groups.get(h) for h in cascade_src} - {None}
        for h, s in pre.items():
            t = post[h]
            reason = frees.get(h)
            if t in TERMINAL_STATES and s not in TERMINAL_STATES:
                self.terminal[h] = t
                if reason is None:
                    self.fail("LegalTransition", f"{event}: handle {h} went {s} -> {t} "
                              "without a Free effect")
            if s in TERMINAL_STATES and t != s:
                self.fail("LegalTransition", f"{event}: terminal handle {h} went {s} -> {t}")
                continue
            if h in target_set or event == TICK:
                if event == TICK and s == t and reason is None:
                    continue  # nothing due
                if event == REGISTER and s == t and rejected:
                    continue  # invalid or duplicate register: counted, changes nothing
                ok = _allowed(event, s, t, reason)
                self.transitions[(s, event, t)] = self.transitions.get((s, event, t), 0) + 1
                if not ok:
                    self.fail("LegalTransition", f"{event}: handle {h} {s} -> {t}"
                              f"{' with free:' + reason if reason else ''} is not a row of "
                              "P_TRANSITIONS")
            elif s != t or reason is not None:
                if self.groups.get(h) in cascade_groups \
                        and (t, reason) in _row_steps(s, SIBLING):
                    self.transitions[(s, SIBLING, t)] = \
                        self.transitions.get((s, SIBLING, t), 0) + 1
                    continue
                self.fail("LegalTransition", f"{event}: handle {h} not named by the event "
                          f"went {s} -> {t} (free {reason})")
        for h, s in post.items():
            if s in TERMINAL_STATES:
                self.reported.pop(h, None)
                self.expected.pop(h, None)

    def _check_prompt_free(self, ledger: Ledger, where: str) -> None:
        if not self.prompt_free:
            return
        for h, (_st, exp, _fin, _rel, _dl) in ledger.snapshot().items():
            want = max(exp, self.expected.get(h, 0))
            got = self.reported.get(h, set())
            if want and len(got) >= want:
                self.fail("PromptFree", f"after {where}: handle {h} is still held "
                          f"({_st}) although all {want} expected readers reported "
                          f"({sorted(got)})")

    def _check_expired_freed(self, ledger: Ledger, now: int) -> None:
        for h, (s, _exp, _fin, _rel, dl) in ledger.snapshot().items():
            if dl <= now:
                self.fail("ExpiredFreed", f"after tick at {now}: handle {h} ({s}) is still "
                          f"held with deadline {dl} <= now")

    # -- per event ------------------------------------------------------------------------
    def _on_register(self, ledger: Ledger, pre: dict[int, str], step: Step) -> None:
        (h,) = step.handles
        out = step.effects
        fresh = pre.get(h) == UNREGISTERED and not refused(out)
        if fresh:
            self.groups[h] = step.group  # before _post(): a staged done may cascade
        self._post(ledger, REGISTER, pre, [h], out)
        if not fresh:
            return
        self.registered[h] = step.request
        st_ = self.staged.pop(h, None)
        if self.state(ledger, h) in TERMINAL_STATES:
            return
        self.expected[h] = max(step.expected, self.expected.get(h, 0))
        if st_ is not None:
            for kind, reader, exp in st_.msgs:
                if kind != HEARTBEAT:
                    self._report(h, reader, exp)
        self._check_prompt_free(ledger, f"register of handle {h}")

    def _on_message(self, ledger: Ledger, pre: dict[int, str], step: Step) -> None:
        kind, reader, handles, out = step.event, step.reader, step.handles, step.effects
        self._model_event(kind, reader, handles, step.expected, pre, step.now)
        self._post(ledger, kind, pre, handles, out)
        if kind == HEARTBEAT:
            acks = [e for e in out if isinstance(e, Ack)]
            if len(acks) != 1:
                self.fail("LegalTransition", f"heartbeat produced {len(acks)} acks")
            else:
                refused_ = set(acks[0].refused)
                pending = set(acks[0].pending)
                for h in handles:
                    want = "pending" if self.raw.get(h) == UNREGISTERED else \
                        "refused" if pre[h] in (ABORTED, EXPIRED, FREED) else "granted"
                    got = "refused" if h in refused_ else "pending" if h in pending else \
                        "granted"
                    if want != got:
                        self.fail("LegalTransition", f"heartbeat: handle {h} in {pre[h]} was "
                                  f"{got}, not {want}")
        self._check_prompt_free(ledger, f"{kind} from {reader} for {list(handles)}")

    def _on_tick(self, ledger: Ledger, pre: dict[int, str], now: int,
                 out: Sequence[Effect]) -> None:
        self._post(ledger, TICK, pre, [], out)
        limit = now - self.config.ms.max_staged_age
        while self.staged:
            st_ = next(iter(self.staged.values()))
            if st_.since > limit:
                break
            self.staged.popitem(last=False)
        self._check_expired_freed(ledger, now)


# ---------------------------------------------------------------------------
# Safety of the pool and the ledger (the simulator's and the fuzzer's checks).
# ---------------------------------------------------------------------------


def safety_violations(pool: BlockPool, ledger: Ledger, *, recount: bool = True,
                      ledger_invariants: bool = True) -> list[InvariantViolation]:
    """NoDoubleFree and Conservation of ``pool`` (with ``recount``, the counters also
    against a full recount of the blocks), StagingBounded and TombstonesBounded of
    ``ledger``, and (with ``ledger_invariants``) the ledger's own consistency checks."""
    out: list[InvariantViolation] = []
    if pool.violations:
        out.append(InvariantViolation("NoDoubleFree", f"{pool.violations} double free(s)"))
    held = free = -1
    if recount:
        held, free = pool.recount()
    if pool.held_count + pool.free_count != pool.capacity \
            or (recount and held != pool.held_count):
        counted = f" (recount: held {held}, free {free})" if recount else ""
        out.append(InvariantViolation("Conservation", f"held {pool.held_count} + free "
                                      f"{pool.free_count} != {pool.capacity}{counted}"))
    cfg = ledger.config
    if ledger.staged_count > cfg.max_staged:
        out.append(InvariantViolation("StagingBounded",
                                      f"{ledger.staged_count} > {cfg.max_staged}"))
    if ledger.tombstone_count > cfg.max_tombstones:
        out.append(InvariantViolation("TombstonesBounded",
                                      f"{ledger.tombstone_count} > {cfg.max_tombstones}"))
    if ledger_invariants:
        out += ledger_violations(ledger)
    return out


def ledger_violations(ledger: Ledger) -> list[InvariantViolation]:
    """The ledger's own consistency checks (``Ledger.check_invariants``)."""
    errs = ledger.check_invariants()
    return [InvariantViolation("LedgerInvariants", "; ".join(errs))] if errs else []


# ---------------------------------------------------------------------------
# Feeding it: a ledger that hands every event to its oracle.
# ---------------------------------------------------------------------------


class ObservedLedger(Ledger):
    """Mixin over a ledger class: every public event goes through the oracle.

    Use ``observed_ledger_class(cls)`` to put it in front of a mutant's overrides.
    """

    oracle: Oracle | None = None

    def register(self, handle: int, request_id: str, blocks: Iterable[int], now: int, *,
                 group: str | None = None, expected: int = 0) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().register(handle, request_id, blocks, now, group=group,
                                    expected=expected)
        pre = o.pre(self, [handle] if isinstance(handle, int) else [])
        out = super().register(handle, request_id, blocks, now, group=group, expected=expected)
        o.check_step(self, Step(REGISTER, pre, out, self.now, (handle,), expected=expected,
                                request=request_id, group=group))
        return out

    def done(self, reader: str, handle: int, expected: int, now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().done(reader, handle, expected, now)
        pre = o.pre(self, [handle])
        out = super().done(reader, handle, expected, now)
        o.check_step(self, Step(DONE, pre, out, self.now, (handle,), reader, expected))
        return out

    def release(self, reader: str, handles: Sequence[int], expected: int,
                now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().release(reader, handles, expected, now)
        pre = o.pre(self, handles)
        out = super().release(reader, handles, expected, now)
        o.check_step(self, Step(RELEASE, pre, out, self.now, handles, reader, expected))
        return out

    def heartbeat(self, reader: str, seq: int, handles: Sequence[int], expected: int,
                  now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().heartbeat(reader, seq, handles, expected, now)
        pre = o.pre(self, handles)
        out = super().heartbeat(reader, seq, handles, expected, now)
        o.check_step(self, Step(HEARTBEAT, pre, out, self.now, handles, reader, expected))
        return out

    def abort(self, request_id: str, now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().abort(request_id, now)
        h = self.handle_of(request_id)
        targets = [] if h is None else [h]
        pre = o.pre(self, targets)
        out = super().abort(request_id, now)
        o.check_step(self, Step(ABORT, pre, out, self.now, targets, request=request_id))
        return out

    def tick(self, now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().tick(now)
        pre = o.pre(self, [])
        out = super().tick(now)
        o.check_step(self, Step(TICK, pre, out, self.now))
        return out

    def reject(self, reason: str, peer: str, detail: str, now: int) -> list[Effect]:
        o = self.oracle
        if o is None:
            return super().reject(reason, peer, detail, now)
        pre = o.pre(self, [])
        out = super().reject(reason, peer, detail, now)
        o.check_step(self, Step(REJECT, pre, out, self.now))
        return out


_OBSERVED: dict[type[Ledger], type[ObservedLedger]] = {}


def observed_ledger_class(base: type[Ledger]) -> type[ObservedLedger]:
    """``ObservedLedger`` in front of ``base`` (the real ledger or a mutant)."""
    if issubclass(base, ObservedLedger):
        return base
    cls = _OBSERVED.get(base)
    if cls is None:
        if base is Ledger:
            cls = ObservedLedger
        else:
            cls = cast(type[ObservedLedger],
                       type(f"Observed{base.__name__}", (ObservedLedger, base), {}))
        _OBSERVED[base] = cls
    return cls


# ---------------------------------------------------------------------------
# The graph path: one ledger through a sequence of model inputs.
# ---------------------------------------------------------------------------


def _event_of(model: GraphModel, ledger: Ledger, a: Action) -> tuple[str, list[int]]:
    """The P event a model input is, and the handles it names."""
    if a.kind == ABORT:
        h = ledger.handle_of(a.request)
        return ABORT, [] if h is None else [h]
    if a.kind == TICK:
        return TICK, []
    return a.kind, [model.handle(a.request)]


def run(model: GraphModel, oracle: Oracle, labels: Sequence[str],
        factory: LedgerFactory = Ledger, stats: dict[str, int] | None = None) -> str | None:
    """Drive one concrete ledger (no snapshots, no de-duplication) through ``labels`` and
    judge every step with a :meth:`~Oracle.fresh` copy of ``oracle`` (the table, and TLC's
    graph when ``oracle`` has one), then the ledger's own invariants; return the first
    violation, or None. ``stats`` counts steps that changed the abstract state, left it
    unchanged, or were refused (Rejected)."""
    from kvproto.verify.abstraction import abstract, apply_action, initial_node

    o = oracle.fresh()
    acts = {a.label: a for a in model.actions()}
    node = initial_node(model, factory)
    before = abstract(model, node)
    for i, label in enumerate(labels):
        a = acts[label]
        L = node.ledger
        event, handles = _event_of(model, L, a)
        pre = o.pre(L, handles)
        effects = apply_action(model, node, a)
        after = abstract(model, node)
        reg = event == REGISTER
        found = o.check_step(L, Step(
            event, pre, effects, L.now, handles, reader=a.reader,
            expected=model.reg_expected[a.request] if reg else a.expected,
            request=a.request, group=model.group_of[a.request] if reg else None,
            label=label, before=before, after=after))
        found += ledger_violations(L)
        if found:
            return f"step {i + 1} of {list(labels[:i + 1])}: {found[0]}"
        if stats is not None:
            kind = "rejected" if refused(effects) else "changed" if after != before else "unchanged"
            stats[kind] = stats.get(kind, 0) + 1
        before = after
    return None


__all__ = [
    "INVARIANTS",
    "InvariantViolation",
    "ObservedLedger",
    "Oracle",
    "Step",
    "ledger_violations",
    "observed_ledger_class",
    "refused",
    "run",
    "safety_violations",
]
