"""A simulated vLLM API server: the dev routes of ``docs/protocol.md`` F.4 with the exact
status codes, bodies and connection behaviour of F.4.1, backed by N in-process simulated engines.

The engines are ``exporter.sim.state.EngineState`` state machines (no sockets): ``is_sleeping``,
``sleep``, ``wake_up``, ``reset_prefix_cache`` and the demo story, through their public API.
The server aggregates across them as vLLM's ``AsyncLLM`` does (E.1): ``is_sleeping`` is a
consensus (HTTP 500 "Engines returned different is_sleeping results: [False, True]" when they
disagree), ``reset_prefix_cache`` and ``wake_up`` are ANDs, one failing engine fails the call.

Faithful details: dev mode off gives 404 ``{"detail":"Not Found"}`` on the dev routes (``GET
/version`` still answers), a wrong method gives 405 with an ``allow`` header, bad booleans give
vLLM's 400 validation envelope, and after every 500 the TCP connection is closed without a
``connection: close`` header. Authorization headers are recorded, never checked (vLLM's
``--api-key`` does not cover the dev routes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exporter.sim.engine import SimOptions, run_story
from exporter.sim.state import PAUSE_MODES, Deferred, EngineState

#: pydantic's boolean strings (what FastAPI accepts for ``bool`` query parameters).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """Starlette's JSONResponse: compact separators, ``content-type: application/json``."""
    body = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(
        body=body.encode(), status=status, headers=headers, content_type="application/json"
    )


class _BadQuery(Exception):
    def __init__(self, name: str, raw: str, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.name, self.raw, self.kind, self.msg = name, raw, kind, msg


class _EngineError(Exception):
    """One engine's utility call raised (vLLM: "Call to <method> method failed: <text>")."""


@dataclass
class ApiServerOptions:
    """State and faults of one simulated API server."""

    engines: int = 2
    dev_mode: bool = True
    #: Per-engine state and faults (``sleeping``, ``paused``, ``refuse_reset``, ``reply_delay_s``,
    #: ``hang``); missing entries get defaults.
    engine_options: list[SimOptions] = field(default_factory=list)
    #: engine position → text its utility calls raise (a failing engine).
    failures: dict[int, str] = field(default_factory=dict)
    engine_dead: bool = False  # every dev call answers vLLM's generic 500
    old_reset_response: bool = False  # vLLM < 0.26: POST /reset_prefix_cache answers 200, empty
    close_after_500: bool = True  # vLLM's behaviour
    #: Fault: abort (without an answer) every request that arrives on a reused connection,
    #: as a client sees it when it reuses a pooled connection the server has dropped.
    reset_reused_connections: bool = False
    story_period_s: float | None = None  # run exporter.sim.story on the engines
    story_offset: int = 0  # position of this server's first engine in the fleet
    story_count: int | None = None  # fleet size for the story (default: this server's engines)
    vllm_version: str = "0.33.0"


class SimApiServer:
    """The application state; ``app`` is the aiohttp application serving it.

    ``options`` is a copy of the caller's (never changed); ``engines[i]`` is engine i's state
    machine and ``engine_options[i]`` its faults (``hang``, ``reply_delay_s``, read live).
    """

    def __init__(self, options: ApiServerOptions | None = None) -> None:
        given = options or ApiServerOptions()
        self.options = dataclasses.replace(
            given, engine_options=list(given.engine_options), failures=dict(given.failures)
        )
        o = self.options
        count = o.story_count or o.engines
        self.engine_options: list[SimOptions] = [
            dataclasses.replace(
                o.engine_options[i] if i < len(o.engine_options) else SimOptions(),
                story_offset=o.story_offset + i,
                story_count=count,
            )
            for i in range(o.engines)
        ]
        self.engines: list[EngineState] = [opts.initial_state() for opts in self.engine_options]
        #: (method, path with query, Authorization header or None) of every request received.
        self.requests: list[tuple[str, str, str | None]] = []
        self._connections: dict[Any, int] = {}
        self.aborted = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.app = self._build_app()

    # -- aggregation over the engines (AsyncLLM, E.1) ---------------------------------------

    async def _engine_delay(self) -> None:
        faults = self.engine_options
        if any(f.hang for f in faults):
            await asyncio.Event().wait()  # never answers; the client times out
        delay = max((f.reply_delay_s for f in faults), default=0.0)
        if delay > 0:
            await asyncio.sleep(delay)

    def _check_failures(self, method: str) -> None:
        for i in range(len(self.engines)):
            text = self.options.failures.get(i)
            if text is not None:
                raise _EngineError(f"Call to {method} method failed: {text}")

    # -- HTTP ---------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/version", self._version, allow_head=False)
        if self.options.dev_mode:
            app.router.add_get("/is_sleeping", self._is_sleeping, allow_head=False)
            app.router.add_post("/sleep", self._sleep)
            app.router.add_post("/wake_up", self._wake_up)
            app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        period = self.options.story_period_s
        if period:
            # The engines' story (exporter.sim.story), as a ZMQ engine runs it.
            self._tasks = [
                asyncio.create_task(
                    run_story(state.apply_story, opts.story_offset, opts.story_count, period)
                )
                for state, opts in zip(self.engines, self.engine_options, strict=True)
            ]

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.append(
            (request.method, request.path_qs, request.headers.get("Authorization"))
        )
        peer = request.transport.get_extra_info("peername") if request.transport else None
        seen = self._connections.get(peer, 0)
        self._connections[peer] = seen + 1
        if self.options.reset_reused_connections and seen > 0 and request.transport is not None:
            self.aborted += 1
            request.transport.abort()
            return web.Response(status=500)  # never reaches the client
        try:
            return await handler(request)
        except web.HTTPNotFound:
            return _json({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed as exc:
            return _json(
                {"detail": "Method Not Allowed"},
                status=405,
                headers={"allow": ", ".join(sorted(exc.allowed_methods))},
            )
        except _BadQuery as exc:
            return _json(_validation_error(exc), status=400)
        except _EngineError as exc:
            return await self._internal_error(request, str(exc))

    async def _internal_error(self, request: web.Request, message: str) -> web.StreamResponse:
        envelope = {
            "error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}
        }
        resp = _json(envelope, status=500)
        if not self.options.close_after_500:
            return resp
        await resp.prepare(request)
        await resp.write_eof()
        # Like vLLM's server: close the connection, without announcing it in a header.
        request.protocol.force_close()
        return resp

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": self.options.vllm_version})

    def _dead(self) -> None:
        if self.options.engine_dead:
            raise _EngineError(ENGINE_DEAD_MESSAGE)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        self._dead()
        await self._engine_delay()
        self._check_failures("is_sleeping")
        results = [e.is_sleeping() for e in self.engines]
        if any(r != results[0] for r in results[1:]):
            raise _EngineError(f"Engines returned different is_sleeping results: {results!r}")
        return _json({"is_sleeping": results[0]})

    async def _sleep(self, request: web.Request) -> web.Response:
        raw_level = request.query.get("level", "1")
        try:
            level = int(raw_level)
        except ValueError:
            raise _BadQuery(
                "level", raw_level, "int_parsing", "Input should be a valid integer"
            ) from None
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise _BadQuery("mode", mode, "enum", "Input should be 'abort', 'wait' or 'keep'")
        self._dead()
        await self._engine_delay()
        self._check_failures("sleep")
        for e in self.engines:
            deferred = e.sleep(level, mode)
            if isinstance(deferred, Deferred):
                await asyncio.sleep(deferred.delay_s)
        return _json({"status": "sleeping", "level": level})

    async def _wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        self._dead()
        await self._engine_delay()
        self._check_failures("wake_up")
        awake = all([e.wake_up(tags) for e in self.engines])
        return _json({"status": "awake" if awake else "sleeping", "tags": tags})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        running = _query_bool(request, "reset_running_requests")
        external = _query_bool(request, "reset_external")
        self._dead()
        await self._engine_delay()
        self._check_failures("reset_prefix_cache")
        success = all([e.reset_prefix_cache(running, external) for e in self.engines])
        if self.options.old_reset_response:
            return web.Response(status=200)
        return _json({"success": success})


def _query_bool(request: web.Request, name: str) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return False
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _BadQuery(
        name, raw, "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    )


def _validation_error(exc: _BadQuery) -> dict[str, Any]:
    """vLLM's RequestValidationError envelope (str() of FastAPI's error list as the message)."""
    detail = {"type": exc.kind, "loc": ("query", exc.name), "msg": exc.msg, "input": exc.raw}
    return {
        "error": {
            "message": f"1 validation error:\n  {detail!r}\n",
            "type": "Bad Request",
            "param": f"query.{exc.name}",
            "code": 400,
        }
    }


async def start_api_server(
    host: str = "127.0.0.1",
    port: int = 0,
    options: ApiServerOptions | None = None,
    **kwargs: Any,
) -> tuple[web.AppRunner, str]:
    """Start one simulated API server; ``kwargs`` are ``ApiServerOptions`` fields.

    Returns the runner (``await runner.cleanup()`` to stop it; the ``SimApiServer`` is
    ``runner.app[API_SERVER_KEY]``) and the base URL.
    """
    if options is None:
        options = ApiServerOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either options or option keywords, not both")
    sim = SimApiServer(options)
    sim.app[API_SERVER_KEY] = sim
    runner = web.AppRunner(sim.app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    bound = server.sockets[0].getsockname()[1] if server and server.sockets else port
    return runner, f"http://{host}:{bound}"


API_SERVER_KEY: web.AppKey[SimApiServer] = web.AppKey("sim_api_server", SimApiServer)


def sim_of(runner: web.AppRunner) -> SimApiServer:
    """The ``SimApiServer`` behind a runner from ``start_api_server``."""
    app = runner.app
    if not isinstance(app, web.Application):
        raise TypeError("not a simulated API server runner")
    return app[API_SERVER_KEY]
