"""P's gate: readiness, one consumer per handle, and never-registered notices.

The gate stands in front of P's ``Ledger`` and decides three things the ledger alone
cannot know, each as a row of ``GATE_TRANSITIONS`` (mirrored by ``tla/KVGate.tla`` and
spec/PROTOCOL.md, "The gate"):

* **Readiness.** A block may be registered only once the writes that fill it completed.
  ``register`` carries that mark (``ready``: the request's last forward pass and save
  finished, never an earlier chunk of a chunked prefill); without it the register is
  refused and counted (``unready_register``), and the ledger never sees it.
* **One consumer per handle.** P mints a capability per request
  (:func:`capability`: a MAC, keyed BLAKE2b, over the engine, epoch and handle under a
  key the adapter draws with ``secrets``: unguessable, and checked in O(1) with no per-handle record
  before the first use). The capability travels to D inside the transfer params. The
  first consumer that presents it binds the handle; every later ``present`` from another
  consumer (a done, release, heartbeat or READ of a router retry, a migration, a hedged
  request) is refused and counted (``foreign_consumer``), and a wrong capability
  (``bad_capability``) binds nothing. The spec's ``NoFreeUnderRead`` then holds per
  claimant: only the bound consumer reads, and its done is the one that frees.
* **Never registered.** ``abandon`` (the request's prefill aborted or failed, or the
  ledger refused its register, after its params were handed out) moves the handle to
  ``never`` and emits ``NeverNotice``: the adapter tells the bound consumer (or, when no
  consumer presented yet, every D peer it knows) at once, and D fails the request in one
  round trip instead of at a lease timeout. A consumer that presents a never-registered
  handle later is told again (the row's ``notify`` effect) and refused.

Costs: every event O(1); the MAC runs only on a consumer's first presentation of a
handle (a bound consumer is recognised by name). Caps: ``max_records`` handles with a
binding or a never mark; at the cap a new binding is refused (fail closed: that consumer
recomputes; counted ``gate_full``) and the oldest never mark is evicted (counted
``never_evicted``). A binding leaves when the ledger frees its handle (``forget``).

No sockets, threads or clocks: time is an argument, integer milliseconds.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from types import MappingProxyType
from typing import Final

from kvproto.lifecycle.producer import Ack, Effect, Free, Ledger, Rejected
from kvproto.lifecycle.table import HELD_STATES, UNREGISTERED, TableError

# Gate states of one handle. "open" is also the state of every handle the gate keeps no
# record of (its capability is checked without one).
G_OPEN: Final = "open"  # no consumer bound yet
G_BOUND: Final = "bound"  # the first consumer that presented the capability owns it
G_NEVER: Final = "never"  # will never be registered: the consumer is told so
GATE_STATES: Final = (G_OPEN, G_BOUND, G_NEVER)

# Gate events (TLA+ actions in tla/KVGate.tla: Present, GateRegister, Abandon, Forget).
PRESENT: Final = "present"  # a consumer's message about the handle (claim, done, release,
#                             heartbeat, READ notification) presents its capability
G_REGISTER: Final = "register"
ABANDON: Final = "abandon"
FORGET: Final = "forget"  # the ledger freed the handle: its binding is dropped
GATE_EVENTS: Final = (PRESENT, G_REGISTER, ABANDON, FORGET)

CAPABILITY_BYTES: Final = 16  # hex digits sent: 2 * CAPABILITY_BYTES
MAX_GATE_RECORDS: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class GateRow:
    """One row of the gate's table: in ``src`` on ``event`` with guard outcome ``guard``
    go to ``dst``; ``passes``: the event goes on (to the ledger, or the message is
    accepted); ``bind``: the presenting consumer owns the handle; ``notify``: emit a
    ``NeverNotice``; ``counter``: counted (and, when the row does not pass, a
    ``Rejected`` effect with that reason)."""

    src: str
    event: str
    guard: str
    dst: str
    passes: bool
    doc: str
    bind: bool = False
    notify: bool = False
    counter: str | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.src, self.event, self.guard)

    @property
    def effect(self) -> str:
        parts = (["pass"] if self.passes else []) + (["bind"] if self.bind else []) + \
            (["notify"] if self.notify else []) + \
            ([f"count:{self.counter}"] if self.counter else [])
        return ", ".join(parts)


_R = GateRow
GATE_TRANSITIONS: Final[tuple[GateRow, ...]] = (
    # present: a consumer's message carries the handle's capability ----------------
    _R(G_OPEN, PRESENT, "first", G_BOUND, True, "the first consumer with the right capability owns the handle", bind=True),
    _R(G_OPEN, PRESENT, "bad_capability", G_OPEN, False, "wrong capability: binds nothing", counter="bad_capability"),
    _R(G_BOUND, PRESENT, "same", G_BOUND, True, "the bound consumer again"),
    _R(G_BOUND, PRESENT, "foreign", G_BOUND, False, "another consumer (retry, migration, hedge): refused", counter="foreign_consumer"),
    _R(G_OPEN, PRESENT, "full", G_OPEN, False, "no room for another binding: fail closed, D recomputes", counter="gate_full"),
    _R(G_NEVER, PRESENT, "never", G_NEVER, False, "never registered: told again, refused", notify=True, counter="never_registered"),
    # register: the ledger sees only registers whose writes completed ---------------
    _R(G_OPEN, G_REGISTER, "ready", G_OPEN, True, "the writes that fill the blocks completed"),
    _R(G_BOUND, G_REGISTER, "ready", G_BOUND, True, "the writes that fill the blocks completed"),
    _R(G_OPEN, G_REGISTER, "unready", G_OPEN, False, "a write may still be in flight: refused", counter="unready_register"),
    _R(G_BOUND, G_REGISTER, "unready", G_BOUND, False, "a write may still be in flight: refused", counter="unready_register"),
    _R(G_NEVER, G_REGISTER, "never", G_NEVER, False, "D was told it never will be", counter="register_after_never"),
    # abandon: params were handed out, the request will never be registered --------
    _R(G_OPEN, ABANDON, "unclaimed", G_NEVER, True, "tell every known D peer at once", notify=True),
    _R(G_BOUND, ABANDON, "claimed", G_NEVER, True, "tell the bound consumer at once", notify=True),
    _R(G_NEVER, ABANDON, "again", G_NEVER, False, "already told", counter="duplicate_abandon"),
    # forget: the ledger freed the handle ---------------------------------------------
    _R(G_BOUND, FORGET, "freed", G_OPEN, True, "binding dropped with the blocks (stale messages are the ledger's)"),
    _R(G_OPEN, FORGET, "freed", G_OPEN, True, "nothing bound"),
)

GateTable = MappingProxyType[tuple[str, str, str], GateRow]


def make_gate_table(rows: Iterable[GateRow]) -> GateTable:
    """The gate's table keyed by (src, event, guard); ``TableError`` on a duplicate or a
    row that binds outside ``present`` or passes while refusing."""
    table: dict[tuple[str, str, str], GateRow] = {}
    for row in rows:
        if row.key in table:
            raise TableError(f"duplicate gate row {row.key}")
        if row.bind and (row.event != PRESENT or row.dst != G_BOUND):
            raise TableError(f"gate row {row.key}: only a presentation binds")
        if row.src not in GATE_STATES or row.dst not in GATE_STATES:
            raise TableError(f"gate row {row.key}: unknown state")
        table[row.key] = row
    return MappingProxyType(table)


GATE_TABLE: Final[GateTable] = make_gate_table(GATE_TRANSITIONS)


def capability(key: bytes, engine: str, epoch: int, handle: int) -> str:
    """The capability of ``handle`` of P engine ``engine`` in incarnation ``epoch``: hex
    keyed BLAKE2b (BLAKE2's MAC mode, RFC 7693) under ``key`` (the adapter draws it with
    ``secrets.token_bytes``; a key over 64 bytes is first hashed to 64), with a
    ``CAPABILITY_BYTES`` digest. Unguessable without the key; bound to the engine, the
    epoch and the handle. A third of HMAC-SHA256's cost: it runs once per request."""
    if len(key) > hashlib.blake2b.MAX_KEY_SIZE:
        key = hashlib.blake2b(key).digest()
    msg = f"{engine}\x00{epoch}\x00{handle}".encode()
    return hashlib.blake2b(msg, key=key, digest_size=CAPABILITY_BYTES).hexdigest()


@dataclass(frozen=True, slots=True)
class NeverNotice:
    """Effect: tell D at once that ``handle`` will never be registered. ``consumer``: the
    bound consumer, or None (no consumer presented yet: tell every known D peer)."""

    handle: int
    consumer: str | None


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """Effect: answer ``peer``'s claim of ``handle``: ``granted`` (the handle is bound to
    its consumer: it may read) or refused (it recomputes). D reads only after a grant."""

    peer: str
    handle: int
    granted: bool


GateEffect = Effect | NeverNotice | ClaimAnswer


def _pass_only(row: GateRow | None) -> bool:
    """Whether ``row`` only lets its event through (running it changes nothing)."""
    return row is not None and row.passes and row.src == row.dst and not row.bind \
        and not row.notify and row.counter is None


class Gate:
    """P's gate over one ``Ledger`` (see the module doc). ``key``: the capability key
    (``secrets.token_bytes(32)`` in the adapter; an input, never drawn here)."""

    TABLE: GateTable = GATE_TABLE
    # Derived from TABLE per class (``_derive``): whether the row of (state, register,
    # ready), by state, and the rows of (bound/open, forget, freed) only let the event
    # through (``_pass_only``): the hot paths then skip running them. LOOKUP_ROWS: run
    # every row through a TABLE lookup instead (for a TABLE wrapper that records rows).
    LOOKUP_ROWS: bool = False
    _REG_PASS: dict[str, bool]
    _FORGET_PASS: bool

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls._derive()

    @classmethod
    def _derive(cls) -> None:
        t = cls.TABLE
        lookup = cls.LOOKUP_ROWS
        cls._REG_PASS = {st: not lookup and _pass_only(t.get((st, G_REGISTER, "ready")))
                         for st in (G_OPEN, G_BOUND)}
        b, o = t.get((G_BOUND, FORGET, "freed")), t.get((G_OPEN, FORGET, "freed"))
        cls._FORGET_PASS = not lookup and b is not None and o is not None and _pass_only(o) \
            and b.passes and b.dst == G_OPEN and b.counter is None and not b.notify

    def __init__(self, ledger: Ledger, key: bytes, engine: str, epoch: int, *,
                 max_records: int = MAX_GATE_RECORDS) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise TableError("the capability key must be at least 16 bytes")
        self.ledger = ledger
        self._key = key
        self.engine = engine
        self.epoch = epoch
        self.max_records = max_records
        # Invariant: handle -> bound consumer, for handles some consumer presented and the
        # ledger has not freed. Cap: max_records together with _never.
        self._bound: dict[int, str] = {}
        # Invariant: handles abandoned (never registered), oldest first, none in _bound.
        # Cap: max_records together with _bound (the oldest evicted).
        self._never: OrderedDict[int, None] = OrderedDict()
        # Invariant: handle -> the peers (the bound consumer's D ranks, each once) owed the
        # answer to their claims, for bound handles the ledger has not registered yet:
        # the grants go out at the register (``register``), a never notice at the
        # abandon. A subset of _bound's keys (its cap covers it); at most one entry per
        # rank of the consumer.
        self._pending: dict[int, list[str]] = {}
        self.counters: dict[str, int] = {}

    @classmethod
    def with_rows(cls, *rows: GateRow, name: str | None = None) -> type[Gate]:
        """A subclass whose table has ``rows`` in place of the rows with the same key
        (mutants and mutation tests)."""
        table = dict(cls.TABLE)
        for row in rows:
            if row.key not in table:
                raise TableError(f"no gate row {row.key} to replace")
            table[row.key] = row
        return type(name or f"{cls.__name__}WithRows", (cls,),
                    {"TABLE": make_gate_table(table.values()), "__module__": cls.__module__})

    # -- queries ----------------------------------------------------------------------
    def capability(self, handle: int) -> str:
        """The capability to put in ``handle``'s transfer params."""
        return capability(self._key, self.engine, self.epoch, handle)

    @property
    def key(self) -> bytes:
        """The capability key (the engine's scheduler mints params with it)."""
        return self._key

    def state(self, handle: int) -> str:
        if handle in self._never:
            return G_NEVER
        return G_BOUND if handle in self._bound else G_OPEN

    def consumer(self, handle: int) -> str | None:
        return self._bound.get(handle)

    def __len__(self) -> int:
        return len(self._bound) + len(self._never)

    # -- the machine --------------------------------------------------------------------
    def _run(self, row: GateRow, handle: int, consumer: str | None, detail: str,
             out: list[GateEffect]) -> bool:
        if row.counter is not None:
            self.counters[row.counter] = self.counters.get(row.counter, 0) + 1
            if not row.passes:
                out.append(Rejected(row.counter, consumer or "", handle, detail))
        if row.bind and consumer is not None:
            self._bound[handle] = consumer
        if row.dst == G_NEVER and row.src != G_NEVER:
            self._bound.pop(handle, None)
            self._pending.pop(handle, None)  # the never notice answers the claim
            self._never[handle] = None
            while len(self._never) > 1 and len(self) > self.max_records:
                self._never.popitem(last=False)
                self.counters["never_evicted"] = self.counters.get("never_evicted", 0) + 1
        elif row.dst == G_OPEN and row.src == G_BOUND:
            self._bound.pop(handle, None)
            self._pending.pop(handle, None)
        if row.notify:
            out.append(NeverNotice(handle, consumer))
        return row.passes

    def present(self, consumer: str, handle: int, cap: str,
                out: list[GateEffect]) -> bool:
        """``consumer`` presents ``cap`` for ``handle`` (a claim, or a done, release,
        heartbeat or READ notification): True when the message may go on to the ledger
        (or the READ be served); otherwise refused, counted, and a ``Rejected`` (plus a
        ``NeverNotice`` for a never-registered handle) appended to ``out``."""
        b = self._bound.get(handle)
        if b is not None:
            row = self.TABLE[(G_BOUND, PRESENT, "same" if b == consumer else "foreign")]
            if row.passes and row.counter is None and not row.notify:
                return True  # a row that only lets the message through (the hot path)
            return self._run(row, handle, consumer,
                             f"handle {handle} is bound to another consumer", out)
        if handle in self._never:
            return self._run(self.TABLE[(G_NEVER, PRESENT, "never")], handle, consumer,
                             f"handle {handle} will never be registered", out)
        if not isinstance(cap, str) or not hmac.compare_digest(cap, self.capability(handle)):
            guard = "bad_capability"
        elif len(self) >= self.max_records:
            guard = "full"
        else:
            guard = "first"
        return self._run(self.TABLE[(G_OPEN, PRESENT, guard)], handle, consumer,
                         f"handle {handle}: {guard}", out)

    def register(self, handle: int, request_id: str, blocks: Sequence[int], now: int, *,
                 ready: bool, group: str | None = None,
                 expected: int = 0) -> list[GateEffect]:
        """Register with the ledger when ``ready`` (the writes that fill ``blocks``
        completed); otherwise refused and counted. A register the ledger rejects (or a
        refused one) leaves the handle registrable; the adapter calls ``abandon`` when
        it gives up on it."""
        if ready is True and handle not in self._never:
            st = G_BOUND if handle in self._bound else G_OPEN
            if self._REG_PASS[st]:  # a row that only lets the register through
                fx: list[GateEffect] = list(self.ledger.register(
                    handle, request_id, blocks, now, group=group, expected=expected))
                if self._pending:
                    self._answer_pending(handle, fx)
                return fx
        out: list[GateEffect] = []
        st = self.state(handle)
        guard = "never" if st == G_NEVER else ("ready" if ready is True else "unready")
        row = self.TABLE[(st, G_REGISTER, guard)]
        if not self._run(row, handle, None, f"register of {request_id!r} refused: {guard}",
                         out):
            if row.counter is not None:
                self.ledger.reject(row.counter, "", f"handle {handle} ({request_id!r})", now)
            return out
        out += self.ledger.register(handle, request_id, blocks, now, group=group,
                                    expected=expected)
        if self._pending:
            self._answer_pending(handle, out)
        return out

    def _answer_pending(self, handle: int, out: list[GateEffect]) -> None:
        """After a register of ``handle``: answer the claim that waited for it. Granted
        when the ledger now holds the handle and it is still bound; refused when the
        register freed it at once (it cannot be read). A register the ledger rejected
        leaves the claim waiting (the adapter abandons the handle: a never notice)."""
        peers = self._pending.get(handle)
        if peers is None:
            return
        st = self.ledger.state(handle)
        if st == UNREGISTERED:
            return
        del self._pending[handle]
        granted = handle in self._bound and st in HELD_STATES
        out.extend(ClaimAnswer(p, handle, granted) for p in peers)

    def abandon(self, handle: int) -> list[GateEffect]:
        """Transfer params for ``handle`` were handed out but it will never be registered
        (prefill aborted or failed, register refused): tell D at once."""
        out: list[GateEffect] = []
        if self.ledger.state(handle) != UNREGISTERED:
            return out  # registered: the ledger's abort and lease govern it
        st = self.state(handle)
        guard = {G_OPEN: "unclaimed", G_BOUND: "claimed", G_NEVER: "again"}[st]
        self._run(self.TABLE[(st, ABANDON, guard)], handle, self._bound.get(handle), "", out)
        return out

    def forget(self, handles: Iterable[int]) -> None:
        """The ledger freed ``handles`` (its ``Free`` effects): drop their bindings."""
        if self._FORGET_PASS:  # rows that only drop the binding (the hot path)
            pop = self._bound.pop
            if self._pending:
                handles = list(handles)
                for h in handles:
                    self._pending.pop(h, None)
            for h in handles:
                pop(h, None)
            return
        for h in handles:
            st = G_BOUND if h in self._bound else G_OPEN
            self._run(self.TABLE[(st, FORGET, "freed")], h, None, "", [])

    # -- the ledger's message intake, through the gate ----------------------------------
    # P's port (``kvproto.port.p_receive``) feeds these, with the consumer the sending D
    # rank belongs to (from its handshake). ``claim`` presents a capability and may
    # bind; done, release and heartbeat carry none: from the bound consumer, or about a
    # handle no consumer claimed yet, they go to the ledger; from any other consumer they
    # are refused and counted (row present/foreign; a refused heartbeat handle is refused
    # in its ack, so that consumer fails the request at once). A heartbeat about a
    # never-registered handle is refused in its ack too (row present/never).
    # The claim is answered (``ClaimAnswer`` to the sending ``peer``): D posts its READ
    # only once granted, so only the bound consumer ever reads the handle's blocks. A
    # claim that binds a handle the ledger has not registered yet (D can hold the params
    # before P's worker registers them) is answered at the register: D never reads
    # blocks the ledger does not hold, nor before the readiness mark and the checksums
    # that come with the register (the spec's Read: the consumer is granted and the
    # ledger holds the blocks). Abandoned instead, the never notice answers it.
    def claim(self, consumer: str, handle: int, cap: str, now: int,
              peer: str = "") -> list[GateEffect]:
        out: list[GateEffect] = []
        granted = self.present(consumer, handle, cap, out)
        if not granted:
            for e in out:
                if isinstance(e, Rejected):
                    self.ledger.reject(e.reason, consumer[:64], e.detail, now)
        elif self.ledger.state(handle) == UNREGISTERED:
            waiting = self._pending.setdefault(handle, [])
            if (peer or consumer) not in waiting:
                waiting.append(peer or consumer)
            self.counters["claim_before_register"] = \
                self.counters.get("claim_before_register", 0) + 1
            return out
        out.append(ClaimAnswer(peer or consumer, handle, granted))
        return out

    def _foreign(self, consumer: str | None, handle: int, now: int) -> bool:
        """True when ``handle`` is bound to a consumer other than ``consumer`` and the
        table refuses it (counted, journaled as a ledger rejection)."""
        b = self._bound.get(handle)
        if b is None or consumer is None or b == consumer:
            return False
        row = self.TABLE[(G_BOUND, PRESENT, "foreign")]
        if row.passes:
            return False
        self._run(row, handle, consumer, "", [])
        self.ledger.reject(row.counter or "foreign_consumer", consumer[:64],
                           f"handle {handle} is bound to another consumer", now)
        return True

    def done(self, reader: str, handle: int, expected: int, now: int,
             consumer: str | None = None) -> list[Effect]:
        b = self._bound.get(handle)
        if b is not None and b != consumer and self._foreign(consumer, handle, now):
            return []
        out = self.ledger.done(reader, handle, expected, now)
        if b is not None and out:
            if self._FORGET_PASS and len(out) == 1:  # the hot path: this handle's Free
                e = out[0]
                if isinstance(e, Free):
                    self._bound.pop(e.handle, None)
            else:
                self._freed(out)
        return out

    def done_batch(self, reader: str, handles: Sequence[int], expected: int, now: int,
                   consumer: str | None = None) -> list[Effect]:
        """``done`` for each of ``handles`` in order, in one ledger call
        (``Ledger.done_batch``) when no handle is bound to another consumer and forgetting
        a binding only drops it; else ``done`` per handle. As in ``done``, a handle bound
        before its done forgets the bindings of the requests its done freed."""
        bound = self._bound
        if bound and (not self._FORGET_PASS or any(
                b is not None and b != consumer for b in map(bound.get, handles))):
            out: list[Effect] = []
            for h in handles:
                out += self.done(reader, h, expected, now, consumer)
            return out
        if not bound:
            return self.ledger.done_batch(reader, handles, expected, now)
        marks: list[int] = []
        out = self.ledger.done_batch(reader, handles, expected, now, marks)
        start = 0
        for h, end in zip(handles, marks, strict=True):
            if end > start and h in bound:
                for e in out[start:end]:
                    if isinstance(e, Free):
                        bound.pop(e.handle, None)
            start = end
        return out

    def release(self, reader: str, handles: Sequence[int], expected: int, now: int,
                consumer: str | None = None) -> list[Effect]:
        if self._bound:
            handles = [h for h in handles if not self._foreign(consumer, h, now)]
            if not handles:
                return []
        return self._freed(self.ledger.release(reader, handles, expected, now))

    def heartbeat(self, reader: str, seq: int, handles: Sequence[int], expected: int,
                  now: int, consumer: str | None = None) -> list[Effect]:
        never = self._never
        if not never and not self._bound:
            return self.ledger.heartbeat(reader, seq, handles, expected, now)
        refuse: list[int] = []
        if never and not never.keys().isdisjoint(handles):
            told = [h for h in handles if h in never]
            row = self.TABLE[(G_NEVER, PRESENT, "never")]
            if told and not row.passes:
                refuse += told
                if row.counter is not None:
                    self.counters[row.counter] = self.counters.get(row.counter, 0) + len(told)
        bound = self._bound
        if bound and consumer is not None:
            get = bound.get
            # Every handle's owner (``consumer`` for an unbound one), found in C: the
            # common case, all of them this consumer's, needs no per-handle Python work.
            owners = set(map(get, handles, repeat(consumer, len(handles))))
            if len(owners) > 1 or (owners and consumer not in owners):
                refuse += [h for h in handles
                           if get(h, consumer) != consumer and self._foreign(consumer, h, now)]
        if not refuse:
            return self.ledger.heartbeat(reader, seq, handles, expected, now)
        gone = set(refuse)
        out = self.ledger.heartbeat(reader, seq, [h for h in handles if h not in gone],
                                    expected, now)
        for i, e in enumerate(out):
            if isinstance(e, Ack):
                out[i] = Ack(e.reader, e.seq, e.term, tuple(sorted({*e.refused, *gone})),
                             e.pending)
        return out

    def reject(self, reason: str, peer: str, detail: str, now: int) -> list[Effect]:
        return self.ledger.reject(reason, peer, detail, now)

    def _freed(self, out: list[Effect]) -> list[Effect]:
        if out and self._bound:
            self.forget([e.handle for e in out if isinstance(e, Free)])
        return out


Gate._derive()
