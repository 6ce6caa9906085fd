"""``POST /is_scaling_elastic_ep`` as each simulated release answers it, from the operation and
faults of ``SimElasticEp`` (the handler's answer built directly: no server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from exporter.sim.api_elastic import (
    RUST_NOT_IMPLEMENTED,
    UNAVAILABLE,
    SimElasticEp,
    elastic_ep_answer,
    release,
)
from exporter.sim.api_wire import _HttpError


def body(resp: web.Response) -> Any:
    assert isinstance(resp.body, bytes)
    return json.loads(resp.body)


@pytest.mark.parametrize(
    ("version", "parts"),
    [
        ("0.33.0", (0, 33, 0)),
        ("0.33.0rc1", (0, 33, 0)),
        ("0.32.1+cu128", (0, 32, 1)),
        ("1.0", (1, 0)),
    ],
)
def test_release_is_the_leading_numbers(version: str, parts: tuple[int, ...]) -> None:
    assert release(version) == parts


@pytest.mark.parametrize(
    ("phase", "scaling"),
    [("idle", False), ("preparing", True), ("committing", True), ("failed", False)],
)
async def test_033_answers_the_flag_and_the_operation(phase: str, scaling: bool) -> None:
    state = SimElasticEp(phase=phase, epoch="e2", error=None, requested=4)
    resp = await elastic_ep_answer(state, "0.33.0", None)
    assert resp.status == 200
    assert body(resp) == {
        "is_scaling_elastic_ep": scaling,
        "phase": phase,
        "epoch": "e2",
        "error": None,
        "requested_data_parallel_size": 4,
    }


async def test_032_answers_the_flag_alone_and_knows_no_store() -> None:
    state = SimElasticEp(phase="committing", epoch="e1", unavailable=True)
    resp = await elastic_ep_answer(state, "0.32.2", None)
    assert body(resp) == {"is_scaling_elastic_ep": True}


async def test_an_unreadable_store_is_a_503_in_vllms_envelope() -> None:
    with pytest.raises(_HttpError) as raised:
        await elastic_ep_answer(SimElasticEp(unavailable=True), "0.33.0", None)
    assert (raised.value.status, raised.value.detail) == (503, UNAVAILABLE)


@pytest.mark.parametrize(
    ("rust", "status", "expected"),
    [
        ("0.32.0", 404, {"detail": "Not Found"}),
        ("0.33.1", 501, {"error": {"message": RUST_NOT_IMPLEMENTED, "code": 501}}),
    ],
)
async def test_the_rust_front_end_has_no_such_route(
    rust: str, status: int, expected: dict[str, Any]
) -> None:
    """Whatever the operation or the faults (a hostile body included)."""
    state = SimElasticEp(phase="preparing", unavailable=True, answer=b"[]")
    resp = await elastic_ep_answer(state, "0.33.0", rust)
    assert (resp.status, body(resp)) == (status, expected)


async def test_a_hostile_body_is_served_as_given() -> None:
    resp = await elastic_ep_answer(
        SimElasticEp(answer=b'{"is_scaling_elastic_ep": "yes"'), "0.33.0", None
    )
    assert (resp.status, resp.content_type) == (200, "application/json")
    assert resp.body == b'{"is_scaling_elastic_ep": "yes"'


async def test_a_delay_holds_the_answer_back() -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await elastic_ep_answer(SimElasticEp(delay_s=0.05), "0.33.0", None)
    assert loop.time() - started >= 0.05


def test_the_status_map_is_vllms_get_status() -> None:
    assert SimElasticEp().status() == {
        "phase": "idle",
        "epoch": None,
        "error": None,
        "requested_data_parallel_size": None,
    }
