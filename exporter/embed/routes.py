"""The plugin's routes on vLLM's own port, as ordinary FastAPI routes (in vLLM's OpenAPI).

Under ``/dp/``: ``status`` (the ``/status`` document, same schema), the status page at ``/dp/``,
``gate``, ``readyz``, ``kv_events_targets`` (the ``http_sd`` document of the service's
``/kv_events_targets``) and ``POST /dp/admin/<action>`` for every admin action. And ``GET /metrics``
replaces vLLM's own route (vLLM lets an endpoint plugin do so) with vLLM's series followed by
the ``vllm_dp_*`` series: no new port, no new scrape configuration.

vLLM's ``--api-key`` protects only ``/v1`` routes, so the admin routes refuse to run at all
without the plugin's own token (``VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE``); with it, they take the
admin listener's whole path (constant-time token check, failed attempts throttled, bounded
body, single flight, Idempotency-Key, rate limits, audit). The throttle and the audit take the
connection's peer address, not one a forwarding header put in its place (``exporter.embed.peer``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from multidict import CIMultiDict

from exporter.control.actions import ACTIONS, ActionSpec
from exporter.embed.peer import FORWARDED_FOR, Peer, request_peer
from exporter.embed.runtime import InProcessRuntime
from exporter.metrics.exposition import render_text
from exporter.metrics.families import Family
from exporter.web.admin import AdminHttpRequest
from exporter.web.app import gate_answer, readiness, status_document
from exporter.web.kvtargets import kv_events_targets
from exporter.web.statuspage import HEADERS as PAGE_HEADERS
from exporter.web.statuspage import render_page

log = logging.getLogger("exporter.inprocess")

PREFIX = "/dp"
TAGS: list[str | Any] = ["dp_exporter"]
NO_TOKEN = (
    "the dp_exporter admin routes need the plugin's own token "
    "(VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE): vLLM's --api-key does not protect them"
)
Handler = Callable[[Request], Awaitable[Response]]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON as the aiohttp service writes it (``json.dumps``), whatever values it holds."""
    return Response(
        json.dumps(body).encode(),
        status_code=status,
        headers=headers,
        media_type="application/json",
    )


def _unavailable(runtime: InProcessRuntime) -> Response:
    return json_response({"ok": False, "error": runtime.problem}, status=503)


def add_routes(app: FastAPI, runtime: InProcessRuntime, vllm_metrics: Callable[[], bytes]) -> None:
    """Register every route on ``app``. ``vllm_metrics`` renders vLLM's own series (blocking:
    run off the loop, as vLLM's own handler is)."""

    async def status(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        return json_response(status_document(exporter), headers={"Cache-Control": "no-store"})

    async def page(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        page_html = render_page(status_document(exporter))
        return Response(page_html, media_type="text/html", headers=PAGE_HEADERS)

    async def to_page(request: Request) -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=308)

    async def gate(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        query = {k: request.query_params.getlist(k) for k in request.query_params}
        code, body = await gate_answer(exporter, query)
        return json_response(body, status=code, headers={"Cache-Control": "no-store"})

    async def readyz(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        code, body = readiness(exporter)
        return json_response(body, status=code)

    async def kv_events(request: Request) -> Response:
        exporter = runtime.exporter
        if exporter is None:
            return _unavailable(runtime)
        doc = kv_events_targets(exporter.poller.snapshot, exporter.config.model_name)
        return json_response(doc, headers={"Cache-Control": "no-store"})

    def ours(own: list[Family] | None) -> bytes:
        """The ``vllm_dp_*`` series (every API server's, merged), or nothing: a failure here
        is logged and never costs vLLM its own series."""
        if own is None:
            return b""
        try:
            return render_text(runtime.merge(own))
        except Exception:
            log.exception("dp_exporter: the vllm_dp_* series could not be rendered")
            return b""

    async def metrics(request: Request) -> Response:
        """vLLM's series, then ours (absent while the plugin is not running)."""
        own = runtime.families()
        body = await asyncio.to_thread(lambda: vllm_metrics() + ours(own))
        return Response(body, media_type=None, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def dp_metrics(request: Request) -> Response:
        """The ``vllm_dp_*`` series alone (the status page links here; a scrape of its own)."""
        own = runtime.families()
        if own is None:
            return _unavailable(runtime)
        body = await asyncio.to_thread(ours, own)
        return Response(body, media_type=None, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def healthz(request: Request) -> Response:
        """The plugin answers (the status page links here); /dp/readyz says whether it polls."""
        return json_response({"status": "ok" if runtime.exporter is not None else "not running"})

    app.add_api_route(
        f"{PREFIX}/status",
        status,
        methods=["GET"],
        tags=TAGS,
        summary="Every DP engine's state (the exporter's /status document)",
    )
    app.add_api_route(
        f"{PREFIX}/",
        page,
        methods=["GET"],
        tags=TAGS,
        summary="The status page",
        response_class=Response,
    )
    app.add_api_route(PREFIX, to_page, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        f"{PREFIX}/metrics",
        dp_metrics,
        methods=["GET"],
        tags=TAGS,
        summary="The vllm_dp_* series alone",
    )
    app.add_api_route(
        f"{PREFIX}/healthz", healthz, methods=["GET"], tags=TAGS, summary="The plugin answers"
    )
    app.add_api_route(
        f"{PREFIX}/gate", gate, methods=["GET"], tags=TAGS, summary="The safe-to-resume gate"
    )
    app.add_api_route(
        f"{PREFIX}/readyz",
        readyz,
        methods=["GET"],
        tags=TAGS,
        summary="Whether every engine answered the last poll",
    )
    app.add_api_route(
        f"{PREFIX}/kv_events_targets",
        kv_events,
        methods=["GET"],
        tags=TAGS,
        summary="Every DP engine's KV-events publisher (Prometheus http_sd)",
    )
    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        tags=TAGS,
        summary="vLLM's metrics and the per-engine vllm_dp_* series",
    )
    for spec in ACTIONS.values():
        app.add_api_route(
            f"{PREFIX}/admin/{spec.name}",
            admin_route(runtime, spec),
            methods=["POST"],
            tags=TAGS,
            summary=f"Admin action {spec.name}",
        )


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
        if declared is not None and declared.isdigit() and int(declared) > limit:
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
