"""``exporter.inprocess.start_exporter`` inside the process that owns a (simulated) ``AsyncLLM``:
the service ``serve`` runs, over real HTTP on loopback, against the ``AsyncLLM``'s own
engine-core client (real ZMQ to simulated engines)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from exporter.base.ports import free_listen_port
from exporter.error import ConfigError, StartupError
from exporter.inprocess import start_exporter
from exporter.inprocess.vllm_facts import check_loop
from exporter.sim.options import SimOptions
from exporter.web.app import RunningService
from tests.harness.inprocess import (
    ADMIN_TOKEN,
    EmbeddedExporters,
    SimVllm,
    SimVllmFactory,
    fast_settings,
    fresh_poll,
    http_session,
    refuses_connections,
    token_file,
)
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.waiting import eventually


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as resp:
        return resp.status, await resp.text()


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        return resp.status, await resp.json()


async def reset(
    session: aiohttp.ClientSession, service: RunningService, token: str | None = ADMIN_TOKEN
) -> tuple[int, Any]:
    assert service.admin_url is not None
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.post(service.admin_url + "/admin/reset_prefix_cache", headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def test_serves_metrics_status_and_gate(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters
) -> None:
    sim = await sim_vllm_factory(3, SimOptions(sleeping=True))
    service = await embedded(sim.llm, gate_min_interval=0.05)
    assert service.url.startswith("http://127.0.0.1:")
    assert service.admin_url is not None and service.admin_url.startswith("http://127.0.0.1:")
    assert service.url != service.admin_url
    await fresh_poll(service)
    async with http_session() as session:
        status, text = await get(session, service.url + "/metrics")
        assert status == 200
        m = parse_metrics(text)
        assert [metric_value(m, "vllm_dp_engine_up", engine=str(i)) for i in range(3)] == [1.0] * 3
        assert metric_value(m, "vllm_dp_sleeping") == 1.0
        assert metric_value(m, "vllm_dp_sleep_state_consistent") == 1.0

        status, doc = await get_json(session, service.url + "/status")
        assert status == 200
        assert doc["attach"] == "inprocess"
        assert doc["engines_expected"] == 3 and doc["engines_connected"] == 3
        assert [e["engine"] for e in doc["engines"]] == ["0", "1", "2"]
        for e in doc["engines"]:
            assert e["up"] and e["connected"], e
            assert e["invariants"]["is_sleeping"] == {
                "value": True,
                "outcome": "ok",
                "error": None,
                "values": None,
            }
        assert {e["address"] for e in doc["engines"]} == {"in-process (vLLM client 0)"}
        assert doc["aggregate"]["is_sleeping"]["consistent"] is True

        status, gate = await get_json(session, service.url + "/gate?sleeping=true")
        assert (status, gate["ok"], gate["failing_engines"]) == (200, True, [])

        # The trainer wakes one engine through its own AsyncLLM: the exporter sees it.
        # (The gate shares one fresh fan-out per gate_min_interval: wait that out.)
        assert await sim.direct_call("wake_up", 1) is True
        await asyncio.sleep(0.1)
        status, gate = await get_json(session, service.url + "/gate?sleeping=true")
        assert (status, gate["failing_engines"]) == (412, ["1"])
        await fresh_poll(service)
        m = parse_metrics((await get(session, service.url + "/metrics"))[1])
        assert metric_value(m, "vllm_dp_sleeping") is None
        assert metric_value(m, "vllm_dp_sleep_state_consistent") == 0.0
    # Each answered call's entry left vLLM's table.
    assert sim.core.utility_results == {}


async def test_admin_reset_with_a_token_file(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, tmp_path: Path
) -> None:
    path = token_file(tmp_path)
    assert Path(path).stat().st_mode & 0o777 == 0o600
    service = await embedded(sim_vllm.llm, admin_token_file=path)
    async with http_session() as session:
        status, _ = await reset(session, service, token=None)
        assert status == 401
        assert sim_vllm.received("reset_prefix_cache") == [0, 0, 0]
        status, body = await reset(session, service)
    assert status == 200, body
    assert body["success"] is True and body["outcome"] == "success"
    assert body["engines"] == [
        {"engine": i, "ok": True, "reason": None, "error": None} for i in range(3)
    ]
    assert sim_vllm.received("reset_prefix_cache") == [1, 1, 1]


async def test_admin_reset_partial_failure_names_the_engine(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters, tmp_path: Path
) -> None:
    sim = await sim_vllm_factory(3, refuse_reset={1: True})
    service = await embedded(sim.llm, admin_token_file=token_file(tmp_path))
    async with http_session() as session:
        status, body = await reset(session, service)
    assert status == 502, body
    assert body["outcome"] == "partial_failure"
    assert body["failed_engines"] == [1]
    assert body["engines"][1] == {"engine": 1, "ok": False, "reason": "refused", "error": None}
    assert [body["engines"][i]["ok"] for i in (0, 2)] == [True, True]


async def test_stop_closes_the_ports_and_leaves_the_asyncllm_working(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters
) -> None:
    sim = await sim_vllm_factory(2, hang={1: True})  # calls left in vLLM's table at stop
    service = await embedded(sim.llm)
    await fresh_poll(service)
    assert service.admin_url is not None
    assert not await refuses_connections(service.url)
    assert not await refuses_connections(service.admin_url)
    # Stop while a poll's fan-out waits on the hung engine (the poller's task is cancelled).
    read = sim.engines[1].calls
    await eventually(lambda: sim.engines[1].calls > read, timeout_s=5, what="a poll in flight")
    assert service.exporter.poller.snapshot.poll_number >= 1
    await embedded.stop(service)
    assert await refuses_connections(service.url)
    assert await refuses_connections(service.admin_url)
    # The AsyncLLM is the trainer's: not shut down, not marked dead, still answering.
    assert not sim.core.resources.engine_dead
    assert await sim.direct_call("is_sleeping", 0) is False
    assert await sim.direct_call("reset_prefix_cache", 0) is True
    # The exporter's own calls were cancelled at stop (even the ones to the hung engine).
    client = service.exporter.client
    assert getattr(client, "in_flight", None) == {}


async def test_two_exporters_in_one_process_are_independent(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters, tmp_path: Path
) -> None:
    a = await sim_vllm_factory(2, SimOptions(sleeping=True))
    b = await sim_vllm_factory(3)
    tokens = tmp_path / "b"
    tokens.mkdir()
    svc_a = await embedded(a.llm)
    svc_b = await embedded(b.llm, admin_token_file=token_file(tokens))
    assert len({svc_a.url, svc_b.url, svc_a.admin_url, svc_b.admin_url}) == 4
    await asyncio.gather(fresh_poll(svc_a), fresh_poll(svc_b))
    async with http_session() as session:
        ma = parse_metrics((await get(session, svc_a.url + "/metrics"))[1])
        mb = parse_metrics((await get(session, svc_b.url + "/metrics"))[1])
        assert [s.labels["engine"] for s in ma["vllm_dp_engine_up"].samples] == ["0", "1"]
        assert [s.labels["engine"] for s in mb["vllm_dp_engine_up"].samples] == ["0", "1", "2"]
        assert metric_value(ma, "vllm_dp_sleeping") == 1.0
        assert metric_value(mb, "vllm_dp_sleeping") == 0.0

        # An admin action on B reaches B's engines only.
        status, _ = await reset(session, svc_b)
        assert status == 200
        assert a.received("reset_prefix_cache") == [0, 0]
        assert b.received("reset_prefix_cache") == [1, 1, 1]

        # Stopping A leaves B serving and polling.
        await embedded.stop(svc_a)
        assert await refuses_connections(svc_a.url)
        before = svc_b.exporter.poller.snapshot.poll_number
        await fresh_poll(svc_b)
        assert svc_b.exporter.poller.snapshot.poll_number > before
        status, doc = await get_json(session, svc_b.url + "/status")
        assert status == 200 and doc["engines_connected"] == 3
    assert await a.direct_call("is_sleeping", 1) is True


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"poll_interval": -1}, "poll-interval"),
        ({"call_timeout": 0}, "call-timeout"),
        ({"poll_intervall": 1.0}, "unknown setting 'poll_intervall'"),
    ],
    ids=["negative-poll-interval", "zero-call-timeout", "misspelt-setting"],
)
async def test_bad_settings_are_a_config_error_with_nothing_listening(
    sim_vllm: SimVllm, settings: dict[str, Any], match: str
) -> None:
    listen = f"127.0.0.1:{free_listen_port()}"
    admin = f"127.0.0.1:{free_listen_port()}"
    with pytest.raises(ConfigError, match=match):
        await start_exporter(
            sim_vllm.llm, **fast_settings(listen=listen, admin_listen=admin, **settings)
        )
    assert await refuses_connections(f"http://{listen}")
    assert await refuses_connections(f"http://{admin}")
    assert sim_vllm.calls() == [0, 0, 0]  # nothing was sent to any engine


async def test_an_object_without_what_inprocess_needs_is_a_config_error(
    sim_vllm: SimVllm,
) -> None:
    listen = f"127.0.0.1:{free_listen_port()}"
    with pytest.raises(ConfigError, match="has no engine_core"):
        await start_exporter(SimpleNamespace(), **fast_settings(listen=listen))
    core = sim_vllm.core
    stripped = SimpleNamespace(
        core_engines=core.core_engines, resources=core.resources, utility_results={}
    )  # an engine-core client without _call_utility_async (an in-process InprocClient)
    with pytest.raises(ConfigError, match="lacks _call_utility_async"):
        await start_exporter(SimpleNamespace(engine_core=stripped), **fast_settings(listen=listen))
    assert await refuses_connections(f"http://{listen}")


async def test_a_port_in_use_is_a_startup_error(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        admin = f"127.0.0.1:{free_listen_port()}"
        with pytest.raises(StartupError, match="--listen"):
            await start_exporter(
                sim_vllm.llm, **fast_settings(listen=f"127.0.0.1:{port}", admin_listen=admin)
            )
        # The admin listener it had bound is closed again.
        assert await refuses_connections(f"http://{admin}")
        with pytest.raises(StartupError):
            await start_exporter(sim_vllm.llm, **fast_settings(admin_listen=f"127.0.0.1:{port}"))
    # Nothing of the failed starts is left waiting in vLLM's client, which still answers, and
    # a third start on free ports works.
    assert not sim_vllm.core.resources.engine_dead
    assert await sim_vllm.direct_call("is_sleeping", 2) is False
    service = await embedded(sim_vllm.llm)
    await fresh_poll(service)
    assert service.exporter.poller.snapshot.ready


@contextlib.contextmanager
def task_on_another_loop() -> Iterator[asyncio.Task[None]]:
    """A running task of an event loop in another thread (vLLM's output handler, as an
    ``AsyncLLM`` created on that loop has it)."""
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def main() -> None:
        state["loop"] = asyncio.get_running_loop()
        state["stop"] = stop = asyncio.Event()
        state["task"] = task = asyncio.ensure_future(asyncio.sleep(3600))
        ready.set()
        await stop.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(5), "the other loop did not start"
        yield state["task"]
    finally:
        if "loop" in state:
            state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(5)
        assert not thread.is_alive()


async def test_another_event_loop_is_a_config_error(sim_vllm: SimVllm) -> None:
    listen = f"127.0.0.1:{free_listen_port()}"
    with task_on_another_loop() as handler:
        llm = SimpleNamespace(
            engine_core=sim_vllm.core, vllm_config=sim_vllm.llm.vllm_config, output_handler=handler
        )
        with pytest.raises(ConfigError, match="event loop that runs the AsyncLLM"):
            check_loop(llm)
        with pytest.raises(ConfigError, match="event loop"):
            await start_exporter(llm, **fast_settings(listen=listen))
        assert await refuses_connections(f"http://{listen}")
    assert sim_vllm.calls() == [0, 0, 0]


async def test_an_output_handler_on_this_loop_is_accepted(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    handler = asyncio.ensure_future(asyncio.sleep(3600))
    try:
        llm = SimpleNamespace(
            engine_core=sim_vllm.core, vllm_config=sim_vllm.llm.vllm_config, output_handler=handler
        )
        check_loop(llm)
        service = await embedded(llm)
        await fresh_poll(service)
        assert service.exporter.poller.snapshot.ready
    finally:
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
    # A finished output handler (vLLM's loop gone) is not checked.
    check_loop(SimpleNamespace(output_handler=handler))


async def test_listen_addresses_come_from_the_environment_when_not_given(
    sim_vllm: SimVllm,
) -> None:
    env = {"VLLM_DP_EXPORTER_LISTEN": "127.0.0.1:0", "VLLM_DP_EXPORTER_ADMIN_LISTEN": "off"}
    settings = {k: v for k, v in fast_settings().items() if "listen" not in k and k != "environ"}
    service = await start_exporter(sim_vllm.llm, environ=env, **settings)
    try:
        assert service.url.startswith("http://127.0.0.1:")
        assert service.admin_url is None
        async with http_session() as session:
            status, _ = await get(session, service.url + "/metrics")
        assert status == 200
    finally:
        await service.stop()
