"""One D rank's reading plan and coverage join, as the worker applies them.

For every admitted request, ``RankReads`` works out from the transfer params (the region
map travels in them: P's TP size, KV heads and layers per KV cache group,
``kvproto.vllm.topology.RANKS_KEY``) and this rank's place (TP rank and size, the
model's KV heads):

* its parts: the P ranks it reads, one per P rank that holds some of its heads
  (``kvproto.vllm.topology.plan_parts``), each with that rank's params: whole blocks when
  both hold the same heads; a head slice of P's blocks when P's rank holds more heads
  than D's (P TP 1 -> D TP 2 with split heads; the slice is cut in NIXL's remote
  descriptors, ``kvproto.nixl.agent.RemoteRegion.head_slice``); and, when D's rank holds
  more heads than one P rank (P TP 2 -> D TP 1 with split heads), one part per P rank
  whose whole blocks land in the heads of D's block that rank holds (the slice is cut
  in D's local descriptors, ``kvproto.nixl.transport.NixlDTransport.local_slices``).
  Each part is its own ``Consumer`` entry (its own claim at its P rank's gate, READ,
  stamp check, done or release), and its stamp READs land in the part's own stamp slot
  set (``Part.stamps``), since the parts of one request share its local blocks;
* the expected reader count of each part's P rank, from the TP ratio
  (``Topology.readers``): D's messages announce it, and P's ledger frees as
  ``transferred`` only once that many distinct readers are done (P TP 1 -> D TP 2 with a
  replicated head: 2). Never lowered below what P's params say;
* the P ranks no D rank reads (``Topology.orphans``): their blocks are never pulled.
  D rank 0 counts them once per request (``orphan``) and admits each as an entry that
  never reads; when the request ends on D (done or failed) the worker aborts that
  entry, which sends its P rank a ``release`` (P frees as ``released`` instead of
  waiting for the lease);
* the region map of the request on this rank, handed to the coverage machine
  (``kvproto.lifecycle.coverage.Coverage``, event ``expect``): one part per P rank.

When a part's READ ends, ``finish_part`` feeds the machine (``part_read`` with the
regions the verified READ covered, or ``part_failed``) and answers whether the request
is complete (every part read), cannot be (a part failed: the other parts are
cancelled), or waits for other parts. The worker reports a load successful to vLLM only
on ``complete``, and only once every part's entry ended (no READ of any part may still
land in the blocks it hands back): fail closed, a part that was fenced, failed or never
read, or a region of the map that a READ does not cover (P's params name a layer or
group D registered no KV tensor for), makes the load fail, and the request recomputes
or fails per ``kv_load_failure_policy``.

What a verified READ covers: D's data READ of a block posts one descriptor per registered
KV segment (every layer tensor vLLM registered, ``kvproto.nixl.agent.tensor_segments``),
and the stamp READ after it verifies the whole block; so a pulled part covers, on its P
rank, every ``(layer, group)`` whose KV tensor D registered (``covered``).

Cost: ``plan`` O(regions of the request) (at most ``coverage.MAX_REGIONS``),
``finish_part`` O(regions of the part). Cap: the coverage machine tracks at most ``max_requests``
requests (admitted, not yet finished); at the cap ``expect`` fails the request closed
(``coverage_full``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from kvproto.errors import UsageError
from kvproto.lifecycle.coverage import (
    MAX_COVERAGE_REQUESTS,
    CancelParts,
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
    parse_ranks,
    plan_parts,
    rank_params,
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


@dataclass(frozen=True)
class Part:
    """One P rank a request is read from on this rank: its admit order (that rank's
    params), the head slices of the READ (``PartPlan``) and ``stamps``, the stamp slot
    set its stamp READs land in (the part's index in the plan: two parts of one request
    share local blocks, never stamp slots)."""

    p_rank: int
    order: AdmitOrder
    remote: HeadSlice | None
    local: HeadSlice | None
    stamps: int


@dataclass(frozen=True)
class Plan:
    """A request's plan on this rank: its parts, the P ranks no D rank reads (their
    admit orders: D rank 0 releases them once the request ends) and the region map."""

    parts: tuple[Part, ...]
    orphans: tuple[AdmitOrder, ...]
    need: dict[int, frozenset[Region]]


class RankReads:
    """One D rank's plan and coverage join (see the module docstring)."""

    def __init__(self, d_rank: int, d_tp: int, kv_heads: int,
                 covered: Collection[tuple[int, int]], layers: Sequence[int],
                 coverage: Coverage | None = None,
                 max_requests: int = MAX_COVERAGE_REQUESTS, slices: bool = False) -> None:
        """``covered``: this rank's ``(layer, group)`` pairs; ``layers``: layers per KV
        cache group of this engine (the map's axes when P's params carry none);
        ``slices``: this rank may read head slices (its KV tensors hold the head
        dimension outermost within a block, and block checksums are off)."""
        self.d_rank, self.d_tp, self.kv_heads = d_rank, d_tp, kv_heads
        self.slices = slices
        # P engine -> how this rank reads its blocks (remote slice, local slice, stamp
        # slot set); fixed per engine (its TP size fixes the plan). Size: the P engines
        # admitted.
        self.slice_of: dict[str, tuple[HeadSlice | None, HeadSlice | None, int]] = {}
        self.covered = frozenset(covered)
        self.layers = tuple(layers) or (1,)
        self.cov = coverage if coverage is not None else Coverage(max_requests)
        self.part: dict[str, tuple[int, ...]] = {}  # request -> its parts (tracked ones)
        self.counters: dict[str, float] = {}

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + n

    def plan(self, ad: AdmitOrder) -> Plan:
        """The parts this rank reads ``ad`` from, the orphaned P ranks (D rank 0 only)
        and the request's region map on this rank. Raises TopologyUnsupported or
        ParamsError (the caller counts ``tp_refused`` and ends the request before any
        READ)."""
        base = RemoteParams(ad.params, ad.host, ad.port, 1)
        ranks = parse_ranks(ad.ranks, base)
        pps = plan_parts(ranks, self.d_rank, self.d_tp, self.kv_heads, slices=self.slices)
        p_tp = ranks.p_tp if ranks is not None else 1
        layers = ranks.layers if ranks is not None else self.layers
        top = Topology(p_tp, self.d_tp, self.kv_heads)  # checked by plan_parts
        try:
            need = region_map(top, self.d_rank, layers)
        except UsageError as e:
            raise ParamsError("bad_params", str(e)) from None
        parts: list[Part] = []
        for k, pp in enumerate(pps):
            rp = rank_params(base, ranks, pp.p_rank)
            how = (pp.remote, pp.local, k)
            engine = rp.params.engine
            if self.slice_of.get(engine, how) != how:
                raise TopologyUnsupported(f"P engine {engine[:64]} read as "
                                          f"{self.slice_of[engine]} before, now {how}")
            params = rp.params
            readers = top.readers(pp.p_rank)
            if readers > params.expected:
                params = replace(params, expected=readers)
            parts.append(Part(pp.p_rank, AdmitOrder(ad.request_id, params, rp.host, rp.port),
                              pp.remote, pp.local, k))
        for pt in parts:
            self.slice_of[pt.order.params.engine] = (pt.remote, pt.local, pt.stamps)
        orphans: list[AdmitOrder] = []
        if self.d_rank == 0 and top.orphans():
            self._count("orphan", len(top.orphans()))
            for p in top.orphans():
                rp = rank_params(base, ranks, p)
                orphans.append(AdmitOrder(ad.request_id, rp.params, rp.host, rp.port))
        return Plan(tuple(parts), tuple(orphans), need)

    def refused_releases(self, ad: AdmitOrder) -> tuple[AdmitOrder, ...]:
        """For a request whose plan this rank refused (``TopologyUnsupported``: its
        params were valid): the admit orders of the P ranks it would have read, and on
        D rank 0 the orphaned ones, each with the reader count of the TP ratio, so that
        the worker releases them (each P rank hears one release per D rank that would
        have read it, and frees as ``released`` once all did). Empty when the params do
        not parse (``ParamsError``): a release must name a P rank and handle D can
        trust, and bad params name neither."""
        base = RemoteParams(ad.params, ad.host, ad.port, 1)
        try:
            ranks = parse_ranks(ad.ranks, base)
            p_tp = ranks.p_tp if ranks is not None else 1
            if ranks is not None and ranks.kv_heads != self.kv_heads:
                return ()
            top = Topology(p_tp, self.d_tp, self.kv_heads)
        except (ParamsError, UsageError):
            return ()
        want = [s.p_rank for s in top.sources(self.d_rank)]
        if self.d_rank == 0:
            want += list(top.orphans())
        out = []
        for p in want:
            rp = rank_params(base, ranks, p)
            params = rp.params
            if top.readers(p) > params.expected:
                params = replace(params, expected=top.readers(p))
            out.append(AdmitOrder(ad.request_id, params, rp.host, rp.port))
        return tuple(out)

    def expect(self, rid: str, need: dict[int, frozenset[Region]]) -> bool:
        """Event ``expect`` with the request's region map (its parts are the map's P
        ranks); False: the request cannot be complete (no region, or the machine is
        full) and must end before any READ."""
        for fx in self.cov.expect(rid, need):
            if isinstance(fx, CoverageDone) and not fx.ok:
                self._count(f"coverage_{fx.reason}")
                self.cov.forget(rid)
                return False
        self.part[rid] = tuple(sorted(need))
        return True

    def regions_read(self, part: int) -> frozenset[Region]:
        """The regions a verified READ from P rank ``part`` covers on this rank."""
        return frozenset(Region(part, layer, g) for layer, g in self.covered)

    def finish_part(self, rid: str, part: int, pulled: bool
                    ) -> tuple[bool | None, tuple[int, ...]]:
        """Part ``part`` of ``rid`` ended (``pulled``: its READ landed and its stamps
        verified). Returns the request's outcome -- True only when the coverage machine
        reports it complete (every part read), False once it cannot be, None while other
        parts are pending -- and the parts to cancel (the machine's ``CancelParts``: a
        part failed, so the others must stop)."""
        if part not in self.part.get(rid, ()):
            return False, ()
        fxs = self.cov.part_read(rid, part, self.regions_read(part)) if pulled \
            else self.cov.part_failed(rid, part)
        res: bool | None = None
        cancel: tuple[int, ...] = ()
        for fx in fxs:
            if isinstance(fx, CancelParts):
                cancel = fx.parts
            elif isinstance(fx, CoverageDone):
                res = fx.ok
                if not res and pulled:
                    self._count(f"coverage_{fx.reason}")
                    self._count("coverage_missing_regions", len(fx.missing))
        if res is not None:
            self.part.pop(rid, None)
            self.cov.forget(rid)
            if res:
                self._count("coverage_complete")
        return res, cancel

    def finish(self, rid: str, pulled: bool) -> bool:
        """A one-part request's READ ended: True only when it is complete."""
        parts = self.part.get(rid, ())
        if len(parts) != 1:
            return False
        return self.finish_part(rid, parts[0], pulled)[0] is True

    def drop(self, rid: str) -> None:
        """The request ended without a READ outcome (never loaded): forget it."""
        if self.part.pop(rid, None) is not None:
            self.cov.forget(rid)

    def __len__(self) -> int:
        return len(self.part)
