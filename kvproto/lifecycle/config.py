"""``Config``: the timing assumptions and caps both machines run under, validated.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any, Final, NamedTuple

from kvproto.errors import UsageError

# Configuration and timing assumptions.
# ---------------------------------------------------------------------------


class ConfigError(UsageError, ValueError):
    """An invalid configuration. The message says which rule failed and why."""


# What the wire and the adapters can carry (spec/PROTOCOL.md, "Configuration"): the
# machines count whole milliseconds, and a granted term travels in an ack as a u32 of
# milliseconds, so every duration is a whole number of milliseconds, at least 1 ms (or 0
# where 0 is allowed) and at most 2**32-1 ms (about 49.7 days).
MIN_DURATION: Final = 0.001
MAX_DURATION: Final = 0xFFFFFFFF / 1000
# A duration in seconds is a whole number of milliseconds when seconds * 1000 is within
# this much (relative) of an integer: float noise of decimal seconds (0.1 + 0.2), no more.
MS_TOLERANCE: Final = 1e-9
# Caps on the integer knobs: each sizes a tracking structure, so each has a ceiling.
MAX_CAP: Final = 1 << 24
MIN_MESSAGE_BYTES: Final = 64  # room for the largest header and prefix plus one handle
MAX_MESSAGE_BYTES: Final = 1 << 20
_DURATIONS: Final = ("initial_lease", "lease_extension", "heartbeat_interval", "abort_grace",
                     "max_delay", "max_read_time", "clock_drift", "max_staged_age",
                     "peer_timeout", "read_grace")


def to_ms(seconds: float) -> int:
    """Seconds (a user's duration, an adapter's clock reading) as whole milliseconds.

    The one conversion into the machines' time (spec/PROTOCOL.md, "Time"): every time a
    machine sees -- an event's ``now``, a deadline, a lease term -- is an integer number
    of milliseconds. Milliseconds because the wire already carries a granted term as a u32
    of milliseconds, ``Config`` durations are whole milliseconds (``MIN_DURATION`` 1 ms,
    ``MAX_DURATION`` 2**32-1 ms), TLC's 32-bit integers hold 24.8 days of them, and lease
    timing needs nothing finer; Python and TLC then compute with the same integers, and
    trace validation needs no scale and no tolerance."""
    return round(seconds * 1000)


def is_whole_ms(seconds: float) -> bool:
    """Whether ``seconds`` is a whole number of milliseconds, up to float noise."""
    ms = seconds * 1000
    return abs(ms - round(ms)) <= MS_TOLERANCE * max(1.0, abs(ms))


class Millis(NamedTuple):
    """``Config``'s durations in whole milliseconds (``Config.ms``): what the machines
    compute with. Same names as the fields they come from."""

    initial_lease: int
    lease_extension: int
    heartbeat_interval: int
    abort_grace: int
    max_delay: int
    max_read_time: int
    clock_drift: int
    max_staged_age: int
    peer_timeout: int
    lease_horizon: int
    read_grace: int


@dataclass(frozen=True)
class Config:
    """Timing assumptions (seconds) and caps. See spec/PROTOCOL.md, "Configuration".

    The lease terms are durations; no timestamp from another host's clock is ever used.
    Users write durations in seconds; each must be a whole number of milliseconds, and
    the machines read them as integer milliseconds from ``ms``.
    """

    initial_lease: float = 30.0  # term granted at register
    lease_extension: float = 20.0  # a heartbeat extends the deadline to max(deadline, now + this)
    heartbeat_interval: float = 5.0  # D heartbeats every request it still intends to pull
    abort_grace: float = 30.0  # after abort on P: free no later than now + this (>= lease horizon)
    max_delay: float = 1.0  # bound on message delivery delay (notifications, transfer params)
    max_read_time: float = 5.0  # bound on one READ, post to completion
    clock_drift: float = 0.5  # bound on clock-rate disagreement accumulated over one lease term
    max_staged: int = 4096  # early-message staging entries (handles); oldest dropped at the cap
    max_staged_age: float = 30.0  # staged entries older than this are dropped on tick
    max_tombstones: int = 65536  # freed handles remembered to classify late messages as stale
    max_message_bytes: int = 4096  # cap on one wire message (encode chunks, decode rejects)
    max_groups_remembered: int = 65536  # P: transferred sibling groups remembered
    max_tick_work: int = 512  # heap entries one tick may process (P: deadlines, D: leases); the rest carry over
    peer_timeout: float = 20.0  # D: a P engine that leaves heartbeats unanswered this long is lost
    # Block checksums (opt-in): P checksums every block at register, D verifies every
    # block it read against them, and a READ with a mismatch is fenced (never served).
    checksums: bool = False
    # D: a READ still in flight max_read_time + read_grace after D's machine posted it
    # (its PostRead effect, at the schedule; the adapter hands it to NIXL within the same
    # poll) is overdue: its request fails (recomputed or an error, per the engine's
    # policy) and its local blocks stay quarantined until the transfer ends
    # (spec/PROTOCOL.md, "Bounded reads").
    read_grace: float = 5.0

    @property
    def lease_horizon(self) -> float:
        """The longest a deadline can lie in the future: max(initial, extension)."""
        return max(self.initial_lease, self.lease_extension)

    @cached_property
    def ms(self) -> Millis:
        """The durations in whole milliseconds (``to_ms``, once per config): the machines'
        time unit. Exact for a validated config (every duration is whole ms)."""
        return Millis(to_ms(self.initial_lease), to_ms(self.lease_extension),
                      to_ms(self.heartbeat_interval), to_ms(self.abort_grace),
                      to_ms(self.max_delay), to_ms(self.max_read_time),
                      to_ms(self.clock_drift), to_ms(self.max_staged_age),
                      to_ms(self.peer_timeout), to_ms(self.lease_horizon),
                      to_ms(self.read_grace))

    def timing_rules(self) -> list[tuple[bool, str]]:
        """The timing argument's rules (spec/PROTOCOL.md §5), in order: (holds, why it
        must), decided in the machines' integer milliseconds (``ms``: exact, no float
        rounding). ``validate`` raises the first that fails; ``kvproto check`` compares
        them before and after turning seconds into model time units."""
        m = self.ms
        renew_need = m.heartbeat_interval + m.max_delay + m.clock_drift
        read_need = m.max_read_time + 2 * m.max_delay + m.clock_drift
        init_need = m.max_read_time + m.max_delay + m.clock_drift
        first_hb = m.heartbeat_interval + 2 * m.max_delay + m.clock_drift
        peer_need = m.heartbeat_interval + 2 * m.max_delay
        return [
            (m.lease_extension > renew_need,
             f"lease_extension ({self.lease_extension}) must exceed heartbeat_interval + "
             f"max_delay + clock_drift ({renew_need / 1000}): otherwise a lease can run out "
             "between two heartbeats that both arrive on time"),
            (m.lease_extension > read_need,
             f"lease_extension ({self.lease_extension}) must exceed max_read_time + "
             f"2*max_delay + clock_drift ({read_need / 1000}): otherwise no renewed lease can "
             "cover a READ"),
            (m.initial_lease > init_need,
             f"initial_lease ({self.initial_lease}) must exceed max_read_time + max_delay + "
             f"clock_drift ({init_need / 1000}): otherwise D can never READ on the initial term"),
            (m.initial_lease > first_hb,
             f"initial_lease ({self.initial_lease}) must exceed heartbeat_interval + "
             f"2*max_delay + clock_drift ({first_hb / 1000}): otherwise a request D admitted "
             "just after a heartbeat expires on P before its first renewal arrives"),
            (m.peer_timeout > peer_need,
             f"peer_timeout ({self.peer_timeout}) must exceed heartbeat_interval + "
             f"2*max_delay ({peer_need / 1000}): otherwise D declares a P engine that answers "
             "every heartbeat on time lost (and fails its requests)"),
            (m.abort_grace >= m.lease_horizon,
             f"abort_grace ({self.abort_grace}) must be >= max(initial_lease, lease_extension) "
             f"({self.lease_horizon}): a shorter grace can free blocks under a READ that D "
             "started within its lease (see spec/PROTOCOL.md, 'Abort after finish')"),
        ]

    def validate(self) -> Config:
        """Raise ConfigError naming the first violated rule; return self when valid."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(v, bool):
                    raise ConfigError(f"{f.name} must be true or false, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{f.name} must be a number, got {v!r}")
            if not math.isfinite(v):
                raise ConfigError(f"{f.name} must be finite, got {v!r}")
            if f.type in ("int",) and int(v) != v:
                raise ConfigError(f"{f.name} must be an integer, got {v!r}")
        for name in ("initial_lease", "lease_extension", "heartbeat_interval", "max_read_time",
                     "max_staged_age", "peer_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_delay", "clock_drift", "abort_grace", "read_grace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in _DURATIONS:
            v = getattr(self, name)
            if v and not MIN_DURATION <= v <= MAX_DURATION:
                raise ConfigError(
                    f"{name} must be within [{MIN_DURATION}, {MAX_DURATION}] s (or 0 where 0 is "
                    f"allowed), got {v}: the machines count whole milliseconds and a term "
                    "travels as a u32 of milliseconds")
            if not is_whole_ms(v):
                raise ConfigError(
                    f"{name} must be a whole number of milliseconds, got {v} s: the "
                    "machines count whole milliseconds")
        for ok, why in self.timing_rules():
            if not ok:
                raise ConfigError(why)
        for name in ("max_staged", "max_tombstones", "max_groups_remembered", "max_tick_work"):
            v = getattr(self, name)
            if not 1 <= v <= MAX_CAP:
                raise ConfigError(f"{name} must be within [1, {MAX_CAP}], got {v}")
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"max_message_bytes must be within [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}], "
                f"got {self.max_message_bytes}")
        return self

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build and validate a config; unknown keys are an error, not silently ignored."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)} (known: {', '.join(known)})")
        kwargs: dict[str, Any] = {}
        for k, v in data.items():
            if known[k].type == "bool":
                if not isinstance(v, bool):
                    raise ConfigError(f"{k} must be true or false, got {v!r}")
                kwargs[k] = v
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{k} must be a number, got {v!r}")
            kwargs[k] = int(v) if known[k].type == "int" and float(v).is_integer() else v
        return cls(**kwargs).validate()
