"""Alert rules: promtool validity and unit tests, structure, runbooks, metric names."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import yaml

from tests.harness import artefacts

REQUIRED_ALERTS = {
    "VllmDpEnginesInconsistent",
    "VllmDpEngineDown",
    "VllmDpPrefixCacheResetPartialFailure",
    "VllmDpEnginesMissing",
    "VllmDpExporterPollsStale",
    "VllmDpStateFileWriteFailing",
    "VllmDpEngineHung",
    "VllmDpEngineStalled",
    "VllmDpRequestsOnUnroutableEngine",
}
SEVERITIES = {"critical", "warning", "info"}


def test_promtool_check_rules():
    promtool = artefacts.tool("promtool")
    out = artefacts.run([promtool, "check", "rules", str(artefacts.RULES_FILE)], timeout=60)
    assert "SUCCESS" in out.stdout


def test_promtool_unit_tests():
    promtool = artefacts.tool("promtool")
    files = sorted(str(p) for p in artefacts.RULE_TESTS_DIR.glob("*.yml"))
    assert files, "no promtool test files in deploy/prometheus/tests/"
    artefacts.run([promtool, "test", "rules", *files], timeout=180)


def test_required_alerts_exist():
    names = [rule["alert"] for rule in artefacts.alerting_rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS


def test_every_alert_is_unit_tested_firing_and_silent():
    firing: set[str] = set()
    silent: set[str] = set()
    for path in artefacts.RULE_TESTS_DIR.glob("*.yml"):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for case in doc.get("tests", []):
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in artefacts.alerting_rules()}
    assert names - firing == set(), "alerts without a firing unit test"
    assert names - silent == set(), "alerts without a not-firing unit test"


def test_alert_structure():
    anchors = artefacts.runbook_sections()
    for rule in artefacts.alerting_rules():
        name = rule["alert"]
        assert re.fullmatch(r"VllmDp[A-Za-z]+", name), name
        assert "for" in rule, f"{name}: no for:"
        assert re.fullmatch(r"([0-9]+(ms|s|m|h|d))+", str(rule["for"])), f"{name}: bad for"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        ann = rule.get("annotations", {})
        for key in ("summary", "description", "runbook_url"):
            assert str(ann.get(key, "")).strip(), f"{name}: missing annotations.{key}"
        url = ann["runbook_url"]
        assert url.startswith(artefacts.RUNBOOK_URL_PREFIX), f"{name}: runbook_url {url}"
        anchor = url[len(artefacts.RUNBOOK_URL_PREFIX) :]
        assert anchor == name.lower(), f"{name}: anchor {anchor}"
        assert anchor in anchors, f"{name}: docs/runbooks.md has no section #{anchor}"


def test_runbooks_explain_how_to_confirm():
    text = artefacts.RUNBOOKS.read_text(encoding="utf-8")
    assert "vllm-dp-exporter ctl status --url http://" in text
    assert "--json" in text
    assert "paused" in text
    sections = artefacts.runbook_sections()
    for rule in artefacts.alerting_rules():
        body = sections[rule["alert"].lower()]
        for part in ("**Meaning.**", "**Confirm.**", "**Act.**"):
            assert part in body, f"runbook {rule['alert']} lacks {part}"


def test_rule_expressions_use_catalog_metrics():
    known = artefacts.catalog_sample_names()
    used: set[str] = set()
    for rule in artefacts.alerting_rules():
        names = artefacts.metric_names(rule["expr"])
        assert names - known == set(), f"{rule['alert']}: unknown metrics"
        used |= names
    assert used, "no vllm_dp_ metric found in the rules"


def test_inconsistent_and_unknown_are_not_confused():
    rules = {rule["alert"]: rule for rule in artefacts.alerting_rules()}
    expr = rules["VllmDpEnginesInconsistent"]["expr"]
    assert 'state="inconsistent"' in expr
    assert "unknown" not in expr


def test_prometheusrule_is_generated_from_rules_file():
    import sys

    artefacts.run(
        [sys.executable, "deploy/prometheus/render_rules.py", "prometheusrule", "--check"]
    )
    manifest = yaml.safe_load(
        (artefacts.KUSTOMIZE_DIR / "prometheusrule.yaml").read_text(encoding="utf-8")
    )
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == artefacts.load_rules()["groups"]


def test_for_durations_can_be_shortened_in_one_place(tmp_path):
    module = artefacts.render_rules()
    text = artefacts.RULES_FILE.read_text(encoding="utf-8")
    n_rules = len(artefacts.alerting_rules())
    assert len(module.for_durations(text)) == n_rules, "a for: is not on its own `for:` line"

    short = module.rules_with_for(text, "0s")
    assert module.for_durations(short) == ["0s"] * n_rules
    original, shortened = artefacts.load_rules(), yaml.safe_load(short)
    for group in shortened["groups"]:
        for rule in group["rules"]:
            rule["for"] = None
    for group in original["groups"]:
        for rule in group["rules"]:
            rule["for"] = None
    assert original == shortened, "shortening changed more than the for: values"

    promtool = artefacts.tool("promtool")
    copy = tmp_path / "short.rules.yml"
    copy.write_text(short, encoding="utf-8")
    artefacts.run([promtool, "check", "rules", str(copy)], timeout=60)


def test_runbook_base_is_configurable(tmp_path):
    module = artefacts.render_rules()
    text = artefacts.RULES_FILE.read_text(encoding="utf-8")
    # the committed rules link to the runbooks in this repository, never to a placeholder host
    urls = module.runbook_urls(text)
    assert len(urls) == len(artefacts.alerting_rules())
    assert {base for base, _ in urls} == {module.DEFAULT_RUNBOOK_BASE}
    assert (artefacts.ROOT / module.DEFAULT_RUNBOOK_BASE).is_file()

    base = "https://wiki.example.com/sre/vllm-dp-exporter/runbooks.md"
    moved = module.rules_with_runbook_base(text, base)
    assert [a for _, a in module.runbook_urls(moved)] == [a for _, a in urls]
    original, rebased = artefacts.load_rules(), yaml.safe_load(moved)
    for rule in [r for g in rebased["groups"] for r in g["rules"] if "alert" in r]:
        url = rule["annotations"]["runbook_url"]
        assert url == f"{base}#{rule['alert'].lower()}"
        rule["annotations"]["runbook_url"] = None
    for rule in [r for g in original["groups"] for r in g["rules"] if "alert" in r]:
        rule["annotations"]["runbook_url"] = None
    assert original == rebased, "changing the runbook base changed more than runbook_url"

    promtool = artefacts.tool("promtool")
    copy = tmp_path / "rebased.rules.yml"
    artefacts.run(
        [sys.executable, "deploy/prometheus/render_rules.py", "rules", "--runbook-base", base,
         "-o", str(copy)]
    )  # fmt: skip
    assert copy.read_text(encoding="utf-8") == moved
    artefacts.run([promtool, "check", "rules", str(copy)], timeout=60)


def test_prometheusrule_labels_and_runbook_base_from_the_command_line():
    base = "https://git.example.com/ops/vllm-dp-exporter/blob/main/docs/runbooks.md"
    out = artefacts.run(
        [sys.executable, "deploy/prometheus/render_rules.py", "prometheusrule",
         "--label", "release=kube-prometheus-stack", "--label", "team=ml", "--runbook-base", base]
    ).stdout  # fmt: skip
    manifest = yaml.safe_load(out)
    labels = manifest["metadata"]["labels"]
    assert labels["release"] == "kube-prometheus-stack" and labels["team"] == "ml"
    assert labels["app.kubernetes.io/name"] == "vllm-dp-exporter"
    for group in manifest["spec"]["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["annotations"]["runbook_url"].startswith(base + "#")
    bad = subprocess.run(
        [sys.executable, "deploy/prometheus/render_rules.py", "prometheusrule", "--label", "x y"],
        cwd=artefacts.ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_summaries_name_namespace_and_pod():
    for rule in artefacts.alerting_rules():
        summary = rule["annotations"]["summary"]
        if "$labels.instance" not in summary:
            continue  # absent(): no target labels at all
        for label in ("namespace", "pod"):
            assert f"with $labels.{label}" in summary, f"{rule['alert']}: summary lacks {label}"


def _unit_test_cases() -> list[dict[str, Any]]:
    cases = []
    for path in artefacts.RULE_TESTS_DIR.glob("*.yml"):
        cases += yaml.safe_load(path.read_text(encoding="utf-8")).get("tests", [])
    return cases


def test_engine_down_tells_start_up_from_an_outage():
    rules = {rule["alert"]: rule for rule in artefacts.alerting_rules()}
    down = rules["VllmDpEngineDown"]["expr"]
    assert "vllm_dp_engine_last_success_timestamp_seconds" in down
    assert "max_over_time(vllm_dp_engine_up[" in down
    assert "VllmDpEngineNeverUp" in rules
    # promtool cases for both: an engine that starts with engine_up 0 must keep
    # VllmDpEngineDown silent, and one that was 1 then 0 must fire it.
    start_up_silent = outage_fires = False
    for case in _unit_test_cases():
        ups = [
            s["values"].split()
            for s in case["input_series"]
            if s["series"].startswith("vllm_dp_engine_up{")
        ]
        checks = [
            c for c in case.get("alert_rule_test", []) if c["alertname"] == "VllmDpEngineDown"
        ]
        if (
            any(v[0].startswith("0") for v in ups)
            and checks
            and not any(c.get("exp_alerts") for c in checks)
        ):
            start_up_silent = True
        if any(c.get("exp_alerts") for c in checks) and all(v[0].startswith("1") for v in ups):
            outage_fires = True
    assert start_up_silent and outage_fires


def _minutes(duration: str) -> float:
    """A promtool eval_time such as 90s, 12m or 1h30m, in minutes."""
    scale = {"ms": 1 / 60000, "s": 1 / 60, "m": 1, "h": 60, "d": 1440}
    parts = re.findall(r"([0-9]+)(ms|s|m|h|d)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * scale[u] for n, u in parts)


def test_state_file_alert_clears_after_a_good_write():
    name = "VllmDpStateFileWriteFailing"
    expr = {rule["alert"]: rule for rule in artefacts.alerting_rules()}[name]["expr"]
    # "no good write since the last failed one": both outcomes are in the expression
    assert 'vllm_dp_state_file_writes_total{outcome="failed"}' in expr
    assert 'vllm_dp_state_file_writes_total{outcome="ok"}' in expr
    # a promtool case where it fires and, later in the same case, is silent again (one failure
    # must not keep it firing forever)
    cleared = False
    for case in _unit_test_cases():
        checks = sorted(
            (c for c in case.get("alert_rule_test", []) if c["alertname"] == name),
            key=lambda c: _minutes(c["eval_time"]),
        )
        fired = [i for i, c in enumerate(checks) if c.get("exp_alerts")]
        if fired and any(not c.get("exp_alerts") for c in checks[fired[0] + 1 :]):
            cleared = True
    assert cleared


def test_sleep_state_mismatch_recording_rule():
    records = {
        rule["record"]: rule
        for group in artefacts.load_rules()["groups"]
        for rule in group["rules"]
        if "record" in rule
    }
    expr = records["vllm_dp:engine_sleep_state_mismatch"]["expr"]
    assert 'vllm:engine_sleep_state{sleep_state="awake"}' in expr
    assert 'vllm_dp_engine_state{state="asleep"}' in expr
    assert "on (namespace, model_name, engine)" in expr
    assert artefacts.metric_names(expr) - artefacts.catalog_sample_names() == set()
    tested = {
        check["expr"] for case in _unit_test_cases() for check in case.get("promql_expr_test", [])
    }
    assert "vllm_dp:engine_sleep_state_mismatch" in tested


def test_requests_on_unroutable_engine_needs_known_counts():
    """Waiting requests on a rank that is not routable, joined per rank; an unknown count (no
    vllm_dp_engine_requests series: owner and relay mode) must never match, and a promtool case
    proves it: an unroutable rank without a waiting series keeps the alert silent."""
    name = "VllmDpRequestsOnUnroutableEngine"
    expr = {rule["alert"]: rule for rule in artefacts.alerting_rules()}[name]["expr"]
    assert 'vllm_dp_engine_requests{state="waiting"}' in expr
    assert "vllm_dp_engine_routable == 0" in expr
    assert "and on (job, instance, engine)" in expr
    assert "unless" not in expr and " or " not in expr  # an absent count is no match

    def rank(series: str) -> tuple[str, tuple[str, ...]]:
        metric, _, labels = series.partition("{")
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        return metric, tuple(found.get(k, "") for k in ("job", "instance", "engine"))

    proved = False
    for case in _unit_test_cases():
        ranks = [rank(s["series"]) for s in case["input_series"]]
        counted = {r for metric, r in ranks if metric == "vllm_dp_engine_requests"}
        without_counts = [
            r for metric, r in ranks if metric == "vllm_dp_engine_routable" and r not in counted
        ]
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == name]
        if without_counts and checks and not any(c.get("exp_alerts") for c in checks):
            proved = True
    assert proved, f"no promtool case where {name} stays silent without request counts"


def test_engine_stalled_is_its_own_state():
    """Stalled is the exporter's verdict (state="stalled": answering, holding requests, no token
    for --stall-after), never hung or paused; promtool cases prove a hung and a paused rank keep
    it silent while their progress series stand still."""
    name = "VllmDpEngineStalled"
    expr = {rule["alert"]: rule for rule in artefacts.alerting_rules()}[name]["expr"]
    assert 'vllm_dp_engine_state{state="stalled"}' in expr
    assert "max by (job, instance, namespace, pod, engine)" in expr
    assert "hung" not in expr and "paused" not in expr

    def states(case: dict[str, Any], value: str) -> bool:
        """A rank whose state series ``value`` is 1 at some sample."""
        return any(
            s["series"].startswith("vllm_dp_engine_state{")
            and f'state="{value}"' in s["series"]
            and re.search(r"(^|\s)1(x[0-9]+)?(\s|$)", s["values"])
            for s in case["input_series"]
        )

    silent_for = set()
    for case in _unit_test_cases():
        checks = [c for c in case.get("alert_rule_test", []) if c["alertname"] == name]
        if checks and not any(c.get("exp_alerts") for c in checks) and not states(case, "stalled"):
            silent_for |= {v for v in ("hung", "paused") if states(case, v)}
    missing = {"hung", "paused"} - silent_for
    assert not missing, f"no promtool case where {name} stays silent for a rank {missing}"
