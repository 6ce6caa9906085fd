"""What the transport layer reports upward, and the protocol-error tally shared by the layers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from exporter.protocol import EngineOutput, RegistrationInfo

log = logging.getLogger("exporter.protocol_errors")


class TransportListener(Protocol):
    """Callbacks the transport makes, on the event loop thread, in arrival order."""

    def on_output(self, engine_index: int, output: EngineOutput) -> None: ...

    def on_engine_down(self, engine_index: int, reason: str) -> None: ...

    def on_engine_up(self, engine_index: int) -> None: ...


@dataclass
class ProtocolErrorTally:
    """Counts rejected frames/peers by kind and logs each kind at most once per interval.

    A hostile or broken peer can send thousands of bad frames a second; the counter keeps the
    full count while the log keeps one line per kind per ``log_interval_s`` (no log floods).
    """

    log_interval_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    counts: dict[str, int] = field(default_factory=dict)
    _last_logged: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = self.clock()
        last = self._last_logged.get(kind)
        if last is None or now - last >= self.log_interval_s:
            suppressed = self._suppressed.pop(kind, 0)
            more = f" ({suppressed} more since last report)" if suppressed else ""
            log.warning("protocol error %s: %s%s", kind, detail, more)
            self._last_logged[kind] = now
        else:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1


@dataclass(frozen=True, slots=True)
class EngineLinkView:
    """A read-only view of one engine's link state, for status pages and the client."""

    engine_index: int
    connected: bool
    dead: bool
    handshakes: int
    registration: RegistrationInfo | None
    output_address: str
