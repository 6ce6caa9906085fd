"""Admin bodies and queries that are valid JSON or URL syntax but no valid text or shape (a
lone surrogate escape, 1,020 nested arrays, percent-encoded bytes that are not UTF-8): a 400
naming the problem, audited, never a 500, and nothing reaches an engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.harness.service import Service, ServiceFactory

HOSTILE_BODIES = (
    b'{"weight_version": "\\ud800"}',
    b'{"weight_version": "v\\udc80x"}',
    b'{"weight_version": "\\udbff"}',
    b"[" * 1020,
    b'{"weight_version": ' + b"[" * 1000,
    b'{"weight_version": "v1", "x": ' + b"[" * 490 + b"]" * 490 + b"}",
    b'{"a":' * 200,
)
#: Query strings a client can send as raw bytes (percent-encoded or not UTF-8 at all).
HOSTILE_QUERIES = (
    ("wake_up", "tags=%ED%A0%80"),
    ("wake_up", "tags=%FF"),
    ("sleep", "level=%ED%A0%80"),
    ("pause", "mode=%C0%80"),
    ("reset_prefix_cache", "reset_connector=%ED%A0%80"),
    ("reset_prefix_cache", "%ED%A0%80=1"),
    ("wake_up", "tags=\udcff"),  # sent as the raw byte 0xff
    ("sleep", "level=1&mode=\udcc0\udc80"),
)


async def _raw_post(svc: Service, target: str, body: bytes = b"", **headers: bytes) -> int:
    """One POST over raw TCP (so the request carries exactly these bytes); its status."""
    assert svc.admin_url is not None
    port = int(svc.admin_url.rsplit(":", 1)[1])
    head = (
        b"POST "
        + target.encode("utf-8", "surrogateescape")
        + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    )
    for name, value in headers.items():
        head += name.replace("_", "-").encode() + b": " + value + b"\r\n"
    head += b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return int(status_line.split()[1])


@pytest.fixture
async def fleet(service_factory: ServiceFactory) -> Service:
    records: list[dict[str, Any]] = []
    svc = await service_factory(2, audit=records.append)
    await svc.start_engines()
    await svc.ready()
    svc.audit_records = records  # type: ignore[attr-defined]
    return svc


async def test_weight_version_bodies_that_are_no_valid_text_are_400(fleet: Service) -> None:
    for body in HOSTILE_BODIES:
        status = await _raw_post(fleet, "/admin/weight_version", body)
        assert status == 400, (body[:40], status)
    outcomes = [r["outcome"] for r in fleet.audit_records]  # type: ignore[attr-defined]
    assert outcomes == ["bad_request"] * len(HOSTILE_BODIES), outcomes
    for engine in fleet.engines:
        assert not engine.args_of("set_weight_version")
    # A good body is still served.
    status = await _raw_post(fleet, "/admin/weight_version", b'{"weight_version": "v\\u00e9"}')
    assert status == 200
    assert all(e.args_of("set_weight_version") == [["v\u00e9"]] for e in fleet.engines)


async def test_every_admin_route_refuses_hostile_bodies_and_queries_with_400(
    fleet: Service,
) -> None:
    # (The prefix-cache reset reads no body: any body up to 1 KiB is ignored, as documented.)
    routes = (
        "sleep",
        "wake_up",
        "pause",
        "resume",
        "reset_mm_cache",
        "reset_encoder_cache",
        "verify_weights",
    )
    for route in routes:
        status = await _raw_post(fleet, f"/admin/{route}", b"[" * 1020)
        assert status == 400, (route, status)
    for route, query in HOSTILE_QUERIES:
        status = await _raw_post(fleet, f"/admin/{route}?{query}")
        assert status == 400, (route, query, status)
    # Header bytes that are not UTF-8 in the Idempotency-Key: a usable key or a 400, never 500.
    status = await _raw_post(fleet, "/admin/resume", Idempotency_Key=b"\xff\xfe-key")
    assert status in (200, 400), status
    audited = [r["status"] for r in fleet.audit_records]  # type: ignore[attr-defined]
    assert 500 not in audited, audited
    for engine in fleet.engines:
        for method in ("sleep", "wake_up", "pause_scheduler", "reset_prefix_cache"):
            assert not engine.args_of(method), (engine.engine_index, method)
