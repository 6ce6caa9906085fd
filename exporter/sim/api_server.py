"""A simulated vLLM API server: an aiohttp application serving the routes of
``exporter.sim.api_routes`` (``docs/protocol.md`` F.4) with the connection behaviour of F.4.1,
backed by N in-process simulated engines that run the demo story.

Faithful details: dev mode off gives 404 ``{"detail":"Not Found"}`` on the dev and RL routes
(``GET /version`` and ``GET /metrics`` still answer; ``log_stats=False``, vLLM's
``--disable-log-stats``, leaves the request counts out of ``/metrics``), ``fault_tolerance`` adds
vLLM 0.33's ``GET /fault_tolerance/status`` (404 without it, as vLLM; under ``/v1/`` only with
``fault_tolerance_prefix="/v1"``, as vLLM's open PR #46370 may serve it), ``missing_routes`` leaves
some out (404, as a vLLM without them), ``POST /is_scaling_elastic_ep`` answers as each release
does (``exporter.sim.api_elastic``; ``set_elastic_ep`` moves its operation), a wrong method
gives 405 with an ``allow`` header, bad query or body values give vLLM's 400 validation
envelope, and after every 500 from an exception the TCP connection is closed without a
``connection: close`` header (the RL routes that catch their exceptions answer ``{"error":
"Failed to ...: <text>"}`` and keep the connection). Authorization headers are recorded, never
checked (vLLM's ``--api-key`` does not cover the dev routes). With the dev routes it serves
``POST /v1/completions`` and ``/v1/chat/completions``: ``X-data-parallel-rank`` pins a request to
an engine as vLLM does (a rank out of range is its 400), ``completions`` counts where each went.
A 0.34 server (``vllm_version``; its engines are of its release) whose engines run with sleep
mode serves vLLM 0.34's ``/checkpoint/{status,prepare,restore}`` whatever the dev mode
(``exporter.sim.api_checkpoint``; ``checkpoint_routes.answers``: a hostile answer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections import Counter
from typing import Any

from aiohttp import web

from exporter.protocol.pushes import encode_ft_status_value
from exporter.sim.api_checkpoint import CheckpointRoutes, mounted
from exporter.sim.api_elastic import ELASTIC_EP_PATH, SimElasticEp
from exporter.sim.api_routes import COMPLETION_ROUTES, ApiRoutes, Handler
from exporter.sim.api_wire import (
    _PHRASES,
    _BadQuery,
    _EngineError,
    _HttpError,
    _json,
    _validation_error,
)
from exporter.sim.options import ApiServerOptions, SimOptions
from exporter.sim.state import EngineState
from exporter.sim.story import StoryState, run_story


class SimApiServer(ApiRoutes):
    """The application state; ``app`` is the aiohttp application serving it.

    ``options`` is a copy of the caller's (never changed); ``engines[i]`` is engine i's state
    machine and ``engine_options[i]`` its faults (``hang``, ``reply_delay_s``, read live).
    ``engine_status`` is the front end's copy of the sentinels' pushes (DP rank → payload, as
    vLLM's ``AsyncMPClient._engine_status``); ``ft_answer``, when set, is served instead, and
    ``metrics_answer`` instead of ``/metrics``. A test gives engine i requests with
    ``engines[i].submit(duration_s, time.monotonic(), count)``.
    """

    def __init__(self, options: ApiServerOptions | None = None) -> None:
        given = options or ApiServerOptions()
        self.options = dataclasses.replace(
            given, engine_options=list(given.engine_options), failures=dict(given.failures)
        )
        o = self.options
        count = o.story_count or o.engines
        self.engine_options = [
            dataclasses.replace(
                o.engine_options[i] if i < len(o.engine_options) else SimOptions(),
                story_offset=o.story_offset + i,
                story_count=count,
                vllm_version=o.vllm_version,  # the engines behind a server are of its release
            )
            for i in range(o.engines)
        ]
        self.engines = [
            opts.initial_state(0 if o.duplicate_checksum_keys else o.story_offset + i)
            for i, opts in enumerate(self.engine_options)
        ]
        ranks = [self.rank_of(i) for i in range(o.engines)] if o.fault_tolerance else []
        self.engine_status: dict[int, dict[str, Any]] = {
            rank: encode_ft_status_value(rank, "healthy") for rank in ranks
        }
        self.ft_answer: bytes | None = None
        #: Seconds ``GET /fault_tolerance/status`` takes to answer (with the statuses of when
        #: its request came).
        self.ft_delay_s = 0.0
        self.metrics_answer: bytes | None = None
        #: ``POST /is_scaling_elastic_ep``'s operation and faults (``set_elastic_ep``).
        self.elastic_ep = SimElasticEp()
        #: vLLM 0.34's checkpoint routes over these engines (served when ``checkpoint_served``).
        self.checkpoint_routes = CheckpointRoutes(self._call_all)
        #: (method, path with query, Authorization header or None) of every request received.
        self.requests: list[tuple[str, str, str | None]] = []
        #: Path with query → requests answered, each once its handler's answer was handed
        #: back to be sent (an aborted request has none): with ``requests``, what tells a test
        #: that every request received has been answered. Counts: bounded by the paths asked.
        self.answered: Counter[str] = Counter()
        #: Engine position → completions it was given (``X-data-parallel-rank`` or vLLM's
        #: balancing; ``api_routes``): where a test's requests went. Bounded by the engines.
        self.completions: Counter[int] = Counter()
        self.lb_start = 0
        self._connections: dict[Any, int] = {}
        self.aborted = 0
        #: The path of each request aborted (``reset_reused_connections``), in order.
        self.aborted_paths: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.app = self._build_app()

    def rank_of(self, position: int) -> int:
        """The DP rank of this server's engine ``position``."""
        return self.options.story_offset + position

    def set_fault_status(self, position: int, status: str, fault_info: str | None = None) -> None:
        """Engine ``position``'s sentinel pushed ``status`` (the payload vLLM stores as is):
        vLLM 0.33's three, PR #41438's ``paused`` and ``recovering``, or any other string."""
        rank = self.rank_of(position)
        self.engine_status[rank] = encode_ft_status_value(rank, status, fault_info)

    def set_elastic_ep(
        self,
        phase: str = "idle",
        epoch: str | None = None,
        error: str | None = None,
        requested: int | None = None,
    ) -> None:
        """The elastic-EP operation vLLM's shared store now holds (any phase string); the
        faults (``elastic_ep.unavailable``, ``elastic_ep.answer``) stay as they are."""
        state = self.elastic_ep
        state.phase, state.epoch, state.error, state.requested = phase, epoch, error, requested

    def recovery_failed(self, request_id: str, reason: str) -> None:
        """``handle_fault`` failed: vLLM notes it in the first managed rank's entry."""
        first = self.engine_status.get(self.rank_of(0))
        if first is not None:
            first.update(last_ft_request_id=request_id, ft_error=reason)

    @property
    def checkpoint_served(self) -> bool:
        """vLLM mounts its checkpoint routes from 0.34 on, with ``--enable-sleep-mode`` (one
        flag for the whole server: here, every engine's ``enable_sleep_mode``)."""
        o = self.options
        sleep_mode = all(opts.enable_sleep_mode for opts in self.engine_options)
        return mounted(o.vllm_version, o.rust_front_end, sleep_mode)

    # -- HTTP ---------------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/version", self._version, allow_head=False)
        app.router.add_get("/metrics", self._metrics, allow_head=False)
        if self.options.fault_tolerance:  # vLLM registers it whatever the dev mode
            path = self.options.fault_tolerance_prefix + "/fault_tolerance/status"
            app.router.add_get(path, self._ft_status, allow_head=False)
        if ELASTIC_EP_PATH not in self.options.missing_routes:  # wherever vLLM serves generate
            app.router.add_post(ELASTIC_EP_PATH, self._elastic_ep_status)
        if self.checkpoint_served:  # beside generate too, whatever the dev mode
            for verb, path, handler in self.checkpoint_routes.routes():
                if path not in self.options.missing_routes:
                    app.router.add_route(verb, path, handler)
        if self.options.dev_mode:
            # vLLM serves its OpenAI routes whatever the dev mode; the simulation only with
            # the dev routes (a server without them keeps its three routes).
            for path in COMPLETION_ROUTES:
                if path not in self.options.missing_routes:
                    app.router.add_post(path, self._completion)
            for verb, path, handler in self._dev_routes():
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
                    run_story(
                        functools.partial(_apply_story, state, opts),
                        opts.story_offset,
                        opts.story_count,
                        period,
                    )
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
            self.aborted_paths.append(request.path)
            request.transport.abort()
            return web.Response(status=500)  # never reaches the client
        response = await self._answer(request, handler)
        self.answered[request.path_qs] += 1
        return response

    async def _answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The answer to ``request`` (its handler's, or the server's own error envelope)."""
        key = self.options.api_key
        guarded = key is not None and request.path.startswith("/v1/")  # vLLM's GUARDED_PREFIX
        if guarded and request.headers.get("Authorization") != f"Bearer {key}":
            return _json({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except web.HTTPNotFound:
            if self.options.rust_front_end is not None:  # its 404s and 405s have no body
                return web.Response(status=404)
            return _json({"detail": "Not Found"}, status=404)
        except web.HTTPMethodNotAllowed as exc:
            allow = {"allow": ", ".join(sorted(exc.allowed_methods))}
            if self.options.rust_front_end is not None:
                return web.Response(status=405, headers=allow)
            return _json({"detail": "Method Not Allowed"}, status=405, headers=allow)
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
        rust = self.options.rust_front_end
        # vLLM's Rust front end 0.32 types its 500s "server_error"; 0.33 as the Python server.
        kind = (
            "server_error"
            if rust is not None and rust.startswith("0.32")
            else "InternalServerError"
        )
        # The Rust front end's code is a string (measured on 0.32: "server_error").
        code: int | str = "server_error" if rust is not None and kind == "server_error" else 500
        envelope = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        resp = _json(envelope, status=500)
        if not self.options.close_after_500:
            return resp
        await resp.prepare(request)
        await resp.write_eof()
        # Like vLLM's server: close the connection, without announcing it in a header.
        request.protocol.force_close()
        return resp


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


def _apply_story(state: EngineState, faults: SimOptions, story: StoryState, now: float) -> None:
    """The demo story's state for one engine, and its hung window (the server then answers
    nothing that needs that engine, as vLLM's API server waits for every engine)."""
    state.apply_story(story, now)
    faults.hang = story.hung
