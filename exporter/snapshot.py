"""Immutable fleet snapshots: what one poll learned, published whole for scrapes and /status."""

from __future__ import annotations

from dataclasses import dataclass

from exporter.aggregate import ConsensusVerdict, FleetState
from exporter.fleet import EngineDetail, EngineOutcome


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    engine: str
    detail: EngineDetail
    sleeping_outcome: EngineOutcome | None
    paused_outcome: EngineOutcome | None
    last_success_unix: float | None

    @property
    def up(self) -> bool:
        return self.sleeping_outcome is not None and self.sleeping_outcome.ok

    @property
    def sleeping(self) -> bool | None:
        o = self.sleeping_outcome
        return o.value if o is not None and o.ok and isinstance(o.value, bool) else None

    @property
    def paused(self) -> bool | None:
        o = self.paused_outcome
        if not self.up or o is None or not o.ok or not isinstance(o.value, bool):
            return None
        return bool(o.value)

    @property
    def state(self) -> str:
        """awake | asleep | paused | unknown (vLLM's is_sleeping is also true while paused)."""
        if self.sleeping is None:
            return "unknown"
        if self.paused:
            return "paused"
        return "asleep" if self.sleeping else "awake"


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    taken_at_unix: float
    poll_duration_s: float
    engines: tuple[EngineSnapshot, ...]
    sleeping: ConsensusVerdict
    paused: ConsensusVerdict
    expected: int
    connected: int
    poll_number: int

    @property
    def ready(self) -> bool:
        """Every expected engine finished its handshake and answered the last poll."""
        return (
            bool(self.engines)
            and self.connected == self.expected
            and all(e.up for e in self.engines)
        )


def empty_snapshot(details: list[EngineDetail], expected: int, connected: int) -> FleetSnapshot:
    """The snapshot before the first poll: every engine unknown."""
    unknown = ConsensusVerdict("is_sleeping", FleetState.UNKNOWN)
    return FleetSnapshot(
        taken_at_unix=0.0,
        poll_duration_s=0.0,
        engines=tuple(EngineSnapshot(d.engine, d, None, None, None) for d in details),
        sleeping=unknown,
        paused=ConsensusVerdict("is_scheduler_paused", FleetState.UNKNOWN),
        expected=expected,
        connected=connected,
        poll_number=0,
    )
