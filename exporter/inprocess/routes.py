"""The plugin's routes on vLLM's own port, as ordinary FastAPI routes (in vLLM's OpenAPI).

Under ``/dp/``: ``status`` (the ``/status`` document, same schema), the status page at ``/dp/``,
``gate``, ``readyz``, ``watch`` (the feed of ``exporter.web.watch``), ``kv_events_targets``
(the ``http_sd`` document of the service's ``/kv_events_targets``) and
``POST /dp/admin/<action>`` for every admin action. And ``GET /metrics`` replaces vLLM's own
route (vLLM lets an endpoint plugin do so) with vLLM's series followed by the ``vllm_dp_*``
series: no new port, no new scrape configuration.

vLLM's ``--api-key`` protects only ``/v1`` routes, so the admin routes refuse to run at all
without the plugin's own token (``VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE``); with it, they take the
admin listener's whole path (constant-time token check, failed attempts throttled, bounded
body, single flight, Idempotency-Key, rate limits, audit). The throttle and the audit take the
connection's peer address, not one a forwarding header put in its place
(``exporter.inprocess.peer``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response, StreamingResponse
from multidict import CIMultiDict

from exporter.base.steps import run_steps_async
from exporter.control.actions import ACTIONS, ActionSpec
from exporter.feed.hub import stream
from exporter.inprocess.peer import FORWARDED_FOR, Peer, request_peer
from exporter.inprocess.runtime import InProcessRuntime
from exporter.web.admin import AdminHttpRequest
from exporter.web.answers import READ_ROUTES, ReadRoute, RouteAnswer, json_answer, not_started
from exporter.web.watch import STREAM_HEADERS, last_event_id, refused

log = logging.getLogger("exporter.inprocess")

PREFIX = "/dp"
TAGS: list[str | Any] = ["dp_exporter"]
NO_TOKEN = (
    "the dp_exporter admin routes need the plugin's own token "
    "(VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE): vLLM's --api-key does not protect them"
)
Handler = Callable[[Request], Awaitable[Response]]


def to_response(answer: RouteAnswer) -> Response:
    """An ``RouteAnswer`` as Starlette's response."""
    headers = {**answer.headers, "Content-Type": answer.content_type}
    return Response(answer.body, status_code=answer.status, headers=headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON as the aiohttp service writes it (``json.dumps``), whatever values it holds."""
    return to_response(json_answer(body, status, headers))


def _unavailable(runtime: InProcessRuntime) -> Response:
    return to_response(not_started(runtime.problem))


def read_handler(runtime: InProcessRuntime, route: ReadRoute) -> Handler:
    """``route``'s answer (``exporter.web.answers``, as the service's) built and written a step
    per turn of vLLM's loop (256 engines' /status: ~360 KB of JSON)."""

    async def handler(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        query = {k: request.query_params.getlist(k) for k in request.query_params}
        return to_response(await route.answer(exporter, query, run_steps_async))

    handler.__name__ = f"dp_{route.name}"
    return handler


class PluginHandlers:
    """The handlers of the plugin's own routes, over one runtime; ``vllm_metrics`` renders
    vLLM's own series (blocking: run off the loop, as vLLM's own handler is). A method's name
    and docstring are its route's name and description in vLLM's OpenAPI schema."""

    def __init__(self, runtime: InProcessRuntime, vllm_metrics: Callable[[], bytes]) -> None:
        self.runtime = runtime
        self.vllm_metrics = vllm_metrics

    async def to_page(self, request: Request) -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=308)

    async def ours(self) -> bytes | None:
        """The ``vllm_dp_*`` series (every API server's, merged), None while the plugin is
        not running; a failure here is logged and never costs vLLM its own series."""
        try:
            return await self.runtime.series()
        except Exception:
            log.exception("dp_exporter: the vllm_dp_* series could not be rendered")
            return b""

    async def metrics(self, request: Request) -> Response:
        """vLLM's series, then ours (absent while the plugin is not running)."""
        ours = await self.ours()
        body = await asyncio.to_thread(self.vllm_metrics) + (ours or b"")
        return Response(body, media_type=None, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def dp_metrics(self, request: Request) -> Response:
        """The ``vllm_dp_*`` series alone (the status page links here; a scrape of its own)."""
        body = await self.ours()
        if body is None:
            return _unavailable(self.runtime)
        return Response(body, media_type=None, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def watch(self, request: Request) -> Response:
        """Every rank's row, then each change, as Server-Sent Events (docs/watch.md): the
        hub's frames, encoded once per change, one write per watcher per wake-up."""
        exporter = self.runtime.exporter
        if exporter is None:
            return _unavailable(self.runtime)
        hub = exporter.feed
        query = {k: request.query_params.getlist(k) for k in request.query_params}
        watcher = hub.connect(last_event_id(request.headers, query))
        if watcher is None:
            return to_response(refused(hub))

        async def frames() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream(hub, watcher):
                    yield chunk
            finally:
                hub.disconnect(watcher)

        return StreamingResponse(frames(), headers=STREAM_HEADERS)

    async def healthz(self, request: Request) -> Response:
        """The plugin answers (the status page links here); /dp/readyz says whether it polls."""
        status = "ok" if self.runtime.exporter is not None else "not running"
        return json_response({"status": status})


@dataclass(frozen=True)
class PluginRoute:
    """One route on vLLM's port: method, path, handler and its place in vLLM's OpenAPI schema
    (``summary`` None: left out of it)."""

    method: str
    path: str
    handler: Handler
    summary: str | None
    response_class: type[Response] | None = None

    def options(self) -> dict[str, Any]:
        """``add_api_route``'s keywords besides the path, the handler and the method."""
        if self.summary is None:
            return {"include_in_schema": False}
        extra = {} if self.response_class is None else {"response_class": self.response_class}
        return {"tags": TAGS, "summary": self.summary, **extra}


def route_table(h: PluginHandlers) -> list[PluginRoute]:
    """Every route the plugin adds, in the order FastAPI matches them."""
    return [
        *(
            PluginRoute(
                "GET",
                f"{PREFIX}{route.path}",
                read_handler(h.runtime, route),
                route.summary,
                # The page is HTML: no JSON response model in vLLM's schema.
                response_class=Response if route.path == "/" else None,
            )
            for route in READ_ROUTES
        ),
        PluginRoute("GET", PREFIX, h.to_page, None),
        PluginRoute("GET", f"{PREFIX}/metrics", h.dp_metrics, "The vllm_dp_* series alone"),
        PluginRoute("GET", f"{PREFIX}/healthz", h.healthz, "The plugin answers"),
        PluginRoute(
            "GET",
            f"{PREFIX}/watch",
            h.watch,
            "Every rank's row, then each change (Server-Sent Events)",
            response_class=StreamingResponse,
        ),
        PluginRoute(
            "GET", "/metrics", h.metrics, "vLLM's metrics and the per-engine vllm_dp_* series"
        ),
        *(
            PluginRoute(
                "POST",
                f"{PREFIX}/admin/{path}",
                admin_route(h.runtime, spec),
                f"Admin action {spec.name}" if path == spec.name else None,
            )
            for spec in ACTIONS.values()
            for path in spec.paths
        ),
    ]


def add_routes(app: FastAPI, runtime: InProcessRuntime, vllm_metrics: Callable[[], bytes]) -> None:
    """Register every route of :func:`route_table` on ``app``. ``vllm_metrics`` renders vLLM's
    own series (blocking: run off the loop, as vLLM's own handler is)."""
    for route in route_table(PluginHandlers(runtime, vllm_metrics)):
        app.add_api_route(route.path, route.handler, methods=[route.method], **route.options())


#: What vLLM's own /metrics answers with (prometheus_client's text format).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def admin_route(runtime: InProcessRuntime, spec: ActionSpec) -> Handler:
    async def handler(request: Request) -> Response:
        admin, exporter = runtime.admin, runtime.exporter
        if admin is None or exporter is None:
            return _unavailable(runtime)
        if exporter.config.admin_token is None:
            return json_response({"error": NO_TOKEN}, status=403)
        client = request.scope.get("client")
        peer = request_peer(request.receive, client, request.headers.raw)
        claimed = FORWARDED_FOR.set(peer.forwarded)  # for this request's audit record
        try:
            status, body, headers = await admin.handle(from_starlette(request, peer), spec)
        finally:
            FORWARDED_FOR.reset(claimed)
        return json_response(body, status=status, headers=headers)

    handler.__name__ = f"dp_admin_{spec.name}"
    return handler


def from_starlette(request: Request, peer: Peer) -> AdminHttpRequest:
    """The guards' view of a Starlette request: header values from the raw bytes (as
    aiohttp hands them over: UTF-8, anything else as surrogate escapes); the remote address
    the connection's peer (None: unknown, one shared throttle key)."""
    headers: CIMultiDict[str] = CIMultiDict(
        (k.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for k, v in request.headers.raw
    )
    query = {k: request.query_params.getlist(k) for k in request.query_params}
    remote = peer.address

    async def read_body(limit: int, timeout_s: float) -> bytes | tuple[int, str]:
        declared = request.headers.get("content-length")
        # ASCII digits only: str.isdigit takes "²", which int() refuses.
        if (
            declared is not None
            and declared.isascii()
            and declared.isdigit()
            and int(declared) > limit
        ):
            return 413, "request body too large"
        received = bytearray()

        async def drain(stream: AsyncIterator[bytes]) -> bool:
            async for chunk in stream:
                received.extend(chunk)
                if len(received) > limit:
                    return False
            return True

        try:
            within = await asyncio.wait_for(drain(request.stream()), timeout_s)
        except asyncio.TimeoutError:
            return 408, "request body not received in time"
        except Exception:  # the client went away mid-body
            return 400, "request body incomplete"
        return bytes(received) if within else (413, "request body too large")

    return AdminHttpRequest(headers, query, remote, read_body)
