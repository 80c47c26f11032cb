"""The kvproto vLLM connector's scheduler halves (``PScheduler``, ``DScheduler``), its
options and the validation of client ``kv_transfer_params``. No vLLM, no NIXL needed.

The worker halves over real NIXL are in tests/test_vllm_connector.py; end-to-end runs
with real vLLM engines in tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproto.lifecycle import Config, TransferParams
from kvproto.vllm.sched import (
    PARAMS_KEY,
    ConnectorOptions,
    DScheduler,
    LoadOrder,
    ParamsError,
    PeerInfo,
    PScheduler,
    encode_remote_params,
    parse_remote_params,
    sibling_group,
)

CFG = Config(initial_lease=3.0, lease_extension=2.0, heartbeat_interval=0.3, abort_grace=3.0,
             max_delay=0.2, max_read_time=1.0, clock_drift=0.1)
LEASE = {k: getattr(CFG, k) for k in ("initial_lease", "lease_extension", "heartbeat_interval",
                                      "abort_grace", "max_delay", "max_read_time",
                                      "clock_drift")}
_ids = itertools.count()


def opts(**kw: Any) -> ConnectorOptions:
    return ConnectorOptions.parse({"lease": LEASE, **kw}, "kv_both")


# -- options ---------------------------------------------------------------------------


def test_options_defaults_and_roles() -> None:
    o = ConnectorOptions.parse(None, "kv_both")
    assert (o.role, o.producer, o.consumer, o.config) == ("both", True, True, Config())
    assert ConnectorOptions.parse({}, "kv_producer").role == "producer"
    assert not ConnectorOptions.parse({}, "kv_consumer").producer
    assert ConnectorOptions.parse({"role": "consumer"}, "kv_both").role == "consumer"


@pytest.mark.parametrize("extra, msg", [
    ({"lease_s": 3}, "unknown kv_connector_extra_config keys"),
    ({"role": "decoder"}, "role must be one of"),
    ({"lease": {"initial_lease": 1.0}}, "bad lease config"),
    ({"lease": {"bogus": 1}}, "bad lease config"),
    ({"handshake_port": 70000}, "handshake_port"),
    ({"expected_readers": 0}, "expected_readers"),
    ({"handshake_timeout": "fast"}, "handshake_timeout"),
    ({"group_siblings": 1}, "group_siblings"),
    ({"journal": ""}, "journal"),
])
def test_options_refuse_bad_values_with_one_line(extra: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg) as e:
        ConnectorOptions.parse(extra, "kv_both")
    assert "\n" not in str(e.value)


# -- transfer params ---------------------------------------------------------------------

TP = TransferParams(engine="kvproto-p-x", epoch=7, handle=3, blocks=(4, 5, 6), initial_term=3000,
                    expected=1, group=None, generations=(0, 2, 1))


def test_params_round_trip() -> None:
    d = encode_remote_params(TP, "127.0.0.1", 4000, 70)
    assert d["do_remote_prefill"] is True and d["do_remote_decode"] is False
    rp = parse_remote_params(d)
    assert (rp.params, rp.host, rp.port, rp.num_tokens) == (TP, "127.0.0.1", 4000, 70)


def _bad(mut: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    d = encode_remote_params(TP, "127.0.0.1", 4000, 70)
    mut(d[PARAMS_KEY])
    return d


@pytest.mark.parametrize("params", [
    None, [], "x", {"do_remote_prefill": True}, {PARAMS_KEY: [1]},
    _bad(lambda d: d.pop("engine")),
    _bad(lambda d: d.update(engine="")),
    _bad(lambda d: d.update(port=0)),
    _bad(lambda d: d.update(handle=-1)),
    _bad(lambda d: d.update(handle=True)),
    _bad(lambda d: d.update(blocks=[])),
    _bad(lambda d: d.update(generations=[0])),
    _bad(lambda d: d.update(blocks=[1, 2, "3"])),
    _bad(lambda d: d.update(blocks=[1, 2, -3])),
    _bad(lambda d: d.update(initial_term=float("inf"))),
    _bad(lambda d: d.update(initial_term=0)),
    _bad(lambda d: d.update(initial_term=30.0)),  # ms are ints: a float is refused
    _bad(lambda d: d.update(initial_term=2**32)),
    _bad(lambda d: d.update(expected=0)),
    _bad(lambda d: d.update(group=5)),
    _bad(lambda d: d.update(num_tokens=0)),
])
def test_malformed_params_are_a_params_error(params: Any) -> None:
    with pytest.raises(ParamsError):
        parse_remote_params(params)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=4),
                     max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(junk=st.dictionaries(st.sampled_from(["engine", "epoch", "handle", "blocks", "generations",
                                             "initial_term", "expected", "group", "host", "port",
                                             "num_tokens", "x"]), _json, max_size=12))
def test_arbitrary_params_never_raise_anything_else(junk: dict[str, Any]) -> None:
    base = encode_remote_params(TP, "h", 1, 70)[PARAMS_KEY]
    try:
        rp = parse_remote_params({PARAMS_KEY: {**base, **junk}})
    except ParamsError:
        return
    assert len(rp.params.blocks) == len(rp.params.generations) > 0


def test_sibling_groups() -> None:
    assert sibling_group("0_abc", None, True) == sibling_group("1_abc", None, True) == "n>1:abc"
    assert sibling_group("0_abc", None, False) is None
    assert sibling_group("abc", None, True) is None
    assert sibling_group("abc", {"group": "g"}, True) == "g"


# -- the scheduler halves ------------------------------------------------------------------


def test_p_scheduler_handles_stamps_and_orders() -> None:
    ps = PScheduler(opts(), num_blocks=8)
    assert ps.finished("r0", [1, 2], 40, {"do_remote_decode": True}) is None  # no worker info
    ps.set_peer(PeerInfo("P", 9, "127.0.0.1", 5000))
    a = ps.finished("r1", [1, 2], 40, {"do_remote_decode": True})
    ps.on_stamps({2: 3, 5: 1, 99: 4})  # out-of-range block ignored
    ps.on_stamps({2: 1})  # stamps never go back
    b = ps.finished("r2", [2, 5], 40, {"do_remote_decode": True})
    assert a is not None and b is not None
    pa, pb = parse_remote_params(a).params, parse_remote_params(b).params
    assert (pa.handle, pb.handle) == (1, 2)
    assert pa.generations == (0, 0) and pb.generations == (3, 1)
    assert (pa.engine, pa.epoch, pa.initial_term) == ("P", 9, CFG.ms.initial_lease)
    orders = ps.drain()
    assert [(o.request_id, o.handle, o.blocks, o.generations) for o in orders] == [
        ("r1", 1, (1, 2), (0, 0)), ("r2", 2, (2, 5), (3, 1))]
    assert ps.drain() == []
    assert ps.finished("r1", [3], 10, None) is None  # still held: a duplicate
    assert ps.finished("r3", [8], 10, None) is None  # block outside the cache
    assert ps.counters == {"no_worker_metadata": 1, "duplicate_finish": 1, "bad_blocks": 1}
    ps.on_finished_sending({"r1", "unknown"})
    assert set(ps.held) == {"r2"}


def _remote(handle: int, num_tokens: int = 10) -> dict[str, Any]:
    """D's params for one of P's requests (3 blocks of 4 tokens by default)."""
    return encode_remote_params(replace(TP, handle=handle), "127.0.0.1", 4000, num_tokens)


def test_late_params_are_counted_logged_and_passed_to_the_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    """P's params carry its issue time (``issued_ms``, P's wall clock); D compares it with
    its own wall clock at admit: params later than ``max_delay`` are counted
    (``late_params``) and logged at the 1st, 2nd, 4th... occurrence, and every admit
    carries its delay to the worker's metrics. No decision changes: late params are
    admitted like the others."""
    o = opts()
    ps = PScheduler(o, 16)
    ps.set_peer(PeerInfo("P", 1, "127.0.0.1", 4000, b""))
    ps.wall = lambda: 1000.0
    out = ps.finished("r", [1, 2, 3], 10, {"do_remote_decode": True})
    assert out is not None and out[PARAMS_KEY]["issued_ms"] == 1_000_000
    ds = DScheduler(block_size=4, max_delay_ms=500)
    now = [1000.3]
    ds.wall = lambda: now[0]
    ds.new_request("on-time", out)
    caplog.set_level(logging.WARNING, logger="kvproto.vllm.connector")
    late = []
    for i in range(5):
        now[0] = 1002.0 + i
        ds.new_request(f"late{i}", {**out, PARAMS_KEY: {**out[PARAMS_KEY], "handle": 10 + i}})
        late.append(f"late{i}")
    assert ds.counters == {"late_params": 5}
    admits = ds.drain().admits
    assert [a.request_id for a in admits] == ["on-time", *late]  # all admitted
    assert [(a.delay_ms, a.late) for a in admits] == [(300, False)] + [
        (2000 + 1000 * i, True) for i in range(5)]
    lines = [r.getMessage() for r in caplog.records if "beyond max_delay" in r.message]
    assert len(lines) == 3, lines  # the 1st, 2nd and 4th
    assert "late0" in lines[0] and "2.00 s after P issued them" in lines[0]
    assert "max_delay 0.50 s" in lines[0] and "\n" not in lines[0]
    # no issue time (an older P), or a malformed one
    ds.new_request("no-time", {**out, PARAMS_KEY: {k: v for k, v in out[PARAMS_KEY].items()
                                                   if k != "issued_ms"} | {"handle": 30}})
    ds.new_request("bad-time", {**out, PARAMS_KEY: {**out[PARAMS_KEY], "handle": 31,
                                                    "issued_ms": "soon"}})
    assert [(a.request_id, a.delay_ms) for a in ds.drain().admits] == [("no-time", None)]
    assert ds.counters == {"late_params": 5, "rejected_params": 1}


def test_d_scheduler_admit_load_abort() -> None:
    ds = DScheduler(block_size=4)
    ds.new_request("a", _remote(1))
    ds.new_request("bad", {"do_remote_prefill": True, PARAMS_KEY: {"engine": 1}})
    ds.new_request("plain", None)
    assert ds.counters == {"rejected_params": 1}
    o = ds.drain()
    assert [x.request_id for x in o.admits] == ["a"] and not o.loads and not o.aborts
    assert ds.matched_tokens("bad", 10, 0) == (0, False)
    assert ds.matched_tokens("a", 10, 4) == (6, True)
    ds.allocated("a", [20, 21], local_prefix_blocks=1, num_external_tokens=6)
    o = ds.drain()
    assert o.loads == [LoadOrder("a", (20, 21))]
    assert ds.matched_tokens("a", 10, 0) == (0, False)  # one load per request
    ds.finished("a")  # client abort while loading: the worker must answer it
    assert ds.drain().aborts == ["a"]
    # A prompt that does not match P's blocks, and a full local hit, go local and tell P.
    ds.new_request("m", _remote(2))
    ds.new_request("h", _remote(3))
    assert ds.matched_tokens("m", 11, 0) == (0, False)
    assert ds.matched_tokens("h", 10, 12) == (0, False)
    assert ds.drain().aborts == ["m", "h"]
    ds.finished("m")
    assert not ds.drain()  # already told P
    # Ended on the worker before any load: prefill locally.
    ds.new_request("e", _remote(4))
    ds.on_failed(["e", "unknown"])
    assert ds.matched_tokens("e", 10, 0) == (0, False)


def test_d_scheduler_one_request_pulls_a_handle() -> None:
    """vLLM's n>1 children carry their parent's params: the first pulls, the others
    prefill locally without an admit, under either policy (not a failure)."""
    for policy in ("recompute", "fail"):
        ds = DScheduler(block_size=4, load_failure_policy=policy)
        ds.new_request("0_r", _remote(5))
        ds.new_request("1_r", _remote(5))
        assert [a.request_id for a in ds.drain().admits] == ["0_r"]
        assert ds.state("1_r") == "local" and ds.counters == {"shared_handle": 1}
        assert ds.matched_tokens("1_r", 10, 0) == (0, False)
        ds.finished("1_r")
        assert not ds.drain()
        ds.finished("0_r")  # the handle is free again
        assert ds.drain().aborts == ["0_r"]
        ds.new_request("again", _remote(5))
        assert [a.request_id for a in ds.drain().admits] == ["again"]


def test_d_scheduler_fail_policy_fails_what_cannot_be_loaded() -> None:
    """kv_load_failure_policy "fail": a request whose remote KV cannot be loaded (bad
    params, a prompt P's blocks do not match, ended by the worker before a load) is
    answered as an asynchronous load that fails at once (vLLM then ends it with an
    error), never prefilled locally. A full local prefix hit is no failure."""
    ds = DScheduler(block_size=4, load_failure_policy="fail")
    ds.new_request("bad", {"do_remote_prefill": True, PARAMS_KEY: {"engine": 1}})
    ds.new_request("m", _remote(1))
    ds.new_request("e", _remote(2))
    ds.new_request("h", _remote(3))
    assert [a.request_id for a in ds.drain().admits] == ["m", "e", "h"]
    ds.on_failed(["e"])  # e.g. the handshake with P failed, or the lease ran out
    assert ds.matched_tokens("bad", 10, 0) == (10, True)
    assert ds.matched_tokens("m", 11, 4) == (7, True)  # P holds 10 tokens, not 11
    assert ds.matched_tokens("e", 10, 0) == (10, True)
    assert ds.matched_tokens("h", 10, 12) == (0, False)  # all local already
    assert ds.drain().aborts == ["m", "h"]  # told P (the worker releases)
    ds.allocated("bad", [7, 8, 9], local_prefix_blocks=0, num_external_tokens=10)
    ds.allocated("m", [3, 2], local_prefix_blocks=1, num_external_tokens=7)
    ds.allocated("e", [1, 0, 6], local_prefix_blocks=0, num_external_tokens=10)
    assert ds.drain().loads == [LoadOrder("bad", (7, 8, 9), fail=True),
                                LoadOrder("m", (3, 2), fail=True),
                                LoadOrder("e", (1, 0, 6), fail=True)]
    assert {ds.state(r) for r in ("bad", "m", "e")} == {"loading"}
    # A load whose allocation does not fit P's blocks fails too, naming every new block.
    ds.new_request("x", _remote(4))
    ds.drain()
    assert ds.matched_tokens("x", 10, 0) == (10, True)
    ds.allocated("x", [11], local_prefix_blocks=0, num_external_tokens=10)
    assert ds.drain().loads == [LoadOrder("x", (11,), fail=True)]
    # The same requests under "recompute" prefill locally.
    dr = DScheduler(block_size=4, load_failure_policy="recompute")
    dr.new_request("bad", {"do_remote_prefill": True, PARAMS_KEY: {"engine": 1}})
    dr.new_request("m", _remote(1))
    dr.new_request("e", _remote(2))
    dr.on_failed(["e"])
    assert [dr.matched_tokens(r, n, 0) for r, n in (("bad", 10), ("m", 11), ("e", 10))] \
        == [(0, False)] * 3
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        DScheduler(block_size=4, load_failure_policy="retry")


def test_options_for_data_parallel_ranks() -> None:
    """Every data-parallel rank is an engine of its own on the same host: a fixed port
    is port + rank, a journal gets the rank in its name; 0 (any free port) stays."""
    o = opts(handshake_port=5600, metrics_port=9100, journal="/var/log/kv/P.jsonl")
    assert o.for_dp_rank(0) is o
    r2 = o.for_dp_rank(2)
    assert (r2.handshake_port, r2.metrics_port, r2.journal) == (5602, 9102,
                                                               "/var/log/kv/P.dp2.jsonl")
    free = opts(metrics_port=0).for_dp_rank(3)
    assert (free.handshake_port, free.metrics_port, free.journal) == (0, 0, None)
    with pytest.raises(ValueError, match="handshake_port 65535"):
        opts(handshake_port=65535).for_dp_rank(1)
