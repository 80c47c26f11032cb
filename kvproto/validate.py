"""``kvproto validate JOURNAL.jsonl...``: is a recorded journal a behaviour of the spec?

Each journal (from the simulator, or later from the NIXL adapters) is turned into a
TLA+ trace literal and checked by TLC against ``tla/KVLedger.tla`` through
``tla/conformance/TraceLedger.tla``: every step applies the spec's own transition
operators and checks that the recorded effects (frees, reclaimed blocks, acks,
rejections) are exactly the spec's. The first step the spec does not allow is reported
with its journal line. Several journals are checked in one TLC run (batches of about
``--batch-bytes`` of TLA+ text: SANY's parse time dominates).

Mapping journal -> spec (spec/CONFORMANCE.md): handle h -> request "h<h>"; readers keep
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
from kvproto.conformance import (
    CONF_DIR,
    TLA_DIR,
    ParseError,
    TLCError,
    TLCMissing,
    parse_value,
    render,
    run_tlc,
)
from kvproto.journal import JournalError, read_journal
from kvproto.lifecycle import (
    R_EXPIRED,
    Abort,
    Ack,
    Config,
    ConfigError,
    Done,
    Effect,
    Free,
    Heartbeat,
    Register,
    Reject,
    Rejected,
    Release,
    Tick,
)

log = logging.getLogger(__name__)

EXIT_OK: Final = 0
EXIT_NOT_ALLOWED: Final = 1
EXIT_BAD_INPUT: Final = 2
EXIT_MISSING: Final = 3

TLC_INT_MAX: Final = 2**31 - 1
DEFAULT_BATCH_BYTES: Final = 800_000


class TraceError(ValueError):
    """The journal cannot be expressed as a trace of the spec (bad input)."""


@dataclass
class Trace:
    """One journal as TLA+ constants and steps; ``lines[i]`` is step i+1's journal line."""

    path: str
    scale: int  # time units per second
    constants: dict[str, str]  # TLA+ constant name -> TLA+ expression
    steps: list[str]  # TLA+ record literals
    lines: list[int]
    events: list[dict[str, Any]]  # the journal's event objects (for the report)

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


def journal_to_trace(path: str | Path) -> Trace:
    """Read a journal and build its trace (raises JournalError / TraceError)."""
    with open(path, encoding="utf-8") as f:
        header, body = read_journal(f)
        rows = list(body)
    try:
        cfg = Config.from_dict(header.get("config", {}))
    except (ConfigError, TypeError) as e:
        raise TraceError(f"journal header config: {e}") from None
    capacity = header.get("capacity")
    if not isinstance(capacity, int) or capacity < 1:
        raise TraceError("journal header lacks a valid capacity")
    # Re-read the raw event objects for the report (read_journal gives dataclasses).
    raw: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if lineno > 1 and line.strip():
                raw[lineno] = json.loads(line).get("event", {})

    durations = [cfg.initial_lease, cfg.lease_extension, cfg.abort_grace, cfg.max_staged_age]
    times = [float(ev.now) for _, ev, _ in rows]
    scale = choose_scale(durations + times)

    def units(x: float) -> int:
        return round(x * scale)

    requests: set[str] = set()
    readers: set[str] = set()
    first_reg: dict[int, Register] = {}
    groups: set[str] = set()
    for _, ev, _ in rows:
        if isinstance(ev, Register):
            if _valid_register(ev, capacity) and ev.handle not in first_reg:
                first_reg[ev.handle] = ev
                requests.add(_req(ev.handle))
                if ev.group is not None:
                    groups.add(ev.group)
        elif isinstance(ev, Done):
            requests.add(_req(ev.handle))
            readers.add(ev.reader)
        elif isinstance(ev, (Heartbeat, Release)):
            requests.update(_req(h) for h in ev.handles)
            readers.add(ev.reader)
    if len(first_reg) > cfg.max_tombstones or len(groups) > cfg.max_groups_remembered:
        raise TraceError("more requests (or groups) than the ledger remembers tombstones "
                         "for: outside the spec's assumptions (no eviction)")
    no_group = "nogroup"
    while no_group in groups:
        no_group += "_"
    blocks = sorted({b for ev in first_reg.values() for b in ev.blocks})

    def per_request(f: Any, default: str) -> str:
        if not requests:
            return "<<>>"
        parts = []
        for r in sorted(requests):
            h = int(r[1:])
            ev = first_reg.get(h)
            parts.append(f"{_s(r)} :> {f(ev) if ev is not None else default}")
        return "(" + " @@ ".join(parts) + ")"

    constants = {
        "Requests": _tla_set(_s(r) for r in requests),
        "Readers": _tla_set(_s(d) for d in readers),
        "Blocks": "{" + ", ".join(str(b) for b in blocks) + "}",
        "BlocksOf": per_request(lambda ev: "{" + ", ".join(str(b) for b in sorted(ev.blocks)) + "}",
                                "{}"),
        "GroupOf": per_request(lambda ev: _s(ev.group if ev.group is not None else no_group),
                               _s(no_group)),
        "NoGroup": _s(no_group),
        "RegExpected": per_request(lambda ev: str(ev.expected), "0"),
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
    return Trace(str(path), scale, constants, steps, lines, [raw.get(n, {}) for n in lines])


# ---------------------------------------------------------------------------
# Batches and TLC.
# ---------------------------------------------------------------------------

_KV_VARS: Final = ("pstate", "expected", "finished", "released", "deadline", "reports", "rc",
                   "stagedQ", "staged", "stagedAge", "groupsDone", "nfree")


def batch_module(name: str, traces: Sequence[Trace]) -> tuple[str, str]:
    """The TLA+ module and config checking ``traces`` (one INSTANCE each)."""
    out = [f"---- MODULE {name} ----",
           "(* GENERATED by kvproto validate: one INSTANCE of TraceLedger per journal. *)",
           "EXTENDS Naturals, Sequences, TLC", "VARIABLE st"]
    for k, tr in enumerate(traces, start=1):
        out.append(f"\\* {tr.path}")
        out.append(f"Trace{k} == <<" + ",\n  ".join(tr.steps) + ">>")
        subs = [f"{c} <- {v}" for c, v in tr.constants.items()]
        # KVLedger's variables are not used by the trace operators (they work on records).
        subs += [f"{v} <- st" for v in _KV_VARS]
        subs += [f"Trace <- Trace{k}", f"TraceId <- {k}", "tst <- st"]
        out.append(f"T{k} == INSTANCE TraceLedger WITH " + ",\n    ".join(subs))
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


_VERDICT_RE: Final = re.compile(r'^<<"(ACCEPT|REJECT)".*>>\s*$')


DEFAULT_TIMEOUT: Final = 600.0  # seconds of TLC per batch


def check_batch(traces: Sequence[Trace], *, workdir: Path | None = None,
                workers: int = 1, timeout: float = DEFAULT_TIMEOUT) -> list[Verdict]:
    """One TLC run over several traces."""
    wd = Path(tempfile.mkdtemp(prefix="validate-")) if workdir is None else workdir
    wd.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copy(TLA_DIR / "KVLedger.tla", wd / "KVLedger.tla")
        shutil.copy(CONF_DIR / "TraceLedger.tla", wd / "TraceLedger.tla")
        name = "TraceBatch"
        mod, cfg = batch_module(name, traces)
        (wd / f"{name}.tla").write_text(mod, encoding="utf-8")
        (wd / f"{name}.cfg").write_text(cfg, encoding="utf-8")
        run = run_tlc(wd / f"{name}.tla", wd / f"{name}.cfg", workers=workers,
                      extra=["-deadlock"], timeout=timeout)
        log.info("TLC checked %d journal(s), %d steps, in %.1fs", len(traces),
                 sum(len(t.steps) for t in traces), run.seconds)
        found: dict[int, Verdict] = {}
        for line in run.output.splitlines():
            if not _VERDICT_RE.match(line.strip()):
                continue
            try:
                v = parse_value(line.strip())
            except ParseError:
                continue
            assert isinstance(v, tuple)
            k = v[1]
            assert isinstance(k, int)
            tr = traces[k - 1]
            if v[0] == "ACCEPT":
                found[k] = Verdict(tr.path, True, len(tr.steps))
            else:
                step, why = v[2], v[3]
                assert isinstance(step, int) and isinstance(why, str)
                found[k] = Verdict(tr.path, False, step - 1, tr.lines[step - 1],
                                   tr.events[step - 1], why)
        missing = [traces[k - 1].path for k in range(1, len(traces) + 1) if k not in found]
        if missing:
            raise TLCError(f"TLC gave no verdict for {missing}", run.output)
        return [found[k] for k in range(1, len(traces) + 1)]
    finally:
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)


def validate(paths: Sequence[str | Path], *, batch_bytes: int = DEFAULT_BATCH_BYTES,
             workdir: Path | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[Verdict]:
    """Validate journals (raises JournalError/TraceError on bad input, TLCMissing)."""
    traces = [journal_to_trace(p) for p in paths]
    verdicts: list[Verdict] = []
    for i, b in enumerate(batches(traces, batch_bytes)):
        verdicts += check_batch(b, workdir=None if workdir is None else workdir / f"batch{i}",
                                timeout=timeout)
    return verdicts


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journals", nargs="+", metavar="JOURNAL.jsonl",
                   help="event journals (kvproto simulate --journal, or the NIXL adapters)")
    p.add_argument("--batch-bytes", type=int, default=DEFAULT_BATCH_BYTES,
                   help="TLA+ text per TLC run when checking several journals "
                        f"(default {DEFAULT_BATCH_BYTES})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help="give up a batch after S seconds of TLC (exit 4; default "
                        f"{DEFAULT_TIMEOUT:.0f}); TLC time grows faster than a journal's length")
    p.add_argument("--keep", metavar="DIR",
                   help="write the generated TLA+ modules here and keep them")


def run(args: argparse.Namespace) -> int:
    from kvproto.verify.dconformance import check_d_journal, is_d_journal

    d_paths = [p for p in args.journals if is_d_journal(p)]
    d_ok = True
    for p in d_paths:  # one D rank's journal: checked against D's table (no TLC)
        try:
            dv = check_d_journal(p)
        except (JournalError, OSError, json.JSONDecodeError) as e:
            print(f"kvproto validate: bad input: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(dv.describe())
        d_ok &= dv.allowed
    args.journals = [p for p in args.journals if p not in d_paths]
    if not args.journals:
        return EXIT_OK if d_ok else EXIT_NOT_ALLOWED
    try:
        verdicts = validate(args.journals, batch_bytes=args.batch_bytes,
                            workdir=Path(args.keep) if args.keep else None,
                            timeout=getattr(args, "timeout", DEFAULT_TIMEOUT))
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


