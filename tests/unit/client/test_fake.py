"""``FakeFleet`` keeps the promises of a real attach mode (the fast tier rests on it): one
outcome per engine in engine order, the allow-list, disconnected and closed engines never
called, engine strings bounded by the one rule."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import STOPPING, EngineOutcome, Outcome, connected_count
from exporter.error import MethodNotAllowed
from exporter.protocol.strings import MAX_ENGINE_STRING


def echo(engine: str, method: str, args: tuple[Any, ...]) -> Any:
    return f"{engine}:{method}:{args}"


async def test_one_outcome_per_engine_in_engine_order_and_only_those_asked() -> None:
    fleet = FakeFleet(echo, engines=("0", "1", "2"))
    outcomes = await fleet.call_utility("is_sleeping", timeout_s=1.0)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        (e, Outcome.OK, f"{e}:is_sleeping:()") for e in ("0", "1", "2")
    ]
    some = await fleet.call_utility("is_sleeping", timeout_s=1.0, engines={"2", "0"})
    assert [o.engine for o in some] == ["0", "2"]


async def test_the_allow_list_refuses_before_anything_is_called() -> None:
    fleet = FakeFleet(echo)
    with pytest.raises(MethodNotAllowed):
        await fleet.call_utility("shutdown", timeout_s=1.0)
    assert fleet.calls == []


async def test_disconnected_and_closed_engines_are_never_called() -> None:
    fleet = FakeFleet(echo, engines=("0", "1"), disconnected={"1"})
    outcomes = await fleet.call_utility("has_work", timeout_s=1.0)
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.DISCONNECTED]
    assert [c[0] for c in fleet.calls] == ["0"]
    assert connected_count(fleet) == 1
    assert [d.connected for d in fleet.engine_details()] == [True, False]
    await fleet.close()
    closed = await fleet.call_utility("has_work", timeout_s=1.0)
    assert {(o.outcome, o.error) for o in closed} == {(Outcome.DISCONNECTED, STOPPING)}
    assert len(fleet.calls) == 1


async def test_engine_strings_are_bounded_whatever_the_handler_returns() -> None:
    huge = "x" * (MAX_ENGINE_STRING * 10)

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if engine == "0":
            return huge
        return EngineOutcome(engine, Outcome.FAILED, error=huge)

    ok, failed = await FakeFleet(handler).call_utility("get_weight_version", timeout_s=1.0)
    assert len(ok.value.encode()) <= MAX_ENGINE_STRING + 64
    assert failed.error is not None and len(failed.error.encode()) <= MAX_ENGINE_STRING + 64


async def test_fixed_answers_fail_a_method_they_do_not_name() -> None:
    fleet = FakeFleet(answers({"0": {"is_sleeping": False}, "1": {"is_sleeping": True}}))
    outcomes = await fleet.call_utility("is_sleeping", timeout_s=1.0)
    assert [o.value for o in outcomes] == [False, True]
    missing = await fleet.call_utility("has_work", timeout_s=1.0)
    assert all(not o.ok for o in missing)


def test_its_methods_are_the_allow_list_less_what_the_test_made_unsupported() -> None:
    fleet = FakeFleet(echo, unsupported=frozenset({"has_work"}))
    assert "is_sleeping" in fleet.capabilities.methods
    assert "has_work" not in fleet.capabilities.methods
    assert "shutdown" not in fleet.capabilities.methods
