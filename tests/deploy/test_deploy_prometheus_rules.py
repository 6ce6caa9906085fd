"""Alert rules: promtool validity and unit tests, structure, runbooks, metric names."""

from __future__ import annotations

import importlib.util
import re

import yaml

REQUIRED_ALERTS = {
    "VllmDpEnginesInconsistent",
    "VllmDpEngineDown",
    "VllmDpPrefixCacheResetPartialFailure",
    "VllmDpEnginesMissing",
    "VllmDpExporterPollsStale",
}
SEVERITIES = {"critical", "warning", "info"}


def _render_rules_module(deploy):
    path = deploy.ROOT / "deploy" / "prometheus" / "render_rules.py"
    spec = importlib.util.spec_from_file_location("vllm_dp_render_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_promtool_check_rules(deploy):
    promtool = deploy.tool("promtool")
    out = deploy.run([promtool, "check", "rules", str(deploy.RULES_FILE)], timeout=60)
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests(deploy):
    promtool = deploy.tool("promtool")
    files = sorted(str(p) for p in deploy.RULE_TESTS_DIR.glob("*.yml"))
    assert files, "no promtool test files in deploy/prometheus/tests/"
    deploy.run([promtool, "test", "rules", *files], timeout=180)


def test_required_alerts_exist(deploy):
    names = [rule["alert"] for rule in deploy.alerting_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS


def test_every_alert_is_unit_tested_firing_and_silent(deploy):
    firing: set[str] = set()
    silent: set[str] = set()
    for path in deploy.RULE_TESTS_DIR.glob("*.yml"):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for case in doc.get("tests", []):
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in deploy.alerting_rules()}
    assert names - firing == set(), "alerts without a firing unit test"
    assert names - silent == set(), "alerts without a not-firing unit test"


def test_alert_structure(deploy):
    anchors = deploy.runbook_sections()
    for rule in deploy.alerting_rules():
        name = rule["alert"]
        assert re.fullmatch(r"VllmDp[A-Za-z]+", name), name
        assert "for" in rule, f"{name}: no for:"
        assert re.fullmatch(r"([0-9]+(ms|s|m|h|d))+", str(rule["for"])), f"{name}: bad for"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        ann = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert str(ann.get(key, "")).strip(), f"{name}: missing annotations.{key}"
        url = ann["runbook_url"]
        assert url.startswith(deploy.RUNBOOK_URL_PREFIX), f"{name}: runbook_url {url}"
        anchor = url[len(deploy.RUNBOOK_URL_PREFIX) :]
        assert anchor == name.lower(), f"{name}: anchor {anchor}"
        assert anchor in anchors, f"{name}: docs/runbooks.md has no section #{anchor}"


def test_runbooks_explain_how_to_confirm(deploy):
    text = deploy.RUNBOOKS.read_text(encoding="utf-8")
    assert "vllm-dp-exporter ctl status --url http://" in text
    assert "--json" in text
    assert "paused" in text
    sections = deploy.runbook_sections()
    for rule in deploy.alerting_rules():
        body = sections[rule["alert"].lower()]
        for part in ("**Meaning.**", "**Confirm.**", "**Act.**"):
            assert part in body, f"runbook {rule['alert']} lacks {part}"


def test_rule_expressions_use_catalog_metrics(deploy):
    known = deploy.catalog_sample_names()
    used: set[str] = set()
    for rule in deploy.alerting_rules():
        names = deploy.metric_names(rule["expr"])
        assert names - known == set(), f"{rule['alert']}: unknown metrics"
        used |= names
    assert used, "no vllm_dp_ metric found in the rules"


def test_inconsistent_and_unknown_are_not_confused(deploy):
    rules = {rule["alert"]: rule for rule in deploy.alerting_rules()}
    expr = rules["VllmDpEnginesInconsistent"]["expr"]
    assert 'state="inconsistent"' in expr
    assert "unknown" not in expr


def test_prometheusrule_is_generated_from_rules_file(deploy):
    import sys

    deploy.run([sys.executable, "deploy/prometheus/render_rules.py", "prometheusrule", "--check"])
    manifest = yaml.safe_load(
        (deploy.KUSTOMIZE_DIR / "prometheusrule.yaml").read_text(encoding="utf-8")
    )
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == deploy.load_rules()["groups"]


def test_for_durations_can_be_shortened_in_one_place(deploy, tmp_path):
    module = _render_rules_module(deploy)
    text = deploy.RULES_FILE.read_text(encoding="utf-8")
    n_rules = len(deploy.alerting_rules())
    assert len(module.for_durations(text)) == n_rules, "a for: is not on its own `for:` line"

    short = module.rules_with_for(text, "0s")
    assert module.for_durations(short) == ["0s"] * n_rules
    original, shortened = deploy.load_rules(), yaml.safe_load(short)
    for group in shortened["groups"]:
        for rule in group["rules"]:
            rule["for"] = None
    for group in original["groups"]:
        for rule in group["rules"]:
            rule["for"] = None
    assert original == shortened, "shortening changed more than the for: values"

    promtool = deploy.tool("promtool")
    copy = tmp_path / "short.rules.yml"
    copy.write_text(short, encoding="utf-8")
    deploy.run([promtool, "check", "rules", str(copy)], timeout=60)
