"""``kvproto validate JOURNAL.jsonl...``: is a recorded journal a behaviour of the spec?

Each journal (from the simulator, or later from the NIXL adapters) is turned into a
TLA+ trace literal and checked by TLC against ``kvproto/tla/KVLedger.tla`` through
``kvproto/tla/conformance/TraceLedger.tla``: every step applies the spec's own transition
operators and checks that the recorded effects (frees, reclaimed blocks, acks,
rejections) are exactly the spec's. The first step the spec does not allow is reported
with its journal line. Several journals are checked in one TLC run (batches of about
``--batch-bytes`` of TLA+ text: SANY's parse time dominates).

Long journals are checked in segments (``--segment-steps``): each segment names only the
requests live or staged at its start and those its events touch, starts from the
journal's events replayed through the Python ledger, and must end in the replayed state
(TraceLedger's EndL), so the segments chain into one behaviour and TLC's time grows
linearly with the journal's length.

Mapping journal -> spec (TraceLedger.tla's header): handle h -> request "h<h>"; readers keep
their names; blocks keep their ids; group None -> NoGroup; request ids are tracked for
abort (abort names a request id) and for duplicate registers; times -> integer units
(the coarsest 10^-k s that makes every time and duration integral), clamped to be
monotone like the ledger's clock; ``reject`` events are stuttering steps.

Exit codes: 0 every journal is allowed; 1 some journal is not; 2 bad input (unreadable
journal, times not representable, outside the spec's assumptions); 3 Java/TLC missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvproto import lifecycle
from kvproto.journal import (
    JournalError,
    decode_row,
    header_capacity,
    journal_lines,
    read_journal_objects,
)
from kvproto.lifecycle import (
    R_EXPIRED,
    Abort,
    Ack,
    BlockPool,
    Config,
    ConfigError,
    Done,
    Effect,
    Event,
    Free,
    Heartbeat,
    Ledger,
    Register,
    Reject,
    Rejected,
    Release,
    Tick,
)
from kvproto.verify.tlc import (
    MissingDependency,
    ParseError,
    TLCError,
    parse_value,
    render,
    require_ok,
    run_tlc,
    spec_dir,
)

log = logging.getLogger(__name__)

TLCMissing = MissingDependency

EXIT_OK: Final = 0
EXIT_NOT_ALLOWED: Final = 1
EXIT_BAD_INPUT: Final = 2
EXIT_MISSING: Final = 3

TLC_INT_MAX: Final = 2**31 - 1
DEFAULT_BATCH_BYTES: Final = 800_000


class TraceError(ValueError):
    """The journal cannot be expressed as a trace of the spec (bad input)."""


# KVLedger's variables (the trace module works on a record of them).
_KV_VARS: Final = ("pstate", "expected", "finished", "released", "deadline", "reports", "rc",
                   "stagedQ", "staged", "stagedAge", "groupsDone", "nfree")


@dataclass
class Trace:
    """One segment of a journal as TLA+ constants and steps.

    ``lines[i]`` is step i+1's journal line; ``offset`` is the number of journal steps
    before this segment (a whole journal is one segment with offset 0). ``module`` is the
    trace module instantiated for it (its state variable is ``tst``; it prints ACCEPT or
    REJECT verdicts), ``spec_vars`` the variables of the spec it extends (unused by the
    trace operators, substituted by the batch's variable), and ``files`` the modules it
    needs, relative to the shipped spec. P journals use TraceLedger over KVLedger; another
    machine's journals name their own."""

    path: str
    scale: int  # time units per second
    constants: dict[str, str]  # TLA+ constant name -> TLA+ expression
    steps: list[str]  # TLA+ record literals
    lines: list[int]
    events: list[dict[str, Any]]  # the journal's event objects (for the report)
    offset: int = 0
    module: str = "TraceLedger"
    spec_vars: tuple[str, ...] = _KV_VARS
    files: tuple[str, ...] = ("KVLedger.tla", "conformance/TraceLedger.tla")

    def tla_size(self) -> int:
        return sum(len(s) + 2 for s in self.steps) + sum(len(v) for v in self.constants.values())


@dataclass
class Verdict:
    path: str
    allowed: bool
    steps: int
    line: int | None = None
    event: dict[str, Any] | None = None
    why: str = ""

    def describe(self) -> str:
        if self.allowed:
            return f"{self.path}: OK, all {self.steps} steps are allowed by the spec"
        return (f"{self.path}: NOT ALLOWED at line {self.line} (step {self.steps + 1}): "
                f"{self.why}\n  event: {json.dumps(self.event, sort_keys=True)}")


# ---------------------------------------------------------------------------
# Journal -> trace.
# ---------------------------------------------------------------------------


def _req(h: int) -> str:
    return f"h{h}"


def _s(x: str) -> str:
    return render(x)


def _tla_set(xs: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(set(xs))) + "}"


def _tla_fn(domain: str, default: str, items: Iterable[tuple[str, str]]) -> str:
    r"""``[x \in domain |-> default]`` with the exceptions ``items`` (key, value)."""
    base = f"[x \\in {domain} |-> {default}]"
    ex = [f"![{k}] = {v}" for k, v in items if v != default]
    return f"[{base} EXCEPT {', '.join(ex)}]" if ex else base


def choose_scale(values: Iterable[float]) -> int:
    """The coarsest 10^k (k <= 6) units per second making every value an integer."""
    vals = list(values)
    for k in range(7):
        scale = int(10**k)
        # tolerance: float noise of decimal times (0.1 + 0.2), relative to the value
        if all(abs(v * scale - round(v * scale)) <= 1e-9 * max(1.0, abs(v * scale))
               for v in vals):
            return scale
    raise TraceError("times are not multiples of a microsecond; cannot express them in "
                     "integer time units")


def _valid_register(ev: Register, capacity: int) -> bool:
    # The ledger's input validation (Ledger.register): checked before any guard.
    if not isinstance(ev.handle, int) or isinstance(ev.handle, bool) or ev.handle < 0:
        return False
    if not isinstance(ev.expected, int) or not 0 <= ev.expected <= 0xFFFF:
        return False
    blocks = ev.blocks
    if any(not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < capacity for b in blocks):
        return False
    return len(set(blocks)) == len(blocks)


def _effects(effects: Sequence[Effect]) -> dict[str, str]:
    frees: list[str] = []
    reclaimed: set[int] = set()
    rejected: list[str] = []
    acks: list[str] = []
    for e in effects:
        if isinstance(e, Free):
            st = "expired" if e.reason == R_EXPIRED else "freed"
            frees.append(f"[r |-> {_s(_req(e.handle))}, st |-> {_s(st)}, reason |-> "
                         f"{_s(e.reason)}, blocks |-> {{{', '.join(str(b) for b in sorted(e.blocks))}}}]")
            reclaimed.update(e.reclaimed)
        elif isinstance(e, Rejected):
            rejected.append(_s(e.reason))
        elif isinstance(e, Ack):
            refused = _tla_set(_s(_req(h)) for h in e.refused)
            pending = _tla_set(_s(_req(h)) for h in getattr(e, "pending", ()))
            acks.append(f"[refused |-> {refused}, pending |-> {pending}]")
    return {"frees": "<<" + ", ".join(frees) + ">>",
            "reclaimed": "{" + ", ".join(str(b) for b in sorted(reclaimed)) + "}",
            "rejected": "<<" + ", ".join(rejected) + ">>",
            "acks": "<<" + ", ".join(acks) + ">>"}


def _touched(ev: Event, capacity: int) -> list[int]:
    """The handles an event names (the requests its step reads or writes)."""
    if isinstance(ev, Register):
        return [ev.handle] if _valid_register(ev, capacity) else []
    if isinstance(ev, Done):
        return [ev.handle]
    if isinstance(ev, (Heartbeat, Release)):
        return list(ev.handles)
    return []


class _Replay:
    """The implementation's ledger replayed from the journal's events: each segment
    starts from its state (restricted to the segment's requests), and must end in it."""

    def __init__(self, cfg: Config, capacity: int, scale: int, no_group: str,
                 first_reg: dict[int, Register]) -> None:
        self.ledger = Ledger(cfg, BlockPool(capacity, strict=False))
        self.scale = scale
        self.no_group = no_group
        self.first_reg = first_reg

    def units(self, dt: float) -> int:
        return round(dt * self.scale)

    def ledger_record(self, handles: Sequence[int], blocks: str) -> tuple[str, str]:
        """The ledger as KVLedger's record over ``handles`` (the abstraction function of
        KVLedger.tla's header, time relative to the ledger's clock), and the request
        ids of the live ones (TraceLedger's ridOf)."""
        L = self.ledger
        now = L.now
        snap = L.snapshot()
        staged = {h: (since, msgs) for h, since, msgs in L.staged_entries()}
        cols: dict[str, list[tuple[str, str]]] = {k: [] for k in (
            "pstate", "expected", "finished", "released", "deadline", "reports", "staged",
            "stagedAge", "nfree")}
        rid: list[tuple[str, str]] = []
        held_blocks: dict[int, int] = {}
        for h in handles:
            r = _s(_req(h))
            st = L.state(h)
            cols["pstate"].append((r, _s(st)))
            live = snap.get(h)
            if live is not None:
                _st, exp, fin, rel, dl = live
                cols["expected"].append((r, str(exp)))
                cols["finished"].append((r, _tla_set(_s(d) for d in fin)))
                cols["released"].append((r, "TRUE" if rel else "FALSE"))
                cols["deadline"].append((r, str(self.units(dl - now))))
                cols["reports"].append((r, str(len(fin))))
                rid.append((r, _s(L.request_id(h) or "")))
            if st in lifecycle.TERMINAL_STATES:
                cols["nfree"].append((r, "1"))
            stg = staged.get(h)
            if stg is not None:
                since, msgs = stg
                cols["stagedAge"].append((r, str(self.units(now - since))))
                cols["staged"].append((r, "<<" + ", ".join(
                    f"[kind |-> {_s(k)}, reader |-> {_s(d)}, exp |-> {e}, age |-> "
                    f"{self.units(now - t) if k == lifecycle.HEARTBEAT else 0}]"
                    for k, d, e, t in msgs) + ">>"))
        for h in handles:
            reg = self.first_reg.get(h)
            if reg is not None:
                for b in reg.blocks:
                    held_blocks[b] = L.pool.refcount(b)
        defaults = {"pstate": _s(lifecycle.UNREGISTERED), "expected": "0", "finished": "{}",
                    "released": "FALSE", "deadline": "0", "reports": "0", "staged": "<<>>",
                    "stagedAge": "0", "nfree": "0"}
        fields = {k: _tla_fn("Requests", defaults[k], v) for k, v in cols.items()}
        fields["rc"] = _tla_fn(blocks, "0", ((str(b), str(n)) for b, n in held_blocks.items()))
        fields["stagedQ"] = "<<" + ", ".join(_s(_req(h)) for h in staged) + ">>"
        groups = {reg.group for h in handles
                  if (reg := self.first_reg.get(h)) is not None and reg.group is not None}
        fields["groupsDone"] = _tla_set(_s(g) for g in L.groups_done() if g in groups)
        rec = "[" + ", ".join(f"{k} |-> {fields[k]}" for k in _KV_VARS) + "]"
        return rec, _tla_fn("Requests", '""', rid)


DEFAULT_SEGMENT_STEPS: Final = 250


def journal_to_trace(path: str | Path) -> Trace:
    """The whole journal as one trace (raises JournalError / TraceError)."""
    return journal_to_traces(path, 0)[0]


def journal_to_traces(path: str | Path, segment_steps: int = DEFAULT_SEGMENT_STEPS) -> list[Trace]:
    """Read a journal and cut it into traces of ``segment_steps`` steps (0: one trace).

    Each segment's requests are the live and staged ones at its start plus those its
    events name, so a step costs TLC O(live + segment) instead of O(journal): time grows
    linearly with the journal. A segment starts from the replayed implementation's state
    and TraceLedger checks that the spec's state at its end is the replayed state at the
    next segment's start: the segments chain into one behaviour of the spec.
    Raises JournalError / TraceError."""
    # Read as bytes, within journal.py's limits (line length, nesting, capacity).
    with open(path, "rb") as f:
        header, objs = read_journal_objects(journal_lines(f))
        raw: dict[int, dict[str, Any]] = {}  # the raw event objects, for the report
        rows: list[tuple[int, Event, list[Effect]]] = []
        for lineno, d in objs:
            raw[lineno] = d["event"]
            rows.append((lineno, *decode_row(lineno, d)))
    try:
        cfg = Config.from_dict(header.get("config", {}))
    except (ConfigError, TypeError) as e:
        raise TraceError(f"journal header config: {e}") from None
    capacity = header_capacity(header)

    durations = [cfg.initial_lease, cfg.lease_extension, cfg.abort_grace, cfg.max_staged_age]
    times = [float(ev.now) for _, ev, _ in rows]
    scale = choose_scale(durations + times)

    def units(x: float) -> int:
        return round(x * scale)

    readers: set[str] = set()
    first_reg: dict[int, Register] = {}
    groups: set[str] = set()
    for _, ev, _ in rows:
        if isinstance(ev, Register):
            if _valid_register(ev, capacity) and ev.handle not in first_reg:
                first_reg[ev.handle] = ev
                if ev.group is not None:
                    groups.add(ev.group)
        elif isinstance(ev, (Done, Heartbeat, Release)):
            readers.add(ev.reader)
    if len(first_reg) > cfg.max_tombstones or len(groups) > cfg.max_groups_remembered:
        raise TraceError("more requests (or groups) than the ledger remembers tombstones "
                         "for: outside the spec's assumptions (no eviction)")
    no_group = "nogroup"
    while no_group in groups:
        no_group += "_"

    fixed = {
        "Readers": _tla_set(_s(d) for d in readers),
        "NoGroup": _s(no_group),
        "InitialLease": str(units(cfg.initial_lease)),
        "LeaseExtension": str(units(cfg.lease_extension)),
        "AbortGrace": str(units(cfg.abort_grace)),
        "MaxStaged": str(cfg.max_staged),
        "MaxStagedMsgs": str(lifecycle.MAX_STAGED_MSGS_PER_HANDLE),
        "MaxStagedAge": str(units(cfg.max_staged_age)),
        "LedgerMaxExpected": "0",
        "BugCountMessages": "FALSE",
        "BugDropEarly": "FALSE",
        "BugAbortFreesNow": "FALSE",
    }

    def per_request(hs: Sequence[int], f: Any, default: str) -> str:
        return _tla_fn("Requests", default, ((_s(_req(h)), f(first_reg[h]))
                                             for h in hs if h in first_reg))

    steps: list[str] = []
    lines: list[int] = []
    prev: int | None = None
    for lineno, ev, effs in rows:
        t = units(float(ev.now))
        t = t if prev is None else max(prev, t)
        dt = 0 if prev is None else t - prev
        prev = t
        if dt > TLC_INT_MAX:
            raise TraceError(f"line {lineno}: time step of {dt} units overflows TLC integers")
        fld: dict[str, str] = {"type": '"stutter"', "dt": str(dt), "r": '""', "rs": "<<>>",
                             "d": '""', "e": "0", "rid": '""', "valid": "TRUE"}
        if isinstance(ev, Register):
            valid = _valid_register(ev, capacity)
            fld.update(type='"register"', r=_s(_req(ev.handle)) if valid else '""',
                     rid=_s(str(ev.request_id)), valid="TRUE" if valid else "FALSE")
        elif isinstance(ev, Done):
            fld.update(type='"done"', r=_s(_req(ev.handle)), d=_s(ev.reader), e=str(ev.expected))
        elif isinstance(ev, (Release, Heartbeat)):
            fld.update(type=_s("release" if isinstance(ev, Release) else "heartbeat"),
                     rs="<<" + ", ".join(_s(_req(h)) for h in ev.handles) + ">>",
                     d=_s(ev.reader), e=str(ev.expected))
        elif isinstance(ev, Abort):
            fld.update(type='"abort"', rid=_s(ev.request_id))
        elif isinstance(ev, Tick):
            fld.update(type='"tick"')
        elif isinstance(ev, Reject):
            pass
        fld.update(_effects(effs))
        steps.append("[" + ", ".join(f"{k} |-> {v}" for k, v in fld.items()) + "]")
        lines.append(lineno)

    n = len(rows)
    seg = n if segment_steps <= 0 else segment_steps
    bounds = list(range(0, n, max(seg, 1))) or [0]
    replay = _Replay(cfg, capacity, scale, no_group, first_reg)
    traces: list[Trace] = []
    for lo in bounds:
        hi = min(n, lo + max(seg, 1)) if n else 0
        L = replay.ledger
        hs: set[int] = set(L.live_handles())
        hs.update(h for h, _, _ in L.staged_entries())
        for _, ev, _ in rows[lo:hi]:
            hs.update(_touched(ev, capacity))
        handles = sorted(hs)
        blocks = sorted({b for h in handles if h in first_reg for b in first_reg[h].blocks})
        constants = {
            **fixed,
            "Requests": _tla_set(_s(_req(h)) for h in handles),
            "Blocks": "{" + ", ".join(str(b) for b in blocks) + "}",
            "BlocksOf": per_request(handles, lambda ev: "{" + ", ".join(
                str(b) for b in sorted(ev.blocks)) + "}", "{}"),
            "GroupOf": per_request(handles, lambda ev: _s(
                ev.group if ev.group is not None else no_group), _s(no_group)),
            "RegExpected": per_request(handles, lambda ev: str(ev.expected), "0"),
        }
        constants["InitL"], constants["InitRid"] = replay.ledger_record(handles, "Blocks")
        for _, ev, _ in rows[lo:hi]:
            L.apply(ev)
        constants["EndL"], _ = replay.ledger_record(handles, "Blocks")
        traces.append(Trace(str(path), scale, constants, steps[lo:hi], lines[lo:hi],
                            [raw.get(k, {}) for k in lines[lo:hi]], lo))
    return traces


# ---------------------------------------------------------------------------
# Batches and TLC.
# ---------------------------------------------------------------------------



def batch_module(name: str, traces: Sequence[Trace]) -> tuple[str, str]:
    """The TLA+ module and config checking ``traces`` (one INSTANCE each)."""
    out = [f"---- MODULE {name} ----",
           "(* GENERATED by kvproto validate: one INSTANCE of a trace module per segment. *)",
           "EXTENDS Integers, Sequences, TLC", "VARIABLE st"]
    for k, tr in enumerate(traces, start=1):
        out.append(f"\\* {tr.path}")
        out.append(f"Trace{k} == <<" + ",\n  ".join(tr.steps) + ">>")
        # Each constant is a top-level definition, substituted by name: TLC evaluates a
        # constant-level definition once, but re-evaluates a substituted expression at
        # every use (a BlocksOf literal of n requests at every lookup: quadratic or worse).
        # Functions over the segment's requests or blocks name their domain, which is
        # this trace's constant here.
        for c, v in tr.constants.items():
            v = v.replace("[x \\in Requests |->", f"[x \\in Requests_{k} |->")
            v = v.replace("[x \\in Blocks |->", f"[x \\in Blocks_{k} |->")
            out.append(f"{c}_{k} == {v}")
        subs = [f"{c} <- {c}_{k}" for c in tr.constants]
        # The spec's variables are not used by the trace operators (they work on records).
        subs += [f"{v} <- st" for v in tr.spec_vars]
        subs += [f"Trace <- Trace{k}", f"TraceId <- {k}", "tst <- st"]
        out.append(f"T{k} == INSTANCE {tr.module} WITH " + ",\n    ".join(subs))
    out.append("Init == " + " \\/ ".join(f"T{k}!TInit" for k in range(1, len(traces) + 1)))
    out.append("Next == " + " \\/ ".join(f"(st.tid = {k} /\\ T{k}!TNext)"
                                          for k in range(1, len(traces) + 1)))
    out.append("====")
    return "\n".join(out) + "\n", "INIT Init\nNEXT Next\n"


def batches(traces: Sequence[Trace], max_bytes: int) -> list[list[Trace]]:
    out: list[list[Trace]] = []
    cur: list[Trace] = []
    size = 0
    for tr in traces:
        s = tr.tla_size()
        if cur and size + s > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(tr)
        size += s
    if cur:
        out.append(cur)
    return out


# A verdict printed by TraceLedger (PrintT wraps long tuples over several lines; the
# reasons it prints contain no ">>").
_VERDICT_RE: Final = re.compile(r'^<<\s*"(?:ACCEPT|REJECT)".*?>>', re.M | re.S)


DEFAULT_TIMEOUT: Final = 600.0  # seconds of TLC per batch


def check_batch(traces: Sequence[Trace], *, workdir: Path | None = None,
                workers: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Verdict]:
    """One TLC run over several traces."""
    wd = Path(tempfile.mkdtemp(prefix="validate-")) if workdir is None else workdir
    wd.mkdir(parents=True, exist_ok=True)
    try:
        for rel in sorted({f for tr in traces for f in tr.files}):
            shutil.copy(spec_dir() / rel, wd / Path(rel).name)
        name = "TraceBatch"
        mod, cfg = batch_module(name, traces)
        (wd / f"{name}.tla").write_text(mod, encoding="utf-8")
        (wd / f"{name}.cfg").write_text(cfg, encoding="utf-8")
        run = require_ok(run_tlc(f"{name}.cfg", module=name, workdir=wd, workers=workers,
                                 args=["-nowarning", "-deadlock"], timeout=timeout))
        log.info("TLC checked %d journal(s), %d steps, in %.1fs", len(traces),
                 sum(len(t.steps) for t in traces), run.seconds)
        found: dict[int, Verdict] = {}
        for m in _VERDICT_RE.finditer(run.output):
            try:
                v = parse_value(m.group(0))
            except ParseError:
                continue
            assert isinstance(v, tuple)
            k = v[1]
            assert isinstance(k, int)
            tr = traces[k - 1]
            if v[0] == "ACCEPT":
                found[k] = Verdict(tr.path, True, tr.offset + len(tr.steps))
            else:
                step, why = v[2], v[3]
                assert isinstance(step, int) and isinstance(why, str)
                found[k] = Verdict(tr.path, False, tr.offset + step - 1, tr.lines[step - 1],
                                   tr.events[step - 1], why)
        missing = [traces[k - 1].path for k in range(1, len(traces) + 1) if k not in found]
        if missing:
            raise TLCError(f"TLC gave no verdict for {missing}", run.output)
        return [found[k] for k in range(1, len(traces) + 1)]
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)


def validate(paths: Sequence[str | Path], *, batch_bytes: int = DEFAULT_BATCH_BYTES,
             workdir: Path | None = None, timeout: float = DEFAULT_TIMEOUT,
             segment_steps: int = DEFAULT_SEGMENT_STEPS) -> list[Verdict]:
    """Validate journals, one verdict each (raises JournalError/TraceError on bad input,
    TLCMissing). A journal is allowed when all its segments are; otherwise its verdict
    is its first segment's rejection."""
    from kvproto.verify.dconformance import is_d_journal
    from kvproto.verify.dtrace import d_journal_to_traces

    per_path: list[list[Trace]] = []
    for p in paths:
        try:
            if is_d_journal(p):  # one D rank's journal: TraceConsumer over KVConsumer
                per_path.append(d_journal_to_traces(p, segment_steps))
            else:
                per_path.append(journal_to_traces(p, segment_steps))
        except (JournalError, TraceError) as e:  # name the file: several may be given
            raise TraceError(f"{p}: {e}") from None
    traces = [t for ts in per_path for t in ts]
    seg_verdicts: list[Verdict] = []
    for i, b in enumerate(batches(traces, batch_bytes)):
        seg_verdicts += check_batch(b, workdir=None if workdir is None else workdir / f"batch{i}",
                                    timeout=timeout)
    verdicts: list[Verdict] = []
    it = iter(seg_verdicts)
    for ts in per_path:
        segs = [next(it) for _ in ts]
        bad = next((v for v in segs if not v.allowed), None)
        verdicts.append(bad if bad is not None else segs[-1])
    return verdicts


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journals", nargs="+", metavar="JOURNAL.jsonl",
                   help="event journals (kvproto simulate --journal, or the NIXL adapters)")
    from kvproto.cli import number

    p.add_argument("--batch-bytes", type=number(1, 1 << 30, integer=True),
                   default=DEFAULT_BATCH_BYTES,
                   help="TLA+ text per TLC run when checking several journals "
                        f"(default {DEFAULT_BATCH_BYTES})")
    p.add_argument("--timeout", type=number(0, 7 * 86400, lo_open=True),
                   default=DEFAULT_TIMEOUT, metavar="S",
                   help="give up a batch after S seconds of TLC (exit 4; default "
                        f"{DEFAULT_TIMEOUT:.0f})")
    p.add_argument("--segment-steps", type=number(0, 1 << 30, integer=True), default=DEFAULT_SEGMENT_STEPS, metavar="N",
                   help="validate each journal in segments of N steps, chained through the "
                        "replayed ledger state (time grows linearly with the journal); 0 = "
                        f"one piece (default {DEFAULT_SEGMENT_STEPS})")
    p.add_argument("--keep", metavar="DIR",
                   help="write the generated TLA+ modules here and keep them")


def run(args: argparse.Namespace) -> int:
    from kvproto.verify.dconformance import check_d_journal, is_d_journal

    d_paths = [p for p in args.journals if is_d_journal(p)]
    d_ok = True
    for p in d_paths:  # one D rank's journal: replayed against D's table, then TLC below
        try:
            dv = check_d_journal(p)
        except (JournalError, OSError, json.JSONDecodeError) as e:
            print(f"kvproto validate: bad input: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(dv.describe())
        d_ok &= dv.allowed
    try:
        verdicts = validate(args.journals, batch_bytes=args.batch_bytes,
                            workdir=Path(args.keep) if args.keep else None,
                            timeout=getattr(args, "timeout", DEFAULT_TIMEOUT),
                            segment_steps=getattr(args, "segment_steps", DEFAULT_SEGMENT_STEPS))
    except (JournalError, TraceError, OSError, json.JSONDecodeError) as e:
        print(f"kvproto validate: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TLCMissing as e:
        print(f"kvproto validate: {e}", file=sys.stderr)
        return EXIT_MISSING
    except TLCError as e:
        print(f"kvproto validate: {e}", file=sys.stderr)
        log.debug("TLC output:\n%s", e.output[-4000:])
        return 4
    for v in verdicts:
        print(v.describe())
    return EXIT_OK if d_ok and all(v.allowed for v in verdicts) else EXIT_NOT_ALLOWED


