"""``GET /routable``, ``GET /readyz?engine=N`` and the ``routable`` entries of ``/status``
from a hand-built snapshot: the verdicts and their reasons as JSON, the statuses, and an
unknown engine named safely."""

from __future__ import annotations

from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.snapshot import EngineSnapshot
from exporter.protocol.pushes import FaultStatus
from exporter.web.routabledoc import engine_readiness, routable_document, routable_json
from tests.harness.snapshots import engine_snapshot, polled


def ready(name: str) -> EngineSnapshot:
    return engine_snapshot(name, is_sleeping=False, is_scheduler_paused=False)


def asleep(name: str, paused: bool = False) -> EngineSnapshot:
    return engine_snapshot(name, is_sleeping=True, is_scheduler_paused=paused)


def faulty(name: str) -> EngineSnapshot:
    status = FaultStatus("unhealthy", "RuntimeError", 10.0)
    return engine_snapshot(
        name,
        EngineDetail(name, True, "fake://", fault_status=status),
        is_sleeping=False,
        is_scheduler_paused=False,
    )


def timed_out(name: str) -> EngineSnapshot:
    return engine_snapshot(name, is_sleeping=EngineOutcome(name, Outcome.TIMEOUT, None))


def test_an_engine_entry_is_the_verdict_and_its_reasons() -> None:
    assert routable_json(ready("0")) == {"routable": True, "reasons": []}
    assert routable_json(faulty("1")) == {
        "routable": False,
        "reasons": ["fault tolerance: unhealthy (RuntimeError)"],
    }
    assert routable_json(asleep("3", paused=True))["reasons"] == ["paused"], "paused wins"
    assert routable_json(timed_out("2")) == {
        "routable": False,
        "reasons": ["no answer in the last poll (timeout)"],
    }


def test_the_document_lists_every_rank_and_the_routable_ones() -> None:
    snap = polled(ready("0"), asleep("1"), ready("2"), taken_at_unix=1234.5)
    doc = routable_document(snap)
    assert doc["poll"] == 1 and doc["taken_at_unix"] == 1234.5
    assert doc["routable_engines"] == ["0", "2"]
    assert doc["engines"][1] == {"engine": "1", "routable": False, "reasons": ["asleep"]}
    assert [e["engine"] for e in doc["engines"]] == ["0", "1", "2"]


def test_before_any_poll_the_time_is_null() -> None:
    assert routable_document(polled(ready("0"), taken_at_unix=0.0))["taken_at_unix"] is None


def test_readiness_of_one_engine_is_200_or_503_with_reasons() -> None:
    snap = polled(ready("0"), asleep("1"))
    assert engine_readiness(snap, "0") == (
        200,
        {"engine": "0", "poll": 1, "routable": True, "reasons": []},
    )
    status, body = engine_readiness(snap, "1")
    assert (status, body["routable"], body["reasons"]) == (503, False, ["asleep"])


def test_an_unknown_engine_is_a_404_naming_the_known_ones_and_a_short_echo() -> None:
    snap = polled(ready("0"), ready("1"))
    status, body = engine_readiness(snap, "7" * 500)
    assert status == 404
    assert body["error"] == f"no engine {'7' * 64!r} (known: 0, 1)"
