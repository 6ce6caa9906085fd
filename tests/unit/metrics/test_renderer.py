"""``Renderer`` (``exporter.metrics.renderer``): every form of the series from one cache. A form
is rendered once per state version (a scrape storm costs one render), never served older than
the state, and each form is exactly what its format says."""

from __future__ import annotations

import gzip

from prometheus_client.registry import CollectorRegistry

from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import Steps, run_steps
from exporter.fleetstate.snapshot import FleetSnapshot
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import ExporterCollector, Family, build_registry, self_collectors
from exporter.metrics.negotiation import CONTENT_TYPES, OPENMETRICS, TEXT
from exporter.metrics.renderer import OURS, Form, Renderer
from exporter.metrics.stats import Stats
from tests.harness.snapshots import engine_snapshot, polled


def snapshot_of(engines: int) -> FleetSnapshot:
    return polled(*(engine_snapshot(str(i), is_sleeping=False) for i in range(engines)))


class CountingCollector(ExporterCollector):
    """Counts how often the families are built (a render's work)."""

    builds = 0

    def family_steps(self) -> Steps[list[Family]]:
        self.builds += 1
        return super().family_steps()


def renderer(
    snap: FleetSnapshot, version: list[int]
) -> tuple[Renderer, CountingCollector, CollectorRegistry]:
    collector = CountingCollector(lambda: snap, Stats(), ProtocolErrorTally())
    process = build_registry(*self_collectors())
    openmetrics = build_registry(collector, *self_collectors())
    return Renderer(collector, process, openmetrics, lambda: version[0]), collector, process


def test_a_form_is_rendered_once_per_state_version() -> None:
    version = [1]
    r, collector, _ = renderer(snapshot_of(3), version)
    first = run_steps(r.steps(Form()))
    assert run_steps(r.steps(Form())) is first and collector.builds == 1
    version[0] = 2
    assert run_steps(r.steps(Form())) is not first  # a new version: rendered again
    assert collector.builds == 2


def test_each_form_is_cached_apart_and_is_what_its_format_says() -> None:
    snap = snapshot_of(2)
    r, collector, _ = renderer(snap, [7])
    ours = run_steps(r.steps(OURS))
    fresh = run_steps(text_steps(collector.families()))  # no process_* series
    helps = [line for line in fresh.splitlines() if line.startswith(b"# HELP")]
    assert [line for line in ours.splitlines() if line.startswith(b"# HELP")] == helps
    assert b"vllm_dp_" in ours and b"process_" not in ours and b"python_info" not in ours
    text = run_steps(r.steps(Form(TEXT)))
    assert text.startswith(ours) and b"python_info" in text
    zipped = run_steps(r.steps(Form(TEXT, use_gzip=True)))
    assert gzip.decompress(zipped).startswith(ours)
    om = run_steps(r.steps(Form(OPENMETRICS)))
    assert om.rstrip().endswith(b"# EOF") and b"vllm_dp_" in om
    assert Form(OPENMETRICS).content_type == CONTENT_TYPES[OPENMETRICS]
    builds = collector.builds
    for form in (OURS, Form(TEXT), Form(TEXT, use_gzip=True)):
        run_steps(r.steps(form))
    assert collector.builds == builds  # every form served from the cache


def test_a_render_in_steps_yields_between_engines() -> None:
    r, _, _ = renderer(snapshot_of(100), [1])
    steps = r.steps(OURS)
    turns = 0
    try:
        while True:
            next(steps)
            turns += 1
    except StopIteration as done:
        body = done.value
    assert turns > 3 and b'engine="99"' in body
