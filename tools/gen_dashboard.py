#!/usr/bin/env python3
"""Generate grafana/dashboards/vllm-dp-exporter.json (stdlib only).

    python tools/gen_dashboard.py            write the dashboard
    python tools/gen_dashboard.py --check    exit 1 when the committed JSON differs
    python tools/gen_dashboard.py --stdout   print it

Edit the panels here, never the JSON: tests/deploy/test_dashboard.py fails when the committed
file is not exactly this script's output. Every query filters on job, instance and model_name with
regex matchers; the "All" value of each variable is ".*", which also matches a series without the
label (model_name exists only when the exporter runs with --model-name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "grafana" / "dashboards" / "vllm-dp-exporter.json"

UID = "vllm-dp-exporter"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance", model_name=~"$model_name"'

# State encodings for the stat / state-timeline panels: one number per state, with a colour.
FLEET_STATES = (("consistent", 0, "green"), ("unknown", 1, "orange"), ("inconsistent", 2, "red"))
ENGINE_STATES = (
    ("awake", 0, "green"),
    ("asleep", 1, "blue"),
    ("paused", 2, "yellow"),
    ("unknown", 3, "orange"),
)
GREEN_RED = [{"color": "green", "value": None}, {"color": "red", "value": 1}]


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def one_hot_code(metric: str, states: tuple[tuple[str, int, str], ...], by: str) -> str:
    """Collapse a one-hot {state} gauge into one number per group (see *_STATES)."""
    parts = [
        f"({metric}{sel('state=' + json.dumps(name))} == 1) * {code}" for name, code, _ in states
    ]
    return f"max by ({by}) (\n  " + "\n  or ".join(parts) + "\n)"


def mappings(states: tuple[tuple[str, int, str], ...]) -> list[dict]:
    return [
        {
            "type": "value",
            "options": {
                str(code): {"index": i, "text": name, "color": color}
                for i, (name, code, color) in enumerate(states)
            },
        }
    ]


def target(expr: str, legend: str = "", ref: str = "A", **extra) -> dict:
    t = {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": True,
        "refId": ref,
    }
    t.update(extra)
    return t


def thresholds(steps: list[dict]) -> dict:
    return {"mode": "absolute", "steps": steps}


class Layout:
    """Hands out ids and grid positions, left to right, top to bottom."""

    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._id(),
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: dict, w: int, h: int) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def panel(
    kind: str,
    title: str,
    description: str,
    targets: list[dict],
    *,
    unit: str = "short",
    steps: list[dict] | None = None,
    maps: list[dict] | None = None,
    options: dict | None = None,
    custom: dict | None = None,
    extra: dict | None = None,
    overrides: list[dict] | None = None,
) -> dict:
    defaults: dict = {
        "unit": unit,
        "thresholds": thresholds(steps or [{"color": "green", "value": None}]),
    }
    if maps:
        defaults["mappings"] = maps
    if custom:
        defaults["custom"] = custom
    if extra:
        defaults.update(extra)
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
    }
    return p


def stat(title, description, targets, *, color_mode="background", text_mode="auto", **kw):
    opts = {
        "colorMode": color_mode,
        "graphMode": "none",
        "justifyMode": "auto",
        "textMode": text_mode,
        "orientation": "auto",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return panel("stat", title, description, targets, options=opts, **kw)


def timeseries(
    title, description, targets, *, stack=False, bars=False, show_thresholds=False, **kw
):
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 10,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "line" if show_thresholds else "off"},
    }
    opts = {
        "legend": {
            "displayMode": "table",
            "placement": "bottom",
            "showLegend": True,
            "calcs": ["lastNotNull", "max"],
        },
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel("timeseries", title, description, targets, custom=custom, options=opts, **kw)


def state_timeline(title, description, targets, **kw):
    opts = {
        "mergeValues": True,
        "showValue": "auto",
        "alignValue": "left",
        "rowHeight": 0.9,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return panel(
        "state-timeline",
        title,
        description,
        targets,
        options=opts,
        custom={"fillOpacity": 80, "lineWidth": 0},
        **kw,
    )


def color_override(name: str, color: str) -> dict:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
    }


def build_panels() -> list[dict]:
    L = Layout()
    NOT_OK = sel('outcome!="ok"')
    fleet_code = one_hot_code("vllm_dp_fleet_state", FLEET_STATES, "job, instance")
    engine_code = one_hot_code("vllm_dp_engine_state", ENGINE_STATES, "instance, engine")

    # ------------------------------------------------------------------ verdict at a glance
    L.row("Fleet verdict")
    L.add(
        stat(
            "Fleet verdict",
            "Aggregated is_sleeping consensus of the DP group from vllm_dp_fleet_state: consistent "
            "(every engine gave the same answer), inconsistent (engines that answered disagree: "
            "some asleep or paused, some awake) or unknown (some engine did not answer while the "
            "others agree). Unknown is never shown as inconsistent.",
            [target(fleet_code, "{{instance}}", instant=True)],
            maps=mappings(FLEET_STATES),
            text_mode="value_and_name",
            steps=[{"color": "text", "value": None}],
        ),
        w=6,
        h=5,
    )
    L.add(
        stat(
            "Engines connected / expected",
            "Engines that completed the start-up handshake (vllm_dp_engines_connected) and the "
            "fleet size the exporter is configured for (vllm_dp_engines_expected, --engine-count).",
            [
                target(f"vllm_dp_engines_connected{sel()}", "connected {{instance}}", "A"),
                target(f"vllm_dp_engines_expected{sel()}", "expected {{instance}}", "B"),
            ],
            color_mode="value",
            text_mode="value_and_name",
        ),
        w=5,
        h=5,
    )
    L.add(
        stat(
            "Engines missing or down",
            "Expected engines that never connected plus connected engines whose last utility call "
            "failed (expected - sum of vllm_dp_engine_up). 0 is healthy.",
            [
                target(
                    f"vllm_dp_engines_expected{sel()} - on (job, instance) "
                    f"sum by (job, instance) (vllm_dp_engine_up{sel()})",
                    "{{instance}}",
                )
            ],
            steps=GREEN_RED,
        ),
        w=4,
        h=5,
    )
    L.add(
        stat(
            "Aggregated sleeping",
            "vllm_dp_sleeping: the DP group's aggregated is_sleeping (asleep also covers paused "
            "schedulers). No value while the fleet is inconsistent or unknown.",
            [target(f"vllm_dp_sleeping{sel()}", "{{instance}}")],
            maps=[
                {
                    "type": "value",
                    "options": {
                        "0": {"index": 0, "text": "awake", "color": "green"},
                        "1": {"index": 1, "text": "asleep", "color": "blue"},
                    },
                }
            ],
            extra={"noValue": "n/a (inconsistent or unknown)"},
            steps=[{"color": "text", "value": None}],
        ),
        w=4,
        h=5,
    )
    L.add(
        stat(
            "Time since last poll",
            "Seconds since the exporter last finished polling every engine "
            "(time() - vllm_dp_last_poll_timestamp_seconds). Default poll interval is 5 s; above "
            "60 s the VllmDpExporterPollsStale alert fires.",
            [target(f"time() - vllm_dp_last_poll_timestamp_seconds{sel()}", "{{instance}}")],
            unit="s",
            steps=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 15},
                {"color": "red", "value": 60},
            ],
        ),
        w=5,
        h=5,
    )
    L.add(
        state_timeline(
            "Fleet verdict over time",
            "History of vllm_dp_fleet_state per exporter: green consistent, red inconsistent, "
            "orange unknown.",
            [target(fleet_code, "{{instance}}")],
            maps=mappings(FLEET_STATES),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=5,
    )

    # ------------------------------------------------------------------ engines
    L.row("Engines")
    L.add(
        state_timeline(
            "Engine sleep state",
            "Per-engine state from vllm_dp_engine_state: awake, asleep, paused (scheduler paused; "
            "vLLM's is_sleeping is also true then) or unknown (the engine did not answer). "
            "Engines that switch at different times show where the fleet diverged.",
            [target(engine_code, "engine {{engine}} ({{instance}})")],
            maps=mappings(ENGINE_STATES),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=8,
    )
    L.add(
        state_timeline(
            "Engine up",
            "vllm_dp_engine_up per engine: 1 when the engine answered its last utility call, 0 "
            "when "
            "it failed, timed out or is disconnected.",
            [target(f"vllm_dp_engine_up{sel()}", "engine {{engine}} ({{instance}})")],
            maps=[
                {
                    "type": "value",
                    "options": {
                        "0": {"index": 0, "text": "down", "color": "red"},
                        "1": {"index": 1, "text": "up", "color": "green"},
                    },
                }
            ],
            steps=[{"color": "text", "value": None}],
        ),
        w=12,
        h=7,
    )
    L.add(
        panel(
            "table",
            "Engines",
            "One row per engine from its start-up registration (vllm_dp_engine_info): vLLM version "
            "and whether sleep mode is enabled, plus the exporter build "
            "(vllm_dp_exporter_build_info).",
            [
                target(
                    f"vllm_dp_engine_info{sel()}",
                    "",
                    "A",
                    format="table",
                    instant=True,
                    range=False,
                ),
                target(
                    f"vllm_dp_exporter_build_info{sel()}",
                    "",
                    "B",
                    format="table",
                    instant=True,
                    range=False,
                ),
            ],
            options={"showHeader": True, "cellHeight": "sm"},
            extra={"custom": {"align": "auto", "filterable": True}},
        ),
        w=12,
        h=7,
    )

    # ------------------------------------------------------------------ inconsistency
    L.row("Inconsistency")
    L.add(
        timeseries(
            "Inconsistent results",
            "Aggregated utility calls (polls) in which the engines that answered disagreed, per "
            "method (increase of vllm_dp_inconsistent_utility_results_total). A poll or two "
            "around a "
            "sleep/wake transition is normal; a steady stream is not.",
            [
                target(
                    f"sum by (method) (increase(vllm_dp_inconsistent_utility_results_total{sel()}"
                    f"[$__rate_interval]))",
                    "{{method}}",
                )
            ],
            bars=True,
            steps=GREEN_RED,
            unit="short",
        ),
        w=16,
        h=7,
    )
    L.add(
        stat(
            "Inconsistent polls in range",
            "Polls that found disagreeing engines during the dashboard's time range, and their "
            "share "
            "of all polls (vllm_dp_polls_total).",
            [
                target(
                    f"sum(increase(vllm_dp_inconsistent_utility_results_total{sel()}[$__range]))",
                    "inconsistent polls",
                    "A",
                    instant=True,
                ),
                target(
                    f"sum(increase(vllm_dp_inconsistent_utility_results_total{sel()}[$__range])) / "
                    f"sum(increase(vllm_dp_polls_total{sel()}[$__range]))",
                    "share of polls",
                    "B",
                    instant=True,
                ),
            ],
            color_mode="value",
            text_mode="value_and_name",
            steps=GREEN_RED,
            overrides=[
                {
                    "matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [
                        {"id": "unit", "value": "percentunit"},
                        {
                            "id": "thresholds",
                            "value": thresholds(
                                [
                                    {"color": "green", "value": None},
                                    {"color": "orange", "value": 0.1},
                                    {"color": "red", "value": 0.25},
                                ]
                            ),
                        },
                    ],
                }
            ],
        ),
        w=8,
        h=7,
    )

    # ------------------------------------------------------------------ prefix-cache resets
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
    return L.panels


def variable_query(name: str, label: str, query: str) -> dict:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "sort": 1,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0,
        "regex": "",
        "options": [],
    }


def build_dashboard() -> dict:
    return {
        "uid": UID,
        "title": "vLLM DP exporter",
        "description": "Sleep-state consistency, prefix-cache resets and utility calls of vLLM "
        "data-parallel engines, from vllm-dp-exporter. Generated by "
        "tools/gen_dashboard.py.",
        "tags": ["vllm", "vllm-dp-exporter"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [
            {
                "title": "Runbooks",
                "type": "link",
                "targetBlank": True,
                "icon": "doc",
                "url": "https://github.com/vllm-dp-exporter/vllm-dp-exporter/blob/main/"
                "docs/runbooks.md",
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "type": "datasource",
                    "name": "datasource",
                    "label": "Data source",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "includeAll": False,
                    "multi": False,
                    "options": [],
                },
                variable_query("job", "Job", "label_values(vllm_dp_engines_expected, job)"),
                variable_query(
                    "instance",
                    "Instance",
                    'label_values(vllm_dp_engines_expected{job=~"$job"}, instance)',
                ),
                variable_query(
                    "model_name",
                    "Model",
                    'label_values(vllm_dp_engines_expected{job=~"$job", '
                    'instance=~"$instance"}, model_name)',
                ),
            ]
        },
        "panels": build_panels(),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail when the committed JSON differs")
    mode.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
    elif args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale; run: python tools/gen_dashboard.py",
                file=sys.stderr,
            )
            return 1
    else:
        OUTPUT.parent.mkdir(parents=True, exist_ok=True)
        OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
