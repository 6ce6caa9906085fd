"""The interface's own rules (``exporter.client.fleet``): the allow-list, the outcomes every
mode gives a stopping client or a missed deadline, and which reads may use a late answer."""

from __future__ import annotations

import asyncio

import pytest

from exporter.client.fleet import (
    ACTION_METHODS,
    DEFAULT_ALLOWED_METHODS,
    LATE_ANSWERS,
    READ_METHODS,
    STOPPING,
    EngineOutcome,
    Outcome,
    check_allowed,
    late_answers_allowed,
    stopping,
    timed_out,
)
from exporter.error import MethodNotAllowed


def test_the_allow_list_is_the_reads_and_the_actions_and_nothing_else() -> None:
    assert DEFAULT_ALLOWED_METHODS == READ_METHODS | ACTION_METHODS
    assert not READ_METHODS & ACTION_METHODS
    check_allowed("is_sleeping", DEFAULT_ALLOWED_METHODS)
    for method in ("shutdown", "collective_rpc", "add_lora", ""):
        with pytest.raises(MethodNotAllowed, match=repr(method)):
            check_allowed(method, DEFAULT_ALLOWED_METHODS)


def test_the_outcomes_of_a_stopping_client_and_a_missed_deadline() -> None:
    assert stopping("3") == EngineOutcome("3", Outcome.DISCONNECTED, error=STOPPING)
    late = timed_out("1", 2.5)
    assert (late.outcome, late.error, late.duration_s) == (
        Outcome.TIMEOUT,
        "no reply within 2.5s",
        2.5,
    )
    assert not late.ok and EngineOutcome("0", Outcome.OK, True).ok


async def test_late_answers_are_allowed_only_inside_the_block_and_its_tasks() -> None:
    assert LATE_ANSWERS.get() is False

    async def seen() -> bool:
        return LATE_ANSWERS.get()

    with late_answers_allowed():
        assert LATE_ANSWERS.get() is True
        assert await asyncio.create_task(seen()) is True  # tasks started inside inherit it
    assert LATE_ANSWERS.get() is False
    assert await asyncio.create_task(seen()) is False


def test_the_flag_is_reset_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), late_answers_allowed():
        raise RuntimeError("poll failed")
    assert LATE_ANSWERS.get() is False
