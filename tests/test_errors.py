"""kvproto's errors: one ``KVProtoError`` base; ``UsageError`` for the caller's own mistakes
(raised) and ``RemoteInputError`` for a peer's bad input (counted and journaled, never
raised out of a machine or port); every type keeps its builtin base. A table without the
row a machine needs raises ``MissingRow``, naming the state, event and guard."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ENGINE, params

import kvproto
from kvproto import port, wire
from kvproto.bench.vllm_serve import ServeError
from kvproto.cli import MissingExtra
from kvproto.errors import KVProtoError, RemoteInputError, UsageError
from kvproto.journal import JournalError
from kvproto.lifecycle import (
    D_TRANSITIONS,
    DONE,
    P_TABLE,
    P_TRANSITIONS,
    REGISTERED,
    RELEASE,
    SCHEDULE,
    TICK,
    WAITING,
    BlockPool,
    Config,
    ConfigError,
    Consumer,
    DoubleFree,
    Ledger,
    MissingRow,
    Rejected,
    TableError,
    make_table,
    with_rows,
)
from kvproto.lifecycle.topology import TopologyError
from kvproto.nixl.channel import FrameError
from kvproto.nixl.driver import PeerError
from kvproto.nixl.faults import FaultConfigError
from kvproto.testing.cfuzz import CoverageViolation
from kvproto.testing.script import ScriptError
from kvproto.verify.check import LeaseConfigError
from kvproto.verify.dsplit import SplitError
from kvproto.verify.oracle import InvariantViolation
from kvproto.verify.tlc import MissingDependency, ParseError, TLCError, WorkersEnvError
from kvproto.verify.trace import TraceError
from kvproto.vllm.groups import GroupsError
from kvproto.vllm.harness import HarnessError
from kvproto.vllm.identity import FingerprintError
from kvproto.vllm.sched import ParamsError
from kvproto.vllm.topology import TopologyUnsupported

# error -> (its kind, the builtin base it keeps)
ERRORS: dict[type[Exception], tuple[type[KVProtoError], type[Exception]]] = {
    ConfigError: (UsageError, ValueError),
    TableError: (UsageError, ValueError),
    MissingRow: (UsageError, KeyError),
    DoubleFree: (UsageError, RuntimeError),
    JournalError: (UsageError, ValueError),
    TraceError: (UsageError, ValueError),
    LeaseConfigError: (UsageError, ValueError),
    WorkersEnvError: (UsageError, ValueError),
    wire.WireError: (RemoteInputError, ValueError),
    FrameError: (RemoteInputError, Exception),
    ParamsError: (RemoteInputError, ValueError),
    PeerError: (RemoteInputError, Exception),
    InvariantViolation: (KVProtoError, AssertionError),
    MissingDependency: (KVProtoError, RuntimeError),
    TLCError: (KVProtoError, RuntimeError),
    ParseError: (KVProtoError, ValueError),
    HarnessError: (KVProtoError, RuntimeError),
    MissingExtra: (KVProtoError, ImportError),
    FingerprintError: (UsageError, ValueError),
    ScriptError: (UsageError, ValueError),
    TopologyError: (UsageError, ValueError),
    TopologyUnsupported: (UsageError, ValueError),
    CoverageViolation: (KVProtoError, AssertionError),
    GroupsError: (UsageError, ValueError),
    FaultConfigError: (UsageError, ValueError),
    SplitError: (UsageError, ValueError),
    ServeError: (KVProtoError, RuntimeError),
}


@pytest.mark.parametrize("error", list(ERRORS), ids=lambda e: e.__name__)
def test_every_error_is_a_kvproto_error_of_one_kind_with_its_builtin_base(
        error: type[Exception]) -> None:
    kind, builtin = ERRORS[error]
    assert issubclass(error, kind) and issubclass(error, KVProtoError)
    assert issubclass(error, builtin)
    assert not (issubclass(error, UsageError) and issubclass(error, RemoteInputError))


def test_every_error_class_in_the_package_is_listed() -> None:
    """A new error type joins the hierarchy (and this list)."""
    pkg = Path(kvproto.__file__).parent
    found = set()
    for f in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception"))
                                                 or b.id in ("DoubleFree", "MissingDependency"))
                    for b in node.bases):
                found.add(node.name)
    listed = {e.__name__ for e in ERRORS} | {"KVProtoError", "UsageError", "RemoteInputError",
                                             "MissingJava", "MissingJar"}
    assert found - listed == set()


def test_the_errors_are_the_public_api() -> None:
    for name in ("KVProtoError", "UsageError", "RemoteInputError", "ConfigError",
                 "TableError", "MissingRow", "DoubleFree", "JournalError", "WireError"):
        assert name in kvproto.__all__ and isinstance(getattr(kvproto, name), type)


def test_bad_remote_bytes_are_a_counted_rejection_not_an_exception() -> None:
    ledger = Ledger(Config(), BlockPool(4))
    with pytest.raises(wire.WireError):
        wire.decode(b"\x00garbage", max_bytes=4096)  # inside the codec it is raised...
    out = port.p_receive(ledger, "d0", b"\x00garbage", 1000, known=True, epoch=1,
                         max_bytes=4096)  # ...and the port turns it into a rejection
    assert [type(e) for e in out] == [Rejected]
    assert sum(v for k, v in ledger.counters.items() if k.startswith("rejected:")) == 1


def p_table_without(key: tuple[str, str, str]) -> type[Ledger]:
    table = make_table(r for r in P_TRANSITIONS if r.key != key)
    return type("LedgerWithoutARow", (Ledger,), {"TABLE": table})


def test_a_missing_p_row_names_the_state_event_and_guard() -> None:
    cls = p_table_without((REGISTERED, DONE, "more_readers"))
    L = cls(Config(), BlockPool(4))
    L.register(1, "r1", (0,), 0, expected=2)
    with pytest.raises(MissingRow) as info:
        L.done("d0", 1, 2, 1000)
    e = info.value
    assert str(e) == ("no row in P's transition table for state 'registered', event 'done', "
                      "guard 'more_readers'")
    assert (e.machine, e.state, e.event, e.guard) == ("P", REGISTERED, DONE, "more_readers")
    assert isinstance(e, KeyError) and isinstance(e, TableError) and isinstance(e, UsageError)


def test_a_missing_p_row_on_the_derived_hot_paths_raises_when_met() -> None:
    """done, release and the tick's expiries read rows the class derived from its table;
    a row the table lacks still raises MissingRow when an event needs it, not before."""
    cases: list[tuple[tuple[str, str, str], Callable[[Ledger], object]]] = [
        ((REGISTERED, TICK, "deadline_passed"), lambda L: L.tick(10**9)),
        ((REGISTERED, RELEASE, "all_finished"), lambda L: L.release("d0", (1,), 1, 1000)),
        ((REGISTERED, DONE, "all_done"), lambda L: L.done("d0", 1, 1, 1000))]
    for key, run in cases:
        L = p_table_without(key)(Config(), BlockPool(4))
        L.register(1, "r1", (0,), 0, expected=1)
        with pytest.raises(MissingRow) as info:
            run(L)
        assert (info.value.state, info.value.event, info.value.guard) == key


def test_a_missing_d_row_names_the_state_event_and_guard() -> None:
    key = (WAITING, SCHEDULE, "lease_covers_read")
    table = make_table((r for r in D_TRANSITIONS if r.key != key), machine="D")
    cls = type("ConsumerWithoutARow", (Consumer,), {"TABLE": table})
    c = cls("d0", Config())
    c.handshake_result(ENGINE, True, 0)
    c.admit("r1", params(1), 0)
    with pytest.raises(MissingRow, match="D's transition table for state 'waiting', "
                                         "event 'schedule', guard 'lease_covers_read'"):
        c.schedule("r1", 1000)


def test_a_lookup_and_a_replacement_of_no_row_raise_missing_row() -> None:
    with pytest.raises(MissingRow, match="state 'leased', event 'done', guard 'nope'"):
        P_TABLE[("leased", "done", "nope")]
    row = P_TABLE[(REGISTERED, DONE, "more_readers")]
    with pytest.raises(MissingRow, match="guard 'other'"):
        with_rows(P_TABLE, replace(row, guard="other"))
    assert P_TABLE.get(("leased", "done", "nope")) is None  # get stays quiet


def test_caller_mistakes_raise_usage_errors() -> None:
    with pytest.raises(ConfigError):
        BlockPool(0)
    with pytest.raises(ConfigError):
        Config(initial_lease=-1000).validate()
    pool = BlockPool(2)
    with pytest.raises(UsageError, match="is not held"):
        Ledger(Config(), pool).expire(5, 0, [])
