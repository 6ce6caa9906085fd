"""What engines push unasked, over real HTTP and real ZMQ (owner mode: the exporter is client 0,
the one vLLM's engines push to): fault-tolerance statuses (``FT_STATUS_CALL_ID``, vLLM 0.33's
``{"id", "status", "fault_info"}``) in /metrics, /status and ``GET /gate?healthy=true``,
elastic-EP notifications (``EEP_NOTIFICATION_CALL_ID``) as membership events; hostile pushes
are protocol errors that change nothing, a flood does not stall the exporter, and a new
handshake forgets the status. Relay mode cannot see pushes: ``healthy`` is 501 there.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from exporter.protocol.pushes import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATE_VALUES,
    FT_STATUS_CALL_ID,
    MAX_FAULT_INFO,
    encode_ft_status_value,
)
from exporter.protocol.strings import is_cut
from exporter.protocol.utility import encode_utility_reply
from exporter.sim.options import SimOptions
from tests.harness.scrape import Families, metric_value
from tests.harness.service import RecordingSimEngine, Service, ServiceFactory, relay_service
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

FT = "vllm_dp_engine_fault_tolerance_status"
FAULTY = "vllm_dp_fault_tolerance_faulty_engines"
PUSHES = "vllm_dp_engine_pushes_total"
EVENTS = "vllm_dp_engine_membership_event_timestamp_seconds"
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def push_errors(svc: Service) -> dict[str, int]:
    """The protocol errors but late poll replies (``unknown_call_id``: a reply that came after
    its call timed out, on a loaded machine; nothing to do with pushes)."""
    return {k: n for k, n in svc.exporter.faults.counts.items() if k != "unknown_call_id"}


def total_pushes(svc: Service) -> int:
    return sum(svc.client.pushes.counts.values())


async def push(svc: Service, index: int, call_id: int, value: Any) -> None:
    """One push from engine ``index``; returns once the exporter read it and a poll that
    started after it was published (what /metrics and /status show)."""
    before = total_pushes(svc)
    await svc.engines[index].push(call_id, value)
    await eventually(lambda: total_pushes(svc) > before, what="the push read")
    await svc.fresh_poll()


async def ft(svc: Service, index: int, status: str, info: str | None = None) -> None:
    await push(svc, index, FT_STATUS_CALL_ID, encode_ft_status_value(index, status, info))


async def sentinel(svc: Service, index: int, status: str, info: str | None = None) -> None:
    """Engine ``index``'s own sentinel push (``SimEngine.push_fault_status``), read and polled."""
    before = total_pushes(svc)
    await svc.engines[index].push_fault_status(status, info)
    await eventually(lambda: total_pushes(svc) > before, what="the push read")
    await svc.fresh_poll()


def ft_series(m: Families) -> dict[str, str]:
    """engine → the status its state set says (exactly one series at 1 per engine)."""
    found: dict[str, list[str]] = {}
    for s in m[FT].samples if FT in m else []:
        found.setdefault(s.labels["engine"], [])
        if s.value == 1.0:
            found[s.labels["engine"]].append(s.labels["status"])
    assert all(len(v) == 1 for v in found.values()), found
    values = len(FT_STATE_VALUES)
    assert all(len([s for s in m[FT].samples if s.labels["engine"] == e]) == values for e in found)
    return {e: v[0] for e, v in found.items()}


async def status(svc: Service) -> dict[str, Any]:
    doc = await svc.status()
    validate_status(doc)
    return doc


async def gate(svc: Service) -> tuple[int, dict[str, Any]]:
    return await svc.get_json("/gate?healthy=true")


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_fault_tolerance_transitions_in_metrics_status_and_gate(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    me = str(position)
    m = await fleet.scrape()
    assert FT not in m and FAULTY not in m and PUSHES not in m  # nothing reported yet
    doc = await status(fleet)
    assert doc["fault_tolerance"] == {"healthy": True, "faulty_engines": [], "reported_engines": []}
    assert [e["fault_tolerance"] for e in doc["engines"]] == [None] * 3
    assert (await gate(fleet))[0] == 200

    await ft(fleet, position, "healthy")
    m = await fleet.scrape()
    assert ft_series(m) == {me: "healthy"} and metric_value(m, FAULTY) == 0.0
    first = (await status(fleet))["engines"][position]["fault_tolerance"]
    assert first["status"] == "healthy" and first["fault_info"] is None

    await ft(fleet, position, "unhealthy", "NCCL timeout on rank 3")
    m = await fleet.scrape()
    assert ft_series(m) == {me: "unhealthy"} and metric_value(m, FAULTY) == 1.0
    doc = await status(fleet)
    assert doc["fault_tolerance"] == {
        "healthy": False,
        "faulty_engines": [me],
        "reported_engines": [me],
    }
    mine = doc["engines"][position]["fault_tolerance"]
    assert mine["status"] == "unhealthy" and mine["fault_info"] == "NCCL timeout on rank 3"
    assert mine["since_unix"] >= first["since_unix"]
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == [me], body
    (failure,) = next(e for e in body["engines"] if e["engine"] == me)["failures"]
    assert "unhealthy" in failure and "NCCL timeout on rank 3" in failure
    assert all(e["ok"] for e in body["engines"] if e["engine"] != me)

    await ft(fleet, position, "healthy")
    m = await fleet.scrape()
    assert ft_series(m) == {me: "healthy"} and metric_value(m, FAULTY) == 0.0
    assert (await status(fleet))["engines"][position]["fault_tolerance"]["fault_info"] is None
    assert (await gate(fleet))[0] == 200

    await ft(fleet, position, "dead")
    m = await fleet.scrape()
    assert ft_series(m) == {me: "dead"} and metric_value(m, FAULTY) == 1.0
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == [me] and "dead" in str(body["engines"])
    assert (await fleet.get_json("/gate?healthy=false"))[0] == 412  # the others are healthy
    assert metric_value(m, PUSHES, engine=me, kind="fault_tolerance_status") == 4.0
    assert (await status(fleet))["engines"][position]["pushes"] == {"fault_tolerance_status": 4}
    assert push_errors(fleet) == {}  # well-formed pushes are no protocol errors


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


#: (call id, payload from engine 1) that no engine may send: they change nothing.
BAD_PUSHES = {
    "spoof_of_another_engine": (FT_STATUS_CALL_ID, encode_ft_status_value(0, "dead")),
    "eep_not_a_pair": (EEP_NOTIFICATION_CALL_ID, "RECONFIGURE_FINISHED"),
    "eep_rank_as_text": (EEP_NOTIFICATION_CALL_ID, ["RECONFIGURE_FINISHED", "1"]),
    "eep_of_a_rank_no_engine_has": (EEP_NOTIFICATION_CALL_ID, ["SHUTDOWN_COMPLETE", 65536]),
    "eep_unknown_event": (EEP_NOTIFICATION_CALL_ID, ["x" * 60, 1]),
}
#: Status pushes from engine 1's own connection that cannot be read: engine 1's status is
#: unknown from then on (fail closed), never the last one kept, never healthy.
UNREADABLE_PUSHES = {
    "not_a_map": ["dead"],
    "status_as_a_number": {"id": 1, "status": 3},  # PR #41438 renumbers the codes: no name
    "status_as_a_map": {"id": 1, "status": {"name": "dead"}},
    "no_status": {"id": 1, "fault_info": "RuntimeError"},
    "id_as_bool": {"id": True, "status": "dead"},
    "id_as_text": {"id": "1", "status": "dead"},
    "status_nested_500_deep": {"id": 1, "status": nested(500)},
}


@pytest.mark.parametrize("case", BAD_PUSHES.values(), ids=BAD_PUSHES.keys())
async def test_a_malformed_push_is_bad_push_and_changes_nothing(
    fleet_factory: ServiceFactory, case: tuple[int, Any]
) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    await ft(fleet, 1, "unhealthy", "before")
    before = (await status(fleet))["engines"]
    await push(fleet, 1, *case)
    assert push_errors(fleet) == {"bad_push": 1}
    m = await fleet.scrape()
    assert metric_value(m, "vllm_dp_protocol_errors_total", kind="bad_push") == 1.0
    assert ft_series(m) == {"1": "unhealthy"} and EVENTS not in m
    after = (await status(fleet))["engines"]
    assert [e["fault_tolerance"] for e in after] == [e["fault_tolerance"] for e in before]
    assert [e["membership_event"] for e in after] == [None] * 3
    assert [e["up"] for e in after] == [True] * 3
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == ["1"]  # engine 0 was not made dead


@pytest.mark.parametrize("case", UNREADABLE_PUSHES.values(), ids=UNREADABLE_PUSHES.keys())
async def test_an_unreadable_status_push_makes_the_engine_unknown(
    fleet_factory: ServiceFactory, case: Any
) -> None:
    """Reliability E1: a status the exporter cannot read is never healthy, never dropped."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    await ft(fleet, 1, "healthy")
    assert (await gate(fleet))[0] == 200
    await push(fleet, 1, FT_STATUS_CALL_ID, case)
    assert push_errors(fleet) == {"bad_push": 1}
    m = await fleet.scrape()
    assert ft_series(m) == {"1": "unknown"} and metric_value(m, FAULTY) == 1.0
    doc = await status(fleet)
    mine = doc["engines"][1]["fault_tolerance"]
    assert mine["status"] == "unknown" and mine["fault_info"].startswith("unreadable status")
    assert doc["fault_tolerance"]["healthy"] is False
    assert doc["fault_tolerance"]["faulty_engines"] == ["1"]
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == ["1"], body
    assert "unknown" in str(body["engines"][1]["failures"])
    await ft(fleet, 1, "healthy")  # a readable status again: healthy again
    assert (await gate(fleet))[0] == 200


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_statuses_beyond_0_33_are_their_own_values(
    fleet_factory: ServiceFactory, position: int
) -> None:
    """The simulated engine pushes vLLM PR #41438's ``recovering`` and ``paused`` and a status no
    vLLM has: each shows as its own value (the unknown string as ``other``, named in
    ``fault_info``, never a label), fails ``/gate?healthy=true`` naming the engine, and is no
    protocol error; ``healthy`` again opens the gate."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    me = str(position)
    for sent, shown, info in (
        ("recovering", "recovering", None),
        ("paused", "paused", "held by the sentinel"),
        ("zzz-new", "other", "status 'zzz-new'"),
    ):
        await sentinel(fleet, position, sent, info if sent == "paused" else None)
        m = await fleet.scrape()
        assert ft_series(m) == {me: shown} and metric_value(m, FAULTY) == 1.0
        doc = await status(fleet)
        mine = doc["engines"][position]["fault_tolerance"]
        assert (mine["status"], mine["fault_info"]) == (shown, info)
        assert doc["fault_tolerance"]["healthy"] is False
        assert doc["fault_tolerance"]["faulty_engines"] == [me]
        code, body = await gate(fleet)
        assert code == 412 and body["failing_engines"] == [me], body
        (failure,) = next(e for e in body["engines"] if e["engine"] == me)["failures"]
        assert f"reports {shown}" in failure
    assert "zzz-new" not in await fleet.metrics()
    await ft(fleet, position, "healthy")
    m = await fleet.scrape()
    assert ft_series(m) == {me: "healthy"} and metric_value(m, FAULTY) == 0.0
    assert (await gate(fleet))[0] == 200
    assert metric_value(m, PUSHES, engine=me, kind="fault_tolerance_status") == 4.0
    assert push_errors(fleet) == {}  # readable statuses: no bad_push


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_vllm_0_34_diagnosing_then_unhealthy_with_its_mask(
    fleet_factory: ServiceFactory, position: int
) -> None:
    """vLLM 0.34's sentinel on a faulted rank (``engine_core_sentinel.py``): ``diagnosing``
    first (its own value, never healthy, the gate 412), then ``unhealthy`` with the workers'
    all2all ``mask``, shown in ``fault_info``; a mask of another shape is said unreadable and
    the status still counts."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    me = str(position)
    await push(fleet, position, FT_STATUS_CALL_ID, {"id": position, "status": "diagnosing"})
    m = await fleet.scrape()
    assert ft_series(m) == {me: "diagnosing"} and metric_value(m, FAULTY) == 1.0
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == [me], body
    for mask, shown in (
        ([0, 1, 1, 0], "RuntimeError; all2all mask 0110"),
        ([1] * 100, "RuntimeError; all2all mask " + "1" * 64 + "... (100 ranks)"),
        (["1", 2], "RuntimeError; mask unreadable"),
        ({"ranks": [1]}, "RuntimeError; mask unreadable"),
    ):
        sent = {"id": position, "status": "unhealthy", "fault_info": "RuntimeError", "mask": mask}
        await push(fleet, position, FT_STATUS_CALL_ID, sent)
        mine = (await status(fleet))["engines"][position]["fault_tolerance"]
        assert (mine["status"], mine["fault_info"]) == ("unhealthy", shown)
    assert push_errors(fleet) == {}


async def test_a_hostile_status_string_is_cut_and_never_a_label(
    fleet_factory: ServiceFactory,
) -> None:
    """A 10 KB status of control characters: ``other``, shown cut and escaped, not counted."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    hostile = ("\x00\x1b[31m\r\n\u2028" + "z" * 50) * 200
    assert len(hostile.encode()) > 10_000
    await push(fleet, 1, FT_STATUS_CALL_ID, {"id": 1, "status": hostile, "fault_info": "E"})
    info = (await status(fleet))["engines"][1]["fault_tolerance"]["fault_info"]
    assert info.startswith("status '\\x00\\x1b[31m\\r\\n\\u2028zzz")
    assert is_cut(info.split("'")[1])
    assert info.endswith("': E") and len(info.encode()) <= MAX_FAULT_INFO
    assert all(c.isprintable() for c in info)
    text = await fleet.metrics()
    assert "zzz" not in text and len(text) < 100_000
    assert ft_series(await fleet.scrape()) == {"1": "other"}
    assert push_errors(fleet) == {}
    code, body = await gate(fleet)
    assert code == 412 and body["failing_engines"] == ["1"] and len(str(body)) < 10_000


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_fault_info_that_is_not_text_keeps_the_status(
    fleet_factory: ServiceFactory, position: int
) -> None:
    """Reliability E1: the one rule of every mode; the status is what counts."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    for info in (7, ["RuntimeError"]):
        await push(
            fleet,
            position,
            FT_STATUS_CALL_ID,
            {"id": position, "status": "dead", "fault_info": info},
        )
        mine = (await status(fleet))["engines"][position]["fault_tolerance"]
        assert (mine["status"], mine["fault_info"]) == ("dead", repr(info))
        code, body = await gate(fleet)
        assert code == 412 and body["failing_engines"] == [str(position)]
    assert push_errors(fleet) == {}


async def test_a_5000_deep_push_is_a_protocol_error_and_changes_nothing(
    fleet_factory: ServiceFactory,
) -> None:
    """msgspec cannot even encode it, so the frame is written by hand on engine 1's output
    address: a push whose status is 5,000 nested arrays."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    await ft(fleet, 1, "dead")
    placeholder = "PLACEHOLDERXYZ!"
    frame = encode_utility_reply(
        1, FT_STATUS_CALL_ID, value={"id": 1, "status": placeholder}, timestamp=time.time()
    )
    marker = b"\xaf" + placeholder.encode()
    assert frame.count(marker) == 1
    frame = frame.replace(marker, b"\x91" * 5000 + b"\x90")
    address = fleet.client.engine_details()[1].address
    sock = fleet.context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send(frame)
        await eventually(lambda: bool(push_errors(fleet)), what="a protocol error")
    finally:
        sock.close(linger=0)
    await fleet.fresh_poll()
    assert set(push_errors(fleet)) <= {"too_deep", "bad_push"}
    assert sum(push_errors(fleet).values()) == 1
    m = await fleet.scrape()
    assert ft_series(m) == {"1": "dead"}
    doc = await status(fleet)
    assert [e["up"] for e in doc["engines"]] == [True] * 3
    assert doc["fault_tolerance"]["faulty_engines"] == ["1"]


async def test_a_megabyte_of_fault_info_is_cut(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    await ft(fleet, 2, "unhealthy", "x" * 1_000_000)
    doc = await status(fleet)
    info = doc["engines"][2]["fault_tolerance"]["fault_info"]
    assert info.startswith("xxx") and is_cut(info) and len(info.encode()) == MAX_FAULT_INFO
    code, body = await gate(fleet)
    assert code == 412 and len(str(body)) < 10_000
    m = await fleet.scrape()
    assert ft_series(m) == {"2": "unhealthy"} and metric_value(m, FAULTY) == 1.0
    assert len(await fleet.metrics()) < 100_000  # the info is in no label
    # A fault_info that is not a string (a nested structure) is shown as its cut repr.
    deep = {"id": 0, "status": "unhealthy", "fault_info": nested(400)}
    await push(fleet, 0, FT_STATUS_CALL_ID, deep)
    info = (await status(fleet))["engines"][0]["fault_tolerance"]["fault_info"]
    assert info.startswith("[[[") and len(info.encode()) <= MAX_FAULT_INFO
    assert push_errors(fleet) == {}


async def test_a_flood_of_pushes_does_not_stall_the_exporter(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(3)
    flood, statuses = 20_000, ("healthy", "unhealthy", "dead")
    polls_before = fleet.exporter.poller.snapshot.poll_number

    async def send() -> None:
        engine = fleet.engines[0]
        for i in range(flood):
            await engine.push(FT_STATUS_CALL_ID, encode_ft_status_value(0, statuses[i % 3], "f"))

    sender = asyncio.create_task(send())
    slowest = 0.0
    scrapes = 0
    while not sender.done() or scrapes < 3:
        started = time.monotonic()
        text = await fleet.metrics()
        slowest = max(slowest, time.monotonic() - started)
        assert "vllm_dp_engines_connected 3.0" in text
        scrapes += 1
        await asyncio.sleep(0.05)
    await sender
    await eventually(lambda: total_pushes(fleet) == flood, 30, "every push read")
    await fleet.fresh_poll()
    assert slowest < 5.0, f"a scrape took {slowest:.1f}s during the flood"
    # Polls went on through the flood (how many depends on the machine's speed).
    assert fleet.exporter.poller.snapshot.poll_number > polls_before
    m = await fleet.scrape()
    assert metric_value(m, PUSHES, engine="0", kind="fault_tolerance_status") == float(flood)
    assert ft_series(m) == {"0": statuses[(flood - 1) % 3]}
    # Polls' replies from engine 0 queue behind the flood: some may come after their call
    # timed out (counted as late replies); no push is a protocol error.
    assert set(fleet.exporter.faults.counts) <= {"unknown_call_id"}, fleet.exporter.faults.counts
    await fleet.next_polls(3)  # and polls still run afterwards
    await fleet.ready()
    m = await fleet.scrape()
    assert [metric_value(m, "vllm_dp_engine_up", engine=e) for e in "012"] == [1.0] * 3


async def test_elastic_ep_notifications_are_membership_events(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(3)
    assert (await status(fleet))["last_membership_event"] is None
    await push(fleet, 2, EEP_NOTIFICATION_CALL_ID, ["RECONFIGURE_FINISHED", 2])
    doc = await status(fleet)
    event = doc["engines"][2]["membership_event"]
    assert (event["event"], event["dp_rank"], event["reported_rank"]) == (
        "RECONFIGURE_FINISHED",
        2,
        2,
    )
    assert event["unix"] <= doc["generated_unix"]
    assert doc["last_membership_event"] == {"engine": "2", **event}
    m = await fleet.scrape()
    assert metric_value(m, EVENTS, engine="2", event="RECONFIGURE_FINISHED") == event["unix"]
    assert metric_value(m, PUSHES, engine="2", kind="elastic_ep") == 1.0
    assert FT not in m and FAULTY not in m  # no fault-tolerance status came with it

    await push(fleet, 0, EEP_NOTIFICATION_CALL_ID, ["SHUTDOWN_COMPLETE", 0])
    await push(fleet, 2, EEP_NOTIFICATION_CALL_ID, ["SHUTDOWN_COMPLETE", 2])
    doc = await status(fleet)
    assert doc["last_membership_event"]["engine"] == "2"
    assert doc["last_membership_event"]["event"] == "SHUTDOWN_COMPLETE"
    assert doc["engines"][0]["membership_event"]["event"] == "SHUTDOWN_COMPLETE"
    m = await fleet.scrape()
    series = sorted((s.labels["engine"], s.labels["event"]) for s in m[EVENTS].samples)
    assert series == [("0", "SHUTDOWN_COMPLETE"), ("2", "SHUTDOWN_COMPLETE")]  # the last only
    assert metric_value(m, PUSHES, engine="2", kind="elastic_ep") == 2.0
    # A reserved id vLLM does not use (yet) is counted as "other", never a protocol error.
    await push(fleet, 1, -7, {"anything": 1})
    m = await fleet.scrape()
    assert metric_value(m, PUSHES, engine="1", kind="other") == 1.0
    doc = await status(fleet)
    assert doc["engines"][1]["membership_event"] is None
    assert doc["engines"][1]["pushes"] == {"other": 1}
    # No push was a protocol error (a poll reply that came after its call timed out, on a
    # loaded machine, is one: unknown_call_id, nothing to do with pushes).
    assert set(fleet.exporter.faults.counts) <= {"unknown_call_id"}


async def test_a_new_handshake_forgets_the_status(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    await ft(fleet, 1, "dead")
    await push(fleet, 1, EEP_NOTIFICATION_CALL_ID, ["SHUTDOWN_COMPLETE", 1])
    assert (await gate(fleet))[0] == 412
    old = fleet.engines[1]
    old.options.shutdown_window_s = 0.0
    old.stop()
    await asyncio.wait_for(fleet.engine_tasks[1], 5)
    await eventually(
        lambda: [d.connected for d in fleet.client.engine_details()] == [1, 0, 1],
        what="engine 1's disconnection",
    )
    restarted = RecordingSimEngine(
        fleet.config.handshake_address, 1, SimOptions(), context=fleet.context
    )
    fleet.engines[1] = restarted
    fleet.engine_tasks.append(asyncio.create_task(restarted.run()))
    await eventually(
        lambda: [d.handshakes for d in fleet.client.engine_details()] == [1, 2, 1],
        what="engine 1's second handshake",
    )
    await fleet.ready()
    await fleet.fresh_poll()
    doc = await status(fleet)
    assert doc["engines"][1]["handshakes"] == 2 and doc["engines"][1]["up"]
    assert doc["engines"][1]["fault_tolerance"] is None
    assert doc["engines"][1]["membership_event"] is None
    assert doc["fault_tolerance"] == {"healthy": True, "faulty_engines": [], "reported_engines": []}
    assert doc["last_membership_event"] is None
    m = await fleet.scrape()
    assert FT not in m and FAULTY not in m and EVENTS not in m
    # A counter never goes down: the pushes it received before its restart stay counted.
    assert metric_value(m, PUSHES, engine="1", kind="fault_tolerance_status") == 1.0
    assert (await gate(fleet))[0] == 200
    await ft(fleet, 1, "unhealthy", "again")  # and the restarted engine's pushes count
    assert (await gate(fleet))[0] == 412


@pytest.fixture
async def relayed() -> AsyncIterator[Service]:
    async with relay_service(gate_min_interval=0.0) as (svc, _frontend):
        yield svc


async def test_relay_mode_cannot_answer_healthy(relayed: Service) -> None:
    code, body = await gate(relayed)
    assert code == 501, body
    assert body["unsupported"] == ["healthy"] and "healthy" in body["error"]
    code, body = await relayed.get_json("/gate?healthy=true&sleeping=false")
    assert code == 501 and body["unsupported"] == ["healthy"]
    assert (await relayed.get_json("/gate?sleeping=false"))[0] == 200
    m = await relayed.scrape()
    assert FT not in m and FAULTY not in m


async def test_relay_mode_says_unknown_not_healthy(relayed: Service) -> None:
    """E4: the engines push to the front end (client 0): /status says it cannot know, even
    after an engine reported unhealthy (to the front end), never healthy."""
    await relayed.engines[1].push(FT_STATUS_CALL_ID, encode_ft_status_value(1, "unhealthy", "x"))
    await relayed.fresh_poll()
    doc = await status(relayed)
    assert doc["fault_tolerance"]["healthy"] is None
    assert "not available" in doc["fault_tolerance"]["note"]
    assert [e["fault_tolerance"] for e in doc["engines"]] == [None, None]
    m = await relayed.scrape()
    assert FT not in m and FAULTY not in m and PUSHES not in m


async def test_a_push_is_published_without_polling_the_fleet(
    fleet_factory: ServiceFactory,
) -> None:
    """E8: a status change one engine pushes is published at once (the snapshot republished),
    and no engine is asked anything for it: a flood of changes from engine 0 costs the silent
    engines no call (before, every change polled the whole fleet)."""
    fleet = await fleet_factory(3, poll_interval=30.0, gate_min_interval=0.0)
    await fleet.fresh_poll()
    poller = fleet.exporter.poller
    polls = poller.snapshot.poll_number
    silent = [fleet.engines[1], fleet.engines[2]]
    asked = [len(e.received) for e in silent]
    await fleet.engines[0].push(FT_STATUS_CALL_ID, encode_ft_status_value(0, "dead"))
    await eventually(
        lambda: (
            (ft := poller.snapshot.engines[0].detail.fault_status) is not None
            and ft.status == "dead"
        ),
        what="the pushed status published",
    )
    m = await fleet.scrape()
    assert ft_series(m) == {"0": "dead"}
    for i in range(2000):
        status = ("healthy", "unhealthy")[i % 2]
        await fleet.engines[0].push(FT_STATUS_CALL_ID, encode_ft_status_value(0, status))
    await eventually(lambda: total_pushes(fleet) == 2001, 30, "every push read")
    snap = poller.snapshot
    assert snap.engines[0].detail.fault_status is not None
    assert snap.engines[0].detail.fault_status.status == "unhealthy"
    assert poller.snapshot.poll_number == polls, "a push made the exporter poll"
    assert [len(e.received) for e in silent] == asked
    assert poller.republished >= 2
