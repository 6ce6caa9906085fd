"""``exporter/fleetstate/snapshot.py``: what one poll learned, per engine and for the fleet
(pure): an engine's state from its answers, the fleet's fault-tolerance view, readiness."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.fleetstate.invariants import INVARIANTS, WEIGHT_VERSION
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot, empty_snapshot
from exporter.protocol.pushes import FaultStatus
from tests.harness.snapshots import engine_snapshot, polled

TIMEOUT = EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s")


def engine(name: str = "0", fault: FaultStatus | None = None, **answers: Any) -> EngineSnapshot:
    detail = EngineDetail(name, True, f"fake://{name}", fault_status=fault)
    return engine_snapshot(name, detail, **answers)


def fleet(
    *engines: EngineSnapshot, expected: int | None = None, connected: int | None = None
) -> FleetSnapshot:
    return polled(*engines, expected=expected, connected=connected)


@pytest.mark.parametrize(
    ("answers", "state"),
    [
        ({"is_sleeping": False, "is_scheduler_paused": False}, "awake"),
        ({"is_sleeping": True, "is_scheduler_paused": False}, "asleep"),
        ({"is_sleeping": True}, "asleep"),  # a vLLM without the paused query
        ({"is_sleeping": True, "is_scheduler_paused": True}, "paused"),
        ({"is_sleeping": TIMEOUT, "is_scheduler_paused": True}, "unknown"),
        ({"is_sleeping": "yes", "is_scheduler_paused": False}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_an_engines_state_comes_from_is_sleeping_then_paused(
    answers: dict[str, Any], state: str
) -> None:
    assert engine(**answers).state == state


def test_paused_and_the_weight_version_are_believed_only_from_an_engine_that_is_up() -> None:
    down = engine(is_sleeping=TIMEOUT, is_scheduler_paused=True, get_weight_version="v1")
    assert not down.up and down.paused is None and down.weight_version is None
    up = engine(is_sleeping=False, is_scheduler_paused=False, get_weight_version="v1")
    assert up.up and up.paused is False and up.weight_version == "v1"


def test_an_answer_of_the_wrong_type_is_not_known() -> None:
    e = engine(is_sleeping=False, get_weight_version=5)
    assert not e.known(WEIGHT_VERSION) and e.value(WEIGHT_VERSION) is None
    unversioned = engine(is_sleeping=False, get_weight_version=None)
    assert unversioned.known(WEIGHT_VERSION) and unversioned.weight_version is None


def test_a_method_no_poll_asked_is_unknown_for_the_fleet() -> None:
    snap = fleet(engine(is_sleeping=False))
    assert snap.paused.state is FleetState.UNKNOWN and snap.paused.method == "is_scheduler_paused"
    verdict = aggregate_consensus("is_sleeping", [EngineOutcome("0", Outcome.OK, False)])
    snap = FleetSnapshot(1.0, 0.0, (), {"is_sleeping": verdict}, 0, 0, 1)
    assert snap.sleeping is verdict


def test_faulty_ranks_are_unhealthy_dead_or_unknown_and_silence_is_healthy() -> None:
    snap = fleet(
        engine("0", FaultStatus("healthy", None, 1.0)),
        engine("1", FaultStatus("unhealthy", "E", 1.0)),
        engine("2", FaultStatus("dead", None, 1.0)),
        engine("3", FaultStatus("unknown", "unreadable status: x", 1.0)),
        engine("4"),
    )
    assert snap.faulty == ("1", "2", "3")
    assert snap.fault_reported == ("0", "1", "2", "3")


def test_ready_needs_every_expected_engine_connected_and_up() -> None:
    up = engine("0", is_sleeping=False)
    assert fleet(up, engine("1", is_sleeping=True)).ready
    assert not fleet(up, engine("1", is_sleeping=TIMEOUT)).ready
    assert not fleet(up, expected=2, connected=1).ready
    assert not fleet().ready  # no engine at all is never ready


def test_before_the_first_poll_every_invariant_and_engine_is_unknown() -> None:
    details = [EngineDetail("0", True, "a"), EngineDetail("1", False, "b")]
    snap = empty_snapshot(details, expected=3, connected=1, fault_tolerance_known=False)
    assert (snap.poll_number, snap.expected, snap.connected) == (0, 3, 1)
    assert set(snap.verdicts) == {inv.method for inv in INVARIANTS}
    assert {v.state for v in snap.verdicts.values()} == {FleetState.UNKNOWN}
    assert [e.state for e in snap.engines] == ["unknown", "unknown"]
    assert not snap.fault_tolerance_known and not snap.ready
