"""Interaction scripts: the protocol's stories as data, run through the real machines.

A script is a text file of commands for one machine: P's ``Ledger`` (files under a
``ledger/`` directory) or D's ``Consumer`` (files under ``consumer/``). Each command is one
line, followed by a ``----`` line and the output it must produce, up to a blank line or the
end of the file::

    # Lines that start with '#' are comments; blank lines separate commands.
    config initial_lease=30 lease_extension=20 abort_grace=30
    ----
    ok

    register 1 req blocks=0,1 expected=2 t=0
    ----
    h1: unregistered -> registered deadline=30000

A command is its name, its positional arguments, then ``key=value`` arguments (shell
quoting for values with spaces; a positional argument may also be written ``key=value``).
Lists are comma-separated (``blocks=0,1``). Rules of the format:

* Times and durations in commands are integer milliseconds: ``t=1500``, ``tick 1500``,
  ``term=20000``. An event without ``t=`` happens at the script's clock, the last time a
  command gave. ``machine_time`` is the one place that turns script time into the
  machines' time.
* ``config key=value ...`` starts a story: a fresh machine (and the clock at 0) under this
  ``Config``, written in seconds as a user writes it, plus ``capacity`` (P's block pool)
  or ``reader`` and ``heartbeat_chunk`` (D). A file that does not start with ``config``
  starts with the defaults.
* The output of an event is, in order: its effects (``describe``), the changes it made to
  every request the story knows (state, lease, readers...), and the counters it moved.
  An event with no output prints ``ok``. On P, a broken invariant prints ``invariant ...``.
* ``state`` (and on P ``held``, ``staged``, ``pool``) and ``counters`` print the machine.

A malformed line raises ``ScriptError`` naming the file and line. ``run_file`` runs a
script and compares; ``Result.rewritten()`` is the script with every expected output
replaced by the actual one (``pytest tests/test_interaction.py --rewrite``).
"""

from __future__ import annotations

import difflib
import json
import math
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Final

from kvproto.errors import UsageError
from kvproto.lifecycle import (
    CLOCK_START,
    D_NEW,
    Ack,
    BlockPool,
    Config,
    ConfigError,
    Consumer,
    DRejected,
    DropPeer,
    Finished,
    Free,
    Ledger,
    PostRead,
    Quarantined,
    Rejected,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    TransferParams,
    Unquarantined,
)

# ---------------------------------------------------------------------------
# Time: scripts count integer milliseconds.
# ---------------------------------------------------------------------------


def machine_time(ms: int) -> int:
    """A script time or duration (integer milliseconds) as the machines take it (integer
    milliseconds too). The only function that knows the machines' time unit: the
    renderer's inverse is derived from it (``_script_ms``)."""
    return ms


def _script_ms(t: float) -> float:
    """A machine time or duration in script milliseconds (the inverse of machine_time)."""
    return t * 1000 / machine_time(1000)


def _fmt_time(t: float | None) -> str:
    """A machine time in whole script milliseconds ("none", "inf", "-inf" otherwise; a
    time that is not a whole millisecond keeps three decimals)."""
    if t is None:
        return "none"
    if t == CLOCK_START:  # "before any time" (the machines' int stand-in for -inf)
        return "-inf"
    if not math.isfinite(t):
        return "inf" if t > 0 else "-inf"
    ms = _script_ms(t)
    whole = round(ms)
    return str(whole) if abs(ms - whole) < 1e-6 else f"{ms:.3f}"


def _seconds_ms(seconds: float) -> int:
    """A configuration duration (seconds) in script milliseconds."""
    return round(seconds * 1000)


# ---------------------------------------------------------------------------
# Rendering: one function, ``describe``, for effects, effect lists and machines.
# ---------------------------------------------------------------------------


def _ints(xs: Iterable[int]) -> str:
    s = ",".join(str(x) for x in xs)
    return s or "-"


def _quote(s: str) -> str:
    """A string as one token: bare when it has no space or quote, else JSON-quoted."""
    if s and not any(c.isspace() or c in "\"'\\=" for c in s):
        return s
    return json.dumps(s)


def describe(x: object, known: Iterable[Any] = ()) -> str:
    """Render an effect, a list of effects, a ``Ledger`` or a ``Consumer`` as text, one
    line per effect (or per request, peer, group...), deterministically: the expected
    outputs of interaction scripts are this function's output. ``known`` names the
    handles (P) or request ids (D) whose state a machine's rendering must also show when
    they are no longer held. An empty list renders as the empty string."""
    if isinstance(x, (list, tuple)):
        return "\n".join(describe(e) for e in x)
    if isinstance(x, Free):
        return (f"free h{x.handle} {_quote(x.request_id)} {x.reason} blocks={_ints(x.blocks)}"
                f" reclaimed={_ints(x.reclaimed)} deadline={_fmt_time(x.deadline)}")
    if isinstance(x, Ack):
        s = f"ack {x.reader} seq={x.seq} term={_fmt_time(x.term)}"
        if x.refused:
            s += f" refused={_ints(x.refused)}"
        if x.pending:
            s += f" pending={_ints(x.pending)}"
        return s
    if isinstance(x, (Rejected, DRejected)):
        s = f"rejected {x.reason}"
        if x.peer:
            s += f" peer={_quote(x.peer)}"
        if isinstance(x, Rejected) and x.handle is not None:
            s += f" h{x.handle}"
        return s + (f" detail={_quote(x.detail)}" if x.detail else "")
    if isinstance(x, StartHandshake):
        return f"start_handshake {x.engine}"
    if isinstance(x, PostRead):
        return (f"post_read {x.request_id} {x.engine} h{x.handle} blocks={_ints(x.blocks)}"
                f" expected={x.expected}")
    if isinstance(x, SendDone):
        return f"send_done {x.request_id} {x.engine} h{x.handle} expected={x.expected}"
    if isinstance(x, SendRelease):
        return f"send_release {x.request_id} {x.engine} h{x.handle} expected={x.expected}"
    if isinstance(x, SendHeartbeat):
        return f"send_heartbeat {x.engine} seq={x.seq} h={_ints(x.handles)} expected={x.expected}"
    if isinstance(x, Finished):
        return f"finished {x.request_id} {x.state} {x.reason}"
    if isinstance(x, DropPeer):
        return f"drop_peer {x.engine} reason={_quote(x.reason)}"
    if isinstance(x, Quarantined):
        return f"quarantined {x.request_id} {x.engine} h{x.handle}"
    if isinstance(x, Unquarantined):
        return f"unquarantined {x.request_id} {x.engine} h{x.handle}"
    if isinstance(x, Ledger):
        return "\n".join(_ledger_state(x, known))
    if isinstance(x, Consumer):
        return "\n".join(_consumer_state(x, known, {}))
    raise TypeError(f"describe: nothing to render for {x!r}")


def _now(m: Ledger | Consumer) -> str:
    return f"now {'none' if m.now == CLOCK_START else _fmt_time(m.now)}"


def _held_line(m: Ledger, h: int) -> str | None:
    v = m.held(h)
    if v is None:
        return None
    s = (f"h{h} {_quote(v.request_id)} {v.state} blocks={_ints(v.blocks)}"
         f" deadline={_fmt_time(v.deadline)} expected={v.expected}")
    if v.finished:
        s += f" finished={','.join(sorted(v.finished))}"
    if v.released:
        s += " released"
    if v.group is not None:
        s += f" group={_quote(v.group)}"
    return s


def _ledger_held(m: Ledger) -> list[str]:
    lines = [_held_line(m, h) for h in sorted(m.live_handles())]
    return [s for s in lines if s is not None] or ["no held requests"]


def _ledger_staged(m: Ledger) -> list[str]:
    out = []
    for st in m.staged():
        msgs = "; ".join(f"{kind} {reader} expected={exp} t={_fmt_time(t)}"
                         for kind, reader, exp, t in st.msgs)
        out.append(f"staged h{st.handle} since={_fmt_time(st.since)}: {msgs}")
    return out or ["nothing staged"]


def _ledger_pool(m: Ledger) -> list[str]:
    pool = m.pool
    rc = " ".join(f"{b}:{pool.refcount(b)}" for b in range(pool.capacity) if pool.refcount(b))
    return [f"pool held={pool.held_count} free={pool.free_count}"
            + (f" refcounts {rc}" if rc else "")]


def _ledger_state(m: Ledger, known: Iterable[Any]) -> list[str]:
    live = set(m.live_handles())
    lines = [_now(m)]
    for h in sorted(live | {h for h in known if isinstance(h, int)}):
        lines.append(_held_line(m, h) or f"h{h} {m.state(h)}")
    if m.staged_count:
        lines += _ledger_staged(m)
    lines += _ledger_pool(m)
    lines.append(f"next_deadline {_fmt_time(m.next_deadline())}")
    return lines


def _counters(counters: Mapping[str, int], label: str) -> str:
    items = " ".join(f"{k}={v}" for k, v in sorted(counters.items()) if v)
    return f"{label}: {items or 'none'}"


def _consumer_state(m: Consumer, known: Iterable[Any],
                    params: Mapping[str, TransferParams]) -> list[str]:
    lines = [_now(m)]
    for rid in m.reqs:
        p = params.get(rid)
        where = f" {p.engine} h{p.handle}" if p is not None else ""
        s = f"{_quote(rid)}{where} {m.state(rid)} lease_end={_fmt_time(m.lease_end(rid))}"
        if m.abort_pending(rid):
            s += " abort_pending"
        if p is not None and p.group is not None:
            s += f" group={_quote(p.group)}"
        lines.append(s)
    for rid in known:
        if isinstance(rid, str) and rid not in m.reqs:
            lines.append(f"{_quote(rid)} not held")
    for engine in sorted(m.peers):
        lines.append(f"peer {engine} {m.peer_state(engine)}"
                     f" outstanding={m.outstanding_heartbeats(engine)}")
    for engine, group in sorted({(p.engine, p.group) for p in params.values()
                                 if p.group is not None}):
        lines.append(f"group {engine}/{group} owner={m.group_owner(engine, group) or 'none'}")
    lines.append(f"next_deadline {_fmt_time(m.next_deadline())}")
    return lines


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


class ScriptError(UsageError, ValueError):
    """A malformed script, or a command the machine could not run: names file and line."""

    def __init__(self, path: str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = path
        self.line = line


_REQUIRED: Final = object()


@dataclass(frozen=True)
class Arg:
    """One argument of a command: its kind (``int``, ``ints``, ``str``, ``ms``, ``bool``)
    and its default (required when none)."""

    kind: str
    default: Any = _REQUIRED


@dataclass(frozen=True)
class Signature:
    positional: tuple[str, ...]
    args: Mapping[str, Arg]
    help: str


def _sig(positional: str, help: str, **args: Arg) -> Signature:
    pos = tuple(positional.split())
    assert all(p in args for p in pos), positional
    return Signature(pos, args, help)


def _convert(kind: str, raw: str) -> Any:
    if kind == "str":
        return raw
    if kind in ("int", "ms"):
        return int(raw)
    if kind == "ints":
        return tuple(int(x) for x in raw.split(",")) if raw not in ("", "-") else ()
    if kind == "bool":
        if raw not in ("true", "false"):
            raise ValueError("expected true or false")
        return raw == "true"
    raise AssertionError(kind)


_KIND_WORDS: Final = {"int": "an integer", "ms": "an integer of milliseconds",
                      "ints": "comma-separated integers", "bool": "true or false"}


@dataclass
class Block:
    """One command, its expected output, and where it stands in the file."""

    line: int  # 1-based line of the command
    text: str  # the command line as written
    name: str
    args: dict[str, Any]
    expected: list[str]


@dataclass
class Script:
    path: str
    machine: str
    items: list[str | Block]  # verbatim lines (comments, blank lines) and blocks, in order

    @property
    def blocks(self) -> list[Block]:
        return [b for b in self.items if isinstance(b, Block)]


def _config_keys(driver: type[_Driver]) -> set[str]:
    return {f.name for f in fields(Config)} | set(driver.EXTRA_CONFIG)


def _parse_command(text: str, driver: type[_Driver], path: str,
                   line: int) -> tuple[str, dict[str, Any]]:
    def fail(msg: str) -> ScriptError:
        return ScriptError(path, line, msg)

    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise fail(f"cannot split {text!r} into arguments: {e}") from None
    name, rest = tokens[0], tokens[1:]
    if name == "config":
        keys = _config_keys(driver)
        values: dict[str, Any] = {}
        for tok in rest:
            key, eq, raw = tok.partition("=")
            if not eq:
                raise fail(f"config: {tok!r} is not key=value")
            if key not in keys:
                raise fail(f"config: unknown key {key!r} (known: {', '.join(sorted(keys))})")
            try:
                num = float(raw)
            except ValueError:
                raise fail(f"config: {key}={raw!r} is not a number") from None
            values[key] = int(num) if num.is_integer() and "." not in raw else num
        return name, values
    sig = driver.COMMANDS.get(name)
    if sig is None:
        known = ", ".join(["config", *sorted(driver.COMMANDS)])
        raise fail(f"unknown command {name!r} for the {driver.MACHINE} (known: {known})")
    values = {}
    pos = list(sig.positional)
    for tok in rest:
        key, eq, raw = tok.partition("=")
        if eq and key.isidentifier():
            if key not in sig.args:
                raise fail(f"{name}: unknown argument {key!r} (known: {', '.join(sig.args)})")
        else:
            pos = [p for p in pos if p not in values]
            if not pos:
                raise fail(f"{name}: unexpected argument {tok!r} (usage: {name} {sig.help})")
            key, raw = pos.pop(0), tok
        if key in values:
            raise fail(f"{name}: argument {key!r} given twice")
        kind = sig.args[key].kind
        try:
            values[key] = _convert(kind, raw)
        except ValueError:
            raise fail(f"{name}: {key}={raw!r} is not {_KIND_WORDS[kind]}") from None
    for key, arg in sig.args.items():
        if key not in values:
            if arg.default is _REQUIRED:
                raise fail(f"{name}: missing argument {key!r} (usage: {name} {sig.help})")
            values[key] = arg.default
    return name, values


def parse(text: str, path: str, machine: str) -> Script:
    """Parse a script for ``machine`` ("ledger" or "consumer"); ``ScriptError`` names the
    file and line of the first malformed line."""
    driver = _driver_class(machine, path)
    lines = text.splitlines()
    items: list[str | Block] = []
    i = 0
    while i < len(lines):
        raw = lines[i]
        s = raw.strip()
        if not s or s.startswith("#"):
            items.append(raw)
            i += 1
            continue
        if s == "----":
            raise ScriptError(path, i + 1, "'----' without a command before it")
        if i + 1 >= len(lines) or lines[i + 1].strip() != "----":
            raise ScriptError(path, i + 1, f"the command {s!r} must be followed by a '----' line")
        name, args = _parse_command(s, driver, path, i + 1)
        j = i + 2
        out: list[str] = []
        while j < len(lines) and lines[j].strip():
            out.append(lines[j].rstrip())
            j += 1
        items.append(Block(i + 1, s, name, args, out))
        i = j
    return Script(path, machine, items)


# ---------------------------------------------------------------------------
# Drivers: one per machine, each command a method.
# ---------------------------------------------------------------------------

_T: Final = Arg("ms", None)  # the event's time; default: the script's clock


class _Driver:
    MACHINE: ClassVar[str]
    COMMANDS: ClassVar[dict[str, Signature]]
    EXTRA_CONFIG: ClassVar[tuple[str, ...]]  # config keys that are not Config fields

    def __init__(self, machine_class: type[Any] | None = None) -> None:
        """``machine_class`` runs the script on a variant of the machine (a subclass, e.g.
        a mutant); None runs the machine itself."""
        self.machine_class = machine_class
        self.clock = 0
        self.config = Config()
        self.configure({})

    def configure(self, values: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def at(self, args: Mapping[str, Any]) -> int:
        """The event's machine time: its ``t=``, else the script's clock."""
        t = args["t"]
        if t is not None:
            self.clock = t
        return machine_time(self.clock)

    def run(self, name: str, args: dict[str, Any]) -> list[str]:
        if name == "config":
            self.clock = 0
            self.configure(args)
            return ["ok"]
        method: Callable[[dict[str, Any]], list[str]] = getattr(self, "do_" + name)
        return method(args) or ["ok"]


def _split_config(values: Mapping[str, Any],
                  extra: Sequence[str]) -> tuple[Config, dict[str, Any]]:
    cfg = {k: v for k, v in values.items() if k not in extra}
    return Config.from_dict(cfg), {k: v for k, v in values.items() if k in extra}


def _count_changes(before: Mapping[str, int], after: Mapping[str, int]) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        d = after.get(k, 0) - before.get(k, 0)
        if d:
            out.append(f"count {k} {d:+d}")
    return out


_LedgerView = tuple[str, float | None, int, frozenset[str], bool]


class LedgerDriver(_Driver):
    MACHINE = "ledger"
    EXTRA_CONFIG: ClassVar[tuple[str, ...]] = ("capacity",)
    COMMANDS: ClassVar[dict[str, Signature]] = {
        "register": _sig("h rid", "H RID blocks=B,.. [group=G] [expected=N] [t=MS]",
                         h=Arg("int"), rid=Arg("str"), blocks=Arg("ints"),
                         group=Arg("str", None), expected=Arg("int", 0), t=_T),
        "done": _sig("reader h", "READER H [expected=N] [t=MS]",
                     reader=Arg("str"), h=Arg("int"), expected=Arg("int", 1), t=_T),
        "heartbeat": _sig("reader h", "READER H,.. [seq=N] [expected=N] [t=MS]",
                          reader=Arg("str"), h=Arg("ints"), seq=Arg("int", None),
                          expected=Arg("int", 1), t=_T),
        "release": _sig("reader h", "READER H,.. [expected=N] [t=MS]",
                        reader=Arg("str"), h=Arg("ints"), expected=Arg("int", 1), t=_T),
        "abort": _sig("rid", "RID [t=MS]", rid=Arg("str"), t=_T),
        "tick": _sig("t", "MS", t=Arg("ms")),
        "reject": _sig("reason", "REASON [peer=P] [detail=D] [t=MS]", reason=Arg("str"),
                       peer=Arg("str", ""), detail=Arg("str", ""), t=_T),
        "state": _sig("", ""),
        "held": _sig("", ""),
        "staged": _sig("", ""),
        "pool": _sig("", ""),
        "counters": _sig("", ""),
    }

    def configure(self, values: Mapping[str, Any]) -> None:
        self.config, extra = _split_config(values, self.EXTRA_CONFIG)
        cls: type[Ledger] = self.machine_class or Ledger
        self.ledger = cls(self.config, BlockPool(int(extra.get("capacity", 64))))
        self.known: set[int] = set()
        self.seqs: dict[str, int] = {}

    def _view(self, h: int) -> _LedgerView:
        v = self.ledger.held(h)
        if v is None:
            return (self.ledger.state(h), None, 0, frozenset(), False)
        return (v.state, v.deadline, v.expected, v.finished, v.released)

    def _event(self, handles: Iterable[int], call: Callable[[], Sequence[object]]) -> list[str]:
        m = self.ledger
        self.known.update(handles)
        watch = sorted(self.known | set(m.live_handles()))
        before = {h: self._view(h) for h in watch}
        counters = dict(m.counters)
        effects = call()
        out = [describe(e) for e in effects]
        for h in sorted(self.known | set(m.live_handles())):
            old, new = before.get(h, (m.state(h), None, 0, frozenset(), False)), self._view(h)
            if old == new:
                continue
            s = f"h{h}: " + (f"{old[0]} -> {new[0]}" if old[0] != new[0] else new[0])
            if new[1] is not None and new[1] != old[1]:
                s += f" deadline={_fmt_time(new[1])}"
            if new[1] is not None and new[2] != old[2]:
                s += f" expected={new[2]}"
            if new[3] != old[3] and new[3]:
                s += f" finished={','.join(sorted(new[3]))}"
            if new[4] and not old[4]:
                s += " released"
            out.append(s)
        out += _count_changes(counters, m.counters)
        out += [f"invariant {e}" for e in m.check_invariants()]
        return out

    def do_register(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["h"]], lambda: self.ledger.register(
            a["h"], a["rid"], a["blocks"], now, group=a["group"], expected=a["expected"]))

    def do_done(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["h"]], lambda: self.ledger.done(a["reader"], a["h"], a["expected"], now))

    def do_heartbeat(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        seq = a["seq"]
        if seq is None:
            seq = self.seqs.get(a["reader"], 0) + 1
        self.seqs[a["reader"]] = seq
        return self._event(a["h"], lambda: self.ledger.heartbeat(
            a["reader"], seq, a["h"], a["expected"], now))

    def do_release(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event(a["h"], lambda: self.ledger.release(a["reader"], a["h"], a["expected"], now))

    def do_abort(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], lambda: self.ledger.abort(a["rid"], now))

    def do_tick(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], lambda: self.ledger.tick(now))

    def do_reject(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], lambda: self.ledger.reject(a["reason"], a["peer"], a["detail"], now))

    def do_state(self, a: dict[str, Any]) -> list[str]:
        return describe(self.ledger, self.known).splitlines()

    def do_held(self, a: dict[str, Any]) -> list[str]:
        return _ledger_held(self.ledger)

    def do_staged(self, a: dict[str, Any]) -> list[str]:
        return _ledger_staged(self.ledger)

    def do_pool(self, a: dict[str, Any]) -> list[str]:
        return _ledger_pool(self.ledger)

    def do_counters(self, a: dict[str, Any]) -> list[str]:
        return [_counters(self.ledger.counters, "counters"), _counters(self.ledger.frees, "frees")]


_ConsumerView = tuple[str, int | None, bool]


class ConsumerDriver(_Driver):
    MACHINE = "consumer"
    EXTRA_CONFIG: ClassVar[tuple[str, ...]] = ("reader", "heartbeat_chunk")
    COMMANDS: ClassVar[dict[str, Signature]] = {
        "admit": _sig("rid h", "RID H [engine=P0] [term=MS] [expected=1] [group=G] "
                      "[blocks=0,1] [epoch=7] [t=MS]",
                      rid=Arg("str"), h=Arg("int"), engine=Arg("str", "P0"),
                      term=Arg("ms", None), expected=Arg("int", 1), group=Arg("str", None),
                      blocks=Arg("ints", (0, 1)), epoch=Arg("int", 7), t=_T),
        "handshake_ok": _sig("engine", "[ENGINE] [t=MS]", engine=Arg("str", "P0"), t=_T),
        "handshake_failed": _sig("engine", "[ENGINE] [reason=R] [t=MS]",
                                 engine=Arg("str", "P0"), reason=Arg("str", "handshake"), t=_T),
        "schedule": _sig("rid", "RID [t=MS]", rid=Arg("str"), t=_T),
        "read_ok": _sig("rid", "RID [notif_attached=true|false] [t=MS]", rid=Arg("str"),
                        notif_attached=Arg("bool", True), t=_T),
        "read_failed": _sig("rid", "RID [fenced=true|false] [t=MS]", rid=Arg("str"),
                            fenced=Arg("bool", False), t=_T),
        "abort": _sig("rid", "RID [t=MS]", rid=Arg("str"), t=_T),
        "ack": _sig("engine", "[ENGINE] seq=N [term=MS] [refused=H,..] [pending=H,..] [t=MS]",
                    engine=Arg("str", "P0"), seq=Arg("int"), term=Arg("ms", None),
                    refused=Arg("ints", ()), pending=Arg("ints", ()), t=_T),
        "peer_lost": _sig("engine", "[ENGINE] [t=MS]", engine=Arg("str", "P0"), t=_T),
        "tick": _sig("t", "MS", t=Arg("ms")),
        "reject": _sig("reason", "REASON [peer=P] [detail=D] [t=MS]", reason=Arg("str"),
                       peer=Arg("str", ""), detail=Arg("str", ""), t=_T),
        "state": _sig("", ""),
        "counters": _sig("", ""),
    }

    def configure(self, values: Mapping[str, Any]) -> None:
        self.config, extra = _split_config(values, self.EXTRA_CONFIG)
        chunk = extra.get("heartbeat_chunk")
        cls: type[Consumer] = self.machine_class or Consumer
        self.consumer = cls(str(extra.get("reader", "d0")), self.config,
                            heartbeat_chunk=None if chunk is None else int(chunk))
        self.known: dict[str, None] = {}  # request ids, in order of first mention
        self.engines: dict[str, None] = {}
        self.params: dict[str, TransferParams] = {}

    def _views(self) -> tuple[dict[str, _ConsumerView], dict[str, tuple[str, int]],
                              dict[tuple[str, str], str | None]]:
        m = self.consumer
        reqs = {rid: (m.state(rid), m.lease_end(rid), m.abort_pending(rid))
                for rid in [*self.known, *(r for r in m.reqs if r not in self.known)]}
        peers = {e: (m.peer_state(e), m.outstanding_heartbeats(e))
                 for e in sorted(set(self.engines) | set(m.peers))}
        groups = {(p.engine, p.group): m.group_owner(p.engine, p.group)
                  for p in self.params.values() if p.group is not None}
        return reqs, peers, groups

    def _event(self, rids: Iterable[str], engines: Iterable[str],
               call: Callable[[], Sequence[object]]) -> list[str]:
        m = self.consumer
        self.known.update(dict.fromkeys(rids))
        self.engines.update(dict.fromkeys(engines))
        reqs0, peers0, groups0 = self._views()
        counters = dict(m.counters)
        effects = call()
        reqs1, peers1, groups1 = self._views()
        ended = {e.request_id: e.state for e in effects if isinstance(e, Finished)}
        out = [describe(e) for e in effects]
        for rid, new in reqs1.items():
            old = reqs0.get(rid, (D_NEW, None, False))
            state = ended.get(rid, new[0]) if new[0] == D_NEW else new[0]
            if old == new and state == new[0]:
                continue
            s = f"{_quote(rid)}: " + (f"{old[0]} -> {state}" if old[0] != state else state)
            if new[1] is not None and new[1] != old[1]:
                s += f" lease_end={_fmt_time(new[1])}"
            if new[2] and not old[2]:
                s += " abort_pending"
            out.append(s)
        for engine, (pstate, outstanding) in peers1.items():
            old_p = peers0.get(engine, ("unknown", 0))
            if old_p == (pstate, outstanding):
                continue
            s = f"peer {engine}: " + (f"{old_p[0]} -> {pstate}" if old_p[0] != pstate else pstate)
            if outstanding != old_p[1]:
                s += f" outstanding={outstanding}"
            out.append(s)
        for (engine, group), owner in sorted(groups1.items()):
            if groups0.get((engine, group)) != owner:
                out.append(f"group {engine}/{group}: owner={owner or 'none'}")
        out += _count_changes(counters, m.counters)
        return out

    def do_admit(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        term = a["term"] if a["term"] is not None else _seconds_ms(self.config.initial_lease)
        p = TransferParams(engine=a["engine"], epoch=a["epoch"], handle=a["h"],
                           blocks=a["blocks"], initial_term=machine_time(term),
                           expected=a["expected"], group=a["group"])
        if a["rid"] not in self.consumer.reqs:
            self.params[a["rid"]] = p
        return self._event([a["rid"]], [a["engine"]], lambda: self.consumer.admit(a["rid"], p, now))

    def do_handshake_ok(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], [a["engine"]],
                           lambda: self.consumer.handshake_result(a["engine"], True, now))

    def do_handshake_failed(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], [a["engine"]], lambda: self.consumer.handshake_result(
            a["engine"], False, now, a["reason"]))

    def do_schedule(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["rid"]], [], lambda: self.consumer.schedule(a["rid"], now))

    def do_read_ok(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["rid"]], [], lambda: self.consumer.read_result(
            a["rid"], True, now, notif_attached=a["notif_attached"]))

    def do_read_failed(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["rid"]], [], lambda: self.consumer.read_result(
            a["rid"], False, now, fenced=a["fenced"]))

    def do_abort(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([a["rid"]], [], lambda: self.consumer.abort(a["rid"], now))

    def do_ack(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        term = a["term"] if a["term"] is not None else _seconds_ms(self.config.lease_extension)
        return self._event([], [a["engine"]], lambda: self.consumer.ack(
            a["engine"], a["seq"], machine_time(term), a["refused"], now, a["pending"]))

    def do_peer_lost(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], [a["engine"]], lambda: self.consumer.peer_lost(a["engine"], now))

    def do_tick(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], [], lambda: self.consumer.tick(now))

    def do_reject(self, a: dict[str, Any]) -> list[str]:
        now = self.at(a)
        return self._event([], [], lambda: self.consumer.reject(a["reason"], a["peer"],
                                                                a["detail"], now))

    def do_state(self, a: dict[str, Any]) -> list[str]:
        return _consumer_state(self.consumer, self.known, self.params)

    def do_counters(self, a: dict[str, Any]) -> list[str]:
        return [_counters(self.consumer.counters, "counters"),
                _counters(self.consumer.finished, "finished")]


DRIVERS: Final[dict[str, type[_Driver]]] = {"ledger": LedgerDriver, "consumer": ConsumerDriver}


def _driver_class(machine: str, path: str) -> type[_Driver]:
    driver = DRIVERS.get(machine)
    if driver is None:
        raise ScriptError(path, 1, f"unknown machine {machine!r} (known: {', '.join(DRIVERS)}):"
                                   " a script lives in a directory named after its machine")
    return driver


# ---------------------------------------------------------------------------
# Running and rewriting
# ---------------------------------------------------------------------------


@dataclass
class Result:
    """A script and what each of its commands actually printed."""

    script: Script
    actual: list[list[str]] = field(default_factory=list)  # per block, in order

    @property
    def mismatches(self) -> list[tuple[Block, list[str]]]:
        return [(b, out) for b, out in zip(self.script.blocks, self.actual, strict=True)
                if b.expected != out]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def rewritten(self) -> str:
        """The script with every expected output replaced by the actual one."""
        lines: list[str] = []
        outs = iter(self.actual)
        for item in self.script.items:
            if isinstance(item, Block):
                lines += [item.text, "----", *next(outs)]
            else:
                lines.append(item)
        return "\n".join(lines) + "\n"

    def report(self, original: str) -> str:
        """Where the outputs differ: the first differing command's file and line, then a
        unified diff of the script against its rewritten self."""
        bad = self.mismatches
        if not bad:
            return ""
        head = "\n".join(f"{self.script.path}:{b.line}: output of {b.text!r} differs"
                         for b, _ in bad)
        diff = difflib.unified_diff(original.splitlines(), self.rewritten().splitlines(),
                                    f"{self.script.path} (expected)",
                                    f"{self.script.path} (actual)", lineterm="")
        return (head + "\n" + "\n".join(diff)
                + "\n(pytest tests/test_interaction.py --rewrite regenerates the outputs)")


def run(script: Script, machine_class: type[Any] | None = None) -> Result:
    """Run every command of ``script`` through a fresh machine (of ``machine_class`` when
    given: a subclass of the script's machine); a command the machine cannot run raises
    ``ScriptError`` naming its line."""
    driver = DRIVERS[script.machine](machine_class)
    result = Result(script)
    for b in script.blocks:
        try:
            out = driver.run(b.name, b.args)
        except ConfigError as e:
            raise ScriptError(script.path, b.line, f"config: {e}") from e
        except Exception as e:
            raise ScriptError(script.path, b.line,
                              f"{b.text!r} raised {type(e).__name__}: {e}") from e
        assert all(s.strip() for s in out), f"{script.path}:{b.line}: blank output line"
        result.actual.append(out)
    return result


def run_text(text: str, machine: str, path: str = "<script>",
             machine_class: type[Any] | None = None) -> Result:
    return run(parse(text, path, machine), machine_class)


def machine_of(path: Path) -> str:
    """The machine a script runs on: the name of its directory."""
    return path.parent.name


def run_file(path: Path, machine_class: type[Any] | None = None) -> Result:
    return run_text(path.read_text(encoding="utf-8"), machine_of(path), str(path),
                    machine_class)


def check_file(path: Path, *, rewrite: bool = False) -> None:
    """Run the script at ``path``: with ``rewrite``, write the actual outputs into it;
    otherwise raise AssertionError with a diff when an output differs."""
    original = path.read_text(encoding="utf-8")
    result = run_text(original, machine_of(path), str(path))
    if rewrite:
        new = result.rewritten()
        if new != original:
            path.write_text(new, encoding="utf-8")
        return
    if not result.ok:
        raise AssertionError(result.report(original))
