"""``exporter/web/statusdoc.py``: the ``/status`` document from one snapshot, the counters and
the history (pure). The schema, the invariants' shared shape, unsupported and silent engines
and the last action are in tests/unit/web/test_statuspage.py; here: the fleet's fault-tolerance
verdict, the per-engine facts, the counters' and history's own rules."""

from __future__ import annotations

from typing import Any

from exporter.base.steps import run_steps
from exporter.client.fleet import REGISTRATION_KEYS, EngineDetail, EngineOutcome, Outcome
from exporter.client.observe import UnexpectedEngine
from exporter.config.settings import ServeConfig
from exporter.fleetstate.aggregate import ConsensusVerdict, FleetState
from exporter.fleetstate.history import FleetHistory
from exporter.fleetstate.snapshot import empty_snapshot
from exporter.metrics.stats import Stats
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FT_STATE_VALUES, FaultStatus, MembershipEvent
from exporter.web.statusdoc import (
    FT_NOT_AVAILABLE,
    OUTCOMES,
    counters_json,
    history_json,
    status_steps,
    verdict_json,
)
from tests.harness.snapshots import engine_snapshot, polled
from tests.harness.statusschema import validate_status

CONFIG = ServeConfig(attach="owner", engine_count=2, handshake_address="tcp://127.0.0.1:1")


def detail(name: str, **facts: Any) -> EngineDetail:
    return EngineDetail(name, True, f"fake://{name}", **facts)


def test_a_mode_that_cannot_know_fault_statuses_is_never_shown_healthy() -> None:
    dead = detail("0", fault_status=FaultStatus("dead", None, 1.0))
    blind = polled(engine_snapshot("0", dead, is_sleeping=False), fault_tolerance_known=False)
    doc = run_steps(status_steps(blind, CONFIG, now=60.0))
    validate_status(doc)
    assert doc["fault_tolerance"] == {
        "healthy": None,
        "faulty_engines": [],
        "reported_engines": [],
        "note": FT_NOT_AVAILABLE,
    }
    seen = polled(
        engine_snapshot("0", dead, is_sleeping=False),
        engine_snapshot("1", detail("1", fault_status=FaultStatus("healthy", None, 2.0))),
        engine_snapshot("2", is_sleeping=False),
    )
    assert run_steps(status_steps(seen, CONFIG, now=60.0))["fault_tolerance"] == {
        "healthy": False,
        "faulty_engines": ["0"],
        "reported_engines": ["0", "1"],
    }


def test_every_fault_tolerance_value_is_in_the_schema_and_only_healthy_is_healthy() -> None:
    """paused, recovering (vLLM PR #41438), other and unknown: each valid in /status, each
    faulty in the fleet verdict."""
    snaps = [
        engine_snapshot(str(i), detail(str(i), fault_status=FaultStatus(s, None, 1.0)))
        for i, s in enumerate(FT_STATE_VALUES)
    ]
    doc = run_steps(status_steps(polled(*snaps), CONFIG, now=60.0))
    validate_status(doc)
    assert [e["fault_tolerance"]["status"] for e in doc["engines"]] == list(FT_STATE_VALUES)
    assert doc["fault_tolerance"]["faulty_engines"] == [
        str(i) for i, s in enumerate(FT_STATE_VALUES) if s != "healthy"
    ]


def test_the_latest_membership_event_of_any_engine_is_the_fleets() -> None:
    early = MembershipEvent("RECONFIGURE_FINISHED", 0, "0", 10.0)
    late = MembershipEvent("SHUTDOWN_COMPLETE", 1, "1", 20.0, reported_rank=0)  # a dense rank
    snap = polled(
        engine_snapshot("0", detail("0", membership=early), is_sleeping=False),
        engine_snapshot("1", detail("1", membership=late), is_sleeping=False),
    )
    doc = run_steps(status_steps(snap, CONFIG, now=60.0))
    validate_status(doc)
    assert doc["last_membership_event"] == {
        "engine": "1",
        "event": "SHUTDOWN_COMPLETE",
        "dp_rank": 1,
        "reported_rank": 0,
        "unix": 20.0,
    }
    assert doc["engines"][0]["membership_event"]["event"] == "RECONFIGURE_FINISHED"
    assert (
        run_steps(status_steps(polled(engine_snapshot("0")), CONFIG))["last_membership_event"]
        is None
    )


def test_each_engine_says_how_long_since_it_last_answered_and_what_it_registered() -> None:
    registered = detail("0", vllm_version="0.33.0", registration=(("dtype", "bfloat16"),))
    stats = Stats()
    stats.record_confirmed_resets(["0"], "pause", 55.0)
    snap = polled(engine_snapshot("0", registered, 59.1234, is_sleeping=False))
    (doc,) = run_steps(status_steps(snap, CONFIG, stats, now=60.0))["engines"]
    assert doc["seconds_since_last_success"] == 0.877 and doc["last_success_unix"] == 59.1234
    assert doc["registration"]["dtype"] == "bfloat16"
    assert set(doc["registration"]) == set(REGISTRATION_KEYS)
    assert doc["registration"]["max_model_len"] is None  # not sent: null, never left out
    assert doc["prefix_cache"] == {
        "confirmed_resets": 1,
        "last_reset_unix": 55.0,
        "last_reset_action": "pause",
    }
    assert doc["kv_events"] is None and doc["fault_tolerance"] is None
    # A clock behind the last success never shows a negative age.
    (behind,) = run_steps(status_steps(snap, CONFIG, stats, now=50.0))["engines"]
    assert behind["seconds_since_last_success"] == 0.0


def test_an_invariant_no_engine_has_is_unsupported_not_unknown() -> None:
    verdict = ConsensusVerdict("get_weight_version", FleetState.UNKNOWN)
    assert verdict_json(verdict, True, ["0", "1"], engines=2)["outcome"] == "unsupported"
    assert verdict_json(verdict, True, ["1"], engines=2)["outcome"] == "unknown"
    assert verdict_json(verdict, False, [], engines=2)["outcome"] == "unsupported"
    assert verdict_json(verdict, True, [], engines=0)["outcome"] == "unknown"


def test_failed_calls_count_every_outcome_but_ok_and_actions_only_those_that_ran() -> None:
    stats = Stats()
    stats.preset(["0"])
    stats.record_calls(
        "is_sleeping",
        [
            EngineOutcome("0", Outcome.OK, True),
            EngineOutcome("1", Outcome.TIMEOUT),
            EngineOutcome("2", Outcome.DISCONNECTED),
        ],
    )
    stats.record_calls("get_weight_version", [EngineOutcome("0", Outcome.FAILED, error="x")])
    stats.record_action("sleep", "success")
    counters = counters_json(stats)
    assert counters["failed_calls"] == {
        "checkpoint_state": 0,
        "get_weight_version": 1,
        "has_work": 0,
        "is_scheduler_paused": 0,
        "is_sleeping": 2,
    }
    assert counters["failed_calls_total"] == 3
    assert counters["actions"] == {"sleep": {"success": 1}}  # the preset zeros are left out
    assert counters["actions_by_outcome"] == {o: int(o == "success") for o in OUTCOMES}


def test_without_counters_or_history_the_document_keeps_its_shape() -> None:
    snap = empty_snapshot([EngineDetail("0", False, "a")], expected=1, connected=0)
    doc = run_steps(
        status_steps(snap, CONFIG, now=60.0, unexpected={"ab12": UnexpectedEngine(7, 3, 59.0)})
    )
    validate_status(doc)
    assert doc["last_poll"] == {
        "number": 0,
        "unix": None,
        "duration_s": None,
        "source": {"role": "alone", "from": "self", "age_s": None, "reason": None},
    }
    assert doc["history"] == {"bucket_s": 0, "window_s": 0, "entries": []}
    assert doc["last_action"] is None and doc["counters"]["polls"] == 0
    assert doc["unexpected_engines"] == [
        {"identity": "ab12", "dp_rank": 7, "handshakes": 3, "last_seen_unix": 59.0}
    ]


def test_the_history_shows_only_the_buckets_of_the_window() -> None:
    history = FleetHistory(bucket_s=30.0, window_s=60.0)
    history.record(0.0, {"is_sleeping": "consistent"}, 2, 2)
    history.record(45.0, {"is_sleeping": "unknown"}, 1, 2)
    shown = history_json(history, now=100.0)
    assert (shown["bucket_s"], shown["window_s"]) == (30.0, 60.0)
    assert [e["start_unix"] for e in shown["entries"]] == [45.0]
    assert shown["entries"][0]["engines_up_min"] == 1


def test_each_engine_says_what_it_is_doing_and_null_where_unknown() -> None:
    timeout = EngineOutcome("2", Outcome.TIMEOUT, error="no reply within 1s")
    snap = polled(
        engine_snapshot(
            "0", detail("0", requests=RequestCounts(2, 1)), is_sleeping=False, has_work=True
        ),
        engine_snapshot(
            "1", detail("1", requests=RequestCounts(0, 0)), is_sleeping=False, has_work=False
        ),
        engine_snapshot(
            "2", detail("2", requests=RequestCounts(0, 0)), is_sleeping=False, has_work=timeout
        ),
        engine_snapshot("3", is_sleeping=False, has_work=False),  # a mode without counts
        engine_snapshot("4", is_sleeping=False, has_work="no"),  # not a boolean: unknown
        engine_snapshot(
            "5", detail("5", requests=RequestCounts(0, 4)), is_sleeping=False, has_work=False
        ),
        engine_snapshot("6", is_sleeping=False),  # has_work not read (unsupported)
        engine_snapshot(  # a listening poll: told by its counts, not asked
            "7",
            detail("7", requests=RequestCounts(0, 0)),
            is_sleeping=False,
            has_work=EngineOutcome("7", Outcome.OK, False, told=True),
        ),
    )
    doc = run_steps(status_steps(snap, CONFIG, now=60.0))
    validate_status(doc)
    engine = "asked"
    assert [e["activity"] for e in doc["engines"]] == [
        {"has_work": True, "has_work_read": engine, "running": 2, "waiting": 1, "drained": False},
        {"has_work": False, "has_work_read": engine, "running": 0, "waiting": 0, "drained": True},
        # Idle counts do not make an unanswered rank drained.
        {"has_work": None, "has_work_read": None, "running": 0, "waiting": 0, "drained": None},
        {
            "has_work": False,
            "has_work_read": engine,
            "running": None,
            "waiting": None,
            "drained": True,
        },
        {
            "has_work": None,
            "has_work_read": None,
            "running": None,
            "waiting": None,
            "drained": None,
        },
        # has_work says no, vLLM publishes queued requests: not drained.
        {"has_work": False, "has_work_read": engine, "running": 0, "waiting": 4, "drained": False},
        {
            "has_work": None,
            "has_work_read": None,
            "running": None,
            "waiting": None,
            "drained": None,
        },
        {"has_work": False, "has_work_read": "told", "running": 0, "waiting": 0, "drained": True},
    ]
    before = empty_snapshot([EngineDetail("0", True, "a")], expected=1, connected=1)
    (first,) = run_steps(status_steps(before, CONFIG, now=60.0))["engines"]
    assert first["activity"] == {
        "has_work": None,
        "has_work_read": None,
        "running": None,
        "waiting": None,
        "drained": None,
    }
