"""A prometheus_client custom Collector: every series rendered from one snapshot at scrape time.

No module-level metric objects: each app (and each test) builds its own ``CollectorRegistry``
with one ``ExporterCollector`` reading the latest ``FleetSnapshot`` plus the ``Stats`` counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from exporter import __version__
from exporter.aggregate import FleetState
from exporter.metrics_catalog import BY_NAME, ENGINE_STATES, FLEET_STATES
from exporter.snapshot import FleetSnapshot
from exporter.stats import Stats
from exporter.transport.events import ProtocolErrorTally


class _Families:
    """Builds families from the catalog, appending the optional ``model_name`` label."""

    def __init__(self, model_name: str | None) -> None:
        self.extra_names: list[str] = ["model_name"] if model_name else []
        self.extra_values: list[str] = [model_name] if model_name else []

    def _labels(self, name: str) -> list[str]:
        return [*BY_NAME[name].labels, *self.extra_names]

    def gauge(self, name: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, BY_NAME[name].help, labels=self._labels(name))

    def counter(self, name: str) -> CounterMetricFamily:
        spec = BY_NAME[name]
        return CounterMetricFamily(spec.family, spec.help, labels=self._labels(name))

    def histogram(self, name: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, BY_NAME[name].help, labels=self._labels(name))

    def values(self, *labels: str) -> list[str]:
        return [*labels, *self.extra_values]


class ExporterCollector(Collector):
    """Renders the latest snapshot and the counters; cheap enough to run on every scrape."""

    def __init__(
        self,
        snapshot: Callable[[], FleetSnapshot],
        stats: Stats,
        protocol_errors: ProtocolErrorTally,
        *,
        model_name: str | None = None,
        include_relay: bool = False,
    ) -> None:
        self._snapshot = snapshot
        self._stats = stats
        self._errors = protocol_errors
        self._f = _Families(model_name)
        self._include_relay = include_relay

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from self._engine_families(snap)
        yield from self._fleet_families(snap)
        yield from self._counter_families()

    def _engine_families(self, snap: FleetSnapshot) -> Iterator[Metric]:
        f = self._f
        up = f.gauge("vllm_dp_engine_up")
        sleeping = f.gauge("vllm_dp_engine_sleeping")
        paused = f.gauge("vllm_dp_engine_paused")
        state = f.gauge("vllm_dp_engine_state")
        last_ok = f.gauge("vllm_dp_engine_last_success_timestamp_seconds")
        info = f.gauge("vllm_dp_engine_info")
        for e in snap.engines:
            up.add_metric(f.values(e.engine), 1.0 if e.up else 0.0)
            if e.sleeping is not None:
                sleeping.add_metric(f.values(e.engine), float(e.sleeping))
            if e.paused is not None:
                paused.add_metric(f.values(e.engine), float(e.paused))
            current = e.state
            for s in ENGINE_STATES:
                state.add_metric(f.values(e.engine, s), 1.0 if s == current else 0.0)
            if e.last_success_unix is not None:
                last_ok.add_metric(f.values(e.engine), e.last_success_unix)
            d = e.detail
            if d.vllm_version is not None or d.enable_sleep_mode is not None:
                mode = "" if d.enable_sleep_mode is None else str(d.enable_sleep_mode).lower()
                info.add_metric(f.values(e.engine, d.vllm_version or "", mode), 1.0)
        yield from (up, sleeping, paused, state, last_ok, info)

    def _fleet_families(self, snap: FleetSnapshot) -> Iterator[Metric]:
        f = self._f
        verdict = snap.sleeping
        sleeping = f.gauge("vllm_dp_sleeping")
        consistent = f.gauge("vllm_dp_sleep_state_consistent")
        if verdict.state is FleetState.CONSISTENT:
            sleeping.add_metric(f.values(), float(bool(verdict.value)))
            consistent.add_metric(f.values(), 1.0)
        elif verdict.state is FleetState.INCONSISTENT:
            consistent.add_metric(f.values(), 0.0)
        fleet = f.gauge("vllm_dp_fleet_state")
        for s in FLEET_STATES:
            fleet.add_metric(f.values(s), 1.0 if s == verdict.state.value else 0.0)
        expected = f.gauge("vllm_dp_engines_expected")
        expected.add_metric(f.values(), float(snap.expected))
        connected = f.gauge("vllm_dp_engines_connected")
        connected.add_metric(f.values(), float(snap.connected))
        duration = f.gauge("vllm_dp_poll_duration_seconds")
        last_poll = f.gauge("vllm_dp_last_poll_timestamp_seconds")
        if snap.poll_number:
            duration.add_metric(f.values(), snap.poll_duration_s)
            last_poll.add_metric(f.values(), snap.taken_at_unix)
        build = f.gauge("vllm_dp_exporter_build_info")
        build.add_metric(f.values(__version__), 1.0)
        yield from (sleeping, consistent, fleet, expected, connected, duration, last_poll, build)

    def _counter_families(self) -> Iterator[Metric]:
        f, st = self._f, self._stats
        yield _counter(
            f, "vllm_dp_inconsistent_utility_results_total", _keyed(st.inconsistent_results)
        )
        yield _counter(f, "vllm_dp_utility_calls_total", st.utility_calls.items())
        calls = f.histogram("vllm_dp_utility_call_duration_seconds")
        for method, hist in sorted(st.call_durations.items()):
            calls.add_metric(f.values(method), hist.cumulative(), hist.total)
        yield calls
        yield _counter(f, "vllm_dp_prefix_cache_resets_total", _keyed(st.resets))
        yield _counter(
            f, "vllm_dp_prefix_cache_reset_engine_failures_total", st.reset_engine_failures.items()
        )
        resets = f.histogram("vllm_dp_prefix_cache_reset_duration_seconds")
        resets.add_metric(f.values(), st.reset_durations.cumulative(), st.reset_durations.total)
        yield resets
        last_reset = f.gauge("vllm_dp_prefix_cache_last_success_timestamp_seconds")
        if st.last_reset_success_unix is not None:
            last_reset.add_metric(f.values(), st.last_reset_success_unix)
        yield last_reset
        yield _counter(f, "vllm_dp_protocol_errors_total", _keyed(self._errors.counts))
        polls = f.counter("vllm_dp_polls_total")
        polls.add_metric(f.values(), float(st.polls))
        yield polls
        yield _counter(f, "vllm_dp_admin_requests_total", st.admin_requests.items())
        if self._include_relay:
            yield _counter(f, "vllm_dp_relay_handshakes_total", _keyed(st.relay_handshakes))


def _keyed(counts: Mapping[str, int]) -> list[tuple[tuple[str, ...], int]]:
    """Single-label counters: ``{"x": 3}`` → ``[(("x",), 3)]``."""
    return [((key,), value) for key, value in counts.items()]


def _counter(
    f: _Families, name: str, rows: Iterable[tuple[tuple[str, ...], int]]
) -> CounterMetricFamily:
    family = f.counter(name)
    for labels, value in sorted(rows):
        family.add_metric(f.values(*labels), float(value))
    return family


def build_registry(collector: ExporterCollector) -> CollectorRegistry:
    """A fresh registry holding only this exporter's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
