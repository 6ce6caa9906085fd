"""RL invariants, socket-free: parsing, verdicts and the poller's "unsupported" memory.

Each behaviour is proved over real sockets in tests/integration/rl/; here the semantics are
pinned down without them (``FakeFleet``, pure functions).
"""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.actions import ACTIONS, run_action, run_verify_weights
from exporter.control.gate import GateRequestError, evaluate, parse_conditions
from exporter.control.parsing import ActionRequest, BadActionRequest, Check, parse_weight_version
from exporter.control.runtime import Exporter
from exporter.control.verdicts import classify
from exporter.fleetstate.aggregate import FleetState
from exporter.fleetstate.checksums import compare, comparison_key, flatten
from exporter.fleetstate.invariants import SLEEPING, WEIGHT_VERSION
from tests.harness.gatesample import gate_sample

NO_ATTR = "Call to {m} method failed: 'EngineCoreProc' object has no attribute '{m}'"


class Engines:
    """A tiny stateful fleet for FakeFleet: sleep, pause and weight version per engine."""

    def __init__(self, count: int = 3) -> None:
        self.state: dict[str, dict[str, Any]] = {
            str(i): {"sleeping": False, "paused": False, "version": None} for i in range(count)
        }
        self.stubborn: set[str] = set()  # accept state changes, keep the old state
        self.lacking: dict[str, set[str]] = {}

    def __call__(self, engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method in self.lacking.get(engine, set()):
            return EngineOutcome(engine, Outcome.FAILED, error=NO_ATTR.format(m=method))
        s = self.state[engine]
        change = engine not in self.stubborn
        if method == "is_sleeping":
            return s["sleeping"] or s["paused"]
        if method == "is_scheduler_paused":
            return s["paused"]
        if method == "get_weight_version":
            return s["version"]
        if method == "sleep" and change:
            s["sleeping"] = True
        elif method == "wake_up" and change:
            s["sleeping"] = s["paused"] = False
            return True
        elif method == "pause_scheduler" and change:
            s["paused"] = True
        elif method == "resume_scheduler" and change:
            s["paused"] = False
        elif method == "set_weight_version" and change:
            s["version"] = args[0]
        elif method == "compute_weight_checksums":
            digest = "bad" if engine == "2" else "good"
            return [{f"dp{engine}/pp0/pcp0/tp0/layer.weight": digest, "dp0/pp0/pcp0/tp0/x": "ok"}]
        return None


def exporter_over(fleet: FakeFleet) -> Exporter:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=len(fleet.engines),
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
    )
    return Exporter(config, client=fleet)


async def test_weight_versions_agree_disagree_and_unsupported_engines_are_left_out() -> None:
    engines = Engines()
    fleet = FakeFleet(engines, engines=("0", "1", "2"))
    exporter = exporter_over(fleet)
    snap = await exporter.poller.poll_once()
    assert snap.weight_version.state is FleetState.CONSISTENT
    assert snap.weight_version.value is None
    engines.state["1"]["version"] = "v2"
    snap = await exporter.poller.poll_once()
    assert snap.weight_version.state is FleetState.INCONSISTENT
    assert exporter.stats.inconsistent_results["get_weight_version"] == 1
    # An engine without the method: unsupported once, never asked again, not a failure.
    engines.lacking["2"] = {"get_weight_version"}
    engines.state["0"]["version"] = "v2"
    await exporter.poller.poll_once()
    asked = len([c for c in fleet.calls if c[:2] == ("2", "get_weight_version")])
    snap = await exporter.poller.poll_once()
    assert len([c for c in fleet.calls if c[:2] == ("2", "get_weight_version")]) == asked
    assert snap.weight_version.state is FleetState.CONSISTENT and snap.weight_version.value == "v2"
    assert "get_weight_version" in snap.engines[2].unsupported
    assert snap.engines[2].up
    failed = exporter.stats.utility_calls[("get_weight_version", "2", "failed")]
    assert failed == 0, "an unsupported method is not a failing call"


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, {}),
        ({"weight_version": ["v7"]}, {"weight_version": "v7"}),
        ({"sleeping": ["false"], "paused": ["0"]}, {"sleeping": False, "paused": False}),
    ],
)
def test_gate_conditions(query: dict[str, list[str]], expected: dict[str, Any]) -> None:
    assert parse_conditions(query) == expected


@pytest.mark.parametrize(
    "query",
    [
        {"bogus": ["1"]},
        {"sleeping": ["maybe"]},
        {"paused": ["true", "false"]},
        {"weight_version": [""]},
        {"healthy": ["maybe"]},
        {"healthy": ["true", "true"]},
        {"healthy": ["x" * 10_000]},
    ],
)
def test_gate_bad_conditions(query: dict[str, list[str]]) -> None:
    with pytest.raises(GateRequestError):
        parse_conditions(query)


def test_gate_verdict_names_failing_engines_and_conditions() -> None:
    s = gate_sample(
        {
            "0": {"is_sleeping": False, "get_weight_version": "v2"},
            "1": {"is_sleeping": False, "get_weight_version": "v1"},
            "2": {"is_sleeping": EngineOutcome("2", Outcome.TIMEOUT, error="no reply")},
        }
    )
    status, body = evaluate({"weight_version": "v2", "sleeping": False}, s, 0.0)
    assert status == 412 and body["failing_engines"] == ["1", "2"]
    failures = {e["engine"]: e["failures"] for e in body["engines"]}
    assert failures["0"] == []
    assert failures["1"] == ["weight_version is 'v1', expected 'v2'"]
    assert any("sleeping: timeout" in f for f in failures["2"])
    status, body = evaluate(
        {"weight_version": "v2"},
        gate_sample({"0": {"is_sleeping": True, "get_weight_version": "v2"}}),
        0.0,
    )
    assert status == 200 and body["ok"] is True


def test_weight_version_body_is_checked() -> None:
    request = parse_weight_version({}, b'{"weight_version": "step-42"}')
    assert request.args == ("step-42",) and request.check == Check(WEIGHT_VERSION, "step-42")
    for body in (b"", b"[]", b'{"weight_version": 3}', b'{"weight_version": "x", "y": 1}', b"{"):
        with pytest.raises(BadActionRequest):
            parse_weight_version({}, body)


@pytest.mark.parametrize(
    ("action", "query", "args"),
    [
        ("sleep", {}, (1,)),
        ("sleep", {"level": ["2"], "mode": ["wait"]}, (2, "wait")),
        ("wake_up", {}, (None,)),
        ("wake_up", {"tags": ["weights"]}, (["weights"],)),
        ("wake_up", {"tags": ["kv_cache,weights"]}, (["kv_cache", "weights"],)),
        ("pause", {"mode": ["keep"]}, ("keep",)),
        ("resume", {}, ()),
    ],
)
def test_action_parsing(action: str, query: dict[str, list[str]], args: tuple[Any, ...]) -> None:
    assert ACTIONS[action].parse(query, b"").args == args


@pytest.mark.parametrize(
    ("action", "query"),
    [
        ("sleep", {"level": ["3"]}),
        ("sleep", {"mode": ["nap"]}),
        ("wake_up", {"tags": ["gpu"]}),
        ("pause", {"mode": ["x"]}),
        ("resume", {"now": ["1"]}),
    ],
)
def test_bad_action_parameters(action: str, query: dict[str, list[str]]) -> None:
    with pytest.raises(BadActionRequest):
        ACTIONS[action].parse(query, b"")


def test_classify_tells_every_reason_apart() -> None:
    request = ActionRequest("sleep", "sleep", (1,), {}, Check(SLEEPING, True))
    calls = [
        EngineOutcome("0", Outcome.OK, None),
        EngineOutcome("1", Outcome.OK, None),
        EngineOutcome("2", Outcome.TIMEOUT, error="no reply"),
        EngineOutcome("3", Outcome.DISCONNECTED, error="gone"),
        EngineOutcome("4", Outcome.FAILED, error=NO_ATTR.format(m="sleep")),
        EngineOutcome("5", Outcome.FAILED, error="Call to sleep method failed: boom"),
    ]
    back = {
        "0": EngineOutcome("0", Outcome.OK, True),
        "1": EngineOutcome("1", Outcome.OK, False),
    }
    verdict = classify(request, calls, back)
    reasons = [e.reason for e in verdict.engines]
    assert reasons == [None, "unverified", "timeout", "disconnected", "unsupported", "failed"]
    assert verdict.outcome == "partial_failure"
    assert "is False, not True" in (verdict.engines[1].error or "")


async def test_actions_are_verified_by_reading_the_state_back() -> None:
    engines = Engines()
    engines.stubborn = {"1"}
    fleet = FakeFleet(engines, engines=("0", "1", "2"))
    result = await run_action(fleet, ACTIONS["sleep"].parse({}, b""), timeout_s=1.0)
    assert result.status == 502
    reasons = {e["engine"]: e["reason"] for e in result.body["engines"]}
    assert reasons == {0: None, 1: "unverified", 2: None}
    assert result.body["engines"][0]["state"] is True
    engines.stubborn = set()
    result = await run_action(
        fleet, parse_weight_version({}, b'{"weight_version": "v9"}'), timeout_s=1.0
    )
    assert result.status == 200 and result.body["success"] is True


async def test_weights_are_compared_across_ranks() -> None:
    fleet = FakeFleet(Engines(), engines=("0", "1", "2"))
    request = ACTIONS["verify_weights"].parse({}, b"")
    result = await run_verify_weights(fleet, request, timeout_s=1.0)
    assert result.status == 502
    by_engine = {e["engine"]: e for e in result.body["engines"]}
    assert by_engine[2]["reason"] == "mismatch"
    assert by_engine[2]["mismatching_parameters"] == ["pp0/pcp0/tp0/layer.weight"]
    assert by_engine[0]["agrees_with_majority"] and by_engine[1]["agrees_with_majority"]
    assert result.extra["mismatches"] == {"0": 0, "1": 0, "2": 1}


def test_checksum_keys_lose_only_their_dp_component() -> None:
    assert comparison_key("dp3/pp1/pcp0/tp2/model.w") == "pp1/pcp0/tp2/model.w"
    assert comparison_key("dp3_pp1_tp2.model.w") == "pp1_tp2.model.w"
    assert comparison_key("model.dpx.weight") == "model.dpx.weight"
    per_engine = {
        "0": flatten([{"dp0/tp0/a": "1"}, {"dp0/tp1/a": "2"}]),
        "1": flatten([{"dp0/tp0/a": "1"}]),
        "2": flatten([{"dp0/tp0/a": "9"}, {"dp0/tp1/a": "2"}]),
    }
    result = {c.engine: c for c in compare(per_engine)}
    assert result["0"].mismatches == 0
    assert result["1"].listed == ("tp1/a",)
    assert result["2"].listed == ("tp0/a",)
