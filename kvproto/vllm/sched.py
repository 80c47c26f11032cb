"""Scheduler-side bookkeeping of the kvproto vLLM connector, and input validation.

No vLLM import here: the connector (``kvproto.vllm.connector``) feeds these classes from
vLLM's hooks, and tests drive them directly. Nothing here decides a block's lifecycle:
``PScheduler`` mints handles and snapshots generation stamps for the transfer params and
queues the registration for P's worker, where the ``Ledger`` lives; ``DScheduler`` queues
admissions, loads and aborts for D's worker, where the ``Consumer`` lives. See the design
notes at the top of ``kvproto/vllm/connector.py`` and spec/VLLM.md.

Every structure here is bounded by the number of requests vLLM itself holds (entries are
removed when vLLM reports the request finished), except the stamp mirror, which has one
entry per KV block.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import PurePath
from typing import Any

from kvproto.errors import RemoteInputError
from kvproto.lifecycle import Config, ConfigError, TransferParams
from kvproto.lifecycle.gate import capability
from kvproto.vllm.groups import HIT, MAX_GROUPS, NEW, plan_load, single_layout, split_p_blocks

log = logging.getLogger(__name__)

PARAMS_KEY = "kvproto"  # kv_transfer_params[PARAMS_KEY] holds TransferParams.to_dict()
MAX_PARAM_BLOCKS = 1 << 20  # a client's transfer params may name at most this many blocks
MAX_NAME = 256  # engine names and group names, characters
# P's NIXL progress thread sleeps this long between passes (0: NIXL's own busy loop, about
# one core). Off by default: on a CPU-starved host (a loaded 2-core machine, TP 2 engines)
# a sleeping progress thread delayed NIXL's first contacts (handshake, first claims)
# past a 3 s lease, and the first requests recomputed instead of pulling; a positive
# value trades that for an idle core (bench idle --path server)
PROGRESS_DELAY_US = 0
# P's idle wait (idle_wait_ms): an engine step that exists only because blocks are held
# waits up to this long in the connector; a request arriving then is scheduled at most
# this much later
IDLE_WAIT_MS = 20.0
# The workers' poller (poll_gap_ms): when the engine thread has not polled the adapter for
# this long (a long forward pass, an engine loop short of CPU), a thread of the worker polls
# it, so that P answers heartbeats, claims and dones and runs its expiries, and D sends its
# heartbeats and claims and posts its ordered READs, between steps
POLL_GAP_MS = 50.0
# vLLM's n>1 children are named "<index>_<parent id>" (vllm/v1/engine/parallel_sampling).
_CHILD_ID = re.compile(r"^(\d+)_(.+)$")

ROLES = ("producer", "consumer", "both")
_KV_ROLE = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}

# kv_connector_extra_config keys and what they are (README "Use with vLLM").
EXTRA_KEYS: dict[str, str] = {
    "role": "producer | consumer | both (default: from kv_role)",
    "lease": "lifecycle Config fields (initial_lease, lease_extension, heartbeat_interval, "
             "abort_grace, max_delay, max_read_time, clock_drift, ...), seconds",
    "checksums": "block checksums: P computes one per block at register (CRC-32 in DRAM, "
                 "wsum32 on the GPU), D verifies "
                 "each block it read before vLLM sees it; a mismatch fails the load "
                 "(recompute or error per kv_load_failure_policy). Both sides must agree "
                 "(false; same as lease.checksums)",
    "handshake_host": "address P's handshake listener binds and advertises (127.0.0.1)",
    "handshake_port": "P's handshake port (0: ephemeral; data-parallel rank r uses port + r)",
    "expected_readers": "decode ranks that pull each request from one P rank (1)",
    "journal": "path of P's event journal (JSON lines, `kvproto validate`); none by default",
    "journal_flush_every": "journal lines per flush (1)",
    "handshake_timeout": "D: seconds per handshake attempt (2.0)",
    "handshake_attempts": "D: attempts before a handshake fails (4)",
    "group_siblings": "P: register vLLM's n>1 children as one sibling group (true)",
    "metrics_port": "serve kvproto's own Prometheus metrics (kvproto.metrics, P and D) on "
                    "127.0.0.1:<port> from the worker (0: any free port; data-parallel rank "
                    "r uses port + r; default: off)",
    "progress_thread": "P: NIXL progress thread, so that D's READs complete while P's "
                       "engine is idle (true)",
    "progress_delay_us": "P: the NIXL progress thread sleeps this many microseconds between "
                         "its passes instead of busy-polling a core (0: NIXL's busy loop; "
                         f"default {PROGRESS_DELAY_US})",
    "poll_gap_ms": "P and D: when the engine thread has not polled for this many "
                   "milliseconds (a long forward pass, an engine short of CPU), a worker "
                   "thread polls: P answers heartbeats, claims and dones and runs its "
                   "expiries, D (while it has requests in flight) heartbeats, claims and "
                   "posts ordered READs, between steps (0: only the engine thread polls; "
                   f"default {POLL_GAP_MS:g})",
    "idle_wait_ms": "P: while the engine steps only because it holds blocks (nothing "
                    "scheduled, no D work), each step waits up to this many milliseconds "
                    "for a message or the next lease deadline instead of spinning; a new "
                    "request arriving then waits at most this long (0: off; default "
                    f"{IDLE_WAIT_MS:g}, see spec/VLLM.md)",
    "model_revision": "a string naming the weights (e.g. a commit or release tag); replaces "
                      "the start-up fingerprint of the weight files in the handshake's model "
                      "identity (default: fingerprint)",
    "test_read_stall_s": "TEST ONLY. D: block this many seconds between the data READ and "
                         "the stamp READ (0)",
    "test_stall_post_s": "TEST ONLY. D: block this many seconds just before posting each "
                         "data READ, after P granted its claim (0)",
    "test_delay_load_s": "TEST ONLY. D: start each READ this many seconds after vLLM "
                         "allocated its blocks (0)",
    "test_faults": "TEST ONLY. D: a seeded fault shim on D's notifications to P, "
                   "{seed, drop, dup, delay} (probabilities; default off)",
    "test_hold_read_s": "TEST ONLY. D: each data READ reports in progress for this many "
                        "seconds after its post, a READ that does not complete (0)",
}


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's options, parsed from ``kv_connector_extra_config``."""

    role: str = "both"
    config: Config = field(default_factory=Config)
    handshake_host: str = "127.0.0.1"
    handshake_port: int = 0
    expected_readers: int = 1
    journal: str | None = None
    journal_flush_every: int = 1
    handshake_timeout: float = 2.0
    handshake_attempts: int = 4
    group_siblings: bool = True
    progress_thread: bool = True
    progress_delay_us: int = PROGRESS_DELAY_US
    idle_wait_ms: float = IDLE_WAIT_MS
    poll_gap_ms: float = POLL_GAP_MS
    metrics_port: int | None = None
    model_revision: str | None = None
    test_read_stall_s: float = 0.0
    test_stall_post_s: float = 0.0
    test_delay_load_s: float = 0.0
    test_faults: Mapping[str, Any] | None = None
    test_hold_read_s: float = 0.0

    @property
    def producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, kv_role: str | None = None
              ) -> ConnectorOptions:
        """Raise ValueError with one clear line on an unknown key or a bad value."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kvproto: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(EXTRA_KEYS)})")
        role = extra.get("role", _KV_ROLE.get(kv_role or "", "both"))
        if role not in ROLES:
            raise ValueError(f"kvproto: role must be one of {ROLES}, got {role!r}")
        try:
            config = Config.from_dict(dict(extra.get("lease") or {}))
        except (ConfigError, TypeError, ValueError) as e:
            raise ValueError(f"kvproto: bad lease config: {e}") from None
        checksums = extra.get("checksums", False)
        if not isinstance(checksums, bool):
            raise ValueError(f"kvproto: checksums must be true or false, got {checksums!r}")
        if checksums:
            config = replace(config, checksums=True)

        def num(key: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
            v = extra.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not lo <= v <= hi or (integer and int(v) != v):
                raise ValueError(f"kvproto: {key} must be a number within [{lo}, {hi}]"
                                 f"{' (integer)' if integer else ''}, got {v!r}")
            return int(v) if integer else float(v)

        host = extra.get("handshake_host", "127.0.0.1")
        if not isinstance(host, str) or not host or len(host) > MAX_NAME:
            raise ValueError(f"kvproto: handshake_host must be a host name, got {host!r}")
        journal = extra.get("journal")
        if journal is not None and (not isinstance(journal, str) or not journal):
            raise ValueError(f"kvproto: journal must be a path, got {journal!r}")
        group = extra.get("group_siblings", True)
        if not isinstance(group, bool):
            raise ValueError(f"kvproto: group_siblings must be true or false, got {group!r}")
        prog = extra.get("progress_thread", True)
        if not isinstance(prog, bool):
            raise ValueError(f"kvproto: progress_thread must be true or false, got {prog!r}")
        revision = extra.get("model_revision")
        if revision is not None and (not isinstance(revision, str) or not revision
                                     or len(revision) > MAX_NAME):
            raise ValueError(f"kvproto: model_revision must be a non-empty string of at most "
                             f"{MAX_NAME} characters, got {str(revision)[:40]!r}")
        gap = num("poll_gap_ms", POLL_GAP_MS, 0.0, 60_000.0)
        if 0 < gap < 1:
            raise ValueError(f"kvproto: poll_gap_ms must be 0 (off) or at least 1, got {gap!r}")
        faults = extra.get("test_faults")
        if faults is not None:
            from kvproto.nixl.faults import FaultConfigError, FaultRates

            try:
                FaultRates.parse(faults)
            except FaultConfigError as e:
                raise ValueError(f"kvproto: {e}") from None
        return cls(role=role, config=config, handshake_host=host,
                   handshake_port=num("handshake_port", 0, 0, 65535, True),
                   expected_readers=num("expected_readers", 1, 1, 0xFFFF, True),
                   journal=journal,
                   journal_flush_every=num("journal_flush_every", 1, 1, 1 << 20, True),
                   handshake_timeout=num("handshake_timeout", 2.0, 0.01, 3600),
                   handshake_attempts=num("handshake_attempts", 4, 1, 1000, True),
                   group_siblings=group, progress_thread=prog,
                   progress_delay_us=num("progress_delay_us", PROGRESS_DELAY_US, 0, 100_000,
                                         True),
                   idle_wait_ms=num("idle_wait_ms", IDLE_WAIT_MS, 0.0, 1000.0),
                   poll_gap_ms=gap,
                   metrics_port=None if extra.get("metrics_port") is None
                   else num("metrics_port", 0, 0, 65535, True),
                   model_revision=revision,
                   test_read_stall_s=num("test_read_stall_s", 0.0, 0.0, 3600),
                   test_stall_post_s=num("test_stall_post_s", 0.0, 0.0, 3600),
                   test_delay_load_s=num("test_delay_load_s", 0.0, 0.0, 3600),
                   test_faults=dict(faults) if faults else None,
                   test_hold_read_s=num("test_hold_read_s", 0.0, 0.0, 3600))

    def for_dp_rank(self, rank: int) -> ConnectorOptions:
        """The options of data-parallel rank ``rank``: every rank is its own engine with
        its own worker on the same host, so a fixed port becomes port + rank (0 stays 0,
        any free port) and a journal path gains ``.dp<rank>`` before its suffix (rank 0
        keeps the given names). Raise ValueError with one line when a port overflows."""
        if rank == 0:
            return self

        def shifted(key: str, v: int | None) -> int | None:
            if not v:
                return v
            if v + rank > 65535:
                raise ValueError(f"kvproto: {key} {v} + data-parallel rank {rank} exceeds "
                                 "65535")
            return v + rank

        handshake_port = shifted("handshake_port", self.handshake_port)
        assert handshake_port is not None
        journal = self.journal
        if journal is not None:
            j = PurePath(journal)
            journal = str(j.with_name(f"{j.stem}.dp{rank}{j.suffix}"))
        return replace(self, handshake_port=handshake_port,
                       metrics_port=shifted("metrics_port", self.metrics_port), journal=journal)


class ParamsError(RemoteInputError, ValueError):
    """Malformed ``kv_transfer_params`` from a client: a counted, logged rejection."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RemoteParams:
    """What D needs to pull one request: P's transfer params and where P handshakes."""

    params: TransferParams
    host: str
    port: int
    num_tokens: int  # tokens whose KV P holds in ``params.blocks``
    # Per KV cache group ``(skip, count)`` (kvproto.vllm.groups); None: one group.
    layout: tuple[tuple[int, int], ...] | None = None
    block_size: int | None = None  # P's block size (tokens); None: not given
    # P's wall clock (Unix ms) when it issued the params; None: not given. A diagnostic
    # only (the delivery delay D observes, ``DScheduler``), never an input to a decision.
    issued_ms: int | None = None

    def groups(self) -> list[list[int]]:
        if self.layout is None:
            return single_layout(len(self.params.blocks))
        return [list(g) for g in self.layout]


def encode_remote_params(tp: TransferParams, host: str, port: int, num_tokens: int,
                         extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``kv_transfer_params`` P's request returns (D's request takes them unchanged);
    ``extra``: ``groups`` and ``block_size`` (kvproto.vllm.groups)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            PARAMS_KEY: {**tp.to_dict(), "host": host, "port": port,
                         "num_tokens": num_tokens, **(extra or {})}}


def _int(d: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ParamsError("bad_params", f"{key} must be an integer within [{lo}, {hi}], "
                                        f"got {str(v)[:40]!r}")
    return v


def parse_remote_params(kv_params: Any, *, max_blocks: int = MAX_PARAM_BLOCKS) -> RemoteParams:
    """Validate a D request's ``kv_transfer_params`` (client input: never trusted)."""
    if not isinstance(kv_params, Mapping):
        raise ParamsError("bad_params", f"kv_transfer_params is a {type(kv_params).__name__}")
    d = kv_params.get(PARAMS_KEY)
    if not isinstance(d, Mapping):
        raise ParamsError("bad_params", f"kv_transfer_params lacks a {PARAMS_KEY!r} mapping")
    engine = d.get("engine")
    if not isinstance(engine, str) or not engine or len(engine) > MAX_NAME:
        raise ParamsError("bad_params", "engine must be a non-empty name")
    host = d.get("host")
    if not isinstance(host, str) or not host or len(host) > MAX_NAME:
        raise ParamsError("bad_params", "host must be a non-empty name")
    port = _int(d, "port", 1, 65535)
    epoch = _int(d, "epoch", 0, (1 << 32) - 1)
    handle = _int(d, "handle", 0, (1 << 63) - 1)
    expected = _int(d, "expected", 1, 0xFFFF)
    num_tokens = _int(d, "num_tokens", 1, 1 << 40)
    blocks, gens = d.get("blocks"), d.get("generations")
    if not isinstance(blocks, list) or not isinstance(gens, list) or not blocks:
        raise ParamsError("bad_params", "blocks and generations must be non-empty lists")
    if len(blocks) > max_blocks or len(gens) != len(blocks):
        raise ParamsError("bad_params", f"{len(blocks)} blocks, {len(gens)} generations "
                                        f"(at most {max_blocks}, one generation per block)")
    for v in (*blocks, *gens):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62:
            raise ParamsError("bad_params", "block ids and generations must be integers >= 0")
    term = _int(d, "initial_term", 1, 0xFFFFFFFF)  # ms, as the machines count time
    group = d.get("group")
    if group is not None and (not isinstance(group, str) or len(group) > MAX_NAME):
        raise ParamsError("bad_params", "group must be a name or null")
    cap = d.get("capability", "")
    if not isinstance(cap, str) or len(cap) > 64 or any(c not in "0123456789abcdef" for c in cap):
        raise ParamsError("bad_params", "capability must be at most 64 lowercase hex digits")
    tp = TransferParams(engine=engine, epoch=epoch, handle=handle, blocks=tuple(blocks),
                        initial_term=term, expected=expected, group=group,
                        generations=tuple(gens), capability=cap)
    block_size = None if d.get("block_size") is None else _int(d, "block_size", 1, 1 << 20)
    issued = None if d.get("issued_ms") is None else _int(d, "issued_ms", 0, 1 << 53)
    layout = _layout(d.get("groups"), len(blocks))
    return RemoteParams(tp, host, port, num_tokens, layout, block_size, issued)


def _layout(v: Any, nblocks: int) -> tuple[tuple[int, int], ...] | None:
    """The params' per-group ``[[skip, count], ...]`` (None when absent); the counts
    must add up to the params' blocks."""
    if v is None:
        return None
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_GROUPS:
        raise ParamsError("bad_params", f"groups must be a list of 1..{MAX_GROUPS} pairs")
    out = []
    for g in v:
        if not isinstance(g, list) or len(g) != 2 or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x <= MAX_PARAM_BLOCKS
                for x in g):
            raise ParamsError("bad_params", "each group must be [skip, count], integers >= 0")
        out.append((g[0], g[1]))
    if sum(c for _, c in out) != nblocks:
        raise ParamsError("bad_params", f"groups count {sum(c for _, c in out)} blocks, "
                                        f"the params carry {nblocks}")
    return tuple(out)


def sibling_group(request_id: str, kv_params: Mapping[str, Any] | None, auto: bool
                  ) -> str | None:
    """P: the sibling group of a request. An explicit ``kv_transfer_params["group"]``
    wins; with ``auto``, vLLM's n>1 children ("<i>_<parent>") share their parent's.
    A wrong grouping is safe: it can only free P's blocks early, which D's generation
    check then fences (recompute), never serve."""
    g = (kv_params or {}).get("group")
    if isinstance(g, str) and g and len(g) <= MAX_NAME:
        return g
    if auto:
        m = _CHILD_ID.match(request_id)
        if m is not None:
            return "n>1:" + m.group(2)[:MAX_NAME]
    return None


# ---------------------------------------------------------------------------
# Orders from the scheduler to the worker (carried by the connector metadata).
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RegisterOrder:
    """P: hand ``blocks`` of ``request_id`` to the worker's Ledger under ``handle``."""

    request_id: str
    handle: int
    blocks: tuple[int, ...]
    group: str | None
    expected: int
    generations: tuple[int, ...]  # the scheduler's snapshot, given to D
    # The readiness mark: every prompt token's KV was computed by a forward pass that
    # completed (never an earlier chunk of a chunked prefill). P's gate refuses a
    # register without it.
    ready: bool = False
    tokens: int = 0  # the prompt tokens whose KV the blocks hold (held-tokens gauge)


@dataclass(frozen=True)
class AdmitOrder:
    """D: admit ``request_id`` into the worker's Consumer (heartbeats start)."""

    request_id: str
    params: TransferParams
    host: str
    port: int
    # The per-rank params as the client sent them (kvproto.vllm.topology.RANKS_KEY),
    # validated by each D rank (kvproto.vllm.topology.rank_admit); None: P runs TP 1.
    ranks: Any = None
    # How long the params took from P's issue to D's admit (ms, the two wall clocks; None:
    # P gave no issue time), and whether that is beyond max_delay: a diagnostic for the
    # worker's metrics, never an input to a decision.
    delay_ms: int | None = None
    late: bool = False


@dataclass(frozen=True)
class LoadOrder:
    """D: READ the request's KV into ``local_blocks`` (vLLM allocated them); with
    ``fail`` the load fails at once (its remote KV is lost: policy "fail")."""

    request_id: str
    local_blocks: tuple[int, ...]
    fail: bool = False
    # Indices into P's params blocks, one per local block; None: the last
    # ``len(local_blocks)`` of them (one group, D holding a prefix locally).
    remote: tuple[int, ...] | None = None


@dataclass
class Orders:
    registers: list[RegisterOrder] = field(default_factory=list)
    admits: list[AdmitOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # D: abort (release) these requests

    def __bool__(self) -> bool:
        return bool(self.registers or self.admits or self.loads or self.aborts)


@dataclass(frozen=True)
class PeerInfo:
    """P's worker, as its handshake metadata tells the scheduler."""

    engine: str
    epoch: int
    host: str
    port: int
    cap_key: bytes = b""  # the worker gate's capability key (same engine, never sent out)


class PScheduler:
    """P's scheduler side: handles, stamp snapshots, register orders.

    The stamp mirror holds, per block, the newest generation P's worker reported (worker
    metadata, processed by vLLM before the ``finished_sending`` of the same step frees
    any block). It never runs ahead of the worker's stamp tensor, so a stale snapshot can
    only make D's stamp check fail (recompute), never pass wrongly."""

    def __init__(self, options: ConnectorOptions, num_blocks: int) -> None:
        self.options = options
        self.num_blocks = num_blocks
        self.mirror = [0] * num_blocks
        self.peer: PeerInfo | None = None
        self._next_handle = 1
        self._orders: list[RegisterOrder] = []
        self.held: dict[str, int] = {}  # request id -> handle, until finished_sending
        self.counters: dict[str, int] = {}
        self.wall = time.time  # the params' issue time (a diagnostic for D: issued_ms)

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def set_peer(self, peer: PeerInfo) -> None:
        self.peer = peer

    def finished(self, request_id: str, blocks: list[int], num_tokens: int,
                 kv_params: Mapping[str, Any] | None,
                 extra: Mapping[str, Any] | None = None, *,
                 ready: bool = False) -> dict[str, Any] | None:
        """A prefill for remote decode finished: return D's transfer params and queue the
        registration, or None (vLLM then frees the blocks at once). ``blocks``: every KV
        cache group's real blocks (the ledger holds and stamps them all); ``extra``: the
        params' ``groups`` and ``block_size`` (kvproto.vllm.groups); ``ready``: the
        readiness mark the register order carries (see ``RegisterOrder``)."""
        if self.peer is None:
            self._count("no_worker_metadata")
            log.error("kvproto: P request %s finished before the worker's handshake "
                      "metadata arrived; served without remote decode", request_id)
            return None
        if not blocks or any(not 0 <= b < self.num_blocks for b in blocks):
            self._count("bad_blocks")
            log.error("kvproto: P request %s has no or invalid blocks %s", request_id,
                      blocks[:8])
            return None
        if request_id in self.held:
            self._count("duplicate_finish")
            return None
        handle = self._next_handle
        self._next_handle += 1
        gens = tuple(self.mirror[b] for b in blocks)
        group = sibling_group(request_id, kv_params, self.options.group_siblings)
        expected = self.options.expected_readers
        self._orders.append(RegisterOrder(request_id, handle, tuple(blocks), group, expected,
                                          gens, ready, num_tokens))
        self.held[request_id] = handle
        cap = capability(self.peer.cap_key, self.peer.engine, self.peer.epoch, handle) \
            if len(self.peer.cap_key) >= 16 else ""
        tp = TransferParams(engine=self.peer.engine, epoch=self.peer.epoch, handle=handle,
                            blocks=tuple(blocks),
                            initial_term=self.options.config.ms.initial_lease,
                            expected=expected, group=group, generations=gens,
                            capability=cap)
        return encode_remote_params(tp, self.peer.host, self.peer.port, num_tokens,
                                    {**(extra or {}), "issued_ms": int(self.wall() * 1000)})

    def finished_groups(self, request_id: str, block_ids: Sequence[Sequence[int]],
                        num_tokens: int, kv_params: Mapping[str, Any] | None,
                        block_size: int, *, ready: bool = False) -> dict[str, Any] | None:
        """``finished`` for every KV cache group's block list (vLLM's
        ``request_finished_all_groups``): the real blocks of all groups are held, and the
        params carry the groups' layout and P's block size (kvproto.vllm.groups)."""
        split = split_p_blocks(block_ids)
        if isinstance(split, str):
            self._count("bad_blocks")
            log.error("kvproto: P request %s: block lists not transferable (%s); served "
                      "without remote decode", request_id, split)
            return None
        flat, layout = split
        return self.finished(request_id, flat, num_tokens, kv_params,
                             {"block_size": block_size, "groups": layout}, ready=ready)

    def drain(self) -> list[RegisterOrder]:
        out, self._orders = self._orders, []
        return out

    def on_stamps(self, stamps: Mapping[int, int]) -> None:
        """The worker bumped these blocks' stamps (before reporting their frees)."""
        m = self.mirror
        for b, g in stamps.items():
            if 0 <= b < self.num_blocks and g > m[b]:
                m[b] = g

    def on_finished_sending(self, request_ids: set[str] | frozenset[str]) -> None:
        for rid in request_ids:
            self.held.pop(rid, None)


# D request states on the scheduler side.
S_ADMITTED = "admitted"  # admit order sent; no blocks yet
S_LOADING = "loading"  # load order sent; vLLM waits for finished_recving
S_LOCAL = "local"  # nothing to pull (a full local prefix hit, or a duplicate of P's handle)
S_FAILED = "failed"  # P's KV cannot be loaded; policy "fail": a load that fails at once

LOAD_FAILURE_POLICIES = ("fail", "recompute")  # vLLM's kv_load_failure_policy values


class DScheduler:
    """D's scheduler side: which requests pull remote KV, and the orders for the worker.

    ``load_failure_policy`` is vLLM's ``kv_load_failure_policy``. A request whose remote
    KV cannot be loaded (params rejected, P's prompt length differs, or the worker's
    machine ended it before a load: handshake failed, lease lost, P lost) prefills
    locally under "recompute"; under "fail" it is answered as an asynchronous load that
    fails at once, so that vLLM ends it with an error (the connector names its blocks
    as load errors and the request as a failed receive). A full local prefix hit and a
    second request carrying a handle already in use (vLLM's n>1 children share their
    parent's params) are not failures: they prefill locally under either policy.

    Late params (a diagnostic): params that carry P's issue time (``issued_ms``, P's wall
    clock) and reach ``new_request`` more than ``max_delay_ms`` later by D's wall clock
    are counted (``late_params``) and logged at the 1st, 2nd, 4th, 8th... occurrence. The
    protocol assumes params arrive within ``max_delay`` (D ages P's initial term by it),
    so late ones may lose their lease on D and be recomputed (never served stale: P's
    gate and stamps still hold). The figure compares two hosts' wall clocks: it means
    something only where those are synchronized well below ``max_delay``, and no decision
    reads it."""

    def __init__(self, block_size: int, load_failure_policy: str = "recompute",
                 group_block_sizes: list[int] | None = None,
                 max_delay_ms: int | None = None) -> None:
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kvproto: kv_load_failure_policy must be one of "
                             f"{LOAD_FAILURE_POLICIES}, got {load_failure_policy!r}")
        self.block_size = block_size
        # D's KV cache groups (kvproto.vllm.groups), by their block sizes.
        self.group_block_sizes = list(group_block_sizes or [block_size])
        self.fail = load_failure_policy == "fail"
        self.reqs: dict[str, tuple[str, RemoteParams | None]] = {}
        # (P engine, epoch, handle) -> the request pulling it (one per handle; bounded by reqs)
        self.pulling: dict[tuple[str, int, int], str] = {}
        self._orders = Orders()
        self.counters: dict[str, int] = {}
        self.max_delay_ms = max_delay_ms
        self.wall = time.time

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _delay(self, request_id: str, rp: RemoteParams) -> tuple[int | None, bool]:
        """The params' delivery delay (ms) and whether it exceeds ``max_delay_ms``."""
        if rp.issued_ms is None:
            return None, False
        delay = int(self.wall() * 1000) - rp.issued_ms
        late = self.max_delay_ms is not None and delay > self.max_delay_ms
        if late:
            self._count("late_params")
            n = self.counters["late_params"]
            if n & (n - 1) == 0:
                log.warning("kvproto: transfer params of %s reached D %.2f s after P issued "
                            "them, beyond max_delay %.2f s (%d late so far; wall clocks of "
                            "P's and D's hosts): D's lease estimate runs ahead of P's "
                            "deadline, so such requests may lose their lease and be "
                            "recomputed; set max_delay to the real worst delay from P's "
                            "answer to D's engine, router included", request_id,
                            delay / 1000, (self.max_delay_ms or 0) / 1000, n)
        return delay, late

    def state(self, request_id: str) -> str | None:
        r = self.reqs.get(request_id)
        return None if r is None else r[0]

    def new_request(self, request_id: str, kv_params: Any) -> None:
        """vLLM's on_new_request: admit at once, so heartbeats start while queued."""
        if not isinstance(kv_params, Mapping) or not kv_params.get("do_remote_prefill"):
            return
        if request_id in self.reqs:
            self._count("duplicate_request")
            return
        try:
            rp = parse_remote_params(kv_params)
        except ParamsError as e:
            self._count("rejected_params")
            log.warning("kvproto: request %s: rejected kv_transfer_params (%s); %s",
                        request_id, e, self._outcome())
            if self.fail:
                self.reqs[request_id] = (S_FAILED, None)
            return
        delay_ms, late = self._delay(request_id, rp)
        why = self._refusal(rp)
        if why:
            # Different block sizes or groups: P's blocks do not map onto D's. Refused
            # before any admit (no handshake, no READ); P's lease frees them.
            self._count("rejected_" + why[0])
            log.warning("kvproto: request %s: refused: %s; %s", request_id, why[1],
                        self._outcome())
            if self.fail:
                self.reqs[request_id] = (S_FAILED, None)
            return
        # The epoch belongs to the key: a restarted P mints handles from 1 again.
        key = (rp.params.engine, rp.params.epoch, rp.params.handle)
        if key in self.pulling:  # another request pulls this handle: prefill locally
            self._count("shared_handle")
            self.reqs[request_id] = (S_LOCAL, rp)
            return
        self.pulling[key] = request_id
        self.reqs[request_id] = (S_ADMITTED, rp)
        self._orders.admits.append(AdmitOrder(request_id, rp.params, rp.host, rp.port,
                                               kv_params.get("kvproto_tp"), delay_ms, late))

    def _refusal(self, rp: RemoteParams) -> tuple[str, str] | None:
        """(counter reason, one line) when P's blocks cannot map onto D's, else None."""
        if rp.block_size is not None and rp.block_size != self.block_size:
            return ("block_size", f"P's block size is {rp.block_size} tokens, D's "
                    f"{self.block_size}; KVProtoConnector maps blocks only between equal "
                    "block sizes")
        ng, nd = len(rp.groups()), len(self.group_block_sizes)
        if ng != nd:
            return ("groups", f"P's params carry {ng} KV cache groups, D has {nd}")
        return None

    def _outcome(self) -> str:
        return "failing it (kv_load_failure_policy fail)" if self.fail \
            else "prefilling locally"

    def matched_tokens(self, request_id: str, num_prompt_tokens: int, num_computed: int
                       ) -> tuple[int, bool]:
        """vLLM's get_num_new_matched_tokens: (tokens to load, asynchronously)."""
        r = self.reqs.get(request_id)
        if r is None:
            return 0, False
        count = num_prompt_tokens - num_computed
        if r[0] == S_FAILED:
            return (count, True) if self.fail and count > 0 else (0, False)
        if r[0] != S_ADMITTED:
            return 0, False
        rp = r[1]
        assert rp is not None
        nb = len(rp.params.blocks)
        # Every group's list on P (nulls included) covers the prompt: one block position
        # per block_size tokens.
        spans = [s + c for s, c in rp.groups()]
        if rp.num_tokens != num_prompt_tokens or any(
                n != (num_prompt_tokens + bs - 1) // bs
                for n, bs in zip(spans, self.group_block_sizes, strict=True)):
            self._count("rejected_params")
            log.warning("kvproto: request %s: P holds %d tokens in %d blocks (block "
                        "positions per group %s), the prompt has %d tokens (block size "
                        "%d); %s", request_id, rp.num_tokens, nb, spans,
                        num_prompt_tokens, self.block_size, self._outcome())
            self._give_up(request_id, S_FAILED)
            return (count, True) if self.fail and count > 0 else (0, False)
        if count <= 0:  # everything is local already (prefix cache): tell P
            self._give_up(request_id, S_LOCAL)
            return 0, False
        return count, True

    def allocated(self, request_id: str, unhashed_blocks: list[int], local_prefix_blocks: int,
                  num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc, one KV cache group: ``unhashed_blocks`` are
        the new blocks (the READ lands there), ``local_prefix_blocks`` the ones D's prefix
        cache supplied."""
        view = [[(-1, HIT)] * local_prefix_blocks + [(b, NEW) for b in unhashed_blocks]]
        self.allocated_groups(request_id, view, num_external_tokens)

    def allocated_groups(self, request_id: str, view: list[list[tuple[int, int]]],
                         num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: ``view`` is D's blocks per KV cache group as
        ``kvproto.vllm.groups.d_view`` gives them; the READ fills the NEW ones that P
        holds KV for (``groups.plan_load``)."""
        r = self.reqs.get(request_id)
        if r is None:
            return
        unhashed_blocks = [b for g in view for b, k in g if k == NEW]
        if r[0] == S_FAILED and self.fail and num_external_tokens > 0:
            # A load that fails at once: its blocks are reported as load errors.
            self.reqs[request_id] = (S_LOADING, r[1])
            self._orders.loads.append(LoadOrder(request_id, tuple(unhashed_blocks), fail=True))
            return
        if r[0] != S_ADMITTED:
            return
        if num_external_tokens <= 0:
            self._give_up(request_id, S_LOCAL)
            return
        rp = r[1]
        assert rp is not None
        self.reqs[request_id] = (S_LOADING, rp)
        plan = plan_load(rp.groups(), view)
        if isinstance(plan, str) or not plan[0]:
            # vLLM parks the request for a load anyway: order one that fails at once.
            self._count("alloc_mismatch")
            log.error("kvproto: request %s: D's blocks do not match P's (%s); %s",
                      request_id, plan if isinstance(plan, str) else "nothing to read",
                      self._outcome())
            self._orders.loads.append(LoadOrder(request_id, tuple(unhashed_blocks), fail=True))
            return
        local, index = plan
        nb = len(rp.params.blocks)
        suffix = index == list(range(nb - len(index), nb))
        self._orders.loads.append(LoadOrder(request_id, tuple(local),
                                            remote=None if suffix else tuple(index)))

    def _give_up(self, request_id: str, state: str) -> None:
        """An admitted request will not pull: tell the worker (it releases to P)."""
        r = self.reqs.get(request_id)
        if r is not None and r[0] == S_ADMITTED:
            self.reqs[request_id] = (state, r[1])
            self._orders.aborts.append(request_id)

    def finished(self, request_id: str) -> None:
        """vLLM's request_finished on D (done, or aborted by the client)."""
        r = self.reqs.pop(request_id, None)
        if r is None:
            return
        rp = r[1]
        if rp is not None:
            key = (rp.params.engine, rp.params.epoch, rp.params.handle)
            if self.pulling.get(key) == request_id:
                del self.pulling[key]
        if r[0] in (S_ADMITTED, S_LOADING):
            # Loading: the worker answers finished_recving once no READ is in flight.
            self._orders.aborts.append(request_id)

    def on_failed(self, request_ids: list[str]) -> None:
        """The worker's machine ended these requests before any load order: they prefill
        locally (policy "recompute") or fail (policy "fail")."""
        for rid in request_ids:
            r = self.reqs.get(rid)
            if r is not None and r[0] == S_ADMITTED:
                self.reqs[rid] = (S_FAILED, r[1])

    def drain(self) -> Orders:
        out, self._orders = self._orders, Orders()
        return out
