"""vLLM 0.34's checkpoint routes on the simulated API server, over its engines' own
checkpoint state (handlers called with mocked requests, no socket): where vLLM mounts them,
the status each state is answered with, prepare and restore as 0.34's router rules them, and
vLLM's non-strict aggregate over several engines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exporter.client.http.checkpoint import state_body
from exporter.sim.api_checkpoint import aggregate, mounted
from exporter.sim.api_server import SimApiServer
from exporter.sim.api_wire import _BadQuery, _EngineError
from exporter.sim.options import ApiServerOptions, SimOptions

PATHS = {"/checkpoint/status", "/checkpoint/prepare", "/checkpoint/restore"}
PATHS_STATUS = "/checkpoint/status"


def server(engines: int = 1, **options: Any) -> SimApiServer:
    return SimApiServer(ApiServerOptions(engines=engines, vllm_version="0.34.0", **options))


def served(sim: SimApiServer) -> set[str]:
    return {r.resource.canonical for r in sim.app.router.routes() if r.resource is not None}


def answer(resp: web.StreamResponse) -> tuple[int, Any]:
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    return resp.status, json.loads(resp.body)


async def status(sim: SimApiServer) -> tuple[int, Any]:
    return answer(await sim.checkpoint_routes.status(make_mocked_request("GET", PATHS_STATUS)))


async def prepare(sim: SimApiServer, query: str = "") -> tuple[int, Any]:
    request = make_mocked_request("POST", "/checkpoint/prepare" + query)
    return answer(await sim.checkpoint_routes.prepare(request))


async def restore(sim: SimApiServer) -> tuple[int, Any]:
    request = make_mocked_request("POST", "/checkpoint/restore")
    return answer(await sim.checkpoint_routes.restore(request))


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([["running", None]] * 2, ("running", None)),
        ([["prepared", None], ["prepared", None]], ("prepared", None)),
        ([["prepared", None], ["failed", "boom"], ["failed", "other"]], ("failed", "boom")),
        ([["running", None], ["preparing", None], ["restoring", None]], ("preparing", None)),
        ([["prepared", None], ["running", None]], ("restoring", None)),
        ([["restoring", None], ["running", None]], ("restoring", None)),
    ],
)
def test_vllms_aggregate_is_not_strict(
    answers: list[list[Any]], expected: tuple[str, str | None]
) -> None:
    assert aggregate(answers) == expected


def test_mounted_from_0_34_with_sleep_mode_whatever_the_dev_mode() -> None:
    assert mounted("0.34.0", None, True) and mounted("0.35.0rc1", None, True)
    assert not mounted("0.33.0", None, True) and not mounted("0.34.0", None, False)
    assert not mounted("0.34.0", "0.33.0", True)  # the Rust binary answers: its release
    assert served(server()) >= PATHS and served(server(dev_mode=False)) >= PATHS
    assert not PATHS & served(SimApiServer(ApiServerOptions(vllm_version="0.33.0")))
    no_sleep = server(2, engine_options=[SimOptions(), SimOptions(enable_sleep_mode=False)])
    assert not PATHS & served(no_sleep)
    missing = server(missing_routes=frozenset({"/checkpoint/restore"}))
    assert PATHS & served(missing) == PATHS - {"/checkpoint/restore"}


def test_the_engines_behind_a_server_are_of_its_release() -> None:
    sim = server(2, engine_options=[SimOptions(vllm_version="0.33.0")])
    assert [o.vllm_version for o in sim.engine_options] == ["0.34.0"] * 2
    assert all(e.checkpoint is not None for e in sim.engines)
    assert all(e.checkpoint is None for e in SimApiServer().engines)


async def test_a_cycle_answers_each_state_with_its_status() -> None:
    sim = server(2)
    assert await status(sim) == (503, {"state": "running"})  # no "error": exclude_none
    assert await restore(sim) == (200, {"state": "running"})  # nothing to restore: a 200
    code, body = await prepare(sim, "?mode=abort")
    assert code == 200 and body["state"] in ("preparing", "prepared")
    assert [e.pause_clear_cache for e in sim.engines] == [False, False]  # caches kept
    assert await status(sim) == (200, {"state": "prepared"})
    assert await prepare(sim) == (200, {"state": "prepared"})  # a repeat: a no-op
    assert await restore(sim) == (200, {"state": "running"})
    assert not any(e.paused for e in sim.engines)
    assert await status(sim) == (503, {"state": "running"})


async def test_every_answer_reads_as_http_modes_client_reads_it() -> None:
    sim = server()
    await prepare(sim)
    resp = await sim.checkpoint_routes.status(make_mocked_request("GET", PATHS_STATUS))
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    assert state_body(resp.body) == ("prepared", None)
    assert resp.content_type == "application/json"


async def test_a_refusal_is_a_400_with_the_engines_text_and_nothing_changes() -> None:
    sim = server(2)
    sim.engines[0].sleeping_tags = {"weights"}
    code, body = await prepare(sim)
    assert code == 400 and body["state"] == "running"
    assert body["error"] == "Preparing for a checkpoint requires an awake engine"
    first = sim.engines[0].checkpoint
    assert first is not None and first.state == "running"
    # vLLM answers the first engine's refusal; the others ran the prepare (a DP quirk).
    second = sim.engines[1].checkpoint
    assert second is not None and second.state != "running"


async def test_a_failed_prepare_is_500_with_its_error_and_cannot_restore() -> None:
    sim = server(3, engine_options=[SimOptions(), SimOptions(checkpoint_fault="CUDA error")])
    await prepare(sim)
    assert await status(sim) == (500, {"state": "failed", "error": "CUDA error"})
    assert await prepare(sim) == (400, {"state": "failed", "error": "CUDA error"})
    assert await restore(sim) == (400, {"state": "failed", "error": "CUDA error"})


async def test_restore_from_preparing_is_a_400() -> None:
    sim = server(engine_options=[SimOptions(drain_s=30.0)])  # a wait drains for 30 s
    assert (await prepare(sim, "?mode=wait"))[1] == {"state": "preparing"}
    assert await restore(sim) == (400, {"state": "preparing"})


async def test_a_bad_mode_is_vllms_validation_error_and_an_engine_failure_its_500() -> None:
    with pytest.raises(_BadQuery):
        await prepare(server(), "?mode=later")
    sim = server(2, failures={1: "engine gone"})
    with pytest.raises(_EngineError, match="engine gone"):
        await status(sim)


async def test_a_hostile_answer_is_served_instead() -> None:
    sim = server()
    sim.checkpoint_routes.answers["/checkpoint/status"] = (200, b"not json")
    resp = await sim.checkpoint_routes.status(make_mocked_request("GET", PATHS_STATUS))
    assert isinstance(resp, web.Response) and (resp.status, resp.body) == (200, b"not json")
    assert (await prepare(sim))[0] == 200  # only the path given
