"""D-side conformance (issue 10, part 2): the journals of the simulator's D ranks follow
D's transition table (``kvproto.verify.dconformance``, what ``kvproto validate`` does
with a D journal). The real NIXL run's D journal is checked in
``tests/test_nixl_procs.py`` (a silent P lost after ``peer_timeout``)."""

from __future__ import annotations

import json
from pathlib import Path

from kvproto.journal import JournalWriter
from kvproto.sim import Faults, Simulator
from kvproto.verify.dconformance import check_d_journal, is_d_journal


def sim_d_journals(tmp_path: Path, seed: int, duration: float = 40.0) -> list[Path]:
    sim = Simulator(seed, faults=Faults())  # the default faults: loss, crashes, aborts...
    writers: list[JournalWriter] = []
    paths: list[Path] = []
    for name, rank in sim.ranks.items():
        p = tmp_path / f"{seed}-{name}.jsonl"
        w = JournalWriter(p, sim.config, None, {"source": "sim", "seed": seed}, reader=name)
        rank.sink = w.sink
        writers.append(w)
        paths.append(p)
    sim.run(duration)
    for w in writers:
        w.close()
    return paths


def test_simulator_d_journals_follow_the_d_table(tmp_path: Path) -> None:
    finished: dict[str, int] = {}
    events = 0
    for seed in (1, 2):
        for p in sim_d_journals(tmp_path, seed):
            assert is_d_journal(p)
            v = check_d_journal(p)
            assert v.allowed, v.describe()
            events += v.events
            for k, n in v.finished.items():
                finished[k] = finished.get(k, 0) + n
    assert events > 1000
    assert finished.get("done:pulled", 0) > 10  # real traffic, not an idle run
    assert len(finished) >= 3, finished  # several ways of leaving the machine


def test_a_d_journal_whose_effects_were_changed_is_rejected(tmp_path: Path) -> None:
    path = max(sim_d_journals(tmp_path, 3, 20.0), key=lambda p: p.stat().st_size)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    i = next(i for i, r in enumerate(rows) if i and any(
        e["type"] == "post_read" for e in r["effects"]))
    for e in rows[i]["effects"]:
        if e["type"] == "post_read":
            e["blocks"] = [b + 1 for b in e["blocks"]]  # D would read the wrong blocks
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = check_d_journal(path)
    assert not v.allowed
    assert any(f"line {i + 1}:" in p for p in v.problems), v.describe()
