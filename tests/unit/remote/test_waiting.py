"""``wait_for_gate``: a closed gate, a restarting exporter and a moment of garbage are asked
again until the timeout; a question the gate rejects ends the wait at once. Driven by a fake
clock whose sleeps only move the clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from exporter.remote.errors import (
    BadRequest,
    HttpError,
    NotFound,
    RemoteError,
    Unreachable,
    Unsupported,
    WaitTimeout,
)
from exporter.remote.results import GateResult
from exporter.remote.waiting import MIN_REQUEST_TIMEOUT_S, Progress, wait_for_gate

OPEN = GateResult.from_json(200, {"ok": True, "engines": [{"engine": "0", "ok": True}]})
CLOSED_BODY: dict[str, Any] = {
    "conditions": {"paused": False},
    "engines": [
        {"engine": "0", "ok": True, "failures": []},
        {"engine": "1", "ok": False, "failures": ["paused is True, expected False"]},
    ],
    "failing_engines": ["1"],
}
CLOSED = GateResult.from_json(412, CLOSED_BODY)


class Clock:
    """``time.monotonic`` and ``asyncio.sleep`` of one test: a sleep moves the clock."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.slept.append(delay)
        self.now += delay


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(asyncio, "sleep", fake.sleep)
    return fake


Answer = GateResult | RemoteError


def checks(
    clock: Clock, *answers: Answer, cost_s: float = 0.0
) -> tuple[Callable[[float], Awaitable[GateResult]], list[float]]:
    """A gate check answering ``answers`` in turn (each taking ``cost_s``), and the
    per-request timeouts it was given."""
    script = list(answers)
    timeouts: list[float] = []

    async def check(timeout_s: float) -> GateResult:
        timeouts.append(timeout_s)
        clock.now += cost_s
        answer = script.pop(0)
        if isinstance(answer, RemoteError):
            raise answer
        return answer

    return check, timeouts


async def test_an_open_gate_ends_the_wait_at_once(clock: Clock) -> None:
    seen: list[Progress] = []
    check, _ = checks(clock, OPEN)
    got = await wait_for_gate(check, {}, 10.0, progress=seen.append, clock=clock)
    assert got is OPEN and seen == [] and clock.slept == []


async def test_closed_answers_and_failures_are_asked_again(clock: Clock) -> None:
    seen: list[Progress] = []
    refused = Unreachable("ClientConnectorError: refused")
    check, _ = checks(clock, CLOSED, refused, HttpError("HTTP 502", status=502), OPEN)
    got = await wait_for_gate(check, {}, 10.0, interval_s=0.5, progress=seen.append, clock=clock)
    assert got is OPEN
    assert [(p.attempt, p.result, p.error) for p in seen] == [
        (1, CLOSED, None),
        (2, None, refused),
        (3, None, seen[2].error),
    ]
    assert [p.elapsed_s for p in seen] == [0.0, 0.5, 1.0]
    assert [p.remaining_s for p in seen] == [10.0, 9.5, 9.0]
    assert clock.slept == [0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    "rejected",
    [
        BadRequest("HTTP 400: unknown condition", status=400),
        NotFound("HTTP 404", status=404),
        Unsupported("HTTP 501", status=501, conditions=("drained",)),
    ],
)
async def test_a_rejected_question_ends_the_wait_at_once(
    clock: Clock, rejected: RemoteError
) -> None:
    seen: list[Progress] = []
    check, _ = checks(clock, CLOSED, rejected, OPEN)
    with pytest.raises(type(rejected)) as raised:
        await wait_for_gate(check, {}, 10.0, progress=seen.append, clock=clock)
    assert raised.value is rejected and len(seen) == 1


async def test_the_timeout_names_the_conditions_and_keeps_the_last_answer(clock: Clock) -> None:
    check, _ = checks(clock, *[CLOSED] * 3, cost_s=0.25)
    with pytest.raises(WaitTimeout) as late:
        await wait_for_gate(check, {"paused": False, "weight_version": "v2"}, 2.0, clock=clock)
    error = late.value
    assert str(error) == (
        "wait timed out after 2s for paused=false weight_version=v2 (last: HTTP 412)"
    )
    assert error.last is CLOSED and error.last_error == "HTTP 412"
    assert error.status == 412 and error.body == CLOSED_BODY
    # Checks at 0, 1.25 and 2 (the last pause cut to the deadline, then one last check).
    assert clock.slept == [1.0, 0.5] and clock.now == 1002.25


async def test_a_timeout_after_failures_only_says_why(clock: Clock) -> None:
    check, _ = checks(clock, Unreachable("ClientConnectorError: refused"))
    with pytest.raises(WaitTimeout) as late:
        await wait_for_gate(check, {}, 0.0, clock=clock)
    assert late.value.last is None and late.value.status is None
    assert late.value.last_error == "ClientConnectorError: refused"
    assert str(late.value).endswith("for (none) (last: ClientConnectorError: refused)")


async def test_each_request_gets_what_is_left_within_bounds(clock: Clock) -> None:
    check, timeouts = checks(clock, CLOSED, CLOSED, CLOSED, cost_s=3.0)
    with pytest.raises(WaitTimeout):
        await wait_for_gate(check, {}, 7.25, interval_s=1.0, request_timeout_s=5.0, clock=clock)
    assert timeouts == [5.0, 3.25, MIN_REQUEST_TIMEOUT_S]  # 7.25 left, then 3.25, then 0


async def test_an_async_progress_is_awaited_and_its_error_ends_the_wait(clock: Clock) -> None:
    awaited: list[int] = []

    async def progress(p: Progress) -> None:
        awaited.append(p.attempt)
        if p.attempt == 2:
            raise KeyError("stop")

    check, _ = checks(clock, CLOSED, CLOSED, OPEN)
    with pytest.raises(KeyError):
        await wait_for_gate(check, {}, 10.0, progress=progress, clock=clock)
    assert awaited == [1, 2]


@pytest.mark.parametrize(("timeout_s", "interval_s"), [(10.0, 0.0), (10.0, -1.0), (-1.0, 1.0)])
async def test_bad_timings_are_refused_before_asking(
    clock: Clock, timeout_s: float, interval_s: float
) -> None:
    check, timeouts = checks(clock, OPEN)
    with pytest.raises(ValueError, match="interval_s must be positive"):
        await wait_for_gate(check, {}, timeout_s, interval_s=interval_s, clock=clock)
    assert timeouts == []


def test_a_progress_summary_names_what_still_fails() -> None:
    closed = Progress(1, 0.0, 9.0, CLOSED, None)
    assert closed.summary == "engine 1: paused is True, expected False"
    no_engine = GateResult.from_json(503, {"error": "no engine\x1b connected"})
    assert Progress(1, 0.0, 9.0, no_engine, None).summary == "no engine\\x1b connected"
    bare = GateResult.from_json(412, {"engines": [{"engine": "2", "ok": False}]})
    assert Progress(1, 0.0, 9.0, bare, None).summary == "engine 2: failing"
    assert Progress(1, 0.0, 9.0, GateResult.from_json(412, {}), None).summary == "HTTP 412"
    failed = Progress(2, 1.0, 8.0, None, Unreachable("reset\r\n"))
    assert failed.summary == "reset\\r\\n"
    assert Progress(3, 2.0, 7.0, None, None).summary == "no answer"
