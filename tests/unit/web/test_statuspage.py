"""The /status document's schema (docs/status.md), the history ring, and the page's
escaping and Content-Security-Policy, over the in-memory ``FakeFleet``."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import re
from html import escape
from typing import Any

from exporter.base.steps import run_steps
from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.fleetstate.history import FleetHistory
from exporter.web.statusdoc import SCHEMA_VERSION, status_steps
from exporter.web.statuspage import CSP, HEADERS, activity_cell, age, page_steps
from tests.harness.statusschema import validate_status
from tests.unit.control.test_fleet_semantics import make_exporter

HOSTILE = '<script>alert("x")</script>&<img src=x onerror=alert(1)>'


def fleet(per_engine: dict[str, dict[str, Any]], **kw: Any) -> FakeFleet:
    return FakeFleet(answers(per_engine), engines=tuple(per_engine), **kw)


def awake(version: str | None = "v1") -> dict[str, Any]:
    return {"is_sleeping": False, "is_scheduler_paused": False, "get_weight_version": version}


async def test_document_validates_before_and_after_polls() -> None:
    exporter = make_exporter(fleet({"0": awake(), "1": awake("v2")}))
    poller = exporter.poller
    doc = run_steps(status_steps(poller.snapshot, exporter.config, exporter.stats, poller.history))
    validate_status(doc)
    assert doc["schema_version"] == SCHEMA_VERSION == 1
    assert doc["last_poll"]["number"] == 0 and doc["history"]["entries"] == []
    assert {v["state"] for v in doc["aggregate"].values()} == {"unknown"}

    await poller.poll_once()
    doc = run_steps(status_steps(poller.snapshot, exporter.config, exporter.stats, poller.history))
    validate_status(doc)
    weights = doc["aggregate"]["get_weight_version"]
    assert weights["state"] == "inconsistent" and weights["consistent"] is False
    assert weights["by_engine"] == {"0": "v1", "1": "v2"}
    assert doc["aggregate"]["is_sleeping"]["state"] == "consistent"
    # Every invariant has the same keys, in the aggregate and per engine.
    assert len({tuple(v) for v in doc["aggregate"].values()}) == 1
    for e in doc["engines"]:
        assert set(e["invariants"]) == set(doc["aggregate"])
        assert len({tuple(i) for i in e["invariants"].values()}) == 1
    assert doc["engines"][1]["invariants"]["get_weight_version"] == {
        "value": "v2",
        "outcome": "ok",
        "error": None,
        "values": None,
    }
    assert doc["counters"]["inconsistencies"]["get_weight_version"] == 1
    assert doc["history"]["entries"][0]["states"]["get_weight_version"] == "inconsistent"
    # The pre-schema keys are gone: each invariant lives in "aggregate" and "invariants" only.
    assert not {"consistent", "is_scheduler_paused"} & set(doc)
    pre_schema = {"outcome", "value", "paused", "error", "values", "weight_version"}
    assert not [e["engine"] for e in doc["engines"] if pre_schema & set(e)]


async def test_unsupported_and_silent_engines_are_named() -> None:
    timeout = EngineOutcome("2", Outcome.TIMEOUT, error="no answer within 1.0s")
    per_engine = {"0": awake(), "1": {"is_sleeping": False, "is_scheduler_paused": False}}

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        return timeout if engine == "2" else answers(per_engine)(engine, method, args)

    fake = FakeFleet(handler, engines=("0", "1", "2"), disconnected=set())
    exporter = make_exporter(fake)
    await exporter.poller.poll_once()
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    weights = doc["aggregate"]["get_weight_version"]
    assert weights["unsupported"] == ["1"] and weights["missing"] == ["2"]
    assert weights["state"] == "unknown"
    assert doc["engines"][1]["invariants"]["get_weight_version"]["outcome"] == "unsupported"
    assert doc["engines"][2]["invariants"]["is_sleeping"]["outcome"] == "timeout"
    assert doc["counters"]["failed_calls"]["is_sleeping"] == 1


async def test_a_mode_without_the_paused_query_says_so() -> None:
    fake = fleet({"0": awake()}, unsupported=frozenset({"is_scheduler_paused"}))
    exporter = make_exporter(fake)
    await exporter.poller.poll_once()
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    paused = doc["aggregate"]["is_scheduler_paused"]
    assert paused["supported"] is False and paused["state"] == "unknown"
    assert doc["engines"][0]["invariants"]["is_scheduler_paused"]["outcome"] is None
    assert "not asked in this attach mode" in run_steps(page_steps(doc))


def test_last_action_and_counters() -> None:
    exporter = make_exporter(fleet({"0": awake(), "1": awake()}))
    stats = exporter.stats
    body = {
        "action": "pause",
        "outcome": "partial_failure",
        "params": {"mode": "abort"},
        "duration_s": 0.25,
        "engines": [
            {"engine": 0, "ok": True, "reason": None, "error": None},
            {"engine": 1, "ok": False, "reason": "unverified", "error": HOSTILE},
        ],
    }
    stats.record_action("pause", "partial_failure", [("1", "unverified")])
    stats.record_last_action("pause", 502, body, unix=1_700_000_000.0)
    doc = run_steps(
        status_steps(exporter.poller.snapshot, exporter.config, stats, now=1_700_000_005.0)
    )
    validate_status(doc)
    last = doc["last_action"]
    assert last["action"] == "pause" and last["status"] == 502 and last["success"] is False
    assert last["failed_engines"] == ["1"] and last["engines"][0]["engine"] == "0"
    assert doc["counters"]["actions"] == {"pause": {"partial_failure": 1}}
    assert doc["counters"]["actions_by_outcome"]["partial_failure"] == 1
    page = run_steps(page_steps(doc))
    assert "PARTIAL_FAILURE</strong> (HTTP 502)" in page and "5.0 s ago" in page


def test_history_ring_is_bounded_and_keeps_the_worst_state() -> None:
    history = FleetHistory(bucket_s=30, window_s=3600)
    assert history.capacity == 120
    history.record(0.0, {"is_sleeping": "consistent"}, 4, 4)
    history.record(10.0, {"is_sleeping": "inconsistent"}, 3, 4)
    history.record(20.0, {"is_sleeping": "unknown"}, 4, 4)
    (entry,) = history.entries()
    assert entry.polls == 3 and entry.states["is_sleeping"] == "inconsistent"
    assert entry.engines_up_min == 3 and entry.end_unix == 20.0
    for i in range(1, 1000):
        history.record(i * 30.0, {"is_sleeping": "consistent"}, 4, 4)
    assert len(history) == 120
    now = 999 * 30.0
    assert all(e.end_unix >= now - 3600 for e in history.entries(now))
    assert len(history.entries(now + 1815)) == 60  # half an hour later: half the ring


async def test_every_engine_string_is_escaped() -> None:
    per_engine = {HOSTILE: {**awake(HOSTILE)}, "1": awake("v1")}
    fake = fleet(per_engine, vllm_version=HOSTILE)
    exporter = make_exporter(fake)
    exporter.config = dataclasses.replace(exporter.config, model_name=HOSTILE)
    await exporter.poller.poll_once()
    exporter.stats.record_last_action(
        "weight_version",
        502,
        {
            "outcome": "partial_failure",
            "params": {"weight_version": HOSTILE},
            "error": HOSTILE,
            "engines": [{"engine": HOSTILE, "ok": False, "reason": "failed", "error": HOSTILE}],
        },
    )
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    page = run_steps(page_steps(doc))
    assert page.count("<script") == 1 and "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&lt;img" in page


def test_csp_allows_exactly_the_inline_style_and_script() -> None:
    page = run_steps(
        page_steps(
            {
                "generated_unix": 0.0,
                "model_name": None,
                "version": "0",
                "attach": "owner",
                "engines_expected": 0,
                "engines_connected": 0,
                "last_poll": {"number": 0, "unix": None, "duration_s": None},
                "aggregate": {},
                "engines": [],
                "last_action": None,
                "counters": {
                    "since_unix": 0.0,
                    "polls": 0,
                    "inconsistencies": {},
                    "failed_calls": {},
                    "failed_calls_total": 0,
                    "actions": {},
                    "actions_by_outcome": {},
                },
                "history": {"bucket_s": 30, "window_s": 3600, "entries": []},
            }
        )
    )
    blocks = re.findall(r"<(style|script)>(.*?)</\1>", page, re.S)
    assert [tag for tag, _ in blocks] == ["style", "script"]
    for tag, content in blocks:
        digest = base64.b64encode(hashlib.sha256(content.encode()).digest()).decode()
        assert f"{tag}-src 'sha256-{digest}'" in CSP
    assert "default-src 'none'" in CSP and "connect-src 'self'" in CSP
    assert "unsafe-inline" not in CSP and "http" not in CSP
    assert HEADERS["Content-Security-Policy"] == CSP
    # No external resource anywhere: every link and fetch is relative to this origin.
    assert " src=" not in page and not re.search(r"""href=["']?(https?:)?//""", page)


def test_ages_read_like_a_clock() -> None:
    assert [age(None), age(0.42), age(42), age(185), age(7300)] == [
        "never",
        "0.4 s",
        "42 s",
        "3 min 5 s",
        "2 h 1 min",
    ]


async def test_each_engine_s_activity_has_a_column() -> None:
    """has work / drained / unknown, with "running N, waiting M" where vLLM published them;
    an engine string in the same row stays escaped."""
    per_engine = {
        "0": {**awake(), "has_work": True},
        "1": {**awake(), "has_work": False},
        HOSTILE: awake(),  # no has_work answer: unknown
        "3": {**awake(), "has_work": False},
    }
    exporter = make_exporter(fleet(per_engine))
    await exporter.poller.poll_once()
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    doc["engines"][0]["activity"].update(running=2, waiting=1)  # as HTTP mode publishes them
    doc["engines"][1]["activity"].update(running=0, waiting=0)
    validate_status(doc)
    assert [e["activity"]["drained"] for e in doc["engines"]] == [False, True, None, True]
    page = run_steps(page_steps(doc))
    cells = re.findall(r'<td class="act act-(\w+)" data-activity="\1">([^<]*)</td>', page)
    assert cells == [
        ("busy", "has work (running 2, waiting 1)"),
        ("drained", "drained (running 0, waiting 0)"),
        ("unknown", "unknown"),
        ("drained", "drained"),
    ]
    assert "<th>activity</th>" in page and "<img" not in page
    assert f'data-engine="{escape(HOSTILE)}"' in page
    # Every row has as many cells as the table has headers.
    headers = len(re.findall(r"<th>", page.split('id="engines"')[1].split("</thead>")[0]))
    rows = re.findall(r"<tr data-engine=.*?</tr>", page.split('id="engine-rows"')[1])
    assert {row.count("<td") for row in rows[:4]} == {headers}


def test_activity_cells_of_older_and_partial_documents() -> None:
    assert activity_cell(None) == ("unknown", "unknown")  # an exporter before the field
    assert activity_cell({"has_work": True, "drained": False}) == ("has work", "busy")
    assert activity_cell({"has_work": None, "running": 4, "waiting": 0, "drained": None}) == (
        "unknown (running 4, waiting 0)",
        "unknown",
    )
    assert activity_cell({"has_work": False, "running": 1, "waiting": 0, "drained": False}) == (
        "has work (running 1, waiting 0)",
        "busy",
    )
