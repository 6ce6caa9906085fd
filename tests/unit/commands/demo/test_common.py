"""What every attach mode of the demo shares: its options, how engines are grouped into child
processes, the "where to look" lines, when the demo's own trainer may run, and the trainer
(``reset_loop``), which outlives any one failed call: a client failure that is not an
exporter's answer is logged and the loop goes on, so the demo's reset panels keep moving."""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import subprocess
from typing import Any

import pytest

from exporter.commands.demo import common
from exporter.commands.demo.common import (
    WEIGHT_UPDATE_EVERY,
    DemoOptions,
    _status_of,
    add_demo_arguments,
    demo_config,
    engine_groups,
    reset_loop,
    serve_demo,
    spawn_engines,
    stop_processes,
    trainer_blocked,
)
from exporter.config.settings import ServeConfig
from exporter.config.webconfig import WebConfig
from exporter.remote import ActionResult
from exporter.remote.errors import Conflict, Forbidden, Unreachable
from exporter.sim.options import ApiServerOptions, SimOptions

TLS = WebConfig("web.yml", ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
USERS = WebConfig("web.yml", users={b"alice": b"$2b$hash"})


async def _raises(exc: BaseException) -> ActionResult:
    raise exc


def test_an_exporter_error_gives_its_status() -> None:
    busy = Conflict("another admin action is running", status=409)
    assert asyncio.run(_status_of(_raises(busy))) == 409
    assert asyncio.run(_status_of(_raises(Unreachable("no answer", url="http://x")))) is None


def test_an_unexpected_client_failure_is_logged_and_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="exporter.demo"):
        status = asyncio.run(_status_of(_raises(RuntimeError("session closed"))))
    assert status is None
    assert "demo trainer: RuntimeError: session closed" in caplog.text


def test_cancellation_still_stops_the_loop() -> None:
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_status_of(_raises(asyncio.CancelledError())))


def test_the_flags_defaults_are_the_options_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    assert DemoOptions.from_args(parser.parse_args([])) == DemoOptions()
    args = parser.parse_args(["--engines", "6", "--attach", "relay", "--reset-every", "0"])
    assert DemoOptions.from_args(args) == DemoOptions(engines=6, attach="relay", reset_every=0)


def test_the_vllm_version_is_a_release_and_defaults_to_the_simulations(
    capsys: pytest.CaptureFixture[str],
) -> None:
    default = DemoOptions().vllm_version
    assert default == SimOptions().vllm_version == ApiServerOptions().vllm_version
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    for given in ("0.34.0", "0.34.0rc1", "0.35.1+cpu", "1.0"):
        args = parser.parse_args(["--vllm-version", given])
        assert DemoOptions.from_args(args).vllm_version == given
    for bad in ("latest", "0.34.0; rm -rf /", "", "34"):
        with pytest.raises(SystemExit) as refused:
            parser.parse_args(["--vllm-version", bad])
        assert refused.value.code == 2
    assert "not a vLLM release: 'latest'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"engines": 0}, "engines must be at least 1"),
        ({"attach": "inprocess"}, "attach must"),
        ({"vllm_version": "next"}, "not a vLLM release"),
    ],
)
def test_options_that_cannot_run_are_refused(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DemoOptions(**kwargs)


@pytest.mark.parametrize(
    ("count", "groups"),
    [
        (1, [(0, 1)]),
        (8, [(i, 1) for i in range(8)]),
        (9, [(0, 2), (2, 2), (4, 2), (6, 2), (8, 1)]),
        (64, [(i, 8) for i in range(0, 64, 8)]),
    ],
)
def test_engines_are_grouped_into_at_most_eight_processes(
    count: int, groups: list[tuple[int, int]]
) -> None:
    assert engine_groups(count) == groups
    assert sum(n for _, n in groups) == count


def test_each_process_runs_its_group_as_part_of_the_whole_fleet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[list[str]] = []

    def popen(cmd: list[str], **kw: Any) -> list[str]:
        started.append(cmd)
        return cmd

    monkeypatch.setattr(subprocess, "Popen", popen)
    spawn_engines("tcp://127.0.0.1:5555", 9, 40.0, "0.34.0")
    assert len(started) == 5
    first = started[0][started[0].index("sim-engine") :]
    assert first == [
        "sim-engine", "--handshake-address", "tcp://127.0.0.1:5555", "--engine-index", "0",
        "--engine-count", "2", "--story-period", "40.0", "--fleet-start", "0", "--fleet-size", "9",
        "--vllm-version", "0.34.0",
    ]  # fmt: skip
    last = started[-1]
    assert last[last.index("--engine-index") + 1] == "8"
    assert last[last.index("--engine-count") + 1] == "1"


class FakeProcess:
    def __init__(self, running: bool, stubborn: bool = False) -> None:
        self.running, self.stubborn = running, stubborn
        self.signals: list[str] = []

    def poll(self) -> int | None:
        return None if self.running else 0

    def terminate(self) -> None:
        self.signals.append("terminate")

    def kill(self) -> None:
        self.signals.append("kill")
        self.stubborn = False

    def wait(self, timeout: float | None = None) -> int:
        if self.stubborn:
            raise subprocess.TimeoutExpired("sim-engine", timeout or 0)
        return 0


def test_stopping_terminates_the_running_and_kills_the_stubborn() -> None:
    done, running, stubborn = FakeProcess(False), FakeProcess(True), FakeProcess(True, True)
    stop_processes([done, running, stubborn])  # type: ignore[list-item]
    assert (done.signals, running.signals) == ([], ["terminate"])
    assert stubborn.signals == ["terminate", "kill"]


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (ServeConfig(), None),
        (ServeConfig(web=TLS), "the web config serves TLS"),
        (ServeConfig(web=USERS), "the web config asks for basic auth"),
        (ServeConfig(web=USERS, admin_token="tok"), None),  # the token is the admin credential
        (ServeConfig(web=WebConfig("web.yml")), None),
    ],
)
def test_when_the_demo_s_trainer_cannot_reach_its_admin_listener(
    config: ServeConfig, why: str | None
) -> None:
    assert trainer_blocked(config) == why


@pytest.mark.usefixtures("no_exporter_env")
def test_a_demo_config_resets_as_often_as_the_demo_asks() -> None:
    options = DemoOptions(listen="127.0.0.1:9400", poll_interval=0.5, model_name="m")
    config = demo_config(options, attach="http", http_target=("node0=http://h:1",))
    assert (config.attach, config.http_target) == ("http", ("node0=http://h:1",))
    assert (config.listen, config.poll_interval, config.model_name) == ("127.0.0.1:9400", 0.5, "m")
    assert config.reset_min_interval == 0.0


async def demo_lines(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    config: ServeConfig,
    reset_every: float,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``serve_demo``'s printed lines and the reset loops it started (serving returns at once)."""
    loops: list[tuple[Any, ...]] = []
    cancelled = asyncio.Event()

    async def fake_loop(*args: Any) -> None:
        loops.append(args)
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def serve(config: ServeConfig, stop: asyncio.Event | None) -> None:
        await asyncio.sleep(0)  # the loop task starts

    monkeypatch.setattr(common, "reset_loop", fake_loop)
    monkeypatch.setattr("exporter.commands.service.serve", serve)
    await serve_demo(config, ["headline"], reset_every)
    assert cancelled.is_set() == bool(loops)  # a started loop never outlives serving
    return capsys.readouterr().out.splitlines(), loops


async def test_where_to_look_and_the_trainer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ServeConfig(listen="0.0.0.0:9400", admin_listen="[::1]:9401", admin_token="t",
                         admin_token_file="/run/tok")  # fmt: skip
    lines, loops = await demo_lines(monkeypatch, capsys, config, 5.0)
    assert lines == [
        "headline",
        "  dashboard page  http://127.0.0.1:9400/",
        "  metrics         http://127.0.0.1:9400/metrics",
        "  status (JSON)   http://127.0.0.1:9400/status",
        "  per-rank feed   http://127.0.0.1:9400/watch  (curl -N; or ctl watch)",
        '  admin reset     curl -X POST -H "Authorization: Bearer $(cat /run/tok)" '
        "http://[::1]:9401/admin/reset_prefix_cache",
    ]
    assert loops == [("http://[::1]:9401", 5.0, "t")]


async def test_a_blocked_trainer_is_not_started_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ServeConfig(listen="10.0.0.5:9400", web=TLS)
    lines, loops = await demo_lines(monkeypatch, capsys, config, 5.0)
    assert lines[1] == "  dashboard page  https://10.0.0.5:9400/"
    assert lines[5:] == [
        "  web config      web.yml",
        "  admin reset     curl --cacert CA.crt -X POST https://127.0.0.1:19401/admin/reset_prefix_cache",
        "  demo resets     off: the web config serves TLS (the demo holds no client credentials)",
    ]
    assert loops == []
    users = ServeConfig(admin_listen="off", web=USERS)
    lines, loops = await demo_lines(monkeypatch, capsys, users, 5.0)
    assert not any("admin" in line for line in lines) and loops == []


class FakeClient:
    """The demo trainer's client: each reset answers in turn; the loop ends when none is left."""

    def __init__(self, resets: list[int], version_status: int = 200) -> None:
        self.resets, self.version_status = resets, version_status
        self.calls: list[str] = []

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def reset_prefix_cache(self, **kw: Any) -> ActionResult:
        if not self.resets:
            raise asyncio.CancelledError
        self.calls.append("reset")
        return ActionResult.from_json("reset_prefix_cache", self.resets.pop(0), {})

    async def weight_version(self, version: str, **kw: Any) -> ActionResult:
        self.calls.append(version)
        if self.version_status == 403:
            raise Forbidden("HTTP 403: relay mode", status=403)
        return ActionResult.from_json("weight_version", 200, {})

    async def verify_weights(self, **kw: Any) -> ActionResult:
        self.calls.append("verify")
        return ActionResult.from_json("verify_weights", 200, {})


async def run_trainer(monkeypatch: pytest.MonkeyPatch, client: FakeClient) -> list[str]:
    monkeypatch.setattr(common, "Client", lambda *a, **kw: client)
    with pytest.raises(asyncio.CancelledError):
        await reset_loop("http://h:1", 0.0)
    return client.calls


async def test_the_trainer_updates_weights_after_the_first_reset_that_reached_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resets = [503, 200] + [200] * WEIGHT_UPDATE_EVERY
    calls = await run_trainer(monkeypatch, FakeClient(resets))
    assert calls == ["reset", "reset", "demo-1", "verify"] + ["reset"] * 3 + [
        "reset", "demo-2", "verify",
    ]  # fmt: skip


async def test_the_trainer_stops_setting_versions_once_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = await run_trainer(monkeypatch, FakeClient([502] * 5, version_status=403))
    assert calls == ["reset", "demo-1", "verify"] + ["reset"] * 3 + ["reset", "verify"]
