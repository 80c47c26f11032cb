"""What ``kvproto bench vllm``'s offline path (``kvproto.bench.vllm``) and its server path
(``kvproto.bench.vllm_serve``) share: the per-connector figures, the report, the
topologies and how a refused topology is reported."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONNECTORS = ("stock", "kvproto")
MAX_TP = 8          # the largest tensor parallel size --p-tp/--d-tp take


@dataclass
class ConnectorRun:
    """Raw figures of one connector, before the report is built."""

    requests: int = 0
    wrong: int = 0
    errors: int = 0
    late_requests: int = 0
    late_wrong: int = 0
    late_errors: int = 0
    round_tok_s: list[float] = field(default_factory=list)
    round_cpu_ms_per_tok: list[float] = field(default_factory=list)
    idle_cpu_pct: float = 0.0
    ttft_ms: list[float] = field(default_factory=list)
    stranded_block_seconds: float = 0.0
    stranded_freed: bool = True
    seconds_to_free: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)   # kvproto's own, per side
    failed: str = ""      # why this connector's pair did not run (one line), else empty
    refused: int = 0      # requests D refused before any READ (topology), recomputed
    pulled: int | None = None   # requests D served from pulled KV, where counted


def build_report(runs: dict[str, ConnectorRun], *, meta: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The JSON object: one entry per connector and ``throughput_ratio`` (kvproto/stock:
    the median of the per-round ratios of the alternating rounds, as ``bench transfer``
    computes its ``ratio``, so that load drifting between rounds cancels;
    ``throughput_ratio_of_medians`` is the ratio of the two median throughputs)."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        out[name] = {
            "requests": r.requests + r.late_requests,
            "wrong_outputs": r.wrong + r.late_wrong,
            "errors": r.errors + r.late_errors,
            "late_d": {"requests": r.late_requests, "wrong_outputs": r.late_wrong,
                       "errors": r.late_errors},
            "throughput_tok_s": round(statistics.median(r.round_tok_s), 1)
            if r.round_tok_s else 0.0,
            "throughput_rounds_tok_s": [round(x, 1) for x in r.round_tok_s],
            "idle_cpu_pct": round(r.idle_cpu_pct, 1),
            "cpu_ms_per_token": round(statistics.median(r.round_cpu_ms_per_tok), 3)
            if r.round_cpu_ms_per_tok else None,
            "ttft_ms_mean": round(statistics.fmean(r.ttft_ms), 2) if r.ttft_ms else 0.0,
            "stranded_block_seconds": round(r.stranded_block_seconds, 2),
            "stranded_all_freed": r.stranded_freed,
            "seconds_to_free_after_d_kill": round(r.seconds_to_free, 2),
        }
        if r.counters:
            out[name]["connector_counters"] = r.counters
        if r.failed:
            out[name]["failed"] = r.failed
        if r.refused:
            out[name]["refused_requests"] = r.refused
        if r.pulled is not None:
            out[name]["pulled_requests"] = r.pulled
    s, k = runs.get("stock"), runs.get("kvproto")
    ratio = None
    paired = None
    if s and k and s.round_tok_s and k.round_tok_s:
        sm, km = statistics.median(s.round_tok_s), statistics.median(k.round_tok_s)
        ratio = round(km / sm, 4) if sm > 0 else None
        pairs = [b / a for a, b in zip(s.round_tok_s, k.round_tok_s, strict=False) if a > 0]
        paired = round(statistics.median(pairs), 4) if pairs else None
    out["throughput_ratio"] = paired
    out["throughput_ratio_of_medians"] = ratio
    cpu = None
    if s and k and s.round_cpu_ms_per_tok and k.round_cpu_ms_per_tok:
        km = statistics.median(k.round_cpu_ms_per_tok)
        cpu = round(statistics.median(s.round_cpu_ms_per_tok) / km, 4) if km > 0 else None
    out["cpu_efficiency_ratio"] = cpu
    if meta:
        out.update(meta)
    return out


def topologies(p_tp: str, d_tp: str) -> list[tuple[int, int]]:
    """Every (P TP, D TP) pair of the two comma-separated lists, in order. Raises
    ValueError with one line for a size that is not an integer in 1..MAX_TP."""
    sizes = []
    for flag, text in (("--p-tp", p_tp), ("--d-tp", d_tp)):
        got = []
        for part in text.split(","):
            part = part.strip()
            if not part.isdigit() or not 1 <= int(part) <= MAX_TP:
                raise ValueError(f"{flag} takes sizes 1..{MAX_TP} separated by commas, "
                                 f"got {text[:40]!r}")
            if int(part) not in got:
                got.append(int(part))
        sizes.append(got)
    return [(p, d) for p in sizes[0] for d in sizes[1]]


def topology_tag(p_tp: int, d_tp: int) -> str:
    return "" if (p_tp, d_tp) == (1, 1) else f"-p{p_tp}d{d_tp}"


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


# The line kvproto's D worker logs for a request it ends before any READ (a topology
# it does not serve, bad params): "kvproto: request <id>: <why>; <outcome>"
_REFUSED_LINE = re.compile(r"kvproto: request (\S+): (.+?); ")


WARM = "warm-"   # request ids of the uncounted warm-up requests contain this


def refused_in_log(path: Path) -> tuple[int, str]:
    """(requests D's log shows ended before any READ, the first reason given; warm-up
    requests not counted); what the bench reads where D's worker counters live in other
    processes (TP > 1, servers)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return 0, ""
    found = [(rid, why) for rid, why in _REFUSED_LINE.findall(text) if WARM not in rid]
    return len({rid for rid, _ in found}), (found[0][1][:200] if found else "")


def refusal_note(run: ConnectorRun, p_tp: int, d_tp: int, why: str = "") -> str | None:
    """What the report says when kvproto's D refused requests of this topology before
    any READ and recomputed them instead of pulling."""
    if not run.refused:
        return None
    return (f"kvproto refused P TP {p_tp} -> D TP {d_tp}: D ended {run.refused} "
            f"request(s) before any READ{f' ({why})' if why else ''} and recomputed "
            f"them; its figures are those of local prefill")


@dataclass
class Workload:
    model: str
    rounds: list[dict[str, list[int]]]
    late: dict[str, list[int]]
    kill: dict[str, list[int]]
    reference: dict[str, list[int]] = field(default_factory=dict)
