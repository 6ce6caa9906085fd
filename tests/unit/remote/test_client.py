"""``Client``: which request each call makes (route, parameters, headers, whether it may be
retried) and which result or typed error each answer becomes. The request path underneath is
an in-memory ``Http`` that records the requests and hands back scripted answers."""

from __future__ import annotations

import re
from typing import Any

import pytest

from exporter.error import ConfigError
from exporter.remote.answers import Answer
from exporter.remote.client import VERIFY_TIMEOUT_S, Client
from exporter.remote.credentials import BasicAuth, Credentials, Secret
from exporter.remote.errors import (
    AuthError,
    BadRequest,
    Conflict,
    InvalidAnswer,
    NoEngineConnected,
    NotFound,
    PartialFailure,
    Unsupported,
)
from exporter.remote.http import NO_RETRY, Http, Retry

URL, ADMIN = "http://h:19400/dp", "http://h:19401"
OK_ENGINES: dict[str, Any] = {"engines": [{"engine": 0, "ok": True}]}


class FakeHttp(Http):
    """``Http`` without a pool: each request recorded, each answer scripted."""

    def __init__(self, *answers: tuple[int, dict[str, Any] | None]) -> None:
        super().__init__(None, 1024)
        self.answers = list(answers)
        self.sent: list[dict[str, Any]] = []

    async def request(
        self,
        method: str,
        url: str,
        *,
        timeout_s: float,
        retry: Retry = NO_RETRY,
        retry_statuses: bool = False,
        **kwargs: Any,
    ) -> Answer:
        self.sent.append(
            {"method": method, "url": url, "timeout_s": timeout_s, "retry": retry, **kwargs}
        )
        self.sent[-1]["retry_statuses"] = retry_statuses
        status, body = self.answers.pop(0)
        problem = None if body is not None else f"HTTP {status}: the answer is not JSON: <html>"
        return Answer(url, status, body, problem)


def client_with(
    *answers: tuple[int, dict[str, Any] | None], **kwargs: Any
) -> tuple[Client, FakeHttp]:
    client = Client(URL, ADMIN, **kwargs)
    fake = FakeHttp(*answers)
    client._http = fake
    return client, fake


async def test_status_is_a_retried_read_without_the_admin_token() -> None:
    creds = Credentials(Secret("tok"), BasicAuth("alice", Secret("pw")))
    retry = Retry(attempts=5)
    client, http = client_with(
        (200, {"attach": "http", "engines": []}), credentials=creds, retry=retry
    )
    status = await client.status(timeout_s=3.0)
    assert status.attach == "http"
    sent = http.sent[0]
    assert (sent["method"], sent["url"], sent["timeout_s"]) == ("GET", f"{URL}/status", 3.0)
    assert sent["retry"] is retry and sent["retry_statuses"] is True
    assert sent["headers"]["Authorization"].startswith("Basic ")  # never "Bearer tok"


async def test_a_status_that_is_not_a_success_is_its_typed_error() -> None:
    client, _ = client_with((401, {"error": "no"}), (200, None))
    with pytest.raises(AuthError):
        await client.status()
    with pytest.raises(InvalidAnswer) as garbage:
        await client.status()
    assert garbage.value.status == 200 and "not JSON" in str(garbage.value)


async def test_a_client_without_a_url_refuses_before_sending() -> None:
    reads_only, http = client_with()
    reads_only.admin_url = None
    with pytest.raises(ConfigError, match="without an admin URL"):
        await reads_only.resume()
    reads_only.url = None
    with pytest.raises(ConfigError, match="without a URL"):
        await reads_only.gate()
    assert http.sent == []


async def test_a_closed_gate_is_an_answer_and_a_rejected_one_an_error() -> None:
    client, http = client_with(
        (412, {"engines": [{"engine": "0", "ok": False}]}),
        (503, {"error": "no engine connected"}),
        (501, {"error": "no has_work", "unsupported": ["drained", 7]}),
        (501, {"unsupported": "drained"}),
        (404, {"error": "no gate"}),
    )
    closed = await client.gate(drained=True, paused=False, weight_version="v2")
    assert not closed.ok and closed.status == 412
    assert http.sent[0]["params"] == {"paused": "false", "weight_version": "v2", "drained": "true"}
    assert (await client.gate()).status == 503
    with pytest.raises(Unsupported) as unsupported:
        await client.gate(drained=True)
    assert unsupported.value.conditions == ("drained", "7")
    with pytest.raises(Unsupported) as odd:
        await client.gate()
    assert odd.value.conditions == ()
    with pytest.raises(NotFound):
        await client.gate()


async def test_a_gate_answer_of_the_wrong_type_names_the_field_and_status() -> None:
    client, _ = client_with((200, {"engines": "all"}))
    with pytest.raises(InvalidAnswer) as bad:
        await client.gate()
    assert str(bad.value).startswith("HTTP 200: the answer.engines must be an array")
    assert bad.value.status == 200 and bad.value.body == {"engines": "all"}


async def test_an_action_without_a_key_is_sent_once_with_the_token() -> None:
    client, http = client_with((200, OK_ENGINES), credentials=Credentials(Secret("tok")))
    result = await client.sleep(2, "wait")
    assert result.success and result.action == "sleep"
    sent = http.sent[0]
    assert (sent["method"], sent["url"]) == ("POST", f"{ADMIN}/admin/sleep")
    assert sent["params"] == {"level": "2", "mode": "wait"} and sent["json"] is None
    assert sent["retry"] is NO_RETRY and sent["retry_statuses"] is False
    assert sent["headers"] == {"Accept": "application/json", "Authorization": "Bearer tok"}


async def test_an_action_with_a_key_may_be_retried() -> None:
    client, http = client_with((200, OK_ENGINES), (200, OK_ENGINES), auto_idempotency_keys=True)
    await client.resume(idempotency_key="mine-1")
    await client.resume()
    given, made = (s["headers"]["Idempotency-Key"] for s in http.sent)
    assert given == "mine-1" and re.fullmatch("exporter-remote-[0-9a-f]{32}", made)
    assert all(s["retry"] is client.retry for s in http.sent)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("Sleep", None),
        ("sleep/../x", None),
        ("a" * 65, None),
        ("sleep", ""),
        ("sleep", "k" * 201),
        ("sleep", "clé"),
        ("sleep", "a\nb"),
    ],
)
async def test_a_bad_action_name_or_key_is_refused_before_sending(
    name: str, key: str | None
) -> None:
    client, http = client_with()
    with pytest.raises(BadRequest):
        await client.action(name, idempotency_key=key)
    assert http.sent == []


async def test_each_failed_action_carries_its_result() -> None:
    failed = {"engines": [{"engine": 1, "ok": False, "reason": "refused"}], "outcome": "failure"}
    client, _ = client_with(
        (502, {**failed, "action": "pause"}),
        (
            501,
            {
                "engines": [{"engine": 0, "ok": False, "reason": "unsupported"}],
                "outcome": "unsupported",
            },
        ),
        (503, {"engines": [], "error": "no engine connected"}),
        (409, {"error": "another admin action is running"}),
    )
    with pytest.raises(PartialFailure) as partial:
        await client.pause()
    assert str(partial.value) == "pause: failure (engine 1: refused)"
    assert partial.value.result.failures[0].engine == "1" and partial.value.status == 502
    with pytest.raises(Unsupported) as unsupported:
        await client.reset_mm_cache()
    assert unsupported.value.result is not None and unsupported.value.result.unsupported
    with pytest.raises(NoEngineConnected) as none:
        await client.resume()
    assert none.value.result is not None and none.value.result.engines == ()
    with pytest.raises(Conflict, match="HTTP 409: another admin action is running"):
        await client.resume()


async def test_each_action_s_parameters() -> None:
    client, http = client_with(*[(200, OK_ENGINES)] * 9)
    await client.reset_prefix_cache(reset_connector=True)
    await client.sleep()
    await client.wake_up(["weights", "kv_cache"])
    await client.wake_up("weights")
    await client.wake_up()
    await client.pause()
    await client.set_weight_version("v7")
    await client.verify_weights()
    await client.pause("keep", clear_cache=False)
    assert [(s["url"].rsplit("/", 1)[1], s["params"]) for s in http.sent] == [
        ("reset_prefix_cache", {"reset_running_requests": "false", "reset_connector": "true"}),
        ("sleep", {"level": "1"}),
        ("wake_up", {"tags": "weights,kv_cache"}),
        ("wake_up", {"tags": "weights"}),
        ("wake_up", {}),
        ("pause", {}),
        ("weight_version", {}),
        ("verify_weights", {}),
        ("pause", {"mode": "keep", "clear_cache": "false"}),
    ]
    assert http.sent[6]["json"] == {"weight_version": "v7"}
    assert http.sent[7]["timeout_s"] == VERIFY_TIMEOUT_S


async def test_wait_asks_the_gate_once_per_check_without_retries() -> None:
    client, http = client_with((200, OK_ENGINES))
    opened = await client.wait({"paused": False}, 5.0, drained=True, interval_s=0.01)
    assert opened.ok
    assert http.sent[0]["retry"] is NO_RETRY
    assert http.sent[0]["params"] == {"paused": "false", "drained": "true"}
    with pytest.raises(BadRequest, match="contradicts"):
        await client.wait({"drained": False}, 5.0, drained=True)
    assert len(http.sent) == 1
