"""The connector's poll-gap watch (``kvproto.vllm.workers.PollGaps``): a gap between a
worker's adapter polls counts as a stall when it exceeds ``max_delay`` and the worker had
work at the poll that opened it. Pure: times are passed in."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvproto.vllm.workers import PollGaps


def test_a_gap_is_a_stall_only_over_max_delay_and_with_work_pending() -> None:
    g = PollGaps(1.0, now=0.0)
    assert g.polled(5.0, watch=False) is None  # opened at start-up: nothing pending
    assert g.polled(10.0, watch=True) is None  # opened idle (an idle engine need not step)
    assert g.polled(10.5, watch=True) is None  # within max_delay
    assert g.polled(11.5, watch=True) is None  # exactly max_delay: not over it
    assert g.polled(14.0, watch=False) == 2.5  # over it, with work pending: a stall
    assert g.polled(40.0, watch=True) is None  # opened idle again
    assert g.polled(41.25, watch=True) == 1.25
    assert (g.stalls, g.stalled_s, g.longest) == (2, 3.75, 2.5)


def test_the_watch_follows_the_poll_that_opened_the_gap_not_the_one_that_closed_it() -> None:
    g = PollGaps(0.5, now=0.0)
    g.polled(1.0, watch=True)
    # The work ended during the gap (this poll finds nothing pending): still a stall.
    assert g.polled(3.0, watch=False) == 2.0
    # Work arrived during an idle gap: the gap does not count.
    assert g.polled(9.0, watch=True) is None
    assert g.stalls == 1


def test_the_warm_up_reports_poll_stalls_only_where_the_harness_can_ask() -> None:
    """``scenarios.poll_stalls``: a TP engine's worker side is out of the harness's reach
    (None, no call made); a failing call is None; otherwise the worker's count."""
    from types import SimpleNamespace
    from typing import Any, cast

    from kvproto.vllm import scenarios as sc
    from kvproto.vllm.harness import HarnessError

    class Fake:
        def __init__(self, tp: int, stats: dict[str, float] | None) -> None:
            self.spec = SimpleNamespace(name="e", tensor_parallel_size=tp)
            self.stats = stats
            self.calls = 0

        def connector_stats(self) -> dict[str, float]:
            self.calls += 1
            if self.stats is None:
                raise HarnessError("e: connector failed")
            return self.stats

    tp2 = Fake(2, {"poll_stalls": 3.0})
    assert sc.poll_stalls(cast(Any, tp2)) is None and tp2.calls == 0
    assert sc.poll_stalls(cast(Any, Fake(1, None))) is None
    assert sc.poll_stalls(cast(Any, Fake(1, {"poll_stalls": 2.0}))) == 2.0
    assert sc.poll_stalls(cast(Any, Fake(1, {}))) == 0.0
