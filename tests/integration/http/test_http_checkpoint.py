"""vLLM 0.34's checkpoint lifecycle in HTTP mode, over real HTTP on 127.0.0.1: the exporter
polls each simulated 0.34 API server's ``GET /checkpoint/status`` (one engine behind each, so
one target is one rank) and drives ``POST /checkpoint/{prepare,restore}`` through its admin
routes. Every rank's state in ``/status`` and ``vllm_dp_engine_checkpoint_state``; the gate's
``checkpoint=`` naming the rank behind; a rank that refuses or fails, first, middle or last;
a hostile answer (huge, not JSON, wrong types) read as a failed call, never as a state."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from exporter.client.http.routes import MAX_ANSWER
from tests.harness.apiservers import ApiServer, ApiServers, http_config
from tests.harness.scrape import metric_value
from tests.harness.service import Service, Services

POSITIONS = {"first": 0, "middle": 1, "last": 2}
ERROR = "CUDA error: device lost"
Fleet = tuple[Service, list[ApiServer]]
StartFleet = Callable[..., Awaitable[Fleet]]


@pytest.fixture
async def fleet() -> AsyncIterator[StartFleet]:
    """``await fleet(**api_options)`` → HTTP mode over three 0.34 API servers (targets
    ``0``..``2``), the gate always fresh."""
    apis, services = ApiServers(), Services(start=False)

    async def start(**options: Any) -> Fleet:
        options.setdefault("vllm_version", "0.34.0")
        servers = [await apis.start(engines=1, **options) for _ in range(3)]
        svc = await services.serve(http_config([s.url for s in servers], gate_min_interval=0.0))
        return svc, servers

    yield start
    await services.close()
    await apis.close()


async def admin(svc: Service, path: str, **params: str) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/{path}", params=params) as resp:
        return resp.status, await resp.json()


async def gate(svc: Service, state: str) -> tuple[int, dict[str, Any]]:
    return await svc.get_json(f"/gate?checkpoint={state}")


async def engines(svc: Service) -> dict[str, dict[str, Any]]:
    """Each engine's ``checkpoint_state`` row in a fresh ``/status``."""
    await svc.fresh_poll()
    doc = await svc.status()
    return {e["engine"]: e["invariants"]["checkpoint_state"] for e in doc["engines"]}


def reasons(body: dict[str, Any]) -> dict[str, str]:
    return {str(e["engine"]): e["reason"] for e in body["engines"] if e["reason"]}


async def test_every_rank_is_read_and_a_cycle_is_driven_through_the_admin_routes(
    fleet: StartFleet,
) -> None:
    svc, servers = await fleet()
    rows = await engines(svc)
    assert {k: (r["outcome"], r["value"]) for k, r in rows.items()} == {
        str(i): ("ok", ["running", None]) for i in range(3)
    }
    assert all(("GET", "/checkpoint/status", None) in s.sim.requests for s in servers)
    assert (await gate(svc, "running"))[0] == 200
    code, closed = await gate(svc, "prepared")
    assert code == 412 and closed["failing_engines"] == ["0", "1", "2"]

    code, body = await admin(svc, "checkpoint_prepare", mode="abort")
    assert code == 200 and body["outcome"] == "success", body
    assert all(("POST", "/checkpoint/prepare?mode=abort", None) in s.sim.requests for s in servers)
    assert (await gate(svc, "prepared"))[0] == 200
    assert {k: r["value"] for k, r in (await engines(svc)).items()} == {
        str(i): ["prepared", None] for i in range(3)
    }
    m = await svc.scrape()
    for engine in ("0", "1", "2"):
        series = "vllm_dp_engine_checkpoint_state"
        assert metric_value(m, series, engine=engine, state="prepared") == 1.0
        assert metric_value(m, series, engine=engine, state="running") == 0.0

    code, body = await admin(svc, "checkpoint/restore")  # vLLM's route name, an alias
    assert code == 200 and body["outcome"] == "success", body
    assert (await gate(svc, "running"))[0] == 200
    assert not any(s.sim.engines[0].paused for s in servers)  # serving again


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_that_fails_is_named_with_its_error_and_cannot_restore(
    fleet: StartFleet, position: int
) -> None:
    svc, servers = await fleet()
    behind = servers[position].sim.engines[0].checkpoint
    assert behind is not None
    behind.fail_with = ERROR
    code, body = await admin(svc, "checkpoint_prepare")
    assert code == 502 and reasons(body) == {str(position): "unverified"}, body
    rows = await engines(svc)
    assert rows[str(position)]["value"] == ["failed", ERROR]
    doc = await svc.status()
    verdict = doc["aggregate"]["checkpoint_state"]
    expected: list[Any] = [["prepared", None]] * 3
    expected[position] = ["failed", ERROR]
    assert verdict["state"] == "inconsistent" and verdict["values"] == expected
    m = await svc.scrape()
    counted = metric_value(
        m, "vllm_dp_inconsistent_utility_results_total", method="checkpoint_state"
    )
    assert counted is not None and counted >= 1
    series = "vllm_dp_engine_checkpoint_state"
    assert metric_value(m, series, engine=str(position), state="failed") == 1.0
    code, closed = await gate(svc, "prepared")
    assert code == 412
    failing = {e["engine"]: e["failures"] for e in closed["engines"] if e["failures"]}
    assert failing == {str(position): [f"checkpoint is 'failed' ({ERROR}), expected 'prepared'"]}
    code, body = await admin(svc, "checkpoint_restore")
    assert code == 502 and reasons(body) == {str(position): "failed"}, body
    failed = next(e for e in body["engines"] if str(e["engine"]) == str(position))
    assert failed["error"] == f"cannot restore while the checkpoint state is failed ({ERROR})"


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_that_refuses_keeps_running_and_the_gate_names_it(
    fleet: StartFleet, position: int
) -> None:
    svc, servers = await fleet()
    servers[position].sim.engines[0].sleeping_tags = {"weights"}  # 0.34 prepares awake engines
    code, body = await admin(svc, "checkpoint_prepare", mode="wait")
    assert code == 502 and body["outcome"] == "partial_failure", body
    assert reasons(body) == {str(position): "refused"}
    refused = next(e for e in body["engines"] if str(e["engine"]) == str(position))
    assert "requires an awake engine" in refused["error"]
    checkpoint = servers[position].sim.engines[0].checkpoint
    assert checkpoint is not None and checkpoint.state == "running"
    code, closed = await gate(svc, "prepared")
    assert code == 412 and closed["failing_engines"] == [str(position)]
    failures = next(e["failures"] for e in closed["engines"] if e["engine"] == str(position))
    assert failures == ["checkpoint is 'running', expected 'prepared'"]


HOSTILE = {
    "huge": (200, json.dumps({"state": "prepared", "error": "x" * MAX_ANSWER}).encode()),
    "not_json": (200, b"<html>prepared</html>"),
    "state_not_text": (200, b'{"state": 7}'),
    "error_not_text": (503, b'{"state": "running", "error": ["boom"]}'),
    "not_an_object": (200, b'["prepared", null]'),
    "unknown_state": (200, b'{"state": "snapshotted"}'),
}


@pytest.mark.parametrize("answer", HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_status_is_a_failed_call_never_a_state(
    fleet: StartFleet, answer: tuple[int, bytes]
) -> None:
    svc, servers = await fleet()
    for s in servers:  # every rank prepared: a hostile "prepared" must not pass for one
        s.sim.engines[0].call("checkpoint_prepare", ["abort"])
    servers[1].sim.checkpoint_routes.answers["/checkpoint/status"] = answer
    rows = await engines(svc)
    assert rows["1"]["outcome"] == "failed" and rows["1"]["value"] is None, rows["1"]
    assert rows["0"]["value"] == rows["2"]["value"] == ["prepared", None]
    doc = await svc.status()
    assert doc["aggregate"]["checkpoint_state"]["state"] != "consistent"
    m = await svc.scrape()
    for state in ("running", "prepared", "failed"):
        series = "vllm_dp_engine_checkpoint_state"
        assert metric_value(m, series, engine="1", state=state) is None  # no state, no series
    code, closed = await gate(svc, "prepared")
    assert code == 412 and closed["failing_engines"] == ["1"], closed


async def test_a_hostile_prepare_answer_is_a_failed_call(fleet: StartFleet) -> None:
    svc, servers = await fleet()
    servers[2].sim.checkpoint_routes.answers["/checkpoint/prepare"] = (200, b"OK")
    code, body = await admin(svc, "checkpoint_prepare")
    assert code == 502 and reasons(body) == {"2": "failed"}, body
