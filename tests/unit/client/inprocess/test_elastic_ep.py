"""In-process mode's elastic-EP read (``exporter.client.inprocess.elastic_ep``) over a stub of
vLLM's engine client: it answers what vLLM's own route would (the status map, else the
process-local flag), and whatever vLLM raises or lacks is this read's problem, never an
exception into vLLM's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.client.inprocess.elastic_ep import LOCAL_TARGET, UNSUPPORTED, ElasticEpWatch
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.protocol.elastic_ep import ElasticEpRead
from tests.unit.client.inprocess.test_vllm_core import StubCore

WALL = 1.7e9


def watch_over(
    status: Callable[[], Any] | None, flag: Callable[[], Any] | None = None
) -> ElasticEpWatch:
    front_end = SimpleNamespace()
    if status is not None:
        front_end.get_external_elastic_ep_status = status
    core = VllmCore(StubCore(), front_end=front_end, scaling_flag=flag)
    return ElasticEpWatch(core, wall=lambda: WALL)


def returning(value: Any, delay_s: float = 0.0) -> Callable[[], Any]:
    async def status() -> Any:
        await asyncio.sleep(delay_s)
        if isinstance(value, BaseException):
            raise value
        return value

    return status


async def read(watch: ElasticEpWatch, timeout_s: float = 1.0) -> ElasticEpRead:
    watch.refresh(timeout_s)
    if watch._task is not None:
        await watch._task
    (found,) = watch.reads()
    return found


async def test_the_status_map_is_the_operation() -> None:
    watch = watch_over(returning({"phase": "preparing", "epoch": "7", "error": None}))
    assert watch.reads() == (ElasticEpRead(LOCAL_TARGET),)  # not asked yet
    found = await read(watch)
    assert found.operation is not None and found.problem is None
    assert (found.operation.phase, found.operation.epoch, found.operation.scaling) == (
        "preparing",
        "7",
        True,
    )
    assert found.read_at_unix == WALL and found.target == LOCAL_TARGET


@pytest.mark.parametrize(
    ("flag", "phase"),
    [(lambda: True, "committing"), (lambda: False, "idle"), (None, "idle")],
)
async def test_without_external_elastic_ep_the_local_flag_answers(
    flag: Callable[[], Any] | None, phase: str
) -> None:
    """As vLLM's route reads it: committing while set; no flag in this process: idle."""
    found = await read(watch_over(returning(None), flag))
    assert found.operation is not None and found.operation.phase == phase


async def test_a_flag_that_raises_is_an_unreadable_status() -> None:
    def broken() -> bool:
        raise RuntimeError("flag")

    found = await read(watch_over(returning(None), broken))
    assert found.operation is None
    assert found.problem == (
        "unreadable status from get_external_elastic_ep_status(): "
        "the process-local flag: RuntimeError"
    )


async def test_a_vllm_without_the_method_is_unsupported_and_not_asked_again() -> None:
    watch = watch_over(None)
    found = await read(watch)
    assert (found.supported, found.problem, found.operation) == (False, UNSUPPORTED, None)
    watch.refresh(1.0)
    assert watch._task is not None and watch._task.done()  # no new read started


@pytest.mark.parametrize(
    ("status", "problem"),
    [
        (
            returning(RuntimeError("store down")),
            "temporarily unavailable: RuntimeError: store down",
        ),
        (
            returning({"phase": "preparing"}, delay_s=5.0),
            "no answer from get_external_elastic_ep_status() within 0.05s",
        ),
        (returning(["not", "a", "map"]), "unreadable status from get_external_elastic_ep_status()"),
    ],
)
async def test_failures_are_the_reads_problem_never_the_last_operation(
    status: Callable[[], Any], problem: str
) -> None:
    calls = {"n": 0}

    async def first_good_then(*_: Any) -> Any:
        calls["n"] += 1
        return {"phase": "idle"} if calls["n"] == 1 else await status()

    watch = watch_over(first_good_then)
    assert (await read(watch, 0.05)).operation is not None
    found = await read(watch, 0.05)
    assert found.operation is None and found.supported
    assert found.problem is not None and found.problem.startswith(problem)


async def test_one_read_at_a_time_and_close_cancels_it() -> None:
    asked = {"n": 0}

    async def slow() -> Any:
        asked["n"] += 1
        await asyncio.sleep(10)

    watch = watch_over(slow)
    watch.refresh(30.0)
    task = watch._task
    await asyncio.sleep(0)
    watch.refresh(30.0)
    await asyncio.sleep(0)
    assert watch._task is task and asked["n"] == 1
    watch.close()
    assert task is not None
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and watch._task is None
