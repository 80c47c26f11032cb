"""kvproto as a vLLM 0.32 KV connector (``kvproto.vllm.connector.KVProtoConnector``), with
the harness that runs real vLLM engines in separate processes for the end-to-end tests and
``bench vllm`` (``kvproto.vllm.harness``, ``kvproto.bench.vllm``).

``kvproto.vllm.sched`` holds the connector's scheduler-side bookkeeping and the validation
of ``kv_transfer_params`` and of the connector's extra config; it imports no vLLM, so it
can be tested on its own. ``kvproto.vllm.connector`` is the vLLM glue (imports vLLM).
See spec/VLLM.md for which vLLM hook maps to which lifecycle event and effect.
"""
