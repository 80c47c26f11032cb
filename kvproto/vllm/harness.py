"""Real vLLM engines in separate processes, for the end-to-end tests and ``bench vllm``.

Nothing here is mocked: each :class:`Engine` is a child process running vLLM's own
``LLMEngine`` (in-process engine core, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that the
child's pid is the whole engine and ``kill -9`` kills all of it) over a tiny
``LlamaForCausalLM`` with random but real weights written locally by
:func:`build_tiny_model` (never downloaded, never ``load_format="dummy"``: dummy weights
make outputs insensitive to the KV contents, which would hide wrong-KV bugs).

The parent (the "router") talks to each child over a ``multiprocessing`` pipe with plain
tuples: it submits token-id prompts, aborts requests (in the output processor, or in the
engine core directly for a request whose output already finished, e.g. P after its
prefill), reads counters (free KV blocks, requests held by the scheduler, anything the
connector exposes through :meth:`Engine.connector_call`), pauses the step loop, and
kill -9s the process group. The parent imports neither torch nor vLLM. The engine side
of the pipe is :mod:`kvproto.vllm.engine_child`.

Start: engines fork from a server process that imported torch and vLLM once
(``multiprocessing``'s fork server, preloading :mod:`kvproto.vllm.preload`), which saves
each engine its imports; ``KVPROTO_ENGINE_START=spawn`` starts each one in a fresh
interpreter instead. Each engine gets the parent's environment as it is at its start, plus
its own (``EngineSpec.env``). A TP > 1 engine's worker processes are vLLM's own; vLLM's
CPU platform spawns them (each imports torch and vLLM afresh, 20–90 s on 2 loaded cores),
and ``EngineSpec.worker_start="fork"`` forks them from the engine process instead.

Cleanup: every child runs in its own session (process group) and exits when its parent
(the fork server, which exits with this process) goes away (pipe closed, or parent pid
changed); :func:`kill_all` (registered with
``atexit``) kills every engine this process started; tests use :class:`Engine` as a
context manager or through fixtures that call :meth:`Engine.close` in ``finally``.

Block size: vLLM's CPU attention backend wants a multiple of 32. Engines run with
``enforce_eager``, ``skip_tokenizer_init`` and an explicit ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import fcntl
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import socket
import termios
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvproto.errors import KVProtoError
from kvproto.vllm.engine_child import STALL_DUMP_S, engine_main

log = logging.getLogger(__name__)

BLOCK_SIZE = 32
STOCK_CONNECTOR: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                   "kv_buffer_device": "cpu",
                                   "kv_load_failure_policy": "recompute"}
KVPROTO_CONNECTOR: dict[str, Any] = {"kv_connector": "KVProtoConnector",
                                     "kv_connector_module_path": "kvproto.vllm.connector",
                                     "kv_role": "kv_both", "kv_buffer_device": "cpu",
                                     "kv_load_failure_policy": "recompute"}

# KVProtoConnector options that ``pd_specs`` gives both engines of a pair unless the call
# sets them itself. Empty here (the connector's own defaults, what ``bench vllm`` measures);
# the test suite sets ``progress_delay_us`` (tests/conftest.py).
CONNECTOR_DEFAULTS: dict[str, Any] = {}


class HarnessError(KVProtoError, RuntimeError):
    """An engine process failed to start, died, or did not answer in time."""


def vllm_available() -> str | None:
    """None when vLLM (and NIXL) can be imported here; otherwise a one-line reason.
    Checked in a subprocess-free way by looking the modules up, without importing torch."""
    import importlib.util

    for mod in ("vllm", "nixl", "safetensors", "numpy"):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed (pip install 'kvproto[vllm]')"
        except (ImportError, ValueError) as e:  # pragma: no cover - broken install
            return f"{mod} cannot be imported: {e}"
    return None


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class TinyModel:
    path: Path
    vocab: int
    max_len: int


def build_tiny_model(directory: str | os.PathLike[str], *, seed: int = 0, hidden: int = 128,
                     layers: int = 2, heads: int = 4, kv_heads: int = 4, vocab: int = 1024,
                     intermediate: int = 256, max_len: int = 2048,
                     std: float = 0.15, sliding_window: int | None = None) -> TinyModel:
    """Write ``config.json`` and ``model.safetensors`` of a random LlamaForCausalLM.

    ``sliding_window``: a hybrid model, Gemma-3 style: layers alternate between sliding
    window attention over that many tokens (even layers) and full attention (odd
    layers), named in the config's ``layer_types``; vLLM's hybrid allocator then gives
    it two KV cache groups.

    The weights are seeded normal noise (``std`` larger than the usual 0.02 so that greedy
    argmax is well separated and attention is far from uniform: a decode step then
    depends visibly on every KV block). Idempotent: an existing model with the same
    parameters is reused."""
    import numpy as np
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": max_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "attention_bias": False, "mlp_bias": False,
        "kvproto_seed": seed, "kvproto_std": std,
    }
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(layers)]
    cfg_path = d / "config.json"
    weights = d / "model.safetensors"
    if cfg_path.exists() and weights.exists():
        try:
            if json.loads(cfg_path.read_text()) == config:
                return TinyModel(d, vocab, max_len)
        except ValueError:
            pass
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> Any:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t: dict[str, Any] = {"model.embed_tokens.weight": w(vocab, hidden),
                         "model.norm.weight": np.ones(hidden, np.float32),
                         "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    save_file(t, str(weights), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps(config, indent=1))
    return TinyModel(d, vocab, max_len)


# Token ids of the word tokenizer's special tokens (the tiny model's config agrees).
WORD_SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


def write_word_tokenizer(directory: str | os.PathLike[str], *, vocab: int = 1024) -> Path:
    """Write a tokenizer beside a tiny model so that a server (``vllm serve``) can take and
    return text: token ``i`` is the word ``w<i>`` (ids 0-2 are ``<unk>``, ``<s>``,
    ``</s>``), words are split on white space, no special token is added, and decoding
    joins words with one space. Text and token ids then map one to one, so a prompt can
    be written as ``"w17 w5 w900"``. A chat template joins the messages' contents with one
    space (no role markers), so a chat request's prompt is its words. Idempotent (an
    existing tokenizer is kept)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists():
        return d
    words = {w: i for w, i in WORD_SPECIAL.items()}
    words.update({f"w{i}": i for i in range(len(WORD_SPECIAL), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(WORD_SPECIAL))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
        "model_max_length": 1 << 20, "add_bos_token": False, "add_eos_token": False,
        "chat_template": "{% for m in messages %}{% if not loop.first %} {% endif %}"
                         "{{ m['content'] }}{% endfor %}",
    }, indent=1))
    return d


def make_prompts(count: int, *, vocab: int = 1024, seed: int = 1,
                 lengths: Sequence[int] | None = None) -> list[list[int]]:
    """Deterministic token-id prompts. Default lengths cycle through one block, a partial
    block, exactly several blocks and several blocks plus a partial last one."""
    import random

    rng = random.Random(seed)
    if lengths is None:
        b = BLOCK_SIZE
        lengths = [b, 7, 3 * b, 2 * b + 5, 5 * b + 17, b + 1, 4 * b, 9 * b + 3]
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        out.append([rng.randrange(3, vocab) for _ in range(n)])
    return out


_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_PORT_LOW = 20000  # the lowest port free_port hands out
_ports_given: set[int] = set()  # one int per port handed out (a few hundred per test run)
_port_rng = random.Random()  # seeded from os.urandom: two test processes pick apart


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path(_PORT_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return lo, hi


def free_port() -> int:
    """A loopback TCP port that is free now, never handed out before by this process, and
    outside the kernel's ephemeral range. The port is bound later by another process (an
    engine's metrics exporter or side channel); a port from the ephemeral range can be
    taken meanwhile by any process's outgoing connection or ``bind(0)`` (vLLM's own
    sockets start many), which kills that engine at start with "address in use". Callers
    may use the port up to port + 31 (a side channel per TP rank) as well."""
    lo, hi = _ephemeral_range()
    if lo - 64 > _PORT_LOW:
        span = (_PORT_LOW, lo - 64)
    elif hi + 64 < 65000:
        span = (hi + 64, 65000)
    else:  # no room outside the ephemeral range: the kernel's choice
        span = (0, 0)
    for _ in range(256 if span[1] else 0):
        port = _port_rng.randrange(*span)
        if port in _ports_given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _ports_given.add(port)
    return port


# ---------------------------------------------------------------------------- the engine


WORKER_STARTS: Final = ("spawn", "fork")


@dataclass
class EngineSpec:
    """What one engine process runs. ``kv_transfer_config`` None: a plain engine (the
    single-engine reference)."""

    name: str
    model: str
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    kv_cache_memory_bytes: int = 128 << 20
    block_size: int = BLOCK_SIZE
    max_model_len: int = 2048
    max_num_seqs: int = 64
    log_path: str | None = None
    prefix_caching: bool = False
    tensor_parallel_size: int = 1
    max_num_batched_tokens: int | None = None  # small: chunked prefill of long prompts
    # How vLLM starts the worker processes of a TP > 1 engine: "spawn" (what vLLM's CPU
    # platform does: each worker imports torch and vLLM afresh) or "fork" (each worker is
    # a copy of the engine process, imports done; the engine process has started no
    # thread by then). Either way the workers are vLLM's own and load the connector.
    worker_start: str = "spawn"
    # One step-loop iteration slower than this dumps every thread's stack into the log
    # (default STALL_DUMP_S); 0: off, for engines stopped on purpose (SIGSTOP), whose
    # resumption would read as a stall.
    stall_dump_s: float = STALL_DUMP_S

    def __post_init__(self) -> None:
        if self.worker_start not in WORKER_STARTS:
            raise HarnessError(f"EngineSpec {self.name}: worker_start={self.worker_start!r}, "
                               f"expected one of {', '.join(WORKER_STARTS)}")


@dataclass
class Result:
    """One finished request as the engine reported it."""

    rid: str
    internal_id: str
    token_ids: list[list[int]]           # one list per completion (n>1: several)
    finish_reasons: list[str | None]
    kv_transfer_params: dict[str, Any] | None
    submit_t: float
    first_token_t: float | None
    finish_t: float
    error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.token_ids[0] if self.token_ids else []


_LIVE: dict[int, Engine] = {}
STARTED: list[int] = []       # pids of every engine process this process started (bounded
_MAX_STARTED = 4096           # by _MAX_STARTED; the oldest are dropped)


def stray_engines() -> list[int]:
    """Engine processes this process started that still exist (a leak, unless open)."""
    out = []
    for pid in STARTED:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:   # pragma: no cover - pid reused by another user
            continue
        out.append(pid)
    return out


def kill_all() -> None:
    """kill -9 every engine process group this process started and has not closed."""
    for eng in list(_LIVE.values()):
        eng.kill()


atexit.register(kill_all)


ENGINE_START_ENV = "KVPROTO_ENGINE_START"
_START_METHODS = ("forkserver", "spawn")


def _start_context() -> Any:
    """How engine processes start (``KVPROTO_ENGINE_START``): "forkserver" (default), forked
    from one server process per test process that imported torch and vLLM once
    (``kvproto.vllm.preload``); "spawn", a fresh interpreter per engine. Either way the
    engine gets its own environment (``EngineSpec.env``) before it builds its engine."""
    how = os.environ.get(ENGINE_START_ENV, "forkserver")
    if how not in _START_METHODS:
        raise HarnessError(f"{ENGINE_START_ENV}={how!r}: expected one of "
                           f"{', '.join(_START_METHODS)}")
    ctx = mp.get_context(how)
    if how == "forkserver":
        ctx.set_forkserver_preload(["kvproto.vllm.preload"])
    return ctx


class Engine:
    """Parent-side handle of one engine process."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        ctx = _start_context()
        self._conn, child = ctx.Pipe()
        sd = _spec_dict(spec)
        sd["base_env"] = dict(os.environ)  # a forked engine gets this process's env too
        self._proc = ctx.Process(target=engine_main, args=(child, sd),
                                 name=f"vllm-{spec.name}",
                                 # TP > 1 spawns worker processes, which a daemonic
                                 # process may not; kill_all still ends it at exit
                                 daemon=spec.tensor_parallel_size == 1)
        self._seq = 0
        self._replies: dict[int, Any] = {}
        self.results: dict[str, Result] = {}
        self.info: dict[str, Any] = {}
        self._ready = False
        self._dead = False
        self._proc.start()
        self.pid = int(self._proc.pid or 0)
        _LIVE[self.pid] = self
        STARTED.append(self.pid)
        del STARTED[:-_MAX_STARTED]
        child.close()

    # -- lifecycle
    def wait_ready(self, timeout: float = 240.0) -> Engine:
        deadline = time.monotonic() + timeout
        while not self._ready:
            self._pump(deadline - time.monotonic())
            if time.monotonic() > deadline and not self._ready:
                raise HarnessError(f"{self.spec.name}: not ready after {timeout:.0f} s"
                                   f"{self._log_tail()}")
        return self

    def cpu_seconds(self) -> float:
        """CPU time (user + system, all threads) the engine process has used so far;
        0.0 where /proc is unavailable or the process is gone."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def alive(self) -> bool:
        return self._proc.is_alive() and not self._dead

    def kill(self) -> None:
        """kill -9 the engine's process group (the engine and anything it started)."""
        _LIVE.pop(self.pid, None)
        if self.pid and self._proc.is_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self._proc.join(10)
        self._dead = True
        with contextlib.suppress(OSError):
            self._conn.close()

    def close(self, timeout: float = 20.0) -> None:
        """Ask the engine to shut down cleanly (connector ``shutdown`` runs), then kill."""
        if self.alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(("stop",))
            self._proc.join(timeout)
        self.kill()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests
    def submit(self, rid: str, prompt: Sequence[int], *, max_tokens: int = 8, n: int = 1,
               kv_transfer_params: dict[str, Any] | None = None,
               temperature: float = 0.0, seed: int | None = None) -> None:
        sp = {"max_tokens": max_tokens, "n": n, "temperature": temperature,
              "ignore_eos": True, "seed": seed}
        self._send(("add", rid, list(prompt), sp, kv_transfer_params))

    def abort(self, rids: Iterable[str], *, core: bool = False) -> None:
        """Abort requests. ``core``: straight into the engine core by internal id, which
        also reaches requests whose output already finished (P after its prefill)."""
        self._send(("abort", list(rids), core))

    def abort_on(self, rid: str, status: str = "WAITING_FOR_REMOTE_KVS") -> None:
        """Abort ``rid`` (as a client would) right after the first engine step that leaves
        it in ``status``; for D, WAITING_FOR_REMOTE_KVS means its READ was issued and has
        not completed yet (an abort during the read)."""
        self._send(("abort_on", rid, status))

    def pause(self, seconds: float) -> None:
        """Stop stepping the engine for ``seconds`` (a stalled scheduler)."""
        self._send(("pause", seconds))

    def wait(self, rids: Iterable[str], timeout: float = 120.0) -> dict[str, Result]:
        want = list(rids)
        deadline = time.monotonic() + timeout
        while any(r not in self.results for r in want):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in want if r not in self.results]
                raise HarnessError(f"{self.spec.name}: {len(missing)} requests unfinished "
                                   f"after {timeout:.0f} s: {missing[:5]}")
            self._pump(min(left, 1.0))
        return {r: self.results[r] for r in want}

    def generate(self, prompts: Mapping[str, Sequence[int]], *, timeout: float = 120.0,
                 **kw: Any) -> dict[str, Result]:
        for rid, p in prompts.items():
            self.submit(rid, p, **kw)
        return self.wait(prompts, timeout)

    def poll(self, timeout: float = 0.0) -> None:
        """Read whatever the engine has sent (results) without waiting for anything."""
        self._pump(timeout)

    def unread_bytes(self) -> int:
        """Bytes the engine sent that this side has not read yet (tests of the pipe)."""
        buf = array.array("i", [0])
        fcntl.ioctl(self._conn.fileno(), termios.FIONREAD, buf)
        return int(buf[0])

    # -- counters
    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """``free_blocks``, ``total_blocks``, ``scheduler_requests`` (requests the
        scheduler still holds, finished-but-delayed-free ones included), ``running``,
        ``waiting``, ``unfinished``, ``time``."""
        return dict(self._call(("stats",), timeout))

    def held(self, timeout: float = 30.0) -> dict[str, int]:
        """Requests the scheduler keeps after they finished (P: blocks held for a remote
        reader), by internal id, with the number of KV blocks each still holds."""
        return {str(k): int(v) for k, v in self._call(("held",), timeout).items()}

    def connector_call(self, method: str, *args: Any, worker: bool = False,
                       timeout: float = 30.0) -> Any:
        """Call a method of the engine's connector (scheduler side, or the worker side)
        and return its (picklable) result; None when there is no such method."""
        return self._call(("connector", worker, method, list(args)), timeout)

    def core_call(self, method: str, timeout: float = 30.0, **kwargs: Any) -> Any:
        """Call one of the engine core's own operations (``engine_child.CORE_CALLS``:
        ``reset_prefix_cache``, ``pause_scheduler``, ...) with ``kwargs``; its
        (picklable) result. An exception in the engine raises :class:`HarnessError`
        naming it, and the engine keeps running."""
        return self._call(("core", method, kwargs), timeout)

    def connector_stats(self, method: str = "kvproto_stats") -> dict[str, Any]:
        """``method()`` of the scheduler-side and the worker-side connector, merged
        (numbers added, dicts merged key by key); {} when neither has it."""
        merged: dict[str, Any] = {}
        for worker in (False, True):
            part = self.connector_call(method, worker=worker)
            if isinstance(part, dict):
                _merge(merged, part)
        return merged

    # -- internals
    def _call(self, msg: tuple[Any, ...], timeout: float) -> Any:
        self._seq += 1
        seq = self._seq
        self._send(("call", seq, msg))
        deadline = time.monotonic() + timeout
        while seq not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(f"{self.spec.name}: no answer to {msg[0]} in {timeout} s")
            self._pump(min(left, 1.0))
        ok, value = self._replies.pop(seq)
        if not ok:
            raise HarnessError(f"{self.spec.name}: {msg[0]} failed: {value}")
        return value

    def _send(self, msg: tuple[Any, ...]) -> None:
        if not self.alive():
            raise HarnessError(f"{self.spec.name}: engine process is not running")
        try:
            self._conn.send(msg)
        except (OSError, BrokenPipeError) as e:
            raise HarnessError(f"{self.spec.name}: engine pipe closed: {e}") from e

    def _pump(self, timeout: float) -> None:
        try:
            if not self._conn.poll(max(0.0, timeout)):
                if not self._proc.is_alive():
                    self._dead = True
                    raise HarnessError(f"{self.spec.name}: engine process exited "
                                       f"(code {self._proc.exitcode}){self._log_tail()}")
                return
            while True:
                self._handle(self._conn.recv())
                if not self._conn.poll(0):
                    return
        except (EOFError, OSError) as e:
            self._dead = True
            raise HarnessError(f"{self.spec.name}: engine process gone ({e})"
                               f"{self._log_tail()}") from e

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            self._ready = True
            self.info = dict(msg[1])
        elif kind == "out":
            r = Result(**msg[1])
            self.results[r.rid] = r
        elif kind == "reply":
            self._replies[msg[1]] = (msg[2], msg[3])
        elif kind == "fatal":
            self._dead = True
            raise HarnessError(f"{self.spec.name}: {msg[1]}")

    def _log_tail(self, lines: int = 30) -> str:
        if not self.spec.log_path:
            return ""
        try:
            text = Path(self.spec.log_path).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n--- " + self.spec.log_path + " ---\n" + "\n".join(text[-lines:])


def _merge(into: dict[str, Any], part: dict[str, Any]) -> None:
    for k, v in part.items():
        old = into.get(k)
        if isinstance(v, dict):
            sub = old if isinstance(old, dict) else {}
            _merge(sub, v)
            into[k] = sub
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and \
                isinstance(old, (int, float)) and not isinstance(old, bool):
            into[k] = old + v
        else:
            into[k] = v


def _spec_dict(spec: EngineSpec) -> dict[str, Any]:
    return {"name": spec.name, "model": spec.model,
            "kv_transfer_config": spec.kv_transfer_config, "env": dict(spec.env),
            "kv_cache_memory_bytes": spec.kv_cache_memory_bytes,
            "block_size": spec.block_size, "max_model_len": spec.max_model_len,
            "max_num_seqs": spec.max_num_seqs, "log_path": spec.log_path,
            "prefix_caching": spec.prefix_caching,
            "tensor_parallel_size": spec.tensor_parallel_size,
            "max_num_batched_tokens": spec.max_num_batched_tokens,
            "worker_start": spec.worker_start, "stall_dump_s": spec.stall_dump_s}


# ---------------------------------------------------------------------------- P/D pairs


def engine_env(extra: dict[str, str] | None = None, *,
               side_channel_port: int | None = None) -> dict[str, str]:
    """The environment every engine process gets: in-process engine core (one pid per
    engine), one OpenMP thread without pinning (several engines share 2 cores), and a
    NIXL side-channel port of its own."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": "1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port or free_port()),
           "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra or {})
    return env


def start_engines(specs: Sequence[EngineSpec], timeout: float = 300.0) -> list[Engine]:
    """Start several engines at once and wait until all are ready; on any failure every
    one of them is killed before the error propagates."""
    engines: list[Engine] = []
    try:
        for s in specs:
            engines.append(Engine(s))
        for e in engines:
            e.wait_ready(timeout)
    except BaseException:
        for e in engines:
            e.kill()
        raise
    return engines


def pd_specs(model: str, workdir: str | os.PathLike[str], connector: dict[str, Any], *,
             tag: str = "", extra_config: dict[str, Any] | None = None,
             p_extra: dict[str, Any] | None = None, d_extra: dict[str, Any] | None = None,
             p_kv_bytes: int = 128 << 20, d_kv_bytes: int = 128 << 20,
             env: dict[str, str] | None = None, prefix_caching: bool = False
             ) -> tuple[EngineSpec, EngineSpec]:
    """Specs of a P and a D engine with ``connector`` (``STOCK_CONNECTOR`` or
    ``KVPROTO_CONNECTOR``); ``extra_config`` goes into both engines'
    ``kv_connector_extra_config``, ``p_extra``/``d_extra`` into one only, both over
    ``CONNECTOR_DEFAULTS`` (KVProtoConnector only); ``prefix_caching`` on both engines."""
    wd = Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    specs = []
    for role, extra, kvb in (("P", p_extra, p_kv_bytes), ("D", d_extra, d_kv_bytes)):
        cfg = dict(connector)
        ec = dict(cfg.get("kv_connector_extra_config") or {})
        if cfg.get("kv_connector") == KVPROTO_CONNECTOR["kv_connector"]:
            ec = {**CONNECTOR_DEFAULTS, **ec}
        ec.update(extra_config or {})
        ec.update(extra or {})
        if ec:
            cfg["kv_connector_extra_config"] = ec
        specs.append(EngineSpec(name=f"{role}{tag}", model=model, kv_transfer_config=cfg,
                                env=engine_env(env), kv_cache_memory_bytes=kvb,
                                log_path=str(wd / f"{role}{tag}.log"),
                                prefix_caching=prefix_caching))
    return specs[0], specs[1]


@dataclass
class PD:
    """A running P/D pair and the router between them."""

    p: Engine
    d: Engine
    counter: int = 0

    def prefill(self, rid: str, prompt: Sequence[int], *, n: int = 1,
                timeout: float = 120.0) -> Result:
        """Run the prefill on P (max_tokens 1, do_remote_decode) and return its result,
        whose ``kv_transfer_params`` go to D. n>1 samples (vLLM refuses n>1 with greedy
        sampling); the prompt's KV does not depend on it."""
        self.p.submit(rid, prompt, max_tokens=1, n=n,
                      temperature=0.0 if n == 1 else 1.0, seed=None if n == 1 else 0,
                      kv_transfer_params={"do_remote_decode": True})
        return self.p.wait([rid], timeout)[rid]

    def submit_prefills(self, items: Mapping[str, Sequence[int]], **kw: Any) -> None:
        for rid, prompt in items.items():
            self.p.submit(rid, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True}, **kw)

    def submit_decode(self, rid: str, prompt: Sequence[int], p_result: Result, *,
                      max_tokens: int = 8, n: int = 1, temperature: float = 0.0,
                      seed: int | None = None) -> None:
        """Send a request to D with P's transfer params, unchanged."""
        self.d.submit(rid, prompt, max_tokens=max_tokens, n=n, temperature=temperature,
                      seed=seed, kv_transfer_params=p_result.kv_transfer_params)

    def run(self, prompts: Mapping[str, Sequence[int]], *, max_tokens: int = 8,
            timeout: float = 180.0) -> dict[str, Result]:
        """The whole P/D path for several requests in flight at once: all prefills on P,
        each decode sent to D as soon as its prefill returns; D's results."""
        self.submit_prefills(prompts)
        routed: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(routed) < len(prompts):
            if time.monotonic() > deadline:
                raise HarnessError(f"P: {len(prompts) - len(routed)} prefills unfinished")
            self.p.poll(0.05)
            for rid in prompts:
                if rid not in routed and rid in self.p.results:
                    self.submit_decode(rid, prompts[rid], self.p.results[rid],
                                       max_tokens=max_tokens)
                    routed.add(rid)
            self.d.poll(0)
        return self.d.wait(prompts, max(1.0, deadline - time.monotonic()))

    def warm_up(self, tag: str = "warm", count: int = 2, max_tokens: int = 4) -> None:
        """``count`` short requests through P then D, their tokens not checked: a fresh
        pair's first contact (handshake, the first claims) and each engine's first decode
        steps (several seconds for a TP engine on 2 cores, while the prefilled requests'
        leases run on P) are paid here, not by the first requests a test measures against
        a short lease. Each engine's stats and journals include these requests.
        ``HarnessError`` if one of them ends with an error."""
        prompts = make_prompts(count, seed=7919, lengths=[BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 1])
        items = {f"{tag}-{i}": pr for i, pr in enumerate(prompts)}
        failed = {rid: r.error for rid, r in self.run(items, max_tokens=max_tokens).items()
                  if r.error is not None}
        if failed:
            raise HarnessError(f"warm-up requests failed: {failed}")

    def close(self) -> None:
        for e in (self.d, self.p):
            e.close()
