"""``GET /watch``: every rank's row as Server-Sent Events (``exporter.feed``; docs/watch.md).

The service's route; the plugin's ``/dp/watch`` streams the same hub's frames through
Starlette (``exporter.inprocess.routes``). Both take ``Last-Event-ID`` from the header, or from
``?last_event_id=`` for clients that cannot set one, and answer 503 beyond ``--max-watchers``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

from aiohttp import web

from exporter.feed.hub import WatchHub, stream
from exporter.feed.sse import EVENT_STREAM
from exporter.web.answers import RouteAnswer, json_answer

#: The feed's response headers (``X-Accel-Buffering``: a proxy in front must not buffer it).
STREAM_HEADERS = {
    "Content-Type": EVENT_STREAM,
    "Cache-Control": "no-store",
    "X-Accel-Buffering": "no",
}


def last_event_id(headers: Mapping[str, str], query: Mapping[str, list[str]]) -> str | None:
    """The id a client resumes from: the ``Last-Event-ID`` header, else ``?last_event_id=``."""
    header = headers.get("Last-Event-ID")
    if header is not None:
        return header
    values = query.get("last_event_id") or []
    return values[0] if len(values) == 1 else None


def refused(hub: WatchHub) -> RouteAnswer:
    """The answer beyond ``--max-watchers`` (counted by the hub)."""
    body = {
        "ok": False,
        "error": f"at most {hub.max_watchers} watchers at once (--max-watchers)",
    }
    return json_answer(body, status=503, headers={"Retry-After": "5"})


async def serve_watch(request: web.Request, hub: WatchHub) -> web.StreamResponse:
    """Stream ``hub`` to ``request``'s client until it leaves, the hub drops it, or the
    exporter stops."""
    query = {k: request.query.getall(k) for k in request.query}
    watcher = hub.connect(last_event_id(request.headers, query))
    if watcher is None:
        answer = refused(hub)
        headers = {**answer.headers, "Content-Type": answer.content_type}
        return web.Response(body=answer.body, status=answer.status, headers=headers)
    watcher.on_drop = _closer(request)
    response = web.StreamResponse(headers=STREAM_HEADERS)
    try:
        await response.prepare(request)
        async for chunk in stream(hub, watcher, _gone(request)):
            await response.write(chunk)
    except (ConnectionError, RuntimeError):
        pass  # the client went away mid-write (or the transport was closed under us)
    finally:
        hub.disconnect(watcher)
    return response


def _gone(request: web.Request) -> Callable[[], bool]:
    """Whether the client closed the connection (aiohttp does not cancel the handler)."""

    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


def _closer(request: web.Request) -> Callable[[], None]:
    def close() -> None:
        transport = request.transport
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.abort()

    return close
