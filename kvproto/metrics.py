"""Prometheus metrics: one set of definitions for the P adapter, the D adapter and the
vLLM connector.

``Metrics`` registers every kvproto metric in a ``CollectorRegistry`` (a fresh one by
default, so several engines in one process never collide), with constant labels (for
example ``role``, ``engine``) on every series. Adapters feed it from the effects and
counters they already handle; each call is an O(1) counter increment (a labelled child
is looked up in a dict, created on first use). Gauges of current state (held blocks,
held requests, in-flight READs) are read when scraped, through callbacks, so they cost
nothing per event.

``serve(metrics, port)`` exposes a registry over HTTP on 127.0.0.1 (port 0 picks a free
port; the chosen one is returned). Adapters only do that when asked (opt-in).

Label values come from small fixed sets (free reasons, wire rejection reasons,
handshake failure reasons); a label that would take more than ``MAX_LABEL_VALUES``
distinct values folds the rest into ``"other"``, so a peer cannot grow the exposition
without bound.

Metric names (each with the constant labels):

* ``kvproto_frees_total{reason}``, ``kvproto_freed_blocks_total{reason}``: P frees by
  reason (transferred, released, sibling, aborted, expired) and the blocks they freed;
* ``kvproto_stranded_block_seconds_total``: P blocks x seconds held by requests that were
  freed by expiry or abort (nobody pulled them), from registration to the free;
* ``kvproto_held_blocks``, ``kvproto_held_requests``: P's current holdings;
  ``kvproto_held_tokens``: the prompt tokens whose KV they hold (the vLLM connector: the
  KV pinned for pending transfers, in tokens);
* ``kvproto_rejections_total{reason}``: bad or stale input, counted and dropped;
* ``kvproto_heartbeats_total``: heartbeat messages (P: received and handled by the
  ledger; D: sent); ``kvproto_heartbeat_ids_total``: request ids they carried;
* ``kvproto_tick_seconds``: time spent in the ledger's tick (a histogram) and
  ``kvproto_tick_lag_seconds``: how late the last tick ran after its earliest due
  deadline;
* ``kvproto_fenced_reads_total``: D READs whose generation stamps changed (never served);
* ``kvproto_checksum_failures_total``: D READs whose stamps matched but a block's
  checksum did not (``Config.checksums``; fenced, never served);
* ``kvproto_reads_total{outcome}``, ``kvproto_read_bytes_total``: D requests finished by
  outcome (``done:pulled``, ``failed:fenced``, ...) and bytes pulled;
* ``kvproto_recomputed_blocks_total``: blocks D could not pull and must recompute (a
  request that failed for any reason but a client abort);
* ``kvproto_handshake_failures_total{reason}``: D handshakes that failed;
* ``kvproto_reads_in_flight``: D READs not finished yet;
* ``kvproto_params_delay_seconds``: how long D's transfer params took from P's issue to
  D's admit (a histogram, by the two hosts' wall clocks; only params that carry P's issue
  time), and ``kvproto_late_params_total``: those beyond ``max_delay``. Diagnostics for
  sizing ``max_delay`` and the leases; no decision reads them;
* ``kvproto_poll_stalls_total``, ``kvproto_poll_stall_seconds_total``: the vLLM
  connector's gaps between adapter polls longer than ``max_delay`` while work was pending
  (its engine thread and its poller both stalled), and their total length. Leases run on
  through such a gap: a diagnostic for requests that lost theirs.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvproto.lifecycle import R_ABORTED, R_EXPIRED, Ack, Effect, Free, Rejected

log = logging.getLogger(__name__)

MAX_LABEL_VALUES: Final = 64
_STRANDED: Final = frozenset({R_EXPIRED, R_ABORTED})  # nobody pulled: blocks sat unused
TICK_BUCKETS: Final = (1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 0.05, 0.25, 1.0)
DELAY_BUCKETS: Final = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

# registry -> {(namespace, constant label names): {metric name: metric family}}
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, dict[tuple[str, tuple[str, ...]],
                                                             dict[str, Any]]] = \
    weakref.WeakKeyDictionary()


class _Labelled:
    """A labelled metric with its constant labels bound; children cached by value."""

    __slots__ = ("_children", "_const", "_metric")

    def __init__(self, metric: Any, const: Mapping[str, str]) -> None:
        self._metric = metric
        self._const = dict(const)
        self._children: dict[str, Any] = {}

    def child(self, value: str) -> Any:
        c = self._children.get(value)
        if c is None:
            if len(self._children) >= MAX_LABEL_VALUES:
                value = "other"
                c = self._children.get(value)
                if c is not None:
                    return c
            c = self._metric.labels(*self._const.values(), value)
            self._children[value] = c
        return c


class Metrics:
    """Every kvproto metric for one engine (P rank, D rank or vLLM connector).

    ``labels`` are constant labels put on every series (e.g. ``{"role": "P",
    "engine": "prefill-0"}``). Several ``Metrics`` may share a registry (one family per
    metric, one series per label set) when their label names are the same; two with the
    same label values share their series."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 labels: Mapping[str, str] | None = None, namespace: str = "kvproto") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        const = {k: str(v) for k, v in (labels or {}).items()}
        names = tuple(const)
        values = tuple(const.values())
        # One family per metric name and registry: several Metrics (engines, ranks) can
        # share a registry as long as their constant label names agree.
        fams = _FAMILIES.setdefault(self.registry, {})
        key = (namespace, names)
        if fams and next(iter(fams)) != key:
            raise ValueError(f"this registry's kvproto metrics use labels {next(iter(fams))[1]},"
                             f" not {names}")
        fam = fams.setdefault(key, {})
        ns = namespace
        reg = self.registry

        def family(kind: type[Any], name: str, doc: str, label: str | None, **kw: Any) -> Any:
            m = fam.get(name)
            if m is None:
                m = kind(name, doc, [*names, label] if label else list(names), namespace=ns,
                         registry=reg, **kw)
                fam[name] = m
            return m

        def counter(name: str, doc: str, label: str | None = None) -> Any:
            m = family(Counter, name, doc, label)
            return _Labelled(m, const) if label else (m.labels(*values) if names else m)

        def gauge(name: str, doc: str) -> Any:
            m = family(Gauge, name, doc, None)
            return m.labels(*values) if names else m

        self._frees = counter("frees", "P frees by reason", "reason")
        self._freed_blocks = counter("freed_blocks", "blocks P returned to its allocator, "
                                     "by free reason", "reason")
        self._stranded = counter("stranded_block_seconds",
                                 "P blocks x seconds held by requests freed by expiry or "
                                 "abort (registration to free)")
        self._rejections = counter("rejections", "bad or stale input, counted and dropped",
                                   "reason")
        self._heartbeats = counter("heartbeats", "heartbeat messages (P: handled; D: sent)")
        self._heartbeat_ids = counter("heartbeat_ids", "request ids carried by heartbeats")
        self._fenced = counter("fenced_reads", "D READs whose generation stamps changed "
                               "(data never served)")
        self._checksum = counter("checksum_failures", "D READs with a block whose checksum "
                                 "failed (stamps unchanged; data never served)")
        self._reads = counter("reads", "D requests finished, by outcome", "outcome")
        self._read_bytes = counter("read_bytes", "bytes D pulled with READs that were served")
        self._recomputed = counter("recomputed_blocks",
                                   "blocks D could not pull and must recompute")
        self._hs_failures = counter("handshake_failures", "D handshakes that failed",
                                    "reason")
        hist = family(Histogram, "tick_seconds", "time spent in the ledger's tick", None,
                      buckets=TICK_BUCKETS)
        self._tick = hist.labels(*values) if names else hist
        self._tick_lag = gauge("tick_lag_seconds",
                               "how late the last tick ran after its earliest due deadline")
        self._held_blocks = gauge("held_blocks", "blocks P holds now")
        self._held_requests = gauge("held_requests", "requests P holds now")
        self._held_tokens = gauge("held_tokens", "prompt tokens whose KV P holds for D now "
                                  "(the vLLM connector)")
        self._in_flight = gauge("reads_in_flight", "D READs not finished yet")
        dh = family(Histogram, "params_delay_seconds", "D: transfer params' delay from P's "
                    "issue to D's admit (wall clocks of both hosts)", None,
                    buckets=DELAY_BUCKETS)
        self._params_delay = dh.labels(*values) if names else dh
        self._late_params = counter("late_params", "D: transfer params that reached D later "
                                    "than max_delay after P issued them (wall clocks)")
        self._poll_stalls = counter("poll_stalls", "connector adapter polls that came more "
                                    "than max_delay after the one before, with work "
                                    "pending (engine thread and poller both stalled)")
        self._poll_stall_s = counter("poll_stall_seconds", "total length of those gaps")
        self._stuck = gauge("d_stuck_reads", "D READs past max_read_time + read_grace whose "
                            "transfer has not ended (their local blocks quarantined)")

    # -- P --------------------------------------------------------------------------------
    def p_effect(self, e: Effect, now: int, registered_at: int | None = None) -> None:
        """Count one effect of a P ``Ledger``, as the P adapter applies it (a connector
        that drives a ``Ledger`` itself calls this too). ``now`` and ``registered_at`` are
        the ledger's times (ms); ``registered_at``: for a ``Free``, the request's
        registration time (its stranded block-seconds when an expiry or abort freed it);
        one ``Ack`` is one heartbeat the ledger handled."""
        if isinstance(e, Free):
            stranded = ((now - registered_at) / 1000 * len(e.blocks)
                        if registered_at is not None and e.reason in _STRANDED else 0.0)
            self.free(e.reason, len(e.reclaimed), stranded)
        elif isinstance(e, Ack):
            self.heartbeat(0)
        elif isinstance(e, Rejected):
            self.rejected(e.reason)

    def free(self, reason: str, blocks: int, stranded_block_seconds: float = 0.0) -> None:
        self._frees.child(reason).inc()
        if blocks:
            self._freed_blocks.child(reason).inc(blocks)
        if stranded_block_seconds > 0:
            self._stranded.inc(stranded_block_seconds)

    def rejected(self, reason: str) -> None:
        self._rejections.child(reason).inc()

    def heartbeat(self, ids: int) -> None:
        self._heartbeats.inc()
        if ids:
            self._heartbeat_ids.inc(ids)

    def tick(self, seconds: float, lag: float) -> None:
        self._tick.observe(seconds)
        self._tick_lag.set(lag)

    def track_holdings(self, blocks: Callable[[], float], requests: Callable[[], float]) -> None:
        """Held blocks and requests, read at scrape time (no per-event cost)."""
        self._held_blocks.set_function(blocks)
        self._held_requests.set_function(requests)

    def track_tokens(self, tokens: Callable[[], float]) -> None:
        """Held prompt tokens, read at scrape time (the vLLM connector knows them)."""
        self._held_tokens.set_function(tokens)

    # -- D and the connector ----------------------------------------------------------------
    def fenced(self) -> None:
        self._fenced.inc()

    def checksum_failed(self) -> None:
        self._checksum.inc()

    def read_finished(self, outcome: str, nbytes: int = 0) -> None:
        self._reads.child(outcome).inc()
        if nbytes:
            self._read_bytes.inc(nbytes)

    def recomputed(self, blocks: int) -> None:
        if blocks:
            self._recomputed.inc(blocks)

    def handshake_failed(self, reason: str) -> None:
        self._hs_failures.child(reason).inc()

    def params_delay(self, seconds: float, late: bool) -> None:
        """One admitted request's params delay (negative: D's wall clock is behind P's
        by more than the delay; observed as 0)."""
        self._params_delay.observe(max(0.0, seconds))
        if late:
            self._late_params.inc()

    def poll_stall(self, seconds: float) -> None:
        """One gap between the connector's adapter polls longer than ``max_delay``."""
        self._poll_stalls.inc()
        self._poll_stall_s.inc(seconds)

    def track_in_flight(self, reads: Callable[[], float]) -> None:
        self._in_flight.set_function(reads)

    def track_stuck_reads(self, stuck: Callable[[], float]) -> None:
        self._stuck.set_function(stuck)


class Exporter:
    """A running HTTP exposition of one registry (on 127.0.0.1)."""

    def __init__(self, registry: CollectorRegistry, port: int = 0,
                 host: str = "127.0.0.1") -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        try:
            self._server.shutdown()
            self._server.server_close()
        except Exception as e:  # pragma: no cover - teardown
            log.debug("metrics exporter shutdown: %s", e)
        self._thread.join(2.0)


def serve(metrics: Metrics, port: int = 0, host: str = "127.0.0.1") -> Exporter:
    """Expose ``metrics`` over HTTP; ``port`` 0 picks a free one (``Exporter.port``)."""
    return Exporter(metrics.registry, port, host)


def scrape_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse an exposition into ``{(sample name, sorted labels): value}`` (tests, tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out
