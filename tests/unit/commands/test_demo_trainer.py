"""The demo's trainer (``reset_loop``) outlives any one failed call: a client failure that is not
an exporter's answer is logged and the loop goes on, so the demo's reset panels keep moving."""

from __future__ import annotations

import asyncio
import logging

import pytest

from exporter.commands.demo.common import _status_of
from exporter.remote import ActionResult
from exporter.remote.errors import Conflict, Unreachable


async def _raises(exc: BaseException) -> ActionResult:
    raise exc


def test_an_exporter_error_gives_its_status() -> None:
    busy = Conflict("another admin action is running", status=409)
    assert asyncio.run(_status_of(_raises(busy))) == 409
    assert asyncio.run(_status_of(_raises(Unreachable("no answer", url="http://x")))) is None


def test_an_unexpected_client_failure_is_logged_and_survived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="exporter.demo"):
        status = asyncio.run(_status_of(_raises(RuntimeError("session closed"))))
    assert status is None
    assert "demo trainer: RuntimeError: session closed" in caplog.text


def test_cancellation_still_stops_the_loop() -> None:
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_status_of(_raises(asyncio.CancelledError())))
