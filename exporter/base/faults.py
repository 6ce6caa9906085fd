"""Counts of what went wrong outside the happy path, shared by every layer that sees it.

``ProtocolErrorTally`` counts frames and peers the exporter rejected (by kind) and background
tasks that failed (by task name), and logs each kind at most once per interval: a hostile or
broken peer can send thousands of bad frames a second, so the counter keeps the full count while
the log keeps one line per kind per ``log_interval_s``. Malformed HTTP requests (refused by
aiohttp's parser before any handler runs) are tallied the same way, per listener.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("exporter.protocol_errors")
http_log = logging.getLogger("exporter.http")


@dataclass
class ProtocolErrorTally:
    """Rejected frames/peers by kind, failed background tasks by name; rate-limited logs."""

    log_interval_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    counts: dict[str, int] = field(default_factory=dict)
    #: Background tasks that raised unexpectedly (and were restarted or stopped the process).
    task_failures: dict[str, int] = field(default_factory=dict)
    #: Malformed HTTP requests by listener (``metrics``, ``admin``).
    http_bad_requests: dict[str, int] = field(default_factory=dict)
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

    def http_listener(self, listener: str) -> Callable[[str], None]:
        """The sink of one listener's malformed requests; its series starts at 0."""
        self.http_bad_requests.setdefault(listener, 0)
        self.generation += 1
        return functools.partial(self.bad_http_request, listener)

    def bad_http_request(self, listener: str, detail: str) -> None:
        """A request aiohttp's parser refused (answered 400): counted, logged as one line at
        most once per interval per listener (a scanner sends thousands)."""
        self.http_bad_requests[listener] = self.http_bad_requests.get(listener, 0) + 1
        self.generation += 1
        key = f"http:{listener}"
        if self._should_log(key):
            suppressed = self._suppressed.pop(key, 0)
            more = f" ({suppressed} more since last report)" if suppressed else ""
            http_log.warning(
                "malformed HTTP request on the %s listener: %s%s", listener, detail, more
            )

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
