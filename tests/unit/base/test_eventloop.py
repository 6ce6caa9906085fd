"""``--event-loop``: the converter, which loop ``auto`` resolves to, and ``run`` on the resolved
loop. uvloop's presence is faked where the answer depends on it."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from exporter.base import eventloop
from exporter.base.eventloop import (
    EVENT_LOOPS,
    event_loop_value,
    resolve_event_loop,
    running_loop_name,
)
from exporter.error import ConfigError


@pytest.mark.parametrize(
    ("text", "value"), [("auto", "auto"), (" UVLoop ", "uvloop"), ("AsyncIO", "asyncio")]
)
def test_the_converter_takes_any_case(text: str, value: str) -> None:
    assert event_loop_value(text) == value


def test_the_converter_names_the_choices_when_it_refuses() -> None:
    with pytest.raises(ValueError, match=r"auto, uvloop, asyncio.*'tokio'"):
        event_loop_value("tokio")
    # argparse names a converter's failure by its __name__: "invalid event_loop value".
    assert event_loop_value.__name__ == "event_loop"
    assert EVENT_LOOPS == ("auto", "uvloop", "asyncio")


@pytest.mark.parametrize(("installed", "resolved"), [(True, "uvloop"), (False, "asyncio")])
def test_auto_takes_uvloop_only_when_installed(
    monkeypatch: pytest.MonkeyPatch, installed: bool, resolved: str
) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: installed)
    assert resolve_event_loop("auto") == resolved
    assert resolve_event_loop("asyncio") == "asyncio", "asked for the stdlib: always the stdlib"


def test_asking_for_a_missing_uvloop_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        resolve_event_loop("uvloop")


def test_run_closes_the_coroutine_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """No "coroutine was never awaited" warning after the ConfigError."""
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)

    async def main() -> int:
        return 1

    coro = main()
    with pytest.raises(ConfigError):
        eventloop.run(coro, "uvloop")
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


async def _loop_name() -> str:
    await asyncio.sleep(0)
    return running_loop_name()


def test_run_on_the_stdlib_loop() -> None:
    assert eventloop.run(_loop_name(), "asyncio") == "asyncio"


@pytest.mark.skipif(not eventloop.uvloop_available(), reason="uvloop is not installed")
def test_run_on_uvloop_when_installed() -> None:
    assert eventloop.run(_loop_name(), "uvloop") == "uvloop"
    assert eventloop.run(_loop_name(), "auto") == "uvloop"
