"""kvproto: the KV-block lifecycle protocol for P/D disaggregated serving.

The public API is the sans-I/O core, which needs only the standard library:

* P's machine, :class:`Ledger`, over a :class:`BlockPool`, fed :class:`Register`,
  :class:`Done`, :class:`Heartbeat`, :class:`Release`, :class:`Abort` and :class:`Tick`
  events and answering :class:`Free`, :class:`Ack` and :class:`Rejected` effects;
* D's machine, :class:`Consumer`, fed :class:`Admit` ... :class:`DTick` and answering
  :class:`StartHandshake` ... :class:`Finished`;
* :class:`Config` (validated; :class:`ConfigError`), :class:`TransferParams` (what P hands
  D), the transition tables ``P_TABLE`` and ``D_TABLE``;
* the errors: :class:`KVProtoError`, with :class:`UsageError` (the caller's mistake,
  raised) and :class:`RemoteInputError` (a peer's bad input, counted and journaled,
  never raised out of a machine or port) below it;
* the one intake for remote bytes on each side (:mod:`kvproto.port`), the wire format
  (:mod:`kvproto.wire`) and the journal writer (:class:`JournalWriter`).

Adapters live in :mod:`kvproto.nixl` and :mod:`kvproto.vllm` (extras), verification in
:mod:`kvproto.verify`, test machinery in :mod:`kvproto.testing`, benchmarks in
:mod:`kvproto.bench`.
"""

from __future__ import annotations

from kvproto.errors import KVProtoError, RemoteInputError, UsageError
from kvproto.journal import JournalError, JournalWriter
from kvproto.lifecycle import (
    D_TABLE,
    P_TABLE,
    Abort,
    Ack,
    Admit,
    BlockPool,
    Config,
    ConfigError,
    Consumer,
    DAbort,
    DAck,
    DEffect,
    DEvent,
    Done,
    DoubleFree,
    DReject,
    DRejected,
    DropPeer,
    DTick,
    Effect,
    Event,
    Finished,
    Free,
    HandshakeFailed,
    HandshakeOk,
    Heartbeat,
    Ledger,
    MissingRow,
    PeerLost,
    PostRead,
    ReadFailed,
    ReadOk,
    Register,
    Reject,
    Rejected,
    Release,
    Schedule,
    SendDone,
    SendHeartbeat,
    SendRelease,
    StartHandshake,
    TableError,
    Tick,
    TransferParams,
)
from kvproto.wire import WireError

__all__ = [
    "D_TABLE",
    "P_TABLE",
    "Abort",
    "Ack",
    "Admit",
    "BlockPool",
    "Config",
    "ConfigError",
    "Consumer",
    "DAbort",
    "DAck",
    "DEffect",
    "DEvent",
    "DReject",
    "DRejected",
    "DTick",
    "Done",
    "DoubleFree",
    "DropPeer",
    "Effect",
    "Event",
    "Finished",
    "Free",
    "HandshakeFailed",
    "HandshakeOk",
    "Heartbeat",
    "JournalError",
    "JournalWriter",
    "KVProtoError",
    "Ledger",
    "MissingRow",
    "PeerLost",
    "PostRead",
    "ReadFailed",
    "ReadOk",
    "Register",
    "Reject",
    "Rejected",
    "Release",
    "RemoteInputError",
    "Schedule",
    "SendDone",
    "SendHeartbeat",
    "SendRelease",
    "StartHandshake",
    "TableError",
    "Tick",
    "TransferParams",
    "UsageError",
    "WireError",
]
