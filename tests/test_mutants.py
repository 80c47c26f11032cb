"""The stateful fuzzer finds bugs: every known upstream lifecycle bug, re-introduced into
the P machine by table rows or documented public hooks (``kvproto.testing.mutants``), is
caught within the CI budget by one of the invariants the mutant lists in ``caught_by``.

The runs are derandomized, so each result is reproducible. Each test can fail: the real
``Ledger`` under exactly the same budget and settings finds nothing
(``test_the_real_ledger_passes_the_same_budget``), so a mutant run that raises is a
detection, not noise. The fuzzer runs the production D driver too, and a driver mutant
(``DRIVER_MUTANTS``: one that skips stamp fencing) is caught the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import budget_d_journal
from hypothesis import Phase, settings

from kvproto.lifecycle import P_TABLE, Consumer, Ledger
from kvproto.nixl.driver_d import DDriver
from kvproto.testing import fuzz
from kvproto.testing.mutants import D_MUTANTS, DRIVER_MUTANTS, MUTANTS, DriverMutant, Mutant
from kvproto.verify.dconformance import check_d_journal

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)


def mutant_budget() -> settings:
    """The CI budget, deterministic; shrinking off (only *whether* and *how* the mutant is
    caught matters here, and shrinking can take minutes)."""
    return settings(fuzz.ci_settings(), phases=[Phase.explicit, Phase.generate])


def test_every_mutant_overrides_table_rows_or_documented_hooks_only() -> None:
    assert len(MUTANTS) == 4
    for m in MUTANTS.values():
        assert issubclass(m.ledger_cls, Ledger) and m.ledger_cls is not Ledger
        assert m.caught_by and m.caught_by <= fuzz.INVARIANTS, m.name
        overridden = {k for k, v in vars(m.ledger_cls).items()
                      if callable(v) and getattr(Ledger, k, None) is not v
                      and not k.startswith("__")}
        rows = [k for k in P_TABLE if m.ledger_cls.TABLE[k] != P_TABLE[k]]
        assert overridden or rows, f"{m.name} changes nothing"
        # Documented hooks (and the public register) only: no copy of the internals.
        assert overridden <= {"tally", "sweep", "register"}, (m.name, overridden)


@pytest.mark.parametrize("mutant", list(MUTANTS.values()), ids=lambda m: m.name)
def test_the_fuzzer_catches_the_mutant(mutant: Mutant,
                                      record_property: Callable[[str, object], None]) -> None:
    fuzz.FuzzCounters.reset()
    with pytest.raises(fuzz.InvariantViolation) as info:
        fuzz.run_fuzz(fuzz.machine_class(mutant.ledger_cls), mutant_budget())
    assert info.value.invariant in mutant.caught_by, str(info.value)
    record_property("examples_to_catch", fuzz.FuzzCounters.examples)


def test_the_real_ledger_passes_the_same_budget() -> None:
    fuzz.FuzzCounters.reset()
    fuzz.run_fuzz(fuzz.machine_class(Ledger), mutant_budget())
    assert fuzz.FuzzCounters.examples >= fuzz.CI_EXAMPLES


def test_every_d_mutant_overrides_documented_hooks_or_rows_only() -> None:
    for m in D_MUTANTS.values():
        assert issubclass(m.consumer_cls, Consumer) and m.consumer_cls is not Consumer
        overridden = {k for k, v in vars(m.consumer_cls).items()
                      if callable(v) and getattr(Consumer, k, None) is not v
                      and not k.startswith("__")}
        # documented hooks only, or rows of the table
        assert overridden <= {"sweep_leases", "sweep_reads", "refuses_load"}, (m.name, overridden)
        assert overridden or m.consumer_cls.TABLE != Consumer.TABLE, m.name


def test_d_journal_validation_catches_the_unbounded_tick(tmp_path: Path) -> None:
    """The mutant's journal breaks TickBounded (a tick failed more leases than
    max_tick_work: 5 and 4 against a budget of 2); the real Consumer's journal of the
    same inputs passes. TLC's trace validation catches it too (tests/test_dconformance.py)."""
    m = D_MUTANTS["unbounded_tick"]
    real = check_d_journal(budget_d_journal(tmp_path / "real.jsonl"))
    assert real.allowed, real.describe()
    bad = check_d_journal(budget_d_journal(tmp_path / "mutant.jsonl", m.consumer_cls))
    assert not bad.allowed
    caught = [p for p in bad.problems if p.startswith("VIOLATION")]
    assert caught and all(any(c in p for c in m.caught_by) for p in caught), caught
    assert "a tick failed 5 leases, more than max_tick_work (2)" in caught[0]

# ---------------------------------------------------------------------------
# Driver mutants: the fuzzer runs the production D driver, so a bug there is caught too.
# ---------------------------------------------------------------------------


def test_every_driver_mutant_overrides_documented_hooks_only() -> None:
    assert DRIVER_MUTANTS
    for m in DRIVER_MUTANTS.values():
        assert issubclass(m.driver_cls, DDriver) and m.driver_cls is not DDriver
        assert m.caught_by and m.caught_by <= fuzz.INVARIANTS, m.name
        overridden = {k for k, v in vars(m.driver_cls).items()
                      if callable(v) and getattr(DDriver, k, None) is not v
                      and not k.startswith("__")}
        assert overridden and overridden <= {"_fenced", "_corrupt"}, (m.name, overridden)


@pytest.mark.parametrize("mutant", list(DRIVER_MUTANTS.values()), ids=lambda m: m.name)
def test_the_fuzzer_catches_the_driver_mutant(
        mutant: DriverMutant, record_property: Callable[[str, object], None]) -> None:
    fuzz.FuzzCounters.reset()
    with pytest.raises(fuzz.InvariantViolation) as info:
        fuzz.run_fuzz(fuzz.machine_class(Ledger, driver_cls=mutant.driver_cls),
                      mutant_budget())
    assert info.value.invariant in mutant.caught_by, str(info.value)
    record_property("examples_to_catch", fuzz.FuzzCounters.examples)
