"""A prefill/decode pair of vLLM engines on CPU, joined by KVProtoConnector.

    python examples/vllm_pd_cpu.py [--prompts 8] [--workdir DIR]

P and D each run in their own process (vLLM's offline ``LLM`` API). P prefills token-id
prompts with ``max_tokens=1`` and ``do_remote_decode``; its outputs carry the
``kv_transfer_params`` that D's requests take unchanged; D pulls the KV over NIXL (UCX on
loopback) and decodes. The model is a tiny random-weight Llama written locally (nothing
is downloaded). The script checks D's greedy outputs against D prefilling the same
prompts itself, prints one line per prompt and exits 0 when all match.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import signal
import sys
import tempfile
import time
from typing import Any

MAX_TOKENS = 16


def kv_transfer_config(journal: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {
        # Lifecycle timing (seconds); the defaults suit production, these a demo.
        "lease": {"initial_lease": 10.0, "lease_extension": 10.0, "heartbeat_interval": 2.0,
                  "abort_grace": 10.0, "max_delay": 0.5, "max_read_time": 2.0,
                  "clock_drift": 0.2},
    }
    if journal:
        extra["journal"] = journal  # P's event journal: check it with `kvproto validate`
    return {"kv_connector": "KVProtoConnector",
            "kv_connector_module_path": "kvproto.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


def make_llm(model: str, journal: str | None) -> Any:
    from vllm import LLM

    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True,
               kv_cache_memory_bytes=128 << 20, block_size=32, max_model_len=1024,
               enable_prefix_caching=True, seed=0,
               kv_transfer_config=kv_transfer_config(journal))


def prefill_engine(model: str, journal: str, jobs: Any, results: Any) -> None:
    os.setsid()  # own process group: the parent ends the engine and its children at once
    from vllm import SamplingParams

    llm = make_llm(model, journal)
    results.put("ready")
    prompts = jobs.get()
    sp = SamplingParams(max_tokens=1, temperature=0,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    results.put([o.kv_transfer_params for o in outs])
    jobs.get()  # keep serving (D reads from this engine) until the parent ends it


def decode_engine(model: str, jobs: Any, results: Any) -> None:
    os.setsid()
    from vllm import SamplingParams

    llm = make_llm(model, None)
    results.put("ready")
    prompts, params = jobs.get()
    remote = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                        extra_args={"kv_transfer_params": kp}) for kp in params])
    local = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    results.put(([list(o.outputs[0].token_ids) for o in remote],
                 [list(o.outputs[0].token_ids) for o in local]))
    jobs.get()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="number of prompts (default 8)")
    ap.add_argument("--workdir", default=None, help="where the model and journal go")
    args = ap.parse_args()
    from kvproto.vllm.harness import build_tiny_model

    work = args.workdir or tempfile.mkdtemp(prefix="kvproto-vllm-")
    model = str(build_tiny_model(os.path.join(work, "model")).path)
    journal = os.path.join(work, "P.jsonl")
    rng = random.Random(1)
    lengths = [5, 32, 33, 64, 100, 200, 17, 90]
    prompts = [[rng.randrange(1, 1000) for _ in range(lengths[i % len(lengths)])]
               for i in range(args.prompts)]
    ctx = mp.get_context("spawn")
    pj, pr, dj, dr = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=prefill_engine, args=(model, journal, pj, pr))
    d = ctx.Process(target=decode_engine, args=(model, dj, dr))
    p.start()
    d.start()

    def get(q: Any, proc: Any, timeout: float) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise SystemExit(f"engine process exited with {proc.exitcode}") from None
        raise SystemExit(f"no answer from an engine in {timeout:.0f} s")

    try:
        get(pr, p, 600)
        get(dr, d, 600)
        t = time.monotonic()
        pj.put(prompts)
        params = get(pr, p, 300)
        dj.put((prompts, params))
        remote, local = get(dr, d, 300)
    finally:
        for proc in (p, d):  # each engine with its engine-core and worker processes
            if proc.pid is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.join(10)
    ok = 0
    for i, (a, b) in enumerate(zip(remote, local, strict=True)):
        ok += a == b
        print(f"prompt {i:2d} ({len(prompts[i]):3d} tokens): "
              f"{'same' if a == b else 'DIFFERENT'} {a[:8]}")
    print(f"{ok}/{len(prompts)} P/D outputs equal D's own prefill "
          f"({time.monotonic() - t:.1f} s); P's journal: {journal}")
    return 0 if ok == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
