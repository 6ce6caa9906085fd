"""Counters and histograms the poller and admin code increment (plain data, no globals).

The collector renders these at scrape time; a scrape never changes them, so several Prometheus
replicas scraping one exporter see the same numbers.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from exporter.fleet import EngineOutcome, Outcome
from exporter.metrics_catalog import RESET_FAILURE_REASONS, RESET_OUTCOMES

CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RESET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Fixed-bucket histogram: per-bucket (non-cumulative) counts, a sum and a count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs including +Inf, as HistogramMetricFamily wants."""
        out = []
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), float(running)))
        out.append(("+Inf", float(self.count)))
        return out


@dataclass
class Stats:
    """Every counter the exporter keeps, keyed by label tuples."""

    utility_calls: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    call_durations: dict[str, Histogram] = field(default_factory=dict)
    inconsistent_results: Counter[str] = field(default_factory=Counter)
    resets: Counter[str] = field(default_factory=Counter)
    reset_engine_failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    reset_durations: Histogram = field(default_factory=lambda: Histogram(RESET_BUCKETS))
    last_reset_success_unix: float | None = None
    admin_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    relay_handshakes: Counter[str] = field(default_factory=Counter)
    polls: int = 0

    def preset(self, engines: list[str]) -> None:
        """Start the outcome series at 0 so that ``increase()`` sees their first event."""
        for method in ("is_sleeping", "is_scheduler_paused"):
            self.inconsistent_results[method] += 0
        for outcome in RESET_OUTCOMES:
            self.resets[outcome] += 0
        for engine in engines:
            for reason in RESET_FAILURE_REASONS:
                self.reset_engine_failures[(engine, reason)] += 0

    def record_calls(self, method: str, outcomes: list[EngineOutcome]) -> None:
        hist = self.call_durations.get(method)
        if hist is None:
            hist = self.call_durations[method] = Histogram(CALL_BUCKETS)
        for o in outcomes:
            self.utility_calls[(method, o.engine, o.outcome.value)] += 1
            # Only real round trips: a timeout or a refused send measured nothing.
            if o.duration_s is not None and o.outcome in (Outcome.OK, Outcome.FAILED):
                hist.observe(o.duration_s)
