"""The ``kvproto`` command line, and the generated docs (diagrams, tables, TLA+ names).

Exit codes: 0 ok, 1 problem found, 2 usage or input error.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvproto import cli
from kvproto.diagram import render
from kvproto.lifecycle import P_EVENTS, P_STATES

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = [[name] for name in cli.COMMANDS] + [["bench"]] + [
    ["bench", name] for name in cli.BENCHES]


# ---------------------------------------------------------------------------
# Help and usage errors
# ---------------------------------------------------------------------------


def test_help_exits_0_and_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvproto")
    for name in [*cli.COMMANDS, "bench"]:
        assert name in out


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_subcommand_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvproto {' '.join(argv)}")


def test_no_subcommand_exits_2_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == cli.EXIT_USAGE == 2
    assert "usage: kvproto" in capsys.readouterr().err


def test_bench_without_a_benchmark_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 2
    assert "usage: kvproto" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["teleport"],
    ["--no-such-flag"],
    ["simulate", "--seeds", "many"],
    ["simulate", "--duration"],
    ["simulate", "--bogus"],
    ["replay"],
    ["diagram", "--side", "sideways"],
    ["diagram", "--format", "png"],
    ["bench", "nothing"],
])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["kvproto", "kvproto.cli"])
def test_module_entry_point_runs(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", module, "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: kvproto")


# ---------------------------------------------------------------------------
# kvproto diagram
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("side", "fmt"), [("producer", "mermaid"), ("consumer", "mermaid"),
                                           ("producer", "table"), ("consumer", "table")])
def test_diagram_prints_the_generated_diagram(side: str, fmt: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["diagram", "--side", side, "--format", fmt]) == 0
    assert capsys.readouterr().out == render(side, fmt)


def test_diagram_is_generated_from_the_table() -> None:
    p = render("producer", "mermaid")
    assert p.startswith("stateDiagram-v2\n")
    assert "    [*] --> registered: register [fresh] / hold\n" in p
    assert "    leased --> leased: heartbeat [renew] / renew\n" in p
    assert "    registered --> expired: tick [deadline_passed] / free:expired\n" in p
    assert "    aborted --> freed: tick [deadline_passed] / free:aborted\n" in p
    d = render("consumer", "mermaid")
    assert "    waiting --> reading: schedule [lease_covers_read] / read\n" in d


# ---------------------------------------------------------------------------
# Generated docs agree with the tables
# ---------------------------------------------------------------------------


def marked_block(path: Path, name: str) -> str:
    """Text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` (fails if absent)."""
    assert path.exists(), f"{path.relative_to(ROOT)} does not exist"
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"<!-- BEGIN {name} -->\n(.*?)<!-- END {name} -->", text, re.S)
    assert m is not None, (f"{path.relative_to(ROOT)} lacks the markers <!-- BEGIN {name} --> "
                           f"/ <!-- END {name} -->; run `kvproto diagram --update-docs`")
    return m.group(1)


@pytest.mark.parametrize(("name", "side"), [("P DIAGRAM", "producer"),
                                            ("D DIAGRAM", "consumer")])
def test_readme_diagram_matches_the_transition_table(name: str, side: str) -> None:
    block = marked_block(ROOT / "README.md", name)
    m = re.fullmatch(r"\s*```mermaid\n(.*?)```\s*", block, re.S)
    assert m is not None, f"README.md {name}: the block is not one ```mermaid fence"
    want = render(side, "mermaid")
    assert m.group(1) == want, (
        f"README.md's {name} disagrees with the {side} transition table: run "
        f"`kvproto diagram --side {side}` (or `kvproto diagram --update-docs`) and paste "
        f"its output between the markers")


@pytest.mark.parametrize(("name", "side"), [("P TABLE", "producer"), ("D TABLE", "consumer")])
def test_protocol_spec_table_matches_the_transition_table(name: str, side: str) -> None:
    block = marked_block(ROOT / "spec" / "PROTOCOL.md", name)
    want = render(side, "table")
    assert block.strip("\n") == want.strip("\n"), (
        f"spec/PROTOCOL.md's {name} disagrees with the {side} transition table: run "
        f"`kvproto diagram --side {side} --format table` (or `kvproto diagram --update-docs`)")


def test_tla_spec_names_every_p_state_and_event() -> None:
    tla = ROOT / "kvproto" / "tla" / "KVLedger.tla"
    if not tla.exists():
        pytest.skip("kvproto/tla/KVLedger.tla does not exist yet")
    text = tla.read_text(encoding="utf-8")
    missing_states = [s for s in P_STATES if f'"{s}"' not in text]
    assert missing_states == [], f"P states missing from {tla.name} (as strings)"
    missing_events = [e for e in P_EVENTS
                      if not re.search(rf"\b{re.escape(e)}\b", text, re.IGNORECASE)]
    assert missing_events == [], f"P events missing from {tla.name} (as action names)"


def _tla_invariants() -> set[str]:
    """Invariant and property names defined in the spec (``Name ==`` of the sections that
    PROTOCOL.md §9 and spec/TLA.md §3 list)."""
    text = (ROOT / "kvproto" / "tla" / "KVLifecycle.tla").read_text(encoding="utf-8")
    names = {"TypeOK", "NoDoubleFree", "Conservation", "NoFreeUnderRead", "StagingBounded",
             "StaleIsHarmless", "RenewalKeepsLease", "NoLeak", "ReportedIsFreed"}
    defined = {n for n in names if re.search(rf"^{n} ==", text, re.M)}
    assert defined == names, f"not defined in KVLifecycle.tla: {sorted(names - defined)}"
    return names


def test_invariants_are_named_alike_in_the_three_mirrors() -> None:
    """Every invariant of the TLA+ spec is in PROTOCOL.md §9's table and TLA.md §3's, and
    those tables name nothing the spec does not define."""
    names = _tla_invariants()
    for doc in ("PROTOCOL.md", "TLA.md"):
        text = (ROOT / "spec" / doc).read_text(encoding="utf-8")
        listed = set(re.findall(r"^\| `(\w+)`(?: \(liveness\))? \|", text, re.M)) & (
            names | {"Liveness"})
        assert listed == names, f"spec/{doc}: missing {sorted(names - listed)}"


def test_every_check_model_is_documented_and_every_cfg_is_a_model() -> None:
    from kvproto.verify.models import TLC_MODELS as MODELS

    tla_md = (ROOT / "spec" / "TLA.md").read_text(encoding="utf-8")
    cfgs = {p.name for p in (ROOT / "kvproto" / "tla").glob("MC_*.cfg")} - {"MC_ledger.cfg"}
    assert cfgs == {m.cfg for m in MODELS.values()}
    for m in MODELS.values():
        row = re.search(rf"^\| `{m.name}` \| `{re.escape(m.cfg)}` \| (.*?) \|", tla_md, re.M)
        assert row, f"spec/TLA.md §5 has no row for model {m.name}"
        assert (m.expect is None) == (row.group(1) == "pass"), (m.name, row.group(1))
        if m.expect:
            assert m.expect in row.group(1)
