"""The routes of the simulated vLLM API server (``exporter.sim.api_server``): the dev and RL
handlers of ``docs/protocol.md`` F.4 with the status codes and bodies of F.4.1, over the server's
in-process simulated engines.

The engines are ``exporter.sim.state.EngineState`` state machines (no sockets), called through
``EngineState.call`` (so their faults apply: missing methods, ignored state changes). The routes
aggregate across them as vLLM's ``AsyncLLM`` does (E.1): ``is_sleeping``,
``is_scheduler_paused`` (``GET /is_paused``) and ``get_weight_version`` (``GET /weight_info``)
are consensus calls (HTTP 500 "Engines returned different is_sleeping results: [False, True]"
when they disagree), ``reset_prefix_cache`` and ``wake_up`` are ANDs,
``compute_weight_checksums`` is flattened over the engines, everything else fans out to every
engine; one failing engine fails the call (the others still ran it).

Routes (F.4): ``GET /version``; with the dev routes, ``POST /v1/completions`` and
``/v1/chat/completions`` (a request runs on one engine for ``max_tokens`` / ``TOKENS_PER_S``
seconds, pinned by ``X-data-parallel-rank`` as vLLM 0.30 to 0.34 pin it: ``data_parallel_rank``);
``GET /metrics`` (served whatever the dev mode, as vLLM's: each engine's running and waiting
requests, ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` with its DP rank as the
``engine`` label, unless ``log_stats`` is off; no engine called); with fault tolerance on, ``GET
/fault_tolerance/status`` (vLLM 0.33's ``get_status()``: the front end's copy of the sentinels'
pushes, no engine called); ``POST /is_scaling_elastic_ep`` (whatever the dev mode: ``api_elastic``);
dev ``GET /is_sleeping``, ``POST /sleep``, ``/wake_up``, ``/reset_prefix_cache``,
``/reset_mm_cache``, ``/reset_encoder_cache``; RL ``POST /pause``, ``/resume``, ``GET /is_paused``,
``POST /update_weight_version``, ``GET /weight_info``, ``POST /weight_checker``. Bad query or body
values raise ``_BadQuery`` (vLLM's 400 validation envelope); engine failures raise ``_EngineError``
(a 500), except on the RL routes that catch their exceptions and answer ``{"error": "Failed to ...:
<text>"}``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from exporter.sim.api_elastic import SimElasticEp, elastic_ep_answer
from exporter.sim.api_wire import (
    METRICS_CONTENT_TYPE,
    WEIGHT_CHECKER_ACTIONS,
    _BadQuery,
    _EngineError,
    _HttpError,
    _json,
    _json_body,
    _query_bool,
    _query_mode,
    _RustFrontEndError,
    metrics_text,
)
from exporter.sim.options import ApiServerOptions, SimOptions
from exporter.sim.state import Deferred, EngineState, UtilityFailure
from exporter.sim.work import TOKENS_PER_S

ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_MISSING: Any = object()


#: The request header that pins a request to one DP rank (vLLM's ``_get_data_parallel_rank``).
DP_RANK_HEADER = "X-data-parallel-rank"
#: The OpenAI routes served (with the dev routes): path → the ``object`` of their answer.
COMPLETION_ROUTES = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat.completion",
}
#: A completion's ``max_tokens`` when it gives none (OpenAI's default), and the longest one
#: runs whatever it asks (seconds).
DEFAULT_MAX_TOKENS = 16
MAX_COMPLETION_S = 30.0
#: How often a running completion looks at its engine (paused, asleep, hung or frozen: it
#: waits; otherwise its time runs).
COMPLETION_TICK_S = 0.02


def data_parallel_rank(headers: Mapping[str, str]) -> int | None:
    """vLLM's ``_get_data_parallel_rank`` (0.30 to 0.34): the header as Python's ``int()``
    reads it; absent or not an integer is None (vLLM then balances the request itself)."""
    raw = headers.get(DP_RANK_HEADER)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def rank_out_of_range(rank: int, ranks: int) -> dict[str, Any]:
    """vLLM's answer to a rank it does not have (``InputProcessor.process_inputs`` raises
    ``VLLMValidationError``; the API server's envelope, 400 ``BadRequestError``)."""
    message = f"data_parallel_rank {rank} is out of range [0, {ranks})."
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


#: The name vLLM's Rust front end gives a consensus route's call in its error prefix, where it
#: is not the utility method's (measured on vLLM 0.32's binary).
RUST_CALL_NAMES = {"is_scheduler_paused": "is_paused"}


class ApiRoutes:
    """The route handlers of one simulated API server, over its engines.

    ``options`` are the server's options; ``engines[i]`` is engine i's state machine and
    ``engine_options[i]`` its faults (``hang``, ``reply_delay_s``, read live). The server
    (``SimApiServer``) sets all three.
    """

    options: ApiServerOptions
    engine_options: list[SimOptions]
    engines: list[EngineState]
    engine_status: dict[int, dict[str, Any]]
    ft_answer: bytes | None
    ft_delay_s: float
    metrics_answer: bytes | None
    elastic_ep: SimElasticEp
    #: Engine position → completions it was given (pinned or balanced); bounded by the engines.
    completions: Counter[int]
    #: Where the balancing of unpinned completions starts its scan next (rotated every time).
    lb_start: int

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
                result = engine.call(method, list(args), now=time.monotonic())
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
            if self.options.rust_front_end is not None:
                # Its prefix names the route's own call (``is_paused`` for is_scheduler_paused).
                call = RUST_CALL_NAMES.get(method, method)
                raise _RustFrontEndError(
                    f"failed to call {call}: utility call `{method}` returned inconsistent "
                    f"results across engines: {json.dumps(results)}"
                )
            raise _EngineError(f"Engines returned different {method} results: {results!r}")
        return results[0]

    def _dead(self) -> None:
        if self.options.engine_dead:
            raise _EngineError(ENGINE_DEAD_MESSAGE)

    # -- the route table -----------------------------------------------------------------------

    def _dev_routes(self) -> list[tuple[str, str, Handler]]:
        """The dev and RL routes (served only in dev mode), as (method, path, handler)."""
        return [
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

    async def _version(self, request: web.Request) -> web.Response:
        answer: dict[str, str] = {"version": self.options.vllm_version}
        if self.options.rust_front_end is not None:  # the Rust front end adds its own
            answer["rust_frontend_version"] = self.options.rust_front_end
        return _json(answer)

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's Prometheus exposition: the stat loggers' last values (no engine is called)."""
        body = self.metrics_answer  # a test's hostile answer
        if body is None:
            now, first = time.monotonic(), self.options.story_offset  # engine i is rank first+i
            counts = {first + i: e.request_counts(now) for i, e in enumerate(self.engines)}
            tokens = {first + i: e.tokens(now) for i, e in enumerate(self.engines)}
            body = metrics_text(counts, self.options.log_stats, tokens).encode()
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _ft_status(self, request: web.Request) -> web.Response:
        if self.ft_answer is not None:  # a test's hostile answer
            return web.Response(body=self.ft_answer, content_type="application/json")
        engines = list(self.engine_status.values())  # the statuses when the request came
        if self.ft_delay_s > 0:  # a slow front end: the answer is as old as its request
            await asyncio.sleep(self.ft_delay_s)
        return _json({"schema_version": 1, "total_engines": len(self.engines), "engines": engines})

    async def _elastic_ep_status(self, request: web.Request) -> web.Response:
        """``POST /is_scaling_elastic_ep`` as this release answers it (``api_elastic``)."""
        o = self.options
        return await elastic_ep_answer(self.elastic_ep, o.vllm_version, o.rust_front_end)

    # -- OpenAI completions (served with the dev routes) -------------------------------------

    def _balanced(self) -> int:
        """vLLM's own choice for an unpinned request (``DPLBAsyncMPClient``): the engine with
        the fewest running + waiting requests, the scan starting one further every time."""
        now, count = time.monotonic(), len(self.engines)
        start, self.lb_start = self.lb_start, (self.lb_start + 1) % count
        order = [(start + k) % count for k in range(count)]
        return min(order, key=lambda i: sum(self.engines[i].request_counts(now)))

    async def _run(self, position: int, duration_s: float, started: asyncio.Event) -> None:
        """One request on engine ``position``: its time runs only while the engine runs
        requests (awake, not paused, not stuck, not hung or frozen); ``started`` is set when it
        first does."""
        engine, faults = self.engines[position], self.engine_options[position]
        engine.submit(duration_s, time.monotonic())
        left, last = duration_s, time.monotonic()
        while True:
            held = engine.is_sleeping() or engine.work.stuck or faults.hang or faults.frozen
            if not held:
                started.set()
            if left <= 0:
                return
            await asyncio.sleep(COMPLETION_TICK_S)
            now = time.monotonic()
            if not held:
                left -= now - last
            last = now

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` and ``/v1/chat/completions``: the request runs on the engine
        ``X-data-parallel-rank`` names, else on the one vLLM's balancing picks; a rank out of
        range is vLLM's 400 (in a streamed answer: its error event, then ``[DONE]``)."""
        body = await _json_body(request)
        self._dead()
        stream = body.get("stream") is True
        rank, count = data_parallel_rank(request.headers), len(self.engines)
        if rank is not None and not 0 <= rank < count:
            error = rank_out_of_range(rank, count)
            if not stream:
                return _json(error, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        position = self._balanced() if rank is None else rank
        self.completions[position] += 1
        tokens = body.get("max_tokens")
        tokens = tokens if isinstance(tokens, int) and tokens > 0 else DEFAULT_MAX_TOKENS
        duration = min(tokens / TOKENS_PER_S, MAX_COMPLETION_S)
        kind = COMPLETION_ROUTES.get(request.path, "text_completion")
        answer = {
            "id": f"cmpl-sim-{sum(self.completions.values())}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [{"index": 0, "text": " sim" * tokens, "finish_reason": "length"}],
            "usage": {"completion_tokens": tokens},
        }
        started = asyncio.Event()
        run = asyncio.ensure_future(self._run(position, duration, started))
        try:
            if not stream:
                await run
                return _json(answer)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            waiter = asyncio.ensure_future(started.wait())
            try:
                await asyncio.wait((run, waiter), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
            first = {**answer, "object": f"{kind}.chunk", "choices": [{"index": 0, "text": ""}]}
            await resp.write(f"data: {json.dumps(first)}\n\n".encode())
            await run
            last = {**answer, "object": f"{kind}.chunk"}
            await resp.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            run.cancel()

    # -- dev routes ---------------------------------------------------------------------------

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
        except _RustFrontEndError:
            raise  # the Rust front end's own envelope, as on every route
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
