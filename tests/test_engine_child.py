"""Stalled engine threads are reported, not silent.

* The test engines' step loop (kvproto.vllm.engine_child): one loop iteration slower than
  ``stall_dump_s`` writes every thread's stack to the engine's log, so that a lease lost
  to a frozen engine names where it froze. Run in a subprocess (faulthandler writes to
  the process's stderr) around a stand-in engine whose third step stalls; no vLLM needed.
* The NIXL peer metadata load, which runs on the engine thread, logs its duration when
  it is slow (kvproto.nixl.transport)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import logging, os, sys, time, types
    import multiprocessing as mp
    from kvproto.vllm.engine_child import _Child

    logging.basicConfig(level=logging.INFO)  # as engine_main does
    stall_s, slow_step = float(sys.argv[1]), int(sys.argv[2])
    a, b = mp.Pipe()

    class Sched:
        def has_requests(self): return True
        def get_request_counts(self): return (1, 0)

    class Engine:
        n = 0
        def step(self):
            self.n += 1
            if self.n == slow_step:
                time.sleep(0.8)  # a frozen step, e.g. a blocking call on the engine thread
            if self.n == 8:
                b.send(("stop",))
            return []

    sched = Sched()
    sched.kv_cache_manager = types.SimpleNamespace(block_pool=types.SimpleNamespace(
        num_gpu_blocks=1, get_num_free_blocks=lambda: 1))
    core = types.SimpleNamespace(scheduler=sched, shutdown=lambda: None)
    eng = Engine()
    eng.engine_core = types.SimpleNamespace(engine_core=core)
    child = _Child(a, eng, {"name": "x", "stall_dump_s": stall_s}, os.getppid())
    child.serve()
    child.out.flush(1.0)
    print("served", eng.n, flush=True)
""")


def _run(stall_s: float, slow_step: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, str(stall_s), str(slow_step)],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("stall_s", "slow_step", "dumped"), [
    (0.3, 3, True),    # the stalled step is named, with the stack that stalled
    (0.3, 0, False),   # fast steps: nothing written
    (0.0, 3, False),   # off (engines stopped on purpose by SIGSTOP)
])
def test_a_stalled_step_dumps_every_threads_stack(stall_s: float, slow_step: int,
                                                  dumped: bool) -> None:
    r = _run(stall_s, slow_step)
    assert r.returncode == 0 and "served 8" in r.stdout, r.stderr[-2000:]
    if dumped:  # one dump: every thread once, the main one inside the stalled step
        assert r.stderr.count("in _serve") == 1, r.stderr[-2000:]
        assert r.stderr.count("in step") == 1 and "Thread 0x" in r.stderr
        assert "stall dumps on" in r.stderr
    else:
        assert "most recent call first" not in r.stderr, r.stderr[-2000:]


def test_a_slow_nixl_metadata_load_is_logged(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """The peer metadata load runs on the engine thread; a slow one says how long the
    thread was blocked, a fast one says nothing."""
    pytest.importorskip("torch")
    import time

    from kvproto.nixl import transport

    class Agent:
        def __init__(self, delay: float) -> None:
            self.delay = delay

        def add_remote_agent(self, metadata: bytes) -> bytes:
            time.sleep(self.delay)
            return metadata

    monkeypatch.setattr(transport, "SLOW_METADATA_LOAD_S", 0.05)
    with caplog.at_level("WARNING", logger="kvproto.nixl.transport"):
        assert transport._add_remote_agent(Agent(0.0), b"fast", "P0") == b"fast"
        assert not caplog.records
        assert transport._add_remote_agent(Agent(0.1), b"slow", "P1") == b"slow"
    [rec] = caplog.records
    msg = rec.getMessage()
    assert "loading the NIXL metadata of P1 took 0.1 s" in msg
    # A sleep is a wait: almost none of the 0.1 s was this thread's CPU time.
    assert "0.00 s of it on this thread's CPU" in msg, msg


def test_core_calls_are_the_listed_operations_only() -> None:
    """``Engine.core_call`` reaches the engine core's own operations named in
    ``CORE_CALLS`` (with keyword arguments, the result made picklable), nothing else:
    ``shutdown`` or a private method is refused before anything is called."""
    from types import SimpleNamespace

    from kvproto.vllm.engine_child import CORE_CALLS, _Child

    calls: list[tuple[str, dict[str, object]]] = []

    class Core:
        def reset_prefix_cache(self, **kw: object) -> bool:
            calls.append(("reset_prefix_cache", kw))
            return False

        def shutdown(self) -> None:
            calls.append(("shutdown", {}))

    child = SimpleNamespace(core=Core())
    assert "reset_prefix_cache" in CORE_CALLS and "shutdown" not in CORE_CALLS
    got = _Child._call(child, ("core", "reset_prefix_cache",  # type: ignore[arg-type]
                               {"reset_running_requests": True}))
    assert got is False and calls == [("reset_prefix_cache", {"reset_running_requests": True})]
    for bad in ("shutdown", "_preempt_request", "__class__"):
        with pytest.raises(ValueError, match="is not one of"):
            _Child._call(child, ("core", bad, {}))  # type: ignore[arg-type]
    assert len(calls) == 1
