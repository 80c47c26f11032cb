"""P journals as TLA+ traces (TraceLedger over KVLedger).

Mapping journal -> spec (TraceLedger.tla's header): handle h -> request "h<h>"; readers keep
their names; blocks keep their ids; group None -> NoGroup; request ids are tracked for
abort (abort names a request id) and for duplicate registers; times are the journal's
integer milliseconds (one TLA+ time unit), clamped to be monotone like the ledger's clock; ``reject`` events are stuttering steps.

Long journals are checked in segments: each segment names only the requests live or staged
at its start and those its events touch, starts from the journal's events replayed through
the Python ledger, and must end in the replayed state (TraceLedger's EndL), so the segments
chain into one behaviour and TLC's time grows linearly with the journal's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvproto import lifecycle
from kvproto.journal import (
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
from kvproto.verify.trace import (
    DEFAULT_SEGMENT_STEPS,
    KV_VARS,
    TLC_INT_MAX,
    Trace,
    TraceError,
    req_name,
    tla_fn,
    tla_set,
    tla_str,
)


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
            frees.append(f"[r |-> {tla_str(req_name(e.handle))}, st |-> {tla_str(st)}, reason |-> "
                         f"{tla_str(e.reason)}, blocks |-> {{{', '.join(str(b) for b in sorted(e.blocks))}}}]")
            reclaimed.update(e.reclaimed)
        elif isinstance(e, Rejected):
            rejected.append(tla_str(e.reason))
        elif isinstance(e, Ack):
            refused = tla_set(tla_str(req_name(h)) for h in e.refused)
            pending = tla_set(tla_str(req_name(h)) for h in getattr(e, "pending", ()))
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

    def __init__(self, cfg: Config, capacity: int, no_group: str,
                 first_reg: dict[int, Register]) -> None:
        self.ledger = Ledger(cfg, BlockPool(capacity, strict=False))
        self.no_group = no_group
        self.first_reg = first_reg

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
            r = tla_str(req_name(h))
            st = L.state(h)
            cols["pstate"].append((r, tla_str(st)))
            live = snap.get(h)
            if live is not None:
                _st, exp, fin, rel, dl = live
                cols["expected"].append((r, str(exp)))
                cols["finished"].append((r, tla_set(tla_str(d) for d in fin)))
                cols["released"].append((r, "TRUE" if rel else "FALSE"))
                cols["deadline"].append((r, str(dl - now)))
                cols["reports"].append((r, str(len(fin))))
                rid.append((r, tla_str(L.request_id(h) or "")))
            if st in lifecycle.TERMINAL_STATES:
                cols["nfree"].append((r, "1"))
            stg = staged.get(h)
            if stg is not None:
                since, msgs = stg
                cols["stagedAge"].append((r, str(now - since)))
                cols["staged"].append((r, "<<" + ", ".join(
                    f"[kind |-> {tla_str(k)}, reader |-> {tla_str(d)}, exp |-> {e}, age |-> "
                    f"{now - t if k == lifecycle.HEARTBEAT else 0}]"
                    for k, d, e, t in msgs) + ">>"))
        for h in handles:
            reg = self.first_reg.get(h)
            if reg is not None:
                for b in reg.blocks:
                    held_blocks[b] = L.pool.refcount(b)
        defaults = {"pstate": tla_str(lifecycle.UNREGISTERED), "expected": "0", "finished": "{}",
                    "released": "FALSE", "deadline": "0", "reports": "0", "staged": "<<>>",
                    "stagedAge": "0", "nfree": "0"}
        fields = {k: tla_fn("Requests", defaults[k], v) for k, v in cols.items()}
        fields["rc"] = tla_fn(blocks, "0", ((str(b), str(n)) for b, n in held_blocks.items()))
        fields["stagedQ"] = "<<" + ", ".join(tla_str(req_name(h)) for h in staged) + ">>"
        groups = {reg.group for h in handles
                  if (reg := self.first_reg.get(h)) is not None and reg.group is not None}
        fields["groupsDone"] = tla_set(tla_str(g) for g in L.groups_done() if g in groups)
        rec = "[" + ", ".join(f"{k} |-> {fields[k]}" for k in KV_VARS) + "]"
        return rec, tla_fn("Requests", '""', rid)



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

    ms = cfg.ms
    if max(ms.initial_lease, ms.lease_extension, ms.abort_grace, ms.max_staged_age) \
            > TLC_INT_MAX:
        raise TraceError("a lease duration overflows TLC's integers in milliseconds")

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
        "Readers": tla_set(tla_str(d) for d in readers),
        "NoGroup": tla_str(no_group),
        "InitialLease": str(ms.initial_lease),
        "LeaseExtension": str(ms.lease_extension),
        "AbortGrace": str(ms.abort_grace),
        "MaxStaged": str(cfg.max_staged),
        "MaxStagedMsgs": str(lifecycle.MAX_STAGED_MSGS_PER_HANDLE),
        "MaxStagedAge": str(ms.max_staged_age),
        "LedgerMaxExpected": "0",
        "BugCountMessages": "FALSE",
        "BugDropEarly": "FALSE",
        "BugAbortFreesNow": "FALSE",
    }

    def per_request(hs: Sequence[int], f: Any, default: str) -> str:
        return tla_fn("Requests", default, ((tla_str(req_name(h)), f(first_reg[h]))
                                             for h in hs if h in first_reg))

    steps: list[str] = []
    lines: list[int] = []
    prev: int | None = None
    for lineno, ev, effs in rows:
        t = ev.now
        t = t if prev is None else max(prev, t)
        dt = 0 if prev is None else t - prev
        prev = t
        if dt > TLC_INT_MAX:
            raise TraceError(f"line {lineno}: time step of {dt} ms overflows TLC integers")
        fld: dict[str, str] = {"type": '"stutter"', "dt": str(dt), "r": '""', "rs": "<<>>",
                             "d": '""', "e": "0", "rid": '""', "valid": "TRUE"}
        if isinstance(ev, Register):
            valid = _valid_register(ev, capacity)
            fld.update(type='"register"', r=tla_str(req_name(ev.handle)) if valid else '""',
                     rid=tla_str(str(ev.request_id)), valid="TRUE" if valid else "FALSE")
        elif isinstance(ev, Done):
            fld.update(type='"done"', r=tla_str(req_name(ev.handle)), d=tla_str(ev.reader), e=str(ev.expected))
        elif isinstance(ev, (Release, Heartbeat)):
            fld.update(type=tla_str("release" if isinstance(ev, Release) else "heartbeat"),
                     rs="<<" + ", ".join(tla_str(req_name(h)) for h in ev.handles) + ">>",
                     d=tla_str(ev.reader), e=str(ev.expected))
        elif isinstance(ev, Abort):
            fld.update(type='"abort"', rid=tla_str(ev.request_id))
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
    replay = _Replay(cfg, capacity, no_group, first_reg)
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
            "Requests": tla_set(tla_str(req_name(h)) for h in handles),
            "Blocks": "{" + ", ".join(str(b) for b in blocks) + "}",
            "BlocksOf": per_request(handles, lambda ev: "{" + ", ".join(
                str(b) for b in sorted(ev.blocks)) + "}", "{}"),
            "GroupOf": per_request(handles, lambda ev: tla_str(
                ev.group if ev.group is not None else no_group), tla_str(no_group)),
            "RegExpected": per_request(handles, lambda ev: str(ev.expected), "0"),
        }
        constants["InitL"], constants["InitRid"] = replay.ledger_record(handles, "Blocks")
        for _, ev, _ in rows[lo:hi]:
            L.apply(ev)
        constants["EndL"], _ = replay.ledger_record(handles, "Blocks")
        traces.append(Trace(str(path), constants, steps[lo:hi], lines[lo:hi],
                            [raw.get(k, {}) for k in lines[lo:hi]], lo))
    return traces
