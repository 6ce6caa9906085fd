"""Basic auth without a listener: header parsing, bcrypt checks (at bcrypt's lowest cost),
verified credentials answered without bcrypt, throttling ahead of bcrypt, the bounded queue,
and the middleware and headers ``protect`` adds to an app (mocked requests)."""

from __future__ import annotations

import asyncio
import base64
import threading

import bcrypt
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exporter.config.webconfig import WebConfig
from exporter.web import basicauth
from exporter.web.admin_guard import AuthThrottle
from exporter.web.basicauth import (
    BASIC_AUTH_KEY,
    MISSING,
    OK,
    REALM,
    WRONG,
    BasicAuthChecker,
    dummy_hash,
    protect,
    too_many,
    unauthorized,
)

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4))


def basic(user: str, password: str | bytes) -> str:
    raw = password if isinstance(password, bytes) else password.encode()
    return "Basic " + base64.b64encode(user.encode() + b":" + raw).decode()


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        (basic("ann", "pw:with:colons"), (b"ann", b"pw:with:colons")),
        ("  basic " + base64.b64encode(b"ann:").decode(), (b"ann", b"")),
        ("Bearer abc", None),
        ("Basic !!!", None),
        ("Basic " + base64.b64encode(b"no-colon").decode(), None),
        ("", None),
    ],
)
def test_parse(header: str, parsed: tuple[bytes, bytes] | None) -> None:
    assert BasicAuthChecker.parse(header) == parsed


def test_the_dummy_hash_costs_as_much_as_the_dearest_and_matches_nothing() -> None:
    dear = b"$2b$12$" + HASH[7:]
    assert dummy_hash([HASH, dear])[:7] == b"$2b$12$"
    assert dummy_hash([])[:7] == b"$2b$10$"
    cheap = dummy_hash([HASH])
    assert bcrypt.hashpw(b"", cheap) != cheap and len(cheap) == len(HASH)
    assert BasicAuthChecker({b"ann": HASH}).dummy_cost == 4


async def test_a_verified_credential_is_answered_without_bcrypt() -> None:
    checker = BasicAuthChecker({b"ann": HASH})
    assert await checker.authenticate(basic("ann", "s3cret"), "10.0.0.1") == OK
    assert await checker.authenticate(basic("ann", "s3cret"), "10.0.0.2") == OK
    assert checker.bcrypt_checks == 1
    assert await checker.authenticate(basic("ann", "other"), "10.0.0.2") == WRONG
    assert checker.bcrypt_checks == 2, "another password is checked again"


async def test_unreadable_credentials_are_missing_and_cost_nothing() -> None:
    checker = BasicAuthChecker({b"ann": HASH})
    assert await checker.authenticate("Bearer token", "a") == MISSING
    assert (checker.bcrypt_checks, checker.throttle.remaining("a")) == (0, 5)


async def test_failures_are_throttled_ahead_of_bcrypt_but_not_a_known_credential() -> None:
    checker = BasicAuthChecker({b"ann": HASH}, throttle=AuthThrottle(limit=2))
    assert await checker.authenticate(basic("ann", "s3cret"), "b") == OK
    for user in ("ann", "nobody"):  # an unknown user is checked against the dummy hash
        assert await checker.authenticate(basic(user, "guess"), "a") == WRONG
    assert checker.bcrypt_checks == 3
    throttled = await checker.authenticate(basic("ann", "guess"), "a")
    assert (throttled.ok, throttled.reason) == (False, "throttled") and throttled.retry_after > 0
    assert checker.bcrypt_checks == 3, "no bcrypt for a throttled source"
    assert await checker.authenticate(basic("ann", "s3cret"), "a") == OK, "remembered"
    assert await checker.check(basic("ann", "guess"), "c") is False


async def test_a_password_past_72_bytes_is_refused_without_bcrypt() -> None:
    checker = BasicAuthChecker({b"ann": HASH})
    assert await checker.authenticate(basic("ann", b"s3cret" + b"x" * 67), "a") == WRONG
    assert checker.bcrypt_checks == 0 and checker.throttle.remaining("a") == 4


async def test_checks_beyond_the_queue_or_a_sources_budget_wait_outside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One slow check holds the only slot: the next is ``busy``, or ``throttled`` from a
    source with no failures left to spend on checks already running."""
    release = threading.Event()
    real = bcrypt.hashpw

    def slow(password: bytes, salt: bytes) -> bytes:
        release.wait(5)
        return real(password, salt)

    monkeypatch.setattr(bcrypt, "hashpw", slow)
    checker = BasicAuthChecker(
        {b"ann": HASH}, throttle=AuthThrottle(limit=1), max_concurrent=1, max_waiting=0
    )
    first = asyncio.create_task(checker.authenticate(basic("ann", "x"), "a"))
    for _ in range(5):
        await asyncio.sleep(0)
    same = await checker.authenticate(basic("ann", "y"), "a")
    other = await checker.authenticate(basic("ann", "y"), "b")
    release.set()
    assert await first == WRONG
    assert (same.reason, same.retry_after) == ("throttled", basicauth.BUSY_RETRY_S)
    assert (other.reason, other.retry_after) == ("busy", basicauth.BUSY_RETRY_S)


def test_the_refusals() -> None:
    denied = unauthorized()
    assert (denied.status, denied.headers["WWW-Authenticate"]) == (401, REALM)
    assert too_many(0.2).headers["Retry-After"] == "1"
    assert (too_many(2.5).status, too_many(2.5).headers["Retry-After"]) == (429, "3")


async def ok(request: web.Request) -> web.StreamResponse:
    return web.Response(text="in")


async def test_protect_asks_every_path_but_the_probes() -> None:
    app = web.Application()
    protect(app, WebConfig("w.yml", users={b"ann": HASH}))
    (middleware,) = app.middlewares
    assert isinstance(app[BASIC_AUTH_KEY], BasicAuthChecker)

    async def call(path: str, headers: dict[str, str]) -> int:
        request = make_mocked_request("GET", path, headers=headers, app=app)
        return (await middleware(request, ok)).status

    assert await call("/metrics", {}) == 401
    assert await call("/healthz", {}) == 200 and await call("/readyz", {}) == 200
    assert await call("/metrics", {"Authorization": basic("ann", "s3cret")}) == 200


async def test_protect_adds_the_configured_headers_without_overriding_a_routes() -> None:
    app = web.Application()
    protect(app, WebConfig("w.yml", headers={"X-Frame-Options": "deny", "Cache-Control": "x"}))
    assert not app.middlewares and BASIC_AUTH_KEY not in app, "no users: no basic auth"
    response = web.Response(headers={"Cache-Control": "no-store"})
    for hook in app.on_response_prepare:
        await hook(make_mocked_request("GET", "/", app=app), response)
    assert response.headers["X-Frame-Options"] == "deny"
    assert response.headers["Cache-Control"] == "no-store"


def test_no_web_config_changes_nothing() -> None:
    app = web.Application()
    protect(app, None)
    protect(app, WebConfig("w.yml", users={b"ann": HASH}), basic_auth=False)
    assert not app.middlewares and not app.on_response_prepare
