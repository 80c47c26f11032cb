"""Shared fixtures and helpers for the kvproto test suite.

Conventions: times are ints of milliseconds, as the machines count them (durations in a
``Config`` stay seconds); ``cfg`` is the default, validated
``Config``; ``make_ledger`` builds a P ledger over a strict ``BlockPool`` so that any
double free raises at once. Helpers assert exact effects rather than "something happened".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from kvproto.lifecycle import (
    BlockPool,
    Config,
    Consumer,
    DEffect,
    Effect,
    Finished,
    Free,
    Ledger,
    SendRelease,
    TransferParams,
)

# Fast and deterministic by default (the whole suite, TLC and NIXL included, must stay well
# inside CI's 30 minutes on 2 cores; the long runs are `kvproto fuzz` and `kvproto check large`).
settings.register_profile(
    "kvproto", max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("kvproto")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--rewrite", action="store_true", default=False,
                     help="write the actual outputs of the interaction scripts "
                          "(tests/testdata/*/*.txt) in place of their expected outputs")


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
