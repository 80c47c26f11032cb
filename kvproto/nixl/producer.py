"""The P adapter: P's driver (:class:`kvproto.nixl.driver_p.PDriver`) over NIXL
(:class:`kvproto.nixl.transport.NixlPTransport`).

It owns P's agent, the registered KV cache and its generation stamps, the block
allocator and the handshake listener; what it does with each effect, and how it checks
handshakes, is the driver's (see there). With a shared secret (``handshake_secret=``, or
the ``KVPROTO_HANDSHAKE_SECRET`` environment variable) every handshake must carry a valid
HMAC (``kvproto.nixl.channel``), else it is refused, counted and logged. With
``handshake_thread`` the listener runs on a thread of its own and answers while the
engine thread is busy (the driver's docstring says what runs where).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvproto.lifecycle import Config, Effect, Event
from kvproto.nixl.channel import Server, secret_from_env
from kvproto.nixl.driver_p import (
    MAX_HANDSHAKE_QUEUE,
    Clock,
    EffectObserver,
    InHook,
    PDriver,
)
from kvproto.nixl.transport import NixlPTransport

if TYPE_CHECKING:
    from kvproto.metrics import Exporter, Metrics

log = logging.getLogger(__name__)

__all__ = ["MAX_HANDSHAKE_QUEUE", "Clock", "EffectObserver", "InHook",
           "ProducerAdapter"]


class ProducerAdapter(PDriver):
    """One P rank: agent + KV cache + ledger + handshake listener. Call ``poll`` often."""

    transport: NixlPTransport

    def __init__(self, name: str, config: Config, *, num_blocks: int, block_bytes: int,
                 device: str = "cpu", epoch: int | None = None, clock: Clock = time.monotonic,
                 sink: Callable[[Event, list[Effect]], None] | None = None,
                 tp_rank: int = 0, tp_size: int = 1, host: str = "127.0.0.1", port: int = 0,
                 fault_hook: InHook | None = None, strict_pool: bool = True,
                 observer: EffectObserver | None = None,
                 progress_thread: bool = False, progress_delay_us: int = 0,
                 metrics: Metrics | None = None,
                 metrics_port: int | None = None,
                 kv_tensors: Sequence[torch.Tensor] | None = None,
                 handshake_secret: bytes | None = None,
                 identity: Mapping[str, str] | None = None,
                 handshake_thread: bool = False) -> None:
        """With ``kv_tensors`` the KV cache is the engine's own (registered in place, see
        ``KVRegion``) and so is the block allocator: reclaimed blocks get their stamps
        bumped, and the engine learns of each ``Free`` through ``observer`` (called after
        the bump) instead of this adapter's free list.
        ``handshake_secret``: require authenticated handshakes (HMAC-SHA256 under this
        shared secret); default: ``KVPROTO_HANDSHAKE_SECRET`` when set, else none.
        ``identity``: the model identity (``kvproto.vllm.identity``) sent in the handshake;
        a D whose identity differs in any field is refused (``model_mismatch``).
        ``progress_delay_us``: the progress thread's sleep between passes (``make_agent``).
        ``handshake_thread``: serve the handshake listener from a thread of its own.
        Prometheus (opt-in): pass ``metrics`` to share a registry, ``metrics_port`` (0:
        any free port) to serve it on 127.0.0.1; ``metrics_port`` is then the chosen one."""
        secret = handshake_secret if handshake_secret is not None else secret_from_env()
        transport = NixlPTransport(name, num_blocks=num_blocks, block_bytes=block_bytes,
                                   device=device, tp_rank=tp_rank, tp_size=tp_size, host=host,
                                   port=port, progress_thread=progress_thread,
                                   progress_delay_us=progress_delay_us,
                                   kv_tensors=kv_tensors, handshake_secret=secret,
                                   threaded=handshake_thread, checksums=config.checksums)
        if metrics_port is not None and metrics is None:
            from kvproto.metrics import Metrics

            metrics = Metrics(labels={"role": "P", "engine": name})
        super().__init__(name, config, transport, num_blocks=num_blocks, epoch=epoch,
                         clock=clock, sink=sink, fault_hook=fault_hook,
                         strict_pool=strict_pool, observer=observer, metrics=metrics,
                         handshake_secret=secret, identity=identity)
        self.external_allocator = bool(kv_tensors)
        self.host = transport.host
        self.port = transport.port
        self._closed = False
        self._exporter: Exporter | None = None
        self.metrics_port: int | None = None
        if metrics_port is not None:
            from kvproto.metrics import serve

            assert self.metrics is not None
            self._exporter = serve(self.metrics, metrics_port)
            self.metrics_port = self._exporter.port
            log.info("%s: metrics on %s", name, self._exporter.url)

    # The NIXL parts, for tests, the demo and the connector.
    @property
    def agent(self) -> Any:
        return self.transport.agent

    @property
    def region(self) -> Any:
        return self.transport.region

    @property
    def server(self) -> Server:
        return self.transport.server

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.transport.close()
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
