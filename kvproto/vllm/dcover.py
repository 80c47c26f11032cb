"""One D rank's reading plan and coverage join, as the worker applies them.

For every admitted request, ``RankReads`` works out from the transfer params (the region
map travels in them: P's TP size, KV heads and layers per KV cache group,
``kvproto.vllm.topology.RANKS_KEY``) and this rank's place (TP rank and size, the
model's KV heads):

* the P rank it reads and which of its heads (``kvproto.vllm.topology.plan_source``):
  whole blocks when both hold the same heads, a head slice of P's blocks when P's rank
  holds more heads than D's (P TP 1 -> D TP 2 with split heads; the slice is cut in
  NIXL's descriptors, ``kvproto.nixl.agent.RemoteRegion.head_slice``); a plan whose D
  block needs several P ranks is refused before any READ, counted ``tp_refused``;
* the expected reader count of that P rank's request, from the TP ratio
  (``Topology.readers``): D's messages announce it, and P's ledger frees as
  ``transferred`` only once that many distinct readers are done (P TP 1 -> D TP 2 with a
  replicated head: 2). Never lowered below what P's params say;
* the P ranks no D rank reads (``Topology.orphans``): their blocks are never pulled and
  P frees them by lease expiry. D rank 0 counts them once per request (``orphan``);
* the region map of the request on this rank, handed to the coverage machine
  (``kvproto.lifecycle.coverage.Coverage``, event ``expect``).

When the request's READ ends, ``finish`` feeds the machine (``part_read`` with the
regions the verified READ covered, or ``part_failed``) and answers whether the request
is complete. The worker reports a load successful to vLLM only on that answer:
fail closed, a region of the map that this rank's READ does not cover (P's params name a
layer or group D registered no KV tensor for) makes the load fail (``coverage_short``),
and the request recomputes or fails per ``kv_load_failure_policy``.

What a verified READ covers: D's data READ of a block posts one descriptor per registered
KV segment (every layer tensor vLLM registered, ``kvproto.nixl.agent.tensor_segments``),
and the stamp READ after it verifies the whole block; so a pulled part covers, on its P
rank, every ``(layer, group)`` whose KV tensor D registered (``covered``).

Cost: ``admit`` O(regions of the request) (at most ``coverage.MAX_REGIONS``), ``finish``
O(regions of the part). Cap: the coverage machine tracks at most ``max_requests``
requests (admitted, not yet finished); at the cap ``expect`` fails the request closed
(``coverage_full``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, Final

from kvproto.errors import UsageError
from kvproto.lifecycle.coverage import (
    MAX_COVERAGE_REQUESTS,
    Coverage,
    CoverageDone,
    Region,
    region_map,
)
from kvproto.lifecycle.topology import Topology
from kvproto.vllm.sched import AdmitOrder, ParamsError, RemoteParams
from kvproto.vllm.topology import (
    HeadSlice,
    TopologyUnsupported,
    d_params,
    parse_ranks,
    plan_source,
)

MAX_LAYER_KEYS: Final = 1 << 16  # (layer, group) pairs a rank may cover


def covered_layers(names: Sequence[str], groups: Sequence[Sequence[str]]
                   ) -> frozenset[tuple[int, int]]:
    """The ``(layer, group)`` pairs whose KV tensor a rank registered: layer ``i`` of
    group ``g`` is the ``i``-th name of the group's layer names. Without group
    information (``groups`` empty) the registered tensors are the layers of group 0."""
    have = set(names)
    if not groups:
        return frozenset((i, 0) for i in range(min(len(names), MAX_LAYER_KEYS)))
    return frozenset((i, g) for g, layer_names in enumerate(groups)
                     for i, n in enumerate(layer_names) if n in have)


def heads_outermost(tensors: Sequence[Any], num_blocks: int, heads: int) -> bool:
    """Whether every KV tensor holds the head dimension (``heads`` long) right after the
    block dimension, so that a block's heads are contiguous runs (vLLM's CPU layout (N,
    H, block size, 2 x head size)): then a head slice of a block is one NIXL descriptor
    per segment. Otherwise a slice would be strided per token, and is not read."""
    for t in tensors:
        shape = list(t.shape)
        if num_blocks not in shape:
            return False
        nb = shape.index(num_blocks)
        if nb + 1 >= len(shape) or shape[nb + 1] != heads:
            return False
    return bool(tensors)


class RankReads:
    """One D rank's plan and coverage join (see the module docstring)."""

    def __init__(self, d_rank: int, d_tp: int, kv_heads: int,
                 covered: Collection[tuple[int, int]], layers: Sequence[int],
                 coverage: Coverage | None = None,
                 max_requests: int = MAX_COVERAGE_REQUESTS, slices: bool = False) -> None:
        """``covered``: this rank's ``(layer, group)`` pairs; ``layers``: layers per KV
        cache group of this engine (the map's axes when P's params carry none);
        ``slices``: this rank may read head slices of P's blocks (its KV tensors hold the
        head dimension outermost within a block, and block checksums are off)."""
        self.d_rank, self.d_tp, self.kv_heads = d_rank, d_tp, kv_heads
        self.slices = slices
        # P engine -> the head slice this rank reads of its blocks (None: whole blocks);
        # fixed per engine (its TP size fixes the plan). Size: the P engines admitted.
        self.slice_of: dict[str, HeadSlice | None] = {}
        self.covered = frozenset(covered)
        self.layers = tuple(layers) or (1,)
        self.cov = coverage if coverage is not None else Coverage(max_requests)
        self.part: dict[str, int] = {}  # request -> the P rank it reads (tracked ones)
        self.counters: dict[str, float] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + n

    def plan(self, ad: AdmitOrder) -> tuple[AdmitOrder, int, dict[int, frozenset[Region]]]:
        """The admit order this rank pulls with, the P rank it reads and the request's
        region map on this rank; the head slice it reads of that P rank's blocks is
        ``slice_of[engine]``. Raises TopologyUnsupported or ParamsError (the caller
        counts ``tp_refused`` and ends the request before any READ)."""
        base = RemoteParams(ad.params, ad.host, ad.port, 1)
        ranks = parse_ranks(ad.ranks, base)
        rp = d_params(base, ranks, self.d_rank, self.d_tp, self.kv_heads, slices=self.slices)
        _, sl = plan_source(ranks, self.d_rank, self.d_tp, self.kv_heads, slices=self.slices)
        engine = rp.params.engine
        if engine in self.slice_of and self.slice_of[engine] != sl:
            raise TopologyUnsupported(f"P engine {engine[:64]} read as {self.slice_of[engine]}"
                                      f" before, now {sl}")
        self.slice_of[engine] = sl
        p_tp = ranks.p_tp if ranks is not None else 1
        layers = ranks.layers if ranks is not None else self.layers
        top = Topology(p_tp, self.d_tp, self.kv_heads)  # checked by d_params
        [src] = top.sources(self.d_rank)
        try:
            need = region_map(top, self.d_rank, layers)
        except UsageError as e:
            raise ParamsError("bad_params", str(e)) from None
        params = rp.params
        readers = top.readers(src.p_rank)
        if readers > params.expected:
            params = replace(params, expected=readers)
        if self.d_rank == 0 and top.orphans():
            self._count("orphan", len(top.orphans()))
        return AdmitOrder(ad.request_id, params, rp.host, rp.port), src.p_rank, need

    def expect(self, rid: str, part: int, need: dict[int, frozenset[Region]]) -> bool:
        """Event ``expect`` with the request's region map; False: the request cannot be
        complete (no region, or the machine is full) and must end before any READ."""
        for fx in self.cov.expect(rid, need):
            if isinstance(fx, CoverageDone) and not fx.ok:
                self._count(f"coverage_{fx.reason}")
                self.cov.forget(rid)
                return False
        self.part[rid] = part
        return True

    def regions_read(self, part: int) -> frozenset[Region]:
        """The regions a verified READ from P rank ``part`` covers on this rank."""
        return frozenset(Region(part, layer, g) for layer, g in self.covered)

    def finish(self, rid: str, pulled: bool) -> bool:
        """The READ of ``rid`` ended (``pulled``: landed and its stamps verified). True
        only when the coverage machine reports the request complete."""
        part = self.part.pop(rid, None)
        if part is None:
            return False
        fxs = self.cov.part_read(rid, part, self.regions_read(part)) if pulled \
            else self.cov.part_failed(rid, part)
        ok = False
        for fx in fxs:
            if isinstance(fx, CoverageDone):
                ok = fx.ok
                if not ok and pulled:
                    self._count(f"coverage_{fx.reason}")
                    self._count("coverage_missing_regions", len(fx.missing))
        self.cov.forget(rid)
        if pulled and ok:
            self._count("coverage_complete")
        return ok

    def drop(self, rid: str) -> None:
        """The request ended without a READ outcome (never loaded): forget it."""
        if self.part.pop(rid, None) is not None:
            self.cov.forget(rid)

    def __len__(self) -> int:
        return len(self.part)
