"""docs/reliability.md, rows A9 to A11 and A23: what a scraper writes in ``Accept`` and
``Accept-Encoding`` selects one of two formats, gzip or not, and nothing else: no per-client
cache entries, no 500, ``gzip;q=0`` honoured, ``Vary`` on every answer. Real HTTP against
the service (raw sockets where a header must carry bytes aiohttp's client would not send)."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from exporter.metrics.negotiation import (
    CONTENT_TYPES,
    OPENMETRICS,
    TEXT,
    metrics_format,
    wants_gzip,
)
from tests.harness.service import Service, ServiceFactory

TEXT_TYPE = CONTENT_TYPES[TEXT]
OM_TYPE = CONTENT_TYPES[OPENMETRICS]


async def _raw_get(svc: Service, *headers: bytes) -> tuple[int, dict[str, str], bytes]:
    """GET /metrics with the header lines given as bytes; (status, headers, body)."""
    host, port = svc.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        writer.write(request + b"".join(h + b"\r\n" for h in headers) + b"\r\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), fields, body


async def _ready_service(service_factory: ServiceFactory) -> Service:
    svc = await service_factory(1, poll_interval=60.0)  # no poll changes the state meanwhile
    await svc.start_engines()
    await svc.ready()
    return svc


async def test_distinct_accept_headers_share_four_cache_entries(
    service_factory: ServiceFactory,
) -> None:
    svc = await _ready_service(service_factory)
    types = set()
    for i in range(200):
        for accept in (
            f"application/openmetrics-text; version=1.0.{i}",
            f"text/plain; version=0.0.{i}; x-client={i}",
        ):
            for encoding in ("gzip", "identity"):
                headers = {"Accept": accept, "Accept-Encoding": encoding}
                async with svc.session.get(svc.url + "/metrics", headers=headers) as resp:
                    assert resp.status == 200
                    types.add(resp.headers["Content-Type"])
                    await resp.read()
    assert types == {TEXT_TYPE, OM_TYPE}
    entries = svc.exporter.renderer.entries
    assert entries <= 4, f"{entries} render-cache entries"


@pytest.mark.parametrize(
    "accept",
    [
        b"application/openmetrics-text; version=abc",
        b"application/openmetrics-text; version=1.0.0abc",
        "application/openmetrics-text; version=1.0.0\u00e9".encode(),
        b"application/openmetrics-text; version=\xff\xfe",
        b"text/plain; version=abc",
        b"text/plain; q=nan, application/json",
        b"\xc3\xa9/\xc3\xa9; q=2",
        b";;;,,,=;q=",
    ],
)
async def test_odd_accept_headers_fall_back_to_the_text_format(
    service_factory: ServiceFactory, accept: bytes
) -> None:
    svc = await service_factory(1, poll_interval=60.0)
    status, headers, body = await _raw_get(svc, b"Accept: " + accept)
    assert status == 200, body[:300]
    assert headers["Content-Type"] == TEXT_TYPE
    assert b"# HELP vllm_dp_engine_up" in body and b"# EOF" not in body
    # The service is unharmed: OpenMetrics still negotiated for a proper request.
    status, headers, body = await _raw_get(svc, b"Accept: application/openmetrics-text")
    assert status == 200 and headers["Content-Type"] == OM_TYPE
    assert body.rstrip().endswith(b"# EOF")


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("GZIP;Q=0, identity", False),
        ("*;q=0, identity", False),
        ("gzip;q=0.3, identity;q=0.9", False),
        ("br, deflate", False),
        ("", False),
        ("gzip", True),
        ("gzip, deflate, br", True),
        ("x-gzip", True),
        ("*", True),
        ("identity;q=0.5, gzip;q=0.8", True),
    ],
)
async def test_accept_encoding_q_values_and_vary(
    service_factory: ServiceFactory, accept_encoding: str, gzipped: bool
) -> None:
    svc = await service_factory(1, poll_interval=60.0)
    status, headers, body = await _raw_get(svc, f"Accept-Encoding: {accept_encoding}".encode())
    assert status == 200
    assert ("Content-Encoding" in headers) is gzipped, headers
    text = gzip.decompress(body) if gzipped else body
    assert b"# TYPE vllm_dp_engine_up gauge" in text
    vary = {v.strip().lower() for v in headers.get("Vary", "").split(",")}
    assert {"accept", "accept-encoding"} <= vary, headers


def test_negotiation_rules() -> None:
    prometheus2 = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
        "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    prometheus3 = (
        "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
        "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
        "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
    )
    cases = {
        "": TEXT,
        "*/*": TEXT,
        prometheus2: OPENMETRICS,
        prometheus3: OPENMETRICS,
        "text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.5": TEXT,
        "application/openmetrics-text;q=0, */*": TEXT,
        "application/openmetrics-text; version=2.0.0": TEXT,
        "application/openmetrics-text, text/plain": OPENMETRICS,
        "text/plain, application/openmetrics-text": TEXT,
        "application/*;q=0.9, text/plain;q=0.1": OPENMETRICS,
        "application/json": TEXT,
    }
    for accept, fmt in cases.items():
        assert metrics_format(accept) == fmt, accept
    assert wants_gzip("deflate, gzip;q=1.0, *;q=0.5")
    assert not wants_gzip("gzip;q=-1") and not wants_gzip("gzip;q=abc")
