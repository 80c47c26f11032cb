"""``kvproto bench idle --path server``: the idle CPU of a ``vllm serve`` P + D + router
stack, per process, stock NixlConnector and KVProtoConnector in one run.

Per variant, one after the other (one stack up at a time, so no stack's threads compete
with another's): P and D servers and the router (``kvproto.bench.vllm_serve.start_stack``,
P on the last core, D on the first), a few requests through the router (all must come
back), then two windows of ``--interval`` seconds:

* ``after``: the requests are done; nothing is held (kvproto: D's done freed P's blocks;
  stock: D's READ notification did);
* ``held``: ``--held`` prefills sent to P alone with ``do_remote_decode`` (as the router
  does) and no D to pull them: P holds their blocks for the lease.

In each window every process of the stack is measured on its own (``api_server``: the
``vllm serve`` process, ``engine_core``, ``worker``: vLLM's worker process, where the
connector's worker side and NIXL's agent live, ``router``): CPU seconds per wall second
(``kvproto.testing.serve.cpu_per_second``). Variants: ``stock``; ``kvproto`` (the
connector's defaults: NIXL progress thread on P in its busy loop, ``idle_wait_ms``: the
engine loop waits in the connector while P holds blocks and nothing is due);
``kvproto_sleep`` (the same with ``progress_delay_us`` 50: the progress thread sleeps
between passes); ``kvproto_busy`` (``idle_wait_ms`` 0 too: a step every loop turn);
``kvproto_nowait`` (``progress_delay_us`` 50, ``idle_wait_ms`` 0). Ratios per window:
each variant's total over ``kvproto``'s (``cpu_ratio_<variant>_kvproto_<window>``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# variant -> (connector, kvproto options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "stock": ("stock", {}),
    "kvproto": ("kvproto", {}),
    "kvproto_sleep": ("kvproto", {"progress_delay_us": 50}),
    "kvproto_busy": ("kvproto", {"progress_delay_us": 0, "idle_wait_ms": 0}),
    "kvproto_nowait": ("kvproto", {"progress_delay_us": 50, "idle_wait_ms": 0}),
}
SETTLE_S = 2.0   # after the requests, before a window: the engines finish their steps


def _hold(p_url: str, prompts: list[list[int]]) -> None:
    """Prefill ``prompts`` on P alone, as the router's first leg does: P keeps their
    blocks for a D that never comes (until the lease ends)."""
    import httpx

    from kvproto.testing.serve import SERVED_NAME

    for pr in prompts:
        r = httpx.post(p_url + "/v1/completions", timeout=300.0,
                       json={"model": SERVED_NAME, "prompt": pr, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()


def _variant(args: argparse.Namespace, workdir: Path, model: str, variant: str
             ) -> dict[str, Any]:
    from kvproto.bench.vllm_serve import _round, start_stack
    from kvproto.testing.serve import cpu_per_second
    from kvproto.vllm import harness as h
    from kvproto.vllm.harness import HarnessError

    name, extra = VARIANTS[variant]
    ns = argparse.Namespace(server_bind="cores", lease=args.lease)
    st = start_stack(ns, workdir, model, name, 1, 1, extra_config=extra,
                     tag=f"idle-{variant}")
    try:
        prompts = h.make_prompts(4 + args.held, seed=7)
        answers, _ = asyncio.run(_round(st.router_url, {f"{variant}-{i}": p for i, p in
                                                        enumerate(prompts[:4])}, 4))
        bad = [rid for rid, a in answers.items() if a.error or len(a.tokens) != 4]
        if bad:
            raise HarnessError(f"{variant}: requests through the router failed: "
                               f"{answers[bad[0]].error or answers[bad[0]].tokens}")
        time.sleep(SETTLE_S)
        after = cpu_per_second(st.procs, args.interval)
        _hold(st.p_url, prompts[4:])
        time.sleep(SETTLE_S)
        held = cpu_per_second(st.procs, args.interval)
    finally:
        st.close()

    def by_kind(w: dict[str, float]) -> dict[str, float]:
        out = {k.split("/", 1)[0].rsplit("-", 1)[-1] + "_" + k.split("/", 1)[1]: round(v, 3)
               for k, v in w.items() if not k.endswith("/other") or v >= 0.005}
        out["total"] = round(sum(w.values()), 3)
        return out

    res = {"after": by_kind(after), "held": by_kind(held)}
    log.info("%s: %s", variant, res)
    return res


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The server path's idle figures (see the module's doc)."""
    from kvproto.vllm import harness as h

    t_start = time.monotonic()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    tiny = h.build_tiny_model(workdir / "model")
    h.write_word_tokenizer(tiny.path, vocab=tiny.vocab)
    model = str(tiny.path)
    load0 = os.getloadavg()[0]
    res: dict[str, Any] = {v: _variant(args, workdir, model, v)
                           for v in args.variants.split(",")}
    for w in ("after", "held"):
        for num, den in ((v, "kvproto") for v in VARIANTS if v != "kvproto"):
            if num in res and den in res and res[den][w]["total"] > 0:
                res[f"cpu_ratio_{num}_{den}_{w}"] = round(
                    res[num][w]["total"] / res[den][w]["total"], 2)
    res.update(path="server", held_requests=args.held, interval_s=args.interval,
               lease_s=args.lease, cpu_count=os.cpu_count(), loadavg_1m_start=round(load0, 2),
               loadavg_1m=round(os.getloadavg()[0], 2),
               wall_s=round(time.monotonic() - t_start, 1))
    return res
