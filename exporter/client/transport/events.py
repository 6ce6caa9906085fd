"""What the ZMQ transports report upward, and the read-only copy of each engine's link."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from exporter.protocol import EngineOutput, RegistrationInfo
from exporter.protocol.pushes import FaultStatus


class TransportListener(Protocol):
    """Callbacks the transport makes, on the event loop thread, in arrival order."""

    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        """An engine's output; True when it answered a call in flight (proves the sender)."""
        ...

    def on_engine_down(self, engine_index: int, reason: str) -> None: ...

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        """The engine is callable: after a new handshake (``handshaken``: it starts over), or
        reattached without one (the same engine process: what it said before still holds)."""
        ...

    def on_death_claimed(self, engine_index: int) -> None:
        """ENGINE_CORE_DEAD arrived on a connection not known to be the engine's own: any peer
        can send those 16 bytes. The listener confirms (``confirm_dead``) or counts a spoof."""
        ...


@dataclass(frozen=True, slots=True)
class LinkSnapshot:
    """One engine's link state copied at one moment (read-only), for status pages and the
    client: the live ``EngineLink`` stays inside the transport."""

    engine_index: int
    connected: bool
    dead: bool
    handshakes: int
    registration: RegistrationInfo | None
    output_address: str
    #: Why the exporter does not use this engine (e.g. coordinated DP in owner mode).
    refused: str | None = None
    #: Its fault-tolerance status as the link keeps it (restored from the state file).
    fault_status: FaultStatus | None = None
