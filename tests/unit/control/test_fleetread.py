"""``exporter/control/fleetread.py``: the one read of the fleet the poller and the gate share,
and its memory of what each engine said it does not have (over the in-memory ``FakeFleet``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.client.observe import PROGRESS, Observation, Observations
from exporter.control.fleetread import ALL_METHODS, KNOWN_UNSUPPORTED, FleetRead
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.pushes import FaultStatus
from tests.harness.fakefleets import HeldFleet, ReportingFleet, awake

ENGINES = ("0", "1")
VERSION = "get_weight_version"


def older_vllm_on(engine: str) -> ReportingFleet:
    """Engines awake at v1; ``engine`` has no ``get_weight_version``."""
    values = awake(ENGINES)
    del values[engine][VERSION]
    return ReportingFleet(answers(values), engines=ENGINES)


def asked(fleet: ReportingFleet, method: str) -> list[str]:
    return [engine for engine, m, _ in fleet.calls if m == method]


async def test_an_engine_that_said_it_lacks_a_method_is_not_asked_again() -> None:
    fleet = older_vllm_on("1")
    read = FleetRead(fleet)
    await read.read({VERSION}, 1.0)
    assert read.unsupported_by("1") == {VERSION} and read.unsupported_by("0") == set()
    results = (await read.read({VERSION}, 1.0)).outcomes
    assert asked(fleet, VERSION) == ["0", "1", "0"]
    by_engine = {o.engine: o for o in results[VERSION]}
    assert by_engine["0"].outcome is Outcome.OK and by_engine["0"].value == "v1"
    said = by_engine["1"]
    assert said.outcome is Outcome.FAILED and said.error == KNOWN_UNSUPPORTED
    assert is_unsupported(said)  # read as unsupported by the poller and the gate alike


async def test_an_engine_that_handshook_again_is_asked_everything_again() -> None:
    fleet = older_vllm_on("1")
    read = FleetRead(fleet)
    await read.read({VERSION}, 1.0)
    fleet.handler = answers(awake(ENGINES, version="v2"))  # restarted on a newer vLLM
    fleet.handshakes["1"] = 2
    results = (await read.read({VERSION}, 1.0)).outcomes
    assert asked(fleet, VERSION) == ["0", "1", "0", "1"]
    assert [o.value for o in results[VERSION]] == ["v2", "v2"]
    assert read.unsupported_by("1") == set()


async def test_an_engine_that_left_is_forgotten() -> None:
    fleet = older_vllm_on("1")
    read = FleetRead(fleet)
    await read.read({VERSION}, 1.0)
    assert read.unsupported_everywhere(VERSION, ["1"])
    fleet.engines = ("0",)  # rank 1 left the fleet
    await read.read({VERSION}, 1.0)
    assert read.unsupported_by("1") == set()
    assert not read.unsupported_everywhere(VERSION, ["1"])


async def test_unsupported_everywhere_needs_every_engine_and_at_least_one() -> None:
    fleet = older_vllm_on("1")
    read = FleetRead(fleet)
    await read.read({VERSION, "is_sleeping"}, 1.0)
    assert read.unsupported_everywhere(VERSION, ["1"])
    assert not read.unsupported_everywhere(VERSION, ["0", "1"])
    assert not read.unsupported_everywhere(VERSION, [])
    assert not read.unsupported_everywhere("is_sleeping", ["1"])


async def test_only_the_methods_asked_that_the_mode_supports_are_read() -> None:
    fleet = older_vllm_on("1")
    fleet.unsupported = frozenset({"is_scheduler_paused"})
    read = FleetRead(fleet)
    results = (await read.read({"is_sleeping", "is_scheduler_paused"}, 1.0)).outcomes
    assert set(results) == {"is_sleeping"}
    assert {m for _, m, _ in fleet.calls} == {"is_sleeping"}


async def test_answers_of_the_wrong_type_are_failed_reads() -> None:
    values = awake(ENGINES, changed={"1": {"is_sleeping": "yes"}})
    fleet = ReportingFleet(answers(values), engines=ENGINES)
    results = (await FleetRead(fleet).read({"is_sleeping"}, 1.0)).outcomes
    ok, odd = results["is_sleeping"]
    assert ok.outcome is Outcome.OK and ok.value is False
    assert odd.outcome is Outcome.FAILED and odd.error == "expected a boolean, got 'yes'"


async def test_a_reading_carries_the_details_the_fan_out_left() -> None:
    """What the fan-out learnt (here: a fault status pushed while the calls were out) is in
    the reading, read once after the calls, for the engines the read asked."""
    fleet = older_vllm_on("1")
    pushed = dict(fleet.fault_status)
    handler = fleet.handler

    def answering(engine: str, method: str, args: tuple[object, ...]) -> object:
        if engine == "1":
            fleet.fault_status["1"] = FaultStatus("unhealthy", "nccl timeout", 1.0)
        return handler(engine, method, args)

    fleet.handler = answering
    reading = await FleetRead(fleet).read({"is_sleeping"}, 1.0)
    assert pushed == {} and reading.engines == ENGINES
    assert reading.details["1"].fault_status == FaultStatus("unhealthy", "nccl timeout", 1.0)
    assert reading.details["0"].fault_status is None
    assert reading.known_after == ENGINES


async def test_progress_is_read_only_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll reads each engine's progress with its fan-out; a gate decides without it."""
    fleet = older_vllm_on("1")
    asked: list[str] = []

    def source() -> list[Observation]:
        asked.append("read")
        return []

    board = Observations()
    board.add_source(PROGRESS, source)
    monkeypatch.setattr(ReportingFleet, "observations", property(lambda self: board))
    assert (await FleetRead(fleet).read({"is_sleeping"}, 1.0)).progress is None
    assert asked == []
    assert (await FleetRead(fleet).read({"is_sleeping"}, 1.0, progress=True)).progress == {}
    assert asked == ["read"]


@dataclass
class CountedDetails(HeldFleet):
    """A fleet that counts its details reads (its calls answer at once unless ``hold``)."""

    details_read: int = 0
    hold: bool = False

    def engine_details(self) -> list[EngineDetail]:
        self.details_read += 1
        return super().engine_details()

    async def call_utility(self, method: str, *args: Any, **kwargs: Any) -> list[EngineOutcome]:
        if not self.hold:
            return await FakeFleet.call_utility(self, method, *args, **kwargs)
        return await super().call_utility(method, *args, **kwargs)


FOUR = ("0", "1", "2", "3")


async def test_a_paced_polls_later_bursts_take_its_first_bursts_details() -> None:
    """Details are read before the first burst and after the last: not around every burst
    (256 engines' details 17 times a poll). Any other read reads them afresh, and so does
    the burst after it."""
    fleet = CountedDetails(answers(awake(FOUR)), engines=FOUR)
    read = FleetRead(fleet)
    await read.read(ALL_METHODS, 1.0, engines=("0",))
    await read.read(ALL_METHODS, 1.0, engines=("1",))
    assert fleet.details_read == 1
    assert {e for e, _, _ in fleet.calls} == {"0", "1"}  # each burst asked its own engines
    last = await read.read(ALL_METHODS, 1.0, engines=("2", "3"), progress=True)
    assert fleet.details_read == 2 and set(last.details) == set(FOUR)
    await read.read(ALL_METHODS, 1.0, engines=("0",))  # the next poll's first burst
    assert fleet.details_read == 3
    await read.read({VERSION}, 1.0)  # a gate's read between bursts: before and after it
    assert fleet.details_read == 5
    await read.read(ALL_METHODS, 1.0, engines=("1",))  # and the burst after it: afresh
    assert fleet.details_read == 6


async def test_an_engine_that_restarts_between_bursts_is_asked_again_from_the_next_poll() -> None:
    """The last burst takes the first's details: a restart between them is in the reading's
    details (read after the last burst) at once, and its engine is asked everything again
    from the next poll on."""
    fleet = older_vllm_on("1")
    read = FleetRead(fleet)
    await read.read(ALL_METHODS, 1.0, engines=("0",))
    await read.read(ALL_METHODS, 1.0, engines=("1",), progress=True)
    assert read.unsupported_by("1") == {VERSION}
    await read.read(ALL_METHODS, 1.0, engines=("0",))  # the next poll's first burst
    fleet.handler = answers(awake(ENGINES, version="v2"))  # rank 1 restarted, newer vLLM
    fleet.handshakes["1"] = 2
    last = await read.read(ALL_METHODS, 1.0, engines=("1",), progress=True)
    assert last.details["1"].handshakes == 2  # seen by the read after the last burst
    assert asked(fleet, VERSION) == ["0", "1", "0"]  # not asked again in this poll
    await read.read(ALL_METHODS, 1.0, engines=("0",))
    last = await read.read(ALL_METHODS, 1.0, engines=("1",), progress=True)
    assert asked(fleet, VERSION) == ["0", "1", "0", "0", "1"]
    assert [o.value for o in last.outcomes[VERSION]] == ["v2"]
    assert read.unsupported_by("1") == set()


@dataclass
class TurnsFleet(FakeFleet):
    """A ``FakeFleet`` that notes the loop turn (``turn``, moved by the test) each call began."""

    turn: int = 0
    began: list[tuple[str, int]] = field(default_factory=list)

    async def call_utility(self, method: str, *args: Any, **kwargs: Any) -> list[EngineOutcome]:
        self.began.append((method, self.turn))
        return await super().call_utility(method, *args, **kwargs)


async def test_a_reads_methods_are_sent_a_loop_turn_apart() -> None:
    """In-process mode sends on vLLM's loop: each method of a burst in its own turn."""
    fleet = TurnsFleet(answers(awake(FOUR)), engines=FOUR)
    ticking = True

    async def tick() -> None:
        while ticking:
            fleet.turn += 1
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(tick())
    reading = await FleetRead(fleet).read(ALL_METHODS, 1.0, engines=("1", "2"))
    ticking = False
    await ticker
    turns = [turn for _, turn in fleet.began]
    assert len(fleet.began) == len(reading.outcomes) >= 3
    assert turns == sorted(set(turns)), fleet.began  # one turn each, in the asked order
    assert all(len(o) == 2 for o in reading.outcomes.values())


async def test_a_burst_cut_short_leaves_no_details_to_the_next_poll() -> None:
    fleet = CountedDetails(answers(awake(FOUR)), engines=FOUR, hold=True)
    read = FleetRead(fleet)
    burst = asyncio.ensure_future(read.read(ALL_METHODS, 1.0, engines=("0",)))
    await asyncio.wait_for(fleet.entered.wait(), 5)
    burst.cancel()  # the poller stopped mid-poll
    with pytest.raises(asyncio.CancelledError):
        await burst
    fleet.hold = False
    await read.read(ALL_METHODS, 1.0, engines=("1",))
    assert fleet.details_read == 2
