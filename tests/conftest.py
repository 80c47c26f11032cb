"""Shared fixtures and helpers for the kvproto test suite.

Conventions: times are ints of milliseconds, as the machines count them (durations in a
``Config`` stay seconds); ``cfg`` is the default, validated
``Config``; ``make_ledger`` builds a P ledger over a strict ``BlockPool`` so that any
double free raises at once. Helpers assert exact effects rather than "something happened".
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvproto.journal import JournalWriter
from kvproto.lifecycle import (
    BlockPool,
    Config,
    Consumer,
    DEffect,
    Effect,
    Finished,
    Free,
    Ledger,
    SendHeartbeat,
    SendRelease,
    TransferParams,
)
from kvproto.vllm import harness as h

# Fast and deterministic by default (the whole suite, TLC and NIXL included, must stay well
# inside CI's 40 minutes on 2 cores; the long runs are `kvproto fuzz` and `kvproto check large`).
settings.register_profile(
    "kvproto", max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvproto")

# The engines the tests start through ``pd_specs``, and the `vllm serve` stack, run NIXL's
# progress thread with a 50 µs sleep between passes instead of the connector's default busy
# loop. On this suite's 2 cores each busy loop takes most of a core from the engines beside
# it (BENCHMARKS.md, the suite's wall time). `bench scale`'s engines take it too
# (`scale_specs`), and the chaos campaign's test passes it (`kvproto chaos
# --progress-delay-us`): during a campaign the two busy loops held both cores.
h.CONNECTOR_DEFAULTS["progress_delay_us"] = 50

# Rule: a test that starts a vLLM engine or a `vllm serve` process carries the `vllm`
# marker (or `nixl`), so that `make test` runs it in its serial pass 2 and never beside
# pass 1's CPU-bound tests. Such a start from any other test fails at once, naming the
# test. ``UNMARKED`` holds the id of the test being set up or run when it has neither
# marker (module-scoped fixtures start their engines inside the first test's setup).
UNMARKED: list[str] = []
ENGINE_MARKERS = ("vllm", "nixl")


class UnmarkedEngineTest(RuntimeError):
    """A test without the `vllm` or `nixl` marker tried to start an engine or server."""


def refuse_unmarked(what: str) -> None:
    if UNMARKED:
        raise UnmarkedEngineTest(
            f"{UNMARKED[0]} starts {what} but is not marked vllm or nixl: mark it "
            "(pytest.mark.vllm) so that it runs in the serial engine pass")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marked = any(item.get_closest_marker(m) is not None for m in ENGINE_MARKERS)
    UNMARKED[:] = [] if marked else [item.nodeid]


def _guarded(method: Callable[..., Any], what: str) -> Callable[..., Any]:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        refuse_unmarked(what)
        return method(self, *args, **kwargs)
    return guarded


def _install_engine_guard() -> None:
    from kvproto.testing import serve as sv

    h.Engine.__init__ = _guarded(h.Engine.__init__, "a vLLM engine")  # type: ignore[method-assign]
    sv.HasProcs.start = _guarded(sv.HasProcs.start, "`vllm serve` servers")  # type: ignore[method-assign]


_install_engine_guard()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--rewrite", action="store_true", default=False,
                     help="write the actual outputs of the interaction scripts "
                          "(tests/testdata/*/*.txt) in place of their expected outputs")


@pytest.fixture(scope="module", autouse=True)
def _collect_module_garbage() -> Iterator[None]:
    """After each module, collect its cyclic garbage: objects a module's tests left in
    reference cycles (NIXL agents among them, whose progress threads spin until freed)
    must not keep costing CPU while the next modules' engines run."""
    yield
    gc.collect()


ENGINE = "P0"
EPOCH = 7


@pytest.fixture
def cfg() -> Config:
    """The default configuration (initial 30 s, extension 20 s, heartbeat 5 s)."""
    return Config().validate()


LedgerFactory = Callable[..., Ledger]


@pytest.fixture
def make_ledger() -> LedgerFactory:
    """``make_ledger(capacity=64, strict=True, **config_overrides) -> Ledger``."""

    def factory(capacity: int = 64, *, strict: bool = True, **overrides: Any) -> Ledger:
        config = replace(Config(), **overrides)
        return Ledger(config, BlockPool(capacity, strict=strict))

    return factory


@pytest.fixture
def ledger(make_ledger: LedgerFactory) -> Ledger:
    return make_ledger()


ConsumerFactory = Callable[..., Consumer]


@pytest.fixture
def make_consumer() -> ConsumerFactory:
    """``make_consumer(reader="d0", heartbeat_chunk=None, **config_overrides) -> Consumer``."""

    def factory(reader: str = "d0", *, heartbeat_chunk: int | None = None,
                **overrides: Any) -> Consumer:
        return Consumer(reader, replace(Config(), **overrides), heartbeat_chunk=heartbeat_chunk)

    return factory


def params(handle: int, *, engine: str = ENGINE, term: int = 30_000, expected: int = 1,
           group: str | None = None, blocks: Sequence[int] = (0, 1)) -> TransferParams:
    """Transfer parameters as P hands them to D (``term`` in ms)."""
    return TransferParams(engine=engine, epoch=EPOCH, handle=handle, blocks=tuple(blocks),
                          initial_term=term, expected=expected, group=group)


def frees(effects: Sequence[Effect]) -> list[tuple[int, str]]:
    """(handle, reason) of every Free effect, in order."""
    return [(e.handle, e.reason) for e in effects if isinstance(e, Free)]


def finished(effects: Sequence[DEffect]) -> list[tuple[str, str, str]]:
    """(request id, state, reason) of every Finished effect, in order."""
    return [(e.request_id, e.state, e.reason) for e in effects if isinstance(e, Finished)]


def releases(effects: Sequence[DEffect]) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, SendRelease)]


def assert_conserved(ledger: Ledger) -> None:
    """held + free == capacity, the pool's counters match a recount, no invariant broken."""
    pool = ledger.pool
    assert pool.held_count + pool.free_count == pool.capacity
    assert pool.recount() == (pool.held_count, pool.free_count)
    assert ledger.check_invariants() == []


def budget_d_journal(path: Path, consumer_cls: type[Consumer] = Consumer) -> Path:
    """One D rank's journal whose ticks run out of their work budget
    (``max_tick_work = 2``): leases lost at once are failed over several ticks, stale and
    renewed heap entries use the budget too, a late request is scheduled (lease_short)
    and another is named by a heartbeat and renewed by its ack before its turn; a silent
    peer is lost at the end. ``consumer_cls`` may be a mutant
    (``kvproto.testing.mutants.D_MUTANTS``)."""
    cfg = replace(Config(), max_tick_work=2)
    with JournalWriter(path, cfg, None, {"source": "budget"}, reader="d0") as w:
        c = consumer_cls("d0", cfg, sink=w.sink)
        c.handshake_result(ENGINE, True, 0)
        for h in range(1, 5):
            c.admit(f"r{h}", params(h, term=8000), 0)  # lease end 7000
        (hb,) = [e for e in c.tick(0) if isinstance(e, SendHeartbeat)]
        c.ack(ENGINE, hb.seq, 20_000, (), 500)  # r1..r4: lease end 19_500, heap entries at 7000
        for h in range(5, 10):
            c.admit(f"r{h}", params(h, term=8000), 600)  # lease end 7600: lost after 2100
        c.admit("r10", params(10, term=40_000), 600)
        c.tick(2200)  # r1, r2: renewed, re-inserted
        c.schedule("r5", 2300)  # late: lease_short
        c.tick(2400)  # r3, r4: re-inserted
        c.tick(3000)  # r5 (gone), r6: lost
        (hb,) = [e for e in c.tick(5000) if isinstance(e, SendHeartbeat)]  # r7, r8 lost
        c.ack(ENGINE, hb.seq, 20_000, (), 5200)  # names the late r9: renewed to 24_500
        for t in (5300, 10_000, 14_500, 14_501, 15_000, 19_500, 19_501, 19_502, 20_000, 25_000, 30_500):
            c.tick(t)  # r1..r4, r9 lost at 19_500 over three ticks; P silent since 5200
    return path
