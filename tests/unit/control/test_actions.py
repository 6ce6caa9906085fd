"""``exporter/control/actions.py``'s read-back of an action that waits for the work
(``pause?mode=wait``, ``sleep?mode=wait``): ``has_work`` is read on every engine the call
reached, with each one's published counts; an engine still holding work is read again every
``DRAIN_RECHECK_S`` within the deadline and is ``unverified`` naming its work if it never
drains; an action that drops the work (``abort``) reads no ``has_work`` at all. Over the
in-memory ``FakeFleet``; the same over real sockets in every attach mode:
tests/integration/conformance/test_work_conformance.py."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fake import FakeFleet
from exporter.client.fleet import Capabilities, EngineDetail, EngineOutcome, Outcome
from exporter.control.actions import DRAIN_RECHECK_S, read_back, run_action
from exporter.control.parsing import parse_pause, parse_sleep
from exporter.protocol.activity import RequestCounts

ENGINES = ("0", "1", "2")
PAUSE_WAIT = parse_pause({"mode": ["wait"]}, b"")


@dataclass
class WorkFleet(FakeFleet):
    """Engines that pause as asked and answer ``has_work`` from ``busy_reads[engine]`` (how
    many ``has_work`` reads still find work: -1 forever), publishing ``requests``."""

    busy_reads: dict[str, int] = field(default_factory=dict)
    requests: dict[str, RequestCounts] = field(default_factory=dict)
    has_work_answer: dict[str, Any] = field(default_factory=dict)
    fake_capabilities: Capabilities = field(
        default_factory=lambda: Capabilities(fault_status=True, request_counts=True)
    )

    def __post_init__(self) -> None:
        self.handler = self._answer

    def _answer(self, engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method == "has_work":
            if engine in self.has_work_answer:
                return self.has_work_answer[engine]
            left = self.busy_reads.get(engine, 0)
            if left > 0:
                self.busy_reads[engine] = left - 1
            return left != 0
        if method in ("is_scheduler_paused", "is_sleeping"):
            return True
        return None

    def engine_details(self) -> list[EngineDetail]:
        return [
            dataclasses.replace(d, requests=self.requests.get(d.engine))
            for d in super().engine_details()
        ]

    def reads(self, method: str = "has_work") -> Counter[str]:
        return Counter(engine for engine, m, _ in self.calls if m == method)


def reasons(body: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    return [(e["engine"], e["reason"], e["error"]) for e in body["engines"]]


async def test_an_engine_that_drains_after_a_few_reads_is_verified() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, busy_reads={"1": 2})
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=10.0)
    assert run.status == 200 and run.body["success"], run.body
    assert fleet.reads() == Counter({"0": 1, "1": 3, "2": 1})  # only the busy one again
    assert fleet.reads("is_scheduler_paused") == Counter({"0": 1, "1": 1, "2": 1})


async def test_an_engine_that_never_drains_is_unverified_at_the_deadline() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, busy_reads={"2": -1})
    fleet.requests = {"0": RequestCounts(0, 0), "2": RequestCounts(0, 3)}
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=1.0)
    assert run.status == 502 and run.body["outcome"] == "partial_failure"
    assert reasons(run.body) == [
        (0, None, None),
        (1, None, None),
        (2, "unverified", "paused, but it still has work (running 0, waiting 3)"),
    ]
    assert run.body["engines"][2]["state"] is True  # paused all the same
    reads = fleet.reads()
    assert reads["0"] == reads["1"] == 1 and reads["2"] >= 2


async def test_counts_published_after_has_work_said_no_are_read_again() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES)
    fleet.requests = {"1": RequestCounts(1, 0)}
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=1.0)
    assert run.status == 502
    assert reasons(run.body)[1] == (
        1,
        "unverified",
        "paused, has_work is false but vLLM publishes requests (running 1, waiting 0)",
    )
    assert fleet.reads()["1"] >= 2


async def test_a_has_work_that_is_not_a_boolean_is_unverified_and_not_read_again() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, has_work_answer={"0": "yes", "2": 1})
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=1.0)
    assert [r[:2] for r in reasons(run.body)] == [(0, "unverified"), (1, None), (2, "unverified")]
    assert reasons(run.body)[0][2] == "could not read has_work: expected a boolean, got 'yes'"
    assert fleet.reads() == Counter({"0": 1, "1": 1, "2": 1})


async def test_an_engine_without_has_work_cannot_be_verified_drained() -> None:
    lacking = EngineOutcome(
        "1",
        Outcome.FAILED,
        error="Call to has_work method failed: 'EngineCoreProc' object has no attribute",
    )
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, has_work_answer={"1": lacking})
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=1.0)
    assert reasons(run.body)[1][:2] == (1, "unverified")
    assert "could not read has_work" in reasons(run.body)[1][2]


async def test_has_work_is_read_only_on_the_engines_the_call_reached() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, disconnected={"1"})
    run = await run_action(fleet, PAUSE_WAIT, timeout_s=1.0)
    assert [r[:2] for r in reasons(run.body)] == [(0, None), (1, "disconnected"), (2, None)]
    assert fleet.reads() == Counter({"0": 1, "2": 1})


async def test_an_action_that_drops_the_work_reads_no_has_work() -> None:
    for request in (
        parse_pause({}, b""),
        parse_pause({"mode": ["keep"]}, b""),
        parse_sleep({}, b""),
    ):
        fleet = WorkFleet(lambda *_: None, engines=ENGINES, busy_reads={"0": -1})
        run = await run_action(fleet, request, timeout_s=1.0)
        assert run.status == 200, (request.params, run.body)
        assert fleet.reads() == Counter(), request.params


async def test_sleep_wait_reads_is_sleeping_and_has_work_back() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, busy_reads={"0": 1})
    run = await run_action(fleet, parse_sleep({"mode": ["wait"]}, b""), timeout_s=10.0)
    assert run.status == 200, run.body
    assert fleet.reads() == Counter({"0": 2, "1": 1, "2": 1})
    assert fleet.reads("is_sleeping") == Counter({"0": 1, "1": 1, "2": 1})


async def test_the_read_back_of_no_engine_reads_nothing() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES)
    assert await read_back(fleet, PAUSE_WAIT, [], 1.0) == ({}, {})
    back, drain = await read_back(fleet, parse_pause({}, b""), ["0"], 1.0)
    assert set(back) == {"0"} and drain is None
    assert fleet.reads() == Counter()


async def test_a_deadline_shorter_than_a_recheck_reads_once() -> None:
    fleet = WorkFleet(lambda *_: None, engines=ENGINES, busy_reads={"0": -1})
    _, drain = await read_back(fleet, PAUSE_WAIT, list(ENGINES), DRAIN_RECHECK_S / 2)
    assert drain is not None and drain["0"][0].value is True
    assert fleet.reads() == Counter({"0": 1, "1": 1, "2": 1})
