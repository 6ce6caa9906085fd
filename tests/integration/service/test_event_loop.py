"""``--event-loop``: ``serve`` runs on uvloop when installed (the default) or on the stdlib loop,
with the same behaviour on both: real ``serve`` and ``sim-engine`` processes over real ZMQ, a
first engine killed mid-run, /metrics answering throughout."""

from __future__ import annotations

import asyncio
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from exporter.base import eventloop
from exporter.base.ports import free_listen_port
from exporter.config.settings import resolve_config
from exporter.error import ConfigError
from tests.harness.processes import ROOT, SimProcess, clean_env, python_cmd, run_cli, sim_processes
from tests.harness.processes import terminate as terminate_process
from tests.harness.scrape import metric_value, parse_metrics

BASE = {"engine_count": 2, "handshake_address": "tcp://127.0.0.1:5555"}


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), (" UVLOOP ", "uvloop")])
def test_event_loop_values(text: str, value: str) -> None:
    assert eventloop.event_loop_value(text) == value
    assert resolve_config(None, environ={}, event_loop=text, **BASE).event_loop == value


def test_bad_event_loop_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="--event-loop: event loop must be one of"):
        resolve_config(None, environ={}, event_loop="trio", **BASE)
    env = {"VLLM_DP_EXPORTER_EVENT_LOOP": "tokio"}
    with pytest.raises(ConfigError, match="tokio"):
        resolve_config(None, environ=env, **BASE)


def test_auto_prefers_uvloop_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert eventloop.resolve_event_loop("auto") == "uvloop"  # a dependency on Linux/CPython
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    assert eventloop.resolve_event_loop("auto") == "asyncio"
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        resolve_config(None, environ={}, event_loop="uvloop", **BASE)


async def _loop_name() -> str:
    await asyncio.sleep(0)
    return eventloop.running_loop_name()


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_run_uses_the_loop_asked_for(kind: str) -> None:
    assert eventloop.run(_loop_name(), kind) == kind


def test_run_refused_never_leaves_an_unawaited_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eventloop, "uvloop_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail here
        with pytest.raises(ConfigError):
            eventloop.run(_loop_name(), "uvloop")


@pytest.mark.slow
async def test_cli_rejects_a_bad_event_loop_in_one_line() -> None:
    code, _, err = await run_cli(
        "serve", "--engine-count", "1", "--handshake-address", "tcp://127.0.0.1:1",
        "--event-loop", "trio",
    )  # fmt: skip
    assert code == 2
    assert "--event-loop" in err and "'trio'" in err
    assert "Traceback" not in err


async def _scrape(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url) as resp:
            return await resp.text() if resp.status == 200 else None
    except aiohttp.ClientError:
        return None


async def _wait_for(
    http: aiohttp.ClientSession,
    url: str,
    what: str,
    check: Callable[[str], bool],
    timeout_s: float = 20.0,
) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = await _scrape(http, url)
        if text is not None and check(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last /metrics: {text!r:.400}")
        await asyncio.sleep(0.1)


def _up(text: str, engine: str) -> float | None:
    return metric_value(parse_metrics(text), "vllm_dp_engine_up", engine=engine)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["auto", "asyncio"])
async def test_serve_on_each_loop_survives_a_dead_first_engine(kind: str, tmp_path: Path) -> None:
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    port = free_listen_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log_file:
        serve = subprocess.Popen(
            python_cmd(
                "serve", "--engine-count", "3", "--handshake-address", handshake,
                "--listen", f"127.0.0.1:{port}", "--admin-listen", "off",
                "--poll-interval", "0.2", "--call-timeout", "1", "--event-loop", kind,
            ),
            cwd=ROOT, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=log_file,
        )  # fmt: skip
    first = SimProcess(handshake, 0)
    try:
        with sim_processes(first, SimProcess(handshake, 1), SimProcess(handshake, 2)):
            url = f"http://127.0.0.1:{port}/metrics"
            timeout = aiohttp.ClientTimeout(total=5)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                await _wait_for(
                    http, url, "every engine up",
                    lambda t: all(_up(t, e) == 1 for e in ("0", "1", "2")),
                )  # fmt: skip
                first.kill()
                text = await _wait_for(
                    http, url, "engine 0 down, 1 and 2 up",
                    lambda t: _up(t, "0") == 0 and _up(t, "1") == 1 and _up(t, "2") == 1,
                )  # fmt: skip
                families = parse_metrics(text)
                assert metric_value(families, "vllm_dp_engines_connected") == 2
    finally:
        terminate_process(serve)
    log = log_path.read_text()
    expected = "uvloop" if kind == "auto" else "asyncio"
    assert f"event loop {expected}" in log, log
    assert "Traceback" not in log, log
