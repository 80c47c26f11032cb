"""Prometheus metrics (``kvproto.metrics``): the definitions, the HTTP exposition, and a
real P/D run (P in its own process, real NIXL) scraped over HTTP while it runs, with the
scraped values checked against P's event journal."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from test_nixl_procs import Proc  # the engine-process wrapper the NIXL tests use

from kvproto.lifecycle import Config, TransferParams
from kvproto.metrics import MAX_LABEL_VALUES, Metrics, scrape_values, serve

CFG = Config(initial_lease=2.0, lease_extension=2.0, heartbeat_interval=0.3, abort_grace=2.0,
             max_delay=0.2, max_read_time=1.0, clock_drift=0.1)
BB = 8192
_ids = itertools.count()

Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> Values:
    with urllib.request.urlopen(url, timeout=10) as r:  # a real HTTP GET
        assert r.status == 200
        return scrape_values(r.read().decode())


def value(vals: Values, name: str, **labels: str) -> float:
    """The sample ``name`` whose labels include ``labels`` (0 when absent)."""
    want = set(labels.items())
    hits = [v for (n, lb), v in vals.items() if n == name and want <= set(lb)]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else 0.0


def by_label(vals: Values, name: str, label: str) -> dict[str, float]:
    return {dict(lb)[label]: v for (n, lb), v in vals.items() if n == name and v}


def test_metrics_served_on_loopback_with_constant_labels() -> None:
    m = Metrics(labels={"role": "P", "engine": "p0"})
    m.free("expired", 3, 4.5)
    m.free("transferred", 2)
    m.free("transferred", 1)
    m.rejected("bad_magic")
    m.heartbeat(7)
    m.tick(2e-5, 0.25)
    m.track_holdings(lambda: 11, lambda: 3)
    ex = serve(m, 0)
    try:
        assert ex.port > 0 and ex.url == f"http://127.0.0.1:{ex.port}/metrics"
        v = get(ex.url)
    finally:
        ex.close()
    lb = {"role": "P", "engine": "p0"}
    assert by_label(v, "kvproto_frees_total", "reason") == {"expired": 1, "transferred": 2}
    assert by_label(v, "kvproto_freed_blocks_total", "reason") == {"expired": 3,
                                                                    "transferred": 3}
    assert value(v, "kvproto_stranded_block_seconds_total", **lb) == 4.5
    assert value(v, "kvproto_rejections_total", reason="bad_magic", **lb) == 1
    assert value(v, "kvproto_heartbeats_total", **lb) == 1
    assert value(v, "kvproto_heartbeat_ids_total", **lb) == 7
    assert value(v, "kvproto_tick_seconds_count", **lb) == 1
    assert value(v, "kvproto_tick_lag_seconds", **lb) == 0.25
    assert value(v, "kvproto_held_blocks", **lb) == 11
    assert value(v, "kvproto_held_requests", **lb) == 3


def test_ledger_effects_map_to_metrics() -> None:
    """``Metrics.p_effect``: what the P adapter (and a connector driving a Ledger) feed."""
    from prometheus_client import generate_latest

    from kvproto.lifecycle import Ack, BlockPool, Free, Ledger, Rejected

    m = Metrics(labels={"engine": "p"})
    L = Ledger(CFG, BlockPool(8))
    reg: dict[int, int] = {}
    effects = []
    for i, now in enumerate((0, 500)):  # ms, as the ledger's times
        h = L.new_handle()
        reg[h] = now
        effects += [(e, now) for e in L.register(h, f"r{i}", (2 * i, 2 * i + 1), now)]
    effects += [(e, 1000) for e in L.heartbeat("d", 1, [1, 2], 1, 1000)]
    effects += [(e, 1000) for e in L.done("d", 1, 1, 1000)]
    effects += [(e, 1000) for e in L.reject("bad_magic", "x", "", 1000)]
    effects += [(e, 9000) for e in L.tick(9000)]  # r1 expires: 2 blocks x (9.0 - 0.5) s
    for e, now in effects:
        m.p_effect(e, now, reg.get(e.handle) if isinstance(e, Free) else None)
    kinds = [type(e).__name__ for e, _ in effects]
    assert kinds.count("Free") == 2 and Ack in map(type, (e for e, _ in effects))
    assert Rejected in map(type, (e for e, _ in effects))
    v = scrape_values(generate_latest(m.registry).decode())
    assert by_label(v, "kvproto_frees_total", "reason") == {"transferred": 1, "expired": 1}
    assert value(v, "kvproto_stranded_block_seconds_total") == pytest.approx(17.0)
    assert value(v, "kvproto_heartbeats_total") == 1
    assert value(v, "kvproto_rejections_total", reason="bad_magic") == 1


def test_one_registry_many_engines_and_bounded_labels() -> None:
    """The connector's shape: several engines' metrics in one registry, told apart by
    their constant labels; a label cannot grow past MAX_LABEL_VALUES values."""
    reg = CollectorRegistry()
    a = Metrics(reg, labels={"role": "D", "engine": "d0"})
    b = Metrics(reg, labels={"role": "D", "engine": "d1"})
    a.fenced()
    b.recomputed(5)
    b.read_finished("done:pulled", 4096)
    for i in range(MAX_LABEL_VALUES + 10):
        a.rejected(f"r{i}")
    a.handshake_failed("unreachable")
    from prometheus_client import generate_latest

    v = scrape_values(generate_latest(reg).decode())
    assert value(v, "kvproto_fenced_reads_total", engine="d0") == 1
    assert value(v, "kvproto_fenced_reads_total", engine="d1") == 0
    assert value(v, "kvproto_recomputed_blocks_total", engine="d1") == 5
    assert value(v, "kvproto_reads_total", engine="d1", outcome="done:pulled") == 1
    assert value(v, "kvproto_read_bytes_total", engine="d1") == 4096
    assert value(v, "kvproto_handshake_failures_total", engine="d0", reason="unreachable") == 1
    reasons = by_label(v, "kvproto_rejections_total", "reason")
    assert len(reasons) == MAX_LABEL_VALUES + 1  # the first 64, then "other"
    assert reasons["other"] == 10 and sum(reasons.values()) == MAX_LABEL_VALUES + 10
    # Separate Metrics without a registry never collide.
    Metrics(labels={"engine": "x"}).fenced()
    Metrics(labels={"engine": "x"}).fenced()


def _journal_counts(path: Path) -> dict[str, Any]:
    """Frees by reason, rejections by reason, heartbeats and stranded block-seconds,
    computed from P's event journal."""
    lines = [json.loads(ln) for ln in path.read_text().splitlines()[1:] if ln.strip()]
    frees: Counter[str] = Counter()
    rejects: Counter[str] = Counter()
    heartbeats = 0
    reg_at: dict[int, float] = {}
    stranded = 0.0
    for ln in lines:
        ev = ln["event"]
        if ev["type"] == "register":
            reg_at[ev["handle"]] = ev["now"]
        elif ev["type"] == "heartbeat":
            heartbeats += 1
        elif ev["type"] == "reject":
            rejects[ev["reason"]] += 1
        for eff in ln["effects"]:
            if eff["type"] == "free":
                frees[eff["reason"]] += 1
                if eff["reason"] in ("expired", "aborted"):
                    # journal times are ms; block-seconds as the metric counts them
                    stranded += (ev["now"] - reg_at[eff["handle"]]) / 1000 * len(eff["blocks"])
    return {"frees": dict(frees), "rejects": dict(rejects), "heartbeats": heartbeats,
            "stranded": stranded}


@pytest.mark.nixl
def test_scrape_while_p_and_d_run_matches_the_journal(tmp_path: Path) -> None:
    pytest.importorskip("nixl._api")
    from kvproto.nixl.consumer import ConsumerAdapter
    from kvproto.nixl.procs import producer_main

    journal = tmp_path / "journal.jsonl"
    pname = f"mP-{os.getpid()}-{next(_ids)}"
    p = Proc(producer_main, pname, CFG.to_dict(), 64, BB,
              {"device": "cpu", "journal": str(journal), "metrics_port": 0})
    d: ConsumerAdapter | None = None
    try:
        _, host, port, _epoch = p.recv("ready")
        _, _name, mport = p.recv("metrics")
        p_url = f"http://127.0.0.1:{mport}/metrics"
        d = ConsumerAdapter(f"mD-{os.getpid()}-{next(_ids)}", CFG, num_blocks=64,
                            block_bytes=BB, metrics_port=0)
        assert d.metrics_port is not None and d.metrics_port != mport
        d.add_engine(pname, host, port)

        def register(rid: str, n: int = 2) -> TransferParams:
            _, _, pd = p.call("register", rid, n, None, 0, rid, None, reply="registered")
            assert pd is not None
            return TransferParams.from_dict(pd)

        pulled = [register(f"ok{i}") for i in range(6)]
        register("expires", 3)  # never admitted on D: its lease runs out
        register("p_abort", 1)  # aborted on P, never read: freed when abort_grace ends
        d_abort = register("d_abort")  # D gives up before reading: released
        # Params that lost their generations: D refuses to read (fail closed), releases,
        # and the engine must recompute those 2 blocks.
        bad = dataclasses.replace(register("bad"), generations=())
        p.conn.send(("abort", "p_abort"))
        for i, pr in enumerate(pulled):
            d.admit(f"ok{i}", pr)
            d.schedule(f"ok{i}")
        d.admit("d_abort", d_abort)
        d.admit("bad", bad)
        d.schedule("bad")
        comps: list[Any] = []
        end = time.monotonic() + 15
        while len(comps) < 6 and time.monotonic() < end:
            comps += d.poll()
            time.sleep(0.001)
        hb_until = time.monotonic() + 3 * CFG.heartbeat_interval  # d_abort waits: heartbeats
        while time.monotonic() < hb_until:
            comps += d.poll()
            time.sleep(0.005)
        d.abort("d_abort")
        for junk in (b"not a kvproto message", b"KV\x07\x01\x00\x00\x00\x00"):
            d.agent.send_notif(pname, junk)
        # While P still holds the expiring request: scrape it live.
        live = get(p_url)
        assert value(live, "kvproto_held_blocks") >= 3
        assert value(live, "kvproto_held_requests") >= 1
        assert value(live, "kvproto_frees_total", reason="transferred") == 6
        # Run until P holds nothing, then scrape again before P stops.
        t_end = time.monotonic() + 15
        while time.monotonic() < t_end:
            comps += d.poll()
            s = p.call("stats", reply="stats")[1]
            if s["held"] == 0 and len(comps) >= 8:
                break
            time.sleep(0.01)
        assert s["held"] == 0, s
        final = get(p_url)
        d_vals = get(f"http://127.0.0.1:{d.metrics_port}/metrics")
    finally:
        if d is not None:
            d.close(1.0)
        p.stop()
    j = _journal_counts(journal)  # P stopped: the journal is complete and flushed
    assert j["frees"] == {"transferred": 6, "expired": 1, "aborted": 1, "released": 2}
    assert by_label(final, "kvproto_frees_total", "reason") == j["frees"]
    assert {k: v for k, v in s["frees"].items() if v} == j["frees"]
    assert by_label(final, "kvproto_rejections_total", "reason") == j["rejects"]
    assert j["rejects"].get("bad_magic", 0) >= 1 and j["rejects"].get("version", 0) == 1
    assert value(final, "kvproto_heartbeats_total") == j["heartbeats"] > 0
    assert value(final, "kvproto_stranded_block_seconds_total") == pytest.approx(
        j["stranded"], abs=1e-6)
    assert j["stranded"] > 0
    assert value(final, "kvproto_held_blocks") == 0 and value(final, "kvproto_held_requests") == 0
    assert value(final, "kvproto_freed_blocks_total", reason="transferred") == 12
    assert value(final, "kvproto_tick_seconds_count") >= 1
    # D's side of the same run.
    assert value(d_vals, "kvproto_reads_total", outcome="done:pulled") == 6
    assert value(d_vals, "kvproto_reads_total", outcome="failed:aborted") == 1
    assert value(d_vals, "kvproto_read_bytes_total") == 6 * 2 * BB
    assert value(d_vals, "kvproto_reads_total", outcome="failed:transfer_error") == 1
    assert value(d_vals, "kvproto_recomputed_blocks_total") == 2  # bad's (not the aborted)
    assert value(d_vals, "kvproto_fenced_reads_total") == 0
    assert value(d_vals, "kvproto_reads_in_flight") == 0
    assert value(d_vals, "kvproto_heartbeats_total") >= 1


def test_demo_refuses_a_bad_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    """A user's mistake exits 2 with one line, before any engine starts."""
    pytest.importorskip("nixl._api")
    import socket

    from kvproto import cli

    assert cli.main(["demo", "--metrics-port", "70000"]) == 2
    assert "not a TCP port" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert cli.main(["demo", "--metrics-port", str(busy)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{busy}" in err[0]
