"""The machines' fast paths give what their generic paths give.

``Ledger`` runs ``tally``'s body inline when a class keeps the hook, moves the state
directly for rows without effects, builds ``Free`` through a slotted twin
(``kvproto.lifecycle.hotpath``) and keeps its deadline heap as ints
(``deadline << HEAP_SHIFT | handle``). Each test here drives the fast path against the
generic one (a subclass that overrides ``tally`` with ``super()`` takes the generic path)
or checks the encoding at its edges, so that it fails when a fast path departs.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto import lifecycle
from kvproto.lifecycle import BlockPool, Config, Effect, Free, Ledger, Rejected
from kvproto.lifecycle.hotpath import new_free, register_free
from kvproto.lifecycle.producer import HEAP_HANDLE_MASK


class GenericTally(Ledger):
    """The same machine through the generic path: ``tally`` is overridden (by itself)."""

    def tally(self, handle: int, event: str, reader: str) -> int:
        return super().tally(handle, event, reader)


def test_a_class_that_overrides_tally_is_asked_for_every_report() -> None:
    calls: list[str] = []

    class Watching(Ledger):
        def tally(self, handle: int, event: str, reader: str) -> int:
            calls.append(reader)
            return super().tally(handle, event, reader)

    L = Watching(Config(), BlockPool(4))
    L.register(1, "r1", (0,), 0, expected=2)
    L.done("d0", 1, 2, 10)
    L.release("d1", [1], 2, 10)
    assert calls == ["d0", "d1"] and L.held_requests == 0


def _drive(cls: type[Ledger], seed: int) -> list[object]:
    rng = random.Random(seed)
    L = cls(Config(max_tombstones=8), BlockPool(12, strict=False))
    trace: list[object] = []
    now = 0
    live: list[int] = []
    for i in range(120):
        now += rng.choice((0, 1, 50, 700, 5000))
        op = rng.randrange(7)
        h = rng.choice(live) if live and rng.random() < 0.8 else rng.randrange(1, 40)
        reader = rng.choice(("d0", "d1", "d2"))
        exp = rng.choice((0, 1, 2, 3))
        out: list[Effect]
        if op == 0:
            h = L.new_handle()
            blocks = tuple(rng.sample(range(12), rng.randint(1, 3)))
            group = rng.choice((None, "g1", "g2"))
            out = L.register(h, f"r{i}", blocks, now, group=group, expected=exp)
            live.append(h)
        elif op == 1:
            out = L.done(reader, h, exp, now)
        elif op == 2:
            out = L.release(reader, [h, rng.randrange(1, 40)], exp, now)
        elif op == 3:
            out = L.heartbeat(reader, i, [h], exp, now)
        elif op == 4:
            out = L.abort(f"r{rng.randrange(i + 1)}", now)
        else:
            out = L.tick(now)
        trace.append((op, out, L.snapshot(), sorted(L.counters.items()), dict(L.frees),
                      L.next_deadline()))
    assert L.check_invariants() == []
    return trace


@pytest.mark.parametrize("seed", range(12))
def test_the_inline_tally_and_the_hook_give_the_same_run(seed: int) -> None:
    assert _drive(Ledger, seed) == _drive(GenericTally, seed)


def test_free_built_fast_is_a_free() -> None:
    f = new_free(7, "r7", "transferred", (1, 2), (2,), 900)
    g = Free(7, "r7", "transferred", (1, 2), (2,), 900)
    assert type(f) is Free and f == g and hash(f) == hash(g) and repr(f) == repr(g)
    assert dataclasses.astuple(f) == dataclasses.astuple(g)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.handle = 8  # type: ignore[misc]


def test_the_fast_constructor_refuses_a_class_of_another_shape() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Other:
        handle: int

    with pytest.raises(TypeError):
        register_free(Other)


def test_the_largest_wire_handle_is_held_and_expires_and_a_larger_one_is_refused() -> None:
    L = Ledger(Config(), BlockPool(4))
    big = HEAP_HANDLE_MASK  # 2**64 - 1
    assert L.register(big, "big", (0,), 0, expected=1) == []
    assert L.register(big + 1, "bigger", (1,), 0, expected=1) == [
        Rejected("invalid_register", "", big + 1,
                 f"handle must be below 2**64 (the wire's range), got {big + 1}")]
    assert L.counters["invalid_register"] == 1
    assert L.next_deadline() == 30_000
    assert L.tick(29_999) == []
    out = L.tick(30_000)
    assert [(type(e), e.handle) for e in out] == [(Free, big)]  # type: ignore[union-attr]
    assert L.held_requests == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-(10**12), 10**12), st.integers(0, HEAP_HANDLE_MASK)),
                min_size=1, max_size=30, unique_by=lambda t: t[1]))
def test_deadlines_expire_in_deadline_then_handle_order_at_any_time(
        regs: list[tuple[int, int]]) -> None:
    """Negative and large times and handles up to 2**64-1: the int heap orders entries
    as the (deadline, handle) pair would, and a tick frees exactly the due ones."""
    L = Ledger(Config(max_tick_work=lifecycle.MAX_CAP), BlockPool(64, strict=False))
    lease = L.config.ms.initial_lease
    for t, h in sorted(regs):
        L.register(h, f"r{h}", (0,), t, expected=1)
    due = sorted((t + lease, h) for t, h in regs)
    assert L.next_deadline() == due[0][0]
    at = max(due[len(due) // 2][0], L.now)  # a tick before the clock would be clamped
    out = L.tick(at)
    assert [e.handle for e in out if isinstance(e, Free)] == [h for d, h in due if d <= at]
    assert L.held_requests == sum(1 for d, _ in due if d > at)
    assert L.check_invariants() == []
