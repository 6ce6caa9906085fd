"""``exporter/metrics/families.py``: every series as plain rows from one snapshot plus the
counters (``family_steps``), and the prometheus_client view of them. That the text encoder
renders these rows byte for byte as prometheus_client does is tests/unit/metrics/test_exposition.py;
the fleet gauges over polls are tests/unit/control/test_fleet_semantics.py."""

from __future__ import annotations

from typing import Any

from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import run_steps
from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.control.poller import Poller
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot, empty_snapshot
from exporter.metrics.catalog import BY_NAME, ENGINE_STATES
from exporter.metrics.families import (
    ExporterCollector,
    Family,
    build_registry,
    family_steps,
)
from exporter.metrics.stats import Stats
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FaultStatus
from tests.harness.fakefleets import awake, fleet_of
from tests.harness.snapshots import engine_snapshot, polled

TIMEOUT = EngineOutcome("1", Outcome.TIMEOUT, error="no reply within 1s")


def engine(name: str, detail: EngineDetail | None = None, **answers: Any) -> EngineSnapshot:
    return engine_snapshot(name, detail, 100.0, **answers)


def families(snap: FleetSnapshot, **options: Any) -> dict[str, Family]:
    built = run_steps(family_steps(snap, Stats(), ProtocolErrorTally(), **options))
    return {f.spec.name: f for f in built}


def rows(fams: dict[str, Family], name: str) -> dict[tuple[str, ...], float]:
    return dict(fams[name].rows)


def test_an_unknown_engine_has_no_sleeping_series_and_its_state_says_unknown() -> None:
    snap = polled(
        engine("0", is_sleeping=True, is_scheduler_paused=True),
        engine("1", is_sleeping=TIMEOUT),
    )
    fams = families(snap)
    assert rows(fams, "vllm_dp_engine_up") == {("0",): 1.0, ("1",): 0.0}
    assert rows(fams, "vllm_dp_engine_sleeping") == {("0",): 1.0}
    assert rows(fams, "vllm_dp_engine_paused") == {("0",): 1.0}
    states = rows(fams, "vllm_dp_engine_state")
    assert [s for (e, s), v in states.items() if v == 1.0] == ["paused", "unknown"]
    assert len(states) == 2 * len(ENGINE_STATES)  # every state of every engine, one of them 1


def test_the_weight_version_series_names_the_version_of_an_engine_that_is_up() -> None:
    snap = polled(
        engine("0", is_sleeping=False, get_weight_version="step-7"),
        engine("1", is_sleeping=False, get_weight_version=None),
        engine("2", is_sleeping=TIMEOUT, get_weight_version="old"),
    )
    fams = families(snap)
    assert rows(fams, "vllm_dp_engine_weight_version_info") == {
        ("0", "step-7"): 1.0,
        ("1", ""): 1.0,
    }
    assert rows(fams, "vllm_dp_weight_version_consistent") == {(): 0.0}


def test_the_fault_tolerance_series_appear_only_once_an_engine_reported() -> None:
    silent = polled(engine("0", is_sleeping=False))
    assert "vllm_dp_engine_fault_tolerance_status" not in families(silent)
    assert "vllm_dp_fault_tolerance_faulty_engines" not in families(silent)
    assert "vllm_dp_engine_pushes_total" not in families(silent)
    dead = EngineDetail(
        "1",
        True,
        "a",
        fault_status=FaultStatus("dead", None, 1.0),
        pushes=(("fault_tolerance_status", 2),),
    )
    fams = families(polled(engine("0", is_sleeping=False), engine("1", dead, is_sleeping=False)))
    status = rows(fams, "vllm_dp_engine_fault_tolerance_status")
    assert status == {
        ("1", "healthy"): 0.0,
        ("1", "unhealthy"): 0.0,
        ("1", "dead"): 1.0,
        ("1", "paused"): 0.0,
        ("1", "recovering"): 0.0,
        ("1", "diagnosing"): 0.0,
        ("1", "other"): 0.0,
        ("1", "unknown"): 0.0,
    }
    assert rows(fams, "vllm_dp_fault_tolerance_faulty_engines") == {(): 1.0}
    assert rows(fams, "vllm_dp_engine_pushes_total") == {("1", "fault_tolerance_status"): 2.0}


def test_an_engine_info_series_only_for_an_engine_that_said_something() -> None:
    said = EngineDetail("1", True, "a", vllm_version="0.33.0")
    fams = families(polled(engine("0", is_sleeping=False), engine("1", said, is_sleeping=False)))
    (labels,) = rows(fams, "vllm_dp_engine_info")
    assert labels[:3] == ("1", "0.33.0", "unknown")


def test_before_the_first_poll_there_is_no_poll_time_and_no_fleet_value() -> None:
    snap = empty_snapshot([EngineDetail("0", False, "a")], expected=1, connected=0)
    fams = families(snap)
    assert rows(fams, "vllm_dp_poll_duration_seconds") == {}
    assert rows(fams, "vllm_dp_last_poll_timestamp_seconds") == {}
    assert (
        rows(fams, "vllm_dp_sleeping") == {} and rows(fams, "vllm_dp_sleep_state_consistent") == {}
    )
    assert rows(fams, "vllm_dp_fleet_state") == {
        ("consistent",): 0.0,
        ("inconsistent",): 0.0,
        ("unknown",): 1.0,
    }
    after = families(polled(engine("0", is_sleeping=False)))
    assert rows(after, "vllm_dp_poll_duration_seconds") == {(): 0.25}
    assert rows(after, "vllm_dp_last_poll_timestamp_seconds") == {(): 50.0}


def test_a_model_name_is_the_last_label_of_every_series() -> None:
    fams = families(polled(engine("0", is_sleeping=False)), model_name="llama")
    for fam in fams.values():
        assert fam.labels[-1] == "model_name" and fam.labels[:-1] == BY_NAME[fam.spec.name].labels
        assert all(values[-1] == "llama" for values, _ in fam.rows)
        assert all(values[-1] == "llama" for values, _, _ in fam.histograms)


def test_the_attach_modes_own_counters_are_rendered_as_given() -> None:
    counters = {"vllm_dp_relay_handshakes_total": {"relayed": 3, "refused": 1}}
    fams = families(polled(engine("0", is_sleeping=False)), client_counters=counters)
    assert rows(fams, "vllm_dp_relay_handshakes_total") == {("refused",): 1.0, ("relayed",): 3.0}
    assert "vllm_dp_relay_handshakes_total" not in families(polled(engine("0", is_sleeping=False)))


def test_the_collector_reads_the_snapshot_and_counters_at_every_collection() -> None:
    snaps = [polled(engine("0", is_sleeping=False))]
    stats = Stats()
    registry = build_registry(ExporterCollector(lambda: snaps[-1], stats, ProtocolErrorTally()))
    assert registry.get_sample_value("vllm_dp_engine_sleeping", {"engine": "0"}) == 0.0
    assert registry.get_sample_value("vllm_dp_polls_total") == 0.0
    snaps.append(polled(engine("0", is_sleeping=True)))
    stats.record_poll([])
    assert registry.get_sample_value("vllm_dp_engine_sleeping", {"engine": "0"}) == 1.0
    assert registry.get_sample_value("vllm_dp_polls_total") == 1.0
    assert registry.get_sample_value("vllm_dp_prefix_cache_reset_duration_seconds_count") == 0.0


def test_has_work_is_one_series_per_engine_that_answered_it_as_a_boolean() -> None:
    busy = EngineDetail("0", True, "a", requests=RequestCounts(running=2, waiting=3))
    idle = EngineDetail("1", True, "b", requests=RequestCounts(0, 0))
    snap = polled(
        engine("0", busy, is_sleeping=False, has_work=True),
        engine("1", idle, is_sleeping=False, has_work=False),
        engine("2", is_sleeping=False, has_work=TIMEOUT),
        engine("3", is_sleeping=False, has_work="yes"),  # not a boolean: unknown
        engine("4", is_sleeping=False, has_work=1),
        engine("5", is_sleeping=False),  # not asked (unsupported)
    )
    fams = families(snap)
    assert rows(fams, "vllm_dp_engine_has_work") == {("0",): 1.0, ("1",): 0.0}
    assert rows(fams, "vllm_dp_engine_requests") == {
        ("0", "running"): 2.0,
        ("0", "waiting"): 3.0,
        ("1", "running"): 0.0,
        ("1", "waiting"): 0.0,
    }


def test_request_counts_are_shown_where_known_even_when_has_work_is_not() -> None:
    counted = EngineDetail("0", True, "a", requests=RequestCounts(1, 0))
    fams = families(polled(engine("0", counted, is_sleeping=TIMEOUT, has_work=TIMEOUT)))
    assert rows(fams, "vllm_dp_engine_has_work") == {}
    assert rows(fams, "vllm_dp_engine_requests") == {("0", "running"): 1.0, ("0", "waiting"): 0.0}
    none = families(polled(engine("0", is_sleeping=False, has_work=False)))
    assert rows(none, "vllm_dp_engine_requests") == {}  # owner and relay mode: no counts


async def test_work_on_some_ranks_is_no_inconsistency() -> None:
    values = awake(("0", "1", "2"), changed={"1": {"has_work": True}})
    stats = Stats()
    poller = Poller(fleet_of(values), stats, interval_s=60.0, call_timeout_s=1.0)
    snap = await poller.poll_once()
    assert "has_work" not in snap.verdicts  # no fleet verdict: ranks differ by design
    assert [e.has_work for e in snap.engines] == [False, True, False]
    built = run_steps(family_steps(snap, stats, ProtocolErrorTally()))
    fams = {f.spec.name: f for f in built}
    inconsistent = rows(fams, "vllm_dp_inconsistent_utility_results_total")
    assert not any(inconsistent.values()) and ("has_work",) not in inconsistent
    assert sum(stats.inconsistent_results.values()) == 0
    assert rows(fams, "vllm_dp_engine_has_work") == {("0",): 0.0, ("1",): 1.0, ("2",): 0.0}
    assert rows(fams, "vllm_dp_fleet_state")[("consistent",)] == 1.0
