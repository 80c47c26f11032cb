"""Thin helpers around the ``nixl`` Python API (no lifecycle decisions here).

* ``make_agent``      -- a UCX agent (UCX left at its defaults);
* ``KVRegion``        -- a KV cache ``uint8[num_blocks, block_bytes]`` plus a slot
  tensor ``int64[2 * num_blocks]`` (generation stamps, then block checksums), both
  registered with the agent; or, with ``tensors=``,
  an engine's own KV-cache tensors (e.g. vLLM's, one per layer) described as
  *segments* (base address, block stride, bytes per block) plus its own stamp tensor;
* ``prep_blocks``     -- prepared descriptor lists, one descriptor per block, for the local
  region or a remote one described by plain numbers from the handshake;
* ``Xfer``            -- one READ with exception-safe post/poll/release: NIXL raises typed
  exceptions on negative status codes; they become outcome strings here, and a handle
  whose release fails is kept (its blocks stay pinned) rather than dropped.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvproto.nixl.checksum import ALGO_KEY, algorithm_for, region_sums
from kvproto.wire import Layout

log = logging.getLogger(__name__)

GEN_BYTES = 8  # int64 generation stamp per block

# Outcomes of post/poll.
PROC = "proc"
DONE = "done"
# Errors: "error:<name>", e.g. "error:remote_disconnect".
DISCONNECT = "error:remote_disconnect"
NOT_FOUND = "error:not_found"

_ERROR_NAMES = {
    "nixlRemoteDisconnectError": "remote_disconnect",
    "nixlNotFoundError": "not_found",
    "nixlBackendError": "backend",
    "nixlInvalidParamError": "invalid_param",
    "nixlMismatchError": "mismatch",
    "nixlNotAllowedError": "not_allowed",
    "nixlNotPostedError": "not_posted",
    "nixlRepostActiveError": "repost_active",
    "nixlUnknownError": "unknown",
    "nixlNotSupportedError": "not_supported",
    "nixlCancelledError": "canceled",
}


# nixl 1.5.1's serialized agent metadata starts with the agent's name:
# b"nixlSerDes|" b"Agent" <length u64 little endian> <name> b"|" (then "Conns", backends...).
_MD_PREFIX = b"nixlSerDes|Agent"
_MD_LEN = struct.Struct("<Q")
MAX_AGENT_NAME_BYTES = 1024


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name inside NIXL agent metadata, read without loading it; None when the
    bytes do not have that shape (then they must not be loaded either)."""
    start = len(_MD_PREFIX) + _MD_LEN.size
    if not isinstance(metadata, bytes) or not metadata.startswith(_MD_PREFIX) \
            or len(metadata) < start:
        return None
    (n,) = _MD_LEN.unpack_from(metadata, len(_MD_PREFIX))
    if not 1 <= n <= MAX_AGENT_NAME_BYTES or metadata[start + n:start + n + 1] != b"|":
        return None
    try:
        return metadata[start:start + n].decode("utf-8")
    except UnicodeDecodeError:
        return None


def error_name(exc: BaseException) -> str:
    """A short stable token for a NIXL exception (``"error:<name>"``)."""
    return "error:" + _ERROR_NAMES.get(type(exc).__name__, type(exc).__name__)


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return False
    return True


def quiet_nixl_logging(level: int = logging.WARNING) -> None:
    """Raise the ``nixl`` logger's level. NIXL configures that logger (INFO, to stdout)
    when it is first imported, so import it first: setting the level earlier is undone."""
    try:
        import nixl._api  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return
    logging.getLogger("nixl").setLevel(level)


# make_agent's amendment of NIXL's agent config is one swap of a module attribute: one
# agent construction at a time in this process.
_AGENT_LOCK = threading.Lock()


def make_agent(name: str, *, progress_thread: bool = False, progress_delay_us: int = 0
               ) -> Any:
    """Create a UCX agent named ``name``. UCX environment variables are left alone.

    The progress thread is off by default: the adapters poll from their step loops
    (transfer state and notifications make progress when polled). With it on,
    ``progress_delay_us`` > 0 makes the thread sleep that long between its progress passes
    (NIXL's ``pthrDelay``). NIXL's Python API fixes that delay at 0, a busy loop that
    costs about one core whether or not anything moves; a delay of tens of microseconds
    cuts that to about 2 % of a core (``kvproto bench idle --path server``), and a READ
    that needs this side's progress waits at most one delay longer."""
    import sys

    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    if not progress_thread or progress_delay_us <= 0:
        return nixl_agent(name, cfg)
    bind = getattr(sys.modules[nixl_agent.__module__], "nixlBind", None)
    if bind is None or not hasattr(bind, "nixlAgent"):  # pragma: no cover - other build
        log.warning("NIXL build without nixlBind.nixlAgent: progress thread busy-polls")
        return nixl_agent(name, cfg)
    native = bind.nixlAgent

    def with_delay(agent_name: str, agent_cfg: Any) -> Any:
        agent_cfg.pthrDelay = int(progress_delay_us)
        return native(agent_name, agent_cfg)

    with _AGENT_LOCK:
        bind.nixlAgent = with_delay
        try:
            return nixl_agent(name, cfg)
        finally:
            bind.nixlAgent = native


def default_device() -> str:
    """``cuda`` (VRAM) when CUDA is present, else ``cpu`` (DRAM)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class RemoteRegion:
    """A peer's registered region, as plain numbers from its handshake (never pickle)."""

    kv_addr: int
    gen_addr: int
    dev_id: int
    mem: str  # "DRAM" or "VRAM"
    num_blocks: int
    block_bytes: int
    # (base address, block stride, bytes per block) per segment; () = one contiguous
    # segment at kv_addr with stride = length = block_bytes.
    segments: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_extra(cls, extra: dict[str, Any], layout: Layout) -> RemoteRegion:
        def num(v: Any) -> int:  # a JSON integer within a u64: nothing is coerced
            if type(v) is not int or not 0 <= v < 1 << 64:
                raise TypeError(f"{str(v)[:40]!r} is not an integer in [0, 2^64)")
            return v

        try:
            raw = extra.get("segments", ())
            if not isinstance(raw, (list, tuple)):
                raise TypeError("segments must be a list")
            segs = tuple((num(a), num(st), num(ln)) for a, st, ln in raw)
            mem = extra["mem"]
            if not isinstance(mem, str):
                raise TypeError("mem must be a string")
            r = cls(num(extra["kv_addr"]), num(extra["gen_addr"]), num(extra["dev_id"]),
                    mem, layout.num_blocks, layout.block_bytes, segs)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"handshake lacks region fields: {e}") from None
        if r.mem not in ("DRAM", "VRAM") or r.kv_addr <= 0 or r.gen_addr <= 0 or r.dev_id < 0:
            raise ValueError(f"bad region description {extra!r}")
        if segs and (len(segs) > MAX_SEGMENTS or sum(ln for _, _, ln in segs) != r.block_bytes
                     or any(a <= 0 or ln <= 0 or st < ln for a, st, ln in segs)):
            raise ValueError("bad segment description")
        return r

    def block_index(self, blocks: Sequence[int]) -> list[int]:
        """Descriptor indices of ``blocks`` in this region's prepared KV dlist."""
        return segment_index(len(self.segments), self.num_blocks, blocks)

    def head_slice(self, heads: int, first: int, count: int) -> RemoteRegion:
        """The same region restricted to KV heads ``first .. first + count`` of the
        ``heads`` each block of each segment holds, the head dimension outermost within
        a block (vLLM's CPU layout (N, H, block size, 2 x head size)): one descriptor per
        segment and block, as for whole blocks, ``count / heads`` of the bytes. Raises
        ValueError when the segments cannot be cut so."""
        if not self.segments:
            raise ValueError("a head slice needs the engine's KV segments")
        if not (1 <= count <= heads and 0 <= first <= heads - count):
            raise ValueError(f"heads {first}+{count} outside 0..{heads}")
        segs = []
        for base, stride, ln in self.segments:
            if ln % heads:
                raise ValueError(f"a block of {ln} bytes does not split into {heads} heads")
            per = ln // heads
            segs.append((base + first * per, stride, count * per))
        return replace(self, segments=tuple(segs), block_bytes=sum(x[2] for x in segs))


MAX_SEGMENTS = 4096  # cap on segments per region (e.g. layers x K/V)


def segment_index(nseg: int, num_blocks: int, blocks: Sequence[int]) -> list[int]:
    """Descriptor indices of ``blocks`` in a dlist of ``nseg`` segments (segment-major;
    one segment, or none described, is the identity)."""
    if nseg <= 1:
        return list(blocks)
    return [s * num_blocks + b for s in range(nseg) for b in blocks]


def tensor_segments(tensors: Sequence[torch.Tensor], num_blocks: int
                    ) -> tuple[list[tuple[int, int, int]], str]:
    """Describe external KV-cache tensors as segments ``(base, block stride, bytes per
    block)``. In each tensor the block dimension is the first one of size ``num_blocks``;
    the dimensions before it are split into separate segments, the ones after it must be
    contiguous (one block of one segment is one descriptor). Tensors sharing storage are
    counted once. Returns the segments and a dtype tag naming their shape, so that peers
    with different layouts refuse each other at the handshake."""
    segs: list[tuple[int, int, int]] = []
    seen: set[int] = set()
    dtypes: set[str] = set()
    for t in tensors:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        shape, strides, es = list(t.shape), list(t.stride()), t.element_size()
        try:
            d = shape.index(num_blocks)
        except ValueError:
            raise ValueError(f"KV tensor of shape {tuple(shape)} has no dimension of "
                             f"{num_blocks} blocks") from None
        inner = 1
        for k in range(len(shape) - 1, d, -1):
            if strides[k] != inner:
                raise ValueError(f"KV tensor of shape {tuple(shape)} is not contiguous "
                                 "within a block")
            inner *= shape[k]
        outer: list[int] = [0]
        for k in range(d):
            outer = [o + i * strides[k] * es for o in outer for i in range(shape[k])]
        for o in outer:
            segs.append((t.data_ptr() + o, strides[d] * es, inner * es))
        dtypes.add(str(t.dtype).replace("torch.", ""))
    if not segs or len(segs) > MAX_SEGMENTS:
        raise ValueError(f"{len(segs)} KV segments (need 1..{MAX_SEGMENTS})")
    tag = f"{'+'.join(sorted(dtypes))}/{len(segs)}x{segs[0][2]}"
    return segs, tag


def drop_native(agent: Any) -> None:
    """Let go of ``agent``'s native NIXL agent now, after its owner closed: it (and its
    progress thread, a busy loop) ends once no transfer or descriptor handle holds it.
    Without this it ends only when the cyclic GC collects the owner's objects, which can
    be minutes in a process that allocates little, while the thread keeps one core busy.
    Any later call on ``agent`` raises AttributeError."""
    with contextlib.suppress(AttributeError):
        del agent.agent


class KVRegion:
    """KV blocks plus per-block generation stamps, registered with one agent.

    With ``tensors`` the KV blocks are the caller's (an engine's KV cache, registered
    in place); only the stamp tensor is allocated here."""

    def __init__(self, agent: Any, num_blocks: int, block_bytes: int, *,
                 device: str = "cpu", tensors: Sequence[torch.Tensor] | None = None) -> None:
        self.agent = agent
        self.num_blocks = num_blocks
        self.device = device
        self.segments: list[tuple[int, int, int]] = []
        self.dtype_tag = "uint8"
        if tensors:
            self.segments, self.dtype_tag = tensor_segments(tensors, num_blocks)
            block_bytes = sum(ln for _, _, ln in self.segments)
            self.kv = tensors[0]
            device = str(tensors[0].device)
        else:
            self.kv = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=device)
        self.block_bytes = block_bytes
        # The stamp slots, then the checksum slots (``Config.checksums``): one int64 each
        # per block in one registered tensor, so that one READ fetches both.
        self.slots = torch.zeros((2 * num_blocks,), dtype=torch.int64, device=device)
        self.gen = self.slots[:num_blocks]
        self.sums = self.slots[num_blocks:]
        self.mem = "VRAM" if self.kv.is_cuda else "DRAM"
        self.sum_algo = algorithm_for(self.mem)  # the checksum function P seals with
        self.dev_id = self.kv.get_device() if self.kv.is_cuda else 0
        if tensors:
            uniq = list({int(t.data_ptr()): t for t in tensors}.values())
            self._reg = agent.register_memory([*uniq, self.slots])
        else:
            self._reg = agent.register_memory([self.kv, self.slots])
        self._local_kv: Any = None
        self._local_gen: Any = None

    def layout(self, tp_rank: int = 0, tp_size: int = 1) -> Layout:
        return Layout(self.num_blocks, self.block_bytes, self.dtype_tag, tp_rank, tp_size)

    def extra(self) -> dict[str, Any]:
        """Plain numbers a peer needs to address this region (goes in the handshake)."""
        e: dict[str, Any] = {"kv_addr": int(self.kv.data_ptr()),
                             "gen_addr": int(self.gen.data_ptr()),
                             "dev_id": int(self.dev_id), "mem": self.mem,
                             ALGO_KEY: self.sum_algo}
        if self.segments:
            e["segments"] = [list(s) for s in self.segments]
        return e

    def as_remote(self) -> RemoteRegion:
        e = self.extra()
        return RemoteRegion(e["kv_addr"], e["gen_addr"], e["dev_id"], e["mem"],
                            self.num_blocks, self.block_bytes, tuple(self.segments))

    def block_sums(self, blocks: Sequence[int], algo: str | None = None) -> list[int]:
        """The checksum of each of ``blocks`` as it holds now under ``algo`` (default:
        this region's own function; ``kvproto.nixl.checksum``), computed where the bytes
        live: in place in DRAM, by the device in VRAM."""
        return region_sums(int(self.kv.data_ptr()), self.block_bytes, self.segments, blocks,
                           algo or self.sum_algo, self.kv.device)

    def block_index(self, blocks: Sequence[int]) -> list[int]:
        """Descriptor indices of ``blocks`` in ``local_dlists()[0]``."""
        return segment_index(len(self.segments), self.num_blocks, blocks)

    def local_dlists(self) -> tuple[Any, Any]:
        """Prepared local descriptor lists (blocks, generation stamps); built once."""
        if self._local_kv is None:
            self._local_kv, self._local_gen = prep_blocks(self.agent, "", self.as_remote())
        return self._local_kv, self._local_gen

    def close(self) -> None:
        for h in (self._local_kv, self._local_gen):
            if h is not None:
                try:
                    self.agent.release_dlist_handle(h)
                except Exception as e:  # pragma: no cover - teardown
                    log.debug("release_dlist_handle: %s", e)
        self._local_kv = self._local_gen = None
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as e:  # pragma: no cover - teardown
            log.debug("deregister_memory: %s", e)


def prep_blocks(agent: Any, peer: str, region: RemoteRegion) -> tuple[Any, Any]:
    """Prepared dlists (one descriptor per block; one per generation stamp, then one per
    checksum slot: descriptor ``num_blocks + b`` is block ``b``'s checksum).

    ``peer`` is ``""`` for the local side, else the remote agent's name."""
    bb = region.block_bytes
    if region.segments:  # segment-major, see segment_index
        kv = [(base + i * stride, ln, region.dev_id) for base, stride, ln in region.segments
              for i in range(region.num_blocks)]
    else:
        kv = [(region.kv_addr + i * bb, bb, region.dev_id) for i in range(region.num_blocks)]
    gen = [(region.gen_addr + i * GEN_BYTES, GEN_BYTES, region.dev_id)
           for i in range(2 * region.num_blocks)]
    h_kv = agent.prep_xfer_dlist(peer, kv, region.mem)
    h_gen = agent.prep_xfer_dlist(peer, gen, region.mem)
    return h_kv, h_gen


class Xfer:
    """One READ. ``poll`` never raises; ``release`` refuses while in progress."""

    __slots__ = ("agent", "handle", "nbytes", "posted", "released", "state")

    def __init__(self, agent: Any, handle: Any, nbytes: int) -> None:
        self.agent = agent
        self.handle = handle
        self.nbytes = nbytes
        self.state = "new"
        self.posted = False
        self.released = False

    @classmethod
    def make_read(cls, agent: Any, local: Any, local_idx: Sequence[int], remote: Any,
                  remote_idx: Sequence[int], notif: bytes, nbytes: int) -> Xfer | str:
        """Build a READ; on failure return the error token."""
        try:
            h = agent.make_prepped_xfer(
                "READ", local, local_idx if type(local_idx) is list else list(local_idx),
                remote, remote_idx if type(remote_idx) is list else list(remote_idx), notif)
        except Exception as e:
            log.warning("make_prepped_xfer failed: %s", e)
            return error_name(e)
        return cls(agent, h, nbytes)

    def post(self) -> str:
        try:
            st = self.agent.transfer(self.handle)
        except Exception as e:
            self.state = error_name(e)
            return self.state
        self.posted = True
        self.state = DONE if st == "DONE" else PROC if st == "PROC" else "error:post"
        return self.state

    def poll(self) -> str:
        if self.state != PROC:
            return self.state
        try:
            st = self.agent.check_xfer_state(self.handle)
        except Exception as e:
            self.state = error_name(e)
            return self.state
        self.state = DONE if st == "DONE" else PROC if st == "PROC" else "error:xfer"
        return self.state

    @property
    def in_progress(self) -> bool:
        return self.state == PROC

    def release(self) -> bool:
        """Release the handle unless a post is still in progress. True when released."""
        if self.released:
            return True
        if self.in_progress:
            return False
        try:
            self.agent.release_xfer_handle(self.handle)
        except Exception as e:
            log.warning("release_xfer_handle failed (%s): handle kept", error_name(e))
            return False
        self.released = True
        return True


_PATTERN_BASE: dict[tuple[int, str], torch.Tensor] = {}


def fill_pattern(key: str, index: int, nbytes: int, device: str | torch.device = "cpu"
                 ) -> torch.Tensor:
    """Deterministic bytes for logical block ``index`` of request (or group) ``key``.

    A view into a cached pseudo-random buffer at an offset derived from (key, index):
    cheap to produce and to compare, and different for different (key, index) pairs
    with overwhelming probability. Do not write to the result."""
    import zlib

    dev = str(device)
    base = _PATTERN_BASE.get((nbytes, dev))
    if base is None:
        g = torch.Generator().manual_seed(0x6B7670)
        base = torch.randint(0, 256, (2 * nbytes,), dtype=torch.uint8, generator=g).to(dev)
        _PATTERN_BASE[(nbytes, dev)] = base
    off = zlib.crc32(f"{key}/{index}".encode()) % nbytes
    return base[off:off + nbytes]
