"""D's READs in flight, as the driver tracks them: one ``Read`` per request, coalesced
into ``ReadBatch`` transfers of up to ``MAX_READ_DESCS`` blocks per P engine, and the
``StampBatch`` READs of their generation stamps. Data only; ``DDriver`` decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproto.lifecycle import TransferParams

# Stamps fetched by one stamp READ at most (a request with more blocks gets its own READ).
# Bounds the descriptor list of one READ; the queue itself is bounded by the local blocks.
MAX_STAMP_DESCS = 4096
# Descriptors of one coalesced data READ at most: READs queued for one P engine are posted
# as transfers of up to this many descriptors (a request with more gets its own).
MAX_READ_DESCS = 4096


class Read:
    __slots__ = ("engine", "gens", "local", "nbytes", "params", "remote", "rid", "started",
                 "warned")

    def __init__(self, rid: str, params: TransferParams, local: list[int], started: int,
                 remote: Sequence[int] | None = None, gens: Sequence[int] | None = None) -> None:
        self.rid = rid
        self.params = params
        self.engine = params.engine
        self.local = local
        # The remote blocks read and the stamps they must carry (all of the params' by
        # default; a suffix when the engine already holds a prefix locally).
        self.remote: Sequence[int] = params.blocks if remote is None else remote
        self.gens: Sequence[int] = params.generations if gens is None else gens
        self.started = started
        self.nbytes = 0
        self.warned = False


def chunks(rds: list[Read], cap: int) -> list[list[Read]]:
    """``rds`` in order, cut into runs of at most ``cap`` blocks (a READ larger than
    ``cap`` alone makes a run of its own)."""
    if len(rds) == 1:
        return [rds]
    out: list[list[Read]] = []
    run: list[Read] = []
    n = 0
    for rd in rds:
        k = len(rd.local)
        if run and n + k > cap:
            out.append(run)
            run, n = [], 0
        run.append(rd)
        n += k
    if run:
        out.append(run)
    return out


def batch_blocks(rds: list[Read]) -> tuple[list[int], Sequence[int]]:
    """The local and the remote blocks of ``rds``, in order (one transfer's pairs)."""
    if len(rds) == 1:
        return rds[0].local, rds[0].remote
    return [b for rd in rds for b in rd.local], [b for rd in rds for b in rd.remote]


class ReadBatch:
    """One data READ (one transfer) of several requests' blocks (same P engine)."""

    __slots__ = ("reads", "xfer")

    def __init__(self, reads: list[Read], xfer: Any) -> None:
        self.reads = reads
        self.xfer = xfer


class StampBatch:
    """One READ of the generation stamps of several requests (same P engine)."""

    __slots__ = ("local", "reads", "xfer")

    def __init__(self, reads: list[Read], local: list[int], xfer: Any) -> None:
        self.reads = reads
        self.local = local  # the local stamp slots, in the order of ``reads``
        self.xfer = xfer
