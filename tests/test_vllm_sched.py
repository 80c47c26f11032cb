"""The kvproto vLLM connector's scheduler halves (``PScheduler``, ``DScheduler``), its
options and the validation of client ``kv_transfer_params``. No vLLM, no NIXL needed.

The worker halves over real NIXL are in tests/test_vllm_connector.py; end-to-end runs
with real vLLM engines in tests/test_vllm_e2e.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
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


def test_d_scheduler_admit_load_abort() -> None:
    ds = DScheduler(block_size=4)
    good = encode_remote_params(TP, "127.0.0.1", 4000, 10)  # 3 blocks of 4 tokens
    ds.new_request("a", good)
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
    ds.new_request("m", good)
    ds.new_request("h", good)
    assert ds.matched_tokens("m", 11, 0) == (0, False)
    assert ds.matched_tokens("h", 10, 12) == (0, False)
    assert ds.drain().aborts == ["m", "h"]
    ds.finished("m")
    assert not ds.drain()  # already told P
    # Ended on the worker before any load: prefill locally.
    ds.new_request("e", good)
    ds.on_failed(["e", "unknown"])
    assert ds.matched_tokens("e", 10, 0) == (0, False)
