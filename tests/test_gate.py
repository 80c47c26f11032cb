"""P's gate: readiness, one consumer per handle, never-registered notices (rows, caps,
counters), and the fuzzer catching each of its mutants."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproto.lifecycle import BlockPool, Config, Free, Ledger, Rejected
from kvproto.lifecycle.gate import (
    G_BOUND,
    G_NEVER,
    G_OPEN,
    GATE_TRANSITIONS,
    Gate,
    NeverNotice,
    capability,
)
from kvproto.testing.gatefuzz import GATE_MUTANTS, OP_NAMES, GateMutant, Op, explore, run_ops

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

CFG = Config(initial_lease=10.0, lease_extension=10.0, heartbeat_interval=1.0,
             abort_grace=10.0, max_delay=0.5, max_read_time=1.0, clock_drift=0.1)
KEY = b"s" * 32


def gate(**kw: int) -> Gate:
    return Gate(Ledger(CFG, BlockPool(16)), KEY, "P0", 3, **kw)


def test_capability_is_bound_to_engine_epoch_and_handle() -> None:
    c = capability(KEY, "P0", 3, 1)
    assert len(c) == 32
    assert c != capability(KEY, "P1", 3, 1)
    assert c != capability(KEY, "P0", 4, 1)
    assert c != capability(KEY, "P0", 3, 2)
    assert c != capability(b"t" * 32, "P0", 3, 1)
    with pytest.raises(ValueError, match="16 bytes"):
        Gate(Ledger(CFG, BlockPool(4)), b"short", "P0", 1)


def test_first_consumer_binds_and_any_other_is_refused_and_counted() -> None:
    g = gate()
    out: list[object] = []
    assert g.present("D1", 5, g.capability(5), out)  # type: ignore[arg-type]
    assert g.state(5) == G_BOUND and g.consumer(5) == "D1" and out == []
    assert g.present("D1", 5, "anything", out)  # type: ignore[arg-type]
    assert not g.present("D2", 5, g.capability(5), out)  # type: ignore[arg-type]
    assert isinstance(out[0], Rejected) and out[0].reason == "foreign_consumer"
    assert g.counters == {"foreign_consumer": 1}
    assert g.consumer(5) == "D1"


def test_a_wrong_capability_binds_nothing() -> None:
    g = gate()
    out: list[object] = []
    assert not g.present("D2", 5, capability(KEY, "P0", 2, 5), out)  # type: ignore[arg-type]
    assert not g.present("D2", 5, 12345, out)  # type: ignore[arg-type]
    assert g.state(5) == G_OPEN and g.counters == {"bad_capability": 2}
    assert g.present("D1", 5, g.capability(5), out)  # type: ignore[arg-type]


def test_unready_register_is_refused_counted_and_journaled_by_the_ledger() -> None:
    g = gate()
    out = g.register(1, "r1", (1, 2), 0, ready=False)
    assert [type(e) for e in out] == [Rejected] and out[0].reason == "unready_register"  # type: ignore[union-attr]
    assert g.ledger.state(1) == "unregistered" and g.ledger.pool.held_count == 0
    assert g.counters["unready_register"] == 1
    assert g.ledger.counters["rejected:unready_register"] == 1
    g.register(1, "r1", (1, 2), 1, ready=True)
    assert g.ledger.state(1) == "registered"


def test_abandon_tells_the_bound_consumer_or_everyone_and_refuses_later() -> None:
    g = gate()
    out: list[object] = []
    g.present("D1", 1, g.capability(1), out)  # type: ignore[arg-type]
    assert g.abandon(1) == [NeverNotice(1, "D1")]
    assert g.abandon(2) == [NeverNotice(2, None)]
    assert g.state(1) == g.state(2) == G_NEVER and g.consumer(1) is None
    again = g.abandon(2)
    assert [type(e) for e in again] == [Rejected] and g.counters["duplicate_abandon"] == 1
    assert not g.present("D3", 2, g.capability(2), out)  # type: ignore[arg-type]
    assert out[-1] == NeverNotice(2, "D3")
    reg = g.register(2, "r2", (3,), 0, ready=True)
    assert reg[0].reason == "register_after_never"  # type: ignore[union-attr]
    assert g.ledger.state(2) == "unregistered"


def test_abandon_of_a_registered_handle_is_the_ledgers_business() -> None:
    g = gate()
    g.register(1, "r1", (1,), 0, ready=True)
    assert g.abandon(1) == [] and g.state(1) == G_OPEN


def test_forget_drops_the_binding_when_the_ledger_frees() -> None:
    g = gate()
    g.register(1, "r1", (1,), 0, ready=True, expected=1)
    out: list[object] = []
    assert g.present("D1", 1, g.capability(1), out)  # type: ignore[arg-type]
    freed = [e.handle for e in g.ledger.done("D1", 1, 1, 1) if isinstance(e, Free)]
    assert freed == [1]
    g.forget(freed)
    assert g.state(1) == G_OPEN and len(g) == 0


def test_records_are_capped_fail_closed() -> None:
    g = gate(max_records=2)
    out: list[object] = []
    assert g.present("D1", 1, g.capability(1), out)  # type: ignore[arg-type]
    assert g.present("D1", 2, g.capability(2), out)  # type: ignore[arg-type]
    assert not g.present("D1", 3, g.capability(3), out)  # type: ignore[arg-type]
    assert g.counters["gate_full"] == 1 and len(g) == 2
    g.abandon(4)
    g.abandon(5)
    assert len(g) <= 3 and g.counters["never_evicted"] >= 1


def test_every_row_is_reached() -> None:
    """The scenarios above and the fuzz world reach every row (no dead rows)."""
    seen: set[tuple[str, str, str]] = set()

    class Rows(dict[tuple[str, str, str], object]):
        def __getitem__(self, key: tuple[str, str, str]) -> object:
            seen.add(key)
            return super().__getitem__(key)

    class Seen(Gate):
        TABLE = Rows(Gate.TABLE)  # type: ignore[assignment]
        LOOKUP_ROWS = True  # every row through the TABLE lookup

    g = Seen(Ledger(CFG, BlockPool(16)), KEY, "P0", 3, max_records=3)
    out: list[object] = []
    g.present("D1", 1, g.capability(1), out)  # type: ignore[arg-type]
    g.present("D2", 1, g.capability(1), out)  # type: ignore[arg-type]
    g.present("D1", 1, g.capability(1), out)  # type: ignore[arg-type]
    g.present("D2", 2, "bad", out)  # type: ignore[arg-type]
    g.register(1, "r1", (1,), 0, ready=True, expected=1)
    g.register(1, "r1", (1,), 0, ready=False)
    g.register(2, "r2", (2,), 0, ready=True, expected=1)
    g.register(3, "r3", (3,), 0, ready=False)
    g.forget([2])
    g.forget([1])
    g.present("D1", 6, g.capability(6), out)  # type: ignore[arg-type]
    g.abandon(6)
    g.abandon(7)
    g.abandon(7)
    g.present("D1", 7, g.capability(7), out)  # type: ignore[arg-type]
    g.register(7, "r7", (7,), 0, ready=True)
    g.present("D1", 8, g.capability(8), out)  # type: ignore[arg-type]
    g.present("D1", 9, g.capability(9), out)  # type: ignore[arg-type]
    g.present("D1", 10, g.capability(10), out)  # type: ignore[arg-type]
    assert seen == {r.key for r in GATE_TRANSITIONS}


def ops_of(names: tuple[str, ...]) -> st.SearchStrategy[list[Op]]:
    return st.lists(st.tuples(st.sampled_from(names), st.integers(0, 1), st.integers(0, 3)),
                    max_size=24)


OPS = ops_of(OP_NAMES)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_the_real_gate_keeps_every_property(ops: list[Op]) -> None:
    assert run_ops(ops, requests=2, consumers=3, forgers=1) is None


@pytest.mark.parametrize("mutant", GATE_MUTANTS, ids=lambda m: m.name)
def test_hypothesis_catches_the_gate_mutant(mutant: GateMutant) -> None:
    found: list[str] = []

    @settings(max_examples=2000, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(ops=ops_of(mutant.ops))
    def prop(ops: list[Op]) -> None:
        bad = run_ops(ops, mutant.cls, requests=1, consumers=2 + mutant.forgers,
                      forgers=mutant.forgers)
        if bad is not None:
            found.append(bad)
        assert bad is None

    with pytest.raises(AssertionError):
        prop()
    assert found and found[-1].startswith(mutant.caught_by), found[-1]


GATE_CFG = """CONSTANTS
    Requests = {"r0"}
    Consumers = {"c0", "c1", "c2", "c3"}
    Chunks = 2
    BugSkipBinding = FALSE
    BugRegisterUnready = FALSE
    BugNoNeverNotice = FALSE
    Forgers = {"c3"}
    MayBeFull = TRUE
    BugSkipCapability = FALSE
    BugReadBeforeGrant = FALSE
INIT Init
NEXT Next
INVARIANT GateTypeOK NoFreeUnderRead ReadinessHolds NeverToldAtOnce OneConsumerServed NoGrantBeforeRegister
    OnlyHoldersBind
"""


def _tlc_states(tmp: Path) -> set[object]:
    from kvproto.verify.conformance import read_dot
    from kvproto.verify.tlc import Fn, find_jar, find_java, require_ok, run_tlc, spec_dir

    try:
        find_java()
        find_jar()
    except Exception as e:  # no Java or no jar on this machine
        pytest.skip(str(e))
    for name in ("KVGate.tla", "MC_gate.tla"):
        (tmp / name).write_text((spec_dir() / name).read_text())
    (tmp / "conf_gate.cfg").write_text(GATE_CFG)
    dot = tmp / "gate.dot"
    require_ok(run_tlc("conf_gate.cfg", module="MC_gate", workdir=tmp, workers=1,
                       args=["-nowarning", "-dump", "dot,actionlabels", str(dot)]))
    out: set[object] = set()
    for s in read_dot(dot).nodes:
        assert isinstance(s, Fn)
        assert s["untold"] == frozenset()
        reqs = sorted(s["written"].keys())  # type: ignore[union-attr]
        per_r = tuple((s["written"][r], s["aborted"][r], s["gstate"][r],  # type: ignore[index]
                       s["bound"][r], s["pstate"][r]) for r in reqs)  # type: ignore[index]
        cst = s["cstate"]
        assert isinstance(cst, Fn)
        out.add((per_r, tuple(sorted((p[0], p[1], v) for p, v in cst.items)),  # type: ignore[index]
                 frozenset((p[0], p[1]) for p in s["told"])))  # type: ignore[union-attr, index]
    return out


@pytest.mark.tlc
def test_the_gate_and_kvgate_reach_the_same_states(tmp_path: Path) -> None:
    """State-set equality: the Python gate (over the ledger, in the fuzz world) and
    tla/KVGate.tla reach exactly the same abstract states."""
    tlc = _tlc_states(tmp_path)
    py = explore(requests=1, consumers=4, forgers=1)
    assert len(py) > 100
    assert py == tlc, (sorted(map(repr, py - tlc))[:3], sorted(map(repr, tlc - py))[:3])


@pytest.mark.tlc
@pytest.mark.parametrize("name", ["gate"])
def test_the_gate_model_passes(name: str) -> None:
    from kvproto.verify import check

    o = check.check_model(check.MODELS[name], workers=1)
    if o.result.result == "error" and "java" in o.summary.lower():
        pytest.skip(o.summary)
    assert o.result.result == "ok", o.summary
    assert o.result.distinct is not None and o.result.distinct > 1000


def test_every_gate_row_is_named_in_kvgate_and_the_docs() -> None:
    """Name for name: every row of GATE_TRANSITIONS is taken somewhere in tla/KVGate.tla
    (its ``event/guard`` named where the spec takes it), listed in spec/TLA.md §7, and is
    a row of spec/PROTOCOL.md §11's table (its state, event and guard)."""
    from kvproto.verify.tlc import spec_dir

    root = Path(__file__).resolve().parent.parent
    tla = (spec_dir() / "KVGate.tla").read_text()
    tla_md = (root / "spec" / "TLA.md").read_text()
    gate_md = tla_md[tla_md.index("## 7. P's gate"):tla_md.index("## 8.")]
    proto = (root / "spec" / "PROTOCOL.md").read_text()
    table = next(b for b in proto[proto.index("## 11. P's gate"):].split("\n\n")
                 if b.startswith("| state |")).splitlines()
    for row in GATE_TRANSITIONS:
        name = f"{row.event}/{row.guard}"
        assert name in tla, name
        assert f"`{name}`" in gate_md, name
        assert any(f"| {row.event} | {row.guard} |" in ln
                   and row.src in ln.split("|")[1] for ln in table), name
