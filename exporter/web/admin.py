"""The admin listener: collective actions on every engine (``POST /admin/<action>``):
``reset_prefix_cache`` (AND semantics) and the actions of ``exporter.control.actions`` (sleep,
wake_up, pause, resume, weight_version, reset_mm_cache, reset_encoder_cache), each verified by
reading the state back on every engine where the engine exposes it.

Secured by default: bearer token compared in constant time (never logged), failed tokens rate
limited per source address (a correct token is always accepted), one action at a time (409),
Idempotency-Key replay (``exporter.web.admin_guard``), a minimum interval (429), small request
bodies, chunked or not (413), POST only (405). Every request leaves one audit record in the
structured log (``exporter.base.logs.log_audit``: logger ``exporter.audit``).

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
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from exporter.base.logs import log_audit
from exporter.client.fleet import Outcome
from exporter.control.actions import (
    ACTIONS,
    ActionRequest,
    BadRequest,
    run_action,
    run_verify_weights,
)
from exporter.control.reset import parse_reset, reset_body
from exporter.control.runtime import Exporter
from exporter.fleetstate.aggregate import aggregate_all_true
from exporter.web.admin_guard import (
    AuthThrottle,
    IdempotencyStore,
    Replay,
    read_body_bounded,
    source_key,
)
from exporter.web.basicauth import REALM as BASIC_REALM
from exporter.web.basicauth import BasicAuth, protect
from exporter.web.httpguard import BAD_REQUESTS_KEY

log = logging.getLogger("exporter.admin")

RESET_PATH = "/admin/reset_prefix_cache"
ADMIN_SHUTDOWN_KEY: web.AppKey[Callable[[], Awaitable[None]]] = web.AppKey("admin_shutdown")
MAX_ADMIN_BODY = 1024
BEARER_REALM = 'Bearer realm="vllm-dp-exporter"'
#: A request body (chunked or not) must arrive within this many seconds (408 otherwise).
BODY_TIMEOUT_S = 5.0
#: Answers of completed resets: stored and replayed for Idempotency-Key retries.
STORED_STATUSES = frozenset({200, 502})
RELAY_REFUSAL = (
    "{action} changes engine state, and in relay mode the stock front end would not learn of "
    "it (its own vllm:engine_sleep_state would go stale); run it through the front end, or "
    "start the exporter with --relay-allow-state-changes"
)
Parser = Callable[[dict[str, list[str]], bytes], ActionRequest]
Handler = Callable[[web.Request], Awaitable[web.Response]]


class AdminController:
    """State of the admin endpoint: single flight, idempotency cache, rate limits."""

    def __init__(
        self,
        exporter: Exporter,
        *,
        audit: Callable[[dict[str, Any]], None] = log_audit,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.exporter = exporter
        self._audit = audit
        self._clock = clock
        self._inflight: asyncio.Task[tuple[int, dict[str, Any]]] | None = None
        self._inflight_action = ""
        self._last_reset: float | None = None
        self.idempotency = IdempotencyStore(clock=clock)
        self.auth_throttle = AuthThrottle(clock=clock)
        token = exporter.config.admin_token
        self._token = token.encode() if token is not None else None
        web = exporter.config.web
        self._basic = (
            BasicAuth(web.users, throttle=self.auth_throttle)
            if token is None and web is not None and web.users
            else None
        )

    # -- checks ----------------------------------------------------------------------------

    async def _auth_refusal(
        self, request: web.Request, audit: dict[str, Any]
    ) -> tuple[int, dict[str, Any], dict[str, str]] | None:
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

    def _token_ok(self, request: web.Request) -> bool:
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

    def route(self, action: str, parse: Parser, state_changing: bool) -> Handler:
        """The aiohttp handler of ``POST /admin/<action>``."""

        async def handler(request: web.Request) -> web.Response:
            return await self.handle(request, action, parse, state_changing)

        return handler

    async def handle(
        self,
        request: web.Request,
        action: str = "reset_prefix_cache",
        parse: Parser | None = None,
        state_changing: bool = False,
    ) -> web.Response:
        started = time.perf_counter()
        audit: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "event": "admin_request",
            "action": action,
            "client": request.remote,
        }
        try:
            status, body, headers = await self._decide(
                request, audit, action, parse or parse_reset, state_changing
            )
        except Exception:  # a bug: still answered, audited and counted, never a bare 500
            log.exception("admin request failed")
            audit["outcome"] = "internal_error"
            status, body, headers = 500, {"error": "internal error"}, {}
        audit.update(status=status, duration_s=round(time.perf_counter() - started, 6))
        self.exporter.stats.record_admin_request(action, status)
        self._audit(audit)
        return web.json_response(body, status=status, headers=headers)

    async def _decide(
        self,
        request: web.Request,
        audit: dict[str, Any],
        action: str,
        parse: Parser,
        state_changing: bool,
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        refusal = await self._auth_refusal(request, audit)
        if refusal is not None:
            return refusal
        body_or_problem = await read_body_bounded(request, MAX_ADMIN_BODY, BODY_TIMEOUT_S)
        if isinstance(body_or_problem, tuple):
            audit["outcome"] = "bad_request"
            return body_or_problem[0], {"error": body_or_problem[1]}, {}
        try:
            parsed = parse({k: request.query.getall(k) for k in request.query}, body_or_problem)
        except BadRequest as exc:
            audit["outcome"] = "bad_request"
            return 400, {"error": str(exc)}, {}
        audit["params" if action != "reset_prefix_cache" else "flags"] = dict(parsed.params)
        config = self.exporter.config
        if state_changing and config.attach == "relay" and not config.relay_allow_state_changes:
            audit["outcome"] = "refused_in_relay_mode"
            return 403, {"error": RELAY_REFUSAL.format(action=action)}, {}
        fingerprint = parsed.fingerprint
        key = request.headers.get("Idempotency-Key")
        if key is not None:
            if not 0 < len(key) <= 200:
                audit["outcome"] = "bad_request"
                return 400, {"error": "Idempotency-Key must be 1-200 characters"}, {}
            seen = self.idempotency.check(key, fingerprint)
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
        if self._inflight is not None and not self._inflight.done():
            audit["outcome"] = "conflict"
            running = self._inflight_action
            return 409, {"error": f"an admin action ({running}) is already running"}, {}
        if action == "reset_prefix_cache":
            min_interval = config.reset_min_interval
            if self._last_reset is not None:
                wait = min_interval - (self._clock() - self._last_reset)
                if wait > 0:
                    audit["outcome"] = "rate_limited"
                    return (
                        429,
                        {"error": f"resets are limited to one every {min_interval:g}s"},
                        {"Retry-After": str(math.ceil(wait))},
                    )
            self._last_reset = self._clock()
        self._inflight_action = action
        self._inflight = asyncio.create_task(self._keyed(parsed, key))
        if key is not None:  # held from now on, released however the task ends
            self.idempotency.begin(key, fingerprint)
            self._inflight.add_done_callback(lambda _: self.idempotency.finish(key, None))
        # Shielded: a client that hangs up does not cut a fan-out in half.
        status, body = await asyncio.shield(self._inflight)
        audit["outcome"] = body.get("outcome", "failure")
        audit["failed_engines"] = body.get("failed_engines", [])
        return status, body, {}

    async def _keyed(self, request: ActionRequest, key: str | None) -> tuple[int, dict[str, Any]]:
        """The action; its Idempotency-Key's answer is stored only when the action completed
        (200 or 502; not 503 "no engine connected")."""
        if request.action == "reset_prefix_cache":
            status, body = await self._reset(request)
        else:
            status, body = await self._action(request)
        self.exporter.stats.record_last_action(request.action, status, body)
        # The state may have changed: the gate's shared sample and the last poll are older.
        self.exporter.gate.invalidate()
        self.exporter.poller.poll_soon()
        if key is not None and status in STORED_STATUSES:
            self.idempotency.finish(key, Replay(status, body))
        return status, body

    async def _action(self, request: ActionRequest) -> tuple[int, dict[str, Any]]:
        exporter = self.exporter
        config = exporter.config
        stats = exporter.stats
        if request.action == "verify_weights":
            result = await run_verify_weights(
                exporter.fleet, timeout_s=config.verify_weights_timeout
            )
            if "mismatches" in result.extra:
                stats.record_weight_verification(result.extra["mismatches"], time.time())
        else:
            result = await run_action(exporter.fleet, request, timeout_s=config.action_timeout)
        verdict = result.verdict
        if verdict is None:
            stats.record_action(request.action, "failure")
            return result.status, result.body
        stats.record_action(
            request.action, verdict.outcome, [(e.engine, e.reason or "") for e in verdict.failures]
        )
        if not verdict.success:
            log.warning(
                "%s %s: %s",
                request.action,
                verdict.outcome,
                ", ".join(f"engine {e.engine} {e.reason}" for e in verdict.failures),
            )
        return result.status, result.body

    async def _reset(self, request: ActionRequest) -> tuple[int, dict[str, Any]]:
        exporter = self.exporter
        stats = exporter.stats
        started = time.perf_counter()
        timeout = exporter.config.reset_timeout or exporter.config.call_timeout
        flags = dict(request.params)
        outcomes = await exporter.fleet.call_utility(
            "reset_prefix_cache", request.args, timeout_s=timeout
        )
        if all(o.outcome is Outcome.DISCONNECTED for o in outcomes):
            stats.record_reset("failure")
            stats.record_action("reset_prefix_cache", "failure")
            body = {
                "success": False,
                "outcome": "failure",
                "engines": [],
                "failed_engines": [],
                "flags": flags,
                "error": "no engine is connected",
            }
            return 503, body
        duration = time.perf_counter() - started
        verdict = aggregate_all_true("reset_prefix_cache", outcomes)
        failures = [(f.engine, f.reason) for f in verdict.failures]
        stats.record_reset(
            verdict.outcome, failures, duration, time.time() if verdict.success else None
        )
        stats.record_action("reset_prefix_cache", verdict.outcome, failures)
        if not verdict.success:
            log.warning(
                "prefix-cache reset %s: %s",
                verdict.outcome,
                ", ".join(f"engine {f.engine} {f.reason}" for f in verdict.failures),
            )
        return (200 if verdict.success else 502), reset_body(verdict, flags, duration)

    async def drain(self, grace_s: float) -> None:
        """At shutdown: let an in-flight reset finish, up to ``grace_s``."""
        task = self._inflight
        if task is not None and not task.done():
            log.info("waiting up to %.1fs for the in-flight prefix-cache reset", grace_s)
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
    controller = AdminController(exporter, audit=audit)
    app[ADMIN_KEY] = controller
    app[BAD_REQUESTS_KEY] = exporter.errors.http_listener("admin")
    app.router.add_post(RESET_PATH, controller.handle)
    for spec in ACTIONS.values():
        handler = controller.route(spec.name, spec.parse, spec.state_changing)
        app.router.add_post(f"/admin/{spec.name}", handler)

    async def shutdown() -> None:
        await controller.drain(exporter.config.shutdown_grace)

    app[ADMIN_SHUTDOWN_KEY] = shutdown
    return app
