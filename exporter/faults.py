"""Counts of what went wrong outside the happy path, shared by every layer that sees it.

``ProtocolErrorTally`` counts frames and peers the exporter rejected (by kind) and background
tasks that failed (by task name), and logs each kind at most once per interval: a hostile or
broken peer can send thousands of bad frames a second, so the counter keeps the full count while
the log keeps one line per kind per ``log_interval_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("exporter.protocol_errors")


@dataclass
class ProtocolErrorTally:
    """Rejected frames/peers by kind, failed background tasks by name; rate-limited logs."""

    log_interval_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    counts: dict[str, int] = field(default_factory=dict)
    #: Background tasks that raised unexpectedly (and were restarted or stopped the process).
    task_failures: dict[str, int] = field(default_factory=dict)
    #: Bumped on every record: part of the render cache's generation.
    generation: int = 0
    _last_logged: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, detail: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.generation += 1
        if self._should_log(kind):
            suppressed = self._suppressed.pop(kind, 0)
            more = f" ({suppressed} more since last report)" if suppressed else ""
            log.warning("protocol error %s: %s%s", kind, detail, more)

    def task_failed(self, task: str, exc: BaseException) -> None:
        """A background task raised; the traceback is logged at most once per interval."""
        self.task_failures[task] = self.task_failures.get(task, 0) + 1
        self.generation += 1
        if self._should_log(f"task:{task}"):
            log.error("background task %s failed", task, exc_info=exc)

    def _should_log(self, key: str) -> bool:
        now = self.clock()
        last = self._last_logged.get(key)
        if last is None or now - last >= self.log_interval_s:
            self._last_logged[key] = now
            return True
        self._suppressed[key] = self._suppressed.get(key, 0) + 1
        return False
