"""``serve``: one line and exit 2 for what cannot start, 1 for a later failure; while serving,
SIGTERM and SIGINT stop it, and the signal handlers and the service are gone once it returns
(or fails to start). The service and the event loop runner are replaced by recorders."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any

import pytest
import zmq

from exporter.base import eventloop
from exporter.commands import service
from exporter.commands.service import run_serve, serve
from exporter.config.settings import ServeConfig
from exporter.error import ConfigError, ExporterError, StartupError


class FakeService:
    def __init__(self, admin_url: str | None) -> None:
        self.url, self.admin_url = "http://127.0.0.1:19400", admin_url
        self.stopped = 0

    async def stop(self) -> None:
        self.stopped += 1


def handlers_left() -> list[bool]:
    """Whether SIGTERM and SIGINT still have a handler on the running loop (removes them)."""
    loop = asyncio.get_running_loop()
    return [loop.remove_signal_handler(s) for s in (signal.SIGTERM, signal.SIGINT)]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[FakeService]:
    """The services ``serve`` started (``start_service`` recorded)."""
    made: list[FakeService] = []

    async def start_service(config: ServeConfig) -> FakeService:
        made.append(FakeService(None if config.admin_listen == "off" else "http://a:1"))
        return made[-1]

    monkeypatch.setattr(service, "start_service", start_service)
    return made


async def test_serving_ends_when_stop_is_set_and_cleans_up(
    started: list[FakeService], caplog: pytest.LogCaptureFixture
) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_soon(stop.set)
    with caplog.at_level(logging.INFO, logger="exporter"):
        await serve(ServeConfig(attach="http"), stop)
    assert started[0].stopped == 1 and handlers_left() == [False, False]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("serving /metrics on http://127.0.0.1:19400 (attach=http, ")
    assert "admin endpoint on http://a:1" in messages and messages[-1] == "stopping"


async def test_sigterm_stops_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[FakeService] = []

    async def start_service(config: ServeConfig) -> FakeService:
        """Once started (the handlers are in place by then), the operator stops it."""
        asyncio.get_running_loop().call_soon(signal.raise_signal, signal.SIGTERM)
        made.append(FakeService(None))
        return made[-1]

    monkeypatch.setattr(service, "start_service", start_service)
    # Without serve's handler the signal is ignored (and the wait times out), never fatal.
    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    try:
        await asyncio.wait_for(serve(ServeConfig(admin_listen="off")), 5.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert made[0].stopped == 1 and handlers_left() == [False, False]


async def test_a_start_that_fails_leaves_no_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    async def start_service(config: ServeConfig) -> FakeService:
        raise StartupError("--listen 0.0.0.0:19400: address already in use")

    monkeypatch.setattr(service, "start_service", start_service)
    with pytest.raises(StartupError, match="address already in use"):
        await serve(ServeConfig(), asyncio.Event())
    assert handlers_left() == [False, False]


async def test_the_heap_is_frozen_only_when_asked(
    started: list[FakeService], monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen: list[int] = []

    def freeze() -> int:
        frozen.append(1)
        return 0

    monkeypatch.setattr(service, "freeze_startup_heap", freeze)
    stop = asyncio.Event()
    stop.set()
    await serve(ServeConfig(), stop)
    assert frozen == []
    await serve(ServeConfig(), stop, freeze_heap=True)
    assert frozen == [1]


def run_with(
    monkeypatch: pytest.MonkeyPatch, outcome: BaseException | None, config: Any = None
) -> int:
    """``run_serve`` with the config resolved to ``config`` (or raising it) and the serving
    loop ending with ``outcome``."""

    def resolve(args: argparse.Namespace) -> ServeConfig:
        if isinstance(config, BaseException):
            raise config
        return ServeConfig(event_loop="asyncio")

    def run(main: Coroutine[Any, Any, None], kind: str) -> None:
        main.close()
        assert kind == "asyncio"
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(service, "resolve_config", resolve)
    monkeypatch.setattr(service, "configure_logging", lambda level, fmt: None)
    monkeypatch.setattr(eventloop, "run", run)
    return run_serve(argparse.Namespace())


@pytest.mark.parametrize(
    ("outcome", "code", "line"),
    [
        (None, 0, ""),
        (StartupError("--listen h:1: address in use"), 2, "--listen h:1: address in use"),
        (ConfigError("--web-config-file: bad"), 2, "--web-config-file: bad"),
        (zmq.ZMQError(zmq.EADDRINUSE), 1, "ZMQ: Address already in use"),
        (ExporterError("engine 3 sent garbage"), 1, "engine 3 sent garbage"),
        (OSError("too many open files"), 1, "too many open files"),
    ],
)
def test_each_failure_has_its_exit_code_and_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    outcome: BaseException | None,
    code: int,
    line: str,
) -> None:
    monkeypatch.setattr(service, "env_warnings", lambda: [])
    assert run_with(monkeypatch, outcome) == code
    err = capsys.readouterr().err
    assert err == (f"vllm-dp-exporter serve: {line}\n" if line else "")


def test_a_bad_setting_exits_two_before_serving(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(service, "env_warnings", lambda: ["VLLM_DP_EXPORTER_POL is no setting"])
    code = run_with(monkeypatch, AssertionError("never served"), ConfigError("--poll-interval: -1"))
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "vllm-dp-exporter serve: warning: VLLM_DP_EXPORTER_POL is no setting",
        "vllm-dp-exporter serve: --poll-interval: -1",
    ]
