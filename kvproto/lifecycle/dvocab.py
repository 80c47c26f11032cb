"""D's vocabulary: ``TransferParams`` (what P hands D for one request) and D's events
and effects as data. ``Consumer`` (``kvproto.lifecycle.consumer``) runs ``D_TABLE`` over
them; both modules export these names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvproto.lifecycle.quarantine import Quarantined, Unquarantined


def _ms(v: Any) -> int:
    """A duration read from JSON: an int of milliseconds, >= 0 (a float or bool is
    refused)."""
    if type(v) is not int or v < 0:
        raise ValueError(f"a duration must be an int of milliseconds >= 0, got {str(v)[:40]!r}")
    return v


def _nat(v: Any, name: str, lo: int = 0) -> int:
    """An int field read from JSON, at least ``lo`` (a float, bool or string is refused)."""
    if type(v) is not int or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {str(v)[:40]!r}")
    return v


def _ids(v: Any, name: str) -> tuple[int, ...]:
    """A list of ids read from JSON: ints >= 0."""
    if not isinstance(v, list):
        raise ValueError(f"{name} must be a list of ints >= 0")
    for x in v:
        if type(x) is not int or x < 0:
            raise ValueError(f"{name} must be a list of ints >= 0, got {str(x)[:40]!r}")
    return tuple(v)


@dataclass(frozen=True)
class TransferParams:
    """What P hands D (through the router) for one request."""

    engine: str  # P engine/rank name (NIXL agent name)
    epoch: int  # P incarnation; messages carry it so a restarted P rejects old ones
    handle: int
    blocks: tuple[int, ...]
    initial_term: int  # a duration in milliseconds, never a timestamp
    expected: int = 1  # readers that will pull this request from this P rank
    group: str | None = None
    generations: tuple[int, ...] = ()  # fail-closed reads (see the NIXL adapter)
    capability: str = ""  # P's capability for the handle (lifecycle.gate); "" = none

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["blocks"] = list(self.blocks)
        d["generations"] = list(self.generations)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferParams:
        """Params decoded from JSON (remote input, never trusted). Raises ``ValueError``
        naming the first bad field: a missing or mistyped field, no block, a negative
        id, ``expected`` below 1, or generations that are neither absent nor one per
        block. No number is coerced (a float, bool or string is refused)."""
        if not isinstance(d, dict):
            raise ValueError(f"transfer params must be a mapping, got {type(d).__name__}")
        engine = d.get("engine")
        if not isinstance(engine, str) or not engine:
            raise ValueError("engine must be a non-empty name")
        blocks = _ids(d.get("blocks"), "blocks")
        if not blocks:
            raise ValueError("blocks must name at least one block")
        gens = _ids(d.get("generations", []), "generations")
        if gens and len(gens) != len(blocks):
            raise ValueError(f"{len(gens)} generations for {len(blocks)} blocks "
                             "(one per block, or none)")
        group = d.get("group")
        if group is not None and not isinstance(group, str):
            raise ValueError("group must be a name or null")
        capability = d.get("capability", "")
        if not isinstance(capability, str):
            raise ValueError("capability must be a string")
        return cls(engine=engine, epoch=_nat(d.get("epoch"), "epoch"),
                   handle=_nat(d.get("handle"), "handle"), blocks=blocks,
                   initial_term=_ms(d.get("initial_term")),
                   expected=_nat(d.get("expected", 1), "expected", 1),
                   group=group, generations=gens, capability=capability)


# D effects. Values: compared and hashed by their fields, and never changed once built
# (nothing in kvproto assigns to one). Not ``frozen``: a frozen dataclass costs about 4x
# as much to build (0.66 us vs 0.16 us for PostRead, measured), and D builds three of
# these per request on its hot path.
@dataclass(slots=True, unsafe_hash=True)
class StartHandshake:
    engine: str


@dataclass(slots=True, unsafe_hash=True)
class SendClaim:
    """Effect: present ``capability`` for ``handle`` to P's gate (wire ``claim``); P
    answers with a grant or a refusal (wire ``grant``), or ``never``."""

    request_id: str
    engine: str
    handle: int
    capability: str


@dataclass(slots=True, unsafe_hash=True)
class PostRead:
    request_id: str
    engine: str
    handle: int
    blocks: tuple[int, ...]
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendDone:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendRelease:
    request_id: str
    engine: str
    handle: int
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class SendHeartbeat:
    engine: str
    seq: int
    handles: tuple[int, ...]
    expected: int


@dataclass(slots=True, unsafe_hash=True)
class Finished:
    """The request left the machine: ``state`` is done or failed, with a reason."""

    request_id: str
    state: str
    reason: str


@dataclass(slots=True, unsafe_hash=True)
class DropPeer:
    """Effect: the machine declared ``engine`` lost (no ack for ``peer_timeout`` while
    heartbeats were outstanding): close its connection; its requests were failed."""

    engine: str
    reason: str


@dataclass(slots=True, unsafe_hash=True)
class DRejected:
    """Effect: counted, logged rejection of bad remote input (see ``DReject``)."""

    reason: str
    peer: str
    detail: str


DEffect = (StartHandshake | SendClaim | PostRead | SendDone | SendRelease | SendHeartbeat | Finished
           | DropPeer | DRejected | Quarantined | Unquarantined)


# D events (inputs of ``Consumer.apply``; the journal of a D rank records them).
@dataclass(frozen=True, slots=True)
class Admit:
    request_id: str
    params: TransferParams
    now: int


@dataclass(frozen=True, slots=True)
class HandshakeOk:
    engine: str
    now: int


@dataclass(frozen=True, slots=True)
class HandshakeFailed:
    engine: str
    reason: str
    now: int


@dataclass(frozen=True, slots=True)
class Schedule:
    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class ReadOk:
    request_id: str
    now: int
    notif_attached: bool = True  # the done notification travelled with the READ


@dataclass(frozen=True, slots=True)
class ReadFailed:
    request_id: str
    now: int
    fenced: bool = False  # the data landed but its generation stamps changed


@dataclass(frozen=True, slots=True)
class DAbort:
    """Client abort on D."""

    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class DAck:
    """P's ack of heartbeat ``seq`` arrived (see the P effect ``Ack``)."""

    engine: str
    seq: int
    term: int  # milliseconds
    refused: tuple[int, ...]
    now: int
    pending: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerLost:
    """The adapter lost P engine ``engine`` (disconnect, channel closed)."""

    engine: str
    now: int


@dataclass(frozen=True, slots=True)
class ClaimGranted:
    """P's gate granted this consumer's claim of the request's handle."""

    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class ClaimRefused:
    """P's gate refused this consumer's claim of the request's handle."""

    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class NeverRegistered:
    """P said it will never register the request's handle (wire ``never``)."""

    request_id: str
    now: int


@dataclass(frozen=True, slots=True)
class DTick:
    now: int


@dataclass(frozen=True, slots=True)
class DReject:
    """Bad input the port rejected before it became an event (bytes that do not decode,
    a message for another epoch, an oversized one, an unknown peer, a kind D does not
    take). Journaled and counted, changes nothing but the clock."""

    reason: str
    peer: str
    detail: str
    now: int


DEvent = (Admit | HandshakeOk | HandshakeFailed | Schedule | ReadOk | ReadFailed | DAbort
          | DAck | PeerLost | DTick | DReject | ClaimGranted | ClaimRefused | NeverRegistered)
