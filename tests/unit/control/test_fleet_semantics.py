"""The socket-free tier: poller, metrics, status and admin over the in-memory ``FakeFleet``.

These run in milliseconds (``make unit``); the same behaviours are proved over real sockets in
tests/integration/resilience, tests/integration/service, tests/integration/relay and
tests/integration/http.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import run_steps
from exporter.base.tasks import supervise
from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.parsing import parse_reset
from exporter.control.runtime import Exporter
from exporter.fleetstate.aggregate import FleetState
from exporter.web.admin import AdminController
from exporter.web.statusdoc import status_steps
from tests.harness.scrape import metric_value, parse_metrics


def make_exporter(fleet: FakeFleet) -> Exporter:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=max(1, len(fleet.engines)),
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
        call_timeout=1.0,
    )
    return Exporter(config, client=fleet)


def scrape(exporter: Exporter) -> dict[str, Any]:
    body, _ = exporter.render_metrics("", use_gzip=False)
    return parse_metrics(body.decode())


def sleeping(values: dict[str, bool], paused: bool = False) -> FakeFleet:
    per_engine = {e: {"is_sleeping": v, "is_scheduler_paused": paused} for e, v in values.items()}
    return FakeFleet(answers(per_engine), engines=tuple(values))


async def test_consistent_fleet_publishes_the_value() -> None:
    exporter = make_exporter(sleeping({"0": True, "1": True, "2": True}))
    snap = await exporter.poller.poll_once()
    assert snap.sleeping.state is FleetState.CONSISTENT and snap.sleeping.value is True
    m = scrape(exporter)
    assert metric_value(m, "vllm_dp_sleeping") == 1.0
    assert metric_value(m, "vllm_dp_sleep_state_consistent") == 1.0
    assert metric_value(m, "vllm_dp_engine_sleeping", engine="2") == 1.0


async def test_disagreement_is_inconsistent_and_counted_once_per_poll() -> None:
    exporter = make_exporter(sleeping({"0": False, "1": True}))
    await exporter.poller.poll_once()
    await exporter.poller.poll_once()
    m = scrape(exporter)
    assert metric_value(m, "vllm_dp_sleeping") is None
    assert metric_value(m, "vllm_dp_sleep_state_consistent") == 0.0
    assert (
        metric_value(m, "vllm_dp_inconsistent_utility_results_total", method="is_sleeping") == 2.0
    )
    error = exporter.poller.snapshot.sleeping.error
    assert error is not None and error.method == "is_sleeping" and error.values == [False, True]


@pytest.mark.parametrize("down", [{"0"}, {"1"}, {"2"}, {"0", "1"}])
async def test_a_silent_engine_makes_the_aggregate_unknown_never_inconsistent(
    down: set[str],
) -> None:
    fleet = sleeping({"0": False, "1": False, "2": False})
    fleet.disconnected = set(down)
    exporter = make_exporter(fleet)
    snap = await exporter.poller.poll_once()
    assert snap.sleeping.state is FleetState.UNKNOWN
    assert set(snap.sleeping.missing) == down
    m = scrape(exporter)
    for engine in ("0", "1", "2"):
        assert metric_value(m, "vllm_dp_engine_up", engine=engine) == (
            0.0 if engine in down else 1.0
        )
    assert metric_value(m, "vllm_dp_fleet_state", state="unknown") == 1.0
    assert metric_value(m, "vllm_dp_sleep_state_consistent") is None


async def test_no_engine_at_all_is_unknown_with_the_empty_error() -> None:
    exporter = make_exporter(FakeFleet(answers({}), engines=()))
    snap = await exporter.poller.poll_once()
    assert snap.sleeping.state is FleetState.UNKNOWN
    assert snap.sleeping.error is not None and snap.sleeping.error.values == []


async def test_status_document_names_every_engine() -> None:
    fleet = sleeping({"0": False, "1": True})
    exporter = make_exporter(fleet)
    snap = await exporter.poller.poll_once()
    doc = run_steps(status_steps(snap, exporter.config))
    assert doc["aggregate"]["is_sleeping"]["state"] == "inconsistent"
    assert [e["engine"] for e in doc["engines"]] == ["0", "1"]
    assert doc["engines"][1]["invariants"]["is_sleeping"]["value"] is True


def reset_fleet(results: dict[str, Any]) -> FakeFleet:
    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method == "reset_prefix_cache":
            return results[engine]
        return False

    return FakeFleet(handler, engines=tuple(results))


async def run_reset(admin: AdminController) -> tuple[int, dict[str, Any]]:
    """The prefix-cache reset as the admin listener runs it once its guards let it through."""
    result = await admin.runner.run(parse_reset({}, b""))
    return result.status, result.body


async def test_admin_reset_is_an_and_with_reasons_and_the_scrape_is_never_stale() -> None:
    timeout = EngineOutcome("2", Outcome.TIMEOUT, error="no reply within 1s")
    exporter = make_exporter(reset_fleet({"0": True, "1": False, "2": timeout}))
    admin = AdminController(exporter.action_parts(), audit=lambda record: None)
    before = scrape(exporter)
    status, body = await run_reset(admin)
    assert status == 502 and body["outcome"] == "partial_failure"
    assert body["failed_engines"] == [1, 2]
    reasons = {e["engine"]: e["reason"] for e in body["engines"]}
    assert reasons == {0: None, 1: "refused", 2: "timeout"}
    # The very next scrape (no poll in between) shows the reset: the render cache is keyed on
    # a generation every counter change bumps.
    after = scrape(exporter)
    assert metric_value(before, "vllm_dp_prefix_cache_resets_total", outcome="partial_failure") == 0
    assert metric_value(after, "vllm_dp_prefix_cache_resets_total", outcome="partial_failure") == 1
    assert (
        metric_value(
            after, "vllm_dp_prefix_cache_reset_engine_failures_total", engine="1", reason="refused"
        )
        == 1
    )


async def test_admin_reset_with_no_engine_connected_is_503() -> None:
    fleet = reset_fleet({"0": True, "1": True})
    fleet.disconnected = {"0", "1"}
    exporter = make_exporter(fleet)
    admin = AdminController(exporter.action_parts(), audit=lambda record: None)
    status, body = await run_reset(admin)
    assert status == 503 and body["error"] == "no engine is connected"
    assert fleet.calls == []


async def test_supervised_loop_is_restarted_and_counted() -> None:
    faults = ProtocolErrorTally()
    runs: list[int] = []
    done = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        done.set()

    task = supervise("flaky", flaky, faults, delays_s=(0.0,))
    await asyncio.wait_for(done.wait(), 5)
    await task
    assert faults.task_failures == {"flaky": 2}
    assert len(runs) == 3


async def test_metrics_carry_the_exporters_own_process_and_python_series() -> None:
    exporter = make_exporter(sleeping({"0": False}))
    await exporter.poller.poll_once()
    m = scrape(exporter)
    assert (metric_value(m, "process_resident_memory_bytes") or 0) > 0
    assert metric_value(m, "process_open_fds") is not None
    assert m["python_info"].samples, "python_info is exported"
    assert "python_gc_objects_collected" in m
    body, content_type = exporter.render_metrics(
        "application/openmetrics-text; version=1.0.0", use_gzip=False
    )
    assert content_type.startswith("application/openmetrics-text")
    text = body.decode()
    assert "process_resident_memory_bytes" in text and "vllm_dp_engine_up" in text
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
