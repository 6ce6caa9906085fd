"""The plugin's ``vllm_dp_*`` text (``InProcessRuntime.series``) over real HTTP on a real
FastAPI app, with a simulated vLLM and simulated engines on real ZMQ sockets: built a step per
turn of vLLM's event loop and kept until the exporter's state changes, so scrapes between two
polls cost nothing and never serve a body older than the state.

Polls are slow here (``POLL_INTERVAL=30``): between the first poll and the one a test asks for
(``poll_soon``), nothing changes the state."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from exporter.base.steps import Steps, run_steps
from exporter.control.runtime import Exporter
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import Family
from exporter.metrics.renderer import OURS
from tests.harness.plugin_app import VLLM_MARKER, PluginApp, PluginApps
from tests.harness.scrape import metric_value, parse_metrics

WAIT_S = 10.0


async def scrape(app: PluginApp, path: str = "/dp/metrics") -> bytes:
    async with app.session.get(app.url + path) as resp:
        assert resp.status == 200, resp.status
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return await resp.read()


def exporter_of(app: PluginApp) -> Exporter:
    exporter = app.runtime.exporter
    assert exporter is not None
    return exporter


def count_builds(exporter: Exporter, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each build of the collector's families from now on appends to the returned list."""
    builds: list[int] = []
    original: Callable[[], Steps[list[Family]]] = exporter.collector.family_steps

    def counted() -> Steps[list[Family]]:
        builds.append(len(builds))
        return original()

    monkeypatch.setattr(exporter.collector, "family_steps", counted)
    return builds


def polls_total(body: bytes) -> float | None:
    return metric_value(parse_metrics(body.decode()), "vllm_dp_polls_total")


async def next_poll(exporter: Exporter) -> int:
    """Ask for a poll now and wait (bounded) until it is published."""
    before = exporter.poller.snapshot.poll_number
    exporter.poller.poll_soon()
    snap = await exporter.poller.wait_for_poll(before, WAIT_S)
    assert snap.poll_number > before
    return snap.poll_number


@pytest.fixture
def slow_polls(env: Callable[..., None]) -> None:
    env(POLL_INTERVAL="30")


async def test_scrapes_between_two_polls_are_served_from_one_build(
    slow_polls: None, plugin_apps: PluginApps, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await plugin_apps(3)
    exporter = exporter_of(app)
    first = await scrape(app)
    cached = exporter.renderer.cached(OURS)
    assert cached is not None
    assert cached == (exporter.state_version(), first)
    builds = count_builds(exporter, monkeypatch)
    second = await scrape(app)
    assert second == first
    assert builds == []  # not built again
    kept = exporter.renderer.cached(OURS)
    assert kept is cached and kept[1] is cached[1]
    # vLLM's own /metrics carries the same cached text after vLLM's series.
    whole = await scrape(app, "/metrics")
    assert whole.endswith(first)
    assert f"{VLLM_MARKER} 42.0".encode() in whole
    assert builds == []
    # The body is what the exporter's families render to right now.
    assert first == run_steps(text_steps(exporter.collector.families()))


async def test_a_new_poll_is_rebuilt_once_and_shown(
    slow_polls: None, plugin_apps: PluginApps, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = await plugin_apps(3)
    exporter = exporter_of(app)
    first = await scrape(app)
    polls_before = polls_total(first)
    assert polls_before is not None and polls_before >= 1
    builds = count_builds(exporter, monkeypatch)
    number = await next_poll(exporter)
    fresh = await scrape(app)
    assert builds == [0]
    assert fresh != first
    assert polls_total(fresh) == exporter.stats.polls > polls_before
    assert exporter.poller.snapshot.poll_number == number
    assert exporter.renderer.cached(OURS) == (exporter.state_version(), fresh)
    again = await scrape(app)
    assert again == fresh and builds == [0]  # the new body is kept in turn
    assert fresh == run_steps(text_steps(exporter.collector.families()))


async def test_a_counter_change_between_polls_is_rebuilt(
    slow_polls: None, plugin_apps: PluginApps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not only polls: any change a scrape could show (here an admin request counted) makes
    the next scrape build again."""
    app = await plugin_apps(2)
    exporter = exporter_of(app)
    first = await scrape(app)
    labels = {"action": "sleep", "code": "200"}
    assert metric_value(parse_metrics(first.decode()), "vllm_dp_admin_requests", **labels) is None
    builds = count_builds(exporter, monkeypatch)
    exporter.stats.record_admin_request("sleep", 200)
    fresh = await scrape(app)
    assert builds == [0]
    counted = metric_value(parse_metrics(fresh.decode()), "vllm_dp_admin_requests", **labels)
    assert counted == 1.0
    assert polls_total(fresh) == polls_total(first)  # no poll in between
    exporter.faults.record("not_msgpack", "a test's protocol error")
    latest = await scrape(app)
    assert builds == [0, 1]
    errors = metric_value(
        parse_metrics(latest.decode()), "vllm_dp_protocol_errors", kind="not_msgpack"
    )
    assert errors == 1.0


async def test_a_kept_body_is_not_served_once_the_plugin_stopped(
    plugin_apps: PluginApps,
) -> None:
    app = await plugin_apps(2)
    await scrape(app)
    assert exporter_of(app).renderer.cached(OURS) is not None
    await app.runtime.stop()
    status, _, text = await app.get("/dp/metrics")
    assert status == 503
    assert "stopped" in text
    assert app.runtime.exporter is None
