"""The one request path of ``exporter.remote``: every attempt within the call's deadline, a
doubling pause between attempts, retried statuses only when asked, redirects never followed.
Driven through an in-memory session (no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import aiohttp
import pytest

from exporter.remote.errors import Unreachable
from exporter.remote.http import NO_RETRY, Http, Retry

URL = "http://h:19400/status"
#: What one attempt meets: an exception raised, ``None`` for no answer ever, or a status.
Step = BaseException | int | None


class FakeContent:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        yield self.raw


class FakeResponse:
    """What ``read_answer`` reads of an aiohttp response."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.content_length: int | None = None
        self.content = FakeContent(b'{"status": %d}' % status)
        self.headers: dict[str, str] = {}


class FakeSession:
    """``request`` as aiohttp's: an async context manager, one scripted step per attempt."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.calls: list[dict[str, Any]] = []
        self.closed = False

    @asynccontextmanager
    async def request(self, method: str, url: str, **kwargs: Any) -> AsyncIterator[FakeResponse]:
        self.calls.append({"method": method, "url": url, **kwargs})
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        if step is None:
            await asyncio.Event().wait()
        yield FakeResponse(cast(int, step))

    async def close(self) -> None:
        self.closed = True


def http_of(session: FakeSession) -> Http:
    return Http(None, 4096, cast(aiohttp.ClientSession, session))


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pauses between attempts, recorded instead of slept."""
    slept: list[float] = []
    real_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep

    async def sleep(delay: float) -> None:
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return slept


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"backoff_s": -0.1}, {"max_backoff_s": -1.0}])
def test_a_retry_that_cannot_work_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="attempts must be at least 1"):
        Retry(**kwargs)


def test_the_default_retry_and_no_retry() -> None:
    assert NO_RETRY.attempts == 1
    assert Retry().attempts == 3 and Retry().statuses == frozenset({500, 502, 504})


async def test_a_connection_error_is_tried_again(pauses: list[float]) -> None:
    session = FakeSession(aiohttp.ClientConnectionError("refused"), 200)
    answer = await http_of(session).request(
        "GET", URL, timeout_s=30, retry=Retry(), headers={"Accept": "application/json"}
    )
    assert answer.status == 200 and answer.body == {"status": 200}
    assert len(session.calls) == 2 and pauses == [0.25]
    first = session.calls[0]
    assert first["allow_redirects"] is False and first["ssl"] is True  # system CAs, name checked
    assert first["headers"] == {"Accept": "application/json"}


async def test_the_pause_doubles_up_to_its_cap(pauses: list[float]) -> None:
    session = FakeSession(*[OSError("reset")] * 4, 200)
    retry = Retry(attempts=5, backoff_s=0.25, max_backoff_s=0.6)
    answer = await http_of(session).request("GET", URL, timeout_s=60, retry=retry)
    assert answer.status == 200
    assert pauses == [0.25, 0.5, 0.6, 0.6]


async def test_the_last_failure_is_raised_printable(pauses: list[float]) -> None:
    session = FakeSession(*[aiohttp.ClientConnectionError("no\x1b[2J route")] * 3)
    with pytest.raises(Unreachable) as failed:
        await http_of(session).request("GET", URL, timeout_s=60, retry=Retry())
    assert str(failed.value) == "ClientConnectionError: no\\x1b[2J route"
    assert failed.value.url == URL and len(session.calls) == 3 and len(pauses) == 2


async def test_a_retried_status_only_when_the_caller_asks(pauses: list[float]) -> None:
    asked = FakeSession(502, 504, 200)
    answer = await http_of(asked).request(
        "GET", URL, timeout_s=60, retry=Retry(), retry_statuses=True
    )
    assert answer.status == 200 and len(asked.calls) == 3
    once = FakeSession(502, 200)
    answer = await http_of(once).request("POST", URL, timeout_s=60, retry=Retry())
    assert answer.status == 502 and len(once.calls) == 1
    other = FakeSession(503, 200)
    answer = await http_of(other).request(
        "GET", URL, timeout_s=60, retry=Retry(), retry_statuses=True
    )
    assert answer.status == 503 and len(other.calls) == 1  # not one of the retried statuses


async def test_the_last_attempt_s_status_is_returned_not_raised(pauses: list[float]) -> None:
    session = FakeSession(500, 500)
    answer = await http_of(session).request(
        "GET", URL, timeout_s=60, retry=Retry(attempts=2), retry_statuses=True
    )
    assert answer.status == 500 and len(session.calls) == 2


async def test_no_retry_when_the_pause_would_pass_the_deadline(pauses: list[float]) -> None:
    session = FakeSession(OSError("reset"), 200)
    with pytest.raises(Unreachable, match="OSError: reset"):
        await http_of(session).request(
            "GET", URL, timeout_s=1.0, retry=Retry(attempts=5, backoff_s=5.0)
        )
    assert len(session.calls) == 1 and pauses == []


async def test_an_attempt_without_an_answer_ends_at_the_deadline() -> None:
    session = FakeSession(None, 200)
    with pytest.raises(Unreachable) as late:
        await http_of(session).request("GET", URL, timeout_s=0.05, retry=Retry())
    assert str(late.value) == f"TimeoutError: no answer from {URL} within 0.05s"
    assert len(session.calls) == 1


async def test_a_session_given_is_the_caller_s_to_close() -> None:
    session = FakeSession()
    await http_of(session).close()
    assert not session.closed
