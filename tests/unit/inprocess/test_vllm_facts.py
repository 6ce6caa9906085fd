"""What in-process mode reads of vLLM besides its engine-core client
(``exporter.inprocess.vllm_facts``), over stub objects: each reader has a fallback, because a
vLLM release that renamed an attribute must cost a fact, never the plugin's start."""

from __future__ import annotations

import asyncio
import sys
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.error import ConfigError
from exporter.inprocess.vllm_facts import (
    SCALING_MODULE,
    ApiServer,
    api_server,
    check_loop,
    core_of,
    multiprocess_dir,
    scaling_flag,
    sleep_mode,
    vllm_version,
)
from tests.unit.control.test_attach import StubCore


def engine_client(sleep: Any = True, **parallel: Any) -> SimpleNamespace:
    return SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=sleep),
            parallel_config=SimpleNamespace(**parallel),
        ),
        engine_core=StubCore(),
    )


@pytest.mark.parametrize(("value", "read"), [(True, True), (False, False), (1, None), (None, None)])
def test_sleep_mode_is_a_bool_or_unknown(value: Any, read: bool | None) -> None:
    assert sleep_mode(engine_client(value)) is read
    assert sleep_mode(object()) is None  # no vllm_config at all


def test_the_api_server_from_vllms_parallel_config() -> None:
    server = api_server(engine_client(_api_process_rank=2, _api_process_count=4), None)
    assert server == ApiServer(index=2, count=4) and not server.leader
    assert ApiServer(0, 4).leader


def test_the_api_server_falls_back_to_the_args_and_the_client_index() -> None:
    client = engine_client(_api_process_rank=-1, _api_process_count=0)
    client.engine_core.client_index = 1
    assert api_server(client, Namespace(api_server_count=3)) == ApiServer(1, 3)
    assert api_server(client, Namespace(api_server_count="3")) == ApiServer(1, 1)
    assert api_server(object(), None) == ApiServer(0, 1)  # one API server, the leader


def test_vllms_version_and_scaling_flag_are_read_only_where_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it fails
    assert vllm_version() is None
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.33.0"))
    assert vllm_version() == "0.33.0"
    monkeypatch.delitem(sys.modules, SCALING_MODULE, raising=False)
    assert scaling_flag() is False  # a process that never loaded vLLM's middleware
    monkeypatch.setitem(
        sys.modules, SCALING_MODULE, SimpleNamespace(get_scaling_elastic_ep=lambda: 1)
    )
    assert scaling_flag() is True


def test_the_multiprocess_directory_is_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/prom")
    assert multiprocess_dir() == "/tmp/prom"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    assert multiprocess_dir() is None


def test_another_event_loop_is_refused() -> None:
    """vLLM's client answers only on the loop that created it: a start elsewhere would hang."""
    client = engine_client()

    async def check() -> None:
        check_loop(client)

    home, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        home.run_until_complete(check())  # no output handler yet: nothing to check
        client.output_handler = home.create_task(asyncio.sleep(10))
        with pytest.raises(ConfigError, match="event loop that runs the AsyncLLM"):
            other.run_until_complete(check())
        home.run_until_complete(check())  # the AsyncLLM's own loop
        client.output_handler.cancel()
        home.run_until_complete(asyncio.gather(client.output_handler, return_exceptions=True))
        other.run_until_complete(check())  # a handler that ended: nothing to check
    finally:
        home.close()
        other.close()


async def test_core_of_carries_what_vllm_says_of_itself() -> None:
    client = engine_client(sleep=False)
    core = core_of(client)
    assert core.core is client.engine_core and core.front_end is client
    assert core.enable_sleep_mode is False
    assert core.scaling_flag is scaling_flag
    with pytest.raises(ConfigError, match="has no engine_core"):
        core_of(SimpleNamespace())
