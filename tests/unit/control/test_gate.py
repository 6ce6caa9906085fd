"""``exporter/control/gate.py``: the conditions a query may set, the pure verdict over a sample,
and the ``Gate``'s fresh fan-out (shared by concurrent callers, at most one per
``min_interval_s``) over the in-memory ``FakeFleet``. The verdict's failing-engine names, the
``healthy`` condition and the 501 of a condition no engine has are in
tests/unit/control/test_rl_semantics.py and tests/unit/protocol/test_pushes_and_unsupported.py."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import Capabilities, EngineDetail, EngineOutcome, Outcome
from exporter.control.gate import (
    ALL_METHODS,
    Gate,
    GateRequestError,
    Sample,
    evaluate,
    needed_methods,
    parse_conditions,
)
from exporter.control.poller import Poller
from exporter.metrics.stats import Stats
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FaultStatus
from tests.harness.clock import ManualClock
from tests.harness.fakefleets import HeldFleet, ReportingFleet, awake, fleet_of
from tests.harness.gatesample import gate_sample

ENGINES = ("0", "1")
NO_ATTR = "Call to {m} method failed: 'EngineCoreProc' object has no attribute '{m}'"


def gate_over(fleet: Any, clock: ManualClock | None = None, **options: Any) -> Gate:
    """A gate on ``clock``, whose rate-bound waits move that clock (and take no real time)."""
    options.setdefault("min_interval_s", 1.0)
    moved = clock or ManualClock()

    async def sleep(seconds: float) -> None:
        moved.now += seconds
        await asyncio.sleep(0)

    return Gate(
        fleet, timeout_s=1.0, clock=moved, wall_clock=lambda: 5000.0, sleep=sleep, **options
    )


def methods_called(fleet: Any) -> set[str]:
    return {method for _, method, _ in fleet.calls}


# -- conditions -------------------------------------------------------------------------------


def test_boolean_conditions_take_any_case_and_versions_are_bounded() -> None:
    parsed = parse_conditions({"sleeping": ["TRUE"], "paused": ["0"], "healthy": ["1"]})
    assert parsed == {"sleeping": True, "paused": False, "healthy": True}
    assert parse_conditions({"weight_version": ["v" * 256]}) == {"weight_version": "v" * 256}
    with pytest.raises(GateRequestError, match="1-256 characters"):
        parse_conditions({"weight_version": ["v" * 257]})


@pytest.mark.parametrize("bad", ["yes", "", "2", "true ", "\u0661"])
def test_inference_ready_is_a_boolean_like_every_other_state_condition(bad: str) -> None:
    assert parse_conditions({"inference_ready": ["True"]}) == {"inference_ready": True}
    with pytest.raises(GateRequestError, match="'inference_ready' must be true, false, 1 or 0"):
        parse_conditions({"inference_ready": [bad]})
    with pytest.raises(GateRequestError, match="given more than once"):
        parse_conditions({"inference_ready": ["true", "true"]})
    wanted = needed_methods({"inference_ready": True})
    assert wanted == frozenset({"is_sleeping", "is_inference_ready"})


@pytest.mark.parametrize(
    ("conditions", "methods"),
    [
        ({}, None),
        ({"healthy": True}, {"is_sleeping"}),
        ({"sleeping": False}, {"is_sleeping"}),
        ({"paused": False}, {"is_sleeping", "is_scheduler_paused"}),
        ({"weight_version": "v1", "healthy": True}, {"is_sleeping", "get_weight_version"}),
    ],
)
def test_conditions_need_is_sleeping_and_their_own_methods(
    conditions: dict[str, Any], methods: set[str] | None
) -> None:
    assert needed_methods(conditions) == (None if methods is None else frozenset(methods))


# -- the verdict ------------------------------------------------------------------------------


def test_every_engine_must_answer_is_sleeping_even_without_conditions() -> None:
    timeout = EngineOutcome("1", Outcome.TIMEOUT, error="no reply within 1s")
    status, body = evaluate(
        {}, gate_sample({"0": {"is_sleeping": True}, "1": {"is_sleeping": timeout}}), 0.0
    )
    assert status == 412 and body["failing_engines"] == ["1"]
    assert body["engines"][1]["failures"] == ["sleeping: timeout (no reply within 1s)"]
    first = body["engines"][0]
    assert (first["engine"], first["ok"], first["failures"]) == ("0", True, [])
    assert first["values"] == {"sleeping": True}


def test_a_sample_without_engines_is_never_ok() -> None:
    status, body = evaluate({"sleeping": False}, gate_sample({}), 0.0)
    assert status == 412 and body["ok"] is False and body["engines"] == []


def test_a_failed_read_names_its_error_and_an_unsupported_one_says_so() -> None:
    sample = gate_sample(
        {
            "0": {
                "is_sleeping": False,
                "get_weight_version": EngineOutcome("0", Outcome.FAILED, error="boom"),
            },
            "1": {
                "is_sleeping": False,
                "get_weight_version": EngineOutcome(
                    "1", Outcome.FAILED, error=NO_ATTR.format(m="get_weight_version")
                ),
            },
        }
    )
    status, body = evaluate({"weight_version": "v1"}, sample, 0.0)
    assert status == 412
    failures = [e["failures"] for e in body["engines"]]
    assert failures == [
        ["weight_version: failed (boom)"],
        ["weight_version: unsupported by this engine"],
    ]


def test_healthy_false_is_met_only_by_a_faulty_rank() -> None:
    statuses = {"0": FaultStatus("dead", None, 1.0)}
    sample = gate_sample({"0": {"is_sleeping": False}, "1": {"is_sleeping": False}}, statuses)
    status, body = evaluate({"healthy": False}, sample, 0.0)
    assert status == 412 and body["failing_engines"] == ["1"]
    assert [e["values"]["healthy"] for e in body["engines"]] == [False, True]
    assert body["engines"][1]["failures"] == [
        "healthy: fault tolerance reports healthy, expected healthy=False"
    ]


def test_the_age_of_a_sample_is_never_negative() -> None:
    sample = gate_sample({"0": {"is_sleeping": False}})  # taken at 0.0
    assert evaluate({}, sample, 2.5)[1]["age_s"] == 2.5
    assert evaluate({}, sample, -1.0)[1]["age_s"] == 0.0


# -- the shared fan-out -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conditions", "methods"),
    [
        ({}, set(ALL_METHODS)),
        ({"healthy": True}, {"is_sleeping"}),
        ({"paused": False}, {"is_sleeping", "is_scheduler_paused"}),
    ],
)
async def test_the_gate_asks_only_what_its_conditions_need(
    conditions: dict[str, Any], methods: set[str]
) -> None:
    fleet = fleet_of(awake(ENGINES))
    status, _ = await gate_over(fleet).check(conditions)
    assert status == 200
    assert methods_called(fleet) == methods


async def test_callers_arriving_during_a_fan_out_share_it() -> None:
    fleet = fleet_of(awake(ENGINES))
    gate = gate_over(fleet)
    first, second, third = await asyncio.gather(gate.sample(), gate.sample(), gate.sample())
    assert first is second is third
    assert gate.fanouts == 1
    assert len(fleet.calls) == len(ENGINES) * len(ALL_METHODS)


async def test_callers_arriving_together_share_one_fan_out_of_what_they_all_want() -> None:
    clock = ManualClock()
    gate = gate_over(fleet_of(awake(ENGINES)), clock)
    small, everything = await asyncio.gather(gate.sample(frozenset({"is_sleeping"})), gate.sample())
    assert gate.fanouts == 1 and small is everything and everything.asked == ALL_METHODS
    gate.invalidate()
    clock.now += 1.0  # past the rate bound: the next fan-out asks what its callers want
    paused, version = await asyncio.gather(
        gate.sample(frozenset({"is_scheduler_paused"})),
        gate.sample(frozenset({"get_weight_version"})),
    )
    assert gate.fanouts == 2 and paused is version
    assert paused.asked == {"is_sleeping", "is_scheduler_paused", "get_weight_version"}


async def test_a_caller_wanting_more_than_the_fan_out_in_flight_waits_for_the_next() -> None:
    fleet = HeldFleet(answers(awake(ENGINES)), engines=ENGINES)
    clock = ManualClock()
    gate = gate_over(fleet, clock, min_interval_s=1.0)
    small = asyncio.ensure_future(gate.sample(frozenset({"is_sleeping"})))
    await fleet.entered.wait()  # the narrow fan-out is in flight
    wider = asyncio.ensure_future(gate.sample(frozenset({"has_work"})))
    fleet.release.set()
    first, second = await asyncio.gather(small, wider)
    assert first.asked == {"is_sleeping"} and second is not first and gate.fanouts == 2
    # It waited for the rate bound (1 s of the gate's clock), and asks every read method.
    assert clock.now >= 101.0 and second.asked == ALL_METHODS


@pytest.mark.parametrize("min_interval_s", [0.2, 1.0])
async def test_alternating_conditions_get_at_most_one_fan_out_per_interval(
    min_interval_s: float,
) -> None:
    """Callers cycling ``drained``, ``weight_version``, ``paused``, ``sleeping`` one after the
    other cannot buy a fan-out each: over 10 intervals of the gate's clock, at most 11."""
    clock = ManualClock()
    fleet = fleet_of(awake(ENGINES))
    gate = gate_over(fleet, clock, min_interval_s=min_interval_s)
    cycle: list[dict[str, Any]] = [
        {"drained": True},
        {"weight_version": "v1"},
        {"paused": False},
        {"sleeping": False},
    ]
    start, asked = clock.now, 0
    while clock.now - start < 10 * min_interval_s:
        await gate.check(cycle[asked % len(cycle)])
        asked += 1
        clock.now += min_interval_s / 7  # callers far faster than the bound
    assert asked >= 30
    assert gate.fanouts <= 11, gate.fanouts
    assert len(fleet.calls) <= 11 * len(ENGINES) * len(ALL_METHODS)


async def test_a_sample_serves_min_interval_then_a_fresh_fan_out_is_taken() -> None:
    clock = ManualClock()
    gate = gate_over(fleet_of(awake(ENGINES)), clock, min_interval_s=1.0)
    first = await gate.sample()
    clock.now += 0.999
    assert await gate.sample() is first
    assert gate.fanouts == 1
    clock.now += 0.001
    assert await gate.sample() is not first
    assert gate.fanouts == 2


async def test_a_sample_of_fewer_methods_is_not_reused_for_a_caller_wanting_more() -> None:
    clock = ManualClock()
    gate = gate_over(fleet_of(awake(ENGINES)), clock)
    first = await gate.sample(frozenset({"is_sleeping"}))
    clock.now += 1.0  # past the rate bound: the next fan-out asks what its caller wants
    sample = await gate.sample(frozenset({"get_weight_version"}))
    assert gate.fanouts == 2 and sample is not first
    assert sample.asked == {"is_sleeping", "get_weight_version"}
    assert await gate.sample(frozenset({"is_sleeping"})) is sample  # asks less: shared
    assert gate.fanouts == 2


async def test_a_reused_sample_reports_its_age_and_when_it_was_taken() -> None:
    clock = ManualClock(100.0)
    gate = gate_over(fleet_of(awake(ENGINES)), clock)
    await gate.check({})
    clock.now = 100.25
    status, body = await gate.check({})
    assert status == 200 and gate.fanouts == 1
    assert body["age_s"] == 0.25 and body["checked_at_unix"] == 5000.0


async def test_after_invalidate_no_caller_gets_a_fan_out_started_before_it() -> None:
    fleet = HeldFleet(answers(awake(ENGINES)), engines=ENGINES)
    gate = gate_over(fleet)
    before = asyncio.ensure_future(gate.sample())
    await fleet.entered.wait()  # the first fan-out is in flight
    gate.invalidate()  # an admin action changed the state
    after = asyncio.ensure_future(gate.sample())
    fleet.release.set()
    old, new = await asyncio.gather(before, after)
    assert new is not old and gate.fanouts == 2
    assert await gate.sample() is new  # and the fresh one is what later callers share


async def test_one_caller_hanging_up_does_not_cancel_the_fan_out_others_wait_for() -> None:
    fleet = HeldFleet(answers(awake(ENGINES)), engines=ENGINES)
    gate = gate_over(fleet)
    leaving = asyncio.ensure_future(gate.check({}))
    staying = asyncio.ensure_future(gate.check({}))
    await fleet.entered.wait()
    leaving.cancel()
    fleet.release.set()
    status, body = await staying
    assert status == 200 and body["ok"] is True and gate.fanouts == 1
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_no_engine_connected_is_503_and_nobody_is_asked() -> None:
    fleet = fleet_of(awake(ENGINES), disconnected={"0", "1"})
    gate = gate_over(fleet)
    status, body = await gate.check({"sleeping": False})
    assert status == 503 and body["error"] == "no engine is connected"
    assert body["failing_engines"] == ["0", "1"] and body["conditions"] == {"sleeping": False}
    assert gate.fanouts == 0 and fleet.calls == []


async def test_a_method_the_attach_mode_does_not_ask_makes_its_condition_unsupported() -> None:
    fleet = fleet_of(awake(ENGINES), unsupported=frozenset({"is_scheduler_paused"}))
    status, body = await gate_over(fleet).check({"paused": False})
    assert status == 501 and body["unsupported"] == ["paused"]
    assert body["engines"][0]["failures"] == ["paused: not available in this attach mode"]
    assert "is_scheduler_paused" not in methods_called(fleet)


async def test_healthy_reads_what_engines_pushed_where_the_mode_can_know() -> None:
    fleet = ReportingFleet(answers(awake(ENGINES)), engines=ENGINES)
    gate = gate_over(fleet, min_interval_s=0.0)
    assert (await gate.check({"healthy": True}))[0] == 200  # no engine reported: healthy
    fleet.fault_status["1"] = FaultStatus("unhealthy", "RuntimeError", 1.0)
    status, body = await gate.check({"healthy": True})
    assert status == 412 and body["failing_engines"] == ["1"]
    blind = ReportingFleet(
        answers(awake(ENGINES)), engines=ENGINES, fake_capabilities=Capabilities()
    )
    blind.fault_status["1"] = FaultStatus("dead", None, 1.0)
    status, body = await gate_over(blind).check({"healthy": True})
    assert status == 501 and body["unsupported"] == ["healthy"]


async def test_the_gate_never_asks_what_the_poller_learnt_an_engine_lacks() -> None:
    values = awake(ENGINES)
    del values["1"]["get_weight_version"]  # engine 1 is an older vLLM
    fleet = fleet_of(values)
    poller = Poller(fleet, Stats(), interval_s=60.0, call_timeout_s=1.0)
    await poller.poll_once()
    asked_before = len(fleet.calls)
    status, body = await gate_over(fleet, reader=poller.reader).check({"weight_version": "v1"})
    assert ("1", "get_weight_version", ()) not in fleet.calls[asked_before:]
    assert ("0", "get_weight_version", ()) in fleet.calls[asked_before:]
    assert status == 412 and body["failing_engines"] == ["1"]
    assert body["engines"][1]["failures"] == ["weight_version: unsupported by this engine"]


# -- drained (has_work and the published request counts) --------------------------------------


@dataclass
class PublishingFleet(FakeFleet):
    """A ``FakeFleet`` of a mode that learns each rank's request counts (``requests``, set by
    the test), as in-process and HTTP mode do."""

    requests: dict[str, RequestCounts] = field(default_factory=dict)
    fake_capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(fault_status=True, request_counts=True)
    )

    def engine_details(self) -> list[EngineDetail]:
        return [
            dataclasses.replace(d, requests=self.requests.get(d.engine))
            for d in super().engine_details()
        ]


def drain_sample(
    has_work: dict[str, Any], requests: dict[str, RequestCounts] | None = None
) -> Sample:
    values = {e: {"is_sleeping": False, "has_work": v} for e, v in has_work.items()}
    return dataclasses.replace(gate_sample(values), requests=requests)


def test_drained_is_a_boolean_condition_given_once() -> None:
    assert parse_conditions({"drained": ["TRUE"]}) == {"drained": True}
    assert parse_conditions({"drained": ["0"], "sleeping": ["false"]}) == {
        "drained": False,
        "sleeping": False,
    }
    with pytest.raises(GateRequestError, match="must be true, false, 1 or 0, got 'maybe'"):
        parse_conditions({"drained": ["maybe"]})
    with pytest.raises(GateRequestError, match="given more than once"):
        parse_conditions({"drained": ["true", "true"]})
    with pytest.raises(GateRequestError, match=r"known: .*drained"):
        parse_conditions({"idle": ["true"]})
    assert needed_methods({"drained": True}) == frozenset({"is_sleeping", "has_work"})
    assert "has_work" in ALL_METHODS  # a gate without conditions reads it too


def test_drained_true_names_each_rank_with_work_and_its_counts() -> None:
    sample = drain_sample(
        {"0": False, "1": True, "2": False, "3": True},
        {"0": RequestCounts(0, 0), "1": RequestCounts(1, 0), "2": RequestCounts(2, 3)},
    )
    status, body = evaluate({"drained": True}, sample, 0.0)
    assert status == 412 and body["failing_engines"] == ["1", "2", "3"]
    failures = [e["failures"] for e in body["engines"]]
    assert failures == [
        [],
        ["drained: has work (running 1, waiting 0), expected drained=true"],
        [
            "drained: has_work false but requests published (running 2, waiting 3), "
            "expected drained=true"
        ],
        ["drained: has work, expected drained=true"],  # no counts known: none named
    ]
    assert [e["values"]["drained"] for e in body["engines"]] == [True, False, False, False]
    assert [e["requests"] for e in body["engines"]] == [
        {"running": 0, "waiting": 0},
        {"running": 1, "waiting": 0},
        {"running": 2, "waiting": 3},
        None,
    ]
    assert evaluate({"drained": True}, drain_sample({"0": False, "1": False}), 0.0)[0] == 200


def test_drained_false_is_met_only_by_ranks_with_work() -> None:
    sample = drain_sample({"0": True, "1": False}, {"1": RequestCounts(0, 0)})
    status, body = evaluate({"drained": False}, sample, 0.0)
    assert status == 412 and body["failing_engines"] == ["1"]
    assert body["engines"][1]["failures"] == ["drained: no work, expected drained=false"]
    busy = drain_sample({"0": True, "1": False}, {"1": RequestCounts(0, 1)})
    assert evaluate({"drained": False}, busy, 0.0)[0] == 200


def test_a_rank_whose_work_is_unknown_is_never_drained() -> None:
    sample = drain_sample(
        {
            "0": EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s"),
            "1": EngineOutcome("1", Outcome.FAILED, error="expected a boolean, got 'yes'"),
            "2": EngineOutcome("2", Outcome.FAILED, error=NO_ATTR.format(m="has_work")),
            "3": False,
        },
        {"0": RequestCounts(0, 0), "1": RequestCounts(0, 0)},  # idle counts prove nothing
    )
    for expected in (True, False):
        status, body = evaluate({"drained": expected}, sample, 0.0)
        assert status == 412 and body["failing_engines"][:3] == ["0", "1", "2"]
        assert [e["failures"] for e in body["engines"][:3]] == [
            ["drained: unknown, has_work: timeout (no reply within 1s)"],
            ["drained: unknown, has_work: failed (expected a boolean, got 'yes')"],
            ["drained: unknown, has_work: unsupported by this engine"],
        ]
        assert [e["values"]["drained"] for e in body["engines"]] == [None, None, None, True]


async def test_the_gate_reads_has_work_and_the_counts_the_mode_publishes() -> None:
    fleet = PublishingFleet(
        answers(awake(ENGINES, changed={"1": {"has_work": True}})), engines=ENGINES
    )
    fleet.requests["1"] = RequestCounts(1, 2)
    gate = gate_over(fleet, min_interval_s=0.0)
    status, body = await gate.check({"drained": True})
    assert methods_called(fleet) == {"is_sleeping", "has_work"}
    assert status == 412 and body["failing_engines"] == ["1"]
    assert body["engines"][1]["failures"] == [
        "drained: has work (running 1, waiting 2), expected drained=true"
    ]
    # has_work says no, the published counts say yes: not drained either.
    fleet.handler = answers(awake(ENGINES))
    status, body = await gate.check({"drained": True})
    assert status == 412 and "requests published" in body["engines"][1]["failures"][0]
    fleet.requests["1"] = RequestCounts(0, 0)
    status, body = await gate.check({"drained": True})
    assert status == 200 and body["engines"][1]["requests"] == {"running": 0, "waiting": 0}


async def test_a_hostile_has_work_answer_is_unknown_in_the_gate() -> None:
    for hostile in ("yes", 1, 0, None, [False], {"has_work": False}):
        fleet = fleet_of(awake(ENGINES, changed={"0": {"has_work": hostile}}))
        status, body = await gate_over(fleet).check({"drained": True})
        assert status == 412 and body["failing_engines"] == ["0"], hostile
        assert body["engines"][0]["failures"][0].startswith(
            "drained: unknown, has_work: failed (expected a boolean"
        )
        assert body["engines"][0]["requests"] is None  # this fake publishes no counts


async def test_drained_is_unsupported_only_when_no_rank_has_has_work() -> None:
    lacking = EngineOutcome("0", Outcome.FAILED, error=NO_ATTR.format(m="has_work"))
    status, body = evaluate({"drained": True}, drain_sample({"0": lacking}), 0.0)
    assert status == 501 and body["unsupported"] == ["drained"]
    assert "no engine supports drained" in body["error"]
    assert evaluate({"drained": True}, drain_sample({"0": lacking, "1": False}), 0.0)[0] == 412
    # An attach mode that does not ask has_work at all.
    fleet = fleet_of(awake(ENGINES), unsupported=frozenset({"has_work"}))
    status, body = await gate_over(fleet).check({"drained": True})
    assert status == 501 and body["unsupported"] == ["drained"]
    assert "has_work" not in methods_called(fleet)
    # Without conditions, has_work is shown beside the invariants; work is no failure.
    fleet = fleet_of(awake(ENGINES, changed={"0": {"has_work": True}}))
    status, body = await gate_over(fleet).check({})
    assert status == 200 and [e["values"]["has_work"] for e in body["engines"]] == [True, False]


async def test_an_admin_action_lifts_the_rate_bound_for_the_next_fan_out() -> None:
    """A question waiting for the bound (60 s here) gets its fan-out as soon as an action
    invalidates the gate: the RL script asks the gate right after setting the version."""
    clock = ManualClock()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(0)  # real time, the clock stands still: only invalidate frees it

    gate = Gate(
        fleet_of(awake(ENGINES)),
        timeout_s=1.0,
        min_interval_s=60.0,
        clock=clock,
        wall_clock=lambda: 5000.0,
        sleep=sleep,
    )
    await gate.sample(frozenset({"is_sleeping"}))
    waiting = asyncio.ensure_future(gate.sample(frozenset({"has_work"})))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done() and waits
    gate.invalidate()
    sample = await asyncio.wait_for(waiting, 5)
    assert gate.fanouts == 2 and "has_work" in sample.asked
    assert max(waits) <= 0.05  # it slept in short steps, so the lift was seen at once


def test_the_checkpoint_condition_takes_prepared_or_running_only() -> None:
    assert parse_conditions({"checkpoint": ["prepared"]}) == {"checkpoint": "prepared"}
    assert parse_conditions({"checkpoint": ["running"]}) == {"checkpoint": "running"}
    for bad in ("preparing", "PREPARED", "", "x" * 10_000):
        with pytest.raises(GateRequestError, match="prepared or running"):
            parse_conditions({"checkpoint": [bad]})
