"""HTTP mode over plugin-enabled servers, socket-free: one ``/dp/gate`` answer becomes one
outcome per engine for each read method (the same over real HTTP:
tests/integration/inprocess/test_http_mode_over_plugin.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.plugin import (
    engine_label,
    gate_engines,
    gate_outcomes,
    is_plugin_url,
    server_root,
)
from exporter.client.http.replies import fault_entries, worst_fault_status
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.pushes import FT_STATE_VALUES, RankStatus
from exporter.protocol.strings import MAX_ENGINE_STRING


def gate(*engines: dict[str, Any], ok: bool = True) -> bytes:
    return json.dumps({"ok": ok, "engines": list(engines)}).encode()


def engine(rank: str, failures: list[str] | None = None, **values: Any) -> dict[str, Any]:
    return {"engine": rank, "ok": not failures, "values": values, "failures": failures or []}


@pytest.mark.parametrize(
    ("url", "plugin"),
    [
        ("http://127.0.0.1:8000/dp", True),
        ("http://127.0.0.1:8000/dp/", True),
        ("http://127.0.0.1:8000/v1/dp", True),
        ("http://127.0.0.1:8000", False),
        ("http://127.0.0.1:8000/dpx", False),
    ],
)
def test_a_plugin_target_is_a_url_ending_in_dp(url: str, plugin: bool) -> None:
    assert is_plugin_url(url) is plugin


def test_every_engine_of_a_gate_answer_is_one_outcome_per_read_method() -> None:
    body = gate(
        engine("0", sleeping=False, paused=False, weight_version="v1"),
        engine("1", sleeping=True, paused=False, weight_version="v2"),
    )
    assert gate_engines(200, body) == ["0", "1"]
    sleeping = gate_outcomes("a", ["0", "1"], "is_sleeping", 200, body, 0.01)
    assert [(o.engine, o.outcome, o.value) for o in sleeping] == [
        ("a/0", Outcome.OK, False),
        ("a/1", Outcome.OK, True),
    ]
    versions = gate_outcomes("a", ["0", "1"], "get_weight_version", 200, body, 0.01)
    assert [o.value for o in versions] == ["v1", "v2"]


def test_the_gates_failures_keep_their_kind_and_unsupported_stays_unsupported() -> None:
    body = gate(
        engine("0", ["sleeping: timeout (no reply within 1s)"]),
        engine("1", ["sleeping: disconnected (engine gone)"]),
        engine("2", ["sleeping: failed (boom)"]),
        engine("3", ["sleeping: unsupported by this engine"]),
        ok=False,
    )
    got = gate_outcomes("a", ["0", "1", "2", "3"], "is_sleeping", 412, body, 0.01)
    assert [o.outcome for o in got] == [
        Outcome.TIMEOUT,
        Outcome.DISCONNECTED,
        Outcome.FAILED,
        Outcome.FAILED,
    ]
    assert got[2].error == "failed (boom)"
    assert is_unsupported(got[3]) and not is_unsupported(got[2])


def test_an_engine_the_answer_does_not_name_is_disconnected() -> None:
    body = gate(engine("0", sleeping=False))
    got = gate_outcomes("a", ["0", "1"], "is_sleeping", 200, body, 0.0)
    assert [o.outcome for o in got] == [Outcome.OK, Outcome.DISCONNECTED]


@pytest.mark.parametrize(
    ("status", "body", "kind", "text"),
    [
        (404, b"Not Found", Outcome.FAILED, "no dp_exporter plugin"),
        (503, b'{"ok": false, "error": "not started"}', Outcome.DISCONNECTED, "not started"),
        (500, b"\xff\xfe", Outcome.FAILED, "HTTP 500"),
        (200, b"[" * 100_000, Outcome.FAILED, "HTTP 200"),
        (200, b'{"engines": "no"}', Outcome.FAILED, "HTTP 200"),
    ],
)
def test_an_answer_that_is_not_a_gate_document_fails_every_engine(
    status: int, body: bytes, kind: Outcome, text: str
) -> None:
    got = gate_outcomes("a", ["0", "1"], "is_sleeping", status, body, 0.0)
    assert [o.outcome for o in got] == [kind, kind]
    assert all(o.error is not None and text in o.error for o in got)
    assert gate_engines(status, body) is None


def test_hostile_entries_are_dropped_and_long_strings_cut() -> None:
    huge = "x" * 1_000_000
    body = gate(
        {"engine": 0, "values": {}, "failures": []},  # not a string rank
        {"engine": "../etc", "values": {}, "failures": []},
        {"engine": "1234567", "values": {}, "failures": []},  # more than 5 digits
        "not an entry",  # type: ignore[arg-type]
        engine("0", weight_version=huge),
        engine("1", [f"sleeping: failed ({huge})"]),
    )
    assert gate_engines(200, body) == ["0", "1"]
    (value,) = gate_outcomes("a", ["0"], "get_weight_version", 200, body, 0.0)
    assert len(value.value.encode()) <= MAX_ENGINE_STRING
    (failed,) = gate_outcomes("a", ["1"], "is_sleeping", 200, body, 0.0)
    assert failed.error is not None and len(failed.error.encode()) <= MAX_ENGINE_STRING


def test_at_most_1024_engines_are_believed() -> None:
    body = gate(*(engine(str(i), sleeping=False) for i in range(5000)))
    ranks = gate_engines(200, body)
    assert ranks is not None and len(ranks) == 1024
    assert engine_label("a", "7") == "a/7"


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://10.0.0.5:8000/dp", "http://10.0.0.5:8000"),
        ("http://10.0.0.5:8000/dp/", "http://10.0.0.5:8000"),
        ("http://h:8000/prefix/dp", "http://h:8000/prefix"),
        ("https://[::1]:8443/dp", "https://[::1]:8443"),
    ],
)
def test_a_plugin_target_s_fault_status_is_asked_at_its_server_s_root(url: str, root: str) -> None:
    assert is_plugin_url(url) and server_root(url) == root


def test_fault_entries_are_per_rank_and_the_worst_is_the_server_s() -> None:
    body = json.dumps(
        {
            "engines": [
                {"id": 2, "status": "dead", "fault_info": "gone"},
                {"id": 0, "status": "healthy"},
                {"id": 1, "status": "unhealthy"},
            ]
        }
    ).encode()
    ranks = fault_entries(body)
    assert ranks == [
        RankStatus(0, "healthy", None),
        RankStatus(1, "unhealthy", None),
        RankStatus(2, "dead", "gone"),
    ]
    assert worst_fault_status(ranks) == ("dead", "rank 1: unhealthy; rank 2: gone")
    odd = json.dumps({"engines": [{"id": 0, "status": "healthy"}, {"id": 1, "status": 3}]})
    ranks = fault_entries(odd.encode())
    assert ranks[1].status == "unknown" and ranks[1].problem
    assert worst_fault_status(ranks) == ("unknown", f"rank 1: {ranks[1].fault_info}")
    assert worst_fault_status([]) is None
    twice = {"engines": [{"id": 0, "status": "healthy"}, {"id": 0, "status": "dead"}]}
    with pytest.raises(ValueError, match="twice"):
        fault_entries(json.dumps(twice).encode())


#: Worst last, as a server read as one engine reports its ranks (replies._FT_SEVERITY).
FT_ORDER = (
    "healthy",
    "paused",
    "recovering",
    "diagnosing",
    "unhealthy",
    "other",
    "unknown",
    "dead",
)


def test_the_worst_of_every_pair_of_statuses_wins() -> None:
    """Every value of the state set is ranked: a server with two ranks is the worse of them,
    ``fault_info`` naming each rank that is not healthy (an ``other`` rank's own string)."""
    assert set(FT_ORDER) == set(FT_STATE_VALUES)
    sent: dict[str, object] = {s: s if s != "other" else "zzz-new" for s in FT_ORDER}
    sent["unknown"] = 7  # no string: unreadable
    for i, better in enumerate(FT_ORDER):
        for worse in FT_ORDER[i:]:
            entries = [{"id": 0, "status": sent[better]}, {"id": 1, "status": sent[worse]}]
            ranks = fault_entries(json.dumps({"engines": entries}).encode())
            found = worst_fault_status(ranks)
            assert found is not None and found[0] == worse, (better, worse)
    mixed = [{"id": 0, "status": "paused"}, {"id": 1, "status": "zzz-new"}]
    ranks = fault_entries(json.dumps({"engines": mixed}).encode())
    assert [r.problem for r in ranks] == [None, None]
    assert worst_fault_status(ranks) == ("other", "rank 0: paused; rank 1: status 'zzz-new'")
