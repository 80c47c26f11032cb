"""``kvproto replay``: feed a journal's events to a fresh machine of its side (a ledger, or
a Consumer), compare the effects line by line, and check the safety invariants after every
step. Verification code: the production path (:mod:`kvproto.journal`) only writes journals.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

from kvproto.journal import (
    JournalError,
    header_capacity,
    header_config,
    journal_lines,
    journal_side,
    read_journal,
    to_json,
)
from kvproto.lifecycle import (
    R_ABORTED,
    R_EXPIRED,
    Admit,
    BlockPool,
    ClaimGranted,
    Config,
    Consumer,
    DTick,
    Finished,
    Free,
    Ledger,
    PostRead,
    Quarantined,
    ReadFailed,
    ReadOk,
    SendClaim,
    SendRelease,
)
from kvproto.verify.oracle import safety_violations


class ReplayResult:
    def __init__(self) -> None:
        self.events = 0
        self.divergences: list[str] = []
        self.violations: list[str] = []
        self.frees: dict[str, int] = {}  # P: frees per reason; D: finishes per state:reason
        self.side = "P"

    @property
    def ok(self) -> bool:
        return not self.divergences and not self.violations


def _replay_step(machine: Any, lineno: int, ev: Any, recorded: list[Any], res: ReplayResult,
                 out: IO[str] | None, max_reports: int) -> list[Any] | None:
    """Feed one journaled event to ``machine`` (a Ledger or a Consumer), write and compare
    its effects; None when the machine raised (recorded as a violation)."""
    try:
        got: list[Any] = machine.apply(ev)
    except Exception as e:
        res.violations.append(f"line {lineno}: machine raised {type(e).__name__}: {e}")
        return None
    res.events += 1
    if out is not None:
        for eff in got:
            out.write(json.dumps(to_json(eff), separators=(",", ":")) + "\n")
    if got != recorded and len(res.divergences) < max_reports:
        res.divergences.append(
            f"line {lineno}: {to_json(ev)['type']} effects differ\n"
            f"    recorded: {[to_json(e) for e in recorded]}\n"
            f"    replayed: {[to_json(e) for e in got]}")
    return got


def replay(source: Iterable[str] | Iterable[bytes] | IO[str] | IO[bytes],
           out: IO[str] | None = None, *,
           full_check_every: int = 1000, max_reports: int = 10) -> ReplayResult:
    """Replay a journal through a fresh machine of its side (a ledger, or a Consumer).
    Raises JournalError on unreadable input."""
    header, body = read_journal(source)
    config = header_config(header)
    if journal_side(header) == "D":
        return _replay_d(header, config, body, out, max_reports)
    capacity = header_capacity(header)
    pool = BlockPool(capacity, strict=False)
    ledger = Ledger(config, pool)
    res = ReplayResult()
    for lineno, ev, recorded in body:
        got = _replay_step(ledger, lineno, ev, recorded, res, out, max_reports)
        if got is None:
            break
        for eff in got:
            if isinstance(eff, Free):
                res.frees[eff.reason] = res.frees.get(eff.reason, 0) + 1
        for who, effs in (("replayed", got), ("recorded", recorded)):
            for eff in effs:
                if isinstance(eff, Free) and eff.reason in (R_EXPIRED, R_ABORTED) \
                        and eff.deadline > ev.now:
                    res.violations.append(
                        f"line {lineno}: NoFreeUnderRead: {who} free of handle {eff.handle} "
                        f"({eff.reason}) at {ev.now} before its lease deadline {eff.deadline}")
        bad = safety_violations(pool, ledger, recount=False, ledger_invariants=False)
        if bad:
            res.violations.extend(f"line {lineno}: {v}" for v in bad)
            break
        if full_check_every and res.events % full_check_every == 0:
            errs = ledger.check_invariants()
            if errs:
                res.violations.extend(f"line {lineno}: {e}" for e in errs)
                break
    if not res.violations:
        res.violations.extend(f"end: {e}" for e in ledger.check_invariants())
    return res


def _replay_d(header: dict[str, Any], config: Config, body: Iterator[tuple[int, Any, list[Any]]],
              out: IO[str] | None, max_reports: int) -> ReplayResult:
    """Replay one D rank's journal. Besides the effects, checks what D promises P: no
    release for a request whose READ is in flight, and at most one READ posted per
    sibling group (per P engine) unless the previous one failed; no READ of a request
    whose claim P has not granted (ReadOnlyGranted); and its bounded tick
    (TickBounded: no recorded tick fails more leases than ``max_tick_work``)."""
    machine = Consumer(str(header["reader"]), config)
    res = ReplayResult()
    res.side = "D"
    # NoQuarantinedReuse: READs posted whose transport has not reported their end, and
    # the quarantined ones among them. NoSecondPull: (engine, epoch, handle) of every READ
    # posted, and the rid -> key of admitted loads. Bounded by the journal's requests.
    in_flight: set[str] = set()
    quarantined: set[str] = set()
    pulled: set[tuple[str, int, int]] = set()
    key_of: dict[str, tuple[str, int, int]] = {}
    # ReadOnlyGranted: requests admitted with a capability whose claim (a recorded
    # SendClaim) P has not granted (a READ of one would race another consumer of the
    # handle); and the requests whose claim was sent.
    ungranted: set[str] = set()
    claimed: set[str] = set()
    for lineno, ev, recorded in body:
        if isinstance(ev, Admit):
            key_of[ev.request_id] = (ev.params.engine, ev.params.epoch, ev.params.handle)
            if ev.params.capability and ev.request_id not in machine.reqs:
                ungranted.add(ev.request_id)  # a duplicate admit changes nothing
        elif isinstance(ev, ClaimGranted) and ev.request_id in claimed:
            ungranted.discard(ev.request_id)
        if isinstance(ev, (ReadOk, ReadFailed)):
            in_flight.discard(ev.request_id)
            quarantined.discard(ev.request_id)
        for eff in recorded:
            if isinstance(eff, Quarantined):
                quarantined.add(eff.request_id)
            elif isinstance(eff, SendClaim):
                claimed.add(eff.request_id)
            elif isinstance(eff, PostRead):
                in_flight.add(eff.request_id)
                if eff.request_id in ungranted:
                    res.violations.append(f"line {lineno}: ReadOnlyGranted: READ of "
                                          f"{eff.request_id} before P granted its claim")
                load = key_of.get(eff.request_id)
                if load is not None and load in pulled \
                        and not machine.counters.get("ended_memory_evicted"):
                    res.violations.append(f"line {lineno}: NoSecondPull: a second READ of "
                                          f"{load} ({eff.request_id})")
                if load is not None:
                    pulled.add(load)
        for eff in recorded:
            if isinstance(eff, Finished) and eff.request_id in in_flight \
                    and eff.request_id not in quarantined:
                res.violations.append(f"line {lineno}: NoQuarantinedReuse: {eff.request_id} "
                                      "finished while its READ runs, blocks not quarantined")
                in_flight.discard(eff.request_id)
        if isinstance(ev, DTick):
            lost = sum(1 for e in recorded
                       if isinstance(e, Finished) and e.reason == "lease_lost")
            if lost > config.max_tick_work:
                res.violations.append(f"line {lineno}: TickBounded: a tick failed {lost} "
                                      f"leases, more than max_tick_work "
                                      f"({config.max_tick_work})")
        before = {rid: machine.state(rid) for rid in machine.reqs}
        got = _replay_step(machine, lineno, ev, recorded, res, out, max_reports)
        if got is None:
            break
        for eff in got:
            if isinstance(eff, Finished):
                key = f"{eff.state}:{eff.reason}"
                res.frees[key] = res.frees.get(key, 0) + 1
            if isinstance(eff, SendRelease) and before.get(eff.request_id) == "reading" \
                    and not isinstance(ev, (ReadFailed, ReadOk)):
                res.violations.append(f"line {lineno}: NoReleaseUnderRead: release of "
                                      f"{eff.request_id} while its READ was in flight")
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journal", help="journal file (JSON Lines), or - for stdin")
    p.add_argument("--no-effects", action="store_true",
                   help="do not print the replayed effects, only the verdict")


def run(args: argparse.Namespace) -> int:
    path = args.journal
    try:
        f: IO[bytes] = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        print(f"kvproto replay: cannot open {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        res = replay(journal_lines(f), None if args.no_effects else sys.stdout)
    except JournalError as e:
        print(f"kvproto replay: {path}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a directory, or a read error
        print(f"kvproto replay: cannot read {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        if path != "-":
            f.close()
    for d in res.divergences:
        print(f"kvproto replay: DIVERGED {d}", file=sys.stderr)
    for v in res.violations:
        print(f"kvproto replay: VIOLATION {v}", file=sys.stderr)
    verdict = "ok" if res.ok else "FAILED"
    what = "finished" if res.side == "D" else "frees"
    print(f"kvproto replay: {res.events} events replayed, {what} {res.frees}, {verdict}",
          file=sys.stderr)
    return 0 if res.ok else 1
