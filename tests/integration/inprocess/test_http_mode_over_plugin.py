"""A sidecar in HTTP mode over plugin-enabled vLLM servers (targets ending in ``/dp``): each
server's engines become the sidecar's engines, ``<target>/<rank>``, read one by one from the
server's ``/dp/gate`` — so one exporter watches many servers with per-engine truth. Real HTTP
both ways: the sidecar (``start_service``) and the plugin's app (uvicorn), simulated engines on
real ZMQ behind a simulated ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from exporter.client.http.client import HttpFleetClient
from exporter.sim.options import SimOptions
from exporter.web.app import RunningService, start_service
from tests.harness.plugin_app import PluginApps
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import serve_config
from tests.harness.waiting import eventually


async def sidecar(**targets: str) -> RunningService:
    entries = tuple(f"{name}={url}/dp" for name, url in targets.items())
    return await start_service(serve_config(attach="http", http_target=entries))


async def scrape(service: RunningService) -> str:
    async with aiohttp.ClientSession() as session, session.get(service.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_every_engine_of_every_server_is_one_engine_of_the_sidecar(
    plugin_apps: PluginApps,
) -> None:
    a = await plugin_apps(2, by_index={1: SimOptions(sleeping=True)})
    b = await plugin_apps(3)
    service = await sidecar(a=a.url, b=b.url)
    try:
        labels = ["a/0", "a/1", "b/0", "b/1", "b/2"]
        await eventually(
            lambda: service.exporter.poller.snapshot.ready, 10, "the sidecar's first polls"
        )
        assert service.exporter.client.engine_labels == labels
        families = parse_metrics(await scrape(service))
        for label in labels:
            assert metric_value(families, "vllm_dp_engine_up", engine=label) == 1.0
        assert metric_value(families, "vllm_dp_engine_sleeping", engine="a/1") == 1.0
        assert metric_value(families, "vllm_dp_engine_sleeping", engine="b/2") == 0.0
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        assert [e["engine"] for e in doc["engines"]] == labels
        assert doc["aggregate"]["is_sleeping"]["consistent"] is False
        # The sidecar's gate names the one engine that is asleep.
        status, body = await get_json(service.url + "/gate?sleeping=false")
        assert status == 412 and body["failing_engines"] == ["a/1"]
    finally:
        await service.stop()


@pytest.mark.parametrize("hung", [0, 1, 2])
async def test_a_hung_engine_behind_a_plugin_is_that_engine_alone(
    plugin_apps: PluginApps, hung: int
) -> None:
    app = await plugin_apps(3, ready=False, by_index={hung: SimOptions(hang=True)})
    service = await sidecar(a=app.url)
    try:
        await eventually(
            lambda: len(service.exporter.client.engine_labels) == 3, 10, "the server's engines"
        )

        def settled() -> bool:
            snap = service.exporter.poller.snapshot
            ups = {e.engine: e.up for e in snap.engines}
            return ups == {f"a/{i}": i != hung for i in range(3)}

        await eventually(settled, 10, "only the hung engine down")
        families = parse_metrics(await scrape(service))
        ups = [metric_value(families, "vllm_dp_engine_up", engine=f"a/{i}") for i in range(3)]
        assert ups == [0.0 if i == hung else 1.0 for i in range(3)]
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        engine = doc["engines"][hung]
        assert engine["invariants"]["is_sleeping"]["outcome"] == "timeout", engine
    finally:
        await service.stop()


async def test_actions_are_not_relayed_to_a_plugin_server(plugin_apps: PluginApps) -> None:
    app = await plugin_apps(2)
    service = await sidecar(a=app.url)
    try:
        await eventually(lambda: service.exporter.poller.snapshot.ready, 10, "a ready sidecar")
        assert service.admin_url is not None
        async with (
            aiohttp.ClientSession() as session,
            session.post(service.admin_url + "/admin/reset_prefix_cache") as resp,
        ):
            status, body = resp.status, await resp.json(content_type=None)
        assert status == 502, body
        assert body["failed_engines"] == ["a/0", "a/1"]
        assert all("POST" in (e["error"] or "") for e in body["engines"]), body
        assert app.fleet is not None
        assert [len(e.args_of("reset_prefix_cache")) for e in app.fleet.engines] == [0, 0]
    finally:
        await service.stop()


async def test_a_server_without_the_plugin_or_down_is_one_engine_that_says_why(
    plugin_apps: PluginApps,
) -> None:
    app = await plugin_apps(2)
    await app.runtime.stop()  # the plugin answers 503 "stopped"
    service = await sidecar(a=app.url, gone="http://127.0.0.1:9")
    try:
        await eventually(lambda: service.exporter.poller.snapshot.poll_number >= 2, 10, "two polls")
        assert service.exporter.client.engine_labels == ["a", "gone"]
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        outcomes = [e["invariants"]["is_sleeping"] for e in doc["engines"]]
        assert [o["outcome"] for o in outcomes] == ["disconnected", "disconnected"]
        assert "stopped" in outcomes[0]["error"]
        assert "cannot connect" in outcomes[1]["error"]
    finally:
        await service.stop()


async def fault_view(service: RunningService) -> tuple[dict[str, Any], dict[str, float], Any]:
    """Each engine's ``fault_tolerance`` in /status, the status series, the healthy gate."""
    _, doc = await get_json(service.url + "/status")
    family = parse_metrics(await scrape(service)).get("vllm_dp_engine_fault_tolerance_status")
    samples = family.samples if family is not None else []
    series = {f"{s.labels['engine']}:{s.labels['status']}": s.value for s in samples}
    gate = await get_json(service.url + "/gate?healthy=true")
    return {e["engine"]: e["fault_tolerance"] for e in doc["engines"]}, series, gate


async def gate_answers(
    service: RunningService, what: str = "", timeout_s: float = 10.0, status: int = 200
) -> None:
    """``GET /gate?healthy=true`` answers ``status`` within ``timeout_s`` (the gate shares a
    sample for its minimum interval, so the first answer after a poll may still be the older
    one: seen under load, a 200 from before the hostile answer)."""
    deadline = time.monotonic() + timeout_s
    while (answer := (await fault_view(service))[2])[0] != status:
        assert time.monotonic() < deadline, (what, answer)
        await asyncio.sleep(0.1)


def statuses(service: RunningService) -> dict[str, str | None]:
    """Each engine's fault status in the last poll's snapshot (None: none reported)."""
    return {
        e.engine: None if e.detail.fault_status is None else e.detail.fault_status.status
        for e in service.exporter.poller.snapshot.engines
    }


@pytest.mark.parametrize("faulty", [0, 1, 2], ids=["first", "middle", "last"])
async def test_each_rank_behind_a_plugin_server_has_its_own_fault_status(
    plugin_apps: PluginApps, faulty: int
) -> None:
    """vLLM's own ``GET /fault_tolerance/status`` at the server's root names every rank: each
    becomes that engine's status (not the worst of the server), and the gate names that rank."""
    app = await plugin_apps(3)
    assert app.fleet is not None
    app.fleet.core.enable_fault_tolerance()
    app.fleet.core.set_engine_status(faulty, "unhealthy", "RuntimeError: rank lost its GPU")
    service = await sidecar(a=app.url)
    labels = [f"a/{i}" for i in range(3)]
    expected = {label: "unhealthy" if i == faulty else "healthy" for i, label in enumerate(labels)}
    try:
        await eventually(lambda: statuses(service) == expected, 10, "every rank's fault status")
        entries, series, (status, body) = await fault_view(service)
        for label, want in expected.items():
            assert entries[label]["status"] == want, entries
            assert series[f"{label}:{want}"] == 1.0
        assert entries[labels[faulty]]["fault_info"] == "RuntimeError: rank lost its GPU"
        assert status == 412 and body["failing_engines"] == [labels[faulty]], body
        # The rank recovers: the next poll says so, and the gate opens.
        app.fleet.core.set_engine_status(faulty, "healthy")
        await eventually(
            lambda: set(statuses(service).values()) == {"healthy"}, 10, "the rank healthy again"
        )
        await gate_answers(service)
    finally:
        await service.stop()


async def test_each_rank_behind_a_plugin_server_serving_the_route_under_v1(
    plugin_apps: PluginApps,
) -> None:
    """A server that serves ``/v1/fault_tolerance/status`` only (vLLM's open PR #46370): each
    rank still gets its own status, vLLM PR #41438's ``paused`` and ``recovering`` and an unknown
    string (``other``) included, and the gate names every rank that is not healthy."""
    app = await plugin_apps(3)
    assert app.fleet is not None
    app.app.state.fault_status_under_v1 = True
    app.fleet.core.enable_fault_tolerance()
    for rank, status in enumerate(("paused", "recovering", "zzz-new")):
        app.fleet.core.set_engine_status(rank, status)
    service = await sidecar(a=app.url)
    expected = {"a/0": "paused", "a/1": "recovering", "a/2": "other"}
    try:
        await eventually(lambda: statuses(service) == expected, 10, "every rank's fault status")
        # Readable statuses, none counted: not even the sidecar's first read, made before it
        # followed the server's ranks (the target's own label is no rank to match).
        await two_more_polls(service)
        assert service.exporter.faults.counts.get("bad_fault_tolerance_status", 0) == 0
        entries, series, (status, body) = await fault_view(service)
        assert entries["a/2"]["fault_info"] == "status 'zzz-new'"
        assert all(series[f"{label}:{want}"] == 1.0 for label, want in expected.items())
        assert status == 412 and body["failing_engines"] == list(expected), body
        for rank in range(3):
            app.fleet.core.set_engine_status(rank, "healthy")
        await eventually(
            lambda: set(statuses(service).values()) == {"healthy"}, 10, "every rank healthy"
        )
        await gate_answers(service)
    finally:
        await service.stop()


async def two_more_polls(service: RunningService) -> None:
    poller = service.exporter.poller
    target = poller.snapshot.poll_number + 2
    await eventually(lambda: poller.snapshot.poll_number >= target, 10, "two more polls")


HOSTILE_FT_ANSWERS = {
    "a rank the gate never named": {"engines": [{"id": 999, "status": "dead"}]},
    "a rank twice": {"engines": [{"id": 0, "status": "healthy"}, {"id": 0, "status": "dead"}]},
    "a bad entry": {"engines": [{"id": 1, "status": "healthy"}, {"id": "0"}]},
    "not JSON": b"\x00not json",
}


async def test_a_plugin_server_without_fault_tolerance_or_lying_about_it(
    plugin_apps: PluginApps,
) -> None:
    """Fault tolerance off (404): no status, the gate open. A hostile answer (a rank the server's
    gate never named, a rank twice, a bad entry, garbage) adds no engine; the ranks it does not
    say readably are unknown (E1: never the healthy they were), counted; a readable answer makes
    them healthy again."""
    app = await plugin_apps(2)
    assert app.fleet is not None
    service = await sidecar(a=app.url)
    exporter = service.exporter
    try:
        await eventually(lambda: exporter.poller.snapshot.poll_number >= 2, 10, "two polls")
        entries, series, (status, _) = await fault_view(service)
        assert entries == {"a/0": None, "a/1": None} and series == {} and status == 200
        # Turned on: the sidecar asks again (a 404 is remembered until the server reconnects,
        # or for FT_RECHECK_S): restart the sidecar rather than wait minutes.
        await service.stop()
        app.fleet.core.enable_fault_tolerance()
        service = await sidecar(a=app.url)
        exporter = service.exporter
        healthy = {"a/0": "healthy", "a/1": "healthy"}
        await eventually(lambda: statuses(service) == healthy, 10, "both ranks healthy")
        for name, answer in HOSTILE_FT_ANSWERS.items():
            counted = exporter.faults.counts.get("bad_fault_tolerance_status", 0)
            body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
            app.app.state.fault_status_body = body
            await two_more_polls(service)
            assert exporter.client.engine_labels == ["a/0", "a/1"], name
            assert isinstance(exporter.client, HttpFleetClient)
            assert set(exporter.client.pushes.fault_status) == set(healthy), name
            assert statuses(service) == {"a/0": "unknown", "a/1": "unknown"}, name
            await gate_answers(service, name, status=412)  # closed, once its sample is fresh
            assert exporter.faults.counts.get("bad_fault_tolerance_status", 0) > counted, name
            app.app.state.fault_status_body = None
            await eventually(lambda: statuses(service) == healthy, 10, f"healthy after {name}")
            await gate_answers(service, name)
    finally:
        await service.stop()
