"""``ActionRunner`` (``exporter.control.runner``): what every admin action leaves behind, since
the admin listener and the plugin's routes both rely on it: the action and reset counters, the
confirmed resets, the last action on /status, the warning on a partial failure, and a gate
sample and poll that start after the action, never before it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest

from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.parsing import parse_reset, parse_resume
from exporter.control.runner import ActionRunner
from exporter.control.runtime import Exporter


def exporter_over(fleet: FakeFleet) -> Exporter:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=len(fleet.engines),
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
        call_timeout=1.0,
    )
    return Exporter(config, client=fleet)


def nonzero(counts: Mapping[Any, int]) -> dict[Any, int]:
    """The series that moved (``Stats`` presets each one at 0)."""
    return {k: v for k, v in counts.items() if v}


def refusing(*refusers: str) -> Any:
    """Engines in ``refusers`` answer False to the reset; every engine is awake and unpaused."""

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method == "reset_prefix_cache":
            return engine not in refusers
        if method == "resume_scheduler" and engine in refusers:
            return EngineOutcome(engine, Outcome.TIMEOUT, error="no reply")
        return {"is_sleeping": False, "is_scheduler_paused": False}.get(method)

    return handler


async def test_a_successful_reset_is_counted_confirmed_and_shown() -> None:
    exporter = exporter_over(FakeFleet(refusing(), engines=("0", "1")))
    result = await ActionRunner(exporter.action_parts()).run(parse_reset({}, b""))
    stats = exporter.stats
    assert result.status == 200
    assert nonzero(stats.resets) == {"success": 1}
    assert nonzero(stats.admin_actions) == {("reset_prefix_cache", "success"): 1}
    assert stats.last_reset_success_unix is not None
    assert nonzero(stats.confirmed_resets) == {"0": 1, "1": 1}
    assert {e: a for e, (_, a) in stats.last_resets.items()} == {
        "0": "reset_prefix_cache",
        "1": "reset_prefix_cache",
    }
    assert stats.last_action is not None and stats.last_action.action == "reset_prefix_cache"
    assert stats.last_action.status == 200


async def test_a_partial_failure_names_the_engine_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = exporter_over(FakeFleet(refusing("1"), engines=("0", "1")))
    with caplog.at_level(logging.WARNING, logger="exporter.admin"):
        await ActionRunner(exporter.action_parts()).run(parse_reset({}, b""))
    stats = exporter.stats
    assert nonzero(stats.resets) == {"partial_failure": 1}
    assert nonzero(stats.reset_engine_failures) == {("1", "refused"): 1}
    assert nonzero(stats.admin_action_failures) == {("reset_prefix_cache", "1", "refused"): 1}
    assert stats.last_reset_success_unix is None
    assert nonzero(stats.confirmed_resets) == {"0": 1}  # only the engine that said so
    assert caplog.messages == ["prefix-cache reset partial_failure: engine 1 refused"]


async def test_an_action_that_is_no_reset_leaves_the_reset_series_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = exporter_over(FakeFleet(refusing("1"), engines=("0", "1")))
    with caplog.at_level(logging.WARNING, logger="exporter.admin"):
        await ActionRunner(exporter.action_parts()).run(parse_resume({}, b""))
    stats = exporter.stats
    assert not nonzero(stats.resets) and not nonzero(stats.confirmed_resets)
    assert nonzero(stats.admin_actions) == {("resume", "partial_failure"): 1}
    assert [m.split(":")[0] for m in caplog.messages] == ["resume partial_failure"]


async def test_no_engine_connected_is_a_failure_with_no_verdict() -> None:
    fleet = FakeFleet(refusing(), engines=("0", "1"), disconnected={"0", "1"})
    exporter = exporter_over(fleet)
    result = await ActionRunner(exporter.action_parts()).run(parse_reset({}, b""))
    assert result.status == 503 and result.verdict is None
    assert nonzero(exporter.stats.resets) == {"failure": 1}
    assert nonzero(exporter.stats.admin_actions) == {("reset_prefix_cache", "failure"): 1}
    assert not nonzero(exporter.stats.confirmed_resets)
    assert fleet.calls == []


async def test_after_an_action_the_gate_samples_afresh_and_a_poll_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = exporter_over(FakeFleet(refusing(), engines=("0",)))
    asked: list[str] = []
    monkeypatch.setattr(exporter.poller, "poll_soon", lambda: asked.append("poll"))
    first = await exporter.gate.sample()
    assert await exporter.gate.sample() is first  # shared within the gate's interval
    await ActionRunner(exporter.action_parts()).run(parse_resume({}, b""))
    assert asked == ["poll"]
    assert await exporter.gate.sample() is not first  # never a sample from before the action
    assert exporter.gate.fanouts == 2
