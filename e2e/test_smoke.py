"""The smoke set's own scenarios (docs/e2e.md, "Smoke set", scenario 10): owner mode against
the session's owner fleet (``owner_fleet``, 2 engines of one headless launcher), adapting to
what the vLLM under test has (``e2e/vllm_features.py``, read from its source).

``make e2e-smoke VLLM_VERSION=0.30.0`` runs every test marked ``smoke``: these, scenario 1
(``test_owner.py``: owner mode ready, ``vllm_version`` label, reset confirmed by both engines)
and scenarios 3 and 3b (``test_relay.py``: relay mode beside a stock front end, completions
through it, its pause). CI runs it against an older vLLM on every landing.

* Where the version has a method, the action works for real: pause and resume verified on both
  engines, a weight version set, read back and seen by ``GET /gate``.
* Where it lacks one, the unsupported path (the exporter's contract): ``POST /admin/<action>``
  answers 501 ``outcome: "unsupported"`` with every engine ``reason: "unsupported"``, counted
  as ``vllm_dp_admin_actions_total{outcome="unsupported"}``, and ``ctl`` exits 4; a
  ``/gate`` condition no engine can answer is 501 naming it, and ``ctl wait`` exits 4 at once;
  ``/status`` marks the invariant ``unsupported`` per engine.

Every test leaves the fleet as it found it (resumed, weight version back to vLLM's initial
``default``): scenario 7b runs on the same engines after this module.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest

from e2e import web
from e2e.exporter_proc import GATE_MIN_INTERVAL_S, ExporterProc, confirmed, states
from e2e.fleets import OwnerFleet
from e2e.vllm_features import VllmFeatures

pytestmark = [pytest.mark.timeout(900), pytest.mark.smoke]

ENGINES = ("0", "1")
POLL_WAIT_S = 15.0
# ctl's exit code when no engine supports what was asked (HTTP 501).
EXIT_UNSUPPORTED = 4
# vLLM's weight version before anyone sets one (EngineCore._weight_version).
VLLM_DEFAULT_VERSION = "default"
# The invariants the exporter polls, by the engine-core method behind each.
POLLED = ("is_sleeping", "is_scheduler_paused", "get_weight_version")
PAUSE_METHODS = ("pause_scheduler", "resume_scheduler", "is_scheduler_paused")


@dataclass(frozen=True)
class Action:
    """``POST /admin/<name>``: the engine-core method it calls, its ``ctl`` subcommand."""

    name: str
    method: str
    ctl: tuple[str, ...]
    payload: dict[str, Any] | None = None


ACTIONS = (
    Action("verify_weights", "compute_weight_checksums", ("verify-weights",)),
    Action(
        "weight_version",
        "set_weight_version",
        ("set-weight-version", "smoke-1"),
        {"weight_version": "smoke-1"},
    ),
    Action("pause", "pause_scheduler", ("pause",)),
    Action("resume", "resume_scheduler", ("resume",)),
    Action("reset_mm_cache", "reset_mm_cache", ("reset-mm-cache",)),
    Action("reset_encoder_cache", "reset_encoder_cache", ("reset-encoder-cache",)),
)


@pytest.fixture
def exporter(owner_fleet: OwnerFleet) -> ExporterProc:
    return owner_fleet.exporter


def actions_counted(exporter: ExporterProc, action: str, outcome: str) -> float:
    return exporter.scrape().total("vllm_dp_admin_actions_total", action=action, outcome=outcome)


def gate(exporter: ExporterProc, expect: int, **conditions: str) -> dict[str, Any]:
    """``GET /gate`` once the shared fan-out of the last action expired (scenario 7)."""
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)
    reply = exporter.gate(**conditions)
    body: dict[str, Any] = reply.json()
    assert reply.status == expect, (conditions, body)
    return body


def polled(exporter: ExporterProc, method: str, value: Any) -> dict[str, Any]:
    """/status once both engines' polled ``method`` is consistently ``value``."""

    def probe() -> dict[str, Any] | None:
        status = exporter.status()
        verdict = status["aggregate"][method]
        return status if verdict["state"] == "consistent" and verdict["value"] == value else None

    return web.wait_for(probe, POLL_WAIT_S, f"{method} consistently {value!r}")


def ctl_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any] | None:
    try:
        body = json.loads(result.stdout)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


# -- what the version has: the actions for real --------------------------------------------------


@pytest.mark.vllm_needs(*PAUSE_METHODS)
def test_scenario10_pause_and_resume_verified_on_both_engines(exporter: ExporterProc) -> None:
    before = {a: actions_counted(exporter, a, "success") for a in ("pause", "resume")}
    body = confirmed(exporter.admin("pause"), "pause")
    assert states(body) == [(e, True, True) for e in ENGINES]
    try:
        gate(exporter, 200, paused="true")
        body = gate(exporter, 412, paused="false")
        assert body["failing_engines"] == list(ENGINES)
        status = polled(exporter, "is_scheduler_paused", True)
        assert [(str(e["engine"]), e["state"]) for e in status["engines"]] == [
            (e, "paused") for e in ENGINES
        ]
        scrape = exporter.scrape()
        for engine in ENGINES:
            assert scrape.value("vllm_dp_engine_paused", engine=engine) == 1
    finally:
        resumed = exporter.admin("resume")
    body = confirmed(resumed, "resume")
    assert states(body) == [(e, True, False) for e in ENGINES]
    gate(exporter, 200, paused="false", sleeping="false")
    status = polled(exporter, "is_scheduler_paused", False)
    assert [(str(e["engine"]), e["state"]) for e in status["engines"]] == [
        (e, "awake") for e in ENGINES
    ]
    for action, count in before.items():
        assert actions_counted(exporter, action, "success") == count + 1


@pytest.mark.vllm_needs("get_weight_version", "set_weight_version")
def test_scenario10_weight_version_set_read_back_and_gated(exporter: ExporterProc) -> None:
    polled(exporter, "get_weight_version", VLLM_DEFAULT_VERSION)
    before = actions_counted(exporter, "weight_version", "success")
    body = confirmed(
        exporter.admin("weight_version", {"weight_version": "smoke-1"}), "weight_version"
    )
    assert states(body) == [(e, True, "smoke-1") for e in ENGINES]
    try:
        gate(exporter, 200, weight_version="smoke-1")
        body = gate(exporter, 412, weight_version="smoke-0")
        assert body["failing_engines"] == list(ENGINES)
        polled(exporter, "get_weight_version", "smoke-1")
    finally:
        restored = exporter.admin("weight_version", {"weight_version": VLLM_DEFAULT_VERSION})
    confirmed(restored, "weight_version")
    polled(exporter, "get_weight_version", VLLM_DEFAULT_VERSION)
    assert actions_counted(exporter, "weight_version", "success") == before + 2


# -- what the version lacks: the unsupported paths -----------------------------------------------


def test_scenario10_status_marks_unsupported_exactly_what_the_version_lacks(
    exporter: ExporterProc, vllm_features: VllmFeatures
) -> None:
    """Every polled invariant whose method the engines lack is ``unsupported`` on both (never
    a failed call); nothing the version has is."""
    lacking = {m for m in POLLED if not vllm_features.has(m)}
    status = exporter.status()
    for engine in status["engines"]:
        unsupported = set(engine["unsupported"])
        assert unsupported & set(POLLED) == lacking, engine
        assert unsupported <= set(vllm_features.lacks()), engine
        for method in POLLED:
            outcome = engine["invariants"][method]["outcome"]
            assert outcome == ("unsupported" if method in lacking else "ok"), (method, engine)
    for method in lacking:
        verdict = status["aggregate"][method]
        assert [str(e) for e in verdict["unsupported"]] == list(ENGINES), verdict
        assert verdict["outcome"] == "unsupported", verdict
    for method in set(POLLED) - lacking:
        assert status["aggregate"][method]["outcome"] != "unsupported", status["aggregate"]
    scrape = exporter.scrape()
    for method in lacking:
        assert scrape.total("vllm_dp_utility_calls_total", method=method, outcome="failed") == 0


@pytest.mark.parametrize(
    "action",
    [pytest.param(a, marks=pytest.mark.vllm_lacks(a.method), id=a.name) for a in ACTIONS],
)
def test_scenario10_an_action_no_engine_supports_is_501_and_ctl_exits_4(
    exporter: ExporterProc, action: Action
) -> None:
    before = actions_counted(exporter, action.name, "unsupported")
    reply = exporter.admin(action.name, action.payload)
    body = reply.json()
    assert reply.status == 501, body
    assert body["outcome"] == "unsupported" and body["success"] is False, body
    assert [(str(e["engine"]), e["ok"], e["reason"]) for e in body["engines"]] == [
        (e, False, "unsupported") for e in ENGINES
    ]
    ctl = exporter.ctl(*action.ctl, "--admin-url", exporter.admin_url, "--json")
    assert ctl.returncode == EXIT_UNSUPPORTED, (ctl.returncode, ctl.stdout, ctl.stderr)
    answer = ctl_json(ctl)
    if answer is not None:
        assert answer.get("outcome") == "unsupported", answer
    assert actions_counted(exporter, action.name, "unsupported") == before + 2
    assert actions_counted(exporter, action.name, "success") == 0


@pytest.mark.vllm_needs("registration:enable_sleep_mode")
@pytest.mark.parametrize(("action", "ctl"), [("sleep", "sleep"), ("wake_up", "wake-up")])
def test_scenario10_sleep_on_engines_registered_without_sleep_mode_is_501(
    exporter: ExporterProc, action: str, ctl: str
) -> None:
    """vLLM's CPU platform refuses ``--enable-sleep-mode``: the engines register
    ``enable_sleep_mode=false``, so the exporter does not send ``sleep``/``wake_up`` at all and
    answers as for a method no engine has (the one unsupported path every version with that
    registration key, 0.32 included, exercises for real)."""
    status = exporter.status()
    assert all(e["state"] == "awake" for e in status["engines"]), status["engines"]
    before = actions_counted(exporter, action, "unsupported")
    reply = exporter.admin(action)
    body = reply.json()
    assert reply.status == 501, body
    assert body["outcome"] == "unsupported", body
    assert [(str(e["engine"]), e["reason"]) for e in body["engines"]] == [
        (e, "unsupported") for e in ENGINES
    ]
    result = exporter.ctl(ctl, "--admin-url", exporter.admin_url, "--json")
    assert result.returncode == EXIT_UNSUPPORTED, (result.returncode, result.stdout, result.stderr)
    assert actions_counted(exporter, action, "unsupported") == before + 2
    polled(exporter, "is_sleeping", False)  # nothing was sent: still awake


@pytest.mark.vllm_lacks("get_weight_version")
def test_scenario10_a_gate_condition_no_engine_supports_is_501_and_ctl_wait_exits_4(
    exporter: ExporterProc,
) -> None:
    body = gate(exporter, 501, weight_version="smoke-1")
    assert body["unsupported"] == ["weight_version"], body
    started = time.monotonic()
    ctl = exporter.ctl(
        "wait", "--weight-version", "smoke-1", "--url", exporter.url, "--timeout", "30"
    )
    took = time.monotonic() - started
    assert ctl.returncode == EXIT_UNSUPPORTED, (ctl.returncode, ctl.stdout, ctl.stderr)
    assert took < 15, f"ctl wait took {took:.1f} s: it waited for its timeout"
