"""The reading a deployment's leader publishes and its followers build on (pure bytes and a
``FakeFleet``; the processes and files are in tests/integration/inprocess/test_one_reader.py)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.fleetread import ALL_METHODS, FleetRead
from exporter.control.sources import (
    BadReading,
    FollowerRead,
    PublishingRead,
    decode_reading,
)

NOW = 1_700_000_000.0
ENGINES = ("0", "1", "2")


def fleet(answers: dict[str, Any], lacking: str | None = None) -> FakeFleet:
    """Engines answering ``answers[method]``; engine 1 has no ``lacking`` method."""

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method == lacking and engine == "1":
            text = f"Call to {method} method failed: 'EngineCoreProc' object has no attribute"
            return EngineOutcome(engine, Outcome.FAILED, error=text)
        return answers.get(method)

    return FakeFleet(handler, engines=ENGINES)


AWAKE = {
    "is_sleeping": False,
    "is_scheduler_paused": False,
    "get_weight_version": "v1",
    "has_work": False,
}


async def leader_bytes(client: FakeFleet) -> tuple[PublishingRead, list[bytes]]:
    written: list[bytes] = []

    async def publish(data: bytes) -> None:
        written.append(data)

    leader = PublishingRead(FleetRead(client), publish, wall_clock=lambda: NOW)
    await leader.read(ALL_METHODS, 1.0, progress=True)
    return leader, written


async def test_a_follower_shows_the_leaders_answers_and_asks_nothing() -> None:
    _, written = await leader_bytes(fleet({**AWAKE, "is_sleeping": True}, lacking="has_work"))
    own = fleet(AWAKE)

    async def load() -> bytes:
        return written[-1]

    follower = FollowerRead(FleetRead(own), own, load, max_age_s=5.0, wall_clock=lambda: NOW + 1.0)
    reading = await follower.read(ALL_METHODS, 1.0)
    assert own.calls == []
    assert [(o.engine, o.value) for o in reading.outcomes["is_sleeping"]] == [
        (e, True) for e in ENGINES
    ]
    assert follower.unsupported_by("1") == frozenset({"has_work"})
    assert follower.unsupported_by("0") == frozenset()
    assert follower.describe() == {
        "role": "follower",
        "from": "api_server_0",
        "age_s": 1.0,
        "reason": None,
    }


async def test_a_stale_reading_makes_the_follower_ask_itself() -> None:
    _, written = await leader_bytes(fleet({**AWAKE, "is_sleeping": True}))
    own = fleet(AWAKE)

    async def load() -> bytes:
        return written[-1]

    follower = FollowerRead(FleetRead(own), own, load, max_age_s=5.0, wall_clock=lambda: NOW + 6.0)
    reading = await follower.read(ALL_METHODS, 1.0)
    assert [o.value for o in reading.outcomes["is_sleeping"]] == [False] * 3  # its own
    assert len(own.calls) == len(ENGINES) * len(ALL_METHODS)
    assert follower.describe()["from"] == "self"
    assert "6.0 s old" in follower.describe()["reason"]


async def test_an_engine_the_leader_did_not_read_is_failed_never_guessed() -> None:
    _, written = await leader_bytes(fleet(AWAKE))
    own = FakeFleet(lambda e, m, a: AWAKE.get(m), engines=(*ENGINES, "3"))

    async def load() -> bytes:
        return written[-1]

    follower = FollowerRead(FleetRead(own), own, load, max_age_s=5.0, wall_clock=lambda: NOW)
    reading = await follower.read(ALL_METHODS, 1.0)
    last = reading.outcomes["is_sleeping"][-1]
    assert (last.engine, last.outcome) == ("3", Outcome.FAILED)
    assert "not in the leader's reading" in (last.error or "")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "not a reading"),
        (b"[]", "not a reading"),
        (b'{"format": 1}', "not a reading"),
        (b"9" * 10_000, "not a reading"),
        (
            b'{"format":1,"written_unix":NaN,"api_server":0,"outcomes":{},"unsupported":{}}',
            "not a reading",
        ),
    ],
)
def test_bytes_that_are_no_reading_are_refused(data: bytes, reason: str) -> None:
    with pytest.raises(BadReading, match=reason):
        decode_reading(data, now_unix=NOW, max_age_s=5.0)


def test_an_infinite_time_is_refused() -> None:
    data = b'{"format":1,"written_unix":1e400,"api_server":0,"outcomes":{},"unsupported":{}}'
    with pytest.raises(BadReading):
        decode_reading(data, now_unix=NOW, max_age_s=5.0)
