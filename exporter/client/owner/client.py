"""Owner mode's client: the engine-core client over an ``OwnerTransport``, built in one place
(the composition root, ``ctl probe``, the simulated front end and tests all call this)."""

from __future__ import annotations

import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import DEFAULT_ALLOWED_METHODS, ChangeCallback
from exporter.client.owner.transport import OwnerConfig, OwnerTransport


def owner_client(
    config: OwnerConfig,
    faults: ProtocolErrorTally,
    *,
    context: zmq.asyncio.Context | None = None,
    allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS,
    on_change: ChangeCallback | None = None,
    on_status: ChangeCallback | None = None,
) -> EngineCoreClient:
    """An ``EngineCoreClient`` that owns the handshake of ``config``'s engines (client 0: it
    receives their pushes); its transport is ``client.transport``, an ``OwnerTransport``."""
    return EngineCoreClient(
        lambda listener: OwnerTransport(config, listener, faults, context=context),
        faults,
        allowed_methods=allowed_methods,
        on_change=on_change,
        on_status=on_status,
    )
