"""``supervise``, ``watch`` and ``cancel_and_wait`` on the test's event loop (no sockets): a
failure is counted and restarted with a growing delay, a clean end or a cancellation is not a
failure, and a clean hour forgives earlier failures."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.base.tasks import cancel_and_wait, supervise, watch


@contextmanager
def recorded_sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The supervisor's restart delays, recorded; each sleep only yields once."""
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        delays.append(delay)
        await real_sleep(0)

    with monkeypatch.context() as patch:
        patch.setattr(asyncio, "sleep", sleep)  # as the supervisor calls it
        yield delays


async def test_a_failing_loop_is_restarted_with_growing_delays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    faults = ProtocolErrorTally()
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 5:
            raise RuntimeError(f"failure {runs}")

    with recorded_sleeps(monkeypatch) as delays:
        await supervise("flaky", flaky, faults, delays_s=(1.0, 2.0, 3.0))
    assert runs == 6, "restarted until it returned"
    assert delays == [1.0, 2.0, 3.0, 3.0, 3.0], "the last delay repeats"
    assert faults.task_failures == {"flaky": 5}


async def test_a_clean_hour_resets_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's clock is moved by the run itself: the third run lasts over an hour."""
    faults = ProtocolErrorTally()
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    runs = 0

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            now[0] += 3601
        if runs <= 3:
            raise RuntimeError("boom")

    with recorded_sleeps(monkeypatch) as delays, monkeypatch.context() as patch:
        patch.setattr(loop, "time", lambda: now[0])
        await supervise("long", run, faults, delays_s=(0.1, 0.2, 0.3))
    assert delays == [0.1, 0.2, 0.1]


async def test_a_supervised_loop_can_be_cancelled_without_a_failure() -> None:
    faults = ProtocolErrorTally()
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = supervise("forever", forever, faults)
    assert task.get_name() == "forever"
    await started.wait()
    await cancel_and_wait(task)
    assert task.cancelled()
    assert faults.task_failures == {}


async def test_watch_counts_a_one_shot_tasks_failure_only() -> None:
    faults = ProtocolErrorTally()

    async def fail() -> None:
        raise ValueError("once")

    async def succeed() -> None:
        return None

    async def hang() -> None:
        await asyncio.Event().wait()

    failing, fine, hung = (asyncio.create_task(c) for c in (fail(), succeed(), hang()))
    for task, name in ((failing, "fail"), (fine, "fine"), (hung, "hung")):
        watch(task, name, faults)
    await asyncio.gather(failing, fine, return_exceptions=True)
    await cancel_and_wait(hung)
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert faults.task_failures == {"fail": 1}


async def test_cancel_and_wait_accepts_none_and_a_finished_task() -> None:
    await cancel_and_wait(None)

    async def done() -> int:
        return 1

    task = asyncio.create_task(done())
    await task
    await cancel_and_wait(task)  # nothing to cancel: no error
    assert task.result() == 1
