"""Malformed HTTP requests over raw TCP, on both listeners: answered 400 by aiohttp's parser,
counted per listener, logged in a few rate-limited lines (never a traceback per request), and
the listeners keep serving good requests."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.harness.scrape import metric_value
from tests.harness.service import ServiceFactory

#: A control byte in a header value, a 9 KB request line, an HTTP version that does not exist.
MALFORMED = (
    b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n",
)
PER_LISTENER = 201  # 67 of each kind


async def _send_raw(port: int, request: bytes) -> bytes:
    """One request on its own connection; what came back before the server closed it."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _storm(port: int) -> list[bytes]:
    answers: list[bytes] = []
    for start in range(0, PER_LISTENER, 20):  # 20 connections at a time
        batch = [MALFORMED[i % len(MALFORMED)] for i in range(start, min(start + 20, PER_LISTENER))]
        answers += await asyncio.gather(*(_send_raw(port, r) for r in batch))
    return answers


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_malformed_requests_are_counted_and_logged_in_a_few_lines(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    svc = await service_factory(2, guarded=True)
    await svc.start_engines()
    await svc.ready()
    assert svc.admin_url is not None
    caplog.set_level(logging.INFO)
    caplog.clear()
    for url in (svc.url, svc.admin_url):
        answers = await _storm(_port(url))
        assert all(a.startswith(b"HTTP/1.0 400") or a.startswith(b"HTTP/1.1 400") for a in answers)
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = "\n".join(caplog.text.splitlines())
    # One line per listener per log interval, whatever the number of bad requests.
    assert len(logged) <= 4, [r.getMessage()[:120] for r in logged[:6]]
    assert not any(r.exc_info for r in logged) and "Traceback" not in text
    assert len(caplog.text) < 2048, len(caplog.text)
    assert {r.name for r in logged} <= {"exporter.http"}
    assert any("metrics listener" in r.getMessage() for r in logged)
    assert any("admin listener" in r.getMessage() for r in logged)
    # The listeners still serve good requests, and the scrape counts what was refused.
    status, body, _ = await svc.reset()
    assert status == 200 and body["success"] is True
    m = await svc.scrape()
    for listener in ("metrics", "admin"):
        counted = metric_value(m, "vllm_dp_http_bad_requests_total", listener=listener)
        assert counted == PER_LISTENER, (listener, counted)
    assert metric_value(m, "vllm_dp_engine_up", engine="0") == 1.0
