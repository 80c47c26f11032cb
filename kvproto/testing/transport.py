"""The drivers' transports over a simulated network (the contract:
:mod:`kvproto.nixl.driver`), so that the simulator and the fuzzer run the production
drivers (:class:`~kvproto.nixl.driver_p.PDriver`, :class:`~kvproto.nixl.driver_d.DDriver`).

:class:`World` is everything outside the drivers: one clock, the wire
(:class:`Network`: the real encoded bytes, with their faults), P's memory (what each KV
block holds and its generation stamp), each D rank's landing area and stamp slots, the
handshake exchanges, and the READs in flight. :class:`SimPTransport` and
:class:`SimDTransport` are the drivers' views of it.

Faults (:class:`Faults`; a seed's own mix from :meth:`Faults.swarm`): loss, duplication,
reordering (random delays within ``max_delay``), delay beyond ``max_delay``, handshake
failures, partitions between P and a D rank (notifications dropped, handshakes
unreachable, READs failing with a disconnect), D rank crashes, a READ landing after
``max_read_time`` (outside the timing assumption: P may free its blocks meanwhile),
stamps changed by reuse (the
engine overwrites freed blocks at once), and data READs landing corrupted with their
stamps unchanged (``corrupt``: only block checksums catch it). Memory is modelled by what was written, not by
bytes: P's block ``b`` holds write ``content[b]``; a data READ copies the writes its
remote blocks hold *when it lands*, a stamp READ the stamps they carry then (and the
checksums P sealed in their checksum slots, with ``Config.checksums``).

Every time here is the machines' time, integer milliseconds (``World.now``); the
``Faults`` knobs and the config's durations are seconds, turned into ms where used.
"""

from __future__ import annotations

import heapq
import json
import random
import zlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kvproto.lifecycle import Config
from kvproto.nixl.driver import DISCONNECT, DONE, PROC, Accept, HandshakeHandler, PeerError
from kvproto.wire import Handshake, Layout

# What the simulated agents' metadata looks like (a name, nothing to load).
_MD = b"sim-agent:"
# A time (ms) that never comes: a handshake request the fuzzer has not sent on yet.
NEVER: Final = 1 << 62


@dataclass
class Faults:
    """Probabilities per message, per READ or per step; all zero = a perfect network."""

    loss: float = 0.02
    duplicate: float = 0.02
    max_delay: float | None = None  # None: the config's max_delay (the timing assumption)
    crash_rate: float = 0.0004  # per step, per live D rank (it restarts as a new reader)
    restart_after: float = 5.0  # a crashed rank comes back (new identity) after this long
    register_lag: float = 0.3  # fraction of requests whose P registration lags the params
    abort_p_rate: float = 0.02  # per step: abort a random held request on P
    abort_d_rate: float = 0.02  # per step: abort a random request on one D engine
    malformed_rate: float = 0.01  # per step: garbage into P's inbox, and into a D rank's
    handshake_fail: float = 0.05  # per handshake attempt: P unreachable
    sibling_rate: float = 0.15  # fraction of requests with n>1 siblings
    reorder: bool = True  # delays drawn within max_delay (else FIFO: every one max_delay)
    delay: float = 0.0  # fraction of messages delayed beyond max_delay (up to 4x)
    partition_rate: float = 0.0  # per step: cut one live D rank off P for a while
    late_read: float = 0.0  # fraction of READs landing after max_read_time (World.late_bound)
    reuse: float = 0.0  # fraction of freed blocks the engine overwrites at once
    # Fraction of data READs landing with one block's bytes changed and its stamp
    # unchanged (a NIC or backend fault). Only block checksums (``Config.checksums``)
    # catch it, so ``swarm`` never draws it: ``Simulator`` turns it on with checksums.
    corrupt: float = 0.0

    @classmethod
    def none(cls) -> Faults:
        return cls(loss=0, duplicate=0, crash_rate=0, abort_p_rate=0, abort_d_rate=0,
                   malformed_rate=0, handshake_fail=0)

    @classmethod
    def swarm(cls, rng: random.Random) -> Faults:
        """A seed's own fault mix (swarm testing): each fault is on with probability
        1/2, at a rate drawn log-uniformly within its range; the workload knobs
        (registration lag, siblings, reordering) are drawn too."""
        def pick(lo: float, hi: float) -> float:
            on = rng.random() < 0.5
            rate = lo * (hi / lo) ** rng.random()
            return rate if on else 0.0

        return cls(loss=pick(0.002, 0.2), duplicate=pick(0.002, 0.2),
                   crash_rate=pick(1e-4, 2e-3), register_lag=rng.uniform(0.0, 0.6),
                   abort_p_rate=pick(0.002, 0.05), abort_d_rate=pick(0.002, 0.05),
                   malformed_rate=pick(0.002, 0.05), handshake_fail=pick(0.01, 0.5),
                   sibling_rate=rng.uniform(0.0, 0.4), reorder=rng.random() < 0.5,
                   delay=pick(0.005, 0.1), partition_rate=pick(1e-4, 2e-3),
                   late_read=pick(0.01, 0.2), reuse=pick(0.1, 1.0))

    def mix(self) -> dict[str, float | bool]:
        """The faults that are on, with their rates (what a swarm seed drew)."""
        off = Faults.none()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("max_delay", "restart_after", "register_lag", "sibling_rate")
                and getattr(self, f.name) != getattr(off, f.name)}


@dataclass(order=True)
class Msg:
    at: int  # ms
    seq: int
    src: str = field(compare=False)
    dst: str = field(compare=False)
    data: bytes = field(compare=False)


class Network:
    """Delivers bytes after a random delay (within ``max_delay`` ms unless delayed); may
    lose, duplicate or delay them."""

    def __init__(self, rng: random.Random, faults: Faults, max_delay: int) -> None:
        self.rng = rng
        self.faults = faults
        self.max_delay = max_delay
        self.queue: list[Msg] = []
        self._seq = 0
        self.sent = self.lost = self.duplicated = self.delayed = 0

    def _delay(self) -> int:
        f = self.faults
        if f.delay and self.rng.random() < f.delay:
            self.delayed += 1
            return round(self.rng.uniform(self.max_delay, 4 * self.max_delay))
        return round(self.rng.uniform(0, self.max_delay)) if f.reorder else self.max_delay

    def send(self, now: int, src: str, dst: str, data: bytes) -> None:
        self.sent += 1
        if self.rng.random() < self.faults.loss:
            self.lost += 1
            return
        copies = 2 if self.rng.random() < self.faults.duplicate else 1
        self.duplicated += copies - 1
        for _ in range(copies):
            self._seq += 1
            heapq.heappush(self.queue, Msg(now + self._delay(), self._seq, src, dst, data))

    def due(self, now: int) -> list[Msg]:
        out = []
        while self.queue and self.queue[0].at <= now:
            out.append(heapq.heappop(self.queue))
        return out


@dataclass
class SimXfer:
    """One READ in flight: ``remote`` blocks of P into ``local`` ones of ``rank`` (their
    stamps into its stamp slots with ``stamps``), landing at ``end``."""

    rank: str
    local: tuple[int, ...]
    remote: tuple[int, ...]
    stamps: bool
    posted: int  # ms
    end: int
    late: bool = False
    state: str = PROC
    seq: int = 0
    sums: bool = False  # a stamp READ that fetches the checksum slots too
    corrupt: bool = False  # a data READ that lands with its first block's bytes changed


@dataclass
class HsAttempt:
    """One handshake exchange of ``rank`` with P: the request reaches P at ``at``; the
    answer (``result``) is ready at ``ready``."""

    rank: str
    payload: bytes
    at: int  # ms
    seq: int
    reachable: bool = True
    ready: int = NEVER
    result: tuple[str, bytes | str] | None = None


class World:
    """The clock, the wire, the memories, the handshakes and the READs of one simulated
    P rank and its D ranks. ``run_due`` makes everything due by ``now`` happen."""

    def __init__(self, rng: random.Random, faults: Faults, config: Config, net: Network,
                 capacity: int) -> None:
        self.rng = rng
        self.faults = faults
        self.config = config
        self.net = net
        self.now = 0  # ms
        self.inbox: dict[str, list[tuple[str, bytes]]] = {}
        self.content = [0] * capacity  # P's blocks: the write each one holds
        self.stamps = [0] * capacity  # P's generation stamps
        self.sums = [0] * capacity  # P's checksum slots (``seal``)
        self.writes = 0
        self.local: dict[str, list[int]] = {}  # D rank -> the write each local block holds
        self.local_stamps: dict[str, list[int]] = {}
        self.local_sums: dict[str, list[int]] = {}
        self.corrupted = 0  # data READs that landed corrupted
        self.xfers: list[SimXfer] = []  # posted, not landed yet
        self.attempts: dict[str, HsAttempt] = {}  # rank -> its handshake in progress
        self.down: set[str] = set()  # crashed D ranks
        self.cut: dict[str, int] = {}  # D rank -> end of its partition from P (ms)
        self.conns: dict[int, str] = {}  # P's handshake connections: id -> rank
        self.p: SimPTransport | None = None
        self.ranks: dict[str, SimDTransport] = {}
        self._seq = 0

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # -- faults --------------------------------------------------------------------------
    def cut_off(self, rank: str) -> bool:
        """Whether ``rank`` is partitioned from P now."""
        end = self.cut.get(rank)
        if end is None:
            return False
        if end <= self.now:
            del self.cut[rank]
            return False
        return True

    def partition(self, rank: str, until: int) -> None:
        self.cut[rank] = max(until, self.cut.get(rank, until))

    def crash(self, rank: str) -> None:
        """``rank`` dies: nothing reaches it any more and P's connection to it closes."""
        self.down.add(rank)
        self.attempts.pop(rank, None)
        for cid, r in list(self.conns.items()):
            if r == rank:
                del self.conns[cid]
                if self.p is not None and self.p.on_closed is not None:
                    self.p.on_closed(rank)

    def write(self, blocks: Sequence[int]) -> None:
        """P's engine writes new KV into ``blocks`` (a prefill, or a reuse)."""
        for b in blocks:
            self.writes += 1
            self.content[b] = self.writes

    # -- the wire ------------------------------------------------------------------------
    def send(self, src: str, dst: str, data: bytes) -> None:
        self.net.send(self.now, src, dst, data)

    def deliver(self, m: Msg) -> None:
        """One message arrives (unless its end is down or cut off)."""
        rank = m.src if m.dst not in self.ranks else m.dst
        if m.dst in self.down or self.cut_off(rank):
            self.net.lost += 1
            return
        self.inbox.setdefault(m.dst, []).append((m.src, m.data))

    # -- handshakes ----------------------------------------------------------------------
    def start_handshake(self, rank: str, payload: bytes) -> None:
        at = self.now + round(self.rng.uniform(5, 250))
        ok = self.rng.random() >= self.faults.handshake_fail
        self.attempts[rank] = HsAttempt(rank, payload, at, self._next(), reachable=ok)

    def answer(self, a: HsAttempt) -> None:
        """The request reaches P (or does not): the answer is ready after the way back."""
        p = self.p
        if not a.reachable or p is None or p.handler is None or self.cut_off(a.rank):
            a.result = ("error", "unreachable")
            a.ready = self.now
            return
        cid = self._next()
        self.conns[cid] = a.rank
        r = p.handler(cid, a.payload, False)
        if isinstance(r, Accept):
            a.result = ("ok", r.payload)
        else:
            a.result = ("refused", json.dumps({"reason": r.reason, "detail": r.detail}).encode())
            del self.conns[cid]
        a.ready = self.now + round(self.rng.uniform(5, 250))

    # -- READs ---------------------------------------------------------------------------
    def read_bound(self) -> int:
        """How long one transfer may take within the timing assumption (ms): a READ is a
        data transfer then a stamp transfer, posted at the next poll, and the whole must
        fit ``max_read_time``."""
        return self.config.ms.max_read_time // 3

    def late_bound(self) -> int:
        """How long a late READ may take (ms): long enough for P to free its blocks under
        it (a lease lapsing, an abort's grace running out) and reuse them."""
        m = self.config.ms
        return m.max_read_time + m.lease_horizon + m.abort_grace

    def post(self, rank: str, local: Sequence[int], remote: Sequence[int], stamps: bool,
             sums: bool = False) -> SimXfer:
        bound = self.read_bound()
        late = self.faults.late_read > 0 and self.rng.random() < self.faults.late_read
        if late:
            dur = round(self.rng.uniform(self.config.ms.max_read_time, self.late_bound()))
        else:
            dur = round(self.rng.uniform(min(1, bound / 2), bound))
        corrupt = not stamps and self.faults.corrupt > 0 and self.rng.random() < self.faults.corrupt
        x = SimXfer(rank, tuple(local), tuple(remote), stamps, self.now, self.now + dur, late,
                    seq=self._next(), sums=sums, corrupt=corrupt)
        self.xfers.append(x)
        return x

    def land(self, x: SimXfer, ok: bool = True) -> None:
        """``x`` finishes now: it copies what P's blocks hold now (or fails)."""
        if x in self.xfers:
            self.xfers.remove(x)
        if not ok or self.cut_off(x.rank):
            x.state = DISCONNECT
            return
        if x.stamps:
            slots = self.local_stamps[x.rank]
            for lb, rb in zip(x.local, x.remote, strict=True):
                slots[lb] = self.stamps[rb]
            if x.sums:
                sums = self.local_sums[x.rank]
                for lb, rb in zip(x.local, x.remote, strict=True):
                    sums[lb] = self.sums[rb]
        else:
            held = self.local[x.rank]
            for lb, rb in zip(x.local, x.remote, strict=True):
                held[lb] = self.content[rb]
            if x.corrupt and x.local:
                # A byte flipped in flight: what lands is no write P ever made.
                held[x.local[0]] = -1 - self.content[x.remote[0]]
                self.corrupted += 1
        x.state = DONE

    def run_due(self, now: int) -> None:
        """Everything due by ``now``: messages, handshake answers, READs landing."""
        self.now = now
        for m in self.net.due(now):
            self.deliver(m)
        for a in sorted(self.attempts.values(), key=lambda a: a.seq):
            if a.result is None and a.at <= now:
                self.answer(a)
        for x in sorted((x for x in self.xfers if x.end <= now), key=lambda x: (x.end, x.seq)):
            self.land(x)

    def next_due(self) -> int:
        """When the world next has something to do on its own (``NEVER``: nothing)."""
        t = min((x.end for x in self.xfers), default=NEVER)
        if self.net.queue:
            t = min(t, self.net.queue[0].at)
        for a in self.attempts.values():
            t = min(t, a.at if a.result is None else t)
        return t


def content_sum(write: int) -> int:
    """The checksum of a block holding ``write`` (CRC-32 of its 8 bytes, as the NIXL
    transport's of a block's bytes)."""
    return zlib.crc32(write.to_bytes(8, "little", signed=True))


# The fuzzer's variants: nothing random, every choice made by the fuzzer.


class FuzzNetwork(Network):
    """Nothing random: every message waits for the fuzzer (deliver/drop/duplicate) and is
    delivered at ``sent + max_delay`` at the latest (the timing assumption).

    Fault bursts: while ``drop_next`` (``dup_next``) is positive, each message sent is
    lost (sent twice) and the count goes down by one -- a flaky link for the next few
    messages, whichever they turn out to be."""

    drop_next: int = 0
    dup_next: int = 0

    def send(self, now: int, src: str, dst: str, data: bytes) -> None:
        self.sent += 1
        if self.drop_next > 0:
            self.drop_next -= 1
            self.lost += 1
            return
        copies = 1
        if self.dup_next > 0:
            self.dup_next -= 1
            self.duplicated += 1
            copies = 2
        for _ in range(copies):
            self._seq += 1
            heapq.heappush(self.queue, Msg(now + self.max_delay, self._seq, src, dst, data))

    def take(self, i: int) -> Msg:
        m = self.queue.pop(i)
        heapq.heapify(self.queue)
        return m

    def duplicate(self, i: int) -> None:
        m = self.queue[i]
        self._seq += 1
        self.duplicated += 1
        heapq.heappush(self.queue, Msg(m.at, self._seq, m.src, m.dst, m.data))


class FuzzWorld(World):
    """Nothing random: a handshake waits for the fuzzer's answer (``decide``), and a READ
    lands when the fuzzer says or at its bound (``read_bound``; ``late_bound`` once the
    fuzzer made it late: ``slow``, or while ``slow_next`` is positive when it is posted)."""

    slow_next: int = 0
    corrupt_next: int = 0  # data READs posted from now on that land corrupted

    def start_handshake(self, rank: str, payload: bytes) -> None:
        self.attempts[rank] = HsAttempt(rank, payload, NEVER, self._next())

    def decide(self, rank: str, ok: bool) -> None:
        """``rank``'s handshake request reaches P (``ok``) or P is unreachable."""
        a = self.attempts[rank]
        a.reachable = ok
        self.answer(a)
        a.ready = self.now

    def post(self, rank: str, local: Sequence[int], remote: Sequence[int], stamps: bool,
             sums: bool = False) -> SimXfer:
        x = SimXfer(rank, tuple(local), tuple(remote), stamps, self.now,
                    self.now + self.read_bound(), seq=self._next(), sums=sums)
        self.xfers.append(x)
        if self.corrupt_next > 0 and not stamps:
            self.corrupt_next -= 1
            x.corrupt = True
        if self.slow_next > 0:
            self.slow_next -= 1
            self.slow(x)
        return x

    def slow(self, x: SimXfer) -> None:
        """``x`` lands late: past ``max_read_time``, as late as ``late_bound``."""
        x.late = True
        x.end = x.posted + self.late_bound()


class SimPTransport:
    """P's transport over the world (``PTransport``)."""

    threaded = False

    def __init__(self, world: World, name: str, capacity: int) -> None:
        self.world = world
        self.name = name
        self.metadata = _MD + name.encode()
        self._layout = Layout(capacity, 1, "sim", 0, 1)
        self.handler: HandshakeHandler | None = None
        self.on_closed: Callable[[str], None] | None = None
        world.p = self

    def layout(self) -> Layout:
        return self._layout

    def extra(self) -> dict[str, Any]:
        return {}

    def attach(self, handler: HandshakeHandler, on_closed: Callable[[str], None]) -> None:
        self.handler = handler
        self.on_closed = on_closed

    def serve(self, now: int) -> None:
        """Handshakes are answered by the world as they arrive."""

    def conn_open(self, conn: int) -> bool:
        return conn in self.world.conns

    def drop_conn(self, conn: int) -> None:
        self.world.conns.pop(conn, None)

    def receive(self) -> list[tuple[str, bytes]]:
        return self.world.inbox.pop(self.name, [])

    def send(self, peer: str, buf: bytes) -> str | None:
        self.world.send(self.name, peer, buf)
        return None

    def stamps(self, blocks: Sequence[int]) -> tuple[int, ...]:
        s = self.world.stamps
        return tuple(s[b] for b in blocks)

    def bump(self, blocks: Sequence[int]) -> None:
        s = self.world.stamps
        for b in blocks:
            s[b] += 1

    def seal(self, blocks: Sequence[int]) -> None:
        w = self.world
        for b in blocks:
            w.sums[b] = content_sum(w.content[b])

    def metadata_name(self, metadata: bytes) -> str | None:
        if not metadata.startswith(_MD):
            return None
        return metadata[len(_MD):].decode("utf-8", errors="replace")

    def load_peer(self, metadata: bytes) -> str:
        name = self.metadata_name(metadata)
        if name is None:
            raise PeerError("metadata", "not a simulated agent", final=False)
        return name

    def unload_peer(self, name: str) -> None:
        """Nothing is loaded in the simulation."""

    def close(self) -> None:
        """Nothing to release."""


class SimDTransport:
    """One D rank's transport over the world (``DTransport``)."""

    block_bytes = 1

    def __init__(self, world: World, name: str, num_blocks: int, p_layout: Layout) -> None:
        self.world = world
        self.name = name
        self.num_blocks = num_blocks
        self.metadata = _MD + name.encode()
        self._layout = Layout(num_blocks, p_layout.block_bytes, p_layout.dtype, 0, 1)
        world.local[name] = [0] * num_blocks
        world.local_stamps[name] = [-1] * num_blocks
        world.local_sums[name] = [-1] * num_blocks
        world.ranks[name] = self

    def layout(self) -> Layout:
        return self._layout

    def receive(self) -> list[tuple[str, bytes]]:
        return self.world.inbox.pop(self.name, [])

    def send(self, engine: str, buf: bytes) -> str | None:
        self.world.send(self.name, engine, buf)
        return None

    def connect(self, engine: str, host: str, port: int, payload: bytes) -> None:
        self.world.start_handshake(self.name, payload)

    def poll_connect(self, engine: str) -> tuple[str, bytes | str] | None:
        a = self.world.attempts.get(self.name)
        if a is None:
            return ("error", "no handshake in progress")
        if a.result is None or a.ready > self.world.now:
            return None
        del self.world.attempts[self.name]
        return a.result

    def hangup(self, engine: str) -> None:
        self.world.attempts.pop(self.name, None)

    def alive(self, engine: str) -> bool:
        return True  # P never dies in the simulation

    def load_peer(self, engine: str, hs: Handshake) -> None:
        """Nothing to load: P's memory is the world's."""

    def drop(self, engine: str) -> None:
        self.world.attempts.pop(self.name, None)

    def post_read(self, engine: str, local: Sequence[int], remote: Sequence[int], *,
                  stamps: bool, sums: bool = False) -> tuple[Any, str]:
        w = self.world
        if w.cut_off(self.name):
            return None, DISCONNECT
        x = w.post(self.name, local, remote, stamps, sums)
        return x, x.state

    def poll(self, xfer: Any) -> str:
        st: str = xfer.state
        return st

    def release(self, xfer: Any) -> None:
        """Landed transfers hold nothing."""

    def landed_stamps(self, local: Sequence[int], engine: str = "") -> list[int]:
        slots = self.world.local_stamps[self.name]
        return [slots[i] for i in local]

    def landed_sums(self, local: Sequence[int]) -> list[int]:
        sums = self.world.local_sums[self.name]
        return [sums[i] for i in local]

    def block_sums(self, local: Sequence[int], engine: str = "") -> list[int]:
        held = self.world.local[self.name]
        return [content_sum(held[i]) for i in local]

    def stale(self) -> bool:
        return False

    def reap(self, busy: Collection[str], unknown: Collection[str]) -> None:
        """Nothing to release."""

    def close(self) -> None:
        """Nothing to release."""
