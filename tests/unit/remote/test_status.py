"""``/status`` typed: each verdict's outcome, each engine's row and each API server's
elastic-EP operation, with missing keys defaulted and wrong types refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.remote.errorbase import InvalidAnswer
from exporter.remote.status import (
    INVARIANTS,
    ElasticEpOperationStatus,
    EngineInvariant,
    EngineStatus,
    Status,
    Verdict,
)

ROW: dict[str, Any] = {
    "engine": "3",
    "connected": True,
    "up": True,
    "state": "awake",
    "vllm_version": "0.33.0",
    "front_end": "rust",
    "rust_frontend_version": "0.2.1",
    "address": "tcp://10.0.0.3:5555",
    "handshakes": 2,
    "invariants": {
        "is_sleeping": {"value": False, "outcome": "ok"},
        "get_weight_version": {"value": "v9", "outcome": "ok"},
        "is_scheduler_paused": {"outcome": "timeout", "error": "no answer in 10s"},
    },
}


def test_a_verdict_s_outcome_is_its_state_unless_the_server_says_otherwise() -> None:
    plain = Verdict.from_json({"state": "inconsistent", "missing": [2]}, "aggregate.x")
    assert (plain.state, plain.outcome, plain.missing, plain.supported) == (
        "inconsistent",
        "inconsistent",
        ("2",),  # a numeric index becomes the label /status uses
        True,
    )
    old = Verdict.from_json(
        {"state": "unknown", "outcome": "unsupported", "supported": False, "unsupported": ["0"]},
        "aggregate.is_scheduler_paused",
    )
    assert (old.outcome, old.supported, old.unsupported) == ("unsupported", False, ("0",))
    assert not old.consistent and Verdict.from_json({}, "a").state == "unknown"
    assert Verdict.from_json({}, "a").outcome is None


def test_an_engine_row_reads_every_field() -> None:
    row = EngineStatus.from_json(ROW, "engines[0]")
    assert (row.engine, row.front_end, row.rust_frontend_version) == ("3", "rust", "0.2.1")
    assert (row.address, row.handshakes, row.vllm_version) == ("tcp://10.0.0.3:5555", 2, "0.33.0")
    assert row.weight_version == "v9"
    assert row.invariants["is_scheduler_paused"] == EngineInvariant(
        None, "timeout", "no answer in 10s"
    )
    assert set(row.invariants) == set(INVARIANTS)


def test_a_down_engine_has_no_weight_version_even_if_one_was_read() -> None:
    row = EngineStatus.from_json({**ROW, "up": False}, "engines[0]")
    assert row.weight_version is None
    assert row.invariants["get_weight_version"].value == "v9"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"handshakes": "2"}, "engines[0].handshakes must be an integer or null"),
        ({"front_end": 1}, "engines[0].front_end must be a string or null"),
        ({"invariants": {"is_sleeping": []}}, "engines[0].invariants.is_sleeping must be"),
        ({"fault_tolerance": {"status": 3}}, "engines[0].fault_tolerance.status must be"),
        ({"routable": {"reasons": "hung"}}, "engines[0].routable.reasons must be a list"),
        ({"unresponsive_seconds": True}, "engines[0].unresponsive_seconds must be a number"),
    ],
)
def test_a_row_of_the_wrong_type_names_the_field(change: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidAnswer) as bad:
        EngineStatus.from_json({**ROW, **change}, "engines[0]")
    assert says in str(bad.value)


def test_an_elastic_ep_operation() -> None:
    failed = ElasticEpOperationStatus.from_json(
        {
            "target": "node0",
            "phase": "failed",
            "scaling": False,
            "epoch": "7",
            "error": "worker died",
            "requested_data_parallel_size": 8,
            "read_at_unix": 1700000000,
        },
        "elastic_ep_operations[0]",
    )
    assert failed.failed and failed.requested_data_parallel_size == 8
    assert failed.read_at_unix == 1700000000.0 and failed.supported
    unknown = ElasticEpOperationStatus.from_json(
        {"target": "node1", "phase": None, "problem": "HTTP 500"}, "e"
    )
    assert not unknown.failed and unknown.phase is None and unknown.problem == "HTTP 500"
    with pytest.raises(InvalidAnswer, match=r"elastic_ep_operations\[2\].target must be"):
        ElasticEpOperationStatus.from_json({"phase": "idle"}, "elastic_ep_operations[2]")
    with pytest.raises(InvalidAnswer, match="requested_data_parallel_size must be a count"):
        ElasticEpOperationStatus.from_json({"target": "n", "requested_data_parallel_size": -1}, "e")


def test_elastic_ep_operations_absent_is_none_not_empty() -> None:
    """None: the mode has no API server to ask; an empty tuple would claim it asked none."""
    assert Status.from_json({}).elastic_ep_operations is None
    assert Status.from_json({"elastic_ep_operations": None}).elastic_ep_operations is None
    assert Status.from_json({"elastic_ep_operations": []}).elastic_ep_operations == ()
    ops = Status.from_json(
        {"elastic_ep_operations": [{"target": "a", "phase": "idle"}, {"target": "b"}]}
    ).elastic_ep_operations
    assert ops is not None and [o.target for o in ops] == ["a", "b"]
    with pytest.raises(InvalidAnswer, match=r"elastic_ep_operations\[1\]"):
        Status.from_json({"elastic_ep_operations": [{"target": "a"}, {"phase": "idle"}]})


def test_a_document_s_engines_are_found_by_label_or_index() -> None:
    status = Status.from_json({"generated_unix": 5, "engines": [ROW, {**ROW, "engine": "node1/0"}]})
    assert status.engine(3) is status.engines[0] and status.engine("3") is status.engines[0]
    assert status.engine("node1/0").engine == "node1/0"
    assert status.generated_unix == 5.0
    with pytest.raises(KeyError):
        status.engine(4)


def test_the_fleet_is_consistent_only_on_its_sleeping_verdict() -> None:
    agree = {"is_sleeping": {"state": "consistent", "value": False}}
    split = {**agree, "get_weight_version": {"state": "inconsistent"}}
    assert Status.from_json({"aggregate": split}).consistent
    assert not Status.from_json({"aggregate": {"is_sleeping": {"state": "unknown"}}}).consistent
    assert not Status.from_json({"aggregate": {}}).consistent
