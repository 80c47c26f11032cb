"""Block checksums (``Config.checksums``, opt-in): what P computes at register and D
verifies before a READ's blocks become visible to its engine.

The function is CRC-32 (``zlib.crc32``), chained over a block's segments in order (an
engine cache splits one block over its layers: one segment per layer and K/V). Chosen
for speed among what the standard library offers, measured on the project VM over a
memoryview of tensor bytes (``kvproto bench transfer --checksum`` prints the figures
again; BENCHMARKS.md): CRC-32 ~5.6 GB/s, Adler-32 ~1.6 GB/s, BLAKE2b ~0.6 GB/s. CRC-32 also detects every error burst of up to
32 bits (one flipped byte is one), where Adler-32 is weak on short and sparse changes;
a cryptographic hash buys nothing here: the threat is a fault (a NIC, a backend, a
stray write), not an adversary, who could rewrite the checksum slot as easily. A 64-bit
word sum with numpy is about 3x faster than CRC-32 (measured beside them for the
record) but blind to swapped words and compensating changes, so it is not used.

A checksum is one unsigned 32-bit number per block, kept in P's registered *checksum
slot* of that block (next to its generation stamp) and fetched by D's stamp READ, in
the same transfer as the stamps: no wire message carries it (spec/PROTOCOL.md, Block
checksums).

DRAM only here: the bytes are read in place through their addresses (no copy). On
CUDA the same rule would run on the device: one kernel per register (P) and per landed
batch (D) computing a CRC (or a position-weighted 64-bit sum) of every block of the
batch into the checksum slots, which stay in VRAM like the stamps; the host never
touches the KV bytes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Final

ALGORITHM: Final = "crc32"
# P's handshake ``extra`` key saying that it seals block checksums at register (a D
# that verifies refuses a P without it: ``checksums_unsupported``).
CHECKSUMS_KEY: Final = "checksums"

# A block's segments: (address, length) pairs, in order.
Parts = Sequence[tuple[int, int]]


@functools.lru_cache(maxsize=256)
def _span(nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
    """The ctypes array type of ``nbytes`` bytes (a region has a few segment sizes)."""
    return ctypes.c_char * nbytes


def view(addr: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    """The ``nbytes`` of host memory at ``addr`` as a buffer, without a copy (DRAM only)."""
    return _span(nbytes).from_address(addr)


def block_sum(parts: Parts) -> int:
    """CRC-32 of one block, chained over its segments in order."""
    crc = 0
    for addr, n in parts:
        crc = zlib.crc32(_span(n).from_address(addr), crc)
    return crc


def region_sums(kv_addr: int, block_bytes: int, segments: Sequence[tuple[int, int, int]],
                blocks: Sequence[int]) -> list[int]:
    """CRC-32 of each of ``blocks`` of a region (see ``block_parts``)."""
    crc32 = zlib.crc32
    if not segments:
        span = _span(block_bytes)
        return [crc32(span.from_address(kv_addr + b * block_bytes)) for b in blocks]
    return [block_sum(block_parts(kv_addr, block_bytes, segments, b)) for b in blocks]


def block_parts(kv_addr: int, block_bytes: int, segments: Sequence[tuple[int, int, int]],
                block: int) -> list[tuple[int, int]]:
    """The (address, length) segments of ``block`` in a region: one contiguous block at
    ``kv_addr + block * block_bytes``, or one per segment ``(base, stride, length)``."""
    if not segments:
        return [(kv_addr + block * block_bytes, block_bytes)]
    return [(base + block * stride, ln) for base, stride, ln in segments]


def mismatches(want: Sequence[int], got: Sequence[int]) -> list[int]:
    """Positions where the checksum computed over the landed data (``got``) differs from
    the one P stored (``want``); every position when the lengths differ (fail closed)."""
    if want == got:  # the common case, compared in C
        return []
    if len(want) != len(got):
        return list(range(max(len(want), len(got))))
    return [i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]


# -- what the choice rests on: each candidate's speed here ------------------------------
CANDIDATES: Final[dict[str, Callable[[memoryview], object]]] = {
    "crc32": zlib.crc32,
    "adler32": zlib.adler32,
    "blake2b-64": lambda m: hashlib.blake2b(m, digest_size=8).digest(),
}


def speeds(nbytes: int = 16 << 20, seconds: float = 0.3) -> dict[str, float]:
    """GB/s of each candidate over a memoryview of ``nbytes`` (measured now, here)."""
    buf = bytearray(nbytes)
    for i in range(0, nbytes, 4096):  # not all zeros: some bytes vary
        buf[i] = i & 0xFF
    mv = memoryview(buf)
    out: dict[str, float] = {}
    cands = dict(CANDIDATES)
    try:  # not a candidate (numpy, and weaker), measured for the comparison only
        import numpy as np

        cands["sum64-numpy"] = lambda m: int(np.frombuffer(m, dtype=np.uint64).sum())
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass
    for name, f in cands.items():
        f(mv)
        n = 0
        t0 = time.perf_counter()
        while True:
            f(mv)
            n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        out[name] = n * nbytes / dt / 1e9
    return out
