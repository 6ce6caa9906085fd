"""A hostile vLLM API server for HTTP mode's tests (a plain target, or a plugin target at
``<url>/dp``): each route answers what the test sets — a JSON document (or one made per request),
a body that never ends, one that drips a byte at a time, one just over a size — and the server
records what it was asked, from which client port, and how much each answer sent before the
client went away. 127.0.0.1, a kernel-chosen port; every stream ends by itself (a size or time
cap), so a client without the fix cannot hold the machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.harness.apiservers import http_config
from tests.harness.service import Service, start_service

HOST = "127.0.0.1"
#: Answers that end in no other way stop here.
STREAM_CAP_BYTES = 256 << 20
STREAM_CAP_S = 30.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class HostileApi:
    """The server, what each route answers (``routes``: path → handler) and what it saw."""

    runner: web.AppRunner | None = None
    url: str = ""
    routes: dict[str, Handler] = field(default_factory=dict)
    asked: Counter[str] = field(default_factory=Counter)
    #: path → the client port of each request (a dropped connection: the next port is new).
    ports: dict[str, list[int]] = field(default_factory=dict)
    #: path → bytes each streamed answer wrote before it ended (or is writing now).
    streamed: dict[str, list[int]] = field(default_factory=dict)
    #: path → streamed answers the client stopped reading (its connection closed).
    abandoned: Counter[str] = field(default_factory=Counter)

    async def start(self) -> HostileApi:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, HOST, 0).start()
        self.url = f"http://{HOST}:{self.runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self.runner is not None:
            await asyncio.wait_for(self.runner.cleanup(), 5)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.asked[path] += 1
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.ports.setdefault(path, []).append(peer[1] if peer else -1)
        handler = self.routes.get(path)
        if handler is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        return await handler(request)

    # -- answers ---------------------------------------------------------------------------

    def json(self, path: str, doc: Any | Callable[[], Any], status: int = 200) -> None:
        """``path`` answers ``doc`` (or ``doc()``, made per request)."""

        async def answer(_: web.Request) -> web.StreamResponse:
            body = doc() if callable(doc) else doc
            return web.json_response(body, status=status)

        self.routes[path] = answer

    def padded(self, path: str, doc: dict[str, Any], size: int) -> None:
        """``path`` answers ``doc`` with a padding key: valid JSON of exactly ``size`` bytes."""
        bare = json.dumps({**doc, "pad": ""}).encode()
        body = json.dumps({**doc, "pad": "x" * (size - len(bare))}).encode()
        assert len(body) == size

        async def answer(_: web.Request) -> web.StreamResponse:
            return web.Response(body=body, content_type="application/json")

        self.routes[path] = answer

    def endless(self, path: str, chunk: int = 512 << 10, pause_s: float = 0.01) -> None:
        """``path`` answers 200 and a body that never ends (about 50 MB/s at most)."""
        self._stream(path, b"[" + b" " * (chunk - 1), b" " * chunk, pause_s)

    def drip(self, path: str, pause_s: float = 0.05) -> None:
        """``path`` answers 200 and then one byte of body every ``pause_s``, never finishing."""
        self._stream(path, b"{", b" ", pause_s)

    def _stream(self, path: str, first: bytes, more: bytes, pause_s: float) -> None:
        async def answer(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            sizes = self.streamed.setdefault(path, [])
            sizes.append(0)
            index = len(sizes) - 1
            started = time.monotonic()
            data = first
            try:
                while sizes[index] < STREAM_CAP_BYTES and time.monotonic() - started < STREAM_CAP_S:
                    await resp.write(data)
                    sizes[index] += len(data)
                    data = more
                    await asyncio.sleep(pause_s)
            except (ConnectionError, RuntimeError):
                self.abandoned[path] += 1  # the client closed the connection
                return resp
            return resp

        self.routes[path] = answer


def gate_doc(ranks: list[int] | range, sleeping: bool = False) -> dict[str, Any]:
    """A ``/dp/gate`` answer of the dp_exporter plugin naming ``ranks``, each awake and well."""
    values = {"sleeping": sleeping, "paused": False, "weight_version": "v1"}
    engines = [{"engine": str(r), "ok": True, "values": values, "failures": []} for r in ranks]
    return {"ok": True, "engines": engines}


def plain_good(api: HostileApi) -> HostileApi:
    """``api`` answers the dev routes HTTP mode polls as an awake vLLM (the other routes 404)."""
    api.json("/is_sleeping", {"is_sleeping": False})
    api.json("/is_paused", {"is_paused": False})
    api.json("/weight_info", {"weight_version": "v1"})
    api.json("/version", {"version": "0.33.0"})
    return api


@contextlib.asynccontextmanager
async def sidecar_over(
    setup: Callable[[int, HostileApi], None], *, plugin: bool, **settings: Any
) -> AsyncIterator[tuple[Service, list[HostileApi]]]:
    """An HTTP-mode exporter over three hostile servers ``t0..t2`` (plugin targets, ``…/dp``,
    when ``plugin``), each set up by ``setup(index, api)`` before the exporter starts; every
    server and the exporter are stopped on the way out."""
    apis = [await HostileApi().start() for _ in range(3)]
    service: Service | None = None
    try:
        for i, api in enumerate(apis):
            setup(i, api)
        suffix = "/dp" if plugin else ""
        targets = [f"t{i}={api.url}{suffix}" for i, api in enumerate(apis)]
        service = await start_service(http_config(targets, gate_min_interval=0, **settings))
        yield service, apis
    finally:
        if service is not None:
            await service.stop()
        for api in apis:
            await api.close()
