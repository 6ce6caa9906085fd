"""Connection guards for the HTTP listeners: a request-header deadline and a short keep-alive.

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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("exporter.http")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 15.0


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
    """``web.AppRunner`` whose server enforces a header deadline and a short keep-alive."""

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
