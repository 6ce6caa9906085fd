"""The plugin's admin throttle and audit take the connection's peer, not ``X-Forwarded-For``.

vLLM's launcher serves its app with uvicorn's defaults: ``proxy_headers`` on and the header
trusted from loopback, so uvicorn rewrites the client address to whatever the header says. A
guesser on the host rotating the header must still meet the failed-token throttle (5 x 401,
then 429), and the audit must record the loopback peer as ``client``, the header's address only
labelled ``forwarded_for``. With a middleware that hides the connection (Starlette's
``BaseHTTPMiddleware``), a request with a forwarding header has an unknown peer: one shared
throttle bucket, never a header's value. Real uvicorn on 127.0.0.1, real HTTP.
"""

from __future__ import annotations

import contextlib
import logging
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from exporter.base.logs import AUDIT_LOGGER, FIELDS_ATTR
from exporter.inprocess.plugin import DpExporterPlugin
from tests.harness.inprocess import start_sim_vllm_fleet
from tests.harness.plugin_app import TOKEN, WAIT_S, serve, server_url, stop_server

GUESSES = 200
ACTION = "reset_prefix_cache"


@pytest.fixture
def token_env(env: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's token file set; uvicorn's trusted proxies its default (loopback)."""
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    env(ADMIN_TOKEN_FILE=str(path))
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)


async def echo_client(request: Request) -> Response:
    """What uvicorn made of the client address (the premise: it trusts the header)."""
    client = request.client
    return JSONResponse({"client": client.host if client is not None else None})


@contextlib.asynccontextmanager
async def plugin_server(*, hide_transport: bool = False) -> AsyncIterator[str]:
    """The plugin's app over two simulated engines, served as vLLM serves it (uvicorn's
    defaults: proxy headers on); ``hide_transport``: behind a ``BaseHTTPMiddleware``, which
    hands the routes a ``receive`` of its own. Yields the base URL."""
    fleet = await start_sim_vllm_fleet(2)
    try:
        app = FastAPI()
        app.add_api_route("/echo-client", echo_client, methods=["GET"])
        if hide_transport:

            async def passthrough(
                request: Request, call_next: Callable[[Request], Awaitable[Response]]
            ) -> Response:
                return await call_next(request)

            app.middleware("http")(passthrough)
        plugin = DpExporterPlugin()
        plugin.attach_router(app)
        await plugin.init_state(fleet.llm, app.state, Namespace())
        assert plugin.runtime.exporter is not None, plugin.runtime.problem
        server, task = await serve(app)
        assert server.config.proxy_headers  # vLLM's launcher leaves uvicorn's default
        try:
            yield server_url(server)
        finally:
            await stop_server(server, task)
            await plugin.runtime.stop()
    finally:
        await fleet.stop()


async def post(
    http: aiohttp.ClientSession, url: str, token: str, forwarded: str | None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"}
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    async with http.post(f"{url}/dp/admin/{ACTION}", headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def audits(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [getattr(r, FIELDS_ATTR) for r in caplog.records if r.name == AUDIT_LOGGER]


async def guess(url: str) -> list[int]:
    """GUESSES wrong tokens from 127.0.0.1, each claiming another forwarded address."""
    statuses = []
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i in range(GUESSES):
            forwarded = f"203.0.{113 + i // 250}.{i % 250 + 1}"
            status, _ = await post(http, url, "wrong-token", forwarded)
            statuses.append(status)
    return statuses


async def test_rotating_forwarded_for_is_throttled_and_audited_as_the_peer(
    token_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    async with plugin_server() as url:
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            headers = {"X-Forwarded-For": "203.0.113.66"}
            async with http.get(f"{url}/echo-client", headers=headers) as resp:
                rewritten = (await resp.json())["client"]
            assert rewritten == "203.0.113.66"  # uvicorn believed the header
            caplog.clear()
            status, body = await post(http, url, "wrong-token", "203.0.113.66")
            assert status == 401, body
        first = audits(caplog)
        assert len(first) == 1, first
        assert first[0]["client"] == "127.0.0.1", first
        assert first[0]["forwarded_for"] == "203.0.113.66", first
        assert first[0]["outcome"] == "unauthorized"

        statuses = await guess(url)
        # One failure was spent above: 4 more answers 401, then every guess 429.
        assert statuses[:4] == [401] * 4, statuses[:10]
        assert set(statuses[4:]) == {429}, statuses[:10]
        records = audits(caplog)
        assert {r["client"] for r in records} == {"127.0.0.1"}
        assert all(r["forwarded_for"].startswith("203.0.") for r in records)
        assert not any(TOKEN in str(r) or "wrong-token" in str(r) for r in records)

        async with aiohttp.ClientSession(timeout=timeout) as http:
            status, body = await post(http, url, TOKEN, "198.51.100.7")
        assert status == 200, body  # the right token is never throttled
        last = audits(caplog)[-1]
        assert last["client"] == "127.0.0.1" and last["forwarded_for"] == "198.51.100.7"


async def test_a_hidden_connection_with_a_forwarded_header_is_one_unknown_source(
    token_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a middleware that hides uvicorn's transport: fail closed."""
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    async with plugin_server(hide_transport=True) as url:
        statuses = await guess(url)
        assert statuses[:5] == [401] * 5, statuses[:10]
        assert set(statuses[5:]) == {429}, statuses[:10]
        records = audits(caplog)
        assert {r["client"] for r in records} == {"unknown"}
        assert records[0]["forwarded_for"] == "203.0.113.1"
        # Without a forwarding header nothing rewrote the address: the peer is believed, and
        # its own bucket is not the unknown one.
        caplog.clear()
        timeout = aiohttp.ClientTimeout(total=WAIT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            status, body = await post(http, url, "wrong-token", None)
        assert status == 401, body
        (plain,) = audits(caplog)
        assert plain["client"] == "127.0.0.1" and "forwarded_for" not in plain
