"""The admin listener's bookkeeping with a moved clock: the per-source failed-auth throttle and
its bounds, the Idempotency-Key store's answers and evictions, and bounded body reads over
mocked requests."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from exporter.web.admin_guard import (
    AuthThrottle,
    IdempotencyStore,
    Replay,
    read_body_bounded,
    source_key,
)
from tests.harness.clock import ManualClock


@pytest.mark.parametrize(
    ("remote", "key"),
    [
        ("10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # the same /64: one bucket
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("fe80::1%eth0", "fe80::/64"),
        (None, "unknown"),
        ("", "unknown"),
        ("/run/exporter.sock", "unknown"),
    ],
)
def test_source_key(remote: str | None, key: str) -> None:
    assert source_key(remote) == key


def test_the_limit_makes_a_source_wait_for_its_oldest_failure_to_age() -> None:
    clock = ManualClock(0.0)
    throttle = AuthThrottle(limit=3, window_s=60.0, clock=clock)
    for step in range(3):
        assert throttle.retry_after("a") == 0.0
        assert throttle.remaining("a") == 3 - step
        throttle.record_failure("a")
        clock.now += 10
    assert throttle.remaining("a") == 0
    assert throttle.retry_after("a") == pytest.approx(30.0), "first failure at 0, now 30"
    assert throttle.retry_after("b") == 0.0, "other sources are never affected"
    clock.now = 60.0
    assert throttle.retry_after("a") == 0.0 and throttle.remaining("a") == 1


def test_the_table_forgets_quiet_sources_and_stays_bounded() -> None:
    clock = ManualClock(0.0)
    throttle = AuthThrottle(limit=2, window_s=60.0, max_addresses=2, clock=clock)
    throttle.record_failure("a")
    throttle.record_failure("b")
    throttle.record_failure("a")  # a is now the most recently failed
    throttle.record_failure("c")  # evicts b, the least recently failed
    assert len(throttle) == 2
    assert throttle.remaining("b") == 2 and throttle.remaining("a") == 0
    clock.now = 61.0
    throttle.record_failure("d")
    assert len(throttle) == 1, "a and c expired"


def test_an_idempotency_key_replays_refuses_or_lets_through() -> None:
    clock = ManualClock(0.0)
    store = IdempotencyStore(ttl_s=600.0, clock=clock)
    assert store.check("k", ("sleep", 1)) is None
    store.begin("k", ("sleep", 1))
    assert store.check("k", ("sleep", 1)) == "in_flight"
    assert store.check("k", ("sleep", 2)) == "mismatch"
    store.finish("k", Replay(200, {"ok": True}))
    assert store.check("k", ("sleep", 1)) == Replay(200, {"ok": True})
    assert store.check("k", ("sleep", 2)) == "mismatch"
    store.finish("k", Replay(500, {}))
    assert store.check("k", ("sleep", 1)) == Replay(200, {"ok": True}), "finished once only"
    clock.now = 600.5
    assert store.check("k", ("sleep", 1)) is None and len(store) == 0


def test_a_request_that_did_not_complete_forgets_its_key() -> None:
    store = IdempotencyStore(clock=ManualClock())
    store.begin("k", "f")
    store.finish("k", None)
    assert store.check("k", "other") is None


def test_only_stored_answers_are_evicted_oldest_first() -> None:
    store = IdempotencyStore(max_keys=2, clock=ManualClock())
    store.begin("running", "f")
    for key in ("a", "b", "c"):
        store.begin(key, "f")
        store.finish(key, Replay(200, {"key": key}))
    assert store.check("a", "f") is None, "the oldest answer went"
    assert store.check("b", "f") == Replay(200, {"key": "b"})
    assert store.check("running", "f") == "in_flight", "a running request is never evicted"
    assert len(store) == 3


def body_request(
    data: bytes = b"", *, eof: bool = True, length: int | None = None
) -> tuple[aiohttp.web.Request, StreamReader]:
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    if data:
        payload.feed_data(data)
    if eof:
        payload.feed_eof()
    headers = {"Content-Length": str(length)} if length is not None else {}
    return make_mocked_request("POST", "/admin/sleep", headers=headers, payload=payload), payload


async def test_a_body_within_the_limit_is_read_whole() -> None:
    request, _ = body_request(b'{"level": 1}')
    assert await read_body_bounded(request, 12, 1.0) == b'{"level": 1}'


async def test_a_body_over_the_limit_is_a_413_declared_or_not() -> None:
    declared, _ = body_request(b"x", length=1000)
    assert await read_body_bounded(declared, 10, 1.0) == (413, "request body too large")
    chunked, _ = body_request(b"x" * 11)
    assert await read_body_bounded(chunked, 10, 1.0) == (413, "request body too large")


async def test_a_slow_or_broken_body_is_a_408_or_a_400() -> None:
    slow, _ = body_request(b"{", eof=False)
    assert await read_body_bounded(slow, 10, 0.02) == (408, "request body not received in time")
    broken, payload = body_request(b"{", eof=False)
    payload.set_exception(aiohttp.ClientPayloadError("connection lost"))
    assert await read_body_bounded(broken, 10, 1.0) == (400, "request body incomplete")
