"""The HTTP service: ``create_app(config)`` → /metrics, /healthz, /readyz, /status, /gate,
/routable,
/kv_events_targets and ``/``.

Background work (the attach client, the poller, the admin listener) lives in ``cleanup_ctx``, so
a test can start and stop the whole service in-process with aiohttp's own runner.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.base.ports import url_host
from exporter.base.steps import Steps, run_steps
from exporter.client.observe import unexpected_engines
from exporter.config.settings import ServeConfig
from exporter.control.gate import GateRequestError, parse_conditions
from exporter.control.runtime import Exporter
from exporter.error import StartupError
from exporter.metrics.negotiation import VARY, wants_gzip
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.web.basicauth import protect
from exporter.web.httpguard import BAD_REQUESTS_KEY, guarded_runner
from exporter.web.kvtargets import kv_events_targets
from exporter.web.routabledoc import engine_readiness, routable_document
from exporter.web.statusdoc import status_steps
from exporter.web.statuspage import HEADERS as PAGE_HEADERS
from exporter.web.statuspage import page_steps

log = logging.getLogger("exporter.server")

EXPORTER_KEY = web.AppKey("exporter", Exporter)
ADMIN_URL_KEY = web.AppKey("admin_url", str)
MAX_REQUEST_BYTES = 16 * 1024
#: ``GET /routable`` is computed from the last poll: a router polling it every second may cache.
ROUTABLE_CACHE = "max-age=1"


async def metrics(request: web.Request) -> web.Response:
    """Text format or OpenMetrics, gzip or not (``exporter.metrics.negotiation``); never a 406."""
    exporter = request.app[EXPORTER_KEY]
    use_gzip = wants_gzip(request.headers.get("Accept-Encoding", ""))
    body, content_type = exporter.render_metrics(request.headers.get("Accept", ""), use_gzip)
    headers = {"Content-Type": content_type, "Vary": VARY}
    if use_gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def gate(request: web.Request) -> web.Response:
    """The safe-to-resume gate (``exporter.control.gate``): JSON in every case."""
    query = {k: request.query.getall(k) for k in request.query}
    status, body = await gate_answer(request.app[EXPORTER_KEY], query)
    return web.json_response(body, status=status, headers={"Cache-Control": "no-store"})


async def gate_answer(exporter: Exporter, query: Mapping[str, list[str]]) -> tuple[int, Any]:
    """The gate's status and JSON body for ``query`` (400 for a bad one), whichever server
    received it (this app, or the plugin's routes on vLLM's port)."""
    try:
        conditions = parse_conditions(query)
    except GateRequestError as exc:
        return 400, {"ok": False, "error": str(exc)}
    return await exporter.gate.check(conditions)


def readiness(exporter: Exporter, engines: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    """``/readyz``: 200 when every expected engine answered the last poll, else 503;
    ``/readyz?engine=N``: 200 while rank N is routable (``routabledoc.engine_readiness``)."""
    snap = exporter.poller.snapshot
    if engines:
        if len(engines) > 1:
            return 400, {"error": "engine given more than once"}
        return engine_readiness(snap, engines[0])
    body = {
        "ready": snap.ready,
        "engines_expected": snap.expected,
        "engines_connected": snap.connected,
        "last_poll": snap.poll_number,
    }
    return (200 if snap.ready else 503), body


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    status, body = readiness(request.app[EXPORTER_KEY], request.query.getall("engine", []))
    return web.json_response(body, status=status)


async def routable(request: web.Request) -> web.Response:
    """Every rank's routable verdict from the last poll (``routabledoc.routable_document``)."""
    doc = routable_document(request.app[EXPORTER_KEY].poller.snapshot)
    return web.json_response(doc, headers={"Cache-Control": ROUTABLE_CACHE})


def status_document_steps(exporter: Exporter) -> Steps[dict[str, Any]]:
    """The ``/status`` document (and the page's data) of ``exporter`` now, in steps
    (``exporter.base.steps``): run at once here, a step per loop turn in the plugin."""
    poller = exporter.poller
    return status_steps(
        poller.snapshot,
        exporter.config,
        exporter.stats,
        poller.history,
        unexpected=unexpected_engines(exporter.client.observations),
    )


async def status(request: web.Request) -> web.Response:
    """The fleet as JSON (``exporter.web.statusdoc``; schema: docs/status.schema.json)."""
    doc = run_steps(status_document_steps(request.app[EXPORTER_KEY]))
    return web.json_response(doc, headers={"Cache-Control": "no-store"})


async def kv_events(request: web.Request) -> web.Response:
    """Every engine's KV-events publisher, an ``http_sd`` document (``exporter.web.kvtargets``)."""
    exporter = request.app[EXPORTER_KEY]
    doc = kv_events_targets(exporter.poller.snapshot, exporter.config.model_name)
    return web.json_response(doc, headers={"Cache-Control": "no-store"})


async def index(request: web.Request) -> web.Response:
    """The incident view (``exporter.web.statuspage``), from the same document as /status."""
    return web.Response(
        text=run_steps(page_steps(run_steps(status_document_steps(request.app[EXPORTER_KEY])))),
        content_type="text/html",
        headers=PAGE_HEADERS,
    )


def create_app(config: ServeConfig, exporter: Exporter | None = None) -> web.Application:
    """The main application; its cleanup context runs the exporter and the admin listener."""
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[EXPORTER_KEY] = exporter = exporter if exporter is not None else Exporter(config)
    app[BAD_REQUESTS_KEY] = exporter.faults.http_listener("metrics")
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/gate", gate)
    app.router.add_get("/routable", routable)
    app.router.add_get("/kv_events_targets", kv_events)
    app.router.add_get("/", index)
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
    runner = guarded_runner(admin_app, access_log=None, handler_cancellation=False)
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
