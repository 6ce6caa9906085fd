"""``exporter/base/steps.py``: a generator of steps run at once (``run_steps``) or a step per
turn of the event loop (``run_steps_async``), both returning what the generator returns."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from exporter.base.steps import Steps, run_steps, run_steps_async


def counted(n: int, log: list[int]) -> Steps[str]:
    """``n`` steps, each logged before its yield; returns a value that says how many ran."""
    for i in range(n):
        log.append(i)
        yield
    return f"done after {len(log)}"


def test_run_steps_runs_every_step_and_returns_the_value() -> None:
    log: list[int] = []
    assert run_steps(counted(5, log)) == "done after 5"
    assert log == [0, 1, 2, 3, 4]


def test_run_steps_of_a_generator_that_never_yields_returns_its_value() -> None:
    log: list[int] = []
    assert run_steps(counted(0, log)) == "done after 0"
    assert log == []


async def test_run_steps_async_runs_every_step_and_returns_the_value() -> None:
    log: list[int] = []
    assert await run_steps_async(counted(5, log)) == "done after 5"
    assert log == [0, 1, 2, 3, 4]


async def test_run_steps_async_of_a_generator_that_never_yields_returns_its_value() -> None:
    assert await run_steps_async(counted(0, [])) == "done after 0"


async def test_run_steps_async_gives_the_loop_a_turn_between_steps() -> None:
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    def watching(n: int) -> Steps[list[int]]:
        for _ in range(n):
            seen.append(turns)
            yield
        seen.append(turns)
        return seen

    task = asyncio.create_task(other())
    await asyncio.sleep(0)  # the other task is running
    try:
        result = await run_steps_async(watching(6))
    finally:
        task.cancel()
    assert result is seen and len(seen) == 7
    # Between every two steps the other task ran at least once.
    assert all(b > a for a, b in itertools.pairwise(seen)), seen


async def test_run_steps_never_gives_the_loop_a_turn() -> None:
    """The plain form is one stretch of work: the same other task never runs in it."""
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    def watching(n: int) -> Steps[None]:
        for _ in range(n):
            seen.append(turns)
            yield
        seen.append(turns)

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    try:
        run_steps(watching(6))
    finally:
        task.cancel()
    assert len(set(seen)) == 1, seen


class Boom(Exception):
    pass


def failing(after: int, log: list[int]) -> Steps[int]:
    for i in range(after):
        log.append(i)
        yield
    raise Boom(f"failed after {after} steps")


def test_an_exception_in_the_generator_propagates_from_run_steps() -> None:
    log: list[int] = []
    with pytest.raises(Boom, match="failed after 3 steps"):
        run_steps(failing(3, log))
    assert log == [0, 1, 2]


async def test_an_exception_in_the_generator_propagates_from_run_steps_async() -> None:
    log: list[int] = []
    with pytest.raises(Boom, match="failed after 3 steps"):
        await run_steps_async(failing(3, log))
    assert log == [0, 1, 2]


async def test_an_exception_before_the_first_yield_propagates_from_run_steps_async() -> None:
    with pytest.raises(Boom, match="failed after 0 steps"):
        await run_steps_async(failing(0, []))


async def test_a_cancelled_run_stops_between_steps() -> None:
    """A cancellation of the task running the steps lands at a turn between two steps: the
    generator is not run further."""
    log: list[int] = []
    started = asyncio.Event()

    def long(n: int) -> Steps[None]:
        for i in range(n):
            log.append(i)
            started.set()
            yield

    task = asyncio.create_task(run_steps_async(long(1000)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(log) < 1000
