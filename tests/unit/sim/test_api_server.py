"""``SimApiServer`` without serving it: the state it builds from its options, the routes its
app registers, the fault-tolerance and elastic-EP state tests move, and its middleware's
envelopes (vLLM's statuses) over mocked requests."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exporter.sim.api_server import SimApiServer, _apply_story, start_api_server
from exporter.sim.api_wire import _BadQuery, _EngineError, _HttpError
from exporter.sim.options import ApiServerOptions, SimOptions
from exporter.sim.story import StoryState


def paths(sim: SimApiServer) -> set[tuple[str, str]]:
    return {
        (route.method, route.resource.canonical)
        for route in sim.app.router.routes()
        if route.resource is not None
    }


def test_options_are_copied_and_engines_placed_in_the_fleet() -> None:
    given = ApiServerOptions(
        engines=3, story_offset=4, engine_options=[SimOptions(sleeping=True)], failures={1: "x"}
    )
    sim = SimApiServer(given)
    given.engine_options.append(SimOptions())
    given.failures.clear()
    assert len(sim.options.engine_options) == 1 and sim.options.failures == {1: "x"}
    assert [(o.story_offset, o.story_count) for o in sim.engine_options] == [(4, 3), (5, 3), (6, 3)]
    assert [e.dp_rank for e in sim.engines] == [4, 5, 6]
    assert [e.is_sleeping() for e in sim.engines] == [True, False, False], "missing: defaults"
    duplicate = SimApiServer(ApiServerOptions(engines=2, duplicate_checksum_keys=True))
    assert [e.dp_rank for e in duplicate.engines] == [0, 0]


def test_the_app_serves_what_the_options_say() -> None:
    default = paths(SimApiServer())
    assert {("GET", "/version"), ("GET", "/metrics"), ("POST", "/is_scaling_elastic_ep")} <= default
    assert ("POST", "/sleep") in default and ("GET", "/is_paused") in default
    assert not any("fault_tolerance" in path for _, path in default)
    plain = paths(SimApiServer(ApiServerOptions(dev_mode=False)))
    assert {path for _, path in plain} == {"/version", "/metrics", "/is_scaling_elastic_ep"}
    options = ApiServerOptions(
        fault_tolerance=True,
        fault_tolerance_prefix="/v1",
        missing_routes=frozenset({"/weight_info"}),
    )
    custom = paths(SimApiServer(options))
    assert ("GET", "/v1/fault_tolerance/status") in custom
    assert ("GET", "/weight_info") not in custom and ("GET", "/is_sleeping") in custom


def test_fault_statuses_start_healthy_and_follow_the_test() -> None:
    sim = SimApiServer(ApiServerOptions(engines=2, story_offset=2, fault_tolerance=True))
    assert sim.engine_status == {
        2: {"id": 2, "status": "healthy"},
        3: {"id": 3, "status": "healthy"},
    }
    sim.set_fault_status(1, "unhealthy", "RuntimeError")
    assert sim.engine_status[3] == {"id": 3, "status": "unhealthy", "fault_info": "RuntimeError"}
    sim.recovery_failed("req-1", "timed out")
    assert sim.engine_status[2] == {
        "id": 2,
        "status": "healthy",
        "last_ft_request_id": "req-1",
        "ft_error": "timed out",
    }
    assert SimApiServer().engine_status == {}, "no fault tolerance: no statuses"


def test_set_elastic_ep_moves_the_operation_and_keeps_the_faults() -> None:
    sim = SimApiServer()
    sim.elastic_ep.unavailable = True
    sim.set_elastic_ep("preparing", epoch="e1", requested=4)
    assert sim.elastic_ep.status() == {
        "phase": "preparing",
        "epoch": "e1",
        "error": None,
        "requested_data_parallel_size": 4,
    }
    assert sim.elastic_ep.unavailable


def test_the_story_hangs_the_engine_in_its_hung_window() -> None:
    sim = SimApiServer(ApiServerOptions(engines=1))
    story = StoryState(paused=True, sleeping=False, refuse_reset=True, hung=True)
    _apply_story(sim.engines[0], sim.engine_options[0], story, 1.0)
    assert sim.engine_options[0].hang and sim.engines[0].refuse_reset
    _apply_story(sim.engines[0], sim.engine_options[0], StoryState(False, False, False), 2.0)
    assert not sim.engine_options[0].hang


async def through_middleware(sim: SimApiServer, exc: Exception) -> tuple[int, Any, web.Response]:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise exc

    request = make_mocked_request("GET", "/x?y=1", headers={"Authorization": "Bearer k"})
    resp = await sim._middleware(request, handler)
    assert isinstance(resp, web.Response)
    body = json.loads(resp.body) if isinstance(resp.body, bytes) else None
    return resp.status, body, resp


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [
        (web.HTTPNotFound(), 404, {"detail": "Not Found"}),
        (web.HTTPMethodNotAllowed("PUT", ["POST", "GET"]), 405, {"detail": "Method Not Allowed"}),
        (
            _HttpError(409, "busy"),
            409,
            {"error": {"message": "busy", "type": "Conflict", "param": None, "code": 409}},
        ),
    ],
)
async def test_the_middleware_answers_in_vllms_envelopes(
    exc: Exception, status: int, body: dict[str, Any]
) -> None:
    sim = SimApiServer()
    got_status, got_body, resp = await through_middleware(sim, exc)
    assert (got_status, got_body) == (status, body)
    if status == 405:
        assert resp.headers["allow"] == "GET, POST"
    assert sim.requests == [("GET", "/x?y=1", "Bearer k")], "recorded, never checked"


async def test_a_bad_query_is_a_400_validation_envelope() -> None:
    status, body, _ = await through_middleware(
        SimApiServer(), _BadQuery("level", "x", "int_parsing", "bad")
    )
    assert status == 400 and body["error"]["param"] == "query.level"


async def test_the_rust_front_ends_404_has_no_body() -> None:
    status, body, _ = await through_middleware(
        SimApiServer(ApiServerOptions(rust_front_end="0.33.0")), web.HTTPNotFound()
    )
    assert (status, body) == (404, None)


@pytest.mark.parametrize(
    ("rust", "kind", "code"),
    [
        (None, "InternalServerError", 500),
        ("0.32.0", "server_error", "server_error"),
        ("0.33.0", "InternalServerError", 500),
    ],
)
async def test_an_engine_failure_is_a_500_typed_by_front_end(
    rust: str | None, kind: str, code: Any
) -> None:
    sim = SimApiServer(ApiServerOptions(rust_front_end=rust, close_after_500=False))
    status, body, _ = await through_middleware(sim, _EngineError("Call to x method failed: y"))
    assert status == 500
    assert body == {
        "error": {
            "message": "Call to x method failed: y",
            "type": kind,
            "param": None,
            "code": code,
        }
    }


async def test_start_takes_options_or_keywords_not_both() -> None:
    with pytest.raises(TypeError, match="either options or option keywords"):
        await start_api_server(options=ApiServerOptions(), engines=1)
