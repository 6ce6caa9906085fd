"""The admin endpoint under abuse (docs/reliability.md, rows A7, A8, A12, A14 to A16 and A22),
over real HTTP against the admin app, with simulated engines on real ZMQ sockets.

Different client addresses come from binding the client side to other loopback addresses
(127.0.0.2, 127.0.0.3: the whole 127/8 is loopback on Linux).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from exporter.sim.options import SimOptions
from exporter.web.admin import MAX_ADMIN_BODY, RESET_PATH
from exporter.web.admin_guard import AuthThrottle, IdempotencyStore, Replay, source_key
from tests.harness.service import Service, ServiceFactory

TOKEN = "adm-4f1c9e2b7d3a"
ATTACKER, OPERATOR = "127.0.0.2", "127.0.0.1"


@dataclass
class Admin:
    """The admin app of ``service`` on a kernel-chosen port, auditing into ``records``."""

    url: str
    service: Service
    records: list[dict[str, Any]] = field(default_factory=list)
    sessions: dict[str, aiohttp.ClientSession] = field(default_factory=dict)

    def session(self, source: str) -> aiohttp.ClientSession:
        """A client session whose connections come from ``source`` (a loopback address)."""
        if source not in self.sessions:
            connector = aiohttp.TCPConnector(local_addr=(source, 0))
            self.sessions[source] = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=10)
            )
        return self.sessions[source]

    async def post(
        self,
        *,
        source: str = OPERATOR,
        token: str | None = TOKEN,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        data: Any = None,
    ) -> tuple[int, dict[str, Any], Any]:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        async with self.session(source).post(
            self.url + RESET_PATH, params=params or {}, headers=h, data=data
        ) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers

    def resets(self) -> list[int]:
        return [e.calls_by_method.get("reset_prefix_cache", 0) for e in self.service.engines]


AdminFactory = Callable[..., Awaitable[Admin]]


@pytest.fixture
async def admin_service(
    service_factory: ServiceFactory, tmp_path: Path
) -> AsyncIterator[AdminFactory]:
    """``await admin_service(**config)`` → the ``Admin`` of a token-protected two-engine
    service (engines not started), served by the harness with an audit sink into
    ``Admin.records`` (``start_service(config, audit=...)``)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    made: list[Admin] = []

    async def build(**overrides: Any) -> Admin:
        records: list[dict[str, Any]] = []
        svc = await service_factory(
            2, admin_token_file=str(token_file), audit=records.append, **overrides
        )
        assert svc.admin_url is not None
        admin = Admin(svc.admin_url, svc, records)
        made.append(admin)
        return admin

    yield build
    for admin in made:
        for session in admin.sessions.values():
            await session.close()


async def _ready_admin(admin_service: AdminFactory) -> Admin:
    """The admin app of a token-protected service with both engines up."""
    admin = await admin_service()
    await admin.service.start_engines()
    await admin.service.ready()
    return admin


# -- A7, A8: failed tokens are throttled per source; a correct token always passes -----------


async def test_wrong_tokens_never_lock_out_the_right_token(
    admin_service: AdminFactory,
) -> None:
    admin = await _ready_admin(admin_service)

    # A stranger guesses: five 401s, then 429s for that address only.
    statuses = [(await admin.post(source=ATTACKER, token=f"guess-{i}"))[0] for i in range(8)]
    assert statuses == [401] * 5 + [429] * 3, statuses
    status, body, headers = await admin.post(source=ATTACKER, token="guess-x")
    assert status == 429 and 1 <= int(headers["Retry-After"]) <= 60
    assert "authentication" in body["error"]

    # The operator, from another address, with the right token: served at once.
    status, body, _ = await admin.post(source=OPERATOR)
    assert status == 200 and body["success"] is True, body
    # ... and a typo from the operator's address is a plain 401, not the stranger's lockout.
    status, _, _ = await admin.post(source=OPERATOR, token="typo")
    assert status == 401
    # The right token is accepted even from the throttled address.
    status, body, _ = await admin.post(source=ATTACKER)
    assert status == 200 and body["success"] is True
    assert admin.resets() == [2, 2]

    outcomes = Counter(r["outcome"] for r in admin.records if r["client"] == ATTACKER)
    assert outcomes == Counter({"unauthorized": 5, "auth_rate_limited": 4, "success": 1})
    assert not any(TOKEN in repr(r) or "guess-" in repr(r) for r in admin.records)


def test_throttle_table_is_bounded_and_groups_ipv6_by_64() -> None:
    now = [0.0]
    throttle = AuthThrottle(limit=5, window_s=60, max_addresses=100, clock=lambda: now[0])
    for i in range(10_000):  # a spray from many addresses
        throttle.record_failure(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(throttle) == 100
    for _ in range(5):
        throttle.record_failure("192.0.2.7")
    assert throttle.retry_after("192.0.2.7") == pytest.approx(60)
    assert throttle.retry_after("192.0.2.8") == 0
    now[0] = 61.0
    assert throttle.retry_after("192.0.2.7") == 0
    assert len(throttle) == 0  # expired sources are dropped
    # One IPv6 host owns a /64: its addresses share one entry; v4-mapped is the v4 address.
    assert source_key("2001:db8:1:2::1") == source_key("2001:db8:1:2:ffff::9")
    assert source_key("2001:db8:1:2::1") != source_key("2001:db8:1:3::1")
    assert source_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert source_key(None) == source_key("not an address") == "unknown"


# -- A12: a bearer token that is not UTF-8 -----------------------------------------------------


async def _raw_post(url: str, authorization: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST " + RESET_PATH.encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: " + authorization + b"\r\n"
            b"Content-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_non_utf8_bearer_token_is_401_audited_and_counted(
    admin_service: AdminFactory,
) -> None:
    admin = await admin_service()
    svc = admin.service
    await svc.start_engines()
    answers = [
        await _raw_post(admin.url, b"Bearer \xff\xfe\xc3(" + bytes([0x80 + i])) for i in range(6)
    ]
    assert [a.split(b" ", 2)[1] for a in answers] == [b"401"] * 5 + [b"429"]
    assert b"WWW-Authenticate: Bearer" in answers[0]
    assert [r["outcome"] for r in admin.records] == ["unauthorized"] * 5 + ["auth_rate_limited"]
    assert svc.exporter.stats.admin_requests[("reset_prefix_cache", "401")] == 5
    # The token itself, whole and as raw bytes, still works (comparison is on bytes).
    answer = await _raw_post(admin.url, b"Bearer " + TOKEN.encode())
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# -- A14 to A16: Idempotency-Key -----------------------------------------------------------


async def test_reused_key_with_other_flags_is_422(
    admin_service: AdminFactory,
) -> None:
    admin = await _ready_admin(admin_service)
    key = {"Idempotency-Key": "step-7"}
    first = await admin.post(headers=key)
    assert first[0] == 200
    status, body, _ = await admin.post(headers=key, params={"reset_running_requests": "true"})
    assert status == 422, body
    assert "Idempotency-Key" in body["error"]
    # Same flags, spelled differently (the alias, 0 for false): a replay, not a new reset.
    status, body, headers = await admin.post(
        headers=key, params={"reset_running_requests": "0", "reset_external": "false"}
    )
    assert status == 200 and headers.get("Idempotency-Replayed") == "true"
    assert body == first[1]
    assert admin.resets() == [1, 1]
    assert [r["outcome"] for r in admin.records] == [
        "success",
        "idempotency_key_reused",
        "idempotent_replay",
    ]


async def test_no_engine_503_is_not_stored(
    admin_service: AdminFactory,
) -> None:
    admin = await admin_service()
    svc = admin.service
    key = {"Idempotency-Key": "after-weights-3"}
    status, body, _ = await admin.post(headers=key)
    assert status == 503 and "no engine" in body["error"]
    await svc.start_engines()
    await svc.ready()
    status, body, headers = await admin.post(headers=key)
    assert status == 200 and body["success"] is True
    assert "Idempotency-Replayed" not in headers
    assert admin.resets() == [1, 1]
    # Now it is stored: the next retry is a replay.
    status, _, headers = await admin.post(headers=key)
    assert status == 200 and headers.get("Idempotency-Replayed") == "true"
    assert admin.resets() == [1, 1]


async def test_same_key_while_the_first_runs_is_409(
    admin_service: AdminFactory,
) -> None:
    admin = await admin_service(call_timeout=3.0)
    svc = admin.service
    await svc.start_engines(by_index={i: SimOptions(reply_delay_s=0.4) for i in range(2)})
    await svc.ready()
    key = {"Idempotency-Key": "k-409"}
    first = asyncio.create_task(admin.post(headers=key))
    await asyncio.wait_for(_until(lambda: admin.resets() != [0, 0] or first.done()), 5)
    same = await admin.post(headers=key)
    other = await admin.post(headers=key, params={"reset_connector": "1"})
    status, body, _ = await first
    assert status == 200 and body["success"] is True
    assert same[0] == 409 and "Idempotency-Key" in same[1]["error"], same
    assert other[0] == 422, other
    replay = await admin.post(headers=key)
    assert replay[0] == 200 and replay[2].get("Idempotency-Replayed") == "true"
    assert admin.resets() == [1, 1]


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_store_keeps_only_what_it_is_told_and_stays_bounded() -> None:
    now = [0.0]
    store = IdempotencyStore(ttl_s=10, max_keys=3, clock=lambda: now[0])
    store.begin("a", ("x",))
    assert store.check("a", ("x",)) == "in_flight"
    assert store.check("a", ("y",)) == "mismatch"
    store.finish("a", None)  # did not complete: forgotten
    assert store.check("a", ("y",)) is None
    for key in "bcde":
        store.begin(key, ())
        store.finish(key, Replay(200, {"k": key}))
    assert len(store) == 3 and store.check("b", ()) is None  # the oldest went first
    store.finish("e", None)  # a late "did not complete" never drops a stored answer
    assert store.check("e", ()) == Replay(200, {"k": "e"})
    now[0] = 11.0
    assert store.check("e", ()) is None and len(store) == 0


# -- A22: the body limit holds for chunked bodies ---------------------------------------------


async def _chunks(total: int, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        chunk = b"x" * min(size, total - sent)
        sent += len(chunk)
        yield chunk


async def test_chunked_bodies_are_held_to_the_limit(
    admin_service: AdminFactory,
) -> None:
    admin = await _ready_admin(admin_service)
    # A chunked body just over the limit, and a large one: 413, no reset.
    for total in (MAX_ADMIN_BODY + 1, 256 * 1024):
        status, body, _ = await admin.post(data=_chunks(total, size=700))
        assert status == 413, (total, body)
        assert "too large" in body["error"]
    try:
        status, _, _ = await admin.post(data=_chunks(50 * 1024 * 1024))
    except aiohttp.ClientError:
        status = 413  # the server may stop reading (and close) before the client is done
    assert status == 413
    assert admin.resets() == [0, 0]
    # A small chunked body is fine; so is the usual empty one.
    status, _, _ = await admin.post(data=_chunks(100))
    assert status == 200
    status, _, _ = await admin.post()
    assert status == 200
    assert admin.resets() == [2, 2]
    assert [r["status"] for r in admin.records] == [413, 413, 413, 200, 200]
