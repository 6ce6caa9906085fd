"""Relay mode's client: the engine-core client over a ``RelayTransport``, built in one place."""

from __future__ import annotations

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import ChangeCallback
from exporter.client.relay.transport import RelayConfig, RelayTransport


def relay_client(
    config: RelayConfig, faults: ProtocolErrorTally, *, on_change: ChangeCallback | None = None
) -> EngineCoreClient:
    """An ``EngineCoreClient`` with a slot of its own beside the stock front end ``config``
    relays the handshake to (which owns the engines and receives their pushes)."""
    return EngineCoreClient(
        lambda listener: RelayTransport(config, listener, faults),
        faults,
        on_change=on_change,
        beside_a_front_end=True,
    )
