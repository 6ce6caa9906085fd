"""The gate (``gate``, ``wait`` with its progress callback and timeout) and ``/status``
through ``exporter.remote.Client``, against the real service with simulated engines."""

from __future__ import annotations

import asyncio
import time

import pytest

from exporter.remote import BadRequest, Client, GateResult, Progress, Status, WaitTimeout
from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS
from tests.harness.service import ServiceFactory
from tests.harness.waiting import eventually

RESUMED = {"weight_version": "v2", "sleeping": False, "paused": False}


async def test_a_closed_gate_names_what_fails(fleet: ServiceFactory) -> None:
    svc = await fleet(3, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    svc.engines[1].state.paused = True
    async with Client(svc.url, None) as dp:
        closed = await dp.gate(weight_version="v1", paused=False)
        assert (closed.ok, closed.status) == (False, 412)
        assert closed.conditions == {"weight_version": "v1", "paused": False}
        assert closed.failing_engines == ("1",) and [e.engine for e in closed.failing] == ["1"]
        assert closed.failing[0].failures == ("paused is True, expected False",)
        assert closed.engines[0].values["weight_version"] == "v1"
        assert closed.checked_at_unix is not None and closed.age_s is not None
        svc.engines[1].state.paused = False
        opened = await dp.gate(weight_version="v1", paused=False)
        assert opened.ok and opened.failing_engines == ()


async def test_wait_reports_progress_until_the_fleet_catches_up(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    seen: list[Progress] = []
    awaited: list[int] = []

    async def progress(p: Progress) -> None:  # an async callback is awaited
        seen.append(p)
        awaited.append(p.attempt)

    async with Client(svc.url, None) as dp:
        waiting = asyncio.create_task(dp.wait(RESUMED, 10, progress=progress, interval_s=0.1))
        await eventually(lambda: len(seen) >= 2, 5, "two closed gates reported")
        assert not waiting.done()
        for engine in svc.engines:
            engine.state.weight_version = "v2"
        opened = await asyncio.wait_for(waiting, 5)
    assert opened.ok and opened.conditions == RESUMED
    assert len(seen) >= 2 and awaited == [p.attempt for p in seen]
    assert [p.attempt for p in seen] == list(range(1, len(seen) + 1))
    first = seen[0]
    assert first.result is not None and first.result.status == 412 and first.error is None
    assert first.remaining_s <= 10 and first.elapsed_s >= 0
    assert "weight_version is 'v1', expected 'v2'" in first.summary


async def test_wait_times_out_with_the_last_answer(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    svc.engines[0].state.sleeping_tags = set(ALL_TAGS)
    calls: list[Progress] = []
    started = time.monotonic()
    async with Client(svc.url, None) as dp:
        with pytest.raises(WaitTimeout) as timed_out:
            await dp.wait(RESUMED, 0.6, progress=calls.append, interval_s=0.1)
    elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 3
    error = timed_out.value
    assert isinstance(error, TimeoutError) and error.last_error == "HTTP 412"
    assert error.last is not None and error.last.failing_engines == ("0", "1")
    assert str(error).startswith(
        "wait timed out after 0.6s for weight_version=v2 sleeping=false paused=false"
    )
    assert len(calls) >= 3


async def test_a_rejected_question_fails_at_once(fleet: ServiceFactory) -> None:
    svc = await fleet(1)
    started = time.monotonic()
    async with Client(svc.url, None) as dp:
        with pytest.raises(BadRequest) as unknown:
            await dp.wait({"colour": "blue"}, 30)
        with pytest.raises(BadRequest):
            await dp.gate(weight_version="x" * 300)
    assert "unknown condition 'colour'" in unknown.value.detail
    assert time.monotonic() - started < 5


async def test_a_callback_that_raises_ends_the_wait(fleet: ServiceFactory) -> None:
    svc = await fleet(1, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)

    def give_up(p: Progress) -> None:
        raise RuntimeError(f"stop at {p.attempt}")

    async with Client(svc.url, None) as dp:
        with pytest.raises(RuntimeError, match="stop at 1"):
            await dp.wait(RESUMED, 30, progress=give_up, interval_s=0.1)


async def test_status_is_typed(fleet: ServiceFactory) -> None:
    svc = await fleet(3, options=SimOptions(weight_version="v1"))
    async with Client(svc.url, None) as dp:
        status = await dp.status()
        assert isinstance(status, Status)
        assert (status.attach, status.ready, status.engines_expected) == ("owner", True, 3)
        assert status.engines_connected == 3 and status.consistent
        assert status.last_poll is not None and status.last_poll >= 0
        assert status.sleeping.value is False
        assert status.aggregate["get_weight_version"].value == "v1"
        assert [e.engine for e in status.engines] == ["0", "1", "2"]
        assert status.engine(1).weight_version == "v1" and status.engine("2").state == "awake"
        assert status.engine(0).vllm_version == "0.33.0" and status.engine(0).connected
        assert status.raw["engines_expected"] == 3
        svc.engines[1].state.sleeping_tags = set(ALL_TAGS)
        await svc.next_polls()
        split = await dp.status()
    assert not split.consistent and split.sleeping.state == "inconsistent"
    assert split.engine(1).state == "asleep"
    assert split.engine(1).invariants["is_sleeping"].value is True


async def test_gate_result_is_the_server_answer(fleet: ServiceFactory) -> None:
    """``raw`` is the body as the exporter sent it: what ``ctl wait --json`` prints."""
    svc = await fleet(1, gate_min_interval=0.0)
    async with Client(svc.url, None) as dp:
        result = await dp.gate(sleeping=False)
    status, body = await svc.get_json("/gate?sleeping=false")
    assert isinstance(result, GateResult) and status == 200
    assert set(result.raw) == set(body) and result.raw["conditions"] == {"sleeping": False}
