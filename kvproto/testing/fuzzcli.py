"""``kvproto fuzz``: a long stateful fuzzing run of P, D and the network (the machine and
its checks are in ``kvproto.testing.fuzz``), with progress on stderr, failing examples
saved, and a replayable journal of the first failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

from kvproto.lifecycle import Ledger
from kvproto.nixl.driver_d import DDriver
from kvproto.testing.fuzz import CONFIGS, FuzzCounters, machine_class, run_fuzz
from kvproto.testing.sim import quiet_drivers


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvproto.cli import number

    p.add_argument("--examples", type=number(1, 10**9, integer=True), default=1000,
                   help="examples to run (default 1000)")
    p.add_argument("--steps", type=number(1, 10**6, integer=True), default=60,
                   help="max rule steps per example (default 60)")
    p.add_argument("--seed", type=number(0, 2**63, integer=True), default=0,
                   help="hypothesis seed (default 0)")
    p.add_argument("--config", action="append", choices=sorted(CONFIGS),
                   help="fuzz only under this config (repeatable; default: all)")
    p.add_argument("--mutant", default=None,
                   help="fuzz a mutant ledger or D driver from kvproto.testing.mutants "
                        "instead of the real one")
    p.add_argument("--out", default="fuzz-failures",
                   help="directory for the example database and failing journals")
    p.add_argument("--no-shrink", action="store_true", help="report the first failure unshrunk")


@dataclass
class _Progress:
    stream: Any
    t0: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    total: int = 0

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self.last >= 1.0:
            self.last = now
            self.report()

    def report(self, final: bool = False, stopped: bool = False) -> None:
        el = max(1e-9, time.perf_counter() - self.t0)
        ex, steps = FuzzCounters.examples, FuzzCounters.steps
        head = "stopped, no check failed: " if stopped else "done: " if final else ""
        print(f"[fuzz] {head}{ex} examples ({ex / el:.1f}/s), {steps} steps "
              f"({steps / el:.0f}/s), {el:.0f}s", file=self.stream, flush=True)


def run(args: argparse.Namespace) -> int:
    """``kvproto fuzz``: exit 0 when no check failed, 1 on a failure (saved under
    ``--out``: the hypothesis example database, the failing example's steps and the P
    journal of that example for ``kvproto replay``), 2 on a usage error."""
    if args.examples < 1 or args.steps < 1:
        print("kvproto fuzz: --examples and --steps must be >= 1", file=sys.stderr)
        return 2
    ledger_cls: type[Ledger] = Ledger
    driver_cls: type[DDriver] = DDriver
    if args.mutant:
        from kvproto.testing import mutants

        found = mutants.MUTANTS.get(args.mutant)
        found_d = mutants.DRIVER_MUTANTS.get(args.mutant)
        if found is not None:
            ledger_cls = found.ledger_cls
        elif found_d is not None:
            driver_cls = found_d.driver_cls
        else:
            known = [*mutants.MUTANTS, *mutants.DRIVER_MUTANTS]
            print(f"kvproto fuzz: unknown mutant {args.mutant!r} "
                  f"(known: {', '.join(known)})", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db_dir = out / "hypothesis-db"
    machine = machine_class(ledger_cls, configs=args.config, journal=True,
                            driver_cls=driver_cls)
    # No explain phase: it traces every line and makes shrinking many times slower.
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if not args.no_shrink:
        phases.append(Phase.shrink)
    stg = settings(max_examples=args.examples, stateful_step_count=args.steps, deadline=None,
                   database=DirectoryBasedExampleDatabase(str(db_dir)), phases=phases,
                   suppress_health_check=list(HealthCheck), print_blob=True,
                   report_multiple_bugs=False)
    prog = _Progress(sys.stderr)
    FuzzCounters.examples = FuzzCounters.steps = 0
    FuzzCounters.progress = prog
    what = ledger_cls.__name__ + ("" if driver_cls is DDriver else f" + {driver_cls.__name__}")
    print(f"[fuzz] {what}: up to {args.examples} examples of up to "
          f"{args.steps} steps, seed {args.seed}, configs "
          f"{', '.join(machine.CONFIG_NAMES)}", file=sys.stderr, flush=True)
    try:
        with quiet_drivers(getattr(args, "verbose", 0)):
            run_fuzz(machine, stg, seed=args.seed)
    except KeyboardInterrupt:
        # Stopped by hand: say how far the run got (no check had failed), then exit 130.
        prog.report(stopped=True)
        raise
    except Exception as e:  # any failure of the run is reported the same way
        prog.report(final=True)
        stem = out / f"failing-seed{args.seed}"
        journal_path = stem.with_suffix(".jsonl")
        steps_path = stem.with_suffix(".txt")
        name = getattr(e, "invariant", type(e).__name__)
        notes = "\n".join(getattr(e, "__notes__", []))
        steps_path.write_text(f"{name}: {e}\n{notes}\n", encoding="utf-8")
        buf = machine.last_journal
        if buf is not None:
            journal_path.write_text(buf.getvalue(), encoding="utf-8")
        print(notes, file=sys.stderr)
        print(f"kvproto fuzz: FAILED ({name}): {e}", file=sys.stderr)
        print(f"kvproto fuzz: example database: {db_dir} (a rerun with the same --out "
              "replays the failure first)", file=sys.stderr)
        print(f"kvproto fuzz: failing example's steps: {steps_path}", file=sys.stderr)
        if buf is not None:
            print(f"kvproto fuzz: P journal of the failing example: {journal_path} "
                  f"(kvproto replay {journal_path})", file=sys.stderr)
        print(json.dumps({"examples": FuzzCounters.examples, "steps": FuzzCounters.steps,
                          "ledger": ledger_cls.__name__, "driver": driver_cls.__name__,
                          "ok": False, "invariant": name,
                          "database": str(db_dir), "steps_file": str(steps_path),
                          "journal": str(journal_path) if buf is not None else None}))
        return 1
    finally:
        FuzzCounters.progress = None
    prog.report(final=True)
    el = max(1e-9, time.perf_counter() - prog.t0)
    print(json.dumps({"examples": FuzzCounters.examples, "steps": FuzzCounters.steps,
                      "seconds": round(el, 2),
                      "examples_per_s": round(FuzzCounters.examples / el, 2),
                      "steps_per_s": round(FuzzCounters.steps / el, 1),
                      "ledger": ledger_cls.__name__, "driver": driver_cls.__name__,
                      "ok": True}))
    return 0

