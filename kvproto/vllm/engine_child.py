"""The engine side of :mod:`kvproto.vllm.harness`: what runs in each engine process.

:func:`engine_main` builds vLLM's ``LLMEngine`` from the spec the parent sent, then serves
the pipe: it reads the parent's commands (submit, abort, pause, counters, connector
calls) between engine steps and sends back outputs and replies through an outbox thread,
so it never blocks on a full pipe while the parent is sending. It exits when the parent
goes away or asks it to stop.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

# A loop iteration (one engine step, or one command) that takes longer than this dumps
# every thread's stack into the engine's log: a stalled engine is a diagnosis, not a
# silent lease loss. Shorter than the margin a D keeps before it gives a lease up
# (about 4.4 s with the TP tests' lease), longer than most steps of the tiny models.
# The spec's ``stall_dump_s`` overrides it (0: off).
STALL_DUMP_S = 4.0


def engine_main(conn: Connection, spec: dict[str, Any]) -> None:  # pragma: no cover
    """Entry point of an engine process (forked from the fork server, or spawned): build
    the engine, serve the pipe."""
    os.setsid()  # own process group: kill -9 of the group takes everything with it
    parent = os.getppid()
    if "base_env" in spec:  # as a spawned child would: this process's env as the parent's
        os.environ.clear()
        os.environ.update(spec["base_env"])
    os.environ.update(spec["env"])
    if spec.get("log_path"):
        fd = os.open(spec["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{spec['name']}] %(name)s: "
                               "%(message)s")
    try:
        engine = _build_engine(spec)
    except BaseException as e:
        logging.getLogger(__name__).exception("engine %s failed to start", spec["name"])
        with contextlib.suppress(OSError):
            conn.send(("fatal", f"failed to start: {type(e).__name__}: {e}"))
        os._exit(3)
    child = _Child(conn, engine, spec, parent)
    try:
        child.serve()
    finally:
        child.out.flush(timeout=5.0)
    os._exit(0)


def _build_engine(spec: dict[str, Any]) -> Any:  # pragma: no cover - child process
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    if spec.get("worker_start", "spawn") == "fork":
        _fork_workers()
    ktc = spec["kv_transfer_config"]
    args = EngineArgs(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], block_size=spec["block_size"],
        max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=bool(spec.get("prefix_caching")), dtype="float32", seed=0,
        tensor_parallel_size=int(spec.get("tensor_parallel_size", 1)),
        kv_transfer_config=KVTransferConfig(**ktc) if ktc else None,
        **({"max_num_batched_tokens": spec["max_num_batched_tokens"],
            "enable_chunked_prefill": True}
           if spec.get("max_num_batched_tokens") else {}),
    )
    return LLMEngine.from_engine_args(args)


def _fork_workers() -> None:  # pragma: no cover - child process
    """Make vLLM's multiprocess executor fork its TP workers from this process instead
    of spawning them (vLLM's CPU platform forces spawn in its config hook, so the
    executor's own context getter is replaced here). Safe while this process has started
    no thread: the engine is built before the outbox thread starts."""
    import multiprocessing

    import vllm.v1.executor.multiproc_executor as mpe

    if threading.active_count() != 1:
        raise RuntimeError("worker_start=fork needs a single-threaded engine process")
    ctx = multiprocessing.get_context("fork")
    mpe.get_mp_context = lambda: ctx


class _Outbox:  # pragma: no cover - runs in the engine process
    """The child's sending side: one thread sends what the engine loop queued, so the
    loop never blocks on a full pipe and always goes on reading the parent's commands.
    The parent sends without reading in between (a burst of submits); were the child to
    block sending outputs meanwhile, each would wait on the other forever. The queue is
    unbounded: it holds at most the outputs of the requests the parent submitted and
    the replies to its calls, which the parent drains whenever it waits."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="harness-outbox", daemon=True)
        self.thread.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self.q.put(msg)

    def _run(self) -> None:
        while (msg := self.q.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError:
                return  # the parent is gone; what is left has no reader

    def flush(self, timeout: float) -> None:
        """Send everything queued (a last ``fatal`` included) before the process exits."""
        self.q.put(None)
        self.thread.join(timeout)


class _Child:  # pragma: no cover - runs in the engine process
    def __init__(self, conn: Connection, engine: Any, spec: dict[str, Any],
                 parent: int) -> None:
        self.conn = conn
        self.out = _Outbox(conn)
        self.engine = engine
        self.spec = spec
        self.parent = parent
        self.core = engine.engine_core.engine_core          # EngineCore (in-process)
        self.sched = self.core.scheduler
        self.pool = self.sched.kv_cache_manager.block_pool
        self.ids: dict[str, str] = {}                       # external rid -> internal id
        self.meta: dict[str, dict[str, Any]] = {}           # rid -> submit/first times
        self.paused_until = 0.0
        self.abort_when: dict[str, str] = {}                # rid -> status name
        self.log = logging.getLogger("kvproto.vllm.harness.child")

    def serve(self) -> None:
        self.out.send(("ready", {"pid": os.getpid(), "total_blocks": self.pool.num_gpu_blocks,
                                 "free_blocks": self.pool.get_num_free_blocks()}))
        stall = float(self.spec.get("stall_dump_s", STALL_DUMP_S) or 0.0)
        if stall > 0:
            # SIGALRM's handler is faulthandler's, in C: it writes every thread's stack
            # even while the stalled call holds the GIL. (faulthandler's own timer starts
            # a thread per re-arm, about 0.2 ms; setitimer is one system call.)
            faulthandler.register(signal.SIGALRM, file=sys.stderr, all_threads=True)
            self.log.info("stall dumps on: a step-loop iteration over %.1f s writes every "
                          "thread's stack here", stall)
        try:
            self._serve(stall)
        finally:
            if stall > 0:
                signal.setitimer(signal.ITIMER_REAL, 0)
                faulthandler.unregister(signal.SIGALRM)

    def _serve(self, stall: float) -> None:
        while True:
            if stall > 0:
                # Re-armed every iteration (an idle iteration waits at most 20 ms for a
                # command): fires only when one iteration stalls. Timers are not
                # inherited by forked TP workers.
                signal.setitimer(signal.ITIMER_REAL, stall)
            if os.getppid() != self.parent:
                return
            busy = self.sched.has_requests() and time.monotonic() >= self.paused_until
            try:
                if self.conn.poll(0 if busy else 0.02):
                    msg = self.conn.recv()
                    if msg[0] == "stop":
                        if stall > 0:  # vLLM's shutdown may take seconds: not a stall
                            signal.setitimer(signal.ITIMER_REAL, 0)
                        self._shutdown()
                        return
                    self._command(msg)
                    continue
            except (EOFError, OSError):
                return
            if time.monotonic() < self.paused_until:
                continue
            try:
                outs = self.engine.step()
            except Exception as e:
                self.log.exception("engine step failed")
                with contextlib.suppress(OSError):
                    self.out.send(("fatal", f"engine step failed: {type(e).__name__}: {e}"))
                return
            self._outputs(outs)
            if not outs and self.sched.get_request_counts()[0] == 0 \
                    and self.sched.has_requests():
                # As vLLM's engine-core loop: a step that ran no model while requests
                # remain (delayed frees, remote KV) yields for a millisecond.
                time.sleep(0.001)
            if self.abort_when:
                self._abort_when()

    def _abort_when(self) -> None:
        for rid, status in list(self.abort_when.items()):
            req = self.sched.requests.get(self.ids.get(rid, rid))
            if req is not None and str(req.status) == status:
                self.log.info("aborting %s in status %s", rid, status)
                self.engine.abort_request([rid])
                del self.abort_when[rid]
                self._aborted(rid)

    def _aborted(self, rid: str) -> None:
        """An aborted request produces no output in vLLM; report one so the router's
        wait() ends (error "aborted", finish reason "abort")."""
        m = self.meta.pop(rid, None)
        if m is None:
            return
        self.out.send(("out", {"rid": rid, "internal_id": self.ids.get(rid, rid),
                               "token_ids": [], "finish_reasons": ["abort"],
                               "kv_transfer_params": None, "submit_t": m["submit_t"],
                               "first_token_t": m["first_token_t"], "finish_t": time.time(),
                               "error": "aborted"}))

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.core.shutdown()

    def _command(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(*msg[1:])
        elif kind == "abort":
            rids, core = msg[1], msg[2]
            internal = [self.ids.get(r, r) for r in rids]
            if core:
                targets = [i for i in self.sched.requests
                           if any(i == x or i.startswith(x + "_") or i.endswith("_" + x)
                                  for x in internal)] or internal
                self.core.abort_requests(targets)
                self.engine.output_processor.abort_requests(internal, internal=True)
            else:
                self.engine.abort_request(list(rids))
            for r in rids:
                self._aborted(r)
        elif kind == "abort_on":
            self.abort_when[msg[1]] = msg[2]
        elif kind == "pause":
            self.paused_until = time.monotonic() + float(msg[1])
        elif kind == "call":
            seq, inner = msg[1], msg[2]
            try:
                value = self._call(inner)
                self.out.send(("reply", seq, True, value))
            except Exception as e:
                self.out.send(("reply", seq, False, f"{type(e).__name__}: {e}"))

    def _add(self, rid: str, prompt: list[int], sp: dict[str, Any],
             ktp: dict[str, Any] | None) -> None:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": ktp} if ktp is not None else None
        now = time.time()
        try:
            params = SamplingParams(max_tokens=sp["max_tokens"], n=sp["n"],
                                    temperature=sp["temperature"],
                                    ignore_eos=sp["ignore_eos"], seed=sp["seed"],
                                    extra_args=extra)
            internal = self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        except Exception as e:
            self.out.send(("out", {"rid": rid, "internal_id": "", "token_ids": [],
                                   "finish_reasons": [], "kv_transfer_params": None,
                                   "submit_t": now, "first_token_t": None,
                                   "finish_t": time.time(),
                                   "error": f"{type(e).__name__}: {e}"}))
            return
        self.ids[rid] = internal
        self.meta[rid] = {"submit_t": now, "first_token_t": None}

    def _outputs(self, outs: list[Any]) -> None:
        now = time.time()
        for o in outs:
            rid = getattr(o, "request_id", None)
            m = self.meta.get(rid) if rid is not None else None
            if m is None:
                # output processor may report internal ids; map back
                for ext, internal in self.ids.items():
                    if internal == rid:
                        rid, m = ext, self.meta.get(ext)
                        break
            if m is None or rid is None:
                continue
            if m["first_token_t"] is None and any(len(c.token_ids) for c in o.outputs):
                m["first_token_t"] = now
            # n>1: an output may carry only the children that progressed; keep each
            # child's latest (cumulative) completion by its index
            comp = m.setdefault("comp", {})
            for c in o.outputs:
                comp[c.index] = (list(c.token_ids), c.finish_reason)
            if not o.finished:
                continue
            done = [comp[i] for i in sorted(comp)]
            self.out.send(("out", {
                "rid": rid, "internal_id": self.ids.get(rid, rid),
                "token_ids": [t for t, _ in done],
                "finish_reasons": [f for _, f in done],
                "kv_transfer_params": _plain(o.kv_transfer_params),
                "submit_t": m["submit_t"], "first_token_t": m["first_token_t"],
                "finish_t": now, "error": None}))
            self.meta.pop(rid, None)

    def _call(self, inner: tuple[Any, ...]) -> Any:
        kind = inner[0]
        if kind == "stats":
            running, waiting = self.sched.get_request_counts()
            return {"free_blocks": self.pool.get_num_free_blocks(),
                    "total_blocks": self.pool.num_gpu_blocks,
                    "scheduler_requests": len(self.sched.requests),
                    "running": running, "waiting": waiting,
                    "unfinished": self.sched.get_num_unfinished_requests(),
                    "statuses": dict(Counter(str(r.status) for r in self.sched.requests.values())),
                    "time": time.time()}
        if kind == "held":
            km = self.sched.kv_cache_manager
            return {rid: sum(len(g) for g in km.get_block_ids(rid))
                    for rid, r in self.sched.requests.items() if r.is_finished()}
        if kind == "core":
            method, kwargs = str(inner[1]), dict(inner[2])
            if method not in CORE_CALLS:
                raise ValueError(f"core call {method!r} is not one of {sorted(CORE_CALLS)}")
            return _plain(getattr(self.core, method)(**kwargs))
        if kind == "connector":
            worker, method, args = inner[1], inner[2], inner[3]
            if worker:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                target = get_kv_transfer_group()
            else:
                target = self.sched.connector
            fn = getattr(target, method, None)
            return None if fn is None else _plain(fn(*args))
        raise ValueError(f"unknown call {kind!r}")


# The engine core's own operations a test may drive (vLLM's utility calls, as its API
# server and RLHF clients make them).
CORE_CALLS = frozenset({"reset_prefix_cache", "pause_scheduler", "resume_scheduler",
                        "is_scheduler_paused"})


def _plain(value: Any) -> Any:
    """Make a value safe to pickle across the pipe (dicts, lists, scalars, strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    return repr(value)
