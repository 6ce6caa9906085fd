"""HTTP mode's elastic-EP read (``exporter.client.http.elastic_ep``) over a stub exchange: a
server without the route is "unsupported" (no series) and asked again only rarely or after it
was unreachable, and anything else that is not an operation is that target's problem, never
the last operation kept (it may be stale)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import aiohttp
import pytest

from exporter.client.http import elastic_ep
from exporter.client.http.elastic_ep import ELASTIC_EP_RECHECK_S, ElasticEpReader
from exporter.client.http.routes import Reply, Route

WALL = 1.7e9


class Servers:
    """Answers per server URL (a ``Reply``, an exception, or a delay then a reply)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def exchange(
        self, session: Any, base: str, route: Route, limit: int | None = None
    ) -> Reply:
        assert (route.verb, route.path) == ("POST", "/is_scaling_elastic_ep")
        self.asked.append(base)
        answer = self.answers[base]
        if isinstance(answer, float):
            await asyncio.sleep(answer)
        if isinstance(answer, BaseException):
            raise answer
        return answer if isinstance(answer, Reply) else Reply(200, b"{}")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def no_session() -> aiohttp.ClientSession:
    """The exchange is stubbed: no session is ever used."""
    return cast(aiohttp.ClientSession, object())


def reader(
    monkeypatch: pytest.MonkeyPatch, servers: Servers, targets: list[tuple[str, str]], clock: Clock
) -> tuple[ElasticEpReader, set[asyncio.Task[None]]]:
    monkeypatch.setattr(elastic_ep, "exchange", servers.exchange)
    background: set[asyncio.Task[None]] = set()
    found = ElasticEpReader(targets, no_session, background, clock=clock, wall=lambda: WALL)
    return found, background


async def settle(background: set[asyncio.Task[None]]) -> None:
    await asyncio.gather(*list(background))


def answer(doc: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(doc).encode())


async def test_each_target_is_read_a_plugin_target_at_its_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers(
        {
            "http://a:1": answer(
                {"phase": "committing", "epoch": "3", "requested_data_parallel_size": 4}
            ),
            "http://b:2": answer({"is_scaling_elastic_ep": False}),
        }
    )
    found, background = reader(
        monkeypatch, servers, [("a", "http://a:1"), ("b", "http://b:2/dp")], Clock()
    )
    assert [r.read_at_unix for r in found.reads()] == [None, None]  # not asked yet
    found.refresh(1.0, {})
    await settle(background)
    a, b = found.reads()
    assert sorted(servers.asked) == ["http://a:1", "http://b:2"]
    assert a.operation is not None and (a.operation.phase, a.operation.scaling) == (
        "committing",
        True,
    )
    assert a.operation.requested_data_parallel_size == 4 and a.read_at_unix == WALL
    assert b.operation is not None and b.operation.phase == "idle" and b.problem is None


@pytest.mark.parametrize("status", [404, 405, 501])
async def test_unsupported_is_remembered_and_asked_again_rarely(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    servers, clock = Servers({"http://a:1": Reply(status, b"")}), Clock()
    found, background = reader(monkeypatch, servers, [("a", "http://a:1")], clock)
    found.refresh(1.0, {"a": True})
    await settle(background)
    (read,) = found.reads()
    assert not read.supported and read.operation is None
    assert read.problem == f"unsupported here: HTTP {status} from POST /is_scaling_elastic_ep"
    found.refresh(1.0, {"a": True})
    assert not background and servers.asked == ["http://a:1"]  # not asked within the recheck
    clock.now += ELASTIC_EP_RECHECK_S
    found.refresh(1.0, {"a": True})
    await settle(background)
    assert len(servers.asked) == 2


async def test_an_unreachable_server_is_asked_again_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It may come back as another vLLM, one with the route."""
    servers = Servers({"http://a:1": Reply(404, b"")})
    found, background = reader(monkeypatch, servers, [("a", "http://a:1")], Clock())
    found.refresh(1.0, {"a": True})
    await settle(background)
    found.refresh(1.0, {"a": False})
    await settle(background)
    assert len(servers.asked) == 2


@pytest.mark.parametrize(
    ("reply", "problem"),
    [
        (
            answer({"error": {"message": "temporarily unavailable"}}, 503),
            "HTTP 503 from POST /is_scaling_elastic_ep: temporarily unavailable",
        ),
        (Reply(500, b"oops"), "HTTP 500 from POST /is_scaling_elastic_ep"),
        (Reply(200, b"x" * 10, cut=True), "longer than"),
        (Reply(200, b"not json"), "unreadable answer from POST /is_scaling_elastic_ep"),
        (answer({"phase": 3}), "phase is int, not a string"),
        (ConnectionResetError("reset"), "http://a:1"),
        (RuntimeError("no session"), "not read: RuntimeError"),
        (5.0, "no answer from POST /is_scaling_elastic_ep within 0.05s"),
    ],
)
async def test_anything_not_an_operation_is_the_targets_problem(
    monkeypatch: pytest.MonkeyPatch, reply: Any, problem: str
) -> None:
    servers = Servers({"http://a:1": answer({"phase": "preparing"})})
    found, background = reader(monkeypatch, servers, [("a", "http://a:1")], Clock())
    found.refresh(0.05, {})
    await settle(background)
    assert found.reads()[0].operation is not None
    servers.answers["http://a:1"] = reply
    found.refresh(0.05, {})
    await settle(background)
    (read,) = found.reads()
    assert read.operation is None and read.supported  # never the last operation kept
    assert read.problem is not None and problem in read.problem


async def test_one_read_per_target_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = Servers({"http://a:1": 0.05})
    found, background = reader(monkeypatch, servers, [("a", "http://a:1")], Clock())
    found.refresh(1.0, {})
    found.refresh(1.0, {})
    await asyncio.sleep(0)
    assert len(background) == 1
    await settle(background)
    assert servers.asked == ["http://a:1"]
