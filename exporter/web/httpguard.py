"""Connection guards for the HTTP listeners: a request-header deadline, a short keep-alive, and
malformed requests counted and logged in one rate-limited line instead of a traceback each.

aiohttp has no header timeout: a client that opens a connection and sends half a request line
(or one byte a second) holds a socket and a handler task for as long as the keep-alive timeout
allows, and older aiohttp versions arm no timer at all before the first request. The guard
gives every connection ``header_timeout_s`` from the moment it is accepted to deliver the
complete headers of its first request, however it drips them, and closes it otherwise. After a
response, an idle or half-sent next request is bounded by ``keepalive_timeout_s`` (aiohttp closes
a connection whose keep-alive expires while no complete request is waiting).

The hooks are the public parts of ``aiohttp.web.Server``: ``connection_made`` /
``connection_lost`` (called by every connection's protocol) and ``request_factory`` (called once
the headers of a request have been parsed).

aiohttp answers a request its parser refuses (a control byte in a header, a 9 KB request line,
``HTTP/9.9``) with a 400 before any handler or middleware runs, and logs each one at ERROR with
a traceback. The runner hands its request handlers a ``logger`` (a documented ``AppRunner``
keyword) that passes those to the app's ``BAD_REQUESTS_KEY`` sink instead, as one line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from aiohttp import web
from aiohttp.http import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("exporter.http")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0
MAX_DETAIL = 160

#: Receives a one-line description of each malformed request (peer bytes escaped, capped).
BadRequestSink = Callable[[str], None]
#: ``app[BAD_REQUESTS_KEY] = sink``: set by an app whose listener counts malformed requests.
BAD_REQUESTS_KEY: web.AppKey[BadRequestSink] = web.AppKey("bad_requests")


def describe(exc: BaseException) -> str:
    """``exc``'s class and message on one line, control characters escaped, capped: the
    message quotes the peer's bytes."""
    text = " ".join(str(getattr(exc, "message", "") or exc).split())
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    if len(text) > MAX_DETAIL:
        text = text[: MAX_DETAIL - 3] + "..."
    return f"{type(exc).__name__}: {text}"


class BadRequestLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The logger of a listener's request handlers: a request the parser refused (logged by
    aiohttp with the ``HttpProcessingError`` as ``exc_info``) goes to ``sink``; every other
    record (a handler's exception, a 500) reaches aiohttp's logger as before."""

    def __init__(self, sink: BadRequestSink, logger: logging.Logger | None = None) -> None:
        super().__init__(logger or logging.getLogger("aiohttp.server"), None)
        self._sink = sink

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, tuple):
            exc = exc[1]
        if isinstance(exc, HttpProcessingError):
            peer = args[0] if len(args) == 1 and isinstance(args[0], str) else None
            self._sink(describe(exc) + (f" (from {peer})" if peer else ""))
            return
        super().log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return msg, kwargs  # no ``extra`` of our own


class HeaderDeadline:
    """Per-connection watchdogs on one ``web.Server``: close connections whose first request's
    headers are not complete ``timeout_s`` after the connection was accepted."""

    def __init__(self, server: web.Server, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("header timeout must be greater than 0")
        self.timeout_s = timeout_s
        self.closed_connections = 0
        self._timers: dict[RequestHandler, asyncio.TimerHandle] = {}
        self._inner_made = server.connection_made
        self._inner_lost = server.connection_lost
        self._inner_factory = server.request_factory
        # Instance attributes shadow the methods: every connection calls these.
        server.connection_made = self._connection_made  # type: ignore[method-assign]
        server.connection_lost = self._connection_lost  # type: ignore[method-assign]
        server.request_factory = self._request_factory

    @property
    def watched(self) -> int:
        """Connections still waiting for their first request's headers."""
        return len(self._timers)

    def _connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self._inner_made(handler, transport)
        loop = asyncio.get_running_loop()
        self._timers[handler] = loop.call_later(self.timeout_s, self._expire, handler)

    def _connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        timer = self._timers.pop(handler, None)
        if timer is not None:
            timer.cancel()
        self._inner_lost(handler, exc)

    def _request_factory(self, message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
        timer = self._timers.pop(protocol, None)
        if timer is not None:
            timer.cancel()
        return self._inner_factory(message, payload, protocol, *args)

    def _expire(self, handler: RequestHandler) -> None:
        if self._timers.pop(handler, None) is None:
            return
        self.closed_connections += 1
        log.debug("closing a connection that sent no complete request headers in time")
        handler.force_close()


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose server enforces a header deadline and a short keep-alive, and
    whose request handlers report malformed requests to the app's ``BAD_REQUESTS_KEY`` sink."""

    def __init__(
        self,
        app: web.Application,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        if keepalive_timeout_s <= 0:
            raise ValueError("keep-alive timeout must be greater than 0")
        sink = app.get(BAD_REQUESTS_KEY)
        if sink is not None:
            kwargs.setdefault("logger", BadRequestLog(sink))
        super().__init__(app, keepalive_timeout=keepalive_timeout_s, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_deadline: HeaderDeadline | None = None

    async def setup(self) -> None:
        """Set up as ``web.AppRunner`` does, then guard its (public, read-only) ``server``
        before any site starts accepting connections."""
        await super().setup()
        server = self.server
        assert server is not None
        self.header_deadline = HeaderDeadline(server, self.header_timeout_s)


def guarded_runner(
    app: web.Application,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
    **runner_kwargs: Any,
) -> GuardedAppRunner:
    """A runner for ``app`` with both guards; other keyword arguments go to ``web.AppRunner``
    (``access_log``, ``shutdown_timeout``, ``handler_cancellation``, ...)."""
    return GuardedAppRunner(
        app,
        header_timeout_s=header_timeout_s,
        keepalive_timeout_s=keepalive_timeout_s,
        **runner_kwargs,
    )
