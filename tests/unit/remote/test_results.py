"""``exporter.remote``'s typed results parsed from the exporter's own answer bodies (built by
the server's pure functions, so client and server cannot drift apart), and from hostile ones:
a wrong type is an ``InvalidAnswer`` naming the field, a missing key its default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exporter.client.fleet import EngineOutcome as ServerOutcome
from exporter.client.fleet import Outcome
from exporter.control.gate import Sample, evaluate
from exporter.control.verdicts import (
    RESET_ANSWER,
    ActionVerdict,
    EngineVerdict,
    no_engine_body,
    verdict_body,
)
from exporter.protocol.activity import RequestCounts as ServerCounts
from exporter.remote import (
    ActionResult,
    BadRequest,
    EngineRequests,
    GateResult,
    InvalidAnswer,
    Status,
)
from exporter.remote.results import REASONS
from exporter.remote.waiting import query, with_drained

ROOT = Path(__file__).resolve().parents[3]
EVIL = "x\x1b[2J\r\n\u202e"


def action_body(*results: EngineVerdict, verified: bool = True, **kw: Any) -> dict[str, Any]:
    verdict = ActionVerdict("sleep", results, verified=verified)
    return verdict_body(verdict, {"level": 1, "mode": "abort"}, 0.25, **kw)


def test_an_action_answer_with_every_engine() -> None:
    body = action_body(
        EngineVerdict("0", None, None, True),
        EngineVerdict("1", "unverified", "accepted, but is_sleeping is False", False),
    )
    result = ActionResult.from_json("sleep", 502, body)
    assert (result.action, result.status, result.success, result.outcome) == (
        "sleep",
        502,
        False,
        "partial_failure",
    )
    assert result.verified is True and result.params == {"level": 1, "mode": "abort"}
    assert result.duration_s == 0.25 and result.failed_engines == ("1",)
    assert [(e.engine, e.ok, e.reason, e.state) for e in result.engines] == [
        ("0", True, None, True),
        ("1", False, "unverified", False),
    ]
    assert result.failures == (result.engine(1),) and not result.unsupported
    with pytest.raises(KeyError):
        result.engine(7)
    assert result.raw is body


def test_the_reset_answer_shape_and_the_no_engine_answer() -> None:
    verdict = ActionVerdict("reset_prefix_cache", (EngineVerdict("0", None),), verified=False)
    body = verdict_body(verdict, {"reset_running_requests": False}, 0.1, RESET_ANSWER)
    assert "action" not in body and "flags" in body  # the reset's historical shape
    reset = ActionResult.from_json("reset_prefix_cache", 200, body)
    assert reset.action == "reset_prefix_cache" and reset.verified is None
    assert reset.params == {"reset_running_requests": False} and reset.success
    none = ActionResult.from_json("pause", 503, no_engine_body("pause", {"mode": "abort"}))
    assert none.engines == () and none.outcome == "failure" and not none.success
    assert none.error == "no engine is connected"


@pytest.mark.parametrize(
    ("reasons", "outcome", "status"),
    [
        (("unsupported", "unsupported", "unsupported"), "unsupported", 501),
        (("unsupported", None, "unsupported"), "partial_failure", 502),
        (("unsupported", "refused"), "failure", 502),
        ((None, None), "success", 200),
    ],
)
def test_unsupported_only_when_no_engine_has_the_method(
    reasons: tuple[str | None, ...], outcome: str, status: int
) -> None:
    verdict = ActionVerdict(
        "sleep", tuple(EngineVerdict(str(i), r) for i, r in enumerate(reasons)), verified=True
    )
    assert verdict.outcome == outcome and verdict.status == status
    body = action_body(*verdict.engines)
    result = ActionResult.from_json("sleep", status, body)
    assert result.outcome == outcome
    assert result.unsupported is (outcome == "unsupported")
    # A mix names the engines that lack the method: a partial failure, not "unsupported".
    assert [e.engine for e in result.unsupported_engines] == [
        str(i) for i, r in enumerate(reasons) if r == "unsupported"
    ]


def test_the_reasons_are_the_documented_ones() -> None:
    """The per-engine reasons the client names are the status schema's (the server's)."""
    schema = json.loads((ROOT / "docs" / "status.schema.json").read_text())
    engine = schema["$defs"]["last_action"]["properties"]["engines"]["items"]
    assert set(engine["properties"]["reason"]["enum"]) == {None, *REASONS}


def test_a_gate_answer_from_the_servers_verdict() -> None:
    outcomes = {
        "is_sleeping": {
            "0": ServerOutcome("0", Outcome.OK, False),
            "1": ServerOutcome("1", Outcome.OK, False),
        },
        "is_scheduler_paused": {
            "0": ServerOutcome("0", Outcome.OK, False),
            "1": ServerOutcome("1", Outcome.OK, True),
        },
    }
    status, body = evaluate({"paused": False}, Sample(outcomes, ("0", "1"), 1000.0, 5.0), 5.5)
    gate = GateResult.from_json(status, body)
    assert (gate.ok, gate.status, gate.conditions) == (False, 412, {"paused": False})
    assert gate.failing_engines == ("1",) and gate.age_s == 0.5 and gate.checked_at_unix == 1000
    assert gate.engines[0].values == {"sleeping": False, "paused": False}
    assert gate.failing[0].failures == ("paused is True, expected False",)


STATUS: dict[str, Any] = {
    "schema_version": 1,
    "version": "0.1.0",
    "attach": "owner",
    "model_name": None,
    "ready": True,
    "engines_expected": 2,
    "engines_connected": 2,
    "last_poll": {"number": 12, "unix": 1.0, "duration_s": 0.01},
    "aggregate": {
        "is_sleeping": {"state": "inconsistent", "value": None, "error": EVIL, "missing": []},
        "get_weight_version": {"state": "consistent", "value": "v3"},
    },
    "engines": [
        {
            "engine": "0",
            "connected": True,
            "up": True,
            "state": "asleep",
            "vllm_version": EVIL,
            "invariants": {"get_weight_version": {"value": "v3", "outcome": "ok"}},
            "a_key_from_a_newer_exporter": {"reset_unix": 5.0},
        },
        {"engine": 1, "connected": False, "up": False, "state": "unknown"},
    ],
}


def test_status_typed_with_newer_keys_kept_in_raw() -> None:
    status = Status.from_json(STATUS)
    assert (status.attach, status.ready, status.last_poll) == ("owner", True, 12)
    assert not status.consistent and status.sleeping.error == EVIL  # kept as sent
    assert status.aggregate["get_weight_version"].value == "v3"
    assert status.engine(0).weight_version == "v3" and status.engine("1").weight_version is None
    assert status.engine(0).raw["a_key_from_a_newer_exporter"] == {"reset_unix": 5.0}
    assert status.engine(1).invariants == {}
    assert Status.from_json({}).sleeping.state == "unknown"  # every key missing: defaults
    assert Status.from_json({}).healthy  # an exporter without fault tolerance in /status


def test_status_fault_tolerance_per_engine_and_fleet() -> None:
    body = {
        **STATUS,
        "fault_tolerance": {"healthy": False, "faulty_engines": ["1"], "reported_engines": ["1"]},
        "engines": [
            {**STATUS["engines"][0], "fault_tolerance": None},
            {
                **STATUS["engines"][1],
                "fault_tolerance": {"status": "unhealthy", "fault_info": "E", "since_unix": 1.0},
            },
        ],
    }
    status = Status.from_json(body)
    assert not status.healthy and status.faulty_engines == ("1",)
    assert status.engine(0).fault_status is None
    assert (status.engine(1).fault_status, status.engine(1).fault_info) == ("unhealthy", "E")
    with pytest.raises(InvalidAnswer):
        Status.from_json({**STATUS, "fault_tolerance": {"healthy": "no"}})


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"engines": {"0": {}}}, "the answer.engines must be an array, got an object"),
        ({"engines": [{"engine": 0, "ok": "yes"}]}, "engines[0].ok must be a boolean"),
        ({"engines": [{"engine": True}]}, "engines[0].engine must be an engine index"),
        ({"engines": [{"engine": [0]}]}, "engines[0].engine must be an engine index"),
        ({"engines": ["0"]}, "engines[0] must be a JSON object, got a string"),
        ({"failed_engines": [None]}, "failed_engines[0] must be an engine index"),
        ({"duration_s": "fast"}, "duration_s must be a number or null, got a string"),
        ({"duration_s": True}, "duration_s must be a number or null, got a boolean"),
        ({"params": []}, "params must be an object, got an array"),
        ({"error": 7}, "error must be a string or null"),
        ({"engines": [{"engine": 0, "ok": False, "mismatches": 1.5}]}, "mismatches"),
        ({"engines": [{"mismatching_parameters": [1]}]}, "mismatching_parameters[0]"),
    ],
)
def test_hostile_action_answers_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidAnswer) as bad:
        ActionResult.from_json("sleep", 200, body)
    assert field in str(bad.value)


@pytest.mark.parametrize(
    "body",
    [
        {"engines": [{"engine": "0", "failures": "paused"}]},
        {"conditions": ["paused"]},
        {"engines": [{"values": 1}]},
        {"age_s": "old"},
    ],
)
def test_hostile_gate_answers(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidAnswer):
        GateResult.from_json(412, body)


@pytest.mark.parametrize(
    "body",
    [
        {"aggregate": []},
        {"aggregate": {"is_sleeping": "consistent"}},
        {"engines": [{"engine": "0", "invariants": {"is_sleeping": 1}}]},
        {"last_poll": {"number": "12"}},
        {"ready": "yes"},
        {"engines_expected": 2.5},
    ],
)
def test_hostile_status_documents(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidAnswer):
        Status.from_json(body)


def test_missing_keys_take_their_defaults() -> None:
    bare = ActionResult.from_json("resume", 200, {})
    assert bare.success and bare.outcome == "success" and bare.engines == ()
    assert ActionResult.from_json("resume", 502, {}).outcome == "failure"
    gate = GateResult.from_json(200, {"engines": [{}]})
    assert gate.ok and gate.engines[0].engine == "" and not gate.engines[0].ok
    assert GateResult.from_json(412, {"ok": True}).ok is False  # the status is the verdict


def test_an_engine_s_routable_verdict_and_hung_state() -> None:
    """docs/activity.md: the row says whether a router should send it traffic, and why not."""
    row = {
        **STATUS["engines"][0],
        "state": "hung",
        "unresponsive_seconds": 42.5,
        "routable": {"routable": False, "reasons": ["hung: no answer for 42 s"]},
    }
    engine = Status.from_json({**STATUS, "engines": [row]}).engine(0)
    assert (engine.state, engine.routable, engine.unresponsive_seconds) == ("hung", False, 42.5)
    assert engine.unroutable_reasons == ("hung: no answer for 42 s",)
    old = Status.from_json(STATUS).engine(0)  # an exporter before this field
    assert old.routable is None and old.unroutable_reasons == ()
    with pytest.raises(InvalidAnswer):
        Status.from_json({**STATUS, "engines": [{**row, "routable": {"reasons": [1]}}]})


# -- activity: has_work, running and waiting requests, drained (docs/activity.md) ----------


def test_a_drained_gate_answer_from_the_servers_verdict() -> None:
    outcomes = {
        "is_sleeping": {e: ServerOutcome(e, Outcome.OK, False) for e in ("0", "1", "2")},
        "has_work": {
            "0": ServerOutcome("0", Outcome.OK, False),
            "1": ServerOutcome("1", Outcome.OK, True),
            "2": ServerOutcome("2", Outcome.OK, True),
        },
    }
    requests = {"0": ServerCounts(0, 0), "1": ServerCounts(2, 1)}  # rank 2: not published
    sample = Sample(outcomes, ("0", "1", "2"), 1000.0, 5.0, requests=requests)
    status, body = evaluate({"drained": True}, sample, 5.0)
    gate = GateResult.from_json(status, body)
    assert (gate.ok, gate.status, gate.failing_engines) == (False, 412, ("1", "2"))
    zero, busy, unknown = gate.engines
    assert zero.requests == EngineRequests(0, 0) and zero.drained is True and zero.ok
    assert busy.requests == EngineRequests(2, 1) and busy.requests.total == 3
    assert str(busy.requests) == "running 2, waiting 1" and busy.drained is False
    assert busy.failures == ("drained: has work (running 2, waiting 1), expected drained=true",)
    assert unknown.requests is None and unknown.failures == (
        "drained: has work, expected drained=true",
    )
    assert zero.has_work is None  # a gate with conditions reports the condition, not the read
    bare_status, bare = evaluate({}, sample, 5.0)
    read = GateResult.from_json(bare_status, bare)
    assert [e.has_work for e in read.engines] == [False, True, True]
    assert [e.drained for e in read.engines] == [None, None, None]


def test_an_older_gate_answer_has_no_requests() -> None:
    body = {"engines": [{"engine": "0", "ok": True, "values": {"sleeping": False}}]}
    (engine,) = GateResult.from_json(200, body).engines
    assert engine.requests is None and engine.has_work is None and engine.drained is None


@pytest.mark.parametrize(
    ("requests", "field"),
    [
        ({"running": -1, "waiting": 0}, "engines[0].requests.running must be a count"),
        ({"running": 1, "waiting": 1.5}, "requests.waiting must be a count (a whole number"),
        ({"running": True, "waiting": 0}, "requests.running must be a count"),
        ({"running": "3", "waiting": 0}, "got a string"),
        ({"running": 1}, "engines[0].requests must have both counts"),
        ([1, 0], "engines[0].requests must be a JSON object, got an array"),
        ("busy", "engines[0].requests must be a JSON object, got a string"),
    ],
)
def test_malformed_gate_requests_are_invalid(requests: Any, field: str) -> None:
    body = {"engines": [{"engine": "0", "ok": False, "requests": requests}]}
    with pytest.raises(InvalidAnswer) as bad:
        GateResult.from_json(412, body)
    assert field in str(bad.value)


def test_an_engine_s_activity() -> None:
    busy = {"has_work": True, "running": 3, "waiting": 2, "drained": False}
    idle = {"has_work": False, "running": None, "waiting": None, "drained": True}
    engines = [{**STATUS["engines"][0], "activity": busy}, {**STATUS["engines"][1]}]
    engines[1]["activity"] = idle
    status = Status.from_json({**STATUS, "engines": engines})
    one, two = status.engines
    assert (one.has_work, one.running, one.waiting, one.drained) == (True, 3, 2, False)
    assert one.requests == EngineRequests(3, 2)
    assert (two.has_work, two.running, two.waiting, two.drained) == (False, None, None, True)
    assert two.requests is None  # owner mode: has_work only, no published counts
    unknown = {"has_work": None, "running": None, "waiting": None, "drained": None}
    row = Status.from_json({**STATUS, "engines": [{**engines[0], "activity": unknown}]}).engine(0)
    assert (row.has_work, row.running, row.waiting, row.drained) == (None, None, None, None)


def test_an_older_exporter_s_status_has_no_activity() -> None:
    for engine in Status.from_json(STATUS).engines:  # no "activity" key at all
        assert (engine.has_work, engine.running, engine.waiting, engine.drained) == (
            None,
            None,
            None,
            None,
        )
        assert engine.requests is None
    nulled = Status.from_json({**STATUS, "engines": [{"engine": "0", "activity": None}]})
    assert nulled.engine(0).has_work is None


@pytest.mark.parametrize(
    ("activity", "field"),
    [
        ("busy", "engines[0].activity must be an object, got a string"),
        ([True, 1, 0], "engines[0].activity must be an object, got an array"),
        ({"has_work": "yes"}, "engines[0].activity.has_work must be a boolean"),
        ({"has_work": 1}, "engines[0].activity.has_work must be a boolean, got a number"),
        ({"drained": "false"}, "engines[0].activity.drained must be a boolean"),
        ({"running": -1}, "engines[0].activity.running must be a count"),
        ({"waiting": -3}, "activity.waiting must be a count (a whole number, 0 or more)"),
        ({"running": 2.5}, "activity.running must be a count"),
        ({"running": False}, "activity.running must be a count"),
        ({"waiting": "7"}, "activity.waiting must be a count"),
        ({"waiting": {"n": 1}}, "got an object"),
    ],
)
def test_malformed_activity_is_invalid(activity: Any, field: str) -> None:
    body = {**STATUS, "engines": [{**STATUS["engines"][0], "activity": activity}]}
    with pytest.raises(InvalidAnswer) as bad:
        Status.from_json(body)
    assert field in str(bad.value)


def test_drained_is_a_boolean_condition_checked_before_sending() -> None:
    assert with_drained({"paused": True}, None) == {"paused": True}
    assert with_drained(None, True) == {"drained": True}
    assert with_drained({"drained": "true"}, True) == {"drained": True}
    assert with_drained({"weight_version": "v1"}, False) == {
        "weight_version": "v1",
        "drained": False,
    }
    assert query(with_drained({}, False)) == {"drained": "false"}
    for bad in ("yes", 1, "true"):
        with pytest.raises(BadRequest, match="drained must be True, False or None"):
            with_drained({}, bad)  # type: ignore[arg-type]
    with pytest.raises(BadRequest, match="contradicts"):
        with_drained({"drained": False}, True)
