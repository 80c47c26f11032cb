"""Tensor-parallel pairing: which P ranks hold the KV heads a D rank needs.

A model with ``kv_heads`` KV heads served at tensor-parallel size ``tp`` gives rank ``i``
of ``tp``:

* ``kv_heads >= tp`` (``kv_heads % tp == 0``): the ``kv_heads // tp`` heads starting at
  ``i * kv_heads // tp``;
* ``kv_heads < tp`` (``tp % kv_heads == 0``): one head, ``i * kv_heads // tp``, which
  ``tp // kv_heads`` ranks hold alike (replicated).

``Topology(p_tp, d_tp, kv_heads)`` pairs the ranks of P and D. D rank ``d`` reads every
head it holds exactly once, from one P rank: the only holder when heads are split on P,
else holder number ``d % replicas`` of the P ranks that replicate it (so that D ranks
spread over the replicas). ``sources(d)`` is D rank d's reading plan as runs of
contiguous heads (one ``Source`` per P rank it reads: heads of one rank are contiguous on
both sides); ``readers(p)`` is how many distinct D ranks read P rank p -- the expected
reader count of p's requests, which P's ledger waits for before it frees as
``transferred``. ``orphans()`` are the P ranks no D rank reads (replicated heads on P, a
smaller D): their blocks are never pulled; D counts them (``orphan``) and releases them
once the request ended on D (``kvproto.vllm.dcover``), so P frees them as ``released``.
A D rank whose plan has several sources (P TP 2 -> D TP 1 with split heads) reads each
as its own part; the coverage machine (``kvproto.lifecycle.coverage``) joins them.

Pure and O(d_tp * heads) once at construction (both sizes capped at ``MAX_TP``); every
query after that is a lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvproto.errors import UsageError

MAX_TP: Final = 1024  # largest tensor-parallel size and head count accepted


class TopologyError(UsageError, ValueError):
    """A tensor-parallel size the model's KV heads cannot be split over."""


def _check(tp: int, kv_heads: int, side: str) -> None:
    if not 1 <= tp <= MAX_TP:
        raise TopologyError(f"{side} tensor_parallel_size {tp} outside 1..{MAX_TP}")
    if kv_heads >= tp and kv_heads % tp:
        raise TopologyError(f"{side}: {kv_heads} KV heads cannot be split over "
                            f"tensor_parallel_size {tp}")
    if kv_heads < tp and tp % kv_heads:
        raise TopologyError(f"{side}: {kv_heads} KV heads cannot be replicated over "
                            f"tensor_parallel_size {tp}")


def heads_of(rank: int, tp: int, kv_heads: int) -> range:
    """The global KV heads rank ``rank`` of ``tp`` holds (see the module docstring)."""
    if kv_heads >= tp:
        n = kv_heads // tp
        return range(rank * n, rank * n + n)
    h = rank * kv_heads // tp
    return range(h, h + 1)


@dataclass(frozen=True, slots=True)
class Source:
    """One P rank a D rank reads: ``heads`` contiguous KV heads, at head index
    ``p_head`` of P rank ``p_rank``'s KV tensor and ``d_head`` of D's."""

    p_rank: int
    p_head: int
    d_head: int
    heads: int


class Topology:
    """The pairing of P's and D's tensor-parallel ranks for one model."""

    __slots__ = ("_readers", "_sources", "d_tp", "kv_heads", "p_tp")

    def __init__(self, p_tp: int, d_tp: int, kv_heads: int) -> None:
        if not 1 <= kv_heads <= MAX_TP:
            raise TopologyError(f"{kv_heads} KV heads outside 1..{MAX_TP}")
        _check(p_tp, kv_heads, "P")
        _check(d_tp, kv_heads, "D")
        self.p_tp, self.d_tp, self.kv_heads = p_tp, d_tp, kv_heads
        self._sources = tuple(self._plan(d) for d in range(d_tp))
        readers = [0] * p_tp
        for plan in self._sources:
            for s in plan:
                readers[s.p_rank] += 1
        self._readers = tuple(readers)

    def _holder(self, head: int, d_rank: int) -> int:
        """The one P rank D rank ``d_rank`` reads global head ``head`` from."""
        if self.kv_heads >= self.p_tp:
            return head // (self.kv_heads // self.p_tp)
        replicas = self.p_tp // self.kv_heads
        return head * replicas + d_rank % replicas

    def _plan(self, d: int) -> tuple[Source, ...]:
        out: list[Source] = []
        for i, h in enumerate(heads_of(d, self.d_tp, self.kv_heads)):
            p = self._holder(h, d)
            p_head = h - heads_of(p, self.p_tp, self.kv_heads).start
            last = out[-1] if out else None
            if last is not None and last.p_rank == p and last.p_head + last.heads == p_head:
                out[-1] = Source(p, last.p_head, last.d_head, last.heads + 1)
            else:
                out.append(Source(p, p_head, i, 1))
        return tuple(out)

    def sources(self, d_rank: int) -> tuple[Source, ...]:
        """D rank ``d_rank``'s reading plan: one ``Source`` per P rank it reads."""
        if not 0 <= d_rank < self.d_tp:
            raise TopologyError(f"D rank {d_rank} outside tensor_parallel_size {self.d_tp}")
        return self._sources[d_rank]

    def readers(self, p_rank: int) -> int:
        """How many distinct D ranks read P rank ``p_rank`` (0: an orphan)."""
        if not 0 <= p_rank < self.p_tp:
            raise TopologyError(f"P rank {p_rank} outside tensor_parallel_size {self.p_tp}")
        return self._readers[p_rank]

    def orphans(self) -> tuple[int, ...]:
        """The P ranks that no D rank reads."""
        return tuple(p for p, n in enumerate(self._readers) if n == 0)

    def local_heads(self, side: str) -> int:
        """KV heads in one rank's KV tensor on ``side`` ("P" or "D")."""
        tp = self.p_tp if side == "P" else self.d_tp
        return len(heads_of(0, tp, self.kv_heads))
