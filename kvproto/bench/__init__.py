"""Benchmarks (figures against a baseline in the same run, never timed tests): ``ledger``,
``wire``, ``transfer`` (NIXL) and ``vllm`` (real engines)."""
