"""The demo's story as a pure function of time: each window of the period, who lags, who
refuses, who waits behind the pause; ``run_story`` applying it until cancelled. (The story's
effect on an engine's state, its hung and fault windows: ``test_state.py``.)"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from exporter.sim.story import StoryState, run_story, story_state

PERIOD = 100.0  # a phase of 0.25 is t = 25.0


@pytest.mark.parametrize(
    ("t", "paused", "sleeping", "traffic"),
    [
        (0.0, False, False, True),
        (5.0, False, False, False),  # traffic stops before the pause: the fleet drains
        (10.0, True, False, False),
        (19.9, True, False, False),
        (25.0, False, False, True),
        (30.0, False, True, False),
        (64.9, False, True, False),
        (65.0, False, False, False),
        (70.0, False, False, True),
        (99.9, False, False, True),
    ],
)
def test_the_windows_of_a_period(t: float, paused: bool, sleeping: bool, traffic: bool) -> None:
    state = story_state(0, 3, t, PERIOD)
    assert (state.paused, state.sleeping, state.traffic) == (paused, sleeping, traffic)


def test_the_last_engine_lags_in_and_out_of_sleep() -> None:
    """The inconsistency window: the last of several engines sleeps 0.1 P later."""
    at = {t: [story_state(i, 3, t, PERIOD).sleeping for i in range(3)] for t in (35.0, 45.0, 70.0)}
    assert at == {35.0: [True, True, False], 45.0: [True] * 3, 70.0: [False, False, True]}
    assert story_state(0, 1, 35.0, PERIOD).sleeping, "a fleet of one has no laggard"
    assert not story_state(0, 1, 70.0, PERIOD).sleeping


def test_only_the_second_engine_refuses_resets_in_the_second_half() -> None:
    refusing = {
        (i, t)
        for i in range(3)
        for t in (10.0, 49.9, 50.0, 99.0)
        if story_state(i, 3, t, PERIOD).refuse_reset
    }
    assert refusing == {(1, 50.0), (1, 99.0)}


def test_one_request_waits_behind_the_pause_on_the_last_engine() -> None:
    queued = [
        t for t in (12.0, 14.0, 19.9, 20.0) if story_state(2, 3, t, PERIOD).queue_behind_pause
    ]
    assert queued == [14.0, 19.9]
    assert not story_state(0, 3, 15.0, PERIOD).queue_behind_pause


def test_the_story_repeats_every_period() -> None:
    for t in (3.0, 15.0, 40.0, 80.0, 90.0):
        assert story_state(1, 3, t, PERIOD) == story_state(1, 3, t + 5 * PERIOD, PERIOD)


def test_the_default_state_is_healthy_and_quiet() -> None:
    quiet = StoryState(paused=False, sleeping=False, refuse_reset=False)
    assert (quiet.fault, quiet.traffic, quiet.queue_behind_pause, quiet.hung) == (
        "healthy",
        False,
        False,
        False,
    )


async def test_run_story_applies_the_state_until_cancelled() -> None:
    """Without a fault reporter it only applies; the time it passes is the engine's clock."""
    applied: list[tuple[StoryState, float]] = []
    twice = asyncio.Event()

    def apply(story: StoryState, now: float) -> None:
        applied.append((story, now))
        if len(applied) >= 2:
            twice.set()

    task = asyncio.create_task(run_story(apply, 0, 2, 0.5))
    await asyncio.wait_for(twice.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    count = len(applied)
    await asyncio.sleep(0.03)
    assert len(applied) == count, "nothing applied once cancelled"
    assert all(isinstance(story, StoryState) for story, _ in applied)
    assert applied[1][1] > applied[0][1], "monotonic time, advancing"
