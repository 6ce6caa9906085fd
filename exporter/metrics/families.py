"""What the exporter publishes, computed once per scrape from one snapshot plus the counters.

``family_steps`` is the one place that decides every series and value: it returns plain rows
(label values, value) per catalog family. Two serializers read those rows:
``ExporterCollector``, a prometheus_client custom ``Collector`` (each app and test registers
it in its own ``CollectorRegistry``; OpenMetrics goes through it), and
``exporter.metrics.exposition.text_steps``, a lean Prometheus text encoder for the hot
``/metrics`` path, kept byte-identical to prometheus_client's ``generate_latest`` by a test.
Both are written once, as steps (``exporter.base.steps``): ``run_steps`` runs them at once,
``run_steps_async`` a step per loop turn (in-process mode, on vLLM's loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from exporter import __version__
from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import Steps, every, run_steps
from exporter.client.fleet import ELASTIC_EP_PHASES, ClientCounters, EngineDetail
from exporter.client.pushes import FT_STATE_VALUES
from exporter.fleetstate.activity import routability
from exporter.fleetstate.aggregate import FleetState
from exporter.fleetstate.invariants import CHECKPOINT, WEIGHT_VERSION
from exporter.fleetstate.snapshot import FleetSnapshot
from exporter.metrics.catalog import (
    BY_NAME,
    CHECKPOINT_STATES,
    ENGINE_STATES,
    FLEET_STATES,
    INFO_FACTS,
    UNKNOWN_FACT,
    MetricSpec,
)
from exporter.metrics.stats import Histogram, Stats

Labels = tuple[str, ...]


@dataclass(slots=True)
class Family:
    """One catalog family's rows; ``labels`` include ``model_name`` when configured."""

    spec: MetricSpec
    labels: tuple[str, ...]
    rows: list[tuple[Labels, float]] = field(default_factory=list)
    #: Histograms: (label values, cumulative (le, count) pairs ending with +Inf, sum).
    histograms: list[tuple[Labels, list[tuple[str, float]], float]] = field(default_factory=list)


class _Builder:
    """Appends the optional ``model_name`` label value to every row."""

    def __init__(self, model_name: str | None) -> None:
        self.extra_names: Labels = ("model_name",) if model_name else ()
        self.extra_values: Labels = (model_name,) if model_name else ()
        self.families: list[Family] = []

    def family(self, name: str) -> Family:
        spec = BY_NAME[name]
        fam = Family(spec, (*spec.labels, *self.extra_names))
        self.families.append(fam)
        return fam

    def add(self, fam: Family, labels: Labels, value: float) -> None:
        fam.rows.append(((*labels, *self.extra_values), value))

    def counter(self, name: str, rows: Mapping[Any, int]) -> None:
        """``rows`` maps label-value tuples to counts."""
        fam = self.family(name)
        for labels, value in sorted(rows.items()):
            self.add(fam, labels, float(value))

    def histograms(self, name: str, hist: Histogram) -> Steps[None]:
        fam = self.family(name)
        for position, (labels, buckets, total) in enumerate(hist.iter_rows(), 1):
            if every(position):
                yield
            fam.histograms.append(((*labels, *self.extra_values), buckets, total))


#: The feeds' series (``exporter.feed``): name → label values → value.
FeedFigures = Mapping[str, Mapping[Labels, float]]


def _single(counts: Mapping[str, int]) -> dict[Labels, int]:
    return {(key,): value for key, value in counts.items()}


def family_steps(
    snap: FleetSnapshot,
    stats: Stats,
    faults: ProtocolErrorTally,
    model_name: str | None = None,
    client_counters: ClientCounters | None = None,
    feed: FeedFigures | None = None,
) -> Steps[list[Family]]:
    """Every series the exporter publishes now, in exposition order, in steps of
    ``ENGINES_PER_STEP`` engines (``exporter.base.steps``); ``client_counters`` are the attach
    mode's own (``FleetClient.counters``). Run a step per loop turn, the counters it reads may
    move between steps: copied first."""
    counters = {name: dict(counts) for name, counts in (client_counters or {}).items()}
    b = _Builder(model_name)
    yield from _engine_rows(b, snap)
    yield from _progress_rows(b, snap)
    _push_rows(b, snap)
    _elastic_ep_rows(b, snap)
    yield
    _fleet_rows(b, snap)
    yield from _counter_rows(b, stats, faults, counters)
    for name, rows in (feed or {}).items():  # the feeds' own series (exporter.feed)
        _rows(b, name, sorted(rows.items()))
    return b.families


def _engine_rows(b: _Builder, snap: FleetSnapshot) -> Steps[None]:
    up = b.family("vllm_dp_engine_up")
    sleeping = b.family("vllm_dp_engine_sleeping")
    paused = b.family("vllm_dp_engine_paused")
    state = b.family("vllm_dp_engine_state")
    silent = b.family("vllm_dp_engine_unresponsive_seconds")
    routable = b.family("vllm_dp_engine_routable")
    has_work = b.family("vllm_dp_engine_has_work")
    # Declared only where the mode learns counts (owner mode never has them).
    requests = b.family("vllm_dp_engine_requests") if snap.request_counts_known else None
    last_ok = b.family("vllm_dp_engine_last_success_timestamp_seconds")
    info = b.family("vllm_dp_engine_info")
    weights = b.family("vllm_dp_engine_weight_version_info")
    checkpoint = b.family("vllm_dp_engine_checkpoint_state")
    for position, e in enumerate(snap.engines, 1):
        if every(position):
            yield
        engine = (e.engine,)
        b.add(up, engine, 1.0 if e.up else 0.0)
        if e.sleeping is not None:
            b.add(sleeping, engine, float(e.sleeping))
        if e.paused is not None:
            b.add(paused, engine, float(e.paused))
        current = e.state
        for s in ENGINE_STATES:
            b.add(state, (e.engine, s), 1.0 if s == current else 0.0)
        if snap.poll_number:  # after the first poll (before it, nothing is known)
            b.add(silent, engine, round(e.unresponsive_s, 3))
            b.add(routable, engine, 1.0 if routability(e).routable else 0.0)
        if e.has_work is not None:
            b.add(has_work, engine, float(e.has_work))
        counts = e.requests
        if counts is not None and requests is not None:
            b.add(requests, (e.engine, "running"), float(counts.running))
            b.add(requests, (e.engine, "waiting"), float(counts.waiting))
        if e.last_success_unix is not None:
            b.add(last_ok, engine, e.last_success_unix)
        d = e.detail
        if d.registration or d.vllm_version is not None or d.enable_sleep_mode is not None:
            b.add(info, (e.engine, *info_labels(d)), 1.0)
        if e.known(WEIGHT_VERSION) and e.up:
            b.add(weights, (e.engine, e.weight_version or ""), 1.0)
        if e.known(CHECKPOINT):
            current = CHECKPOINT.state_of(e.value(CHECKPOINT))
            for s in CHECKPOINT_STATES:
                b.add(checkpoint, (e.engine, s), 1.0 if s == current else 0.0)


def _progress_rows(b: _Builder, snap: FleetSnapshot) -> Steps[None]:
    """Each engine's computed tokens and how long since they grew (where the mode has a
    source of them: ``progress_known``; an engine it tells nothing of is left out)."""
    if not snap.progress_known:
        return
    tokens = b.family("vllm_dp_engine_progress_tokens_total")
    age = b.family("vllm_dp_engine_last_progress_age_seconds")
    for position, e in enumerate(snap.engines, 1):
        if every(position):
            yield
        if e.progress is not None:
            b.add(tokens, (e.engine,), float(e.progress.tokens))
            b.add(age, (e.engine,), round(e.progress_age_s or 0.0, 3))


def info_labels(d: EngineDetail) -> Labels:
    """``INFO_FACTS`` of one engine as label values (``unknown`` where it did not say)."""
    facts = dict(d.registration)
    facts.setdefault("vllm_version", d.vllm_version)
    facts.setdefault("front_end", d.front_end)
    facts.setdefault("rust_frontend_version", d.rust_frontend_version)
    facts.setdefault("enable_sleep_mode", d.enable_sleep_mode)
    values = []
    for key in INFO_FACTS:
        value = facts.get(key)
        if value is None:
            values.append(UNKNOWN_FACT)
        elif isinstance(value, bool):
            values.append(str(value).lower())
        else:
            values.append(str(value))
    return tuple(values)


def _push_rows(b: _Builder, snap: FleetSnapshot) -> None:
    """Fault-tolerance status and membership events per engine (``exporter.client.pushes``).
    Each family appears once it has a series: an exporter that never learned a status (vLLM
    without ``--enable-fault-tolerance``, relay mode) shows none of them."""
    status: list[tuple[Labels, float]] = []
    pushes: list[tuple[Labels, float]] = []
    events: list[tuple[Labels, float]] = []
    for e in snap.engines:
        ft = e.detail.fault_status
        if ft is not None:
            status += [((e.engine, s), 1.0 if s == ft.status else 0.0) for s in FT_STATE_VALUES]
        pushes += [((e.engine, kind), float(n)) for kind, n in e.detail.pushes]
        m = e.detail.membership
        if m is not None:
            events.append(((e.engine, m.event), m.received_unix))
    if status:
        _rows(b, "vllm_dp_engine_fault_tolerance_status", status)
        _rows(b, "vllm_dp_fault_tolerance_faulty_engines", [((), float(len(snap.faulty)))])
    if pushes:
        _rows(b, "vllm_dp_engine_pushes_total", pushes)
    if events:
        _rows(b, "vllm_dp_engine_membership_event_timestamp_seconds", events)


def _elastic_ep_rows(b: _Builder, snap: FleetSnapshot) -> None:
    """Each API server's elastic-EP operation (``snap.elastic_ep``): a family appears once it
    has a series (none where no server's operation is known)."""
    phases: list[tuple[Labels, float]] = []
    epochs: list[tuple[Labels, float]] = []
    sizes: list[tuple[Labels, float]] = []
    for read in snap.elastic_ep or ():
        op = read.operation
        if op is None:
            continue
        phases += [((read.target, p), 1.0 if p == op.phase else 0.0) for p in ELASTIC_EP_PHASES]
        if op.epoch_number is not None:
            epochs.append(((read.target,), float(op.epoch_number)))
        if op.requested_data_parallel_size is not None:
            sizes.append(((read.target,), float(op.requested_data_parallel_size)))
    for name, rows in (
        ("vllm_dp_elastic_ep_operation", phases),
        ("vllm_dp_elastic_ep_epoch", epochs),
        ("vllm_dp_elastic_ep_requested_data_parallel_size", sizes),
    ):
        if rows:
            _rows(b, name, rows)


def _rows(b: _Builder, name: str, rows: list[tuple[Labels, float]]) -> None:
    fam = b.family(name)
    for labels, value in rows:
        b.add(fam, labels, value)


def _fleet_rows(b: _Builder, snap: FleetSnapshot) -> None:
    verdict = snap.sleeping
    sleeping = b.family("vllm_dp_sleeping")
    consistent = b.family("vllm_dp_sleep_state_consistent")
    if verdict.state is FleetState.CONSISTENT:
        b.add(sleeping, (), float(bool(verdict.value)))
        b.add(consistent, (), 1.0)
    elif verdict.state is FleetState.INCONSISTENT:
        b.add(consistent, (), 0.0)
    weights = b.family("vllm_dp_weight_version_consistent")
    state = snap.weight_version.state
    if state is not FleetState.UNKNOWN:
        b.add(weights, (), 1.0 if state is FleetState.CONSISTENT else 0.0)
    fleet = b.family("vllm_dp_fleet_state")
    for s in FLEET_STATES:
        b.add(fleet, (s,), 1.0 if s == verdict.state.value else 0.0)
    b.add(b.family("vllm_dp_engines_expected"), (), float(snap.expected))
    b.add(b.family("vllm_dp_engines_connected"), (), float(snap.connected))
    duration = b.family("vllm_dp_poll_duration_seconds")
    last_poll = b.family("vllm_dp_last_poll_timestamp_seconds")
    if snap.poll_number:
        b.add(duration, (), snap.poll_duration_s)
        b.add(last_poll, (), snap.taken_at_unix)
    b.add(b.family("vllm_dp_exporter_build_info"), (__version__,), 1.0)


def _counter_rows(
    b: _Builder, st: Stats, faults: ProtocolErrorTally, client_counters: ClientCounters
) -> Steps[None]:
    b.counter("vllm_dp_inconsistent_utility_results_total", _single(st.inconsistent_results))
    b.counter("vllm_dp_utility_calls_total", st.utility_calls)
    yield
    yield from b.histograms("vllm_dp_utility_call_duration_seconds", st.call_durations)
    b.counter("vllm_dp_prefix_cache_resets_total", _single(st.resets))
    b.counter("vllm_dp_prefix_cache_reset_engine_failures_total", st.reset_engine_failures)
    yield from b.histograms("vllm_dp_prefix_cache_reset_duration_seconds", st.reset_durations)
    last_reset = b.family("vllm_dp_prefix_cache_last_success_timestamp_seconds")
    if st.last_reset_success_unix is not None:
        b.add(last_reset, (), st.last_reset_success_unix)
    engine_reset = b.family("vllm_dp_prefix_cache_last_reset_timestamp_seconds")
    for engine, (unix, _action) in sorted(st.last_resets.items()):
        b.add(engine_reset, (engine,), unix)
    b.counter("vllm_dp_prefix_cache_confirmed_resets_total", _single(st.confirmed_resets))
    b.counter("vllm_dp_admin_actions_total", st.admin_actions)
    b.counter("vllm_dp_admin_action_engine_failures_total", st.admin_action_failures)
    mismatches = b.family("vllm_dp_weight_checksum_mismatches")
    for engine, count in sorted(st.weight_checksum_mismatches.items()):
        b.add(mismatches, (engine,), float(count))
    b.counter("vllm_dp_protocol_errors_total", _single(faults.counts))
    b.counter("vllm_dp_task_failures_total", _single(faults.task_failures))
    b.counter("vllm_dp_http_bad_requests_total", _single(faults.http_bad_requests))
    b.counter("vllm_dp_polls_total", {(): st.polls})
    b.counter("vllm_dp_admin_requests_total", st.admin_requests)
    for name, counts in client_counters.items():  # the attach mode's own series
        b.counter(name, _single(counts))


class ExporterCollector(Collector):
    """The prometheus_client view of ``family_steps`` (OpenMetrics, registries, tests)."""

    def __init__(
        self,
        snapshot: Callable[[], FleetSnapshot],
        stats: Stats,
        faults: ProtocolErrorTally,
        *,
        model_name: str | None = None,
        client_counters: Callable[[], ClientCounters] = dict,
        feed: Callable[[], FeedFigures] = dict,
    ) -> None:
        self._snapshot = snapshot
        self._stats = stats
        self._faults = faults
        self._model_name = model_name
        self._client_counters = client_counters
        self._feed = feed

    def families(self) -> list[Family]:
        return run_steps(self.family_steps())

    def family_steps(self) -> Steps[list[Family]]:
        """``families`` in steps (``exporter.base.steps``): in-process mode builds them a
        step per turn of vLLM's event loop."""
        return family_steps(
            self._snapshot(),
            self._stats,
            self._faults,
            self._model_name,
            self._client_counters(),
            self._feed(),
        )

    def collect(self) -> Iterator[Metric]:
        for fam in self.families():
            yield _to_metric(fam)


def _to_metric(fam: Family) -> Metric:
    spec, labels = fam.spec, list(fam.labels)
    metric: GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily
    if spec.kind == "histogram":
        metric = HistogramMetricFamily(spec.name, spec.help, labels=labels)
        for values, buckets, total in fam.histograms:
            metric.add_metric(list(values), buckets, total)
        return metric
    if spec.kind == "counter":
        metric = CounterMetricFamily(spec.family, spec.help, labels=labels)
    else:
        metric = GaugeMetricFamily(spec.name, spec.help, labels=labels)
    for values, value in fam.rows:
        metric.add_metric(list(values), value)
    return metric


def build_registry(*collectors: Collector) -> CollectorRegistry:
    """A fresh registry holding only ``collectors`` (never the global default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def self_collectors() -> list[Collector]:
    """The exporter's own ``process_*`` and ``python_*`` series (memory, CPU, file
    descriptors, garbage collection), created unregistered for this exporter's registries."""
    return [
        ProcessCollector(registry=None),
        PlatformCollector(registry=None),
        # GCCollector always registers itself somewhere: a scratch registry, dropped here.
        GCCollector(registry=CollectorRegistry(auto_describe=False)),
    ]
