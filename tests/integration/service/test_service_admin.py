"""``POST /admin/reset_prefix_cache`` over real HTTP against the real admin listener,
with simulated engines on real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from exporter.client.fleet import connected_count
from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value as value
from tests.harness.service import CALL_TIMEOUT, ServiceFactory
from tests.harness.waiting import eventually

TOKEN = "tok-7f3a9c1e5b2d4a60"


def token_file(tmp_path: Path, token: str = TOKEN) -> str:
    path = tmp_path / "admin-token"
    path.write_text(token + "\n")
    return str(path)


def resets_at_engines(fleet: Any) -> list[int]:
    return [e.calls_by_method.get("reset_prefix_cache", 0) for e in fleet.engines]


async def test_all_engines_confirm(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3)
    assert fleet.admin_url is not None and fleet.admin_url.startswith("http://127.0.0.1:")
    status, body, _ = await fleet.reset()
    assert status == 200
    assert body["success"] is True
    assert body["engines"] == [
        {"engine": i, "ok": True, "reason": None, "error": None} for i in range(3)
    ]
    assert body["flags"] == {"reset_running_requests": False, "reset_connector": False}
    assert isinstance(body["duration_s"], float) and body["duration_s"] >= 0
    assert body["outcome"] == "success" and body["failed_engines"] == []
    assert resets_at_engines(fleet) == [1, 1, 1]
    # Both flags false: sent with no arguments at all (every vLLM since 0.7 accepts that).
    assert all(e.args_of("reset_prefix_cache") == [[]] for e in fleet.engines)

    m = await fleet.scrape()
    assert value(m, "vllm_dp_prefix_cache_resets", outcome="success") == 1.0
    assert value(m, "vllm_dp_prefix_cache_last_success_timestamp_seconds")
    durations = m["vllm_dp_prefix_cache_reset_duration_seconds"].samples
    assert [s.value for s in durations if s.name.endswith("_count")] == [1.0]
    assert value(m, "vllm_dp_admin_requests", action="reset_prefix_cache", code="200") == 1.0
    failures = m["vllm_dp_prefix_cache_reset_engine_failures"].samples
    assert failures and all(s.value == 0 for s in failures)  # preset at 0, never incremented


async def test_one_engine_refuses(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, per_engine={"refuse_reset": {1: True}})
    status, body, _ = await fleet.reset()
    assert status == 502
    assert body["success"] is False
    assert body["outcome"] == "partial_failure"
    assert body["failed_engines"] == [1]
    assert body["engines"][1] == {"engine": 1, "ok": False, "reason": "refused", "error": None}
    assert body["engines"][0]["ok"] is True and body["engines"][2]["ok"] is True

    m = await fleet.scrape()
    assert value(m, "vllm_dp_prefix_cache_resets", outcome="partial_failure") == 1.0
    assert value(m, "vllm_dp_prefix_cache_resets", outcome="success") == 0.0
    assert (
        value(m, "vllm_dp_prefix_cache_reset_engine_failures", engine="1", reason="refused") == 1.0
    )
    failures = m["vllm_dp_prefix_cache_reset_engine_failures"].samples
    assert [(s.labels["engine"], s.labels["reason"]) for s in failures if s.value] == [
        ("1", "refused")
    ]
    assert value(m, "vllm_dp_prefix_cache_last_success_timestamp_seconds") is None


async def test_every_engine_refuses_is_failure(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, options=SimOptions(refuse_reset=True))
    status, body, _ = await fleet.reset()
    assert status == 502
    assert body["outcome"] == "failure" and body["failed_engines"] == [0, 1]


async def test_hung_engine_times_out_within_the_call_timeout(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    fleet.engines[0].options.hang = True
    started = time.monotonic()
    status, body, _ = await fleet.reset()
    elapsed = time.monotonic() - started
    assert status == 502
    assert body["engines"][0]["reason"] == "timeout"
    assert body["engines"][0]["ok"] is False
    assert str(CALL_TIMEOUT) in body["engines"][0]["error"]
    assert body["engines"][1]["ok"] is True
    # Bounded by the call timeout (a correctness bound, generous for slow machines).
    assert body["duration_s"] >= CALL_TIMEOUT * 0.9
    assert elapsed < CALL_TIMEOUT + 3
    m = await fleet.scrape()
    assert (
        value(m, "vllm_dp_prefix_cache_reset_engine_failures", engine="0", reason="timeout") == 1.0
    )
    assert (
        value(
            m, "vllm_dp_utility_calls", method="reset_prefix_cache", engine="0", outcome="timeout"
        )
        == 1.0
    )


async def test_dead_engine_is_disconnected(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    dying = fleet.engines[1]
    dying.options.dead_after_calls = dying.calls + 1  # ENGINE_CORE_DEAD after its next call
    await eventually(
        lambda: connected_count(fleet.exporter.client) == 1, what="engine 1 reported dead"
    )
    status, body, _ = await fleet.reset()
    assert status == 502
    assert body["engines"][1]["reason"] == "disconnected"
    assert body["engines"][1]["ok"] is False
    assert body["engines"][0] == {"engine": 0, "ok": True, "reason": None, "error": None}
    await fleet.next_polls()
    m = await fleet.scrape()
    assert (
        value(m, "vllm_dp_prefix_cache_reset_engine_failures", engine="1", reason="disconnected")
        == 1.0
    )
    assert value(m, "vllm_dp_engine_up", engine="1") == 0.0
    assert (
        value(m, "vllm_dp_utility_calls", method="is_sleeping", engine="1", outcome="disconnected")
        or 0
    ) >= 1


async def test_no_engine_connected_is_503(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, start=False)
    status, body, _ = await fleet.reset()
    assert status == 503
    assert body["success"] is False and body["engines"] == []
    assert "no engine" in body["error"]
    m = await fleet.scrape()
    assert value(m, "vllm_dp_prefix_cache_resets", outcome="failure") == 1.0


async def test_token_required(fleet_factory: ServiceFactory, tmp_path: Path) -> None:
    fleet = await fleet_factory(2, admin_token_file=token_file(tmp_path))
    status, body, headers = await fleet.reset()
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert "token" in body["error"]
    status, _, _ = await fleet.reset(token="wrong")
    assert status == 401
    status, _, _ = await fleet.reset(headers={"Authorization": f"Basic {TOKEN}"})
    assert status == 401
    assert resets_at_engines(fleet) == [0, 0]
    status, body, _ = await fleet.reset(token=TOKEN)
    assert status == 200 and body["success"] is True
    m = await fleet.scrape()
    assert value(m, "vllm_dp_admin_requests", action="reset_prefix_cache", code="401") == 3.0


async def test_bad_parameters_are_400(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1)
    status, body, _ = await fleet.reset({"reset_running_requests": "yes"})
    assert status == 400
    assert "reset_running_requests" in body["error"]
    status, body, _ = await fleet.reset({"reset_connector": "maybe"})
    assert status == 400 and "reset_connector" in body["error"]
    status, body, _ = await fleet.reset({"flush": "true"})
    assert status == 400 and "flush" in body["error"]
    status, body, _ = await fleet.reset({"reset_connector": "true", "reset_external": "false"})
    assert status == 400 and "reset_external" in body["error"]
    status, body, _ = await fleet.reset(headers={"Idempotency-Key": "k" * 201})
    assert status == 400 and "Idempotency-Key" in body["error"]
    assert resets_at_engines(fleet) == [0]


async def test_get_is_405(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1)
    assert fleet.admin_url is not None
    async with fleet.session.get(fleet.admin_url + "/admin/reset_prefix_cache") as resp:
        assert resp.status == 405
        assert "POST" in resp.headers.get("Allow", "")
    async with fleet.session.get(fleet.url + "/admin/reset_prefix_cache") as resp:
        assert resp.status in (404, 405)  # the admin route is not on the public listener
    assert resets_at_engines(fleet) == [0]


async def test_concurrent_resets_exactly_one_409(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, call_timeout=2.0)
    for engine in fleet.engines:
        engine.options.reply_delay_s = 0.3
    results = await asyncio.gather(fleet.reset(), fleet.reset())
    statuses = sorted(r[0] for r in results)
    assert statuses == [200, 409], results
    conflict = next(r[1] for r in results if r[0] == 409)
    assert "already running" in conflict["error"]
    assert resets_at_engines(fleet) == [1, 1]


async def test_idempotency_key_replays(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    key = {"Idempotency-Key": "after-step-42"}
    first = await fleet.reset(headers=key)
    second = await fleet.reset(headers=key)
    assert first[0] == second[0] == 200
    assert first[1] == second[1]
    assert second[2].get("Idempotency-Replayed") == "true"
    assert resets_at_engines(fleet) == [1, 1]
    third = await fleet.reset(headers={"Idempotency-Key": "after-step-43"})
    assert third[0] == 200 and "Idempotency-Replayed" not in third[2]
    assert resets_at_engines(fleet) == [2, 2]


async def test_rate_limit_429_with_retry_after(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1, reset_min_interval=5)
    status, _, _ = await fleet.reset()
    assert status == 200
    status, body, headers = await fleet.reset()
    assert status == 429
    assert 1 <= int(headers["Retry-After"]) <= 5
    assert "5s" in body["error"]
    assert resets_at_engines(fleet) == [1]


async def test_wrong_tokens_lock_out_after_five(
    fleet_factory: ServiceFactory, tmp_path: Path
) -> None:
    fleet = await fleet_factory(1, admin_token_file=token_file(tmp_path))
    for _ in range(5):
        status, _, _ = await fleet.reset(token="guess")
        assert status == 401
    status, body, headers = await fleet.reset(token="guess")
    assert status == 429
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert "authentication" in body["error"]
    # Only wrong tokens are throttled (per source address): the right token still works.
    status, _, _ = await fleet.reset(token=TOKEN)
    assert status == 200
    assert resets_at_engines(fleet) == [1]


async def test_audit_record_and_no_token_in_logs(
    fleet_factory: ServiceFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    records: list[dict[str, Any]] = []
    fleet = await fleet_factory(
        2,
        audit=records.append,
        admin_token_file=token_file(tmp_path),
        per_engine={"refuse_reset": {1: True}},
    )
    status, _, _ = await fleet.reset({"reset_running_requests": "1"}, token=TOKEN)
    assert status == 502
    status, _, _ = await fleet.reset(token=TOKEN + "x")
    assert status == 401
    assert len(records) == 2
    ok, denied = records
    assert ok["event"] == "admin_request" and ok["action"] == "reset_prefix_cache"
    assert time.strptime(ok["time"], "%Y-%m-%dT%H:%M:%SZ")
    assert ok["client"] == "127.0.0.1"
    assert ok["flags"] == {"reset_running_requests": True, "reset_connector": False}
    assert ok["outcome"] == "partial_failure"
    assert ok["failed_engines"] == [1]
    assert ok["status"] == 502
    assert isinstance(ok["duration_s"], float) and ok["duration_s"] >= 0
    assert denied["outcome"] == "unauthorized" and denied["status"] == 401
    assert "flags" not in denied
    for record in records:
        json.dumps(record)  # one JSON line each
        assert TOKEN not in json.dumps(record)
    assert TOKEN not in caplog.text
    assert "engine 1 refused" in caplog.text  # the failure is logged, the token is not


async def test_reset_flags_reach_the_engines(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    cases = [
        ({"reset_running_requests": "1"}, [True]),
        ({"reset_running_requests": "true", "reset_connector": "TRUE"}, [True, True]),
        ({"reset_external": "1"}, [False, True]),
        ({"reset_running_requests": "0", "reset_connector": "false"}, []),
    ]
    for params, args in cases:
        status, body, _ = await fleet.reset(params)
        assert status == 200, body
        for engine in fleet.engines:
            assert engine.args_of("reset_prefix_cache")[-1] == args, params
    assert body["flags"] == {"reset_running_requests": False, "reset_connector": False}


async def test_an_engine_lacking_the_reset_is_unsupported(fleet_factory: ServiceFactory) -> None:
    """An older vLLM without ``reset_prefix_cache`` fails the reset as ``unsupported``, the
    reason every admin action gives; the answer keeps the reset's documented shape."""
    missing = frozenset({"reset_prefix_cache"})
    fleet = await fleet_factory(2, per_engine={"missing_methods": {1: missing}})
    status, body, _ = await fleet.reset()
    assert status == 502
    assert list(body) == ["success", "outcome", "engines", "failed_engines", "flags", "duration_s"]
    assert body["outcome"] == "partial_failure" and body["failed_engines"] == [1]
    assert body["engines"][0] == {"engine": 0, "ok": True, "reason": None, "error": None}
    lacking = body["engines"][1]
    assert list(lacking) == ["engine", "ok", "reason", "error"]
    assert lacking["reason"] == "unsupported" and "reset_prefix_cache" in lacking["error"]

    m = await fleet.scrape()
    assert value(m, "vllm_dp_prefix_cache_resets", outcome="partial_failure") == 1.0
    assert (
        value(m, "vllm_dp_prefix_cache_reset_engine_failures", engine="1", reason="unsupported")
        == 1.0
    )
    assert (
        value(
            m,
            "vllm_dp_admin_action_engine_failures",
            action="reset_prefix_cache",
            engine="1",
            reason="unsupported",
        )
        == 1.0
    )


async def test_oversized_body_is_413(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1)
    assert fleet.admin_url is not None
    url = fleet.admin_url + "/admin/reset_prefix_cache"
    async with fleet.session.post(url, data=b"x" * 4096) as resp:
        assert resp.status == 413
        assert "too large" in (await resp.json())["error"]
    assert resets_at_engines(fleet) == [0]
