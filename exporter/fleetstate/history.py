"""The fleet's state over the last hour, in a bounded in-memory ring (pure, no clocks).

Every published poll is folded into a time bucket (``bucket_s`` wide, 30 s by default): the
bucket keeps the worst state each invariant had in it (inconsistent > unknown > consistent) and
the fewest engines up. At most ``window_s / bucket_s`` buckets are kept (120 for one hour),
whatever the poll interval, so the ring costs the same at 0.1 s and at 30 s polls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

#: Worse states win when polls are folded into one bucket.
SEVERITY = {"consistent": 0, "unknown": 1, "inconsistent": 2}


def worst(a: str, b: str) -> str:
    return a if SEVERITY.get(a, 1) >= SEVERITY.get(b, 1) else b


@dataclass(slots=True)
class HistoryEntry:
    """One bucket: the polls published between ``start_unix`` and ``end_unix``."""

    bucket: int
    start_unix: float
    end_unix: float
    polls: int
    #: invariant method → its worst state in the bucket.
    states: dict[str, str]
    engines_up_min: int
    engines_expected: int

    def fold(self, unix: float, states: Mapping[str, str], up: int, expected: int) -> None:
        self.end_unix = max(self.end_unix, unix)
        self.polls += 1
        for method, state in states.items():
            self.states[method] = worst(self.states.get(method, state), state)
        self.engines_up_min = min(self.engines_up_min, up)
        self.engines_expected = max(self.engines_expected, expected)


@dataclass
class FleetHistory:
    """``record`` once per poll; ``entries(now)`` the buckets of the last ``window_s``."""

    bucket_s: float = 30.0
    window_s: float = 3600.0
    _ring: deque[HistoryEntry] = field(init=False)

    def __post_init__(self) -> None:
        self._ring = deque(maxlen=max(1, math.ceil(self.window_s / self.bucket_s)))

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def record(self, unix: float, states: Mapping[str, str], up: int, expected: int) -> None:
        bucket = math.floor(unix / self.bucket_s)
        last = self._ring[-1] if self._ring else None
        if last is not None and last.bucket == bucket:
            last.fold(unix, states, up, expected)
            return
        self._ring.append(HistoryEntry(bucket, unix, unix, 1, dict(states), up, expected))

    def entries(self, now: float | None = None) -> list[HistoryEntry]:
        """Oldest first; with ``now``, only the buckets that end within the window."""
        if now is None:
            return list(self._ring)
        return [e for e in self._ring if e.end_unix >= now - self.window_s]

    def __iter__(self) -> Iterator[HistoryEntry]:
        return iter(self._ring)

    def __len__(self) -> int:
        return len(self._ring)
