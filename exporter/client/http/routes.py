"""The dev or RL route of vLLM's API server that stands for one utility call (``route``, pure;
HTTP mode, ``docs/protocol.md`` F.4), and one exchange of a route with an API server
(``exchange``: vLLM's connection habits, an answer read up to a fixed limit).

Every answer is read up to :data:`MAX_ANSWER` (:data:`MAX_CHECKSUM_ANSWER` for the weight
checksums, :data:`MAX_METRICS_ANSWER` for ``/metrics``): a target that sends more (a body that
never ends) costs the exporter that much at most, its answer is refused (``Reply.cut``: the
caller makes it a failed call naming the limit, ``answer_too_long``) and its connection dropped,
never reused.

Mapping of the allow-listed utility methods (dev and RL routes, F.4; replies: ``replies``):

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
* ``checkpoint_state`` → ``GET /checkpoint/status``; ``checkpoint_prepare([mode])`` →
  ``POST /checkpoint/prepare?mode=..``; ``checkpoint_restore()`` → ``POST /checkpoint/restore``
  (vLLM 0.34 with ``--enable-sleep-mode``; ``exporter.client.http.checkpoint``).
* ``has_work`` → ``GET /metrics`` (vLLM has no route for it; served without dev mode): the
  target's running and waiting requests, ``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting`` summed over the ``engine`` labels it publishes, and ``has_work``
  true when they add up above zero (``replies.read_activity``). vLLM's batch queue and DP wave,
  which its ``EngineCore.has_work`` also counts, do not show there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.error import MethodNotAllowed

Query = list[tuple[str, str]]

#: The most of one answer read from a target. A dev or RL route answers under 1 KiB; a plugin's
#: ``/dp/gate`` for 1,024 engines, every string at its 256-byte cut, about 1.5 MiB: 4 MiB keeps
#: every real answer whole and a hostile one at a few MiB per target and poll.
MAX_ANSWER = 4 << 20
#: ``POST /weight_checker`` (``compute_weight_checksums``): one key and digest per tensor of every
#: worker behind the server (about 150 bytes each), several MiB for a large model; 32 MiB holds
#: some 200,000 tensors. Only an admin action (authenticated, rate-limited) reads this much.
MAX_CHECKSUM_ANSWER = 32 << 20
#: ``GET /metrics`` (``has_work``): vLLM's whole Prometheus exposition, read every poll for two
#: of its families. It holds every family of every engine the server manages (some 50-60 KiB
#: per engine with its histograms, more with LoRA or spec-decode series): 16 MiB keeps a server
#: of 256 engines whole; a longer answer is refused (``has_work`` failed, never guessed idle).
MAX_METRICS_ANSWER = 16 << 20


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP request standing for one utility call, and the most of its answer read."""

    verb: str
    path: str
    query: Query | None = None
    body: dict[str, Any] | None = None  # sent as JSON
    #: Not part of the request (two routes that send the same are equal).
    limit: int = field(default=MAX_ANSWER, compare=False)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _no_args(method: str, args: tuple[Any, ...]) -> None:
    if args:
        raise MethodNotAllowed(f"{method} takes no arguments")


#: The routes of the methods that take no arguments.
PLAIN_ROUTES = {
    "is_sleeping": Route("GET", "/is_sleeping"),
    "is_scheduler_paused": Route("GET", "/is_paused"),
    "get_weight_version": Route("GET", "/weight_info"),
    "has_work": Route("GET", "/metrics", limit=MAX_METRICS_ANSWER),
    "reset_mm_cache": Route("POST", "/reset_mm_cache"),
    "reset_encoder_cache": Route("POST", "/reset_encoder_cache"),
    "resume_scheduler": Route("POST", "/resume"),
    "compute_weight_checksums": Route(
        "POST", "/weight_checker", body={"action": "checksum"}, limit=MAX_CHECKSUM_ANSWER
    ),
    "checkpoint_state": Route("GET", "/checkpoint/status"),
    "checkpoint_restore": Route("POST", "/checkpoint/restore"),
}


def route(method: str, args: tuple[Any, ...] = ()) -> Route:
    """Pure: the request for one utility call (``MethodNotAllowed`` for a method without a
    route or arguments the route cannot carry)."""
    plain = PLAIN_ROUTES.get(method)
    if plain is not None:
        _no_args(method, args)
        return plain
    build = _BUILDERS.get(method)
    if build is None:
        raise MethodNotAllowed(f"utility method {method!r} has no HTTP route")
    return build(args)


def _reset_prefix_cache(args: tuple[Any, ...]) -> Route:
    if len(args) > 2 or not all(isinstance(a, bool) for a in args):
        raise MethodNotAllowed("reset_prefix_cache takes at most two booleans")
    running = args[0] if args else False
    external = args[1] if len(args) > 1 else False
    query = [("reset_running_requests", _bool(running)), ("reset_external", _bool(external))]
    return Route("POST", "/reset_prefix_cache", query)


def _sleep(args: tuple[Any, ...]) -> Route:
    if len(args) > 2:
        raise MethodNotAllowed("sleep takes (level[, mode])")
    level = args[0] if args else 1
    if isinstance(level, bool) or not isinstance(level, int):
        raise MethodNotAllowed("sleep's level must be an integer")
    query = [("level", str(level))]
    if len(args) > 1:
        query.append(("mode", _mode(args[1])))
    return Route("POST", "/sleep", query)


def _wake_up(args: tuple[Any, ...]) -> Route:
    if len(args) > 1:
        raise MethodNotAllowed("wake_up takes ([tags])")
    tags = args[0] if args else None
    if tags is None:
        return Route("POST", "/wake_up")
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise MethodNotAllowed("wake_up's tags must be a list of strings")
    return Route("POST", "/wake_up", [("tags", t) for t in tags])


def _pause_scheduler(args: tuple[Any, ...]) -> Route:
    if len(args) > 2:
        raise MethodNotAllowed("pause_scheduler takes ([mode[, clear_cache]])")
    query = [("mode", _mode(args[0] if args else "abort"))]
    if len(args) > 1:
        if not isinstance(args[1], bool):
            raise MethodNotAllowed("pause_scheduler's clear_cache must be a boolean")
        query.append(("clear_cache", _bool(args[1])))
    return Route("POST", "/pause", query)


def _checkpoint_prepare(args: tuple[Any, ...]) -> Route:
    if len(args) > 1:
        raise MethodNotAllowed("checkpoint_prepare takes ([mode])")
    return Route("POST", "/checkpoint/prepare", [("mode", _mode(args[0] if args else "wait"))])


def _set_weight_version(args: tuple[Any, ...]) -> Route:
    if len(args) != 1 or not isinstance(args[0], str):
        raise MethodNotAllowed("set_weight_version takes one string")
    return Route("POST", "/update_weight_version", body={"new_version": args[0]})


#: The routes of the methods with arguments, each built (and its arguments checked) by one.
_BUILDERS: dict[str, Callable[[tuple[Any, ...]], Route]] = {
    "reset_prefix_cache": _reset_prefix_cache,
    "sleep": _sleep,
    "wake_up": _wake_up,
    "pause_scheduler": _pause_scheduler,
    "set_weight_version": _set_weight_version,
    "checkpoint_prepare": _checkpoint_prepare,
}


#: Every utility method HTTP mode has a route for (vLLM 0.34's ``is_inference_ready`` has none:
#: a server's readiness goes through other routes).
ROUTED_METHODS = frozenset(PLAIN_ROUTES) | frozenset(_BUILDERS)


def _mode(mode: Any) -> str:
    if not isinstance(mode, str):
        raise MethodNotAllowed("the pause mode must be a string")
    return mode


# -- one exchange ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    #: The answer was longer than the limit: ``body`` is its first bytes (just past the limit),
    #: the rest was never read and the connection was dropped.
    cut: bool = False


class Retryable(Exception):
    """A pooled connection was reset before any response: worth one retry on a fresh one."""


async def exchange(
    session: aiohttp.ClientSession, base_url: str, spec: Route, limit: int | None = None
) -> Reply:
    """One request and its answer, read up to ``limit`` (default: the route's): a longer body
    is cut just past it (``Reply.cut``, its connection dropped), never buffered whole. A read
    cancelled (the caller's deadline) or failed midway drops its connection too: a half-read
    answer must not reach the next request on a pooled connection."""
    limit = spec.limit if limit is None else limit
    try:
        async with session.request(
            spec.verb,
            base_url + spec.path,
            params=spec.query,
            json=spec.body,
            allow_redirects=False,
        ) as resp:
            # Kept: an answer just over the limit may have arrived whole, its connection back
            # in the pool, before the read reaches the limit; it is dropped all the same.
            transport = resp.connection.transport if resp.connection is not None else None
            try:
                body = await _read_at_most(resp, limit)
            except BaseException:
                resp.close()
                raise
            if len(body) > limit and transport is not None:
                transport.close()
            if resp.status >= 500:
                # vLLM closes the connection after a 500 without a `connection: close`
                # header: do not hand it back to the pool.
                resp.close()
            return Reply(resp.status, body, cut=len(body) > limit)
    except aiohttp.ClientConnectorError:
        raise  # could not connect at all: nothing to retry
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        raise Retryable(type(exc).__name__) from exc


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            resp.close()
            break
    return bytes(body)


def answer_too_long(path: str, limit: int) -> str:
    """The error of a call whose answer was longer than ``limit`` (``Reply.cut``)."""
    return f"answer from {path} longer than {limit >> 20} MiB (the limit of one answer): refused"


def connection_error(url: str, exc: BaseException) -> str:
    """A connection failure without request headers (the token) in it."""
    cause = exc.__cause__ if isinstance(exc, Retryable) and exc.__cause__ else exc
    if isinstance(cause, aiohttp.ClientConnectorError):
        detail = cause.strerror or type(cause.os_error).__name__
        return f"cannot connect to {url}: {detail}"
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return f"{url} closed the connection without a response"
    if isinstance(cause, OSError) and cause.strerror:
        return f"connection to {url} failed: {cause.strerror}"
    return f"connection to {url} failed: {type(cause).__name__}"
