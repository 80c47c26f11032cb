"""The D adapter: one decode rank's driver (:class:`kvproto.nixl.driver_d.DDriver`) over
NIXL (:class:`kvproto.nixl.transport.NixlDTransport`).

What each ``Consumer`` effect becomes, READ batching, stamp fencing, done and release
batching and the handshake bookkeeping are the driver's (see there); the transport
posts block-granular READs with prepared dlists, keeps one handshake connection per P
engine (its own socket, deadline, retries: one dead P never delays another), and turns
NIXL's exceptions into error tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvproto.lifecycle import Config, DEffect, DEvent
from kvproto.nixl.channel import secret_from_env
from kvproto.nixl.dreads import MAX_READ_DESCS, MAX_STAMP_DESCS
from kvproto.nixl.driver_d import (
    Clock,
    Completion,
    DDriver,
    OutHook,
    PhaseHook,
)
from kvproto.nixl.transport import NixlDTransport

if TYPE_CHECKING:
    from kvproto.metrics import Exporter, Metrics

log = logging.getLogger(__name__)

__all__ = ["MAX_READ_DESCS", "MAX_STAMP_DESCS", "Clock", "Completion", "ConsumerAdapter",
           "OutHook", "PhaseHook"]


class ConsumerAdapter(DDriver):
    """One D rank. Call ``poll`` from the step loop; it never blocks."""

    transport: NixlDTransport

    def __init__(self, name: str, config: Config, *, num_blocks: int, block_bytes: int,
                 device: str = "cpu", clock: Clock = time.monotonic, tp_rank: int = 0,
                 tp_size: int = 1, handshake_timeout: float = 2.0, handshake_attempts: int = 4,
                 backoff: float = 0.1, peer_timeout: float | None = None,
                 fault_hook: OutHook | None = None, phase_hook: PhaseHook | None = None,
                 progress_thread: bool = False, metrics: Metrics | None = None,
                 metrics_port: int | None = None,
                 kv_tensors: Sequence[torch.Tensor] | None = None,
                 handshake_secret: bytes | None = None, identity: Mapping[str, str] | None = None,
                 sink: Callable[[DEvent, list[DEffect]], None] | None = None) -> None:
        """With ``kv_tensors`` the KV cache is the engine's own (see ``KVRegion``) and so
        are the local blocks: ``schedule`` names the blocks each READ lands in.
        ``handshake_secret``: authenticate handshakes (and require P's reply to be
        authenticated) with this shared secret; default: ``KVPROTO_HANDSHAKE_SECRET``.
        ``sink`` receives every machine event and its effects (a D journal:
        ``JournalWriter(..., reader=name).sink``). ``identity``: the model identity sent in
        the handshake (``kvproto.vllm.identity``). Prometheus (opt-in), as on P:
        ``metrics`` shares a registry, ``metrics_port`` (0: any free port) serves it on
        127.0.0.1 and becomes the chosen port."""
        secret = handshake_secret if handshake_secret is not None else secret_from_env()
        transport = NixlDTransport(name, num_blocks=num_blocks, block_bytes=block_bytes,
                                   device=device, tp_rank=tp_rank, tp_size=tp_size,
                                   progress_thread=progress_thread, kv_tensors=kv_tensors,
                                   handshake_secret=secret, checksums=config.checksums)
        if metrics_port is not None and metrics is None:
            from kvproto.metrics import Metrics

            metrics = Metrics(labels={"role": "D", "engine": name})
        super().__init__(name, config, transport, clock=clock,
                         handshake_timeout=handshake_timeout,
                         handshake_attempts=handshake_attempts, backoff=backoff,
                         peer_timeout=peer_timeout, fault_hook=fault_hook,
                         phase_hook=phase_hook, metrics=metrics, identity=identity, sink=sink)
        self.handshake_secret = secret
        self._exporter: Exporter | None = None
        self.metrics_port: int | None = None
        if metrics_port is not None:
            from kvproto.metrics import serve

            assert self.metrics is not None
            self._exporter = serve(self.metrics, metrics_port)
            self.metrics_port = self._exporter.port
            log.info("%s: metrics on %s", name, self._exporter.url)

    # The NIXL parts, for tests, the demo, the benchmarks and the connector.
    @property
    def agent(self) -> Any:
        return self.transport.agent

    @property
    def region(self) -> Any:
        return self.transport.region

    @property
    def local_kv(self) -> Any:
        return self.transport.local_kv

    @property
    def local_gen(self) -> Any:
        return self.transport.local_gen

    @property
    def zombies(self) -> list[Any]:
        return self.transport.zombies

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for in-flight READs, then release everything."""
        super().close(timeout)
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
