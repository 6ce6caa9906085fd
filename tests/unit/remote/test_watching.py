"""``watch()``: the feed as typed events, and every way a connection ends: resumed with the last
id, backed off and bounded when attempts deliver nothing, a 503 waited out, errors that no
retry can cure raised at once, a silent connection taken as dead, a hostile id never sent back.
Each connection is a scripted answer of an in-memory session (no sockets)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import pytest

from exporter.error import ConfigError
from exporter.remote.client import Client
from exporter.remote.credentials import BasicAuth, Credentials, Secret
from exporter.remote.errors import (
    AuthError,
    BadRequest,
    Forbidden,
    HttpError,
    InvalidAnswer,
    NotFound,
    Unreachable,
)
from exporter.remote.http import Http
from exporter.remote.sse import SseEvent
from exporter.remote.sync import SyncClient
from exporter.remote.watching import (
    Reconnect,
    Reconnecting,
    Watch,
    WatchEvent,
    WatchRefused,
)

URL = "http://h:19400/watch"
FAST = Reconnect(max_failures=3, backoff_s=0.01, max_backoff_s=0.04, idle_timeout_s=5.0)
#: What a connection does after its chunks: end (EOF), fail, or send nothing more.
EOF, HANG = "eof", "hang"


def frame(kind: str, ident: str, data: str) -> bytes:
    return f"event: {kind}\nid: {ident}\ndata: {data}\n\n".encode()


SNAPSHOT = (
    frame("snapshot", "ab-4.0", '{"reason":"connect","engines":["0","1"]}')
    + frame("rank", "ab-4.1", '{"engine":"0","state":"awake","routable":true,"reasons":[]}')
    + frame("rank", "ab-4", '{"engine":"1","state":"hung","routable":false,"reasons":["hung"]}')
)
CHANGE = frame("rank", "ab-5", '{"engine":"1","state":"awake","routable":true,"reasons":[]}')


@dataclass
class Stream:
    """A 200 event stream: its chunks, then ``after`` (EOF, HANG, or an exception raised)."""

    chunks: list[bytes]
    after: str | BaseException = EOF
    content_type: str = "text/event-stream"


@dataclass
class Refusal:
    status: int
    body: bytes = b'{"ok": false, "error": "no"}'
    headers: dict[str, str] = field(default_factory=dict)


Step = Stream | Refusal | BaseException


class FakeContent:
    def __init__(self, chunks: list[bytes], after: str | BaseException) -> None:
        self.chunks = list(chunks)
        self.after = after

    async def readany(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        if isinstance(self.after, BaseException):
            raise self.after
        if self.after == HANG:
            await asyncio.Event().wait()
        return b""

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        while chunk := await self.readany():
            yield chunk


class FakeResponse:
    def __init__(self, step: Stream | Refusal) -> None:
        self.closed = False
        self.content_length: int | None = None
        if isinstance(step, Stream):
            self.status = 200
            self.headers = {"Content-Type": step.content_type}
            self.content = FakeContent(step.chunks, step.after)
        else:
            self.status = step.status
            self.headers = {"Content-Type": "application/json", **step.headers}
            self.content = FakeContent([step.body], EOF)

    def close(self) -> None:
        self.closed = True


class FakeSession:
    """``get`` as aiohttp's: one scripted step per connection, every request recorded."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.requests: list[dict[str, Any]] = []
        self.responses: list[FakeResponse] = []

    @asynccontextmanager
    async def get(self, url: str, **kwargs: Any) -> AsyncIterator[FakeResponse]:
        self.requests.append({"url": url, **kwargs})
        if not self.steps:
            raise aiohttp.ClientConnectionError("the script is over")
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        response = FakeResponse(step)
        self.responses.append(response)
        yield response

    def sent(self, header: str) -> list[str | None]:
        return [r["headers"].get(header) for r in self.requests]

    async def close(self) -> None:
        pass


def http_of(session: FakeSession) -> Http:
    return Http(None, 1024, cast(aiohttp.ClientSession, session))


def watch_of(session: FakeSession, reconnect: Reconnect = FAST, **kwargs: Any) -> Watch:
    return Watch(http_of(session), URL, None, reconnect=reconnect, **kwargs)


async def take(watch: Watch, n: int) -> list[WatchEvent]:
    async def first_n() -> list[WatchEvent]:
        return [await watch.__anext__() for _ in range(n)]

    return await asyncio.wait_for(first_n(), 10)


async def test_the_events_typed_in_order_with_their_ids() -> None:
    session = FakeSession(Stream([SNAPSHOT]))
    async with watch_of(session) as watch:
        head, zero, one = await take(watch, 3)
    assert (head.kind, head.id, head.data["reason"]) == ("snapshot", "ab-4.0", "connect")
    assert head.engine is None and head.routable is None and head.reasons == ()
    assert (zero.engine, zero.state, zero.routable) == ("0", "awake", True)
    assert (one.engine, one.routable, one.reasons, one.id) == ("1", False, ("hung",), "ab-4")
    assert watch.last_event_id == "ab-4" and watch.connections == 1
    request = session.requests[0]
    assert request["url"] == URL and request["allow_redirects"] is False
    assert request["headers"]["Accept"] == "text/event-stream"
    assert "Last-Event-ID" not in request["headers"]
    assert session.responses[0].closed, "the block closed the connection"


async def test_after_the_server_closes_it_resumes_with_the_last_id() -> None:
    session = FakeSession(
        Stream([SNAPSHOT], after=aiohttp.ClientPayloadError("reset")), Stream([CHANGE])
    )
    notices: list[Reconnecting] = []
    async with watch_of(session, on_reconnect=notices.append) as watch:
        *_, change = await take(watch, 4)
    assert (change.id, change.engine, change.routable) == ("ab-5", "1", True)
    assert session.sent("Last-Event-ID") == [None, "ab-4"]
    [notice] = notices
    assert isinstance(notice.error, Unreachable)
    assert str(notice.error) == f"the feed at {URL} broke off: ClientPayloadError: reset"
    assert (notice.failures, notice.delay_s, notice.last_event_id) == (0, 0.01, "ab-4")
    assert watch.connections == 2


async def test_an_id_given_is_where_it_starts() -> None:
    session = FakeSession(Stream([CHANGE]))
    async with watch_of(session, last_event_id="ab-4") as watch:
        await take(watch, 1)
    assert session.sent("Last-Event-ID") == ["ab-4"]
    for bad in ("", "a\nb", "x" * 257, "caf\u00e9"):
        with pytest.raises(BadRequest, match="last_event_id"):
            watch_of(session, last_event_id=bad)


async def test_attempts_that_deliver_nothing_back_off_and_end_in_the_last_error() -> None:
    refused = aiohttp.ClientConnectionError("connection refused")
    session = FakeSession(*[refused] * 5)
    notices: list[Reconnecting] = []
    watch = watch_of(session, on_reconnect=notices.append)
    gave_up = r"^ClientConnectionError: connection refused \(gave up after 4 failed attempts"
    with pytest.raises(Unreachable, match=gave_up):
        await take(watch, 1)
    assert [n.failures for n in notices] == [1, 2, 3]
    assert [n.delay_s for n in notices] == [0.01, 0.02, 0.04]  # doubling, capped
    assert len(session.requests) == 4


async def test_a_connection_that_delivered_resets_the_count() -> None:
    refused = aiohttp.ClientConnectionError("refused")
    session = FakeSession(refused, refused, refused, Stream([SNAPSHOT]), refused, Stream([CHANGE]))
    notices: list[Reconnecting] = []
    async with watch_of(session, on_reconnect=notices.append) as watch:
        events = await take(watch, 4)
    assert events[-1].id == "ab-5"
    assert [n.failures for n in notices] == [1, 2, 3, 0, 1]  # 3 is the limit: never passed


async def test_no_reconnect_at_all_when_asked() -> None:
    session = FakeSession(Stream([SNAPSHOT]), Stream([CHANGE]))
    async with watch_of(session, Reconnect(max_failures=0, backoff_s=0.0)) as watch:
        events = await take(watch, 4)  # the end of a connection that delivered is no failure
    assert events[-1].id == "ab-5"
    session = FakeSession(aiohttp.ClientConnectionError("refused"))
    with pytest.raises(Unreachable, match="gave up after 1 failed"):
        await take(watch_of(session, Reconnect(max_failures=0)), 1)


async def test_a_503_waits_its_retry_after_capped_then_gives_up() -> None:
    busy = Refusal(503, b'{"ok": false, "error": "at most 0 watchers"}', {"Retry-After": "5"})
    reconnect = Reconnect(max_failures=2, backoff_s=0.01, max_retry_after_s=0.03)
    notices: list[Reconnecting] = []
    watch = watch_of(FakeSession(busy, busy, busy), reconnect, on_reconnect=notices.append)
    with pytest.raises(WatchRefused, match="at most 0 watchers") as refused:
        await take(watch, 1)
    assert refused.value.status == 503 and refused.value.retry_after == 5.0
    assert [n.delay_s for n in notices] == [0.03, 0.03]
    session = FakeSession(busy, Stream([SNAPSHOT]))
    async with watch_of(session, reconnect) as watch:
        assert (await take(watch, 1))[0].kind == "snapshot"


@pytest.mark.parametrize(
    ("status", "error"),
    [(401, AuthError), (403, Forbidden), (404, NotFound), (400, BadRequest), (302, HttpError)],
)
async def test_what_no_retry_can_cure_is_raised_at_once(
    status: int, error: type[Exception]
) -> None:
    session = FakeSession(Refusal(status), Stream([SNAPSHOT]))
    with pytest.raises(error, match=f"HTTP {status}"):
        await take(watch_of(session), 1)
    assert len(session.requests) == 1


async def test_a_5xx_of_a_proxy_is_retried() -> None:
    session = FakeSession(Refusal(502, b"<html>bad gateway</html>"), Stream([SNAPSHOT]))
    notices: list[Reconnecting] = []
    async with watch_of(session, on_reconnect=notices.append) as watch:
        assert (await take(watch, 1))[0].kind == "snapshot"
    assert isinstance(notices[0].error, HttpError) and notices[0].error.status == 502


@pytest.mark.parametrize(
    ("step", "says"),
    [
        (Stream([SNAPSHOT], content_type="text/html"), "text/html, not an event stream"),
        (Stream([frame("rank", "a-1", "{not json")]), "its data is not JSON"),
        (Stream([frame("rank", "a-1", "[1, 2]")]), "not a JSON object"),
        (Stream([frame("rank", "a-1", '{"state": "awake"}')]), "names no engine"),
        (Stream([b"data: " + b"x" * 2**16] * 17), "line longer than"),
        (Stream([b"data: " + b"[" * 2**19 + b"\n\n"]), "its data is not JSON"),
    ],
    ids=["html", "not-json", "not-object", "no-engine", "huge-line", "deep"],
)
async def test_an_answer_that_is_not_the_feed_is_raised_at_once(step: Stream, says: str) -> None:
    session = FakeSession(step, Stream([SNAPSHOT]))
    with pytest.raises(InvalidAnswer, match=says) as invalid:
        await take(watch_of(session), 1)
    assert invalid.value.url == URL and len(session.requests) == 1


async def test_a_connection_without_events_is_taken_as_dead() -> None:
    reconnect = Reconnect(max_failures=1, backoff_s=0.0, idle_timeout_s=0.2)
    session = FakeSession(Stream([SNAPSHOT, b": a comment is no sign of life\n"], after=HANG))
    session.steps.append(Stream([CHANGE]))
    notices: list[Reconnecting] = []
    async with watch_of(session, reconnect, on_reconnect=notices.append) as watch:
        events = await take(watch, 4)
    assert events[-1].id == "ab-5"
    assert "no event from http://h:19400/watch within 0.2s" in str(notices[0].error)
    assert session.responses[0].closed


async def test_a_hostile_id_is_never_sent_back() -> None:
    hostile = b'event: rank\nid: ab-9\x01\r\ndata: {"engine": "0"}\n\n'
    session = FakeSession(Stream([SNAPSHOT, hostile]), Stream([CHANGE]))
    async with watch_of(session) as watch:
        events = await take(watch, 5)
    assert events[3].id == "ab-9\x01"
    assert session.sent("Last-Event-ID") == [None, None]  # a fresh snapshot instead


async def test_stop_ends_the_iteration_during_a_pause_and_mid_stream() -> None:
    session = FakeSession(aiohttp.ClientConnectionError("refused"))
    watch = watch_of(session, Reconnect(backoff_s=30.0, max_backoff_s=30.0))
    waiting = asyncio.ensure_future(watch.next_event())
    await asyncio.sleep(0.05)
    watch.stop()
    assert await asyncio.wait_for(waiting, 5) is None
    session = FakeSession(Stream([SNAPSHOT], after=HANG))
    watch = watch_of(session)
    await take(watch, 3)
    reading = asyncio.ensure_future(watch.next_event())
    await asyncio.sleep(0.05)
    await watch.aclose()  # from another task while it reads: stop() ends it
    assert await asyncio.wait_for(reading, 5) is None
    assert session.responses[0].closed


async def test_the_client_watches_its_url_with_read_credentials_and_close_ends_it() -> None:
    session = FakeSession(Stream([SNAPSHOT], after=HANG))
    basic = BasicAuth("ops", Secret("pw"))
    credentials = Credentials(token=Secret("admin-secret"), basic_auth=basic)
    client = Client("http://h:8000/dp/", None, credentials=credentials)
    client._http = http_of(session)
    watch = client.watch()
    await take(watch, 3)
    request = session.requests[0]
    assert request["url"] == "http://h:8000/dp/watch"
    assert request["headers"]["Authorization"] == basic.header()  # never the admin token
    await client.close()
    assert await asyncio.wait_for(watch.next_event(), 5) is None
    with pytest.raises(ConfigError, match="without a URL"):
        Client(None, "http://h:19401").watch()


def test_the_sync_client_iterates_in_its_thread_and_close_ends_it() -> None:
    session = FakeSession(Stream([SNAPSHOT]), Stream([CHANGE], after=HANG))
    threads: list[str] = []
    with SyncClient("http://h:19400", None) as dp:
        dp.client._http = http_of(session)
        with dp.watch(
            reconnect=FAST, on_reconnect=lambda n: threads.append(threading.current_thread().name)
        ) as events:
            kinds = [(e.kind, e.id) for _, e in zip(range(4), events, strict=False)]
            assert events.last_event_id == "ab-5"
        assert session.responses[-1].closed
        assert list(events) == []  # a closed watch ends
    assert kinds[0] == ("snapshot", "ab-4.0") and kinds[-1] == ("rank", "ab-5")
    assert threads == ["exporter-remote"]
    with pytest.raises(RuntimeError, match="this SyncClient is closed"):
        next(events)


def test_an_event_in_json_and_the_reconnect_rules() -> None:
    event = WatchEvent.from_sse(SseEvent("rank", "ab-5", '{"engine": "1", "id": "x", "up": true}'))
    assert event.to_json() == {"event": "rank", "id": "ab-5", "engine": "1", "up": True}
    assert hash(event) == hash(WatchEvent("rank", "ab-5", {}))  # the data is not hashed
    assert Reconnect().delay_s(0) == 0.2 and Reconnect().delay_s(100) == 5.0
    assert Reconnect().bound_s() > 30 * 60
    with pytest.raises(ValueError):
        Reconnect(max_failures=-1)
    with pytest.raises(ValueError):
        Reconnect(idle_timeout_s=0)
