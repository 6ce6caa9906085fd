"""The simulated API server's ``X-data-parallel-rank`` without serving it: the header read as
vLLM 0.30 to 0.34 read it, vLLM's 400 for a rank out of range, vLLM's balancing of an unpinned
request, and where the completion routes are served."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp import web
from multidict import CIMultiDict

from exporter.sim.api_routes import (
    COMPLETION_ROUTES,
    DP_RANK_HEADER,
    data_parallel_rank,
    rank_out_of_range,
)
from exporter.sim.api_server import SimApiServer
from exporter.sim.options import ApiServerOptions
from tests.unit.sim.test_api_wire import with_body


@pytest.mark.parametrize(
    ("raw", "rank"),
    [
        *[("0", 0), ("3", 3), (" 2 ", 2), ("+1", 1), ("-1", -1), ("1_0", 10), ("99", 99)],
        *[("", None), ("one", None), ("1.0", None), ("0x1", None), (None, None)],
    ],
)
def test_the_header_is_read_as_python_int_reads_it(raw: str | None, rank: int | None) -> None:
    headers = CIMultiDict[str]() if raw is None else CIMultiDict({DP_RANK_HEADER: raw})
    assert data_parallel_rank(headers) == rank
    if raw is not None:  # header names are case-insensitive
        assert data_parallel_rank(CIMultiDict({"x-data-parallel-rank": raw})) == rank


def test_a_rank_out_of_range_is_vllms_validation_envelope() -> None:
    assert rank_out_of_range(4, 2) == {
        "error": {
            "message": "data_parallel_rank 4 is out of range [0, 2).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


def test_the_completion_routes_come_with_the_dev_routes() -> None:
    def posts(sim: SimApiServer) -> set[str]:
        routes = sim.app.router.routes()
        return {r.resource.canonical for r in routes if r.method == "POST" and r.resource}

    assert set(COMPLETION_ROUTES) <= posts(SimApiServer())
    assert not set(COMPLETION_ROUTES) & posts(SimApiServer(ApiServerOptions(dev_mode=False)))
    missing = ApiServerOptions(missing_routes=frozenset({"/v1/chat/completions"}))
    assert "/v1/chat/completions" not in posts(SimApiServer(missing))


def test_unpinned_requests_go_to_the_least_loaded_engine_scanning_from_a_rotating_start() -> None:
    sim = SimApiServer(ApiServerOptions(engines=3))
    assert [sim._balanced() for _ in range(4)] == [0, 1, 2, 0], "idle: round robin"
    now = time.monotonic()
    sim.engines[0].paused = sim.engines[1].paused = True  # their requests stay queued
    sim.engines[0].submit(1.0, now, count=2)
    sim.engines[1].submit(1.0, now, count=1)
    assert [sim._balanced() for _ in range(3)] == [2, 2, 2]
    sim.engines[2].submit(5.0, now, count=3)  # running: 3 against 2 and 1
    assert sim._balanced() == 1


async def test_a_rank_out_of_range_is_answered_before_any_engine_runs() -> None:
    sim = SimApiServer(ApiServerOptions(engines=2))
    request = with_body(b'{"model": "m", "prompt": "x"}').clone(
        headers={DP_RANK_HEADER: "2", "Content-Type": "application/json"}
    )
    resp = await sim._completion(request)
    assert isinstance(resp, web.Response) and isinstance(resp.body, bytes)
    assert resp.status == 400
    assert json.loads(resp.body)["error"]["message"].endswith("out of range [0, 2).")
    assert not sim.completions and not any(e.has_work() for e in sim.engines)
