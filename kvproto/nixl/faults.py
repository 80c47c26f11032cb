"""A seeded fault shim for D's outgoing notifications, for fault campaigns only.

``NotificationFaults`` is a ``DDriver`` out-hook: every notification D sends to a P engine
(done, release, heartbeat, claim) passes through it and is sent once (the common case),
dropped, duplicated, or held back and sent after a later notification to the same
engine (delayed and reordered; a held notification that no later one follows is never
sent, a loss counted as ``delay``). It only changes what the network would do anyway: the
protocol assumes notifications can be lost, duplicated and reordered, and the
lifecycle machines on both sides stay the only deciders of blocks.

It is off unless a user turns it on (``kv_connector_extra_config["test_faults"]``) and
is never meant for production traffic.

Cost and caps: O(1) per notification; at most ``MAX_HELD`` notifications are held back
per P engine, and at most ``MAX_ENGINES`` engines are tracked. When a cap is reached the
notification that would be held is sent at once instead (a fault not injected, counted
as ``held_cap``), so the shim never grows without bound.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvproto.errors import UsageError

MAX_HELD = 64
MAX_ENGINES = 256
KINDS = ("drop", "dup", "delay")


class FaultConfigError(UsageError, ValueError):
    """A bad ``test_faults`` setting (one clear line)."""


@dataclass(frozen=True)
class FaultRates:
    """Per-notification probabilities (each in [0, 1], their sum at most 1) and the
    seed of the shim's random stream."""

    seed: int = 0
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> FaultRates:
        if not isinstance(raw, Mapping):
            raise FaultConfigError(f"test_faults must be a mapping, got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"seed", *KINDS})
        if unknown:
            raise FaultConfigError(f"test_faults: unknown keys {unknown} (known: seed, "
                                   f"{', '.join(KINDS)})")
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise FaultConfigError(f"test_faults: seed must be a non-negative integer, "
                                   f"got {seed!r}")
        rates: dict[str, float] = {}
        for k in KINDS:
            v = raw.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise FaultConfigError(f"test_faults: {k} must be a probability in [0, 1], "
                                       f"got {v!r}")
            rates[k] = float(v)
        if sum(rates.values()) > 1.0:
            raise FaultConfigError("test_faults: drop + dup + delay must be at most 1")
        return cls(seed=seed, **rates)


class NotificationFaults:
    """The out-hook: ``hook(kind, engine, buf)`` returns the buffers to send now."""

    def __init__(self, rates: FaultRates) -> None:
        self.rates = rates
        self._rng = random.Random(rates.seed)
        self._held: dict[str, deque[bytes]] = {}
        self.counts: dict[str, int] = {k: 0 for k in (*KINDS, "passed", "held_cap")}

    def __call__(self, kind: str, engine: str, buf: bytes) -> list[bytes]:
        r = self._rng.random()
        rt = self.rates
        held = self._held.get(engine)
        # A held-back notification goes out after this one: delayed and reordered.
        out: list[bytes] = []
        if r < rt.drop:
            self.counts["drop"] += 1
        elif r < rt.drop + rt.dup:
            self.counts["dup"] += 1
            out = [buf, buf]
        elif r < rt.drop + rt.dup + rt.delay:
            if held is None and len(self._held) < MAX_ENGINES:
                held = self._held[engine] = deque()
            if held is not None and len(held) < MAX_HELD:
                self.counts["delay"] += 1
                held.append(buf)
                return []
            self.counts["held_cap"] += 1
            out = [buf]
        else:
            self.counts["passed"] += 1
            out = [buf]
        if held:
            out.extend(held)
            held.clear()
        return out


def from_options(raw: Mapping[str, Any] | None) -> NotificationFaults | None:
    """The shim for a ``test_faults`` setting (None: off)."""
    if not raw:
        return None
    return NotificationFaults(FaultRates.parse(raw))
