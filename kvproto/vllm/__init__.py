"""kvproto as a vLLM KV connector (``kvproto.vllm.connector``), with the harness that runs
real vLLM engines in separate processes for the end-to-end tests and ``bench vllm``
(``kvproto.vllm.harness``, ``kvproto.vllm.bench``)."""
