"""Grafana JSON building blocks for tools/gen_dashboard.py (stdlib only)."""

from __future__ import annotations

import json
from typing import Any

UID = "vllm-dp-exporter"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance", model_name=~"$model_name"'

# State encodings for the stat / state-timeline panels: one number per state, with a colour.
FLEET_STATES = (("consistent", 0, "green"), ("unknown", 1, "orange"), ("inconsistent", 2, "red"))
#: The engine states (exporter.metrics.labels.ENGINE_STATES); worst last.
ENGINE_STATES = (
    ("awake", 0, "green"),
    ("asleep", 1, "blue"),
    ("paused", 2, "yellow"),
    ("unknown", 3, "orange"),
    # answers and holds requests, no token computed for --stall-after (in-process mode only;
    # docs/activity.md); darker than unknown's orange so the two stay apart
    ("stalled", 4, "dark-orange"),
    ("hung", 5, "red"),  # connected, no answer for --hung-after (docs/activity.md)
)
#: vLLM's fault-tolerance statuses (vllm_dp_engine_fault_tolerance_status{status}), every value
#: of exporter.protocol.pushes.FT_STATE_VALUES, numbered as HTTP mode ranks them (worst last).
FT_STATUSES = (
    ("healthy", 0, "green"),
    ("paused", 1, "blue"),  # vLLM PR #41438: held still while the fleet recovers
    ("recovering", 2, "yellow"),  # vLLM PR #41438: being recovered
    ("diagnosing", 3, "light-orange"),  # vLLM 0.34: faulted, its all2all mask being read
    ("unhealthy", 4, "orange"),
    ("other", 5, "dark-purple"),  # a status string the exporter does not know
    ("unknown", 6, "purple"),  # not readable, or lost at a restart: never healthy
    ("dead", 7, "red"),
)
GREEN_RED = [{"color": "green", "value": None}, {"color": "red", "value": 1}]


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def one_hot_code(
    metric: str, states: tuple[tuple[str, int, str], ...], by: str, label: str = "state"
) -> str:
    """Collapse a one-hot {state} gauge into one number per group (see *_STATES)."""
    parts = [
        f"({metric}{sel(label + '=' + json.dumps(name))} == 1) * {code}" for name, code, _ in states
    ]
    return f"max by ({by}) (\n  " + "\n  or ".join(parts) + "\n)"


def mappings(states: tuple[tuple[str, int, str], ...]) -> list[dict[str, Any]]:
    return [
        {
            "type": "value",
            "options": {
                str(code): {"index": i, "text": name, "color": color}
                for i, (name, code, color) in enumerate(states)
            },
        }
    ]


def target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict[str, Any]:
    t: dict[str, Any] = {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend or "__auto",
        "range": True,
        "refId": ref,
    }
    t.update(extra)
    return t


def thresholds(steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": steps}


class Layout:
    """Hands out ids and grid positions, left to right, top to bottom."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
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

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
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
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    steps: list[dict[str, Any]] | None = None,
    maps: list[dict[str, Any]] | None = None,
    options: dict[str, Any] | None = None,
    custom: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    overrides: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    defaults: dict[str, Any] = {
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


def stat(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    color_mode: str = "background",
    text_mode: str = "auto",
    **kw: Any,
) -> dict[str, Any]:
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
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    stack: bool = False,
    bars: bool = False,
    show_thresholds: bool = False,
    **kw: Any,
) -> dict[str, Any]:
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


def state_timeline(
    title: str, description: str, targets: list[dict[str, Any]], **kw: Any
) -> dict[str, Any]:
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


def color_override(name: str, color: str) -> dict[str, Any]:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
    }
