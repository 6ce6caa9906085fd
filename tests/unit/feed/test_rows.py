"""A rank's row for routers (pure): what it holds, and what counts as a change."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from exporter.client.fleet import EngineDetail
from exporter.feed.rows import gone_row, rank_row, rank_rows, reason_key
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FaultStatus
from tests.harness.snapshots import engine_snapshot, polled

AWAKE: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False, "has_work": True}


def test_a_row_holds_what_a_router_decides_by() -> None:
    detail = EngineDetail("1", True, "x", requests=RequestCounts(3, 2))
    row = rank_row(engine_snapshot("1", detail, get_weight_version="v7", **AWAKE))
    body = json.loads(row.data(poll=4, unix=10.0, progress_age_s=None))
    assert body["engine"] == "1" and body["state"] == "awake" and body["routable"] is True
    assert (body["running"], body["waiting"], body["weight_version"]) == (3, 2, "v7")
    assert (body["poll"], body["unix"], body["reasons"]) == (4, 10.0, [])


def test_paused_asleep_and_unhealthy_ranks_are_not_routable_and_say_why() -> None:
    paused = rank_row(engine_snapshot("0", **{**AWAKE, "is_scheduler_paused": True}))
    assert not paused.routable and paused.fields["reasons"] == ["paused"]
    asleep = rank_row(engine_snapshot("0", **{**AWAKE, "is_sleeping": True}))
    assert not asleep.routable and asleep.fields["state"] == "asleep"
    faulty = EngineDetail("0", True, "x", fault_status=FaultStatus("unhealthy", None, 1.0))
    row = rank_row(engine_snapshot("0", faulty, **AWAKE))
    assert not row.routable and row.fields["fault_tolerance"] == "unhealthy"


def test_a_duration_in_a_reason_is_no_change() -> None:
    base = engine_snapshot("2", **AWAKE)
    hung_1 = dataclasses.replace(base, hung=True, unresponsive_s=1.0)
    hung_9 = dataclasses.replace(base, hung=True, unresponsive_s=9.0)
    assert rank_row(hung_1).fields["reasons"] != rank_row(hung_9).fields["reasons"]
    assert rank_row(hung_1).key == rank_row(hung_9).key
    assert rank_row(hung_1).key != rank_row(base).key
    assert reason_key("hung: no answer for 12 s") == "hung"
    assert reason_key("stale: no poll for 31 s") == "stale"
    assert reason_key("paused") == "paused"


def test_counts_are_a_change_the_poll_is_not() -> None:
    one = EngineDetail("0", True, "x", requests=RequestCounts(1, 0))
    two = EngineDetail("0", True, "x", requests=RequestCounts(2, 0))
    assert (
        rank_row(engine_snapshot("0", one, **AWAKE)).key
        != rank_row(engine_snapshot("0", two, **AWAKE)).key
    )
    a = rank_rows(polled(engine_snapshot("0", one, **AWAKE), taken_at_unix=1.0))
    b = rank_rows(polled(engine_snapshot("0", one, **AWAKE), taken_at_unix=99.0))
    assert a["0"].key == b["0"].key


def test_a_rank_that_left_is_never_routable() -> None:
    row = gone_row("5")
    assert row.fields == {
        "engine": "5",
        "state": "gone",
        "routable": False,
        "reasons": ["no longer part of the fleet"],
    }
