"""Every Config that ``validate()`` accepts works end to end.

A property test: such a config survives JSON and the journal header, every wire message
whose size or fields it sets encodes and decodes within ``max_message_bytes`` (the
granted term travels as whole milliseconds), and a short simulator run with it (real
encoded bytes, faults) keeps every safety invariant. Configs near the edges that
``validate()`` must refuse because the wire cannot carry them are checked too.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvproto import wire
from kvproto.journal import JournalWriter, header_config, read_journal
from kvproto.lifecycle import (
    MAX_CAP,
    MAX_DURATION,
    MAX_MESSAGE_BYTES,
    MIN_DURATION,
    MIN_MESSAGE_BYTES,
    Config,
    ConfigError,
)
from kvproto.testing.sim import Simulator

pytestmark = pytest.mark.background  # CPU-bound, no wall-clock bound (scripts/test.sh)

MAX_MS = round(MAX_DURATION * 1000)
# Durations are whole milliseconds (what validate() accepts), drawn in ms at every scale.
DURATION_MS = st.one_of(
    st.integers(1, 10),
    st.integers(10, 100_000),
    st.integers(100_000, MAX_MS),
    st.sampled_from([1, 250, 1000, 30_000, MAX_MS]),
)
DURATION = DURATION_MS.map(lambda ms: ms / 1000)
SMALL_MS = st.one_of(st.just(0), st.integers(1, 500), st.integers(500, 1_000_000))


@st.composite
def valid_configs(draw: st.DrawFn) -> Config:
    """Configs built to satisfy the timing rules (with margins drawn at every scale),
    then checked by validate() like any other."""
    hb = draw(DURATION_MS)
    delay = draw(SMALL_MS)
    read = draw(DURATION_MS)
    drift = draw(SMALL_MS)
    need_ext = max(hb + delay + drift, read + 2 * delay + drift)
    need_init = max(read + delay + drift, hb + 2 * delay + drift)
    ext = int(need_ext * draw(st.floats(1.0001, 3.0))) + draw(st.integers(1, 1000))
    init = int(need_init * draw(st.floats(1.0001, 3.0))) + draw(st.integers(1, 1000))
    grace = int(max(init, ext) * draw(st.floats(1.0, 2.0)))
    cfg = Config(
        initial_lease=init / 1000, lease_extension=ext / 1000, heartbeat_interval=hb / 1000,
        abort_grace=grace / 1000, max_delay=delay / 1000, max_read_time=read / 1000,
        clock_drift=drift / 1000,
        max_staged=draw(st.integers(1, 5000)), max_staged_age=draw(DURATION),
        max_tombstones=draw(st.integers(1, 5000)),
        max_message_bytes=draw(st.one_of(st.integers(MIN_MESSAGE_BYTES, 256),
                                         st.integers(MIN_MESSAGE_BYTES, MAX_MESSAGE_BYTES))),
        max_groups_remembered=draw(st.integers(1, 5000)),
        max_tick_work=draw(st.integers(1, 5000)))
    try:
        return cfg.validate()
    except ConfigError:
        assume(False)
        raise


@st.composite
def any_configs(draw: st.DrawFn) -> Config:
    """Arbitrary numbers: most are refused; whatever validate() accepts must work."""
    hostile = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**9))
    plausible = st.one_of(st.floats(0.0005, 120.0), st.integers(0, 70000),
                          st.integers(1, 120_000).map(lambda ms: ms / 1000),
                          st.sampled_from([MIN_DURATION, MAX_DURATION, 1e7, 1e-4]))
    kwargs: dict[str, Any] = {}
    for name in ("initial_lease", "lease_extension", "heartbeat_interval", "abort_grace",
                 "max_delay", "max_read_time", "clock_drift", "max_staged_age",
                 "max_staged", "max_tombstones", "max_message_bytes",
                 "max_groups_remembered", "max_tick_work"):
        k = draw(st.integers(0, 5))
        if k == 0:
            kwargs[name] = draw(hostile)
        elif k == 1:
            kwargs[name] = draw(plausible)
    cfg = replace(Config(), **kwargs)
    try:
        return cfg.validate()
    except ConfigError:
        assume(False)
        raise


def check_end_to_end(cfg: Config, seed: int) -> None:
    # JSON and the journal header.
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    buf = io.StringIO()
    JournalWriter(buf, cfg, 64).close()
    header, _ = read_journal(io.StringIO(buf.getvalue()))
    assert header_config(header) == cfg
    # Wire messages whose size or fields the config sets.
    mb = cfg.max_message_bytes
    handles = [1, 2, 3, 1000, 2**40, 2**64 - 1]
    for chunk in wire.encode_ack(7, 5, cfg.ms.lease_extension, handles[:3], mb, handles[3:]):
        m = wire.decode(chunk, max_bytes=mb, epoch=7)
        assert m.term_ms == cfg.ms.lease_extension >= 1  # exactly the granted term
    sent = wire.encode_heartbeat(7, 2**32 - 1, handles, 65535, mb)
    got = [h for c in sent for h in wire.decode(c, max_bytes=mb, epoch=7).handles]
    assert got == handles
    got = [h for c in wire.encode_release(7, handles, 3, mb)
           for h in wire.decode(c, max_bytes=mb, epoch=7).handles]
    assert got == handles
    assert wire.decode(wire.encode_done(7, 2**64 - 1, 65535), max_bytes=mb).handles == (2**64 - 1,)
    # A short simulator run (faults on): every step fine-grained enough for the config.
    ms = cfg.ms
    positive = [v for v in (ms.heartbeat_interval, ms.max_delay, ms.max_read_time,
                            ms.clock_drift, ms.initial_lease) if v > 0]
    dt = max(1, min(100, min(positive) // 10)) / 1000  # whole ms, as the simulator's clock
    sim = Simulator(seed, config=cfg, capacity=64, dt=dt, arrival_rate=2.0 / dt / 20,
                    max_queue=min(20.0, cfg.initial_lease))
    stats = sim.run(150 * dt, drain=False)
    assert stats.violations == []
    assert sim.ledger.check_invariants() == []


SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.filter_too_much])


@SETTINGS
@given(valid_configs(), st.integers(0, 1000))
def test_every_valid_config_encodes_decodes_and_simulates(cfg: Config, seed: int) -> None:
    check_end_to_end(cfg, seed)


@SETTINGS
@given(any_configs(), st.integers(0, 1000))
def test_whatever_validate_accepts_works_end_to_end(cfg: Config, seed: int) -> None:
    check_end_to_end(cfg, seed)


@pytest.mark.parametrize("overrides", [
    {"lease_extension": MAX_DURATION * 1.01, "initial_lease": MAX_DURATION,
     "abort_grace": MAX_DURATION * 1.01},
    {"heartbeat_interval": MIN_DURATION / 2},
    {"clock_drift": MIN_DURATION / 10},
    {"max_delay": 0.0105},  # not whole milliseconds: the machines could not count it
    {"max_message_bytes": MIN_MESSAGE_BYTES - 1},
    {"max_message_bytes": MAX_MESSAGE_BYTES + 1},
    {"max_tombstones": MAX_CAP + 1},
    {"max_tick_work": 0},
])
def test_validate_refuses_what_the_wire_cannot_carry(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        replace(Config(), **overrides).validate()


def test_the_edges_validate_accepts_are_carried() -> None:
    cfg = replace(Config(), lease_extension=MAX_DURATION, initial_lease=MAX_DURATION,
                  abort_grace=MAX_DURATION, max_message_bytes=MIN_MESSAGE_BYTES).validate()
    check_end_to_end(cfg, 1)
