"""Tensor parallelism inside the vLLM connector: per-rank options, per-rank stamp mirrors,
the per-rank transfer params, and which P rank a D rank pulls from.

With tensor parallel size t, vLLM runs t workers per engine, each with its own KV tensors
(its heads), and so its own NIXL agent, ``Ledger`` (P) or ``Consumer`` (D), handshake
address, epoch and stamp tensor. vLLM's scheduler still sees one request; its KV output
aggregator reports a request in ``finished_sending``/``finished_recving`` only once
every rank did, and unions the load errors of all ranks.

* P: every rank registers the request under the same handle (the register order goes
  to every worker). The transfer params carry, besides rank 0's params (``kvproto``),
  the key ``RANKS_KEY``: P's TP size, the model's KV heads, the layers per KV cache
  group (the region map's axes), and for every P rank its agent, epoch, handshake
  address and the generations of the blocks from *that rank's* stamp mirror
  (``RankMirrors``; ranks bump stamps at their own pace, so one mirror for all ranks
  could pair one rank's stamp with another's bump).
* D: rank d takes its plan from ``kvproto.lifecycle.topology.Topology``: one *part* per
  P rank that holds some of its heads (``plan_parts``), each read with that rank's
  params (``rank_params``). Whole blocks when both hold the same heads (equal TP sizes,
  KV heads replicated on both sides); a head slice of P's blocks when a P rank holds
  more heads than D's (P TP 1 -> D TP 2, split heads); and several parts, each P rank's
  whole blocks landing in the heads of D's block that rank holds, when D's rank holds
  more heads than one P rank (P TP 2 -> D TP 1, split heads: one READ per P rank and
  step, each part with its own stamp slots, joined by the coverage machine). Slices
  need heads outermost within a block on both sides and block checksums off; else the
  plan is refused before anything is read (``TopologyUnsupported``, counted
  ``tp_refused``; the request recomputes or fails per ``kv_load_failure_policy``).
  P ranks no D rank reads (replicated heads, a smaller D) are released by D rank 0 once
  the request ends on D (``kvproto.vllm.dcover``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any, Final

from kvproto.errors import UsageError
from kvproto.lifecycle import TransferParams
from kvproto.lifecycle.gate import capability
from kvproto.lifecycle.topology import MAX_TP, Topology, TopologyError
from kvproto.vllm.sched import (
    MAX_NAME,
    AdmitOrder,
    ConnectorOptions,
    ParamsError,
    RemoteParams,
)

RANKS_KEY: Final = "kvproto_tp"  # kv_transfer_params key of the per-rank params
MAX_LAYERS: Final = 4096  # layers per KV cache group in params


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without vLLM's distributed state)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no distributed state (a bare worker): one rank
        return 0


def for_tp_rank(opts: ConnectorOptions, rank: int, tp_size: int, dp_rank: int
                ) -> ConnectorOptions:
    """The options of TP rank ``rank`` (after ``for_dp_rank``): a fixed port becomes
    port + dp_rank * tp_size + rank (the DP shift already added dp_rank), a journal path
    gains ``.tp<rank>`` before its suffix on rank > 0."""
    if rank == 0 and dp_rank == 0:
        return opts
    extra = dp_rank * (tp_size - 1) + rank

    def shifted(key: str, v: int | None) -> int | None:
        if not v:
            return v
        if v + extra > 65535:
            raise ValueError(f"kvproto: {key} {v} + rank offset {extra} exceeds 65535")
        return v + extra

    journal = opts.journal
    if journal is not None and rank > 0:
        j = PurePath(journal)
        journal = str(j.with_name(f"{j.stem}.tp{rank}{j.suffix}"))
    hp = shifted("handshake_port", opts.handshake_port)
    assert hp is not None
    return replace(opts, handshake_port=hp,
                   metrics_port=shifted("metrics_port", opts.metrics_port), journal=journal)


class RankMirrors:
    """P's scheduler: one stamp mirror per TP rank (block -> newest generation that
    rank's worker reported). A rank's mirror never runs ahead of that rank's stamps."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._m: dict[int, list[int]] = {}

    def on_stamps(self, rank_stamps: Mapping[int, Mapping[int, int]]) -> None:
        for r, stamps in rank_stamps.items():
            if not 0 <= r < MAX_TP:
                continue
            m = self._m.setdefault(r, [0] * self.num_blocks)
            for b, g in stamps.items():
                if 0 <= b < self.num_blocks and g > m[b]:
                    m[b] = g

    def gens(self, rank: int, blocks: Sequence[int]) -> list[int]:
        m = self._m.get(rank)
        return [m[b] for b in blocks] if m is not None else [0] * len(blocks)


@dataclass(frozen=True)
class RankPeer:
    engine: str
    epoch: int
    host: str
    port: int
    cap_key: bytes = b""  # the rank's gate key (same engine, never sent out)


def _rank_capability(p: RankPeer, handle: int | None) -> str:
    """The capability of ``handle`` at P rank ``p``'s gate ("" without a key or handle:
    that rank's params then bind nothing)."""
    if handle is None or len(p.cap_key) < 16:
        return ""
    return capability(p.cap_key, p.engine, p.epoch, handle)


def encode_ranks(peers: Mapping[int, RankPeer], mirrors: RankMirrors, blocks: Sequence[int],
                 kv_heads: int, layers: Sequence[int], handle: int | None = None
                 ) -> dict[str, Any]:
    """The ``RANKS_KEY`` value of P's transfer params (see the module docstring). Every
    rank's entry carries the capability of ``handle`` at that rank's own gate: each P
    rank binds the handle to the first consumer that claims it there."""
    return {"p_tp": len(peers), "kv_heads": kv_heads, "layers": list(layers),
            "ranks": [{"engine": p.engine, "epoch": p.epoch, "host": p.host,
                       "port": p.port, "generations": mirrors.gens(r, blocks),
                       "capability": _rank_capability(p, handle)}
                      for r, p in sorted(peers.items())]}


@dataclass(frozen=True)
class RankParams:
    """D's view of the per-rank params: P's TP size, KV heads, layers per group, and
    one ``RemoteParams`` per P rank (rank 0's handle, blocks and term, its own engine,
    epoch, address and generations)."""

    p_tp: int
    kv_heads: int
    layers: tuple[int, ...]
    ranks: tuple[RemoteParams, ...]


def parse_ranks(d: Any, base: RemoteParams) -> RankParams | None:
    """Validate the ``RANKS_KEY`` value of a D request's params (client input); None when
    absent (P runs TP 1). Raises ParamsError."""
    if d is None:
        return None
    if not isinstance(d, Mapping):
        raise ParamsError("bad_params", f"{RANKS_KEY} must be a mapping")
    p_tp, heads, layers, ranks = d.get("p_tp"), d.get("kv_heads"), d.get("layers"), \
        d.get("ranks")
    for name, v in (("p_tp", p_tp), ("kv_heads", heads)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TP:
            raise ParamsError("bad_params", f"{RANKS_KEY}.{name} must be in 1..{MAX_TP}")
    if not isinstance(layers, list) or not 1 <= len(layers) <= 64 or any(
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LAYERS
            for n in layers):
        raise ParamsError("bad_params", f"{RANKS_KEY}.layers must list layer counts")
    if not isinstance(ranks, list) or len(ranks) != p_tp:
        raise ParamsError("bad_params", f"{RANKS_KEY}.ranks must list p_tp ranks")
    out: list[RemoteParams] = []
    for i, r in enumerate(ranks):
        if not isinstance(r, Mapping):
            raise ParamsError("bad_params", f"{RANKS_KEY}.ranks[{i}] must be a mapping")
        engine, host, port, epoch, gens = (r.get(k) for k in (
            "engine", "host", "port", "epoch", "generations"))
        if not isinstance(engine, str) or not engine or len(engine) > MAX_NAME \
                or not isinstance(host, str) or not host or len(host) > MAX_NAME:
            raise ParamsError("bad_params", f"{RANKS_KEY}.ranks[{i}]: engine and host "
                                            "must be names")
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535 \
                or isinstance(epoch, bool) or not isinstance(epoch, int) \
                or not 0 <= epoch < 1 << 32:
            raise ParamsError("bad_params", f"{RANKS_KEY}.ranks[{i}]: bad port or epoch")
        if not isinstance(gens, list) or len(gens) != len(base.params.blocks) or any(
                isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < 1 << 62
                for g in gens):
            raise ParamsError("bad_params", f"{RANKS_KEY}.ranks[{i}]: one generation per "
                                            "block")
        cap = r.get("capability", "")
        if not isinstance(cap, str) or len(cap) > 64 \
                or any(ch not in "0123456789abcdef" for ch in cap):
            raise ParamsError("bad_params", f"{RANKS_KEY}.ranks[{i}]: capability must be "
                                            "at most 64 lowercase hex digits")
        tp = TransferParams(engine=engine, epoch=epoch, handle=base.params.handle,
                            blocks=base.params.blocks,
                            initial_term=base.params.initial_term,
                            expected=base.params.expected, group=base.params.group,
                            generations=tuple(gens), capability=cap)
        out.append(RemoteParams(tp, host, port, base.num_tokens))
    n_tp, n_heads = int(p_tp or 0), int(heads or 0)  # checked above
    try:
        Topology(n_tp, 1, n_heads)
    except TopologyError as e:
        raise ParamsError("bad_params", f"{RANKS_KEY}: {e}") from None
    return RankParams(n_tp, n_heads, tuple(layers), tuple(out))


class TopologyUnsupported(UsageError, ValueError):
    """A plan this version cannot pull (head slices: P and D TP sizes differ)."""


def rank_params(rp: RemoteParams, ranks: RankParams | None, p_rank: int) -> RemoteParams:
    """The params of P rank ``p_rank`` (P rank 0's plain params when P runs TP 1). P rank
    0's entry takes the capability the scheduler minted for rank 0's params."""
    if ranks is None:
        return rp
    out = ranks.ranks[p_rank]
    if out.params.engine == rp.params.engine and out.params.epoch == rp.params.epoch:
        out = RemoteParams(replace(out.params, capability=rp.params.capability), out.host,
                           out.port, out.num_tokens)
    return out


def d_params(rp: RemoteParams, ranks: RankParams | None, d_rank: int, d_tp: int,
             kv_heads: int, *, slices: bool = False) -> RemoteParams:
    """The params D rank ``d_rank`` of ``d_tp`` pulls with when one P rank fills its
    block (``plan_source``). Raises TopologyUnsupported (several P ranks: see
    ``plan_parts``) or ParamsError."""
    src, _ = plan_source(ranks, d_rank, d_tp, kv_heads, slices=slices)
    return rank_params(rp, ranks, src)


HeadSlice = tuple[int, int, int]  # (KV heads per block, first head, heads)


@dataclass(frozen=True)
class PartPlan:
    """One P rank a D rank reads (one part of its requests): ``remote``, the head slice
    of P's blocks it reads (None: whole blocks); ``local``, the head slice of D's blocks
    they land in (None: whole blocks)."""

    p_rank: int
    remote: HeadSlice | None
    local: HeadSlice | None


def plan_parts(ranks: RankParams | None, d_rank: int, d_tp: int, kv_heads: int, *,
               slices: bool = False) -> tuple[PartPlan, ...]:
    """D rank ``d_rank``'s parts: one per P rank of ``Topology.sources`` (in head order).
    Whole blocks on both sides when a P rank and D hold the same heads (equal TP sizes,
    or KV heads replicated on both sides); with ``slices`` (heads outermost within a
    block on both sides), a head slice of P's blocks (P TP 1 -> D TP 2 with split heads)
    and/or of D's (P TP 2 -> D TP 1 with split heads: each P rank's whole blocks land in
    the heads of D's block that rank holds). A plan that needs a slice without
    ``slices`` raises TopologyUnsupported; P's KV heads other than D's raise
    ParamsError."""
    p_tp = ranks.p_tp if ranks is not None else 1
    if ranks is not None and ranks.kv_heads != kv_heads:
        raise ParamsError("bad_params", f"P has {ranks.kv_heads} KV heads, D {kv_heads}")
    try:
        top = Topology(p_tp, d_tp, kv_heads)
        srcs = top.sources(d_rank)
    except TopologyError as e:
        raise ParamsError("bad_params", str(e)) from None
    p_heads, d_heads = top.local_heads("P"), top.local_heads("D")
    out = []
    for s in srcs:
        remote = None if s.heads == p_heads else (p_heads, s.p_head, s.heads)
        local = None if s.heads == d_heads else (d_heads, s.d_head, s.heads)
        if (remote is not None or local is not None) and not slices:
            raise TopologyUnsupported(f"P TP {p_tp} -> D TP {d_tp} with {kv_heads} KV "
                                      "heads: head slices")
        out.append(PartPlan(s.p_rank, remote, local))
    return tuple(out)


def plan_source(ranks: RankParams | None, d_rank: int, d_tp: int, kv_heads: int, *,
                slices: bool = False) -> tuple[int, HeadSlice | None]:
    """The one P rank D rank ``d_rank`` reads, and the head slice of P's blocks it reads
    (None: whole blocks), for plans where one P rank fills D's whole block (see
    ``plan_parts``). A plan whose D block needs several P ranks raises
    TopologyUnsupported here (``plan_parts`` gives its parts)."""
    parts = plan_parts(ranks, d_rank, d_tp, kv_heads, slices=slices)
    if len(parts) != 1 or parts[0].local is not None:
        p_tp = ranks.p_tp if ranks is not None else 1
        raise TopologyUnsupported(f"P TP {p_tp} -> D TP {d_tp} with {kv_heads} KV heads: "
                                  "D's block needs several P ranks")
    return parts[0].p_rank, parts[0].remote


def rank_admit(ad: AdmitOrder, d_rank: int, d_tp: int, kv_heads: int) -> AdmitOrder:
    """D rank ``d_rank``'s admit order: the one of the P rank it pulls from. Raises
    TopologyUnsupported or ParamsError (the request then ends before any READ)."""
    base = RemoteParams(ad.params, ad.host, ad.port, 1)
    rp = d_params(base, parse_ranks(ad.ranks, base), d_rank, d_tp, kv_heads)
    return AdmitOrder(ad.request_id, rp.params, rp.host, rp.port)
