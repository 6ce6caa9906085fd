"""HTTP mode's fault-tolerance read (``exporter.client.http.fault``) over a stub exchange: the
route that answered is remembered, a server without either is left alone for a while, and any
answer that cannot be read makes its ranks ``unknown`` (never healthy, never the last status
kept), since the gate's ``healthy`` condition passes on these statuses."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, cast

import aiohttp
import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.http import fault
from exporter.client.http.fault import FT_RECHECK_S, FT_ROUTES, FaultRead, FaultStatusReader
from exporter.client.http.routes import Reply, Retryable, Route
from exporter.client.pushes import BAD_FT_STATUS, PushBook

SERVER = "http://h:8000"


def status_body(*ranks: tuple[int, str, str | None]) -> bytes:
    engines = [{"id": r, "status": s, "fault_info": info} for r, s, info in ranks]
    return json.dumps(
        {"schema_version": 1, "total_engines": len(engines), "engines": engines}
    ).encode()


class Server:
    """Answers by path; records every path asked."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def exchange(
        self, session: Any, base: str, route: Route, limit: int | None = None
    ) -> Reply:
        assert base == SERVER
        self.asked.append(route.path)
        answer = self.answers.get(route.path, Reply(404, b""))
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]


def no_session() -> aiohttp.ClientSession:
    """The exchange is stubbed: no session is ever used."""
    return cast(aiohttp.ClientSession, object())


def reader(monkeypatch: pytest.MonkeyPatch, server: Server) -> tuple[FaultStatusReader, PushBook]:
    monkeypatch.setattr(fault, "exchange", server.exchange)
    faults = ProtocolErrorTally()
    pushes = PushBook(faults)
    return FaultStatusReader(pushes, faults, no_session, set()), pushes


async def read_once(ft: FaultStatusReader, read: FaultRead, labels: list[str]) -> None:
    task = ft.refresh(read, labels, 1.0)
    assert task is not None
    await task


async def test_a_plain_target_gets_the_worst_of_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    body = status_body((0, "healthy", None), (1, "unhealthy", "RuntimeError"))
    ft, pushes = reader(monkeypatch, Server({FT_ROUTES[0].path: Reply(200, body)}))
    await read_once(ft, FaultRead("a", SERVER, per_rank=False), ["a"])
    status = pushes.fault_status["a"]
    assert (status.status, status.fault_info) == ("unhealthy", "rank 1: RuntimeError")


async def test_the_v1_route_is_tried_on_404_and_then_asked_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    v1 = FT_ROUTES[1].path
    server = Server({v1: Reply(200, status_body((0, "healthy", None)))})
    ft, pushes = reader(monkeypatch, server)
    read = FaultRead("a", SERVER, per_rank=False)
    await read_once(ft, read, ["a"])
    await read_once(ft, read, ["a"])
    assert server.asked == [FT_ROUTES[0].path, v1, v1]
    assert read.route == 1 and pushes.fault_status["a"].status == "healthy"


async def test_a_server_without_the_route_is_left_alone_until_rechecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = Server({})
    ft, pushes = reader(monkeypatch, server)
    pushes.set_fault_status("a", "healthy", None)
    read = FaultRead("a", SERVER, per_rank=False)
    await read_once(ft, read, ["a"])
    assert read.missing_at is not None and "a" not in pushes.fault_status  # no status: none
    assert ft.refresh(read, ["a"], 1.0) is None
    read.missing_at = time.monotonic() - FT_RECHECK_S - 1
    await read_once(ft, read, ["a"])
    assert server.asked == [p for _ in range(2) for p in (FT_ROUTES[0].path, FT_ROUTES[1].path)]
    read.reconnected()
    assert read.missing_at is None


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (Reply(500, b"boom"), "HTTP 500 from /fault_tolerance/status"),
        (Reply(200, b"<html>"), "answer is not JSON"),
        (Reply(200, b'{"engines": [{"status": "healthy"}]}'), "an entry names no rank"),
    ],
)
async def test_an_unreadable_answer_is_unknown_and_counted(
    monkeypatch: pytest.MonkeyPatch, reply: Reply, why: str
) -> None:
    ft, pushes = reader(monkeypatch, Server({FT_ROUTES[0].path: reply}))
    pushes.set_fault_status("a", "healthy", None)
    await read_once(ft, FaultRead("a", SERVER, per_rank=False), ["a"])
    status = pushes.fault_status["a"]
    assert status.status == "unknown"
    assert status.fault_info is not None and why in status.fault_info
    assert ft._faults.counts == {BAD_FT_STATUS: 1}


async def test_an_unreachable_server_makes_a_known_status_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ft, pushes = reader(monkeypatch, Server({FT_ROUTES[0].path: Retryable("reset")}))
    pushes.set_fault_status("a", "healthy", None)
    await read_once(ft, FaultRead("a", SERVER, per_rank=False), ["a", "never-seen"])
    assert pushes.fault_status["a"].status == "unknown"
    assert pushes.fault_status["a"].fault_info == "not read: Retryable"
    assert "never-seen" not in pushes.fault_status  # nothing invented for an unknown engine


async def test_a_plugin_target_gives_each_named_rank_its_own_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = status_body((0, "healthy", None), (1, "dead", "gone"), (7, "healthy", None))
    ft, pushes = reader(monkeypatch, Server({FT_ROUTES[0].path: Reply(200, body)}))
    read = FaultRead("p", SERVER, per_rank=True)
    await read_once(ft, read, ["p"])  # its gate named no rank yet: nothing to match
    assert pushes.fault_status == {}
    await read_once(ft, read, ["p/0", "p/1", "p/2"])
    assert {k: v.status for k, v in pushes.fault_status.items()} == {
        "p/0": "healthy",
        "p/1": "dead",
        "p/2": "unknown",  # named by the gate, missing from the answer
    }
    assert "p/7" not in pushes.fault_status  # a rank only the answer names adds no engine


async def test_a_gate_read_not_done_by_its_deadline_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ft, pushes = reader(monkeypatch, Server({}))
    pushes.set_fault_status("a", "healthy", None)
    read = FaultRead("a", SERVER, per_rank=False)
    read.task = asyncio.create_task(asyncio.sleep(10))  # a read from before the gate asked
    read.started_at = time.monotonic() - 1
    try:
        await ft.fresh(read, ["a"], 1.0, asked_at=time.monotonic(), deadline=time.monotonic())
    finally:
        read.task.cancel()
        await asyncio.gather(read.task, return_exceptions=True)
    assert pushes.fault_status["a"].status == "unknown"
    assert "before the gate's deadline" in (pushes.fault_status["a"].fault_info or "")
