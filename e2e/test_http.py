"""HTTP attach mode against two real single-engine vLLM API servers (docs/e2e.md, scenario 5).

``VLLM_SERVER_DEV_MODE=1`` gives each server its dev routes (``/is_sleeping``,
``/reset_prefix_cache``) and the RL routes (``/pause``, ``/resume``, ``/is_paused``), so each
target's value can be made to differ for real: a paused scheduler answers ``is_sleeping: true``.
The servers are shared with scenario 7a (``http_deployment``).
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e import web
from e2e.fleets import HTTP_TARGETS as TARGETS
from e2e.fleets import HttpDeployment
from e2e.traffic import start_long_generations
from e2e.vllm_runtime import VllmRuntime

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.vllm_needs("GET /is_sleeping", "POST /reset_prefix_cache", "GET /is_paused"),
]

LONG_TOKENS = 2500


@pytest.fixture
def deployment(http_deployment: HttpDeployment) -> HttpDeployment:
    """The session's HTTP deployment (``conftest.py``), shared with scenario 7a."""
    return http_deployment


def with_info(scrape: web.Scrape, version: str) -> web.Scrape | None:
    """The scrape once every target's ``vllm_dp_engine_info`` carries ``version``."""
    ok = all(
        scrape.value("vllm_dp_engine_info", engine=t, vllm_version=version) == 1 for t in TARGETS
    )
    return scrape if ok else None


def answer(engine: dict[str, Any], method: str, key: str = "value") -> Any:
    """One engine's ``key`` for ``method`` in /status (its ``invariants``)."""
    return engine["invariants"][method][key]


def reset_reasons(body: dict[str, Any]) -> list[tuple[str, bool, str | None]]:
    return [(str(e["engine"]), e["ok"], e["reason"]) for e in body["engines"]]


def test_scenario5_per_target_values_and_reset_through_the_dev_route(
    deployment: HttpDeployment, runtime: VllmRuntime
) -> None:
    exporter = deployment.exporter
    status = exporter.status()
    assert status["attach"] == "http" and status["engines_connected"] == 2
    assert status["aggregate"]["is_sleeping"]["value"] is False
    # is_scheduler_paused comes from the RL route GET /is_paused (dev mode).
    assert status["aggregate"]["is_scheduler_paused"]["state"] == "consistent"
    assert status["aggregate"]["is_scheduler_paused"]["value"] is False
    sleeping = [
        (e["engine"], answer(e, "is_sleeping", "outcome"), answer(e, "is_sleeping"))
        for e in status["engines"]
    ]
    assert sleeping == [
        ("0", "ok", False),
        ("1", "ok", False),
    ]
    # engine_info comes from one GET /version per target, sent off the poll path once the
    # target first answered: it can land a moment after /readyz turned 200.
    scrape = web.wait_for(
        lambda: with_info(exporter.scrape(), runtime.version),
        15,
        "vllm_dp_engine_info with the real version for both targets",
    )
    for target in TARGETS:
        assert scrape.value("vllm_dp_engine_up", engine=target) == 1
        assert scrape.value("vllm_dp_engine_sleeping", engine=target) == 0
        assert scrape.value("vllm_dp_engine_paused", engine=target) == 0
    assert scrape.value("vllm_dp_sleeping") == 0
    assert scrape.value("vllm_dp_sleep_state_consistent") == 1

    reply = exporter.reset()
    assert reply.status == 200, reply.body
    assert reset_reasons(reply.json()) == [("0", True, None), ("1", True, None)]
    for server in deployment.servers.values():
        assert "POST /reset_prefix_cache?reset_running_requests=false" in server.log_text()


@pytest.mark.vllm_needs("POST /pause", "POST /resume")
def test_scenario5_one_paused_target_makes_the_fleet_inconsistent(
    deployment: HttpDeployment,
) -> None:
    exporter, url0 = deployment.exporter, deployment.urls["0"]
    counted_before = exporter.scrape().total(
        "vllm_dp_inconsistent_utility_results_total", method="is_sleeping"
    )
    paused = web.post(f"{url0}/pause?mode=keep", timeout_s=60)
    assert paused.status == 200, paused.body
    try:
        status = web.wait_for(
            lambda: (
                (s := exporter.status())["aggregate"]["is_sleeping"]["state"] == "inconsistent"
                and s
            ),
            15,
            "the fleet to turn inconsistent",
        )
        values = [
            (e["engine"], answer(e, "is_sleeping"), answer(e, "is_scheduler_paused"))
            for e in status["engines"]
        ]
        assert values == [
            ("0", True, True),
            ("1", False, False),
        ]
        scrape = exporter.scrape()
        assert scrape.value("vllm_dp_engine_sleeping", engine="0") == 1
        assert scrape.value("vllm_dp_engine_sleeping", engine="1") == 0
        assert scrape.value("vllm_dp_sleep_state_consistent") == 0
        assert scrape.value("vllm_dp_fleet_state", state="inconsistent") == 1
        assert scrape.value("vllm_dp_sleeping") is None
        assert (
            scrape.total("vllm_dp_inconsistent_utility_results_total", method="is_sleeping")
            > counted_before
        )
    finally:
        resumed = web.post(f"{url0}/resume")
    assert resumed.status == 200, resumed.body
    web.wait_for(
        lambda: (
            exporter.status()["aggregate"]["is_sleeping"].items()
            >= {
                "state": "consistent",
                "value": False,
                "consistent": True,
                "error": None,
                "values": None,
                "missing": [],
            }.items()
        ),
        15,
        "the fleet to be consistent again",
    )


@pytest.mark.vllm_needs("POST /pause", "POST /resume")
def test_scenario5_a_target_with_running_requests_refuses_the_reset(
    deployment: HttpDeployment,
) -> None:
    exporter = deployment.exporter
    gens = start_long_generations(deployment.urls["0"], 2, LONG_TOKENS)
    # Paused with mode=keep, the running requests keep their KV blocks however fast this CPU
    # generates, so the reset cannot race the end of the generations.
    paused = web.post(f"{deployment.urls['0']}/pause?mode=keep&clear_cache=false", timeout_s=60)
    assert paused.status == 200, paused.body
    try:
        reply = exporter.reset()
        assert not any(g.finished.is_set() for g in gens), "a generation ended before the reset"
    finally:
        # Resumed, the generations stream at once: the busy server may answer late.
        resumed = web.post(f"{deployment.urls['0']}/resume", timeout_s=60)
    assert resumed.status == 200, resumed.body
    body = reply.json()
    assert reply.status == 502, body
    assert body["outcome"] == "partial_failure"
    assert reset_reasons(body) == [("0", False, "refused"), ("1", True, None)]
    scrape = exporter.scrape()
    assert (
        scrape.value(
            "vllm_dp_prefix_cache_reset_engine_failures_total", engine="0", reason="refused"
        )
        == 1
    )
    assert scrape.total("vllm_dp_prefix_cache_reset_engine_failures_total", engine="1") == 0
    assert scrape.value("vllm_dp_prefix_cache_resets_total", outcome="partial_failure") == 1

    assert [g.result(600) for g in gens] == [LONG_TOKENS] * 2
    reply = exporter.reset()
    assert reply.status == 200, reply.body
