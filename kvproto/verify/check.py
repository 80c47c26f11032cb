"""``kvproto check``: model-check the TLA+ spec with TLC, or check a user's lease numbers.

Models are the ``MC_*.cfg`` files in ``kvproto/tla/``; :data:`MODELS` names each one, says what
it covers and what TLC must conclude about it:

* ``ci`` (the default) and ``live`` must pass: the safety invariants, then liveness
  (``NoLeak``, ``ReportedIsFreed``) under fairness;
* ``large`` is the longer run (every fault at once, not in CI) and ``full`` the one for
  TLC's distributed mode;
* the ``bug_*`` models each re-introduce a known upstream bug and must FAIL with the
  named property. ``kvproto check --bugs`` exits 0 only when every one of them does: a
  checker that cannot fail proves nothing.

``kvproto check --simulate N MODEL`` runs TLC's random simulation instead of the
exhaustive search (:class:`Simulation`): N random behaviours per worker, every invariant
checked in every state. It is how ``full``, which no single machine exhausts, gets
checked at all on one; a pass is evidence, not proof. Models with a temporal property
are refused by name and skipped under ``--all`` / ``--bugs``.

``kvproto check --lease-config FILE`` (or the timing flags) model-checks a user's own
lease, extension, heartbeat interval and delay bounds: the numbers are turned into
discrete time units, rounding every term P grants *down* and every delay *up* (so a
pass is sound for the real numbers), and TLC checks ``NoFreeUnderRead``,
``RenewalKeepsLease`` and every other safety invariant on the ``lease`` model with
them. ``NoLeak`` is checked on the small ``lease_live`` model at a coarse unit (the
longest term in :data:`LIVE_UNITS` units): it depends only on every term being positive,
and liveness checking costs about 45 ms of TLC time per state here.

Exit codes: 0 every model concluded as expected; 1 a property was violated (or a bug
model was not caught); 2 usage error or bad config file; 3 no Java runtime; 4 TLC crashed
or could not parse the spec; 5 no tla2tools.jar.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

from kvproto.cli import number
from kvproto.errors import UsageError
from kvproto.lifecycle import MAX_DURATION, Config, ConfigError
from kvproto.verify.models import TLC_MODELS
from kvproto.verify.models import TlcModel as Model
from kvproto.verify.tlc import (
    MissingJar,
    MissingJava,
    Progress,
    TlcResult,
    WorkersEnvError,
    default_workers,
    render_trace,
    run_tlc,
)

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_NO_JAVA = 3
EXIT_TLC_CRASH = 4
EXIT_NO_JAR = 5


# The models (kvproto/tla/MC_*.cfg) live in the one registry, kvproto.verify.models.
MODELS: Final[dict[str, Model]] = TLC_MODELS

DEFAULT_MODELS = ("ci",)

# ---------------------------------------------------------------------------
# A user's lease numbers -> the `lease` model.
# ---------------------------------------------------------------------------

# Config key -> TLA+ constant. Terms P grants: rounded down (shorter is worse). Delays and
# bounds: rounded up.
_TERMS = {"initial_lease": "InitialLease", "lease_extension": "LeaseExtension",
          "abort_grace": "AbortGrace"}
_DELAYS = {"heartbeat_interval": "HeartbeatInterval", "max_delay": "MaxDelay",
           "max_read_time": "MaxReadTime", "clock_drift": "ClockDrift"}
TIMING_KEYS = (*_TERMS, *_DELAYS)
MAX_UNITS = 6  # the longest term in model time units when --unit is not given
LIVE_UNITS = 3  # the longest term in units for the NoLeak pass


MAX_LEASE_CONFIG_BYTES = 1 << 20
# A lease model's time constants must be TLC integers (32-bit, and the spec adds terms
# together): more units than this is refused as a usage error (and would never finish).
MAX_MODEL_UNITS = 1 << 20


class LeaseConfigError(UsageError, ValueError):
    """A lease config file or flag that cannot be read (not: a config that is unsafe)."""


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def load_lease_config(path: str | None, overrides: dict[str, float]) -> Config:
    """Read a JSON (or TOML, by extension) file of ``Config`` keys, apply flag overrides.

    The result is *not* validated: checking an unsafe config is the point. Unknown keys,
    non-numbers and negative values are errors.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as f:
                raw = f.read(MAX_LEASE_CONFIG_BYTES + 1)
        except OSError as e:
            raise LeaseConfigError(f"cannot read {path}: {e.strerror or e}") from e
        if len(raw) > MAX_LEASE_CONFIG_BYTES:
            raise LeaseConfigError(f"{path}: larger than {MAX_LEASE_CONFIG_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LeaseConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        try:
            if p.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            else:
                data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, TOMLDecodeError
            raise LeaseConfigError(f"{path}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}:"
                                   f" {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise LeaseConfigError(f"{path}: expected an object of Config keys, "
                                   f"got {type(data).__name__}")
    data = {**data, **overrides}
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise LeaseConfigError(f"unknown config keys: {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(known))})")
    flags = {f.name for f in fields(Config) if f.type == "bool"}  # no timing meaning
    for k, v in data.items():
        if k in flags:
            if not isinstance(v, bool):
                raise LeaseConfigError(f"{k} must be true or false, got {str(v)[:40]}")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
            raise LeaseConfigError(f"{k} must be a finite number, got {str(v)[:40]}")
        if v < 0:
            raise LeaseConfigError(f"{k} must be >= 0, got {v}")
        if k in TIMING_KEYS and v > MAX_DURATION:
            raise LeaseConfigError(f"{k} must be <= {MAX_DURATION} s (2**32-1 ms), got {v}")
    for k in ("initial_lease", "lease_extension", "heartbeat_interval", "max_read_time"):
        if k in data and data[k] <= 0:
            raise LeaseConfigError(f"{k} must be > 0, got {data[k]}")
    return replace(Config(), **data)


@dataclass(frozen=True)
class Quantized:
    unit: float  # seconds per model time unit
    units: dict[str, int]  # TLA+ constant -> units
    exact: bool  # every number is a whole number of units

    def describe(self) -> str:
        parts = ", ".join(f"{k}={v}" for k, v in self.units.items())
        return f"1 unit = {self.unit:g} s: {parts}" + ("" if self.exact else
                                                       " (terms rounded down, delays up)")


def quantize(config: Config, unit: float) -> Quantized:
    if not (math.isfinite(unit) and unit > 0):
        raise LeaseConfigError(f"--unit must be a finite number > 0, got {unit}")
    units: dict[str, int] = {}
    exact = True
    for key, const in _TERMS.items():
        q = getattr(config, key) / unit
        units[const] = math.floor(q + 1e-9)
        exact &= abs(q - round(q)) < 1e-9
    for key, const in _DELAYS.items():
        q = getattr(config, key) / unit
        units[const] = math.ceil(q - 1e-9)
        exact &= abs(q - round(q)) < 1e-9
    units["HeartbeatInterval"] = max(units["HeartbeatInterval"], 1)
    units["MaxReadTime"] = max(units["MaxReadTime"], 1)
    big = {k: v for k, v in units.items() if v > MAX_MODEL_UNITS}
    if big:
        k, v = next(iter(big.items()))
        raise LeaseConfigError(
            f"with --unit {unit:g} s, {k} is {v} model time units; TLC needs at most "
            f"{MAX_MODEL_UNITS} (its integers are 32-bit): pass a coarser --unit")
    return Quantized(unit, units, exact)


def _rules(config: Config, q: Quantized | None = None) -> tuple[bool, ...]:
    """Which of ``Config.timing_rules`` hold, in seconds or (with ``q``) in units."""
    if q is not None:
        consts = {**_TERMS, **_DELAYS}
        units: dict[str, Any] = {k: float(q.units[c]) for k, c in consts.items()}
        units["peer_timeout"] = config.peer_timeout / q.unit  # D only: not a model constant
        config = replace(config, **units)
    return tuple(ok for ok, _ in config.timing_rules())


def choose_unit(config: Config, max_units: int = MAX_UNITS) -> float:
    """The coarsest unit (fewest states) whose rounding keeps every timing rule of
    ``Config.validate`` as it is in seconds; an exact common unit if one is small enough."""
    secs = {c: getattr(config, k) for k, c in {**_TERMS, **_DELAYS}.items()}
    truth = _rules(config)
    longest = max(config.initial_lease, config.lease_extension, config.abort_grace)
    # An exact common unit (gcd of the numbers as fractions), when it keeps terms small.
    fr = [Fraction(v).limit_denominator(1000) for v in secs.values() if v > 0]
    g = fr[0]
    for f in fr[1:]:
        g = Fraction(math.gcd(g.numerator * f.denominator, f.numerator * g.denominator),
                     g.denominator * f.denominator)
    if g > 0 and longest / float(g) <= max_units + 1e-9:
        return float(g)
    best: float | None = None
    for n in range(1, 4 * max_units + 1):
        unit = longest / n
        q = quantize(config, unit)
        if _rules(config, q) == truth and q.units["HeartbeatInterval"] >= 1:
            best = unit
            break
    return best if best is not None else longest / max_units


def live_quantize(config: Config) -> Quantized:
    """The coarse units of the NoLeak pass: every term at least 1 unit."""
    longest = max(config.initial_lease, config.lease_extension, config.abort_grace)
    q = quantize(config, longest / LIVE_UNITS)
    units = dict(q.units)
    for const in _TERMS.values():
        units[const] = max(units[const], 1)
    return Quantized(q.unit, units, q.exact)


def lease_cfg_text(q: Quantized, model: str = "lease") -> str:
    """A lease model's cfg (``lease`` or ``lease_live``) with the numbers substituted."""
    m = MODELS[model]
    text = m.path.read_text()
    for const, v in q.units.items():
        text, n = re.subn(rf"(?m)^(\s*){const}\s*=\s*-?\d+\s*$", rf"\g<1>{const} = {v}", text)
        if n != 1:
            raise RuntimeError(f"{m.cfg} has no single line for {const}")
    return text


# ---------------------------------------------------------------------------
# Running and reporting.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Simulation:
    """TLC's random simulation (``-simulate num=N -depth D -seed S``) in place of the
    exhaustive search: ``behaviours`` random behaviours from the initial states, each at
    most ``depth`` steps, every invariant checked in every state. Finds bugs in models
    too large to exhaust (``full``); a pass proves nothing beyond the behaviours run.
    ``behaviours`` is per TLC worker (TLC's ``num``)."""

    behaviours: int  # per TLC worker (TLC's num)
    depth: int = 100
    seed: int = 0
    workers: int = 1

    def tlc_args(self) -> list[str]:
        return ["-simulate", f"num={self.behaviours}", "-depth", str(self.depth),
                "-seed", str(self.seed)]

    def describe(self) -> str:
        per = f" per worker x {self.workers} workers" if self.workers > 1 else ""
        return (f"{self.behaviours:,} random behaviours{per} of at most {self.depth} steps, "
                f"seed {self.seed}; not exhaustive")


@dataclass
class Outcome:
    model: Model
    result: TlcResult
    as_expected: bool
    summary: str
    violated: str | None = None  # the property that failed, named from the cfg for liveness
    simulation: Simulation | None = None  # None: the exhaustive search


def _properties(cfg_text: str) -> list[str]:
    """PROPERTY names of a cfg (to name a liveness violation: TLC only says which
    when the config has one)."""
    out: list[str] = []
    for line in cfg_text.splitlines():
        line = line.split("\\*", 1)[0]
        m = re.match(r"\s*PROPERTY\s+(.*)$", line)
        if m:
            out += m.group(1).split()
    return out


def violated_name(res: TlcResult, cfg_text: str) -> str | None:
    if res.result != "violation":
        return None
    if res.kind == "liveness":
        props = _properties(cfg_text)
        return props[0] if len(props) == 1 else "Temporal properties"
    return res.violated


def judge(model: Model, res: TlcResult, cfg_text: str,
          simulation: Simulation | None = None) -> Outcome:
    o = _judge(model, res, cfg_text, simulation)
    o.violated = violated_name(res, cfg_text)
    o.simulation = simulation
    return o


def _judge(model: Model, res: TlcResult, cfg_text: str,
           simulation: Simulation | None = None) -> Outcome:
    name = violated_name(res, cfg_text)
    gen = f", {res.generated:,} generated" if isinstance(res.generated, int) else ""
    stats = (f"{res.distinct if res.distinct is not None else '?':,} distinct states{gen}, "
             f"depth {res.depth if res.depth is not None else '?'}, {res.seconds:.1f} s"
             if isinstance(res.distinct, int) else f"{res.seconds:.1f} s")
    if simulation is not None:
        checked = f"{res.generated:,}" if isinstance(res.generated, int) else "?"
        stats = f"{checked} states checked in {simulation.describe()}, {res.seconds:.1f} s"
    if res.result == "error":
        return Outcome(model, res, False, f"TLC failed: {res.message}")
    if model.expect is None:
        if res.result == "ok":
            return Outcome(model, res, True, f"ok: no violation ({stats})")
        what = name or res.result
        return Outcome(model, res, False, f"VIOLATION of {what} ({res.kind}; {stats})")
    if name == model.expect:
        return Outcome(model, res, True, f"ok: the expected violation of {name} was found "
                                         f"({stats})")
    if res.result == "ok":
        return Outcome(model, res, False, f"NOT CAUGHT: expected a violation of "
                                          f"{model.expect}, TLC found none ({stats})")
    return Outcome(model, res, False, f"WRONG VIOLATION: expected {model.expect}, got "
                                      f"{name or res.result} ({stats})")


def check_model(model: Model, *, cfg_text: str | None = None, workers: int | None = None,
                timeout: float | None = None,
                on_progress: Callable[[Progress], None] | None = None,
                simulation: Simulation | None = None) -> Outcome:
    """Run TLC on one model (exhaustively, or ``simulation``'s random behaviours) and
    judge the result against the model's expectation. Raises MissingJava / MissingJar;
    ``UsageError`` for a simulation of a model that checks a temporal property (TLC's
    simulation checks invariants)."""
    text = cfg_text if cfg_text is not None else model.path.read_text()
    if simulation is not None and _properties(text):
        raise UsageError(f"--simulate checks invariants only; {model.name} checks the "
                         f"temporal propert{'ies' if len(_properties(text)) > 1 else 'y'} "
                         f"{', '.join(_properties(text))}: check it exhaustively")
    res = run_tlc(model.cfg, module=getattr(model, "module", "MC"), cfg_text=text,
                  workers=workers, timeout=timeout,
                  on_progress=on_progress, name=model.name,
                  args=simulation.tlc_args() if simulation is not None else ())
    return judge(model, res, text, simulation)


def _progress_printer(name: str, stream: Any,
                      simulation: Simulation | None = None) -> Callable[[Progress], None]:
    def show(p: Progress) -> None:
        if simulation is not None:
            print(f"  [{name} {p.elapsed:6.0f} s] {p.generated:,} states checked",
                  file=stream, flush=True)
            return
        print(f"  [{name} {p.elapsed:6.0f} s] {p.distinct:,} distinct states, {p.generated:,} "
              f"generated, {p.queue:,} on queue ({p.rate_per_min:,} states/min)",
              file=stream, flush=True)
    return show


def _outcome_json(o: Outcome) -> dict[str, Any]:
    r = o.result
    return {
        "model": o.model.name, "cfg": f"kvproto/tla/{o.model.cfg}", "expect": o.model.expect,
        "result": r.result, "violated": o.violated, "kind": r.kind,
        "as_expected": o.as_expected, "distinct": r.distinct, "generated": r.generated,
        "depth": r.depth, "seconds": round(r.seconds, 2), "exit_code": r.exit_code,
        "summary": o.summary,
        "simulation": None if o.simulation is None else {
            "behaviours": o.simulation.behaviours, "depth": o.simulation.depth,
            "seed": o.simulation.seed, "workers": o.simulation.workers},
        "trace": [{"step": s.index, "action": s.action, "vars": s.raw} for s in r.trace],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("models:\n" + "\n".join(
        f"  {m.name:<22} {'must fail: ' + m.expect if m.expect else 'must pass'}"
        f"{'' if m.ci else ' (long run)'}" for m in MODELS.values()) +
        "\n\nexit codes: 0 as expected; 1 violation (or a bug model not caught); 2 usage or "
        "bad config;\n3 no Java runtime; 4 TLC crashed or cannot parse the spec; "
        "5 no tla2tools.jar")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"models to check (default: {' '.join(DEFAULT_MODELS)}); see below")
    p.add_argument("--model", action="append", dest="model_opts", metavar="MODEL",
                   default=None,
                   help="a model to check, the same as naming it as MODEL (repeatable: "
                        "`kvproto check --model ci` is `kvproto check ci`)")
    p.add_argument("--all", action="store_true",
                   help="every model except the long ones (what CI runs)")
    p.add_argument("--bugs", action="store_true",
                   help="the deliberately buggy models: exit 0 only if TLC catches each one")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--plan", action="store_true",
                   help="check the arguments and print what would be checked (models, the "
                        "lease numbers in model units), without running TLC")
    g = p.add_argument_group("checking your own lease numbers (seconds)")
    g.add_argument("--lease-config", metavar="FILE",
                   help="JSON (or .toml) object of kvproto Config keys, e.g. "
                        '{"initial_lease": 30, "lease_extension": 20, "heartbeat_interval": 5}')
    for key in TIMING_KEYS:
        g.add_argument(f"--{key.replace('_', '-')}", type=number(0, MAX_DURATION), metavar="S",
                       dest=key,
                       help=f"{key} (overrides the file; default {getattr(Config(), key):g})")
    g.add_argument("--unit", type=number(0, MAX_DURATION, lo_open=True), metavar="S",
                   help="seconds per model time unit (default: the coarsest unit that keeps "
                        "every timing rule as it is in seconds)")
    g = p.add_argument_group("random simulation instead of the exhaustive search")
    g.add_argument("--simulate", type=number(1, 10**9, integer=True), metavar="N",
                   help="run N random behaviours of each model per TLC worker (TLC "
                        "-simulate) instead of exhausting it: every invariant checked in every "
                        "state; finds bugs "
                        "in a model too large to exhaust (full), proves nothing beyond the "
                        "behaviours run. Models with a temporal property are refused")
    g.add_argument("--depth", type=number(1, 10**6, integer=True), metavar="D",
                   help="with --simulate: steps per behaviour at most (default 100)")
    g.add_argument("--seed", type=number(0, 2**62, integer=True), metavar="S",
                   help="with --simulate: TLC's random seed (default 0)")
    p.add_argument("--workers", type=number(1, 256, integer=True), metavar="N",
                   help="TLC worker threads (default: cores)")
    p.add_argument("--timeout", type=number(0, 7 * 86400, lo_open=True), metavar="S",
                   help="give up a model after S seconds (exit 4)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per model on stdout instead of text")
    p.add_argument("--raw", action="store_true", help="also print TLC's own output")


def _lease_mode(args: argparse.Namespace) -> bool:
    return args.lease_config is not None or any(
        getattr(args, k, None) is not None for k in TIMING_KEYS) or args.unit is not None


def run(args: argparse.Namespace) -> int:
    out = sys.stdout
    err = sys.stderr
    quiet = bool(getattr(args, "quiet", False))  # progress goes to stderr, even with --json
    if args.list:
        for m in MODELS.values():
            want = f"must fail: {m.expect}" if m.expect else "must pass"
            print(f"{m.name:<22} kvproto/tla/{m.cfg:<30} {want}\n{'':<23}{m.about}", file=out)
        return EXIT_OK
    if args.workers is not None and args.workers < 1:
        print("kvproto check: --workers must be >= 1", file=err)
        return EXIT_USAGE
    if args.workers is None:
        try:
            default_workers()
        except WorkersEnvError as e:
            print(f"kvproto check: {e}", file=err)
            return EXIT_USAGE
    jobs: list[tuple[Model, str | None]] = []
    models = [*args.models, *(getattr(args, "model_opts", None) or [])]
    simulation: Simulation | None = None
    sim_n = getattr(args, "simulate", None)
    if sim_n is None and (getattr(args, "depth", None) is not None
                          or getattr(args, "seed", None) is not None):
        print("kvproto check: --depth and --seed need --simulate", file=err)
        return EXIT_USAGE
    if sim_n is not None:
        if _lease_mode(args):
            print("kvproto check: --simulate runs named models, not the lease check", file=err)
            return EXIT_USAGE
        simulation = Simulation(sim_n, args.depth if args.depth is not None else 100,
                                args.seed if args.seed is not None else 0,
                                args.workers or default_workers())
    if _lease_mode(args):
        if models or args.all or args.bugs:
            print("kvproto check: the lease check runs alone (no MODEL, --all or --bugs)",
                  file=err)
            return EXIT_USAGE
        overrides = {k: getattr(args, k) for k in TIMING_KEYS if getattr(args, k) is not None}
        try:
            config = load_lease_config(args.lease_config, overrides)
            unit = args.unit if args.unit is not None else choose_unit(config)
            q = quantize(config, unit)
        except LeaseConfigError as e:
            print(f"kvproto check: bad lease config: {e}", file=err)
            return EXIT_USAGE
        try:
            config.validate()
            verdict = "Config.validate() accepts these numbers"
        except ConfigError as e:
            verdict = f"Config.validate() would refuse these numbers: {e}"
        if not args.json:
            print(f"lease check: {q.describe()}", file=out)
            print(f"  {verdict}", file=out)
        if q.units["LeaseExtension"] < 1 or q.units["InitialLease"] < 1:
            print("kvproto check: a term rounds down to 0 units; pass a smaller --unit", file=err)
            return EXIT_USAGE
        jobs.append((MODELS["lease"], lease_cfg_text(q)))
        jobs.append((MODELS["lease_live"], lease_cfg_text(live_quantize(config), "lease_live")))
    else:
        names: list[str] = list(models)
        if args.all:
            names += [m.name for m in MODELS.values() if m.ci]
        if args.bugs:
            names += [m.name for m in MODELS.values() if m.expect]
        if not names:
            names = list(DEFAULT_MODELS)
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            print(f"kvproto check: unknown model(s) {', '.join(unknown)} "
                  f"(known: {', '.join(MODELS)})", file=err)
            return EXIT_USAGE
        seen: set[str] = set()
        for n in names:
            if n not in seen:
                seen.add(n)
                jobs.append((MODELS[n], None))
        if simulation is not None:
            # Named models must all be simulable; --all and --bugs skip those that are not.
            temporal = [m.name for m, _ in jobs if _properties(m.path.read_text())]
            skipped = [n for n in temporal if n not in models]
            if skipped and not quiet:
                print(f"kvproto check: --simulate skips {', '.join(skipped)} (a temporal "
                      f"property: checked exhaustively only)", file=err)
            jobs = [(m, t) for m, t in jobs if m.name not in skipped]
            temporal = [n for n in temporal if n not in skipped]
            if temporal:
                print(f"kvproto check: --simulate checks invariants only; "
                      f"{', '.join(temporal)} check{'s' if len(temporal) == 1 else ''} a "
                      f"temporal property (check {'it' if len(temporal) == 1 else 'them'} "
                      f"exhaustively)", file=err)
                return EXIT_USAGE
    if args.plan:
        for model, text in jobs:
            print(f"would check {model.name} (kvproto/tla/{model.cfg})"
                  f"{' with the numbers above' if text is not None else ''}"
                  f"{': ' + simulation.describe() if simulation is not None else ''}",
                  file=out)
        return EXIT_OK
    rc = EXIT_OK
    for model, text in jobs:
        if not quiet:
            how = "simulating" if simulation is not None else "checking"
            print(f"{how} {model.name} (kvproto/tla/{model.cfg}): {model.about}", file=err,
                  flush=True)
        try:
            o = check_model(model, cfg_text=text, workers=args.workers, timeout=args.timeout,
                            on_progress=None if quiet else _progress_printer(
                                model.name, err, simulation),
                            simulation=simulation)
        except MissingJava as e:
            print(f"kvproto check: {e}", file=err)
            return EXIT_NO_JAVA
        except MissingJar as e:
            print(f"kvproto check: {e}", file=err)
            return EXIT_NO_JAR
        res = o.result
        if args.json:
            print(json.dumps(_outcome_json(o)), file=out, flush=True)
        else:
            print(f"{model.name}: {o.summary}", file=out, flush=True)
            if res.trace and (not o.as_expected or model.expect is not None):
                print(f"  counterexample ({len(res.trace)} states; the names are spec/PROTOCOL.md's"
                      " and each step names the Python it mirrors):", file=out)
                for line in render_trace(res.trace).splitlines():
                    print(f"  {line}", file=out)
            if args.raw:
                print(res.output, file=out)
        if res.result == "error":
            rc = max(rc, EXIT_TLC_CRASH)
        elif not o.as_expected:
            rc = max(rc, EXIT_VIOLATION)
    return rc


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - via kvproto.cli
    p = argparse.ArgumentParser(prog="kvproto check")
    add_arguments(p)
    return run(p.parse_args(argv))
