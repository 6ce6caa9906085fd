"""The HTTP service: ``create_app(config)`` → /metrics, /healthz, /readyz, /status and ``/``.

Background work (the attach client, the poller, the admin listener) lives in ``cleanup_ctx``, so
a test can start and stop the whole service in-process with aiohttp's own runner.
"""

from __future__ import annotations

import contextlib
import html
import logging
from collections.abc import AsyncIterator
from typing import Any

import zmq
from aiohttp import web

from exporter import __version__
from exporter.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.aggregate import ConsensusVerdict, FleetState
from exporter.config import ServeConfig
from exporter.error import ExporterError
from exporter.gate import GateRequestError, parse_conditions
from exporter.httpguard import guarded_runner
from exporter.negotiation import VARY, wants_gzip
from exporter.runtime import Exporter
from exporter.snapshot import EngineSnapshot, FleetSnapshot

log = logging.getLogger("exporter.server")

EXPORTER_KEY = web.AppKey("exporter", Exporter)
ADMIN_URL_KEY = web.AppKey("admin_url", str)
MAX_REQUEST_BYTES = 16 * 1024


class StartupError(ExporterError):
    """The service could not start: a socket could not be bound (the message names it)."""


def verdict_json(verdict: ConsensusVerdict) -> dict[str, Any]:
    consistent = {FleetState.CONSISTENT: True, FleetState.INCONSISTENT: False}.get(verdict.state)
    return {
        "state": verdict.state.value,
        "value": verdict.value if verdict.state is FleetState.CONSISTENT else None,
        "consistent": consistent,
        "error": str(verdict.error) if verdict.error else None,
        "values": verdict.error.values if verdict.error else None,
        "missing": list(verdict.missing),
    }


def engine_json(e: EngineSnapshot) -> dict[str, Any]:
    o = e.sleeping_outcome
    return {
        "engine": e.engine,
        "connected": e.detail.connected,
        "up": e.up,
        "state": e.state,
        "outcome": o.outcome.value if o else None,
        "value": e.sleeping,
        "paused": e.paused,
        "error": o.error if o else None,
        "values": list(o.values) if o and o.values else None,
        "weight_version": e.weight_version,
        "unsupported": sorted(e.unsupported),
        "last_success_unix": e.last_success_unix,
        "vllm_version": e.detail.vllm_version,
        "enable_sleep_mode": e.detail.enable_sleep_mode,
        "address": e.detail.address,
        "handshakes": e.detail.handshakes,
    }


def status_json(snap: FleetSnapshot, config: ServeConfig) -> dict[str, Any]:
    return {
        "version": __version__,
        "attach": config.attach,
        "model_name": config.model_name,
        "ready": snap.ready,
        "engines_expected": snap.expected,
        "engines_connected": snap.connected,
        "aggregate": {m: verdict_json(v) for m, v in snap.verdicts.items()},
        "consistent": verdict_json(snap.sleeping)["consistent"],
        "is_scheduler_paused": verdict_json(snap.paused),
        "last_poll": {
            "number": snap.poll_number,
            "unix": snap.taken_at_unix or None,
            "duration_s": snap.poll_duration_s if snap.poll_number else None,
        },
        "engines": [engine_json(e) for e in snap.engines],
    }


async def metrics(request: web.Request) -> web.Response:
    """Text format or OpenMetrics, gzip or not (``exporter.negotiation``); never a 406."""
    exporter = request.app[EXPORTER_KEY]
    use_gzip = wants_gzip(request.headers.get("Accept-Encoding", ""))
    body, content_type = exporter.render_metrics(request.headers.get("Accept", ""), use_gzip)
    headers = {"Content-Type": content_type, "Vary": VARY}
    if use_gzip:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def gate(request: web.Request) -> web.Response:
    """The safe-to-resume gate (``exporter.gate``): JSON in every case."""
    exporter = request.app[EXPORTER_KEY]
    try:
        conditions = parse_conditions({k: request.query.getall(k) for k in request.query})
    except GateRequestError as exc:
        return web.json_response({"ok": False, "error": str(exc)}, status=400)
    status, body = await exporter.gate.check(conditions)
    return web.json_response(body, status=status, headers={"Cache-Control": "no-store"})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    snap = request.app[EXPORTER_KEY].poller.snapshot
    body = {
        "ready": snap.ready,
        "engines_expected": snap.expected,
        "engines_connected": snap.connected,
        "last_poll": snap.poll_number,
    }
    return web.json_response(body, status=200 if snap.ready else 503)


async def status(request: web.Request) -> web.Response:
    exporter = request.app[EXPORTER_KEY]
    return web.json_response(status_json(exporter.poller.snapshot, exporter.config))


async def index(request: web.Request) -> web.Response:
    exporter = request.app[EXPORTER_KEY]
    return web.Response(
        text=render_index(exporter.poller.snapshot, exporter.config), content_type="text/html"
    )


def render_index(snap: FleetSnapshot, config: ServeConfig) -> str:
    """A small page readable without Grafana: the verdict and one row per engine."""
    verdict = snap.sleeping
    rows = []
    for e in snap.engines:
        o = e.sleeping_outcome
        cells = [
            e.engine,
            e.state,
            "up" if e.up else "down",
            o.outcome.value if o else "-",
            e.weight_version if e.weight_version is not None else "-",
            e.detail.vllm_version or "-",
            o.error if o and o.error else "",
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    title = "vllm-dp-exporter"
    if config.model_name:
        title += f" — {config.model_name}"
    paused = snap.paused.state is FleetState.CONSISTENT and snap.paused.value is True
    value = ("paused" if paused else "asleep") if verdict.value else "awake"
    verdict_text = value if verdict.state is FleetState.CONSISTENT else verdict.state.value
    weights = snap.weight_version
    weights_text = (
        f"{weights.value}" if weights.state is FleetState.CONSISTENT else weights.state.value
    )
    errors = [v.error for v in (verdict, weights) if v.error is not None]
    error = "".join(f"<p class=err>{html.escape(str(e))}</p>" for e in errors)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta http-equiv="refresh" content="5">
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:.2em .8em;text-align:left}}
.err{{color:#b00}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>Fleet: <b id="verdict">{html.escape(verdict_text)}</b> ·
weights <b id="weights">{html.escape(weights_text)}</b> ·
engines connected {snap.connected}/{snap.expected} · poll #{snap.poll_number}</p>{error}
<table><thead><tr><th>engine</th><th>state</th><th>up</th><th>last outcome</th>
<th>weights</th><th>vLLM</th><th>error</th></tr></thead><tbody>
{"".join(rows)}
</tbody></table>
<p><a href="/metrics">/metrics</a> · <a href="/status">/status</a> ·
<a href="/healthz">/healthz</a> · <a href="/readyz">/readyz</a></p>
</body></html>
"""


def create_app(config: ServeConfig, exporter: Exporter | None = None) -> web.Application:
    """The main application; its cleanup context runs the exporter and the admin listener."""
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[EXPORTER_KEY] = exporter if exporter is not None else Exporter(config)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/gate", gate)
    app.router.add_get("/", index)
    app.cleanup_ctx.append(_run_exporter)
    app.cleanup_ctx.append(_run_admin_listener)
    return app


async def _run_exporter(app: web.Application) -> AsyncIterator[None]:
    exporter = app[EXPORTER_KEY]
    try:
        await exporter.start()
    except BaseException as exc:
        # Close what did start (sockets bound before the failing one) before reporting.
        with contextlib.suppress(Exception):
            await exporter.stop()
        if isinstance(exc, zmq.ZMQError):
            raise StartupError(
                f"cannot open the engine-facing sockets: {exc} (see --handshake-address, "
                "--advertise-host, --bind-host, --fixed-base-port)"
            ) from None
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
    site = web.TCPSite(runner, where[0], where[1])
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise StartupError(
            f"--admin-listen {exporter.config.admin_listen}: {exc.strerror or exc}"
        ) from None
    port = runner.addresses[0][1] if runner.addresses else where[1]
    app[ADMIN_URL_KEY] = f"http://{where[0]}:{port}"
    yield
    await admin_app[ADMIN_SHUTDOWN_KEY]()
    await runner.cleanup()
