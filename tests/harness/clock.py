"""A clock the test moves, for code that takes ``clock`` / ``wall_clock`` callables."""

from __future__ import annotations


class ManualClock:
    """``clock()`` is ``now``; the test sets or advances ``now``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
