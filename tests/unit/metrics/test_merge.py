"""Several API servers' families as one set (``exporter.metrics.merge``): the files' JSON round
trip, every file that cannot be believed refused as ``BadShare`` (never another exception, never
text that breaks the exposition), gauges from the leader only, counters and histograms summed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.base.steps import run_steps
from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.runtime import Exporter
from exporter.metrics import merge
from exporter.metrics.catalog import BY_NAME
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import Family
from exporter.metrics.merge import BadShare, families_from_json, families_to_json, merge_processes
from tests.harness.scrape import metric_value, parse_metrics

Rows = list[tuple[tuple[str, ...], float]]


def fam(
    name: str,
    rows: dict[tuple[str, ...], float] | None = None,
    *,
    labels: tuple[str, ...] | None = None,
    histograms: list[tuple[tuple[str, ...], list[tuple[str, float]], float]] | None = None,
) -> Family:
    spec = BY_NAME[name]
    return Family(
        spec,
        spec.labels if labels is None else labels,
        sorted((rows or {}).items()),
        list(histograms or []),
    )


def by_name(families: list[Family]) -> dict[str, Family]:
    names = [f.spec.name for f in families]
    assert len(names) == len(set(names)), names
    return {f.spec.name: f for f in families}


def answers(engine: str, method: str, args: tuple[object, ...]) -> object:
    if engine == "2":
        return EngineOutcome("2", Outcome.TIMEOUT, error="no reply", duration_s=1.0)
    return {"is_sleeping": engine == "1", "is_scheduler_paused": False}.get(method, "v1")


async def real_families(model_name: str | None = None) -> list[Family]:
    """A real exporter's families after one poll, a reset and some admin requests."""
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=3,
        handshake_address="tcp://127.0.0.1:1",
        model_name=model_name,
        admin_listen="off",
    )
    exporter = Exporter(config, client=FakeFleet(answers, engines=("0", "1", "2")))
    await exporter.poller.poll_once()
    exporter.stats.record_reset("partial_failure", [("1", "refused")], 0.3, 1.5e9)
    exporter.stats.record_admin_request("reset_prefix_cache", 502)
    return exporter.collector.families()


# -- the files' JSON ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", [None, 'm"odel\\\n'])
async def test_round_trip_is_exact(model_name: str | None) -> None:
    families = await real_families(model_name)
    assert any(f.histograms for f in families) and any(f.rows for f in families)
    back = families_from_json(families_to_json(families))
    assert back == families
    assert run_steps(text_steps(back)) == run_steps(text_steps(families))


def doc(*entries: dict[str, Any]) -> bytes:
    return json.dumps(list(entries)).encode()


def polls(rows: Any, labels: Any = None) -> dict[str, Any]:
    return {"name": "vllm_dp_polls_total", "labels": [] if labels is None else labels, "rows": rows}


def engine_up(rows: Any, labels: Any = None) -> dict[str, Any]:
    return {
        "name": "vllm_dp_engine_up",
        "labels": ["engine"] if labels is None else labels,
        "rows": rows,
    }


def durations(histograms: Any) -> dict[str, Any]:
    return {
        "name": "vllm_dp_prefix_cache_reset_duration_seconds",
        "labels": [],
        "histograms": histograms,
    }


NESTED = 100_000
BAD_SHARES: dict[str, tuple[bytes, str]] = {
    "not JSON": (b"\xff\xfe{not json", "not JSON"),
    "deep nesting": (b"[" * NESTED + b"]" * NESTED, "not JSON"),
    "deep nesting, unclosed": (b"[" * NESTED, "not JSON"),
    "nesting in label values": (
        doc(engine_up([[json.loads("[" * 200 + "]" * 200), 1]])),
        "label values",
    ),
    "not a list": (b'{"name": "vllm_dp_polls_total"}', "not a list"),
    "a family that is no object": (b"[1]", "without a name"),
    "a name that is no string": (b'[{"name": 7}]', "without a name"),
    "unknown family": (doc({"name": "vllm_dp_nope_total", "labels": [], "rows": []}), "unknown"),
    "label names not strings": (doc(engine_up([], labels=[1])), "not strings"),
    "label names not a list": (doc(engine_up([], labels="engine")), "not strings"),
    "label names not the catalog's": (doc(engine_up([], labels=["host"])), "not the catalog's"),
    "label names injecting text": (
        doc(engine_up([[["0"], 1]], labels=['engine="0"} 1\nvllm_dp_fake{x'])),
        "not the catalog's",
    ),
    "a bool as value": (doc(polls([[[], True]])), "not a number"),
    "a string as value": (doc(polls([[[], "1"]])), "not a number"),
    "a null as value": (doc(polls([[[], None]])), "not a number"),
    "an integer beyond any float": (doc(polls([[[], 10**400]])), "too large"),
    "a bool as label value": (doc(engine_up([[[True], 1]])), "not strings"),
    "too few label values": (doc(engine_up([[[], 1]])), "do not match"),
    "too many label values": (doc(engine_up([[["0", "1"], 1]])), "do not match"),
    "a row that is no pair": (doc(polls([[[], 1, 2]])), "not [labels, value]"),
    "rows not a list": (doc(polls({"a": 1})), "a list was expected"),
    "a series twice": (doc(engine_up([[["0"], 1], [["0"], 0]])), "twice"),
    "a family twice": (doc(polls([[[], 1]]), polls([[[], 2]])), "twice"),
    "a histogram that is no triple": (doc(durations([[[], [["+Inf", 1]]]])), "not [labels"),
    "a bucket that is no pair": (doc(durations([[[], [["+Inf"]], 1]])), "not [le, count]"),
    "a bucket bound that is no string": (doc(durations([[[], [[1.0, 1]], 1]])), "not [le"),
    "a histogram without buckets": (doc(durations([[[], [], 1]])), "without buckets"),
    "a histogram sum that is a bool": (doc(durations([[[], [["+Inf", 1]], False]])), "number"),
}


@pytest.mark.parametrize("case", list(BAD_SHARES))
def test_bad_shares_are_refused_with_the_reason(case: str) -> None:
    data, words = BAD_SHARES[case]
    with pytest.raises(BadShare) as caught:
        families_from_json(data)
    assert words in str(caught.value), str(caught.value)


def test_too_many_rows_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "MAX_ROWS", 3)
    rows = [[[str(i)], 1] for i in range(4)]
    with pytest.raises(BadShare, match="more than 3 rows"):
        families_from_json(doc(engine_up(rows)))
    assert len(families_from_json(doc(engine_up(rows[:3])))[0].rows) == 3


def test_what_is_believed_renders_as_valid_text() -> None:
    """model_name is believed; label values of any text are escaped by the renderer."""
    data = doc(
        engine_up([[['0"}\n', "m"], 1]], labels=["engine", "model_name"]),
        durations([[[], [["0.1", 1], ["+Inf", 2]], 0.5]]),
    )
    families = families_from_json(data)
    parsed = parse_metrics(run_steps(text_steps(families)).decode())
    assert metric_value(parsed, "vllm_dp_engine_up", engine='0"}\n', model_name="m") == 1.0
    assert families[1].histograms == [((), [("0.1", 1.0), ("+Inf", 2.0)], 0.5)]


# -- merging -----------------------------------------------------------------------------------


def test_gauges_come_from_the_leader_only() -> None:
    leader = [fam("vllm_dp_engine_up", {("0",): 1.0, ("1",): 1.0})]
    other = [
        fam("vllm_dp_engine_up", {("0",): 0.0, ("1",): 0.0, ("2",): 1.0}),
        fam("vllm_dp_engines_expected", {(): 9.0}),  # a gauge only another process has
    ]
    merged = by_name(merge_processes(leader, [other]))
    assert list(merged) == ["vllm_dp_engine_up"]
    assert merged["vllm_dp_engine_up"].rows == [(("0",), 1.0), (("1",), 1.0)]


def test_progress_is_summed_and_its_age_is_the_least_of_any_process() -> None:
    """Each API server counts the tokens of its own requests: a rank's progress is their sum,
    and it last progressed when any process saw it (the least age), not API server 0 alone."""
    age = "vllm_dp_engine_last_progress_age_seconds"
    tokens = "vllm_dp_engine_progress_tokens_total"
    leader = [fam(tokens, {("0",): 10.0, ("1",): 0.0}), fam(age, {("0",): 2.0, ("1",): 300.0})]
    other = [fam(tokens, {("1",): 40.0}), fam(age, {("0",): 9.0, ("1",): 1.5, ("2",): 7.0})]
    merged = by_name(merge_processes(leader, [other]))
    assert dict(merged[tokens].rows) == {("0",): 10.0, ("1",): 40.0}
    assert dict(merged[age].rows) == {("0",): 2.0, ("1",): 1.5, ("2",): 7.0}


def test_counters_are_summed_with_label_sets_only_one_side_has() -> None:
    key = ("reset_prefix_cache", "200")
    leader = [
        fam("vllm_dp_admin_requests_total", {key: 2.0, ("sleep", "200"): 1.0}),
        fam("vllm_dp_polls_total", {(): 10.0}),
    ]
    one = [fam("vllm_dp_admin_requests_total", {key: 3.0, ("pause", "409"): 1.0})]
    two = [
        fam("vllm_dp_admin_requests_total", {key: 1.0}),
        fam("vllm_dp_polls_total", {(): 7.0}),
        fam("vllm_dp_task_failures_total", {("poller",): 1.0}),  # only this process has it
    ]
    leader_rows = list(leader[0].rows)
    merged = merge_processes(leader, [one, two])
    assert [f.spec.name for f in merged] == [
        "vllm_dp_admin_requests_total",
        "vllm_dp_polls_total",
        "vllm_dp_task_failures_total",
    ]
    families = by_name(merged)
    assert dict(families["vllm_dp_admin_requests_total"].rows) == {
        key: 6.0,
        ("sleep", "200"): 1.0,
        ("pause", "409"): 1.0,
    }
    assert families["vllm_dp_polls_total"].rows == [((), 17.0)]
    assert families["vllm_dp_task_failures_total"].rows == [(("poller",), 1.0)]
    assert leader[0].rows == leader_rows  # the inputs are not changed


def test_histograms_are_summed_bucket_by_bucket() -> None:
    name = "vllm_dp_utility_call_duration_seconds"
    leader = [
        fam(name, histograms=[(("is_sleeping",), [("0.1", 1.0), ("+Inf", 2.0)], 0.3)]),
    ]
    other = [
        fam(
            name,
            histograms=[
                (("is_sleeping",), [("0.1", 4.0), ("+Inf", 5.0)], 1.0),
                (("sleep",), [("0.1", 0.0), ("+Inf", 1.0)], 2.5),
            ],
        )
    ]
    (merged,) = merge_processes(leader, [other])
    assert merged.histograms == [
        (("is_sleeping",), [("0.1", 5.0), ("+Inf", 7.0)], 1.3),
        (("sleep",), [("0.1", 0.0), ("+Inf", 1.0)], 2.5),
    ]
    text = run_steps(text_steps([merged])).decode()
    parsed = parse_metrics(text)
    counts = [s for s in parsed[name].samples if s.name.endswith("_count")]
    assert {s.labels["method"]: s.value for s in counts} == {"is_sleeping": 7.0, "sleep": 1.0}


def test_other_label_names_are_not_summed() -> None:
    """Another configuration (a model_name label) is skipped, counters and histograms alike."""
    name = "vllm_dp_prefix_cache_reset_duration_seconds"
    leader = [
        fam("vllm_dp_polls_total", {(): 3.0}),
        fam(name, histograms=[((), [("+Inf", 1.0)], 0.1)]),
    ]
    other = [
        fam("vllm_dp_polls_total", {("m",): 5.0}, labels=("model_name",)),
        fam(name, labels=("model_name",), histograms=[(("m",), [("+Inf", 4.0)], 9.0)]),
    ]
    families = by_name(merge_processes(leader, [other]))
    assert families["vllm_dp_polls_total"].labels == ()
    assert families["vllm_dp_polls_total"].rows == [((), 3.0)]
    assert families[name].histograms == [((), [("+Inf", 1.0)], 0.1)]


async def test_real_exporters_merge_to_text_without_a_series_twice() -> None:
    leader, other = await real_families(), await real_families()
    shared = families_from_json(families_to_json(other))
    text = run_steps(text_steps(merge_processes(leader, [shared]))).decode()
    lines = [line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")]
    assert len(lines) == len(set(lines))
    parsed = parse_metrics(text)
    assert metric_value(parsed, "vllm_dp_polls_total") == 2.0
    assert metric_value(parsed, "vllm_dp_engine_up", engine="0") == 1.0  # a gauge: not 2
    assert (
        metric_value(parsed, "vllm_dp_admin_requests", action="reset_prefix_cache", code="502")
        == 2.0
    )
