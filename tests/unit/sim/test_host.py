"""Many simulated engines in one process: each engine's own options and place in the story of
a fleet that may span processes, and the exit code of a run (engines stubbed: nothing runs on
a socket)."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest

from exporter.sim.engine import SimEngine, SimStartupError
from exporter.sim.host import make_engines, serve_engines
from exporter.sim.options import SimOptions

ADDRESS = "tcp://127.0.0.1:1"


def test_each_engine_gets_a_copy_of_the_options_and_its_place_in_the_story() -> None:
    options = SimOptions(story_period_s=30.0, weight_version="w1")
    engines = make_engines(ADDRESS, [4, 5, 6], options)
    assert [e.engine_index for e in engines] == [4, 5, 6]
    assert [(e.options.story_offset, e.options.story_count) for e in engines] == [
        (0, 3),
        (1, 3),
        (2, 3),
    ]
    assert all(e.options.weight_version == "w1" for e in engines)
    engines[0].options.hang = True
    assert not engines[1].options.hang and not options.hang, "no engine shares its options"
    assert (options.story_offset, options.story_count) == (0, 1), "the caller's are untouched"


def test_a_process_holding_part_of_the_fleet_places_its_engines_in_the_whole() -> None:
    engines = make_engines(ADDRESS, [6, 7], SimOptions(), fleet_start=4, fleet_size=8)
    assert [(e.options.story_offset, e.options.story_count) for e in engines] == [(2, 8), (3, 8)]
    assert make_engines(ADDRESS, [], SimOptions()) == []


class StubEngine:
    """An engine whose run ends as the test says; ``stop`` is recorded."""

    def __init__(self, index: int, result: BaseException | str) -> None:
        self.engine_index = index
        self.result = result
        self.stopped = False

    async def run(self) -> str:
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def stop(self) -> None:
        self.stopped = True


async def serve(*engines: StubEngine) -> int:
    return await serve_engines(cast(Any, list(engines)), handle_signals=False)


async def test_every_engine_exiting_is_a_clean_exit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "exporter.sim")
    assert await serve(StubEngine(0, "stopped"), StubEngine(1, "exited")) == 0
    assert "engine 1 exited: exited" in caplog.messages


@pytest.mark.parametrize(
    ("failure", "logged"),
    [
        (SimStartupError("Did not receive response from front-end process"), "engine 1: Did not"),
        (RuntimeError("bug"), "engine 1 crashed: RuntimeError('bug')"),
    ],
)
async def test_one_failing_engine_fails_the_run(
    caplog: pytest.LogCaptureFixture, failure: BaseException, logged: str
) -> None:
    caplog.set_level(logging.ERROR, "exporter.sim")
    assert await serve(StubEngine(0, "stopped"), StubEngine(1, failure)) == 1
    assert any(m.startswith(logged) for m in caplog.messages)


def test_the_engines_are_sim_engines_on_the_given_address() -> None:
    (engine,) = make_engines(ADDRESS, [2], SimOptions())
    assert isinstance(engine, SimEngine)
    assert (engine.handshake_address, engine.context) == (ADDRESS, None)
