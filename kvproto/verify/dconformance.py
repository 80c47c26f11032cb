"""D-side conformance: one decode rank's journal checked against D's transition table.

A D journal (``JournalWriter(..., reader=name)`` on a ``Consumer``'s sink: the simulator,
``kvproto demo``, the NIXL tests) is replayed through a fresh ``Consumer`` (which runs
``D_TRANSITIONS``, the table ``tla/KVLifecycle.tla``'s D actions mirror name for name):
every recorded effect must be the table's, and D's promises to P must hold (no release
while a READ is in flight). ``kvproto validate`` sends D journals here.

Not done yet (issue 10): a standalone TLA+ D module with graph equality against the
Python ``Consumer`` and TLC trace validation of D journals, as ``tla/KVLedger.tla`` has
for P. Until then, D's TLA+ mirror is KVLifecycle's D actions, checked by TLC with P.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvproto.journal import JournalError, journal_side, replay


@dataclass
class DVerdict:
    """The outcome for one D journal."""

    path: str
    reader: str
    events: int
    allowed: bool
    finished: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = (f"{self.path}: D journal of {self.reader}: {self.events} events "
                f"{'follow' if self.allowed else 'do NOT follow'} D_TRANSITIONS "
                f"(finished {self.finished})")
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def is_d_journal(path: str | Path) -> bool:
    """True when ``path``'s header says it is one D rank's journal (False for P's, or
    when the header cannot be read: the caller reports that)."""
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
        return isinstance(header, dict) and journal_side(header) == "D"
    except (OSError, ValueError, JournalError):
        return False


def check_d_journal(path: str | Path) -> DVerdict:
    """Replay a D journal through ``Consumer``; raises JournalError on unreadable input."""
    with open(path, encoding="utf-8") as f:
        header = json.loads(f.readline())
        f.seek(0)
        res = replay(f)
    return DVerdict(str(path), str(header.get("reader")), res.events, res.ok, res.frees,
                    [*(f"DIVERGED {d}" for d in res.divergences),
                     *(f"VIOLATION {v}" for v in res.violations)])
