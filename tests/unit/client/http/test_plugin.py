"""``has_work`` and the request counts of a plugin-enabled server's ranks, socket-free: one
``/dp/gate`` answer → each rank's ``has_work`` outcome and its ``requests`` (``gate_outcomes``,
``gate_counts``; over real HTTP: tests/integration/http/test_http_activity.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.plugin import (
    GATE_KEYS,
    MAX_ENGINES,
    gate_counts,
    gate_engines,
    gate_outcomes,
)
from exporter.fleetstate.invariants import READS, is_unsupported
from exporter.protocol.activity import MAX_REQUESTS, RequestCounts


def gate(*engines: dict[str, Any]) -> bytes:
    return json.dumps({"ok": True, "engines": list(engines)}).encode()


def engine(
    rank: str, requests: Any = None, failures: list[str] | None = None, **values: Any
) -> dict[str, Any]:
    entry = {"engine": rank, "ok": True, "values": values, "failures": failures or []}
    if requests is not None:
        entry["requests"] = requests
    return entry


def counts(running: Any, waiting: Any) -> dict[str, Any]:
    return {"running": running, "waiting": waiting}


def test_every_poll_read_has_a_gate_key() -> None:
    assert {inv.method for inv in READS} == set(GATE_KEYS)
    assert GATE_KEYS["has_work"] == "has_work"


def test_each_rank_has_its_own_has_work_and_counts() -> None:
    body = gate(
        engine("0", counts(2, 1), sleeping=False, has_work=True),
        engine("1", counts(0, 0), sleeping=False, has_work=False),
    )
    outcomes = gate_outcomes("a", ["0", "1"], "has_work", 200, body, 0.01)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("a/0", Outcome.OK, True),
        ("a/1", Outcome.OK, False),
    ]
    assert gate_counts(200, body) == {"0": RequestCounts(2, 1), "1": RequestCounts(0, 0)}
    # A gate that failed (412) still carries every rank's reads.
    assert gate_counts(412, body) == gate_counts(200, body)


HOSTILE_COUNTS = {
    "negative": counts(-1, 0),
    "huge": counts(MAX_REQUESTS + 1, 0),
    "float_huge": counts(1e30, 0),
    "fraction": counts(0.5, 0),
    "string": counts("3", 0),
    "bool": counts(True, False),
    "null_count": counts(None, 0),
    "missing_waiting": {"running": 0},
    "list": [0, 0],
    "string_object": "0,0",
    "number": 0,
    "nested": {"running": {"n": 1}, "waiting": 0},
}


@pytest.mark.parametrize("value", HOSTILE_COUNTS.values(), ids=HOSTILE_COUNTS.keys())
@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
def test_counts_that_are_not_counts_leave_that_rank_unknown(value: Any, position: int) -> None:
    entries = [engine(str(r), counts(r, 0), sleeping=False, has_work=r > 0) for r in range(3)]
    entries[position]["requests"] = value
    found = gate_counts(200, gate(*entries))
    assert found == {str(r): RequestCounts(r, 0) for r in range(3) if r != position}
    # The rank itself still answers: its counts alone are unknown.
    assert gate_engines(200, gate(*entries)) == ["0", "1", "2"]


def test_absent_or_null_counts_are_unknown_not_zero() -> None:
    body = gate(
        engine("0", sleeping=False, has_work=False),
        {**engine("1", sleeping=False, has_work=False), "requests": None},
    )
    assert gate_counts(200, body) == {}


@pytest.mark.parametrize(
    ("status", "text"),
    [(404, b"{}"), (500, gate()), (200, b"not json"), (200, b'{"engines": 3}'), (200, b"[]")],
)
def test_an_answer_that_is_no_gate_document_has_no_counts(status: int, text: bytes) -> None:
    assert gate_counts(status, text) is None


def test_counts_of_at_most_1024_ranks_are_read() -> None:
    entries = [engine(str(r), counts(1, 0), has_work=True) for r in range(MAX_ENGINES + 5)]
    found = gate_counts(200, gate(*entries))
    assert found is not None and len(found) == MAX_ENGINES


def test_has_work_the_gate_could_not_read_keeps_its_kind() -> None:
    body = gate(
        engine("0", failures=["has_work: timeout"], sleeping=False),
        engine("1", failures=["has_work: unsupported by this engine"], sleeping=False),
        engine("2", failures=["has_work: failed (boom)"], sleeping=False),
    )
    outcomes = gate_outcomes("a", ["0", "1", "2"], "has_work", 200, body, 0.01)
    assert [o.outcome for o in outcomes] == [Outcome.TIMEOUT, Outcome.FAILED, Outcome.FAILED]
    assert [is_unsupported(o) for o in outcomes] == [False, True, False]


def test_a_bare_gates_unread_has_work_is_read_as_a_failure() -> None:
    entry = engine("0", sleeping=False)
    entry["unread"] = ["has_work: unsupported by this engine"]
    (outcome,) = gate_outcomes("a", ["0"], "has_work", 200, gate(entry), 0.01)
    assert is_unsupported(outcome)


def test_a_plugin_that_never_heard_of_has_work_is_unsupported_not_idle() -> None:
    """An older plugin's entries have neither a value nor a failure for it."""
    body = gate(engine("0", sleeping=False, paused=False, weight_version="v1"))
    (outcome,) = gate_outcomes("a", ["0"], "has_work", 200, body, 0.01)
    assert outcome.outcome is Outcome.FAILED and is_unsupported(outcome), outcome
    # The invariants keep their rule: missing is a failure, never "unsupported".
    body = gate(engine("0", has_work=False))
    (outcome,) = gate_outcomes("a", ["0"], "is_sleeping", 200, body, 0.01)
    assert outcome.outcome is Outcome.FAILED and not is_unsupported(outcome)


def test_a_has_work_that_is_not_a_boolean_is_passed_on_for_the_type_check() -> None:
    """``require_type`` (every attach mode's) makes it a failure; here it is only bounded."""
    (outcome,) = gate_outcomes(
        "a", ["0"], "has_work", 200, gate(engine("0", has_work="x" * 5000)), 0.01
    )
    assert outcome.outcome is Outcome.OK and isinstance(outcome.value, str)
    assert len(outcome.value) < 5000


@pytest.mark.parametrize(
    "rank",
    ["\u00b2", "\u0661", "\uff11", "1\u0661", " 1", "+1"],
    ids=["superscript", "arabic", "fullwidth", "mixed", "space", "plus"],
)
def test_a_rank_that_is_not_ascii_digits_is_that_entry_unreadable(rank: str) -> None:
    """Ranks are ASCII digits only: "²" passes ``str.isdigit`` and makes ``int()`` raise, the
    Arabic-Indic and fullwidth one (U+0661, U+FF11) read as rank 1. That entry is dropped like
    any malformed one; ranks 0 and 1 read right, no rank 1 made of another, nothing raised."""
    body = gate(
        engine("0", counts(0, 0), sleeping=False),
        engine("1", counts(1, 0), sleeping=False),
        engine(rank, counts(5, 5), sleeping=True),
    )
    assert gate_engines(200, body) == ["0", "1"]
    assert gate_counts(200, body) == {"0": RequestCounts(0, 0), "1": RequestCounts(1, 0)}
    outcomes = gate_outcomes("a", ["0", "1"], "is_sleeping", 200, body, 0.01)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("a/0", Outcome.OK, False),
        ("a/1", Outcome.OK, False),
    ]
