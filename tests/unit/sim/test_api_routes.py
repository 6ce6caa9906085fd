"""The simulated API server's route handlers over in-process engine state machines, called
directly with mocked requests (no server): AsyncLLM's aggregation (consensus, AND, flattening),
vLLM's failure texts, and the RL routes that catch their errors."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exporter.sim.api_elastic import SimElasticEp
from exporter.sim.api_routes import ENGINE_DEAD_MESSAGE, ApiRoutes
from exporter.sim.api_wire import _BadQuery, _EngineError, _HttpError, _RustFrontEndError
from exporter.sim.options import ApiServerOptions, SimOptions
from tests.unit.sim.test_api_wire import with_body


def routes(*engines: SimOptions, **options: Any) -> ApiRoutes:
    """Routes over one engine per ``SimOptions``, engine i at DP rank i."""
    r = ApiRoutes()
    r.options = ApiServerOptions(engines=len(engines), **options)
    r.engine_options = list(engines)
    r.engines = [o.initial_state(i) for i, o in enumerate(engines)]
    r.engine_status, r.ft_answer, r.ft_delay_s, r.metrics_answer = {}, None, 0.0, None
    r.elastic_ep = SimElasticEp()
    return r


def answer(resp: web.StreamResponse) -> tuple[int, Any]:
    assert isinstance(resp, web.Response)
    return resp.status, json.loads(resp.body) if isinstance(resp.body, bytes) else resp.body


def get(path: str) -> web.Request:
    return make_mocked_request("GET", path)


async def test_is_sleeping_is_a_consensus() -> None:
    r = routes(SimOptions(), SimOptions())
    assert answer(await r._is_sleeping(get("/is_sleeping"))) == (200, {"is_sleeping": False})
    r.engines[1].sleep(1)
    with pytest.raises(_EngineError, match=r"different is_sleeping results: \[False, True\]$"):
        await r._is_sleeping(get("/is_sleeping"))


async def test_the_rust_front_end_names_the_route_in_its_consensus_error() -> None:
    r = routes(SimOptions(), SimOptions(paused=True), rust_front_end="0.32.0")
    with pytest.raises(_RustFrontEndError) as raised:
        await r._is_paused(get("/is_paused"))
    assert str(raised.value) == (
        "failed to call is_paused: utility call `is_scheduler_paused` returned inconsistent "
        "results across engines: [false, true]"
    )


async def test_is_paused_answers_its_own_error_in_the_python_server() -> None:
    r = routes(SimOptions(), SimOptions(paused=True))
    status, body = answer(await r._is_paused(get("/is_paused")))
    assert status == 500
    assert body["error"].startswith("Failed to fetch pause status: Engines returned different")


async def test_sleep_and_wake_up_reach_every_engine() -> None:
    r = routes(SimOptions(), SimOptions())
    slept = await r._sleep(make_mocked_request("POST", "/sleep?level=2&mode=keep"))
    assert answer(slept) == (200, {"status": "sleeping", "level": 2})
    assert all(e.is_sleeping() for e in r.engines)
    woke = await r._wake_up(make_mocked_request("POST", "/wake_up?tags=weights"))
    assert answer(woke) == (200, {"status": "sleeping", "tags": ["weights"]})
    assert answer(await r._wake_up(make_mocked_request("POST", "/wake_up"))) == (
        200,
        {"status": "awake", "tags": None},
    )
    with pytest.raises(_BadQuery, match="valid integer"):
        await r._sleep(make_mocked_request("POST", "/sleep?level=deep"))


async def test_a_reset_succeeds_only_where_every_engine_did() -> None:
    r = routes(SimOptions(), SimOptions(refuse_reset=True))
    request = make_mocked_request("POST", "/reset_prefix_cache?reset_running_requests=true")
    assert answer(await r._reset_prefix_cache(request)) == (200, {"success": False})
    old = routes(SimOptions(), old_reset_response=True)
    assert answer(await old._reset_prefix_cache(request)) == (200, None), "vLLM < 0.26: empty"


async def test_one_failing_engine_fails_the_call_and_a_dead_fleet_answers_vllms_500() -> None:
    r = routes(SimOptions(), SimOptions(), failures={1: "CUDA error"})
    with pytest.raises(_EngineError, match=r"^Call to reset_mm_cache method failed: CUDA error$"):
        await r._reset_mm_cache(make_mocked_request("POST", "/reset_mm_cache"))
    dead = routes(SimOptions(), engine_dead=True)
    with pytest.raises(_EngineError, match=f"^{re.escape(ENGINE_DEAD_MESSAGE)}$"):
        await dead._reset_encoder_cache(make_mocked_request("POST", "/reset_encoder_cache"))


async def test_pause_and_resume_catch_engine_failures() -> None:
    r = routes(SimOptions(), failures={0: "boom"})
    paused = answer(await r._pause(make_mocked_request("POST", "/pause")))
    assert paused == (
        500,
        {"error": "Failed to pause generation: Call to pause_scheduler method failed: boom"},
    )
    resumed = answer(await r._resume(make_mocked_request("POST", "/resume")))
    assert resumed[0] == 500 and resumed[1]["error"].startswith("Failed to resume generation:")
    fine = routes(SimOptions())
    assert answer(await fine._pause(make_mocked_request("POST", "/pause?mode=keep"))) == (
        200,
        {"status": "paused"},
    )
    assert fine.engines[0].is_scheduler_paused()


async def test_the_weight_version_is_set_everywhere_and_read_by_consensus() -> None:
    r = routes(SimOptions(weight_version="v1"), SimOptions(weight_version="v1"))
    assert answer(await r._weight_info(get("/weight_info"))) == (200, {"weight_version": "v1"})
    updated = await r._update_weight_version(with_body(b'{"new_version": "v2"}'))
    assert answer(updated) == (200, {"success": True, "new_version": "v2"})
    assert [e.weight_version for e in r.engines] == ["v2", "v2"]
    for raw, kind in ((b"{}", "missing"), (b'{"new_version": 2}', "string_type")):
        with pytest.raises(_BadQuery) as refused:
            await r._update_weight_version(with_body(raw))
        assert (refused.value.kind, refused.value.where) == (kind, "body")


async def test_the_weight_checker_flattens_and_compares_checksums() -> None:
    r = routes(SimOptions(weight_version="v1"), SimOptions(weight_version="v1", tp_size=2))
    _, got = answer(await r._weight_checker(with_body(b'{"action": "checksum"}')))
    checksums = got["checksums"]
    assert len({k.rsplit(":", 1)[0] for k in checksums}) == 3, "one prefix per worker"
    baseline = dict(checksums)
    changed = sorted(baseline)[0]
    baseline[changed] = "0" * 64
    compare = json.dumps({"action": "compare", "baseline": baseline}).encode()
    assert answer(await r._weight_checker(with_body(compare))) == (
        200,
        {"match": False, "mismatches": [changed]},
    )
    with pytest.raises(_HttpError, match="requires a 'baseline'"):
        await r._weight_checker(with_body(b'{"action": "compare"}'))
    with pytest.raises(_BadQuery) as refused:
        await r._weight_checker(with_body(b'{"action": "verify"}'))
    assert refused.value.kind == "literal_error"


async def test_duplicate_checksum_keys_are_vllms_500() -> None:
    r = routes(SimOptions(), SimOptions())
    r.engines[1].dp_rank = 0  # both engines' workers say DP rank 0
    with pytest.raises(_HttpError) as raised:
        await r._weight_checker(with_body(b'{"action": "checksum"}'))
    assert raised.value.status == 500 and "Duplicate weight checksum keys" in raised.value.detail


async def test_metrics_label_engines_by_dp_rank_and_call_none() -> None:
    r = routes(SimOptions(), SimOptions(hang=True), story_offset=4)
    r.engines[1].submit(600.0, time.monotonic(), count=5)  # 4 run, 1 waits
    resp = await r._metrics(get("/metrics"))
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    text = resp.body.decode()
    assert 'vllm:num_requests_running{engine="5",model_name="sim"} 4.0' in text
    assert 'vllm:num_requests_waiting{engine="5",model_name="sim"} 1.0' in text
    assert 'engine="4"' in text and 'engine="0"' not in text
    r.metrics_answer = b"hostile"
    assert (await r._metrics(get("/metrics"))).body == b"hostile"


async def test_a_hung_engine_never_answers() -> None:
    r = routes(SimOptions(), SimOptions(hang=True))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(r._is_sleeping(get("/is_sleeping")), 0.05)
    assert answer(await r._version(get("/version"))) == (200, {"version": "0.33.0"})
