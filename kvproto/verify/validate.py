"""``kvproto validate JOURNAL.jsonl...``: is a recorded journal a behaviour of the spec?

Each journal (from the simulator, or later from the NIXL adapters) is turned into a
TLA+ trace literal and checked by TLC against ``kvproto/tla/KVLedger.tla`` through
``kvproto/tla/conformance/TraceLedger.tla``: every step applies the spec's own transition
operators and checks that the recorded effects (frees, reclaimed blocks, acks,
rejections) are exactly the spec's. The first step the spec does not allow is reported
with its journal line. Several journals are checked in one TLC run (batches of about
``--batch-bytes`` of TLA+ text: SANY's parse time dominates).

A D journal whose P restarted names several P engines; KVConsumer models one, so each
engine's part of the journal is traced on its own (``kvproto.verify.dsplit`` says why
that is sound) and the whole journal is replayed through D's table for what the parts
share.

Long journals are checked in segments (``--segment-steps``): each segment names only the
requests live or staged at its start and those its events touch, starts from the
journal's events replayed through the Python ledger, and must end in the replayed state
(TraceLedger's EndL), so the segments chain into one behaviour and TLC's time grows
linearly with the journal's length.

Mapping journal -> spec (TraceLedger.tla's header): handle h -> request "h<h>"; readers keep
their names; blocks keep their ids; group None -> NoGroup; request ids are tracked for
abort (abort names a request id) and for duplicate registers; times are the journal's
integer milliseconds, one TLA+ time unit each (a version 1 journal's seconds are read as
milliseconds), clamped to be monotone like the ledger's clock; ``reject`` events are
stuttering steps.

Exit codes: 0 every journal is allowed; 1 some journal is not; 2 bad input (unreadable
journal, a version 1 time that is not whole milliseconds, outside the spec's
assumptions); 3 Java/TLC missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from kvproto.journal import (
    JournalError,
)
from kvproto.verify.dconformance import check_d_journal, is_d_journal
from kvproto.verify.dsplit import SplitError
from kvproto.verify.dtrace import d_journal_engine_traces
from kvproto.verify.ptrace import journal_to_traces
from kvproto.verify.tlc import (
    MissingDependency,
    TLCError,
    default_workers,
)
from kvproto.verify.trace import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_SEGMENT_STEPS,
    DEFAULT_TIMEOUT,
    Trace,
    TraceError,
    Verdict,
    batches,
    check_batch,
)

log = logging.getLogger(__name__)

TLCMissing = MissingDependency

EXIT_OK: Final = 0
EXIT_NOT_ALLOWED: Final = 1
EXIT_BAD_INPUT: Final = 2
EXIT_MISSING: Final = 3


def validate(paths: Sequence[str | Path], *, batch_bytes: int = DEFAULT_BATCH_BYTES,
             workdir: Path | None = None, timeout: float = DEFAULT_TIMEOUT,
             segment_steps: int = DEFAULT_SEGMENT_STEPS,
             jobs: int | None = None) -> list[Verdict]:
    """Validate journals, one verdict each (raises JournalError/TraceError on bad input,
    TLCMissing). A journal is allowed when all its segments are; otherwise its verdict
    is its first segment's rejection. The traces go to TLC in batches of about
    ``batch_bytes``, at most ``jobs`` TLC runs at a time (default: ``default_workers()``,
    one per core or ``$KVPROTO_TLC_WORKERS``), each with one TLC worker. A D journal
    that names several P engines (its P restarted) is traced per engine
    (``kvproto.verify.dsplit``) and replayed whole (verdict status ``traced``); one that
    cannot be split is replayed only (``replayed``, with the reason, logged)."""
    per_path: list[list[Trace]] = []
    engines: list[int] = []  # P engines traced separately, per journal
    replayed: dict[int, Verdict] = {}  # journals TLC cannot trace: their replay's verdict
    for k, p in enumerate(paths):
        try:
            if is_d_journal(p):  # one D rank's journal: TraceConsumer over KVConsumer
                try:
                    parts = d_journal_engine_traces(p, segment_steps)
                except SplitError as e:
                    log.warning("%s: not traced by TLC (%s): replayed through D's table",
                                p, e)
                    replayed[k] = _replay_verdict(p, str(e))
                    parts = []
                per_path.append([t for _, ts in parts for t in ts])
                engines.append(len(parts))
            else:
                per_path.append(journal_to_traces(p, segment_steps))
                engines.append(1)
        except (JournalError, TraceError) as e:  # name the file: several may be given
            raise TraceError(f"{p}: {e}") from None
    traces = [t for ts in per_path for t in ts]
    seg_verdicts = [v for vs in _check_batches(list(batches(traces, batch_bytes)), workdir,
                                               timeout, jobs)
                    for v in vs]
    verdicts: list[Verdict] = []
    it = iter(seg_verdicts)
    for k, (p, ts) in enumerate(zip(paths, per_path, strict=True)):
        segs = [next(it) for _ in ts]
        bad = next((v for v in segs if not v.allowed), None)
        if k in replayed:
            verdicts.append(replayed[k])
        elif bad is not None:
            verdicts.append(bad)
        elif engines[k] > 1:
            # Each P engine's part is a behaviour of KVConsumer; what the parts share (the
            # tick's work budget, the effects of each whole tick, ended loads across
            # engines) is checked by replaying the whole journal through D's table.
            dv = check_d_journal(p)
            steps = sum(len(t.steps) for t in ts)
            verdicts.append(Verdict(str(p), dv.allowed, steps, engines=engines[k],
                                    why=_first_problems(dv.problems)))
        else:
            verdicts.append(segs[-1])
    return verdicts


def _check_batches(bs: list[list[Trace]], workdir: Path | None, timeout: float,
                   jobs: int | None) -> list[list[Verdict]]:
    """Each batch's verdicts, in order. Batches are independent TLC runs (one JVM each,
    its own directory), so up to ``jobs`` run side by side; the first failure is raised
    once every started run has ended."""
    def one(i: int) -> list[Verdict]:
        return check_batch(bs[i], workdir=None if workdir is None else workdir / f"batch{i}",
                           timeout=timeout)

    n = max(1, min(len(bs), default_workers() if jobs is None else jobs))
    if n == 1:
        return [one(i) for i in range(len(bs))]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="tlc-batch") as pool:
        return list(pool.map(one, range(len(bs))))


def _replay_verdict(path: str | Path, reason: str) -> Verdict:
    """The verdict of a D journal TLC cannot trace (``reason``): its replay through D's
    table with every invariant (kvproto.verify.replay)."""
    dv = check_d_journal(path)
    return Verdict(str(path), dv.allowed, dv.events, why=_first_problems(dv.problems),
                   replayed=reason)


def _first_problems(problems: Sequence[str]) -> str:
    """A replay's first two problems, broken invariants before diverging effects."""
    return "; ".join(sorted(problems, key=lambda p: not p.startswith("VIOLATION"))[:2])


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
    p.add_argument("--jobs", type=number(1, 256, integer=True), default=None, metavar="N",
                   help="TLC runs (batches) at a time (default: one per core, at most 8, "
                        "or $KVPROTO_TLC_WORKERS)")


def run(args: argparse.Namespace) -> int:
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
                            segment_steps=getattr(args, "segment_steps", DEFAULT_SEGMENT_STEPS),
                            jobs=getattr(args, "jobs", None))
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
