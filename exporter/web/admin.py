"""The admin listener: collective actions on every engine (``POST /admin/<action>``), one
route per entry of ``exporter.control.actions.ACTIONS`` (the prefix-cache reset, sleep,
wake_up, pause, resume, weight_version, reset_mm_cache, reset_encoder_cache, verify_weights).

This module keeps the HTTP concerns; ``exporter.control.runner.ActionRunner`` runs the action.
A request passes a chain of small guards, each of which may answer it early: authentication
(bearer token compared in constant time, never logged; failed attempts rate limited per source
address, a correct token always accepted), a small request body, chunked or not (413), the
action's parameters (400), the relay-mode policy (403), Idempotency-Key replay
(``exporter.web.admin_guard``), one action at a time (409) and the action's minimum interval
(429). POST only (405). Every request leaves one audit record in the structured log
(``exporter.base.logs.log_audit``: logger ``exporter.audit``).

With ``--web-config-file`` the listener serves TLS; its ``basic_auth_users`` authenticate admin
requests only when no admin token is configured (one Authorization header carries one scheme;
the token, when configured, stays the admin's credential).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.base.logs import log_audit
from exporter.control.actions import ACTIONS, ActionSpec
from exporter.control.parsing import ActionRequest, BadActionRequest
from exporter.control.runner import ActionParts, ActionRunner
from exporter.control.runtime import Exporter
from exporter.web.admin_guard import (
    AuthThrottle,
    IdempotencyStore,
    Replay,
    read_body_bounded,
    source_key,
)
from exporter.web.basicauth import REALM as BASIC_REALM
from exporter.web.basicauth import BasicAuthChecker, protect
from exporter.web.httpguard import BAD_REQUESTS_KEY

log = logging.getLogger("exporter.admin")

#: Every action is served on ``/admin/<name>``; the reset's path is the one scripts name most.
RESET_PATH = "/admin/reset_prefix_cache"
ADMIN_SHUTDOWN_KEY: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("admin_shutdown")
MAX_ADMIN_BODY = 1024
BEARER_REALM = 'Bearer realm="vllm-dp-exporter"'
#: A request body (chunked or not) must arrive within this many seconds (408 otherwise).
BODY_TIMEOUT_S = 5.0
#: Answers of completed actions: stored and replayed for Idempotency-Key retries.
STORED_STATUSES = frozenset({200, 501, 502})
RELAY_REFUSAL = (
    "{action} changes engine state, and in relay mode the stock front end would not learn of "
    "it (its own vllm:engine_sleep_state would go stale); run it through the front end, or "
    "start the exporter with --relay-allow-state-changes"
)
Handler = Callable[[web.Request], Awaitable[web.Response]]
#: Status, JSON body and headers of an answer.
Answer = tuple[int, dict[str, Any], dict[str, str]]


@dataclass(frozen=True)
class AdminHttpRequest:
    """What the guards read of an HTTP request, whichever server received it (this module's
    aiohttp listener, or the FastAPI routes of ``exporter.inprocess`` on vLLM's own port)."""

    #: Case-insensitive; header values that are not UTF-8 as surrogate escapes.
    headers: Mapping[str, str]
    query: Mapping[str, list[str]]
    remote: str | None
    #: The body, reading at most ``limit`` + 1 bytes for at most ``timeout_s`` seconds; or the
    #: status and error to answer (``read_body_bounded``'s contract).
    read_body: Callable[[int, float], Awaitable[bytes | tuple[int, str]]]


def from_aiohttp(request: web.Request) -> AdminHttpRequest:
    async def read_body(limit: int, timeout_s: float) -> bytes | tuple[int, str]:
        return await read_body_bounded(request, limit, timeout_s)

    query = {k: request.query.getall(k) for k in request.query}
    return AdminHttpRequest(request.headers, query, request.remote, read_body)


@dataclass
class Pending:
    """One admin request on its way through the guards, and what they learnt of it."""

    http: AdminHttpRequest
    spec: ActionSpec
    audit: dict[str, Any]
    body: bytes = b""
    parsed: ActionRequest | None = None
    key: str | None = None

    @property
    def request(self) -> ActionRequest:
        """The parsed request (the guards after parsing only)."""
        if self.parsed is None:
            raise RuntimeError("the admin request is not parsed yet")
        return self.parsed


Step = Callable[[Pending], Awaitable[Answer | None]]


def retry_after(last: float | None, interval_s: float, now: float) -> float:
    """Seconds until an action that last started at ``last`` may start again (<= 0: now)."""
    return 0.0 if last is None else interval_s - (now - last)


class AdminController:
    """State of the admin endpoint: single flight, idempotency cache, rate limits."""

    def __init__(
        self,
        parts: ActionParts,
        *,
        audit: Callable[[dict[str, Any]], None] = log_audit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.parts = parts
        self._audit = audit
        self._clock = clock
        self.runner = ActionRunner(parts)
        self._inflight: asyncio.Task[tuple[int, dict[str, Any]]] | None = None
        self._inflight_action = ""
        #: action → when it last started (actions with a minimum interval only).
        self._last_started: dict[str, float] = {}
        self.idempotency = IdempotencyStore(clock=clock)
        self.auth_throttle = AuthThrottle(clock=clock)
        token = parts.config.admin_token
        self._token = token.encode() if token is not None else None
        web = parts.config.web
        self._basic = (
            BasicAuthChecker(web.users, throttle=self.auth_throttle)
            if token is None and web is not None and web.users
            else None
        )
        #: The guards, in order: the first to answer ends the request.
        self.steps: tuple[Step, ...] = (
            self._authenticate,
            self._read_body,
            self._parse,
            self._relay_policy,
            self._idempotency,
            self._single_flight,
            self._rate_limit,
        )

    @property
    def basic_auth(self) -> BasicAuthChecker | None:
        """The web config's basic-auth checker of this listener (None: a token, or no users)."""
        return self._basic

    # -- checks ----------------------------------------------------------------------------

    async def _auth_refusal(
        self, request: AdminHttpRequest, audit: dict[str, Any]
    ) -> Answer | None:
        """None when authenticated (the bearer token when one is configured, else the web
        config's basic auth users when there are some, else nothing to check), else the 401
        or 429 to answer. Only failed attempts are throttled, and per source: a correct token
        (or a basic-auth credential already verified) is always accepted, whatever strangers
        (or this address) tried before; basic auth asks the throttle before bcrypt runs."""
        source = source_key(request.remote)
        busy = False
        if self._basic is not None:
            header = request.headers.get("Authorization", "")
            result = await self._basic.authenticate(header, source)
            if result.ok:
                return None
            retry, busy = result.retry_after, result.reason == "busy"
        else:
            if self._token_ok(request):
                return None
            retry = self.auth_throttle.retry_after(source)
            if retry <= 0:
                self.auth_throttle.record_failure(source)
        if retry > 0:
            audit["outcome"] = "auth_rate_limited"
            error = (
                "too many authentication checks at once"
                if busy
                else "too many failed authentication attempts"
            )
            return 429, {"error": error}, {"Retry-After": str(max(1, math.ceil(retry)))}
        audit["outcome"] = "unauthorized"
        if self._basic is not None:
            error, challenge = "missing or invalid basic-auth credentials", BASIC_REALM
        else:
            error, challenge = "missing or invalid bearer token", BEARER_REALM
        return 401, {"error": error}, {"WWW-Authenticate": challenge}

    def _token_ok(self, request: AdminHttpRequest) -> bool:
        """Constant-time comparison of the raw bytes presented (aiohttp hands header bytes
        that are not UTF-8 over as surrogate escapes; they are turned back into the bytes)."""
        if self._token is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer":
            presented = ""
        raw = presented.strip().encode("utf-8", "surrogateescape")
        return hmac.compare_digest(raw, self._token)

    # -- the request -----------------------------------------------------------------------

    def route(self, spec: ActionSpec) -> Handler:
        """The aiohttp handler of ``POST /admin/<spec.name>``."""

        async def handler(request: web.Request) -> web.Response:
            status, body, headers = await self.handle(from_aiohttp(request), spec)
            return web.json_response(body, status=status, headers=headers)

        return handler

    async def handle(self, request: AdminHttpRequest, spec: ActionSpec) -> Answer:
        """The answer to one admin request: audited and counted whatever it is."""
        started = time.perf_counter()
        pending = Pending(
            request,
            spec,
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "event": "admin_request",
                "action": spec.name,
                "client": request.remote,
            },
        )
        try:
            status, body, headers = await self._decide(pending)
        except Exception:  # a bug: still answered, audited and counted, never a bare 500
            log.exception("admin request failed")
            pending.audit["outcome"] = "internal_error"
            status, body, headers = 500, {"error": "internal error"}, {}
        pending.audit.update(status=status, duration_s=round(time.perf_counter() - started, 6))
        self.parts.stats.record_admin_request(spec.name, status)
        self._audit(pending.audit)
        return status, body, headers

    async def _decide(self, pending: Pending) -> Answer:
        """The first guard's answer, or the action's once every guard let it through."""
        for step in self.steps:
            answer = await step(pending)
            if answer is not None:
                return answer
        return await self._start(pending)

    # -- the guards: each answers the request early, or returns None to pass it on ----------

    async def _authenticate(self, pending: Pending) -> Answer | None:
        return await self._auth_refusal(pending.http, pending.audit)

    async def _read_body(self, pending: Pending) -> Answer | None:
        body_or_problem = await pending.http.read_body(MAX_ADMIN_BODY, BODY_TIMEOUT_S)
        if isinstance(body_or_problem, tuple):
            pending.audit["outcome"] = "bad_request"
            return body_or_problem[0], {"error": body_or_problem[1]}, {}
        pending.body = body_or_problem
        return None

    async def _parse(self, pending: Pending) -> Answer | None:
        try:
            parsed = pending.spec.parse(dict(pending.http.query), pending.body)
        except BadActionRequest as exc:
            pending.audit["outcome"] = "bad_request"
            return 400, {"error": str(exc)}, {}
        pending.parsed = parsed
        pending.audit[pending.spec.answer.params_key] = dict(parsed.params)
        return None

    async def _relay_policy(self, pending: Pending) -> Answer | None:
        config = self.parts.config
        if (
            pending.spec.state_changing
            and self.parts.fleet.capabilities.beside_a_front_end
            and not config.relay_allow_state_changes
        ):
            pending.audit["outcome"] = "refused_in_relay_mode"
            return 403, {"error": RELAY_REFUSAL.format(action=pending.spec.name)}, {}
        return None

    async def _idempotency(self, pending: Pending) -> Answer | None:
        key = pending.http.headers.get("Idempotency-Key")
        if key is None:
            return None
        audit = pending.audit
        if not 0 < len(key) <= 200:
            audit["outcome"] = "bad_request"
            return 400, {"error": "Idempotency-Key must be 1-200 characters"}, {}
        seen = self.idempotency.check(key, pending.request.fingerprint)
        if seen == "mismatch":
            audit["outcome"] = "idempotency_key_reused"
            error = "this Idempotency-Key was used with other parameters; use a new key"
            return 422, {"error": error}, {}
        if seen == "in_flight":
            audit["outcome"] = "conflict"
            error = "a request with this Idempotency-Key is still running; retry later"
            return 409, {"error": error}, {}
        if isinstance(seen, Replay):
            audit["outcome"] = "idempotent_replay"
            return seen.status, seen.body, {"Idempotency-Replayed": "true"}
        pending.key = key
        return None

    async def _single_flight(self, pending: Pending) -> Answer | None:
        if self._inflight is not None and not self._inflight.done():
            pending.audit["outcome"] = "conflict"
            running = self._inflight_action
            return 409, {"error": f"an admin action ({running}) is already running"}, {}
        return None

    async def _rate_limit(self, pending: Pending) -> Answer | None:
        limit = pending.spec.rate_limit
        if limit is None:
            return None
        interval = limit.interval(self.parts.config)
        wait = retry_after(self._last_started.get(pending.spec.name), interval, self._clock())
        if wait <= 0:
            return None
        pending.audit["outcome"] = "rate_limited"
        return 429, {"error": limit.refusal(interval)}, {"Retry-After": str(math.ceil(wait))}

    # -- the action --------------------------------------------------------------------------

    async def _start(self, pending: Pending) -> Answer:
        """Every guard passed: run the action, shielded (a client that hangs up does not cut a
        fan-out in half)."""
        spec, request, key = pending.spec, pending.request, pending.key
        if spec.rate_limit is not None:
            self._last_started[spec.name] = self._clock()
        self._inflight_action = spec.name
        self._inflight = asyncio.create_task(self._keyed(request, key))
        if key is not None:  # held from now on, released however the task ends
            self.idempotency.begin(key, request.fingerprint)
            self._inflight.add_done_callback(lambda _: self.idempotency.finish(key, None))
        status, body = await asyncio.shield(self._inflight)
        pending.audit["outcome"] = body.get("outcome", "failure")
        pending.audit["failed_engines"] = body.get("failed_engines", [])
        return status, body, {}

    async def _keyed(self, request: ActionRequest, key: str | None) -> tuple[int, dict[str, Any]]:
        """The action; its Idempotency-Key's answer is stored only when the action completed
        (200, 501 or 502; not 503 "no engine connected")."""
        result = await self.runner.run(request)
        if key is not None and result.status in STORED_STATUSES:
            self.idempotency.finish(key, Replay(result.status, result.body))
        return result.status, result.body

    async def drain(self, grace_s: float) -> None:
        """At shutdown: let an in-flight action finish, up to ``grace_s``."""
        task = self._inflight
        if task is not None and not task.done():
            log.info(
                "waiting up to %.1fs for the in-flight admin action (%s)",
                grace_s,
                self._inflight_action,
            )
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            if not task.done():
                task.cancel()


ADMIN_KEY: web.AppKey[AdminController] = web.AppKey("admin")


def create_admin_app(
    exporter: Exporter, *, audit: Callable[[dict[str, Any]], None] = log_audit
) -> web.Application:
    """The admin application (served on ``--admin-listen``)."""
    app = web.Application(client_max_size=MAX_ADMIN_BODY)
    protect(app, exporter.config.web, basic_auth=False)  # headers; auth is the controller's
    controller = AdminController(exporter.action_parts(), audit=audit)
    app[ADMIN_KEY] = controller
    app[BAD_REQUESTS_KEY] = exporter.faults.http_listener("admin")
    for spec in ACTIONS.values():
        for path in spec.paths:
            app.router.add_post(f"/admin/{path}", controller.route(spec))

    async def shutdown() -> None:
        await controller.drain(exporter.config.shutdown_grace)

    app[ADMIN_SHUTDOWN_KEY] = shutdown
    return app
