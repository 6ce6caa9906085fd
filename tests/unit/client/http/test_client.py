"""``HttpFleetClient`` (``exporter.client.http.client``) over a stub exchange and stub
sessions: one outcome per called target in target order, a connection failure a
``disconnected`` target, a slow one a ``timeout``, a reset pooled connection retried once on a
fresh one, and a closed client sends nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import aiohttp
import pytest

from exporter.client.fleet import DEFAULT_ALLOWED_METHODS, Outcome
from exporter.client.http import client as http_client
from exporter.client.http import fault
from exporter.client.http.client import HttpFleetClient, HttpTarget
from exporter.client.http.routes import Reply, Retryable, Route
from exporter.error import MethodNotAllowed

A, B = HttpTarget("a", "http://a:1"), HttpTarget("b", "http://b:2")


class Session:
    def __init__(self, name: str) -> None:
        self.name = name

    async def close(self) -> None:
        return None


class Servers:
    """Answers by (server, path): a ``Reply``, an exception to raise, or seconds to hang."""

    def __init__(self, answers: dict[tuple[str, str], Any]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, str, str]] = []

    async def exchange(
        self, session: Any, base: str, route: Route, limit: int | None = None
    ) -> Reply:
        self.asked.append((session.name, base, route.path))
        answer = self.answers.get((base, route.path), Reply(404, b""))
        if callable(answer):
            answer = answer(session)
        if isinstance(answer, float):
            await asyncio.sleep(answer)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]


def json_reply(doc: Any) -> Reply:
    return Reply(200, json.dumps(doc).encode())


def client_over(
    monkeypatch: pytest.MonkeyPatch, servers: Servers, *targets: HttpTarget
) -> HttpFleetClient:
    monkeypatch.setattr(http_client, "exchange", servers.exchange)
    monkeypatch.setattr(fault, "exchange", servers.exchange)
    client = HttpFleetClient(list(targets or (A, B)))
    client._session, client._fresh, client._side = (
        cast(aiohttp.ClientSession, Session(name)) for name in ("pooled", "fresh", "side")
    )
    return client


def test_each_target_is_one_engine_not_connected_until_it_answers() -> None:
    client = HttpFleetClient([A, HttpTarget("p", "http://p:3/dp")], token="s3cret")
    assert client.engine_labels == ["a", "p"]
    details = client.engine_details()
    assert [(d.engine, d.connected, d.address) for d in details] == [
        ("a", False, "http://a:1"),
        ("p", False, "http://p:3/dp"),
    ]
    caps = client.capabilities
    assert caps.fault_status and caps.request_counts and caps.methods <= DEFAULT_ALLOWED_METHODS
    assert "s3cret" not in repr(client)  # the token stays out of reprs


async def test_outcomes_per_target_in_order_and_the_version_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers(
        {
            ("http://a:1", "/is_paused"): json_reply({"is_paused": True}),
            ("http://a:1", "/version"): json_reply({"version": "0.33.0"}),
            ("http://b:2", "/is_paused"): aiohttp.ClientConnectionError("refused"),
        }
    )
    client = client_over(monkeypatch, servers)
    outcomes = await client.call_utility("is_scheduler_paused", timeout_s=1.0)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("a", Outcome.OK, True),
        ("b", Outcome.DISCONNECTED, None),
    ]
    assert outcomes[1].error is not None and "http://b:2" in outcomes[1].error
    await asyncio.gather(*list(client._background))
    details = {d.engine: d for d in client.engine_details()}
    assert details["a"].connected and details["a"].vllm_version == "0.33.0"
    assert not details["b"].connected
    await client.call_utility("is_scheduler_paused", timeout_s=1.0)
    assert [p for _, base, p in servers.asked if p == "/version"] == ["/version"]  # once


async def test_is_sleeping_brings_the_fault_status_read_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ft = {"engines": [{"id": 0, "status": "healthy"}, {"id": 1, "status": "recovering"}]}
    servers = Servers(
        {
            ("http://a:1", "/is_sleeping"): json_reply({"is_sleeping": False}),
            ("http://a:1", "/fault_tolerance/status"): json_reply(ft),
        }
    )
    client = client_over(monkeypatch, servers, A)
    (outcome,) = await client.call_utility("is_sleeping", timeout_s=1.0)
    assert (outcome.outcome, outcome.value) == (Outcome.OK, False)
    (detail,) = client.engine_details()
    assert detail.fault_status is not None and detail.fault_status.status == "recovering"
    assert ("side", "http://a:1", "/fault_tolerance/status") in servers.asked  # its own pool


async def test_only_the_engines_asked_for_are_called(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = Servers({("http://b:2", "/is_paused"): json_reply({"is_paused": False})})
    client = client_over(monkeypatch, servers)
    outcomes = await client.call_utility("is_scheduler_paused", timeout_s=1.0, engines=["b"])
    assert [(o.engine, o.value) for o in outcomes] == [("b", False)]
    assert {base for _, base, path in servers.asked if path == "/is_paused"} == {"http://b:2"}


async def test_a_reset_pooled_connection_is_retried_once_on_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def reset_when_pooled(session: Session) -> Any:
        return Retryable("reset") if session.name == "pooled" else json_reply({"is_paused": True})

    servers = Servers({("http://a:1", "/is_paused"): reset_when_pooled})
    client = client_over(monkeypatch, servers, A)
    (outcome,) = await client.call_utility("is_scheduler_paused", timeout_s=1.0)
    assert outcome.outcome is Outcome.OK and client.retries == 1
    sessions = [name for name, _, path in servers.asked if path == "/is_paused"]
    assert sessions == ["pooled", "fresh"]


async def test_a_slow_target_times_out_and_the_others_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers(
        {
            ("http://a:1", "/is_paused"): 5.0,
            ("http://b:2", "/is_paused"): json_reply({"is_paused": False}),
        }
    )
    client = client_over(monkeypatch, servers)
    outcomes = await client.call_utility("is_scheduler_paused", timeout_s=0.05)
    assert [(o.engine, o.outcome) for o in outcomes] == [
        ("a", Outcome.TIMEOUT),
        ("b", Outcome.OK),
    ]
    await client.close()


async def test_nothing_is_sent_off_the_allow_list_or_once_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = Servers({})
    client = client_over(monkeypatch, servers)
    with pytest.raises(MethodNotAllowed):
        await client.call_utility("shutdown", timeout_s=1.0)
    await client.close()
    outcomes = await client.call_utility("is_scheduler_paused", timeout_s=1.0)
    assert [(o.engine, o.outcome) for o in outcomes] == [
        ("a", Outcome.DISCONNECTED),
        ("b", Outcome.DISCONNECTED),
    ]
    assert servers.asked == []


async def test_a_bug_fails_the_targets_call_and_never_the_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not started (no session): the call fails with the error's name, logged, not raised."""
    client = HttpFleetClient([A])
    (outcome,) = await client.call_utility("is_scheduler_paused", timeout_s=1.0)
    assert (outcome.outcome, outcome.error) == (Outcome.FAILED, "RuntimeError")
    assert "is_scheduler_paused on target a: RuntimeError" in caplog.text
