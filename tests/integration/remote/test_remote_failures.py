"""``exporter.remote`` against addresses that are not a healthy exporter: nothing listening, a
server that never answers, answers that are huge, not JSON, of the wrong shape or full of
control characters, redirects, transient failures. Every case ends in a typed error within
the call's timeout; retries happen only where they are safe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from exporter.base.ports import free_listen_port
from exporter.remote import (
    NO_RETRY,
    AuthError,
    Client,
    Conflict,
    HttpError,
    InvalidAnswer,
    Progress,
    RateLimited,
    Retry,
    Unreachable,
)
from tests.integration.remote.conftest import AppServer

RESUMED = {
    "action": "resume",
    "success": True,
    "outcome": "success",
    "verified": True,
    "engines": [{"engine": 0, "ok": True, "reason": None, "error": None, "state": False}],
    "failed_engines": [],
    "params": {},
    "duration_s": 0.01,
}


@pytest.fixture
async def silent_server() -> AsyncIterator[str]:
    """A TCP server that accepts connections, reads, and never answers."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read()  # until the client hangs up

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in writers:
        writer.close()
    server.close()
    await asyncio.wait_for(server.wait_closed(), 5)


async def test_nothing_listening_is_unreachable() -> None:
    url = f"http://127.0.0.1:{free_listen_port()}"
    started = time.monotonic()
    async with Client(url, url, retry=Retry(attempts=2, backoff_s=0.05)) as dp:
        with pytest.raises(Unreachable) as status:
            await dp.status(timeout_s=3)
        with pytest.raises(Unreachable):
            await dp.reset_prefix_cache(timeout_s=3)
    assert status.value.status is None and status.value.body is None
    assert str(status.value).startswith("ClientConnectorError: ")
    assert time.monotonic() - started < 3


async def test_a_server_that_never_answers_is_bounded_by_the_timeout(silent_server: str) -> None:
    async with Client(silent_server, silent_server) as dp:
        for call in (
            dp.status(timeout_s=0.5),
            dp.gate(timeout_s=0.5, paused=False),
            dp.resume(idempotency_key="k", timeout_s=0.5),  # retried writes share the bound
        ):
            started = time.monotonic()
            with pytest.raises(Unreachable) as timed_out:
                await call
            assert 0.5 <= time.monotonic() - started < 2.0
            assert "TimeoutError: no answer" in str(timed_out.value)


async def test_reads_are_retried_after_transient_failures(serve_app: AppServer) -> None:
    hits: list[str] = []

    async def status(request: web.Request) -> web.Response:
        hits.append("status")
        if len(hits) < 3:
            return web.json_response({"error": "bad gateway"}, status=502)
        return web.json_response({"engines_expected": 1, "engines": []})

    app = web.Application()
    app.router.add_get("/status", status)
    url = await serve_app(app)
    async with Client(url, None, retry=Retry(attempts=3, backoff_s=0.01)) as dp:
        assert (await dp.status()).engines_expected == 1
    assert len(hits) == 3
    hits.clear()
    async with Client(url, None, retry=NO_RETRY) as dp:
        with pytest.raises(HttpError) as once:
            await dp.status()
    assert once.value.status == 502 and len(hits) == 1


async def test_writes_are_retried_only_with_an_idempotency_key(serve_app: AppServer) -> None:
    keys: list[str | None] = []

    async def resume(request: web.Request) -> web.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        if len(keys) % 2 == 1:  # every first attempt: the connection drops, no answer
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(0.05)
        return web.json_response(RESUMED)

    app = web.Application()
    app.router.add_post("/admin/resume", resume)
    url = await serve_app(app)
    retry = Retry(attempts=3, backoff_s=0.01)
    async with Client(None, url, retry=retry) as dp:
        with pytest.raises(Unreachable):
            await dp.resume()  # no key: never sent twice
        assert keys == [None]
        keys.clear()
        assert (await dp.resume(idempotency_key="step-7-resume")).success
        assert keys == ["step-7-resume", "step-7-resume"]
    keys.clear()
    async with Client(None, url, retry=retry, auto_idempotency_keys=True) as dp:
        assert (await dp.resume()).success
    assert len(keys) == 2 and keys[0] == keys[1]
    assert keys[0] is not None and keys[0].startswith("exporter-remote-")


async def test_redirects_are_not_followed(serve_app: AppServer) -> None:
    elsewhere: list[str] = []

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async def target(request: web.Request) -> web.Response:
        elsewhere.append(request.headers.get("Authorization", ""))
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/status", moved)
    app.router.add_post("/admin/resume", moved)
    app.router.add_route("*", "/elsewhere", target)
    url = await serve_app(app)
    async with Client(url, url) as dp:
        with pytest.raises(HttpError) as status:
            await dp.status()
        with pytest.raises(HttpError):
            await dp.resume()
    assert status.value.status == 307 and elsewhere == []


async def test_huge_answers_are_bounded(serve_app: AppServer) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"[" * 2**16
        for _ in range(2**12):  # 256 MiB if nobody stopped reading
            await resp.write(chunk)
        return resp

    async def declared(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 10**9
        await resp.prepare(request)
        await resp.write(b"{")
        await asyncio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_get("/status", endless)
    app.router.add_get("/gate", declared)
    url = await serve_app(app)
    started = time.monotonic()
    async with Client(url, None, retry=NO_RETRY, max_answer_bytes=2**20) as dp:
        with pytest.raises(InvalidAnswer) as streamed:
            await dp.status()
        with pytest.raises(InvalidAnswer) as announced:
            await dp.gate()
    assert "larger than the 1048576 bytes" in str(streamed.value)
    assert "1000000000 bytes, more than the 1048576" in str(announced.value)
    assert time.monotonic() - started < 5


async def test_answers_that_are_not_the_exporters_api(serve_app: AppServer) -> None:
    evil = "busy\x1b[2J\x1b[31mPWNED\r\n\u202e"
    bodies: dict[str, tuple[int, Any]] = {
        "/status": (200, "<html>not an exporter</html>"),
        "/gate": (200, "[" * 100_000),
        "/admin/resume": (200, {**RESUMED, "engines": [{"engine": 0, "ok": "yes"}]}),
        "/admin/pause": (409, {"error": evil}),
        "/admin/sleep": (401, "Unauthorized\x07"),
        "/admin/wake_up": (502, {**RESUMED, "engines": [{"engine": True, "ok": False}]}),
        "/admin/reset_prefix_cache": (429, {"error": "slow down"}),
    }

    async def answer(request: web.Request) -> web.Response:
        status, body = bodies[request.path]
        if isinstance(body, str):
            return web.Response(status=status, text=body, content_type="text/html")
        headers = {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"} if status == 429 else {}
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    for path in bodies:
        app.router.add_route("*", path, answer)
    url = await serve_app(app)
    async with Client(url, url, retry=NO_RETRY) as dp:
        with pytest.raises(InvalidAnswer, match="HTTP 200: the answer is not JSON: <html>"):
            await dp.status()
        with pytest.raises(InvalidAnswer, match="not JSON"):
            await dp.gate()  # nested deeper than the decoder goes: still one typed error
        with pytest.raises(InvalidAnswer, match=r"engines\[0\]\.ok must be a boolean"):
            await dp.resume()
        with pytest.raises(Conflict) as conflict:
            await dp.pause()
        with pytest.raises(AuthError) as auth:
            await dp.sleep()
        with pytest.raises(InvalidAnswer, match=r"engines\[0\]\.engine must be an engine"):
            await dp.wake_up()
        with pytest.raises(RateLimited) as limited:
            await dp.reset_prefix_cache()
    for error in (conflict.value, auth.value):
        assert str(error).isprintable() and error.detail.isprintable()
    assert "\\x1b[2J" in str(conflict.value) and conflict.value.body == {"error": evil}
    assert auth.value.body is None and "\\x07" in str(auth.value)
    assert limited.value.retry_after == 0.0  # a date in the past: now


async def test_wait_retries_5xx_and_reports_the_errors(serve_app: AppServer) -> None:
    answers = [(500, {"error": "internal error"}), (200, {"ok": True, "engines": [{}]})]

    async def gate(request: web.Request) -> web.Response:
        status, body = answers.pop(0) if len(answers) > 1 else answers[0]
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/gate", gate)
    url = await serve_app(app)
    seen: list[Progress] = []
    async with Client(url, None) as dp:
        opened = await dp.wait({"paused": False}, 5, progress=seen.append, interval_s=0.05)
    assert opened.ok
    assert [type(p.error) for p in seen] == [HttpError] and seen[0].result is None
    assert "internal error" in seen[0].summary


async def test_base_urls_keep_their_path_prefix(serve_app: AppServer) -> None:
    paths: list[str] = []

    async def any_route(request: web.Request) -> web.Response:
        paths.append(request.path)
        if request.path.endswith("/gate"):
            return web.json_response({"ok": True, "engines": []})
        if request.path.endswith("/status"):
            return web.json_response({"engines": []})
        return web.json_response(RESUMED)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    url = await serve_app(app)
    async with Client(url + "/dp/", url + "/dp") as dp:
        await dp.status()
        await dp.gate()
        await dp.resume()
    assert paths == ["/dp/status", "/dp/gate", "/dp/admin/resume"]
