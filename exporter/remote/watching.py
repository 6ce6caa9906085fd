"""``watch()``: an exporter's per-rank feed (``GET <url>/watch``, docs/watch.md) as typed
events, resumed by itself after a dropped connection (``SyncWatch``, in ``sync``, blocks).

A follower of the feed must not lose a change because a proxy restarted, the exporter dropped
it for reading slowly, or the exporter restarted. So the watch keeps the id of the last event
it received and, whenever the connection ends, connects again with it (``Last-Event-ID``): the
exporter answers with every change since, or with a fresh snapshot whose ``reason`` says why.
A consumer's table per rank starts over at each ``snapshot`` and takes one row per ``rank``.

Bounded in every direction: a connection that delivered an event is resumed after
``Reconnect.backoff_s``; attempts that deliver nothing back off (doubling, up to
``max_backoff_s``) and, after ``max_failures`` in a row, the last error is raised. A 503 (too
many watchers) waits the server's ``Retry-After`` (capped); a 401/403, a 404 or an answer that
is not an event stream raises at once (retrying cannot help). A connection that sends no event
for ``idle_timeout_s`` (the exporter sends a heartbeat every 5 s) is taken as dead. Lines and
events over 1 MiB are refused (``exporter.remote.sse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.remote.answers import error_for, printable, read_answer
from exporter.remote.errors import (
    BadRequest,
    HttpError,
    InvalidAnswer,
    RateLimited,
    RemoteError,
    Unreachable,
)
from exporter.remote.http import Http
from exporter.remote.sse import SseEvent, SseParser

EVENT_STREAM = "text/event-stream"
#: The kinds of event the exporter sends (``WatchEvent.kind``).
SNAPSHOT, RANK, HEARTBEAT = "snapshot", "rank", "heartbeat"
#: The longest id sent back as ``Last-Event-ID`` (the exporter's are under 48 characters).
MAX_RESUME_ID = 256
#: The largest refusal (a 401, a 503) read.
MAX_REFUSAL_BYTES = 2**16
#: Answers tried again with the backoff: a proxy's 502/504, a restarting exporter's 500.
RETRIED_STATUSES = frozenset({500, 502, 504})


@dataclass(frozen=True)
class Reconnect:
    """When a watch connects again: ``backoff_s`` after a connection that delivered events,
    doubling up to ``max_backoff_s`` after attempts that delivered none; after ``max_failures``
    such attempts in a row, the last error is raised (0: never reconnect after a failure).
    A refusal's ``Retry-After`` is waited, up to ``max_retry_after_s``."""

    max_failures: int = 30
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_retry_after_s: float = 30.0
    connect_timeout_s: float = 10.0
    #: No event (not even a heartbeat) for this long: the connection is taken as dead.
    idle_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_failures < 0 or min(self.backoff_s, self.max_backoff_s) < 0:
            raise ValueError("max_failures and the backoffs must not be negative")
        if min(self.max_retry_after_s, self.connect_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("max_retry_after_s and the timeouts must be positive")

    def delay_s(self, failures: int) -> float:
        """The pause before the next attempt, after ``failures`` failed ones in a row."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(max(failures - 1, 0), 32))

    def bound_s(self) -> float:
        """The longest time between two events before the watch raises (how long
        ``SyncWatch`` waits for the next one)."""
        pause = max(self.max_backoff_s, self.max_retry_after_s)
        attempt = self.connect_timeout_s + 2 * self.idle_timeout_s + pause
        return (self.max_failures + 2) * attempt


@dataclass(frozen=True)
class WatchEvent:
    """One event of the feed: ``kind`` (``snapshot``, ``rank``, ``heartbeat``; another kind a
    newer exporter sends is passed on as it came), ``id`` (what a resume starts from) and
    ``data``, the event's JSON object (a rank's row: docs/watch.md). ``to_json()`` is the
    one-line form ``ctl watch --json`` prints."""

    kind: str
    id: str
    data: Mapping[str, Any] = field(hash=False)

    @classmethod
    def from_sse(cls, sse: SseEvent, url: str | None = None) -> WatchEvent:
        """``sse`` typed; ``InvalidAnswer`` when its data is not a JSON object, or when a
        ``rank`` event names no engine."""
        where = f"event {printable(sse.event)!r} (id {printable(sse.id)!r})"
        try:
            data = json.loads(sse.data)
        except (ValueError, RecursionError):
            raise InvalidAnswer(f"{where}: its data is not JSON", url=url) from None
        if not isinstance(data, dict):
            raise InvalidAnswer(f"{where}: its data is not a JSON object", url=url)
        if sse.event == RANK and not isinstance(data.get("engine"), str):
            raise InvalidAnswer(f"{where}: names no engine", url=url)
        return cls(sse.event, sse.id, data)

    @property
    def engine(self) -> str | None:
        """The rank a ``rank`` event is about (None for other kinds)."""
        engine = self.data.get("engine")
        return engine if isinstance(engine, str) else None

    @property
    def state(self) -> str | None:
        state = self.data.get("state")
        return state if isinstance(state, str) else None

    @property
    def routable(self) -> bool | None:
        """Whether a router should send the rank traffic (None: not a rank's row)."""
        routable = self.data.get("routable")
        return routable if isinstance(routable, bool) else None

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the rank is not routable (empty when it is)."""
        reasons = self.data.get("reasons")
        return tuple(str(r) for r in reasons) if isinstance(reasons, list) else ()

    def to_json(self) -> dict[str, Any]:
        """``{"event": kind, "id": id, **data}``: one JSON object per event."""
        rest = {k: v for k, v in self.data.items() if k not in ("event", "id")}
        return {"event": self.kind, "id": self.id, **rest}


@dataclass(frozen=True)
class Reconnecting:
    """What ``on_reconnect`` is told before each pause: why the connection ended, how many
    attempts in a row delivered nothing, the pause, and the id the next attempt resumes from."""

    error: RemoteError
    failures: int
    delay_s: float
    last_event_id: str | None


ReconnectCallback = Callable[[Reconnecting], object]


class WatchRefused(RemoteError):
    """503 from the feed: ``--max-watchers`` clients are connected already (or, behind vLLM's
    port, the plugin's exporter is not running yet). The watch waits ``retry_after`` (capped)
    and tries again; this is raised once ``Reconnect.max_failures`` attempts in a row failed."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


def resumable(last_event_id: str | None) -> bool:
    """Whether an id can be sent back as a header (a hostile one is dropped: fresh snapshot)."""
    return (
        last_event_id is not None
        and 0 < len(last_event_id) <= MAX_RESUME_ID
        and last_event_id.isascii()
        and last_event_id.isprintable()
    )


def retryable(exc: RemoteError) -> bool:
    """What another attempt may cure: no answer, a refusal that says when, a transient 5xx."""
    if isinstance(exc, Unreachable | WatchRefused | RateLimited):
        return True
    return isinstance(exc, HttpError) and exc.status in RETRIED_STATUSES


class Watch:
    """The feed of one exporter as an async iterator of ``WatchEvent`` (``Client.watch``):
    ``async with client.watch() as events: async for event in events: ...``. It ends only
    when closed (``aclose``, the ``async with`` block, the client's ``close``) or by raising
    a ``RemoteError``. ``last_event_id`` is the id of the last event received (persist it to
    resume in another process); ``connections`` counts the connections made."""

    def __init__(
        self,
        http: Http,
        url: str,
        authorization: str | None,
        last_event_id: str | None = None,
        reconnect: Reconnect | None = None,
        on_reconnect: ReconnectCallback | None = None,
    ) -> None:
        if last_event_id is not None and not resumable(last_event_id):
            raise BadRequest(f"last_event_id must be 1-{MAX_RESUME_ID} printable ASCII characters")
        self.url = url
        self.reconnect = reconnect if reconnect is not None else Reconnect()
        self.on_reconnect = on_reconnect
        self.last_event_id = last_event_id
        self.connections = 0
        self._http = http
        self._authorization = authorization
        self._stopped = asyncio.Event()
        self._response: aiohttp.ClientResponse | None = None
        self._events = self._run()

    def __repr__(self) -> str:
        return f"Watch({self.url!r}, last_event_id={self.last_event_id!r})"

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        return await self._events.__anext__()

    async def next_event(self) -> WatchEvent | None:
        """The next event; None once the watch is stopped."""
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            return None

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def stop(self) -> None:
        """End the watch (in its event loop's thread): the iteration stops without an error
        and the connection is closed."""
        self._stopped.set()
        if self._response is not None:
            self._response.close()

    async def aclose(self) -> None:
        self.stop()
        with contextlib.suppress(RuntimeError):  # iterated in another task: stop() ends it
            await self._events.aclose()

    async def _run(self) -> AsyncGenerator[WatchEvent, None]:
        """Connection after connection, until stopped or an attempt cannot succeed."""
        failures = 0
        while not self._stopped.is_set():
            delivered = False
            try:
                async with contextlib.aclosing(self._connection()) as events:
                    async for event in events:
                        delivered, failures = True, 0
                        yield event
                error: RemoteError = Unreachable(f"the feed at {self.url} ended", url=self.url)
            except RemoteError as exc:
                if self._stopped.is_set():
                    return
                if not retryable(exc):
                    raise
                error = exc
            if self._stopped.is_set():
                return
            failures += 0 if delivered else 1
            if failures > self.reconnect.max_failures:
                error.args = (f"{error} (gave up after {failures} failed attempts in a row)",)
                raise error
            await self._pause(error, failures)

    async def _connection(self) -> AsyncGenerator[WatchEvent, None]:
        """The events of one connection; a transport failure as ``Unreachable``."""
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self.reconnect.connect_timeout_s,
            sock_read=self.reconnect.idle_timeout_s,
        )
        try:
            async with self._http._pool().get(
                self.url,
                ssl=self._http._ssl,
                allow_redirects=False,
                timeout=timeout,
                headers=self._headers(),
            ) as resp:
                try:
                    await self._accept(resp)
                    self._response = resp
                    self.connections += 1
                    async with contextlib.aclosing(self._read(resp)) as events:
                        async for event in events:
                            yield event
                finally:
                    resp.close()  # a stream is never read to its end: never reused
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            lost = f"the feed at {self.url} broke off: " if self._response is not None else ""
            why = f"{lost}{type(exc).__name__}: {printable(exc)}"
            raise Unreachable(why, url=self.url) from None
        except InvalidAnswer as exc:
            exc.url = exc.url or self.url
            raise
        finally:
            self._response = None

    async def _read(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[WatchEvent, None]:
        """Chunks into events; each one's id is kept as it is handed over (the resume point),
        and each event restarts the idle timer once the consumer is done with it."""
        loop = asyncio.get_running_loop()
        parser = SseParser(last_event_id=self.last_event_id or "")
        deadline = loop.time() + self.reconnect.idle_timeout_s
        while chunk := await self._chunk(resp, deadline - loop.time()):
            events = parser.feed(chunk)
            for sse in events:
                if self._stopped.is_set():
                    return
                event = WatchEvent.from_sse(sse, self.url)
                self.last_event_id = sse.id or None
                yield event
            if events:
                deadline = loop.time() + self.reconnect.idle_timeout_s

    async def _chunk(self, resp: aiohttp.ClientResponse, timeout_s: float) -> bytes:
        """What arrived (b"" at the end of the stream, or once stopped), or ``Unreachable``
        after ``timeout_s``."""
        # Not ``wait_for``: before Python 3.12 it can swallow a cancellation.
        read = asyncio.ensure_future(resp.content.readany())
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait(
                (read, stopped), timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in (read, stopped):
                if not waiter.done():
                    waiter.cancel()
        if read.done() and not read.cancelled():
            return read.result()
        if self._stopped.is_set():
            return b""
        idle = self.reconnect.idle_timeout_s
        raise Unreachable(f"no event from {self.url} within {idle:g}s", url=self.url)

    async def _accept(self, resp: aiohttp.ClientResponse) -> None:
        """Nothing for an event stream; else the answer's typed error."""
        if resp.status == 200:
            kind = resp.headers.get("Content-Type", "")
            if kind.partition(";")[0].strip().lower() != EVENT_STREAM:
                raise InvalidAnswer(
                    f"HTTP 200: the answer is {printable(kind) or 'untyped'}, not an event "
                    f"stream (is {self.url} an exporter's feed?)",
                    status=200,
                    url=self.url,
                )
            return
        answer = await read_answer(resp, self.url, MAX_REFUSAL_BYTES)
        if answer.status == 503:
            raise WatchRefused(
                answer.message,
                retry_after=answer.retry_after,
                status=answer.status,
                body=answer.body,
                detail=answer.detail,
                url=self.url,
            )
        raise error_for(answer)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": EVENT_STREAM, "Cache-Control": "no-store"}
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        if self.last_event_id is not None and resumable(self.last_event_id):
            headers["Last-Event-ID"] = self.last_event_id
        return headers

    async def _pause(self, error: RemoteError, failures: int) -> None:
        """Wait before the next attempt (the refusal's ``Retry-After``, capped, when longer
        than the backoff); ``stop()`` ends the pause at once."""
        delay = self.reconnect.delay_s(failures)
        if isinstance(error, WatchRefused | RateLimited) and error.retry_after is not None:
            delay = max(delay, min(error.retry_after, self.reconnect.max_retry_after_s))
        if self.on_reconnect is not None:
            self.on_reconnect(Reconnecting(error, failures, delay, self.last_event_id))
        waiter = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait((waiter,), timeout=delay)
        finally:
            waiter.cancel()
