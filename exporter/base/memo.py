"""``ShortMemo``: one value per key, read again only once it is older than a few milliseconds.

In-process mode reads vLLM's front-end tables (the coordinator's counts, its own unfinished
requests) for every engine several times in one step of a poll: before a burst's calls, for
what they tell, and after. Those tables change at most every 100 ms (the coordinator) or per
request; one read serves the reads of the same moment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

T = TypeVar("T")


class ShortMemo:
    """``get(key, ranks, read)``: ``read()``'s value, kept for ``window_s`` for equal ``ranks``."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._kept: dict[str, tuple[float, Hashable, Any]] = {}

    def get(self, key: str, ranks: Hashable, read: Callable[[], T]) -> T:
        now = self._clock()
        kept = self._kept.get(key)
        if kept is not None and now - kept[0] < self.window_s and kept[1] == ranks:
            return cast("T", kept[2])
        value = read()
        self._kept[key] = (now, ranks, value)
        return value

    def clear(self) -> None:
        """The next ``get`` reads afresh (something that may change the tables happened)."""
        self._kept.clear()
