"""The drivers' transports over NIXL (the contract: :mod:`kvproto.nixl.driver`).

* :class:`NixlPTransport` -- P's agent, its registered KV cache and generation stamps
  (``KVRegion``), and the handshake listener (``channel.Server``);
* :class:`NixlDTransport` -- one D rank's agent and KV cache (the landing area and the
  local stamp slots), one handshake connection per P engine (``channel.Client``), the
  prepared descriptor lists of every P engine it reads, and the READs themselves
  (``agent.Xfer``).

No lifecycle decision and no protocol bookkeeping here: those are the drivers'. NIXL
raises typed exceptions; they become error tokens (``agent.error_name``) or
``PeerError``, never an exception into the driver.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvproto.nixl.agent import (
    KVRegion,
    RemoteRegion,
    Xfer,
    drop_native,
    error_name,
    make_agent,
    metadata_agent_name,
    prep_blocks,
)
from kvproto.nixl.channel import ST_OK, Client, Server, frame, refusal
from kvproto.nixl.checksum import ALGO_KEY, ALGORITHM, can_verify
from kvproto.nixl.driver import PROC, Accept, HandshakeHandler, PeerError, Refuse
from kvproto.wire import Handshake, Layout

log = logging.getLogger(__name__)

# A remote agent's metadata load (NIXL add_remote_agent) slower than this is logged: it
# takes tens of milliseconds here, and seconds were seen on an overloaded 2-core host.
SLOW_METADATA_LOAD_S = 1.0


def _add_remote_agent(agent: Any, metadata: bytes, peer: str) -> Any:
    """``agent.add_remote_agent(metadata)``, logged when slow: it runs on the thread that
    polls the adapter (an engine's step loop), so every request of the engine waited.
    The warning gives the thread's CPU time beside the wall time: CPU time close to the
    wall time is work done on a starved host; much less is a wait (a lock, a peer)."""
    t0 = time.monotonic()
    c0 = time.thread_time()
    name = agent.add_remote_agent(metadata)
    took = time.monotonic() - t0
    if took > SLOW_METADATA_LOAD_S:
        log.warning("loading the NIXL metadata of %s took %.1f s, %.2f s of it on this "
                    "thread's CPU (the thread was blocked meanwhile)", peer[:64], took,
                    time.thread_time() - c0)
    return name


def _notifs(agent: Any) -> list[tuple[str, bytes]]:
    """The agent's new notifications as (peer, bytes), in order per peer."""
    got: dict[Any, list[bytes]] = agent.get_new_notifs()
    out: list[tuple[str, bytes]] = []
    for peer, msgs in got.items():
        name = peer.decode(errors="replace") if isinstance(peer, bytes) else str(peer)
        out += [(name, m) for m in msgs]
    return out


def _send(agent: Any, peer: str, buf: bytes) -> str | None:
    try:
        agent.send_notif(peer, buf)
    except Exception as e:
        return error_name(e)
    return None


class NixlPTransport:
    """P's side of NIXL: agent, KV cache with stamps, handshake listener."""

    def __init__(self, name: str, *, num_blocks: int, block_bytes: int, device: str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1, host: str = "127.0.0.1", port: int = 0,
                 progress_thread: bool = False, progress_delay_us: int = 0,
                 kv_tensors: Sequence[torch.Tensor] | None = None,
                 handshake_secret: bytes | None = None, threaded: bool = False,
                 checksums: bool = False) -> None:
        """``threaded``: serve the handshake listener from a thread of its own (see
        ``PTransport.threaded``). ``checksums``: ``seal`` will be called (computed where
        the blocks live: CRC-32 in DRAM, ``wsum32`` on the GPU; ``kvproto.nixl.checksum``)."""
        self.agent = make_agent(name, progress_thread=progress_thread,
                                progress_delay_us=progress_delay_us)
        self.region = KVRegion(self.agent, num_blocks, block_bytes, device=device,
                               tensors=kv_tensors)
        self._gen_view = None if self.region.gen.is_cuda else self.region.gen.numpy()
        self._sum_view = None if self.region.sums.is_cuda else self.region.sums.numpy()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.threaded = threaded
        self._handler: HandshakeHandler | None = None
        self._on_closed: Callable[[str], None] | None = None
        self.server = Server(self._handle, host=host, port=port, on_close=self._closed,
                             secret=handshake_secret, threaded=threaded)
        self.host = self.server.host
        self.port = self.server.port
        self._closed_down = False

    def layout(self) -> Layout:
        return self.region.layout(self.tp_rank, self.tp_size)

    def extra(self) -> dict[str, Any]:
        return self.region.extra()

    # -- handshakes ---------------------------------------------------------------------
    def attach(self, handler: HandshakeHandler, on_closed: Callable[[str], None]) -> None:
        self._handler = handler
        self._on_closed = on_closed

    def _handle(self, conn: int, payload: bytes, authed: bool) -> tuple[bytes, str]:
        assert self._handler is not None, "no driver attached"
        r = self._handler(conn, payload, authed)
        if isinstance(r, Accept):
            return frame(ST_OK, r.payload), r.peer
        assert isinstance(r, Refuse)
        return refusal(r.reason, r.detail), ""

    def _closed(self, peer: str) -> None:
        if self._on_closed is not None:
            self._on_closed(peer)

    def serve(self, now: int) -> None:
        self.server.poll(now / 1000)  # the channel's timeouts are in seconds

    def conn_open(self, conn: int) -> bool:
        return self.server.is_open(conn)

    def drop_conn(self, conn: int) -> None:
        self.server.drop(conn)

    def metadata_name(self, metadata: bytes) -> str | None:
        return metadata_agent_name(metadata)

    def load_peer(self, metadata: bytes) -> str:
        try:
            name = _add_remote_agent(self.agent, metadata, "a D engine")
        except Exception as e:
            raise PeerError("metadata", error_name(e), final=False) from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def unload_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("remove_remote_agent(%s): %s", name[:64], error_name(e))

    # -- notifications and stamps --------------------------------------------------------
    def receive(self) -> list[tuple[str, bytes]]:
        return _notifs(self.agent)

    def send(self, peer: str, buf: bytes) -> str | None:
        return _send(self.agent, peer, buf)

    def stamps(self, blocks: Sequence[int]) -> tuple[int, ...]:
        gv = self._gen_view
        if gv is None:  # pragma: no cover - VRAM only
            return tuple(int(g) for g in self.region.gen[list(blocks)].tolist()) if blocks else ()
        if len(blocks) <= 8:  # scalar reads: numpy fancy indexing costs ~7 us
            return tuple([int(gv[b]) for b in blocks])
        return tuple(gv[list(blocks)].tolist())

    def bump(self, blocks: Sequence[int]) -> None:
        gv = self._gen_view
        if gv is None:  # pragma: no cover - VRAM only
            idx = torch.tensor(list(blocks), dtype=torch.int64, device=self.region.gen.device)
            self.region.gen[idx] += 1
            torch.cuda.synchronize(self.region.gen.device)
        elif len(blocks) <= 8:  # numpy fancy indexing costs ~7 us
            for b in blocks:
                gv[b] += 1
        else:
            gv[list(blocks)] += 1

    def seal(self, blocks: Sequence[int]) -> None:
        sv = self._sum_view
        sums = self.region.block_sums(blocks)
        if sv is None:  # VRAM: the sums were computed on the device; one small copy back
            dev = self.region.sums.device
            idx = torch.tensor(list(blocks), dtype=torch.int64, device=dev)
            self.region.sums[idx] = torch.tensor(sums, dtype=torch.int64, device=dev)
            torch.cuda.synchronize(dev)  # sealed before any READ can be told of them
        elif len(blocks) <= 8:
            for b, c in zip(blocks, sums, strict=True):
                sv[b] = c
        else:
            sv[list(blocks)] = sums

    def close(self) -> None:
        if self._closed_down:
            return
        self._closed_down = True
        self.server.close()
        self.region.close()
        drop_native(self.agent)


class _Remote:
    """One P engine as the transport knows it: its handshake connection and, once
    loaded, its region and prepared descriptor lists."""

    __slots__ = ("client", "region", "remote_gen", "remote_kv", "stale_handles", "sum_algo")

    def __init__(self) -> None:
        self.client: Client | None = None
        self.region: RemoteRegion | None = None
        self.remote_kv: Any = None
        self.remote_gen: Any = None
        self.stale_handles: list[Any] = []  # dlists to release once no READ uses them
        self.sum_algo: str | None = None  # the checksum function P seals with


class NixlDTransport:
    """One D rank's side of NIXL: agent, KV cache (landing area and stamp slots), a
    handshake connection and prepared descriptor lists per P engine, the READs."""

    def __init__(self, name: str, *, num_blocks: int, block_bytes: int, device: str = "cpu",
                 tp_rank: int = 0, tp_size: int = 1, progress_thread: bool = False,
                 kv_tensors: Sequence[torch.Tensor] | None = None,
                 handshake_secret: bytes | None = None, checksums: bool = False) -> None:
        """``checksums``: READs will verify block checksums, with the function each P
        seals with (a P whose function this memory cannot compute is refused at the
        handshake, ``checksums_unsupported``)."""
        self.checksums = checksums
        self.agent = make_agent(name, progress_thread=progress_thread)
        self.region = KVRegion(self.agent, num_blocks, block_bytes, device=device,
                               tensors=kv_tensors)
        self.local_kv, self.local_gen = self.region.local_dlists()
        self._gen_view = None if self.region.gen.is_cuda else self.region.gen.numpy()
        self._sum_view = None if self.region.sums.is_cuda else self.region.sums.numpy()
        self.num_blocks = num_blocks
        self.block_bytes = self.region.block_bytes
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.handshake_secret = handshake_secret
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.remotes: dict[str, _Remote] = {}
        self.zombies: list[Xfer] = []  # transfers whose release failed: kept, retried
        self._stale = False
        # TEST ONLY (connector option test_hold_read_s): a data READ reports in progress
        # for this many seconds after its post, whatever NIXL says: a READ that does not
        # complete, for the bounded-read tests. id(xfer) -> (xfer, time it may report).
        self.hold_reads_s = 0.0
        self._held: dict[int, tuple[Any, float]] = {}
        # Head slices: P engine -> (its KV heads per block, first head, heads) this rank
        # reads of each of its blocks (tensor parallelism, kvproto.lifecycle.topology);
        # an engine absent here is read whole. Set before the engine's handshake; at most
        # one entry per P engine this rank reads.
        self.slices: dict[str, tuple[int, int, int]] = {}
        # The mirror image, for P engines whose blocks fill only some of the heads of this
        # rank's block (P TP 2 -> D TP 1 with split heads: one part per P rank): P engine
        # -> (this rank's KV heads per block, first head, heads) its READs land in, and
        # the stamp slot set its stamp READs land in (0: the region's own slots; part k
        # of a request has set k, so that two parts of one request, which share local
        # blocks, never share a stamp slot). Set before the engine's handshake; one
        # entry per P engine. Local slices and slot sets are built once per value
        # (at most one per head range and part of this rank's plan).
        self.local_slices: dict[str, tuple[int, int, int]] = {}
        self.stamp_set: dict[str, int] = {}
        self._local_sets: dict[tuple[tuple[int, int, int] | None, int], tuple[Any, Any]] = {}
        self._slot_sets: dict[int, tuple[torch.Tensor, Any]] = {}
        self._local_bytes: dict[str, int] = {}  # engine -> bytes of one local (sliced) block

    def layout(self) -> Layout:
        return self.region.layout(self.tp_rank, self.tp_size)

    def _slots(self, k: int) -> torch.Tensor:
        """Stamp slot set ``k`` (stamps, then checksum slots: 2 per local block)."""
        if k == 0:
            return self.region.slots
        got = self._slot_sets.get(k)
        if got is None:
            t = torch.zeros_like(self.region.slots)
            got = self._slot_sets[k] = (t, self.agent.register_memory([t]))
        return got[0]

    def _local_set(self, engine: str) -> tuple[Any, Any]:
        """The local (KV, stamp) dlists the READs of ``engine`` land in."""
        ls, k = self.local_slices.get(engine), self.stamp_set.get(engine, 0)
        if ls is None and k == 0:
            return self.local_kv, self.local_gen
        got = self._local_sets.get((ls, k))
        if got is None:
            region = self.region.as_remote()
            if ls is not None:
                region = region.head_slice(*ls)
            region = replace(region, gen_addr=int(self._slots(k).data_ptr()))
            got = self._local_sets[(ls, k)] = prep_blocks(self.agent, "", region)
        return got

    def _remote(self, engine: str) -> _Remote:
        r = self.remotes.get(engine)
        if r is None:
            r = self.remotes[engine] = _Remote()
        return r

    # -- notifications -------------------------------------------------------------------
    def receive(self) -> list[tuple[str, bytes]]:
        return _notifs(self.agent)

    def send(self, engine: str, buf: bytes) -> str | None:
        return _send(self.agent, engine, buf)

    # -- handshakes ----------------------------------------------------------------------
    def connect(self, engine: str, host: str, port: int, payload: bytes) -> None:
        r = self._remote(engine)
        if r.client is not None:
            r.client.close()
        r.client = Client(host, port, payload, secret=self.handshake_secret)

    def poll_connect(self, engine: str) -> tuple[str, bytes | str] | None:
        r = self.remotes.get(engine)
        if r is None or r.client is None:
            return ("error", "no handshake in progress")
        return r.client.poll()

    def hangup(self, engine: str) -> None:
        r = self.remotes.get(engine)
        if r is not None and r.client is not None:
            r.client.close()
            r.client = None

    def alive(self, engine: str) -> bool:
        r = self.remotes.get(engine)
        return r is None or r.client is None or r.client.alive()

    def load_peer(self, engine: str, hs: Handshake) -> None:
        try:
            region = RemoteRegion.from_extra(hs.extra or {}, hs.layout)
            sl = self.slices.get(engine)
            if sl is not None:
                region = region.head_slice(*sl)
        except ValueError as e:
            raise PeerError("handshake_malformed", str(e), final=True) from None
        algo = (hs.extra or {}).get(ALGO_KEY, ALGORITHM)
        if self.checksums and not can_verify(algo, self.region.mem):
            raise PeerError("checksums_unsupported",
                            f"P seals {str(algo)[:32]!r} checksums, which this D cannot "
                            f"compute over {self.region.mem} (kvproto.nixl.checksum)",
                            final=True)
        ls = self.local_slices.get(engine)
        want = self.block_bytes
        if ls is not None:
            try:
                want = self.region.as_remote().head_slice(*ls).block_bytes
            except ValueError as e:
                raise PeerError("layout_mismatch", f"local head slice: {e}",
                                final=True) from None
        try:
            self._local_set(engine)  # built once, before any READ of the engine
        except Exception as e:
            raise PeerError("metadata", error_name(e), final=False) from e
        if (sl is not None or ls is not None) and region.block_bytes != want:
            raise PeerError("layout_mismatch", f"head slice of {region.block_bytes} B, "
                            f"local (slice of a) block {want} B", final=True)
        self._local_bytes[engine] = want
        md_name = metadata_agent_name(hs.agent_metadata)
        if md_name != engine:  # checked before loading: never replace another agent's
            raise PeerError("handshake_wrong_peer", f"metadata of {str(md_name)[:64]!r}",
                            final=True)
        r = self._remote(engine)
        r.sum_algo = str(algo)
        try:
            name = _add_remote_agent(self.agent, hs.agent_metadata, engine)
            name_s = name.decode() if isinstance(name, bytes) else str(name)
            if name_s != engine:  # pragma: no cover - the name was read out above
                raise PeerError("handshake_wrong_peer", f"metadata of {name_s!r}", final=True)
            r.remote_kv, r.remote_gen = prep_blocks(self.agent, engine, region)
        except PeerError:
            raise
        except Exception as e:
            raise PeerError("metadata", error_name(e), final=False) from e
        r.region = region

    def drop(self, engine: str) -> None:
        r = self.remotes.get(engine)
        if r is None:
            return
        if r.client is not None:
            r.client.close()
            r.client = None
        r.stale_handles += [h for h in (r.remote_kv, r.remote_gen) if h is not None]
        r.remote_kv = r.remote_gen = None
        r.region = None
        if r.stale_handles:
            self._stale = True

    # -- READs ---------------------------------------------------------------------------
    def post_read(self, engine: str, local: Sequence[int], remote: Sequence[int], *,
                  stamps: bool, sums: bool = False) -> tuple[Any, str]:
        r = self.remotes.get(engine)
        if r is None or r.region is None or r.remote_kv is None or r.remote_gen is None:
            return None, "error:peer_gone"
        local_kv, local_gen = self._local_set(engine)
        if stamps and sums:  # descriptor num_blocks + b: block b's checksum slot
            n, rn = self.num_blocks, r.region.num_blocks
            x = Xfer.make_read(self.agent, local_gen, [*local, *(n + b for b in local)],
                               r.remote_gen, [*remote, *(rn + b for b in remote)], b"", 0)
        elif stamps:
            x = Xfer.make_read(self.agent, local_gen, local, r.remote_gen, remote, b"", 0)
        else:
            if self.region.segments or r.region.segments:  # engine caches: descriptor indices
                li: Sequence[int] = self.region.block_index(local)
                ri: Sequence[int] = r.region.block_index(remote)
            else:
                li, ri = local, remote
            x = Xfer.make_read(self.agent, local_kv, li, r.remote_kv, ri, b"",
                               len(local) * self._local_bytes.get(engine, self.block_bytes))
        if isinstance(x, str):
            return None, x
        st: str = x.post()
        if self.hold_reads_s > 0 and not stamps:
            self._held[id(x)] = (x, time.monotonic() + self.hold_reads_s)
            return x, PROC
        return x, st

    def poll(self, xfer: Any) -> str:
        st: str = xfer.poll()
        held = self._held.get(id(xfer)) if self._held else None
        if held is not None:
            if time.monotonic() < held[1]:
                return PROC
            del self._held[id(xfer)]
        return st

    def release(self, xfer: Any) -> None:
        if not xfer.release():
            self.zombies.append(xfer)
            self._stale = True

    def landed_sums(self, local: Sequence[int]) -> list[int]:
        sv = self._sum_view
        if sv is None:  # VRAM
            got: list[int] = self.region.sums[torch.tensor(
                list(local), dtype=torch.int64, device=self.region.sums.device)].tolist()
            return got
        return [int(sv[i]) for i in local] if len(local) <= 8 else sv[list(local)].tolist()

    def block_sums(self, local: Sequence[int], engine: str = "") -> list[int]:
        r = self.remotes.get(engine)
        return self.region.block_sums(local, r.sum_algo if r is not None else None)

    def landed_stamps(self, local: Sequence[int], engine: str = "") -> list[int]:
        k = self.stamp_set.get(engine, 0) if engine else 0
        if k:  # a part's own slot set
            gen = self._slots(k)[:self.num_blocks]
            if gen.is_cuda:
                idx = torch.tensor(list(local), dtype=torch.int64, device=gen.device)
                return [int(g) for g in gen[idx].tolist()]
            return [int(g) for g in gen[list(local)].tolist()]
        gv = self._gen_view
        if gv is None:  # pragma: no cover - VRAM
            got: list[int] = self.region.gen[torch.tensor(
                list(local), dtype=torch.int64, device=self.region.gen.device)].tolist()
            return got
        # DRAM: a numpy view of the registered stamps. Few stamps: scalar reads (numpy
        # fancy indexing has a ~7 us fixed cost).
        return [int(gv[i]) for i in local] if len(local) <= 8 else gv[list(local)].tolist()

    def stale(self) -> bool:
        return self._stale

    def reap(self, busy: Collection[str], unknown: Collection[str]) -> None:
        if self.zombies:
            self.zombies = [x for x in self.zombies if (x.poll(), x.release())[1] is False]
        left = bool(self.zombies)
        for engine, r in self.remotes.items():
            if not r.stale_handles:
                continue
            if engine in busy:
                left = True
                continue
            for h in r.stale_handles:
                try:
                    self.agent.release_dlist_handle(h)
                except Exception as ex:
                    log.debug("release_dlist_handle: %s", error_name(ex))
            r.stale_handles = []
            if engine in unknown:
                try:
                    self.agent.remove_remote_agent(engine)
                except Exception as ex:
                    log.debug("remove_remote_agent(%s): %s", engine, error_name(ex))
        self._stale = left

    def close(self) -> None:
        for r in self.remotes.values():
            if r.client is not None:
                r.client.close()
                r.client = None
        for kv, gen in self._local_sets.values():
            for h in (kv, gen):
                try:
                    self.agent.release_dlist_handle(h)
                except Exception as ex:  # pragma: no cover - teardown
                    log.debug("release_dlist_handle: %s", error_name(ex))
        self._local_sets.clear()
        for _, reg in self._slot_sets.values():
            try:
                self.agent.deregister_memory(reg)
            except Exception as ex:  # pragma: no cover - teardown
                log.debug("deregister_memory: %s", error_name(ex))
        self._slot_sets.clear()
        self.region.close()
        drop_native(self.agent)
