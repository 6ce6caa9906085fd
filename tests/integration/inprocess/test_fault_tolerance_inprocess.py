"""In-process mode reads each engine's fault-tolerance status from the front end's own copy of
the sentinels' pushes (vLLM 0.33's ``_engine_status``): a simulated ``AsyncLLM`` over real ZMQ
engines, read back through the embedded exporter's ``/metrics``, ``/status`` and
``GET /gate?healthy=true``."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from exporter.client.inprocess.client import InProcessFleetClient
from exporter.protocol.pushes import FT_STATE_VALUES
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING
from exporter.web.app import RunningService
from tests.harness.inprocess import (
    EmbeddedExporters,
    SimVllm,
    SimVllmFactory,
    fresh_poll,
    http_session,
)
from tests.harness.scrape import metric_value, parse_metrics

FT_FAMILY = "vllm_dp_engine_fault_tolerance_status"
STATUSES = FT_STATE_VALUES
ENGINES = ("0", "1", "2")


def one_hot(status: str) -> dict[str, float]:
    return {s: 1.0 if s == status else 0.0 for s in STATUSES}


async def get_json(service: RunningService, path: str) -> tuple[int, Any]:
    async with http_session() as session, session.get(service.url + path) as resp:
        return resp.status, await resp.json()


async def ft_state(service: RunningService) -> dict[str, Any]:
    """Per engine: its state-set series ({} when absent) and its ``/status`` entry; the
    faulty count and the top-level ``/status`` verdict."""
    async with http_session() as session, session.get(service.url + "/metrics") as resp:
        assert resp.status == 200
        m = parse_metrics(await resp.text())
    status, doc = await get_json(service, "/status")
    assert status == 200
    series = {}
    for engine in ENGINES:
        values = {s: metric_value(m, FT_FAMILY, engine=engine, status=s) for s in STATUSES}
        series[engine] = {s: v for s, v in values.items() if v is not None}
    return {
        "series": series,
        "entries": {e["engine"]: e["fault_tolerance"] for e in doc["engines"]},
        "faulty": metric_value(m, "vllm_dp_fault_tolerance_faulty_engines"),
        "fleet": doc["fault_tolerance"],
    }


async def serve(sim: SimVllm, embedded: EmbeddedExporters) -> RunningService:
    service = await embedded(sim.llm, gate_min_interval=0)
    await fresh_poll(service)
    return service


@pytest.mark.parametrize("rank", [0, 1, 2], ids=["first", "middle", "last"])
async def test_unhealthy_and_back_at_each_position(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, rank: int
) -> None:
    sim_vllm.core.enable_fault_tolerance()
    service = await serve(sim_vllm, embedded)
    label = str(rank)
    state = await ft_state(service)
    assert state["series"] == {e: one_hot("healthy") for e in ENGINES}
    assert state["faulty"] == 0
    assert state["fleet"] == {
        "healthy": True,
        "faulty_engines": [],
        "reported_engines": list(ENGINES),
    }
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (200, [])

    sim_vllm.core.set_engine_status(rank, "unhealthy", "RuntimeError")
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (412, [label])
    [failing] = [e for e in body["engines"] if e["engine"] == label]
    assert any("unhealthy (RuntimeError)" in f for f in failing["failures"]), failing
    await fresh_poll(service)
    state = await ft_state(service)
    assert state["series"][label] == one_hot("unhealthy")
    assert all(state["series"][e] == one_hot("healthy") for e in ENGINES if e != label)
    entry = state["entries"][label]
    assert (entry["status"], entry["fault_info"]) == ("unhealthy", "RuntimeError")
    assert state["faulty"] == 1
    assert state["fleet"]["healthy"] is False and state["fleet"]["faulty_engines"] == [label]
    await fresh_poll(service)
    assert (await ft_state(service))["entries"][label]["since_unix"] == entry["since_unix"]

    sim_vllm.core.set_engine_status(rank, "healthy")
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (200, [])
    await fresh_poll(service)
    state = await ft_state(service)
    assert state["series"] == {e: one_hot("healthy") for e in ENGINES}
    assert state["entries"][label]["fault_info"] is None
    assert state["faulty"] == 0 and state["fleet"]["healthy"] is True


@pytest.mark.parametrize("rank", [0, 1, 2], ids=["first", "middle", "last"])
async def test_statuses_beyond_0_33_at_each_position(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, rank: int
) -> None:
    """The front end's table holds vLLM PR #41438's ``recovering`` and ``paused`` and a status no
    vLLM has: each its own value (``other`` for the unknown string, named in ``fault_info``),
    the gate 412 naming the rank, nothing counted as unreadable; healthy again, 200."""
    sim_vllm.core.enable_fault_tolerance()
    service = await serve(sim_vllm, embedded)
    label = str(rank)
    for sent, shown, info in (
        ("recovering", "recovering", None),
        ("paused", "paused", None),
        ("zzz-new", "other", "status 'zzz-new'"),
    ):
        sim_vllm.core.set_engine_status(rank, sent)
        status, body = await get_json(service, "/gate?healthy=true")
        assert (status, body["failing_engines"]) == (412, [label]), sent
        [failing] = [e for e in body["engines"] if e["engine"] == label]
        assert any(f"reports {shown}" in f for f in failing["failures"]), failing
        await fresh_poll(service)
        state = await ft_state(service)
        assert state["series"][label] == one_hot(shown)
        assert all(state["series"][e] == one_hot("healthy") for e in ENGINES if e != label)
        assert (state["entries"][label]["status"], state["entries"][label]["fault_info"]) == (
            shown,
            info,
        )
        assert state["faulty"] == 1 and state["fleet"]["faulty_engines"] == [label]
    async with http_session() as session, session.get(service.url + "/metrics") as resp:
        text = await resp.text()
    assert "zzz-new" not in text
    bad = metric_value(
        parse_metrics(text), "vllm_dp_protocol_errors_total", kind="bad_fault_tolerance_status"
    )
    assert not bad
    sim_vllm.core.set_engine_status(rank, "healthy")
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (200, [])


async def test_without_engine_status_the_gate_cannot_tell(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    """A vLLM before 0.33 has no ``_engine_status``: ``healthy`` is a condition this attach
    mode cannot answer (501), and no engine has a status."""
    del sim_vllm.core._engine_status
    service = await serve(sim_vllm, embedded)
    assert not service.exporter.client.capabilities.fault_status
    status, body = await get_json(service, "/gate?healthy=true")
    assert status == 501 and body["unsupported"] == ["healthy"]
    state = await ft_state(service)
    assert state["series"] == {e: {} for e in ENGINES}
    assert state["entries"] == dict.fromkeys(ENGINES)
    status, _ = await get_json(service, "/gate?sleeping=false")
    assert status == 200


async def test_fault_tolerance_off_reports_nothing(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    """vLLM 0.33 without --enable-fault-tolerance keeps ``{}``: nothing reported, and the
    gate's ``healthy`` holds (no rank says otherwise)."""
    assert sim_vllm.core._engine_status == {}
    service = await serve(sim_vllm, embedded)
    assert service.exporter.client.capabilities.fault_status
    state = await ft_state(service)
    assert state["series"] == {e: {} for e in ENGINES}
    assert state["fleet"]["reported_engines"] == []
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (200, [])


def deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


async def test_odd_entries_fail_closed(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters
) -> None:
    """E1: one rule with owner and HTTP mode: an entry whose status cannot be read is
    ``unknown`` (never dropped, never healthy) and counted; a fault_info that is not text is
    shown as its cut repr, the status kept."""
    sim = await sim_vllm_factory(7)
    hostile: dict[Any, Any] = {
        0: {"id": 0, "status": 7},  # an integer code (PR #41438 renumbers them): no name
        6: {"id": 6, "status": ["dead"]},
        1: "garbage",
        2: {"id": 2, "status": "dead", "fault_info": 7},
        3: {"id": 4, "status": "dead"},  # another rank's payload under rank 3's key
        4: {"id": 4, "status": "unhealthy", "fault_info": deep(5000)},
        5: {"id": 5, "status": "unhealthy", "fault_info": "E" * 1_000_000},
        "1": {"id": 1, "status": "healthy"},  # not a rank vLLM's client keys by
    }
    sim.core._engine_status = hostile
    service = await serve(sim, embedded)
    _, doc = await get_json(service, "/status")
    entries = {e["engine"]: e["fault_tolerance"] for e in doc["engines"]}
    assert {e: ft["status"] for e, ft in entries.items()} == {
        "0": "unknown",
        "1": "unknown",
        "2": "dead",
        "3": "unknown",
        "4": "unhealthy",
        "5": "unhealthy",
        "6": "unknown",
    }
    assert entries["2"]["fault_info"] == "7"
    assert "names engine 4" in entries["3"]["fault_info"]
    info = entries["5"]["fault_info"]
    assert info.startswith("EEE") and CUT_MARKER in info
    assert len(info.encode()) <= MAX_ENGINE_STRING
    assert len(entries["4"]["fault_info"].encode()) <= MAX_ENGINE_STRING
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (412, [str(r) for r in range(7)])
    async with http_session() as session, session.get(service.url + "/metrics") as resp:
        m = parse_metrics(await resp.text())
    assert metric_value(m, "vllm_dp_fault_tolerance_faulty_engines") == 7
    assert metric_value(m, FT_FAMILY, engine="0", status="unknown") == 1.0
    bad = metric_value(m, "vllm_dp_protocol_errors_total", kind="bad_fault_tolerance_status")
    assert bad is not None and bad >= 4


class UnwalkableTable(dict[Any, Any]):
    """vLLM's table as a hostile engine could fill it; walking it whole is a test failure."""

    def _walked(self, *args: Any) -> Any:
        raise AssertionError("the whole fault-tolerance table was walked on vLLM's loop")

    __iter__ = items = keys = values = copy = __len__ = _walked


async def test_ranks_vllm_does_not_manage_are_never_read(
    sim_vllm_factory: SimVllmFactory,
    embedded: EmbeddedExporters,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """E6: any engine can add entries to the table (vLLM keys it by the index a push carries):
    20,000 phantom ranks are not read, recorded or logged, and the table is never walked."""
    sim = await sim_vllm_factory(3)
    table = UnwalkableTable()
    for rank in range(3, 20_003):
        dict.__setitem__(table, rank, {"id": rank, "status": "dead", "fault_info": "phantom"})
    dict.__setitem__(table, 1, {"id": 1, "status": "unhealthy"})
    sim.core._engine_status = table
    caplog.set_level(logging.DEBUG)
    service = await serve(sim, embedded)
    _, doc = await get_json(service, "/status")
    assert [e["engine"] for e in doc["engines"]] == ["0", "1", "2"]
    assert [e["fault_tolerance"] and e["fault_tolerance"]["status"] for e in doc["engines"]] == [
        None,
        "unhealthy",
        None,
    ]
    status, body = await get_json(service, "/gate?healthy=true")
    assert (status, body["failing_engines"]) == (412, ["1"])
    client = service.exporter.client
    assert isinstance(client, InProcessFleetClient)
    assert len(client.pushes.fault_status) == 1
    phantom = [r for r in caplog.records if "phantom" in r.getMessage()]
    assert phantom == [] and len(caplog.records) < 100


async def test_fleet_client_reads_the_front_end_copy(sim_vllm: SimVllm) -> None:
    client = sim_vllm.fleet_client()
    sim_vllm.core.enable_fault_tolerance()
    sim_vllm.core.set_engine_status(2, "dead")
    details = {d.engine: d.fault_status for d in client.engine_details()}
    assert {e: ft.status if ft else None for e, ft in details.items()} == {
        "0": "healthy",
        "1": "healthy",
        "2": "dead",
    }
    since = details["2"].since_unix if details["2"] else None
    again = {d.engine: d.fault_status for d in client.engine_details()}
    assert again["2"] is not None and again["2"].since_unix == since
    # A rank the front end no longer lists is forgotten.
    del sim_vllm.core._engine_status[2]
    assert {d.engine: d.fault_status for d in client.engine_details()}["2"] is None
