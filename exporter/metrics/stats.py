"""Counters and histograms the poller and admin code increment (plain data, no globals).

The collector renders these at scrape time; a scrape never changes them, so several Prometheus
replicas scraping one exporter see the same numbers. Every change goes through a method here
that bumps ``generation``: the render cache is keyed on it, so a scrape never serves a body
older than the counters it shows.

Histograms are plain data too (``Histogram`` below), not prometheus_client's: its metric objects
keep their values in ``PROMETHEUS_MULTIPROC_DIR`` files when that is set (vLLM sets it for
several API servers), where vLLM's own multiprocess collector would render them a second time.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from prometheus_client.utils import floatToGoString

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.metrics.catalog import (
    ADMIN_ACTIONS,
    BY_NAME,
    RESET_FAILURE_REASONS,
    RESET_OUTCOMES,
)

_float_to_go = cast(Callable[[float], str], floatToGoString)
#: Each outcome's label value (a dict look-up: the enum's ``value`` is a descriptor call).
_LABEL = {outcome: outcome.value for outcome in Outcome}
#: The outcomes whose duration is a round trip (an answer came).
_ROUND_TRIPS = frozenset({Outcome.OK, Outcome.FAILED})
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RESET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: (label values without ``le``, cumulative (le, count) pairs ending with +Inf, sum).
HistogramRow = tuple[tuple[str, ...], list[tuple[str, float]], float]


class _Child:
    """One label set's bucket counts (not cumulative) and sum."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        # The first bucket whose bound is at least ``value`` (NaN: none, it counts in +Inf).
        self.counts[bisect.bisect_left(self._bounds, value) if value == value else -1] += 1


class Histogram:
    """A labelled histogram as plain data, rendered as prometheus_client renders its own
    (``le`` written by ``floatToGoString``, buckets cumulative, ending with ``+Inf``)."""

    def __init__(self, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self.labelnames = labelnames
        self.bounds = tuple(sorted(buckets))
        self._les = [*(_float_to_go(b) for b in self.bounds), "+Inf"]
        self._children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *values: str) -> _Child:
        if len(values) != len(self.labelnames):
            raise ValueError(f"expected labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Child(self.bounds)
        return child

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self.labels().observe(value)

    def rows(self) -> list[HistogramRow]:
        """Every labelled child as plain rows, in label order."""
        return list(self.iter_rows())

    def iter_rows(self) -> Iterator[HistogramRow]:
        """``rows`` one label set at a time (the label sets as they are now; one forgotten
        meanwhile is left out): a builder taking steps reads each when it gets to it."""
        for labels in sorted(self._children):
            child = self._children.get(labels)
            if child is None:
                continue
            running, buckets = 0, []
            for le, count in zip(self._les, child.counts, strict=True):
                running += count
                buckets.append((le, float(running)))
            yield labels, buckets, child.total


def _histogram(name: str, buckets: tuple[float, ...]) -> Histogram:
    hist = Histogram(BY_NAME[name].labels, buckets)
    if not hist.labelnames:
        hist.labels()  # an unlabelled histogram is published from the start, at 0
    return hist


@dataclass(frozen=True, slots=True)
class LastAction:
    """The last admin action that ran (whatever its outcome), for /status and the page."""

    action: str
    unix: float
    #: The HTTP status it was answered with (200, 502, 503 ...).
    status: int
    outcome: str
    #: (engine, ok, reason, error) per engine called.
    engines: tuple[tuple[str, bool, str | None, str | None], ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    duration_s: float | None = None

    @classmethod
    def from_body(
        cls, action: str, status: int, body: Mapping[str, Any], unix: float
    ) -> LastAction:
        """From the admin answer's body (``exporter.control.verdicts.verdict_body``, either
        shape: parameters as ``params``, or as ``flags`` for the prefix-cache reset)."""
        engines = tuple(
            (str(e.get("engine")), bool(e.get("ok")), e.get("reason"), e.get("error"))
            for e in body.get("engines", [])
            if isinstance(e, Mapping)
        )
        params = body.get("params", body.get("flags", {}))
        duration = body.get("duration_s")
        return cls(
            action,
            unix,
            status,
            str(body.get("outcome", "failure")),
            engines,
            dict(params) if isinstance(params, Mapping) else {},
            str(body["error"]) if body.get("error") else None,
            float(duration) if isinstance(duration, (int, float)) else None,
        )


@dataclass
class Stats:
    """Every counter the exporter keeps, keyed by label tuples."""

    utility_calls: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    call_durations: Histogram = field(
        default_factory=lambda: _histogram("vllm_dp_utility_call_duration_seconds", CALL_BUCKETS)
    )
    inconsistent_results: Counter[str] = field(default_factory=Counter)
    resets: Counter[str] = field(default_factory=Counter)
    reset_engine_failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    reset_durations: Histogram = field(
        default_factory=lambda: _histogram(
            "vllm_dp_prefix_cache_reset_duration_seconds", RESET_BUCKETS
        )
    )
    last_reset_success_unix: float | None = None
    #: Engine → prefix-cache resets it confirmed, whatever action ran them (preset to 0).
    confirmed_resets: Counter[str] = field(default_factory=Counter)
    #: Engine → (unix, action) of its last confirmed prefix-cache reset.
    last_resets: dict[str, tuple[float, str]] = field(default_factory=dict)
    admin_requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: (action, outcome) and (action, engine, reason) of every completed admin action.
    admin_actions: Counter[tuple[str, str]] = field(default_factory=Counter)
    admin_action_failures: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    #: engine → mismatching parameters in the last weight verification.
    weight_checksum_mismatches: dict[str, int] = field(default_factory=dict)
    polls: int = 0
    generation: int = 0
    #: When these counters started (the process's start, in practice).
    started_unix: float = field(default_factory=time.time)
    last_action: LastAction | None = None

    def preset(self, engines: Iterable[str]) -> None:
        """Start the outcome series at 0 so that ``increase()`` sees their first event."""
        for method in ("is_sleeping", "is_scheduler_paused", "get_weight_version"):
            self.inconsistent_results[method] += 0
        for outcome in RESET_OUTCOMES:
            self.resets[outcome] += 0
            for action in ADMIN_ACTIONS:
                self.admin_actions[(action, outcome)] += 0
        for engine in engines:
            self.confirmed_resets[engine] += 0
            for reason in RESET_FAILURE_REASONS:
                self.reset_engine_failures[(engine, reason)] += 0
        self.generation += 1

    def keep_engines(self, engines: Iterable[str]) -> None:
        """Forget every per-engine counter of engines no longer in the fleet (a plugin-enabled
        server's ranks follow its answers): their series end instead of piling up."""
        kept = set(engines)
        for key in [k for k in self.utility_calls if k[1] not in kept]:
            del self.utility_calls[key]
        for failure in [k for k in self.admin_action_failures if k[1] not in kept]:
            del self.admin_action_failures[failure]
        for reset in [k for k in self.reset_engine_failures if k[0] not in kept]:
            del self.reset_engine_failures[reset]
        for mapping in (self.confirmed_resets, self.last_resets, self.weight_checksum_mismatches):
            for engine in [e for e in mapping if e not in kept]:
                del mapping[engine]
        self.generation += 1

    def record_calls(self, method: str, outcomes: Iterable[EngineOutcome]) -> None:
        hist = self.call_durations.labels(method)
        calls = self.utility_calls
        for o in outcomes:
            calls[(method, o.engine, _LABEL[o.outcome])] += 1
            # Only real round trips: a timeout or a refused send measured nothing.
            if o.duration_s is not None and o.outcome in _ROUND_TRIPS:
                hist.observe(o.duration_s)
        self.generation += 1

    def record_poll(self, inconsistent_methods: Iterable[str]) -> None:
        self.polls += 1
        for method in inconsistent_methods:
            self.inconsistent_results[method] += 1
        self.generation += 1

    def record_reset(
        self,
        outcome: str,
        failures: Iterable[tuple[str, str]] = (),
        duration_s: float | None = None,
        success_unix: float | None = None,
    ) -> None:
        """One admin reset: its outcome, (engine, reason) per failed engine, its duration."""
        self.resets[outcome] += 1
        for failure in failures:
            self.reset_engine_failures[failure] += 1
        if duration_s is not None:
            self.reset_durations.observe(duration_s)
        if success_unix is not None:
            self.last_reset_success_unix = success_unix
        self.generation += 1

    def record_confirmed_resets(self, engines: Iterable[str], action: str, unix: float) -> None:
        """Engines that confirmed a prefix-cache reset (``exporter.control.resets``) at ``unix``."""
        for engine in engines:
            self.confirmed_resets[engine] += 1
            self.last_resets[engine] = (unix, action)
        self.generation += 1

    def record_action(
        self, action: str, outcome: str, failures: Iterable[tuple[str, str]] = ()
    ) -> None:
        """One completed admin action: its outcome and (engine, reason) per failed engine."""
        self.admin_actions[(action, outcome)] += 1
        for engine, reason in failures:
            self.admin_action_failures[(action, engine, reason)] += 1
        self.generation += 1

    def record_weight_verification(self, mismatches: dict[str, int]) -> None:
        self.weight_checksum_mismatches = dict(mismatches)
        self.generation += 1

    def record_admin_request(self, action: str, status: int) -> None:
        self.admin_requests[(action, str(status))] += 1
        self.generation += 1

    def record_last_action(
        self, action: str, status: int, body: Mapping[str, Any], unix: float | None = None
    ) -> None:
        """The admin action that just ran, as its answer's body says (shown by /status)."""
        self.last_action = LastAction.from_body(action, status, body, unix or time.time())
        self.generation += 1
