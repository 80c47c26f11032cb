"""P's NIXL progress thread sleeps between passes (``progress_delay_us``), and the
server-path idle benchmark's harness: options, the agent's config, per-process CPU
accounting of a stack's process groups, usage errors. No engine."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvproto.vllm.sched import IDLE_WAIT_MS, PROGRESS_DELAY_US, ConnectorOptions


def test_progress_delay_option_parses_and_rejects_bad_values() -> None:
    assert ConnectorOptions.parse({}).progress_delay_us == PROGRESS_DELAY_US > 0
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
