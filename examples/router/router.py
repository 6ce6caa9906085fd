"""A small router in front of ONE vLLM front end (``vllm serve --data-parallel-size N``) that
keeps traffic off the DP ranks the exporter says are not routable (README.md, docs/routing.md).

It follows the exporter's feed (``GET /watch`` on the service, ``GET /dp/watch`` on vLLM's port
with the plugin; docs/watch.md) and keeps every rank's last row. Each ``POST /v1/completions``
or ``/v1/chat/completions`` goes to the routable rank with the lowest load, pinned with vLLM's
``X-data-parallel-rank`` header: the load is vLLM's own score, the larger of the rank's
running + waiting requests (as the exporter last saw them) and this router's requests in
flight to it, so a burst spreads before the next poll; ties go round robin. The answer is
passed through as it comes (a stream chunk by chunk).

- No rank routable: 503, answered here; the request is not sent.
- The feed quiet for ``stale_after_s`` (no event, no heartbeat; heartbeats come every 5 s):
  the rows are not trusted any more and requests go without the header, balanced by vLLM.
- Nothing is retried: a request that may have reached an engine is never sent again. A
  connection that could not be opened is a 502; an answer cut off midway is cut off here too.
- The feed is resumed with ``Last-Event-ID`` after a dropped connection (the exporter sends
  what was missed, or a fresh snapshot that replaces the table once complete).
- ``GET /stats``: requests per rank and the view of every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("examples.router")

#: vLLM's request header naming the DP rank a request runs on (vLLM 0.30 to 0.34).
DP_RANK_HEADER = "X-data-parallel-rank"
#: The OpenAI routes forwarded.
ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Request headers not forwarded (hop-by-hop, or set again for the upstream).
DROPPED_REQUEST_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "host",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        DP_RANK_HEADER.lower(),
    }
)
#: Response headers not passed back (hop-by-hop; aiohttp frames the body itself).
DROPPED_RESPONSE_HEADERS = frozenset(
    {"connection", "keep-alive", "trailer", "transfer-encoding", "upgrade"}
)
#: The most ranks kept from a feed (a hostile or broken feed cannot grow the router).
MAX_RANKS = 4096


@dataclass(frozen=True)
class RouterConfig:
    """``upstream``: vLLM's URL; ``watch``: the feed's URL; ``first_rank``: the DP rank of the
    front end's first engine (0 behind ``vllm serve --data-parallel-size N``; under hybrid or
    external load balancing vLLM's header counts the front end's own engines from 0)."""

    upstream: str
    watch: str
    first_rank: int = 0
    stale_after_s: float = 15.0
    reconnect_s: float = 1.0
    max_reconnect_s: float = 10.0
    connect_timeout_s: float = 10.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_connections: int = 1024


@dataclass(frozen=True)
class SseEvent:
    event: str
    id: str | None
    data: str


class FeedError(Exception):
    """The feed answered something other than an event stream, or ended."""


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[SseEvent]:
    """The events of a Server-Sent Events body (a line over aiohttp's limit raises
    ``ValueError``)."""
    event: str = "message"
    ident: str | None = None
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line:
            if data:
                yield SseEvent(event, ident, "\n".join(data))
            event, ident, data = "message", None, []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "id":
                ident = value
            elif name == "data":
                data.append(value)


def header_rank(engine: str, first_rank: int) -> int | None:
    """The ``X-data-parallel-rank`` of the feed's ``engine`` label: its DP rank (the label in
    owner, relay and in-process mode; ``target/rank`` behind a plugin-enabled HTTP target)
    minus ``first_rank``; None for a label that names no rank of this front end."""
    tail = engine.rsplit("/", 1)[-1]
    if not (tail.isascii() and tail.isdigit()):
        return None
    local = int(tail) - first_rank
    return local if local >= 0 else None


def _load(row: dict[str, Any]) -> int:
    counts = [row.get("running"), row.get("waiting")]
    return sum(c for c in counts if isinstance(c, int) and c > 0)


def _error(status: int, kind: str, message: str, **headers: str) -> web.Response:
    """vLLM's error envelope."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, headers=headers)


class Router:
    """The feed's table, the choice of a rank, the forwarding and the counts."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        #: Engine label → its last row; ``engines``: the labels in the feed's order.
        self.rows: dict[str, dict[str, Any]] = {}
        self.engines: list[str] = []
        self.last_event_id: str | None = None
        self.last_event_at: float | None = None
        self.feed_connected = False
        self.feed_connects = 0
        self.feed_errors = 0
        self.last_feed_error: str | None = None
        self.inflight: Counter[str] = Counter()
        #: Engine label → requests sent to it; requests sent without a rank; refused (503);
        #: failed upstream (502, or cut off).
        self.requests: Counter[str] = Counter()
        self.unpinned = 0
        self.refused = 0
        self.failed = 0
        self._turn = 0
        self._pending: tuple[list[str], dict[str, dict[str, Any]]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._feed: asyncio.Task[None] | None = None

    # -- the feed ------------------------------------------------------------------------------

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.config.max_connections)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # the bytes pass through as vLLM sent them
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
        )
        self._feed = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._feed is not None:
            self._feed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feed
        if self._session is not None:
            await self._session.close()

    async def _follow(self) -> None:
        """Read the feed for ever, resuming after every dropped connection."""
        assert self._session is not None
        c = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=c.connect_timeout_s, sock_read=c.stale_after_s
        )
        delay = c.reconnect_s
        while True:
            delivered = False
            headers = {"Accept": "text/event-stream"}
            if self.last_event_id is not None:
                headers["Last-Event-ID"] = self.last_event_id
            try:
                async with self._session.get(c.watch, headers=headers, timeout=timeout) as resp:
                    if resp.status != 200 or resp.content_type != "text/event-stream":
                        raise FeedError(f"{resp.status} {resp.content_type}")
                    self.feed_connected = True
                    self.feed_connects += 1
                    async for event in sse_events(resp.content):
                        delivered = True
                        self._apply(event)
                    raise FeedError("the feed ended")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, FeedError) as exc:
                self.feed_errors += 1
                self.last_feed_error = f"{type(exc).__name__}: {exc}"
                log.warning("feed %s: %s; reconnecting", c.watch, self.last_feed_error)
            finally:
                self.feed_connected = False
            delay = c.reconnect_s if delivered else min(2 * delay, c.max_reconnect_s)
            await asyncio.sleep(delay)

    def _apply(self, event: SseEvent) -> None:
        if event.id:
            self.last_event_id = event.id
        self.last_event_at = time.monotonic()
        if event.event not in ("snapshot", "rank"):
            return  # a heartbeat: the feed is alive
        try:
            data = json.loads(event.data)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        if event.event == "snapshot":
            engines = data.get("engines")
            names = [str(e) for e in engines][:MAX_RANKS] if isinstance(engines, list) else []
            self._pending = (names, {})
            self._complete_snapshot()
            return
        engine = data.get("engine")
        if not isinstance(engine, str):
            return
        if self._pending is not None:
            self._pending[1][engine] = data
            self._complete_snapshot()
        elif data.get("state") == "gone":
            self.rows.pop(engine, None)
            if engine in self.engines:
                self.engines.remove(engine)
        elif engine in self.rows or len(self.rows) < MAX_RANKS:
            if engine not in self.rows:
                self.engines.append(engine)
            self.rows[engine] = data

    def _complete_snapshot(self) -> None:
        """A fresh snapshot replaces the table once every rank it lists has its row."""
        assert self._pending is not None
        names, rows = self._pending
        if all(name in rows for name in names):
            self.engines, self.rows, self._pending = names, {n: rows[n] for n in names}, None

    def fresh(self) -> bool:
        at = self.last_event_at
        return at is not None and time.monotonic() - at <= self.config.stale_after_s

    # -- the choice ----------------------------------------------------------------------------

    def routable(self) -> list[str]:
        """The labels of the ranks to send traffic to, in rank order."""
        first = self.config.first_rank
        found = [
            (rank, engine)
            for engine, row in self.rows.items()
            if row.get("routable") is True and (rank := header_rank(engine, first)) is not None
        ]
        return [engine for _, engine in sorted(found)]

    def pick(self) -> str | None:
        """The routable rank with the lowest load (vLLM's score: the larger of its running +
        waiting and this router's requests in flight to it), ties round robin; None: none."""
        candidates = self.routable()
        if not candidates:
            return None
        start = self._turn % len(candidates)
        self._turn += 1
        order = candidates[start:] + candidates[:start]
        return min(order, key=lambda e: max(self.inflight[e], _load(self.rows[e])))

    # -- forwarding ----------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in DROPPED_REQUEST_HEADERS
        }
        if not self.fresh():
            self.unpinned += 1  # no trusted view: vLLM balances it
            return await self._forward(request, body, headers)
        engine = self.pick()
        if engine is None:
            self.refused += 1
            why = "; ".join(
                f"{e}: {', '.join(map(str, self.rows[e].get('reasons') or ['not routable']))}"
                for e in self.engines
                if e in self.rows
            )
            message = f"no routable DP rank ({why or 'no rank known'})"
            return _error(503, "ServiceUnavailableError", message, **{"Retry-After": "1"})
        rank = header_rank(engine, self.config.first_rank)
        headers[DP_RANK_HEADER] = str(rank)
        self.requests[engine] += 1
        self.inflight[engine] += 1
        try:
            return await self._forward(request, body, headers)
        finally:
            self.inflight[engine] -= 1

    async def _forward(
        self, request: web.Request, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        assert self._session is not None
        url = self.config.upstream.rstrip("/") + request.path_qs
        resp: web.StreamResponse | None = None
        try:
            async with self._session.post(url, data=body, headers=headers) as up:
                resp = web.StreamResponse(status=up.status, reason=up.reason)
                for key, value in up.headers.items():
                    if key.lower() not in DROPPED_RESPONSE_HEADERS:
                        resp.headers.add(key, value)
                with contextlib.suppress(ConnectionError):  # the client left: leaving the
                    await resp.prepare(request)  # block closes the request to vLLM (it aborts)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                return resp
        except aiohttp.ClientConnectorError as exc:  # never sent: nothing reached vLLM
            self.failed += 1
            return _error(502, "BadGatewayError", f"vLLM unreachable: {exc}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # It may have reached an engine: never sent again. Cut off here too.
            self.failed += 1
            if resp is None or not resp.prepared:
                return _error(502, "BadGatewayError", f"vLLM's answer failed: {exc!r}")
            if request.transport is not None:
                request.transport.abort()
            return resp

    # -- the app -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        age = None if self.last_event_at is None else time.monotonic() - self.last_event_at
        ranks = [
            {
                "engine": e,
                "header": header_rank(e, self.config.first_rank),
                "routable": self.rows[e].get("routable") is True,
                "reasons": self.rows[e].get("reasons"),
                "running": self.rows[e].get("running"),
                "waiting": self.rows[e].get("waiting"),
                "inflight": self.inflight[e],
                "requests": self.requests[e],
            }
            for e in self.engines
            if e in self.rows
        ]
        return {
            "upstream": self.config.upstream,
            "feed": {
                "url": self.config.watch,
                "connected": self.feed_connected,
                "fresh": self.fresh(),
                "connects": self.feed_connects,
                "errors": self.feed_errors,
                "last_error": self.last_feed_error,
                "last_event_id": self.last_event_id,
                "age_seconds": None if age is None else round(age, 3),
            },
            "requests": dict(self.requests),
            "unpinned": self.unpinned,
            "refused": self.refused,
            "failed": self.failed,
            "ranks": ranks,
        }

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for path in ROUTES:
            app.router.add_post(path, self.handle)
        app.router.add_get("/stats", self._stats)
        return app


async def serve(router: Router, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start ``router`` (its feed) and serve it; returns the runner and its URL. Stop with
    ``await runner.cleanup()`` then ``await router.close()``."""
    await router.start()
    runner = web.AppRunner(router.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, f"http://{host}:{bound}"
