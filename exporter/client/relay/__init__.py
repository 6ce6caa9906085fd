"""Relay mode: the engines' handshake is relayed to a stock vLLM front end, byte for byte but
for one rewrite that gives the exporter a client slot of its own on every engine."""

from exporter.client.relay.client import relay_client
from exporter.client.relay.transport import RelayConfig, RelayTransport

__all__ = ["RelayConfig", "RelayTransport", "relay_client"]
