"""HttpFleetClient against simulated vLLM API servers over real HTTP on 127.0.0.1."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from exporter.base.ports import free_listen_port
from exporter.client.fleet import Outcome, connected_count
from exporter.client.http.client import HttpFleetClient, HttpTarget
from exporter.client.http.replies import DEV_MODE_OFF, NO_SUCCESS_FIELD, interpret
from exporter.config.rules import target_lines
from exporter.control.attach import http_client, parse_targets
from exporter.control.parsing import parse_reset
from exporter.control.verdicts import classify
from exporter.error import ConfigError, MethodNotAllowed
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.sim.options import SimOptions
from tests.harness.apiservers import HOST, StartApi, http_config


async def client_for(
    made: list[HttpFleetClient], targets: list[str], token: str | None = None
) -> HttpFleetClient:
    client = HttpFleetClient(parse_targets(targets), token=token)
    await client.start()
    made.append(client)
    return client


async def test_agreeing_targets(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=2)
    b = await start_api(engines=1)
    client = await client_for(clients, [a.url, f"node-b={b.url}"])
    assert client.engine_labels == ["0", "node-b"]
    assert connected_count(client) == 0  # nothing asked yet
    outcomes = await client.call_utility("is_sleeping", timeout_s=2)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("0", Outcome.OK, False),
        ("node-b", Outcome.OK, False),
    ]
    verdict = aggregate_consensus("is_sleeping", outcomes)
    assert verdict.state is FleetState.CONSISTENT and verdict.value is False
    details = client.engine_details()
    assert [(d.engine, d.connected, d.address) for d in details] == [
        ("0", True, a.url),
        ("node-b", True, b.url),
    ]
    assert connected_count(client) == 2


async def test_disagreeing_targets(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=1)
    b = await start_api(engines=2, engine_options=[SimOptions(sleeping=True)] * 2)
    client = await client_for(clients, [a.url, b.url])
    outcomes = await client.call_utility("is_sleeping", timeout_s=2)
    assert [o.value for o in outcomes] == [False, True]
    verdict = aggregate_consensus("is_sleeping", outcomes)
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.error is not None and verdict.error.values == [False, True]


async def test_target_whose_engines_disagree_is_inconsistent(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=1)
    b = await start_api(
        engines=3, engine_options=[SimOptions(), SimOptions(sleeping=True), SimOptions()]
    )
    client = await client_for(clients, [f"a={a.url}", f"b={b.url}"])
    outcomes = await client.call_utility("is_sleeping", timeout_s=2)
    assert outcomes[0].outcome is Outcome.OK
    bad = outcomes[1]
    assert bad.outcome is Outcome.INCONSISTENT
    assert bad.values == (False, True, False)
    assert bad.error == "Engines returned different is_sleeping results: [False, True, False]"
    assert client.engine_details()[1].connected  # a 500 is an answer
    verdict = aggregate_consensus("is_sleeping", outcomes)
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.error is not None and verdict.error.values == [False, [False, True, False]]


async def test_engine_failure_is_failed_with_vllm_text(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=2, failures={1: "engine exploded"})
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("is_sleeping", timeout_s=2)
    assert o.outcome is Outcome.FAILED
    assert o.error == "Call to is_sleeping method failed: engine exploded"


async def test_engine_dead_generic_500(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=1, engine_dead=True)
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("reset_prefix_cache", timeout_s=2)
    assert o.outcome is Outcome.FAILED
    assert o.error == "The server had an error while processing your request."


async def test_dev_mode_off(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=1, dev_mode=False)
    client = await client_for(clients, [a.url])
    for method in ("is_sleeping", "reset_prefix_cache"):
        [o] = await client.call_utility(method, timeout_s=2)
        assert o.outcome is Outcome.FAILED
        assert o.error == DEV_MODE_OFF
        assert "VLLM_SERVER_DEV_MODE=1" in o.error


async def test_slow_target_times_out_without_delaying_others(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    fast = await start_api(engines=1)
    slow = await start_api(engines=1, engine_options=[SimOptions(hang=True)])
    also_fast = await start_api(engines=1, engine_options=[SimOptions(reply_delay_s=0.05)])
    client = await client_for(clients, [fast.url, f"slow={slow.url}", also_fast.url])
    started = time.perf_counter()
    outcomes = await client.call_utility("is_sleeping", timeout_s=0.5)
    elapsed = time.perf_counter() - started
    assert 0.45 <= elapsed < 1.5
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.TIMEOUT, Outcome.OK]
    assert outcomes[1].error == "no reply within 0.5s"
    assert [d.connected for d in client.engine_details()] == [True, False, True]
    # The shared deadline also covers a reset fan-out.
    started = time.perf_counter()
    outcomes = await client.call_utility("reset_prefix_cache", (True,), timeout_s=0.3)
    assert time.perf_counter() - started < 1.2
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.TIMEOUT, Outcome.OK]


async def test_unreachable_target_is_disconnected(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=1)
    dead = f"http://{HOST}:{free_listen_port()}"
    client = await client_for(clients, [a.url, f"gone={dead}"])
    outcomes = await client.call_utility("is_sleeping", timeout_s=2)
    assert outcomes[0].outcome is Outcome.OK
    assert outcomes[1].outcome is Outcome.DISCONNECTED
    assert outcomes[1].error is not None and dead in outcomes[1].error
    assert connected_count(client) == 1


async def test_is_scheduler_paused_asks_is_paused(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=1)
    client = await client_for(clients, [a.url])
    assert "is_scheduler_paused" in client.capabilities.methods
    [o] = await client.call_utility("is_scheduler_paused", timeout_s=2)
    assert (o.outcome, o.value) == (Outcome.OK, False)
    assert [(m, p) for m, p, _ in a.sim.requests] == [("GET", "/is_paused")]


async def test_methods_outside_the_allow_list_are_refused(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=1)
    client = HttpFleetClient(
        parse_targets([a.url]), allowed_methods=frozenset({"is_sleeping", "reset_prefix_cache"})
    )
    await client.start()
    clients.append(client)
    with pytest.raises(MethodNotAllowed):
        await client.call_utility("sleep", (1,), timeout_s=1)
    assert "sleep" not in client.capabilities.methods
    assert "is_sleeping" in client.capabilities.methods
    with pytest.raises(MethodNotAllowed):
        await client.call_utility("reset_prefix_cache", (True, False, True), timeout_s=1)
    assert a.sim.requests == []


async def test_reset_arguments_become_query_flags(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=2)
    client = await client_for(clients, [a.url])
    for args in ((), (True,), (False, True), (True, True)):
        [o] = await client.call_utility("reset_prefix_cache", args, timeout_s=2)
        assert o.outcome is Outcome.OK and o.value is True
    # The one-off GET /version (for vllm_dp_engine_info) is not part of the resets.
    paths = [path for _, path, _ in a.sim.requests if path != "/version"]
    assert paths == [
        "/reset_prefix_cache?reset_running_requests=false&reset_external=false",
        "/reset_prefix_cache?reset_running_requests=true&reset_external=false",
        "/reset_prefix_cache?reset_running_requests=false&reset_external=true",
        "/reset_prefix_cache?reset_running_requests=true&reset_external=true",
    ]


async def test_reset_refused_and_old_vllm(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    ok = await start_api(engines=1)
    refusing = await start_api(
        engines=2, engine_options=[SimOptions(), SimOptions(refuse_reset=True)]
    )
    old = await start_api(engines=1, old_reset_response=True)
    client = await client_for(clients, [f"ok={ok.url}", f"ref={refusing.url}", f"old={old.url}"])
    outcomes = await client.call_utility("reset_prefix_cache", timeout_s=2)
    assert [(o.outcome, o.value) for o in outcomes] == [
        (Outcome.OK, True),
        (Outcome.OK, False),
        (Outcome.FAILED, None),
    ]
    assert outcomes[2].error == NO_SUCCESS_FIELD
    verdict = classify(parse_reset({}, b""), outcomes)
    assert verdict.outcome == "partial_failure"
    assert [(f.engine, f.reason) for f in verdict.failures] == [
        ("ref", "refused"),
        ("old", "failed"),
    ]


async def test_retry_once_on_reset_pooled_connection(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    """A pooled connection the server dropped: the POST is retried once on a fresh one."""
    a = await start_api(engines=1, reset_reused_connections=True)
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("is_sleeping", timeout_s=2)
    assert o.outcome is Outcome.OK
    [o] = await client.call_utility("reset_prefix_cache", timeout_s=2)
    assert o.outcome is Outcome.OK and o.value is True
    assert client.retries == 1
    # The reset's first try, on the pooled connection (side reads, such as the fault-tolerance
    # status under its other route, may meet the same fate on their own connections).
    assert a.sim.aborted_paths.count("/reset_prefix_cache") == 1
    assert [p for _, p, _ in a.sim.requests].count(
        "/reset_prefix_cache?reset_running_requests=false&reset_external=false"
    ) == 2


async def test_request_after_a_500_succeeds(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    """vLLM closes the connection after every 500; the next request must not fail."""
    a = await start_api(
        engines=2, engine_options=[SimOptions(), SimOptions(sleeping=True)], close_after_500=True
    )
    client = await client_for(clients, [a.url])
    for _ in range(3):
        [o] = await client.call_utility("is_sleeping", timeout_s=2)
        assert o.outcome is Outcome.INCONSISTENT
        [o] = await client.call_utility("reset_prefix_cache", timeout_s=2)
        assert o.outcome is Outcome.OK and o.value is True


async def test_token_reaches_server_and_is_never_logged(
    start_api: StartApi,
    clients: list[HttpFleetClient],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    token = "s3cr3t-token-value"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    a = await start_api(engines=2, engine_options=[SimOptions(), SimOptions(sleeping=True)])
    b = await start_api(engines=1, reset_reused_connections=True)
    gone = f"http://{HOST}:{free_listen_port()}"
    config = http_config([a.url, b.url, gone], http_token_file=str(token_file))
    caplog.set_level(logging.DEBUG)
    client = http_client(config)
    await client.start()
    clients.append(client)
    texts = [repr(client), repr(config)]
    for method in ("is_sleeping", "reset_prefix_cache", "is_scheduler_paused"):
        for o in await client.call_utility(method, timeout_s=2):
            texts.append(repr(o))
    assert {auth for _, _, auth in a.sim.requests} == {f"Bearer {token}"}
    assert {auth for _, _, auth in b.sim.requests} == {f"Bearer {token}"}
    assert client.retries == 1
    for text in [*texts, caplog.text]:
        assert token not in text


def test_targets_file_and_labels(tmp_path: Path) -> None:
    f = tmp_path / "targets"
    f.write_text(
        "# one per line\n"
        "\n"
        "http://10.0.0.1:8000\n"
        "  rank-1=http://10.0.0.2:8000/  # trailing comment\n"
        "https://vllm.example:443\n"
    )
    assert target_lines(f.read_text()) == (
        "http://10.0.0.1:8000",
        "rank-1=http://10.0.0.2:8000/",
        "https://vllm.example:443",
    )
    config = http_config(["first=http://10.0.0.9:8000"], http_targets_file=str(f))
    client = http_client(config)
    assert client.targets == [
        HttpTarget("first", "http://10.0.0.9:8000"),
        HttpTarget("1", "http://10.0.0.1:8000"),
        HttpTarget("rank-1", "http://10.0.0.2:8000"),
        HttpTarget("3", "https://vllm.example:443"),
    ]


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["a=http://x:1", "a=http://y:1"], "used twice"),
        (["ftp://x:1"], "expected http"),
        (["http://user:pw@x:1"], "credentials"),
        (["bad name=http://x:1"], "target name"),
        (["http://x:1/?a=b"], "no query"),
    ],
)
def test_bad_targets(targets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_targets(targets)


def test_empty_token_file(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        http_client(http_config(["http://x:1"], http_token_file=str(f)))


@pytest.mark.parametrize(
    ("status", "body", "outcome", "error"),
    [
        (200, b'{"is_sleeping":true}', Outcome.OK, None),
        (200, b"", Outcome.FAILED, "empty response body"),
        (200, b"<html>", Outcome.FAILED, "response is not JSON: <html>"),
        (502, b"bad gateway", Outcome.FAILED, "HTTP 502: bad gateway"),
        (401, b'{"error":"Unauthorized"}', Outcome.FAILED, "HTTP 401: Unauthorized"),
        (404, b'{"detail":"Not Found"}', Outcome.FAILED, DEV_MODE_OFF),
        (
            500,
            b'{"error":{"message":"Engines returned different is_sleeping results: [True, '
            b'False]","type":"InternalServerError","param":null,"code":500}}',
            Outcome.INCONSISTENT,
            "Engines returned different is_sleeping results: [True, False]",
        ),
        (
            500,
            b'{"error":{"message":"Engines returned different is_sleeping results: [oops',
            Outcome.FAILED,
            "HTTP 500: ",
        ),
    ],
)
def test_interpret_is_sleeping(
    status: int, body: bytes, outcome: Outcome, error: str | None
) -> None:
    o = interpret("t", "is_sleeping", status, body, 0.01)
    assert o.outcome is outcome
    if error is None:
        assert o.error is None
    else:
        assert o.error is not None and o.error.startswith(error)
    if outcome is Outcome.INCONSISTENT:
        assert o.values == (True, False)


def test_interpret_reset() -> None:
    assert interpret("t", "reset_prefix_cache", 200, b'{"success":false}', None).value is False
    o = interpret("t", "reset_prefix_cache", 200, b"null", None)
    assert o.outcome is Outcome.FAILED and o.error == NO_SUCCESS_FIELD


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
async def test_the_rust_front_ends_consensus_error_is_inconsistent_not_failed(
    start_api: StartApi, clients: list[HttpFleetClient], release: str
) -> None:
    """vLLM's Rust front end answers a disagreement with its own 500: read as the
    inconsistency it is, with every engine's value, on each consensus route."""
    a = await start_api(
        engines=2,
        rust_front_end=release,
        engine_options=[SimOptions(), SimOptions(sleeping=True, paused=True)],
    )
    client = await client_for(clients, [a.url])
    [sleeping] = await client.call_utility("is_sleeping", timeout_s=2)
    assert sleeping.outcome is Outcome.INCONSISTENT, sleeping
    assert sleeping.values == (False, True)
    assert sleeping.error == (
        "failed to call is_sleeping: utility call `is_sleeping` returned inconsistent results "
        "across engines: [false, true]"
    )
    [paused] = await client.call_utility("is_scheduler_paused", timeout_s=2)
    assert paused.outcome is Outcome.INCONSISTENT and paused.values == (False, True), paused
    verdict = aggregate_consensus("is_sleeping", [sleeping])
    assert verdict.state is FleetState.INCONSISTENT
    assert client.engine_details()[0].connected  # a 500 is an answer
