"""The contract between the drivers and their transports.

A driver (:class:`kvproto.nixl.driver_p.PDriver`, :class:`kvproto.nixl.driver_d.DDriver`)
is the transport-free half of an adapter: it feeds its machine the events that I/O
stands for, executes the machine's effects, fences stamps, batches READs, dones and
releases, and keeps the handshake bookkeeping. Everything it needs from the outside
world goes through a transport, described here as two protocols:

* :class:`PTransport` -- P's: receive and send notifications, read and bump the
  generation stamps of its KV blocks, seal their checksums, serve handshakes (calling the driver's handler),
  load and unload a peer's metadata;
* :class:`DTransport` -- one D rank's: receive and send notifications, run a handshake
  with a P engine, load and drop a P engine, post READs of data or of stamps (and
  checksums), poll and release them, read the stamps and checksums that landed and
  checksum the landed data.

:mod:`kvproto.nixl.transport` implements both over NIXL (agents, registered memory, the
handshake channel); :mod:`kvproto.testing.transport` over the simulated network, with
its faults. So the simulator and the fuzzer run the production drivers, and a driver
bug is a simulator finding. Standard library only: the drivers and this contract import
no nixl and no torch.

Transfer outcomes (what ``post_read`` and ``poll`` answer): :data:`PROC` (in progress),
:data:`DONE`, or ``"error:<name>"`` (e.g. :data:`DISCONNECT`, :data:`NOT_FOUND`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvproto.errors import RemoteInputError
from kvproto.wire import Handshake, Layout

PROC = "proc"
DONE = "done"
DISCONNECT = "error:remote_disconnect"
NOT_FOUND = "error:not_found"


@dataclass(frozen=True)
class Accept:
    """P's handshake answer: accepted; ``payload`` is P's own handshake (encoded)."""

    payload: bytes
    peer: str


@dataclass(frozen=True)
class Refuse:
    """P's handshake answer: refused, with a reason D can act on (``_FINAL`` reasons are
    not retried) and a detail for the log."""

    reason: str
    detail: str


# P's handshake handler: (connection id, request payload, authenticated) -> the answer.
HandshakeHandler = Callable[[int, bytes, bool], Accept | Refuse]


class PeerError(RemoteInputError):
    """A P engine's handshake reply cannot be used (``DTransport.load_peer``):
    ``reason`` names why (``handshake_malformed``, ``handshake_wrong_peer``,
    ``metadata``); ``final`` says whether retrying can help. D's driver catches it and
    counts the handshake as failed or retried."""

    def __init__(self, reason: str, detail: str, *, final: bool) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.final = final


class PTransport(Protocol):
    """What P's driver needs from the world."""

    metadata: bytes  # this agent's metadata, sent in P's handshake
    # Handshakes are served on a thread of the transport's own: the handler and the
    # closed callback then run on it and must touch no state of the engine thread's.
    threaded: bool

    def layout(self) -> Layout:
        """The local KV cache's layout (checked against every D's)."""

    def extra(self) -> dict[str, Any]:
        """What a D needs to address P's memory (goes in P's handshake)."""

    def attach(self, handler: HandshakeHandler, on_closed: Callable[[str], None]) -> None:
        """The driver's handshake handler and its channel-closed callback."""

    def serve(self, now: int) -> None:
        """Serve the handshake listener once (calls the handler); never blocks. ``now``:
        the driver's time, ms."""

    def conn_open(self, conn: int) -> bool:
        """Whether a peer's handshake connection is still up (from any thread)."""

    def drop_conn(self, conn: int) -> None:
        """Close a peer's handshake connection (it sees its channel close)."""

    def receive(self) -> list[tuple[str, bytes]]:
        """The notifications that arrived since the last call, in order, as (peer,
        bytes). May raise: the driver counts it and carries on."""

    def send(self, peer: str, buf: bytes) -> str | None:
        """Send one notification: None when sent, else an error token."""

    def stamps(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """The generation stamps of ``blocks`` now."""

    def bump(self, blocks: Sequence[int]) -> None:
        """Advance the stamps of ``blocks`` (done before the blocks can be reused)."""

    def seal(self, blocks: Sequence[int]) -> None:
        """Compute the checksum of each of ``blocks`` (as they hold now) into its
        checksum slot, where D's stamp READ fetches it (``Config.checksums``)."""

    def metadata_name(self, metadata: bytes) -> str | None:
        """The agent name inside a peer's metadata, read without loading it (None when
        it has no known shape)."""

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; the name loaded. Raises on failure (``PeerError``,
        whose detail names the error)."""

    def unload_peer(self, name: str) -> None:
        """Forget a peer's metadata (failures are logged, not raised)."""

    def close(self) -> None: ...


class DTransport(Protocol):
    """What one D rank's driver needs from the world."""

    metadata: bytes  # this agent's metadata, sent in D's handshake
    num_blocks: int  # local KV blocks (where READs land)
    block_bytes: int

    def layout(self) -> Layout: ...

    def receive(self) -> list[tuple[str, bytes]]:
        """As ``PTransport.receive``."""

    def send(self, engine: str, buf: bytes) -> str | None:
        """Send one notification to a P engine: None when sent, else an error token
        (``NOT_FOUND`` or ``DISCONNECT``: the engine is gone)."""

    # -- handshakes (one attempt at a time per engine) ---------------------------------
    def connect(self, engine: str, host: str, port: int, payload: bytes) -> None:
        """Start one handshake attempt with ``engine``."""

    def poll_connect(self, engine: str) -> tuple[str, bytes | str] | None:
        """The attempt's outcome once there is one: ("ok", P's handshake payload),
        ("refused", refusal payload) or ("error", detail); None while pending."""

    def hangup(self, engine: str) -> None:
        """Close the handshake connection of ``engine`` (no-op when none)."""

    def alive(self, engine: str) -> bool:
        """Whether the handshake connection of a ready engine is still up."""

    def load_peer(self, engine: str, hs: Handshake) -> None:
        """Make ``engine`` readable from its handshake reply; raises ``PeerError``."""

    def drop(self, engine: str) -> None:
        """``engine`` is lost: close its connection; its remote handles become stale
        (released by ``reap`` once no READ uses them)."""

    # -- READs -------------------------------------------------------------------------
    def post_read(self, engine: str, local: Sequence[int], remote: Sequence[int], *,
                  stamps: bool, sums: bool = False) -> tuple[Any, str]:
        """Post one READ of ``remote`` blocks of ``engine`` into ``local`` ones (their
        generation stamps into the local stamp slots with ``stamps``, and with ``sums``
        their checksum slots too, in the same transfer). Returns the transfer (None when
        it could not be made) and its outcome so far."""

    def poll(self, xfer: Any) -> str:
        """A posted transfer's outcome: PROC, DONE or an error token. Never raises."""

    def release(self, xfer: Any) -> None:
        """Release a finished transfer (one whose release fails is kept and retried by
        ``reap``)."""

    def landed_stamps(self, local: Sequence[int], engine: str = "") -> list[int]:
        """The stamps a finished stamp READ from P engine ``engine`` left in the local
        slots ``local`` (of the slot set that engine's stamp READs land in)."""

    def landed_sums(self, local: Sequence[int]) -> list[int]:
        """The checksums a finished stamp READ with ``sums`` left in the local checksum
        slots ``local`` (what P computed at register)."""

    def block_sums(self, local: Sequence[int], engine: str = "") -> list[int]:
        """The checksums of what the local blocks ``local`` hold now (the landed data),
        with the function the P engine ``engine`` seals with."""

    def stale(self) -> bool:
        """Whether ``reap`` has anything to do (cheap: called every poll)."""

    def reap(self, busy: Collection[str], unknown: Collection[str]) -> None:
        """Release stale handles of engines no READ uses (``busy``: engines with READs
        in flight); unload engines that are ``unknown`` (lost) once idle; retry failed
        transfer releases."""

    def close(self) -> None: ...
