"""A simulated vLLM API server: the dev and RL routes of ``docs/protocol.md`` F.4 with the exact
status codes, bodies and connection behaviour of F.4.1, backed by N in-process simulated engines.

The engines are ``exporter.sim.state.EngineState`` state machines (no sockets), called through
``EngineState.call`` (so their faults apply: missing methods, ignored state changes) and the
demo story. The server aggregates across them as vLLM's ``AsyncLLM`` does (E.1):
``is_sleeping``, ``is_scheduler_paused`` (``GET /is_paused``) and ``get_weight_version`` (``GET
/weight_info``) are consensus calls (HTTP 500 "Engines returned different is_sleeping results:
[False, True]" when they disagree), ``reset_prefix_cache`` and ``wake_up`` are ANDs,
``compute_weight_checksums`` is flattened over the engines, everything else fans out to every
engine; one failing engine fails the call (the others still ran it).

Routes (F.4): dev ``GET /is_sleeping``, ``POST /sleep``, ``/wake_up``, ``/reset_prefix_cache``,
``/reset_mm_cache``, ``/reset_encoder_cache``; RL ``POST /pause``, ``/resume``, ``GET
/is_paused``, ``POST /update_weight_version``, ``GET /weight_info``, ``POST /weight_checker``.
``missing_routes`` leaves some out (404, as a vLLM without them).

Faithful details: dev mode off gives 404 ``{"detail":"Not Found"}`` on the dev and RL routes
(``GET /version`` still answers), a wrong method gives 405 with an ``allow`` header, bad query or
body values give vLLM's 400 validation envelope, and after every 500 from an exception the TCP
connection is closed without a ``connection: close`` header (the RL routes that catch their
exceptions answer ``{"error": "Failed to ...: <text>"}`` and keep the connection). Authorization
headers are recorded, never checked (vLLM's ``--api-key`` does not cover the dev routes).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exporter.sim.api_wire import (
    _PHRASES,
    WEIGHT_CHECKER_ACTIONS,
    _BadQuery,
    _EngineError,
    _HttpError,
    _json,
    _json_body,
    _query_bool,
    _query_mode,
    _validation_error,
)
from exporter.sim.engine import SimOptions, run_story
from exporter.sim.state import Deferred, EngineState, UtilityFailure

ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    #: Routes this server does not have (404), e.g. ``{"/weight_info"}`` for an older vLLM.
    missing_routes: frozenset[str] = frozenset()
    #: Fault: every engine's workers report DP rank 0 (the duplicate-key failure of
    #: ``/weight_checker``). Otherwise engine i reports DP rank ``story_offset + i``.
    duplicate_checksum_keys: bool = False


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
        self.engines: list[EngineState] = [
            opts.initial_state(0 if o.duplicate_checksum_keys else o.story_offset + i)
            for i, opts in enumerate(self.engine_options)
        ]
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

    async def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``call_utility_all_async``: ``method`` on every engine at once, results in engine
        order; the first failure fails the call (the other engines still ran it)."""
        self._dead()
        await self._engine_delay()
        self._check_failures(method)
        results: list[Any] = []
        failure: UtilityFailure | None = None
        delay = 0.0
        for engine in self.engines:
            try:
                result = engine.call(method, list(args))
            except UtilityFailure as exc:
                failure = failure or exc
                result = None
            if isinstance(result, Deferred):
                delay = max(delay, result.delay_s)
                result = result.value
            results.append(result)
        if delay > 0:
            await asyncio.sleep(delay)
        if failure is not None:
            raise _EngineError(str(failure))
        return results

    async def _consensus(self, method: str) -> Any:
        """``call_utility_consensus_async``: every engine must return the same value."""
        results = await self._call_all(method)
        if any(r != results[0] for r in results[1:]):
            raise _EngineError(f"Engines returned different {method} results: {results!r}")
        return results[0]

    # -- HTTP ---------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/version", self._version, allow_head=False)
        if self.options.dev_mode:
            routes: list[tuple[str, str, Handler]] = [
                ("GET", "/is_sleeping", self._is_sleeping),
                ("POST", "/sleep", self._sleep),
                ("POST", "/wake_up", self._wake_up),
                ("POST", "/reset_prefix_cache", self._reset_prefix_cache),
                ("POST", "/reset_mm_cache", self._reset_mm_cache),
                ("POST", "/reset_encoder_cache", self._reset_encoder_cache),
                ("POST", "/pause", self._pause),
                ("POST", "/resume", self._resume),
                ("GET", "/is_paused", self._is_paused),
                ("POST", "/update_weight_version", self._update_weight_version),
                ("GET", "/weight_info", self._weight_info),
                ("POST", "/weight_checker", self._weight_checker),
            ]
            for verb, path, handler in routes:
                if path in self.options.missing_routes:
                    continue
                if verb == "GET":
                    app.router.add_get(path, handler, allow_head=False)
                else:
                    app.router.add_post(path, handler)
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
        except _HttpError as exc:
            envelope = {
                "error": {
                    "message": exc.detail,
                    "type": _PHRASES.get(exc.status, "Error"),
                    "param": None,
                    "code": exc.status,
                }
            }
            return _json(envelope, status=exc.status)
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
        return _json({"is_sleeping": await self._consensus("is_sleeping")})

    async def _sleep(self, request: web.Request) -> web.Response:
        raw_level = request.query.get("level", "1")
        try:
            level = int(raw_level)
        except ValueError:
            raise _BadQuery(
                "level", raw_level, "int_parsing", "Input should be a valid integer"
            ) from None
        mode = _query_mode(request)
        await self._call_all("sleep", level, mode)
        return _json({"status": "sleeping", "level": level})

    async def _wake_up(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", []) or None
        awake = all(await self._call_all("wake_up", tags))
        return _json({"status": "awake" if awake else "sleeping", "tags": tags})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        running = _query_bool(request, "reset_running_requests")
        external = _query_bool(request, "reset_external")
        success = all(await self._call_all("reset_prefix_cache", running, external))
        if self.options.old_reset_response:
            return web.Response(status=200)
        return _json({"success": success})

    async def _reset_mm_cache(self, request: web.Request) -> web.Response:
        await self._call_all("reset_mm_cache")
        return web.Response(status=200)

    async def _reset_encoder_cache(self, request: web.Request) -> web.Response:
        await self._call_all("reset_encoder_cache")
        return web.Response(status=200)

    # -- RL routes (entrypoints/rl/online/api_router.py) -----------------------------------

    async def _pause(self, request: web.Request) -> web.Response:
        """``pause_generation`` → ``pause_scheduler(mode, clear_cache)`` on every engine; the
        route catches engine errors: 500 ``{"error": "Failed to pause generation: ..."}``."""
        mode = _query_mode(request)
        clear_cache = _query_bool(request, "clear_cache", default=True)
        try:
            await self._call_all("pause_scheduler", mode, clear_cache)
        except _EngineError as exc:
            return _json({"error": f"Failed to pause generation: {exc}"}, status=500)
        return _json({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        try:
            await self._call_all("resume_scheduler")
        except _EngineError as exc:
            return _json({"error": f"Failed to resume generation: {exc}"}, status=500)
        return _json({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        try:
            paused = await self._consensus("is_scheduler_paused")
        except _EngineError as exc:
            return _json({"error": f"Failed to fetch pause status: {exc}"}, status=500)
        return _json({"is_paused": paused})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        new_version = body.get("new_version", _MISSING)
        if new_version is _MISSING:
            raise _BadQuery("new_version", body, "missing", "Field required", where="body")
        if not isinstance(new_version, str):
            raise _BadQuery(
                "new_version",
                new_version,
                "string_type",
                "Input should be a valid string",
                where="body",
            )
        await self._call_all("set_weight_version", new_version)
        return _json({"success": True, "new_version": new_version})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return _json({"weight_version": await self._consensus("get_weight_version")})

    async def _weight_checker(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        action = body.get("action", _MISSING)
        if action is _MISSING:
            raise _BadQuery("action", body, "missing", "Field required", where="body")
        if action not in WEIGHT_CHECKER_ACTIONS:
            raise _BadQuery(
                "action",
                action,
                "literal_error",
                "Input should be 'checksum', 'reset' or 'compare'",
                where="body",
            )
        baseline = body.get("baseline")
        if baseline is not None and not (
            isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
        ):
            raise _BadQuery(
                "baseline",
                baseline,
                "dict_type",
                "Input should be a valid dictionary",
                where="body",
            )
        if action == "reset":
            # collective_rpc("reset_weights"): the sim does not model random weights.
            self._dead()
            await self._engine_delay()
            return _json({"status": "reset"})
        if action == "compare" and baseline is None:
            raise _HttpError(400, "action='compare' requires a 'baseline' object")
        checksums: dict[str, str] = {}
        for per_engine in await self._call_all("compute_weight_checksums"):
            for worker in per_engine:
                if duplicates := checksums.keys() & worker.keys():
                    raise _HttpError(500, f"Duplicate weight checksum keys: {sorted(duplicates)}")
                checksums.update(worker)
        if action == "checksum":
            return _json({"checksums": checksums})
        assert baseline is not None
        mismatches = sorted(
            k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k)
        )
        return _json({"match": not mismatches, "mismatches": mismatches})


_MISSING: Any = object()


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
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, f"http://{host}:{bound}"


API_SERVER_KEY: web.AppKey[SimApiServer] = web.AppKey("sim_api_server", SimApiServer)


def sim_of(runner: web.AppRunner) -> SimApiServer:
    """The ``SimApiServer`` behind a runner from ``start_api_server``."""
    app = runner.app
    if not isinstance(app, web.Application):
        raise TypeError("not a simulated API server runner")
    return app[API_SERVER_KEY]
