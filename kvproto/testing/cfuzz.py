"""The coverage fuzzer: random tensor-parallel topologies and random part outcomes driven
through D's ``Coverage`` machine (or a mutant), with an oracle that knows, from the
inputs alone, which regions each request needs and which were read.

Each case draws P's and D's tensor-parallel sizes and a KV head count that both split
(``Topology``), a D rank, KV cache groups and their layer counts, and a few requests;
each request's region map is ``region_map(topology, d_rank, layers)``. Then, in a random
interleaving, each part of each request either fails, or its READ lands having
transferred all of the part's regions or all but a random one of them (a READ plan that
dropped a region), with duplicate and unknown-part reports mixed in.

The oracle checks, after every step:

* ``Coverage``: a request reported complete (``CoverageDone.ok``) has every region of its
  map among the regions its parts' READs transferred (as the oracle recorded them), and
  its report names exactly the regions it needs as read;
* ``FailClosed``: a request with a failed part, or a part whose READ missed a region, is
  never reported complete;
* ``OneVerdict``: each request is reported at most once, and every request whose parts
  all reported is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from random import Random

from kvproto.errors import KVProtoError
from kvproto.lifecycle.coverage import Coverage, CoverageDone, Region, region_map
from kvproto.lifecycle.topology import Topology

INVARIANTS = frozenset({"Coverage", "FailClosed", "OneVerdict"})


class CoverageViolation(KVProtoError, AssertionError):
    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant


@dataclass
class _Req:
    need: dict[int, frozenset[Region]]
    read: set[Region] = field(default_factory=set)
    bad: bool = False
    reported: int = 0
    left: set[int] = field(default_factory=set)


def _topology(rng: Random) -> Topology:
    heads = rng.choice((1, 2, 4, 8))
    sizes = (1, 2, 4, 8)
    p_tp = rng.choice([t for t in sizes if heads % t == 0 or t % heads == 0])
    d_tp = rng.choice([t for t in sizes if heads % t == 0 or t % heads == 0])
    return Topology(p_tp, d_tp, heads)


def run_case(seed: int, cls: type[Coverage] = Coverage) -> int:
    """One random case; returns the number of requests reported. Raises
    CoverageViolation naming the invariant a step broke."""
    rng = Random(seed)
    topo = _topology(rng)
    d_rank = rng.randrange(topo.d_tp)
    layers = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]
    cov = cls()
    reqs: dict[str, _Req] = {}
    for i in range(rng.randint(1, 4)):
        rid = f"r{i}"
        need = region_map(topo, d_rank, layers)
        reqs[rid] = _Req(need, left=set(need))
        _check(cov.expect(rid, need), reqs)
    reported = 0
    while any(r.left for r in reqs.values()):
        rid = rng.choice([k for k, r in reqs.items() if r.left])
        req = reqs[rid]
        part = rng.choice(sorted(req.left))
        roll = rng.random()
        if roll < 0.15:
            req.left.discard(part)
            req.bad = True
            out = cov.part_failed(rid, part)
        else:
            got = set(req.need[part])
            if roll < 0.35 and got:
                got.discard(rng.choice(sorted(got)))
                req.bad = True
            req.read |= got
            req.left.discard(part)
            out = cov.part_read(rid, part, got)
            if rng.random() < 0.1:  # a duplicate report, and one of a part not in the map
                out += cov.part_read(rid, part, got)
                out += cov.part_read(rid, topo.p_tp + 1, ())
        reported += _check(out, reqs)
        if any(isinstance(e, CoverageDone) and e.rid == rid for e in out):
            req.left.clear()  # the request ended: its other parts were cancelled
    for rid, r in reqs.items():
        if r.reported != 1:
            raise CoverageViolation("OneVerdict", f"{rid} reported {r.reported} times")
    return reported


def _check(out: list, reqs: dict[str, _Req]) -> int:  # type: ignore[type-arg]
    n = 0
    for e in out:
        if not isinstance(e, CoverageDone):
            continue
        n += 1
        r = reqs[e.rid]
        r.reported += 1
        if r.reported > 1:
            raise CoverageViolation("OneVerdict", f"{e.rid} reported twice")
        if not e.ok:
            continue
        need = frozenset().union(*r.need.values())
        if not need <= r.read or e.read != need:
            raise CoverageViolation("Coverage", f"{e.rid} complete, missing "
                                                f"{sorted(need - r.read)[:3]}")
        if r.bad:
            raise CoverageViolation("FailClosed", f"{e.rid} complete after a failed or "
                                                  "short part")
    return n


def fuzz(cases: int, cls: type[Coverage] = Coverage, seed: int = 0) -> str | None:
    """Run ``cases`` cases; the invariant the first failing one broke, or None."""
    for i in range(cases):
        try:
            run_case(seed + i, cls)
        except CoverageViolation as v:
            return v.invariant
    return None
