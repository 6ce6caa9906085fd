"""Owner mode against one real headless vLLM launcher with 2 engines (docs/e2e.md, scenarios 1, 2
and 6). The engines are started once per session (``owner_fleet``, shared with scenario 7b);
the scenarios run in file order."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from e2e import web
from e2e.fleets import OwnerFleet
from e2e.vllm_features import VllmFeatures
from e2e.vllm_runtime import READY_TIMEOUT_S, engine_core_pids

pytestmark = pytest.mark.timeout(900)

ENGINES = ("0", "1")


@pytest.fixture
def fleet(owner_fleet: OwnerFleet) -> OwnerFleet:
    """The session's owner fleet (``conftest.py``), shared with scenario 7b."""
    return owner_fleet


def assert_fleet_healthy(scrape: web.Scrape) -> None:
    """Both engines up and awake, the aggregate consistently 'not sleeping'."""
    for engine in ENGINES:
        assert scrape.value("vllm_dp_engine_up", engine=engine) == 1
        assert scrape.value("vllm_dp_engine_sleeping", engine=engine) == 0
        assert scrape.value("vllm_dp_engine_state", engine=engine, state="awake") == 1
    assert scrape.value("vllm_dp_engines_expected") == 2
    assert scrape.value("vllm_dp_engines_connected") == 2
    assert scrape.value("vllm_dp_sleeping") == 0
    assert scrape.value("vllm_dp_sleep_state_consistent") == 1
    assert scrape.value("vllm_dp_fleet_state", state="consistent") == 1
    assert scrape.total("vllm_dp_inconsistent_utility_results_total") == 0


def assert_reset_confirmed_by_both(reply: web.Reply) -> None:
    body = reply.json()
    assert reply.status == 200, body
    assert body["success"] is True and body["outcome"] == "success"
    assert [(e["engine"], e["ok"], e["reason"]) for e in body["engines"]] == [
        (0, True, None),
        (1, True, None),
    ]
    assert body["failed_engines"] == []


def registered_version(fleet: OwnerFleet, features: VllmFeatures) -> str | None:
    """The ``vllm_version`` engines register (vLLM 0.20 registers none)."""
    return fleet.runtime.version if features.has("registration:vllm_version") else None


@pytest.mark.smoke
def test_scenario1_owner_mode_two_real_engines(
    fleet: OwnerFleet, vllm_features: VllmFeatures
) -> None:
    exporter = fleet.exporter
    version = registered_version(fleet, vllm_features)
    status = exporter.status()
    assert status["ready"] is True
    assert (
        status["aggregate"]["is_sleeping"].items()
        >= {
            "state": "consistent",
            "value": False,
            "consistent": True,
            "error": None,
            "values": None,
            "missing": [],
        }.items()
    )
    for engine in status["engines"]:
        assert engine["invariants"]["is_sleeping"]["outcome"] == "ok"
        assert engine["connected"] is True
        assert engine["vllm_version"] == version
        assert engine["handshakes"] == 1
    scrape = exporter.scrape()
    assert_fleet_healthy(scrape)
    for engine in ENGINES:
        if version is not None:
            assert scrape.value("vllm_dp_engine_info", engine=engine, vllm_version=version) == 1
        if vllm_features.has("registration:enable_sleep_mode"):
            # vLLM's CPU platform does not support sleep mode: the engines register without it.
            assert (
                scrape.value("vllm_dp_engine_info", engine=engine, enable_sleep_mode="false") == 1
            )
        if vllm_features.has("is_scheduler_paused"):
            assert scrape.value("vllm_dp_engine_paused", engine=engine) == 0

    assert_reset_confirmed_by_both(exporter.reset())
    after = exporter.scrape()
    assert after.value("vllm_dp_prefix_cache_resets_total", outcome="success") == 1
    assert after.total("vllm_dp_prefix_cache_reset_engine_failures_total") == 0
    assert (after.value("vllm_dp_prefix_cache_last_success_timestamp_seconds") or 0) > 0

    ctl = exporter.ctl("status", "--url", exporter.url, "--json")
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["engines_connected"] == 2
    ctl = exporter.ctl("reset-prefix-cache", "--admin-url", exporter.admin_url, "--json")
    assert ctl.returncode == 0, ctl.stderr
    assert json.loads(ctl.stdout)["failed_engines"] == []


def test_scenario2_exporter_restart_finds_running_engines(fleet: OwnerFleet) -> None:
    engines_before = engine_core_pids(fleet.engines)
    assert sorted(engines_before) == [0, 1], engines_before
    fleet.restart_exporter()
    # Engines never handshake twice: only the fixed ports let them be found again, fast.
    status = fleet.exporter.wait_ready(30.0, fleet.engines)
    assert engine_core_pids(fleet.engines) == engines_before, "the engines were restarted"
    assert [e["handshakes"] for e in status["engines"]] == [0, 0]
    assert all(e["invariants"]["is_sleeping"]["outcome"] == "ok" for e in status["engines"])
    assert_fleet_healthy(fleet.exporter.scrape())
    assert_reset_confirmed_by_both(fleet.exporter.reset())


def test_scenario6_engine_death_then_restart_without_exporter_restart(
    fleet: OwnerFleet, vllm_features: VllmFeatures
) -> None:
    exporter = fleet.exporter
    exporter_pid = exporter.proc.pid
    cores = engine_core_pids(fleet.engines)
    assert sorted(cores) == [0, 1], cores
    # SIGKILL one engine core (a child of our launcher): no ENGINE_CORE_DEAD is sent for it.
    os.kill(cores[1], signal.SIGKILL)
    # vLLM's headless manager stops its other engines and exits when one engine dies.
    web.wait_for(lambda: not fleet.engines.alive(), 60, "the headless launcher to exit")

    def all_disconnected() -> dict[str, Any] | None:
        status = exporter.status()
        engines = status["engines"]
        if status["engines_connected"] == 0 and all(
            e["invariants"]["is_sleeping"]["outcome"] == "disconnected" and not e["connected"]
            for e in engines
        ):
            return status
        return None

    status = web.wait_for(all_disconnected, 30, "every engine reported disconnected")
    assert status["aggregate"]["is_sleeping"]["state"] == "unknown"
    assert exporter.readyz() == 503
    scrape = exporter.scrape()
    for engine in ENGINES:
        assert scrape.value("vllm_dp_engine_up", engine=engine) == 0
        assert scrape.value("vllm_dp_engine_state", engine=engine, state="unknown") == 1
        assert scrape.value("vllm_dp_engine_sleeping", engine=engine) is None
    assert scrape.value("vllm_dp_engines_connected") == 0
    assert scrape.value("vllm_dp_fleet_state", state="unknown") == 1
    assert scrape.value("vllm_dp_sleeping") is None
    dead = exporter.reset()
    assert dead.status == 503, dead.body

    fleet.restart_engines()
    status = exporter.wait_ready(READY_TIMEOUT_S, fleet.engines)
    assert exporter.proc.pid == exporter_pid and exporter.proc.alive()
    assert [e["handshakes"] for e in status["engines"]] == [1, 1]
    version = registered_version(fleet, vllm_features)
    assert all(e["vllm_version"] == version for e in status["engines"])
    assert_fleet_healthy(exporter.scrape())
    assert_reset_confirmed_by_both(exporter.reset())
