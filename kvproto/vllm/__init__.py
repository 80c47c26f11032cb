"""kvproto as a vLLM 0.32 KV connector (``kvproto.vllm.connector.KVProtoConnector``).

``kvproto.vllm.sched`` holds the scheduler-side bookkeeping and the validation of
``kv_transfer_params`` and of the connector's extra config; it imports no vLLM, so it can
be tested on its own. ``kvproto.vllm.connector`` is the vLLM glue (imports vLLM).
See spec/VLLM.md for which vLLM hook maps to which lifecycle event and effect.
"""
