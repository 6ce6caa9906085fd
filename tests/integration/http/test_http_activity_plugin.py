"""HTTP mode's activity read over plugin-enabled targets: each rank's ``has_work`` and running
and waiting requests from its server's ``/dp/gate`` (the server's own ``has_work`` call and its
front end's counts). Counts that are not counts (negative, huge, the wrong type) leave that rank's
unknown; a rank the server stops naming forgets its counts; a plugin that does not answer
``has_work`` is unsupported for it, never idle. Real sockets both ways: hostile gate servers
(``tests/harness/hostile_api.py``) and the exporter served over HTTP, the odd target first,
middle or last."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exporter.client.http.plugin import RANK_ABSENT_ANSWERS
from exporter.client.http.plugin_read import PLUGIN_SHARE_S
from exporter.protocol.activity import MAX_REQUESTS, RequestCounts
from tests.harness.hostile_api import HostileApi, gate_doc, sidecar_over
from tests.harness.service import Service
from tests.harness.waiting import WAIT_S, eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
GATE = "/dp/gate"


def activity_doc(ranks: dict[int, tuple[bool, Any]]) -> dict[str, Any]:
    """A plugin's ``/dp/gate`` answer: rank → (its has_work, its ``requests``)."""
    doc = gate_doc(list(ranks))
    for entry in doc["engines"]:
        has_work, requests = ranks[int(entry["engine"])]
        entry["values"] = {**entry["values"], "has_work": has_work}
        entry["requests"] = requests
    return doc


def counts(running: Any, waiting: Any = 0) -> dict[str, Any]:
    return {"running": running, "waiting": waiting}


IDLE_DOC = activity_doc({0: (False, counts(0)), 1: (False, counts(0))})


async def gate(run: Service, query: str = "") -> tuple[int, dict[str, Any]]:
    """The exporter's gate over a gate answer asked after this call (a plugin target's answer
    serves the reads started within ``PLUGIN_SHARE_S`` of it: past that, a new one is asked)."""
    await asyncio.sleep(2 * PLUGIN_SHARE_S)
    status, body = await asyncio.wait_for(run.get_json(f"/gate{query}"), WAIT_S)
    return status, body


async def named(run: Service, engines: int = 6) -> None:
    """Polls until the targets' ranks are the exporter's engines (bounded)."""
    for _ in range(20):
        await run.fresh_poll()
        if len(run.exporter.client.engine_labels) == engines:
            return
    raise AssertionError(f"never {engines} engines: {run.exporter.client.engine_labels}")


def requests_of(run: Service) -> dict[str, RequestCounts | None]:
    return {d.engine: d.requests for d in run.exporter.client.engine_details()}


#: ``requests`` of one rank that are not two counts.
HOSTILE = {
    "negative": counts(-1),
    "huge": counts(MAX_REQUESTS + 1),
    "float_huge": counts(1e30),
    "string": counts("1"),
    "bool": counts(True, False),
    "list": [1, 0],
    "text": "1 running",
    "missing": {"running": 1},
}


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_counts_per_rank_and_hostile_ones_are_unknown(kind: str, position: str) -> None:
    odd = POSITIONS[position]

    def setup(i: int, api: HostileApi) -> None:
        if i == odd:
            api.json(GATE, activity_doc({0: (True, HOSTILE[kind]), 1: (True, counts(2, 3))}))
        else:
            api.json(GATE, IDLE_DOC)

    async with sidecar_over(setup, plugin=True, call_timeout=1.0) as (run, _):
        await named(run)
        status, body = await gate(run)
        entries = {e["engine"]: e for e in body["engines"]}
        assert len(entries) == 6, list(entries)
        for i in range(3):
            for rank in (0, 1):
                entry = entries[f"t{i}/{rank}"]
                assert entry["values"]["has_work"] is (i == odd), entry
                if i != odd:
                    assert entry["requests"] == counts(0)
        assert entries[f"t{odd}/0"]["requests"] is None  # not counts: unknown, never zero
        assert entries[f"t{odd}/1"]["requests"] == counts(2, 3)
        status, body = await gate(run, "?drained=true")
        assert status == 412 and body["failing_engines"] == [f"t{odd}/0", f"t{odd}/1"]
        # /status keeps answering with the same.
        doc = await asyncio.wait_for(run.status(), WAIT_S)
        assert len(doc["engines"]) == 6


async def test_counts_follow_the_answers_and_a_dropped_rank_forgets_them() -> None:
    async with sidecar_over(
        lambda _, api: api.json(GATE, IDLE_DOC), plugin=True, call_timeout=1.0
    ) as (run, apis):
        await named(run)
        assert requests_of(run)["t1/1"] == RequestCounts(0, 0)
        apis[1].json(GATE, activity_doc({0: (False, counts(0)), 1: (True, counts(1, 4))}))
        status, body = await gate(run, "?drained=true")
        assert (status, body["failing_engines"]) == (412, ["t1/1"])
        assert requests_of(run)["t1/1"] == RequestCounts(1, 4)
        # The server stops naming rank 1: unknown at once, forgotten with the rank.
        apis[1].json(GATE, activity_doc({0: (False, counts(0))}))
        await gate(run)
        assert requests_of(run)["t1/1"] is None
        for _ in range(RANK_ABSENT_ANSWERS):
            await gate(run)
        await eventually(lambda: "t1/1" not in requests_of(run), WAIT_S, "rank 1 dropped")
        assert requests_of(run)["t1/0"] == RequestCounts(0, 0)
        status, body = await gate(run, "?drained=true")
        assert (status, body["failing_engines"]) == (200, [])


@pytest.mark.parametrize("position", list(POSITIONS))
async def test_an_unreachable_gate_forgets_that_targets_counts(position: str) -> None:
    odd = POSITIONS[position]
    async with sidecar_over(
        lambda _, api: api.json(GATE, IDLE_DOC), plugin=True, call_timeout=1.0
    ) as (run, apis):
        await named(run)
        assert all(c == RequestCounts(0, 0) for c in requests_of(run).values())
        apis[odd].json(GATE, {"error": "overloaded"}, status=503)
        await gate(run)
        found = requests_of(run)
        assert [label for label, c in found.items() if c is None] == [f"t{odd}/0", f"t{odd}/1"]
        apis[odd].json(GATE, IDLE_DOC)
        await gate(run)
        assert all(c == RequestCounts(0, 0) for c in requests_of(run).values())


async def test_a_plugin_without_has_work_is_unsupported_never_idle() -> None:
    """Plugins too old to answer ``has_work`` (their entries neither have it nor say why)."""
    async with sidecar_over(
        lambda _, api: api.json(GATE, gate_doc([0, 1])), plugin=True, call_timeout=1.0
    ) as (run, _):
        await named(run)
        status, body = await gate(run, "?drained=true")
        assert status == 501 and body["unsupported"] == ["drained"], body
        status, body = await gate(run)
        assert all("has_work" not in e["values"] and e["requests"] is None for e in body["engines"])
        assert (await gate(run, "?sleeping=false"))[0] == 200
