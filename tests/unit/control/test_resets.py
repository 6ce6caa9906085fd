"""What routers reconcile on, over the in-memory ``FakeFleet``: which engines an action confirmed
a prefix-cache reset on (``exporter.control.resets``), the per-engine series and ``/status``
fields it leaves, their merge over several API servers, and the ``http_sd`` document of the
engines' KV-events publishers (``exporter.web.kvtargets``)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.base.steps import run_steps
from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.parsing import (
    ActionRequest,
    parse_pause,
    parse_reset,
    parse_resume,
    parse_sleep,
    parse_wake_up,
    parse_weight_version,
)
from exporter.control.resets import confirmed_resets, release_of, reset_kind
from exporter.control.runner import ActionRunner
from exporter.control.verdicts import ActionVerdict, EngineVerdict
from exporter.metrics.merge import merge_processes
from exporter.protocol.kv_events import parse_kv_events_config, with_engine_host
from exporter.web.kvtargets import kv_events_targets
from exporter.web.statusdoc import status_steps
from tests.harness.scrape import metric_value
from tests.harness.statusschema import validate_status
from tests.unit.control.test_fleet_semantics import make_exporter, scrape
from tests.unit.metrics.test_merge import by_name, fam

GAUGE = "vllm_dp_prefix_cache_last_reset_timestamp_seconds"
COUNTER = "vllm_dp_prefix_cache_confirmed_resets_total"


def sleep_query(level: str) -> dict[str, list[str]]:
    return {"level": [level]}


@pytest.mark.parametrize(
    ("request_", "kind"),
    [
        (parse_reset({}, b""), "explicit"),
        (parse_reset({"reset_running_requests": ["true"]}, b""), "explicit"),
        (parse_pause({}, b""), "implied"),
        (parse_pause({"mode": ["keep"]}, b""), "implied"),
        (ActionRequest("pause", "pause_scheduler", ("abort", False), {}), None),
        (parse_pause({"mode": ["keep"], "clear_cache": ["false"]}, b""), None),
        (parse_pause({"mode": ["keep"], "clear_cache": ["true"]}, b""), "implied"),
        (parse_sleep(sleep_query("0"), b""), None),
        (parse_sleep(sleep_query("1"), b""), "implied"),
        (parse_sleep(sleep_query("2"), b""), "implied"),
        (parse_sleep({}, b""), "implied"),  # level 1 by default
        (parse_resume({}, b""), None),
        (parse_wake_up({}, b""), None),
        (parse_weight_version({}, b'{"weight_version": "w1"}'), None),
    ],
)
def test_which_actions_reset_the_prefix_cache(request_: ActionRequest, kind: str | None) -> None:
    assert reset_kind(request_) == kind


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.33.0", (0, 33)),
        ("0.32.1rc1+cpu", (0, 32)),
        ("v0.34.0.dev12+g1234", (0, 34)),
        ("", None),
        (None, None),
        ("unknown", None),
    ],
)
def test_release_of_a_vllm_version(version: str | None, release: tuple[int, int] | None) -> None:
    assert release_of(version) == release


def verdict(*reasons: str | None) -> ActionVerdict:
    engines = tuple(EngineVerdict(str(i), reason) for i, reason in enumerate(reasons))
    return ActionVerdict("x", engines, verified=True)


def test_only_confirmations_count_and_implied_ones_on_the_releases_read() -> None:
    reasons = (None, "refused", "timeout", "failed", "disconnected", "unverified", None)
    versions = {str(i): "0.33.0" for i in range(7)} | {"6": "0.34.0"}
    explicit = confirmed_resets(parse_reset({}, b""), verdict(*reasons), versions)
    assert explicit == ["0", "6"]  # the engine's own True counts on any version
    implied = confirmed_resets(parse_pause({}, b""), verdict(*reasons), versions)
    assert implied == ["0", "5"]  # accepted (even unverified), on 0.32/0.33 only
    unknown = confirmed_resets(parse_sleep({}, b""), verdict(None), {"0": None})
    assert unknown == []  # no registered version: not assumed
    assert confirmed_resets(parse_resume({}, b""), verdict(None), {"0": "0.33.0"}) == []


def reset_answers(refused: str, timed_out: str) -> Any:
    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if engine == timed_out and method in ("reset_prefix_cache", "pause_scheduler"):
            return EngineOutcome(engine, Outcome.TIMEOUT, error="no reply", duration_s=1.0)
        if method == "reset_prefix_cache":
            return engine != refused
        return {"is_sleeping": True, "is_scheduler_paused": True}.get(method)

    return handler


@pytest.mark.parametrize(("refused", "timed_out"), [("0", "1"), ("1", "2"), ("2", "0")])
async def test_series_and_status_after_resets_in_every_position(
    refused: str, timed_out: str
) -> None:
    exporter = make_exporter(FakeFleet(reset_answers(refused, timed_out), engines=("0", "1", "2")))
    runner = ActionRunner(exporter.action_parts())
    (confirmed,) = {"0", "1", "2"} - {refused, timed_out}
    m = scrape(exporter)
    assert {
        s.labels["engine"]: s.value for s in m["vllm_dp_prefix_cache_confirmed_resets"].samples
    } == {
        "0": 0.0,
        "1": 0.0,
        "2": 0.0,
    }
    assert not m[GAUGE].samples  # absent until the first
    await runner.run(parse_reset({}, b""))
    m = scrape(exporter)
    assert metric_value(m, COUNTER, engine=confirmed) == 1.0
    assert metric_value(m, COUNTER, engine=refused) == 0.0
    assert metric_value(m, COUNTER, engine=timed_out) == 0.0
    assert [s.labels["engine"] for s in m[GAUGE].samples] == [confirmed]
    first = metric_value(m, GAUGE, engine=confirmed)

    await runner.run(parse_pause({}, b""))  # resets on every engine that accepts it
    await exporter.poller.poll_once()
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    caches = {e["engine"]: e["prefix_cache"] for e in doc["engines"]}
    assert caches[confirmed]["confirmed_resets"] == 2
    assert caches[confirmed]["last_reset_action"] == "pause"
    assert caches[confirmed]["last_reset_unix"] >= first
    assert caches[refused] == {
        "confirmed_resets": 1,
        "last_reset_unix": caches[refused]["last_reset_unix"],
        "last_reset_action": "pause",
    }
    assert caches[timed_out] == {
        "confirmed_resets": 0,
        "last_reset_unix": None,
        "last_reset_action": None,
    }
    assert all(e["kv_events"] is None for e in doc["engines"])


async def test_a_newer_vllms_pause_is_not_assumed_to_reset() -> None:
    fleet = FakeFleet(reset_answers("-", "-"), engines=("0", "1"), vllm_version="0.34.0")
    exporter = make_exporter(fleet)
    await ActionRunner(exporter.action_parts()).run(parse_pause({}, b""))
    assert exporter.stats.last_resets == {}
    await ActionRunner(exporter.action_parts()).run(parse_reset({}, b""))
    assert set(exporter.stats.last_resets) == {"0", "1"}


def test_reset_times_merge_as_the_latest_of_every_api_server() -> None:
    leader = [fam(GAUGE, {("0",): 100.0}), fam("vllm_dp_engine_up", {("0",): 1.0})]
    other = [
        fam(GAUGE, {("0",): 90.0, ("1",): 120.0}),
        fam("vllm_dp_engine_up", {("0",): 0.0, ("1",): 1.0}),
        fam(COUNTER, {("0",): 2.0}),
    ]
    merged = by_name(merge_processes(leader, [other]))
    assert merged[GAUGE].rows == [(("0",), 100.0), (("1",), 120.0)]
    assert merged["vllm_dp_engine_up"].rows == [(("0",), 1.0)]  # a poll's gauge: the leader's
    assert merged[COUNTER].rows == [(("0",), 2.0)]


def publisher(endpoint: str, host: str | None, replay: str | None = None) -> Any:
    found = parse_kv_events_config(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": "kv",
        }
    )
    assert found is not None
    return with_engine_host(found, host)


async def test_kv_events_targets_list_the_connected_publishers_only() -> None:
    sources = {
        "0": publisher("tcp://*:5557", "10.0.0.5", "tcp://*:5600"),
        "2": publisher("ipc:///tmp/kv", "10.0.0.7"),  # no target: /status only
        "3": publisher("tcp://*:5560", "10.0.0.8"),  # disconnected
        "4": publisher("tcp://[::1]:5561", None),
    }
    fleet = FakeFleet(reset_answers("-", "-"), engines=("0", "1", "2", "3", "4"), kv_events=sources)
    fleet.disconnected.add("3")
    exporter = make_exporter(fleet)
    await exporter.poller.poll_once()
    snap = exporter.poller.snapshot
    assert kv_events_targets(snap) == [
        {
            "targets": ["10.0.0.5:5557"],
            "labels": {
                "engine": "0",
                "topic": "kv",
                "endpoint": "tcp://*:5557",
                "publisher": "zmq",
                "replay": "10.0.0.5:5600",
            },
        },
        {
            "targets": ["[::1]:5561"],
            "labels": {
                "engine": "4",
                "topic": "kv",
                "endpoint": "tcp://[::1]:5561",
                "publisher": "zmq",
            },
        },
    ]
    assert kv_events_targets(snap, "m")[0]["labels"]["model_name"] == "m"
    doc = run_steps(status_steps(snap, exporter.config, exporter.stats))
    validate_status(doc)
    by_engine = {e["engine"]: e["kv_events"] for e in doc["engines"]}
    assert by_engine["1"] is None
    assert by_engine["0"]["target"] == "10.0.0.5:5557"
    assert by_engine["2"]["target"] is None and "ipc" in by_engine["2"]["note"]
    assert by_engine["3"]["target"] == "10.0.0.8:5560"  # shown, though not a target now
    assert (
        kv_events_targets(make_exporter(FakeFleet(reset_answers("-", "-"))).poller.snapshot) == []
    )
