"""The simulated vLLM API server answers as vLLM 0.33's dev routes do (protocol doc F.4.1)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from exporter.sim.api_routes import ENGINE_DEAD_MESSAGE
from exporter.sim.options import SimOptions
from tests.harness.apiservers import StartApi


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        yield s


async def raw_exchange(url: str, requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on ONE connection; b"" once the server closed it."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    answers = []
    try:
        for req in requests:
            writer.write(req)
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(65536), 3))
    finally:
        writer.close()
    return answers


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


async def test_is_sleeping_agree_and_disagree(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=3)
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b'{"is_sleeping":false}'
    a.sim.engines[1].sleep(1)
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert resp.status == 500
        assert "connection" not in {k.lower() for k in resp.headers}
        assert json.loads(await resp.read()) == {
            "error": {
                "message": "Engines returned different is_sleeping results: [False, True, False]",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
        }


async def test_connection_closed_after_500_without_header(start_api: StartApi) -> None:
    a = await start_api(engines=2, engine_options=[SimOptions(), SimOptions(sleeping=True)])
    first, second = await raw_exchange(a.url, [get("/is_sleeping"), get("/is_sleeping")])
    head = first.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 500")
    assert b"connection:" not in head
    assert second == b""  # the server closed the connection
    ok = await start_api(engines=1)
    first, second = await raw_exchange(ok.url, [get("/is_sleeping"), get("/is_sleeping")])
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200")


async def test_failing_engine_and_dead_engine(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=2, failures={0: "boom"})
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert resp.status == 500
        body = await resp.json()
        assert body["error"]["message"] == "Call to is_sleeping method failed: boom"
    d = await start_api(engines=1, engine_dead=True)
    async with session.post(f"{d.url}/reset_prefix_cache") as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == ENGINE_DEAD_MESSAGE


async def test_reset_prefix_cache(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=2)
    async with session.post(f"{a.url}/reset_prefix_cache") as resp:
        assert resp.status == 200 and await resp.read() == b'{"success":true}'
    a.sim.engines[1].refuse_reset = True
    url = f"{a.url}/reset_prefix_cache?reset_running_requests=True&reset_external=0"
    async with session.post(url, json={"reset_running_requests": "ignored"}) as resp:
        assert resp.status == 200 and await resp.read() == b'{"success":false}'
    async with session.post(f"{a.url}/reset_prefix_cache?reset_running_requests=maybe") as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["type"] == "Bad Request"
        assert err["param"] == "query.reset_running_requests"
        assert err["code"] == 400
    async with session.get(f"{a.url}/reset_prefix_cache") as resp:
        assert resp.status == 405
        assert resp.headers["allow"] == "POST"
        assert await resp.json() == {"detail": "Method Not Allowed"}
    async with session.post(f"{a.url}/is_sleeping") as resp:
        assert resp.status == 405 and resp.headers["allow"] == "GET"
    old = await start_api(engines=1, old_reset_response=True)
    async with session.post(f"{old.url}/reset_prefix_cache") as resp:
        assert resp.status == 200 and await resp.read() == b""


async def test_dev_mode_off(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=1, dev_mode=False)
    for method, path in [
        ("GET", "/is_sleeping"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("POST", "/reset_prefix_cache"),
    ]:
        async with session.request(method, f"{a.url}{path}") as resp:
            assert resp.status == 404
            assert await resp.read() == b'{"detail":"Not Found"}'
    async with session.get(f"{a.url}/version") as resp:
        assert resp.status == 200


async def test_sleep_and_wake_up(start_api: StartApi, session: aiohttp.ClientSession) -> None:
    a = await start_api(engines=2)
    async with session.post(f"{a.url}/sleep?level=1&mode=abort") as resp:
        assert await resp.json() == {"status": "sleeping", "level": 1}
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": True}
    async with session.post(f"{a.url}/wake_up?tags=weights") as resp:
        assert await resp.json() == {"status": "sleeping", "tags": ["weights"]}
    async with session.post(f"{a.url}/wake_up?tags=kv_cache") as resp:
        assert await resp.json() == {"status": "awake", "tags": ["kv_cache"]}
    async with session.post(f"{a.url}/sleep?level=2") as resp:
        assert resp.status == 200
    async with session.post(f"{a.url}/wake_up") as resp:
        assert await resp.json() == {"status": "awake", "tags": None}
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert await resp.json() == {"is_sleeping": False}
    async with session.post(f"{a.url}/sleep?mode=bogus") as resp:
        assert resp.status == 400


async def test_authorization_recorded_not_checked(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    a = await start_api(engines=1)
    async with session.get(f"{a.url}/is_sleeping", headers={"Authorization": "Bearer x"}) as resp:
        assert resp.status == 200
    async with session.get(f"{a.url}/is_sleeping") as resp:
        assert resp.status == 200
    assert [auth for _, _, auth in a.sim.requests] == ["Bearer x", None]
