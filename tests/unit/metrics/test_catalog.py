"""``exporter/metrics/catalog.py``: the one list of every series, well formed on its own (the
docs and a live exporter agree with it: tests/integration/service/test_service_catalog.py)."""

from __future__ import annotations

import re

from exporter.client.fleet import REGISTRATION_KEYS
from exporter.metrics.catalog import (
    BY_NAME,
    INFO_FACTS,
    METRICS,
    PREFIX,
    MetricSpec,
    sample_names,
)
from exporter.metrics.stats import Stats

MODES = {"owner", "relay", "http", "inprocess"}
LABEL = re.compile(r"[a-z_][a-z0-9_]*\Z")


def test_every_series_is_named_once_with_the_prefix_and_a_known_kind() -> None:
    assert len(BY_NAME) == len(METRICS)
    for spec in METRICS:
        assert spec.name.startswith(PREFIX), spec.name
        assert spec.kind in ("gauge", "counter", "histogram"), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert spec.help.strip() and spec.help.rstrip().endswith("."), spec.name


def test_labels_are_valid_and_modes_are_attach_modes() -> None:
    for spec in METRICS:
        assert all(LABEL.match(label) for label in spec.labels), spec.name
        assert "le" not in spec.labels and "model_name" not in spec.labels, spec.name
        assert len(set(spec.labels)) == len(spec.labels), spec.name
        assert spec.modes and set(spec.modes) <= MODES, spec.name


def test_only_gauges_of_a_moment_merge_as_the_latest() -> None:
    latest = [spec for spec in METRICS if spec.latest]
    assert latest and all(spec.kind == "gauge" for spec in latest)
    assert all(spec.name.endswith("_timestamp_seconds") for spec in latest)


def test_sample_names_follow_the_kind() -> None:
    counter = MetricSpec("vllm_dp_x_total", "counter", (), "X.")
    assert counter.family == "vllm_dp_x"
    assert sample_names(counter) == ("vllm_dp_x_total", "vllm_dp_x_created")
    histogram = MetricSpec("vllm_dp_y_seconds", "histogram", (), "Y.")
    assert histogram.family == "vllm_dp_y_seconds"
    assert sample_names(histogram) == (
        "vllm_dp_y_seconds_bucket",
        "vllm_dp_y_seconds_sum",
        "vllm_dp_y_seconds_count",
    )
    gauge = MetricSpec("vllm_dp_z", "gauge", (), "Z.")
    assert sample_names(gauge) == ("vllm_dp_z",)


def test_every_info_label_is_a_registration_fact_or_the_front_end_and_no_per_start_one() -> None:
    assert set(INFO_FACTS) <= {*REGISTRATION_KEYS, "front_end", "rust_frontend_version"}
    assert "instance_id" not in INFO_FACTS
    assert BY_NAME["vllm_dp_engine_info"].labels == ("engine", *INFO_FACTS)


def test_the_histograms_counters_keep_are_catalogued_with_their_labels() -> None:
    stats = Stats()
    assert (
        stats.call_durations.labelnames == BY_NAME["vllm_dp_utility_call_duration_seconds"].labels
    )
    assert (
        stats.reset_durations.labelnames
        == BY_NAME["vllm_dp_prefix_cache_reset_duration_seconds"].labels
    )
