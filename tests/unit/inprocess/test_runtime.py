"""The exporter inside vLLM's API server (``exporter.inprocess.runtime``), over a stub of
vLLM's engine client: a start that fails must become ``problem`` (the routes' 503) and never
an exception into vLLM, a good one must poll and serve the series (cached between state
changes), and the stop must leave nothing running."""

from __future__ import annotations

import logging
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.inprocess.runtime import NOT_STARTED, InProcessRuntime, plugin_config
from exporter.inprocess.vllm_facts import ApiServer
from tests.unit.client.inprocess.test_vllm_core import StubCore

ENV = "VLLM_DP_EXPORTER_"


class KeyErrorClient:
    """An engine client of a shape this mode does not know: reading it raises a bug's error."""

    @property
    def engine_core(self) -> Any:
        raise KeyError("engine_core")


def vllm_client() -> SimpleNamespace:
    return SimpleNamespace(engine_core=StubCore())


async def test_before_a_start_nothing_is_served() -> None:
    runtime = InProcessRuntime(environ={})
    assert runtime.problem == NOT_STARTED
    assert await runtime.series() is None and runtime.families() is None
    assert runtime.merge([]) == []


@pytest.mark.parametrize(
    ("environ", "client", "problem"),
    [
        ({}, None, "this vLLM server has no engine (the render server)"),
        ({ENV + "POLL_INTERVAL": "soon"}, vllm_client(), ENV + "POLL_INTERVAL='soon'"),
        ({}, SimpleNamespace(), "has no engine_core"),
        ({}, KeyErrorClient(), "KeyError: 'engine_core'"),
    ],
)
async def test_a_failed_start_is_the_problem_never_an_exception(
    caplog: pytest.LogCaptureFixture, environ: dict[str, str], client: Any, problem: str
) -> None:
    runtime = InProcessRuntime(environ=environ)
    with caplog.at_level(logging.ERROR, logger="exporter.inprocess"):
        await runtime.start(client, None)
    assert runtime.problem is not None
    assert runtime.problem.startswith("the dp_exporter plugin did not start: ")
    assert problem in runtime.problem
    assert runtime.exporter is None and runtime.admin is None
    assert caplog.records  # logged once, for vLLM's operator


async def test_a_started_runtime_serves_its_series_until_stopped() -> None:
    runtime = InProcessRuntime(environ={ENV + "POLL_INTERVAL": "60"})  # one poll, then quiet
    await runtime.start(vllm_client(), Namespace(api_server_count=1))
    try:
        assert runtime.problem is None and runtime.admin is not None
        assert runtime.server == ApiServer(0, 1) and runtime.share is None
        exporter = runtime.exporter
        assert exporter is not None and exporter.client.engine_labels == ["0", "1", "2"]
        assert exporter.config.attach == "inprocess"
        await exporter.poller.wait_for_poll(0, timeout_s=5.0)
        body = await runtime.series()
        assert body is not None and b"vllm_dp_engine_state" in body
        assert await runtime.series() is body  # unchanged state: the same text, not a render
        families = runtime.families()
        assert families is not None and runtime.merge(families) is families
    finally:
        await runtime.stop()
    assert runtime.exporter is None
    assert runtime.problem is not None and "stopped" in runtime.problem
    assert await runtime.series() is None


async def test_several_api_servers_share_their_series_through_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    runtime = InProcessRuntime(environ={})
    client = vllm_client()
    client.engine_core.client_index = 1
    await runtime.start(client, Namespace(api_server_count=2))
    try:
        assert runtime.server == ApiServer(1, 2)
        assert runtime.share is not None and runtime.share.path.parent == tmp_path
    finally:
        await runtime.stop()
    assert not list(tmp_path.glob("vllm_dp_exporter.1.*"))  # its file removed with it


def test_the_plugin_config_drops_what_vllms_port_makes_moot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {
        ENV + "LISTEN": "0.0.0.0:1",
        ENV + "WEB_CONFIG_FILE": "/nope",
        ENV + "POLL_INTERVAL": "2",
    }
    with caplog.at_level(logging.WARNING, logger="exporter.inprocess"):
        config = plugin_config(environ)
    assert config.attach == "inprocess" and config.admin_listen == "off"
    assert config.web_config_file is None and config.poll_interval == 2.0
    assert sorted(caplog.messages) == [
        f"dp_exporter: {ENV}LISTEN is not used inside vLLM",
        f"dp_exporter: {ENV}WEB_CONFIG_FILE is not used inside vLLM",
    ]
    assert ENV + "LISTEN" in environ  # the caller's mapping is left alone
