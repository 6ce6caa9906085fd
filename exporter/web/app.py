"""The HTTP service: ``create_app(config)`` → /metrics, /healthz, /watch (``exporter.web.watch``)
and the read routes of ``exporter.web.answers`` (/status, ``/``, /gate, /readyz, /routable,
/kv_events_targets).

Background work (the attach client, the poller, the admin listener) lives in ``cleanup_ctx``, so
a test can start and stop the whole service in-process with aiohttp's own runner.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from exporter.base.ports import url_host
from exporter.config.settings import ServeConfig
from exporter.control.runtime import Exporter
from exporter.error import StartupError
from exporter.metrics.negotiation import VARY, wants_gzip
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.web.answers import READ_ROUTES, ReadRoute, RouteAnswer, at_once
from exporter.web.basicauth import protect
from exporter.web.httpguard import BAD_REQUESTS_KEY, guarded_runner
from exporter.web.watch import serve_watch

log = logging.getLogger("exporter.server")

EXPORTER_KEY = web.AppKey("exporter", Exporter)
ADMIN_URL_KEY = web.AppKey("admin_url", str)
MAX_REQUEST_BYTES = 16 * 1024


async def metrics(request: web.Request) -> web.Response:
    """Text format or OpenMetrics, gzip or not (``exporter.metrics.negotiation``); never a 406."""
    exporter = request.app[EXPORTER_KEY]
    use_gzip = wants_gzip(request.headers.get("Accept-Encoding", ""))
    body, content_type = exporter.render_metrics(request.headers.get("Accept", ""), use_gzip)
    headers = {"Content-Type": content_type, "Vary": VARY}
    if use_gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def watch(request: web.Request) -> web.StreamResponse:
    """Every rank's row, then each change, as Server-Sent Events (``exporter.web.watch``)."""
    return await serve_watch(request, request.app[EXPORTER_KEY].feed)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def to_response(answer: RouteAnswer) -> web.Response:
    """An ``RouteAnswer`` as aiohttp's response."""
    headers = {**answer.headers, "Content-Type": answer.content_type}
    return web.Response(body=answer.body, status=answer.status, headers=headers)


def read_handler(route: ReadRoute) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``route``'s answer over this app's exporter, every step at once."""

    async def handler(request: web.Request) -> web.Response:
        query = {k: request.query.getall(k) for k in request.query}
        return to_response(await route.answer(request.app[EXPORTER_KEY], query, at_once))

    handler.__name__ = route.name
    return handler


def create_app(config: ServeConfig, exporter: Exporter | None = None) -> web.Application:
    """The main application; its cleanup context runs the exporter and the admin listener."""
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[EXPORTER_KEY] = exporter = exporter if exporter is not None else Exporter(config)
    app[BAD_REQUESTS_KEY] = exporter.faults.http_listener("metrics")
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    for route in READ_ROUTES:  # the same answers as the plugin's under /dp
        app.router.add_get(route.path, read_handler(route))
    app.router.add_get("/watch", watch)
    # --web-config-file: basic auth on every path but /healthz and /readyz (TLS: the site's).
    protect(app, config.web)
    app.cleanup_ctx.append(_run_exporter)
    app.cleanup_ctx.append(_run_admin_listener)
    return app


async def _run_exporter(app: web.Application) -> AsyncIterator[None]:
    exporter = app[EXPORTER_KEY]
    try:
        await exporter.start()
    except BaseException:
        # Close what did start (sockets bound before the failing one) before reporting.
        with contextlib.suppress(Exception):
            await exporter.stop()
        raise
    yield
    await exporter.stop()


async def _run_admin_listener(app: web.Application) -> AsyncIterator[None]:
    exporter = app[EXPORTER_KEY]
    where = exporter.config.admin_host_port
    if where is None:
        yield
        return
    admin_app = create_admin_app(exporter)
    # At shutdown the in-flight action has had its grace (``ADMIN_SHUTDOWN_KEY``): then one
    # second for the rest, as the main listener (aiohttp's default would wait 60 s for a client
    # that keeps calling on a kept-alive connection).
    runner = guarded_runner(
        admin_app, access_log=None, handler_cancellation=False, shutdown_timeout=1.0
    )
    await runner.setup()
    web_config = exporter.config.web
    tls = web_config.ssl_context if web_config is not None else None
    site = web.TCPSite(runner, where[0], where[1], ssl_context=tls)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(
            f"--admin-listen {exporter.config.admin_listen}: {exc.strerror or exc}"
        ) from None
    port = runner.addresses[0][1] if runner.addresses else where[1]
    app[ADMIN_URL_KEY] = f"{'https' if tls else 'http'}://{url_host(where[0])}:{port}"
    yield
    await admin_app[ADMIN_SHUTDOWN_KEY]()
    await runner.cleanup()


@dataclass
class RunningService:
    """A started service: its runner, where it listens, and how to stop it."""

    app: web.Application
    runner: web.AppRunner
    #: ``http(s)://host:port`` of /metrics (the port the OS chose when the config said 0).
    url: str
    #: The admin listener's URL, None when ``admin_listen`` is off.
    admin_url: str | None

    @property
    def exporter(self) -> Exporter:
        return self.app[EXPORTER_KEY]

    async def stop(self) -> None:
        """Drain an in-flight admin action, stop polling, close every listener."""
        await self.runner.cleanup()


async def start_service(config: ServeConfig, exporter: Exporter | None = None) -> RunningService:
    """``create_app(config, exporter)`` started and listening on ``config.listen`` (and the
    admin listener on ``config.admin_listen``) in the running event loop: what ``serve`` runs,
    and what ``exporter.inprocess.start_exporter`` runs inside a trainer's process. A socket that
    cannot be bound raises ``StartupError`` (one line) with nothing left running."""
    app = create_app(config, exporter)
    runner = guarded_runner(app, access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()  # starts the exporter, binds the engine-facing sockets, the admin
        host, port = config.listen_host_port
        tls = config.web.ssl_context if config.web is not None else None
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"--listen {config.listen}: {exc.strerror or exc}") from None
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    url = f"{'https' if tls is not None else 'http'}://{shown}:{bound}"
    return RunningService(app, runner, url, app.get(ADMIN_URL_KEY))
