"""How ``exporter.remote`` reads an answer (bounded, JSON checked, escaped for terminals) and
which error each status becomes; the wait's retry rule (pure, no sockets)."""

from __future__ import annotations

import asyncio
import email.utils
from collections.abc import AsyncIterator
from typing import Any, cast, get_args

import aiohttp
import pytest

from exporter.control.parsing import WAKE_TAGS
from exporter.error import ExporterError
from exporter.protocol.utility import PAUSE_MODES
from exporter.remote import (
    AuthError,
    BadRequest,
    Conflict,
    Forbidden,
    HttpError,
    IdempotencyKeyReused,
    InvalidAnswer,
    NoEngineConnected,
    NotFound,
    PartialFailure,
    PauseMode,
    RateLimited,
    RemoteError,
    Unreachable,
    Unsupported,
    WaitTimeout,
    WakeTag,
    printable,
)
from exporter.remote.answers import MAX_DETAIL, Answer, decode, error_for, parse_retry_after
from exporter.remote.answers import read_answer as read
from exporter.remote.waiting import describe, last_error_of, query, retried


def test_printable_escapes_every_control_character() -> None:
    assert printable("0.33.0 ünïcode ✓") == "0.33.0 ünïcode ✓"
    assert printable("a\x1b[2Jb\n\tc\x7f\x9b\u2028\u202ed") == (
        "a\\x1b[2Jb\\n\\tc\\x7f\\x9b\\u2028\\u202ed"
    )


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"<html>\x1b[31m</html>", "HTTP 200: the answer is not JSON: <html>\\x1b[31m</html>"),
        (b"[1, 2]", "HTTP 200: the answer is not a JSON object"),
        (b'"text"', "HTTP 200: the answer is not a JSON object"),
        (b"[" * 100_000, "HTTP 200: the answer is not JSON: " + "[" * 200),  # too deep
        (b'{"n": ' + b"1" * 5000 + b"}", "HTTP 200: the answer is not JSON"),  # int too long
        (b"\xff\xfe", "HTTP 200: the answer is not JSON: \ufffd\ufffd"),
        (b"", "HTTP 200: the answer is not JSON: "),
    ],
)
def test_bodies_that_are_not_a_json_object(raw: bytes, problem: str) -> None:
    body, why = decode(200, raw)
    assert body is None and why is not None and why.startswith(problem.rstrip())
    assert why.isprintable()


def test_the_detail_of_an_answer() -> None:
    assert Answer("u", 409, {"error": "busy\x1b"}).message == "HTTP 409: busy\\x1b"
    assert Answer("u", 500, {"oops": 1}).detail == "{'oops': 1}"
    assert Answer("u", 404, None, "HTTP 404: the answer is not JSON: x").message == (
        "HTTP 404: the answer is not JSON: x"
    )
    long = Answer("u", 400, {"error": "e" * 10_000}).detail
    assert len(long) < MAX_DETAIL + 50 and long.endswith("(8000 more)")


def test_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after(" 5 ") == 5.0 and parse_retry_after("1.5") == 1.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after("nan") is None
    assert parse_retry_after("inf") is None
    when = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after(when, now=1_000_000) == 30.0
    assert parse_retry_after(when, now=2_000_000) == 0.0


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, BadRequest),
        (401, AuthError),
        (403, Forbidden),
        (404, NotFound),
        (405, NotFound),
        (408, BadRequest),
        (409, Conflict),
        (413, BadRequest),
        (422, IdempotencyKeyReused),
        (429, RateLimited),
        (503, NoEngineConnected),
        (500, HttpError),
        (504, HttpError),
        (307, HttpError),
        (418, HttpError),
    ],
)
def test_each_status_is_one_error_class(status: int, kind: type[RemoteError]) -> None:
    answer = Answer("http://h/x", status, {"error": "why"}, retry_after=3.0)
    error = error_for(answer)
    assert type(error) is kind
    assert (error.status, error.body, error.detail, error.url) == (
        status,
        {"error": "why"},
        "why",
        "http://h/x",
    )
    assert str(error) == f"HTTP {status}: why"
    if isinstance(error, RateLimited):
        assert error.retry_after == 3.0


def test_the_error_family() -> None:
    assert issubclass(RemoteError, ExporterError)
    assert issubclass(Forbidden, AuthError) and issubclass(IdempotencyKeyReused, BadRequest)
    # 501 is not a partial failure: nothing was changed, and no retry can help.
    assert not issubclass(Unsupported, PartialFailure) and issubclass(Unsupported, RemoteError)
    assert issubclass(WaitTimeout, TimeoutError)
    for kind in (Unreachable, InvalidAnswer, Conflict, HttpError):
        assert issubclass(kind, RemoteError)


def test_the_literal_types_are_the_servers() -> None:
    assert set(get_args(PauseMode)) == set(PAUSE_MODES)
    assert set(get_args(WakeTag)) == set(WAKE_TAGS)


def test_which_failed_gate_checks_are_retried() -> None:
    assert retried(Unreachable("refused"))
    assert retried(HttpError("x", status=500)) and retried(InvalidAnswer("x", status=200))
    assert retried(InvalidAnswer("x", status=412))
    for status in (400, 401, 404, 429, 501):
        assert not retried(error_for(Answer("u", status, {"error": "no"})))
    assert last_error_of(HttpError("HTTP 500: boom", status=500, body={})) == "HTTP 500"
    assert last_error_of(Unreachable("ClientConnectorError: x")) == "ClientConnectorError: x"
    assert query({"weight_version": "v1", "sleeping": False, "paused": True}) == {
        "weight_version": "v1",
        "sleeping": "false",
        "paused": "true",
    }
    assert describe({"sleeping": False, "x": "\x1b"}) == "sleeping=false x=\\x1b"
    assert describe({}) == "(none)"


class FakeContent:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.read = 0

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.read += len(chunk)
            yield chunk
            await asyncio.sleep(0)


class FakeResponse:
    """What ``read_answer`` uses of an aiohttp response."""

    def __init__(self, chunks: list[bytes], length: int | None = None, **headers: str) -> None:
        self.status = 200
        self.content_length = length
        self.content = FakeContent(chunks)
        self.headers = headers


async def read_fake(resp: FakeResponse, limit: int) -> Answer:
    return await read(cast(aiohttp.ClientResponse, resp), "http://h/status", limit)


async def test_answers_are_read_with_a_bound() -> None:
    endless = FakeResponse([b"x" * 1000] * 1000)
    with pytest.raises(InvalidAnswer, match="larger than the 4096 bytes"):
        await read_fake(endless, 4096)
    assert endless.content.read <= 5000  # stopped reading at the bound
    announced = FakeResponse([b"{}"], length=10**9)
    with pytest.raises(InvalidAnswer, match="1000000000 bytes, more than the 4096"):
        await read_fake(announced, 4096)
    assert announced.content.read == 0
    headers: dict[str, Any] = {"Retry-After": "2", "Idempotency-Replayed": "true"}
    fine = await read_fake(FakeResponse([b'{"ok":', b" true}"], **headers), 4096)
    assert fine.body == {"ok": True} and fine.retry_after == 2.0 and fine.replayed
