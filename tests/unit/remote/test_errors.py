"""Each error of ``exporter.remote`` is one case a training script handles on its own
(``except Conflict``, ``except PartialFailure``), and carries what that case needs: the typed
result, the server's ``Retry-After``, the gate's last answer."""

from __future__ import annotations

import pytest

from exporter.remote import errorbase, errors
from exporter.remote.errors import (
    AuthError,
    BadRequest,
    Conflict,
    Forbidden,
    HttpError,
    IdempotencyKeyReused,
    NoEngineConnected,
    NotFound,
    PartialFailure,
    RateLimited,
    RemoteError,
    Unreachable,
    Unsupported,
    WaitTimeout,
)
from exporter.remote.results import ActionResult, GateResult


def test_the_root_is_re_exported_not_redefined() -> None:
    """``except errors.RemoteError`` must catch what ``results`` raises via ``errorbase``."""
    assert errors.RemoteError is errorbase.RemoteError
    assert errors.InvalidAnswer is errorbase.InvalidAnswer


@pytest.mark.parametrize(
    ("kind", "parent"),
    [(IdempotencyKeyReused, BadRequest), (Forbidden, AuthError)],
)
def test_narrow_cases_are_caught_by_their_broad_one(
    kind: type[RemoteError], parent: type[RemoteError]
) -> None:
    with pytest.raises(parent):
        raise kind("HTTP 4xx", status=422)


@pytest.mark.parametrize(
    "kind", [Unreachable, NotFound, Conflict, HttpError, BadRequest, AuthError]
)
def test_the_plain_kinds_take_the_common_fields(kind: type[RemoteError]) -> None:
    error = kind("HTTP 404: no", status=404, body={"error": "no"}, detail="no", url="http://h/x")
    assert (error.status, error.body, error.detail, error.url) == (
        404,
        {"error": "no"},
        "no",
        "http://h/x",
    )


def test_rate_limited_carries_retry_after() -> None:
    limited = RateLimited("HTTP 429: slow down", retry_after=2.5, status=429)
    assert limited.retry_after == 2.5 and limited.status == 429
    assert RateLimited("HTTP 429").retry_after is None


def test_an_action_s_failures_carry_its_result() -> None:
    result = ActionResult.from_json("sleep", 502, {"engines": [{"engine": "0", "ok": False}]})
    partial = PartialFailure("sleep: failure", result=result, status=502)
    assert partial.result is result and partial.status == 502
    unsupported = Unsupported("sleep: unsupported", result=result, status=501)
    assert unsupported.result is result and unsupported.conditions == ()
    assert NoEngineConnected("HTTP 503").result is None
    gate = Unsupported("HTTP 501", conditions=("drained",))
    assert gate.result is None and gate.conditions == ("drained",)


def test_a_wait_timeout_is_a_timeout_with_the_last_answer() -> None:
    last = GateResult.from_json(412, {"ok": False})
    timeout = WaitTimeout("wait timed out", last=last, last_error="HTTP 412", status=412)
    assert isinstance(timeout, TimeoutError) and isinstance(timeout, RemoteError)
    assert timeout.last is last and timeout.last_error == "HTTP 412"
    with pytest.raises(TimeoutError):
        raise WaitTimeout("wait timed out", last=None, last_error="no answer yet")
