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

Two functions, one per kind of memory, named in P's handshake (``extra["sum_algo"]``):

* ``crc32`` -- DRAM: the bytes are read in place through their addresses (no copy);
* ``wsum32`` -- VRAM (and DRAM, where a D in DRAM verifies a P in VRAM): a
  position-weighted sum of the block's little-endian 32-bit words modulo 2**32, word
  ``i`` of the block (counted across its segments in order) weighted ``2*i + 1``.
  Computed on the device that holds the bytes, by torch: the host never reads the KV
  bytes, only one number per block. Every weight is odd, so any change confined to one
  word (a flipped bit or byte, a stuck word) changes the sum: the change is ``w * d``
  with ``w`` odd and ``0 < |d| < 2**32``, never a multiple of ``2**32``. Position
  weights also catch most swapped or shifted words, which a plain sum cannot. It is
  weaker than CRC-32 on multi-word bursts, and it is the strongest rule that costs a
  few vectorised passes over VRAM (CRC is sequential per byte).

D verifies with the function P sealed with; a D whose memory cannot compute it (a D in
VRAM under a P in DRAM: CRC-32 has no device kernel here) refuses P at the handshake
(``checksums_unsupported``), never serves unverified blocks.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:  # torch comes with the nixl extra; crc32 needs only the stdlib
    import torch

ALGORITHM: Final = "crc32"  # DRAM's function (see the module docstring)
VRAM_ALGORITHM: Final = "wsum32"
ALGORITHMS: Final = (ALGORITHM, VRAM_ALGORITHM)
# The handshake ``extra`` key naming the function P seals with (absent: crc32).
ALGO_KEY: Final = "sum_algo"
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


def algorithm_for(mem: str) -> str:
    """The function a region in ``mem`` (``"DRAM"`` or ``"VRAM"``) seals with."""
    return VRAM_ALGORITHM if mem == "VRAM" else ALGORITHM


def can_verify(algo: object, mem: str) -> bool:
    """Whether a D whose blocks live in ``mem`` can compute ``algo`` over them."""
    return algo == VRAM_ALGORITHM or (algo == ALGORITHM and mem != "VRAM")


def region_sums(kv_addr: int, block_bytes: int, segments: Sequence[tuple[int, int, int]],
                blocks: Sequence[int], algo: str = ALGORITHM,
                device: object = None) -> list[int]:
    """The checksum of each of ``blocks`` of a region (see ``block_parts``) under
    ``algo``; ``device``: where the bytes live (a ``torch.device``; None is DRAM)."""
    if algo == VRAM_ALGORITHM:
        return wsum32_sums(kv_addr, block_bytes, segments, blocks, device)
    if algo != ALGORITHM:
        raise ValueError(f"unknown checksum function {algo!r} (known: {', '.join(ALGORITHMS)})")
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError("crc32 reads the bytes in place: DRAM only")
    crc32 = zlib.crc32
    if not segments:
        span = _span(block_bytes)
        return [crc32(span.from_address(kv_addr + b * block_bytes)) for b in blocks]
    return [block_sum(block_parts(kv_addr, block_bytes, segments, b)) for b in blocks]


# -- wsum32: computed where the bytes live ------------------------------------------------
_WEIGHTS: dict[tuple[str, int, int], torch.Tensor] = {}  # (device, first word, words) -> tensor
MAX_WEIGHT_VECTORS = 64  # cap on cached weight vectors (one per segment length and offset)


class _DeviceBytes:
    """``nbytes`` of device memory at ``addr``, as the CUDA array interface describes
    them (torch wraps it without a copy)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (addr, False), "version": 3,
                                         "strides": None}


def _raw(addr: int, nbytes: int, device: object) -> torch.Tensor:
    """A uint8 tensor aliasing ``nbytes`` at ``addr`` on ``device`` (no copy)."""
    import torch

    dev = torch.device("cpu") if device is None else torch.device(str(device))
    if dev.type == "cuda":
        return torch.as_tensor(_DeviceBytes(addr, nbytes), device=dev)
    return torch.frombuffer(_span(nbytes).from_address(addr), dtype=torch.uint8)


def _weights(device: torch.device, first: int, n: int) -> torch.Tensor:
    """Weights ``2*i + 1`` of words ``first .. first + n - 1`` (int64, on ``device``)."""
    import torch

    key = (str(device), first, n)
    w = _WEIGHTS.get(key)
    if w is None:
        if len(_WEIGHTS) >= MAX_WEIGHT_VECTORS:  # at the cap: start over (a cache only)
            _WEIGHTS.clear()
        w = _WEIGHTS[key] = torch.arange(first, first + n, dtype=torch.int64,
                                         device=device) * 2 + 1
    return w


def wsum32_sums(kv_addr: int, block_bytes: int, segments: Sequence[tuple[int, int, int]],
                blocks: Sequence[int], device: object = None) -> list[int]:
    """``wsum32`` of each of ``blocks``, computed by torch on ``device`` (a batch of
    blocks per segment: a gather, a multiply and a sum per segment, whatever the number
    of blocks). Segments whose length is not a multiple of 4 are zero-padded to whole
    words, each on its own."""
    import torch

    if not blocks:
        return []
    segs = segments or [(kv_addr, block_bytes, block_bytes)]
    dev = torch.device("cpu") if device is None else torch.device(str(device))
    idx = torch.tensor(list(blocks), dtype=torch.int64, device=dev)
    hi = max(blocks)
    total = torch.zeros(len(blocks), dtype=torch.int64, device=dev)
    first = 0
    for base, stride, ln in segs:
        raw = _raw(base, hi * stride + ln, dev)
        rows = raw.as_strided((hi + 1, ln), (stride, 1)).index_select(0, idx)
        if ln % 4:
            rows = torch.nn.functional.pad(rows, (0, 4 - ln % 4))
        words = rows.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        nw = words.shape[1]
        total += (words * _weights(dev, first, nw)).sum(dim=1)  # wraps mod 2**64
        first += nw
    out: list[int] = (total & 0xFFFFFFFF).tolist()
    return out


def wsum32_reference(data: bytes) -> int:
    """``wsum32`` of ``data`` in plain Python (the definition, for the tests)."""
    if len(data) % 4:
        data = data + bytes(4 - len(data) % 4)
    return sum((2 * i + 1) * int.from_bytes(data[4 * i:4 * i + 4], "little")
               for i in range(len(data) // 4)) & 0xFFFFFFFF


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
