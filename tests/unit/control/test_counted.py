"""``CountedFleet`` (``exporter.control.counted``): every caller's fan-out is counted on the
way back, so ``vllm_dp_utility_calls_total`` cannot miss a path; "no such method" is not a
call outcome and a polled read of the wrong type counts as failed, while the caller still
sees every outcome as the client returned it."""

from __future__ import annotations

from typing import Any

from exporter.client.fake import FakeFleet
from exporter.client.fleet import Capabilities, EngineOutcome, Outcome
from exporter.control.counted import CountedFleet, countable
from exporter.metrics.stats import Stats

NO_METHOD = "Call to x method failed: 'EngineCoreProc' object has no attribute 'x'"


def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
    if engine == "0":
        return True
    if engine == "1":
        return EngineOutcome("1", Outcome.TIMEOUT, error="no reply")
    return EngineOutcome(engine, Outcome.FAILED, error=NO_METHOD, duration_s=0.002)


def counted(engines: tuple[str, ...] = ("0", "1", "2")) -> tuple[CountedFleet, FakeFleet, Stats]:
    inner, stats = FakeFleet(handler, engines=engines), Stats()
    return CountedFleet(inner, stats), inner, stats


async def test_each_outcome_is_counted_and_returned_unchanged() -> None:
    fleet, _, stats = counted()
    outcomes = await fleet.call_utility("is_sleeping", timeout_s=1.0)
    assert [(o.engine, o.outcome) for o in outcomes] == [
        ("0", Outcome.OK),
        ("1", Outcome.TIMEOUT),
        ("2", Outcome.FAILED),  # the caller still sees the unsupported answer
    ]
    assert dict(stats.utility_calls) == {
        ("is_sleeping", "0", "ok"): 1,
        ("is_sleeping", "1", "timeout"): 1,
    }


async def test_durations_are_observed_for_round_trips_only() -> None:
    fleet, _, stats = counted()
    await fleet.call_utility("is_sleeping", timeout_s=1.0)
    child = stats.call_durations.labels("is_sleeping")
    assert sum(child.counts) == 1  # engine 0's answer; a timeout measured nothing
    assert child.total == 0.001


async def test_a_fan_out_of_only_unsupported_answers_changes_nothing() -> None:
    fleet, _, stats = counted(engines=("2", "3"))
    before = stats.generation
    outcomes = await fleet.call_utility("is_sleeping", timeout_s=1.0)
    assert len(outcomes) == 2
    assert not stats.utility_calls
    assert stats.generation == before  # no render is invalidated for nothing


def test_a_polled_read_of_the_wrong_type_counts_as_failed() -> None:
    outcomes = [
        EngineOutcome("0", Outcome.OK, "yes", duration_s=0.01),
        EngineOutcome("1", Outcome.OK, False, duration_s=0.01),
    ]
    kept = countable("is_sleeping", outcomes)
    assert [(o.engine, o.outcome) for o in kept] == [("0", Outcome.FAILED), ("1", Outcome.OK)]
    assert kept[0].error is not None and "'yes'" in kept[0].error
    # A method that is no polled invariant keeps its value as it is.
    assert countable("reset_prefix_cache", outcomes) == outcomes


async def test_engine_selection_goes_to_the_inner_client() -> None:
    fleet, inner, stats = counted()
    await fleet.call_utility("is_sleeping", timeout_s=1.0, engines=["0"])
    assert inner.calls == [("0", "is_sleeping", ())]
    assert set(stats.utility_calls) == {("is_sleeping", "0", "ok")}


async def test_the_rest_of_the_interface_is_the_inner_clients() -> None:
    inner = FakeFleet(handler, engines=("a", "b"), fake_capabilities=Capabilities(handshakes=True))
    fleet = CountedFleet(inner, Stats())
    assert fleet.engine_labels == ["a", "b"]
    assert fleet.capabilities.handshakes is True
    assert [d.engine for d in fleet.engine_details()] == ["a", "b"]
    await fleet.start()
    assert inner.started
    await fleet.close()
    assert inner.closed
