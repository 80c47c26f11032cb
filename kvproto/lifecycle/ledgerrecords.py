"""The ledger's per-request records: a held (or freed) request and a staged handle.

Memory per held request is a measured figure (``kvproto bench ledger``,
``bytes_per_request``): a record holds only what every request needs; what few requests
have (a sibling group, a release) is kept beside it by ``producer.Ledger``.
"""

from __future__ import annotations

from kvproto.lifecycle.table import UNREGISTERED


class _Req:
    """A held request. Kept small: memory per held request is a measured figure."""

    # The handle is the key it is held under (``Ledger._live``), its sibling group and
    # whether a reader released it are kept beside it (``Ledger._group_of``,
    # ``Ledger._released``): most requests have neither, and each slot is 8 bytes.
    __slots__ = ("blocks", "deadline", "expected", "finished", "rid", "state")

    def __init__(self, rid: str, blocks: tuple[int, ...], deadline: int, expected: int) -> None:
        self.rid = rid
        self.blocks = blocks
        self.deadline = deadline
        self.expected = expected
        self.state: str = UNREGISTERED  # the register step moves it
        # The distinct readers that reported done or release: None, one reader's name,
        # or a set of two or more (``_add_reader``; ``ledgerviews.readers`` reads it).
        self.finished: str | set[str] | None = None

    def copy(self) -> _Req:
        """An independent copy (``Ledger.clone``)."""
        q = _Req(self.rid, self.blocks, self.deadline, self.expected)
        q.state = self.state
        fin = self.finished
        q.finished = set(fin) if isinstance(fin, set) else fin
        return q


def _add_reader(r: _Req, reader: str) -> int:
    """``reader`` finished ``r`` (done or release): how many distinct readers finished
    it now, or -1 when this reader had already finished (``Ledger.tally``; the caller
    records a release in ``Ledger._released``)."""
    fin = r.finished
    if fin is None:
        r.finished = reader
        n = 1
    elif isinstance(fin, str):
        if fin == reader:
            return -1
        r.finished = {fin, reader}
        n = 2
    elif reader in fin:
        return -1
    else:
        fin.add(reader)
        n = len(fin)
    return n


class _Staged:
    __slots__ = ("msgs", "since")

    def __init__(self, since: int) -> None:
        self.since = since
        self.msgs: list[tuple[str, str, int, int]] = []  # (kind, reader, expected, arrival)

    def copy(self) -> _Staged:
        """An independent copy (``Ledger.clone``)."""
        st = _Staged(self.since)
        st.msgs = list(self.msgs)
        return st
