"""``Exporter`` (``exporter.control.runtime``) over ``FakeFleet``: the wiring every front end
shares. The render cache must never serve a body older than the state (or a scrape storm
would cost one render per scrape), the client's callbacks must reach the poller, and
start/stop must bracket the client and the poll loop."""

from __future__ import annotations

import asyncio
import gc
import gzip
from typing import Any

import pytest

from exporter.client.fake import FakeFleet
from exporter.client.fleet import Capabilities
from exporter.config.settings import ServeConfig, resolve_config
from exporter.control import runtime
from exporter.control.counted import CountedFleet
from exporter.control.runtime import Exporter, gc_paused
from exporter.metrics.negotiation import CONTENT_TYPES, OPENMETRICS, TEXT

OPENMETRICS_ACCEPT = "application/openmetrics-text; version=1.0.0"


def awake(engine: str, method: str, args: tuple[Any, ...]) -> Any:
    return {"is_sleeping": False, "is_scheduler_paused": False}.get(method, "v1")


def config(**settings: Any) -> ServeConfig:
    return resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=2,
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
        **settings,
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_is_paused_for_a_render_and_restored_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a render that fails")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_exporter_counts_every_call_and_presets_its_series() -> None:
    fleet = FakeFleet(awake, fake_capabilities=Capabilities(handshakes=True))
    exporter = Exporter(config(), client=fleet)
    assert exporter.client is fleet
    assert isinstance(exporter.fleet, CountedFleet) and exporter.fleet.inner is fleet
    assert exporter.faults.task_failures == {"poller": 0, "handshake": 0}
    plain = Exporter(config(), client=FakeFleet(awake))
    assert plain.faults.task_failures == {"poller": 0}  # no handshake loop to fail


async def test_a_body_is_rendered_once_per_state_and_again_after_a_change() -> None:
    exporter = Exporter(config(), client=FakeFleet(awake))
    body, content_type = exporter.render_metrics("", use_gzip=False)
    assert content_type == CONTENT_TYPES[TEXT]
    again, _ = exporter.render_metrics("text/plain", use_gzip=False)
    assert again is body  # the cached object, not a new render
    await exporter.poller.poll_once()
    fresh, _ = exporter.render_metrics("", use_gzip=False)
    assert fresh is not body
    assert b"vllm_dp_" in fresh and (b"process_" in fresh or b"python_" in fresh)
    exporter.stats.record_admin_request("sleep", 200)
    assert exporter.render_metrics("", use_gzip=False)[0] is not fresh


async def test_formats_and_gzip_are_cached_apart() -> None:
    exporter = Exporter(config(), client=FakeFleet(awake))
    await exporter.poller.poll_once()
    text, _ = exporter.render_metrics("", use_gzip=False)
    zipped, zipped_type = exporter.render_metrics("", use_gzip=True)
    assert zipped_type == CONTENT_TYPES[TEXT]
    plain_text = gzip.decompress(zipped)
    assert plain_text.split(b"\n")[0] == text.split(b"\n")[0]
    om, om_type = exporter.render_metrics(OPENMETRICS_ACCEPT, use_gzip=False)
    assert om_type == CONTENT_TYPES[OPENMETRICS]
    assert om.endswith(b"# EOF\n") and not text.endswith(b"# EOF\n")


async def test_the_state_version_moves_with_polls_and_counters() -> None:
    exporter = Exporter(config(), client=FakeFleet(awake))
    first = exporter.state_version()
    assert exporter.state_version() == first
    await exporter.poller.poll_once()
    polled = exporter.state_version()
    assert polled != first
    exporter.faults.record("not_msgpack", "a frame")
    assert exporter.state_version() != polled


async def test_the_clients_callbacks_reach_the_poller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection change asks for a poll; a pushed status is republished without one."""
    seen: dict[str, Any] = {}

    def build(cfg: ServeConfig, faults: Any, **callbacks: Any) -> FakeFleet:
        seen.update(callbacks, faults=faults)
        return FakeFleet(awake)

    monkeypatch.setattr(runtime, "build_fleet", build)
    exporter = Exporter(config())
    assert seen["faults"] is exporter.faults  # the tally is made first and shared
    await exporter.poller.poll_once()
    before = exporter.poller.republished
    seen["on_status"]()
    await asyncio.sleep(0)
    assert exporter.poller.republished == before + 1
    polls: list[str] = []
    monkeypatch.setattr(exporter.poller, "poll_soon", lambda: polls.append("soon"))
    seen["on_change"]()
    assert polls == ["soon"]


async def test_start_and_stop_bracket_the_client_and_the_poll_loop() -> None:
    fleet = FakeFleet(awake)
    exporter = Exporter(config(poll_interval=0.05), client=fleet)
    await exporter.start()
    assert fleet.started
    await exporter.poller.wait_for_poll(0, timeout_s=5.0)
    await exporter.stop()
    assert fleet.closed
    calls = len(fleet.calls)
    await asyncio.sleep(0.1)
    assert len(fleet.calls) == calls  # no poll after stop
    await exporter.stop()  # twice: harmless
