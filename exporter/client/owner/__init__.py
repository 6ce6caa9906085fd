"""Owner mode: the exporter owns the engines' start-up handshake (HELLO / INIT / READY) and is
client 0 of every engine, the one vLLM's engines push their fault-tolerance status to."""

from exporter.client.owner.client import owner_client
from exporter.client.owner.transport import OwnerConfig, OwnerTransport

__all__ = ["OwnerConfig", "OwnerTransport", "owner_client"]
