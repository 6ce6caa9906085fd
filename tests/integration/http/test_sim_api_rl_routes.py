"""The simulated API server's RL and cache routes answer as vLLM's do (protocol doc F.4)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from exporter.sim.options import SimOptions
from exporter.sim.state import PARAMETER_NAMES
from tests.harness.apiservers import StartApi


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    # A fresh connection per request: after some 500s the server closes the connection.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=5), connector=connector
    ) as s:
        yield s


async def two_gets_on_one_connection(url: str, path: str) -> tuple[bytes, bytes]:
    """The answers to two GETs sent one after another on ONE connection (b"" once closed)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answers = []
    try:
        for _ in range(2):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(65536), 3))
    finally:
        writer.close()
    return answers[0], answers[1]


async def answer(
    session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any
) -> tuple[int, Any]:
    """Status and body (decoded JSON, or the raw bytes when empty)."""
    async with session.request(method, url, **kwargs) as resp:
        raw = await resp.read()
        return resp.status, (json.loads(raw) if raw else raw)


async def test_pause_resume_and_is_paused(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2)
    assert (await answer(session, "GET", f"{a.url}/is_paused"))[:2] == (200, {"is_paused": False})
    for mode in ("abort", "wait", "keep"):
        status, body = await answer(session, "POST", f"{a.url}/pause?mode={mode}")
        assert (status, body) == (200, {"status": "paused"})
        assert all(e.paused for e in a.sim.engines)
        assert (await answer(session, "GET", f"{a.url}/is_paused"))[1] == {"is_paused": True}
        assert (await answer(session, "POST", f"{a.url}/resume"))[:2] == (
            200,
            {"status": "resumed"},
        )
        assert not any(e.paused for e in a.sim.engines)
    status, body = await answer(session, "POST", f"{a.url}/pause")  # default mode abort
    assert status == 200 and a.sim.engines[0].paused and not a.sim.engines[0].sleeping_tags
    status, body = await answer(session, "POST", f"{a.url}/pause?mode=later")
    assert status == 400
    assert isinstance(body, dict) and body["error"]["param"] == "query.mode"
    status, body = await answer(session, "POST", f"{a.url}/pause?clear_cache=maybe")
    assert status == 400 and isinstance(body, dict)
    assert body["error"]["param"] == "query.clear_cache"
    assert (await answer(session, "GET", f"{a.url}/pause"))[0] == 405
    assert (await answer(session, "POST", f"{a.url}/is_paused"))[0] == 405


async def test_is_paused_disagreement_is_the_routes_own_500(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2, engine_options=[SimOptions(), SimOptions(paused=True)])
    status, body = await answer(session, "GET", f"{a.url}/is_paused")
    assert status == 500
    assert body == {
        "error": "Failed to fetch pause status: "
        "Engines returned different is_scheduler_paused results: [False, True]"
    }
    # The route caught the exception itself: a normal response, the connection stays open.
    first, second = await two_gets_on_one_connection(a.url, "/is_paused")
    assert first.startswith(b"HTTP/1.1 500") and second.startswith(b"HTTP/1.1 500")


async def test_pause_and_resume_failures(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2, failures={1: "boom"})
    assert (await answer(session, "POST", f"{a.url}/pause"))[:2] == (
        500,
        {"error": "Failed to pause generation: Call to pause_scheduler method failed: boom"},
    )
    assert (await answer(session, "POST", f"{a.url}/resume"))[:2] == (
        500,
        {"error": "Failed to resume generation: Call to resume_scheduler method failed: boom"},
    )
    old = await start_api(
        engines=1, engine_options=[SimOptions(missing_methods=frozenset({"is_scheduler_paused"}))]
    )
    status, body = await answer(session, "GET", f"{old.url}/is_paused")
    assert status == 500 and body == {
        "error": "Failed to fetch pause status: Call to is_scheduler_paused method failed: "
        "'EngineCoreProc' object has no attribute 'is_scheduler_paused'"
    }


async def test_weight_version_routes(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=2)
    assert (await answer(session, "GET", f"{a.url}/weight_info"))[:2] == (
        200,
        {"weight_version": None},
    )
    status, body = await answer(
        session, "POST", f"{a.url}/update_weight_version", json={"new_version": "step-5"}
    )
    assert (status, body) == (200, {"success": True, "new_version": "step-5"})
    assert [e.weight_version for e in a.sim.engines] == ["step-5", "step-5"]
    assert (await answer(session, "GET", f"{a.url}/weight_info"))[1] == {"weight_version": "step-5"}
    for payload, kind in (({}, "missing"), ({"new_version": 5}, "string_type")):
        status, body = await answer(session, "POST", f"{a.url}/update_weight_version", json=payload)
        assert status == 400 and isinstance(body, dict)
        assert body["error"]["param"] == "body.new_version"
        assert kind in body["error"]["message"]
    status, body = await answer(
        session, "POST", f"{a.url}/update_weight_version", data=b"{not json"
    )
    assert status == 400
    assert a.sim.engines[0].weight_version == "step-5", "rejected requests change nothing"


async def test_weight_info_disagreement(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2, engine_options=[SimOptions(weight_version="a"), SimOptions()])
    status, body = await answer(session, "GET", f"{a.url}/weight_info")
    assert status == 500
    assert body == {
        "error": {
            "message": "Engines returned different get_weight_version results: ['a', None]",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    # An unhandled exception: the connection is closed (F.4.1). A missing method also fails.
    first, second = await two_gets_on_one_connection(a.url, "/weight_info")
    assert first.startswith(b"HTTP/1.1 500") and second == b""
    old = await start_api(
        engines=1, engine_options=[SimOptions(missing_methods=frozenset({"get_weight_version"}))]
    )
    status, body = await answer(session, "GET", f"{old.url}/weight_info")
    assert status == 500 and isinstance(body, dict)
    assert "object has no attribute 'get_weight_version'" in body["error"]["message"]


async def test_weight_checker(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=2, engine_options=[SimOptions(tp_size=2)] * 2)
    status, body = await answer(
        session, "POST", f"{a.url}/weight_checker", json={"action": "checksum"}
    )
    assert status == 200 and isinstance(body, dict) and list(body) == ["checksums"]
    checksums = body["checksums"]
    assert len(checksums) == 2 * 2 * len(PARAMETER_NAMES)
    prefixes = sorted({k[: k.index(":ep0:") + 5] for k in checksums})
    assert prefixes == [
        "dp0:pp0:pcp0:tp0:ep0:",
        "dp0:pp0:pcp0:tp1:ep0:",
        "dp1:pp0:pcp0:tp0:ep0:",
        "dp1:pp0:pcp0:tp1:ep0:",
    ]
    # Same position on both DP ranks → same digest.
    name = PARAMETER_NAMES[0]
    assert checksums[f"dp0:pp0:pcp0:tp1:ep0:{name}"] == checksums[f"dp1:pp0:pcp0:tp1:ep0:{name}"]
    compare = {"action": "compare", "baseline": checksums}
    status, body = await answer(session, "POST", f"{a.url}/weight_checker", json=compare)
    assert (status, body) == (200, {"match": True, "mismatches": []})
    a.sim.engines[1].corrupt_param = name
    status, body = await answer(session, "POST", f"{a.url}/weight_checker", json=compare)
    assert (status, body) == (
        200,
        {
            "match": False,
            "mismatches": [f"dp1:pp0:pcp0:tp0:ep0:{name}", f"dp1:pp0:pcp0:tp1:ep0:{name}"],
        },
    )
    status, body = await answer(
        session, "POST", f"{a.url}/weight_checker", json={"action": "reset"}
    )
    assert (status, body) == (200, {"status": "reset"})
    status, body = await answer(
        session, "POST", f"{a.url}/weight_checker", json={"action": "compare"}
    )
    assert status == 400 and body == {
        "error": {
            "message": "action='compare' requires a 'baseline' object",
            "type": "Bad Request",
            "param": None,
            "code": 400,
        }
    }
    for payload in ({"action": "hash"}, {}):
        status, body = await answer(session, "POST", f"{a.url}/weight_checker", json=payload)
        assert status == 400 and isinstance(body, dict)
        assert body["error"]["param"] == "body.action"


async def test_weight_checker_duplicate_keys(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2, duplicate_checksum_keys=True)
    status, body = await answer(
        session, "POST", f"{a.url}/weight_checker", json={"action": "checksum"}
    )
    assert status == 500 and isinstance(body, dict)
    message = body["error"]["message"]
    assert message.startswith("Duplicate weight checksum keys: ['dp0:pp0:pcp0:tp0:ep0:")
    assert body["error"]["type"] == "Internal Server Error"


async def test_cache_resets(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=2)
    for path in ("/reset_mm_cache", "/reset_encoder_cache"):
        status, body = await answer(session, "POST", f"{a.url}{path}")
        assert (status, body) == (200, b"")
        assert (await answer(session, "GET", f"{a.url}{path}"))[0] == 405
    old = await start_api(
        engines=2,
        engine_options=[SimOptions(), SimOptions(missing_methods=frozenset({"reset_mm_cache"}))],
    )
    status, body = await answer(session, "POST", f"{old.url}/reset_mm_cache")
    assert status == 500 and isinstance(body, dict)
    assert body["error"]["message"] == (
        "Call to reset_mm_cache method failed: "
        "'EngineCoreProc' object has no attribute 'reset_mm_cache'"
    )


async def test_missing_routes_and_dev_mode_off(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    routes = [
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/update_weight_version"),
        ("GET", "/weight_info"),
        ("POST", "/weight_checker"),
        ("POST", "/reset_mm_cache"),
        ("POST", "/reset_encoder_cache"),
    ]
    off = await start_api(engines=1, dev_mode=False)
    for verb, path in routes:
        assert (await answer(session, verb, f"{off.url}{path}"))[:2] == (
            404,
            {"detail": "Not Found"},
        )
    old = await start_api(engines=1, missing_routes=frozenset({"/weight_info", "/is_paused"}))
    assert (await answer(session, "GET", f"{old.url}/weight_info"))[0] == 404
    assert (await answer(session, "GET", f"{old.url}/is_paused"))[0] == 404
    assert (await answer(session, "GET", f"{old.url}/is_sleeping"))[0] == 200


async def test_engine_that_ignores_state_changes(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(
        engines=2, engine_options=[SimOptions(), SimOptions(ignore_state_changes=True)]
    )
    assert (await answer(session, "POST", f"{a.url}/sleep?level=1"))[:2] == (
        200,
        {"status": "sleeping", "level": 1},
    )
    status, body = await answer(session, "GET", f"{a.url}/is_sleeping")
    assert status == 500 and isinstance(body, dict)
    assert body["error"]["message"] == (
        "Engines returned different is_sleeping results: [True, False]"
    )
    assert (await answer(session, "POST", f"{a.url}/wake_up"))[:2] == (
        200,
        {"status": "awake", "tags": None},
    )
    await answer(session, "POST", f"{a.url}/update_weight_version", json={"new_version": "v"})
    assert [e.weight_version for e in a.sim.engines] == ["v", None]
