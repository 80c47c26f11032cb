"""P's NIXL progress thread sleeps between passes (``progress_delay_us``), and the
server-path idle benchmark's harness: options, the agent's config, per-process CPU
accounting of a stack's process groups, usage errors. No engine."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvproto.vllm.sched import IDLE_WAIT_MS, PROGRESS_DELAY_US, ConnectorOptions


def test_progress_delay_option_parses_and_rejects_bad_values() -> None:
    assert ConnectorOptions.parse({}).progress_delay_us == PROGRESS_DELAY_US == 0
    assert ConnectorOptions.parse({"progress_delay_us": 0}).progress_delay_us == 0
    assert ConnectorOptions.parse({"progress_delay_us": 250}).progress_delay_us == 250
    assert ConnectorOptions.parse({}).idle_wait_ms == IDLE_WAIT_MS > 0
    for bad in (-1, 100_001, 1.5, True, "50"):
        with pytest.raises(ValueError, match="progress_delay_us"):
            ConnectorOptions.parse({"progress_delay_us": bad})


@pytest.mark.parametrize(("prog", "delay", "want"), [(True, 50, 50), (True, 0, None),
                                                     (False, 50, None)])
def test_agent_progress_thread_gets_the_delay(prog: bool, delay: int, want: int | None
                                              ) -> None:
    """The agent's native config carries the delay exactly when the thread runs with one;
    the binding is restored afterwards either way."""
    pytest.importorskip("nixl._api")
    from nixl._api import nixl_agent

    from kvproto.nixl.agent import make_agent

    bind = sys.modules[nixl_agent.__module__].nixlBind
    native = bind.nixlAgent
    seen: list[Any] = []

    def spy(name: str, cfg: Any) -> Any:
        seen.append((cfg.useProgThread, cfg.pthrDelay))
        return native(name, cfg)

    bind.nixlAgent = spy
    try:
        make_agent(f"delay-{prog}-{delay}-{time.monotonic_ns()}", progress_thread=prog,
                   progress_delay_us=delay)
        assert bind.nixlAgent is spy  # make_agent put back what it found
    finally:
        bind.nixlAgent = native
    assert len(seen) == 1
    assert seen[0][0] is prog
    if want is None:
        assert seen[0][1] == 0
    else:
        assert seen[0][1] == want


def test_cpu_accounting_covers_every_process_of_the_group(tmp_path: Path) -> None:
    """A stack process's children (vLLM's engine core and worker) are in its group:
    ``cpu_seconds`` finds them and names each by its kind."""
    pytest.importorskip("psutil")
    from kvproto.testing.serve import Proc, cpu_per_second, cpu_seconds, process_kind

    child = "import time\nwhile True: time.sleep(0.05)"
    parent = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', "
              f"{child!r}])\nprint(p.pid, flush=True)\nend = time.monotonic() + 1.0\n"
              "while time.monotonic() < end: pass\ntime.sleep(60)")
    proc = Proc("t-P", [sys.executable, "-c", parent], {}, tmp_path / "t-P.log")
    try:
        deadline = time.monotonic() + 30.0  # a hang bound
        while not proc.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        kid = int(proc.log_path.read_text().split()[0])
        assert process_kind(kid) == "other"
        got = cpu_seconds([proc])
        assert set(got) == {"t-P/other"}
        rates = cpu_per_second([proc], 0.2)
        assert set(rates) == {"t-P/other"} and rates["t-P/other"] >= 0.0
    finally:
        proc.stop(timeout=5.0)
    assert not proc.group_alive()
    assert cpu_seconds([proc]) == {}


@pytest.mark.parametrize("argv", [["--path", "server", "--variants", "stock,nope"],
                                  ["--path", "server", "--variants", ","],
                                  ["--path", "elsewhere"]])
def test_idle_server_usage_errors_exit_2(argv: list[str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from kvproto.cli import main

    with pytest.raises(SystemExit) as e:
        sys.exit(main(["bench", "idle", *argv]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "idle" in err[-1]


def test_reads_complete_while_p_only_has_its_sleeping_progress_thread() -> None:
    """P's agent with the progress thread sleeping between passes still serves D's READs:
    once D posts its READ, P's own loop is never polled again, and D's READs (data, then
    stamps) complete and verify."""
    pytest.importorskip("nixl._api")
    import itertools
    import os

    from kvproto.lifecycle import Config
    from kvproto.nixl.agent import fill_pattern
    from kvproto.nixl.consumer import Completion, ConsumerAdapter
    from kvproto.nixl.producer import ProducerAdapter

    cfg = Config(initial_lease=30.0, lease_extension=20.0, heartbeat_interval=3.0,
                 abort_grace=30.0, max_delay=1.0, max_read_time=10.0, clock_drift=0.5)
    bb, n = 4096, 3
    tag = f"{os.getpid()}-{next(itertools.count())}-{time.monotonic_ns()}"
    p = ProducerAdapter(f"P-{tag}", cfg, num_blocks=8, block_bytes=bb, progress_thread=True,
                        progress_delay_us=50)
    d = ConsumerAdapter(f"D-{tag}", cfg, num_blocks=8, block_bytes=bb)
    try:
        d.add_engine(p.name, p.host, p.port)
        blocks = p.allocate(n)
        assert blocks is not None
        for i, b in enumerate(blocks):
            p.region.kv[b] = fill_pattern("r", i, bb, p.region.device)
        params = p.register("r", blocks)
        assert params is not None
        posted: list[str] = []
        d.phase_hook = lambda phase, rid: posted.append(phase)
        d.admit("r", params)
        d.schedule("r")
        comps: list[Completion] = []
        deadline = time.monotonic() + 30.0  # hang bounds, not timings
        while "before_post" not in posted and time.monotonic() < deadline:
            p.poll()  # the handshake
            comps += d.poll()
            time.sleep(0.001)
        assert "before_post" in posted
        deadline = time.monotonic() + 30.0
        while not comps and time.monotonic() < deadline:
            comps += d.poll()  # P is not polled from here on
            time.sleep(0.001)
        assert [(c.request_id, c.state, c.reason) for c in comps] == [("r", "done", "pulled")]
        local = comps[0].local_blocks
        assert local is not None
        assert all(torch.equal(d.region.kv[lb], fill_pattern("r", i, bb, d.region.device))
                   for i, lb in enumerate(local))
    finally:
        d.close(timeout=1.0)
        p.close()
