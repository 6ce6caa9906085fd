"""One path for every admin action, socket-free: the registry, the answers' shapes, the guard
chain of the admin listener and the runner every action (the prefix-cache reset included)
goes through. The same behaviours over real sockets: tests/integration/service and rl."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from aiohttp.streams import EmptyStreamReader
from aiohttp.test_utils import make_mocked_request

from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.actions import ACTIONS
from exporter.control.parsing import parse_reset, parse_sleep
from exporter.control.runtime import Exporter
from exporter.control.verdicts import (
    RESET_ANSWER,
    classify,
    no_engine_body,
    verdict_body,
)
from exporter.metrics.catalog import ADMIN_ACTIONS
from exporter.web.admin import AdminController, from_aiohttp, retry_after

TOKEN = "tok-unit"
NO_ATTR = "Call to {m} method failed: 'EngineCoreProc' object has no attribute '{m}'"
RESET_KEYS = ["success", "outcome", "engines", "failed_engines", "flags", "duration_s"]


def make_exporter(fleet: FakeFleet, **overrides: Any) -> Exporter:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=len(fleet.engines),
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
        call_timeout=1.0,
    )
    return Exporter(dataclasses.replace(config, **overrides), client=fleet)


def fleet_of(results: dict[str, Any]) -> FakeFleet:
    """Engines answering ``reset_prefix_cache`` and ``sleep`` with ``results[engine]``, and
    ``is_sleeping`` with True."""

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        return True if method == "is_sleeping" else results[engine]

    return FakeFleet(handler, engines=tuple(results))


class Admin:
    """An ``AdminController`` with its audit records and a clock the test moves."""

    def __init__(self, exporter: Exporter) -> None:
        self.now = 100.0
        self.records: list[dict[str, Any]] = []
        self.controller = AdminController(
            exporter.action_parts(), audit=self.records.append, clock=lambda: self.now
        )

    async def post(
        self, action: str, query: str = "", token: str | None = TOKEN
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = make_mocked_request(
            "POST", f"/admin/{action}{query}", headers=headers, payload=EmptyStreamReader()
        )
        status, body, answer_headers = await self.controller.handle(
            from_aiohttp(request), ACTIONS[action]
        )
        # The body as a client reads it: through JSON.
        return status, json.loads(json.dumps(body)), answer_headers


def test_every_catalogued_action_has_one_spec() -> None:
    assert list(ACTIONS) == list(ADMIN_ACTIONS)
    assert all(spec.name == name for name, spec in ACTIONS.items())


def test_the_reset_answer_keeps_its_documented_keys_and_the_others_name_themselves() -> None:
    request = parse_reset({}, b"")
    outcomes = [EngineOutcome("0", Outcome.OK, True), EngineOutcome("1", Outcome.OK, False)]
    verdict = classify(request, outcomes)
    body = verdict_body(verdict, request.params, 0.25, RESET_ANSWER)
    assert list(body) == RESET_KEYS
    assert body["engines"][1] == {"engine": 1, "ok": False, "reason": "refused", "error": None}
    unreachable = no_engine_body(request.action, request.params, RESET_ANSWER)
    assert list(unreachable) == [
        "success",
        "outcome",
        "engines",
        "failed_engines",
        "flags",
        "error",
    ]
    sleep = parse_sleep({}, b"")
    assert list(verdict_body(classify(sleep, outcomes), sleep.params, 0.1)) == [
        "action",
        "success",
        "outcome",
        "verified",
        "engines",
        "failed_engines",
        "params",
        "duration_s",
    ]
    assert list(no_engine_body(sleep.action, sleep.params)) == [
        "action",
        "success",
        "outcome",
        "engines",
        "failed_engines",
        "params",
        "error",
    ]


def test_a_reset_is_confirmed_only_by_the_engines_own_true() -> None:
    outcomes = [
        EngineOutcome("0", Outcome.OK, True),
        EngineOutcome("1", Outcome.OK, False),
        EngineOutcome("2", Outcome.OK, None),
        EngineOutcome("3", Outcome.FAILED, error=NO_ATTR.format(m="reset_prefix_cache")),
    ]
    verdict = classify(parse_reset({}, b""), outcomes)
    assert [e.reason for e in verdict.engines] == [None, "refused", "failed", "unsupported"]
    assert verdict.engines[2].error == "unexpected result None"


def test_retry_after_is_the_rest_of_the_interval() -> None:
    assert retry_after(None, 1.0, 50.0) == 0.0
    assert retry_after(50.0, 1.0, 50.25) == 0.75
    assert retry_after(50.0, 1.0, 52.0) <= 0


async def test_the_guards_answer_in_order_and_the_first_answer_wins() -> None:
    fleet = fleet_of({"0": True, "1": True})
    admin = Admin(make_exporter(fleet, admin_token=TOKEN))
    # No token and a bad parameter: authentication comes first.
    status, body, headers = await admin.post("reset_prefix_cache", "?nope=1", token=None)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = await admin.post("reset_prefix_cache", "?nope=1")
    assert status == 400 and "nope" in body["error"]
    assert fleet.calls == []
    assert [r["outcome"] for r in admin.records] == ["unauthorized", "bad_request"]
    assert "flags" not in admin.records[1]


async def test_the_reset_min_interval_comes_from_its_spec_and_limits_only_the_reset() -> None:
    fleet = fleet_of({"0": True, "1": True})
    admin = Admin(make_exporter(fleet, admin_token=TOKEN, reset_min_interval=10.0))
    status, body, _ = await admin.post("reset_prefix_cache")
    assert status == 200 and list(body) == RESET_KEYS
    admin.now += 2.5
    status, body, headers = await admin.post("reset_prefix_cache")
    assert status == 429 and headers["Retry-After"] == "8"
    assert body == {"error": "resets are limited to one every 10s"}
    status, _, _ = await admin.post("sleep")  # no interval on its spec
    assert status == 200
    admin.now += 8.0
    status, _, _ = await admin.post("reset_prefix_cache")
    assert status == 200
    outcomes = [r["outcome"] for r in admin.records]
    assert outcomes == ["success", "rate_limited", "success", "success"]
    # The audit names the reset's parameters flags, every other action's params.
    assert admin.records[0]["flags"] == {"reset_running_requests": False, "reset_connector": False}
    assert (
        admin.records[2]["params"] == {"level": 1, "mode": "abort"}
        and "flags" not in (admin.records[2])
    )


async def test_the_reset_runs_through_the_shared_runner() -> None:
    """Counted in the reset's own series and in the admin actions'; an engine without the
    method is unsupported; the last action is recorded."""
    lacking = EngineOutcome("1", Outcome.FAILED, error=NO_ATTR.format(m="reset_prefix_cache"))
    fleet = fleet_of({"0": True, "1": lacking})
    exporter = make_exporter(fleet)
    admin = AdminController(exporter.action_parts(), audit=lambda record: None)
    result = await admin.runner.run(parse_reset({}, b""))
    assert result.status == 502 and list(result.body) == RESET_KEYS
    assert result.body["engines"][1]["reason"] == "unsupported"
    stats = exporter.stats
    assert stats.resets["partial_failure"] == 1
    assert stats.reset_engine_failures[("1", "unsupported")] == 1
    ((_, buckets, _),) = stats.reset_durations.rows()
    assert buckets[-1] == ("+Inf", 1.0)
    assert stats.admin_actions[("reset_prefix_cache", "partial_failure")] == 1
    assert stats.admin_action_failures[("reset_prefix_cache", "1", "unsupported")] == 1
    assert stats.last_reset_success_unix is None
    last = stats.last_action
    assert last is not None and last.action == "reset_prefix_cache" and last.status == 502
    assert last.params == {"reset_running_requests": False, "reset_connector": False}


async def test_an_action_with_no_engine_connected_counts_one_failure() -> None:
    fleet = fleet_of({"0": True, "1": True})
    fleet.disconnected = {"0", "1"}
    exporter = make_exporter(fleet)
    admin = AdminController(exporter.action_parts(), audit=lambda record: None)
    result = await admin.runner.run(parse_reset({}, b""))
    assert result.status == 503 and result.verdict is None
    assert result.body["error"] == "no engine is connected" and "flags" in result.body
    assert exporter.stats.resets["failure"] == 1
    assert exporter.stats.admin_actions[("reset_prefix_cache", "failure")] == 1
    result = await admin.runner.run(parse_sleep({}, b""))
    assert result.status == 503 and result.body["action"] == "sleep"
    assert exporter.stats.resets["failure"] == 1  # a sleep is not a reset
    assert exporter.stats.admin_actions[("sleep", "failure")] == 1
