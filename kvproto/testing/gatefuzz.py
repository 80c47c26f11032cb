"""A small world for P's gate (``kvproto.lifecycle.gate``) and its mutants.

One P (``Gate`` over a ``Ledger``) prefills requests in chunks and hands each request's
transfer params (with its capability) to several consumers: the router's first choice
and its retries, migrations or hedges, all holding the same params. A consumer claims
(presents the capability), reads when the gate let it, and reports done; P may abort a
prefill after the params left (``abandon``). After every step the oracle checks:

* ``NoFreeUnderRead`` per claimant: every consumer whose READ is in flight reads blocks
  the ledger still holds (or that the engine still pins before register);
* ``ReadinessHolds``: the ledger holds only requests whose every chunk was written;
* ``NoGrantBeforeRegister``: no consumer is granted a handle the ledger has not
  registered (a claim that binds it earlier is answered at the register);
* ``NeverToldAtOnce``: in the step that abandoned a request, the consumer bound to it
  was told (a ``NeverNotice``), or, when none was bound, every holder of its params (a
  notice to every peer); a consumer presenting later is told then, and refused;
* ``OnlyHoldersBind``: a forger (a consumer that never got the params: its capability
  is wrong) binds no handle and is never served.

Besides claims, reads and dones, a consumer may claim while the gate's records are full
of other handles' bindings (``claim_full``: fillers bound, the claim, fillers forgotten),
release (after it gave up) and heartbeat; all go through the gate's refusal rows.

``GATE_MUTANTS`` re-introduce the bugs the gate prevents; ``run_ops`` returns the
first violation, and ``tests/test_gate.py`` shows hypothesis finding each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvproto.lifecycle import HELD_STATES, UNREGISTERED, Ack, BlockPool, Config, Free, Ledger
from kvproto.lifecycle.gate import (
    ABANDON,
    G_BOUND,
    G_OPEN,
    G_REGISTER,
    PRESENT,
    ClaimAnswer,
    Gate,
    GateEffect,
    GateRow,
    NeverNotice,
)

CHUNKS = 2  # forward passes that fill one request's blocks
KEY = b"k" * 32
CFG = Config(initial_lease=10.0, lease_extension=10.0, heartbeat_interval=1.0,
             abort_grace=10.0, max_delay=0.5, max_read_time=1.0, clock_drift=0.1)

# Operations: (name, request index, consumer index).
Op = tuple[str, int, int]
# Leases are the main model's business (tla/KVLifecycle.tla): here time stands still, so
# the ledger frees only on a done.
OP_NAMES = ("write", "register", "claim", "read", "done", "abandon", "claim_full", "release",
            "heartbeat")
MAX_RECORDS = 8  # the world's gate cap; its own handles never fill it (fillers do)
FILLER = 1 << 20  # handles of other requests that fill the gate's records


@dataclass
class _Req:
    handle: int
    written: int = 0
    aborted: bool = False


class World:
    def __init__(self, gate_cls: type[Gate], requests: int, consumers: int,
                 forgers: int = 0) -> None:
        """``consumers`` in all, the last ``forgers`` of them without the params."""
        self.ledger = Ledger(CFG, BlockPool(4 * requests))
        self.gate = gate_cls(self.ledger, KEY, "P0", 7, max_records=MAX_RECORDS)
        self.reqs = [_Req(handle=i + 1) for i in range(requests)]
        self.consumers = [f"c{i}" for i in range(consumers)]
        self.forgers = set(range(consumers - forgers, consumers))
        self.seq = 0
        # (request, consumer) -> "waiting" | "claimed" (its claim awaits the gate's
        # answer) | "granted" | "reading" | "done" | "failed"
        self.cstate = {(r, c): "waiting" for r in range(requests) for c in range(consumers)}
        self.told: set[tuple[int, int]] = set()
        self.now = 0

    def _blocks(self, r: int) -> tuple[int, ...]:
        return (4 * r, 4 * r + 1)

    def _effects(self, out: Sequence[GateEffect | object]) -> None:
        freed = [e.handle for e in out if isinstance(e, Free)]
        if freed:
            self.gate.forget(freed)
        for e in out:
            if isinstance(e, NeverNotice):
                r = e.handle - 1
                for c in range(len(self.consumers)):
                    if e.consumer is None or e.consumer == self.consumers[c]:
                        self.told.add((r, c))
                        if self.cstate[(r, c)] in ("waiting", "claimed", "granted"):
                            self.cstate[(r, c)] = "failed"
            elif isinstance(e, ClaimAnswer) and 0 < e.handle <= len(self.reqs):
                key = (e.handle - 1, self.consumers.index(e.peer))
                if self.cstate[key] == "claimed":  # D's claim_granted / claim_refused rows
                    self.cstate[key] = "granted" if e.granted else "failed"

    def step(self, op: Op) -> str | None:
        name, ri, ci = op
        r = ri % len(self.reqs)
        c = ci % len(self.consumers)
        q = self.reqs[r]
        h = q.handle
        cname = self.consumers[c]
        out: list[GateEffect] = []
        if name == "write":
            if not q.aborted and q.written < CHUNKS:
                q.written += 1
        elif name == "register":
            # The adapter tries to register after any chunk; the mark says whether the
            # last chunk's writes completed.
            if not q.aborted and q.written > 0:
                out = self.gate.register(h, f"r{r}", self._blocks(r), self.now,
                                         ready=q.written == CHUNKS, expected=1)
        elif name in ("claim", "claim_full"):
            if self.cstate[(r, c)] == "waiting":
                # A forger presents a capability of its own making (or stale params).
                cap = "0" * 32 if c in self.forgers else self.gate.capability(h)
                fill = [FILLER + k for k in range(MAX_RECORDS)] if name == "claim_full" else []
                for f in fill:  # other requests' bindings, up to the cap
                    if len(self.gate) < MAX_RECORDS:
                        self.gate.present("filler", f, self.gate.capability(f), [])
                self.cstate[(r, c)] = "claimed"
                out = self.gate.claim(cname, h, cap, self.now)  # answered now or at register
                self.gate.forget(fill)
        elif name == "release":
            # A consumer that gave up releases (D's give-up rows); one before register
            # is staged by the ledger (KVLifecycle's business: not drawn here).
            if self.cstate[(r, c)] in ("waiting", "claimed", "granted", "failed") and \
                    self.ledger.state(h) != UNREGISTERED:
                self.cstate[(r, c)] = "failed"
                out = list(self.gate.release(cname, [h], 1, self.now, consumer=cname))
        elif name == "heartbeat":
            if self.cstate[(r, c)] in ("waiting", "granted"):
                self.seq += 1
                acks = self.gate.heartbeat(cname, self.seq, [h], 1, self.now, consumer=cname)
                if any(isinstance(a, Ack) and h in a.refused for a in acks):
                    self.cstate[(r, c)] = "failed"  # D's ack/refused row: recompute
        elif name == "read":
            # D reads once the gate granted its claim (the gate answers a claim of a
            # handle not registered yet at its register); a READ of blocks freed since
            # is the main model's (stamps fence it): not drawn here
            if self.cstate[(r, c)] == "granted" and \
                    self.ledger.state(h) in HELD_STATES:
                self.cstate[(r, c)] = "reading"
        elif name == "done":
            if self.cstate[(r, c)] == "reading":
                self.cstate[(r, c)] = "done"
                if self.gate.present(cname, h, self.gate.capability(h), out):
                    out += self.ledger.done(cname, h, 1, self.now)
        elif name == "abandon":
            if self.ledger.state(h) == UNREGISTERED and not q.aborted:
                q.aborted = True
                claimed = self.gate.consumer(h) is not None
                out = self.gate.abandon(h)
                self._effects(out)
                # Told at once: the consumer that presented; when none did, every holder
                # of the params (a consumer presenting later is told then, refused).
                owed = ("claimed", "granted") if claimed else ("waiting", "claimed", "granted")
                for cc in range(len(self.consumers)):
                    if self.cstate[(r, cc)] in owed and (r, cc) not in self.told:
                        return f"NeverToldAtOnce: {self.consumers[cc]} waits on abandoned r{r}"
                return self.check()
        self._effects(out)
        return self.check()

    def check(self) -> str | None:
        for (r, c), s in self.cstate.items():
            if c in self.forgers and (s in ("granted", "reading", "done")
                                      or self.gate.consumer(self.reqs[r].handle)
                                      == self.consumers[c]):
                return f"OnlyHoldersBind: forger c{c} bound or served r{r} ({s})"
            st = self.ledger.state(self.reqs[r].handle)
            if s == "reading" and st not in HELD_STATES:
                return f"NoFreeUnderRead: c{c} reads r{r} in ledger state {st}"
            if s == "granted" and st == UNREGISTERED:
                return f"NoGrantBeforeRegister: c{c} granted r{r} before its register"
        for r, q in enumerate(self.reqs):
            if self.ledger.state(q.handle) != UNREGISTERED and q.written < CHUNKS:
                return f"ReadinessHolds: r{r} registered after {q.written}/{CHUNKS} chunks"
        return None


def run_ops(ops: Sequence[Op], gate_cls: type[Gate] = Gate, *, requests: int = 1,
            consumers: int = 2, forgers: int = 0) -> str | None:
    """Run ``ops``; the first violated property (with a word on the state), or None."""
    w = World(gate_cls, requests, consumers, forgers)
    for op in ops:
        bad = w.step(op)
        if bad is not None:
            return bad
    return None


@dataclass(frozen=True)
class GateMutant:
    name: str
    cls: type[Gate]
    caught_by: str
    about: str
    ops: tuple[str, ...] = OP_NAMES  # the operations the fuzzer draws for it
    forgers: int = 0  # consumers without the params in its fuzz world


def _row(src: str, event: str, guard: str) -> GateRow:
    return Gate.TABLE[(src, event, guard)]


def _mutant(name: str, row: GateRow, **changes: object) -> type[Gate]:
    fields = {"src": row.src, "event": row.event, "guard": row.guard, "dst": row.dst,
              "passes": row.passes, "doc": row.doc, "bind": row.bind, "notify": row.notify,
              "counter": row.counter}
    fields.update(changes)
    return Gate.with_rows(GateRow(**fields), name=name)  # type: ignore[arg-type]


class GrantBeforeRegisterGate(Gate):
    """Answers every claim at once, also for a handle the ledger has not registered yet
    (overrides the documented ``claim``): D reads blocks the ledger does not hold, before
    the readiness mark and the checksums its register brings."""

    def claim(self, consumer: str, handle: int, cap: str, now: int,
              peer: str = "") -> list[GateEffect]:
        out: list[GateEffect] = []
        granted = self.present(consumer, handle, cap, out)
        out.append(ClaimAnswer(peer or consumer, handle, granted))
        return out


GATE_MUTANTS: tuple[GateMutant, ...] = (
    GateMutant("skip_binding",
               _mutant("SkipBindingGate", _row(G_BOUND, PRESENT, "foreign"), passes=True,
                       counter=None),
               "NoFreeUnderRead",
               "a second consumer of a bound handle is let through: the first one's done "
               "frees the blocks under the second one's READ",
               # without aborts: an abort shows the same bug first as an untold consumer
               tuple(o for o in OP_NAMES if o != "abandon")),
    GateMutant("register_unready",
               _mutant("RegisterUnreadyGate", _row(G_OPEN, G_REGISTER, "unready"),
                       passes=True, counter=None),
               "ReadinessHolds",
               "a register after an earlier chunk of a chunked prefill reaches the ledger"),
    GateMutant("skip_capability",
               _mutant("SkipCapabilityGate", _row(G_OPEN, PRESENT, "bad_capability"),
                       dst=G_BOUND, passes=True, bind=True, counter=None),
               "OnlyHoldersBind",
               "a wrong capability binds like the right one: a consumer that never got "
               "the params binds the handle and is served", forgers=1),
    GateMutant("grant_before_register", GrantBeforeRegisterGate, "NoGrantBeforeRegister",
               "a claim of a handle not registered yet is granted at once: D reads blocks "
               "the ledger does not hold"),
    GateMutant("no_never_notice",
               _mutant("NoNeverNoticeGate", _row(G_OPEN, ABANDON, "unclaimed"),
                       notify=False),
               "NeverToldAtOnce",
               "an abandoned request's consumers are not told: they wait for a timeout"),
)


# ---------------------------------------------------------------------------
# The reachable states, for the state-set equality with tla/KVGate.tla.
# ---------------------------------------------------------------------------

AbstractState = tuple[object, ...]


def abstract(w: World) -> AbstractState:
    """The world as KVGate's variables (told as a set of (request, consumer) names;
    KVGate's ghost ``untold`` is empty in every state of a correct gate)."""
    held = {"registered": "held", "leased": "held", "notified": "held", "aborted": "held",
            "expired": "freed", "freed": "freed", UNREGISTERED: UNREGISTERED}
    per_r = tuple(
        (q.written, q.aborted, w.gate.state(q.handle), w.gate.consumer(q.handle) or "none",
         held[w.ledger.state(q.handle)]) for q in w.reqs)
    cst = tuple(sorted((f"r{r}", w.consumers[c], s) for (r, c), s in w.cstate.items()))
    told = frozenset((f"r{r}", w.consumers[c]) for r, c in w.told)
    return (per_r, cst, told)


def explore(gate_cls: type[Gate] = Gate, *, requests: int = 1,
            consumers: int = 3, forgers: int = 0) -> set[AbstractState]:
    """Every abstract state the world reaches (BFS over every operation)."""
    import copy

    start = World(gate_cls, requests, consumers, forgers)
    seen = {abstract(start)}
    todo = [start]
    ops = [(n, r, c) for n in OP_NAMES for r in range(requests) for c in range(consumers)]
    while todo:
        w = todo.pop()
        for op in ops:
            w2 = copy.deepcopy(w)
            if w2.step(op) is not None:
                raise AssertionError(f"violation while exploring: {op}")
            a = abstract(w2)
            if a not in seen:
                seen.add(a)
                todo.append(w2)
    return seen
