"""Journal traces for TLC: the ``Trace`` a journal segment becomes, its ``Verdict``, the
TLA+ literal helpers, and the batch runner that checks many traces in one TLC run.

Both machines' journals become traces here: P's through :mod:`kvproto.verify.ptrace`
(TraceLedger over KVLedger), D's through :mod:`kvproto.verify.dtrace` (TraceConsumer over
KVConsumer); :mod:`kvproto.verify.validate` is the command that runs them.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvproto.errors import UsageError
from kvproto.verify.tlc import (
    ParseError,
    TLCError,
    parse_value,
    render,
    require_ok,
    run_tlc,
    spec_dir,
)

log = logging.getLogger(__name__)

TLC_INT_MAX: Final = 2**31 - 1
DEFAULT_BATCH_BYTES: Final = 800_000


class TraceError(UsageError, ValueError):
    """The journal cannot be expressed as a trace of the spec (bad input)."""


# KVLedger's variables (the trace module works on a record of them).
KV_VARS: Final = ("pstate", "expected", "finished", "released", "deadline", "reports", "rc",
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
    machine's journals name their own. Times are the journal's own integers: one TLA+
    time unit is one millisecond, as in the machines, so no scale and no rounding."""

    path: str
    constants: dict[str, str]  # TLA+ constant name -> TLA+ expression
    steps: list[str]  # TLA+ record literals
    lines: list[int]
    events: list[dict[str, Any]]  # the journal's event objects (for the report)
    offset: int = 0
    module: str = "TraceLedger"
    spec_vars: tuple[str, ...] = KV_VARS
    files: tuple[str, ...] = ("KVLedger.tla", "conformance/TraceLedger.tla")

    def tla_size(self) -> int:
        return sum(len(s) + 2 for s in self.steps) + sum(len(v) for v in self.constants.values())


@dataclass
class Verdict:
    """A journal's verdict. ``engines``: the P engines a D journal was traced for, one
    trace each (``kvproto.verify.dsplit``); ``replayed``: why TLC could not trace it
    (then the verdict is its replay through D's table)."""

    path: str
    allowed: bool
    steps: int
    line: int | None = None
    event: dict[str, Any] | None = None
    why: str = ""
    engines: int = 1
    replayed: str = ""

    @property
    def status(self) -> str:
        """``valid`` (TLC allows it), ``traced`` (TLC allows each P engine's part, and the
        whole journal replays through D's table), ``replayed`` (not traceable: replayed
        through D's table with every invariant), or ``invalid``."""
        if not self.allowed:
            return "invalid"
        return "replayed" if self.replayed else "traced" if self.engines > 1 else "valid"

    def describe(self) -> str:
        if self.replayed:
            what = "OK" if self.allowed else f"NOT ALLOWED: {self.why}"
            return (f"{self.path}: {what}, replayed through D's table ({self.steps} events; "
                    f"not traced by TLC: {self.replayed})")
        if self.allowed and self.engines > 1:
            return (f"{self.path}: OK, traced per P engine ({self.engines} engines, "
                    f"{self.steps} steps, all allowed by the spec) and replayed whole "
                    "through D's table")
        if self.allowed:
            return f"{self.path}: OK, all {self.steps} steps are allowed by the spec"
        if self.line is None:
            return f"{self.path}: NOT ALLOWED: {self.why}"
        return (f"{self.path}: NOT ALLOWED at line {self.line} (step {self.steps + 1}): "
                f"{self.why}\n  event: {json.dumps(self.event, sort_keys=True)}")


# ---------------------------------------------------------------------------
# TLA+ literals.
# ---------------------------------------------------------------------------


def req_name(h: int) -> str:
    return f"h{h}"


def tla_str(x: str) -> str:
    return render(x)


def tla_set(xs: Iterable[str]) -> str:
    return "{" + ", ".join(sorted(set(xs))) + "}"


def tla_fn(domain: str, default: str, items: Iterable[tuple[str, str]]) -> str:
    r"""``[x \in domain |-> default]`` with the exceptions ``items`` (key, value)."""
    base = f"[x \\in {domain} |-> {default}]"
    ex = [f"![{k}] = {v}" for k, v in items if v != default]
    return f"[{base} EXCEPT {', '.join(ex)}]" if ex else base


DEFAULT_SEGMENT_STEPS: Final = 250


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
