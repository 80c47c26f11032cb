"""``kvproto bench fingerprint``: the start-up cost of the weights fingerprint of the model
identity (``kvproto.vllm.identity.weights_fingerprint``) against reading the same files
once, whole, in the same run.

Writes a checkpoint-like directory (``--files`` files of random bytes, ``--gib`` GiB in
all, each with a safetensors-like JSON header, plus a ``config.json``) under ``--dir``,
then times, in this order: the fingerprint with the files out of the page cache, one
whole read of every file out of the page cache, the fingerprint with the files cached and
a whole read with the files cached. "Out of the page cache" is asked of the kernel per
file (``posix_fadvise(DONTNEED)`` after ``fsync``), which needs no privileges; where the
kernel keeps pages anyway the cold figures are warm ones. The files are deleted at the
end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvproto.vllm.identity import weights_fingerprint

CHUNK = 8 << 20  # bytes per write / read call


def _drop_cache(files: list[Path]) -> bool:
    """Ask the kernel to drop these files' pages; False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def write_checkpoint(root: Path, gib: float, files: int) -> list[Path]:
    """``files`` shards of random bytes, ``gib`` GiB in all, and a config.json."""
    root.mkdir(parents=True, exist_ok=True)
    per = int(gib * (1 << 30)) // files
    out = []
    for i in range(files):
        p = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        header = json.dumps({"__metadata__": {"format": "pt"}, f"layer.{i}.weight": {
            "dtype": "BF16", "shape": [per // 2], "data_offsets": [0, per]}}).encode()
        with open(p, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            left = per
            while left > 0:
                n = min(CHUNK, left)
                f.write(os.urandom(n))
                left -= n
        out.append(p)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return [*out, root / "config.json"]


def read_whole(files: list[Path]) -> int:
    """Read every file once, start to end; returns the bytes read."""
    total = 0
    buf = bytearray(CHUNK)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                total += n
    return total


def run_all(directory: Path, gib: float, files: int) -> dict[str, Any]:
    shards = write_checkpoint(directory, gib, files)
    size = sum(p.stat().st_size for p in shards)
    r: dict[str, Any] = {"files": len(shards), "bytes": size}
    for temp in ("cold", "warm"):
        if temp == "cold":
            r["cache_dropped"] = _drop_cache(shards)
        t0 = time.perf_counter()
        fp, nread = weights_fingerprint(directory)
        r[f"fingerprint_{temp}_s"] = time.perf_counter() - t0
        r["fingerprint_bytes_read"] = nread
        r["fingerprint"] = fp
        if temp == "cold":
            _drop_cache(shards)
        t0 = time.perf_counter()
        whole = read_whole(shards)
        r[f"read_whole_{temp}_s"] = time.perf_counter() - t0
        assert whole == size
        r[f"ratio_{temp}"] = r[f"fingerprint_{temp}_s"] / r[f"read_whole_{temp}_s"]
    return r


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=4.0, help="checkpoint size in GiB (4)")
    p.add_argument("--files", type=int, default=4, help="weight files (4)")
    p.add_argument("--dir", default=None,
                   help="where to write the checkpoint (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if not args.gib > 0 or args.files < 1:
        print("kvproto bench fingerprint: --gib must be > 0 and --files >= 1", file=sys.stderr)
        return 2
    made = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="kvproto-fp-")) if made else Path(args.dir)
    try:
        r = run_all(directory, args.gib, args.files)
    finally:
        if not args.keep:
            if made:
                shutil.rmtree(directory, ignore_errors=True)
            else:
                for p in directory.glob("model-*-of-*.safetensors"):
                    p.unlink()
                (directory / "config.json").unlink(missing_ok=True)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    gib = r["bytes"] / (1 << 30)
    print(f"kvproto bench fingerprint: {r['files']} files, {gib:.2f} GiB; the fingerprint "
          f"read {r['fingerprint_bytes_read'] / (1 << 20):.2f} MiB")
    for temp in ("cold", "warm"):
        print(f"  {temp:<5} fingerprint {r[f'fingerprint_{temp}_s']:9.4f} s   whole read "
              f"{r[f'read_whole_{temp}_s']:9.4f} s   ratio {r[f'ratio_{temp}']:.5f}")
    if not r["cache_dropped"]:
        print("  (the page cache could not be dropped: 'cold' is warm)")
    return 0
