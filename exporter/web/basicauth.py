"""Basic authentication of both listeners (``basic_auth_users`` of ``--web-config-file``).

bcrypt is slow per check by design (its cost: docs/security.md), so a stranger guessing
passwords must not be able to spend that time on the exporter's behalf nor make a good scraper
wait for it:

* a credential verified once is remembered (an HMAC of it, keyed per process, one entry per
  configured user: guesses never evict it) and answered without bcrypt, from any address;
* failed attempts are throttled per source (``admin_guard.AuthThrottle``, ``source_key``)
  *before* bcrypt runs: a throttled source gets 429 with ``Retry-After``, and a source never has
  more checks in flight than failures left in its budget;
* passwords over bcrypt's 72 bytes are refused without bcrypt (they could never match);
* at most ``max_concurrent`` checks run at once (threads: the event loop keeps running) and at
  most ``max_waiting`` wait for a slot; beyond that the answer is 429 at once;
* unknown users are checked against a dummy hash of the configured hashes' highest cost, so
  they take as long as known ones; the final comparison is constant-time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import math
import os
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

import bcrypt
from aiohttp import web

from exporter.config.webconfig import WebConfig
from exporter.web.admin_guard import AuthThrottle, source_key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("exporter.http")

#: Paths answered without basic auth (probes; neither reveals engine addresses). TLS, being the
#: listener's, covers them too.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
REALM = 'Basic realm="vllm-dp-exporter", charset="UTF-8"'
#: bcrypt reads at most this many password bytes; a longer password can never match.
MAX_PASSWORD_BYTES = 72
MAX_CONCURRENT = 4
MAX_WAITING = 8
#: Retry-After (seconds) when the bcrypt queue is full or a source's budget is in flight.
BUSY_RETRY_S = 1.0
_BCRYPT_ALPHABET = b"./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class AuthResult:
    """One verdict: ``ok``; else 429 when ``retry_after`` > 0, 401 otherwise. ``reason``:
    ``ok``, ``missing`` (no or unreadable credentials), ``wrong``, ``throttled``, ``busy``."""

    ok: bool
    reason: str
    retry_after: float = 0.0


OK = AuthResult(True, "ok")
MISSING = AuthResult(False, "missing")
WRONG = AuthResult(False, "wrong")


def dummy_hash(hashes: Iterable[bytes]) -> bytes:
    """A bcrypt hash no password matches, at the highest cost among ``hashes`` (10 without
    any). Free to make: a fresh salt and a random digest, never a bcrypt run."""
    cost = max((int(h[4:6]) for h in hashes), default=10)
    digest = bytes(_BCRYPT_ALPHABET[b % 64] for b in os.urandom(31))
    return bcrypt.gensalt(cost, prefix=b"2b") + digest


class BasicAuthChecker:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes (module docstring)."""

    def __init__(
        self,
        users: Mapping[bytes, bytes],
        *,
        throttle: AuthThrottle | None = None,
        max_concurrent: int = MAX_CONCURRENT,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self._users = dict(users)
        self._dummy = dummy_hash(self._users.values())
        self._key = os.urandom(32)
        #: user → HMAC of the credential last verified for it (only configured users).
        self._verified: dict[bytes, bytes] = {}
        self.throttle = throttle if throttle is not None else AuthThrottle()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._max_pending = max_concurrent + max_waiting
        self._pending = 0
        #: source → its checks running or waiting (only sources with some).
        self._in_flight: dict[str, int] = {}
        self.bcrypt_checks = 0

    @property
    def dummy_cost(self) -> int:
        return int(self._dummy[4:6])

    @staticmethod
    def parse(header: str) -> tuple[bytes, bytes] | None:
        scheme, _, encoded = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user, sep, password = decoded.partition(b":")
        return (user, password) if sep else None

    def _check(self, user: bytes, password: bytes) -> bool:
        known = user in self._users
        hashed = self._users.get(user, self._dummy)
        self.bcrypt_checks += 1
        try:
            computed = bcrypt.hashpw(password, hashed)
        except ValueError:  # refused by bcrypt (never expected: lengths are checked first)
            return False
        return hmac.compare_digest(computed, hashed) and known

    async def authenticate(self, header: str, source: str) -> AuthResult:
        """The verdict on ``header`` (an Authorization header's value) from ``source`` (a
        ``source_key``)."""
        parsed = self.parse(header)
        if parsed is None:
            return MISSING  # nothing guessed, nothing spent: not a failed attempt
        user, password = parsed
        digest = hmac.new(
            self._key, len(user).to_bytes(4, "big") + user + password, hashlib.sha256
        ).digest()
        if hmac.compare_digest(self._verified.get(user, b""), digest):
            return OK
        retry = self.throttle.retry_after(source)
        if retry > 0:
            return AuthResult(False, "throttled", retry)
        if len(password) > MAX_PASSWORD_BYTES:
            self.throttle.record_failure(source)
            return WRONG
        if self._in_flight.get(source, 0) >= self.throttle.remaining(source):
            return AuthResult(False, "throttled", BUSY_RETRY_S)
        if self._pending >= self._max_pending:
            return AuthResult(False, "busy", BUSY_RETRY_S)
        self._pending += 1
        self._in_flight[source] = self._in_flight.get(source, 0) + 1
        try:
            async with self._slots:
                ok = await asyncio.to_thread(self._check, user, password)
        finally:
            self._pending -= 1
            left = self._in_flight.pop(source) - 1
            if left:
                self._in_flight[source] = left
        if ok:
            self._verified[user] = digest
            return OK
        self.throttle.record_failure(source)
        return WRONG

    async def check(self, header: str, source: str = "unknown") -> bool:
        """Whether ``header`` names a user and its password (and was not refused unchecked)."""
        return (await self.authenticate(header, source)).ok


def unauthorized() -> web.Response:
    return web.Response(status=401, text="Unauthorized\n", headers={"WWW-Authenticate": REALM})


def too_many(retry_after: float) -> web.Response:
    return web.Response(
        status=429,
        text="Too Many Requests\n",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )


BASIC_AUTH_KEY: web.AppKey[BasicAuthChecker] = web.AppKey("basic_auth", BasicAuthChecker)


def protect(
    app: web.Application,
    config: WebConfig | None,
    *,
    basic_auth: bool = True,
    open_paths: Collection[str] = OPEN_PATHS,
) -> None:
    """Apply ``config`` to ``app`` (before it starts): the configured response headers, and
    (``basic_auth``) a middleware asking every path but ``open_paths`` for basic auth (its
    checker in ``app[BASIC_AUTH_KEY]``). TLS is the listener's: ``config.ssl_context`` goes
    to the ``TCPSite``."""
    if config is None:
        return
    if config.headers:
        headers = dict(config.headers)

        async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
            for name, value in headers.items():  # a header the route set itself is kept
                response.headers.setdefault(name, value)

        app.on_response_prepare.append(add_headers)
    if basic_auth and config.users:
        checker = BasicAuthChecker(config.users)
        app[BASIC_AUTH_KEY] = checker

        @web.middleware
        async def require_basic_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path in open_paths:
                return await handler(request)
            result = await checker.authenticate(
                request.headers.get("Authorization", ""), source_key(request.remote)
            )
            if result.ok:
                return await handler(request)
            log.debug(
                "%s %s from %s: basic auth %s",
                request.method,
                request.path,
                request.remote,
                result.reason,
            )
            return too_many(result.retry_after) if result.retry_after > 0 else unauthorized()

        app.middlewares.append(require_basic_auth)
