"""kvproto's error types: one base, ``KVProtoError``, and two kinds below it.

* ``UsageError`` -- the caller's own mistake: a bad argument, configuration, transition
  table or file handed in (``ConfigError``, ``TableError``, ``MissingRow``,
  ``DoubleFree``, ``JournalError``...). Raised to the caller.
* ``RemoteInputError`` -- bad bytes or values from a peer (``WireError``,
  ``FrameError``, ``ParamsError``, ``PeerError``). Raised only inside a decoder; the port
  or adapter that called it catches it, counts it and journals it as a rejection
  (``Ledger.reject``): it never leaves a machine, a port or an adapter, so a peer cannot
  crash an engine.

Errors that are neither (a verification finding, a failed engine process, a missing
tool) derive from ``KVProtoError`` directly. Every type also keeps the builtin base it
had before the hierarchy existed (``ValueError``, ``RuntimeError``, ``KeyError``...), so
code that catches the builtin still catches it. spec/PROTOCOL.md, "Errors", lists them.
"""

from __future__ import annotations


class KVProtoError(Exception):
    """Every error kvproto raises on purpose."""


class UsageError(KVProtoError):
    """The caller's own mistake (an argument, configuration, table or file it handed in):
    raised to the caller."""


class RemoteInputError(KVProtoError):
    """Bad input from a peer: caught where it enters (a port or an adapter), counted and
    journaled as a rejection, never raised out of a machine, a port or an adapter."""
