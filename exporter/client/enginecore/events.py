"""What the ZMQ transports report upward, and the read-only copy of each engine's link."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from exporter.client.observe import UnexpectedEngine
from exporter.protocol import EngineOutput, RegistrationInfo
from exporter.protocol.pushes import FaultStatus


class TransportListener(Protocol):
    """Callbacks the transport makes, on the event loop thread, in arrival order."""

    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        """An engine's output; True when it answered a call in flight (proves the sender)."""
        ...

    def on_engine_down(self, engine_index: int, reason: str) -> None: ...

    def on_engine_hello(self, engine_index: int) -> None:
        """A new engine process began its handshake (its HELLO, before its INIT is sent): what
        an earlier process of that rank pushed no longer holds. A push the new one makes as
        soon as its sockets connect, which can be read before its READY is, is its own."""
        ...

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


#: Unexpected engine identities kept for /status (a hostile peer can send any number).
MAX_UNEXPECTED = 64


@dataclass
class UnexpectedEngines:
    """Handshakes from identities outside the expected engine set (``--engine-count``,
    ``--start-rank``: a DP scale-up the exporter was not restarted for, a wrong start rank),
    by identity in hex (newest last). At most ``MAX_UNEXPECTED`` identities, the most recent
    kept: listed, not only counted."""

    wall_clock: Callable[[], float] = time.time
    seen: dict[str, UnexpectedEngine] = field(default_factory=dict)

    def record(self, identity: bytes) -> None:
        key = identity[:32].hex()
        rank = int.from_bytes(identity, "little") if len(identity) == 2 else None
        before = self.seen.pop(key, None)
        count = before.handshakes if before is not None else 0
        self.seen[key] = UnexpectedEngine(rank, count + 1, self.wall_clock())
        while len(self.seen) > MAX_UNEXPECTED:
            del self.seen[next(iter(self.seen))]
