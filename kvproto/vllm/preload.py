"""What the engine fork server imports once (``harness``, ``KVPROTO_ENGINE_START``).

Every engine process forked from the server starts with torch and vLLM already imported
(about 7 s of imports per engine on this 2-core machine). Rules: the server imports
nothing that reads an engine's own environment at import time (the side-channel port,
fault hooks and journal paths are read when the engine is built, after the child has
applied its environment), and it starts no thread (a fork copies only the forking
thread). The thread settings every engine uses are set before torch loads, because
libgomp reads ``OMP_NUM_THREADS`` when it is loaded.
"""

from __future__ import annotations

import importlib
import os

# The values harness.engine_env gives every engine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

for _name in ("torch", "vllm", "vllm.config", "vllm.v1.engine.llm_engine"):
    importlib.import_module(_name)
