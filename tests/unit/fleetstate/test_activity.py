"""``exporter/fleetstate/activity.py``: ``--hung-after`` in effect and the routable verdict with
its reasons (pure; the poller's hung detection over real sockets is in
tests/integration/conformance/test_activity_conformance.py)."""

from __future__ import annotations

import dataclasses

from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.activity import hung_after_s, routability
from exporter.protocol.pushes import FaultStatus
from tests.harness.snapshots import engine_snapshot


def test_hung_after_is_the_setting_or_three_polls_never_below_the_call_timeout() -> None:
    assert hung_after_s(7.0, 5.0, 10.0) == 7.0
    assert hung_after_s(0.0, 5.0, 10.0) == 15.0
    assert hung_after_s(0.0, 1.0, 10.0) == 10.0


def test_an_awake_answering_rank_is_routable_with_no_reasons() -> None:
    verdict = routability(engine_snapshot("0", is_sleeping=False, is_scheduler_paused=False))
    assert verdict.routable and verdict.reasons == ()


def test_each_reason_a_rank_should_not_take_traffic() -> None:
    timeout = EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s")
    silent = routability(engine_snapshot("0", is_sleeping=timeout))
    assert not silent.routable and silent.reasons == ("no answer in the last poll (timeout)",)
    asleep = engine_snapshot("0", is_sleeping=True, is_scheduler_paused=False)
    assert routability(asleep).reasons == ("asleep",)
    paused = engine_snapshot("0", is_sleeping=True, is_scheduler_paused=True)
    assert routability(paused).reasons == ("paused",)
    hung = dataclasses.replace(
        engine_snapshot("0", is_sleeping=timeout), hung=True, unresponsive_s=42.4
    )
    assert routability(hung).reasons[0] == "hung: no answer for 42 s"
    disagree = EngineOutcome("rs", Outcome.INCONSISTENT, values=(False, True), error="...")
    split = routability(engine_snapshot("rs", is_sleeping=disagree))
    assert not split.routable and split.reasons == ("its ranks disagree (inconsistent)",)
    gone = engine_snapshot("0", EngineDetail("0", False, "x"), is_sleeping=timeout)
    assert routability(gone).reasons[0] == "disconnected"


def test_a_fault_tolerance_status_that_is_not_healthy_is_a_reason() -> None:
    for status, why in (("unhealthy", "E"), ("dead", None), ("unknown", "unreadable status: x")):
        ft = FaultStatus(status, why, 1.0)
        detail = EngineDetail("0", True, "x", fault_status=ft)
        verdict = routability(
            engine_snapshot("0", detail, is_sleeping=False, is_scheduler_paused=False)
        )
        info = f" ({why})" if why else ""
        assert verdict.reasons == (f"fault tolerance: {status}{info}",), verdict
    healthy = EngineDetail("0", True, "x", fault_status=FaultStatus("healthy", None, 1.0))
    assert routability(
        engine_snapshot("0", healthy, is_sleeping=False, is_scheduler_paused=False)
    ).routable
