"""HTTP attach mode: one vLLM API server per target, reached through its dev endpoints.

Each target (``--http-target URL`` or ``NAME=URL``, repeatable, and ``--http-targets-file``)
is one "engine" to the layers above: its label is its name, or its position ("0", "1", ...).
A target's own answer is already vLLM's aggregate over the ranks that API server manages, so an
API server whose engines disagree (HTTP 500 "Engines returned different is_sleeping results:
[...]") becomes an ``INCONSISTENT`` outcome carrying those values
(``docs/protocol.md`` F.4 / F.4.1).

Mapping of the allow-listed utility methods:

* ``is_sleeping`` → ``GET /is_sleeping``.
* ``is_scheduler_paused`` → no request: vLLM's dev routes have no verified equivalent (``GET
  /is_paused`` is an RL route whose answer and semantics F.4.1 does not pin down), so every target
  gets ``FAILED("not available over HTTP")`` and the paused series stay absent.
* ``reset_prefix_cache`` with ``()``, ``(rr,)`` or ``(rr, rc)`` → ``POST /reset_prefix_cache?
  reset_running_requests=..&reset_external=..`` (query string only; vLLM ignores a body).

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
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.error import MethodNotAllowed
from exporter.fleet import DEFAULT_ALLOWED_METHODS, EngineDetail, EngineOutcome, Outcome
from exporter.transport.http_replies import interpret

log = logging.getLogger("exporter.http")

#: At most this many requests in flight per client (across all targets).
DEFAULT_MAX_CONCURRENCY = 64
NOT_AVAILABLE = "not available over HTTP"
VERSION_TIMEOUT_S = 5.0


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
        """No dev route answers is_scheduler_paused: the poller does not ask (or count) it."""
        return method in self.allowed_methods and method != "is_scheduler_paused"

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
        self, method: str, args: tuple[Any, ...] = (), *, timeout_s: float
    ) -> list[EngineOutcome]:
        """Call ``method`` on every target at once; one outcome per target, in target order."""
        if method not in self.allowed_methods:
            raise MethodNotAllowed(f"utility method {method!r} is not on the allow-list")
        if method == "is_scheduler_paused":
            return [
                EngineOutcome(t.label, Outcome.FAILED, error=NOT_AVAILABLE) for t in self.targets
            ]
        if method == "is_sleeping":
            if args:
                raise MethodNotAllowed("is_sleeping takes no arguments")
            verb, path, query = "GET", "/is_sleeping", None
        elif method == "reset_prefix_cache":
            verb, path, query = "POST", "/reset_prefix_cache", _reset_query(args)
        else:
            raise MethodNotAllowed(f"utility method {method!r} has no HTTP route")
        tasks = {
            s.target.label: asyncio.create_task(self._call_one(s, method, verb, path, query))
            for s in self._states
        }
        try:
            await asyncio.wait(tasks.values(), timeout=timeout_s)
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        results = []
        for s in self._states:
            task = tasks[s.target.label]
            if task.cancelled():
                s.connected = False
                results.append(
                    EngineOutcome(
                        s.target.label,
                        Outcome.TIMEOUT,
                        error=f"no reply within {timeout_s:g}s",
                        duration_s=timeout_s,
                    )
                )
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

    async def _call_one(
        self,
        state: _TargetState,
        method: str,
        verb: str,
        path: str,
        query: dict[str, str] | None,
    ) -> EngineOutcome:
        label = state.target.label
        async with self._semaphore:
            started = time.perf_counter()
            try:
                try:
                    reply = await self._request(self._pooled(), state, verb, path, query)
                except _Retryable:
                    self.retries += 1
                    log.debug("target %s: pooled connection was reset, retrying once", label)
                    reply = await self._request(self._fresh_session(), state, verb, path, query)
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
                self._request(self._fresh_session(), state, "GET", "/version", None),
                VERSION_TIMEOUT_S,
            )
            data = json.loads(reply.body) if reply.status == 200 else None
            if isinstance(data, dict) and isinstance(data.get("version"), str):
                state.vllm_version = data["version"]
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
        self,
        session: aiohttp.ClientSession,
        state: _TargetState,
        verb: str,
        path: str,
        query: dict[str, str] | None,
    ) -> _Reply:
        state.requests += 1
        try:
            async with session.request(
                verb, state.target.url + path, params=query, allow_redirects=False
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


def _reset_query(args: tuple[Any, ...]) -> dict[str, str]:
    if len(args) > 2 or not all(isinstance(a, bool) for a in args):
        raise MethodNotAllowed("reset_prefix_cache takes at most two booleans")
    running = args[0] if args else False
    external = args[1] if len(args) > 1 else False
    return {
        "reset_running_requests": "true" if running else "false",
        "reset_external": "true" if external else "false",
    }


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
