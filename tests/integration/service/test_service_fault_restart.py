"""A fault-tolerance status across an exporter restart (owner mode, fixed ports): vLLM's engines
push a status only when it changes and reattach without a new handshake, so the state file
keeps it; where the file does not say (no file, an older exporter's file, a value that cannot
be believed) the engine's status is ``unknown``, never healthy, until the engine says again.
Real ZMQ and real HTTP on 127.0.0.1 (reliability rows E3 and E4)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from exporter.client.fleet import connected_count
from exporter.protocol.pushes import FT_STATUS_CALL_ID, encode_ft_status_value
from exporter.sim.options import SimOptions
from tests.harness.restart import VLLM_VERSION, IndexRecordingEngine, RestartRig, answering
from tests.harness.scrape import metric_value
from tests.harness.service import Service
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
FT = "vllm_dp_engine_fault_tolerance_status"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[RestartRig]:
    made = RestartRig("owner", tmp_path)
    yield made
    await made.close()


def recorded_fault(rig: RestartRig, index: int) -> Any:
    for entry in rig.recorded().get("engines", []):
        if entry["engine_index"] == index:
            return entry.get("fault_tolerance", "absent")
    return "absent"


def recorded_status(rig: RestartRig, index: int) -> str | None:
    """The status the state file records for ``index`` (None: none since its handshake)."""
    record = recorded_fault(rig, index)
    status: str | None = record["status"] if isinstance(record, dict) else record
    return status


async def first_run_with(rig: RestartRig, statuses: dict[int, tuple[str, str | None]]) -> None:
    """Handshake every engine with a first exporter, have ``statuses`` pushed, wait until the
    state file holds them, stop that exporter."""
    first = await rig.start()
    await rig_engines(rig, first)
    for index, (status, info) in statuses.items():
        await rig.engines[index].push(
            FT_STATUS_CALL_ID, encode_ft_status_value(index, status, info)
        )
    for index in range(rig.engine_count):
        want = statuses.get(index)
        await eventually(
            lambda i=index, w=want: recorded_status(rig, i) == (w and w[0]),  # type: ignore[misc]
            5,
            f"engine {index}'s status in the state file",
        )
    await first.stop()


async def rig_engines(rig: RestartRig, first: Service) -> None:
    for index in range(rig.engine_count):
        engine = IndexRecordingEngine(rig.handshake, index, SimOptions(vllm_version=VLLM_VERSION))
        rig.engines.append(engine)
        rig.tasks.append(asyncio.create_task(engine.run()))
    await eventually(lambda: connected_count(first.client) == rig.engine_count, 10, "handshakes")
    await first.next_polls()


async def restarted(rig: RestartRig, **overrides: Any) -> Service:
    second = await rig.start(gate_min_interval=0.0, **overrides)
    # Connected once their connections are back; reattached once they answer.
    await eventually(lambda: answering(second), 5, "reattached")
    await second.next_polls(2)
    assert [d.handshakes for d in second.client.engine_details()] == [0, 0, 0]  # no handshake
    return second


async def statuses(svc: Service) -> list[Any]:
    doc = await svc.status()
    validate_status(doc)
    return [e["fault_tolerance"] and e["fault_tolerance"]["status"] for e in doc["engines"]]


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_an_unhealthy_engine_stays_unhealthy_across_an_exporter_restart(
    rig: RestartRig, position: int
) -> None:
    """E3: the documented restart (same fixed ports, same state file) keeps the status, with
    its fault_info and since when; the gate stays shut until the engine says healthy."""
    await first_run_with(rig, {position: ("unhealthy", "NCCL timeout")})
    before = recorded_fault(rig, position)
    second = await restarted(rig)
    want: list[Any] = [None] * 3
    want[position] = "unhealthy"
    assert await statuses(second) == want
    mine = (await second.status())["engines"][position]["fault_tolerance"]
    assert mine["fault_info"] == "NCCL timeout" and mine["since_unix"] == before["since_unix"]
    code, body = await second.get_json("/gate?healthy=true")
    assert code == 412 and body["failing_engines"] == [str(position)], body
    m = await second.scrape()
    assert metric_value(m, FT, engine=str(position), status="unhealthy") == 1.0
    await rig.engines[position].push(FT_STATUS_CALL_ID, encode_ft_status_value(position, "healthy"))
    await eventually(lambda: recorded_fault(rig, position)["status"] == "healthy", 5, "healthy")
    await second.fresh_poll()
    assert (await second.get_json("/gate?healthy=true"))[0] == 200
    assert rig.healthy()


def drop_fault_records(rig: RestartRig) -> None:
    """The state file as an exporter before this field wrote it."""
    state = rig.recorded()
    for entry in state["engines"]:
        entry.pop("fault_tolerance", None)
    rig.path.write_text(json.dumps(state))


def garble_fault_record(rig: RestartRig, index: int, value: Any) -> None:
    state = rig.recorded()
    for entry in state["engines"]:
        if entry["engine_index"] == index:
            entry["fault_tolerance"] = value
    rig.path.write_text(json.dumps(state))


async def test_a_restart_without_a_record_makes_every_engine_unknown(rig: RestartRig) -> None:
    """E3: an older exporter's state file (no fault_tolerance) tells nothing of the engines'
    statuses: each is unknown (not healthy) until it pushes again."""
    await first_run_with(rig, {1: ("unhealthy", "lost")})
    drop_fault_records(rig)
    second = await restarted(rig)
    assert await statuses(second) == ["unknown"] * 3
    code, body = await second.get_json("/gate?healthy=true")
    assert code == 412 and body["failing_engines"] == ["0", "1", "2"], body
    assert "not known since the exporter restarted" in str(body["engines"][0]["failures"])
    reasons = {e["fault_tolerance"]["fault_info"] for e in (await second.status())["engines"]}
    assert reasons == {"not known since the exporter restarted (no record in the state file)"}
    doc = await second.status()
    assert doc["fault_tolerance"]["healthy"] is False
    for index in range(3):
        await rig.engines[index].push(FT_STATUS_CALL_ID, encode_ft_status_value(index, "healthy"))
    await eventually(
        lambda: all(
            d.fault_status is not None and d.fault_status.status == "healthy"
            for d in second.client.engine_details()
        ),
        5,
        "every engine healthy again",
    )
    await second.fresh_poll()
    assert (await second.get_json("/gate?healthy=true"))[0] == 200


async def test_a_restart_without_a_state_file_makes_every_engine_unknown(
    rig: RestartRig,
) -> None:
    """E3: fixed ports without --state-file: engines reattach, nothing says their status."""
    await first_run_with(rig, {})
    second = await restarted(rig, state_file=None)
    assert await statuses(second) == ["unknown"] * 3
    assert (await second.get_json("/gate?healthy=true"))[0] == 412
    # The reason names what is missing: no file at all (not a record the file lacked).
    reasons = {e["fault_tolerance"]["fault_info"] for e in (await second.status())["engines"]}
    assert reasons == {"not known since the exporter restarted (no --state-file)"}


BAD_RECORDS: dict[str, Any] = {
    "a_string": "unhealthy",
    "an_unknown_status": {"status": "fine", "fault_info": None, "since_unix": 1.0},
    "info_not_text": {"status": "healthy", "fault_info": 7, "since_unix": 1.0},
    "since_negative": {"status": "healthy", "fault_info": None, "since_unix": -1},
    "an_extra_key": {"status": "healthy", "fault_info": None, "since_unix": 1.0, "x": 1},
    "a_lone_surrogate": {"status": "unhealthy", "fault_info": "\ud800", "since_unix": 1.0},
    "info_too_long": {"status": "unhealthy", "fault_info": "x" * 300, "since_unix": 1.0},
}


@pytest.mark.parametrize("record", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
async def test_a_record_that_cannot_be_believed_is_unknown(rig: RestartRig, record: Any) -> None:
    """E3: one engine's bad record makes that engine unknown; the others are as recorded."""
    await first_run_with(rig, {2: ("dead", None)})
    garble_fault_record(rig, 1, record)
    second = await restarted(rig)
    assert await statuses(second) == [None, "unknown", "dead"]
    code, body = await second.get_json("/gate?healthy=true")
    assert code == 412 and body["failing_engines"] == ["1", "2"], body
