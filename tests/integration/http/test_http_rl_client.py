"""HttpFleetClient's RL and cache methods: the pure reply mapping of every route, and the client
against simulated vLLM API servers over real HTTP on 127.0.0.1 (protocol doc F.4)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.client.fleet import DEFAULT_ALLOWED_METHODS, Outcome
from exporter.client.http.client import HttpFleetClient
from exporter.client.http.replies import (
    DEV_MODE_OFF,
    UNSUPPORTED_HINT,
    interpret,
    rank_prefix,
    split_checksums,
)
from exporter.client.http.routes import Route, route
from exporter.control.attach import parse_targets
from exporter.error import MethodNotAllowed
from exporter.sim.options import SimOptions
from exporter.sim.state import PARAMETER_NAMES
from tests.harness.apiservers import StartApi

ALL = frozenset(DEFAULT_ALLOWED_METHODS)


def envelope(message: str, code: int = 500) -> bytes:
    kind = "InternalServerError" if code == 500 else "Bad Request"
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()


# -- pure: one reply → one outcome, for every route ------------------------------------------

OK_CASES: list[tuple[str, bytes, Any]] = [
    ("is_scheduler_paused", b'{"is_paused":true}', True),
    ("is_scheduler_paused", b'{"is_paused":false}', False),
    ("get_weight_version", b'{"weight_version":"step-3"}', "step-3"),
    ("get_weight_version", b'{"weight_version":null}', None),
    ("sleep", b'{"status":"sleeping","level":1}', None),
    ("wake_up", b'{"status":"awake","tags":null}', True),
    ("wake_up", b'{"status":"sleeping","tags":["weights"]}', False),
    ("wake_up", b"", None),  # an older vLLM answered nothing
    ("pause_scheduler", b'{"status":"paused"}', None),
    ("resume_scheduler", b'{"status":"resumed"}', None),
    ("set_weight_version", b'{"success":true,"new_version":"v"}', None),
    ("reset_mm_cache", b"", None),
    ("reset_encoder_cache", b"", None),
    (
        "compute_weight_checksums",
        b'{"checksums":{"dp0:pp0:pcp0:tp0:ep0:a":"1","dp0:pp0:pcp0:tp1:ep0:a":"2",'
        b'"dp1:pp0:pcp0:tp0:ep0:a":"1"}}',
        [
            {"dp0:pp0:pcp0:tp0:ep0:a": "1"},
            {"dp0:pp0:pcp0:tp1:ep0:a": "2"},
            {"dp1:pp0:pcp0:tp0:ep0:a": "1"},
        ],
    ),
]


@pytest.mark.parametrize(("method", "body", "value"), OK_CASES)
def test_interpret_ok(method: str, body: bytes, value: Any) -> None:
    o = interpret("e", method, 200, body, 0.01)
    assert (o.outcome, o.value, o.error, o.duration_s) == (Outcome.OK, value, None, 0.01)


@pytest.mark.parametrize("method", sorted(ALL - {"is_sleeping", "reset_prefix_cache"}))
def test_interpret_404_is_unsupported(method: str) -> None:
    o = interpret("e", method, 404, b'{"detail":"Not Found"}', 0.01)
    assert o.outcome is Outcome.FAILED and o.error is not None
    assert o.error.startswith(UNSUPPORTED_HINT) and method in o.error


def test_interpret_404_on_the_oldest_dev_routes_is_dev_mode_off() -> None:
    for method in ("is_sleeping", "reset_prefix_cache"):
        assert interpret("e", method, 404, b"", None).error == DEV_MODE_OFF


def test_interpret_inconsistent_targets() -> None:
    o = interpret(
        "e",
        "get_weight_version",
        500,
        envelope("Engines returned different get_weight_version results: ['a', None]"),
        None,
    )
    assert o.outcome is Outcome.INCONSISTENT and o.values == ("a", None)
    message = (
        "Failed to fetch pause status: "
        "Engines returned different is_scheduler_paused results: [False, True]"
    )
    o = interpret("e", "is_scheduler_paused", 500, json.dumps({"error": message}).encode(), None)
    assert o.outcome is Outcome.INCONSISTENT and o.values == (False, True) and o.error == message
    # Another method's disagreement is not this method's.
    o = interpret(
        "e",
        "get_weight_version",
        500,
        envelope("Engines returned different is_sleeping results: [False, True]"),
        None,
    )
    assert o.outcome is Outcome.FAILED


FAILED_CASES: list[tuple[str, int, bytes, str]] = [
    (
        "pause_scheduler",
        500,
        b'{"error":"Failed to pause generation: Call to pause_scheduler method failed: boom"}',
        "Failed to pause generation: Call to pause_scheduler method failed: boom",
    ),
    (
        "resume_scheduler",
        500,
        b'{"error":"Failed to resume generation: x"}',
        "Failed to resume generation: x",
    ),
    (
        "pause_scheduler",
        400,
        b'{"error":"Invalid pause mode: x"}',
        "HTTP 400: Invalid pause mode: x",
    ),
    (
        "get_weight_version",
        500,
        envelope(
            "Call to get_weight_version method failed: "
            "'EngineCoreProc' object has no attribute 'get_weight_version'"
        ),
        "Call to get_weight_version method failed: "
        "'EngineCoreProc' object has no attribute 'get_weight_version'",
    ),
    (
        "compute_weight_checksums",
        500,
        json.dumps(
            {
                "error": {
                    "message": "Duplicate weight checksum keys: ['dp0:pp0:pcp0:tp0:ep0:a']",
                    "type": "Internal Server Error",
                    "param": None,
                    "code": 500,
                }
            }
        ).encode(),
        "Duplicate weight checksum keys: ['dp0:pp0:pcp0:tp0:ep0:a']",
    ),
    ("compute_weight_checksums", 200, b'{"checksums":[1]}', "checksums are not a map of strings"),
    ("compute_weight_checksums", 200, b'{"match":true}', "response has no 'checksums'"),
    ("get_weight_version", 200, b"{}", "response has no 'weight_version'"),
    ("is_scheduler_paused", 200, b"", "empty response body"),
    ("is_scheduler_paused", 200, b"<html>", "response is not JSON"),
    ("set_weight_version", 400, envelope("1 validation error", 400), "HTTP 400: 1 validation"),
    ("sleep", 405, b'{"detail":"Method Not Allowed"}', "HTTP 405: Method Not Allowed"),
]


@pytest.mark.parametrize(("method", "status", "body", "error"), FAILED_CASES)
def test_interpret_failures(method: str, status: int, body: bytes, error: str) -> None:
    o = interpret("e", method, status, body, None)
    assert o.outcome is Outcome.FAILED and o.error is not None
    assert o.error.startswith(error), o.error


def test_rank_prefix_and_split() -> None:
    assert rank_prefix("dp1:pp0:pcp0:tp3:ep0:model.w") == "dp1:pp0:pcp0:tp3:ep0:"
    assert rank_prefix("model.w") == ""
    assert split_checksums({}) == []
    assert split_checksums({"a": "1", "dp0:tp0:b": "2", "c": "3"}) == [
        {"a": "1", "c": "3"},
        {"dp0:tp0:b": "2"},
    ]


# -- pure: one utility call → one request ------------------------------------------------------


def test_routes() -> None:
    assert route("is_sleeping") == Route("GET", "/is_sleeping")
    assert route("is_scheduler_paused") == Route("GET", "/is_paused")
    assert route("get_weight_version") == Route("GET", "/weight_info")
    assert route("reset_mm_cache") == Route("POST", "/reset_mm_cache")
    assert route("reset_encoder_cache") == Route("POST", "/reset_encoder_cache")
    assert route("resume_scheduler") == Route("POST", "/resume")
    assert route("sleep") == Route("POST", "/sleep", [("level", "1")])
    assert route("sleep", (2, "wait")) == Route(
        "POST", "/sleep", [("level", "2"), ("mode", "wait")]
    )
    assert route("wake_up") == route("wake_up", (None,)) == Route("POST", "/wake_up")
    assert route("wake_up", (["weights", "kv_cache"],)) == Route(
        "POST", "/wake_up", [("tags", "weights"), ("tags", "kv_cache")]
    )
    assert route("pause_scheduler") == Route("POST", "/pause", [("mode", "abort")])
    assert route("pause_scheduler", ("keep", False)) == Route(
        "POST", "/pause", [("mode", "keep"), ("clear_cache", "false")]
    )
    assert route("set_weight_version", ("v1",)) == Route(
        "POST", "/update_weight_version", body={"new_version": "v1"}
    )
    assert route("compute_weight_checksums") == Route(
        "POST", "/weight_checker", body={"action": "checksum"}
    )
    assert route("reset_prefix_cache", (True,)) == Route(
        "POST",
        "/reset_prefix_cache",
        [("reset_running_requests", "true"), ("reset_external", "false")],
    )


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("is_scheduler_paused", (1,)),
        ("get_weight_version", ("x",)),
        ("reset_mm_cache", (True,)),
        ("resume_scheduler", (1,)),
        ("sleep", ("1",)),
        ("sleep", (True,)),
        ("sleep", (1, "abort", 3)),
        ("sleep", (1, 2)),
        ("wake_up", ("weights",)),
        ("wake_up", ([1],)),
        ("pause_scheduler", ("abort", "yes")),
        ("set_weight_version", ()),
        ("set_weight_version", (3,)),
        ("compute_weight_checksums", (1,)),
        ("collective_rpc", ()),
    ],
)
def test_route_refuses_what_it_cannot_carry(method: str, args: tuple[Any, ...]) -> None:
    with pytest.raises(MethodNotAllowed):
        route(method, args)


# -- the client over real HTTP -------------------------------------------------------------


async def client_for(made: list[HttpFleetClient], targets: list[str]) -> HttpFleetClient:
    client = HttpFleetClient(parse_targets(targets), allowed_methods=ALL)
    await client.start()
    made.append(client)
    return client


def requests_of(api: Any) -> list[tuple[str, str]]:
    """The requests a simulated API server received, without the client's ``GET /version``."""
    return [(m, p) for m, p, _ in api.sim.requests if p != "/version"]


async def test_supports_every_routed_method(clients: list[HttpFleetClient]) -> None:
    client = await client_for(clients, ["http://127.0.0.1:1"])
    assert all(m in client.capabilities.methods for m in ALL - {"is_inference_ready"})
    assert "collective_rpc" not in client.capabilities.methods
    assert "is_inference_ready" not in client.capabilities.methods  # vLLM has no route for it
    narrow = HttpFleetClient(
        parse_targets(["http://127.0.0.1:1"]), allowed_methods=frozenset({"is_sleeping"})
    )
    assert "get_weight_version" not in narrow.capabilities.methods


async def test_weight_version_cycle(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=2)
    b = await start_api(engines=1)
    client = await client_for(clients, [f"a={a.url}", f"b={b.url}"])
    outcomes = await client.call_utility("get_weight_version", timeout_s=2)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("a", Outcome.OK, None),
        ("b", Outcome.OK, None),
    ]
    outcomes = await client.call_utility("set_weight_version", ("step-9",), timeout_s=2)
    assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, None)] * 2
    assert [e.weight_version for e in a.sim.engines + b.sim.engines] == ["step-9"] * 3
    assert requests_of(a)[-1] == ("POST", "/update_weight_version")
    outcomes = await client.call_utility("get_weight_version", timeout_s=2)
    assert [o.value for o in outcomes] == ["step-9", "step-9"]


async def test_engines_selects_targets(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=1)
    b = await start_api(engines=1)
    client = await client_for(clients, [f"a={a.url}", f"b={b.url}"])
    outcomes = await client.call_utility(
        "set_weight_version", ("only-b",), timeout_s=2, engines=["b", "nobody"]
    )
    assert [(o.engine, o.outcome) for o in outcomes] == [("b", Outcome.OK)]
    assert a.sim.requests == [] and b.sim.engines[0].weight_version == "only-b"
    assert await client.call_utility("is_sleeping", timeout_s=2, engines=[]) == []
    outcomes = await client.call_utility("get_weight_version", timeout_s=2, engines={"a", "b"})
    assert [(o.engine, o.value) for o in outcomes] == [("a", None), ("b", "only-b")]


async def test_inconsistent_version_and_pause_inside_a_target(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(
        engines=2,
        engine_options=[
            SimOptions(weight_version="v1"),
            SimOptions(weight_version="v2", paused=True),
        ],
    )
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("get_weight_version", timeout_s=2)
    assert o.outcome is Outcome.INCONSISTENT and o.values == ("v1", "v2")
    [o] = await client.call_utility("is_scheduler_paused", timeout_s=2)
    assert o.outcome is Outcome.INCONSISTENT and o.values == (False, True)
    assert client.engine_details()[0].connected


async def test_sleep_wake_pause_resume(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=2)
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("sleep", (2, "wait"), timeout_s=2)
    assert (o.outcome, o.value) == (Outcome.OK, None)
    assert all(e.is_sleeping() and e.sleeping_tags for e in a.sim.engines)
    [o] = await client.call_utility("wake_up", (["weights"],), timeout_s=2)
    assert (o.outcome, o.value) == (Outcome.OK, False)  # kv_cache still asleep
    [o] = await client.call_utility("wake_up", (), timeout_s=2)
    assert (o.outcome, o.value) == (Outcome.OK, True)
    [o] = await client.call_utility("pause_scheduler", ("keep", False), timeout_s=2)
    assert o.ok and all(e.paused for e in a.sim.engines)
    [o] = await client.call_utility("is_scheduler_paused", timeout_s=2)
    assert o.value is True
    [o] = await client.call_utility("resume_scheduler", timeout_s=2)
    assert o.ok and not any(e.paused for e in a.sim.engines)
    paths = [p for _, p in requests_of(a)]
    assert paths == [
        "/sleep?level=2&mode=wait",
        "/wake_up?tags=weights",
        "/wake_up",
        "/pause?mode=keep&clear_cache=false",
        "/is_paused",
        "/resume",
    ]
    [o] = await client.call_utility("sleep", (7,), timeout_s=2)  # the route accepts any int
    assert o.ok


async def test_cache_resets(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=2)
    client = await client_for(clients, [a.url])
    for method in ("reset_mm_cache", "reset_encoder_cache"):
        [o] = await client.call_utility(method, timeout_s=2)
        assert (o.outcome, o.value) == (Outcome.OK, None)
    assert requests_of(a) == [("POST", "/reset_mm_cache"), ("POST", "/reset_encoder_cache")]


async def test_compute_weight_checksums(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    name = PARAMETER_NAMES[1]
    a = await start_api(engines=2, engine_options=[SimOptions(tp_size=2)] * 2)
    b = await start_api(
        engines=2,
        story_offset=2,
        engine_options=[SimOptions(tp_size=2), SimOptions(tp_size=2, corrupt_param=name)],
    )
    client = await client_for(clients, [a.url, b.url])
    outcomes = await client.call_utility("compute_weight_checksums", timeout_s=5)
    assert all(o.ok for o in outcomes)
    workers = [w for o in outcomes for w in o.value]
    prefixes = [rank_prefix(next(iter(w))) for w in workers]
    assert prefixes == [f"dp{d}:pp0:pcp0:tp{t}:ep0:" for d in range(4) for t in range(2)]
    by_position: dict[str, set[str]] = {}
    for w in workers:
        for key, digest in w.items():
            by_position.setdefault(key.split(":", 1)[1], set()).add(digest)
    disagreeing = sorted(k for k, digests in by_position.items() if len(digests) > 1)
    assert disagreeing == [f"pp0:pcp0:tp0:ep0:{name}", f"pp0:pcp0:tp1:ep0:{name}"]
    assert requests_of(a) == [("POST", "/weight_checker")]
    dup = await start_api(engines=2, duplicate_checksum_keys=True)
    dup_client = await client_for(clients, [dup.url])
    [o] = await dup_client.call_utility("compute_weight_checksums", timeout_s=5)
    assert o.outcome is Outcome.FAILED and o.error is not None
    assert o.error.startswith("Duplicate weight checksum keys: ")


async def test_missing_routes_and_methods_are_unsupported(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    old = await start_api(
        engines=1, missing_routes=frozenset({"/weight_info", "/weight_checker", "/is_paused"})
    )
    lacking = await start_api(
        engines=1, engine_options=[SimOptions(missing_methods=frozenset({"get_weight_version"}))]
    )
    client = await client_for(clients, [f"old={old.url}", f"lacking={lacking.url}"])
    for method in ("get_weight_version", "compute_weight_checksums", "is_scheduler_paused"):
        o = (await client.call_utility(method, timeout_s=2))[0]
        assert o.outcome is Outcome.FAILED and o.error is not None
        assert UNSUPPORTED_HINT in o.error
    o = (await client.call_utility("get_weight_version", timeout_s=2))[1]
    assert o.outcome is Outcome.FAILED and o.error is not None
    assert "object has no attribute 'get_weight_version'" in o.error
    off = await start_api(engines=1, dev_mode=False)
    off_client = await client_for(clients, [off.url])
    [o] = await off_client.call_utility("pause_scheduler", timeout_s=2)
    assert o.error is not None and o.error.startswith(UNSUPPORTED_HINT)
    [o] = await off_client.call_utility("is_sleeping", timeout_s=2)
    assert o.error == DEV_MODE_OFF


async def test_accepted_but_ignored_shows_on_read_back(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    a = await start_api(engines=1)
    b = await start_api(engines=1, engine_options=[SimOptions(ignore_state_changes=True)])
    client = await client_for(clients, [a.url, b.url])
    outcomes = await client.call_utility("set_weight_version", ("v5",), timeout_s=2)
    assert all(o.ok for o in outcomes)
    outcomes = await client.call_utility("get_weight_version", timeout_s=2)
    assert [o.value for o in outcomes] == ["v5", None]
    outcomes = await client.call_utility("sleep", (1,), timeout_s=2)
    assert all(o.ok for o in outcomes)
    outcomes = await client.call_utility("is_sleeping", timeout_s=2)
    assert [o.value for o in outcomes] == [True, False]


async def test_slow_checksum_times_out(start_api: StartApi, clients: list[HttpFleetClient]) -> None:
    a = await start_api(engines=1, engine_options=[SimOptions(reply_delay_s=1.0)])
    client = await client_for(clients, [a.url])
    [o] = await client.call_utility("compute_weight_checksums", timeout_s=0.2)
    assert o.outcome is Outcome.TIMEOUT
