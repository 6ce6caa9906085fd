"""``exporter/web/httpguard.py`` without sockets: the one-line description of a malformed
request, the logger that sends those to a sink and everything else to aiohttp's, and the
per-connection header deadline over a stand-in server. The guards on real connections are
tests/integration/resilience/test_http_side.py and test_http_malformed.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from exporter.web.httpguard import (
    MAX_DETAIL,
    BadRequestLog,
    GuardedAppRunner,
    HeaderDeadline,
    describe,
)


def test_a_malformed_request_is_one_escaped_capped_line() -> None:
    assert describe(BadHttpMessage("Invalid header value char: a\x01b")) == (
        "BadHttpMessage: Invalid header value char: a\\x01b"
    )
    long = describe(LineTooLong(b"x" * 9000, 8190))
    assert long.startswith("LineTooLong: Got more than 8190 bytes")
    assert long.endswith("...") and len(long) == len("LineTooLong: ") + MAX_DETAIL
    assert describe(ValueError("two\nlines\x1b[2J")) == "ValueError: two lines\\x1b[2J"


def test_refused_requests_go_to_the_sink_and_other_records_to_aiohttp(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[str] = []
    adapter = BadRequestLog(seen.append)
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    bad = BadHttpMessage("Invalid method")
    adapter.exception("Error handling request from %s", "10.0.0.7", exc_info=bad)
    adapter.debug("Error handling request from %s", "10.0.0.8", exc_info=(type(bad), bad, None))
    assert seen == [
        "BadHttpMessage: Invalid method (from 10.0.0.7)",
        "BadHttpMessage: Invalid method (from 10.0.0.8)",
    ]
    assert caplog.records == []
    adapter.exception("Unhandled exception", exc_info=RuntimeError("a handler's bug"))
    (record,) = caplog.records
    assert record.name == "aiohttp.server" and record.levelno == logging.ERROR
    assert len(seen) == 2


def test_guards_refuse_timeouts_that_are_not_positive() -> None:
    with pytest.raises(ValueError, match="keep-alive"):
        GuardedAppRunner(web.Application(), keepalive_timeout_s=0)
    with pytest.raises(ValueError, match="header timeout"):
        HeaderDeadline(cast(web.Server, StandInServer()), 0)


class StandInServer:
    """The three hooks of ``web.Server`` the deadline wraps, recording what reaches them."""

    def __init__(self) -> None:
        self.made: list[Any] = []
        self.lost: list[Any] = []
        self.requests: list[Any] = []

    def connection_made(self, handler: Any, transport: Any) -> None:
        self.made.append(handler)

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        self.lost.append(handler)

    def request_factory(self, message: Any, payload: Any, protocol: Any, *args: Any) -> Any:
        self.requests.append(protocol)
        return "request"


class Connection:
    """A connection's handler: ``closed`` is set when the deadline force-closes it."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    def force_close(self) -> None:
        self.closed.set()


async def test_only_connections_without_complete_headers_in_time_are_closed() -> None:
    server = StandInServer()
    deadline = HeaderDeadline(cast(web.Server, server), timeout_s=0.05)
    on_time, gone, late = Connection(), Connection(), Connection()
    for connection in (on_time, gone, late):
        server.connection_made(connection, None)  # the hooks are the deadline's now
    assert server.made == [on_time, gone, late] and deadline.watched == 3
    assert server.request_factory("message", "payload", on_time) == "request"
    server.connection_lost(gone)
    assert server.requests == [on_time] and server.lost == [gone] and deadline.watched == 1
    # The last connection's deadline is the latest of the three: once it is closed, the
    # others' deadlines have passed too.
    await asyncio.wait_for(late.closed.wait(), 5)
    assert not on_time.closed.is_set() and not gone.closed.is_set()
    assert deadline.closed_connections == 1 and deadline.watched == 0
