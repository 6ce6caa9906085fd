"""HTTP attach mode: one vLLM API server per target, reached through its dev endpoints.

Each target (``--http-target URL`` or ``NAME=URL``, repeatable, and ``--http-targets-file``)
is one "engine" to the layers above: its label is its name, or its position ("0", "1", ...).
A target's own answer is already vLLM's aggregate over the ranks that API server manages, so an
API server whose engines disagree (HTTP 500 "Engines returned different is_sleeping results:
[...]") becomes an ``INCONSISTENT`` outcome carrying those values
(``docs/protocol.md`` F.4 / F.4.1).

Mapping of the allow-listed utility methods (dev and RL routes, F.4; replies: ``http_replies``):

* ``is_sleeping`` → ``GET /is_sleeping``.
* ``is_scheduler_paused`` → ``GET /is_paused`` (``AsyncLLM.is_paused`` is
  ``is_scheduler_paused`` by consensus).
* ``get_weight_version`` → ``GET /weight_info``.
* ``reset_prefix_cache`` with ``()``, ``(rr,)`` or ``(rr, rc)`` → ``POST /reset_prefix_cache?
  reset_running_requests=..&reset_external=..`` (query string only; vLLM ignores a body).
* ``reset_mm_cache``, ``reset_encoder_cache`` → ``POST /reset_mm_cache``, ``/reset_encoder_cache``.
* ``sleep(level=1[, mode])`` → ``POST /sleep?level=..[&mode=..]``.
* ``wake_up([tags])`` → ``POST /wake_up[?tags=..&tags=..]``.
* ``pause_scheduler([mode[, clear_cache]])`` → ``POST /pause?mode=..[&clear_cache=..]``.
* ``resume_scheduler()`` → ``POST /resume``.
* ``set_weight_version(v)`` → ``POST /update_weight_version`` with JSON ``{"new_version": v}``.
* ``compute_weight_checksums()`` → ``POST /weight_checker`` with JSON ``{"action": "checksum"}``.

A 404 on a route other than the two oldest dev routes is "unsupported" (``UNSUPPORTED_HINT``).

One ``aiohttp.ClientSession`` per client (connection pooling), all targets called concurrently
under one shared deadline and a concurrency bound. vLLM closes the TCP connection after every
500 without saying so: such connections are never put back into the pool, and a request that hits
a reset on a pooled connection is retried once on a fresh one. The bearer token is sent to every
target and kept out of logs, reprs and error texts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.client.fleet import (
    DEFAULT_ALLOWED_METHODS,
    EngineDetail,
    EngineOutcome,
    Outcome,
    check_allowed,
    timed_out,
)
from exporter.client.http_replies import interpret
from exporter.error import MethodNotAllowed
from exporter.protocol.handshake import MAX_REGISTRATION_STRING
from exporter.protocol.strings import bound_text

log = logging.getLogger("exporter.http")

#: At most this many requests in flight per client (across all targets).
DEFAULT_MAX_CONCURRENCY = 64
VERSION_TIMEOUT_S = 5.0

Query = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP request standing for one utility call."""

    verb: str
    path: str
    query: Query | None = None
    body: dict[str, Any] | None = None  # sent as JSON


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """One vLLM API server: its engine label and its base URL (no trailing slash)."""

    label: str
    url: str


@dataclass(slots=True)
class _TargetState:
    target: HttpTarget
    connected: bool = False
    requests: int = 0
    #: From ``GET /version``, asked once the target answers (for ``vllm_dp_engine_info``).
    vllm_version: str | None = None
    version_pending: bool = False


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    body: bytes


class _Retryable(Exception):
    """A pooled connection was reset before any response: worth one retry on a fresh one."""


@dataclass
class HttpFleetClient:
    """``FleetClient`` over vLLM API servers' dev endpoints (see the module docstring)."""

    targets: list[HttpTarget]
    token: str | None = field(default=None, repr=False)
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS

    def __post_init__(self) -> None:
        self._states = [_TargetState(t) for t in self.targets]
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self._background: set[asyncio.Task[None]] = set()
        self.retries = 0

    # -- FleetClient -----------------------------------------------------------------------

    @property
    def engine_labels(self) -> list[str]:
        return [t.label for t in self.targets]

    def engine_details(self) -> list[EngineDetail]:
        return [
            EngineDetail(
                engine=s.target.label,
                connected=s.connected,
                address=s.target.url,
                vllm_version=s.vllm_version,
            )
            for s in self._states
        ]

    def connected_count(self) -> int:
        return sum(1 for s in self._states if s.connected)

    def supports(self, method: str) -> bool:
        """Allow-listed and mapped to a route (whether a given server has the route shows in
        its answer: ``UNSUPPORTED_HINT``). ``route`` maps every method the exporter may send."""
        return method in self.allowed_methods and method in DEFAULT_ALLOWED_METHODS

    async def start(self) -> None:
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        # Deadlines are ours (one per fan-out), not aiohttp's.
        timeout = aiohttp.ClientTimeout(total=None)
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=self.max_concurrency),
            raise_for_status=False,
        )
        # Retries go through a connector that never reuses a connection.
        self._fresh = aiohttp.ClientSession(
            headers=headers,
            timeout=timeout,
            connector=aiohttp.TCPConnector(force_close=True, limit=self.max_concurrency),
            raise_for_status=False,
        )

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        """Call ``method`` on every target at once (only those labelled in ``engines`` when
        given); one outcome per called target, in target order."""
        check_allowed(method, self.allowed_methods)
        spec = route(method, args)
        states = [s for s in self._states if engines is None or s.target.label in engines]
        tasks = {
            s.target.label: asyncio.create_task(self._call_one(s, method, spec)) for s in states
        }
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks.values(), timeout=timeout_s)
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        results = []
        for s in states:
            task = tasks[s.target.label]
            if task.cancelled():
                s.connected = False
                results.append(timed_out(s.target.label, timeout_s))
                continue
            exc = task.exception()
            if exc is not None:  # a bug, not the target: keep it visible but do not crash polls
                log.error("%s on target %s: %s", method, s.target.label, type(exc).__name__)
                results.append(
                    EngineOutcome(s.target.label, Outcome.FAILED, error=type(exc).__name__)
                )
            else:
                results.append(task.result())
        return results

    # -- one target --------------------------------------------------------------------------

    async def _call_one(self, state: _TargetState, method: str, spec: Route) -> EngineOutcome:
        label = state.target.label
        async with self._semaphore:
            started = time.perf_counter()
            try:
                try:
                    reply = await self._request(self._pooled(), state, spec)
                except _Retryable:
                    self.retries += 1
                    log.debug("target %s: pooled connection was reset, retrying once", label)
                    reply = await self._request(self._fresh_session(), state, spec)
            except (_Retryable, aiohttp.ClientError, OSError) as exc:
                state.connected = False
                return EngineOutcome(
                    label, Outcome.DISCONNECTED, error=_connection_error(state.target, exc)
                )
            duration = time.perf_counter() - started
            state.connected = True
            if state.vllm_version is None and not state.version_pending:
                state.version_pending = True
                task = asyncio.create_task(self._fetch_version(state))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            return interpret(label, method, reply.status, reply.body, duration)

    async def _fetch_version(self, state: _TargetState) -> None:
        """``GET /version`` once, off the poll path; a failure is retried on a later poll."""
        try:
            reply = await asyncio.wait_for(
                # A one-off request: on a fresh connection, leaving the pool to the polls.
                self._request(self._fresh_session(), state, Route("GET", "/version")),
                VERSION_TIMEOUT_S,
            )
            data = json.loads(reply.body) if reply.status == 200 else None
            if isinstance(data, dict) and isinstance(data.get("version"), str):
                # The registration's rule for the same string (a label of every scrape).
                state.vllm_version = bound_text(data["version"][:MAX_REGISTRATION_STRING])
        except (_Retryable, aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
            log.debug("target %s: no vLLM version", state.target.label)
        finally:
            state.version_pending = False

    def _pooled(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HttpFleetClient.start() was not called")
        return self._session

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self._fresh is None:
            raise RuntimeError("HttpFleetClient.start() was not called")
        return self._fresh

    async def _request(
        self, session: aiohttp.ClientSession, state: _TargetState, spec: Route
    ) -> _Reply:
        state.requests += 1
        try:
            async with session.request(
                spec.verb,
                state.target.url + spec.path,
                params=spec.query,
                json=spec.body,
                allow_redirects=False,
            ) as resp:
                body = await resp.read()
                if resp.status >= 500:
                    # vLLM closes the connection after a 500 without a `connection: close`
                    # header: do not hand it back to the pool.
                    resp.close()
                return _Reply(resp.status, body)
        except aiohttp.ClientConnectorError:
            raise  # could not connect at all: nothing to retry
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise _Retryable(type(exc).__name__) from exc


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _no_args(method: str, args: tuple[Any, ...]) -> None:
    if args:
        raise MethodNotAllowed(f"{method} takes no arguments")


def route(method: str, args: tuple[Any, ...] = ()) -> Route:
    """Pure: the request for one utility call (``MethodNotAllowed`` for a method without a
    route or arguments the route cannot carry)."""
    if method == "is_sleeping":
        _no_args(method, args)
        return Route("GET", "/is_sleeping")
    if method == "is_scheduler_paused":
        _no_args(method, args)
        return Route("GET", "/is_paused")
    if method == "get_weight_version":
        _no_args(method, args)
        return Route("GET", "/weight_info")
    if method == "reset_prefix_cache":
        if len(args) > 2 or not all(isinstance(a, bool) for a in args):
            raise MethodNotAllowed("reset_prefix_cache takes at most two booleans")
        running = args[0] if args else False
        external = args[1] if len(args) > 1 else False
        query = [("reset_running_requests", _bool(running)), ("reset_external", _bool(external))]
        return Route("POST", "/reset_prefix_cache", query)
    if method in ("reset_mm_cache", "reset_encoder_cache", "resume_scheduler"):
        _no_args(method, args)
        path = "/resume" if method == "resume_scheduler" else f"/{method}"
        return Route("POST", path)
    if method == "sleep":
        if len(args) > 2:
            raise MethodNotAllowed("sleep takes (level[, mode])")
        level = args[0] if args else 1
        if isinstance(level, bool) or not isinstance(level, int):
            raise MethodNotAllowed("sleep's level must be an integer")
        query = [("level", str(level))]
        if len(args) > 1:
            query.append(("mode", _mode(args[1])))
        return Route("POST", "/sleep", query)
    if method == "wake_up":
        if len(args) > 1:
            raise MethodNotAllowed("wake_up takes ([tags])")
        tags = args[0] if args else None
        if tags is None:
            return Route("POST", "/wake_up")
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise MethodNotAllowed("wake_up's tags must be a list of strings")
        return Route("POST", "/wake_up", [("tags", t) for t in tags])
    if method == "pause_scheduler":
        if len(args) > 2:
            raise MethodNotAllowed("pause_scheduler takes ([mode[, clear_cache]])")
        query = [("mode", _mode(args[0] if args else "abort"))]
        if len(args) > 1:
            if not isinstance(args[1], bool):
                raise MethodNotAllowed("pause_scheduler's clear_cache must be a boolean")
            query.append(("clear_cache", _bool(args[1])))
        return Route("POST", "/pause", query)
    if method == "set_weight_version":
        if len(args) != 1 or not isinstance(args[0], str):
            raise MethodNotAllowed("set_weight_version takes one string")
        return Route("POST", "/update_weight_version", body={"new_version": args[0]})
    if method == "compute_weight_checksums":
        _no_args(method, args)
        return Route("POST", "/weight_checker", body={"action": "checksum"})
    raise MethodNotAllowed(f"utility method {method!r} has no HTTP route")


def _mode(mode: Any) -> str:
    if not isinstance(mode, str):
        raise MethodNotAllowed("the pause mode must be a string")
    return mode


def _connection_error(target: HttpTarget, exc: BaseException) -> str:
    """A connection failure without request headers (the token) in it."""
    cause = exc.__cause__ if isinstance(exc, _Retryable) and exc.__cause__ else exc
    if isinstance(cause, aiohttp.ClientConnectorError):
        detail = cause.strerror or type(cause.os_error).__name__
        return f"cannot connect to {target.url}: {detail}"
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return f"{target.url} closed the connection without a response"
    if isinstance(cause, OSError) and cause.strerror:
        return f"connection to {target.url} failed: {cause.strerror}"
    return f"connection to {target.url} failed: {type(cause).__name__}"
