"""Grafana dashboard: generated, well-formed, complete, queries valid and on catalog metrics."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import yaml

from tests.harness import artefacts

SELECTOR = re.compile(r"\b(vllm_dp_[A-Za-z0-9_]+)\s*(\{[^}]*\})?")
REQUIRED_MATCHERS = ('job=~"$job"', 'instance=~"$instance"', 'model_name=~"$model_name"')
# Metrics the dashboard must show (one panel or more each; tools/gen_dashboard.py builds it).
REQUIRED_METRICS = {
    "vllm_dp_fleet_state",
    "vllm_dp_engine_progress_tokens_total",
    "vllm_dp_engine_last_progress_age_seconds",
    "vllm_dp_engine_state",
    "vllm_dp_engines_connected",
    "vllm_dp_engines_expected",
    "vllm_dp_inconsistent_utility_results_total",
    "vllm_dp_prefix_cache_resets_total",
    "vllm_dp_prefix_cache_reset_engine_failures_total",
    "vllm_dp_utility_call_duration_seconds_bucket",
    "vllm_dp_utility_calls_total",
    "vllm_dp_last_poll_timestamp_seconds",
    "vllm_dp_poll_duration_seconds",
    # RL invariants and admin actions (docs/rl.md)
    "vllm_dp_engine_weight_version_info",
    "vllm_dp_weight_version_consistent",
    "vllm_dp_admin_actions_total",
    "vllm_dp_admin_action_engine_failures_total",
    # activity per rank (docs/activity.md)
    "vllm_dp_engine_requests",
    "vllm_dp_engine_has_work",
    "vllm_dp_engine_routable",
    "vllm_dp_engine_unresponsive_seconds",
}


def _dashboard() -> Any:
    return json.loads(artefacts.DASHBOARD_FILE.read_text(encoding="utf-8"))


def _panels() -> list[dict[str, Any]]:
    out = []
    for panel in _dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels inside collapsed rows
    return out


def _queries() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels() for t in p.get("targets", [])]


def test_committed_json_is_generator_output():
    artefacts.run([sys.executable, "tools/gen_dashboard.py", "--check"])


def test_panel_structure():
    panels = _panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are not unique"
    assert any(p["type"] == "state-timeline" for p in panels)
    for p in panels:
        grid = p["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, p["title"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, p["title"]
        assert p.get("title"), f"panel {p['id']} has no title"
        if p["type"] == "row":
            continue
        assert p.get("description", "").strip(), f"{p['title']}: no description"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p.get("targets"), f"{p['title']}: no targets"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']}: duplicate refId"
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"{p['title']}: empty expr"
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
        if p["type"] != "table":
            assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
            assert p["fieldConfig"]["defaults"]["thresholds"]["steps"], p["title"]


def test_seconds_panels_use_seconds_unit():
    for p in _panels():
        exprs = " ".join(t["expr"] for t in p.get("targets", []))
        if "histogram_quantile" in exprs or "time() -" in exprs or "poll_duration" in exprs:
            assert p["fieldConfig"]["defaults"]["unit"] == "s", p["title"]


def test_template_variables():
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert set(variables) >= {"datasource", "job", "instance", "model_name"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance", "model_name"):
        var = variables[name]
        assert var["includeAll"] is True, name
        # ".*" also matches a series that lacks the label (model_name without --model-name)
        assert var["allValue"] == ".*", name
        assert var["datasource"]["uid"] == "${datasource}", name


def test_every_selector_filters_on_the_variables():
    for title, expr in _queries():
        for match in SELECTOR.finditer(expr):
            name, matchers = match.group(1), match.group(2) or ""
            for required in REQUIRED_MATCHERS:
                assert required in matchers, f"{title}: {name} lacks {required}"
        assert re.search(r'\bmodel_name\s*=\s*"', expr) is None, (
            f"{title}: model_name must use a regex matcher (label is optional)"
        )


def test_dashboard_metrics_are_in_catalog():
    known = artefacts.catalog_sample_names()
    used: set[str] = set()
    for title, expr in _queries():
        names = artefacts.metric_names(expr)
        assert names - known == set(), f"{title}: unknown metrics"
        used |= names
    assert REQUIRED_METRICS - used == set(), "metrics the dashboard must show"


def test_dashboard_covers_every_state_value():
    from exporter.metrics.catalog import ENGINE_STATES, FLEET_STATES
    from exporter.protocol.pushes import FT_STATE_VALUES

    panels = _panels()

    def covered(metric: str, state: str, label: str = "state") -> bool:
        for p in panels:
            exprs = " ".join(t["expr"] for t in p.get("targets", []))
            if metric not in exprs or f'{label}="{state}"' not in exprs:
                continue
            texts = {
                opt["text"]
                for m in p["fieldConfig"]["defaults"].get("mappings", [])
                for opt in m.get("options", {}).values()
            }
            if state in texts:
                return True
        return False

    for state in FLEET_STATES:
        assert covered("vllm_dp_fleet_state", state), f"fleet state {state} not shown"
    for state in ENGINE_STATES:
        assert covered("vllm_dp_engine_state", state), f"engine state {state} not shown"
    for status in FT_STATE_VALUES:  # paused, recovering and other included
        ft = "vllm_dp_engine_fault_tolerance_status"
        assert covered(ft, status, "status"), f"fault-tolerance status {status} not shown"


def test_latency_quantiles_by_method():
    exprs = [e for _, e in _queries() if "vllm_dp_utility_call_duration_seconds_bucket" in e]
    for q in ("0.5", "0.99"):
        assert any(f"histogram_quantile({q}," in e and "by (method, le)" in e for e in exprs), q


def test_queries_parse_as_promql(tmp_path):
    """promtool parses every query (Grafana's variables replaced by plausible values)."""
    promtool = artefacts.tool("promtool")
    rules = []
    for i, (_, expr) in enumerate(_queries()):
        concrete = (
            expr.replace("$__rate_interval", "1m")
            .replace("$__range", "1h")
            .replace("$job", ".*")
            .replace("$instance", ".*")
            .replace("$model_name", ".*")
        )
        assert "$" not in concrete, expr
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete})
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    artefacts.run([promtool, "check", "rules", str(path)], timeout=60)


def test_provisioning():
    ds = yaml.safe_load(
        (artefacts.ROOT / "grafana/provisioning/datasources/prometheus.yaml").read_text(
            encoding="utf-8"
        )
    )
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    prov = yaml.safe_load(
        (artefacts.ROOT / "grafana/provisioning/dashboards/vllm-dp-exporter.yaml").read_text(
            encoding="utf-8"
        )
    )
    (provider,) = prov["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load(artefacts.COMPOSE_FILE.read_text(encoding="utf-8"))
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(
        m.split(":")[1] == provider["options"]["path"]
        and m.split(":")[0].endswith("grafana/dashboards")
        for m in mounts
    ), mounts


def test_activity_row():
    """docs/activity.md on the dashboard: running and waiting requests per rank over time, and
    has_work, routable and hung as per-rank state timelines that name both values."""
    panels = _panels()
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert any(title.startswith("Activity") for title in rows), rows

    def shown(kind: str, *needles: str) -> list[dict[str, Any]]:
        return [
            p
            for p in panels
            if p["type"] == kind
            and any(all(n in t["expr"] for n in needles) for t in p.get("targets", []))
        ]

    for state in ("running", "waiting"):
        assert shown("timeseries", "vllm_dp_engine_requests{", f'state="{state}"'), state
    for needle, texts in (
        ("vllm_dp_engine_has_work", {"has work", "no work"}),
        ("vllm_dp_engine_routable", {"routable", "not routable"}),
        ('state="hung"', {"hung", "not hung"}),
    ):
        found = [
            p
            for p in shown("state-timeline", needle)
            if texts
            <= {
                opt["text"]
                for m in p["fieldConfig"]["defaults"].get("mappings", [])
                for opt in m.get("options", {}).values()
            }
        ]
        assert found, f"no state timeline for {needle} naming {texts}"
