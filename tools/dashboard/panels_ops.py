"""Dashboard rows: prefix-cache resets, utility calls, the exporter itself."""

from __future__ import annotations

from dashboard.builders import (
    GREEN_RED,
    Layout,
    color_override,
    sel,
    stat,
    target,
    timeseries,
)


def add_operations_rows(L: Layout) -> None:
    NOT_OK = sel('outcome!="ok"')

    L.row("Prefix-cache resets")
    L.add(
        timeseries(
            "Reset outcomes",
            "Admin prefix-cache resets by outcome (increase of vllm_dp_prefix_cache_resets_total): "
            "success (every engine confirmed), partial_failure (some did not), failure (none did "
            "or "
            "no engine connected).",
            [
                target(
                    f"sum by (outcome) (increase(vllm_dp_prefix_cache_resets_total{sel()}"
                    f"[$__rate_interval]))",
                    "{{outcome}}",
                )
            ],
            bars=True,
            stack=True,
            overrides=[
                color_override("success", "green"),
                color_override("partial_failure", "orange"),
                color_override("failure", "red"),
            ],
        ),
        w=8,
        h=8,
    )
    L.add(
        timeseries(
            "Per-engine reset failures",
            "Engines that did not confirm a prefix-cache reset, by reason (increase of "
            "vllm_dp_prefix_cache_reset_engine_failures_total): refused (answered false, e.g. "
            "blocks "
            "held by running requests), failed, timeout, disconnected.",
            [
                target(
                    f"sum by (instance, engine, reason) (increase("
                    f"vllm_dp_prefix_cache_reset_engine_failures_total{sel()}[$__rate_interval]))",
                    "engine {{engine}} {{reason}} ({{instance}})",
                )
            ],
            bars=True,
            stack=True,
            steps=GREEN_RED,
        ),
        w=8,
        h=8,
    )
    L.add(
        timeseries(
            "Reset duration",
            "p50 and p99 end-to-end duration of an admin prefix-cache reset across all engines "
            "(vllm_dp_prefix_cache_reset_duration_seconds). Empty when no reset ran recently.",
            [
                target(
                    f"histogram_quantile(0.5, sum by (le) (rate("
                    f"vllm_dp_prefix_cache_reset_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p50",
                    "A",
                ),
                target(
                    f"histogram_quantile(0.99, sum by (le) (rate("
                    f"vllm_dp_prefix_cache_reset_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p99",
                    "B",
                ),
            ],
            unit="s",
        ),
        w=5,
        h=8,
    )
    L.add(
        stat(
            "Since last full reset",
            "Time since the last prefix-cache reset that every engine confirmed "
            "(vllm_dp_prefix_cache_last_success_timestamp_seconds).",
            [
                target(
                    f"time() - (vllm_dp_prefix_cache_last_success_timestamp_seconds{sel()} > 0)",
                    "{{instance}}",
                )
            ],
            unit="s",
            color_mode="value",
            extra={"noValue": "never"},
        ),
        w=3,
        h=8,
    )

    # ------------------------------------------------------------------ utility calls
    L.row("Utility calls")
    L.add(
        timeseries(
            "Utility call latency p50 / p99",
            "Round trip of one engine's utility call, by method (histogram_quantile over "
            "vllm_dp_utility_call_duration_seconds_bucket). Calls time out after --call-timeout "
            "(10 s by default).",
            [
                target(
                    f"histogram_quantile(0.5, sum by (method, le) (rate("
                    f"vllm_dp_utility_call_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p50 {{method}}",
                    "A",
                ),
                target(
                    f"histogram_quantile(0.99, sum by (method, le) (rate("
                    f"vllm_dp_utility_call_duration_seconds_bucket{sel()}[$__rate_interval])))",
                    "p99 {{method}}",
                    "B",
                ),
            ],
            unit="s",
            show_thresholds=True,
            steps=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 1},
                {"color": "red", "value": 5},
            ],
        ),
        w=12,
        h=8,
    )
    L.add(
        timeseries(
            "Utility call outcomes per engine",
            "Utility calls per second sent to each engine, by outcome "
            "(vllm_dp_utility_calls_total): "
            "ok, failed, timeout, disconnected (and inconsistent for an HTTP target whose own "
            "engines "
            "disagree).",
            [
                target(
                    f"sum by (instance, engine, outcome) (rate(vllm_dp_utility_calls_total{sel()}"
                    f"[$__rate_interval]))",
                    "engine {{engine}} {{outcome}} ({{instance}})",
                )
            ],
            unit="ops",
            stack=True,
        ),
        w=12,
        h=8,
    )
    L.add(
        timeseries(
            "Failed call ratio per engine",
            "Share of each engine's utility calls that did not return ok (failed, timeout, "
            "disconnected, inconsistent).",
            [
                target(
                    f"(sum by (instance, engine) (rate(vllm_dp_utility_calls_total{NOT_OK}"
                    f"[$__rate_interval])) or sum by (instance, engine) (rate("
                    f"vllm_dp_utility_calls_total{sel()}[$__rate_interval])) * 0)"
                    f" / sum by (instance, engine) (rate(vllm_dp_utility_calls_total{sel()}"
                    f"[$__rate_interval]))",
                    "engine {{engine}} ({{instance}})",
                )
            ],
            unit="percentunit",
            show_thresholds=True,
            extra={"min": 0, "max": 1},
            steps=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 0.01},
                {"color": "red", "value": 0.1},
            ],
        ),
        w=24,
        h=7,
    )

    # ------------------------------------------------------------------ exporter health
    L.row("Exporter")
    L.add(
        timeseries(
            "Poll freshness",
            "Seconds since the last finished poll (time() - vllm_dp_last_poll_timestamp_seconds); "
            "the red line is the VllmDpExporterPollsStale threshold.",
            [target(f"time() - vllm_dp_last_poll_timestamp_seconds{sel()}", "{{instance}}")],
            unit="s",
            show_thresholds=True,
            steps=[{"color": "green", "value": None}, {"color": "red", "value": 60}],
        ),
        w=8,
        h=7,
    )
    L.add(
        timeseries(
            "Poll duration",
            "How long the last poll of every engine took (vllm_dp_poll_duration_seconds). Close to "
            "--call-timeout means some engine is not answering.",
            [target(f"vllm_dp_poll_duration_seconds{sel()}", "{{instance}}")],
            unit="s",
            show_thresholds=True,
            steps=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 1},
                {"color": "red", "value": 10},
            ],
        ),
        w=8,
        h=7,
    )
    L.add(
        timeseries(
            "Protocol errors and admin requests",
            "Frames or peers the exporter rejected, by kind (vllm_dp_protocol_errors_total; 0 when "
            "none ever happened), and admin requests by action and HTTP code "
            "(vllm_dp_admin_requests_total).",
            [
                target(
                    f"sum by (kind) (increase(vllm_dp_protocol_errors_total{sel()}"
                    f'[$__rate_interval])) or label_replace(vector(0), "kind", "none", "", "")',
                    "protocol error {{kind}}",
                    "A",
                ),
                target(
                    f"sum by (action, code) (increase(vllm_dp_admin_requests_total{sel()}"
                    f"[$__rate_interval]))",
                    "admin {{action}} {{code}}",
                    "B",
                ),
            ],
            bars=True,
            steps=GREEN_RED,
        ),
        w=8,
        h=7,
    )
